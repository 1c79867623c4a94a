"""The sharded checkpoint format (``ckpt.format: sharded``): every rank writes and reads only its own rows.

A sharded checkpoint is the same folder as a full one, file for file, plus one file::

    model.safetensors      the whole model under Hugging Face's names: one ordinary safetensors file,
                           into which each rank wrote the rows it holds, at their offsets
    optimizer.safetensors  every parameter-shaped optimizer tensor (AdamW's two moments) as
                           ``<parameter>/<key>``, laid out whole and written the same way
    optimizer.pt           the rest of the optimizer state (steps, parameter groups) and, under
                           OPTIMIZER_TENSORS_KEY, which tensors optimizer.safetensors holds

FSDP shards every parameter along its first dimension as ``torch.chunk`` does (:func:`row_range`), so
each rank knows where its rows go in a file every rank lays out alike (the header follows from the
full shapes alone): no rank ever holds another rank's rows, in a save or in a load. Under DDP or one
process, where every rank holds everything, each still writes only its own chunk of rows.

A save: rank 0 creates the staging folder and both files at their full size (header written, data
not yet); each rank writes its rows and flushes them; the ranks agree that every one of them
succeeded; rank 0 writes the small files and ``meta.json`` and renames the folder into place. A
rank that fails its write fails the save on every rank and the staging folder is removed; a rank
that dies leaves it behind, unpublished, and the next start removes it.

A load reads, for each tensor, the rows this rank holds straight into its shard, from a sharded
folder or a full one (whose optimizer.pt is mapped, never read whole), so a checkpoint resumes on
any world size and in either format.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from astrai.common.contract import OPTIMIZER_FILE, OPTIMIZER_TENSORS_FILE, SHARED_FS_CHECK_PREFIX, WEIGHTS_FILE
from astrai.common.model_folder import ModelConfig, expert_pieces, hf_name, saved_name
from astrai.common.safetensors_file import FLOAT_DTYPES, read_layout
from astrai.trainer.checkpoint.files import (
    OPTIMIZER_TENSORS_KEY,
    CheckpointError,
    first_non_finite,
    has_rows,
    own_copy,
    safetensors_layout,
    submit_for_writeback,
    tensor_bytes,
    write_file,
)
from astrai.trainer.launch.distributed import DistEnv, gather_objects

_CHUNK = 64 << 20
"""Bytes per write or read call; each written chunk is handed to the disk at once."""


def _expert_pieces(config: ModelConfig) -> dict[str, list]:
    """Our stacked expert tensors -> [(stored name, ExpertPiece)], each expert's matrices as save_pretrained
    writes them."""
    pieces: dict[str, list] = {}
    for stored, piece in expert_pieces(config, per_expert=True).items():
        pieces.setdefault(piece.name, []).append((stored, piece))
    return pieces


def row_range(rows: int, rank: int, world: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of a ``rows``-row tensor that ``rank`` of ``world`` holds (torch.chunk's split)."""
    chunk = math.ceil(rows / world)
    start = min(rank * chunk, rows)
    return start, min(start + chunk, rows)


def _held_rows(value: torch.Tensor, rank: int, world: int) -> tuple[int, torch.Tensor]:
    """(first row, the rows) of ``value`` this rank writes: its FSDP shard, or its chunk of a whole tensor."""
    if isinstance(value, DTensor):
        if tuple(value.placements) != (Shard(0),):
            raise CheckpointError(f"a tensor placed {value.placements} cannot be saved sharded (only Shard(0))")
        mesh = value.device_mesh
        start, stop = row_range(value.shape[0], mesh.get_local_rank(), mesh.size())
        local = value.to_local()
        if tuple(local.shape) != (stop - start, *value.shape[1:]):
            raise CheckpointError(f"a shard of shape {tuple(local.shape)} is not rows {start}:{stop} of {value.shape}")
        return start, local
    start, stop = row_range(value.shape[0], rank, world)
    return start, value[start:stop]


@dataclass
class _Piece:
    file: str
    name: str
    start: int
    """First row held."""
    rows: torch.Tensor
    row_bytes: int


class ShardedState:
    """This rank's rows of the model and optimizer state, placed in the files of a sharded checkpoint.

    ``model_state`` and ``optimizer_state`` are what ``get_state_dict(full_state_dict=False)`` returns:
    DTensor shards under FSDP, whole tensors otherwise; ``config`` names the weights as its family does.
    """

    def __init__(self, model_state: dict, optimizer_state: dict, rank: int, world: int, config: ModelConfig):
        self.rank = rank
        self.world = world
        self.pieces: list[_Piece] = []
        shapes: dict[str, dict] = {WEIGHTS_FILE: {}, OPTIMIZER_TENSORS_FILE: {}}
        experts = _expert_pieces(config)
        for name, value in model_state.items():
            if name in experts:
                self._add_experts(shapes, experts[name], value, rank, world)
            else:
                self._add(shapes, WEIGHTS_FILE, saved_name(name, config), value, rank, world)
        rest, names = {}, {}
        for param, values in optimizer_state["state"].items():
            # Copied now: the optimizer updates its step counters in place while a periodic save is written.
            rest[param] = {key: own_copy(value) for key, value in values.items() if not has_rows(value)}
            names[param] = {}
            for key, value in values.items():
                if has_rows(value):
                    names[param][key] = f"{param}/{key}"
                    self._add(shapes, OPTIMIZER_TENSORS_FILE, names[param][key], value, rank, world)
        self.optimizer_rest = {
            "state": rest,
            "param_groups": optimizer_state["param_groups"],
            OPTIMIZER_TENSORS_KEY: names,
        }
        """What optimizer.pt holds (rank 0 writes it)."""
        self.layouts = {
            file: safetensors_layout(entries, {"format": "pt"} if file == WEIGHTS_FILE else None)
            for file, entries in shapes.items()
        }
        self.file_sizes = {
            file: len(self.layouts[file][0])
            + sum(math.prod(shape) * dtype.itemsize for dtype, shape in entries.values())
            for file, entries in shapes.items()
        }

    def _add(self, shapes: dict, file: str, name: str, value: torch.Tensor, rank: int, world: int) -> None:
        shapes[file][name] = (value.dtype, tuple(value.shape))
        start, rows = _held_rows(value, rank, world)
        row_bytes = math.prod(value.shape[1:]) * value.dtype.itemsize
        self.pieces.append(_Piece(file, name, start, rows, row_bytes))

    def _add_experts(self, shapes: dict, pieces: list, value: torch.Tensor, rank: int, world: int) -> None:
        """A stacked expert tensor as save_pretrained writes it, one matrix per expert and projection: each rank
        writes the matrices of the experts (rows) it holds."""
        start, rows = _held_rows(value, rank, world)
        for stored, piece in pieces:
            shape = piece.shape(tuple(value.shape))
            shapes[WEIGHTS_FILE][stored] = (value.dtype, shape)
            if start <= piece.expert < start + rows.shape[0]:
                held = dataclasses.replace(piece, expert=piece.expert - start).select(rows)
                self.pieces.append(_Piece(WEIGHTS_FILE, stored, 0, held, math.prod(shape[1:]) * value.dtype.itemsize))

    writes = True
    """Every rank writes its own rows (a Snapshot of astrai.trainer.checkpoint.formats)."""

    def first_non_finite(self) -> str | None:
        return first_non_finite({piece.name: piece.rows for piece in self.pieces if piece.file == WEIGHTS_FILE})

    def nbytes(self) -> int:
        """This rank's bytes to write, times the ranks: about what the checkpoint's tensors take on disk."""
        return sum(piece.rows.numel() * piece.rows.element_size() for piece in self.pieces) * self.world

    def copy_to_host(self, copy) -> None:
        """Replace the rows by host copies (``copy`` maps a list of tensors to their copies), so training may go on."""
        for piece, copied in zip(self.pieces, copy([piece.rows for piece in self.pieces]), strict=True):
            piece.rows = copied

    def create(self, staging: Path) -> None:
        """Rank 0: each file with its header, at its full size; the data is written by every rank."""
        for file, (head, _) in self.layouts.items():
            with open(staging / file, "wb") as out:
                out.write(head)
                out.truncate(self.file_sizes[file])

    def write(self, staging: Path) -> None:
        """This rank's rows; rank 0 also the rest of the optimizer state (optimizer.pt)."""
        self.write_rows(staging)
        if self.rank == 0:
            write_file(staging / OPTIMIZER_FILE, self.optimizer_rest, torch.save)

    def write_rows(self, folder: Path) -> None:
        """Write this rank's rows at their offsets and flush them to disk."""
        for file, (_, offsets) in self.layouts.items():
            fd = os.open(folder / file, os.O_WRONLY)
            try:
                for piece in self.pieces:
                    if piece.file == file and piece.rows.numel():
                        rows = piece.rows if piece.rows.is_contiguous() else piece.rows.contiguous()
                        _pwrite_all(fd, tensor_bytes(rows), offsets[piece.name] + piece.start * piece.row_bytes)
                os.fsync(fd)
            finally:
                os.close(fd)


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        count = os.pwrite(fd, view[done : done + _CHUNK], offset + done)
        submit_for_writeback(fd, offset + done, count)
        done += count


# --- Reading -----------------------------------------------------------------------------------------


class _RowReader:
    """Reads rows of the tensors of one safetensors file into tensors given, at most _CHUNK bytes at a time."""

    def __init__(self, path: Path):
        self.path = path
        self.start, self.layout = read_layout(path)
        self.fd = os.open(path, os.O_RDONLY)

    def close(self) -> None:
        os.close(self.fd)

    def read_into(self, name: str, start: int, target: torch.Tensor, shape: tuple[int, ...]) -> None:
        """Rows ``start:start + len(target)`` of tensor ``name``, which must have exactly ``shape``, into ``target``."""
        if name not in self.layout:
            raise CheckpointError(f"{self.path}: holds no tensor {name}")
        dtype, stored_shape, (begin, _) = self.layout[name]
        if tuple(stored_shape) != tuple(shape):
            raise CheckpointError(f"{self.path}: {name} is {list(stored_shape)}, this run's is {list(shape)}")
        if not target.numel():
            return
        stored = getattr(torch, FLOAT_DTYPES[dtype]) if dtype in FLOAT_DTYPES else None
        if stored is None:
            raise CheckpointError(f"{self.path}: {name} is stored as {dtype}, not a float dtype a checkpoint holds")
        row_bytes = math.prod(shape[1:]) * stored.itemsize
        offset = self.start + begin + start * row_bytes
        if target.device.type == "cpu" and target.dtype == stored and target.is_contiguous():
            self._read(tensor_bytes(target), offset, name)
            return
        # Another dtype or device: through a buffer of at most _CHUNK bytes' worth of rows.
        step = max(1, _CHUNK // max(row_bytes, 1))
        for first in range(0, target.shape[0], step):
            rows = target[first : first + step]
            buffer = torch.empty(rows.shape, dtype=stored)
            self._read(tensor_bytes(buffer), offset + first * row_bytes, name)
            rows.copy_(buffer)

    def _read(self, into, offset: int, name: str) -> None:
        view = memoryview(into).cast("B")
        done = 0
        while done < len(view):
            count = os.preadv(self.fd, [view[done : done + _CHUNK]], offset + done)
            if not count:
                raise CheckpointError(f"{self.path}: ends inside {name}")
            done += count


def _local_target(value: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(first row, the tensor to fill) for reading ``value``: its shard under FSDP, all of it otherwise."""
    if isinstance(value, DTensor):
        mesh = value.device_mesh
        return row_range(value.shape[0], mesh.get_local_rank(), mesh.size())[0], value.to_local()
    return 0, value


def read_rows(
    folder: Path, small_optimizer: dict, model_state: dict, optimizer_state: dict, config: ModelConfig
) -> None:
    """Fill ``model_state`` and ``optimizer_state`` (this rank's ``get_state_dict`` of the built model) in place.

    Each tensor gets only the rows this rank holds, from a sharded or a full checkpoint, and must have
    exactly the shape of this run's; the optimizer's other values and its parameter groups come from
    ``small_optimizer`` (:func:`small_optimizer_state`).
    """
    weights = _RowReader(folder / WEIGHTS_FILE)
    experts = _expert_pieces(config)
    try:
        with torch.no_grad():
            for name, value in model_state.items():
                start, target = _local_target(value)
                if name in experts and hf_name(name, config) not in weights.layout:
                    # One matrix per expert (as save_pretrained writes them): those of the experts held here.
                    for stored, piece in experts[name]:
                        if start <= piece.expert < start + target.shape[0]:
                            part = dataclasses.replace(piece, expert=piece.expert - start).select(target)
                            weights.read_into(stored, 0, part, piece.shape(tuple(value.shape)))
                    continue
                stored = hf_name(name, config) if hf_name(name, config) in weights.layout else saved_name(name, config)
                weights.read_into(stored, start, target, tuple(value.shape))
    finally:
        weights.close()
    saved = small_optimizer["state"]
    names = small_optimizer.get(OPTIMIZER_TENSORS_KEY)
    if names is not None:
        moments = _RowReader(folder / OPTIMIZER_TENSORS_FILE)
        read = moments.read_into
    else:
        whole = torch.load(folder / OPTIMIZER_FILE, map_location="cpu", weights_only=True, mmap=True)["state"]
        moments = None

        def read(name: str, start: int, target: torch.Tensor, shape: tuple[int, ...]) -> None:
            param, key = name.rsplit("/", 1)
            source = whole[param][key]
            if tuple(source.shape) != shape:
                raise CheckpointError(f"{folder / OPTIMIZER_FILE}: {name} is {list(source.shape)}, not {list(shape)}")
            target.copy_(source[start : start + target.shape[0]])

    try:
        with torch.no_grad():
            for param, values in optimizer_state["state"].items():
                for key, value in list(values.items()):
                    if has_rows(value):
                        start, target = _local_target(value)
                        name = names[param][key] if names is not None else f"{param}/{key}"
                        read(name, start, target, tuple(value.shape))
                    else:
                        values[key] = saved[param][key]
    except KeyError as error:
        raise CheckpointError(f"{folder}: the optimizer state holds no {error} for this run's parameters") from None
    finally:
        if moments is not None:
            moments.close()
    optimizer_state["param_groups"] = small_optimizer["param_groups"]


# --- Agreeing ----------------------------------------------------------------------------------------


_TOKEN_BYTES = 32


def check_shared_job_dir(job_dir: Path, env: DistEnv) -> None:
    """On several nodes, refuse to start unless every node writes into the very folder node 0 reads.

    What a save does, in small: rank 0 creates a file in the job dir, the first rank of each node
    writes a token of its own into it at its node's offset and flushes it, and rank 0 reads every
    token back. A folder each node has on its own disk, one a node may not write, or a file system
    that keeps only one writer's copy of a file fails it, before any step is taken.
    """
    nodes = env.world_size // max(env.local_world_size, 1)
    if nodes <= 1:
        return
    created = [None]
    if env.master_process:
        name = f"{SHARED_FS_CHECK_PREFIX}{secrets.token_hex(8)}"
        try:
            with open(job_dir / name, "wb") as out:
                out.truncate(nodes * _TOKEN_BYTES)
                os.fsync(out.fileno())
            created[0] = name
        except OSError as error:
            created[0] = OSError(error.errno, f"node 0 cannot write into the job dir {job_dir}: {error.strerror}")
            with contextlib.suppress(OSError):
                (job_dir / name).unlink(missing_ok=True)
    dist.broadcast_object_list(created, src=0, group=env.control_group)
    if not isinstance(created[0], str):
        raise CheckpointError(f"ckpt.format sharded: {created[0].strerror}")
    path = job_dir / created[0]
    problems: list = [None]
    try:
        written = None
        if env.local_rank == 0:
            token = secrets.token_hex(_TOKEN_BYTES // 2).encode("ascii")
            try:
                fd = os.open(path, os.O_WRONLY)
                try:
                    os.pwrite(fd, token, env.node * _TOKEN_BYTES)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                written = token.decode("ascii")
            except FileNotFoundError:
                written = OSError("the file node 0 created there is not there")
            except OSError as error:
                written = OSError(f"it cannot write there ({error.strerror})")
        answers = gather_objects(env, (env.node, written))
        if env.master_process:
            problems[0] = _unshared(path, answers)
        dist.broadcast_object_list(problems, src=0, group=env.control_group)
    finally:
        if env.master_process:
            path.unlink(missing_ok=True)
    if problems[0]:
        listed = "; ".join(f"node {node}: {why}" for node, why in problems[0])
        raise CheckpointError(
            f"ckpt.format sharded: node(s) {', '.join(str(node) for node, _ in problems[0])} do not share the job "
            f"dir {job_dir} with node 0 ({listed}). In this format every rank writes its own part of each "
            "checkpoint into that folder, so runtime.paths.checkpoints must be one shared file system mounted "
            "read-write on every node (NFS, Lustre, a parallel or cloud file system that takes writes at offsets "
            "from several hosts); or set ckpt.format: full, with which only node 0 writes checkpoints"
        )


def _unshared(path: Path, answers: list) -> list[tuple[int, str]]:
    """(node, why) for each node whose token rank 0 does not read back from ``path``."""
    try:
        data = path.read_bytes()
    except OSError as error:
        return [(0, f"node 0 cannot read {path.name} back ({error.strerror})")]
    problems = []
    for node, written in answers:
        if isinstance(written, OSError):
            problems.append((node, str(written)))
        elif written is not None and data[node * _TOKEN_BYTES : (node + 1) * _TOKEN_BYTES] != written.encode():
            problems.append(
                (
                    node,
                    "what it wrote there does not reach node 0 (a folder of its own, or a file system "
                    "that keeps one writer's copy of a file)",
                )
            )
    return problems
