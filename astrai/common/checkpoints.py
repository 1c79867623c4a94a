"""The job's checkpoint folder: naming, what counts as a checkpoint, ordering, listing, retention, ``meta.json``.

This module owns the folder rules that the trainer (inside the container) and
the host tasks (`invoke latest`, `list`, `clean`, `status`, `preflight`) share,
so it imports neither torch nor Invoke.

Layout of a job dir (``<checkpoints>/<job_name>``)::

    epoch_0_step_200/        a checkpoint (see below)
    .staging-epoch_0_step_400-<pid>-<token>/   being written; never read
    .trash-epoch_0_step_100-<token>/           being deleted; never read
    metrics.jsonl            one JSON line per progress report

A folder named ``epoch_<E>_step_<S>`` is a **checkpoint** when it holds every
file of ``REQUIRED_FILES`` as a regular file, its ``meta.json`` is a readable
record whose epoch and step agree with the name, and the files it holds are
whole: the weights' safetensors headers describe exactly the bytes on disk,
``optimizer.pt`` and ``scheduler.pt`` are whole zip archives (what
``torch.save`` writes), ``config.json`` is a model config we can read, and a
checkpoint whose ``meta.json`` names the sharded format holds a whole
``optimizer.safetensors`` (the optimizer's moments) too. Every
check reads file headers only, so listing a thousand checkpoints stays fast.

A folder with the name that fails a check is *not a checkpoint* for any
command: resume skips it, it never counts toward ``--keep`` or ``keep_last``,
it is listed apart with the reason, and only ``invoke clean --damaged`` removes
it. The trainer applies this same rule first and then loads the tensors, so a
folder it resumes from is one the host lists.

A checkpoint is written under a staging name, flushed, then renamed, so a folder
under its final name is complete unless someone tampered with it or the disk lost it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import secrets
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from astrai.common.backends import load_model_config
from astrai.common.contract import (
    CKPT_FORMAT_SHARDED,
    CKPT_FORMATS,
    META_FILE,
    OPTIMIZER_FILE,
    OPTIMIZER_TENSORS_FILE,
    REASON_EMERGENCY,
    REASONS,
    REQUIRED_FILES,
    RNG_FILE,
    SCHEDULER_FILE,
    WEIGHTS_FILE,
)
from astrai.common.model_folder import ADAPTER_TARGETS, ModelLoadError, read_header

STAGING_PREFIX = ".staging-"
TRASH_PREFIX = ".trash-"

# A checkpoint holds the weights in fp32 and AdamW's two fp32 moments per weight, plus small files
# (config, meta, scheduler, RNG states, serialization overhead) that this allows for.
FP32_BYTES = 4
ADAMW_MOMENTS = 2
SMALL_FILES_BYTES = 1 << 20

_NAME = re.compile(r"epoch_(0|[1-9][0-9]*)_step_(0|[1-9][0-9]*)")


class DamagedCheckpoint(ValueError):
    """A folder named like a checkpoint that is not one; the message says which file and why."""


@dataclass(frozen=True)
class CheckpointMeta:
    """What ``meta.json`` records: where the run was, why it saved, and with which settings.

    One typed record, written by the trainer and read by the trainer, the host commands and the
    demo alike. Keys this version does not know are ignored when read, so older and newer trainers
    can read each other's folders.
    """

    epoch: int
    step: int
    reason: str
    """Why it was written: periodic, final or emergency."""
    world_size: int
    """Processes that trained it; their RNG states are in rng_state.safetensors."""
    tokens_seen: int = 0
    samples_in_epoch: int = 0
    """Windows of this epoch's permutation already trained on (all ranks together)."""
    parallel_mode: str = "none"
    time: float = 0.0
    """Unix time of the save."""
    config_hash: str | None = None
    """Short hash of the resolved trainer config that wrote it."""
    max_steps: int | None = None
    window_size: int | None = None
    global_batch: int | None = None
    """Sequences per optimizer step when it was written."""
    train_type: str | None = None
    """seq, sft or dpo (absent in checkpoints older than post-training: seq)."""
    reference: dict | None = None
    """DPO only: the frozen reference model it was trained against, ``{"path": ..., "sha256": ...}``."""
    format: str | None = None
    """How it was written: full or sharded (absent in checkpoints older than the sharded format: full)."""
    optimizer: str | None = None
    """adamw or muon: whose moments optimizer.pt holds (absent in older checkpoints)."""
    data_digest: str | None = None
    """Which prepared data it trained on: a digest of the data folders' manifests (absent in older checkpoints)."""
    trackers: dict | None = None
    """The experiment tracker runs the job reports to: each tracker's name (mlflow, wandb) and its run id."""
    lora: dict | None = None
    """LoRA only: ``{"rank", "alpha", "dropout", "targets", "base": {"path", "sha256"}}``. The folder's weights are
    then the adapters alone (PEFT's names), config.json the base model's, and ``base`` which base they belong to
    (sha256: astrai.common.model_folder.base_digest)."""

    rewards: dict | None = None
    """The types that learn from rewards: the settings that shape a step (reward functions, sampling, GRPO's
    keys, by their training.* names), so a resume that changes them says so."""

    def to_dict(self) -> dict:
        values = dataclasses.asdict(self)
        samples = values.pop("samples_in_epoch")
        values["data_position"] = {"epoch": self.epoch, "samples_in_epoch": samples}
        return {key: value for key, value in values.items() if value is not None}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False) + "\n"

    @classmethod
    def from_dict(cls, raw) -> CheckpointMeta:
        """The record of a parsed ``meta.json``; DamagedCheckpoint names the first key that is wrong."""
        if not isinstance(raw, dict):
            raise DamagedCheckpoint(f"{META_FILE}: expected a JSON object, got {type(raw).__name__}")
        position = raw.get("data_position", {})
        if not isinstance(position, dict):
            raise DamagedCheckpoint(f"{META_FILE}: data_position must be an object, got {position!r}")
        values = {
            "epoch": _count(raw, "epoch"),
            "step": _count(raw, "step"),
            "reason": raw.get("reason"),
            "world_size": _count(raw, "world_size", minimum=1),
            "tokens_seen": _count(raw, "tokens_seen", default=0),
            "samples_in_epoch": _count(position, "samples_in_epoch", default=0),
            "parallel_mode": raw.get("parallel_mode", "none"),
            "time": raw.get("time", 0.0),
            "config_hash": raw.get("config_hash"),
            "max_steps": _count(raw, "max_steps", default=None, minimum=1),
            "window_size": _count(raw, "window_size", default=None, minimum=1),
            "global_batch": _count(raw, "global_batch", default=None, minimum=1),
            "train_type": raw.get("train_type"),
            "reference": raw.get("reference"),
            "format": raw.get("format"),
            "optimizer": raw.get("optimizer"),
            "data_digest": raw.get("data_digest"),
            "lora": raw.get("lora"),
            "rewards": raw.get("rewards") if isinstance(raw.get("rewards"), dict) else None,
            "trackers": _tracker_ids(raw.get("trackers")),
        }
        if values["reason"] not in REASONS:
            allowed = ", ".join(REASONS)
            raise DamagedCheckpoint(f"{META_FILE}: reason must be one of {allowed}, got {raw.get('reason')!r}")
        if not isinstance(values["parallel_mode"], str) or not isinstance(values["config_hash"], (str, type(None))):
            raise DamagedCheckpoint(f"{META_FILE}: parallel_mode and config_hash must be strings")
        if values["format"] not in (None, *CKPT_FORMATS):
            raise DamagedCheckpoint(
                f"{META_FILE}: format must be one of {', '.join(CKPT_FORMATS)}, got {values['format']!r}"
            )
        for key in ("train_type", "optimizer", "data_digest"):
            if not isinstance(values[key], (str, type(None))):
                raise DamagedCheckpoint(f"{META_FILE}: {key} must be a string, got {values[key]!r}")
        reference = values["reference"]
        if reference is not None and not (
            isinstance(reference, dict) and all(isinstance(reference.get(key), str) for key in ("path", "sha256"))
        ):
            raise DamagedCheckpoint(f"{META_FILE}: reference must be an object with path and sha256, got {reference!r}")
        _check_lora(values["lora"])
        moment = values["time"]
        if isinstance(moment, bool) or not isinstance(moment, (int, float)) or not math.isfinite(moment):
            raise DamagedCheckpoint(f"{META_FILE}: time must be a number, got {moment!r}")
        return cls(**values)

    @classmethod
    def read(cls, folder: Path) -> CheckpointMeta:
        """The record in ``folder/meta.json``; DamagedCheckpoint when it is missing, unreadable or malformed."""
        path = Path(folder) / META_FILE
        try:
            raw = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise DamagedCheckpoint(f"{META_FILE} is missing") from None
        except OSError as error:
            raise DamagedCheckpoint(f"{META_FILE}: cannot be read ({error.strerror})") from None
        except ValueError as error:
            raise DamagedCheckpoint(f"{META_FILE}: not valid JSON ({error})") from None
        return cls.from_dict(raw)


def _check_lora(lora) -> None:
    if lora is None:
        return
    base = lora.get("base") if isinstance(lora, dict) else None
    rank = lora.get("rank") if isinstance(lora, dict) else None
    targets = lora.get("targets") if isinstance(lora, dict) else None
    if not (
        isinstance(rank, int)
        and not isinstance(rank, bool)
        and rank >= 1
        and _is_number(lora.get("alpha"))
        and _is_number(lora.get("dropout", 0.0))
        and isinstance(targets, list)
        and targets
        and all(isinstance(name, str) and name in ADAPTER_TARGETS for name in targets)
        and isinstance(base, dict)
        and all(isinstance(base.get(key), str) for key in ("path", "sha256"))
    ):
        raise DamagedCheckpoint(
            f"{META_FILE}: lora must be an object with rank, alpha, dropout, targets (of {', '.join(ADAPTER_TARGETS)}) "
            f"and base (path, sha256), got {lora!r}"
        )


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(values: dict, key: str, *, default=..., minimum: int = 0):
    if key not in values and default is not ...:
        return default
    value = values.get(key)
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise DamagedCheckpoint(f"{META_FILE}: {key} must be an integer of at least {minimum}, got {value!r}")
    return value


@dataclass(frozen=True, order=True)
class Checkpoint:
    """One checkpoint folder; instances sort by (epoch, step), numerically."""

    epoch: int
    step: int
    path: Path = field(compare=False)
    meta: CheckpointMeta | None = field(default=None, compare=False, repr=False)
    """Its meta.json, read when the folder was found to be a checkpoint."""

    @property
    def name(self) -> str:
        return self.path.name


@dataclass(frozen=True)
class NotACheckpoint:
    """A folder named like a checkpoint that is not one (see the module docstring), and why."""

    path: Path
    reason: str

    @property
    def name(self) -> str:
        return self.path.name


@dataclass
class JobDirScan:
    """What one pass over a job dir found."""

    complete: list[Checkpoint]
    """Checkpoints (the folders that pass every check), oldest first."""
    damaged: list[NotACheckpoint]
    """Folders with a checkpoint name that are not checkpoints: a missing file, an unreadable or wrong meta.json,
    a truncated file. Never resumed, never counted for retention, only removed when asked."""
    staging: list[Path]
    """Staging and trash folders left behind by an interrupted save or delete."""


def checkpoint_name(epoch: int, step: int) -> str:
    return f"epoch_{epoch}_step_{step}"


def parse_checkpoint_name(name: str) -> tuple[int, int] | None:
    """(epoch, step) for a canonical checkpoint folder name, else None."""
    match = _NAME.fullmatch(name)
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2))


def examine(path: Path) -> Checkpoint:
    """``path`` as a checkpoint, or DamagedCheckpoint saying why it is not one (headers only, no tensors read)."""
    parsed = parse_checkpoint_name(path.name)
    if parsed is None:
        raise DamagedCheckpoint(f"{path.name} is not a checkpoint name (epoch_<E>_step_<S>)")
    try:
        if path.is_symlink() or not path.is_dir():
            raise DamagedCheckpoint("not a folder")
        present = {entry.name for entry in os.scandir(path) if entry.is_file(follow_symlinks=False)}
    except OSError as error:
        raise DamagedCheckpoint(f"cannot be read ({error.strerror})") from None
    missing = [name for name in REQUIRED_FILES if name not in present]
    if missing:
        raise DamagedCheckpoint(f"incomplete: {', '.join(missing)} missing")
    meta = CheckpointMeta.read(path)
    if (meta.epoch, meta.step) != parsed:
        raise DamagedCheckpoint(f"{META_FILE} says epoch {meta.epoch} step {meta.step}, the folder name disagrees")
    try:
        load_model_config(path)
        read_header(path / WEIGHTS_FILE)
        if RNG_FILE in present:
            read_header(path / RNG_FILE)
        if meta.format == CKPT_FORMAT_SHARDED:
            if OPTIMIZER_TENSORS_FILE not in present:
                raise DamagedCheckpoint(f"incomplete: {OPTIMIZER_TENSORS_FILE} missing (a sharded checkpoint)")
            read_header(path / OPTIMIZER_TENSORS_FILE)
    except ModelLoadError as error:
        raise DamagedCheckpoint(str(error).replace(f"{path}/", "").replace(f"{path}: ", "")) from None
    for name in (OPTIMIZER_FILE, SCHEDULER_FILE):
        try:
            with zipfile.ZipFile(path / name):
                pass
        except (OSError, zipfile.BadZipFile, ValueError) as error:
            raise DamagedCheckpoint(f"{name}: damaged or truncated ({error})") from None
    return Checkpoint(parsed[0], parsed[1], path, meta)


def is_complete(path: Path) -> bool:
    """True when ``path`` is a checkpoint by the rule above."""
    try:
        examine(path)
    except DamagedCheckpoint:
        return False
    return True


def scan_job_dir(job_dir: Path) -> JobDirScan:
    """Classify the entries of ``job_dir``; a missing job dir is simply empty.

    Symlinks are never followed: a link named like a checkpoint is neither
    listed nor deleted, so nothing outside the job dir can be reached.
    """
    complete: list[Checkpoint] = []
    damaged: list[NotACheckpoint] = []
    staging: list[Path] = []
    try:
        entries = list(os.scandir(job_dir))
    except FileNotFoundError:
        entries = []
    for entry in entries:
        if not entry.is_dir(follow_symlinks=False):
            continue
        if entry.name.startswith((STAGING_PREFIX, TRASH_PREFIX)):
            staging.append(Path(entry.path))
            continue
        if parse_checkpoint_name(entry.name) is None:
            continue
        try:
            complete.append(examine(Path(entry.path)))
        except DamagedCheckpoint as error:
            damaged.append(NotACheckpoint(Path(entry.path), str(error)))
    order = {item.path: parse_checkpoint_name(item.name) for item in damaged}
    return JobDirScan(sorted(complete), sorted(damaged, key=lambda item: order[item.path]), sorted(staging))


def list_complete_checkpoints(job_dir: Path) -> list[Checkpoint]:
    """Checkpoints of a job, oldest first by (epoch, step)."""
    return scan_job_dir(job_dir).complete


def latest_complete_checkpoint(job_dir: Path) -> Checkpoint | None:
    """The newest checkpoint, or None when there is none."""
    complete = list_complete_checkpoints(job_dir)
    return complete[-1] if complete else None


def emergency_since(job_dir: Path, moment: float | None) -> Checkpoint | None:
    """The newest checkpoint if it is an emergency one written since ``moment`` (a Unix time; None: whenever), else
    None: what a stop that began then left. A second of slack covers file systems that keep whole seconds."""
    newest = latest_complete_checkpoint(job_dir)
    if newest is None or newest.meta.reason != REASON_EMERGENCY:
        return None
    if moment is not None and newest.path.stat().st_mtime < moment - 1:
        return None
    return newest


def plan_retention(checkpoints: list[Checkpoint], keep: int) -> tuple[list[Checkpoint], list[Checkpoint]]:
    """Split checkpoints into (kept, removed) so that the ``keep`` newest stay.

    ``keep`` must be at least 1: the newest checkpoint is never removed. Only checkpoints go in:
    folders that are not checkpoints are never counted, so they cannot push a good one out.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1 (the newest checkpoint is never removed), got {keep}")
    ordered = sorted(checkpoints)
    cut = max(len(ordered) - keep, 0)
    return ordered[cut:], ordered[:cut]


def new_staging_dir(job_dir: Path, name: str) -> Path:
    """Create and return a fresh staging folder for checkpoint ``name`` inside ``job_dir``."""
    job_dir.mkdir(parents=True, exist_ok=True)
    path = job_dir / f"{STAGING_PREFIX}{name}-{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir()
    return path


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a folder's entries (new names, renames), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(staging: Path, final: Path) -> None:
    """Make a fully written, flushed staging folder visible under its final name.

    An existing folder of that name (say a damaged one from an earlier run) is
    first moved aside under a trash name, so the final name only ever points at
    a complete checkpoint; the old folder is deleted afterwards.
    """
    trash = None
    if final.exists() or final.is_symlink():
        trash = final.with_name(f"{TRASH_PREFIX}{final.name}-{secrets.token_hex(4)}")
        os.rename(final, trash)
    os.rename(staging, final)
    fsync_path(final.parent)
    if trash is not None:
        _remove_tree(trash)


def remove_checkpoint(job_dir: Path, checkpoint: Checkpoint | NotACheckpoint) -> None:
    """Delete one checkpoint folder (or a folder that is not one) of ``job_dir``, atomically for a reader.

    The folder is renamed to a trash name first, so an interrupted delete never
    leaves a half-deleted folder under a checkpoint name.
    """
    remove_job_entry(job_dir, checkpoint.path, rename_first=True)


def remove_job_entry(job_dir: Path, path: Path, rename_first: bool = False) -> None:
    """Delete a folder that sits directly in ``job_dir``; refuse anything else."""
    if path.parent.resolve() != job_dir.resolve() or path.is_symlink() or not path.is_dir():
        raise ValueError(f"refusing to delete {path}: not a folder directly inside {job_dir}")
    if rename_first:
        trash = job_dir / f"{TRASH_PREFIX}{path.name}-{secrets.token_hex(4)}"
        os.rename(path, trash)
        path = trash
    _remove_tree(path)


def _remove_tree(path: Path) -> None:
    # rmtree removes symlinks found inside the tree without following them.
    shutil.rmtree(path)


def estimate_checkpoint_bytes(num_parameters: int) -> int:
    """About how large one checkpoint of a model with ``num_parameters`` weights is."""
    return num_parameters * FP32_BYTES * (1 + ADAMW_MOMENTS) + SMALL_FILES_BYTES


def folder_bytes(path: Path) -> int:
    """Total size of the regular files directly inside ``path``."""
    return sum(
        entry.stat(follow_symlinks=False).st_size for entry in os.scandir(path) if entry.is_file(follow_symlinks=False)
    )


def _tracker_ids(value) -> dict | None:
    """The tracker run ids of a checkpoint, text ids only (a damaged entry starts a new tracker run, no more)."""
    if not isinstance(value, dict):
        return None
    return {name: run_id for name, run_id in value.items() if isinstance(name, str) and isinstance(run_id, str)} or None
