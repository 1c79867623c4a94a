"""The modules a block is built of: RMSNorm (and Gemma's offset one), grouped-query attention (with soft-capped
scores), the gated MLP, and the block itself, which takes its attention and MLP by the kinds
:mod:`astrai.common.layers` describes (``ATTENTIONS``, ``MLPS``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from astrai.common.layers import EXPERTS, GATED, GROUPED_QUERY, attention_kind, mlp_kind
from astrai.common.model_folder import ModelConfig
from astrai.trainer.models.cache import KVCache
from astrai.trainer.models.experts import MixtureOfExperts
from astrai.trainer.models.rope import apply_rotary
from astrai.trainer.models.scoring import soft_cap


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
    """Attention then the MLP (a mixture of experts in a sparse layer: :mod:`astrai.trainer.models.experts`), each
    added to the residual stream; RMSNorms before them (Llama), after them (OLMo 2) or both (Gemma), their outputs
    scaled by Granite's residual multiplier."""

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
