"""The native model: a decoder-only transformer language model in plain PyTorch.

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

import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from astrai.common.model_folder import ModelConfig
from astrai.trainer.models.cache import KVCache, additive_mask
from astrai.trainer.models.layers import Block, rms_norm
from astrai.trainer.models.rope import rope_variant, rotary_tables
from astrai.trainer.models.scoring import (
    LogitsShape,
    TokenScores,
    TokenTargets,
    frozen_linear,
    segment_mask,
    token_scores,
)


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
        full = additive_mask(allowed) if segments is not None or explicit else None
        if not banded:
            return {False: full, True: full}
        # A windowed layer's token sees itself and the window - 1 tokens before it.
        return {False: full, True: additive_mask(allowed.logical_and(causal.triu(1 - window)))}

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
        it); ``real`` (B, T) is False at left padding. See :mod:`astrai.trainer.generation.decoding`, which calls it as
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
