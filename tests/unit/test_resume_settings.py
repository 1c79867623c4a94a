"""Resume means what the config says: the checkpoint brings the optimizer's state, the config its settings."""

from __future__ import annotations

import json

import pytest
import torch

from astrai.common.config import TrainingSection, load_trainer_config
from astrai.trainer.models.optim import Schedule, describe_changes


def _records(job_dir):
    return [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_learning_rate_and_optimizer_settings_of_a_resume_are_the_config_s(
    tmp_path, train_yaml, one_thread, run_trainer, make_trainer, capsys
):
    job = tmp_path / "ckpt"
    path = train_yaml(tmp_path / "train.yaml", max_steps=40, max_lr=3e-3, ckpt_interval=20, log_interval=1)
    run_trainer(path, steps=20, ckpt_dir=job)
    capsys.readouterr()
    trainer = make_trainer(path, ckpt_dir=job, max_lr=1e-5, weight_decay=0.0, adam_beta2=0.99, adam_eps=1e-6)
    try:
        assert trainer.progress.step == 20
        for group in trainer.optimizer.param_groups:
            assert group["betas"] == (0.9, 0.99) and group["eps"] == 1e-6 and group["weight_decay"] == 0.0
        assert trainer.optimizer.state, "the moments came from the checkpoint"
        trainer.train(steps=1)
    finally:
        trainer.close()
    out = capsys.readouterr().out
    assert (
        "note: resuming with changed settings: max_lr 0.003 → 1e-05, weight_decay 0.1 → 0, "
        "betas (0.9, 0.95) → (0.9, 0.99), eps 1e-08 → 1e-06" in out
    ), out
    config = load_trainer_config(path, [("max_lr", "1e-5"), ("max_steps", "40")])
    expected = Schedule.of(config.training).lr(20)
    assert _records(job)[-1]["step"] == 21 and _records(job)[-1]["lr"] == expected
    saved = Schedule.of(TrainingSection(max_steps=40, max_lr=3e-3, warmup_ratio=0.05))
    assert f"the learning rate of step 21 goes from {saved.lr(20):.1e} (as saved) to {expected:.1e}" in out


def test_extending_a_finished_run_is_announced_old_to_new(tmp_path, train_yaml, one_thread, run_trainer, capsys):
    job = tmp_path / "ckpt"
    path = train_yaml(tmp_path / "train.yaml", max_steps=60, ckpt_interval=1000, ckpt_dir=str(job))
    run_trainer(path)
    capsys.readouterr()
    run_trainer(path, max_steps=80)
    out = capsys.readouterr().out
    old = Schedule.of(TrainingSection(max_steps=60, max_lr=3e-3, warmup_ratio=0.05))
    new = Schedule.of(TrainingSection(max_steps=80, max_lr=3e-3, warmup_ratio=0.05))
    assert (
        f"resuming with changed settings: warmup_steps 3 → 4, max_steps 60 → 80; the learning rate of step 61 "
        f"goes from {old.lr(60):.1e} (as saved) to {new.lr(60):.1e}" in out
    ), out
    assert new.lr(60) > old.lr(60), "cosine over the longer run climbs back from its floor"
    assert _records(job)[-1]["step"] == 80


def test_the_schedules_warm_up_then_decay_stay_or_decay_late():
    cosine = Schedule("cosine", 1.0, 0.1, 10, 100, 0)
    wsd = Schedule("wsd", 1.0, 0.1, 10, 100, 20)
    constant = Schedule("constant", 1.0, 0.1, 10, 100, 0)
    for schedule in (cosine, wsd, constant):
        assert schedule.lr(0) == pytest.approx(1 / 11) and schedule.lr(10) == 1.0
    # The last step (after 99 completed ones) runs at max_lr * min_lr_ratio, for cosine and wsd alike.
    assert cosine.lr(98) > cosine.lr(99) == pytest.approx(0.1) and cosine.lr(100) == pytest.approx(0.1)
    assert cosine.lr(10 + 89 / 2) == pytest.approx(0.55)
    assert wsd.lr(79) == 1.0 and wsd.lr(80) < 1.0 and wsd.lr(89) == pytest.approx(0.55)
    assert wsd.lr(98) > wsd.lr(99) == pytest.approx(0.1)
    assert constant.lr(99) == constant.lr(10_000) == 1.0
    # A wsd run extended before its decay began only lengthens the plateau.
    assert Schedule("wsd", 1.0, 0.1, 10, 200, 40).lr(79) == 1.0


def test_cosine_gives_the_numbers_torch_s_lambda_scheduler_gave():
    """The schedule moved from LambdaLR to a function of the step: a run's learning rates did not change."""
    schedule = Schedule.of(TrainingSection(max_steps=50, max_lr=3e-4, warmup_ratio=0.1))
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([parameter], lr=schedule.max_lr)
    lambdas = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.multiplier)
    for step in range(50):
        assert optimizer.param_groups[0]["lr"] == schedule.lr(step), step
        optimizer.step()
        lambdas.step()


def test_a_resume_with_unchanged_settings_announces_nothing_and_an_old_scheduler_file_is_tolerated():
    training = TrainingSection(max_steps=50)
    schedule = Schedule.of(training)
    groups = [{"weight_decay": 0.1, "betas": (0.9, 0.95), "eps": 1e-8, "lr": 1.0}]
    assert describe_changes(schedule.state_dict(10), groups, schedule, training, 10) is None
    legacy = {"base_lrs": [3e-4], "last_epoch": 10, "_step_count": 11, "verbose": False}
    assert describe_changes(legacy, groups, schedule, training, 10) is None
    changed = describe_changes(legacy, [{**groups[0], "weight_decay": 0.2}], schedule, training, 10)
    assert changed.startswith("resuming with changed settings: weight_decay 0.2 → 0.1")
