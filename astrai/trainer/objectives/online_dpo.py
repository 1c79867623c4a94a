"""``online_dpo``: two sampled completions of each prompt, the one the rewards score higher chosen, and DPO's sigmoid
loss against the frozen starting model (TRL's online DPO with reward functions as the judge).

A pair whose completions score the same, or that a function left unscored, is skipped (``pairs_tied`` counts them);
the loss is the mean over the step's ranked pairs on every rank (:mod:`astrai.trainer.objectives.dpo`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from astrai.common.contract import METRIC_FRAC_REWARD_ZERO_STD, METRIC_PAIRS_TIED
from astrai.trainer.launch.distributed import DistEnv
from astrai.trainer.objectives.contract import Objective
from astrai.trainer.objectives.dpo import DPOMetrics, dpo_loss
from astrai.trainer.objectives.rollouts import (
    IDLE_TIED,
    CompletionsLog,
    RewardReport,
    RolloutSource,
    StepScores,
    completion_logps,
    sample_step,
)


@dataclass
class PairBatch:
    """One micro-batch's completions (two consecutive rows per prompt), and its ranked pairs."""

    prompts: list[list[int]]
    completions: list[list[int]]
    pairs: torch.Tensor
    """(pairs, 2) row numbers of each ranked pair's chosen and rejected completion."""
    reference: torch.Tensor
    """The completions' token log-probabilities under the frozen starting model."""
    written: list[list[bool]] | None = None
    """Episodes: which of each completion's tokens the policy wrote (a pair of episodes is ranked by their rewards,
    and only the policy's own tokens count in their log-probabilities)."""


class OnlineDPO(Objective):
    """DPO on pairs of the policy's own completions, ranked by the rewards (see the module's docstring)."""

    def __init__(
        self,
        env: DistEnv,
        source: RolloutSource,
        beta: float,
        reference,
        autocast,
        completions_log: CompletionsLog,
        log,
    ):
        if source.generations != 2:
            raise ValueError(f"online DPO ranks two completions of each prompt, not {source.generations}")
        self.env, self.source, self.beta, self.reference = env, source, beta, reference
        self.autocast, self.completions_log = autocast, completions_log
        self.tokens = 0
        self._step_pairs = 0
        self._tied = self._offered = 0
        self._rewards = RewardReport(source, log)
        self._dpo = DPOMetrics(env.device)

    def prepare_step(self, batches, model, step: int) -> list[PairBatch]:
        rollouts = sample_step(self.source, model, batches, step, self.reference, self.autocast, self.completions_log)
        scores = StepScores.gather(rollouts, self.env)
        self._rewards.add(scores)
        self.tokens = scores.tokens
        totals = scores.rewards.view(-1, 2)
        ranked = ~totals.isnan().any(dim=1) & (totals[:, 0] != totals[:, 1])
        self._step_pairs = int(ranked.sum())
        if not self._step_pairs:
            self._rewards.idle(IDLE_TIED)
        self._tied += int((~ranked).sum())
        self._offered += int(ranked.numel())
        rows = scores.rows_of(self.env)
        first = rows.start // 2  # this rank's first pair
        prepared = []
        for part in rollouts:
            pairs = []
            for row in range(0, len(part.completions), 2):
                pair = first + row // 2
                if ranked[pair]:
                    better = totals[pair, 0] > totals[pair, 1]
                    pairs.append((row, row + 1) if better else (row + 1, row))
            first += len(part.completions) // 2
            chosen = torch.tensor(pairs, dtype=torch.long, device=self.env.device).view(-1, 2)
            prepared.append(PairBatch(part.prompts, part.completions, chosen, part.reference_logps, part.written))
        return prepared

    def micro(self, model, batch, prepared: PairBatch, accum: int) -> tuple[torch.Tensor, torch.Tensor]:
        logps, token_mask, _ = completion_logps(model, prepared.prompts, prepared.completions, prepared.written)
        policy = (logps * token_mask).sum(-1)
        reference = (prepared.reference * token_mask).sum(-1)
        pairs = prepared.pairs
        if not len(pairs):
            # No ranked pair here: a zero loss through the model, so every rank still takes part in the backward.
            loss = policy.sum() * 0.0
            return loss, loss.detach()
        losses, rewards = dpo_loss(policy[pairs], reference[pairs], self.beta)
        self._dpo.add(rewards)
        # The mean over the step's ranked pairs on every rank; DDP and FSDP average the ranks' gradients.
        loss = losses.sum() * self.env.world_size / self._step_pairs
        return loss, loss.detach() * accum

    def step_tokens(self, planned: int) -> int:
        return self.tokens

    def metrics(self) -> dict | None:
        dpo = self._dpo.take(self.env)
        values = self._rewards.take()
        if not values:
            return None
        values.pop(METRIC_FRAC_REWARD_ZERO_STD)  # a pair that scored the same is a tie, which pairs_tied counts
        values[METRIC_PAIRS_TIED] = self._tied / max(self._offered, 1)
        values.update(dpo)
        self._tied = self._offered = 0
        return values
