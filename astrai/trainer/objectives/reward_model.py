"""``reward_model``: a Bradley–Terry reward model trained on preference pairs, as TRL's ``RewardTrainer`` computes it.

The model is the base model with a score head in place of its output projection (a sequence classifier with one
label, :attr:`astrai.common.model_config.ModelConfig.num_labels`): a sequence's reward is the head's score of the hidden
state of its last token, read as transformers' ``XForSequenceClassification`` reads it (the last token that is not the
padding token, when the model has one: :func:`last_positions`). For a pair whose chosen and rejected sequences (prompt
and answer, as ``prepare --kind dpo`` wrote them) score ``r_c`` and ``r_r``::

    loss = mean over the pairs of  -log sigmoid(r_c - r_r - margin)  +  center_rewards_coefficient * (r_c + r_r) ** 2

(TRL's ``center_rewards_coefficient``, Eisenstein et al. 2023: it keeps the rewards centred on 0; null: no term; the
``margin`` of a DPO record, which ``prepare --kind dpo`` keeps, 0 where a record gives none). The
step's loss is the mean over the pairs of its whole global batch. The metrics are TRL's: ``reward_model/accuracy``
(the share of pairs whose chosen sequence scores higher) and ``reward_model/margin`` (the mean ``r_c - r_r``), over the
pairs since the last report, and the same on the held-out pairs (``data.val_fraction``) at each validation:
``reward_model/val_accuracy`` and ``reward_model/val_margin`` beside ``val_loss``.

A checkpoint is a sequence-classification folder: ``transformers.AutoModelForSequenceClassification`` loads it with the
same scores, and ``training.rewards`` takes it as ``{model: DIR}`` (:mod:`astrai.trainer.objectives.reward_models`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from astrai.common.contract import (
    METRIC_REWARD_MODEL_ACCURACY,
    METRIC_REWARD_MODEL_MARGIN,
    METRIC_REWARD_MODEL_VAL_ACCURACY,
    METRIC_REWARD_MODEL_VAL_MARGIN,
)
from astrai.common.data_folder import Pairs, WindowSplit
from astrai.common.model_folder import ModelConfig
from astrai.common.settings import RewardModelSettings
from astrai.trainer.feed.records import RecordIndex
from astrai.trainer.launch.distributed import DistEnv
from astrai.trainer.objectives.contract import Objective, RunningSums

INIT_STD = 0.02
"""The score head's initial weights' standard deviation (transformers' initializer_range)."""


def bradley_terry_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, center: float | None = None, margin: torch.Tensor | None = None
) -> torch.Tensor:
    """Each pair's loss (k,) from the rewards of its chosen and rejected sequences (k,): ``-log sigmoid(r_c - r_r -
    margin)``, plus ``center * (r_c + r_r) ** 2``; their mean is TRL's RewardTrainer's loss of the k pairs."""
    difference = chosen - rejected if margin is None else chosen - rejected - margin
    losses = -F.logsigmoid(difference)
    if center is not None:
        losses = losses + center * (chosen + rejected) ** 2
    return losses


def last_positions(tokens: torch.Tensor, lengths: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """The position whose score is each row's reward (B,): its last token that is not ``pad_token_id`` (0 when every
    token is), as transformers' sequence classifiers pick it, among the row's first ``lengths`` tokens."""
    width = tokens.shape[-1]
    index = torch.arange(width, device=tokens.device)
    real = index < lengths.unsqueeze(-1)
    if pad_token_id is not None:
        real = real & (tokens != pad_token_id)
    return (index * real).argmax(-1)


def sequence_rewards(model, tokens: torch.Tensor, lengths: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """Each row's reward (B,) under a sequence classifier of one label."""
    scores = model(tokens)[..., 0]  # (B, T)
    return scores.gather(1, last_positions(tokens, lengths, pad_token_id).unsqueeze(-1)).squeeze(-1).float()


def classifier_start(config: ModelConfig, weights: dict[str, torch.Tensor], seed: int):
    """A causal language model's config and weights as a reward model's: a score head of one label, drawn from the
    seed, in place of the output projection (ValueError for a family without a sequence classifier)."""
    scored = dataclasses.replace(config, num_labels=1)
    scored.architecture  # noqa: B018 - refuses a family transformers has no sequence classifier for
    weights = {name: tensor for name, tensor in weights.items() if name != "output.weight"}
    head = torch.empty(1, config.dim)
    head.normal_(0.0, INIT_STD, generator=torch.Generator().manual_seed(seed))
    return scored, {**weights, "classifier.weight": head}


class RewardPair(NamedTuple):
    """One preference pair, or (collated) a batch of them: rows (2, window + 1) per pair, row 0 chosen, row 1
    rejected, each a whole sequence (prompt and answer) padded at the end."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    """Each row's tokens (2,)."""
    margin: torch.Tensor
    """The pair's margin (TRL's): the lead the chosen reward is to keep over the rejected one; 0 where none is given."""

    def to(self, device: torch.device) -> RewardPair:
        return RewardPair(*(part.to(device, non_blocking=True) for part in self))


class RewardPairs(Dataset):
    """Training pair i (of the split) as a :class:`RewardPair`; ``item(n)`` is pair n, training or held out. A
    sequence longer than the window keeps its first ``window + 1`` tokens (``data.overlong: truncate``)."""

    def __init__(self, index: RecordIndex, pairs: Pairs, window: int, split: WindowSplit):
        self.index, self.pairs, self.window_size, self.split = index, pairs, window, split
        self.margins = index.data.margins()
        """Each sequence's margin (``prepare --kind dpo`` keeps a record's ``margin``); None: a folder without."""

    def __len__(self) -> int:
        return self.split.num_train

    def __getitem__(self, item: int) -> RewardPair:
        return self.item(self.split.train_window(item))

    def item(self, number: int) -> RewardPair:
        tokens = torch.zeros(2, self.window_size + 1, dtype=torch.int64)
        lengths = torch.zeros(2, dtype=torch.int64)
        chosen, rejected, take = self.pairs.pairs[number]
        for row, sequence in enumerate((chosen, rejected)):
            ids, _ = self.index.sequence(sequence, min(take, self.index.length[sequence]))
            tokens[row, : len(ids)] = ids
            lengths[row] = len(ids)
        margin = 0.0 if self.margins is None else self.margins[chosen]
        return RewardPair(tokens, lengths, torch.tensor(margin, dtype=torch.float32))


@dataclass(frozen=True)
class PairSums:
    right: float
    """Pairs whose chosen sequence scored higher."""
    margin: float
    pairs: float


class RewardModelObjective(Objective):
    """``reward_model``: the Bradley–Terry loss of the data's pairs; the loss is the mean over the step's pairs."""

    def __init__(self, env: DistEnv, settings: RewardModelSettings, pad_token_id: int | None):
        self.env, self.settings, self.pad_token_id = env, settings, pad_token_id
        self._sums = RunningSums(PairSums)

    def _rewards(self, model, batch: RewardPair) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The chosen and rejected rewards (k,) of the batch's pairs, and their margins."""
        batch = batch.to(self.env.device)
        width = batch.tokens.shape[-1]
        rewards = sequence_rewards(model, batch.tokens.view(-1, width), batch.lengths.view(-1), self.pad_token_id)
        rewards = rewards.view(-1, 2)
        return rewards[:, 0], rewards[:, 1], batch.margin.view(-1).float()

    def micro(self, model, batch, prepared, accum: int) -> tuple[torch.Tensor, torch.Tensor]:
        chosen, rejected, margins = self._rewards(model, batch)
        loss = bradley_terry_loss(chosen, rejected, self.settings.center_rewards_coefficient, margins).mean()
        margin = (chosen - rejected).detach()
        self._sums.add(self.env.device, right=(margin > 0).sum(), margin=margin.sum(), pairs=len(margin))
        return loss / accum, loss.detach()

    def eval_sums(self, model, batch) -> torch.Tensor:
        """(summed loss, pairs, pairs ranked right, summed margin) of held-out pairs."""
        chosen, rejected, margins = self._rewards(model, batch)
        losses = bradley_terry_loss(chosen, rejected, self.settings.center_rewards_coefficient, margins)
        margin = chosen - rejected
        return torch.stack(
            [losses.sum(), torch.tensor(float(len(losses)), device=losses.device), (margin > 0).sum(), margin.sum()]
        ).double()

    def eval_metrics(self, totals: list[float]) -> dict[str, float]:
        _, pairs, right, margin = totals
        if not pairs:
            return {}
        return {METRIC_REWARD_MODEL_VAL_ACCURACY: right / pairs, METRIC_REWARD_MODEL_VAL_MARGIN: margin / pairs}

    def metrics(self) -> dict | None:
        sums = self._sums.take(self.env)
        if not sums.pairs:
            return None
        return {
            METRIC_REWARD_MODEL_ACCURACY: sums.right / sums.pairs,
            METRIC_REWARD_MODEL_MARGIN: sums.margin / sums.pairs,
        }
