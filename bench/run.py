"""Run every benchmark, print a table, write bench/results.json (and the README's table with --readme).

    invoke bench            # the full set (under 20 minutes on 2 CPU cores)
    invoke bench --quick    # fewer repetitions, and no `base` checkpoint run (under 6 minutes)
    python -m bench.run --quick --readme

Every figure is a ratio or a count measured side by side in the same run, as a
median of repetitions: these machines are shared and noisy, so absolute
seconds are given for context only. A value shown as ``x ± y%`` carries the
relative half-width of its median's ~95% confidence interval (its ``_spread`` key).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import time

from astrai.host import baseimage
from bench import checkpoint_cost, faults, hf_io, host_commands, image_build, stop_latency, trainer_speed, two_nodes
from bench.common import REPO, TORCH_THREADS

RESULTS = REPO / "bench" / "results.json"
README = REPO / "README.md"
README_START, README_END = "<!-- bench:start -->", "<!-- bench:end -->"

# key: (description, comparison, target); comparison "<=" / ">=" against a number, "==" against another key
TARGETS = {
    "trainer_vs_bare": ("trainer tokens per CPU-second over a bare PyTorch loop's (worst of tiny, small)", ">=", 0.98),
    "tiny_trainer_vs_bare": ("the same on `tiny`", ">=", 0.98),
    "small_trainer_vs_bare": ("the same on `small`", ">=", 0.98),
    "trainer_vs_bare_wall": ("the same on wall-clock time (worst of tiny, small)", None, None),
    "ckpt_save_vs_dcp": ("checkpoint write over torch.distributed.checkpoint.save (`small`)", "<=", 1.0),
    "ckpt_save_vs_raw_fsync": ("checkpoint write over raw safetensors + torch.save, fsynced (`small`)", "<=", 1.2),
    "ckpt_save_vs_raw": ("checkpoint write over the same raw writes without fsync (`small`)", "<=", 1.2),
    "ckpt_raw_fsync_vs_raw": ("raw writes plus fsync over raw writes (what the disk alone adds)", None, None),
    "ckpt_stall_vs_dcp_async": ("loop pause of a periodic checkpoint over DCP async_save's (`small`)", "<=", 1.0),
    "ckpt_stall_vs_sync": ("loop pause of a periodic checkpoint over a synchronous save (`small`)", "<=", 0.3),
    "resume_vs_dcp": ("loading a checkpoint to resume over torch.distributed.checkpoint.load (`small`)", "<=", 1.0),
    "ckpt_peak_host_mem_vs_state": (
        "peak extra host memory of a periodic save over the state saved (`small`)",
        None,
        None,
    ),
    "ckpt_sync_peak_host_mem_vs_state": ("the same for a final or emergency save (`small`)", None, None),
    "base_ckpt_save_vs_dcp": ("checkpoint write over DCP save (`base`, 124M parameters)", "<=", 1.0),
    "base_ckpt_save_vs_raw_fsync": ("checkpoint write over raw writes + fsync (`base`)", "<=", 1.2),
    "base_ckpt_stall_vs_dcp_async": ("periodic checkpoint pause over DCP async_save's (`base`)", "<=", 1.0),
    "base_resume_vs_dcp": ("resume load over DCP load (`base`)", "<=", 1.0),
    "base_ckpt_peak_host_mem_vs_state": (
        "peak extra host memory of a periodic save over the state (`base`)",
        None,
        None,
    ),
    "base_ckpt_sync_peak_host_mem_vs_state": ("the same for a final or emergency save (`base`)", None, None),
    "base_ckpt_save_s": ("`base` checkpoint write, seconds (state 1.5 GB)", None, None),
    "ckpt_contention_vs_sync": ("extra run time per periodic save over a synchronous save (2 busy cores)", None, None),
    "resume_s": ("resume from a `small` checkpoint, seconds", None, None),
    "stop_latency_units": ("`invoke stop` to exit with an emergency checkpoint, in (step + save) units", None, None),
    "stop_latency_s": ("`invoke stop` to exit, seconds", None, None),
    "list_1000_vs_shell": ("`invoke list` over a shell loop, 1000 checkpoints", "<=", 0.33),
    "list_1000_s": ("`invoke list`, 1000 checkpoints, seconds", None, None),
    "host_imports_torch": ("host commands import torch", "==", False),
    "rebuild_code_change_s": ("image rebuild after a code change, seconds", None, None),
    "full_build_s": ("full image build (local base image), seconds", None, None),
    "two_node_vs_one": ("tokens/s on 2 nodes x 1 process over 1 node x 2 processes (same global batch)", ">=", 0.9),
    "stop_latency_two_nodes_s": ("`invoke stop --node 1` until both nodes exit, seconds", None, None),
    "kill_trials": ("SIGKILLs at random moments, each followed by a restart", ">=", 20),
    "kill_exact": ("of the killed runs, bitwise equal to an uninterrupted run", "==", "kill_runs"),
    "term_trials": ("SIGTERM stops", ">=", 10),
    "term_ok": ("stops that left an emergency checkpoint and resumed from it", "==", "term_trials"),
    "prepare_vs_tokenizers": ("`prepare --tokenizer` tokens/s over a plain `Tokenizer.encode_batch`", ">=", 0.9),
    "prepare_tokens_per_s": ("`prepare --tokenizer` tokens/s (BPE, 2000 tokens)", None, None),
    "load_vs_safetensors": ("loading a sharded fp32 base model over `load_file` of its shards", "<=", 1.2),
    "load_bf16_vs_safetensors": ("the same, bf16 shards", "<=", 1.2),
}


def machine() -> dict:
    import torch

    cpu = "unknown"
    with open("/proc/cpuinfo", encoding="utf-8") as handle:
        for line in handle:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    docker = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"], capture_output=True, text=True)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "docker": docker.stdout.strip() or "unavailable",
        "date": time.strftime("%Y-%m-%d"),
    }


def verdict(key: str, results: dict) -> str:
    _, comparison, target = TARGETS[key]
    if comparison is None or key not in results:
        return ""
    value = results[key]
    goal = results.get(target) if isinstance(target, str) else target
    met = {"<=": value <= goal, ">=": value >= goal, "==": value == goal}[comparison]
    return f"{'met' if met else 'MISSED'} ({comparison} {goal})"


def table(results: dict) -> str:
    rows = ["| measure | key | value | target |", "|---|---|---|---|"]
    for key, (description, _, _) in TARGETS.items():
        if key in results:
            value = results[key]
            shown = f"{value:.3g}" if isinstance(value, float) else str(value)
            if f"{key}_spread" in results:
                shown += f" ± {results[f'{key}_spread']:.1%}"
            rows.append(f"| {description} | `{key}` | {shown} | {verdict(key, results)} |")
    return "\n".join(rows)


def update_readme(text: str) -> None:
    readme = README.read_text(encoding="utf-8")
    block = f"{README_START}\n{text}\n{README_END}"
    pattern = re.compile(re.escape(README_START) + ".*?" + re.escape(README_END), re.DOTALL)
    if not pattern.search(readme):
        raise SystemExit(f"{README} has no {README_START} ... {README_END} block")
    README.write_text(pattern.sub(lambda _: block, readme), encoding="utf-8")


def run(quick: bool, readme: bool, base_image: str) -> dict:
    baseimage.ensure_base_image(base_image)
    results: dict = {"quick": quick, "machine": machine(), "torch_threads": TORCH_THREADS}
    steps = [
        ("trainer overhead", lambda: trainer_speed.run(quick)),
        ("checkpoint cost", lambda: checkpoint_cost.run(quick)),
        ("host commands at scale", lambda: host_commands.run(quick)),
        ("image rebuild", lambda: image_build.run(quick, base_image)),
        ("stop latency", lambda: stop_latency.run(quick, base_image)),
        ("fault injection", lambda: faults.run(quick)),
        ("two nodes", lambda: two_nodes.run(quick, base_image)),
        ("own model and tokenizer", lambda: hf_io.run(quick)),
    ]
    sections = results["section_seconds"] = {}
    for name, step in steps:
        print(f"== {name}", flush=True)
        started = time.perf_counter()
        results.update(step())
        sections[name] = round(time.perf_counter() - started, 1)
        print(f"   done in {sections[name]:.0f} s", flush=True)
        # Written after every section, so that an interrupted run keeps what it measured.
        RESULTS.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    results["total_seconds"] = round(sum(sections.values()), 1)
    RESULTS.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    info = results["machine"]
    summary = (
        f"Measured {info['date']} with `invoke bench{' --quick' if quick else ''}` on {info['cores']} cores "
        f"({info['cpu']}), Python {info['python']}, torch {info['torch']} ({TORCH_THREADS} thread in-process), "
        f"Docker {info['docker']}; the whole run took {results['total_seconds'] / 60:.1f} minutes"
        f"{' (--quick leaves out the `base` checkpoint rows)' if quick else ''}.\n\n" + table(results)
    )
    print("\n" + summary)
    if readme:
        update_readme(summary)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, no `base` checkpoint run")
    parser.add_argument("--readme", action="store_true", help="write the table into README.md")
    parser.add_argument(
        "--base-image",
        default=os.environ.get("ASTRAI_TEST_BASE_IMAGE", baseimage.DEFAULT_TAG),
        help="local base image for the Docker benchmarks",
    )
    args = parser.parse_args(argv)
    run(args.quick, args.readme, args.base_image)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
