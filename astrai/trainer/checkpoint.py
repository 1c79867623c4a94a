"""The torch side of checkpoints: when to save, what goes in, writing in the background, loading with fallback.

The folder rules (names, completeness, staging, publish, retention) live in
:mod:`astrai.common.checkpoints`, shared with the host. A checkpoint folder holds::

    meta.json              progress, data position, reason, config hash (JSON)
    config.json            the model architecture (Hugging Face Llama form)
    model.safetensors      the full model, even under FSDP, under Hugging Face's tensor names
    optimizer.pt           full optimizer state keyed by parameter name (tensors and plain values only)
    scheduler.pt           learning-rate scheduler state (plain values only)
    rng_state.safetensors  every rank's torch RNG states

Only rank 0 (on node 0) reads and writes these files; the other ranks receive the state from it.

``optimizer.pt`` and ``scheduler.pt`` are read with ``torch.load(weights_only=True)``,
so a checkpoint folder can never run code.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_optimizer_state_dict,
)

from astrai.common.checkpoints import (
    SMALL_FILES_BYTES,
    Checkpoint,
    checkpoint_name,
    fsync_dir,
    list_complete_checkpoints,
    new_staging_dir,
    plan_retention,
    publish,
    read_meta,
    remove_checkpoint,
    remove_job_entry,
    scan_job_dir,
)
from astrai.common.contract import (
    META_FILE,
    MODEL_CONFIG_FILE,
    OPTIMIZER_FILE,
    REASON_EMERGENCY,
    REASON_FINAL,
    REASON_PERIODIC,
    REASONS,
    RNG_FILE,
    SCHEDULER_FILE,
    WEIGHTS_FILE,
)
from astrai.trainer.distributed import DistEnv, broadcast_from_master
from astrai.trainer.model import ModelConfig, ModelLoadError, hf_state_dict, read_weights

# What a damaged checkpoint file raises when read: truncated zip or safetensors, bad JSON,
# a pickle that weights_only refuses, missing keys or wrong types in meta.json.
_DAMAGED = (OSError, ValueError, RuntimeError, EOFError, KeyError, TypeError, pickle.UnpicklingError, SafetensorError)


class CheckpointError(Exception):
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


@dataclass
class LoadedCheckpoint:
    checkpoint: Checkpoint
    meta: dict
    progress: Progress
    model_config: ModelConfig
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict
    scheduler_state: dict
    rng_state: dict[str, torch.Tensor]


class CheckpointManager:
    """Checkpoint policy for one job dir: when to save, writing in the background, resuming with fallback.

    Rank 0 writes every file; other ranks only take part in the collectives that
    gather full state. Periodic saves copy the state to CPU and return while a
    background thread writes, flushes and publishes it; final and emergency saves
    wait; a new save first waits for the previous one.
    """

    def __init__(self, job_dir: Path, interval: int, keep_last: int | None, env: DistEnv, log: Callable[[str], None]):
        self.job_dir = Path(job_dir)
        self.interval = interval
        self.keep_last = keep_last
        self.env = env
        self.log = log
        self._host_copy = _HostCopy(pin=env.device.type == "cuda")
        self._writer: threading.Thread | None = None
        self._write_error: Exception | None = None
        self.extra_files: tuple[Path, ...] = ()
        """Files copied into every checkpoint as they are (the data's tokenizer files)."""

    def reason_for(self, step: int, max_steps: int, stopping: bool) -> str | None:
        """Why a checkpoint is due after ``step``, or None."""
        if step >= max_steps:
            return REASON_FINAL
        if stopping:
            return REASON_EMERGENCY
        if step % self.interval == 0:
            return REASON_PERIODIC
        return None

    def remove_leftovers(self) -> None:
        """Delete staging and trash folders that an interrupted save or delete left behind (rank 0)."""
        for path in scan_job_dir(self.job_dir).staging:
            remove_job_entry(self.job_dir, path)

    # Resuming

    def load_latest(self) -> LoadedCheckpoint | None:
        """The newest checkpoint that loads; ones that fail are skipped with a warning. None means start fresh.

        Rank 0 reads it (only node 0 needs the checkpoint folder); every other rank receives it from rank 0.
        """
        return broadcast_from_master(self.env, self._read_latest)

    def _read_latest(self) -> LoadedCheckpoint | None:
        scan = scan_job_dir(self.job_dir)
        for checkpoint in scan.incomplete:
            self.log(f"warning: skipping {checkpoint.path}: incomplete (a required file is missing)")
        for checkpoint in reversed(scan.complete):
            try:
                return read_checkpoint(checkpoint)
            except CheckpointError as error:
                self.log(f"warning: skipping {checkpoint.path}: {error}")
        return None

    def restore(self, loaded: LoadedCheckpoint, model: torch.nn.Module, optimizer, scheduler, seed: int) -> None:
        """Load optimizer, scheduler and this rank's RNG state (the weights went in before wrapping).

        Saved RNG states belong to the world size that wrote them. On another world size, each rank's
        RNG is seeded from (seed, step, rank) instead: nothing blocks the resume, and it is reproducible.
        """
        set_optimizer_state_dict(
            model, optimizer, loaded.optimizer_state, options=StateDictOptions(full_state_dict=True)
        )
        scheduler.load_state_dict(loaded.scheduler_state)
        cpu_key, cuda_key = f"rank{self.env.rank}.cpu", f"rank{self.env.rank}.cuda"
        saved_world = loaded.meta.get("world_size")
        if saved_world != self.env.world_size or cpu_key not in loaded.rng_state:
            torch.manual_seed(resumed_rank_seed(seed, loaded.progress.step, self.env.rank))
            self.log(
                f"note: the checkpoint holds the RNG states of {saved_world} process(es), this run has "
                f"{self.env.world_size}: each rank's RNG is seeded from random_seed, step and rank"
            )
            return
        torch.set_rng_state(loaded.rng_state[cpu_key])
        if cuda_key in loaded.rng_state and self.env.device.type == "cuda":
            torch.cuda.set_rng_state(loaded.rng_state[cuda_key], self.env.device)

    # Saving

    def save(
        self,
        model,
        optimizer,
        scheduler,
        model_config: ModelConfig,
        progress: Progress,
        reason: str,
        extra_meta: dict,
        wait: bool,
    ) -> Path:
        """Snapshot the training state now and write it as ``epoch_<E>_step_<S>`` (all ranks call this)."""
        if reason not in REASONS:
            raise ValueError(f"reason must be one of {REASONS}, got {reason!r}")
        self.wait()
        final = self.job_dir / checkpoint_name(progress.epoch, progress.step)
        fsdp = self.env.parallel_mode == "fsdp"
        # Full (unsharded) state. FSDP gathers it into fresh CPU tensors on rank 0 (other ranks get empty
        # dicts); otherwise the tensors are the live parameters and optimizer moments themselves.
        model_state, optimizer_state = get_state_dict(
            model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=fsdp)
        )
        rng_state = self._gather_rng_state()
        if self.env.master_process:
            # The full weights are here on rank 0 after every collective of the save, so the check costs no
            # extra collective; on failure nothing is written.
            bad = first_non_finite(model_state)
            if bad is not None:
                raise NonFiniteWeights(f"{bad} holds NaN or infinity")
            # Live tensors must be copied when training goes on during the write, or when they sit on a GPU.
            if not fsdp and (not wait or self.env.device.type != "cpu"):
                model_state, optimizer_state = self._host_copy.copy((model_state, optimizer_state))
            meta = {
                "epoch": progress.epoch,
                "step": progress.step,
                "reason": reason,
                "tokens_seen": progress.tokens_seen,
                "data_position": {"epoch": progress.epoch, "samples_in_epoch": progress.samples_in_epoch},
                "world_size": self.env.world_size,
                "parallel_mode": self.env.parallel_mode,
                "time": time.time(),
                **extra_meta,
            }
            files = _CheckpointFiles(
                model_state, optimizer_state, scheduler.state_dict(), rng_state, model_config, meta, self.extra_files
            )
            self._write_error = None
            self._writer = threading.Thread(
                target=self._write, args=(files, final, reason), name="checkpoint-writer", daemon=False
            )
            self._writer.start()
            if wait:
                self.wait()
        if wait and self.env.distributed:
            # No rank reports or exits before the checkpoint is on disk.
            dist.barrier(group=self.env.control_group)
        return final

    def wait(self) -> None:
        """Block until the save in progress (if any) is published; re-raise its error."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._write_error is not None:
            error, self._write_error = self._write_error, None
            raise error

    def finish_pending(self, timeout: float) -> None:
        """Give a background save in progress up to ``timeout`` seconds to be published (a lost node's last act).

        Its state was copied before the write began, so it is complete and consistent even though the job is
        ending; a write still running when the time is up is left as a staging folder, never published.
        """
        writer = self._writer
        if writer is not None:
            writer.join(timeout)

    def raise_if_failed(self) -> None:
        """Raise a background save's error as soon as it happened; never waits for a save that is running."""
        if self._write_error is not None:
            self.wait()

    def _gather_rng_state(self) -> dict[str, torch.Tensor]:
        local = {"cpu": torch.get_rng_state()}
        if self.env.device.type == "cuda":
            local["cuda"] = torch.cuda.get_rng_state(self.env.device)
        if not self.env.distributed:
            return {f"rank{self.env.rank}.{kind}": state for kind, state in local.items()}
        states = {}
        for kind, state in local.items():
            gathered = [torch.empty_like(state) for _ in range(self.env.world_size)]
            dist.all_gather(gathered, state, group=self.env.control_group)
            states.update({f"rank{rank}.{kind}": tensor for rank, tensor in enumerate(gathered)})
        return states

    def _write(self, files: _CheckpointFiles, final: Path, reason: str) -> None:
        staging = None
        try:
            staging = new_staging_dir(self.job_dir, final.name)
            files.write(staging)
            publish(staging, final)
            staging = None
            if self.keep_last is not None:
                self._apply_retention(Checkpoint(files.meta["epoch"], files.meta["step"], final))
            if reason == REASON_PERIODIC:
                self.log(f"saved periodic checkpoint {final}")
        except Exception as error:  # any failure: wait() hands it to the main thread
            try:
                if staging is not None and staging.exists():
                    remove_job_entry(self.job_dir, staging)
            finally:
                self._write_error = _write_failure(error, final, files.nbytes())

    def _apply_retention(self, newest: Checkpoint) -> None:
        # Only checkpoints up to the one just written count: a newer leftover (one that failed to load)
        # must not push good checkpoints out.
        candidates = [c for c in list_complete_checkpoints(self.job_dir) if c <= newest]
        for old in plan_retention(candidates, self.keep_last)[1]:
            remove_checkpoint(self.job_dir, old)
            self.log(f"removed old checkpoint {old.path} (keep_last={self.keep_last})")


@dataclass
class _CheckpointFiles:
    model_state: dict
    optimizer_state: dict
    scheduler_state: dict
    rng_state: dict
    model_config: ModelConfig
    meta: dict
    extra_files: tuple[Path, ...] = ()

    def nbytes(self) -> int:
        """About how much disk the checkpoint takes: its tensors plus the small files."""
        return _tree_bytes((self.model_state, self.optimizer_state, self.rng_state)) + SMALL_FILES_BYTES

    def write(self, folder: Path) -> None:
        """Write every file into ``folder`` and flush it to disk; meta.json goes last.

        The small files go first and are handed to the disk without waiting, so that their fsyncs at the
        end find them written (one journal commit instead of one each). The two large files are written
        at the same time, ``model.safetensors`` by a helper thread and ``optimizer.pt`` by this one: both
        go to the page cache in parallel (the kernel's copy runs without the GIL), and each file's fsync
        overlaps the other's serialization. Tensors are written straight from their memory, never copied
        into an intermediate buffer.
        """
        small = {
            SCHEDULER_FILE: (self.scheduler_state, torch.save),
            RNG_FILE: (self.rng_state, _write_safetensors),
            MODEL_CONFIG_FILE: (self.model_config.to_json(), _write_text),
        }
        for name, (content, write) in small.items():
            _write_file(folder / name, content, write, durable=False)
        for source in self.extra_files:
            shutil.copyfile(source, folder / source.name)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-model") as pool:
            # Hugging Face names and config.json: the folder loads in transformers as it is.
            model = pool.submit(
                _write_file,
                folder / WEIGHTS_FILE,
                hf_state_dict(self.model_state),
                _write_safetensors,
                {"format": "pt"},
            )
            _write_file(folder / OPTIMIZER_FILE, self.optimizer_state, torch.save)
            model.result()
        for name in [*small, *(source.name for source in self.extra_files)]:
            _fsync(folder / name)
        _write_file(folder / META_FILE, json.dumps(self.meta, indent=2, sort_keys=True) + "\n", _write_text)
        fsync_dir(folder)


def _tree_bytes(tree) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_tree_bytes(value) for value in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tree_bytes(value) for value in tree)
    return 0


def _write_failure(error: Exception, final: Path, needed: int) -> CheckpointError:
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


def _write_file(path: Path, content, write, *args, durable: bool = True) -> None:
    """``write(content, file, *args)`` into a new file at ``path``; then fsync it, or only start its writeback."""
    with _WritebackFile(path) as out:
        write(content, out, *args)
        if durable:
            os.fsync(out.fileno())
        else:
            _submit_for_writeback(out.fileno())


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text(text: str, out: io.RawIOBase) -> None:
    out.write(text.encode("utf-8"))


# safetensors' names for the dtypes a checkpoint holds.
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def _write_safetensors(
    tensors: dict[str, torch.Tensor], out: io.RawIOBase, metadata: dict[str, str] | None = None
) -> None:
    """Write ``tensors`` in the safetensors format into ``out``, each straight from its own memory.

    ``safetensors.torch.save_file`` opens the file itself; written into a :class:`_WritebackFile`
    instead, the start of the model is on its way to the disk while the rest is still being written.
    The file is the same format (readable by ``safetensors.safe_open``, Hugging Face included).
    Layout: an 8-byte little-endian header length, the JSON header (names, dtypes, shapes, byte
    ranges; padded with spaces to a multiple of 8), then the raw little-endian data. Wider dtypes come
    first, so every tensor starts aligned to its itemsize.
    """
    ordered = sorted(tensors.items(), key=lambda item: (-item[1].element_size(), item[0]))
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, tensor in ordered:
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: dtype {tensor.dtype} cannot be stored in safetensors")
        size = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    out.write(len(encoded).to_bytes(8, "little") + encoded)
    for _, tensor in ordered:
        if tensor.numel():
            out.write(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _submit_for_writeback(fd: int, offset: int = 0, length: int = 0) -> None:
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
                _submit_for_writeback(self.fileno(), self._submitted, self._written + count - self._submitted)
                self._submitted = self._written + count
        self._written += count
        return count


class _HostCopy:
    """Reusable CPU copies of a state tree, taken so that training can go on while a thread writes them.

    The buffers are allocated by the first save and reused by the next ones (a new save waits for the
    previous one), which spares the page faults of fresh memory on every save; on CUDA they are pinned
    so the device-to-host copy runs at full speed.
    """

    def __init__(self, pin: bool):
        self.pin = pin
        self.buffers: dict[tuple, torch.Tensor] = {}

    def copy(self, tree):
        copied = self._copy(tree, ())
        if self.pin:
            torch.cuda.synchronize()
        return copied

    def _copy(self, tree, path: tuple):
        if isinstance(tree, torch.Tensor):
            buffer = self.buffers.get(path)
            if buffer is None or buffer.shape != tree.shape or buffer.dtype != tree.dtype:
                buffer = self.buffers[path] = torch.empty(tree.shape, dtype=tree.dtype, pin_memory=self.pin)
            return buffer.copy_(tree.detach(), non_blocking=self.pin)
        if isinstance(tree, dict):
            return {key: self._copy(value, (*path, key)) for key, value in tree.items()}
        if isinstance(tree, (list, tuple)):
            return type(tree)(self._copy(value, (*path, index)) for index, value in enumerate(tree))
        return tree


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


def resumed_rank_seed(seed: int, step: int, rank: int) -> int:
    """The RNG seed of ``rank`` when resuming at ``step`` on a world size other than the checkpoint's."""
    return (seed * 1_000_003 + step) * 1_009 + rank


def read_checkpoint(checkpoint: Checkpoint) -> LoadedCheckpoint:
    """Read and check every file of a checkpoint; anything damaged raises CheckpointError with the reason."""
    path = checkpoint.path
    try:
        meta = read_meta(checkpoint)
        position = meta["data_position"]
        progress = Progress(
            step=_int(meta, "step"),
            epoch=_int(meta, "epoch"),
            samples_in_epoch=_int(position, "samples_in_epoch"),
            tokens_seen=_int(meta, "tokens_seen"),
        )
        if (progress.epoch, progress.step) != (checkpoint.epoch, checkpoint.step):
            raise ValueError(f"meta.json says epoch {progress.epoch} step {progress.step}, the folder name disagrees")
        model_config = ModelConfig.load(path)
        model_state = read_weights(path, model_config)
        optimizer_state = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        if not isinstance(optimizer_state, dict) or not set(optimizer_state.get("state", {})) <= set(model_state):
            raise ValueError("optimizer.pt: not an optimizer state keyed by this model's parameter names")
        scheduler_state = torch.load(path / SCHEDULER_FILE, map_location="cpu", weights_only=True)
        if not isinstance(scheduler_state, dict):
            raise ValueError("scheduler.pt: not a scheduler state")
        rng_state = load_file(path / RNG_FILE, device="cpu")
    except ModelLoadError as error:
        raise CheckpointError(str(error)) from None
    except _DAMAGED as error:
        raise CheckpointError(f"{type(error).__name__}: {error}") from None
    return LoadedCheckpoint(
        checkpoint, meta, progress, model_config, model_state, optimizer_state, scheduler_state, rng_state
    )


def _int(values: dict, key: str) -> int:
    value = values[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"meta.json: {key} must be a non-negative integer, got {value!r}")
    return value
