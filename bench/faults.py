"""Fault injection: SIGKILL and SIGTERM at random moments, then restart, on the `tiny` preset.

- SIGKILL: several runs, each killed a few times (half of the kills aimed at the
  moment a checkpoint is being written, when a staging folder exists) and
  restarted until it finishes. A run counts as exact when its final
  ``model.safetensors`` is bitwise equal to an uninterrupted run's.
- SIGTERM: one long run stopped again and again: each stop must exit 0 and
  leave a complete ``emergency`` checkpoint at the step reached, and the next
  start must name that checkpoint as the one it resumed from.

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
from pathlib import Path

import yaml

from astrai.checkpoints import STAGING_PREFIX, latest_complete_checkpoint, read_meta
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
    if latest is None or read_meta(latest)["step"] != STEPS:
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


def _kill_runs(folder: Path, config: Path, reference: bytes, runs: int, kills_per_run: int, rng: random.Random):
    trials = exact = 0
    for run in range(runs):
        job_dir = folder / f"killed-{run}"
        kills = 0
        while True:
            process = _start(config, job_dir)
            if kills < kills_per_run and _kill_at_random(process, job_dir, during_write=kills % 2 == 1, rng=rng):
                kills += 1
                continue
            process.communicate()
            if process.returncode != 0:
                raise RuntimeError(f"run {run} failed after {kills} kills")
            break
        trials += kills
        exact += _final_weights(job_dir) == reference
    return trials, exact


def _term_trials(folder: Path, config: Path, trials: int, rng: random.Random) -> tuple[int, int]:
    job_dir = folder / "terminated"
    ok = 0
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
            process.returncode == 0
            and latest is not None
            and latest != before
            and read_meta(latest)["reason"] == "emergency"
        )
        resumed = before is None or f"resumed from {before.path}" in output
        ok += left_emergency and resumed
    return trials, ok


def run(quick: bool) -> dict:
    rng = random.Random(20261130)
    with tempfile.TemporaryDirectory(prefix="astrai-bench-faults-") as work:
        folder = Path(work)
        params, data = make_assets(folder, "tiny")
        config = _config(folder, params, data)
        reference_dir = folder / "reference"
        _start(config, reference_dir).communicate()
        reference = _final_weights(reference_dir)
        runs, kills_per_run = (5, 4) if quick else (8, 4)
        kill_trials, kill_exact = _kill_runs(folder, config, reference, runs, kills_per_run, rng)
        term_trials, term_ok = _term_trials(folder, config, 10 if quick else 15, rng)
    return {
        "kill_trials": kill_trials,
        "kill_runs": runs,
        "kill_exact": kill_exact,
        "term_trials": term_trials,
        "term_ok": term_ok,
    }
