"""The kinds of layer a block is built of, described once and torch-free: what each holds (its tensors, by name within
the block, with their shapes), what a token multiplies through, and what it caches for generation.

The model builds one module per kind (``astrai.trainer.models.layers``: ``ATTENTIONS``, ``MLPS``), chosen by
:func:`attention_kind` and :func:`mlp_kind`; the folder's tensor names and shapes (``astrai.common.model_folder``),
the FLOP count (MFU), preflight's memory and the key/value cache read the kinds here. A family that brings a new kind
of layer (a latent attention, a shared expert) adds a :class:`LayerKind` here and its module there; nothing else
describes its shapes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

Shapes = dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class LayerKind:
    """One kind of attention or MLP."""

    name: str
    tensors: Callable[[object], Shapes]
    """The tensors it holds (names within the block: ``attention.wq.weight``), from a ModelConfig."""
    active_share: Callable[[object, str], float] = lambda config, name: 1.0
    """The share of a matrix a token multiplies through (a mixture of experts: its chosen experts' only)."""
    cache: Callable[[object], int] = lambda config: 0
    """Elements of the key/value cache one token takes in one layer of this kind (attention only)."""
    score_flops: Callable[[object, int], int] = lambda config, seq_len: 0
    """Forward FLOPs per token of what is not a weight's product (attention's scores and their use) at seq_len."""


def _grouped_query(config) -> Shapes:
    """Grouped-query attention: q, k, v (one fused matrix in Phi-3; biases in Qwen2), q/k norms, the output."""
    d, q, kv, head = (
        config.dim,
        config.n_heads * config.head_size,
        config.n_kv_heads * config.head_size,
        config.head_size,
    )
    shapes: Shapes = {}
    if config.fused_projections:
        shapes["attention.wqkv.weight"] = (q + 2 * kv, d)
    else:
        shapes.update({"attention.wq.weight": (q, d), "attention.wk.weight": (kv, d), "attention.wv.weight": (kv, d)})
    if config.attention_bias:
        shapes.update({"attention.wq.bias": (q,), "attention.wk.bias": (kv,), "attention.wv.bias": (kv,)})
    if config.qk_norm is not None:
        per_head = config.qk_norm == "head"
        shapes["attention.q_norm.weight"] = (head if per_head else q,)
        shapes["attention.k_norm.weight"] = (head if per_head else kv,)
    shapes["attention.wo.weight"] = (d, q)
    return shapes


def _gated(config) -> Shapes:
    """A gated MLP: w2(act(w1 x) * w3 x); Phi-3 computes w1 and w3 as one matrix, w13."""
    d, f = config.dim, config.ffn_hidden_dim
    if config.fused_projections:
        return {"feed_forward.w13.weight": (2 * f, d), "feed_forward.w2.weight": (d, f)}
    return {"feed_forward.w1.weight": (f, d), "feed_forward.w3.weight": (f, d), "feed_forward.w2.weight": (d, f)}


def _experts(config) -> Shapes:
    """A mixture of experts: the router and the stacked experts (gate rows then up rows; down)."""
    e, d, h = config.n_experts, config.dim, config.expert_hidden_dim
    return {"feed_forward.router.weight": (e, d), "feed_forward.gate_up": (e, 2 * h, d), "feed_forward.down": (e, d, h)}


def _chosen_experts(config, name: str) -> float:
    return 1.0 if name.endswith("router.weight") else config.experts_per_token / config.n_experts


GROUPED_QUERY = LayerKind(
    "grouped_query",
    _grouped_query,
    cache=lambda config: 2 * config.n_kv_heads * config.head_size,
    # Q.K^T and A.V: 2 * seq_len * (n_heads * head_size) FLOPs each, per token (the causal mask not discounted).
    score_flops=lambda config, seq_len: 4 * seq_len * config.n_heads * config.head_size,
)
GATED = LayerKind("gated", _gated)
EXPERTS = LayerKind("experts", _experts, active_share=_chosen_experts)

ATTENTION_KINDS = {kind.name: kind for kind in (GROUPED_QUERY,)}
MLP_KINDS = {kind.name: kind for kind in (GATED, EXPERTS)}


def attention_kind(config, layer: int) -> LayerKind:
    """The attention of ``layer`` (every family's is grouped-query attention with the config's options)."""
    return GROUPED_QUERY


def mlp_kind(config, layer: int) -> LayerKind:
    """The MLP of ``layer``: a mixture of experts in a sparse layer, else a gated MLP."""
    return EXPERTS if layer in config.sparse_layers else GATED


BLOCK_NORMS = {
    # ours -> Hugging Face's, for the norms of a block, by where they sit (ModelConfig.block_norms). Llama's norm
    # before the MLP is its post_attention_layernorm; Gemma's is its pre_feedforward_layernorm.
    "pre": {"attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"},
    "post": {"attention_post_norm": "post_attention_layernorm", "ffn_post_norm": "post_feedforward_layernorm"},
    "both": {
        "attention_norm": "input_layernorm",
        "attention_post_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "ffn_post_norm": "post_feedforward_layernorm",
    },
}
"""A block's RMSNorms by where they sit (``ModelConfig.block_norms``), each with its Hugging Face name."""


def block_norms(config) -> tuple[str, ...]:
    """A block's RMSNorms, by where they sit (``ModelConfig.block_norms``)."""
    return tuple(BLOCK_NORMS[config.block_norms])


def layer_tensors(config, layer: int) -> Shapes:
    """Every tensor of block ``layer``, by its name within the block, in the order the block holds them."""
    norms = {f"{norm}.weight": (config.dim,) for norm in block_norms(config)}
    shapes = {name: shape for name, shape in norms.items() if name.startswith("attention_norm")}
    shapes.update(attention_kind(config, layer).tensors(config))
    shapes.update({name: norms[name] for name in ("attention_post_norm.weight", "ffn_norm.weight") if name in norms})
    shapes.update(mlp_kind(config, layer).tensors(config))
    shapes.update({name: shape for name, shape in norms.items() if name.startswith("ffn_post_norm")})
    return shapes


def matmul_params(config) -> int:
    """Weights a token multiplies through: every block's matrices (of a mixture, the router and the experts it goes
    to), and the output head (the embedding matrix when tied: a lookup at the input, a product at the output)."""
    total = config.vocab_size * config.dim
    for layer in range(config.n_layers):
        for kind in (attention_kind(config, layer), mlp_kind(config, layer)):
            for name, shape in kind.tensors(config).items():
                if len(shape) >= 2:
                    total += int(math.prod(shape) * kind.active_share(config, name))
    return total


def flops_per_token(config, seq_len: int) -> int:
    """Training FLOPs per token: 6 per weight a token multiplies through (2 forward, 4 backward), and three times the
    forward FLOPs of the attention scores at ``seq_len``."""
    scores = sum(attention_kind(config, layer).score_flops(config, seq_len) for layer in range(config.n_layers))
    return 6 * matmul_params(config) + 3 * scores


def kv_cache_elements(config) -> int:
    """Elements of the key/value cache one token takes over every layer."""
    return sum(attention_kind(config, layer).cache(config) for layer in range(config.n_layers))
