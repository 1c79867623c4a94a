"""A decoder-only transformer language model in plain PyTorch.

Token embedding, rotary position embedding, RMSNorm, causal attention through
``scaled_dot_product_attention`` (optionally with fewer key/value heads than
query heads), a SwiGLU MLP and an optionally tied output embedding: the Llama
architecture. A model folder is a Hugging Face model folder (``config.json`` and
``model.safetensors`` or shards, see :mod:`astrai.common.model_folder`), so a Hugging
Face Llama-family model can be a base model and every folder we write loads in
``transformers``.

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
from astrai.common.model_folder import (
    ModelConfig,
    ModelLoadError,
    describe,
    hf_name,
    inspect_weights,
)
from astrai.common.model_folder import (
    check_window as check_window,
)
from astrai.common.model_folder import model_digest as model_digest
from astrai.common.model_folder import num_parameters as num_parameters
from astrai.common.paths import PathError, output_folder
from astrai.common.safetensors_file import FLOAT_DTYPES

PRESETS = {
    # About 0.9M parameters: fast enough for tests on one CPU thread.
    "tiny": ModelConfig(),
    # About 25M parameters.
    "small": ModelConfig(dim=512, n_layers=8, n_heads=8, n_kv_heads=8, ffn_hidden_dim=1408),
    # About 125M parameters; grouped-query attention keeps the KV projections small.
    "base": ModelConfig(dim=768, n_layers=18, n_heads=12, n_kv_heads=4, ffn_hidden_dim=2304, max_seq_len=2048),
}


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """RoPE frequencies of one head, with the config's scaling (as transformers computes them)."""
    dim = config.head_size
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths are slowed down by `factor`, short ones kept, the band between interpolated.
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotary_tables(
    config: ModelConfig, seq_len: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (seq_len, head_size // 2)."""
    inv_freq = inverse_frequencies(config).to(device)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Rotate the two halves of each head as pairs (the GPT-NeoX layout); x is (B, H, T, D), cos and sin
    # (T, D/2) or, with positions of their own per sequence, (B, 1, T, D/2).
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


LOGITS_CHUNK_BYTES = 128 << 20
"""The float32 logits of at most this many bytes exist at once when a loss is computed over the vocabulary."""
LOGITS_KEEP_BYTES = 1 << 30
"""Logits (in the head's compute dtype) of at most this many bytes in all are kept from the forward pass for the
backward; larger ones are computed again there, a chunk at a time."""


class TokenTargets(NamedTuple):
    """Which tokens to score: ``targets`` (B, L), the token each scored position predicts; ``where`` (B, L), the
    positions scored (None: every one, L = T); ``entropy``: the distribution's entropy at each of them too."""

    targets: torch.Tensor
    where: torch.Tensor | None = None
    entropy: bool = False


class TokenScores(NamedTuple):
    """Each scored position's log-probability of its target (B, L), and its entropy (detached) when asked."""

    logps: torch.Tensor
    entropy: torch.Tensor | None


def token_scores(
    hidden: torch.Tensor, head: torch.Tensor, targets: torch.Tensor, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) (N,) in float32 for hidden states (N, D) and the output projection ``head`` (V, D), and the
    entropy of each distribution (N,), detached, when asked.

    The same numbers as ``log_softmax(F.linear(hidden, head).float())`` picked at the targets, and the same
    gradients, but a chunk of rows at a time (:data:`LOGITS_CHUNK_BYTES` of float32 logits), forward and backward:
    the float32 logits of the whole batch are never held, and its logits in the head's dtype only when they are
    small (:data:`LOGITS_KEEP_BYTES`), else each chunk's are computed again in the backward pass."""
    return _ChunkedLogProbs.apply(hidden, head, targets, entropy)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, head, targets, entropy: bool):
        dtype = _compute_dtype(hidden)
        weight = head.to(dtype)
        count, vocab = hidden.shape[0], head.shape[0]
        rows = max(1, LOGITS_CHUNK_BYTES // (4 * vocab))
        keep = count * vocab * dtype.itemsize <= LOGITS_KEEP_BYTES
        logps = torch.empty(count, dtype=torch.float32, device=hidden.device)
        entropies = torch.empty_like(logps) if entropy else None
        kept = []
        for start in range(0, count, rows):
            chunk = F.linear(hidden[start : start + rows].to(dtype), weight)
            if keep:
                kept.append(chunk)
            logits = chunk.float()
            total = torch.logsumexp(logits, dim=-1)
            logps[start : start + rows] = logits.gather(-1, targets[start : start + rows, None]).squeeze(-1) - total
            if entropy:
                entropies[start : start + rows] = total - (logits.softmax(dim=-1) * logits).sum(dim=-1)
        ctx.save_for_backward(hidden, head, targets, *kept)
        ctx.dtype, ctx.rows = dtype, rows
        if entropies is not None:
            ctx.mark_non_differentiable(entropies)
        return logps, entropies

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        hidden, head, targets, *kept = ctx.saved_tensors
        dtype, rows = ctx.dtype, ctx.rows
        weight = head.to(dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_head = None
        if ctx.needs_input_grad[1]:
            grad_head = torch.zeros(head.shape, dtype=torch.float32, device=head.device)
        for index, start in enumerate(range(0, hidden.shape[0], rows)):
            chunk = hidden[start : start + rows].to(dtype)
            logits = (kept[index] if kept else F.linear(chunk, weight)).float()
            grad = grad_logps[start : start + rows].float().unsqueeze(-1)
            # d log p(t) / d logits = onehot(t) - softmax(logits)
            grad_logits = (-logits.softmax(dim=-1) * grad).scatter_add_(-1, targets[start : start + rows, None], grad)
            grad_logits = grad_logits.to(dtype)
            if grad_hidden is not None:
                grad_hidden[start : start + rows] = (grad_logits @ weight).to(hidden.dtype)
            if grad_head is not None:
                grad_head += (grad_logits.transpose(0, 1) @ chunk).float()
        return grad_hidden, None if grad_head is None else grad_head.to(head.dtype), None, None


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_size
        bias = config.attention_bias
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)
        # Qwen3: every query and key head is normalised before the rotary embedding.
        self.q_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps) if config.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=config.norm_eps) if config.qk_norm else None

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
        q = self.wq(x).view(batch, seq_len, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, seq_len, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seq_len, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q.transpose(1, 2), cos, sin), apply_rotary(k.transpose(1, 2), cos, sin)
        if cache is not None:  # generation: attend to every token so far (the mask says which)
            k, v = cache.store(layer, k, v)
        gqa = self.n_kv_heads != self.n_heads
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            # Under autocast the mask must be in the queries' dtype.
            mask = mask if mask.dtype == q.dtype else mask.to(q.dtype)
            if gqa and seq_len == 1:
                # One new token: each key/value head's group of query heads attends as one (G, D) block, so no key
                # or value is repeated for the heads that share it (a decode step reads the cache once).
                grouped = q.reshape(batch, self.n_kv_heads, self.n_heads // self.n_kv_heads, self.head_dim)
                out = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask).reshape(q.shape)
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_hidden_dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_hidden_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, mask, cache, layer)
        return x + self.feed_forward(self.ffn_norm(x))


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

    def begin(self, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Note which of the next T tokens (B, T) are real; their positions (B, T) and the attention mask
        (B, 1, T, capacity) of the forward pass that adds them (eager: T and the slots filled are Python numbers)."""
        start, count = self.length, real.shape[1]
        if start + count > self.capacity:
            raise ValueError(f"{start + count} tokens do not fit a cache of {self.capacity}")
        self._step = False
        self.visible[:, start : start + count] = real
        positions = self.positions.unsqueeze(1) + real.cumsum(dim=1) - 1
        positions = positions.clamp(min=0)
        query = torch.arange(start, start + count, device=real.device).unsqueeze(1)
        key = torch.arange(self.capacity, device=real.device).unsqueeze(0)
        allowed = (key <= query).unsqueeze(0) & self.visible.unsqueeze(1)
        # A padding query sees itself: its row stays finite (and nothing real ever attends to it).
        allowed = allowed | (key == query).unsqueeze(0)
        mask = torch.zeros(allowed.shape, device=real.device).masked_fill_(~allowed, float("-inf"))
        return positions, mask.unsqueeze(1)

    def begin_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One real token per row into the next slot, with device state only: its positions (B, 1) and the
        attention mask (B, 1, 1, capacity)."""
        self._step = True
        self.visible.index_fill_(1, self.slot.view(1), True)
        mask = torch.zeros(self.visible.shape, device=self.visible.device).masked_fill_(~self.visible, float("-inf"))
        return self.positions.unsqueeze(1), mask[:, None, None, :]

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


class Transformer(nn.Module):
    """Maps token ids (B, T) to next-token logits (B, T, vocab_size)."""

    def __init__(self, config: ModelConfig, activation_checkpointing: bool = False):
        super().__init__()
        self.config = config
        # Recompute each block's activations in backward instead of storing them: less memory, ~30% more compute.
        self.activation_checkpointing = activation_checkpointing
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        # A tied model has no separate output tensor, so the state dict never holds two names for one tensor
        # (which safetensors refuses to save).
        self.output = None if config.tie_embeddings else nn.Linear(config.dim, config.vocab_size, bias=False)
        # Rotary tables derive from the config: not in the state dict, and not buffers either (DDP would
        # broadcast them every step), computed for the longest sequence seen so far on the device in use.
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """GPT-2 style init: N(0, 0.02), with residual output projections scaled down by depth."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if name.endswith(".bias"):
                nn.init.zeros_(param)
            elif name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                nn.init.normal_(param, std=residual_std, generator=generator)
            elif param.dim() >= 2:
                nn.init.normal_(param, std=0.02, generator=generator)
            else:
                nn.init.ones_(param)

    def _rotary(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope is None or self._rope[0].shape[0] < seq_len or self._rope[0].device != device:
            self._rope = rotary_tables(self.config, seq_len, device)
        cos, sin = self._rope
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
        step (:meth:`decode`), through ``forward`` so that a DDP or FSDP wrapper sees it as the model's call.
        With ``score``: the log-probabilities of its target tokens instead (:func:`token_scores`), computed over the
        vocabulary a chunk of positions at a time, so the logits of the whole batch never exist at once.
        """
        if cache is not None:
            return self.decode(tokens, real, cache) if real is not None else self.decode_step(tokens, cache)
        seq_len = tokens.shape[1]
        if seq_len > self.config.max_seq_len:
            raise ValueError(f"sequence length {seq_len} exceeds max_seq_len {self.config.max_seq_len}")
        if self.config.sliding_window is not None and seq_len > self.config.sliding_window:
            # Attention here is plain causal: longer sequences would need the sliding window mask.
            raise ValueError(f"sequence length {seq_len} exceeds sliding_window {self.config.sliding_window}")
        cos, sin = self._rotary(seq_len, tokens.device)
        if positions is not None:
            cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        mask = None
        if segments is not None:
            causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=tokens.device).tril()
            allowed = (segments.unsqueeze(2) == segments.unsqueeze(1)).logical_and(causal).unsqueeze(1)
            # Additive (0 / -inf), built once for every layer: attention with a float mask is the faster path.
            mask = torch.zeros(allowed.shape, device=tokens.device).masked_fill_(~allowed, float("-inf"))
        # The activations are in the norms' dtype, which a narrower (frozen) embedding table does not change.
        x = self.tok_embeddings(tokens).to(self.norm.weight.dtype)
        for layer in self.layers:
            if self.activation_checkpointing and self.training:
                x = checkpoint(layer, x, cos, sin, mask, use_reentrant=False)
            else:
                x = layer(x, cos, sin, mask)
        x = self.norm(x)
        head = self.tok_embeddings.weight if self.output is None else self.output.weight
        if score is not None:
            if score.where is not None:  # only these positions: their hidden states alone go through the head
                x = x.gather(1, score.where.unsqueeze(-1).expand(-1, -1, x.shape[-1]))
            logps, entropy = token_scores(x.reshape(-1, x.shape[-1]), head, score.targets.reshape(-1), score.entropy)
            shape = score.targets.shape
            return TokenScores(logps.view(shape), None if entropy is None else entropy.view(shape))
        return frozen_linear(x, head) if self.output is None else self.output(x)

    def decode(self, tokens: torch.Tensor, real: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The next-token logits (B, vocab) after ``tokens`` (B, T), which follow the ones in ``cache`` (and go into
        it); ``real`` (B, T) is False at left padding. See :mod:`astrai.trainer.generate`, which calls it as
        ``model(tokens, cache=cache, real=real)`` (a prompt's prefill) and :meth:`decode_step` for each new token."""
        positions, mask = cache.begin(real)
        x = self._decode_layers(tokens, positions, mask, cache)
        cache.advance(real)
        return x

    def decode_step(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The next-token logits (B, vocab) after one new token per row (B, 1): device work only, the same every
        step (what a CUDA graph captures and replays)."""
        positions, mask = cache.begin_step()
        x = self._decode_layers(tokens, positions, mask, cache)
        cache.advance()
        return x

    def prepare_decode(self, capacity: int, device: torch.device) -> None:
        """Compute the rotary tables for ``capacity`` positions now, so no decode step allocates them."""
        self._rotary(capacity, device)

    def _decode_layers(self, tokens, positions, mask, cache: KVCache) -> torch.Tensor:
        cos, sin = self._rotary(cache.capacity, tokens.device)
        cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        x = self.tok_embeddings(tokens).to(self.norm.weight.dtype)
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache, index)
        x = self.norm(x[:, -1])
        if self.output is None:
            return frozen_linear(x, self.tok_embeddings.weight)
        return self.output(x)


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
            state[ours] = torch.frombuffer(mapped, dtype=kind, count=count, offset=start + begin).view(shape)
    return state


# The weight dtypes a model folder may hold, as torch dtypes.
_TORCH_DTYPES = {name: getattr(torch, dtype) for name, dtype in FLOAT_DTYPES.items()}


def _size(handle) -> int:
    return os.fstat(handle.fileno()).st_size


def hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same tensors under Hugging Face's names, as written to ``model.safetensors``."""
    return {hf_name(name): tensor.contiguous() for name, tensor in state.items()}


def load_base_model(folder: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and checked weights of a base model folder (ours, or a Hugging Face Llama-family one)."""
    folder = Path(folder)
    config = ModelConfig.load(folder)
    return config, read_weights(folder, config)


def load_pretrained(folder: Path) -> Transformer:
    """The model of a folder (a base model, a Hugging Face Llama-family folder or a checkpoint), fp32, in eval mode.

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
    tensors = hf_state_dict(state)
    weights_tmp = folder / f".{WEIGHTS_FILE}.tmp"
    config_tmp = folder / f".{MODEL_CONFIG_FILE}.tmp"
    save_tensors(tensors, weights_tmp, metadata={"format": "pt"})
    config_tmp.write_text(config.to_json(), encoding="utf-8")
    os.replace(weights_tmp, folder / WEIGHTS_FILE)
    os.replace(config_tmp, folder / MODEL_CONFIG_FILE)
    return sum(t.numel() for t in tensors.values())


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


# Fields a preset can be overridden with on the command line (RoPE scaling and token ids come from HF configs).
# eos_token_id may be a list in a Hugging Face config; on this command line it is one id.
_CLI_FIELDS = [
    f
    for f in dataclasses.fields(ModelConfig)
    if f.type in ("int", "float", "bool", "int | None", "int | tuple[int, ...] | None")
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
