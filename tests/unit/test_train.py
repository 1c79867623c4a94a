"""The trainer in-process: learning, exact resume, fallback past broken checkpoints, metrics, clear setup errors."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from astrai.common.checkpoints import latest_complete_checkpoint, list_complete_checkpoints
from astrai.common.data_folder import DataError
from astrai.common.fit import SetupError
from astrai.common.model_folder import hf_name
from astrai.data.pipeline import prepare
from astrai.trainer.models.weights import PRESETS, write_base_model
from astrai.trainer.run.loop import main


def _final_weights(ckpt_dir) -> bytes:
    return (latest_complete_checkpoint(ckpt_dir).path / "model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, train_yaml, run_trainer):
    """An uninterrupted 60-step run; returns (yaml path, ckpt dir)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("reference")
    path = train_yaml(root / "train.yaml", max_steps=60, ckpt_dir=str(root / "ckpt"))
    try:
        run_trainer(path)
    finally:
        torch.set_num_threads(before)
    return path, root / "ckpt"


@pytest.mark.slow
def test_loss_falls_clearly_within_200_steps_on_the_corpus(tmp_path, job_yaml, one_thread, run_trainer):
    path = job_yaml(max_steps=200, ckpt_interval=1000)
    run_trainer(path)
    records = [json.loads(line) for line in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    first, last = records[0]["loss"], records[-1]["loss"]
    # An untrained model is near ln(vocab) = 5.8; byte-level English drops well below 3 once letters and spaces
    # are learned.
    assert first > 4.0 and math.log(PRESETS["tiny"].vocab_size) - first < 1.5
    assert last < 3.0 and last < first - 1.5, [r["loss"] for r in records]


@pytest.mark.slow
def test_progress_lines_metrics_and_final_checkpoint(reference, capsys):
    path, ckpt_dir = reference
    records = [json.loads(line) for line in (ckpt_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [10, 20, 30, 40, 50, 60]
    assert {"step", "max_steps", "epoch", "loss", "lr", "tokens_per_s", "eta_s", "time"} <= set(records[0])
    assert records[-1]["max_steps"] == 60 and records[-1]["eta_s"] == 0
    final = latest_complete_checkpoint(ckpt_dir)
    assert final.step == 60
    assert json.loads((final.path / "meta.json").read_text())["reason"] == "final"


@pytest.mark.slow
def test_a_finished_run_says_so_and_trains_nothing(reference, capsys, one_thread, make_trainer):
    path, ckpt_dir = reference
    assert make_trainer(path) is None
    assert "already at max_steps (60)" in capsys.readouterr().out


@pytest.mark.slow
def test_resume_is_bitwise_exact(reference, tmp_path, capsys, one_thread, run_trainer):
    path, ref_dir = reference
    ckpt_dir = tmp_path / "ckpt"
    assert run_trainer(path, steps=30, ckpt_dir=ckpt_dir).steps == 30
    assert [c.step for c in list_complete_checkpoints(ckpt_dir)] == [20]
    run_trainer(path, ckpt_dir=ckpt_dir)
    out = capsys.readouterr().out
    assert "starting from base model" in out and f"resumed from {ckpt_dir / 'epoch_0_step_20'}" in out
    assert "step 60/60" in out and f"final checkpoint {ckpt_dir}" in out
    assert _final_weights(ckpt_dir) == _final_weights(ref_dir)


@pytest.mark.slow
def test_truncated_newest_and_partial_folders_fall_back_and_still_end_bitwise_equal(
    reference, tmp_path, capsys, one_thread, run_trainer
):
    path, ref_dir = reference
    ckpt_dir = tmp_path / "ckpt"
    run_trainer(path, steps=45, ckpt_dir=ckpt_dir)
    newest = latest_complete_checkpoint(ckpt_dir).path
    assert newest.name == "epoch_0_step_40"
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
    partial = ckpt_dir / "epoch_7_step_900"
    partial.mkdir()
    (partial / "meta.json").write_text('{"epoch": 7, "step": 900}')
    capsys.readouterr()
    run_trainer(path, ckpt_dir=ckpt_dir)
    out = capsys.readouterr().out
    assert f"skipping {partial}: not a checkpoint (incomplete" in out
    assert f"skipping {newest}: not a checkpoint (model.safetensors: truncated" in out
    assert f"resumed from {ckpt_dir / 'epoch_0_step_20'}" in out
    assert (ckpt_dir / "epoch_0_step_60" / "model.safetensors").read_bytes() == _final_weights(ref_dir)


@pytest.mark.slow
def test_accumulation_checkpointing_and_retention(tmp_path, job_yaml, one_thread, run_trainer):
    path = job_yaml(max_steps=30, ckpt_interval=10, keep_last=2, grad_accum_steps=2, activation_checkpointing=True)
    stats = run_trainer(path)
    assert stats.steps == 30 and stats.tokens == 30 * 2 * 4 * 32 and stats.tokens_per_s > 0
    assert [c.step for c in list_complete_checkpoints(tmp_path / "ckpt")] == [20, 30]
    meta = json.loads((tmp_path / "ckpt" / "epoch_0_step_30" / "meta.json").read_text())
    assert meta["tokens_seen"] == stats.tokens and meta["data_position"]["samples_in_epoch"] == 30 * 8


def test_data_vocabulary_larger_than_the_model_is_refused(tmp_path, job_yaml, capsys):
    small = dataclasses.replace(PRESETS["tiny"], vocab_size=200)
    write_base_model(tmp_path / "model", small)
    path = job_yaml(param_path=str(tmp_path / "model"))
    assert main(["--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert "data vocabulary 257" in err and "vocab_size 200" in err


def test_missing_or_too_small_data_gives_a_clear_error(tmp_path, job_yaml, one_thread, make_trainer):
    path = job_yaml(data_root_path=str(tmp_path / "nothing"))
    with pytest.raises(DataError, match="does not exist"):
        make_trainer(path)
    (tmp_path / "t.txt").write_text("far too little text " * 5)
    prepare(tmp_path / "little", [tmp_path / "t.txt"])
    with pytest.raises(
        SetupError,
        match=r"fewer than one global batch of batch_per_device\(4\) \* grad_accum_steps\(1\) \* world_size\(1\) = 4",
    ):
        make_trainer(path, data_root_path=tmp_path / "little")


def test_checkpoint_holds_the_weights_of_its_step(job_yaml, one_thread, make_trainer):
    path = job_yaml(max_steps=5)
    trainer = make_trainer(path)
    try:
        trainer.train(steps=3)
        saved = trainer.save_checkpoint("emergency")
        live = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        config = trainer.model_config
    finally:
        trainer.close()
    assert saved.name == "epoch_0_step_3"
    weights = load_file(saved / "model.safetensors")
    assert all(torch.equal(weights[hf_name(k, config)], live[k]) for k in live)
