"""Host commands at scale: `invoke list`, `latest`, `status` and a `clean` preview over 10, 100 and 1000
checkpoint folders, against a plain shell loop that runs a few subprocesses per folder; and `invoke status`
on a run of 10⁴ logged steps against one of 10⁶.

The shell loop is what a user would otherwise write: for each folder, check the
five required files, then split the name with `basename` and `cut` to sort by
(epoch, step). It checks names only, where `invoke list` also reads each
checkpoint's meta.json and file headers.

``status_time_1e6_vs_1e4`` and ``status_mem_1e6_vs_1e4``: wall time and peak
resident memory of `invoke status` (the whole process, measured from outside)
when the job's metrics.jsonl holds 10⁶ records (about 200 MB) over 10⁴; turns
alternate between the two jobs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from astrai.common.contract import METRICS_FILE
from bench.common import REPO, Figures, invoke, placeholder_checkpoint, sample_times, write_config

SHELL_LIST = r"""
for d in "$1"/epoch_*_step_*; do
    [ -d "$d" ] || continue
    complete=1
    for f in meta.json config.json model.safetensors optimizer.pt scheduler.pt; do
        [ -f "$d/$f" ] || complete=0
    done
    [ "$complete" = 1 ] || continue
    name=$(basename "$d")
    epoch=$(echo "$name" | cut -d_ -f2)
    step=$(echo "$name" | cut -d_ -f4)
    echo "$epoch $step $d"
done | sort -n -k1,1 -k2,2 | cut -d' ' -f3
"""


def _fill(job_dir: Path, count: int) -> None:
    for index in range(count):
        placeholder_checkpoint(job_dir, index // 100, (index + 1) * 10)


def _metrics(job_dir: Path, records: int) -> None:
    """A metrics.jsonl of ``records`` logged steps, as the trainer writes them."""
    job_dir.mkdir(parents=True, exist_ok=True)
    with open(job_dir / METRICS_FILE, "w", encoding="utf-8") as handle:
        for step in range(1, records + 1):
            record = {
                "epoch": step // 50_000,
                "eta_s": 2.0 * (records - step),
                "grad_norm": 0.8,
                "loss": 2.0 + 3.0 / step**0.3,
                "lr": 3e-4,
                "max_steps": records,
                "step": step,
                "time": 1.7e9 + step,
                "tokens_per_s": 123456.7,
                "tokens_seen": 4096 * step,
            }
            handle.write(json.dumps(record, sort_keys=True) + "\n")


_MEASURED = (
    "import resource, subprocess, sys, time; start = time.perf_counter(); "
    "code = subprocess.run(sys.argv[1:], capture_output=True).returncode; "
    "print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, code)"
)


def _status_cost(config: Path) -> tuple[float, int]:
    """(wall seconds, peak resident KiB) of one `invoke status` process, measured by a parent of its own."""
    command = [sys.executable, "-m", "invoke", "--search-root", str(REPO), "status", "--config", str(config)]
    seconds, peak, code = subprocess.run(
        [sys.executable, "-c", _MEASURED, *command], capture_output=True, text=True, check=True
    ).stdout.split()
    if code != "0":
        raise RuntimeError(f"invoke status failed on {config}")
    return float(seconds), int(peak)


def status_at_scale(folder: Path, repeats: int, figures: Figures) -> None:
    costs: dict[int, list[tuple[float, int]]] = {}
    configs = {}
    for records in (10**4, 10**6):
        job = folder / f"status-{records}"
        job.mkdir()
        configs[records] = write_config(
            job, {"job_name": "bench", "gpu": {"devices": "none"}, "container": {"cuda_tag": "cpu"}}
        )
        _metrics(job / "checkpoints" / "bench", records)
        costs[records] = []
    for turn in range(repeats):
        for records in (10**4, 10**6) if turn % 2 == 0 else (10**6, 10**4):
            costs[records].append(_status_cost(configs[records]))
    large, small = costs[10**6], costs[10**4]
    figures.ratio("status_time_1e6_vs_1e4", [s for s, _ in large], [s for s, _ in small])
    figures.ratio("status_mem_1e6_vs_1e4", [kib for _, kib in large], [kib for _, kib in small])
    figures.median("status_1e6_s", [s for s, _ in large])


def run(quick: bool) -> dict:
    sizes = (10, 100, 1000)
    repeats = 2 if quick else 5
    results = Figures()

    def times(run) -> list[float]:
        return sample_times(run, repeats)

    with tempfile.TemporaryDirectory(prefix="astrai-bench-host-") as work:
        for size in sizes:
            folder = Path(work) / str(size)
            folder.mkdir()
            config = write_config(
                folder,
                {
                    "job_name": "bench",
                    "gpu": {"devices": "none"},
                    "container": {"cuda_tag": "cpu", "checkpoint_keep_last": 3},
                },
            )
            job_dir = folder / "checkpoints" / "bench"
            _fill(job_dir, size)
            listed = invoke("list", "--config", str(config)).stdout.split()
            shell = subprocess.run(["sh", "-c", SHELL_LIST, "sh", str(job_dir)], capture_output=True, text=True)
            if listed != shell.stdout.split() or len(listed) != size:
                raise RuntimeError(f"invoke list and the shell loop disagree for {size} folders")
            for verb, args in (("list", ()), ("latest", ()), ("status", ()), ("clean", ("--keep", "3"))):
                results.median(
                    f"{verb}_{size}_s",
                    times(lambda verb=verb, args=args, config=config: invoke(verb, "--config", str(config), *args)),
                )
            results.median(
                f"shell_list_{size}_s",
                times(
                    lambda job_dir=job_dir: subprocess.run(
                        ["sh", "-c", SHELL_LIST, "sh", str(job_dir)], capture_output=True, check=True
                    )
                ),
            )
        results.quotient("list_1000_vs_shell", "list_1000_s", "shell_list_1000_s")
        importtime = invoke("list", "--config", str(config), env={"PYTHONPROFILEIMPORTTIME": "1"}).stderr
        torch_lines = [line for line in importtime.splitlines() if line.rstrip().endswith(" torch")]
        results.observed("host_imports_torch", bool(torch_lines), torch_lines or "no torch in -X importtime")
        status_at_scale(Path(work), 3 if quick else 5, results)
    return results
