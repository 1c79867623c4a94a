"""What a run holds in device memory, worked out from its plan alone: the training state per parameter, generation's
key/value cache, and how many rows one part of a round of generation takes.

Torch-free, so that `invoke preflight` prints the same figures the trainer sizes its caches by. Every figure here is
a function of the model's shape, the plan and the device's *total* memory, never of the memory free at some moment:
a run and the same run resumed split their rounds of generation alike, so they draw the same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

TRAINING_BYTES_PER_PARAMETER = 16
"""An fp32 weight that trains, its gradient and AdamW's two moments."""
FROZEN_BYTES_PER_PARAMETER = {"float32": 4, "bfloat16": 2}
"""A weight that does not train (LoRA's base), by the dtype it is held in (training.lora_base_dtype)."""

CAPACITY_STEP = 64
"""Generation's caches are sized in steps of this many positions."""
DEVICE_USABLE_SHARE = 0.9
"""The share of a device's total memory a run plans to use (the rest: the CUDA context, the allocator's slack)."""
DECODE_CACHE_SHARE = 0.5
"""The share of what the training state leaves of that which generation's key/value caches may take (the rest: the
forward passes of the prefill and the decode steps, the logits, the reward models)."""


def kv_cache_bytes(model, rows: int, capacity: int, itemsize: int) -> int:
    """Bytes of a key/value cache of ``rows`` rows and ``capacity`` positions, every layer's keys and values, for a
    model config (``n_layers``, ``n_kv_heads``, ``head_size``) whose cache holds ``itemsize``-byte elements."""
    return 2 * model.n_layers * model.n_kv_heads * model.head_size * capacity * rows * itemsize


def decode_capacity(longest_prompt: int, max_new_tokens: int, context: int) -> int:
    """The positions a round of generation needs for its longest prompt and every new token but the last (which is
    never fed back), rounded up to :data:`CAPACITY_STEP` and at most the model's ``context``."""
    needed = longest_prompt + max_new_tokens - 1
    return min(context, -(-needed // CAPACITY_STEP) * CAPACITY_STEP)


def decode_rows_per_part(device_total: int, state_bytes: int, row_bytes: int) -> int:
    """The most rows one part of a round of generation takes at once: what the device's total memory leaves after
    the training state (``state_bytes``), its :data:`DECODE_CACHE_SHARE`, in caches of ``row_bytes`` a row; at least
    one."""
    left = device_total * DEVICE_USABLE_SHARE - state_bytes
    return max(1, int(left * DECODE_CACHE_SHARE) // max(1, row_bytes))


def training_state_bytes(parameters: int, adapters: int, base_dtype: str | None) -> int:
    """Weights, gradients and AdamW's moments of a model of ``parameters`` weights: each trains (``base_dtype`` None)
    or is held frozen in ``base_dtype`` with ``adapters`` trainable parameters beside them (LoRA)."""
    if base_dtype is None:
        return parameters * TRAINING_BYTES_PER_PARAMETER
    return parameters * FROZEN_BYTES_PER_PARAMETER[base_dtype] + adapters * TRAINING_BYTES_PER_PARAMETER


@dataclass(frozen=True)
class GenerationCache:
    """The key/value caches a run's rounds of generation hold on one rank: ``rows`` rows a round (every micro-batch
    of a step, each prompt ``generations`` times), at ``capacity`` positions, ``row_bytes`` a row."""

    rows: int
    capacity: int
    row_bytes: int

    @property
    def bytes(self) -> int:
        """The caches of a whole round at once (what preflight shows; a round split in parts holds less)."""
        return self.rows * self.row_bytes

    def rows_per_part(self, device_total: int, state_bytes: int) -> int:
        """The rows one part of a round takes on a device of ``device_total`` bytes (every row, when they fit)."""
        return min(self.rows, decode_rows_per_part(device_total, state_bytes, self.row_bytes))


def generation_cache(
    model, context: int, rows: int, longest_prompt: int, max_new_tokens: int, autocast: str | None
) -> GenerationCache:
    """The caches of rounds of ``rows`` rows whose longest prompt has ``longest_prompt`` tokens, in a model of
    ``context`` positions; the cache holds the autocast dtype (bfloat16: 2 bytes), else the float32 weights' (4)."""
    capacity = decode_capacity(longest_prompt, max_new_tokens, context)
    itemsize = 2 if autocast else 4
    return GenerationCache(rows, capacity, kv_cache_bytes(model, 1, capacity, itemsize))
