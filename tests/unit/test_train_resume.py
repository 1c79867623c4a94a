"""The trainer as the container runs it: killed, stopped and restarted, alone and under torchrun.

Every run here is a real ``python -m astrai.train`` (or torchrun) subprocess on
one CPU thread per process; each test kills whatever it started.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from trainer_runs import (
    TORCHRUN,
    TRAINER,
    Run,
    final_weights,
    kill_at_moments,
    metrics_step,
    metrics_steps,
    run_to_end,
    staging,
    stop_gracefully,
    wait_for,
)

from astrai.common.checkpoints import latest_complete_checkpoint
from astrai.common.model_folder import ModelConfig
from astrai.trainer.models.weights import read_weights

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def references(tmp_path_factory, train_yaml):
    """Uninterrupted runs, computed on first use: {"single": bytes, "ddp": bytes}."""
    root = tmp_path_factory.mktemp("references")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]), TMPDIR=str(root))
    cache = {}

    def get(kind: str) -> bytes:
        if kind not in cache:
            path = train_yaml(root / f"{kind}.yaml", ckpt_dir=str(root / kind))
            command = TRAINER if kind == "single" else [*TORCHRUN, "-m", "astrai.train"]
            extra = [] if kind == "single" else ["--parallel_mode", "ddp"]
            run_to_end([*command, "--config", str(path), *extra], env, root / f"{kind}.log")
            cache[kind] = final_weights(root / kind, 200)
        return cache[kind]

    return get


def test_sigkill_at_random_moments_then_restart_ends_bitwise_equal(tmp_path, train_yaml, trainer_env, references):
    path = train_yaml(tmp_path / "train.yaml", ckpt_dir=str(tmp_path / "ckpt"), ckpt_interval=10)
    ckpt_dir = tmp_path / "ckpt"
    rng = random.Random(20240601)
    kills_during_save = 0

    def at_random(run: Run) -> None:
        time.sleep(rng.uniform(0.0, 0.5))

    def while_saving(run: Run) -> None:
        nonlocal kills_during_save
        deadline = time.monotonic() + 3
        while run.proc.poll() is None and time.monotonic() < deadline and not staging(ckpt_dir):
            time.sleep(0.0005)
        kills_during_save += bool(staging(ckpt_dir))

    # Once a run trains, kill it at a random moment, or (every other time) while it writes a checkpoint.
    command = [*TRAINER, "--config", str(path)]
    run, kills = kill_at_moments(command, trainer_env, tmp_path / "run.log", ckpt_dir, [at_random, while_saving] * 3)
    assert kills == 6, run.output()
    print(f"{kills} kills, {kills_during_save} of them while a checkpoint was being written")
    assert final_weights(ckpt_dir, 200) == references("single")
    assert not staging(ckpt_dir)


def test_sigterm_stops_within_a_step_and_a_save_and_resumes_bitwise_equal(
    tmp_path, train_yaml, trainer_env, references
):
    # One DataLoader worker: the stop signal goes to the whole process group, and the worker must ignore it.
    path = train_yaml(tmp_path / "train.yaml", ckpt_dir=str(tmp_path / "ckpt"), num_workers=1)
    ckpt_dir = tmp_path / "ckpt"
    run = Run([*TRAINER, "--config", str(path)], trainer_env, tmp_path / "run.log")
    try:
        wait_for(lambda: metrics_step(ckpt_dir) >= 50, run)
        logged = metrics_step(ckpt_dir)
        started = time.monotonic()
        os.killpg(run.proc.pid, signal.SIGTERM)
        time.sleep(0.05)
        # A second signal while the emergency checkpoint is written changes nothing.
        os.kill(run.proc.pid, signal.SIGINT)
        code = run.proc.wait(timeout=30)
        elapsed = time.monotonic() - started
    finally:
        run.kill()
    output = run.output()
    assert code == 0, output
    assert "emergency checkpoint" in output
    latest = latest_complete_checkpoint(ckpt_dir)
    # Within a step: the step under way when the signal came (metrics are written every log_interval steps,
    # so at most that many past the last logged one) is the last one trained.
    assert latest.meta.reason == "emergency" and logged <= latest.step <= logged + 10 < 200, (logged, latest.step)
    # And quickly: one step (~0.03 s) and one save of a tiny model (~0.1 s); the rest is the process's exit,
    # slower on a loaded machine, but far short of the ~10 s the remaining steps take.
    assert elapsed < 5, output

    rerun = run_to_end([*TRAINER, "--config", str(path)], trainer_env, tmp_path / "rerun.log")
    assert f"resumed from {latest.path}" in rerun.output()
    assert final_weights(ckpt_dir, 200) == references("single")


def _stopped_at_start(path) -> list[str]:
    """The trainer started as the container starts it, with a SIGTERM already pending (held, then exec'd)."""
    launch = (
        "import os, signal, sys\n"
        "from astrai.trainer.launch import signals\n"
        "signals.hold()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        f"os.execv(sys.executable, {[*TRAINER, '--config', str(path)]!r})\n"
    )
    return [sys.executable, "-c", launch]


def test_a_stop_that_comes_while_the_trainer_starts_is_kept_and_honoured(tmp_path, train_yaml, trainer_env):
    # As in the container: the entrypoint holds the stop signals, a SIGTERM lands before the trainer runs
    # (while it would still be importing torch), and exec carries it over, pending.
    path = train_yaml(tmp_path / "train.yaml", ckpt_dir=str(tmp_path / "ckpt"))
    run = Run(_stopped_at_start(path), trainer_env, tmp_path / "run.log")
    try:
        code = run.wait(timeout=120)
    finally:
        run.kill()
    output = run.output()
    assert code == 0, output
    assert "stop requested (SIGTERM)" in output
    latest = latest_complete_checkpoint(tmp_path / "ckpt")
    assert latest.step == 1 and latest.meta.reason == "emergency", output


def test_ddp_two_processes_killed_and_stopped_ends_bitwise_equal(tmp_path, train_yaml, trainer_env, references):
    path = train_yaml(tmp_path / "train.yaml", ckpt_dir=str(tmp_path / "ckpt"))
    ckpt_dir = tmp_path / "ckpt"
    command = [*TORCHRUN, "-m", "astrai.train", "--config", str(path), "--parallel_mode", "ddp"]
    rng = random.Random(7)

    # SIGKILL everything at a random moment after the first checkpoint.
    run = Run(command, trainer_env, tmp_path / "run1.log")
    try:
        wait_for(lambda: metrics_step(ckpt_dir) >= 30, run)
        time.sleep(rng.uniform(0.0, 1.0))
    finally:
        run.kill()
    killed_at = latest_complete_checkpoint(ckpt_dir)
    assert killed_at is not None

    # SIGTERM to rank 1 only: both ranks agree on the stop step and exit 0.
    run = Run(command, trainer_env, tmp_path / "run2.log")
    reported = len(metrics_steps(ckpt_dir))
    # Records of the killed run may be ahead of its last checkpoint: wait for two records of this run.
    stop_gracefully(run, lambda: len(metrics_steps(ckpt_dir)) >= reported + 2, rank=1)
    assert f"resumed from {killed_at.path}" in run.output()
    stopped_at = latest_complete_checkpoint(ckpt_dir)
    meta = stopped_at.meta
    assert meta.reason == "emergency" and meta.world_size == 2 and "stop requested (on another rank)" in run.output()

    run_to_end(command, trainer_env, tmp_path / "run3.log")
    assert final_weights(ckpt_dir, 200) == references("ddp")


def test_fsdp_two_processes_train_checkpoint_and_resume_in_the_full_format(tmp_path, train_yaml, trainer_env):
    path = train_yaml(tmp_path / "train.yaml", ckpt_dir=str(tmp_path / "ckpt"), max_steps=60)
    ckpt_dir = tmp_path / "ckpt"
    command = [*TORCHRUN, "-m", "astrai.train", "--config", str(path), "--parallel_mode", "fsdp", "--format", "full"]

    stop_gracefully(Run(command, trainer_env, tmp_path / "run1.log"), lambda: metrics_step(ckpt_dir) >= 30, rank=0)
    stopped = latest_complete_checkpoint(ckpt_dir)
    assert stopped.meta.reason == "emergency" and stopped.meta.parallel_mode == "fsdp"
    # The full model in one file, and an optimizer state keyed by parameter name, loadable without pickle.
    read_weights(stopped.path, ModelConfig.load(stopped.path))
    optimizer = torch.load(stopped.path / "optimizer.pt", weights_only=True)
    assert optimizer["state"]["tok_embeddings.weight"]["exp_avg"].shape == (320, 128)

    run = run_to_end(command, trainer_env, tmp_path / "run2.log")
    assert f"resumed from {stopped.path}" in run.output() and "final checkpoint" in run.output()
    assert latest_complete_checkpoint(ckpt_dir).step == 60
    losses = [json.loads(line)["loss"] for line in (ckpt_dir / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0]


def test_a_stop_short_of_the_end_exits_with_the_code_a_retrying_scheduler_is_given(tmp_path, train_yaml, trainer_env):
    from astrai.common.contract import ENV_STOPPED_EXIT_CODE, EXIT_STOPPED_UNFINISHED

    path = train_yaml(tmp_path / "train.yaml", ckpt_dir=str(tmp_path / "ckpt"))
    env = {**trainer_env, ENV_STOPPED_EXIT_CODE: str(EXIT_STOPPED_UNFINISHED)}
    run = Run(_stopped_at_start(path), env, tmp_path / "run.log")
    try:
        assert run.wait(timeout=120) == EXIT_STOPPED_UNFINISHED, run.output()
    finally:
        run.kill()
    assert latest_complete_checkpoint(tmp_path / "ckpt").meta.reason == "emergency"
    # The same run resumed to its end exits 0.
    run_to_end([*TRAINER, "--config", str(path)], env, tmp_path / "rerun.log", timeout=300)
