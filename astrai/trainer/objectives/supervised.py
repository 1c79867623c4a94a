"""The supervised objectives: next-token loss on every token (``seq``) and on the supervised tokens (``sft``).

Each objective turns one micro-batch into the loss to backpropagate and the loss to report, such that
the gradients of a step's micro-batches add up to the gradient of the step's loss over its whole global
batch, however it is split into micro-batches and ranks:

- ``seq``: the mean next-token loss; every micro-batch has the same number of tokens.
- ``sft``: the mean over every supervised token of the global batch. Micro-batches hold different numbers
  of supervised tokens, so each one's summed loss is divided by the count of the whole global batch
  (all micro-batches, all ranks: one small all-reduce per step), not by its own — the
  gradient-accumulation normalisation error of averaging per micro-batch cannot happen.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from astrai.trainer.distributed import DistEnv
from astrai.trainer.objectives.contract import Objective
from astrai.trainer.records import SFTWindow


class NextToken(Objective):
    """Pre-training: every token predicts the next one."""

    def __init__(self, env: DistEnv, vocab_size: int):
        self.env, self.vocab_size = env, vocab_size

    def micro(self, model, batch, prepared, accum: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = batch.to(self.env.device, non_blocking=True)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, self.vocab_size), tokens[:, 1:].reshape(-1))
        return loss / accum, loss.detach()

    def eval_sums(self, model, batch) -> torch.Tensor:
        tokens = batch.to(self.env.device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, self.vocab_size), tokens[:, 1:].reshape(-1), reduction="sum")
        return torch.stack(
            [loss.double(), torch.tensor(tokens[:, 1:].numel(), dtype=torch.float64, device=loss.device)]
        )


class Supervised(Objective):
    """SFT: the loss of the supervised tokens (assistant turns, completions), packed sequences kept apart."""

    def __init__(self, env: DistEnv, vocab_size: int):
        self.env, self.vocab_size = env, vocab_size

    def prepare_step(self, batches, model, step: int) -> list[torch.Tensor]:
        """Every micro-batch divides by the supervised tokens of the whole global batch (this step's micro-batches on
        every rank)."""
        count = sum(batch.weights.sum() for batch in batches).to(self.env.device, dtype=torch.float32)
        if self.env.distributed:
            dist.all_reduce(count)
        return [count.clamp(min=1.0)] * len(batches)

    def _summed(self, model, batch: SFTWindow) -> tuple[torch.Tensor, torch.Tensor]:
        batch = batch.to(self.env.device)
        logits = model(batch.inputs, batch.positions, batch.segments)
        losses = F.cross_entropy(logits.float().view(-1, self.vocab_size), batch.targets.reshape(-1), reduction="none")
        return (losses * batch.weights.reshape(-1)).sum(), batch.weights.sum()

    def micro(self, model, batch, prepared, accum: int) -> tuple[torch.Tensor, torch.Tensor]:
        summed, _ = self._summed(model, batch)
        # Gradients are averaged over the ranks (DDP, FSDP): the world size puts the sum back.
        loss = summed * self.env.world_size / prepared
        return loss, loss.detach() * accum

    def eval_sums(self, model, batch) -> torch.Tensor:
        summed, count = self._summed(model, batch)
        return _sums(summed, count)


def _sums(total: torch.Tensor, count) -> torch.Tensor:
    """(summed loss, what it is summed over) in float64, for validation's running totals."""
    return torch.stack([total.double(), torch.as_tensor(count, dtype=torch.float64, device=total.device)])
