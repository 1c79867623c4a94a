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

from astrai.trainer.feed.records import SFTWindow
from astrai.trainer.launch.distributed import DistEnv
from astrai.trainer.models.scoring import TokenTargets
from astrai.trainer.objectives.contract import Objective


class NextToken(Objective):
    """Pre-training: every token predicts the next one."""

    def __init__(self, env: DistEnv):
        self.env = env

    def _log_probs(self, model, batch) -> torch.Tensor:
        tokens = batch.to(self.env.device, non_blocking=True)
        return model(tokens[:, :-1], score=TokenTargets(tokens[:, 1:])).logps

    def micro(self, model, batch, prepared, accum: int) -> tuple[torch.Tensor, torch.Tensor]:
        loss = -self._log_probs(model, batch).mean()
        return loss / accum, loss.detach()

    def eval_sums(self, model, batch) -> torch.Tensor:
        logps = self._log_probs(model, batch)
        return _sums(-logps.sum(), logps.numel())


class Supervised(Objective):
    """SFT: the loss of the supervised tokens (assistant turns, completions), packed sequences kept apart."""

    def __init__(self, env: DistEnv):
        self.env = env

    def prepare_step(self, batches, model, step: int) -> list[torch.Tensor]:
        """Every micro-batch divides by the supervised tokens of the whole global batch (this step's micro-batches on
        every rank)."""
        count = sum(batch.weights.sum() for batch in batches).to(self.env.device, dtype=torch.float32)
        if self.env.distributed:
            dist.all_reduce(count)
        return [count.clamp(min=1.0)] * len(batches)

    def _summed(self, model, batch: SFTWindow) -> tuple[torch.Tensor, torch.Tensor]:
        batch = batch.to(self.env.device)
        scores = model(batch.inputs, batch.positions, batch.segments, score=TokenTargets(batch.targets))
        return -(scores.logps * batch.weights).sum(), batch.weights.sum()

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
