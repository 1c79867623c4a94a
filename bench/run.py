"""Run the benchmarks, print a table, merge the figures into bench/results.json, write docs/benchmarks.md's table.

    invoke bench                          # every section (about an hour on 2 CPU cores)
    invoke bench --quick                  # fewer repetitions, no `base` checkpoint run (36 minutes, see below)
    invoke bench --only "host commands"   # some sections only; the other figures stay as measured before
    python -m bench.run --table           # rewrite the docs table from bench/results.json, measure nothing

The times: a full run's sections took 58.6 minutes together in their last full runs (2026-12-01 to
2026-12-03), and ``--quick`` took 36.5 minutes on 2026-12-04 on 2 cores shared with other work (load
2.7 to 10.2); ``results.json``'s ``sections`` keep each section's time in the run that last measured it.

Every figure is a ratio or a count measured side by side in the same run, as a
median of repetitions: these machines are shared and noisy, so absolute
seconds are given for context only. A value shown as ``x ± y%`` carries the
relative half-width of its median's ~95% confidence interval (its ``_spread`` key).

``bench/results.json`` keeps every figure at the top level, the samples it was
computed from under ``samples.<key>`` (each turn's pair for a ratio) and the run
that measured it under ``runs.<key>`` (date, quick or full, load average). A run
replaces only the figures it measured, so a ``--quick`` run never erases the
rows only a full run measures; :func:`recompute` gets every figure back from its
samples, and the docs table is made from this file alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import time

from astrai.host import baseimage
from bench import (
    agents,
    checkpoint_cost,
    chunked_loss,
    corpora,
    experts,
    faults,
    generation,
    grpo,
    hf_io,
    host_commands,
    image_build,
    judging,
    lora,
    post_training,
    qlora,
    sharded_checkpoints,
    stop_latency,
    trackers,
    trainer_speed,
    transformers_backend,
    two_nodes,
)
from bench.common import REPO, TORCH_THREADS, Figures, ratio_with_spread

RESULTS = REPO / "bench" / "results.json"
DOCS = REPO / "docs" / "benchmarks.md"
TABLE_START, TABLE_END = "<!-- bench:start -->", "<!-- bench:end -->"
POST_TRAINING = REPO / "docs" / "post-training.md"
CURVE_START, CURVE_END = "<!-- grpo-curve:start -->", "<!-- grpo-curve:end -->"
AGENTS = REPO / "docs" / "agents.md"
AGENT_CURVE_START, AGENT_CURVE_END = "<!-- agent-curve:start -->", "<!-- agent-curve:end -->"
META_KEYS = ("machine", "runs", "samples", "sections")

TARGETS = {
    "trainer_vs_bare": ("trainer tokens per CPU-second over a bare PyTorch loop's (worst of tiny, small)", ">=", 0.98),
    "tiny_trainer_vs_bare": ("the same on `tiny`", ">=", 0.98),
    "small_trainer_vs_bare": ("the same on `small`", ">=", 0.98),
    "trainer_vs_bare_wall": ("the same on wall-clock time (worst of tiny, small)", None, None),
    "chunked_loss_vs_plain": (
        "a forward and backward pass with the loss in chunks over the plain loss (`small`)",
        ">=",
        1.0,
    ),
    "vocab_152k_step_peak_growth_gb": (
        "peak memory of a step of 4,096 tokens, vocabulary 151,936 over 512, GB (loss in chunks)",
        "<=",
        1.2,
    ),
    "plain_vocab_152k_step_peak_growth_gb": ("the same with the plain loss, GB", None, None),
    "ckpt_save_vs_dcp": ("checkpoint write over torch.distributed.checkpoint.save (`small`)", "<=", 1.0),
    "ckpt_save_vs_raw_fsync": ("checkpoint write over raw safetensors + torch.save, fsynced (`small`)", "<=", 1.2),
    "ckpt_save_vs_raw": ("checkpoint write over the same raw writes without fsync (`small`)", "<=", 1.2),
    "ckpt_write_vs_disk": (
        "checkpoint write over the disk's own durable sequential write of the same bytes (`small`)",
        "<=",
        1.1,
    ),
    "base_ckpt_write_vs_disk": ("the same on `base`", "<=", 1.1),
    "disk_write_mb_per_s": ("the disk's durable sequential write rate in that run, MB/s (`small`)", None, None),
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
    "status_time_1e6_vs_1e4": ("`invoke status` wall time, 10⁶ logged steps over 10⁴", "<=", 1.5),
    "status_mem_1e6_vs_1e4": ("`invoke status` peak memory, 10⁶ logged steps over 10⁴", "<=", 1.5),
    "status_1e6_s": ("`invoke status` with 10⁶ logged steps, seconds", None, None),
    "prepare_jsonl_vs_tokenizers": (
        "`prepare` tokens/s on JSON Lines, all cores, over tokenizers' own encode_batch on all cores",
        ">=",
        0.9,
    ),
    "prepare_parallel_speedup": ("`prepare` tokens/s on all cores over `--workers 1`", None, None),
    "cores": ("CPUs `prepare` may use on this machine", None, None),
    "prepare_parallel_efficiency": ("that speedup per core", ">=", 0.8),
    "prepare_memory_10x": ("`prepare` peak resident memory, a corpus 10x larger over the smaller", "<=", 1.2),
    "prepare_jsonl_tokens_per_s": ("`prepare` tokens/s on JSON Lines, all cores (BPE, 2000 tokens)", None, None),
    "mixture_vs_single": ("trainer tokens per CPU-second, three data sources over one", ">=", 0.98),
    "sft_vs_seq": ("SFT record tokens per CPU-second over pre-training tokens (packing overhead)", ">=", 0.9),
    "sft_window_fill": ("record tokens over window positions in the SFT packing", None, None),
    "dpo_step_vs_two_seq": ("DPO step over a pre-training step of the chosen and rejected rows (default)", "<=", 1.3),
    "dpo_live_step_vs_two_seq": ("the same with training.dpo_reference live", None, None),
    "dpo_precomputed_step_vs_two_seq": ("the same with training.dpo_reference precomputed", None, None),
    "sharded_save_vs_full": ("sharded checkpoint save over the gathered (full) one, `base`, FSDP x 4", "<=", 0.5),
    "sharded_load_vs_full": ("sharded resume load over the full one, `base`, FSDP x 4", "<=", 0.5),
    "sharded_peak_mem_vs_share": (
        "peak extra host memory of any rank during a sharded save, over its share of the state",
        "<=",
        1.25,
    ),
    "full_peak_mem_vs_share": ("the same for a full save (rank 0 gathers everything)", None, None),
    "sharded_load_peak_mem_vs_share": ("the same during a sharded resume load", None, None),
    "full_load_peak_mem_vs_share": ("the same during a full resume load (every rank gets the whole state)", None, None),
    "sharded_stall_vs_full": ("loop pause of a periodic sharded save over a full one's", "<=", 1.0),
    "sharded_save_s": ("sharded save of `base` on 4 processes, seconds (state 1.5 GB)", None, None),
    "full_save_s": ("full save of the same, seconds", None, None),
    "lora_tokens_per_s_vs_full": (
        "LoRA r16 tokens per CPU-second over full fine-tuning (worst of small, base)",
        ">=",
        1.2,
    ),
    "small_lora_tokens_per_s_vs_full": ("the same on `small`", ">=", 1.2),
    "base_lora_tokens_per_s_vs_full": ("the same on `base`", ">=", 1.2),
    "lora_peak_mem_vs_full": ("LoRA's peak memory growth over full fine-tuning's, `base`, bf16 base", "<=", 0.5),
    "small_lora_peak_mem_vs_full": ("the same on `small` (activations outweigh its weights)", None, None),
    "base_lora_peak_mem_vs_full": ("the same on `base`", "<=", 0.5),
    "small_lora_fp32_base_peak_mem_vs_full": ("the same on `small`, the base held in fp32", None, None),
    "base_lora_fp32_base_peak_mem_vs_full": ("the same on `base`, the base held in fp32 (CPU's default)", None, None),
    "lora_ckpt_bytes_vs_full": ("a LoRA checkpoint's bytes over a full one's (worst of small, base)", "<=", 0.05),
    "small_lora_ckpt_bytes_vs_full": ("the same on `small`", "<=", 0.05),
    "base_lora_ckpt_bytes_vs_full": ("the same on `base`", "<=", 0.05),
    "lora_save_vs_full": ("a LoRA checkpoint save's time over a full one's (worst of small, base)", "<=", 0.2),
    "small_lora_save_vs_full": ("the same on `small`", "<=", 0.2),
    "base_lora_save_vs_full": ("the same on `base`", "<=", 0.2),
    "nf4_base_bytes_vs_bf16": (
        "QLoRA: the frozen base's bytes held in NF4 over in bf16 (713M in its blocks)",
        "<=",
        0.30,
    ),
    "nf4_peak_mem_vs_bf16": (
        "QLoRA: peak memory in use in LoRA r16 steps, NF4 base over bf16 base (weights dominate: 713M, 1 x 64)",
        "<=",
        0.45,
    ),
    "nf4_tokens_per_s_vs_bf16": (
        "the same model's tokens per CPU-second, NF4 over bf16 (the GPU's has the target)",
        None,
        None,
    ),
    "nf4_step0_loss_vs_bf16": (
        "the step-0 loss on one batch, NF4 base over bf16 (`small`, trained 60 steps)",
        "<=",
        1.02,
    ),
    "nf4_logits_top1_vs_bf16": (
        "the share of that batch's positions whose top token is the same both ways",
        None,
        None,
    ),
    "generate_vs_transformers": (
        "new tokens per CPU-second of the trainer's cached sampling over transformers' generate (8 x 128, greedy)",
        ">=",
        1.0,
    ),
    "generate_same_tokens": ("both sides' greedy tokens equal", None, None),
    "grpo_update_vs_sft": (
        "completion tokens per CPU-second of GRPO's update over an SFT step's on the same rows (`small`)",
        ">=",
        0.9,
    ),
    "grpo_reward_start": ("online_grpo on a toy task: the mean reward of its first 20 steps", "<=", 0.3),
    "grpo_reward_end": ("the same, its last 20 of 400 steps", ">=", 0.8),
    "grpo_rollout_share": ("the share of an online_grpo step's CPU time spent sampling and scoring", None, None),
    "agent_reward_start": (
        "episodes with a tool on a toy task: the pre-trained model's reward (median of 20 steps with no update)",
        "<=",
        0.3,
    ),
    "agent_reward_end": ("the same, learning: the median of the last 20 of 200 steps", ">=", 0.8),
    "episode_step_vs_single_turn": (
        "tokens per CPU-second of a step of two-turn episodes over a single-turn online_grpo step's",
        ">=",
        0.8,
    ),
    "tool_tokens_in_loss": ("tool and environment reply tokens whose log-probability the loss reaches", "==", 0),
    "tracker_overhead": (
        "trainer tokens per CPU-second reporting to MLflow (a server here) and W&B offline, over without them",
        ">=",
        0.98,
    ),
    "tracker_overhead_wall": ("the same on wall time", None, None),
    "tracker_updates_dropped": ("tracker updates dropped over that run", "==", 0),
    "native_vs_transformers_backend": (
        "trainer tokens per CPU-second on the native path over model.backend transformers (Llama `small`)",
        ">=",
        1.2,
    ),
    "transformers_backend_vs_bare": (
        "the trainer on the transformers path over a bare loop around the same transformers model (`small`)",
        ">=",
        0.95,
    ),
    "moe_step_vs_transformers": (
        "one mixture-of-experts layer's forward and backward, transformers' block (grouped_mm) over ours, CPU time "
        "(worse of Qwen3-30B-A3B's and Mixtral-8x7B's shapes scaled down)",
        ">=",
        1.5,
    ),
    "qwen3_moe_step_vs_transformers": ("the same at Qwen3-30B-A3B's shape (128 experts, 8 per token)", None, None),
    "mixtral_step_vs_transformers": ("the same at Mixtral-8x7B's shape (8 experts, 2 per token)", None, None),
    "moe_step_vs_transformers_eager": (
        "the same against transformers' eager experts (a loop over experts), worse of the two shapes",
        None,
        None,
    ),
    "qwen3_moe_step_vs_transformers_eager": ("eager, Qwen3-30B-A3B's shape", None, None),
    "mixtral_step_vs_transformers_eager": ("eager, Mixtral-8x7B's shape", None, None),
    "eval_vs_manual": (
        "the generative evaluation in the loop over the same generation and scoring by hand (64 prompts, `tiny`)",
        "<=",
        1.1,
    ),
    "eval_s": ("that evaluation's wall time, seconds", None, None),
    "reward_model_vs_transformers": (
        "a reward model's scores in the trainer against AutoModelForSequenceClassification's, largest difference",
        "<=",
        1e-5,
    ),
    "bradley_terry_vs_trl": ("reward_model's Bradley-Terry loss against TRL RewardTrainer's, difference", "<=", 1e-6),
    "judge_256_s": ("a remote judge on 256 completions, server answering in 50 ms, 16 in flight, seconds", "<=", 1.2),
    "lm_eval_same_accuracy": (
        "`invoke eval`'s accuracy equals `lm_eval` run by hand on the exported folder",
        "==",
        True,
    ),
}


SECTIONS = {
    "trainer overhead": lambda quick, image: trainer_speed.run(quick),
    "chunked loss": lambda quick, image: chunked_loss.run(quick),
    "mixture of experts": lambda quick, image: experts.run(quick),
    "checkpoint cost": lambda quick, image: checkpoint_cost.run(quick),
    "host commands at scale": lambda quick, image: host_commands.run(quick),
    "image rebuild": lambda quick, image: image_build.run(quick, image),
    "stop latency": lambda quick, image: stop_latency.run(quick, image),
    "fault injection": lambda quick, image: faults.run(quick),
    "two nodes": lambda quick, image: two_nodes.run(quick, image),
    "own model and tokenizer": lambda quick, image: hf_io.run(quick),
    "corpora": lambda quick, image: corpora.run(quick),
    "post-training": lambda quick, image: post_training.run(quick),
    "sharded checkpoints": lambda quick, image: sharded_checkpoints.run(quick),
    "lora": lambda quick, image: lora.run(quick),
    "qlora": lambda quick, image: qlora.run(quick),
    "generation": lambda quick, image: generation.run(quick),
    "grpo": lambda quick, image: grpo.run(quick),
    "agents": lambda quick, image: agents.run(quick),
    "trackers": lambda quick, image: trackers.run(quick),
    "transformers backend": lambda quick, image: transformers_backend.run(quick),
    "evaluation and rewards from models": lambda quick, image: judging.run(quick),
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
        "torch_threads": TORCH_THREADS,
    }


def recompute(results: dict, key: str) -> tuple[object, float | None]:
    """A figure and its spread (None if it has none) from ``results['samples'][key]`` alone."""
    sample = results["samples"][key]
    method = sample["method"]
    if method == "paired_ratio":
        return ratio_with_spread([a for a, _ in sample["pairs"]], [b for _, b in sample["pairs"]])
    if method == "median":
        return statistics.median(sample["values"]), None
    if method == "fraction":
        numerator, denominator = sample["values"]
        return numerator / denominator, None
    if method == "quotient":
        numerator, denominator = sample["of"]
        return recompute(results, numerator)[0] / recompute(results, denominator)[0], None
    if method in ("lowest", "highest"):
        pick = min if method == "lowest" else max
        worst = pick(sample["of"], key=lambda name: recompute(results, name)[0])
        return recompute(results, worst)
    if method == "count":
        outcomes = sample["outcomes"]
        return (len(outcomes) if sample["of"] is None else sum(o == sample["of"] for o in outcomes)), None
    if method == "observed":
        return sample["value"], None
    raise ValueError(f"{key}: unknown sample method {method!r}")


def verdict(key: str, results: dict) -> str:
    _, comparison, target = TARGETS[key]
    if comparison is None or key not in results:
        return ""
    value = results[key]
    goal = results.get(target) if isinstance(target, str) else target
    met = {"<=": value <= goal, ">=": value >= goal, "==": value == goal}[comparison]
    return f"{'met' if met else 'MISSED'} ({comparison} {goal})"


def table(results: dict) -> str:
    """The docs table: every target figure in results.json, with the run that measured it."""
    rows = ["| measure | key | value | target | measured |", "|---|---|---|---|---|"]
    runs = results.get("runs", {})
    for key, (description, _, _) in TARGETS.items():
        if key in results:
            value = results[key]
            shown = f"{value:.3g}" if isinstance(value, float) else str(value)
            if f"{key}_spread" in results:
                shown += f" ± {results[f'{key}_spread']:.1%}"
            run = runs.get(key)
            when = f"{run['date']} {run['mode']}, load {run['load_average']:.1f}" if run else ""
            rows.append(f"| {description} | `{key}` | {shown} | {verdict(key, results)} | {when} |")
    return "\n".join(rows)


def summary(results: dict) -> str:
    info = results["machine"]
    sections = results.get("sections", {})
    # In the order the bench runs them, whatever order results.json keeps them in.
    order = [name for name in SECTIONS if name in sections] + sorted(set(sections) - set(SECTIONS))
    timed = ", ".join(
        f"{name} {sections[name]['seconds'] / 60:.1f} min ({sections[name]['date']} {sections[name]['mode']})"
        for name in order
    )
    return (
        f"Measured with `invoke bench` on {info['cores']} cores ({info['cpu']}), Python {info['python']}, "
        f"torch {info['torch']} ({info['torch_threads']} thread in-process), Docker {info['docker']}. "
        f"Each row names the run that measured it; sections: {timed}.\n\n" + table(results)
    )


def write_docs(results: dict) -> None:
    _fill(DOCS, TABLE_START, TABLE_END, summary(results))
    if "grpo_reward_curve" in results:
        _fill(POST_TRAINING, CURVE_START, CURVE_END, reward_curve(results))
    if "agent_reward_curve" in results:
        _fill(AGENTS, AGENT_CURVE_START, AGENT_CURVE_END, reward_curve(results, "agent_reward_curve", "agents"))


def _fill(path, start: str, end: str, body: str) -> None:
    """Replace what lies between the markers ``start`` and ``end`` in ``path`` with ``body``."""
    text = path.read_text(encoding="utf-8")
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.DOTALL)
    if not pattern.search(text):
        raise SystemExit(f"{path} has no {start} ... {end} block")
    path.write_text(pattern.sub(lambda _: f"{start}\n{body}\n{end}", text), encoding="utf-8")


def reward_curve(results: dict, key: str = "grpo_reward_curve", section: str = "grpo") -> str:
    """A toy task's mean reward as it trains (bench/grpo.py: every 20th of 400 steps; bench/agents.py: the first and
    every 10th of 200), drawn in text."""
    curve = {int(step): reward for step, reward in results[key].items()}
    run = results.get("runs", {}).get(key, {})
    agents = key.startswith("agent")
    rollouts, every = ("episodes", 10) if agents else ("completions", 20)
    lines = ["```", f"step  mean reward of the step's 32 {rollouts}"]
    for step in sorted(curve):
        if step % every == 0 or (agents and step == 1):
            reward = curve[step]
            lines.append(f"{step:>4}  {reward:.2f} {'█' * round(reward * 40)}")
    lines.append("```")
    lines.append(f"Measured by `invoke bench --only {section}` ({run.get('date', 'date unknown')}).")
    return "\n".join(lines)


def load_results() -> dict:
    """bench/results.json as it stands (an empty record when there is none)."""
    try:
        results = json.loads(RESULTS.read_text(encoding="utf-8"))
    except FileNotFoundError:
        results = {}
    for name in ("runs", "samples", "sections"):
        results.setdefault(name, {})
    return results


def merge(results: dict, figures: Figures, run: dict) -> None:
    """Put one section's figures into ``results``, replacing only the figures it measured."""
    for key, value in figures.items():
        results[key] = value
    for key, sample in figures.samples.items():
        results["samples"][key] = sample
        results["runs"][key] = run
        if f"{key}_spread" not in figures:
            results.pop(f"{key}_spread", None)


def run(quick: bool, base_image: str, only: list[str] | None = None) -> dict:
    unknown = sorted(set(only or ()) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"unknown section(s) {', '.join(unknown)}; the sections are: {', '.join(SECTIONS)}")
    baseimage.ensure_base_image(base_image)
    # A full run of every section measures every figure: it starts afresh, so figures no section makes any more go.
    results = load_results() if quick or only else {"runs": {}, "samples": {}, "sections": {}}
    results["machine"] = machine()
    mode = "quick" if quick else "full"
    for name, step in SECTIONS.items():
        if only and name not in only:
            continue
        print(f"== {name}", flush=True)
        started = time.perf_counter()
        figures = step(quick, base_image)
        seconds = round(time.perf_counter() - started, 1)
        stamp = {"date": time.strftime("%Y-%m-%d"), "mode": mode, "load_average": round(os.getloadavg()[0], 2)}
        merge(results, figures, {**stamp, "section": name})
        results["sections"][name] = {**stamp, "seconds": seconds}
        print(f"   done in {seconds:.0f} s", flush=True)
        # Written after every section, so that an interrupted run keeps what it measured.
        RESULTS.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    print("\n" + summary(results))
    write_docs(results)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, no `base` checkpoint run")
    parser.add_argument("--only", action="append", metavar="SECTION", help="measure only this section (repeatable)")
    parser.add_argument(
        "--table", action="store_true", help="rewrite the docs table from results.json, measure nothing"
    )
    parser.add_argument(
        "--base-image",
        default=os.environ.get("ASTRAI_TEST_BASE_IMAGE", baseimage.DEFAULT_TAG),
        help="local base image for the Docker benchmarks",
    )
    args = parser.parse_args(argv)
    if args.table:
        write_docs(load_results())
        return 0
    run(args.quick, args.base_image, args.only)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
