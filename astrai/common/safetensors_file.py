"""The safetensors file layout, torch-free: its dtypes, the header that starts a file, and reading one back.

A safetensors file is an 8-byte little-endian header length, the JSON header (every tensor's dtype, shape and
byte range; padded with spaces to a multiple of 8), then the raw little-endian data. The model folders
(:mod:`astrai.common.model_folder`), both checkpoint formats and ``invoke export`` write and read headers through
this module only, so a file one of them writes is one every other reads.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

from astrai.common.errors import AstraiError

ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}
"""Bytes per element of every safetensors dtype."""
FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
"""The floating point dtypes a model may be stored in (and an export converts between), with torch's names."""
DTYPE_ALIASES = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16", "fp16": "float16", "f16": "float16"}
"""Short names people type for those dtypes (``--dtype bf16``), with torch's."""
TORCH_NAMES = {
    "F64": "float64",
    **FLOAT_DTYPES,
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
"""The dtypes a checkpoint may hold, safetensors' name to torch's."""
CODES = {name: code for code, name in TORCH_NAMES.items()}

Layout = dict[str, tuple[str, tuple[int, ...], tuple[int, int]]]
"""Tensor name -> (dtype, shape, byte range in the data)."""


class ModelLoadError(AstraiError):
    """A model folder whose config or weights cannot be used; the message names the file, key or tensor."""


def header(
    entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> tuple[bytes, dict[str, int]]:
    """The start of a file holding ``entries`` (name, dtype, shape), and where each one's data begins in the file.

    Wider dtypes come first (the order of ``entries`` is kept otherwise), so every tensor starts aligned to its
    element size, as safetensors itself lays a file out. The file is ``len(head)`` plus every tensor's bytes long.
    """
    ordered = sorted(entries, key=lambda entry: -ITEMSIZE[entry[1]])
    content: dict = {"__metadata__": metadata} if metadata else {}
    begins, offset = {}, 0
    for name, dtype, shape in ordered:
        size = math.prod(shape) * ITEMSIZE[dtype]
        content[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        begins[name] = offset
        offset += size
    encoded = json.dumps(content, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    head = len(encoded).to_bytes(8, "little") + encoded
    return head, {name: len(head) + begin for name, begin in begins.items()}


def read_layout(path: Path) -> tuple[int, Layout]:
    """(where the data starts, every tensor's dtype, shape and byte range) from a file's header.

    The header is read once and checked against the file's size, so a truncated file raises ModelLoadError here.
    """
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            head = handle.read(8)
            (length,) = struct.unpack("<Q", head) if len(head) == 8 else (size,)
            if 8 + length > size:
                raise ModelLoadError(f"{path}: truncated: {size} bytes, too short for its safetensors header")
            content = json.loads(handle.read(length))
    except PermissionError:
        raise ModelLoadError(f"{path}: cannot be read by uid {os.getuid()}; check its permissions") from None
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{path}: not a readable safetensors file ({error})") from None
    tensors, end = {}, 0
    try:
        for name, info in content.items():
            if name == "__metadata__":
                continue
            begin, stop = (int(n) for n in info["data_offsets"])
            tensors[name] = (str(info["dtype"]), tuple(int(n) for n in info["shape"]), (begin, stop))
            end = max(end, stop)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
        raise ModelLoadError(f"{path}: damaged safetensors header ({type(error).__name__}: {error})") from None
    if 8 + length + end > size:
        raise ModelLoadError(f"{path}: truncated: {size} bytes, its header describes {8 + length + end}")
    return 8 + length, tensors


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (dtype, shape) from a file's header; a damaged or truncated file raises ModelLoadError."""
    return {name: (dtype, shape) for name, (dtype, shape, _) in read_layout(path)[1].items()}
