"""Small helpers the benchmarks share: timing, subprocesses and throwaway jobs."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from astrai.common.contract import DATA_MANIFEST_FILE
from tests import support
from tests.support import REPO, placeholder_checkpoint, write_config  # noqa: F401 (the benchmarks use them)


def sample_times(run, repeats: int) -> list[float]:
    """Wall time of each of ``repeats`` calls of ``run()``."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times


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


class Figures(dict):
    """The figures one benchmark section measured, each with the samples it was computed from.

    Every figure is a number (or a count, or a yes/no) under its key, as results.json shows it, and
    ``figures.samples[key]`` says how it was computed and from what: ``bench.run.recompute`` gets
    every figure back from its samples alone, so anyone can re-check a figure and its spread.
    """

    def __init__(self, prefix: str = ""):
        super().__init__()
        self.prefix = prefix
        self.samples: dict[str, dict] = {}

    def _put(self, key: str, value, sample: dict, spread: float | None = None) -> float:
        key = self.prefix + key
        self[key] = value
        if spread is not None:
            self[f"{key}_spread"] = spread
        self.samples[key] = sample
        return value

    def ratio(self, key: str, numerators: list[float], denominators: list[float]) -> float:
        """The median of per-turn ratios (each turn's pair measured back to back), with its spread."""
        value, spread = ratio_with_spread(numerators, denominators)
        pairs = [[a, b] for a, b in zip(numerators, denominators, strict=True)]
        return self._put(key, value, {"method": "paired_ratio", "pairs": pairs}, spread)

    def median(self, key: str, values: list[float]) -> float:
        values = list(values)
        return self._put(key, statistics.median(values), {"method": "median", "values": values})

    def fraction(self, key: str, numerator: float, denominator: float, inputs: dict | None = None) -> float:
        """One measured quantity over another (a peak over a size, say); ``inputs``: what each came from."""
        sample = {"method": "fraction", "values": [numerator, denominator], **({"inputs": inputs} if inputs else {})}
        return self._put(key, numerator / denominator, sample)

    def quotient(self, key: str, numerator: str, denominator: str) -> float:
        """Two figures of this section divided: ``numerator`` over ``denominator`` (unprefixed keys)."""
        a, b = self.prefix + numerator, self.prefix + denominator
        return self._put(key, self[a] / self[b], {"method": "quotient", "of": [a, b]})

    def lowest(self, key: str, keys: list[str]) -> float:
        """The worst (lowest) of several figures of this section, with its spread."""
        names = [self.prefix + name for name in keys]
        worst = min(names, key=lambda name: self[name])
        return self._put(key, self[worst], {"method": "lowest", "of": names}, self.get(f"{worst}_spread"))

    def highest(self, key: str, keys: list[str]) -> float:
        """The worst (highest) of several figures of this section whose target is an upper bound."""
        names = [self.prefix + name for name in keys]
        worst = max(names, key=lambda name: self[name])
        return self._put(key, self[worst], {"method": "highest", "of": names}, self.get(f"{worst}_spread"))

    def count(self, key: str, outcomes: list, *, of=True) -> int:
        """How many of ``outcomes`` equal ``of`` (every outcome when ``of`` is None)."""
        outcomes = list(outcomes)
        value = len(outcomes) if of is None else sum(outcome == of for outcome in outcomes)
        return self._put(key, value, {"method": "count", "outcomes": outcomes, "of": of})

    def observed(self, key: str, value, evidence) -> object:
        """A yes/no or a plain reading, with what it was read from."""
        return self._put(key, value, {"method": "observed", "value": value, "evidence": evidence})


_TIMED_PREPARE = """
import resource, subprocess, sys, time
start = time.perf_counter()
subprocess.run(sys.argv[1:], check=True, capture_output=True)
print(time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def run_prepare(out: Path, files: list[Path], tokenizer: Path | None, workers: int) -> tuple[float, int, int]:
    """(tokens/s, peak resident KiB of its largest process, tokens) of one `prepare` command, from outside.

    The command runs as a user runs it, ``python -m astrai.data prepare``, in a fresh process: `prepare`'s worker
    processes then import what that command imports, not the benchmark's own modules (torch among them).
    """
    command = [sys.executable, "-m", "astrai.data", "prepare", "--out", str(out), "--workers", str(workers)]
    command += ["--tokenizer", str(tokenizer)] if tokenizer else []
    result = subprocess.run(
        [sys.executable, "-c", _TIMED_PREPARE, *command, *map(str, files)], capture_output=True, text=True, cwd=REPO
    )
    if result.returncode != 0:
        raise RuntimeError(result.stderr)
    seconds, peak = result.stdout.split()
    tokens = json.loads((out / DATA_MANIFEST_FILE).read_text())["num_tokens"]
    return tokens / float(seconds), int(peak), tokens


def invoke(*args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run one invoke task as a user would; a failure stops the benchmark with its output."""
    return support.invoke(*args, env=env, timeout=timeout, check=True)


def wait_for_metrics(job_dir: Path, lines: int, what: str = "the benchmark job", timeout: float = 300) -> None:
    """Wait until the job has logged ``lines`` steps to metrics.jsonl; RuntimeError when it makes no progress."""
    metrics = job_dir / "metrics.jsonl"
    started = time.monotonic()
    while not metrics.exists() or len(metrics.read_text().splitlines()) < lines:
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"{what} made no progress")
        time.sleep(0.2)


def status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS: resident now, VmHWM: the peak since the last reset)."""
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def drop_from_page_cache(folder: Path) -> None:
    """Evict a (flushed) folder's files from the page cache, so that reading them goes to the disk."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
