"""A decoder-only transformer language model in plain PyTorch.

Token embedding, rotary position embedding, RMSNorm, causal attention through
``scaled_dot_product_attention`` (optionally with fewer key/value heads than
query heads), a SwiGLU MLP and an optionally tied output embedding: the Llama
architecture, and what each family the trainer computes adds to it (Gemma 2 and 3,
Phi-3, OLMo 2, Granite: :mod:`astrai.common.model_config`), each option taken from the
config, so that a feature a model does not have adds no operation. A model folder is a
Hugging Face model folder (``config.json`` and ``model.safetensors`` or shards, see
:mod:`astrai.common.model_folder`), so a Hugging Face model of these families can be a
base model and every folder we write loads in ``transformers``.

Use a trained model (a base model or a checkpoint folder)::

    from astrai.model import load_pretrained
    model = load_pretrained("checkpoints/my-job/epoch_0_step_1000")   # fp32, eval mode
    logits = model(tokens)                                            # [batch, seq, vocab]

Write a fresh base model::

    python -m astrai.model init params --preset tiny
    python -m astrai.model init params --preset small --vocab_size 512 --max_seq_len 2048
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import mmap
import os
import sys
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn
from torch.utils.checkpoint import checkpoint

from astrai.common.contract import MODEL_CONFIG_FILE, WEIGHTS_FILE
from astrai.common.layers import EXPERTS, GATED, GROUPED_QUERY, attention_kind, mlp_kind
from astrai.common.memory import LOGITS_CHUNK_BYTES, LOGITS_KEEP_BYTES
from astrai.common.model_config import FAMILY_FIELDS, RopeScaling
from astrai.common.model_folder import (
    ModelConfig,
    ModelLoadError,
    describe,
    expert_pieces,
    inspect_weights,
    saved_name,
    tensor_shapes,
)
from astrai.common.model_folder import model_digest as model_digest
from astrai.common.model_folder import num_parameters as num_parameters
from astrai.common.paths import PathError, output_folder
from astrai.common.safetensors_file import FLOAT_DTYPES
from astrai.common.values import boolean_word
from astrai.trainer.experts import MixtureOfExperts

PRESETS = {
    # About 0.9M parameters: fast enough for tests on one CPU thread.
    "tiny": ModelConfig(),
    # About 25M parameters.
    "small": ModelConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=8, ffn_hidden_dim=1408),
    # About 125M parameters; grouped-query attention keeps the KV projections small.
    "base": ModelConfig(dim=768, n_layers=18, n_heads=12, n_kv_heads=4, ffn_hidden_dim=2304, max_seq_len=2048),
}


def inverse_frequencies(
    config: ModelConfig, longest: int | None = None, local: bool = False
) -> tuple[torch.Tensor, float]:
    """RoPE frequencies of the turned part of one head, and the factor cos and sin are multiplied by, as transformers
    computes them. ``longest``: the sequence's last position + 1 (dynamic NTK and longrope change with it);
    ``local``: Gemma 3's local layers, whose RoPE has a base of its own and is never scaled."""
    dim = config.rotary_dim
    own_base = local and config.local_rope_theta is not None
    base = config.local_rope_theta if own_base else config.rope_theta
    scaling = None if own_base else config.rope_scaling
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if scaling is None:
        return 1.0 / (base**exponents), 1.0
    kind = scaling.rope_type
    if kind == "linear":
        return 1.0 / (base**exponents) / scaling.factor, 1.0
    if kind == "llama3":
        return _llama3_frequencies(1.0 / (base**exponents), scaling), 1.0
    if kind == "dynamic":
        return _dynamic_frequencies(config, base, exponents, longest), 1.0
    if kind == "yarn":
        return _yarn_frequencies(scaling, base, dim)
    return _longrope_frequencies(config, scaling, base, exponents, longest)


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed down by `factor`, short ones kept, the band between interpolated.
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _dynamic_frequencies(
    config: ModelConfig, base: float, exponents: torch.Tensor, longest: int | None
) -> torch.Tensor:
    """Dynamic NTK: within max_position_embeddings the plain frequencies; beyond, a base raised with the length
    (in float32, as transformers computes it for a longer sequence)."""
    factor, context, dim = config.rope_scaling.factor, config.max_seq_len, config.rotary_dim
    if longest is None or longest <= context:
        return 1.0 / ((base * ((factor * context / context) - (factor - 1)) ** (dim / (dim - 2))) ** exponents)
    length = torch.tensor(longest)
    grown = base * ((factor * length / context) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (grown**exponents)


def _yarn_frequencies(scaling: RopeScaling, base: float, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: frequencies that turn many times within the original context are kept, slow ones interpolated by
    ``factor``, a linear ramp between; cos and sin are scaled by the attention factor."""
    factor = scaling.factor
    attention = scaling.attention_factor
    if attention is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention = float(_yarn_mscale(factor, scaling.mscale) / _yarn_mscale(factor, scaling.mscale_all_dim))
        else:
            attention = _yarn_mscale(factor)
    context = scaling.original_max_position_embeddings

    def dimension_of(rotations: float) -> float:
        return (dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dimension_of(scaling.beta_fast or 32), dimension_of(scaling.beta_slow or 1)
    if scaling.truncate is not False:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers does, against a division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp
    turns = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * turns)) * (1 - kept) + (1.0 / turns) * kept
    return inv_freq, attention


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _longrope_frequencies(
    config: ModelConfig, scaling: RopeScaling, base: float, exponents: torch.Tensor, longest: int | None
) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): each frequency divided by its short factor while the sequence fits the original context,
    by its long factor beyond; cos and sin scaled by the attention factor."""
    context = scaling.original_max_position_embeddings
    factor = scaling.factor if scaling.factor is not None else config.max_seq_len / context
    attention = scaling.attention_factor
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(context))
    long = longest is not None and longest > context
    divisors = torch.tensor(scaling.long_factor if long else scaling.short_factor, dtype=torch.float32)
    return 1.0 / (divisors * base**exponents), attention


def rope_variant(config: ModelConfig, longest: int | None, local: bool = False):
    """What, besides the layer kind, tells one set of rotary tables from another: None for tables that do not
    change with the length; longrope's ``short`` or ``long``; dynamic NTK's length beyond max_position_embeddings."""
    scaling = config.rope_scaling
    if scaling is None or not scaling.depends_on_length or (local and config.local_rope_theta is not None):
        return None
    if scaling.rope_type == "longrope":
        return "long" if longest is not None and longest > scaling.original_max_position_embeddings else "short"
    return longest if longest is not None and longest > config.max_seq_len else None


def rotary_tables(
    config: ModelConfig,
    seq_len: int,
    device: torch.device | None = None,
    longest: int | None = None,
    local: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (seq_len, rotary_dim // 2); ``longest`` and ``local`` as inverse_frequencies."""
    inv_freq, attention = inverse_frequencies(config, longest, local)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq.to(device))
    if attention == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * attention, angles.sin() * attention


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Rotate the two halves of each head as pairs (the GPT-NeoX layout); x is (B, H, T, D), cos and sin
    # (T, R/2) or, with positions of their own per sequence, (B, 1, T, R/2). R < D: only the first R dimensions
    # turn (Phi-3's partial rotary), the rest pass.
    turned = 2 * cos.shape[-1]
    if turned != x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :turned], cos, sin), x[..., turned:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


class _UpcastLinear(torch.autograd.Function):
    """``x @ W.T + b`` in x's dtype for a frozen ``W`` stored narrower: the wide copy of ``W`` lives only while one
    product is computed (autograd keeps the narrow one for the backward pass, and no gradient for ``W``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)
        # The bias added afterwards: F.linear with a bias may return a view, which LoRA's in-place add refuses.
        out = F.linear(x, weight.to(x.dtype))
        return out if bias is None else out.add_(bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        grad_x = grad @ weight.to(grad.dtype) if ctx.needs_input_grad[0] else None
        return grad_x, None, None


def frozen_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for a weight that may be held in a narrower dtype than ``x`` (LoRA's bfloat16 base): computed in
    x's dtype, or as autocast says. A weight of x's dtype is plain ``F.linear`` (it may train)."""
    if weight.dtype == x.dtype or torch.is_autocast_enabled(x.device.type):
        return F.linear(x, weight, bias)
    if weight.requires_grad:
        raise ValueError(f"a {weight.dtype} weight that trains cannot compute in {x.dtype}: it would get no gradient")
    return _UpcastLinear.apply(x, weight, bias)


LOGITS_BACKWARD_CHUNK_BYTES = 512 << 20
"""The float32 logits of at most this many bytes exist at once in the backward pass of an output projection that
trains: each chunk adds its share of the projection's gradient (vocabulary x dim, float32) in one read and write of
it, so larger chunks spread that traffic over more rows."""


class TokenTargets(NamedTuple):
    """Which tokens to score: ``targets`` (B, L), the token each scored position predicts; ``where`` (B, L), the
    positions scored (None: every one, L = T); ``entropy``: the distribution's entropy at each of them too."""

    targets: torch.Tensor
    where: torch.Tensor | None = None
    entropy: bool = False

    def gathered(self, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden states (B, T, D) of the scored positions (B, L, D): only they go through the head."""
        if self.where is None:
            return hidden
        return hidden.gather(1, self.where.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))


class TokenScores(NamedTuple):
    """Each scored position's log-probability of its target (B, L), and its entropy (detached) when asked."""

    logps: torch.Tensor
    entropy: torch.Tensor | None


def segment_mask(segments: torch.Tensor) -> torch.Tensor:
    """Which keys each query may attend to (B, 1, T, T; True = attend) in rows that pack several records:
    ``segments`` (B, T) numbers each token's record, and a token sees the earlier tokens of its own record only."""
    length = segments.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segments.device).tril()
    return (segments.unsqueeze(2) == segments.unsqueeze(1)).logical_and(causal).unsqueeze(1)


def soft_cap(values: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(values / cap)``: Gemma 2's soft cap, of attention scores and of the final logits alike."""
    return torch.tanh(values / cap) * cap


@dataclasses.dataclass(frozen=True)
class LogitsShape:
    """What comes after the output projection: a division (Granite's logits_scaling), then a soft cap
    ``cap * tanh(logits / cap)`` (Gemma 2's final_logit_softcapping)."""

    scaling: float = 1.0
    cap: float | None = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scaling != 1.0:
            logits = logits / self.scaling
        return logits if self.cap is None else soft_cap(logits, self.cap)

    def slope(self, shaped: torch.Tensor) -> torch.Tensor | float:
        """d shaped / d raw logits, from the shaped logits."""
        slope = 1.0 / self.scaling
        return slope if self.cap is None else slope * (1.0 - (shaped / self.cap) ** 2)


def token_scores(
    hidden: torch.Tensor,
    head: torch.Tensor,
    targets: torch.Tensor,
    entropy: bool = False,
    shape: LogitsShape = LogitsShape(),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) (N,) in float32 for hidden states (N, D) and the output projection ``head`` (V, D) (its logits
    shaped by ``shape``), and the entropy of each distribution (N,), detached, when asked.

    The same numbers as ``log_softmax(shape(F.linear(hidden, head)).float())`` picked at the targets, and the same
    gradients, but a chunk of rows at a time (:data:`LOGITS_CHUNK_BYTES` of float32 logits), forward and backward:
    the float32 logits of the whole batch are never held, and its logits in the head's dtype only when they are
    small (:data:`LOGITS_KEEP_BYTES`), else each chunk's are computed again in the backward pass."""
    return _ChunkedLogProbs.apply(hidden, head, targets, entropy, shape)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


def _chunk_rows(vocab: int, budget: int) -> int:
    return max(1, budget // (4 * vocab))


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, head, targets, entropy: bool, shape: LogitsShape):
        dtype = _compute_dtype(hidden)
        weight = head.to(dtype)
        count, vocab = hidden.shape[0], head.shape[0]
        rows = _chunk_rows(vocab, LOGITS_CHUNK_BYTES)
        kept = None
        if count * vocab * dtype.itemsize <= LOGITS_KEEP_BYTES:
            kept = torch.empty(count, vocab, dtype=dtype, device=hidden.device)
        logps = torch.empty(count, dtype=torch.float32, device=hidden.device)
        entropies = torch.empty_like(logps) if entropy else None
        for start in range(0, count, rows):
            chunk = F.linear(hidden[start : start + rows].to(dtype), weight)
            if kept is not None:
                kept[start : start + rows] = chunk
            logits = shape.apply(chunk).float()
            total = torch.logsumexp(logits, dim=-1)
            logps[start : start + rows] = logits.gather(-1, targets[start : start + rows, None]).squeeze(-1) - total
            if entropy:
                entropies[start : start + rows] = total - (logits.softmax(dim=-1) * logits).sum(dim=-1)
        ctx.save_for_backward(hidden, head, targets, *([] if kept is None else [kept]))
        ctx.dtype, ctx.shape = dtype, shape
        if entropies is not None:
            ctx.mark_non_differentiable(entropies)
        return logps, entropies

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        hidden, head, targets, *kept = ctx.saved_tensors
        dtype, shape = ctx.dtype, ctx.shape
        weight = head.to(dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_head = None
        if ctx.needs_input_grad[1]:
            grad_head = torch.zeros(head.shape, dtype=torch.float32, device=head.device)
        budget = LOGITS_CHUNK_BYTES if grad_head is None else LOGITS_BACKWARD_CHUNK_BYTES
        rows = _chunk_rows(head.shape[0], budget)
        for start in range(0, hidden.shape[0], rows):
            chunk = hidden[start : start + rows].to(dtype)
            logits = shape.apply(kept[0][start : start + rows] if kept else F.linear(chunk, weight)).float()
            grad = grad_logps[start : start + rows].float().unsqueeze(-1)
            # d log p(t) / d logits = onehot(t) - softmax(logits), then through the shaping of the logits.
            grad_logits = (-logits.softmax(dim=-1) * grad).scatter_add_(-1, targets[start : start + rows, None], grad)
            grad_logits = (grad_logits * shape.slope(logits)).to(dtype)
            if grad_hidden is not None:
                grad_hidden[start : start + rows] = (grad_logits @ weight).to(hidden.dtype)
            if grad_head is not None:
                add_product(grad_head, grad_logits.transpose(0, 1), chunk)
        return grad_hidden, None if grad_head is None else grad_head.to(head.dtype), None, None, None


def add_product(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``total += a @ b`` for a float32 ``total``, as one matrix product that accumulates into it: for bfloat16 or
    float16 ``a`` and ``b``, the products are summed in float32 by the kernel itself where the device has such a kernel
    (CUDA's ``out_dtype``), so no narrow product, float32 copy and separate addition pass over ``total``."""
    if a.dtype == total.dtype:
        total.addmm_(a, b)
    elif widening_addmm_runs(str(total.device), a.dtype):
        torch.addmm(total, a, b, out_dtype=total.dtype, out=total)
    else:
        total += (a @ b).to(total.dtype)


@functools.cache
def widening_addmm_runs(device: str, dtype: torch.dtype) -> bool:
    """Whether ``addmm`` with ``out_dtype`` float32 accumulates ``dtype`` products into its float32 input in place
    here (tried once on a tiny case, and checked against the widened product)."""
    try:
        a = torch.arange(12, dtype=torch.float32, device=device).view(3, 4).to(dtype)
        b = torch.ones(4, 2, dtype=dtype, device=device)
        total = torch.full((3, 2), 0.5, device=device)
        torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return bool(torch.equal(total, a.float() @ b.float() + 0.5))


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + weight)`` in float32, its weight stored around 0."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


def rms_norm(config: ModelConfig, width: int) -> nn.Module:
    """An RMSNorm of the config's kind: Gemma's (1 + weight), or torch's."""
    return OffsetRMSNorm(width, config.norm_eps) if config.norm_plus_one else nn.RMSNorm(width, eps=config.norm_eps)


def capped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, cap: float
) -> torch.Tensor:
    """Attention with soft-capped scores (Gemma 2): ``cap * tanh(q.k * scale / cap)``, then the additive ``mask``
    and the softmax in float32 — transformers' order of operations. SDPA's fused kernels cannot cap, so it is
    computed explicitly, and only for a model that caps."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # each key/value head serves `groups` query heads
        batch, heads, length, width = k.shape
        k = k[:, :, None].expand(batch, heads, groups, length, width).reshape(batch, heads * groups, length, width)
        v = v[:, :, None].expand(batch, heads, groups, length, width).reshape(batch, heads * groups, length, width)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = soft_cap(scores, cap)
    scores = scores + (mask if mask.dtype == scores.dtype else mask.to(scores.dtype))
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_size
        queries, keys = config.n_heads * self.head_dim, config.n_kv_heads * self.head_dim
        self.widths = (queries, keys, keys)
        self.fused = config.fused_projections
        if self.fused:  # Phi-3: q, k and v from one matrix
            self.wqkv = nn.Linear(config.dim, queries + 2 * keys, bias=False)
        else:
            bias = config.attention_bias
            self.wq = nn.Linear(config.dim, queries, bias=bias)
            self.wk = nn.Linear(config.dim, keys, bias=bias)
            self.wv = nn.Linear(config.dim, keys, bias=bias)
        self.wo = nn.Linear(queries, config.dim, bias=False)
        # Qwen3, Gemma 3: every query and key head is normalised before the rotary embedding; OLMo 2: the whole
        # query and key projections.
        self.qk_norm = config.qk_norm
        per_head = config.qk_norm == "head"
        self.q_norm = rms_norm(config, self.head_dim if per_head else queries) if config.qk_norm else None
        self.k_norm = rms_norm(config, self.head_dim if per_head else keys) if config.qk_norm else None
        self.scale = config.attention_scale
        """None: SDPA's own 1/sqrt(head size)."""
        self.softcap = config.attn_logit_softcapping

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        if self.fused:
            q, k, v = self.wqkv(x).split(self.widths, dim=-1)
        else:
            q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(batch, seq_len, self.n_heads, self.head_dim)
        k = k.view(batch, seq_len, self.n_kv_heads, self.head_dim)
        v = v.view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q.transpose(1, 2), cos, sin), apply_rotary(k.transpose(1, 2), cos, sin)
        if cache is not None:  # generation: attend to every token so far (the mask says which)
            k, v = cache.store(layer, k, v)
        if self.softcap is not None:  # the mask is always given then (Transformer._masks)
            scale = self.scale if self.scale is not None else self.head_dim**-0.5
            out = capped_attention(q, k, v, mask, scale, self.softcap)
        elif mask is None:
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.scale, enable_gqa=self.n_kv_heads != self.n_heads
            )
        else:
            # Under autocast the mask must be in the queries' dtype.
            mask = mask if mask.dtype == q.dtype else mask.to(q.dtype)
            if self.n_kv_heads != self.n_heads and seq_len == 1:
                # One new token: each key/value head's group of query heads attends as one (G, D) block, so no key
                # or value is repeated for the heads that share it (a decode step reads the cache once).
                grouped = q.reshape(batch, self.n_kv_heads, self.n_heads // self.n_kv_heads, self.head_dim)
                out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=self.scale).reshape(q.shape)
            else:
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=self.n_kv_heads != self.n_heads
                )
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


class FeedForward(nn.Module):
    """A gated MLP: w2(act(w1 x) * w3 x), act SiLU (SwiGLU) or GELU's tanh form (Gemma); Phi-3 computes w1 and w3
    as one matrix, w13."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.fused = config.fused_projections
        if self.fused:
            self.w13 = nn.Linear(config.dim, 2 * config.ffn_hidden_dim, bias=False)
        else:
            self.w1 = nn.Linear(config.dim, config.ffn_hidden_dim, bias=False)
            self.w3 = nn.Linear(config.dim, config.ffn_hidden_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden_dim, config.dim, bias=False)
        self.gelu = config.activation == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.w13(x).chunk(2, dim=-1)
        else:
            gate, up = self.w1(x), self.w3(x)
        return self.w2((F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up)


ATTENTIONS: dict[str, type[nn.Module]] = {GROUPED_QUERY.name: Attention}
"""The module of each kind of attention (astrai.common.layers: its tensors and cache described there)."""
MLPS: dict[str, type[nn.Module]] = {GATED.name: FeedForward, EXPERTS.name: MixtureOfExperts}
"""The module of each kind of MLP."""


class Block(nn.Module):
    """Attention then the MLP (a mixture of experts in a sparse layer: :mod:`astrai.trainer.experts`), each added to
    the residual stream; RMSNorms before them (Llama), after them (OLMo 2) or both (Gemma), their outputs scaled by
    Granite's residual multiplier."""

    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        before, after = config.block_norms in ("pre", "both"), config.block_norms in ("post", "both")
        self.attention_norm = rms_norm(config, config.dim) if before else None
        self.attention = ATTENTIONS[attention_kind(config, layer).name](config)
        self.attention_post_norm = rms_norm(config, config.dim) if after else None
        self.ffn_norm = rms_norm(config, config.dim) if before else None
        self.feed_forward = MLPS[mlp_kind(config, layer).name](config)
        self.ffn_post_norm = rms_norm(config, config.dim) if after else None
        self.residual_multiplier = config.residual_multiplier
        self.plain = config.block_norms == "pre" and config.residual_multiplier == 1.0

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        if self.plain:
            x = x + self.attention(self.attention_norm(x), cos, sin, mask, cache, layer)
            return x + self.feed_forward(self.ffn_norm(x))
        attended = self.attention(_norm(self.attention_norm, x), cos, sin, mask, cache, layer)
        x = x + self._scaled(_norm(self.attention_post_norm, attended))
        return x + self._scaled(_norm(self.ffn_post_norm, self.feed_forward(_norm(self.ffn_norm, x))))

    def _scaled(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.residual_multiplier == 1.0 else out * self.residual_multiplier


def _norm(norm: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
    return x if norm is None else norm(x)


class KVCache:
    """Every layer's keys and values in buffers of a fixed capacity, and which of their slots hold a token.

    Its state lives in device tensors (the next slot, each row's next rotary position, the visible slots), so a
    decode step (:meth:`Transformer.decode_step`) reads no Python number that changes from one token to the next:
    the same kernels, on the same buffers, compute every step (what a CUDA graph replays).
    """

    def __init__(self, config: ModelConfig, batch: int, capacity: int, device: torch.device, dtype: torch.dtype):
        shape = (batch, config.n_kv_heads, capacity, config.head_size)
        self.capacity = capacity
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layers)]
        self.visible = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        """Which slots hold a token (not left padding, not yet written)."""
        self.slot = torch.zeros((), dtype=torch.long, device=device)
        """The slot the next token goes into."""
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)
        """Each row's rotary position of its next token (its real tokens so far)."""
        self.length = 0
        """Slots filled, as the eager path (:meth:`begin`) counts them; a decode step counts on the device."""
        self.local_window = config.attention_window if config.window_layers else None
        """A windowed layer (every layer of a Mistral, Gemma's local ones) sees the last local_window tokens only."""
        self.rotary: dict[bool, tuple[torch.Tensor, torch.Tensor]] | None = None
        """The rotary tables (cos, sin) of every position of the cache, by layer kind (windowed or not), owned by the
        cache so that they live as long as the decode step that reads them (a captured step keeps their addresses);
        None for a RoPE that changes with the length, whose tables each step computes (such steps are not captured)."""
        if not config.rope_depends_on_length:
            kinds = {False, bool(config.window_layers)}
            self.rotary = {local: rotary_tables(config, capacity, device, None, local) for local in kinds}
        self._slots = torch.arange(capacity, device=device)
        self._step = False

    def reset(self) -> None:
        """Empty, in place: the buffers stay where they are (a captured decode step keeps reading them)."""
        self.visible.zero_()
        self.slot.zero_()
        self.positions.zero_()
        self.length = 0

    def store(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Put a layer's new keys and values (B, H, T, D) into their slots; every slot's (B, H, capacity, D)."""
        keys, values = keys.to(self.keys[layer].dtype), values.to(self.values[layer].dtype)
        if self._step:
            self.keys[layer].index_copy_(2, self.slot.view(1), keys)
            self.values[layer].index_copy_(2, self.slot.view(1), values)
        else:
            self.keys[layer][:, :, self.length : self.length + keys.shape[2]] = keys
            self.values[layer][:, :, self.length : self.length + keys.shape[2]] = values
        return self.keys[layer], self.values[layer]

    def begin(self, real: torch.Tensor) -> tuple[torch.Tensor, dict[bool, torch.Tensor]]:
        """Note which of the next T tokens (B, T) are real; their positions (B, T) and the additive attention masks
        (B, 1, T, capacity) of the forward pass that adds them, by layer kind (local or not). Eager: T and the slots
        filled are Python numbers."""
        start, count = self.length, real.shape[1]
        if start + count > self.capacity:
            raise ValueError(f"{start + count} tokens do not fit a cache of {self.capacity}")
        self._step = False
        self.visible[:, start : start + count] = real
        positions = (self.positions.unsqueeze(1) + real.cumsum(dim=1) - 1).clamp(min=0)
        query = torch.arange(start, start + count, device=real.device).unsqueeze(1)
        key = self._slots.unsqueeze(0)
        allowed = (key <= query).unsqueeze(0) & self.visible.unsqueeze(1)
        masks = {False: _padded_mask(allowed, key == query)}
        if self.local_window is not None:
            # Cache slots and positions differ by a row's left padding only, so their distances are the same.
            masks[True] = _padded_mask(allowed & (key > query - self.local_window).unsqueeze(0), key == query)
        return positions, masks

    def begin_step(self) -> tuple[torch.Tensor, dict[bool, torch.Tensor]]:
        """One real token per row into the next slot, with device state only: its positions (B, 1) and the attention
        masks (B, 1, 1, capacity) by layer kind."""
        self._step = True
        self.visible.index_fill_(1, self.slot.view(1), True)
        masks = {False: _step_mask(self.visible)}
        if self.local_window is not None:
            masks[True] = _step_mask(self.visible & (self._slots > self.slot - self.local_window).unsqueeze(0))
        return self.positions.unsqueeze(1), masks

    def advance(self, real: torch.Tensor | None = None) -> None:
        """Count the tokens just added: ``real`` (B, T) of :meth:`begin`'s pass, or one per row of a step."""
        if real is None:
            self.slot.add_(1)
            self.positions.add_(1)
            self._step = False
            return
        self.length += real.shape[1]
        self.slot.fill_(self.length)
        self.positions.add_(real.sum(dim=1))


def _step_mask(visible: torch.Tensor) -> torch.Tensor:
    return torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible, float("-inf"))[:, None, None, :]


def _padded_mask(allowed: torch.Tensor, itself: torch.Tensor) -> torch.Tensor:
    # A padding query sees itself: its row stays finite (and nothing real ever attends to it).
    allowed = allowed | itself.unsqueeze(0)
    return torch.zeros(allowed.shape, device=allowed.device).masked_fill_(~allowed, float("-inf")).unsqueeze(1)


def _additive(allowed: torch.Tensor) -> torch.Tensor:
    # Additive (0 / -inf), built once for every layer: attention with a float mask is the faster path.
    return torch.zeros(allowed.shape, device=allowed.device).masked_fill_(~allowed, float("-inf"))


class Transformer(nn.Module):
    """Maps token ids (B, T) to next-token logits (B, T, vocab_size); a sequence classifier's (``config.num_labels``)
    to the scores of its head at every position (B, T, num_labels)."""

    def __init__(self, config: ModelConfig, activation_checkpointing: bool = False):
        super().__init__()
        self.config = config
        # Recompute each block's activations in backward instead of storing them: less memory, ~30% more compute.
        self.activation_checkpointing = activation_checkpointing
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = rms_norm(config, config.dim)
        # A tied model has no separate output tensor, so the state dict never holds two names for one tensor
        # (which safetensors refuses to save).
        classifier = config.num_labels is not None
        self.output = (
            None if config.tie_embeddings or classifier else nn.Linear(config.dim, config.vocab_size, bias=False)
        )
        # A sequence classifier (a reward model) scores each position with its head; a sequence's score is its last
        # token's (astrai.trainer.objectives.reward_model.last_positions).
        self.classifier = nn.Linear(config.dim, config.num_labels, bias=False) if classifier else None
        self.logits_shape = LogitsShape(config.logits_scaling, config.final_logit_softcapping)
        # Rotary tables derive from the config: not in the state dict, and not buffers either (DDP would
        # broadcast them every step), computed for the longest sequence seen so far on the device in use.
        self._rope: dict = {}
        self._local = frozenset(config.window_layers)
        """The layers that attend within the window (every layer of a Mistral, Gemma's local ones): a mask of their
        own past it, and Gemma 3's RoPE base."""

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """GPT-2 style init: N(0, 0.02), with residual output projections scaled down by depth."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if name.endswith(".bias"):
                nn.init.zeros_(param)
            elif name.endswith(("attention.wo.weight", "feed_forward.w2.weight", "feed_forward.down")):
                nn.init.normal_(param, std=residual_std, generator=generator)
            elif param.dim() >= 2:
                nn.init.normal_(param, std=0.02, generator=generator)
            elif self.config.norm_plus_one:
                nn.init.zeros_(param)  # a norm that scales by (1 + weight)
            else:
                nn.init.ones_(param)

    def _rotary(
        self, seq_len: int, device: torch.device, longest: int | None = None, local: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (local and self.config.local_rope_theta is not None, rope_variant(self.config, longest, local))
        cached = self._rope.get(key)
        if cached is None or cached[0].shape[0] < seq_len or cached[0].device != device:
            if len(self._rope) > 8:  # dynamic NTK's tables of past lengths
                self._rope.clear()
            cached = self._rope[key] = rotary_tables(self.config, seq_len, device, longest, local)
        cos, sin = cached
        return cos[:seq_len], sin[:seq_len]

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
        cache: KVCache | None = None,
        real: torch.Tensor | None = None,
        score: TokenTargets | None = None,
    ) -> torch.Tensor | TokenScores:
        """Logits of ``tokens`` (B, T); with ``segments`` (B, T) several records packed in one row.

        ``segments`` confines attention to each record (a token sees the earlier tokens of its own segment
        only); ``positions`` (B, T) restarts the rotary positions at each record. With a ``cache``: generation's
        step (:meth:`decode`, :meth:`decode_step`), through ``forward`` so that a DDP or FSDP wrapper sees it as the
        model's call. With ``score``: the log-probabilities of its target tokens instead (:func:`token_scores`),
        computed over the vocabulary a chunk of positions at a time, so the logits of the whole batch never exist.
        A sequence classifier gives its head's scores at every position instead.
        """
        if cache is not None:
            return self.decode(tokens, real, cache) if real is not None else self.decode_step(tokens, cache)
        seq_len = tokens.shape[1]
        if seq_len > self.config.context:
            raise ValueError(
                f"sequence length {seq_len} exceeds the model's context of {self.config.context} tokens "
                f"(max_position_embeddings {self.config.max_seq_len}, stretched where its RoPE scaling says)"
            )
        inputs = self._layer_inputs(seq_len, positions, segments, tokens.device)
        x = self._embed(tokens)
        for index, layer in enumerate(self.layers):
            cos, sin, mask = inputs[index in self._local]
            if self.activation_checkpointing and self.training:
                x = checkpoint(layer, x, cos, sin, mask, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask)
        x = self.norm(x)
        if self.classifier is not None:
            return self.classifier(x)  # (B, T, num_labels)
        return self._logits(x) if score is None else self._scores(x, score)

    def _layer_inputs(self, seq_len: int, positions, segments, device: torch.device) -> dict:
        """The rotary tables and mask of each kind of layer (local or not): {local: (cos, sin, mask)}."""
        longest = seq_len
        if positions is not None and self.config.rope_depends_on_length:
            longest = int(positions.max()) + 1  # as transformers decides from the position ids
        masks = self._masks(seq_len, segments, device)
        inputs = {}
        for local in {False, bool(self._local)}:
            cos, sin = self._rotary(seq_len, device, longest, local)
            if positions is not None:
                cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
            inputs[local] = (cos, sin, masks[local])
        return inputs

    def _masks(self, seq_len: int, segments, device: torch.device) -> dict[bool, torch.Tensor | None]:
        """The additive attention masks by layer kind; None for plain causal attention (SDPA's fused path)."""
        explicit = self.config.attn_logit_softcapping is not None  # capped scores are computed, not fused
        window = self.config.attention_window
        banded = bool(self._local) and seq_len > window
        if segments is None and not explicit and not banded:
            return {False: None, True: None}
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
        allowed = causal if segments is None else segment_mask(segments)
        full = _additive(allowed) if segments is not None or explicit else None
        if not banded:
            return {False: full, True: full}
        # A windowed layer's token sees itself and the window - 1 tokens before it.
        return {False: full, True: _additive(allowed.logical_and(causal.triu(1 - window)))}

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        # The activations are in the norms' dtype, which a narrower (frozen) embedding table does not change.
        x = self.tok_embeddings(tokens).to(self.norm.weight.dtype)
        scale = self.config.embedding_scale
        return x if scale == 1.0 else x * scale

    def _scores(self, x: torch.Tensor, score: TokenTargets) -> TokenScores:
        x = score.gathered(x)
        head = self.tok_embeddings.weight if self.output is None else self.output.weight
        logps, entropy = token_scores(
            x.reshape(-1, x.shape[-1]), head, score.targets.reshape(-1), score.entropy, self.logits_shape
        )
        size = score.targets.shape
        return TokenScores(logps.view(size), None if entropy is None else entropy.view(size))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = frozen_linear(x, self.tok_embeddings.weight) if self.output is None else self.output(x)
        return self.logits_shape.apply(logits)

    def decode(self, tokens: torch.Tensor, real: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The next-token logits (B, vocab) after ``tokens`` (B, T), which follow the ones in ``cache`` (and go into
        it); ``real`` (B, T) is False at left padding. See :mod:`astrai.trainer.decoding`, which calls it as
        ``model(tokens, cache=cache, real=real)`` (a prompt's prefill) and :meth:`decode_step` for each new token."""
        positions, masks = cache.begin(real)
        longest = int(positions.max()) + 1 if self.config.rope_depends_on_length else None
        x = self._decode_layers(tokens, positions, masks, cache, longest)
        cache.advance(real)
        return x

    def decode_step(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The next-token logits (B, vocab) after one new token per row (B, 1): device work only, the same every
        step (what a CUDA graph captures and replays) — but for a RoPE that changes with the length (dynamic NTK,
        longrope), whose tables follow the longest row (a read of the device, so such steps are not captured)."""
        positions, masks = cache.begin_step()
        longest = int(positions.max()) + 1 if self.config.rope_depends_on_length else None
        x = self._decode_layers(tokens, positions, masks, cache, longest)
        cache.advance()
        return x

    def _decode_layers(self, tokens, positions, masks, cache: KVCache, longest: int | None) -> torch.Tensor:
        rotary = {}
        for local in {False, bool(self._local)}:
            if cache.rotary is not None:  # the cache's own tables: a captured step reads nothing the model replaces
                cos, sin = cache.rotary[local]
            else:
                cos, sin = self._rotary(cache.capacity, tokens.device, longest, local)
            rotary[local] = (cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
        x = self._embed(tokens)
        for index, layer in enumerate(self.layers):
            local = index in self._local
            x = layer(x, *rotary[local], masks[local], cache, index)
        return self._logits(self.norm(x[:, -1]))


def save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.save_file`` with the usual file mode.

    safetensors creates files readable by their owner only; a base model made
    by one user must stay readable by the container, which may run as another.
    """
    save_file(tensors, path, metadata=metadata)
    os.chmod(path, _FILE_MODE)


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


# Read once at import: changing the umask later, from the checkpoint writer thread, would race other threads.
_FILE_MODE = 0o666 & ~_umask()


def read_weights(folder: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """The weights of a model folder, by our tensor names, in the dtype they are stored in.

    Reads either naming, one file or shards, fp32, bf16 or fp16. The file headers are checked against the
    config first (missing, unexpected, misshapen tensors), so a bad folder fails before any weight is read.
    bf16 and fp16 weights become fp32 when ``load_state_dict`` copies them into the (fp32) model: that
    copy happens anyway, so widening them here would only add a pass over every weight.

    Each file's header is read once (by the check): the tensors are then views of the file mapped into
    memory (copy-on-write), read from the disk as they are used.
    """
    summary = inspect_weights(folder, config)
    state = {}
    pieces: dict[str, list] = {}
    for path, names in summary.names.items():
        start, layout = summary.layouts[path]
        try:
            with open(path, "rb") as handle:
                mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY) if start < _size(handle) else None
        except OSError as error:
            raise ModelLoadError(f"{path}: {error.strerror}") from None
        for stored, ours in names.items():
            dtype, shape, (begin, end) = layout[stored]
            kind = _TORCH_DTYPES[dtype]
            if end == begin:
                state[ours] = torch.empty(shape, dtype=kind)
                continue
            count = (end - begin) // kind.itemsize
            tensor = torch.frombuffer(mapped, dtype=kind, count=count, offset=start + begin).view(shape)
            if stored in summary.pieces:
                pieces.setdefault(ours, []).append((summary.pieces[stored], tensor))
            else:
                state[ours] = tensor
    shapes = tensor_shapes(config)
    for ours, parts in pieces.items():
        # An expert tensor stored in parts (each expert's matrices) is put together here: a copy.
        state[ours] = stacked = torch.empty(shapes[ours], dtype=parts[0][1].dtype)
        for piece, tensor in parts:
            piece.select(stacked).copy_(tensor)
    return state


# The weight dtypes a model folder may hold, as torch dtypes.
_TORCH_DTYPES = {name: getattr(torch, dtype) for name, dtype in FLOAT_DTYPES.items()}


def _size(handle) -> int:
    return os.fstat(handle.fileno()).st_size


def hf_state_dict(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The same tensors under Hugging Face's names in ``config``'s family, as written to ``model.safetensors``: as
    transformers' ``save_pretrained`` writes them (the experts one matrix per expert and projection)."""
    tensors = {}
    pieces: dict[str, list] = {}
    for stored, piece in expert_pieces(config, per_expert=True).items():
        pieces.setdefault(piece.name, []).append((stored, piece))
    for name, tensor in state.items():
        if name in pieces:
            tensors.update({stored: piece.select(tensor).contiguous() for stored, piece in pieces[name]})
        else:
            tensors[saved_name(name, config)] = tensor.contiguous()
    return tensors


def load_base_model(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and checked weights of a base model folder (ours, or a Hugging Face one of a native family)."""
    folder = Path(folder)
    config = ModelConfig.load(folder)
    return config, read_weights(folder, config)


def load_pretrained(folder: Path) -> Transformer:
    """The model of a folder (a base model, a Hugging Face folder of a native family or a checkpoint), fp32, in eval
    mode.

    ``model(tokens)`` maps token ids ``[batch, seq]`` to logits ``[batch, seq, vocab]``.
    """
    config, state = load_base_model(folder)
    model = Transformer(config)
    model.load_state_dict(state)
    return model.eval()


def describe_folder(folder: Path) -> str:
    """One line about a model folder (architecture, parameter count, dtype); a bad folder raises ModelLoadError."""
    config = ModelConfig.load(folder)
    return describe(folder, config, inspect_weights(folder, config))


def write_base_model(folder: Path, config: ModelConfig, seed: int = 0) -> int:
    """Initialise a model from ``seed`` and write it to ``folder``; returns the parameter count."""
    model = Transformer(config)
    model.init_weights(torch.Generator().manual_seed(seed))
    return save_model_folder(folder, config, model.state_dict())


def save_model_folder(folder: Path, config: ModelConfig, state: dict[str, torch.Tensor]) -> int:
    """Write ``config.json`` and ``model.safetensors`` (Hugging Face names) into ``folder``; the parameter count.

    Both go under temporary names first and are renamed, so an interrupted write never leaves half a model.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = hf_state_dict(state, config)
    weights_tmp = folder / f".{WEIGHTS_FILE}.tmp"
    config_tmp = folder / f".{MODEL_CONFIG_FILE}.tmp"
    save_tensors(tensors, weights_tmp, metadata={"format": "pt"})
    config_tmp.write_text(config.to_json(), encoding="utf-8")
    os.replace(weights_tmp, folder / WEIGHTS_FILE)
    os.replace(config_tmp, folder / MODEL_CONFIG_FILE)
    return sum(t.numel() for t in tensors.values())


def _parse_bool(text: str) -> bool:
    value = boolean_word(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return value


# Fields a preset can be overridden with on the command line (RoPE scaling and token ids come from HF configs).
# eos_token_id may be a list in a Hugging Face config; on this command line it is one id.
_CLI_FIELDS = [
    f
    for f in dataclasses.fields(ModelConfig)
    if f.type in ("int", "float", "bool", "int | None", "int | tuple[int, ...] | None") and f.name not in FAMILY_FIELDS
]


def main(argv: list[str] | None = None, more: dict | None = None) -> int:
    """``python -m astrai.model``: ``init``, and each of ``more`` (name: (add its parser, run it))."""
    parser = argparse.ArgumentParser(prog="python -m astrai.model", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    for add, _ in (more or {}).values():
        add(commands)
    init = commands.add_parser("init", help="write a freshly initialised base model (config.json, model.safetensors)")
    init.add_argument("dir", help="model folder to write")
    init.add_argument("--preset", choices=sorted(PRESETS), required=True, help="architecture to start from")
    init.add_argument("--seed", type=int, default=0, help="seed of the weight initialisation (default 0)")
    init.add_argument("--force", action="store_true", help="overwrite a model that already exists in DIR")
    for field in _CLI_FIELDS:
        kind = _parse_bool if field.type == "bool" else float if field.type == "float" else int
        init.add_argument(f"--{field.name}", type=kind, help=f"override the preset's {field.name}")
    args = parser.parse_args(argv)
    if args.command in (more or {}):
        return more[args.command][1](args)

    overrides = {f.name: getattr(args, f.name) for f in _CLI_FIELDS if getattr(args, f.name) is not None}
    try:
        config = dataclasses.replace(PRESETS[args.preset], **overrides)
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(config, name)
            if value is not None and not 0 <= value < config.vocab_size:
                raise ValueError(
                    f"--{name} {value}: expected a token id from 0 to {config.vocab_size - 1} (vocab_size)"
                )
        folder = output_folder(args.dir, "DIR")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except PathError as error:
        print(error.show(), file=sys.stderr)
        return error.exit_code
    if not args.force and ((folder / WEIGHTS_FILE).exists() or (folder / MODEL_CONFIG_FILE).exists()):
        print(f"error: {folder} already holds a model; pass --force to overwrite it", file=sys.stderr)
        return 1
    try:
        count = write_base_model(folder, config, seed=args.seed)
    except OSError as error:
        print(f"error: cannot write the model into {folder}: {error.strerror}", file=sys.stderr)
        return 1
    print(f"wrote {args.preset} model ({count / 1e6:.2f}M parameters) to {folder}")
    return 0
