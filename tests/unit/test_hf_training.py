"""A run from a Hugging Face folder and tokenizer, as the container runs it: trains, stops, resumes exactly,
and every checkpoint is a model folder transformers loads. Also: bad base models are refused by the trainer
and by preflight with the key or file named, exit non-zero, no traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import CORPUS_FILES, REPO, SMALL_RUN
from hf_folders import FAMILY_CASES, ROPE_LLAMA3, make_hf_model, make_tokenizer

from astrai.common.checkpoints import latest_complete_checkpoint, list_complete_checkpoints
from astrai.common.config import KEY_SECTION
from astrai.data import pipeline as data_module
from astrai.host import preflight
from astrai.host.runtime import resolve_runtime
from astrai.trainer.models.weights import load_pretrained

TRAINER = [sys.executable, "-m", "astrai.train"]
VOCAB = 512


@pytest.fixture(scope="module")
def hf_data(tmp_path_factory):
    """The example corpus tokenized with a BPE tokenizer trained on it (the tokenizer folder, the data folder)."""
    root = tmp_path_factory.mktemp("hf_data")
    texts = [path.read_text() for path in CORPUS_FILES]
    tokenizer = make_tokenizer(root / "tokenizer", texts, vocab_size=VOCAB, eos_in_config="<|endoftext|>")
    assert (
        data_module.main(
            ["prepare", "--tokenizer", str(tokenizer), "--out", str(root / "data"), *map(str, CORPUS_FILES)]
        )
        == 0
    )
    return tokenizer, root / "data"


def _base_model(folder: Path, sharded: bool) -> Path:
    return make_hf_model(
        folder,
        vocab_size=VOCAB,
        hidden_size=64,
        layers=2,
        heads=4,
        kv_heads=2,
        rope=ROPE_LLAMA3,
        dtype=torch.bfloat16,
        tie=not sharded,
        shard_size="100KB" if sharded else None,
    )


def _write_yaml(path: Path, **keys) -> Path:
    document: dict = {"runtime": {"job_name": "hf", "gpu": {"devices": "none"}}}
    for key, value in {**SMALL_RUN, "max_steps": 150, "ckpt_interval": 50, "log_interval": 5, **keys}.items():
        document.setdefault(KEY_SECTION[key], {})[key] = value
    path.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    return path


def _env(tmp_path: Path) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", TMPDIR=str(tmp_path))


def _run(config: Path, tmp_path: Path, stop_at_step: int | None = None) -> str:
    log = tmp_path / f"run-{time.monotonic_ns()}.log"
    with open(log, "wb") as handle:
        proc = subprocess.Popen(
            [*TRAINER, "--config", str(config)],
            stdout=handle,
            stderr=subprocess.STDOUT,
            env=_env(tmp_path),
            start_new_session=True,
        )
    try:
        if stop_at_step is not None:
            metrics = Path(yaml.safe_load(config.read_text())["ckpt"]["ckpt_dir"]) / "metrics.jsonl"
            deadline = time.monotonic() + 120
            while not (metrics.exists() and f'"step": {stop_at_step},' in metrics.read_text()):
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.01)
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=240) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return log.read_text()


@pytest.mark.slow
@pytest.mark.parametrize("sharded", [False, True], ids=["single-file", "sharded"])
def test_a_run_from_a_hf_folder_stops_resumes_exactly_and_its_checkpoints_load_in_transformers(
    tmp_path, hf_data, sharded
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer_dir, data_dir = hf_data
    base = _base_model(tmp_path / "base", sharded)
    assert (base / "model.safetensors.index.json").exists() == sharded
    common = dict(data_root_path=str(data_dir), param_path=str(base))

    reference = _write_yaml(tmp_path / "ref.yaml", ckpt_dir=str(tmp_path / "ref"), **common)
    out = _run(reference, tmp_path)
    assert "llama (2 layers, dim 64, vocab 512, GQA 4/2, rope llama3" in out and "bfloat16" in out

    config = _write_yaml(tmp_path / "train.yaml", ckpt_dir=str(tmp_path / "ckpt"), **common)
    _run(config, tmp_path, stop_at_step=20)
    stopped = latest_complete_checkpoint(tmp_path / "ckpt")
    assert stopped.meta.reason == "emergency" and 20 <= stopped.step < 150
    out = _run(config, tmp_path)
    assert f"resumed from {stopped.path}" in out
    final = latest_complete_checkpoint(tmp_path / "ckpt")
    assert final.step == 150
    assert (final.path / "model.safetensors").read_bytes() == (
        latest_complete_checkpoint(tmp_path / "ref").path / "model.safetensors"
    ).read_bytes()

    tokenizer_json = (tokenizer_dir / "tokenizer.json").read_bytes()
    for checkpoint in list_complete_checkpoints(tmp_path / "ckpt"):
        # A complete model folder: weights, config and the data's tokenizer.
        assert (checkpoint.path / "tokenizer.json").read_bytes() == tokenizer_json
        assert json.loads((checkpoint.path / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    hf, info = AutoModelForCausalLM.from_pretrained(final.path, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and info["mismatched_keys"] == set()
    tokenizer = AutoTokenizer.from_pretrained(final.path)
    tokens = torch.tensor([tokenizer("A checkpoint is a model folder.", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        ours = load_pretrained(final.path)(tokens)
        assert (hf.eval()(tokens).logits - ours).abs().max().item() <= 1e-4
        # Training changed the model.
        assert (load_pretrained(base)(tokens) - ours).abs().max().item() > 1e-2


def test_the_trainer_refuses_bad_base_models_naming_the_key_or_file(tmp_path, hf_data, capsys):
    from astrai.trainer.run.loop import main

    _, data_dir = hf_data
    base = _base_model(tmp_path / "base", sharded=True)
    config = _write_yaml(
        tmp_path / "train.yaml", ckpt_dir=str(tmp_path / "ckpt"), data_root_path=str(data_dir), param_path=str(base)
    )
    index = json.loads((base / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    cases = [
        # Another family's model_type trains through transformers (model.backend auto), whose model must fit the
        # weights: a Llama's weights are not a GPT-NeoX's.
        (lambda: _edit(base / "config.json", model_type="gpt_neox"), "do not fit its config.json's model_type"),
        (lambda: _edit(base / "config.json", model_type="llama"), None),
        (lambda: (base / shard).rename(tmp_path / "aside"), f"which is missing from {base}"),
        (lambda: (tmp_path / "aside").rename(base / shard), None),
        (lambda: (base / shard).write_bytes((base / shard).read_bytes()[:-10]), f"{shard}: truncated"),
    ]
    for change, message in cases:
        change()
        if message is None:
            continue
        assert main(["--config", str(config)]) == 1
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
    assert not list((tmp_path / "ckpt").glob("epoch_*"))


def test_a_sliding_window_shorter_than_the_training_window_trains_and_leaves_prompts_whole(tmp_path, hf_data, capsys):
    """The window limits attention, not length: windows of 32 train on a Mistral whose sliding_window is 16, and an
    online run's prompts keep the room the context (max_position_embeddings) leaves them, not the window's."""
    from astrai.common.fit import prompt_room
    from astrai.common.model_config import ModelConfig
    from astrai.trainer.run.loop import main

    _, data_dir = hf_data
    base = make_hf_model(tmp_path / "base", model_type="mistral", vocab_size=VOCAB, sliding_window=16)
    config = _write_yaml(
        tmp_path / "train.yaml",
        ckpt_dir=str(tmp_path / "ckpt"),
        data_root_path=str(data_dir),
        param_path=str(base),
        max_steps=2,
        ckpt_interval=2,
    )
    assert main(["--config", str(config), "--dry-run"]) == 0
    assert "start checks: passed" in capsys.readouterr().out
    assert main(["--config", str(config)]) == 0
    assert latest_complete_checkpoint(tmp_path / "ckpt").step == 2
    assert prompt_room(ModelConfig.load(base), 8, base) == (256, 248)


def _edit(path: Path, **changes) -> None:
    values = json.loads(path.read_text())
    values.update(changes)
    path.write_text(json.dumps(values))


def _preflight_line(tmp_path: Path, model: Path) -> preflight.Check:
    document = {
        "runtime": {
            "job_name": "pf",
            "gpu": {"devices": "none"},
            "paths": {"data": str(tmp_path / "data"), "model": str(model), "checkpoints": str(tmp_path / "ckpts")},
        }
    }
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(document))
    return preflight._model_check(resolve_runtime(path), None)[1]


def test_preflight_says_what_base_model_it_found_and_refuses_bad_ones(tmp_path):
    base = make_hf_model(tmp_path / "base", heads=8, kv_heads=2, dtype=torch.bfloat16, shard_size="60KB")
    check = _preflight_line(tmp_path, base)
    assert check.mark == preflight.PASS
    # 2 * 300 * 64 (embedding, output) + 2 * (2 * 64 * 64 + 2 * 16 * 64 + 3 * 64 * 160 + 2 * 64) + 64 (final norm)
    shards = sorted(set(json.loads((base / "model.safetensors.index.json").read_text())["weight_map"].values()))
    assert (
        f"llama (2 layers, dim 64, vocab 300, GQA 8/2), 120.64K parameters, bfloat16, {len(shards)} shards"
        in check.detail
    )

    _edit(base / "config.json", rope_parameters={"rope_type": "proportional", "factor": 4.0, "rope_theta": 1e4})
    check = _preflight_line(tmp_path, base)
    assert check.mark == preflight.FAIL and "rope_parameters.rope_type 'proportional' is not supported" in check.detail

    gemma = make_hf_model(tmp_path / "gemma", **FAMILY_CASES["gemma2"])
    check = _preflight_line(tmp_path, gemma)
    assert check.mark == preflight.PASS and check.detail.startswith(
        f"{gemma}: gemma2 (3 layers, dim 64, vocab 300, GQA 4/2, sliding window 8 on 1 of every 2 layers, "
        "soft-capping attention 4, logits 6, rope yarn, tied)"
    ), check.detail

    _edit(base / "config.json", rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    (base / shards[1]).unlink()
    check = _preflight_line(tmp_path, base)
    assert check.mark == preflight.FAIL and f"{shards[1]}, which is missing" in check.detail
