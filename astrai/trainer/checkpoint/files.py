"""The checkpoint file format: what each file of a checkpoint folder holds, written and read with torch.

The folder rules (names, what makes a folder a checkpoint, staging, publish, retention,
``meta.json``) live in :mod:`astrai.common.checkpoints`, shared with the host; when to save,
the writer thread and the collectives are :mod:`astrai.trainer.checkpoint.manager`'s. A
checkpoint folder holds::

    meta.json              progress, data position, reason, config hash (astrai.common.checkpoints.CheckpointMeta)
    config.json            the model architecture (Hugging Face Llama form)
    model.safetensors      the full model, even under FSDP, under Hugging Face's tensor names (LoRA: the
                           adapters alone, under PEFT's names; config.json is then the base model's)
    optimizer.pt           full optimizer state keyed by parameter name (tensors and plain values only);
                           in the sharded format its parameter-shaped tensors are in optimizer.safetensors
                           (astrai.trainer.checkpoint.sharded), and join_optimizer_tensors puts them back
    scheduler.pt           the learning-rate schedule's settings and step (plain values only)
    rng_state.safetensors  every rank's torch RNG states (optional)
    trainer_state.pt       the state of the run's other parts, by part name (optional; plain values and tensors)

What a checkpoint saves besides the model and the optimizer is the run's parts' state
(:mod:`astrai.trainer.checkpoint.state`), one entry per part. ``optimizer.pt``, ``scheduler.pt`` and
``trainer_state.pt`` are read with ``torch.load(weights_only=True)``,
so a checkpoint folder can never run code.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from astrai.common.backends import BACKEND_NATIVE, load_model_config
from astrai.common.checkpoints import (
    Checkpoint,
    CheckpointMeta,
    DamagedCheckpoint,
    examine,
    fsync_path,
)
from astrai.common.contract import (
    META_FILE,
    MODEL_CONFIG_FILE,
    OPTIMIZER_FILE,
    OPTIMIZER_TENSORS_FILE,
    RNG_FILE,
    SCHEDULER_FILE,
    TRAINER_STATE_FILE,
)
from astrai.common.errors import AstraiError
from astrai.common.model_folder import ModelConfig, ModelLoadError, inspect_weights, read_layout
from astrai.common.safetensors_file import CODES, header
from astrai.trainer.models.backend import backend_named
from astrai.trainer.models.lora import AdapterError

# What a damaged checkpoint file raises when read: truncated zip or safetensors, bad JSON,
# a pickle that weights_only refuses, missing keys or wrong types.
_DAMAGED = (OSError, ValueError, RuntimeError, EOFError, KeyError, TypeError, pickle.UnpicklingError, SafetensorError)


class CheckpointError(AstraiError):
    """A checkpoint could not be written, or the one every rank agreed on could not be read."""


class NonFiniteWeights(CheckpointError):
    """The weights to save hold NaN or infinity: the run diverged, and such a checkpoint is never written."""


@dataclass
class Progress:
    """Where the run is: what meta.json records and resume restores."""

    step: int = 0
    epoch: int = 0
    samples_in_epoch: int = 0
    """Windows of this epoch's permutation already trained on (all ranks together)."""
    tokens_seen: int = 0

    @classmethod
    def of(cls, meta: CheckpointMeta) -> Progress:
        return cls(meta.step, meta.epoch, meta.samples_in_epoch, meta.tokens_seen)

    # A stateful part of the run (astrai.trainer.checkpoint.state): meta.json holds it.
    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for name, value in state.items():
            setattr(self, name, int(value))


PROGRESS, SCHEDULE, RNG = "progress", "schedule", "rng"
"""The parts every run has, by the name its state goes under; the format gives each a file of its own."""
_PART_FILES = {SCHEDULE: SCHEDULER_FILE, RNG: RNG_FILE}
"""Where a part's state is written (progress: into meta.json); every other part goes into trainer_state.pt."""


@dataclass
class LoadedCheckpoint:
    checkpoint: Checkpoint
    meta: CheckpointMeta
    model_config: ModelConfig
    model_state: dict[str, torch.Tensor] | None
    """None when each rank reads its own rows of the weights and moments (``read_checkpoint(whole=False)``)."""
    optimizer_state: dict
    state: dict[str, dict | None]
    """Every part's saved state by part name (a part the folder has no state for: None)."""

    @property
    def progress(self) -> Progress:
        return Progress(**self.state[PROGRESS])

    @property
    def rng_state(self) -> dict[str, torch.Tensor] | None:
        """None when the folder has no rng_state.safetensors (resume then derives each rank's RNG seed)."""
        return self.state.get(RNG)


@dataclass
class SmallFiles:
    """What a checkpoint holds besides the weights and the optimizer's tensors; rank 0 writes them.

    They go first and are handed to the disk without waiting, so that their fsyncs at the end (:meth:`finish`)
    find them written: one journal commit instead of one each.
    """

    state: dict[str, dict]
    """The run's parts by name (RunState.state_dict): progress goes into meta, the others into their files."""
    model_config: ModelConfig
    meta: CheckpointMeta
    extra_files: dict[str, bytes] = field(default_factory=dict)
    """Files every checkpoint carries as they are, by name (the tokenizer's, the base model's generation config)."""

    def files(self) -> dict:
        """The small files by name: (content, writer)."""
        files = {
            SCHEDULER_FILE: (self.state[SCHEDULE], torch.save),
            RNG_FILE: (self.state[RNG], write_safetensors),
            MODEL_CONFIG_FILE: (self.model_config.to_json(), _write_text),
        }
        others = {name: state for name, state in self.state.items() if name not in (PROGRESS, *_PART_FILES)}
        if others:
            files[TRAINER_STATE_FILE] = (others, torch.save)
        return files

    def write(self, folder: Path) -> list[str]:
        """Write every small file and the extra ones, without waiting for the disk; their names."""
        small = self.files()
        for name, (content, write) in small.items():
            write_file(folder / name, content, write, durable=False)
        for name, content in self.extra_files.items():
            (folder / name).write_bytes(content)
        return [*small, *self.extra_files]

    def finish(self, folder: Path, written: list[str]) -> None:
        """Flush the files named ``written``, then write ``meta.json`` and flush the folder: the last step of a save."""
        for name in written:
            fsync_path(folder / name)
        write_file(folder / META_FILE, self.meta.to_json(), _write_text)
        fsync_path(folder)


def tree_bytes(tree) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(tree_bytes(value) for value in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tree_bytes(value) for value in tree)
    return 0


def write_failure(error: Exception, final: Path, needed: int) -> CheckpointError:
    """The error a failed write ends the run with; a full disk says so, where, and how much is missing."""
    try:
        free = shutil.disk_usage(final.parent).free
    except OSError:
        free = None
    if _is_disk_full(error) or (free is not None and free < needed):
        room = f"{_mib(free)} free there" if free is not None else "free space unknown"
        return CheckpointError(
            f"the disk is full: checkpoint {final.name} does not fit in {final.parent} ({room}, a checkpoint needs "
            f"about {_mib(needed)}; {error}); the earlier checkpoints are untouched. Free space, or lower "
            "ckpt.keep_last, or point runtime.paths.checkpoints at a larger disk, then start again to resume"
        )
    return CheckpointError(f"writing checkpoint {final} failed: {type(error).__name__}: {error}")


def _is_disk_full(error: BaseException | None) -> bool:
    """Whether ENOSPC or EDQUOT caused ``error``; torch's writers turn it into a RuntimeError that names it."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if os.strerror(errno.ENOSPC) in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _mib(count: int) -> str:
    return f"{count / (1 << 20):.1f} MiB"


def write_file(path: Path, content, write, *args, durable: bool = True) -> None:
    """``write(content, file, *args)`` into a new file at ``path``; then fsync it, or only start its writeback."""
    with _WritebackFile(path) as out:
        write(content, out, *args)
        if durable:
            os.fsync(out.fileno())
        else:
            submit_for_writeback(out.fileno())


def _write_text(text: str, out: io.RawIOBase) -> None:
    out.write(text.encode("utf-8"))


def safetensors_layout(
    shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> tuple[bytes, dict[str, int]]:
    """The start of a safetensors file holding tensors of these (dtype, shape), and where each one's data begins
    (:func:`astrai.common.safetensors_file.header`; the tensors of one width in name order)."""
    entries = []
    for name, (dtype, shape) in sorted(shapes.items()):
        code = CODES.get(str(dtype).removeprefix("torch."))
        if code is None:
            raise ValueError(f"{name}: dtype {dtype} cannot be stored in safetensors")
        entries.append((name, code, tuple(shape)))
    return header(entries, metadata)


def tensor_bytes(tensor: torch.Tensor):
    """A (CPU, contiguous) tensor's memory as a buffer, without a copy."""
    return tensor.detach().reshape(-1).view(torch.uint8).numpy()


def write_safetensors(
    tensors: dict[str, torch.Tensor], out: io.RawIOBase, metadata: dict[str, str] | None = None
) -> None:
    """Write ``tensors`` in the safetensors format into ``out``, each straight from its own memory.

    ``safetensors.torch.save_file`` opens the file itself; written into a :class:`_WritebackFile`
    instead, the start of the model is on its way to the disk while the rest is still being written.
    The file is the same format (readable by ``safetensors.safe_open``, Hugging Face included), laid
    out by :func:`safetensors_layout`.
    """
    head, offsets = safetensors_layout({name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}, metadata)
    out.write(head)
    for name in sorted(offsets, key=offsets.__getitem__):
        tensor = tensors[name]
        if tensor.numel():
            out.write(tensor_bytes(tensor.contiguous()))


def submit_for_writeback(fd: int, offset: int = 0, length: int = 0) -> None:
    """Hand a range of a file's dirty pages (length 0: to the end) to the disk without waiting for them."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


class _WritebackFile(io.FileIO):
    """A file that submits what it has written to the disk every few megabytes.

    The disk then writes the start of a large file while the rest is still being serialized, instead
    of the whole file waiting for the final fsync. On Linux, POSIX_FADV_DONTNEED submits a range's
    dirty pages for writeback without waiting for them; elsewhere the fsync does all the flushing.
    """

    CHUNK = 4 << 20

    def __init__(self, path: Path):
        super().__init__(path, "w")
        self._written = 0
        self._submitted = 0

    def write(self, data) -> int:
        # A raw write may stop short and torch.save ignores the count, so write until everything is out;
        # a large buffer goes out in CHUNK-sized writes, so its start is on its way to the disk while the
        # rest is still being copied into the page cache.
        view = memoryview(data).cast("B")
        count = 0
        while count < len(view):
            count += super().write(view[count : count + self.CHUNK])
            if self._written + count - self._submitted >= self.CHUNK:
                submit_for_writeback(self.fileno(), self._submitted, self._written + count - self._submitted)
                self._submitted = self._written + count
        self._written += count
        return count


def first_non_finite(tensors: dict[str, torch.Tensor]) -> str | None:
    """The name of a tensor that holds NaN or infinity, or None when all are finite.

    A sum is finite only when every element is, so one fp32 sum per tensor and a single read of the results
    clear the usual case (a tenth of the time of ``isfinite`` per element, which also reads the device once
    per tensor); only a tensor whose sum is not finite, which an overflow of large finite values can also
    cause, is checked element by element.
    """
    if not tensors:
        return None
    names = list(tensors)
    sums = torch.stack([tensors[name].detach().sum(dtype=torch.float32) for name in names])
    for name, finite in zip(names, torch.isfinite(sums).tolist(), strict=True):
        if not finite and not torch.isfinite(tensors[name]).all():
            return name
    return None


OPTIMIZER_TENSORS_KEY = "tensors_in"
"""optimizer.pt of a sharded checkpoint: ``{parameter: {key: name in optimizer.safetensors}}``."""


def own_copy(value):
    """A CPU copy of a tensor that is not a view of anything (other values as they are)."""
    return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def has_rows(value) -> bool:
    """Whether an optimizer state value goes to optimizer.safetensors (a tensor with rows), not optimizer.pt."""
    return isinstance(value, torch.Tensor) and value.dim() >= 1


def small_optimizer_state(folder: Path, shapes: dict[str, tuple[int, ...]]) -> dict:
    """optimizer.pt without its parameter-shaped tensors: what rank 0 reads and hands to every rank.

    A full checkpoint's optimizer.pt holds the moments too; it is mapped (``mmap=True``), so they are not read.
    Where the moments are (optimizer.pt, or a sharded checkpoint's optimizer.safetensors) is checked against
    ``shapes`` (each parameter's, by our name) from the headers alone, so a folder that would fail to load
    fails here, where the resume can still fall back to an older checkpoint.
    """
    state = torch.load(folder / OPTIMIZER_FILE, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(state, dict) or not isinstance(state.get("state"), dict):
        raise ValueError(f"{OPTIMIZER_FILE}: not an optimizer state")
    names = state.get(OPTIMIZER_TENSORS_KEY)
    if names is not None:
        layout = read_layout(folder / OPTIMIZER_TENSORS_FILE)[1]
        found = {
            (param, key): tuple(layout[name][1]) if name in layout else None
            for param, keys in names.items()
            for key, name in keys.items()
        }
    else:
        found = {
            (param, key): tuple(value.shape)
            for param, values in state["state"].items()
            for key, value in values.items()
            if has_rows(value)
        }
    for (param, key), shape in found.items():
        if shape != shapes.get(param):
            held = "is missing" if shape is None else f"is {list(shape)}"
            raise ValueError(f"the optimizer's {key} of {param} {held}; the model's {param} is {shapes.get(param)}")
    return {
        # Copies: a value read from the mapped file would keep all of it mapped for as long as the run holds it.
        "state": {
            param: {key: own_copy(value) for key, value in values.items() if not has_rows(value)}
            for param, values in state["state"].items()
        },
        "param_groups": state["param_groups"],
        OPTIMIZER_TENSORS_KEY: names,
    }


def join_optimizer_tensors(optimizer_state: dict, folder: Path) -> dict:
    """A sharded checkpoint's optimizer state made whole (its moments read from optimizer.safetensors)."""
    names = optimizer_state.pop(OPTIMIZER_TENSORS_KEY, None)
    if names is None:
        return optimizer_state
    tensors = load_file(folder / OPTIMIZER_TENSORS_FILE, device="cpu")
    for param, keys in names.items():
        for key, name in keys.items():
            optimizer_state["state"].setdefault(param, {})[key] = tensors[name]
    return optimizer_state


def read_checkpoint(checkpoint: Checkpoint, whole: bool = True, backend: str = BACKEND_NATIVE) -> LoadedCheckpoint:
    """Read and check every file of a checkpoint; anything damaged raises CheckpointError with the reason.

    The folder rule the host applies comes first (astrai.common.checkpoints.examine), so a folder
    the host does not list is never resumed; then every tensor is read and checked. With ``whole``
    false, the weights and the optimizer's parameter-shaped tensors are left out (``model_state`` is
    None): each rank reads its own rows of them (:func:`astrai.trainer.checkpoint.sharded.read_rows`). With
    ``backend`` transformers, the weights and adapters are under the transformers model's own module names.
    """
    path = checkpoint.path
    try:
        found = examine(path)
        model_config = load_model_config(path, backend)
        adapters = found.meta.lora is not None
        if whole or adapters:
            # The adapters' shapes are checked when they go into the model.
            model_state = backend_named(backend).read_checkpoint_weights(path, model_config, adapters)
            optimizer_state = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
            if isinstance(optimizer_state, dict):
                optimizer_state = join_optimizer_tensors(optimizer_state, path)
            names = set(model_state)
        else:
            # The weights' headers checked against the config, as read_weights checks them.
            summary = inspect_weights(path, model_config)
            shapes = {
                ours: tuple(summary.layouts[file][1][stored][1])
                for file, names in summary.names.items()
                for stored, ours in names.items()
            }
            model_state, optimizer_state = None, small_optimizer_state(path, shapes)
            names = set(shapes)
        if not isinstance(optimizer_state, dict) or not set(optimizer_state.get("state", {})) <= names:
            raise ValueError("optimizer.pt: not an optimizer state keyed by this model's parameter names")
        state = _read_parts(path, found.meta)
    except (ModelLoadError, DamagedCheckpoint, AdapterError) as error:
        raise CheckpointError(str(error)) from None
    except _DAMAGED as error:
        raise CheckpointError(f"{type(error).__name__}: {error}") from None
    return LoadedCheckpoint(found, found.meta, model_config, model_state, optimizer_state, state)


def _read_parts(path: Path, meta: CheckpointMeta) -> dict[str, dict | None]:
    """Every part's saved state: progress from meta.json, the schedule, the RNG states, the rest by name."""
    scheduler_state = torch.load(path / SCHEDULER_FILE, map_location="cpu", weights_only=True)
    if not isinstance(scheduler_state, dict):
        raise ValueError("scheduler.pt: not a scheduler state")
    state = {
        PROGRESS: Progress.of(meta).state_dict(),
        SCHEDULE: scheduler_state,
        RNG: load_file(path / RNG_FILE, device="cpu") if (path / RNG_FILE).is_file() else None,
    }
    if (path / TRAINER_STATE_FILE).is_file():
        others = torch.load(path / TRAINER_STATE_FILE, map_location="cpu", weights_only=True)
        if not isinstance(others, dict) or set(others) & set(state):
            raise ValueError(f"{TRAINER_STATE_FILE}: not the state of the run's parts by name")
        state.update(others)
    return state
