"""What a run holds in device memory, worked out from its plan alone: the training state per parameter, generation's
key/value cache, and how many rows one part of a round of generation takes.

Torch-free, so that `invoke preflight` prints the same figures the trainer sizes its caches by. Every figure here is
a function of the model's shape, the plan and the device's *total* memory, never of the memory free at some moment:
a run and the same run resumed split their rounds of generation alike, so they draw the same tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from astrai.common import nf4
from astrai.common.layers import kv_cache_elements
from astrai.common.model_folder import num_parameters

TRAINING_BYTES_PER_PARAMETER = 16
"""An fp32 weight that trains, its gradient and AdamW's two moments."""
FROZEN_BYTES_PER_PARAMETER = {"float32": 4, "bfloat16": 2, nf4.NF4: nf4.BYTES_PER_PARAMETER}
"""A weight that does not train (LoRA's base), by the dtype it is held in (training.lora_base_dtype). nf4 is the
blocks' linear layers' (:func:`astrai.common.nf4.held_matrices`); the embeddings and the head then stay bfloat16."""

LOGITS_CHUNK_BYTES = 128 << 20
"""The float32 logits of at most this many bytes exist at once when a loss is computed over the vocabulary."""
LOGITS_KEEP_BYTES = 1 << 30
"""Logits (in the head's compute dtype) of at most this many bytes in all are kept from the forward pass for the
backward; larger ones are computed again there, a chunk at a time."""

CAPACITY_STEP = 64
"""Generation's caches are sized in steps of this many positions."""
DEVICE_USABLE_SHARE = 0.9
"""The share of a device's total memory a run plans to use (the rest: the CUDA context, the allocator's slack)."""
DECODE_CACHE_SHARE = 0.5
"""The share of what the training state leaves of that which generation's key/value caches may take (the rest: the
forward passes of the prefill and the decode steps, the logits, the reward models)."""


def kv_cache_bytes(model, rows: int, capacity: int, itemsize: int) -> int:
    """Bytes of a key/value cache of ``rows`` rows and ``capacity`` positions, every layer's keys and values (as
    each layer's kind caches them: astrai.common.layers), for a model config whose cache holds ``itemsize``-byte
    elements."""
    return kv_cache_elements(model) * capacity * rows * itemsize


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


def training_state_bytes(model, adapters: int, base_dtype: str | None) -> int:
    """Weights, gradients and AdamW's moments of ``model`` (a ModelConfig): every weight trains (``base_dtype``
    None), or the model is held frozen in ``base_dtype`` with ``adapters`` trainable parameters beside it (LoRA)."""
    if base_dtype is None:
        return num_parameters(model) * TRAINING_BYTES_PER_PARAMETER
    return frozen_base_bytes(model, base_dtype) + adapters * TRAINING_BYTES_PER_PARAMETER


def frozen_base_bytes(model, base_dtype: str) -> int:
    """What LoRA's frozen base of ``model`` (a ModelConfig) takes held in ``base_dtype``."""
    parameters = num_parameters(model)
    if base_dtype != nf4.NF4:
        return parameters * FROZEN_BYTES_PER_PARAMETER[base_dtype]
    quantized = sum(math.prod(shape) for shape in nf4.held_matrices(model).values())
    held = quantized * FROZEN_BYTES_PER_PARAMETER[nf4.NF4]
    return round(held) + (parameters - quantized) * FROZEN_BYTES_PER_PARAMETER["bfloat16"]


def activation_bytes(model, tokens: int, itemsize: int, checkpointing: bool) -> int:
    """What the backward pass keeps of a micro-batch of ``tokens`` tokens on a rank, estimated for a Llama-family
    block: each block's float32 residual inputs of its two norms, and in ``itemsize``-byte activations (2 under
    autocast) the inputs of its products, the attention's queries, keys, values and output, and the MLP's four
    hidden-width tensors. With activation checkpointing, each block's input alone and one block's whole set while it
    is computed again. Plus the logits the chunked loss keeps."""
    d, f = model.dim, model.ffn_hidden_dim or 0
    if model.sparse_layers:
        f = max(f, model.experts_per_token * (model.expert_hidden_dim or 0))
    q, kv = model.n_heads * model.head_size, model.n_kv_heads * model.head_size
    per_block = 8 * d + itemsize * (2 * d + 2 * q + 2 * kv + 4 * f)
    kept = (model.n_layers * 4 * d + per_block) if checkpointing else model.n_layers * per_block
    logits = min(tokens * model.vocab_size * itemsize, LOGITS_KEEP_BYTES) + LOGITS_CHUNK_BYTES
    return tokens * kept + logits


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
