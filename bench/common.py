"""Small helpers the benchmarks share: timing, subprocesses and throwaway jobs."""

from __future__ import annotations

import math
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


# Threads every in-process benchmark gives torch. On a shared 2-core machine, two OpenMP threads stall
# whenever another process takes one core, which spreads timings far more than one thread does.
TORCH_THREADS = 1


def fix_threads() -> None:
    import torch

    torch.set_num_threads(TORCH_THREADS)


def ratio_with_spread(numerators: list[float], denominators: list[float]) -> tuple[float, float]:
    """Median of the paired ratios a_i / b_i (measured back to back), and the spread of that median.

    The spread is half the width of a distribution-free ~95% confidence interval of the median
    (order statistics n/2 ± sqrt(n)), relative to the median: two runs should agree within about it.
    """
    ratios = sorted(a / b for a, b in zip(numerators, denominators, strict=True))
    n = len(ratios)
    half = math.ceil(math.sqrt(n))
    low, high = ratios[max(n // 2 - half, 0)], ratios[min((n - 1) // 2 + half, n - 1)]
    middle = statistics.median(ratios)
    return middle, (high - low) / 2 / middle


def invoke(
    *args: str, env: dict | None = None, check: bool = True, timeout: float = 900
) -> subprocess.CompletedProcess:
    """Run one invoke task of this project the way a user would."""
    result = subprocess.run(
        [sys.executable, "-m", "invoke", "--search-root", str(REPO), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )
    if check and result.returncode != 0:
        raise RuntimeError(f"invoke {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def write_config(folder: Path, runtime: dict, trainer: dict | None = None) -> Path:
    config = folder / "train.yaml"
    config.write_text(yaml.safe_dump({"runtime": runtime, **(trainer or {})}, sort_keys=False), encoding="utf-8")
    return config
