"""Host commands at scale: `invoke list`, `latest`, `status` and a `clean` preview over 10, 100 and 1000
checkpoint folders, against a plain shell loop that runs a few subprocesses per folder.

The shell loop is what a user would otherwise write: for each folder, check the
five required files, then split the name with `basename` and `cut` to sort by
(epoch, step).
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

from astrai.common.contract import REQUIRED_FILES
from bench.common import invoke, median_time, write_config

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
        folder = job_dir / f"epoch_{index // 100}_step_{(index + 1) * 10}"
        folder.mkdir(parents=True)
        for name in REQUIRED_FILES:
            (folder / name).write_text(
                json.dumps({"epoch": index // 100, "step": (index + 1) * 10, "reason": "periodic"})
            )


def run(quick: bool) -> dict:
    sizes = (10, 100, 1000)
    repeats = 2 if quick else 5
    results: dict = {}
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
                results[f"{verb}_{size}_s"] = median_time(
                    lambda verb=verb, args=args, config=config: invoke(verb, "--config", str(config), *args), repeats
                )
            results[f"shell_list_{size}_s"] = median_time(
                lambda job_dir=job_dir: subprocess.run(
                    ["sh", "-c", SHELL_LIST, "sh", str(job_dir)], capture_output=True, check=True
                ),
                repeats,
            )
        results["list_1000_vs_shell"] = results["list_1000_s"] / results["shell_list_1000_s"]
        importtime = invoke("list", "--config", str(config), env={"PYTHONPROFILEIMPORTTIME": "1"}).stderr
        results["host_imports_torch"] = any(line.rstrip().endswith(" torch") for line in importtime.splitlines())
    return results
