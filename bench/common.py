"""Small helpers the benchmarks share: timing, subprocesses and throwaway jobs."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def median_time(run, repeats: int) -> float:
    """Median wall time of ``run()`` over ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def invoke(*args: str, env: dict | None = None, check: bool = True, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run one invoke task of this project the way a user would."""
    result = subprocess.run([sys.executable, "-m", "invoke", "--search-root", str(REPO), *args],
                            capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"invoke {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def write_config(folder: Path, runtime: dict, trainer: dict | None = None) -> Path:
    config = folder / "train.yaml"
    config.write_text(yaml.safe_dump({"runtime": runtime, **(trainer or {})}, sort_keys=False), encoding="utf-8")
    return config
