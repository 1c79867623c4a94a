"""`invoke export`: a checkpoint as a Hugging Face model folder, converted bit for bit as torch converts, streamed."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import tracemalloc
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from astrai.common.checkpoints import CheckpointMeta
from astrai.common.contract import (
    META_FILE,
    OPTIMIZER_FILE,
    OPTIMIZER_TENSORS_FILE,
    RNG_FILE,
    SCHEDULER_FILE,
    TOKENIZER_FILES,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
)
from astrai.common.values import format_bytes
from astrai.host import export as ex
from tests.support import invoke

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FOLDER_FILES = {
    "tokenizer.json": '{"version": "1.0", "model": {"type": "BPE"}}',
    "tokenizer_config.json": '{"eos_token": "<|endoftext|>"}',
    "special_tokens_map.json": '{"eos_token": "<|endoftext|>"}',
    "chat_template.jinja": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "generation_config.json": '{"do_sample": false, "max_new_tokens": 8}',
}
INTERNALS = (META_FILE, OPTIMIZER_FILE, OPTIMIZER_TENSORS_FILE, SCHEDULER_FILE, RNG_FILE, "extra_state.pt")
ODD = 'it\'s a $b "q" é'
"""A piece of a path with a space, a dollar, quotes and non-ASCII letters."""


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    """The tiny model with a tokenizer's files and a generation config."""
    from astrai.trainer.models.weights import PRESETS, write_base_model

    folder = tmp_path_factory.mktemp("model")
    write_base_model(folder, PRESETS["tiny"], seed=0)
    for name, text in FOLDER_FILES.items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder


def make_checkpoint(model: Path, job_dir: Path, epoch: int = 0, step: int = 20) -> Path:
    """A complete checkpoint holding ``model``, with training state of every kind the export must leave out."""
    folder = job_dir / f"epoch_{epoch}_step_{step}"
    shutil.copytree(model, folder)
    meta = CheckpointMeta(epoch=epoch, step=step, reason="periodic", world_size=1, format="sharded")
    (folder / META_FILE).write_text(meta.to_json(), encoding="utf-8")
    torch.save({"state": {}, "param_groups": []}, folder / OPTIMIZER_FILE)
    torch.save({"last_epoch": step}, folder / SCHEDULER_FILE)
    torch.save({"anything": 1}, folder / "extra_state.pt")
    save_file({"rank0.cpu": torch.zeros(4, dtype=torch.uint8)}, folder / RNG_FILE)
    save_file({"exp_avg.model.norm.weight": torch.zeros(3)}, folder / OPTIMIZER_TENSORS_FILE)
    return folder


@pytest.fixture
def checkpoint(model_folder, tmp_path) -> Path:
    return make_checkpoint(model_folder, tmp_path / "checkpoints" / "j")


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / WEIGHTS_INDEX_FILE
    if not index.exists():
        return load_file(folder / WEIGHTS_FILE)
    tensors = {}
    for name in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        tensors.update(load_file(folder / name))
    return tensors


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()])


def assert_converted_like_torch(exported: torch.Tensor, source: torch.Tensor, dtype: torch.dtype) -> None:
    """Bit for bit what ``source.to(dtype)`` gives; NaNs in the same places, quiet and of the same sign."""
    expected = source.to(dtype)
    assert exported.dtype == dtype and exported.shape == source.shape
    if source.dtype == dtype:
        assert torch.equal(_bits(exported), _bits(source)), "kept byte for byte, NaN payloads too"
        return
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(exported), nan)
    assert torch.equal(_bits(exported)[~nan], _bits(expected)[~nan])
    if nan.any():
        quiet = {torch.float32: 1 << 22, torch.bfloat16: 1 << 6, torch.float16: 1 << 9}[dtype]
        assert bool(((_bits(exported)[nan] & quiet) != 0).all()), "every NaN is quiet"
        assert torch.equal(torch.signbit(exported[nan]), torch.signbit(source[nan])), "NaNs keep their sign"


# --- what an export holds -----------------------------------------------------------------------------------


def test_a_float32_export_holds_every_tensor_the_config_and_tokenizer_but_no_training_state(checkpoint, tmp_path):
    out = tmp_path / "exported"
    result = ex.export_checkpoint(checkpoint, out, "float32", ex.parse_size("5GB"))

    source, exported = load_file(checkpoint / WEIGHTS_FILE), _tensors(out)
    assert sorted(exported) == sorted(source)
    for name, tensor in source.items():
        assert exported[name].dtype == torch.float32 and torch.equal(exported[name], tensor), name
    assert sorted(path.name for path in out.iterdir()) == sorted(["config.json", WEIGHTS_FILE, *FOLDER_FILES])
    for name in (*FOLDER_FILES, *TOKENIZER_FILES):
        assert (out / name).read_bytes() == (checkpoint / name).read_bytes(), name
    config, before = json.loads((out / "config.json").read_text()), json.loads((checkpoint / "config.json").read_text())
    assert config == {**before, "dtype": "float32", "torch_dtype": "float32"}
    with safe_open(out / WEIGHTS_FILE, framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
    assert [entry.name for entry in tmp_path.iterdir() if entry.name.startswith(".")] == [], "no staging left"
    assert result.summary() == (
        f"exported {checkpoint} to {out}: float32, {len(FOLDER_FILES) + 2} files, "
        f"{format_bytes(result.total_bytes)} (weights in {WEIGHTS_FILE})"
    )
    assert result.total_bytes == sum(path.stat().st_size for path in out.iterdir())


@pytest.mark.parametrize(("typed", "dtype"), [("bf16", "bfloat16"), ("float16", "float16"), ("BF16", "bfloat16")])
def test_bf16_and_fp16_exports_are_bitwise_what_torch_converts(checkpoint, tmp_path, typed, dtype):
    out = tmp_path / "out"
    result = ex.export_checkpoint(checkpoint, out, ex.parse_dtype(typed), 5 * 10**9)
    source, exported = load_file(checkpoint / WEIGHTS_FILE), load_file(out / WEIGHTS_FILE)
    assert sorted(exported) == sorted(source)
    for name, tensor in source.items():
        assert_converted_like_torch(exported[name], tensor, TORCH_DTYPES[dtype])
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == dtype
    assert result.dtypes == (dtype,)
    assert (out / WEIGHTS_FILE).stat().st_size < (checkpoint / WEIGHTS_FILE).stat().st_size * 0.51


def _odd_values() -> torch.Tensor:
    """fp32 values that test every rounding rule: NaNs of both signs and several payloads, infinities, fp32 and
    fp16 subnormals, overflow to fp16 infinity, bf16 and fp16 rounding ties (to even, both ways), near-ties."""
    words = [
        0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 0x7FA12345,
        0x7F800000, 0xFF800000, 0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x00400000, 0x00008000,
        0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0xBF808000, 0xBF818000, 0x7F7FFFFF, 0x7F7F8000,
        0x477FF000, 0x477FEFFF, 0x477FE000, 0x47800000, 0xC77FF000, 0x33800000, 0x33000000, 0x33000001,
        0x387FC000, 0x38800000, 0x3F801000, 0x3F803000, 0x3F801001, 0x3F800FFF, 0x0000FFFF, 0x00017FFF,
    ]  # fmt: skip
    special = torch.tensor(words, dtype=torch.int64).to(torch.int32).view(torch.float32)
    generator = torch.Generator().manual_seed(0)
    wide = torch.randn(4000, generator=generator) * torch.logspace(-45, 38, 4000).to(torch.float32)
    every_bit = torch.randint(-(2**31), 2**31 - 1, (4000,), generator=generator, dtype=torch.int64)
    return torch.cat([special, wide, every_bit.to(torch.int32).view(torch.float32)])


@pytest.fixture
def odd_folder(tmp_path) -> Path:
    """A hand-made model folder: a config of no family we know, and tensors of every dtype with awkward values."""
    folder = tmp_path / "odd"
    folder.mkdir()
    values = _odd_values()
    bf16 = torch.randint(-(2**15), 2**15 - 1, (3001,), dtype=torch.int64).to(torch.int16).view(torch.bfloat16)
    f16 = torch.randint(-(2**15), 2**15 - 1, (3001,), dtype=torch.int64).to(torch.int16).view(torch.float16)
    save_file(
        {
            "a.f32": values.reshape(-1, 2),
            "b.bf16": bf16,
            "c.f16": f16,
            "d.ids": torch.arange(7, dtype=torch.int64),
            "e.scalar": torch.tensor(1.5),
            "f.empty": torch.zeros(0, 3),
        },
        folder / WEIGHTS_FILE,
        metadata={"format": "pt"},
    )
    (folder / "config.json").write_text(json.dumps({"model_type": "something-else", "torch_dtype": "float32"}))
    return folder


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_nan_inf_subnormals_and_ties_convert_as_torch_converts_them(odd_folder, tmp_path, dtype):
    out = tmp_path / "out"
    ex.export_checkpoint(odd_folder, out, dtype, 10**9, chunk_bytes=4096)  # many pieces per tensor
    source, exported = load_file(odd_folder / WEIGHTS_FILE), load_file(out / WEIGHTS_FILE)
    for name in ("a.f32", "b.bf16", "c.f16", "e.scalar", "f.empty"):
        assert_converted_like_torch(exported[name], source[name], TORCH_DTYPES[dtype])
    assert exported["d.ids"].dtype == torch.int64 and torch.equal(exported["d.ids"], source["d.ids"])
    config = json.loads((out / "config.json").read_text())
    assert config == {"model_type": "something-else", "torch_dtype": dtype}, "the one dtype key it had"


def test_the_written_file_is_a_safetensors_file_with_every_tensor_aligned(odd_folder, tmp_path):
    out = tmp_path / "out"
    ex.export_checkpoint(odd_folder, out, None, 10**9)
    data = (out / WEIGHTS_FILE).read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    assert length % 8 == 0 and data[8 : 8 + length].rstrip(b" ").endswith(b"}")
    header = json.loads(data[8 : 8 + length])
    assert header.pop("__metadata__") == {"format": "pt"}
    sizes = {"F32": 4, "BF16": 2, "F16": 2, "I64": 8}
    end = 0
    for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"]):
        begin, stop = info["data_offsets"]
        assert begin == end and begin % sizes[info["dtype"]] == 0, name
        end = stop
    assert 8 + length + end == len(data)
    kept = load_file(out / WEIGHTS_FILE)
    for name, tensor in load_file(odd_folder / WEIGHTS_FILE).items():
        assert torch.equal(_bits(kept[name]), _bits(tensor)), "as stored when no --dtype is given"
    assert json.loads((out / "config.json").read_text()) == json.loads((odd_folder / "config.json").read_text())


def test_conversion_to_another_float_kind_is_refused(tmp_path):
    folder = tmp_path / "f64"
    folder.mkdir()
    save_file({"w": torch.zeros(3, dtype=torch.float64)}, folder / WEIGHTS_FILE)
    (folder / "config.json").write_text("{}")
    with pytest.raises(ex.ExportError, match="'w' is stored as F64; --dtype converts between F32, BF16 and F16"):
        ex.export_checkpoint(folder, tmp_path / "out", "bfloat16", 10**9)
    assert not (tmp_path / "out").exists()
    ex.export_checkpoint(folder, tmp_path / "out", None, 10**9)
    assert load_file(tmp_path / "out" / WEIGHTS_FILE)["w"].dtype == torch.float64


# --- shards -----------------------------------------------------------------------------------------------------


def test_a_sharded_export_loads_in_transformers_with_the_same_logits(checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    ex.export_checkpoint(checkpoint, whole, None, ex.parse_size("5GB"))
    limit = ex.parse_size("600KB")
    result = ex.export_checkpoint(checkpoint, sharded, None, limit)

    count = len(result.weight_files)
    assert count > 2 and result.weight_files == tuple(
        f"model-{n:05d}-of-{count:05d}.safetensors" for n in range(1, count + 1)
    )
    assert not (sharded / WEIGHTS_FILE).exists()
    index = json.loads((sharded / WEIGHTS_INDEX_FILE).read_text())
    source = load_file(checkpoint / WEIGHTS_FILE)
    assert set(index) == {"metadata", "weight_map"} and sorted(index["weight_map"]) == sorted(source)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in source.values())
    for name in result.weight_files:
        in_file = load_file(sharded / name)
        assert {t for t, f in index["weight_map"].items() if f == name} == set(in_file)
        assert len(in_file) == 1 or sum(t.numel() * 4 for t in in_file.values()) <= limit
    tokens = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))
    logits = {}
    for folder in (whole, sharded):
        model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], info
        with torch.no_grad():
            logits[folder] = model.eval()(tokens).logits
    assert logits[whole].abs().max() > 0.1
    assert torch.equal(logits[whole], logits[sharded])


def test_a_model_folder_sharded_by_transformers_exports_to_one_file(tmp_path):
    from hf_folders import make_hf_model

    folder = make_hf_model(tmp_path / "hf", dtype=torch.bfloat16, shard_size="40KB")
    assert (folder / WEIGHTS_INDEX_FILE).exists()
    out = tmp_path / f"out {ODD}"
    ex.export_checkpoint(folder, out, "float32", 10**9)
    assert not (out / WEIGHTS_INDEX_FILE).exists()
    exported = load_file(out / WEIGHTS_FILE)
    source = _tensors(folder)
    assert sorted(exported) == sorted(source)
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor.to(torch.float32)), name
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    assert (out / "generation_config.json").read_bytes() == (folder / "generation_config.json").read_bytes()


def test_shard_plan_is_greedy_in_order_and_never_splits_a_tensor():
    def tensor(name, nbytes):
        return ex._Tensor(name, Path("x"), (nbytes // 4,), "F32", 0, nbytes, "F32")

    tensors = [tensor("a", 40), tensor("b", 40), tensor("c", 200), tensor("d", 8), tensor("e", 50), tensor("f", 60)]
    groups = [[t.name for t in shard] for shard in ex.shard_plan(tensors, 100)]
    assert groups == [["a", "b"], ["c"], ["d", "e"], ["f"]]
    assert [[t.name for t in shard] for shard in ex.shard_plan(tensors, 398)] == [["a", "b", "c", "d", "e", "f"]]
    assert ex.shard_names(1) == [WEIGHTS_FILE] and ex.shard_names(2)[1] == "model-00002-of-00002.safetensors"


# --- the options ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("5GB", 5 * 10**9),
        ("500MB", 500 * 10**6),
        ("2GiB", 2 << 30),
        ("64 MiB", 64 << 20),
        ("1.5gb", 1_500_000_000),
        ("10KB", 10_000),
        ("3kib", 3072),
        ("123", 123),
        ("7B", 7),
    ],
)
def test_sizes_as_typed(text, count):
    assert ex.parse_size(text) == count


@pytest.mark.parametrize("text", ["", "5XB", "GB", "-1GB", "0", "five", "5 G B", "1e9"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(ValueError):
        ex.parse_size(text)


def test_dtype_names_and_aliases():
    for typed, name in [("fp32", "float32"), ("FP16", "float16"), ("bf16", "bfloat16"), ("bfloat16", "bfloat16")]:
        assert ex.parse_dtype(typed) == name
    assert ex.parse_dtype(None) is None
    with pytest.raises(ValueError, match="takes float32, bfloat16 or float16"):
        ex.parse_dtype("int8")


# --- memory ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [None, "bfloat16", "float16"])
def test_memory_stays_bounded_by_the_chunk_size_not_the_tensor(tmp_path, monkeypatch, dtype):
    folder = tmp_path / "big"
    folder.mkdir()
    big = torch.randn(4 << 20, generator=torch.Generator().manual_seed(0))  # 16 MiB in one tensor
    save_file({"big": big, "small": torch.ones(3)}, folder / WEIGHTS_FILE)
    (folder / "config.json").write_text("{}")
    chunk = 1 << 20
    reads = []
    real = ex._pieces

    def pieces(reader, tensor, buffer):
        for piece in real(reader, tensor, buffer):
            reads.append(len(piece))
            yield piece

    monkeypatch.setattr(ex, "_pieces", pieces)
    tracemalloc.start()
    try:
        ex.export_checkpoint(folder, tmp_path / "out", dtype, 10**9, chunk_bytes=chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert max(reads) == chunk and len(reads) == 17
    assert peak < 5 * chunk, f"peak {peak} bytes for a {big.numel() * 4}-byte tensor"
    exported = load_file(tmp_path / "out" / WEIGHTS_FILE)["big"]
    assert_converted_like_torch(exported, big, TORCH_DTYPES[dtype or "float32"])


# --- refusals, through invoke -----------------------------------------------------------------------------------


def _job(root: Path) -> Path:
    config = root / "train.yaml"
    runtime = {"job_name": "j", "gpu": {"devices": "none"}, "container": {"cuda_tag": "cpu"}}
    config.write_text(yaml.safe_dump({"runtime": runtime}), encoding="utf-8")
    return config


def _hidden(folder: Path) -> list[str]:
    return [entry.name for entry in folder.iterdir() if entry.name.startswith(".export-")]


def test_export_of_the_newest_checkpoint_or_one_named_in_the_job_dir(model_folder, tmp_path):
    root = tmp_path / ODD
    root.mkdir()
    config = _job(root)
    job_dir = root / "checkpoints" / "j"
    older = make_checkpoint(model_folder, job_dir, 0, 10)
    newest = make_checkpoint(model_folder, job_dir, 1, 5)
    (newest / "tokenizer.json").write_text('{"newest": true}')
    make_checkpoint(model_folder, job_dir, 2, 0)
    (job_dir / "epoch_2_step_0" / OPTIMIZER_FILE).unlink()  # not a checkpoint: never the newest
    out = root / "exports" / "newest"

    result = invoke("export", "--config", str(config), "--out", str(out), "--dtype", "bf16")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(f"exported {newest} to {out}: bfloat16, 7 files,")
    assert (out / "tokenizer.json").read_text() == '{"newest": true}'
    assert not any((out / name).exists() for name in INTERNALS)

    named = invoke("export", "--config", str(config), "--checkpoint", older.name, "--out", str(root / "older"))
    assert named.returncode == 0, named.stderr
    assert f"exported {older} to {root / 'older'}: float32" in named.stdout
    assert load_file(root / "older" / WEIGHTS_FILE).keys() == load_file(older / WEIGHTS_FILE).keys()

    missing = invoke("export", "--config", str(config), "--checkpoint", "epoch_9_step_9", "--out", str(root / "x"))
    assert missing.returncode == 2 and f"no epoch_9_step_9 in {job_dir}" in missing.stderr
    assert not (root / "x").exists()


def _refused(result: subprocess.CompletedProcess, code: int, message: str) -> None:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert result.stdout == ""


def test_refusals_exit_non_zero_without_a_traceback_and_write_nothing(checkpoint, tmp_path):
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    out = tmp_path / "new" / "out"
    source = str(checkpoint)

    _refused(invoke("export", "--checkpoint", source, "--out", str(full)), 2, f"--out {full} exists and is not empty")
    assert [p.name for p in full.iterdir()] == ["keep.txt"] and (full / "keep.txt").read_text() == "mine"
    _refused(invoke("export", "--checkpoint", source, "--out", str(out), "--dtype", "int8"), 2, "--dtype takes")
    _refused(
        invoke("export", "--checkpoint", source, "--out", str(out), "--max-shard-size", "5XB"),
        2,
        "--max-shard-size takes a size like 5GB",
    )
    _refused(invoke("export", "--checkpoint", source), 2, "--out is required")
    inside = checkpoint / "export"
    _refused(invoke("export", "--checkpoint", source, "--out", str(inside)), 2, "is inside the source")
    assert not inside.exists()
    _refused(invoke("export", "--checkpoint", str(tmp_path / "nope"), "--out", str(out)), 2, "does not exist")

    (checkpoint / SCHEDULER_FILE).unlink()
    _refused(
        invoke("export", "--checkpoint", source, "--out", str(out)),
        1,
        f"{checkpoint} is not a complete checkpoint: incomplete: {SCHEDULER_FILE} missing",
    )
    torch.save({}, checkpoint / SCHEDULER_FILE)
    (checkpoint / WEIGHTS_FILE).write_bytes((checkpoint / WEIGHTS_FILE).read_bytes()[:-100])
    _refused(invoke("export", "--checkpoint", source, "--out", str(out)), 1, "model.safetensors: truncated")
    assert not (tmp_path / "new").exists(), "not even the parent of --out"
    assert _hidden(tmp_path) == []


def test_a_malformed_config_is_refused_before_anything_is_written(tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text("runtime:\n  job_name: 'bad name'\n  gpu: {devices: none}\n", encoding="utf-8")
    out = tmp_path / "out"
    _refused(invoke("export", "--config", str(config), "--out", str(out)), 2, f"{config}: runtime.job_name: ")
    _refused(invoke("export", "--config", str(config), "--node", "x", "--out", str(out)), 2, "--node takes")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["train.yaml"]


def test_an_empty_out_folder_is_filled(checkpoint, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    result = invoke("export", "--checkpoint", str(checkpoint), "--out", str(out), "--max-shard-size", "1MiB")
    assert result.returncode == 0, result.stderr
    assert "(weights in 4 shards)" in result.stdout and (out / WEIGHTS_INDEX_FILE).is_file()
    assert _hidden(tmp_path) == []


def test_a_trained_checkpoint_exports_and_loads_in_transformers(tmp_path, train_yaml, one_thread, run_trainer):
    from transformers import AutoModelForCausalLM

    from astrai.common.checkpoints import latest_complete_checkpoint

    job_dir = tmp_path / "ckpt"
    run_trainer(train_yaml(tmp_path / "train.yaml", max_steps=10, ckpt_interval=10, ckpt_dir=str(job_dir)))
    checkpoint = latest_complete_checkpoint(job_dir).path
    out = tmp_path / "hf"
    result = invoke("export", "--checkpoint", str(checkpoint), "--out", str(out), "--dtype", "fp16")
    assert result.returncode == 0, result.stderr
    assert not any((out / name).exists() for name in INTERNALS) and not list(out.glob("*.pt"))
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.float16
    source = load_file(checkpoint / WEIGHTS_FILE)
    for name, tensor in load_file(out / WEIGHTS_FILE).items():
        assert_converted_like_torch(tensor, source[name], torch.float16)


# --- a full disk ------------------------------------------------------------------------------------------------


def test_a_disk_without_room_is_refused_up_front(checkpoint, small_disk):
    (small_disk / "filler").write_bytes(b"\0" * (13 << 20))  # leaves about 3 MiB: the fp32 export takes 3.4
    out = small_disk / "a" / "out"
    result = invoke("export", "--checkpoint", str(checkpoint), "--out", str(out))
    _refused(result, 1, f"not enough room for {out}: the export needs 3.4 MiB")
    assert sorted(os.listdir(small_disk)) == ["filler"]


def test_a_disk_that_fills_during_the_export_leaves_nothing_behind(checkpoint, small_disk, monkeypatch):
    (small_disk / "filler").write_bytes(b"\0" * (13 << 20))
    monkeypatch.setattr(ex, "_free_bytes", lambda folder: None)  # as if the space went meanwhile
    out = small_disk / "a" / "b" / "out"
    with pytest.raises(
        ex.ExportError, match=re.escape(f"the disk filled up while writing {out}: the export needs 3.4 MiB")
    ):
        ex.export_checkpoint(checkpoint, out, None, 10**9)
    assert sorted(os.listdir(small_disk)) == ["filler"], "staging and the parents it made are gone"
