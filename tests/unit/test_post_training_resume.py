"""SFT, DPO, the Muon optimizer and LoRA resume as exactly as pre-training: stopped, killed, restarted, bitwise equal.

Real ``python -m astrai.train`` subprocesses on one CPU thread, as in test_train_resume.py.
"""

from __future__ import annotations

import json
import math
import os
import random
import time

import pytest
from trainer_runs import (
    TORCHRUN,
    TRAINER,
    Run,
    final_weights,
    kill_at_moments,
    metrics_step,
    run_to_end,
    staging,
    stop_gracefully,
)

from astrai.common.checkpoints import latest_complete_checkpoint

pytestmark = pytest.mark.slow

# Each case: (train type, extra keys). The Muon cases also run the other two schedules; dpo precomputes its
# reference's log-probabilities (the default), dpo-muon-constant keeps the reference live.
CASES = {
    "sft": ("sft", {}),
    "dpo": ("dpo", {}),
    "sft-muon-wsd": ("sft", {"optimizer": "muon", "schedule": "wsd", "decay_ratio": 0.3}),
    "dpo-muon-constant": ("dpo", {"optimizer": "muon", "schedule": "constant", "dpo_reference": "live"}),
    # LoRA adapters (their reference: the model with its adapters off), with dropout on the adapters' input.
    "dpo-lora": ("dpo", {"lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.1}),
    # A Bradley-Terry reward model on the DPO pairs: the score head added at the start, then resumed as a classifier.
    "reward_model": ("reward_model", {"center_rewards_coefficient": 0.01}),
}
STEPS = 24
SMALL = {"max_steps": STEPS, "batch_per_device": 2}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, post_yaml):
    """The final weights of each case run start to end without a stop, computed on first use."""
    root = tmp_path_factory.mktemp("post-references")
    env = dict(os.environ, OMP_NUM_THREADS="1", TMPDIR=str(root))
    cache = {}

    def get(case: str) -> bytes:
        if case not in cache:
            kind, keys = CASES[case]
            path = post_yaml(root / f"{case}.yaml", kind, ckpt_dir=str(root / case), **SMALL, **keys)
            run_to_end([*TRAINER, "--config", str(path)], env, root / f"{case}.log")
            cache[case] = final_weights(root / case, STEPS)
        return cache[case]

    return get


@pytest.mark.parametrize("case", ["sft", "dpo", "sft-muon-wsd", "dpo-lora", "reward_model"])
def test_a_graceful_stop_then_a_restart_ends_bitwise_equal(tmp_path, post_yaml, trainer_env, uninterrupted, case):
    kind, keys = CASES[case]
    ckpt_dir = tmp_path / "ckpt"
    path = post_yaml(tmp_path / "train.yaml", kind, ckpt_dir=str(ckpt_dir), num_workers=1, **SMALL, **keys)
    run = Run([*TRAINER, "--config", str(path)], trainer_env, tmp_path / "run.log")
    stop_gracefully(run, lambda: metrics_step(ckpt_dir) >= 8, timeout=30)
    latest = latest_complete_checkpoint(ckpt_dir)
    assert latest.meta.reason == "emergency" and 8 <= latest.step < STEPS, run.output()
    assert latest.meta.train_type == kind
    rerun = run_to_end([*TRAINER, "--config", str(path)], trainer_env, tmp_path / "rerun.log")
    assert f"resumed from {latest.path}" in rerun.output()
    assert final_weights(ckpt_dir, STEPS) == uninterrupted(case)


@pytest.mark.parametrize("case", ["dpo-muon-constant"])
def test_sigkill_at_random_moments_then_a_restart_ends_bitwise_equal(
    tmp_path, post_yaml, trainer_env, uninterrupted, case
):
    kind, keys = CASES[case]
    ckpt_dir = tmp_path / "ckpt"
    path = post_yaml(tmp_path / "train.yaml", kind, ckpt_dir=str(ckpt_dir), ckpt_interval=5, **SMALL, **keys)
    rng = random.Random(case)

    def at_random(run: Run) -> None:
        time.sleep(rng.uniform(0.0, 0.25))

    command = [*TRAINER, "--config", str(path)]
    run, kills = kill_at_moments(command, trainer_env, tmp_path / "run.log", ckpt_dir, [at_random] * 3)
    # On a fast machine the last run may finish its 24 steps before its moment comes: that one ends normally.
    assert kills >= 2, run.output()
    assert final_weights(ckpt_dir, STEPS) == uninterrupted(case)
    assert not staging(ckpt_dir)


def _first_record(ckpt_dir):
    return json.loads((ckpt_dir / "metrics.jsonl").read_text().splitlines()[0])


def test_sft_on_two_ddp_processes_takes_the_step_one_process_takes(tmp_path, post_yaml, trainer_env):
    """The same global batch of 4 windows, as 1 process x 4 or 2 processes x 2: the same loss and gradient."""
    records = {}
    for name, command, per_device in (
        ("one", TRAINER, 4),
        ("ddp", [*TORCHRUN, "-m", "astrai.train", "--parallel_mode", "ddp"], 2),
    ):
        ckpt_dir = tmp_path / name
        path = post_yaml(
            tmp_path / f"{name}.yaml",
            "sft",
            ckpt_dir=str(ckpt_dir),
            max_steps=2,
            batch_per_device=per_device,
            log_interval=1,
        )
        run_to_end([*command, "--config", str(path)], trainer_env, tmp_path / f"{name}.log")
        records[name] = _first_record(ckpt_dir)
    one, ddp = records["one"], records["ddp"]
    assert abs(one["loss"] - ddp["loss"]) <= 1e-5 * one["loss"], records
    # The gradient norm before clipping: a rank dividing by its own supervised tokens would change it.
    assert abs(one["grad_norm"] - ddp["grad_norm"]) <= 1e-4 * one["grad_norm"], records


@pytest.mark.parametrize("reference", ["precomputed", "live"])
def test_dpo_under_fsdp_starts_at_ln2_stops_and_resumes(tmp_path, post_yaml, trainer_env, reference):
    ckpt_dir = tmp_path / "ckpt"
    path = post_yaml(
        tmp_path / "dpo.yaml",
        "dpo",
        ckpt_dir=str(ckpt_dir),
        max_steps=12,
        batch_per_device=2,
        dpo_reference=reference,
        log_interval=1,
    )
    command = [*TORCHRUN, "-m", "astrai.train", "--config", str(path), "--parallel_mode", "fsdp"]
    stop_gracefully(Run(command, trainer_env, tmp_path / "run1.log"), lambda: metrics_step(ckpt_dir) >= 4, rank=1)
    first = _first_record(ckpt_dir)
    assert abs(first["loss"] - math.log(2)) <= 1e-5 and abs(first["rewards_margin"]) <= 1e-6, first
    stopped = latest_complete_checkpoint(ckpt_dir)
    assert stopped.meta.parallel_mode == "fsdp" and stopped.meta.reason == "emergency"
    run = run_to_end(command, trainer_env, tmp_path / "run2.log")
    assert f"resumed from {stopped.path}" in run.output()
    if reference == "precomputed":
        assert "reference log-probabilities of 160 pairs read from" in run.output(), run.output()
    assert latest_complete_checkpoint(ckpt_dir).step == 12
