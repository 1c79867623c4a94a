"""GRPO's arithmetic: advantages from a group's rewards, and the clipped surrogate loss, as TRL computes them.

For each prompt the policy samples a group of ``G`` completions; each completion's total reward (the
weighted sum of :mod:`astrai.trainer.rewards`, None where no function applies) becomes an advantage::

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

from dataclasses import dataclass

import torch

LOSSES = ("grpo", "dr_grpo", "dapo")
SCALES = ("group", "batch", "none")


@dataclass(frozen=True)
class GRPOSettings:
    epsilon: float = 0.2
    """Clip of the probability ratio below 1 (and above, unless epsilon_high is given)."""
    epsilon_high: float | None = None
    """Clip above 1 (DAPO's clip-higher); None = epsilon."""
    beta: float = 0.0
    """Weight of the KL penalty against the frozen starting model; 0 computes no reference at all."""
    loss: str = "grpo"
    scale_rewards: str = "group"
    max_completion_length: int = 256
    """dr_grpo's constant denominator (with the number of completions)."""

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"grpo_loss must be one of {' | '.join(LOSSES)}, got {self.loss!r}")
        if self.scale_rewards not in SCALES:
            raise ValueError(f"scale_rewards must be one of {' | '.join(SCALES)}, got {self.scale_rewards!r}")
        if not 0 <= self.epsilon < 1 or (self.epsilon_high is not None and not self.epsilon_high >= 0):
            raise ValueError(f"grpo_epsilon must be in [0, 1) and grpo_epsilon_high >= 0, got {self}")
        if not self.beta >= 0:
            raise ValueError(f"grpo_beta must be >= 0, got {self.beta}")

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def _nanstd(values: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The sample standard deviation (n - 1) of the values that are not NaN; NaN for fewer than two."""
    mean = torch.nanmean(values, dim=dim, keepdim=True)
    count = torch.sum(~values.isnan(), dim=dim, keepdim=True)
    variance = torch.nansum((values - mean) ** 2, dim=dim, keepdim=True) / (count - 1).clamp(min=1)
    variance = torch.where(count > 1, variance, torch.full_like(variance, float("nan")))
    return variance.sqrt().squeeze() if dim is None else variance.sqrt().squeeze(dim)


def advantages(totals: list[float | None], generations: int, scale: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion's advantage (in groups of ``generations`` consecutive completions), and for each one whether
    its group's rewards were all equal (no signal)."""
    rewards = torch.tensor([float("nan") if total is None else total for total in totals], dtype=torch.float32)
    if rewards.numel() % generations:
        raise ValueError(f"{rewards.numel()} completions do not make groups of {generations}")
    groups = rewards.view(-1, generations)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(generations)
    if scale == "batch":
        std = _nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    else:
        std = _nanstd(groups, dim=1).repeat_interleave(generations) if generations > 1 else torch.zeros_like(rewards)
    advantage = rewards - mean
    if scale != "none":
        advantage = advantage / (std + 1e-4)
    return torch.nan_to_num(advantage, nan=0.0), torch.isclose(std, torch.zeros_like(std))


@dataclass(frozen=True)
class GRPOStats:
    """What a step reports of the loss: the share of completion tokens clipped, and the mean KL."""

    clip_low: float
    clip_high: float
    clip_region: float
    kl: float | None


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

        def masked_mean(values: torch.Tensor) -> float:
            return float((values.to(mask.dtype) * mask).sum() / count)

        stats = GRPOStats(
            masked_mean(low), masked_mean(high), masked_mean(low | high), None if kl is None else masked_mean(kl)
        )
    return loss, stats


def completion_logps(
    model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each completion token's log-probability given its prompt and the tokens before it, under ``model`` (with
    gradients when enabled): ``(logps, mask, entropy)``, each (B, longest completion), the rows padded at the end.

    A row is its prompt and completion, padded at the end (which no earlier token attends to), so one forward pass
    scores the batch; only the completions' positions go through the softmax.
    """
    device = next(model.parameters()).device
    width = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    longest = max(len(c) for c in completions)
    tokens = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    where = torch.zeros(len(prompts), longest, dtype=torch.long, device=device)
    mask = torch.zeros(len(prompts), longest, device=device)
    targets = torch.zeros(len(prompts), longest, dtype=torch.long, device=device)
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        if not prompt:
            raise ValueError("every prompt needs at least one token")
        tokens[row, : len(prompt) + len(completion)] = torch.tensor(prompt + completion, device=device)
        # The logits at position t predict the token at t + 1.
        where[row, : len(completion)] = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(completion))
        mask[row, : len(completion)] = 1.0
        targets[row, : len(completion)] = torch.tensor(completion, dtype=torch.long, device=device)
    logits = model(tokens)
    picked = logits.gather(1, where.unsqueeze(-1).expand(-1, -1, logits.shape[-1])).float()
    log_probs = picked.log_softmax(dim=-1)
    logps = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(dim=-1)
    return logps * mask, mask, entropy.detach() * mask
