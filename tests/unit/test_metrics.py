"""The numbers a user watches: FLOPs and MFU, tokens/s without pauses, the sparkline, event files vs metrics.jsonl."""

from __future__ import annotations

import itertools
import json
import math
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from astrai.common import metrics
from astrai.common.contract import METRICS_FILE, TAG_TRAIN_LOSS, TAG_VAL_LOSS, TENSORBOARD_DIR
from astrai.common.model_folder import ModelConfig
from astrai.host import status
from astrai.trainer.models.native import Transformer
from astrai.trainer.run import report


def event_scalars(folder, tag: str, purge: bool = True) -> list[tuple[int, float]]:
    """(step, value) of ``tag`` as TensorBoard itself reads the folder."""
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0}, purge_orphaned_data=purge)
    accumulator.Reload()
    if tag not in accumulator.Tags()["scalars"]:
        return []
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def test_flops_per_token_matches_a_hand_count():
    config = ModelConfig(
        vocab_size=10, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden_dim=16, max_seq_len=4, tie_embeddings=True
    )
    # Per layer: wq 8x8 = 64, wk and wv 8x4 = 32 each, wo 8x8 = 64, SwiGLU 3 x 8x16 = 384 -> 576;
    # two layers 1152, plus the (tied) output head 10x8 = 80 -> N = 1232, and 6N = 7392.
    # Attention: 12 * layers(2) * heads(2) * head_dim(4) * seq(4) = 768.
    assert report.matmul_params(config) == 1232
    assert report.flops_per_token(config, seq_len=4) == 7392 + 768


@pytest.mark.parametrize("tied", [True, False])
def test_matmul_params_are_the_real_models_matrices(tied):
    config = ModelConfig(
        vocab_size=64,
        dim=32,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden_dim=48,
        max_seq_len=16,
        tie_embeddings=tied,
    )
    matrices = sum(p.numel() for p in Transformer(config).parameters() if p.dim() >= 2)
    lookup_only = 0 if tied else config.vocab_size * config.dim  # an untied input embedding is a lookup
    assert report.matmul_params(config) == matrices - lookup_only


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA H200 NVL", 835.0),
        ("NVIDIA GH200 480GB", 989.0),
        ("NVIDIA H20", 148.0),
        ("NVIDIA B200", 2250.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA A10", 125.0),
        ("NVIDIA GeForce RTX 4090", 165.0),
        ("NVIDIA A10G", None),
        ("Tesla T4", None),
        (None, None),
    ],
)
def test_peak_table_matches_whole_model_names_only(name, peak):
    assert report.peak_tflops(name) == peak


def test_mfu_is_n_a_without_a_peak_and_the_override_wins():
    assert report.mfu(1000.0, 6 * 10**9, None) is None
    assert report.peak_tflops("NVIDIA A100-SXM4-80GB", override=100.0) == 100.0
    # 10k tokens/s at 6 GFLOPs per token is 60 TFLOP/s: 0.3 of a 200 TFLOP/s device.
    assert report.mfu(10_000.0, 6 * 10**9, 200.0) == pytest.approx(0.3)


def test_step_clock_leaves_pauses_and_excluded_steps_out():
    clock = report.StepClock(now=100.0)
    clock.pause(4.0, steps=1)  # a slow first step
    clock.pause(2.0)  # a checkpoint
    assert clock.lap(now=110.0, steps=10) == (4.0, 9)
    assert clock.lap(now=112.0, steps=10) == (2.0, 10)
    # Moving average over both intervals, weighted by steps: 6 s over 19 steps.
    assert clock.seconds_per_step() == pytest.approx(6.0 / 19)
    assert report.eta_seconds(19, clock.seconds_per_step(), evals_left=2, seconds_per_eval=1.5) == pytest.approx(9.0)


def test_sparkline_draws_the_curve_in_blocks():
    assert status.sparkline([4.0, 3.0, 2.0, 1.0, 0.0]) == "█▆▅▃▁"
    assert status.sparkline([1.0, 1.0]) == "▅▅"
    assert status.sparkline([]) == ""
    line = status.sparkline([float(i) for i in range(100)], width=10)
    assert len(line) == 10 and line[0] == "▁" and line[-1] == "█" and list(line) == sorted(line)


def test_read_records_takes_the_last_record_of_a_step_and_drops_work_lost_in_a_crash(tmp_path):
    path = tmp_path / METRICS_FILE
    lines = [
        {"step": 10, "loss": 5.0},
        {"step": 20, "loss": 4.0},
        {"step": 30, "loss": 3.5},
        "not json",
        # a crash after step 30, resumed from a checkpoint at step 10: 20 is logged again, 30 is gone
        {"step": 20, "loss": 3.9},
    ]
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    assert [(r["step"], r["loss"]) for r in metrics.read_records(path)] == [(10, 5.0), (20, 3.9)]
    assert metrics.read_records(tmp_path / "missing.jsonl") == []


def test_event_files_and_sparkline_agree_with_metrics_jsonl(tmp_path, train_yaml, one_thread, capsys, make_trainer):
    job = tmp_path / "ckpt"
    path = train_yaml(tmp_path / "train.yaml", ckpt_dir=str(job), max_steps=40, val_fraction=0.1, eval_interval=20)
    trainer = make_trainer(path)
    try:
        trainer.train()
    finally:
        trainer.close()
    records = metrics.read_records(job / METRICS_FILE)
    assert [r["step"] for r in records] == [10, 20, 30, 40]
    losses = event_scalars(job / TENSORBOARD_DIR, TAG_TRAIN_LOSS)
    assert [step for step, _ in losses] == [10, 20, 30, 40]
    assert [value for _, value in losses] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    val = event_scalars(job / TENSORBOARD_DIR, TAG_VAL_LOSS)
    assert [step for step, _ in val] == [20, 40]
    assert [value for _, value in val] == pytest.approx([r["val_loss"] for r in records if "val_loss" in r], rel=1e-6)
    assert status.sparkline([r["loss"] for r in records]) == status.sparkline([value for _, value in losses])
    output = capsys.readouterr().out
    assert "| mfu n/a |" in output and "val_loss" in output


def test_validation_windows_are_never_trained_on(corpus_data):
    from astrai.common.data_folder import TokenData, WindowSplit

    windows = TokenData.open(corpus_data).num_windows(32)
    split = WindowSplit.from_fraction(windows, 0.1)
    trained = {split.train_window(i) for i in range(split.num_train)}
    held_out = {split.val_window(i) for i in range(split.num_val)}
    assert len(trained) == split.num_train and trained.isdisjoint(held_out)
    assert trained | held_out == set(range(windows))
    assert abs(split.num_val / windows - 0.1) < 0.01
    chosen = split.eval_windows(50)
    assert len(chosen) == 50 and set(chosen) <= held_out and chosen == sorted(chosen)
    assert chosen[-1] > windows * 0.9  # spread over the whole corpus, not its start


def test_tokens_per_s_leaves_checkpoint_pauses_out(tmp_path, train_yaml, one_thread, monkeypatch, make_trainer):
    import time

    path = train_yaml(
        tmp_path / "train.yaml", ckpt_dir=str(tmp_path / "ckpt"), max_steps=30, ckpt_interval=1, log_interval=10
    )
    trainer = make_trainer(path)
    save = trainer.checkpointer.save

    def slow_save(*args, **kwargs):
        time.sleep(0.5)
        return save(*args, **kwargs)

    monkeypatch.setattr(trainer.checkpointer, "save", slow_save)
    try:
        trainer.train()
    finally:
        trainer.close()
    records = metrics.read_records(tmp_path / "ckpt" / METRICS_FILE)
    assert [r["step"] for r in records] == [10, 20, 30]
    for before, after in itertools.pairwise(records):
        # Each interval holds ten 0.5 s pauses; the wall-clock rate counts them, the reported one must not.
        wall_clock_rate = 10 * 4 * 32 / (after["time"] - before["time"])
        assert after["tokens_per_s"] > 2 * wall_clock_rate, records


def test_without_tensorboard_training_goes_on_and_says_so_once(
    tmp_path, train_yaml, one_thread, monkeypatch, capsys, make_trainer
):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    path = train_yaml(tmp_path / "train.yaml", ckpt_dir=str(tmp_path / "ckpt"), max_steps=20)
    trainer = make_trainer(path)
    try:
        trainer.train()
    finally:
        trainer.close()
    output = capsys.readouterr().out
    assert output.count("TensorBoard event files are off") == 1
    assert not (tmp_path / "ckpt" / TENSORBOARD_DIR).exists()
    assert [r["step"] for r in metrics.read_records(tmp_path / "ckpt" / METRICS_FILE)] == [10, 20]
    assert math.isfinite(metrics.read_records(tmp_path / "ckpt" / METRICS_FILE)[-1]["loss"])


def test_tensorboard_is_pinned_alike_in_the_base_image_the_dockerfile_and_the_extras():
    import configparser
    import re
    from pathlib import Path

    from astrai.host.baseimage import DEFAULT_TAG, TENSORBOARD_REQUIREMENT

    repo = Path(__file__).resolve().parents[2]
    version = TENSORBOARD_REQUIREMENT.split("==")[1]
    dockerfile = (repo / "Dockerfile").read_text(encoding="utf-8")
    assert re.findall(r"^ARG TENSORBOARD_VERSION=(\S+)$", dockerfile, re.MULTILINE) == [version]
    setup = configparser.ConfigParser()
    setup.read(repo / "setup.cfg")
    for extra in ("train", "dev"):
        assert TENSORBOARD_REQUIREMENT in setup["options.extras_require"][extra].split()
    assert f"tb{version}" in DEFAULT_TAG  # a cached image from before a version change is not reused
