"""`invoke export`: a checkpoint (or any model folder) as a standalone Hugging Face model folder.

The source is a checkpoint of the job (astrai/common/checkpoints.py decides what
is one) or any folder holding ``config.json`` and safetensors weights
(``model.safetensors``, or shards listed in ``model.safetensors.index.json``).
The export holds every tensor of the source under the same name, converted to
the dtype asked for (or as stored), in one ``model.safetensors`` or in shards of
at most ``--max-shard-size`` with the index transformers writes; ``config.json``
with its dtype set; and the tokenizer's and the model folder's other files. It
never holds a checkpoint's training state (``meta.json``, the optimizer, the
scheduler, the RNG states, any ``*.pt``).

Tensors are streamed: each is read, converted and written in pieces of at most
``CHUNK_BYTES``, so the memory an export takes does not grow with the model.
The conversions are those of torch's ``Tensor.to`` on a CPU, bit for bit, NaN
aside: a NaN stays a quiet NaN of the same sign, but its payload bits may differ
from torch's (which has no single answer: its vectorised and scalar paths differ).

The folder is written under a hidden staging name next to ``--out``, flushed, and
renamed into place, so ``--out`` either does not exist or holds the whole export.

A LoRA checkpoint exports merged (the base with its adapters folded in, W + alpha/r * B A in float32) or as a PEFT
adapter folder (``--adapter``). A run whose base was held in 4 bits (``training.lora_base_dtype: nf4``) exports
merged as the model it trained: each NF4 matrix quantised and dequantised once (astrai.common.nf4.round_trip, the
trainer's arithmetic), the adapters folded into that, the embeddings and head rounded to the bfloat16 they were
held in; then written in the dtype asked for.
Torch-free: NumPy does the arithmetic, and is imported only when an export runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import math
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from astrai.common.checkpoints import CheckpointMeta, DamagedCheckpoint, examine, fsync_path, parse_checkpoint_name
from astrai.common.contract import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    CHECKPOINT_INTERNALS,
    CONTAINER_MODEL,
    MODEL_CONFIG_FILE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
)
from astrai.common.errors import AstraiError
from astrai.common.model_config import read_config_json
from astrai.common.model_folder import (
    PEFT_EXPERT_PARAMETERS,
    ExpertPiece,
    ModelConfig,
    ModelLoadError,
    expert_pieces,
    hf_name,
    other_base,
    peft_adapter_config,
    peft_expert_adapter,
    peft_modules_of,
    peft_target,
    read_layout,
    weight_files,
)
from astrai.common.nf4 import NF4, held_matrices, round_trip
from astrai.common.paths import folder_problem, nearest_existing
from astrai.common.safetensors_file import DTYPE_ALIASES, FLOAT_DTYPES, ITEMSIZE, header
from astrai.common.values import format_bytes
from astrai.host.hostuser import host_user_ids, make_dirs
from astrai.host.runtime import Runtime, check_paths

CHUNK_BYTES = 64 << 20
"""The most bytes of a tensor read (and converted) at once."""
DEFAULT_MAX_SHARD_SIZE = "5GB"
STAGING_PREFIX = ".export-"

DTYPES = {name: code for code, name in FLOAT_DTYPES.items()}
"""The dtypes an export converts to, by torch's name, with safetensors' name."""
_DTYPE_NAMES = FLOAT_DTYPES
_OTHER_FLOATS = ("F64", "F8_E5M2", "F8_E4M3")
"""Floating point dtypes an export keeps as they are but does not convert."""

_NOT_COPIED_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".safetensors.index.json", ".bin.index.json")
"""Training state, and weights other than the ones the export converts (say a stale pytorch_model.bin)."""

_SIZE = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kmgt]i?b|b)?", re.IGNORECASE)
_SIZE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SIZE_UNITS.update(kib=1 << 10, mib=1 << 20, gib=1 << 30, tib=1 << 40)


class ExportError(AstraiError):
    """An export that cannot be made; the message says why and what to do. ``code``: 2 for a bad option."""


# --- the options ------------------------------------------------------------------------------------


def parse_dtype(text: str | None) -> str | None:
    """torch's name for a ``--dtype`` (``bf16`` -> ``bfloat16``), None for none; ValueError says what is allowed."""
    if text is None:
        return None
    name = DTYPE_ALIASES.get(str(text).strip().lower(), str(text).strip().lower())
    if name not in DTYPES:
        raise ValueError(f"takes float32, bfloat16 or float16 (or fp32, bf16, fp16), got {str(text)!r}")
    return name


def parse_size(text) -> int:
    """Bytes in a size as typed: ``5GB`` (10^9), ``500MB``, ``2GiB`` (2^30), ``1.5GB``, or a plain byte count."""
    match = _SIZE.fullmatch(str(text).strip())
    if match is None:
        raise ValueError(f"takes a size like 5GB, 500MB, 2GiB or a number of bytes, got {str(text)!r}")
    number, unit = match.groups()
    whole, _, fraction = number.partition(".")
    scale = _SIZE_UNITS[(unit or "b").lower()]
    count = int(whole or 0) * scale + (int(fraction) * scale // 10 ** len(fraction) if fraction else 0)
    if count < 1:
        raise ValueError(f"must be at least 1 byte, got {str(text)!r}")
    return count


# --- the source ---------------------------------------------------------------------------------------


def needs_job_dir(checkpoint: str | None) -> bool:
    """Whether ``--checkpoint`` names a checkpoint of the job (or none: the newest) rather than a folder path.

    A path (one with a ``/``, or a name that exists where the command runs) is read as it is, without train.yaml.
    """
    if checkpoint is None:
        return True
    return os.sep not in checkpoint and not os.path.lexists(checkpoint)


def job_checkpoint(runtime: Runtime, name: str | None) -> Path:
    """The folder of checkpoint ``name`` in the job dir, or of the newest checkpoint when ``name`` is None."""
    from astrai.host.jobs import latest_path

    if name is None:
        return latest_path(runtime)
    check_paths(runtime, ("checkpoints",))
    path = runtime.job_dir / name
    if not os.path.lexists(path):
        raise ExportError(
            f"--checkpoint: no {name} in {runtime.job_dir} (nor in the current folder); "
            f"`{runtime.command('list')}` shows the checkpoints",
            code=2,
        )
    return path


def lora_base(source: Path, runtime: Runtime | None) -> Path | None:
    """The host folder of the base model a LoRA checkpoint's adapters belong to (None for another source): its
    recorded path, read under the job's model folder when it is the container's model mount."""
    lora = _lora_of(Path(source))
    if lora is None:
        return None
    recorded = PurePosixPath(lora["base"]["path"])
    if runtime is not None and recorded.is_relative_to(CONTAINER_MODEL):
        return runtime.model_dir / recorded.relative_to(CONTAINER_MODEL)
    return Path(recorded) if Path(recorded).is_dir() else None


@dataclass(frozen=True)
class _Tensor:
    """One tensor of the source, and what the export makes of it."""

    name: str
    file: Path
    shape: tuple[int, ...]
    dtype: str
    start: int
    """Where its bytes begin in ``file``."""
    nbytes: int
    out_dtype: str
    held: str | None = None
    """A LoRA base as the run held it, when that changed its values: ``nf4`` (read whole and sent through NF4's
    round trip) or ``bfloat16`` (rounded to it on the way)."""
    merge: tuple[_Tensor, _Tensor, float, tuple[ExpertPiece, int] | None] | None = None
    """LoRA: the adapter's (A, B, scaling, piece), folded into this weight as it is written (W + scaling * B @ A);
    for a mixture of experts' stacked adapters (PEFT's 3-D layout: A (rank * E, in), B (out, rank * E)), the piece
    of the experts this weight is (every expert, or one expert's matrix, or its gate or up half) and how many
    experts there are."""

    @property
    def out_nbytes(self) -> int:
        return self.nbytes // ITEMSIZE[self.dtype] * ITEMSIZE[self.out_dtype]


def _read_source(source: Path, dtype: str | None) -> tuple[dict, list[_Tensor], list[Path]]:
    """The source's config.json, its tensors in header order (file by file), and its weight files."""
    if not source.is_dir():
        problem = "does not exist" if not os.path.lexists(source) else "is not a folder"
        raise ExportError(f"{source} {problem}; name a checkpoint folder or a model folder", code=2)
    if parse_checkpoint_name(source.name) is not None:
        try:
            examine(source)
        except DamagedCheckpoint as error:
            raise ExportError(
                f"{source} is not a complete checkpoint: {error}; export another one (`invoke list` shows them)"
            ) from None
    if not (source / MODEL_CONFIG_FILE).exists():
        raise ExportError(
            f"{source} holds no {MODEL_CONFIG_FILE}: it is neither a checkpoint nor a model folder", code=2
        )
    try:
        config = read_config_json(source)
    except ModelLoadError as error:
        raise ExportError(str(error)) from None
    files = weight_files(source)
    target = DTYPES[dtype] if dtype is not None else None
    tensors: dict[str, _Tensor] = {}
    for path in files:
        data_start, layout = read_layout(path)
        for name, (stored, shape, (begin, stop)) in layout.items():
            if stored not in ITEMSIZE:
                raise ModelLoadError(f"{path}: tensor {name!r} has dtype {stored!r}, which safetensors does not define")
            if stop - begin != math.prod(shape) * ITEMSIZE[stored] or begin < 0:
                raise ModelLoadError(
                    f"{path}: damaged safetensors header: tensor {name!r} of shape {list(shape)} and dtype {stored} "
                    f"takes {math.prod(shape) * ITEMSIZE[stored]} bytes, its offsets say {stop - begin}"
                )
            if name in tensors:
                raise ModelLoadError(f"{path}: tensor {name!r} is stored twice (also in {tensors[name].file.name})")
            if target is not None and stored in _OTHER_FLOATS:
                raise ExportError(
                    f"{path}: tensor {name!r} is stored as {stored}; --dtype converts between F32, BF16 and F16 "
                    "only: export without --dtype to keep every tensor as stored"
                )
            out = target if target is not None and stored in _DTYPE_NAMES else stored
            tensors[name] = _Tensor(name, path, shape, stored, data_start + begin, stop - begin, out)
    _check_index(source, files, tensors)
    return config, list(tensors.values()), files


def _check_index(source: Path, files: list[Path], tensors: dict[str, _Tensor]) -> None:
    """A shard index must put every tensor it names in the file that holds it."""
    if files != [source / WEIGHTS_FILE]:
        index = source / WEIGHTS_INDEX_FILE
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]  # weight_files read it already
        for name, file in weight_map.items():
            if name not in tensors or tensors[name].file.name != file:
                where = f"it is in {tensors[name].file.name}" if name in tensors else "no shard holds it"
                raise ModelLoadError(f"{index}: weight_map puts {name!r} in {file}, but {where}")


def _other_files(source: Path, weights: list[Path]) -> list[Path]:
    """The source's files that go into the export as they are: the tokenizer's and the model folder's own."""
    skip = {MODEL_CONFIG_FILE, WEIGHTS_FILE, WEIGHTS_INDEX_FILE, *CHECKPOINT_INTERNALS, *(p.name for p in weights)}
    found = []
    for entry in sorted(os.scandir(source), key=lambda entry: entry.name):
        if entry.name.startswith(".") or entry.name in skip or entry.name.endswith(_NOT_COPIED_SUFFIXES):
            continue
        if entry.is_file():  # follows a symlink (a Hugging Face cache snapshot is made of them)
            found.append(Path(entry.path))
    return found


# --- the plan -------------------------------------------------------------------------------------------


def shard_plan(tensors: list[_Tensor], max_shard_bytes: int) -> list[list[_Tensor]]:
    """Tensors grouped into files: one when they all fit in ``max_shard_bytes``, else greedily in order.

    A tensor is never split; one larger than the limit gets a file of its own.
    """
    if sum(t.out_nbytes for t in tensors) <= max_shard_bytes:
        return [list(tensors)]
    shards: list[list[_Tensor]] = []
    current: list[_Tensor] = []
    size = 0
    for tensor in tensors:
        if current and size + tensor.out_nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(tensor)
        size += tensor.out_nbytes
    if current:
        shards.append(current)
    return shards


def shard_names(count: int) -> list[str]:
    """The weight files' names as transformers writes them."""
    if count == 1:
        return [WEIGHTS_FILE]
    return [f"model-{number:05d}-of-{count:05d}.safetensors" for number in range(1, count + 1)]


def _header(tensors: list[_Tensor]) -> tuple[bytes, list[_Tensor]]:
    """A safetensors header for ``tensors`` and the order their bytes go in (wider elements first, as
    :func:`astrai.common.safetensors_file.header` lays a file out; the order is otherwise kept)."""
    ordered = sorted(tensors, key=lambda t: -ITEMSIZE[t.out_dtype])
    head, _ = header([(t.name, t.out_dtype, tuple(t.shape)) for t in tensors], {"format": "pt"})
    return head, ordered


def updated_config(config: dict, dtype: str | None) -> dict:
    """``config.json`` saying ``dtype``: under the key(s) it has, ``dtype`` (5.x) or ``torch_dtype`` (4.x)."""
    if dtype is None:
        return config
    keys = [key for key in ("torch_dtype", "dtype") if key in config] or ["torch_dtype"]
    return {**config, **dict.fromkeys(keys, dtype)}


# --- the export -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote."""

    source: Path
    out: Path
    dtypes: tuple[str, ...]
    """The weights' dtypes (torch names, or safetensors' for those torch has no short name for here)."""
    weight_files: tuple[str, ...]
    files: tuple[str, ...]
    """Every file of the export."""
    total_bytes: int

    def summary(self) -> str:
        weights = self.weight_files[0] if len(self.weight_files) == 1 else f"{len(self.weight_files)} shards"
        return (
            f"exported {self.source} to {self.out}: {'/'.join(self.dtypes) or 'no tensors'}, "
            f"{len(self.files)} files, {format_bytes(self.total_bytes)} (weights in {weights})"
        )


def export_checkpoint(
    source: Path,
    out: Path,
    dtype: str | None,
    max_shard_bytes: int,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    base: Path | None = None,
    adapter: bool = False,
) -> ExportResult:
    """Write ``source`` (a checkpoint or a model folder) as a Hugging Face model folder at ``out``.

    ``dtype``: float32, bfloat16 or float16 (see :func:`parse_dtype`), None to keep each tensor as stored.
    A LoRA checkpoint is written merged (the base model ``base`` with the adapters folded in), or with ``adapter``
    as a PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``).
    Refused with nothing written: a source that is not a complete checkpoint or not a model folder, an ``out``
    that exists and is not empty or lies inside the source, a disk without room for the export.
    """
    source, out = Path(source), Path(out)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} or None, got {dtype!r}")
    if max_shard_bytes < 1 or chunk_bytes < 8:
        raise ValueError("max_shard_bytes must be positive and chunk_bytes at least 8")
    chunk_bytes -= chunk_bytes % 8  # a whole number of elements of every dtype
    config, tensors, weights, others, lora = _what_to_write(source, out, dtype, base, adapter)
    if any(t.dtype != t.out_dtype or t.merge is not None for t in tensors):
        _need_numpy()
    shards = [tensors] if adapter else shard_plan(tensors, max_shard_bytes)
    names = [ADAPTER_WEIGHTS_FILE] if adapter else shard_names(len(shards))
    headers = [_header(shard) for shard in shards]
    found = sorted({t.out_dtype for t in tensors}, key=lambda code: (code not in _DTYPE_NAMES, code))
    config_dtype = dtype or (_DTYPE_NAMES[found[0]] if len(found) == 1 and found[0] in _DTYPE_NAMES else None)
    config_name, config_text = _config_file(config, config_dtype, lora if adapter else None, tensors)
    index_text = _index_text(names, shards) if len(shards) > 1 else None
    needed = sum(len(head) + sum(t.out_nbytes for t in ordered) for head, ordered in headers)
    needed += len(config_text) + len(index_text or b"") + sum(path.stat().st_size for path in others)
    free = _free_bytes(out.parent)
    if free is not None and free < needed:
        raise ExportError(
            f"not enough room for {out}: the export needs {format_bytes(needed)}, {format_bytes(free)} are free there; "
            "free space or choose an --out on another disk (nothing was written)"
        )

    created = _make_parents(out.parent)
    staging = out.parent / f"{STAGING_PREFIX}{out.name}-{os.getpid()}-{secrets.token_hex(4)}"
    written: list[str] = []
    readers: dict[Path, object] = {}
    try:
        # Every source file is open before the first byte is written, and the small files go first: a checkpoint
        # that retention deletes meanwhile is still read to the end.
        for path in weights:
            readers[path] = open(path, "rb", buffering=0)
        staging.mkdir()
        _own(staging)
        _write_bytes(staging / config_name, config_text)
        written.append(config_name)
        for path in others:
            _copy(path, staging / path.name)
            written.append(path.name)
        for name, (head, ordered) in zip(names, headers, strict=True):
            _write_weights(staging / name, head, ordered, readers, chunk_bytes)
            written.append(name)
        if index_text is not None:
            _write_bytes(staging / WEIGHTS_INDEX_FILE, index_text)
            written.append(WEIGHTS_INDEX_FILE)
        fsync_path(staging)
        _publish(staging, out)
    except BaseException as error:
        shutil.rmtree(staging, ignore_errors=True)
        for folder in reversed(created):
            with contextlib.suppress(OSError):  # tidying up must not hide the failure
                folder.rmdir()
        if isinstance(error, OSError):
            raise _write_failure(error, out, needed) from None
        raise
    finally:
        for reader in readers.values():
            reader.close()
    dtypes = tuple(_DTYPE_NAMES.get(code, code) for code in found)
    return ExportResult(source, out, dtypes, tuple(names), tuple(sorted(written)), needed)


def _what_to_write(
    source: Path, out: Path, dtype: str | None, base: Path | None, adapter: bool
) -> tuple[dict, list[_Tensor], list[Path], list[Path], dict | None]:
    """The export's config, its tensors, the weight files they are read from, the files copied as they are, and
    the source's LoRA record (None unless it is a LoRA checkpoint)."""
    config, tensors, weights = _read_source(source, dtype)
    lora = _lora_of(source)
    if adapter and lora is None:
        raise ExportError(f"--adapter: {source} holds no LoRA adapters (not a checkpoint of a lora_rank run)", code=2)
    _check_out(source, out)
    others = _other_files(source, weights)
    if lora is not None and not adapter:
        config, tensors, base_weights = _merged(source, lora, base, dtype, tensors)
        weights = [*base_weights, *weights]
    return config, tensors, weights, others, lora


def _config_file(config: dict, dtype: str | None, adapter: dict | None, tensors: list[_Tensor]) -> tuple[str, bytes]:
    """config.json saying the dtype, or for a PEFT adapter folder (``adapter``: the LoRA record) its config, whose
    target_modules are the layers the adapter ``tensors`` adapt, by the model's own names (a Phi-3's ``qkv_proj``,
    where the record names its parts)."""
    if adapter is None:
        return MODEL_CONFIG_FILE, (
            json.dumps(updated_config(config, dtype), indent=2, ensure_ascii=False) + "\n"
        ).encode()
    modules = peft_modules_of(t.name for t in tensors)
    experts = PEFT_EXPERT_PARAMETERS if any(peft_expert_adapter(t.name) for t in tensors) else ()
    settings = (adapter["rank"], adapter["alpha"], adapter.get("dropout", 0.0), modules)
    return ADAPTER_CONFIG_FILE, peft_adapter_config(*settings, adapter["base"]["path"], experts).encode()


def _index_text(names: list[str], shards: list[list[_Tensor]]) -> bytes:
    """model.safetensors.index.json of a sharded export, as transformers writes it."""
    weight_map = {t.name: name for name, shard in zip(names, shards, strict=True) for t in shard}
    total = sum(t.out_nbytes for shard in shards for t in shard)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()


def _lora_of(source: Path) -> dict | None:
    """The ``lora`` record of a LoRA checkpoint's meta.json (its settings and base), None for any other folder."""
    if parse_checkpoint_name(source.name) is None:
        return None
    try:
        return CheckpointMeta.read(source).lora
    except DamagedCheckpoint:  # not a checkpoint: reading the source says so
        return None


def _merged(
    source: Path, lora: dict, base: Path | None, dtype: str | None, adapters: list[_Tensor]
) -> tuple[dict, list[_Tensor], list[Path]]:
    """The base model's config, tensors and weight files, each adapted weight to be written with its update folded
    in; refused when ``base`` is missing or is not the model the adapters were trained on."""
    recorded = lora["base"]
    if base is None:
        gone = "" if Path(recorded["path"]).is_dir() else ", and that folder is not there (moved, or on another host)"
        raise ExportError(
            f"{source} holds LoRA adapters of the base model {recorded['path']}, not a whole model{gone}: give the "
            "base model folder with --base DIR, or export with --adapter for a PEFT adapter folder",
            code=2,
        )
    base = Path(base)
    if not (base / MODEL_CONFIG_FILE).is_file():
        raise ExportError(
            f"{source} holds LoRA adapters of the base model recorded as {recorded['path']}, looked for at {base}, "
            f"which holds no model (moved?): give the base model folder with --base DIR",
            code=2,
        )
    problem = other_base(source, lora, base)
    if problem is not None:
        raise ExportError(problem)
    config, tensors, weights = _read_source(base, dtype)
    by_name = {t.name: t for t in tensors}
    pairs: dict[str, dict[str, _Tensor]] = {}
    expert_pairs: dict[str, dict[str, _Tensor]] = {}
    for tensor in adapters:
        target, expert = peft_target(tensor.name), peft_expert_adapter(tensor.name)
        if expert is not None:
            expert_pairs.setdefault(expert[0], {})[expert[1]] = tensor
            continue
        if target is None or target[0] not in by_name:
            raise ExportError(f"{source}: {tensor.name} is not an adapter of a weight of {base}")
        pairs.setdefault(target[0], {})[target[1]] = tensor
    scaling = float(lora["alpha"]) / int(lora["rank"])
    if lora.get("base_dtype") == NF4:
        _held_in_nf4(ModelConfig.from_dict(config), by_name)
    if expert_pairs:
        _merge_experts(source, ModelConfig.from_dict(config), expert_pairs, by_name, scaling)
    for name, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ExportError(f"{source}: the adapter of {name} lacks its {'B' if 'A' in pair else 'A'} matrix")
        weight = by_name[name]
        if (pair["B"].shape[0], pair["A"].shape[1]) != tuple(weight.shape):
            raise ExportError(f"{source}: the adapter of {name} does not fit its shape {list(weight.shape)}")
        by_name[name] = dataclasses.replace(weight, merge=(pair["A"], pair["B"], scaling, None))
    return config, list(by_name.values()), weights


def _held_in_nf4(config: ModelConfig, by_name: dict[str, _Tensor]) -> None:
    """Mark the base's tensors as an NF4 run held them: the blocks' matrices in NF4, the other matrices (the
    embeddings, the head) in bfloat16; the norms and biases as they are."""
    quantized = {hf_name(name, config) for name in held_matrices(config)}
    for name, tensor in by_name.items():
        if len(tensor.shape) >= 2:
            by_name[name] = dataclasses.replace(tensor, held=NF4 if name in quantized else "bfloat16")


def _merge_experts(
    source: Path, config: ModelConfig, pairs: dict[str, dict[str, _Tensor]], by_name: dict, scaling: float
) -> None:
    """Fold each stacked expert adapter into the base weights that hold its experts (one matrix per expert and
    projection, or transformers 5.x's stacked ones), as the weights are written."""
    pieces = {**expert_pieces(config, per_expert=True), **expert_pieces(config, per_expert=False)}
    for ours, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ExportError(f"{source}: the adapter of {ours} lacks its {'B' if 'A' in pair else 'A'} matrix")
        held = [stored for stored, piece in pieces.items() if piece.name == ours and stored in by_name]
        if not held:
            raise ExportError(f"{source}: the adapters of {ours} adapt no weight of the base model")
        for stored in held:
            merge = (pair["A"], pair["B"], scaling, (pieces[stored], config.n_experts))
            by_name[stored] = dataclasses.replace(by_name[stored], merge=merge)


def _check_out(source: Path, out: Path) -> None:
    """Refuse an ``--out`` that cannot take the export, before anything is read or written."""
    if not str(out).strip():
        raise ExportError("--out: the path is empty; name the folder to write", code=2)
    real_out, real_source = Path(os.path.realpath(out)), Path(os.path.realpath(source))
    if real_out == real_source or real_source in real_out.parents:
        raise ExportError(f"--out {out} is inside the source {source}; write the export somewhere else", code=2)
    if out.is_symlink():
        raise ExportError(f"--out {out} is a symlink; name a new folder (or an empty one)", code=2)
    if out.exists():
        if not out.is_dir():
            raise ExportError(f"--out {out} exists and is not a folder; name a new folder (or an empty one)", code=2)
        try:
            empty = next(os.scandir(out), None) is None
        except OSError as error:
            raise ExportError(f"--out {out}: cannot be read ({error.strerror})", code=2) from None
        if not empty:
            raise ExportError(
                f"--out {out} exists and is not empty; name a new folder, or remove this one first", code=2
            )
    problem = folder_problem(out.parent, need="write", room=len(os.fsencode(out.name)) + 40)
    if problem is not None:
        raise ExportError(f"--out: {problem}", code=2)


def _free_bytes(folder: Path) -> int | None:
    existing = nearest_existing(folder)
    try:
        return shutil.disk_usage(existing).free if isinstance(existing, Path) else None
    except OSError:
        return None


def _make_parents(folder: Path) -> list[Path]:
    try:
        return make_dirs(folder)
    except OSError as error:
        raise ExportError(f"--out: cannot create {error.filename}: {error.strerror}", code=2) from None


def _publish(staging: Path, out: Path) -> None:
    """Rename the flushed staging folder to ``out`` (missing, or an empty folder it replaces) and flush the rename."""
    try:
        os.rename(staging, out)
    except OSError as error:
        if error.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
            raise
        raise ExportError(f"--out {out} appeared or filled up meanwhile; nothing was written", code=2) from None
    fsync_path(out.parent)


def _need_numpy() -> None:
    try:
        import numpy  # noqa: F401
    except ImportError:
        raise ExportError("converting the dtype needs NumPy: pip install 'numpy>=1.24', then export again") from None


def _write_failure(error: OSError, out: Path, needed: int) -> ExportError:
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        free = _free_bytes(out.parent)
        room = f", {format_bytes(free)} are free there" if free is not None else ""
        return ExportError(
            f"the disk filled up while writing {out}: the export needs {format_bytes(needed)}{room}; "
            "free space or choose an --out on another disk (nothing was written)"
        )
    where = f" ({error.filename})" if error.filename else ""
    return ExportError(f"writing {out} failed: {error.strerror or error}{where}; nothing was written")


# --- writing ------------------------------------------------------------------------------------------------


def _write_weights(path: Path, header: bytes, tensors: list[_Tensor], readers: dict, chunk_bytes: int) -> None:
    """One safetensors file: the header, then every tensor's bytes, converted piece by piece."""
    buffer = bytearray(chunk_bytes)
    with open(path, "wb") as handle:  # buffered: a write is whole or raises (a raw one may stop short)
        _own(path)
        handle.write(header)
        for tensor in tensors:
            if tensor.merge is not None or tensor.held == NF4:
                handle.write(_merged_bytes(tensor, readers, buffer))
                continue
            converts = [_converter(tensor.dtype, tensor.out_dtype)]
            if tensor.held == "bfloat16":  # through the bf16 the run held it in
                converts = [_converter(tensor.dtype, "BF16"), _converter("BF16", tensor.out_dtype)]
            for piece in _pieces(readers[tensor.file], tensor, buffer):
                for convert in converts:
                    piece = piece if convert is None else convert(piece)
                handle.write(piece)
        handle.flush()
        os.fsync(handle.fileno())


def _merged_bytes(tensor: _Tensor, readers: dict, buffer: bytearray) -> bytes:
    """An adapted weight with its LoRA update folded in, computed in float32, in the export's dtype (the weight is
    read whole: one matrix of a block at a time); an NF4 base's weight first as its NF4 round trip gives it."""
    import numpy as np

    def f32(part: _Tensor):
        data = b"".join(bytes(piece) for piece in _pieces(readers[part.file], part, buffer))
        convert = _converter(part.dtype, "F32")
        return np.frombuffer(data if convert is None else convert(data), dtype="<f4").reshape(part.shape)

    merged = f32(tensor)
    if tensor.held == NF4:
        merged = round_trip(merged)
    if tensor.merge is not None:
        a, b, scaling, piece = tensor.merge
        delta = f32(b) @ f32(a) if piece is None else _expert_delta(f32(a), f32(b), *piece)
        merged = merged + np.float32(scaling) * delta
    data = merged.astype("<f4").tobytes()
    convert = _converter("F32", tensor.out_dtype)
    return data if convert is None else convert(data)


def _expert_delta(a, b, piece: ExpertPiece, experts: int):
    """B @ A of the experts ``piece`` is (every expert's (E, out, in), or one's (out, in), or its gate or up rows),
    from PEFT's 3-D layout: expert e's A the rows e * rank ..., its B the columns e, e + E, e + 2E, ..."""
    import numpy as np

    rank = a.shape[0] // experts
    a3 = a.reshape(experts, rank, a.shape[1])
    b3 = b.reshape(b.shape[0], rank, experts)
    if piece.expert is None:
        delta = np.einsum("ore,eri->eoi", b3, a3)
    else:
        delta = b3[:, :, piece.expert] @ a3[piece.expert]
    if piece.half is None:
        return delta
    rows = delta.shape[-2] // 2
    return delta[..., :rows, :] if piece.half == "gate" else delta[..., rows:, :]


def _pieces(reader, tensor: _Tensor, buffer: bytearray):
    """The tensor's bytes, ``len(buffer)`` at most at a time (each a view into ``buffer``, valid until the next)."""
    position, left = tensor.start, tensor.nbytes
    view = memoryview(buffer)
    while left:
        size = min(left, len(buffer))
        got = 0
        while got < size:
            reader.seek(position + got)
            count = reader.readinto(view[got:size])
            if not count:
                raise ExportError(
                    f"{tensor.file}: ended while reading tensor {tensor.name!r}: was it changed meanwhile?"
                )
            got += count
        yield view[:size]
        position += size
        left -= size


def _write_bytes(path: Path, content: bytes) -> None:
    with open(path, "wb") as handle:
        _own(path)
        handle.write(content)
        handle.flush()
        os.fsync(handle.fileno())


def _copy(source: Path, target: Path) -> None:
    shutil.copyfile(source, target)
    _own(target)
    fsync_path(target)


def _own(path: Path) -> None:
    """Give what the export writes to the host user (under sudo: the user who ran it)."""
    uid, gid = host_user_ids()
    if (uid, gid) != (os.getuid(), os.getgid()):
        os.chown(path, uid, gid)


# --- dtype conversion ---------------------------------------------------------------------------------------


def _converter(stored: str, target: str):
    """A function from little-endian elements of ``stored`` to those of ``target``; None when they are the same."""
    if stored == target:
        return None
    return {
        ("F32", "BF16"): _f32_to_bf16,
        ("F32", "F16"): _f32_to_f16,
        ("BF16", "F32"): _bf16_to_f32,
        ("BF16", "F16"): lambda data: _f32_to_f16(_bf16_to_f32(data)),
        ("F16", "F32"): _f16_to_f32,
        ("F16", "BF16"): lambda data: _f32_to_bf16(_f16_to_f32(data)),
    }[(stored, target)]


def _f32_to_bf16(data):
    """Round to nearest, ties to even, as torch does: add 0x7FFF plus the kept part's lowest bit, keep the top half."""
    import numpy as np

    bits = np.frombuffer(data, dtype="<u4")
    out = bits >> 16
    out &= 1
    out += 0x7FFF
    out += bits  # wraps round only for NaNs, which are replaced below
    out >>= 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    if nan.any():
        out[nan] = (bits[nan] >> 16) | 0x0040  # quiet, sign and top payload bits kept
    return out.astype("<u2")


def _f32_to_f16(data):
    """numpy's cast: round to nearest even, subnormals and overflow to infinity as IEEE 754 (and torch) say."""
    import numpy as np

    with np.errstate(over="ignore", invalid="ignore"):
        out = np.frombuffer(data, dtype="<f4").astype("<f2")
    return _quiet_nans(out.view("<u2"), 0x7FFF, 0x7C00, 0x0200)


def _bf16_to_f32(data):
    import numpy as np

    out = np.frombuffer(data, dtype="<u2").astype("<u4")
    out <<= 16
    return _quiet_nans(out, 0x7FFFFFFF, 0x7F800000, 0x00400000)


def _f16_to_f32(data):
    import numpy as np

    out = np.frombuffer(data, dtype="<f2").astype("<f4")
    return _quiet_nans(out.view("<u4"), 0x7FFFFFFF, 0x7F800000, 0x00400000)


def _quiet_nans(bits, magnitude: int, exponent: int, quiet: int):
    """Set the quiet bit of every NaN in ``bits`` (an unsigned view), in place; returns ``bits``."""
    nan = (bits & magnitude) > exponent
    if nan.any():
        bits[nan] |= quiet
    return bits
