"""Checkpoint policy for one run: when to save, the one save path, the background writer, resuming with fallback.

What a save holds and how it is written and read is the format's (:mod:`astrai.trainer.checkpoint.formats`:
``full``, where rank 0 gathers and writes the state, or ``sharded``, where every rank writes its own rows);
the files are :mod:`astrai.trainer.checkpoint.files`, the folder rules :mod:`astrai.common.checkpoints`.
Every format is saved the same way: snapshot, check, copy, stage, write, agree, publish, retain.
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from astrai.common.backends import BACKEND_NATIVE
from astrai.common.checkpoints import (
    CheckpointMeta,
    checkpoint_name,
    new_staging_dir,
    plan_retention,
    publish,
    remove_checkpoint,
    remove_job_entry,
    scan_job_dir,
)
from astrai.common.contract import CKPT_FORMAT_FULL, REASON_EMERGENCY, REASON_FINAL, REASON_PERIODIC, REASONS
from astrai.common.model_folder import ModelConfig
from astrai.trainer.checkpoint.files import (
    CheckpointError,
    LoadedCheckpoint,
    NonFiniteWeights,
    SmallFiles,
    read_checkpoint,
    write_failure,
)
from astrai.trainer.checkpoint.formats import FORMATS, CheckpointFormat, Snapshot
from astrai.trainer.checkpoint.state import RunState
from astrai.trainer.launch.distributed import DistEnv, broadcast_from_master, failed_ranks
from astrai.trainer.models.optim import Optimizers


def load_latest(
    job_dir: Path, env: DistEnv, log: Callable[[str], None], whole: bool = True, backend: str = BACKEND_NATIVE
) -> LoadedCheckpoint | None:
    """The newest checkpoint that loads; ones that fail are skipped with a warning. None means start fresh.

    Rank 0 reads it; every other rank receives it from rank 0 (in the full format only node 0 needs the
    checkpoint folder). With ``whole`` false only the small files travel: each rank then reads its own rows
    of the weights and the optimizer's moments (:meth:`CheckpointManager.restore`). ``backend``: which code computes
    the model (model.backend resolved), which decides how its weights are named.
    """
    return broadcast_from_master(env, lambda: _read_latest(Path(job_dir), log, whole, backend))


def _read_latest(job_dir: Path, log: Callable[[str], None], whole: bool, backend: str) -> LoadedCheckpoint | None:
    scan = scan_job_dir(job_dir)
    for folder in scan.damaged:
        log(f"warning: skipping {folder.path}: not a checkpoint ({folder.reason})")
    for checkpoint in reversed(scan.complete):
        try:
            return read_checkpoint(checkpoint, whole, backend)
        except CheckpointError as error:
            log(f"warning: skipping {checkpoint.path}: {error}")
    return None


@dataclass(frozen=True)
class RunFacts:
    """What every checkpoint of this run records besides its progress."""

    config_hash: str
    max_steps: int
    window_size: int
    global_batch: int
    train_type: str = "seq"
    reference: dict | None = None
    """DPO: the frozen reference (path, sha256), never saved itself."""
    optimizer: str | None = None
    data_digest: str | None = None
    lora: dict | None = None
    """LoRA: its settings and the base model the adapters belong to (LoRASettings.record)."""
    rewards: dict | None = None
    """The types that learn from rewards: the settings of a step (astrai.common.config.reward_settings)."""
    trackers: dict | None = None
    """The experiment tracker runs (log.report_to) by tracker name: their run ids, known once each has opened."""


class CheckpointManager:
    """Saves one run's model, optimizer and parts (RunState), handed over once; periodic saves run in the background.

    Periodic saves copy the state to host memory and return while a background thread writes,
    flushes and publishes it; final and emergency saves wait; a new save first waits for the
    previous one. In the full format rank 0 writes every file; in the sharded one every rank writes
    its own rows and rank 0 the rest.
    """

    def __init__(
        self,
        job_dir: Path,
        env: DistEnv,
        log: Callable[[str], None],
        *,
        model: torch.nn.Module,
        optimizer: Optimizers,
        parts: RunState,
        model_config: ModelConfig,
        facts: RunFacts,
        interval: int,
        keep_last: int | None = None,
        extra_files: dict[str, bytes] | None = None,
        format: str | CheckpointFormat = CKPT_FORMAT_FULL,
    ):
        self.job_dir = Path(job_dir)
        self.env = env
        self.log = log
        self.model = model
        self.optimizer = optimizer
        self.parts = parts
        """Everything else a checkpoint holds, saved and restored as one collection (progress, schedule, RNG...)."""
        self.model_config = model_config
        self.facts = facts
        self.interval = interval
        self.keep_last = keep_last
        self.extra_files = dict(extra_files or {})
        """Files written into every checkpoint as they are, by name (the data's tokenizer files, the base model's
        generation config): read once at start, so a data folder prepared again meanwhile changes nothing."""
        self.format = FORMATS[format] if isinstance(format, str) else format
        """full: rank 0 gathers the state and writes it; sharded: every rank writes its own rows."""
        self._host_copy = _HostCopy(pin=env.device.type == "cuda")
        self._writer: threading.Thread | None = None
        self._write_error: Exception | None = None
        if env.master_process:
            self.job_dir.mkdir(parents=True, exist_ok=True)
            # Staging and trash folders an interrupted save or delete left behind.
            for path in scan_job_dir(self.job_dir).staging:
                remove_job_entry(self.job_dir, path)
        self.format.check_job_dir(self.job_dir, env)

    def reason_for(self, step: int, stopping: bool) -> str | None:
        """Why a checkpoint is due after ``step``, or None."""
        if step >= self.facts.max_steps:
            return REASON_FINAL
        if stopping:
            return REASON_EMERGENCY
        if step % self.interval == 0:
            return REASON_PERIODIC
        return None

    # Resuming

    def restore(self, loaded: LoadedCheckpoint) -> None:
        """Load the optimizer's state (the weights went in before wrapping, unless each rank reads its own rows),
        then every part's, in order."""
        self.format.restore(self.model, self.optimizer, loaded, self.env)
        self.parts.load_state_dict(loaded.state)

    # Saving

    def save(self, reason: str, wait: bool) -> Path:
        """Snapshot the training state now and write it as ``epoch_<E>_step_<S>`` (all ranks call this).

        One path for every format: wait for the previous save, snapshot, check, copy, stage, write (in the
        background for a periodic save), agree, publish, retain.
        """
        if reason not in REASONS:
            raise ValueError(f"reason must be one of {REASONS}, got {reason!r}")
        self._wait_everywhere()
        progress = self.parts.progress
        final = self.job_dir / checkpoint_name(progress.epoch, progress.step)
        snapshot = self.format.snapshot(self.model, self.optimizer, self.env)
        bad = snapshot.first_non_finite()
        if failed_ranks(self.env, bad is not None, self.env.control_group):  # nothing is written
            raise NonFiniteWeights(f"{bad or 'a weight'} holds NaN or infinity")
        states = self._parts_state(wait)
        # Live tensors must be copied when training goes on during the write, or when they sit on a GPU.
        if not wait or self.env.device.type != "cpu":
            snapshot.copy_to_host(self._host_copy.copy)
        small = None
        if self.env.master_process:
            small = SmallFiles(states, self.model_config, self._meta(reason), self.extra_files)
        staging = self._stage(snapshot, final)
        if snapshot.writes:
            self._write_error = None
            self._writer = threading.Thread(
                target=self._write, args=(snapshot, small, staging, final, reason), name="checkpoint-writer"
            )
            self._writer.start()
        if wait:
            # No rank reports or exits before the checkpoint is on disk, and every rank learns if it is not.
            self._wait_everywhere()
        return final

    def _parts_state(self, wait: bool) -> dict[str, dict]:
        """Every part's state (all ranks call this: a part may gather); a periodic save, written while training
        goes on, gets its own copy, so a part whose state_dict hands out live values is still saved as it was."""
        states = self.parts.state_dict()
        return states if wait else copy.deepcopy(states)

    def _stage(self, snapshot: Snapshot, final: Path) -> Path:
        """Rank 0 creates the staging folder and what the writers need in it; every rank learns where, or why not."""
        created: list = [None]
        if self.env.master_process:
            staging = None
            try:
                staging = new_staging_dir(self.job_dir, final.name)
                snapshot.create(staging)
                created[0] = str(staging)
            except Exception as error:  # every rank raises it below
                created[0] = write_failure(error, final, snapshot.nbytes())
                if staging is not None:
                    with contextlib.suppress(OSError):  # else left as a staging folder, which the next start removes
                        remove_job_entry(self.job_dir, staging)
        if self.env.distributed:
            dist.broadcast_object_list(created, src=0, group=self.env.control_group)
        if not isinstance(created[0], str):
            raise created[0]
        return Path(created[0])

    def _write(self, snapshot: Snapshot, small: SmallFiles | None, staging: Path, final: Path, reason: str) -> None:
        """The writer thread of each rank that writes: rank 0's small files and this rank's share, agreement,
        then rank 0's meta.json and publish, agreement again, then retention."""
        error: Exception | None = None
        failed: list[int] = []
        written: list[str] = []
        try:
            if small is not None:
                written = small.write(staging)
            snapshot.write(staging)
        except Exception as failure:  # every writing rank learns of it below
            error = failure
        try:
            failed = self._agree(error is not None)
            if not failed:
                if small is not None:
                    try:
                        small.finish(staging, written)
                        publish(staging, final)
                    except Exception as failure:  # rank 0 could not finish: the others learn of it below
                        error = failure
                failed = self._agree(error is not None)
        except Exception as failure:  # the agreement itself failed: a rank is gone
            error = error or failure
            failed = failed or [self.env.rank]
        if not failed:
            if small is not None:
                self._published(final, small.meta, reason)
            return
        try:
            if small is not None and staging.exists():
                remove_job_entry(self.job_dir, staging)
        finally:
            if error is not None:
                self._write_error = write_failure(error, final, snapshot.nbytes())
            else:
                self._write_error = CheckpointError(
                    f"writing checkpoint {final} failed on rank {failed[0]} (its error is in that rank's output)"
                )

    def _agree(self, failed: bool) -> list[int]:
        """The writing ranks that failed: agreed by every rank when every rank writes, else this rank's own word."""
        if not self.format.every_rank_writes:
            return [self.env.rank] if failed else []
        return failed_ranks(self.env, failed, self.env.checkpoint_group)

    def _published(self, final: Path, meta: CheckpointMeta, reason: str) -> None:
        """Rank 0, once a checkpoint is in place: the retention rule, and a word for a periodic save."""
        try:
            if self.keep_last is not None:
                self._apply_retention((meta.epoch, meta.step))
        except Exception as failure:  # the checkpoint is published; the run stops at the next step
            self._write_error = CheckpointError(
                f"checkpoint {final} is written, but removing older ones (ckpt.keep_last) failed: {failure}"
            )
        if reason == REASON_PERIODIC:
            self.log(f"saved periodic checkpoint {final}")

    def host_copy_bytes(self) -> int:
        """Host memory the periodic saves keep for their copies of the state (reused from one save to the next)."""
        return self._host_copy.held_bytes

    def _wait_everywhere(self) -> None:
        """Wait for the save in progress; if it failed on any rank, raise on every rank (before any collective)."""
        error = None
        try:
            self.wait()
        except CheckpointError as failure:
            error = failure
        failed = failed_ranks(self.env, error is not None, self.env.control_group)
        if error is not None:
            raise error
        if failed:
            raise CheckpointError(
                f"rank {failed[0]} reported a checkpoint error (its message is in that rank's output); "
                "the run stops here"
            )

    def _meta(self, reason: str) -> CheckpointMeta:
        progress = self.parts.progress
        return CheckpointMeta(
            epoch=progress.epoch,
            step=progress.step,
            reason=reason,
            world_size=self.env.world_size,
            tokens_seen=progress.tokens_seen,
            samples_in_epoch=progress.samples_in_epoch,
            parallel_mode=self.env.parallel_mode,
            time=time.time(),
            config_hash=self.facts.config_hash,
            max_steps=self.facts.max_steps,
            window_size=self.facts.window_size,
            global_batch=self.facts.global_batch,
            train_type=self.facts.train_type,
            reference=self.facts.reference,
            format=self.format.name,
            optimizer=self.facts.optimizer,
            data_digest=self.facts.data_digest,
            lora=self.facts.lora,
            rewards=self.facts.rewards,
            trackers=self.facts.trackers,
        )

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

    @property
    def failed(self) -> bool:
        """Whether a background save on this rank has failed (a Python flag: never waits, never syncs)."""
        return self._write_error is not None

    def raise_failure(self) -> None:
        """A background save failed on some rank: raise this rank's error, or say which save failed elsewhere."""
        self.wait()
        raise CheckpointError(
            "a background checkpoint failed on another rank (its error is in that rank's output); the run stops here"
        )

    def _apply_retention(self, newest: tuple[int, int]) -> None:
        # Only checkpoints up to the one just written count: a newer leftover (one that failed to load)
        # must not push good checkpoints out; folders that are not checkpoints never count.
        candidates = [c for c in scan_job_dir(self.job_dir).complete if (c.epoch, c.step) <= newest]
        for old in plan_retention(candidates, self.keep_last)[1]:
            remove_checkpoint(self.job_dir, old)
            self.log(f"removed old checkpoint {old.path} (keep_last={self.keep_last})")


ARENA_ALIGNMENT = 64
"""Bytes each tensor's copy is aligned to in the host arena (a cache line; every dtype's element size divides it)."""


class _HostCopy:
    """Reusable CPU copies of a state tree, taken so that training can go on while a thread writes them.

    Every tensor's copy is a view into one arena, allocated by the first save at the tree's exact size (each tensor
    at an offset aligned to :data:`ARENA_ALIGNMENT` bytes) and reused by the next saves (a new save waits for the
    previous one), which spares the page faults of fresh memory on every save. On CUDA the arena is pinned by
    registering it with the driver, so the device-to-host copies run at full speed; torch's pinned allocator would
    round each block up to a power of two (up to twice the state in host memory).
    """

    def __init__(self, pin: bool):
        self.pin = pin
        self.arena: torch.Tensor | None = None
        self.views: dict[tuple, torch.Tensor] = {}

    def copy(self, tree):
        leaves = dict(_leaves(tree, ()))
        if {path: (t.dtype, t.shape) for path, t in leaves.items()} != {
            path: (v.dtype, v.shape) for path, v in self.views.items()
        }:
            self._allocate(leaves)
        for path, tensor in leaves.items():
            self.views[path].copy_(tensor.detach(), non_blocking=self.pin)
        if self.pin:
            torch.cuda.synchronize()
        return _rebuilt(tree, (), self.views)

    @property
    def held_bytes(self) -> int:
        """Host memory the copies take (the arena)."""
        return 0 if self.arena is None else self.arena.numel()

    def _allocate(self, leaves: dict[tuple, torch.Tensor]) -> None:
        self.release()
        offsets, total = {}, 0
        for path, tensor in leaves.items():
            total = -(-total // ARENA_ALIGNMENT) * ARENA_ALIGNMENT
            offsets[path] = total
            total += tensor.numel() * tensor.element_size()
        arena = torch.empty(total, dtype=torch.uint8)
        if self.pin and total:
            _host_register(arena)
        self.arena = arena
        self.views = {
            path: arena[offsets[path] : offsets[path] + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for path, t in leaves.items()
        }

    def release(self) -> None:
        """Unpin and drop the arena (the copies of the last save are no longer used)."""
        if self.arena is not None and self.pin and self.arena.numel():
            torch.cuda.cudart().cudaHostUnregister(self.arena.data_ptr())
        self.arena, self.views = None, {}


def _host_register(arena: torch.Tensor) -> None:
    """Pin an existing host allocation (page-locked, portable to every device), as its exact size."""
    error = int(torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), arena.numel(), 1))
    if error != 0:
        raise CheckpointError(f"pinning {arena.numel()} bytes of host memory for checkpoint copies: CUDA error {error}")


def _leaves(tree, path: tuple):
    """(path, tensor) of every tensor in a tree of dicts, lists and tuples, in order."""
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(tree, (list, tuple)):
        for index, value in enumerate(tree):
            yield from _leaves(value, (*path, index))


def _rebuilt(tree, path: tuple, views: dict):
    """``tree`` with each tensor replaced by its copy."""
    if isinstance(tree, torch.Tensor):
        return views[path]
    if isinstance(tree, dict):
        return {key: _rebuilt(value, (*path, key), views) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_rebuilt(value, (*path, index), views) for index, value in enumerate(tree))
    return tree
