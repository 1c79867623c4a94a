"""Rotary position embedding: the inverse frequencies of each RoPE variant (default, linear, Llama 3, dynamic NTK,
YaRN, LongRoPE) as transformers computes them, the cos/sin tables, and their application to queries and keys."""

from __future__ import annotations

import math

import torch

from astrai.common.model_config import RopeScaling
from astrai.common.model_folder import ModelConfig


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
