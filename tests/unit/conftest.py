"""Shared fixtures for the trainer tests: a tiny base model, the example corpus as token data, train.yaml files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from tests.support import REPO

CORPUS_FILES = sorted((REPO / "examples" / "corpus").glob("*.txt"))

# Small enough to train a few hundred steps in seconds on one CPU thread.
SMALL_RUN = {
    "window_size": 32,
    "batch_per_device": 4,
    "num_workers": 0,
    "max_steps": 200,
    "max_lr": 3e-3,
    "warmup_ratio": 0.05,
    "device": "cpu",
    "ckpt_interval": 20,
    "log_interval": 10,
}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny base model folder (config.json + model.safetensors), seed 0."""
    from astrai.trainer.models.weights import PRESETS, write_base_model

    folder = tmp_path_factory.mktemp("base_model")
    write_base_model(folder, PRESETS["tiny"], seed=0)
    return folder


@pytest.fixture(scope="session")
def corpus_data(tmp_path_factory) -> Path:
    """examples/corpus prepared as token data."""
    from astrai.data.pipeline import prepare

    folder = tmp_path_factory.mktemp("corpus_data")
    prepare(folder, CORPUS_FILES)
    return folder


@pytest.fixture(scope="session")
def train_yaml(tiny_model, corpus_data):
    """Write a train.yaml (with a runtime block the trainer must ignore) from flat keys; returns its path."""
    from astrai.common.config import KEY_SECTION

    def write(path: Path, **keys) -> Path:
        values = {"data_root_path": str(corpus_data), "param_path": str(tiny_model), **SMALL_RUN, **keys}
        document: dict = {"runtime": {"job_name": "test", "gpu": {"devices": "none"}}}
        for key, value in values.items():
            document.setdefault(KEY_SECTION[key], {})[key] = value
        path.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
        return path

    return write


@pytest.fixture
def job_yaml(tmp_path, train_yaml):
    """job_yaml(**flat_keys): train_yaml's file as this test's train.yaml, for the job dir tmp_path / "ckpt"."""

    def write(**keys) -> Path:
        return train_yaml(tmp_path / "train.yaml", ckpt_dir=str(tmp_path / "ckpt"), **keys)

    return write


@pytest.fixture
def one_thread():
    """One torch thread: deterministic float results across in-process runs, and kind to a shared CPU."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def trainer_env(tmp_path) -> dict[str, str]:
    """Environment for trainer subprocesses: importable repo, one thread each, unbuffered output.

    TMPDIR points into the test's folder, so torchrun's log folders go away with it.
    """
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", TMPDIR=str(tmp_path))
    return env


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB filesystem (tmpfs): room for one checkpoint of the tiny model, not two. Needs root."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    folder = tmp_path / "small-disk"
    folder.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(folder)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


@pytest.fixture(scope="session")
def make_trainer():
    """make_trainer(train_yaml, **flat_overrides): a Trainer resuming its job dir, as `python -m astrai.train` builds
    it (None when the run is already at max_steps)."""
    from astrai.common.config import load_trainer_config
    from astrai.trainer.launch.distributed import init_distributed
    from astrai.trainer.run.loop import open_trainer

    def make(config_path, **overrides):
        config = load_trainer_config(config_path, [(key, str(value)) for key, value in overrides.items()])
        return open_trainer(config, init_distributed("none", "cpu"))

    return make


@pytest.fixture(scope="session")
def run_trainer(make_trainer):
    """run_trainer(train_yaml, steps=None, **flat_overrides): build a Trainer, train it, close it; its TrainStats."""

    def run(config_path, steps=None, **overrides):
        trainer = make_trainer(config_path, **overrides)
        try:
            return trainer.train(steps)
        finally:
            trainer.close()

    return run


@pytest.fixture(scope="session")
def chat_world(tmp_path_factory):
    """The post-training tests' world (tests/unit/chat_data.py), with its SFT and DPO records prepared.

    Returns (world, sft data folder, dpo data folder).
    """
    from chat_data import make_chat_world

    from astrai.data.pipeline import prepare
    from astrai.data.tokenizing import HFTokenizer

    root = tmp_path_factory.mktemp("chat_world")
    world = make_chat_world(root)
    sft, dpo = root / "sft-data", root / "dpo-data"
    tokenizer = HFTokenizer(world.tokenizer)
    prepare(sft, [world.sft_file], tokenizer=tokenizer, kind="sft")
    prepare(dpo, [world.dpo_file], tokenizer=tokenizer, kind="dpo")
    return world, sft, dpo


@pytest.fixture(scope="session")
def post_yaml(train_yaml, chat_world):
    """post_yaml(path, kind, **flat_keys): a train.yaml training ``kind`` (sft, dpo) on the chat world."""
    world, sft, dpo = chat_world

    def write(path: Path, kind: str, **keys) -> Path:
        values = {
            "train_type": kind,
            "data_root_path": str(sft if kind == "sft" else dpo),
            "param_path": str(world.model),
            "window_size": 96 if kind == "sft" else 48,
            "val_fraction": 0.0,
            "max_steps": 30,
            "ckpt_interval": 10,
            **keys,
        }
        return train_yaml(path, **values)

    return write
