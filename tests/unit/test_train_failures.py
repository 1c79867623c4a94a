"""The trainer when things go wrong at night: a diverging loss, a full disk (issue 9, items 7 and 12)."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from astrai.common.checkpoints import STAGING_PREFIX, list_complete_checkpoints
from astrai.common.contract import REASON_EMERGENCY
from astrai.trainer.models import optim
from astrai.trainer.run import health, loop, report
from astrai.trainer.run.health import Diverged
from astrai.trainer.run.loop import Trainer
from astrai.trainer.run.report import ReportError
from tests.support import run_python


def _poison(trainer: Trainer) -> None:
    """A NaN in one weight: from the next step on, the loss and every gradient are NaN."""
    with torch.no_grad():
        next(trainer.model.parameters()).view(-1)[0] = float("nan")


def _steps(job_dir) -> list[int]:
    return [checkpoint.step for checkpoint in list_complete_checkpoints(job_dir)]


def _all_finite(job_dir) -> bool:
    return all(
        torch.isfinite(tensor).all()
        for checkpoint in list_complete_checkpoints(job_dir)
        for tensor in load_file(checkpoint.path / "model.safetensors").values()
    )


@pytest.fixture
def diverging(tmp_path, job_yaml, one_thread, make_trainer):
    """A trainer that trained 40 good steps (checkpoints at 30 and 40, keep_last 2), then got a NaN weight."""
    path = job_yaml(max_steps=100, ckpt_interval=10, keep_last=2, log_interval=5)
    trainer = make_trainer(path)
    trainer.train(steps=40)
    trainer.checkpointer.wait()
    assert _steps(tmp_path / "ckpt") == [30, 40]
    _poison(trainer)
    yield trainer, tmp_path / "ckpt"
    trainer.close()


def test_divergence_stops_with_the_step_and_last_finite_loss_and_keeps_the_good_checkpoints(diverging):
    trainer, job_dir = diverging
    with pytest.raises(Diverged) as raised:
        trainer.train()
    message = str(raised.value)
    assert "training diverged: the loss is nan at step 41" in message
    assert re_last_finite(message) == 40
    # Stopped at the first check (step 45), before the periodic save at 50 could write NaN weights and
    # push out the checkpoint of step 30.
    assert trainer.progress.step == 45
    assert _steps(job_dir) == [30, 40] and _all_finite(job_dir)
    records = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(record["loss"]) for record in records) and records[-1]["step"] == 40


def re_last_finite(message: str) -> int:
    marker = "at step "
    tail = message.split("last finite loss ", 1)[1]
    return int(tail.split(marker, 1)[1].split(")", 1)[0])


def test_a_stop_after_divergence_writes_no_emergency_checkpoint(diverging):
    trainer, job_dir = diverging
    trainer.stop.signal_name = "SIGTERM"
    with pytest.raises(Diverged, match="the loss is nan at step 41"):
        trainer.train()
    assert _steps(job_dir) == [30, 40] and _all_finite(job_dir)


def test_no_save_of_non_finite_weights_even_between_checks(diverging):
    trainer, job_dir = diverging
    with pytest.raises(Diverged, match="the weights after step 40 are not finite"):
        trainer.save_checkpoint(REASON_EMERGENCY)
    assert _steps(job_dir) == [30, 40]
    assert not [entry for entry in os.listdir(job_dir) if entry.startswith(STAGING_PREFIX)]


def test_the_health_check_reads_the_device_only_on_logged_steps(job_yaml, one_thread, monkeypatch, make_trainer):
    """No per-step host sync: the trainer reads values off the device only where it reports or saves.

    Counts reads made by the trainer's own loop modules (torch reads CPU scalars internally, which on a GPU
    are not device values).
    """
    path = job_yaml(max_steps=1000, ckpt_interval=1000, log_interval=20, max_grad_norm=1.0)
    trainer = make_trainer(path)
    reads = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name):
            if sys._getframe(1).f_code.co_filename in {m.__file__ for m in (health, loop, optim, report)}:
                reads.append(_name)
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)
    try:
        trainer.train(steps=19)
        assert reads == []
        trainer.train(steps=1)
    finally:
        monkeypatch.undo()
        trainer.close()
    assert 0 < len(reads) <= 4, reads


def test_an_absurd_learning_rate_ends_the_trainer_with_exit_1_and_no_traceback(tmp_path, job_yaml, trainer_env):
    path = job_yaml(max_steps=50, ckpt_interval=1, log_interval=10, max_lr=1e30, warmup_ratio=0.0)
    result = run_python("-m", "astrai.train", "--config", str(path), env=trainer_env, timeout=300)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert "error: training diverged:" in result.stderr and "Lower training.max_lr" in result.stderr
    assert _all_finite(tmp_path / "ckpt")


def test_a_full_disk_stops_the_trainer_at_the_failed_save_and_says_so(small_disk, train_yaml, trainer_env, tmp_path):
    job_dir = small_disk / "j"
    path = train_yaml(tmp_path / "train.yaml", max_steps=200, ckpt_interval=20, log_interval=1, ckpt_dir=str(job_dir))
    result = run_python("-m", "astrai.train", "--config", str(path), env=trainer_env, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    message = result.stderr
    assert f"error: the disk is full: checkpoint epoch_0_step_40 does not fit in {job_dir} (" in message, message
    assert " MiB free there, a checkpoint needs about " in message
    # The save at step 40 runs in the background; the trainer stops as soon as it fails, not at the save of 60.
    last = json.loads((job_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert 40 <= last < 50, last
    assert _steps(job_dir) == [20]
    assert not [entry for entry in os.listdir(job_dir) if entry.startswith(STAGING_PREFIX)]


def test_a_metrics_file_that_cannot_be_written_stops_with_a_clear_error(tmp_path, job_yaml, one_thread, make_trainer):
    path = job_yaml(max_steps=20)
    (tmp_path / "ckpt" / "metrics.jsonl").mkdir(parents=True)
    trainer = make_trainer(path)
    try:
        with pytest.raises(ReportError, match=r"cannot append to .*metrics\.jsonl: Is a directory"):
            trainer.train()
    finally:
        trainer.close()
    assert trainer.progress.step == 10


def test_the_divergence_record_names_the_first_bad_step_without_a_model(tmp_path):
    """The record alone: steps 1-3 finite, step 4's gradient norm infinite; nothing is read before the check."""
    from astrai.trainer.launch.distributed import init_distributed
    from astrai.trainer.run.health import DivergenceRecord

    record = DivergenceRecord(capacity=5, env=init_distributed("none", "cpu"), grad_accum=2, job_dir=tmp_path, step=0)
    for step, (loss_sum, norm) in enumerate([(6.0, 1.0), (5.0, 0.9), (4.0, 0.8)]):
        record.record(step, torch.tensor(loss_sum), torch.tensor(norm))
    assert record.check(3, torch.tensor(2.5)) == 2.5
    record.record(3, torch.tensor(3.0), torch.tensor(float("inf")))
    with pytest.raises(Diverged, match=r"the gradient norm is inf at step 4 \(last finite loss 2.0000 at step 3\)"):
        record.check(4)
