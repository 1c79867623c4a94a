"""Checkpoint folders: the shared folder rules and the trainer's writer and reader."""

from __future__ import annotations

import io
import json
import os
import pickle
from dataclasses import asdict

import pytest
import torch
from safetensors.torch import load_file

from astrai.common.checkpoints import (
    Checkpoint,
    CheckpointMeta,
    checkpoint_name,
    is_complete,
    latest_complete_checkpoint,
    list_complete_checkpoints,
    new_staging_dir,
    parse_checkpoint_name,
    plan_retention,
    publish,
    remove_checkpoint,
    scan_job_dir,
)
from astrai.common.contract import REQUIRED_FILES
from astrai.trainer.checkpoint import files as checkpoint_io
from astrai.trainer.checkpoint import formats
from astrai.trainer.checkpoint.files import CheckpointError, Progress, first_non_finite, read_checkpoint
from astrai.trainer.checkpoint.manager import CheckpointManager, RunFacts, load_latest
from astrai.trainer.checkpoint.state import RunState, run_state
from astrai.trainer.launch.distributed import init_distributed
from astrai.trainer.models.native import Transformer
from astrai.trainer.models.optim import Optimizers, Schedule
from astrai.trainer.models.weights import PRESETS
from tests.support import placeholder_checkpoint as _fake_checkpoint

# The shared folder rules.


def test_names_round_trip_and_order_numerically(tmp_path):
    assert checkpoint_name(2, 1000) == "epoch_2_step_1000"
    assert parse_checkpoint_name("epoch_2_step_1000") == (2, 1000)
    for bad in ("epoch_2_step_01", "epoch_2_step_", "epoch_2_step_5.tmp", ".staging-epoch_0_step_5-1-ab"):
        assert parse_checkpoint_name(bad) is None
    for epoch, step in ((0, 999), (0, 1000), (0, 100), (1, 5)):
        _fake_checkpoint(tmp_path, epoch, step)
    assert [c.name for c in list_complete_checkpoints(tmp_path)] == [
        "epoch_0_step_100",
        "epoch_0_step_999",
        "epoch_0_step_1000",
        "epoch_1_step_5",
    ]
    assert latest_complete_checkpoint(tmp_path).name == "epoch_1_step_5"


def test_scan_separates_checkpoints_folders_that_are_not_and_staging(tmp_path):
    _fake_checkpoint(tmp_path, 0, 10)
    _fake_checkpoint(tmp_path, 9, 999, files=("meta.json",))
    staging = new_staging_dir(tmp_path, "epoch_0_step_20")
    (tmp_path / "notes").mkdir()
    os.symlink(tmp_path / "epoch_0_step_10", tmp_path / "epoch_5_step_5")
    scan = scan_job_dir(tmp_path)
    assert [c.name for c in scan.complete] == ["epoch_0_step_10"]
    assert scan.complete[0].meta.step == 10
    assert [(d.name, d.reason) for d in scan.damaged] == [
        ("epoch_9_step_999", "incomplete: config.json, model.safetensors, optimizer.pt, scheduler.pt missing")
    ]
    assert scan.staging == [staging]
    assert not is_complete(tmp_path / "epoch_9_step_999")
    assert scan_job_dir(tmp_path / "missing").complete == []


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: (p / "meta.json").write_text("x"), "meta.json: not valid JSON"),
        (lambda p: (p / "meta.json").write_text("[1]"), "meta.json: expected a JSON object"),
        (
            lambda p: (p / "meta.json").write_text('{"epoch": 0, "step": 7, "reason": "periodic", "world_size": 1}'),
            "meta.json says epoch 0 step 7, the folder name disagrees",
        ),
        (
            lambda p: (p / "meta.json").write_text('{"epoch": 0, "step": 10, "reason": "nap", "world_size": 1}'),
            "reason must be one of",
        ),
        (
            lambda p: (p / "meta.json").write_text('{"epoch": 0, "step": "10", "reason": "final", "world_size": 1}'),
            "step must be an integer",
        ),
        (lambda p: (p / "model.safetensors").write_bytes(b"x" * 40), "model.safetensors"),
        (lambda p: (p / "optimizer.pt").write_bytes(b"PK" + b"x" * 30), "optimizer.pt: damaged or truncated"),
        (lambda p: (p / "scheduler.pt").write_bytes(b""), "scheduler.pt: damaged or truncated"),
        (lambda p: (p / "config.json").write_text("{}"), "config.json"),
    ],
)
def test_a_folder_whose_files_are_not_whole_is_not_a_checkpoint(tmp_path, damage, reason):
    good = _fake_checkpoint(tmp_path, 0, 5)
    folder = _fake_checkpoint(tmp_path, 0, 10)
    damage(folder)
    scan = scan_job_dir(tmp_path)
    assert [c.path for c in scan.complete] == [good]
    assert [d.path for d in scan.damaged] == [folder] and reason in scan.damaged[0].reason, scan.damaged
    assert latest_complete_checkpoint(tmp_path).path == good


def test_the_seed_s_five_files_make_a_checkpoint_and_rng_state_is_optional(tmp_path):
    assert "rng_state.safetensors" not in REQUIRED_FILES and len(REQUIRED_FILES) == 5
    _fake_checkpoint(tmp_path, 0, 10)
    assert [c.step for c in list_complete_checkpoints(tmp_path)] == [10]


def test_meta_record_round_trips_and_ignores_keys_it_does_not_know():
    meta = CheckpointMeta(epoch=1, step=20, reason="final", world_size=2, samples_in_epoch=8, config_hash="ab")
    raw = json.loads(meta.to_json())
    assert raw["data_position"] == {"epoch": 1, "samples_in_epoch": 8}
    assert CheckpointMeta.from_dict({**raw, "from_the_future": [1]}) == meta


def test_retention_keeps_the_newest(tmp_path):
    checkpoints = [Checkpoint(0, step, tmp_path / checkpoint_name(0, step)) for step in (30, 10, 20)]
    kept, removed = plan_retention(checkpoints, keep=2)
    assert [c.step for c in kept] == [20, 30] and [c.step for c in removed] == [10]
    with pytest.raises(ValueError, match="newest checkpoint is never removed"):
        plan_retention(checkpoints, keep=0)


def test_publish_replaces_an_existing_folder_and_remove_is_atomic(tmp_path_factory, tmp_path):
    broken = _fake_checkpoint(tmp_path, 0, 10, files=("meta.json",))
    written = _fake_checkpoint(tmp_path_factory.mktemp("elsewhere"), 0, 10, meta={"time": 7.0})
    staging = new_staging_dir(tmp_path, broken.name)
    for name in REQUIRED_FILES:
        (staging / name).write_bytes((written / name).read_bytes())
    publish(staging, broken)
    assert is_complete(broken) and CheckpointMeta.read(broken).time == 7.0
    assert sorted(os.listdir(tmp_path)) == ["epoch_0_step_10"]
    remove_checkpoint(tmp_path, Checkpoint(0, 10, broken))
    assert os.listdir(tmp_path) == []


# The trainer's side: writing and reading real checkpoints.


@pytest.fixture
def training_state(one_thread):
    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"])
    optimizer = Optimizers([torch.optim.AdamW(model.parameters(), lr=1e-3)])
    tokens = torch.randint(0, 257, (2, 9))
    torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    return model, optimizer, Schedule("cosine", 1e-3, 0.1, 2, 100, 0)


def _manager(job_dir, state, keep_last=None, logs=None, seed=0, **others):
    model, optimizer, schedule = state
    env, log = init_distributed("none", "cpu"), (logs if logs is not None else []).append
    return CheckpointManager(
        job_dir,
        env,
        log,
        model=model,
        optimizer=optimizer,
        parts=run_state(Progress(), schedule, env, seed, log, **others),
        model_config=model.config,
        facts=RunFacts("abc", 100, 8, 4),
        interval=10,
        keep_last=keep_last,
    )


def _save(manager, step, reason="periodic", wait=True):
    manager.parts.progress.load_state_dict(dict(step=step, epoch=0, samples_in_epoch=4 * step, tokens_seen=128 * step))
    return manager.save(reason, wait=wait)


def test_policy_says_which_checkpoint_is_due(tmp_path, training_state):
    manager = _manager(tmp_path, training_state)
    assert manager.reason_for(10, stopping=False) == "periodic"
    assert manager.reason_for(11, stopping=False) is None
    assert manager.reason_for(11, stopping=True) == "emergency"
    assert manager.reason_for(100, stopping=True) == "final"


def test_saved_checkpoint_is_complete_safe_and_round_trips(tmp_path, training_state):
    model = training_state[0]
    path = _save(_manager(tmp_path, training_state), step=10, reason="emergency")
    assert path.name == "epoch_0_step_10" and is_complete(path)
    meta = json.loads((path / "meta.json").read_text())
    assert meta["reason"] == "emergency" and meta["step"] == 10 and meta["world_size"] == 1
    assert meta["data_position"] == {"epoch": 0, "samples_in_epoch": 40} and meta["tokens_seen"] == 1280
    assert meta["config_hash"] == "abc"
    # Nothing in the folder needs pickle to load.
    torch.load(path / "optimizer.pt", weights_only=True)
    assert torch.load(path / "scheduler.pt", weights_only=True) == {**asdict(training_state[2]), "step": 10}
    assert "rank0.cpu" in load_file(path / "rng_state.safetensors")
    loaded = read_checkpoint(Checkpoint(0, 10, path))
    assert loaded.progress == Progress(step=10, epoch=0, samples_in_epoch=40, tokens_seen=1280)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.model_state[name], tensor)
    assert set(loaded.optimizer_state["state"]) == set(model.state_dict())


class _ShortWrites(io.FileIO):
    """A file whose every write stores at most 1000 bytes, as a raw write is allowed to."""

    def write(self, data):
        return super().write(memoryview(data).cast("B")[:1000])


class _ShortWritebackFile(checkpoint_io._WritebackFile, _ShortWrites):
    CHUNK = 4096


def test_optimizer_file_streamed_to_disk_holds_every_byte_even_after_short_writes(tmp_path):
    state = {"state": {"w": {"exp_avg": torch.randn(70, 90), "step": torch.tensor(7.0)}}, "param_groups": [{"lr": 0.1}]}
    with _ShortWritebackFile(tmp_path / "optimizer.pt") as out:
        torch.save(state, out)
    loaded = torch.load(tmp_path / "optimizer.pt", weights_only=True)
    assert torch.equal(loaded["state"]["w"]["exp_avg"], state["state"]["w"]["exp_avg"])
    assert loaded["param_groups"] == state["param_groups"]


def test_tensors_streamed_as_safetensors_read_back_exactly_with_safetensors_itself(tmp_path):
    from safetensors import safe_open

    weight = torch.nn.Parameter(torch.randn(33, 7))  # a live parameter: requires grad
    tensors = {
        "weight": weight,
        "transposed": torch.randn(6, 10).t(),  # not contiguous
        "half": torch.randn(5, 3).to(torch.bfloat16),
        "odd_bytes": torch.arange(7, dtype=torch.uint8),  # would misalign whatever came after it
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "steps": torch.arange(4, dtype=torch.int64),
    }
    with checkpoint_io._WritebackFile(tmp_path / "t.safetensors") as out:
        checkpoint_io.write_safetensors(tensors, out, {"format": "pt"})
    loaded = load_file(tmp_path / "t.safetensors")
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor.detach()), name
    with safe_open(tmp_path / "t.safetensors", framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
    with checkpoint_io._WritebackFile(tmp_path / "bad.safetensors") as out, pytest.raises(ValueError, match="complex"):
        checkpoint_io.write_safetensors({"z": torch.zeros(2, dtype=torch.complex64)}, out)


def test_background_save_keeps_a_snapshot_of_the_moment(tmp_path, training_state):
    model = training_state[0]
    before = model.tok_embeddings.weight.detach().clone()
    manager = _manager(tmp_path, training_state)
    path = _save(manager, step=10, wait=False)
    with torch.no_grad():
        model.tok_embeddings.weight.add_(1.0)
    manager.wait()
    assert torch.equal(load_file(path / "model.safetensors")["model.embed_tokens.weight"], before)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (
            lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:1000]),
            "model.safetensors: truncated",
        ),
        (lambda p: (p / "meta.json").write_text("{broken"), "meta.json: not valid JSON"),
        (lambda p: (p / "optimizer.pt").write_bytes(pickle.dumps(print, protocol=2)), "optimizer.pt: damaged"),
        (lambda p: _evil_zip(p / "optimizer.pt"), "UnpicklingError"),
        (lambda p: (p / "config.json").write_text('{"dim": 64}'), "config.json: model_type is missing"),
    ],
)
def test_a_damaged_checkpoint_is_refused_with_the_reason(tmp_path, training_state, damage, reason):
    path = _save(_manager(tmp_path, training_state), step=10)
    damage(path)
    with pytest.raises(CheckpointError, match=reason):
        read_checkpoint(Checkpoint(0, 10, path))


def test_resume_skips_broken_and_partial_checkpoints(tmp_path, training_state):
    manager = _manager(tmp_path, training_state, logs=(logs := []))
    _save(manager, step=10)
    newest = _save(manager, step=20)
    (newest / "model.safetensors").write_bytes(b"")
    _fake_checkpoint(tmp_path, 9, 999, files=("meta.json",))
    _fake_checkpoint(tmp_path, 9, 1000)  # whole by its headers, but holds no real state
    loaded = load_latest(tmp_path, init_distributed("none", "cpu"), logs.append)
    assert loaded.checkpoint.name == "epoch_0_step_10"
    assert any("skipping" in line and str(newest) in line for line in logs)
    assert any("skipping" in line and "epoch_9_step_999" in line and "incomplete" in line for line in logs)
    assert any("skipping" in line and "epoch_9_step_1000" in line for line in logs)


class _Counter:
    """A part of a run of its own (as a rollout buffer would be): a count and a tensor."""

    def __init__(self):
        self.count, self.values, self.loaded = 0, torch.zeros(3), "never"

    def state_dict(self) -> dict:
        return {"count": self.count, "values": self.values.clone()}

    def load_state_dict(self, state: dict | None) -> None:
        self.loaded = state
        if state is not None:
            self.count, self.values = state["count"], state["values"]


def test_a_part_of_the_run_s_own_is_one_entry_saved_and_restored_with_the_rest(tmp_path, training_state):
    counter = _Counter()
    counter.count, counter.values = 7, torch.tensor([1.0, 2.0, 3.0])
    manager = _manager(tmp_path, training_state, counter=counter)
    path = _save(manager, step=10)
    assert (path / "trainer_state.pt").is_file()
    assert torch.load(path / "trainer_state.pt", weights_only=True)["counter"]["count"] == 7

    again = _Counter()
    resumed = _manager(tmp_path, training_state, counter=again)
    loaded = load_latest(tmp_path, init_distributed("none", "cpu"), print)
    resumed.restore(loaded)
    assert again.count == 7 and torch.equal(again.values, torch.tensor([1.0, 2.0, 3.0]))
    assert resumed.parts.progress.step == 10 and resumed.parts.progress.samples_in_epoch == 40

    # A checkpoint written before the part existed gives it None to start from.
    plain = _save(_manager(tmp_path / "plain", training_state), step=10)
    assert not (plain / "trainer_state.pt").exists()
    late = _Counter()
    _manager(tmp_path / "plain", training_state, counter=late).restore(
        load_latest(tmp_path / "plain", init_distributed("none", "cpu"), print)
    )
    assert late.loaded is None and late.count == 0
    with pytest.raises(ValueError, match="must start with 'progress', 'schedule', 'rng'"):
        RunState({"counter": late})
    with pytest.raises(ValueError, match="may not be called 'rng'"):
        _manager(tmp_path / "plain", training_state, rng=late)


def test_a_checkpoint_without_rng_state_resumes_with_seeded_rng_and_says_so(tmp_path, training_state):
    from astrai.trainer.checkpoint.state import resumed_rank_seed

    manager = _manager(tmp_path, training_state, logs=(logs := []), seed=5)
    path = _save(manager, step=10)
    (path / "rng_state.safetensors").unlink()
    loaded = load_latest(tmp_path, init_distributed("none", "cpu"), logs.append)
    assert loaded.rng_state is None
    manager.restore(loaded)
    assert torch.equal(torch.get_rng_state(), torch.manual_seed(resumed_rank_seed(5, 10, 0)).get_state())
    assert any("no rng_state.safetensors" in line for line in logs)


def test_a_failed_write_leaves_nothing_visible_and_is_reported(tmp_path, training_state, monkeypatch):
    def fail(self, folder):
        (folder / "model.safetensors").write_text("half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(formats.FullSnapshot, "write", fail)
    manager = _manager(tmp_path, training_state)
    _save(manager, step=10, wait=False)
    with pytest.raises(CheckpointError, match="No space left on device"):
        manager.wait()
    assert os.listdir(tmp_path) == []


def test_keep_last_never_lets_a_newer_leftover_push_out_good_checkpoints(tmp_path, training_state):
    manager = _manager(tmp_path, training_state, keep_last=2)
    _fake_checkpoint(tmp_path, 5, 500)  # newer than anything this run writes, and unloadable
    (damaged := _fake_checkpoint(tmp_path, 0, 1))
    (damaged / "meta.json").write_text("not json")  # never counted, never removed by retention
    for step in (10, 20, 30):
        _save(manager, step=step)
    assert damaged.is_dir()
    names = sorted(c.name for c in list_complete_checkpoints(tmp_path))
    assert names == ["epoch_0_step_20", "epoch_0_step_30", "epoch_5_step_500"]


def test_leftover_staging_folders_are_removed_on_start(tmp_path, training_state):
    staging = new_staging_dir(tmp_path, "epoch_0_step_10")
    (staging / "model.safetensors").write_text("partial")
    _manager(tmp_path, training_state)
    assert os.listdir(tmp_path) == []


def _evil_zip(path):
    """A zip archive (so the folder rule passes) whose pickle would run code: weights_only refuses it."""
    import zipfile

    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", pickle.dumps(print, protocol=2))
        archive.writestr("archive/version", "3")


def test_the_finiteness_check_finds_nan_and_infinity_and_passes_large_finite_values():
    finite = {"a": torch.randn(5, 3), "b": torch.ones(4, dtype=torch.bfloat16), "steps": torch.arange(3)}
    assert first_non_finite(finite) is None and first_non_finite({}) is None
    # Large finite values whose sum overflows fp32 are not a divergence.
    assert first_non_finite({**finite, "big": torch.full((4,), 3.0e38)}) is None
    for bad in (float("nan"), float("inf"), float("-inf")):
        poisoned = torch.randn(6)
        poisoned[4] = bad
        assert first_non_finite({**finite, "w": poisoned, "z": torch.zeros(2)}) == "w", bad
    half = torch.ones(3, dtype=torch.float16)
    half[1] = float("inf")
    assert first_non_finite({"h": half}) == "h"


@pytest.mark.parametrize("kind", ["adamw", "muon", "lora", "before the first step"])
def test_the_optimizer_state_a_save_takes_is_torchs_own_by_parameter_name(kind):
    """What a full or LoRA save writes of the optimizer, taken without torch's state-dict walk, is what torch's
    get_optimizer_state_dict gives (the format checkpoints always had)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from astrai.common.config import build_config
    from astrai.common.settings import LoRASettings
    from astrai.trainer.models.lora import add_adapters
    from astrai.trainer.models.optim import build_optimizer

    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"])
    training = {"optimizer": "muon"} if kind == "muon" else {"lora_rank": 4} if kind == "lora" else {}
    if kind == "lora":
        add_adapters(model, LoRASettings(4, 8.0), torch.Generator().manual_seed(0))
    optimizer = build_optimizer(model, build_config({"training": training}).training, torch.device("cpu"))
    if kind != "before the first step":
        tokens = torch.randint(0, PRESETS["tiny"].vocab_size, (2, 16))
        model(tokens).square().mean().backward()
        optimizer.step()
    ours = formats.named_optimizer_state(model, optimizer)
    theirs = get_optimizer_state_dict(model, optimizer.parts, options=StateDictOptions(full_state_dict=True))
    assert ours["param_groups"] == theirs["param_groups"]
    assert list(ours["state"]) == list(theirs["state"]) and ours["state"]
    for name, values in theirs["state"].items():
        assert ours["state"][name].keys() == values.keys()
        for key, value in values.items():
            assert torch.equal(ours["state"][name][key], value), (name, key)
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    assert list(weights) == list(model.state_dict())  # the full format's weights: the model's own state dict


def test_a_periodic_saves_host_copies_take_the_states_own_size_in_one_arena(tmp_path, training_state):
    """The copies a save writes while training goes on live in one host allocation of the state's size (each tensor
    a view at an aligned offset), reused by the next saves: no block rounded up to a power of two."""
    manager = _manager(tmp_path, training_state)
    model, optimizer, _ = training_state
    state = [*model.state_dict().values()]
    state += [value for values in optimizer.state.values() for value in values.values()]
    state_bytes = sum(t.numel() * t.element_size() for t in state if isinstance(t, torch.Tensor))
    _save(manager, 1, wait=False)
    manager.wait()
    held = manager.host_copy_bytes()
    assert state_bytes <= held <= 1.01 * state_bytes
    arena = manager._host_copy.arena
    _save(manager, 2, wait=False)
    manager.wait()
    assert manager._host_copy.arena is arena and manager.host_copy_bytes() == held


def test_on_cuda_the_arena_is_pinned_once_at_its_exact_size_and_released_when_the_state_changes(monkeypatch):
    """Pinned by registering the arena with the driver (no GPU here: the calls are recorded), so its size is exact."""
    from astrai.trainer.checkpoint import manager as manager_module

    calls = []

    class Runtime:
        def cudaHostRegister(self, pointer, size, flags):
            calls.append(("register", pointer, size))
            return 0

        def cudaHostUnregister(self, pointer):
            calls.append(("unregister", pointer))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Runtime())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    host = manager_module._HostCopy(pin=True)
    tree = {"a": torch.ones(3, dtype=torch.bfloat16), "b": [torch.arange(5), torch.zeros(2, 2)], "step": 7}
    copied = host.copy(tree)
    assert torch.equal(copied["b"][0], tree["b"][0]) and copied["step"] == 7 and copied["a"].dtype == torch.bfloat16
    assert calls == [("register", host.arena.data_ptr(), 64 + 64 + 16)]  # 6 bytes, 40, 16: each at 64-byte offsets
    host.copy({"a": torch.full((3,), 2.0, dtype=torch.bfloat16), "b": [torch.arange(5), torch.ones(2, 2)], "step": 8})
    assert len(calls) == 1 and float(host.views[("a",)][0]) == 2.0
    first = host.arena.data_ptr()
    host.copy({"a": torch.ones(4)})
    assert calls[1:] == [("unregister", first), ("register", host.arena.data_ptr(), 16)]
