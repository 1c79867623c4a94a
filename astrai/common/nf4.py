"""QLoRA's 4-bit frozen base (``training.lora_base_dtype: nf4``), as far as it can be known without torch: the format,
which matrices of a model it holds, what a run needs for it, and the format's round trip in NumPy.

The format is torchao's NF4 tensor (the QLoRA paper's NormalFloat4, as torchtune holds a base in it): a matrix is read
as one row-major run of numbers cut into blocks of :data:`BLOCK` (64); each number is stored as the 4-bit index of the
nearest of the 16 values of :data:`CODEBOOK` after dividing by its block's largest magnitude (its absmax), two indices a
byte. The absmaxes are quantised again ("double quantisation"): their mean is taken off, and each run of
:data:`SCALER_BLOCK` (256) of them is stored as int8 with one float32 factor. So a matrix takes
:data:`BYTES_PER_PARAMETER` bytes a number (about 0.516) where bfloat16 takes 2, and it must hold a whole number of
scaler blocks (64 x 256 = 16,384 numbers): every block projection of a model of common sizes does.

Which matrices: the linear layers of every block (the attention's and the MLP's projections, LoRA's targets or not).
The embeddings and the output head stay in bfloat16, the norms and biases as they are. A mixture of experts is refused:
its experts are stacked three-dimensional tensors, which the NF4 tensor does not hold.

The trainer (:mod:`astrai.trainer.models.nf4`) quantises with torchao itself; :func:`round_trip` is the same
arithmetic in NumPy, for `invoke export` (torch-free), which folds the adapters into the weights the run computed with.
"""

from __future__ import annotations

import re

from astrai.common.model_config import ModelConfig

NF4 = "nf4"
"""training.lora_base_dtype's value for a 4-bit base."""
TORCHAO_PACKAGE = "torchao==0.18.0"
"""What the trainer image installs for a job with an NF4 base (the version the tests run); also in setup.cfg's nf4
and dev extras."""
TORCHAO_VERSION = TORCHAO_PACKAGE.partition("==")[2]
MIN_TORCH = (2, 11)
"""The oldest torch the pinned torchao is built for."""
MIN_CUDA_CAPABILITY = (8, 0)
"""The oldest GPU an NF4 base computes on: bfloat16 matrix products (Ampere, compute capability 8.0), as the trainer's
autocast on CUDA needs."""

BLOCK = 64
"""Numbers per block, each block scaled by its own absmax."""
SCALER_BLOCK = 256
"""Absmaxes per block of the second quantisation (int8, one float32 factor each)."""
WHOLE = BLOCK * SCALER_BLOCK
"""A matrix (and each FSDP shard of it) holds a multiple of this many numbers."""
CODEBOOK = (
    -1.0,
    -0.6962,
    -0.5251,
    -0.3949,
    -0.2844,
    -0.1848,
    -0.0911,
    0.0,
    0.0796,
    0.1609,
    0.2461,
    0.3379,
    0.4407,
    0.5626,
    0.7230,
    1.0,
)
"""The 16 values a normalised number is rounded to, as torchao's NF4 tensor holds them (float32)."""
BYTES_PER_PARAMETER = 0.5 + 1 / BLOCK + 4 / WHOLE
"""A 4-bit index, an int8 absmax per block and a float32 factor per scaler block (one float32 mean per matrix
aside)."""
LARGEST_GAP = max(b - a for a, b in zip(CODEBOOK, CODEBOOK[1:], strict=False))
"""The widest step between two neighbouring values: a number is off by at most half of it times its block's absmax,
plus what the absmax itself loses to its int8 (the round trip's known bound)."""

_BLOCK_MATRIX = re.compile(r"^layers\.\d+\.(attention\.(wq|wk|wv|wqkv|wo)|feed_forward\.(w1|w2|w3|w13))\.weight$")


def held_matrices(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The matrices an NF4 base holds in 4 bits (our names, with their shapes): every block's linear layers."""
    from astrai.common.model_folder import tensor_shapes

    return {name: shape for name, shape in tensor_shapes(config).items() if _BLOCK_MATRIX.match(name)}


def nf4_problem(config: ModelConfig, shards: int = 1) -> str | None:
    """Why ``config``'s model cannot hold its base in NF4 sharded over ``shards`` ranks (FSDP; 1 otherwise), said
    for training.lora_base_dtype; None when it can."""
    if config.sparse_layers:
        return (
            "training.lora_base_dtype nf4: a mixture of experts' experts are stacked 3-D tensors, which torchao's NF4 "
            "tensor does not hold; use bfloat16"
        )
    for name, shape in held_matrices(config).items():
        rows, numbers = shape[0], shape[0] * shape[1]
        if numbers % WHOLE:
            return (
                f"training.lora_base_dtype nf4: {name} {list(shape)} holds {numbers:,} numbers, not a multiple of "
                f"{WHOLE:,} ({BLOCK} per block x {SCALER_BLOCK} blocks per scaler block); use bfloat16"
            )
        if rows % shards or numbers // shards % WHOLE:
            fits = [n for n in range(1, 65) if _shards_whole(held_matrices(config).values(), n)]
            return (
                f"training.lora_base_dtype nf4 under FSDP on {shards} ranks: {name} {list(shape)} does not split "
                f"into {shards} shards of whole NF4 scaler blocks ({WHOLE:,} numbers each); FSDP world sizes that do: "
                f"{', '.join(map(str, fits[:8]))}; or use ddp, or bfloat16"
            )
    return None


def _shards_whole(shapes, shards: int) -> bool:
    return all(rows % shards == 0 and rows * cols // shards % WHOLE == 0 for rows, cols in shapes)


def round_trip(weights):
    """A float32 NumPy matrix as an NF4 base holds it: quantised and dequantised again, in float32, with torchao's
    arithmetic (the indices exactly; the scales to float32 rounding, since the mean of the absmaxes is a sum whose
    order differs from torch's)."""
    import numpy as np

    flat = np.ascontiguousarray(weights, dtype=np.float32).reshape(-1, BLOCK)
    absmax = np.abs(flat).max(axis=1)
    codebook = np.asarray(CODEBOOK, dtype=np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = flat / absmax[:, None]
    indices = _nearest(scaled, codebook)
    mean = absmax.mean(dtype=np.float32)
    centred = (absmax - mean).reshape(-1, SCALER_BLOCK)
    with np.errstate(divide="ignore", invalid="ignore"):
        factor = np.float32(256) / (np.float32(2) * np.abs(centred).max(axis=1))
        stored = np.clip(np.round(centred * factor[:, None]), -128, 127).astype(np.int8)
    scales = (stored.astype(np.float32) / factor[:, None] + mean).reshape(-1, 1)
    return (codebook[indices] * scales).reshape(np.shape(weights))


def _nearest(values, codebook):
    """The index of the nearest codebook value to each of ``values``, the lower one of two as near (torch's first
    minimum); 0 for NaN (a block of zeros, as torch's min gives it). Only the two values around each number are
    compared: the float32 distance to a sorted codebook's values falls, then rises."""
    import numpy as np

    upper = np.clip(np.searchsorted(codebook, values), 1, len(codebook) - 1)
    lower = upper - 1
    below = np.abs(values - codebook[lower]) <= np.abs(values - codebook[upper])
    return np.where(np.isnan(values), 0, np.where(below, lower, upper))
