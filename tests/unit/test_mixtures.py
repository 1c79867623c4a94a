"""Weighted mixtures of prepared data folders (data.sources): shares, repetition, exact resume, any world size."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import yaml
from hf_folders import make_tokenizer
from test_tasks import _cpu_job, invoke

from astrai.common.checkpoints import latest_complete_checkpoint
from astrai.common.config import ConfigError, load_trainer_config
from astrai.common.fit import SetupError
from astrai.data.pipeline import prepare
from astrai.data.tokenizing import HFTokenizer
from astrai.trainer.feed.windows import MIXTURE_BLOCK, MixtureBatchSampler, MixtureOrder, block_quotas
from tests.support import REPO

CORPUS = sorted((REPO / "examples" / "corpus").glob("*.txt"))
MIXTURE = [{"path": "web", "weight": 3}, {"path": "code", "weight": 1}, {"path": "books", "weight": 1}]


@pytest.fixture(scope="module")
def mixture_root(tmp_path_factory) -> Path:
    """Three prepared sources of different sizes under one data root."""
    root = tmp_path_factory.mktemp("mixture")
    prepare(root / "web", CORPUS)
    prepare(root / "code", CORPUS[:2])
    prepare(root / "books", CORPUS[4:])
    return root


def test_quotas_follow_the_weights_and_every_source_gets_its_share_of_each_block():
    assert block_quotas([3, 1, 1]) == [39322, 13107, 13107] and sum(block_quotas([3, 1, 1])) == MIXTURE_BLOCK
    assert min(block_quotas([1, 1e-4 * 6.5])) >= 1


def test_the_stream_is_a_function_of_the_seed_and_the_position_and_repeats_a_small_source_anew():
    order = MixtureOrder([50, 7], [1, 1], seed=3)
    again = MixtureOrder([50, 7], [1, 1], seed=3)
    stream = [order.sample(k) for k in range(2000)]
    assert [again.sample(k) for k in reversed(range(2000))][::-1] == stream  # any order of asking
    small = [window for source, window in stream if source == 1]
    passes = [small[i : i + 7] for i in range(0, 28, 7)]
    assert all(sorted(p) == list(range(7)) for p in passes) and len({tuple(p) for p in passes}) > 1
    counts = Counter(source for source, _ in stream)
    assert order.drawn(2000) == [counts[0], counts[1]]
    assert abs(counts[0] - counts[1]) < 200
    other = MixtureOrder([50, 7], [1, 1], seed=4)
    assert [other.sample(k) for k in range(50)] != stream[:50]


@pytest.mark.parametrize(("world", "accum"), [(2, 2), (4, 1)])
def test_every_step_takes_the_same_windows_on_any_world_size(world, accum):
    order = MixtureOrder([30, 11, 5], [3, 1, 1], seed=7)
    offsets = [0, 30, 41]

    def steps(world_size, grad_accum, count=6, start=40):
        per_rank = []
        for rank in range(world_size):
            sampler = MixtureBatchSampler(order, offsets, 2, grad_accum, rank, world_size)
            sampler.set_position(0, start)
            batches = iter(sampler)
            per_rank.append([[w for _ in range(grad_accum) for w in next(batches)] for _ in range(count)])
        return [sorted(w for rank in per_rank for w in rank[step]) for step in range(count)]

    assert steps(world, accum) == steps(1, 4)


def _mixture_yaml(train_yaml, root: Path, path: Path, **keys) -> Path:
    return train_yaml(path, data_root_path=str(root), sources=MIXTURE, **keys)


def test_a_mixture_trains_in_its_shares_and_reports_tokens_per_source(
    tmp_path, mixture_root, train_yaml, one_thread, run_trainer, capsys
):
    job = tmp_path / "ckpt"
    path = _mixture_yaml(train_yaml, mixture_root, tmp_path / "train.yaml", max_steps=40, val_fraction=0.1)
    run_trainer(path, ckpt_dir=job, eval_interval=20)
    out = capsys.readouterr().out
    assert "mixture of 3 sources: web: 60.0% of the windows" in out and "epochs over this run" in out
    records = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    assert set(last["tokens_per_source"]) == {"web", "code", "books"}
    assert sum(last["tokens_per_source"].values()) == last["tokens_seen"] == 40 * 4 * 32
    shares = {name: tokens / last["tokens_seen"] for name, tokens in last["tokens_per_source"].items()}
    assert 0.45 < shares["web"] < 0.75 and 0.1 < shares["code"] < 0.32, shares
    assert any("val_loss" in record for record in records)


def test_a_mixture_resumes_bitwise_exactly(tmp_path, mixture_root, train_yaml, one_thread, run_trainer):
    path = _mixture_yaml(train_yaml, mixture_root, tmp_path / "train.yaml", max_steps=50, ckpt_interval=20)
    run_trainer(path, ckpt_dir=tmp_path / "whole")
    run_trainer(path, steps=33, ckpt_dir=tmp_path / "stopped")  # the checkpoint at 20 is where it resumes
    run_trainer(path, ckpt_dir=tmp_path / "stopped")
    whole = latest_complete_checkpoint(tmp_path / "whole")
    resumed = latest_complete_checkpoint(tmp_path / "stopped")
    assert whole.step == resumed.step == 50
    assert (whole.path / "model.safetensors").read_bytes() == (resumed.path / "model.safetensors").read_bytes()


def test_sources_with_different_tokenizers_are_refused_by_trainer_and_preflight(
    tmp_path, mixture_root, train_yaml, tiny_model, make_trainer
):
    root = tmp_path / "root"
    shutil.copytree(mixture_root / "web", root / "web")
    tokenizer = HFTokenizer(make_tokenizer(tmp_path / "tok", [path.read_text() for path in CORPUS], vocab_size=300))
    prepare(root / "other", CORPUS[:1], tokenizer=tokenizer)
    path = train_yaml(
        tmp_path / "train.yaml", data_root_path=str(root), sources=[{"path": "web"}, {"path": "other", "weight": 2}]
    )
    with pytest.raises(
        SetupError, match="data.sources: other was prepared with tokenizer.json sha256 .* web with byte"
    ):
        make_trainer(path, ckpt_dir=tmp_path / "ckpt")
    config = _cpu_job(tmp_path, paths={"data": str(root), "model": str(tiny_model)})
    document = yaml.safe_load(config.read_text())
    document["data"] = {"sources": [{"path": "web"}, {"path": "other"}]}
    config.write_text(yaml.safe_dump(document))
    result = invoke("preflight", "--config", str(config))
    line = next(line for line in result.stdout.splitlines() if line[2:].startswith("data "))
    assert line.startswith("✗") and "prepare every source with the same --tokenizer" in line
    document["data"] = {"sources": [{"path": "web", "weight": 3}]}
    config.write_text(yaml.safe_dump(document))
    result = invoke("preflight", "--config", str(config))
    assert "mixture of 1 sources (web 33,821 tokens)" in result.stdout, result.stdout


@pytest.mark.parametrize(
    ("sources", "message"),
    [
        ("[]", "expected a non-empty list"),
        ("[{path: /abs}]", r"data.sources\[0\].path: expected a folder under data.data_root_path"),
        ("[{path: ../up}]", "expected a folder under data.data_root_path"),
        ("[{path: web, weight: 0}]", r"data.sources\[0\].weight: expected a number > 0"),
        ("[{path: web}, {path: web/}]", "'web' is listed twice"),
        ("[{path: a, weight: 1}, {path: b, weight: 1e9}]", "more than 65536:1 apart"),
        ("[{path: a, wieght: 2}]", r"data.sources\[0\]: expected \{path: FOLDER, weight: NUMBER\}"),
    ],
)
def test_bad_sources_are_refused_naming_the_entry(tmp_path, train_yaml, sources, message):
    path = train_yaml(tmp_path / "train.yaml")
    with pytest.raises(ConfigError, match=message):
        load_trainer_config(path, [("sources", sources)])


def test_status_shows_the_tokens_of_each_source(tmp_path):
    config = _cpu_job(tmp_path)
    job = tmp_path / "checkpoints" / "j"
    job.mkdir(parents=True)
    record = {"step": 5, "max_steps": 10, "loss": 2.0, "time": 1.0, "tokens_per_source": {"web": 300, "code": 100}}
    (job / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    status = invoke("status", "--config", str(config)).stdout
    assert "sources     web 300 tokens (75%), code 100 tokens (25%)" in status, status
