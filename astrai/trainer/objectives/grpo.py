"""GRPO's arithmetic: advantages from a group's rewards, and the clipped surrogate loss, as TRL computes them.

For each prompt the policy samples a group of ``G`` completions; each completion's total reward (the
weighted sum of :mod:`astrai.trainer.objectives.rewards`, None where no function applies) becomes an advantage::

    A_i = (r_i - mean(group)) / (std + 1e-4)        std of the group (scale_rewards: group), of the
                                                    whole batch (batch), or no division at all (none)

(a completion no function scored gets advantage 0 and stays out of its group's mean and std). The loss
of a completion token with log-probability ``logp`` now, ``old`` when it was sampled and ``ref`` under the
frozen starting model::

    ratio = exp(logp - old)
    per_token = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A) + beta * KL
    KL = exp(ref - logp) - (ref - logp) - 1

averaged as TRL's loss types say: ``grpo`` over each completion's tokens, then over completions;
``dr_grpo`` summed over every token and divided by completions x max_completion_length; ``dapo`` summed
over every token and divided by the tokens of the whole batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from astrai.common.contract import METRIC_CLIP_HIGH, METRIC_CLIP_LOW, METRIC_CLIP_REGION, METRIC_ENTROPY, METRIC_KL
from astrai.common.settings import GRPOSettings
from astrai.trainer.launch.distributed import DistEnv
from astrai.trainer.objectives.contract import Objective, RunningSums
from astrai.trainer.objectives.rollouts import (
    IDLE_FLAT,
    IDLE_MASKED,
    IDLE_OVERFLOW,
    CompletionsLog,
    RewardReport,
    Rollouts,
    RolloutSource,
    StepScores,
    completion_logps,
    flat_groups,
    sample_step,
)


def nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The sample standard deviation (n - 1) of the values that are not NaN; NaN for fewer than two."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    count = torch.sum(~values.isnan(), dim=dim, keepdim=True)
    variance = torch.nansum((values - mean) ** 2, dim=dim, keepdim=True) / (count - 1).clamp(min=1)
    variance = torch.where(count > 1, variance, torch.full_like(variance, float("nan")))
    return variance.sqrt().squeeze() if dim is None else variance.sqrt().squeeze(dim)


def advantages(totals: list[float | None], generations: int, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion's advantage (in groups of ``generations`` consecutive completions), and for each one whether
    its group's rewards were all equal (no signal). Computed in float64; a completion whose group's statistics are
    not finite (rewards near the float limits) gets advantage 0, as an unscored one does (:func:`overflowing`)."""
    rewards = torch.tensor([float("nan") if total is None else total for total in totals], dtype=torch.float64)
    if rewards.numel() % generations:
        raise ValueError(f"{rewards.numel()} completions do not make groups of {generations}")
    groups = rewards.view(-1, generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(generations)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        std = nanstd(groups, dim=1).repeat_interleave(generations) if generations > 1 else torch.zeros_like(rewards)
    advantage = rewards - mean
    if scale != "none":
        advantage = advantage / (std + 1e-4)
    advantage = torch.where(advantage.isfinite(), advantage, torch.zeros_like(advantage))
    return advantage.float(), torch.isclose(std, torch.zeros_like(std))


def overflowing(totals: torch.Tensor, generations: int) -> int:
    """Groups with a scored completion whose rewards' mean or spread is not finite (float64 overflows)."""
    groups = totals.view(-1, generations)
    scored = ~groups.isnan()
    mean = torch.nanmean(groups, dim=1, keepdim=True)
    spread = torch.nansum((groups - mean) ** 2, dim=1)
    bad = scored.any(dim=1) & (~mean.squeeze(1).isfinite() | ~spread.isfinite())
    return int(bad.sum())


@dataclass(frozen=True)
class GRPOStats:
    """What a step reports of the loss: the share of completion tokens clipped, and the mean KL (0-d tensors on the
    loss's device: reading them waits for it)."""

    clip_low: torch.Tensor
    clip_high: torch.Tensor
    clip_region: torch.Tensor
    kl: torch.Tensor | None


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    ref_logps: torch.Tensor | None,
    advantage: torch.Tensor,
    mask: torch.Tensor,
    settings: GRPOSettings,
    batch_tokens: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, GRPOStats]:
    """The loss of completions (B, T) of per-token log-probabilities; ``mask`` (B, T) marks their tokens.

    ``batch_tokens``: dapo's denominator, the completion tokens of the whole batch the step trains on (all ranks
    and micro-batches, over the world size); by default this batch's own.
    """
    mask = mask.to(logps.dtype)
    advantage = advantage.unsqueeze(1) if advantage.dim() == 1 else advantage
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - settings.epsilon, 1 + settings.high)
    per_token = -torch.min(ratio * advantage, clipped * advantage)
    kl = None
    if settings.beta != 0:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + settings.beta * kl
    if settings.loss == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif settings.loss == "dr_grpo":
        loss = (per_token * mask).sum() / (per_token.size(0) * settings.max_completion_length)
    else:
        tokens = mask.sum() if batch_tokens is None else torch.as_tensor(batch_tokens, dtype=logps.dtype)
        loss = (per_token * mask).sum() / tokens.clamp(min=1.0)
    with torch.no_grad():
        low = (ratio < 1 - settings.epsilon) & (advantage < 0)
        high = (ratio > 1 + settings.high) & (advantage > 0)
        count = mask.sum().clamp(min=1.0)

        def masked_mean(values: torch.Tensor) -> torch.Tensor:
            return (values.to(mask.dtype) * mask).sum() / count

        stats = GRPOStats(
            masked_mean(low), masked_mean(high), masked_mean(low | high), None if kl is None else masked_mean(kl)
        )
    return loss, stats


# --- The objective ----------------------------------------------------------------------------------------


@dataclass
class GRPOBatch:
    """One micro-batch's completions, as GRPO's update takes them."""

    prompts: list[list[int]]
    completions: list[list[int]]
    advantages: torch.Tensor
    reference: torch.Tensor | None
    """The completions' token log-probabilities under the frozen starting model (grpo_beta > 0)."""
    mask: torch.Tensor
    """Which completions count in the loss (all, or those that ended, with mask_truncated_completions)."""
    old: torch.Tensor | None = None
    """With num_iterations > 1: the policy's log-probabilities before the round's first update (taken by that
    update's own forward pass), which the round's later updates take their ratio against."""
    written: list[list[bool]] | None = None
    """Episodes: which of each completion's tokens the policy wrote (the others are replies the loss never sees)."""

    TENSORS = ("advantages", "reference", "mask", "old")

    def state_dict(self) -> dict:
        tensors = {name: getattr(self, name).cpu() for name in self.TENSORS if getattr(self, name) is not None}
        written = {} if self.written is None else {"written": self.written}
        return {"prompts": self.prompts, "completions": self.completions, **tensors, **written}

    @classmethod
    def from_state(cls, state: dict, device: torch.device) -> GRPOBatch:
        tensors = {name: state[name].to(device) if name in state else None for name in cls.TENSORS}
        return cls(state["prompts"], state["completions"], **tensors, written=state.get("written"))


@dataclass(frozen=True)
class RoundShape:
    """A step's rollouts on one rank: micro-batches, and completions in each (prompts x group size)."""

    micro_batches: int
    completions: int


@dataclass(frozen=True)
class GRPOLossSums:
    """What GRPO's loss metrics are computed from, summed over the updates since the last report."""

    clip_low: float
    """Of each micro-batch, its share of completion tokens clipped below (summed: divided by micro_batches)."""
    clip_high: float
    clip_region: float
    kl: float
    kl_micro_batches: float
    """Micro-batches whose loss had a KL term (grpo_beta > 0)."""
    micro_batches: float
    entropy: float
    """Summed over every completion token the loss counts."""
    tokens: float


class GRPO(Objective):
    """GRPO's step on a rollout source's completions: sampled by the policy (``online_grpo``) or given by the data
    (``grpo``); the two differ only in the source.

    At the start of a step (:meth:`prepare_step`) every rank takes its micro-batches' rollouts, the step's rewards
    are gathered from every rank, and each completion's advantage is computed on the whole global batch (a group is
    one prompt's completions, always on one rank; ``scale_rewards: batch`` divides by the whole batch's std). Each
    micro-batch (:meth:`micro`) then scores its completions under the policy, with gradients, and returns
    :func:`grpo_loss`. The log-probabilities the ratio starts from are the policy's own before the update, so the
    ratio is 1 in value and its gradient the policy gradient's, as in TRL with ``num_iterations`` 1; with more, a
    generation round trains that many steps, the later ones against the round's first log-probabilities.

    The advantages (:meth:`weigh`) and the loss (:meth:`update`) are where another algorithm on the same rollouts
    and rounds differs (:class:`astrai.trainer.objectives.rloo.RLOO`).

    The loss normalisations hold across micro-batches and ranks: ``grpo`` and ``dr_grpo`` average equal-sized
    micro-batches (divided by grad_accum_steps; DDP and FSDP average the ranks); ``dapo`` divides each micro-batch's
    summed token losses by the step's completion tokens over every rank, per rank.
    """

    def __init__(
        self,
        env: DistEnv,
        source: RolloutSource,
        settings: GRPOSettings,
        reference,
        round_shape: RoundShape,
        autocast,
        completions_log: CompletionsLog,
        log,
    ):
        self.env, self.source, self.settings, self.reference = env, source, settings, reference
        self.round_shape, self.autocast, self.completions_log, self.log = round_shape, autocast, completions_log, log
        self.iterations = settings.num_iterations
        self.round: list[GRPOBatch] = []
        """The current generation round's batches, trained on ``iterations`` steps."""
        self.round_lost = False
        """A checkpoint's round could not be taken up (another world size or shape): the next step starts one."""
        self.tokens = 0
        """Prompt and completion tokens of the round's rollouts, over every rank (the tokens of each of its steps)."""
        self.loss_tokens = 0.0
        """Completion tokens the loss counts in the round, over every rank (dapo's denominator)."""
        self._rewards = RewardReport(source, log)
        self._loss = RunningSums(GRPOLossSums)

    def parts(self) -> dict:
        return {"grpo_round": GRPORound(self)} if self.iterations > 1 else {}

    def takes_batch(self, step: int) -> bool:
        """Whether ``step`` starts a generation round (and takes new prompts); else it trains on the round's again."""
        return step % self.iterations == 0 or self.round_lost or not self.round

    def prepare_step(self, batches, model, step: int) -> list[GRPOBatch]:
        """Every micro-batch's rollouts with their advantages, weighed on the whole step's rewards; inside a generation
        round (num_iterations > 1, no new batches), the round's again."""
        if batches[0] is None:
            return list(self.round)
        self.round_lost = False
        rollouts = sample_step(self.source, model, batches, step, self.reference, self.autocast, self.completions_log)
        scores = StepScores.gather(rollouts, self.env)
        self._rewards.add(scores)
        self.tokens, self.loss_tokens = scores.tokens, scores.loss_tokens
        self._note_idle(scores)
        mine = self.weigh(scores, rollouts, model)[scores.rows_of(self.env)].to(self.env.device)
        prepared, start = [], 0
        for part in rollouts:
            count = len(part.completions)
            counted = torch.tensor(part.counted, device=self.env.device)
            prepared.append(
                GRPOBatch(
                    part.prompts,
                    part.completions,
                    mine[start : start + count],
                    part.reference_logps,
                    counted,
                    written=part.written,
                )
            )
            start += count
        if self.iterations > 1:
            self.round = list(prepared)
        return prepared

    def weigh(self, scores: StepScores, rollouts: list[Rollouts], model) -> torch.Tensor:
        """Every completion's advantage, over every rank in rank order (a collective where it needs one; ``rollouts``
        are this rank's): GRPO's, from the step's rewards alone."""
        totals = [None if math.isnan(value) else value for value in scores.rewards.tolist()]
        return advantages(totals, self.source.generations, self.settings.scale_rewards)[0]

    def _note_idle(self, scores: StepScores) -> None:
        """Why this step cannot move the weights, if it cannot (the KL penalty still moves them while grpo_beta > 0)."""
        overflowed = overflowing(scores.rewards, self.source.generations)
        if overflowed:
            self._rewards.idle(IDLE_OVERFLOW, overflowed)
        if scores.loss_tokens == 0:
            self._rewards.idle(IDLE_MASKED)
        elif self.settings.beta == 0 and not scores.rewards.isnan().all():
            if flat_groups(scores.rewards, self.source.generations) == len(scores.rewards) // self.source.generations:
                self._rewards.idle(IDLE_FLAT)

    def micro(self, model, batch, prepared: GRPOBatch, accum: int) -> tuple[torch.Tensor, torch.Tensor]:
        logps, token_mask, entropy = completion_logps(model, prepared.prompts, prepared.completions, prepared.written)
        token_mask = token_mask * prepared.mask.unsqueeze(1)
        if self.iterations > 1 and prepared.old is None:
            prepared.old = logps.detach()  # the round's first update: the policy the completions were sampled from
        old = logps.detach() if prepared.old is None else prepared.old
        loss, reported, stats = self.update(logps, old, prepared, token_mask, accum)
        self._loss.add(
            self.env.device,
            clip_low=stats.clip_low,
            clip_high=stats.clip_high,
            clip_region=stats.clip_region,
            kl=0.0 if stats.kl is None else stats.kl,
            kl_micro_batches=0.0 if stats.kl is None else 1.0,
            micro_batches=1.0,
            entropy=(entropy * token_mask).sum(),
            tokens=token_mask.sum(),
        )
        return loss, reported

    def update(
        self, logps: torch.Tensor, old: torch.Tensor, prepared: GRPOBatch, mask: torch.Tensor, accum: int
    ) -> tuple[torch.Tensor, torch.Tensor, GRPOStats]:
        """One micro-batch's (loss to backpropagate, loss to report, statistics), from its completions' token
        log-probabilities now (``logps``, with gradients) and when they were sampled (``old``); ``mask`` marks the
        tokens the loss counts: GRPO's clipped token loss, averaged as grpo_loss says."""
        dapo = self.settings.loss == "dapo"
        # dapo: the step's completion tokens the loss counts, over every rank and micro-batch, per rank.
        batch_tokens = self.loss_tokens / self.env.world_size if dapo else None
        loss, stats = grpo_loss(logps, old, prepared.reference, prepared.advantages, mask, self.settings, batch_tokens)
        if dapo:
            # Each micro-batch's loss is already a share of the step's: summed over the micro-batches, not averaged.
            return loss, loss.detach() * accum, stats
        return loss / accum, loss.detach(), stats

    def step_tokens(self, planned: int) -> int:
        return self.tokens

    def metrics(self) -> dict | None:
        """Rewards, groups without signal, completion lengths (of the rounds sampled) and the loss's statistics (of
        every update) since the last call."""
        loss = self._loss.take(self.env)
        values = self._rewards.take()
        if not values and not loss.micro_batches:
            return None
        if loss.tokens:  # a statistic with no completion token behind it is left out, not written as 0
            micros = max(loss.micro_batches, 1.0)
            values.update(
                {
                    METRIC_CLIP_LOW: loss.clip_low / micros,
                    METRIC_CLIP_HIGH: loss.clip_high / micros,
                    METRIC_CLIP_REGION: loss.clip_region / micros,
                    METRIC_KL: loss.kl / loss.kl_micro_batches if loss.kl_micro_batches else None,
                    METRIC_ENTROPY: loss.entropy / loss.tokens,
                }
            )
        return {key: value for key, value in values.items() if value is not None}


class GRPORound:
    """The generation round under way (num_iterations > 1), every rank's, as a checkpoint part: a run stopped inside
    a round resumes it with the same completions, advantages and old log-probabilities."""

    def __init__(self, objective: GRPO):
        self.objective = objective

    def state_dict(self) -> dict:
        objective, env = self.objective, self.objective.env
        mine = {
            "rollouts": [batch.state_dict() for batch in objective.round],
            "tokens": objective.tokens,
            "loss_tokens": objective.loss_tokens,
        }
        everyone = [mine]
        if env.distributed:
            everyone = [None] * env.world_size
            dist.all_gather_object(everyone, mine, group=env.control_group)
        return {f"rank{rank}": state for rank, state in enumerate(everyone)}

    def load_state_dict(self, state: dict | None) -> None:
        objective, env = self.objective, self.objective.env
        ranks = sum(1 for key in state or {} if key.startswith("rank"))
        if not state or ranks != env.world_size:
            if state:
                objective.log(
                    f"note: the checkpoint holds the generation round of {ranks} process(es), this run has "
                    f"{env.world_size}: a new round starts at the next step"
                )
            objective.round_lost = bool(state)
            return
        mine = state[f"rank{env.rank}"]
        batches = mine["rollouts"]
        shape = RoundShape(len(batches), len(batches[0]["completions"]) if batches else 0)
        if shape != objective.round_shape:
            objective.log(
                f"note: the checkpoint's generation round has {shape.micro_batches} micro-batch(es) of "
                f"{shape.completions} completions, a step of this run {objective.round_shape.micro_batches} of "
                f"{objective.round_shape.completions}: a new round starts"
            )
            objective.round_lost = True
            return
        objective.round = [GRPOBatch.from_state(batch, env.device) for batch in batches]
        objective.tokens, objective.loss_tokens = mine["tokens"], mine["loss_tokens"]
