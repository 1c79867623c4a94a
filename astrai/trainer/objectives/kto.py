"""KTO: unpaired preference examples against a frozen reference, as TRL's ``KTOTrainer`` computes them
(``loss_type: kto``, Ethayarajh et al. 2024).

An example is a prompt ``x`` and a completion ``y`` labelled desirable or not (``prepare --kind kto``). With ``pi`` and
``ref`` the summed log-probabilities of a completion's supervised tokens under the policy and the frozen starting model,
each micro-batch estimates the KL between them from mismatched pairs: each prompt with the completion of the example
before it in the micro-batch, the first with the last's (TRL's rotation of a batch's completions by one)::

    z0 = max(0, mean over the ranks of mean_i (pi(y_{i-1} | x_i) - ref(y_{i-1} | x_i)))      detached

and each example's loss is, with ``r = pi(y | x) - ref(y | x)``::

    desirable:    desirable_weight   * (1 - sigmoid(beta * (r - z0)))
    undesirable:  undesirable_weight * (1 - sigmoid(beta * (z0 - r)))

The step's loss is the mean over its examples (each micro-batch's mean; micro-batches are equal, so divided by
grad_accum_steps, and DDP and FSDP average the ranks). A sequence cut to the window (an example, or a mismatched pair)
counts the completion tokens left. The metrics are TRL's: the rewards ``beta * r`` of the desirable examples
(``rewards_chosen``) and of the undesirable ones (``rewards_rejected``), their margin, the mean ``pi`` of each
(``logps_chosen``, ``logps_rejected``), ``kl`` (z0, averaged over the micro-batches) and the completions' entropy. A
validation loss takes each held-out batch's own KL estimate.

:class:`KTOExamples` is the dataset the loader reads: example ``n`` of the data's examples at the window
(:class:`astrai.common.data_folder.Examples`) with its label, and where its completion begins.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import Dataset

from astrai.common.contract import (
    METRIC_ENTROPY,
    METRIC_KL,
    METRIC_LOGPS_CHOSEN,
    METRIC_LOGPS_REJECTED,
    METRIC_REWARDS_CHOSEN,
    METRIC_REWARDS_MARGIN,
    METRIC_REWARDS_REJECTED,
)
from astrai.common.data_folder import Examples, WindowSplit
from astrai.common.settings import KTOSettings
from astrai.trainer.feed.records import RecordIndex
from astrai.trainer.launch.distributed import DistEnv
from astrai.trainer.models.scoring import TokenTargets
from astrai.trainer.objectives.contract import Objective, RunningSums


def kto_loss(
    policy: torch.Tensor, reference: torch.Tensor, kl: torch.Tensor, labels: torch.Tensor, settings: KTOSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each example's loss (B,) and its reward ``beta * (pi - ref)`` (B,), detached, from the summed log-probabilities
    of its completion under the policy and the reference, the micro-batch's KL estimate and the labels (True:
    desirable)."""
    logratio = policy - reference
    desirable = settings.desirable_weight * (1 - F.sigmoid(settings.beta * (logratio - kl)))
    undesirable = settings.undesirable_weight * (1 - F.sigmoid(settings.beta * (kl - logratio)))
    return torch.where(labels, desirable, undesirable), settings.beta * logratio.detach()


def kl_estimate(policy: torch.Tensor, reference: torch.Tensor, env: DistEnv | None = None) -> torch.Tensor:
    """z0: the mean of the mismatched pairs' ``pi - ref`` (detached), averaged over every rank (a collective), at least
    0."""
    kl = (policy - reference).mean().detach()
    if env is not None and env.distributed:
        dist.all_reduce(kl)
        kl = kl / env.world_size
    return kl.clamp(min=0)


class KTOExample(NamedTuple):
    """One example, or (collated) a micro-batch of them."""

    tokens: torch.Tensor
    """The prompt and completion (window + 1 tokens, padded)."""
    mask: torch.Tensor
    """1 where a token is the completion's and supervised."""
    length: int | torch.Tensor
    """Tokens of the example (the rest is padding)."""
    prompt: int | torch.Tensor
    """Tokens before the completion's first."""
    label: bool | torch.Tensor
    """True: a desirable completion."""

    def to(self, device: torch.device) -> KTOExample:
        return KTOExample(*(part.to(device, non_blocking=True) for part in self))


class KTOExamples(Dataset):
    """Training example i (of the split) as a :class:`KTOExample`; ``item(n)`` is example n, training or held out."""

    def __init__(self, index: RecordIndex, examples: Examples, window: int, split: WindowSplit):
        self.index, self.examples, self.window_size, self.split = index, examples, window, split

    def __len__(self) -> int:
        return self.split.num_train

    def __getitem__(self, item: int) -> KTOExample:
        return self.item(self.split.train_window(item))

    def item(self, number: int) -> KTOExample:
        sequence, take = self.examples.examples[number]
        ids, mask = self.index.sequence(sequence, take)
        tokens = torch.zeros(self.window_size + 1, dtype=torch.int64)
        supervised = torch.zeros(self.window_size + 1, dtype=torch.float32)
        tokens[:take], supervised[:take] = ids, mask.to(torch.float32)
        prompt = int(mask.nonzero()[0]) if mask.any() else take
        return KTOExample(tokens, supervised, take, prompt, self.examples.labels[number])


def mismatched(batch: KTOExample) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch's mismatched pairs (tokens, mask), each (B, window + 1): row i is example i's prompt and
    example i - 1's completion (row 0 takes the last one's), cut to the window."""
    count, width = batch.tokens.shape
    tokens = torch.zeros_like(batch.tokens)
    mask = torch.zeros_like(batch.mask)
    prompts, lengths = batch.prompt.tolist(), batch.length.tolist()
    for row in range(count):
        other = (row - 1) % count
        prompt, begins, ends = prompts[row], prompts[other], lengths[other]
        take = min(width, prompt + ends - begins)
        tokens[row, :prompt] = batch.tokens[row, :prompt]
        tokens[row, prompt:take] = batch.tokens[other, begins : begins + take - prompt]
        mask[row, prompt:take] = batch.mask[other, begins : begins + take - prompt]
    return tokens, mask


def summed_logps(model, tokens: torch.Tensor, mask: torch.Tensor, entropy: bool = False):
    """Each row's summed log-probability of its supervised tokens (B,), and with ``entropy`` the distributions'
    entropy summed over them (detached), under ``model``."""
    scores = model(tokens[:, :-1], score=TokenTargets(tokens[:, 1:], entropy=entropy))
    weights = mask[:, 1:].to(scores.logps.dtype)
    summed = (scores.logps * weights).sum(-1)
    return (summed, (scores.entropy * weights).sum()) if entropy else summed


@dataclass(frozen=True)
class KTOSums:
    """What the metrics are computed from: summed over the examples (and micro-batches) since the last report."""

    chosen_rewards: float
    chosen_logps: float
    chosen: float
    rejected_rewards: float
    rejected_logps: float
    rejected: float
    kl: float
    micro_batches: float
    entropy: float
    tokens: float


class KTOMetrics:
    """TRL's KTO metrics over the micro-batches since the last report, on every rank."""

    def __init__(self, device: torch.device):
        self.device = device
        self._sums = RunningSums(KTOSums)

    def add(self, scored: Scored) -> None:
        labels, policy, rewards = scored.labels, scored.policy.detach(), scored.rewards
        self._sums.add(
            self.device,
            chosen_rewards=rewards[labels].sum(),
            chosen_logps=policy[labels].sum(),
            chosen=labels.sum(),
            rejected_rewards=rewards[~labels].sum(),
            rejected_logps=policy[~labels].sum(),
            rejected=(~labels).sum(),
            kl=scored.kl,
            micro_batches=1.0,
            entropy=scored.entropy,
            tokens=scored.tokens,
        )

    def take(self, env: DistEnv) -> dict[str, float]:
        """The metrics (empty when no micro-batch was seen), then counting starts again; a collective."""
        sums = self._sums.take(env)
        if not sums.micro_batches:
            return {}
        values = {METRIC_KL: sums.kl / sums.micro_batches}
        if sums.chosen:
            values[METRIC_REWARDS_CHOSEN] = sums.chosen_rewards / sums.chosen
            values[METRIC_LOGPS_CHOSEN] = sums.chosen_logps / sums.chosen
        if sums.rejected:
            values[METRIC_REWARDS_REJECTED] = sums.rejected_rewards / sums.rejected
            values[METRIC_LOGPS_REJECTED] = sums.rejected_logps / sums.rejected
        if sums.chosen and sums.rejected:
            values[METRIC_REWARDS_MARGIN] = values[METRIC_REWARDS_CHOSEN] - values[METRIC_REWARDS_REJECTED]
        if sums.tokens:
            values[METRIC_ENTROPY] = sums.entropy / sums.tokens
        return values


class Scored(NamedTuple):
    """A micro-batch's examples scored: each one's loss, reward and summed policy log-probability (B,), the KL
    estimate, and on the device its labels and the completions' summed entropy and token count."""

    losses: torch.Tensor
    rewards: torch.Tensor
    policy: torch.Tensor
    kl: torch.Tensor
    labels: torch.Tensor
    entropy: torch.Tensor
    tokens: torch.Tensor


class KTO(Objective):
    """``kto``: the data's labelled examples against the frozen starting model (a copy, or with LoRA the model with its
    adapters off); see the module's docstring."""

    def __init__(self, env: DistEnv, reference, settings: KTOSettings):
        self.env, self.reference, self.settings = env, reference, settings
        self._metrics = KTOMetrics(env.device)

    def _examples(self, model, batch: KTOExample, env: DistEnv | None) -> Scored:
        """The micro-batch (on the host) scored: the reference first (with LoRA it is the policy's own model, adapters
        off, and its forward pass must not come between the policy's and its backward), then the mismatched pairs
        under the policy, then the examples, with gradients; ``env``: the ranks the KL estimate is averaged over."""
        pairs = [part.to(self.env.device) for part in mismatched(batch)]
        batch = batch.to(self.env.device)
        with torch.no_grad():
            both = summed_logps(self.reference, torch.cat([batch.tokens, pairs[0]]), torch.cat([batch.mask, pairs[1]]))
            reference, reference_pairs = both.split(len(batch.tokens))
            policy_pairs = summed_logps(model, *pairs)
        kl = kl_estimate(policy_pairs, reference_pairs, env)
        policy, entropy = summed_logps(model, batch.tokens, batch.mask, entropy=True)
        losses, rewards = kto_loss(policy, reference, kl, batch.label, self.settings)
        return Scored(losses, rewards, policy, kl, batch.label, entropy, batch.mask[:, 1:].sum())

    def micro(self, model, batch: KTOExample, prepared, accum: int) -> tuple[torch.Tensor, torch.Tensor]:
        scored = self._examples(model, batch, self.env)
        self._metrics.add(scored)
        loss = scored.losses.mean()
        return loss / accum, loss.detach()

    def eval_sums(self, model, batch: KTOExample) -> torch.Tensor:
        losses = self._examples(model, batch, None).losses
        count = torch.tensor(len(losses), dtype=torch.float64, device=losses.device)
        return torch.stack([losses.sum().double(), count])

    def metrics(self) -> dict | None:
        return self._metrics.take(self.env) or None
