"""The transformers engine: generation through a transformers model's own key/value cache
(:class:`astrai.trainer.models.hf_model.TransformersModel`), for a family the trainer does not compute."""

from __future__ import annotations

import torch
from torch import nn

from astrai.common.settings import Sampling
from astrai.trainer.generation.decoding import (
    Draws,
    checked_round,
    left_padded,
    pick_rows,
    regenerated_episodes,
    until_stop,
)
from astrai.trainer.models.compiling import blocks_uncompiled


class TransformersDecoding:
    """Generation through the library model (its own key/value cache), a token at a time: the online types'
    rollouts and ``python -m astrai.model generate``.

    Rows are left-padded; each row's positions count its own tokens and its padding is masked, so a row samples
    what it would alone. The next token is chosen as :class:`astrai.trainer.generation.decoding.DecodeEngine` chooses
    it."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.inner = getattr(model, "module", model)  # DDP's wrapped model
        self.capture_seconds = 0.0

    def episodes(self, prompts, sampling: Sampling, stop, draws: list[Draws], handler, rooms: list[int]) -> None:
        """Multi-turn generation (astrai.trainer.generation.decoding.DecodeEngine.episodes): the library's cache is not
        kept between turns, so each turn generates again from every going row's episode so far."""
        regenerated_episodes(self.generate, prompts, sampling, stop, draws, handler, rooms)

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        sampling: Sampling,
        stop: set[int] | frozenset[int] = frozenset(),
        draws: list[Draws] | None = None,
    ) -> list[list[int]]:
        draws, _ = checked_round(prompts, sampling, draws, self.inner.config.context)
        # The training's compiled blocks (model.compile) would recompile for every length the cache grows to.
        with blocks_uncompiled(self.inner):
            rows = self._generate(prompts, sampling, stop, draws)
        return [until_stop(row, stop) for row in rows]

    def _generate(self, prompts: list[list[int]], sampling: Sampling, stop, draws: list[Draws]) -> list[list[int]]:
        device = next(self.inner.parameters()).device
        batch = len(prompts)
        tokens, real = left_padded(prompts)
        tokens, real = tokens.to(device), real.long().to(device)
        positions = (real.cumsum(-1) - 1).clamp(min=0)
        hf = self.inner.library_model
        out = hf(input_ids=tokens, attention_mask=real, position_ids=positions, use_cache=True)
        cache, logits = out.cache, out.logits[:, -1]
        stops = torch.tensor(sorted(stop), dtype=torch.long, device=device)
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        made = []
        position = positions[:, -1:]
        while True:
            chosen = pick_rows(logits, sampling, draws).masked_fill(done, 0)
            made.append(chosen)
            done = done | torch.isin(chosen, stops)
            if len(made) == sampling.max_new_tokens or bool(done.all()):
                break
            real = torch.cat([real, torch.ones(batch, 1, dtype=real.dtype, device=device)], dim=1)
            position = position + 1
            out = hf(
                input_ids=chosen.view(-1, 1),
                attention_mask=real,
                position_ids=position,
                cache=cache,
                use_cache=True,
            )
            cache, logits = out.cache, out.logits[:, -1]
        return torch.stack(made, dim=1).tolist()
