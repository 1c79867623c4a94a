"""Metrics across crashes: a run SIGKILLed twice and stopped once logs every step exactly once, as TensorBoard reads
it, and its validation losses equal those of a run that was never interrupted."""

from __future__ import annotations

import pytest
from test_metrics import event_scalars
from trainer_runs import TRAINER, Run, run_to_end, stop_gracefully, wait_for

from astrai.common.checkpoints import latest_complete_checkpoint
from astrai.common.contract import METRICS_FILE, TAG_TRAIN_LOSS, TAG_VAL_LOSS, TENSORBOARD_DIR
from astrai.common.metrics import read_records

pytestmark = pytest.mark.slow

RUN = {"max_steps": 120, "ckpt_interval": 30, "log_interval": 10, "val_fraction": 0.1, "eval_interval": 20}


def _logged_step(job) -> int:
    records = read_records(job / METRICS_FILE)
    return records[-1]["step"] if records else 0


def test_killed_twice_and_stopped_logs_each_step_once_with_the_uninterrupted_values(tmp_path, train_yaml, trainer_env):
    reference_job, job = tmp_path / "reference", tmp_path / "job"
    reference = train_yaml(tmp_path / "ref.yaml", ckpt_dir=str(reference_job), **RUN)
    run_to_end([*TRAINER, "--config", str(reference)], trainer_env, tmp_path / "reference.log")

    command = [*TRAINER, "--config", str(train_yaml(tmp_path / "train.yaml", ckpt_dir=str(job), **RUN))]
    # Killed after steps past a checkpoint were logged (they are trained and logged again), twice; then a
    # graceful stop, whose emergency checkpoint must find its events flushed; then the run to its end.
    for kill_after in (50, 80):
        run = Run(command, trainer_env, tmp_path / "run.log")
        try:
            wait_for(lambda after=kill_after: _logged_step(job) >= after, run)
        finally:
            run.kill()
        assert latest_complete_checkpoint(job).step < _logged_step(job)
    stop_gracefully(Run(command, trainer_env, tmp_path / "run.log"), lambda: _logged_step(job) >= 100)
    run = run_to_end(command, trainer_env, tmp_path / "run.log")

    events = job / TENSORBOARD_DIR
    losses = event_scalars(events, TAG_TRAIN_LOSS)
    steps = [step for step, _ in losses]
    stopped_at = [r["step"] for r in read_records(job / METRICS_FILE) if r["step"] % 10]
    assert steps == sorted(set(range(10, 121, 10)) | set(stopped_at)), run.output()
    # The crashes really did log some steps twice: the reader's purge is what makes them appear once.
    assert len(event_scalars(events, TAG_TRAIN_LOSS, purge=False)) > len(losses)

    # Exact resume: the same losses as the uninterrupted run, except at the first report after the stop, which
    # averages fewer steps (those since the stop's own report).
    after_stop = {-(-step // 10) * 10 for step in stopped_at}
    expected = {
        step: value
        for step, value in event_scalars(reference_job / TENSORBOARD_DIR, TAG_TRAIN_LOSS)
        if step not in after_stop
    }
    assert {step: value for step, value in losses if step % 10 == 0 and step not in after_stop} == expected
    val = event_scalars(events, TAG_VAL_LOSS)
    assert [step for step, _ in val] == [20, 40, 60, 80, 100, 120]
    assert val == event_scalars(reference_job / TENSORBOARD_DIR, TAG_VAL_LOSS)
    records = {r["step"]: r for r in read_records(job / METRICS_FILE)}
    reference_records = {r["step"]: r for r in read_records(reference_job / METRICS_FILE)}
    for step in (20, 40, 60, 80, 100, 120):
        assert records[step]["val_loss"] == reference_records[step]["val_loss"]
