"""The job's checkpoint folder: naming, completeness, ordering, listing, retention.

This module owns the folder rules that the trainer (inside the container) and
the host tasks (`invoke latest`, `list`, `clean`, `status`, `preflight`) share,
so it imports neither torch nor Invoke.

Layout of a job dir (``<checkpoints>/<job_name>``)::

    epoch_0_step_200/        a checkpoint; complete when it holds REQUIRED_FILES
    .staging-epoch_0_step_400-<pid>-<token>/   being written; never read
    .trash-epoch_0_step_100-<token>/           being deleted; never read
    metrics.jsonl            one JSON line per progress report

A checkpoint is written under a staging name, flushed, then renamed, so a folder
under its final name is complete unless someone tampered with it; the readers
still check every required file rather than trusting that.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from astrai.common.contract import META_FILE, REQUIRED_FILES

STAGING_PREFIX = ".staging-"
TRASH_PREFIX = ".trash-"

# A checkpoint holds the weights in fp32 and AdamW's two fp32 moments per weight, plus small files
# (config, meta, scheduler, RNG states, serialization overhead) that this allows for.
FP32_BYTES = 4
ADAMW_MOMENTS = 2
SMALL_FILES_BYTES = 1 << 20

_NAME = re.compile(r"epoch_(0|[1-9][0-9]*)_step_(0|[1-9][0-9]*)")


@dataclass(frozen=True, order=True)
class Checkpoint:
    """One checkpoint folder; instances sort by (epoch, step), numerically."""

    epoch: int
    step: int
    path: Path = field(compare=False)

    @property
    def name(self) -> str:
        return self.path.name


@dataclass
class JobDirScan:
    """What one pass over a job dir found."""

    complete: list[Checkpoint]
    """Complete checkpoints, oldest first."""
    incomplete: list[Checkpoint]
    """Folders with a checkpoint name that miss a required file (ignored by resume)."""
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


def is_complete(path: Path) -> bool:
    """True when ``path`` is a real folder holding every required file as a regular file."""
    try:
        if path.is_symlink() or not path.is_dir():
            return False
        present = {entry.name for entry in os.scandir(path) if entry.is_file(follow_symlinks=False)}
    except OSError:
        return False
    return all(name in present for name in REQUIRED_FILES)


def scan_job_dir(job_dir: Path) -> JobDirScan:
    """Classify the entries of ``job_dir``; a missing job dir is simply empty.

    Symlinks are never followed: a link named like a checkpoint is neither
    listed nor deleted, so nothing outside the job dir can be reached.
    """
    complete: list[Checkpoint] = []
    incomplete: list[Checkpoint] = []
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
        parsed = parse_checkpoint_name(entry.name)
        if parsed is None:
            continue
        checkpoint = Checkpoint(parsed[0], parsed[1], Path(entry.path))
        (complete if is_complete(checkpoint.path) else incomplete).append(checkpoint)
    return JobDirScan(sorted(complete), sorted(incomplete), sorted(staging))


def list_complete_checkpoints(job_dir: Path) -> list[Checkpoint]:
    """Complete checkpoints of a job, oldest first by (epoch, step)."""
    return scan_job_dir(job_dir).complete


def latest_complete_checkpoint(job_dir: Path) -> Checkpoint | None:
    """The newest complete checkpoint, or None when there is none."""
    complete = list_complete_checkpoints(job_dir)
    return complete[-1] if complete else None


def plan_retention(checkpoints: list[Checkpoint], keep: int) -> tuple[list[Checkpoint], list[Checkpoint]]:
    """Split complete checkpoints into (kept, removed) so that the ``keep`` newest stay.

    ``keep`` must be at least 1: the newest complete checkpoint is never removed.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1 (the newest checkpoint is never removed), got {keep}")
    ordered = sorted(checkpoints)
    cut = max(len(ordered) - keep, 0)
    return ordered[cut:], ordered[:cut]


def read_meta(checkpoint: Checkpoint | Path) -> dict:
    """The parsed ``meta.json`` of a checkpoint (raises OSError or ValueError when unreadable)."""
    path = checkpoint.path if isinstance(checkpoint, Checkpoint) else Path(checkpoint)
    with open(path / META_FILE, encoding="utf-8") as handle:
        meta = json.load(handle)
    if not isinstance(meta, dict):
        raise ValueError(f"{path / META_FILE}: expected a JSON object")
    return meta


def new_staging_dir(job_dir: Path, name: str) -> Path:
    """Create and return a fresh staging folder for checkpoint ``name`` inside ``job_dir``."""
    job_dir.mkdir(parents=True, exist_ok=True)
    path = job_dir / f"{STAGING_PREFIX}{name}-{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir()
    return path


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (new names, renames) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(staging: Path, final: Path) -> None:
    """Make a fully written, flushed staging folder visible under its final name.

    An existing folder of that name (say a corrupt one from an earlier run) is
    first moved aside under a trash name, so the final name only ever points at
    a complete checkpoint; the old folder is deleted afterwards.
    """
    trash = None
    if final.exists() or final.is_symlink():
        trash = final.with_name(f"{TRASH_PREFIX}{final.name}-{secrets.token_hex(4)}")
        os.rename(final, trash)
    os.rename(staging, final)
    fsync_dir(final.parent)
    if trash is not None:
        _remove_tree(trash)


def remove_checkpoint(job_dir: Path, checkpoint: Checkpoint) -> None:
    """Delete one checkpoint folder of ``job_dir``, atomically from a reader's point of view.

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
