"""RLOO: REINFORCE with the leave-one-out baseline, as TRL's ``RLOOTrainer`` computes it, on GRPO's rollouts and rounds.

For each prompt the policy samples a group of ``G`` completions, as for GRPO. A completion's reward is the weighted
sum of the reward functions (:mod:`astrai.trainer.objectives.rewards`); one that no function scored is unscorable
(NaN): it stays out of every baseline and gets advantage 0. With ``beta`` > 0 the KL against the frozen starting model
is a penalty on the reward, first order and summed over the completion's tokens (the ones the loss counts), with
``old`` the policy's token log-probabilities when the completion was sampled and ``ref`` the starting model's::

    r_i = sum_f w_f * r_f(i) - beta * sum_t (old_t - ref_t)

The baseline of a completion is the mean reward of the other scorable completions of its group, and its advantage the
difference (NaN, then 0, where it has no scorable sibling)::

    b_i = (sum_{j scorable} r_j - r_i) / (n_scorable - 1)        A_i = r_i - b_i

With ``normalize_advantages`` the scorable advantages of the whole step then lose their mean and are divided by their
std (+ 1e-4). The loss is the clipped surrogate of the whole completion's probability ratio, averaged over the
completions::

    ratio_i = exp(sum_t logp_t - sum_t old_t)
    loss = mean_i -min(ratio_i * A_i, clip(ratio_i, 1 - epsilon, 1 + epsilon_high) * A_i)

Everything else is GRPO's (:class:`astrai.trainer.objectives.grpo.GRPO`): the rollouts of a step on every rank, the
rewards gathered over the ranks, generation rounds of ``num_iterations`` steps (the later ones take their ratio
against the round's first log-probabilities), the reward, length, clip and entropy metrics. :class:`RLOO` replaces its
two methods that differ, the advantages and the loss. ``kl`` is the mean per-token ``old - ref`` of the step's
completions, as TRL reports it.

The penalty's ``old`` is a pass of the policy over the step's completions, without gradients and in eval mode (as it
sampled them, and as the reference scores them), before any update. The ratio's ``old`` is, as for GRPO, the round's
first update's own log-probabilities, detached (TRL takes them from a pass before it: the same values without
dropout), so the first update's ratio is exactly 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from astrai.common.contract import METRIC_KL
from astrai.common.settings import RLOOSettings
from astrai.trainer.launch.distributed import DistEnv
from astrai.trainer.objectives.contract import RunningSums
from astrai.trainer.objectives.grpo import GRPO, GRPOBatch, GRPOStats, RoundShape, nanstd
from astrai.trainer.objectives.rollouts import CompletionsLog, Rollouts, RolloutSource, StepScores, completion_logps


def rloo_advantages(
    rewards: torch.Tensor, kl: torch.Tensor | None, generations: int, settings: RLOOSettings
) -> torch.Tensor:
    """Each completion's advantage (float32) from its total reward (NaN: unscorable) and its summed KL (None with
    beta 0), in groups of ``generations`` consecutive completions; computed in float64. A value that is not finite
    (no scorable sibling, or rewards too large to sum) is 0."""
    rewards = rewards.to(torch.float64)
    if rewards.numel() % generations:
        raise ValueError(f"{rewards.numel()} completions do not make groups of {generations}")
    if kl is not None and settings.beta != 0:
        rewards = rewards - settings.beta * kl.to(torch.float64)
    groups = rewards.view(-1, generations)
    scorable = (~groups.isnan()).sum(dim=1, keepdim=True)
    baseline = (torch.nansum(groups, dim=1, keepdim=True) - groups) / (scorable - 1)
    advantage = (groups - baseline).view(-1)
    if settings.normalize_advantages:
        advantage = (advantage - torch.nanmean(advantage)) / (nanstd(advantage) + 1e-4)
    return torch.where(advantage.isfinite(), advantage, torch.zeros_like(advantage)).float()


def sequence_kl(old_logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each completion's first-order KL, ``old - ref`` summed over the tokens ``mask`` (B, T) marks: the penalty's
    part of its reward, before beta."""
    return ((old_logps - ref_logps) * mask).sum(-1)


def rloo_loss(
    logps: torch.Tensor, old_logps: torch.Tensor, advantage: torch.Tensor, mask: torch.Tensor, settings: RLOOSettings
) -> tuple[torch.Tensor, GRPOStats]:
    """The loss of completions (B, T) of per-token log-probabilities now and when sampled; ``mask`` (B, T) marks the
    tokens a completion's log-probability sums. The statistics are the shares of completions clipped."""
    mask = mask.to(logps.dtype)
    ratio = torch.exp((logps * mask).sum(-1) - (old_logps * mask).sum(-1))
    clipped = torch.clamp(ratio, 1 - settings.epsilon, 1 + settings.high)
    loss = -torch.min(ratio * advantage, clipped * advantage).mean()
    with torch.no_grad():
        low = (ratio < 1 - settings.epsilon) & (advantage < 0)
        high = (ratio > 1 + settings.high) & (advantage > 0)
        stats = GRPOStats(low.float().mean(), high.float().mean(), (low | high).float().mean(), None)
    return loss, stats


@dataclass(frozen=True)
class KLSums:
    """The KL penalty's metric: ``old - ref`` summed over the completion tokens of the rounds since the last report."""

    kl: float
    tokens: float


class RLOO(GRPO):
    """RLOO's step (see the module's docstring): GRPO's rollouts, rounds and metrics, RLOO's advantages and loss."""

    def __init__(
        self,
        env: DistEnv,
        source: RolloutSource,
        settings: RLOOSettings,
        reference,
        round_shape: RoundShape,
        autocast,
        completions_log: CompletionsLog,
        log,
    ):
        super().__init__(env, source, settings, reference, round_shape, autocast, completions_log, log)
        self._kl = RunningSums(KLSums)

    def weigh(self, scores: StepScores, rollouts: list[Rollouts], model) -> torch.Tensor:
        """The leave-one-out advantages of the step, the rewards less the KL penalty (a forward pass of the policy
        over this rank's completions, without gradients, and a gather of each completion's KL over the ranks)."""
        kl = None
        if self.reference is not None:
            mine = self._penalties(rollouts, model)
            kl = _gathered(mine, self.env)
        return rloo_advantages(scores.rewards, kl, self.source.generations, self.settings)

    def _penalties(self, rollouts: list[Rollouts], model) -> torch.Tensor:
        """Each of this rank's completions' summed ``old - ref`` over the tokens the loss counts (float64, on the
        CPU); the reference's log-probabilities then leave the rollouts (the loss does not take them)."""
        sums = []
        for part, (logps, mask) in zip(rollouts, _policy_logps(model, rollouts, self.autocast), strict=True):
            mask = mask * torch.tensor(part.counted, dtype=mask.dtype, device=mask.device).unsqueeze(1)
            kl = sequence_kl(logps, part.reference_logps, mask)
            self._kl.add(self.env.device, kl=kl.sum(), tokens=mask.sum())
            sums.append(kl.double().cpu())
            part.reference_logps = None
        return torch.cat(sums)

    def update(
        self, logps: torch.Tensor, old: torch.Tensor, prepared: GRPOBatch, mask: torch.Tensor, accum: int
    ) -> tuple[torch.Tensor, torch.Tensor, GRPOStats]:
        """The mean of the micro-batch's completions' clipped losses (equal micro-batches: divided by accum)."""
        loss, stats = rloo_loss(logps, old, prepared.advantages, mask, self.settings)
        return loss / accum, loss.detach(), stats

    def metrics(self) -> dict | None:
        """GRPO's metrics, and the mean per-token KL of the completions sampled since the last report."""
        kl = self._kl.take(self.env)
        values = super().metrics()
        if kl.tokens:
            values = {**(values or {}), METRIC_KL: kl.kl / kl.tokens}
        return values


def _policy_logps(model, rollouts: list[Rollouts], autocast) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each micro-batch's completions' token log-probabilities under the policy that sampled them, and their mask: in
    eval mode (as it sampled, and as the reference scores), without gradients."""
    inner = getattr(model, "module", model)  # under DDP, the model it wraps
    was_training = inner.training
    model.eval()
    try:
        with torch.no_grad(), autocast:
            return [completion_logps(model, part.prompts, part.completions, part.written)[:2] for part in rollouts]
    finally:
        model.train(was_training)


def _gathered(values: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """This rank's values and every other rank's, in rank order (a collective; every rank has as many)."""
    if not env.distributed:
        return values
    parts = [torch.empty_like(values, device=env.device) for _ in range(env.world_size)]
    dist.all_gather(parts, values.to(env.device))
    return torch.cat(parts).cpu()
