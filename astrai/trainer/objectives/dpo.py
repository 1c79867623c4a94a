"""DPO: the sigmoid loss of preference pairs against a frozen reference, and TRL's reward metrics of them.

For a pair whose chosen and rejected answers have summed log-probabilities ``pi_c``, ``pi_r`` under the policy and
``ref_c``, ``ref_r`` under the frozen reference::

    reward_c = beta * (pi_c - ref_c)        reward_r = beta * (pi_r - ref_r)
    loss = -log sigmoid(reward_c - reward_r)

The metrics are TRL's: the mean rewards of the chosen and the rejected answers, their margin, and the accuracy (the
share of pairs whose chosen reward is the larger). Both DPO train types use this module: ``dpo`` on pairs given by
the data (:class:`Preference`), ``online_dpo`` on pairs of sampled completions that the rewards ranked
(:class:`astrai.trainer.objectives.online_dpo.OnlineDPO`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from astrai.common.contract import (
    METRIC_REWARDS_ACCURACY,
    METRIC_REWARDS_CHOSEN,
    METRIC_REWARDS_MARGIN,
    METRIC_REWARDS_REJECTED,
)
from astrai.trainer.feed.records import DPOPair
from astrai.trainer.launch.distributed import DistEnv
from astrai.trainer.objectives.contract import Objective, RunningSums
from astrai.trainer.objectives.reference import summed_log_probs


def dpo_loss(policy: torch.Tensor, reference: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's loss (k,) and its (chosen, rejected) rewards (k, 2), detached, from summed log-probabilities (k, 2)
    of the chosen and rejected answers under the policy and the reference."""
    rewards = beta * (policy - reference)
    return -F.logsigmoid(rewards[:, 0] - rewards[:, 1]), rewards.detach()


@dataclass(frozen=True)
class DPOSums:
    """What the metrics are computed from: summed over the pairs since the last report."""

    chosen: float
    rejected: float
    margin: float
    right: float
    """Pairs whose chosen reward is the larger."""
    pairs: float


class DPOMetrics:
    """TRL's DPO rewards over the pairs since the last report, on every rank."""

    def __init__(self, device: torch.device):
        self.device = device
        self._sums = RunningSums(DPOSums)

    def add(self, rewards: torch.Tensor) -> None:
        """The (k, 2) rewards of k pairs (chosen, rejected)."""
        margin = rewards[:, 0] - rewards[:, 1]
        self._sums.add(
            self.device,
            chosen=rewards[:, 0].sum(),
            rejected=rewards[:, 1].sum(),
            margin=margin.sum(),
            right=(margin > 0).sum(),
            pairs=len(margin),
        )

    def take(self, env: DistEnv) -> dict[str, float]:
        """The metrics (empty when no pair was seen), then counting starts again; a collective."""
        sums = self._sums.take(env)
        if not sums.pairs:
            return {}
        return {
            METRIC_REWARDS_CHOSEN: sums.chosen / sums.pairs,
            METRIC_REWARDS_REJECTED: sums.rejected / sums.pairs,
            METRIC_REWARDS_MARGIN: sums.margin / sums.pairs,
            METRIC_REWARDS_ACCURACY: sums.right / sums.pairs,
        }


class Preference(Objective):
    """``dpo``: the data's pairs against a frozen reference, a live model or a precomputed table of its
    log-probabilities per pair (:mod:`astrai.trainer.objectives.reference`); the loss is the mean over the pairs."""

    def __init__(self, env: DistEnv, reference, beta: float):
        self.env, self.beta = env, beta
        self.reference = reference
        """A model, or a (pairs, 2) tensor of its summed log-probabilities."""
        self._metrics = DPOMetrics(env.device)

    def _pairs(self, model, batch: DPOPair) -> tuple[torch.Tensor, torch.Tensor]:
        batch = batch.to(self.env.device)
        if isinstance(self.reference, torch.Tensor):
            reference = self.reference[batch.number]
        else:
            # First: a LoRA reference is the policy's own model with its adapters off, and its forward pass
            # must not come between the policy's and its backward.
            with torch.no_grad():
                reference = summed_log_probs(self.reference, batch)
        policy = summed_log_probs(model, batch)
        return dpo_loss(policy, reference, self.beta)

    def micro(self, model, batch, prepared, accum: int) -> tuple[torch.Tensor, torch.Tensor]:
        losses, rewards = self._pairs(model, batch)
        self._metrics.add(rewards)
        loss = losses.mean()
        return loss / accum, loss.detach()

    def eval_sums(self, model, batch) -> torch.Tensor:
        losses, _ = self._pairs(model, batch)
        return torch.stack(
            [losses.sum().double(), torch.tensor(len(losses), dtype=torch.float64, device=losses.device)]
        )

    def metrics(self) -> dict | None:
        return self._metrics.take(self.env) or None
