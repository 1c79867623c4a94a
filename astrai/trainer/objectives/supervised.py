"""What a step minimises, by ``training.train_type``: next-token loss (seq), supervised tokens (sft), DPO (dpo).

Each objective turns one micro-batch into the loss to backpropagate and the loss to report, such that
the gradients of a step's micro-batches add up to the gradient of the step's loss over its whole global
batch, however it is split into micro-batches and ranks:

- ``seq``: the mean next-token loss; every micro-batch has the same number of tokens.
- ``sft``: the mean over every supervised token of the global batch. Micro-batches hold different numbers
  of supervised tokens, so each one's summed loss is divided by the count of the whole global batch
  (all micro-batches, all ranks: one small all-reduce per step), not by its own — the
  gradient-accumulation normalisation error of averaging per micro-batch cannot happen.
- ``dpo``: the sigmoid DPO loss of each pair, mean over the pairs, with ``training.dpo_beta``; the
  reference model is frozen. Rewards are TRL's: beta times the log-probability ratio of policy over
  reference of the chosen (rejected) answer; the margin is their difference, the accuracy the share of
  pairs whose chosen reward is the larger.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from astrai.common.contract import (
    METRIC_REWARDS_ACCURACY,
    METRIC_REWARDS_CHOSEN,
    METRIC_REWARDS_MARGIN,
    METRIC_REWARDS_REJECTED,
)
from astrai.trainer.distributed import DistEnv
from astrai.trainer.records import DPOPair, SFTWindow
from astrai.trainer.reference import summed_log_probs


class NextToken:
    """Pre-training: every token predicts the next one."""

    def __init__(self, env: DistEnv, vocab_size: int):
        self.env, self.vocab_size = env, vocab_size

    def step_scale(self, batches, model=None, step: int = 0) -> None:
        return None

    def micro(self, model, batch, scale, accum: int) -> tuple[torch.Tensor, torch.Tensor]:
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

    def metrics(self) -> dict | None:
        return None


class Supervised:
    """SFT: the loss of the supervised tokens (assistant turns, completions), packed sequences kept apart."""

    def __init__(self, env: DistEnv, vocab_size: int):
        self.env, self.vocab_size = env, vocab_size

    def step_scale(self, batches, model=None, step: int = 0) -> torch.Tensor:
        """Supervised tokens of the whole global batch (this step's micro-batches on every rank)."""
        count = sum(batch.weights.sum() for batch in batches).to(self.env.device, dtype=torch.float32)
        if self.env.distributed:
            dist.all_reduce(count)
        return count.clamp(min=1.0)

    def _summed(self, model, batch: SFTWindow) -> tuple[torch.Tensor, torch.Tensor]:
        batch = batch.to(self.env.device)
        logits = model(batch.inputs, batch.positions, batch.segments)
        losses = F.cross_entropy(logits.float().view(-1, self.vocab_size), batch.targets.reshape(-1), reduction="none")
        return (losses * batch.weights.reshape(-1)).sum(), batch.weights.sum()

    def micro(self, model, batch, scale, accum: int) -> tuple[torch.Tensor, torch.Tensor]:
        summed, _ = self._summed(model, batch)
        # Gradients are averaged over the ranks (DDP, FSDP): the world size puts the sum back.
        loss = summed * self.env.world_size / scale
        return loss, loss.detach() * accum

    def eval_sums(self, model, batch) -> torch.Tensor:
        summed, count = self._summed(model, batch)
        return _sums(summed, count)

    def metrics(self) -> dict | None:
        return None


class Preference:
    """DPO against a frozen reference: a live model, or a precomputed table of its log-probabilities per pair."""

    def __init__(self, env: DistEnv, vocab_size: int, reference, beta: float):
        self.env, self.vocab_size, self.beta = env, vocab_size, beta
        self.reference = reference
        """A model, or a (pairs, 2) tensor of its summed log-probabilities (astrai/trainer/reference.py)."""
        # Chosen and rejected rewards, margin, accuracy and pairs, summed over the steps since the last report.
        self._sums = torch.zeros(5, dtype=torch.float64, device=env.device)

    def step_scale(self, batches, model=None, step: int = 0) -> None:
        return None

    def _pairs(self, model, batch: DPOPair) -> tuple[torch.Tensor, torch.Tensor]:
        batch = batch.to(self.env.device)
        if isinstance(self.reference, torch.Tensor):
            reference = self.reference[batch.number]
        else:
            # First: a LoRA reference is the policy's own model with its adapters off, and its forward pass
            # must not come between the policy's and its backward.
            with torch.no_grad():
                reference = summed_log_probs(self.reference, self.vocab_size, batch)
        policy = summed_log_probs(model, self.vocab_size, batch)
        rewards = self.beta * (policy - reference)
        margins = rewards[:, 0] - rewards[:, 1]
        return -F.logsigmoid(margins), rewards.detach()

    def micro(self, model, batch, scale, accum: int) -> tuple[torch.Tensor, torch.Tensor]:
        losses, rewards = self._pairs(model, batch)
        margin = rewards[:, 0] - rewards[:, 1]
        self._sums += torch.stack(
            [
                rewards[:, 0].sum().double(),
                rewards[:, 1].sum().double(),
                margin.sum().double(),
                (margin > 0).sum().double(),
                torch.tensor(len(margin), dtype=torch.float64, device=margin.device),
            ]
        )
        loss = losses.mean()
        return loss / accum, loss.detach()

    def eval_sums(self, model, batch) -> torch.Tensor:
        losses, _ = self._pairs(model, batch)
        return torch.stack(
            [losses.sum().double(), torch.tensor(len(losses), dtype=torch.float64, device=losses.device)]
        )

    def metrics(self) -> dict | None:
        """TRL's rewards over the pairs since the last call (every rank's), then counting starts again."""
        sums = self._sums.clone()
        self._sums.zero_()
        if self.env.distributed:
            dist.all_reduce(sums)
        chosen, rejected, margin, right, pairs = sums.tolist()
        if not pairs:
            return None
        return {
            METRIC_REWARDS_CHOSEN: chosen / pairs,
            METRIC_REWARDS_REJECTED: rejected / pairs,
            METRIC_REWARDS_MARGIN: margin / pairs,
            METRIC_REWARDS_ACCURACY: right / pairs,
        }


def _sums(total: torch.Tensor, count) -> torch.Tensor:
    """(summed loss, what it is summed over) in float64, for validation's running totals."""
    return torch.stack([total.double(), torch.as_tensor(count, dtype=torch.float64, device=total.device)])
