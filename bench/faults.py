"""Fault injection: SIGKILL and SIGTERM at random moments, then restart, on the `tiny` preset.

- SIGKILL: several runs, each killed a few times (half of the kills aimed at the
  moment a checkpoint is being written, when a staging folder exists) and
  restarted until it finishes. A run counts as exact when its final
  ``model.safetensors`` is bitwise equal to an uninterrupted run's.
- SIGTERM: a few long runs, each stopped again and again: each stop must exit 0
  and leave a complete ``emergency`` checkpoint at the step reached, and the
  next start must name that checkpoint as the one it resumed from.

Runs have their own job folders and go two at a time (one per core, one torch
thread each).

The trainer runs as a plain process here (the same code the container runs), so
the measurement is about the trainer, not Docker's start-up time.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from astrai.common.checkpoints import STAGING_PREFIX, latest_complete_checkpoint
from bench.common import Figures
from bench.trainer_speed import make_assets

STEPS, INTERVAL = 240, 20


def _config(folder: Path, params: Path, data: Path) -> Path:
    config = folder / "train.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "data": {"data_root_path": str(data), "window_size": 32, "num_workers": 0},
                "training": {
                    "max_steps": STEPS,
                    "batch_per_device": 8,
                    "max_lr": 3e-3,
                    "warmup_ratio": 0.05,
                    "random_seed": 11,
                    "device": "cpu",
                },
                "ckpt": {"ckpt_interval": INTERVAL, "param_path": str(params)},
                "log": {"log_interval": 5},
            }
        )
    )
    return config


def _start(config: Path, job_dir: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "astrai.train", "--config", str(config), "--ckpt_dir", str(job_dir), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def _final_weights(job_dir: Path) -> bytes:
    latest = latest_complete_checkpoint(job_dir)
    if latest is None or latest.meta.step != STEPS:
        raise RuntimeError(f"{job_dir} did not finish")
    return (latest.path / "model.safetensors").read_bytes()


def _staging_exists(job_dir: Path) -> bool:
    try:
        return any(entry.name.startswith(STAGING_PREFIX) for entry in os.scandir(job_dir))
    except FileNotFoundError:
        return False


def _metrics_size(job_dir: Path) -> int:
    try:
        return (job_dir / "metrics.jsonl").stat().st_size
    except FileNotFoundError:
        return 0


def _kill_at_random(process: subprocess.Popen, job_dir: Path, during_write: bool, rng: random.Random) -> bool:
    """SIGKILL the trainer once it trains; True when it was killed (False: it finished first)."""
    reported = _metrics_size(job_dir)
    while _metrics_size(job_dir) == reported:
        if process.poll() is not None:
            return False
        time.sleep(0.01)
    if during_write:
        while not _staging_exists(job_dir):
            if process.poll() is not None:
                return False
            time.sleep(0.001)
    else:
        time.sleep(rng.uniform(0.0, 1.5))
    if process.poll() is not None:
        return False
    process.send_signal(signal.SIGKILL)
    process.wait()
    return True


def _killed_run(job_dir: Path, config: Path, reference: bytes, kills_per_run: int, rng: random.Random):
    """(kills, 1 when the run still ended bitwise equal to the uninterrupted one, else 0)."""
    kills = 0
    while True:
        process = _start(config, job_dir)
        if kills < kills_per_run and _kill_at_random(process, job_dir, during_write=kills % 2 == 1, rng=rng):
            kills += 1
            continue
        process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"{job_dir.name} failed after {kills} kills")
        return kills, int(_final_weights(job_dir) == reference)


def _term_trials(job_dir: Path, config: Path, trials: int, rng: random.Random) -> list[bool]:
    """SIGTERM the same job ``trials`` times: for each stop, whether it left an emergency checkpoint that the
    next start resumed."""
    outcomes = []
    for _ in range(trials):
        before = latest_complete_checkpoint(job_dir)
        reported = _metrics_size(job_dir)
        process = _start(config, job_dir, "--max_steps", "100000")
        while _metrics_size(job_dir) == reported and process.poll() is None:
            time.sleep(0.01)  # stop a training run, not one still importing torch
        time.sleep(rng.uniform(0.5, 2.0))
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=120)
        latest = latest_complete_checkpoint(job_dir)
        left_emergency = (
            process.returncode == 0 and latest is not None and latest != before and latest.meta.reason == "emergency"
        )
        resumed = before is None or f"resumed from {before.path}" in output
        outcomes.append(bool(left_emergency and resumed))
    return outcomes


def run(quick: bool) -> dict:
    runs, kills_per_run, term_chains, terms_per_chain = (5, 4, 2, 5) if quick else (8, 4, 3, 5)
    seeds = random.Random(20261130)
    with tempfile.TemporaryDirectory(prefix="astrai-bench-faults-") as work:
        folder = Path(work)
        params, data = make_assets(folder, "tiny")
        config = _config(folder, params, data)
        reference_dir = folder / "reference"
        _start(config, reference_dir).communicate()
        reference = _final_weights(reference_dir)
        # Every run and every chain of stops has its own job folder, so they run side by side (one torch
        # thread each, one per core): what is measured is whether each ends right, not how fast.
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            killed = [
                pool.submit(
                    _killed_run,
                    folder / f"killed-{run}",
                    config,
                    reference,
                    kills_per_run,
                    random.Random(seeds.random()),
                )
                for run in range(runs)
            ]
            stopped = [
                pool.submit(
                    _term_trials, folder / f"terminated-{chain}", config, terms_per_chain, random.Random(seeds.random())
                )
                for chain in range(term_chains)
            ]
            kills = [future.result() for future in killed]
            terms = [future.result() for future in stopped]
    figures = Figures()
    # Each killed run: how many SIGKILLs it took, and whether it still ended bitwise equal.
    figures.count("kill_trials", [1 for count, _ in kills for _ in range(count)], of=None)
    figures.count("kill_runs", [exact for _, exact in kills], of=None)
    figures.count("kill_exact", [bool(exact) for _, exact in kills])
    figures.count("term_trials", [outcome for chain in terms for outcome in chain], of=None)
    figures.count("term_ok", [outcome for chain in terms for outcome in chain])
    return figures
