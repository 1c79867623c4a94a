"""``online_grpo``: each step samples completions of its prompts with the model being trained, scores them, and
takes GRPO's update.

A step's global batch counts prompts (``batch_per_device`` per micro-batch on each rank). Before the step's
first micro-batch (:meth:`OnlineGRPO.step_scale`), every rank, for each of its micro-batches:

1. samples ``num_generations`` completions of each prompt (:func:`astrai.trainer.generate.generate`, with a
   generator seeded from the run's seed, the step and the rank: a resumed run samples what the uninterrupted
   one sampled);
2. scores them with ``training.rewards`` (:mod:`astrai.trainer.rewards`), in text, with each prompt record's
   other fields;
3. scores them under the frozen starting model when ``grpo_beta`` > 0 (the KL penalty's reference).

Then the step's rewards are gathered from every rank, so each completion's advantage is computed on the whole
global batch (a group is one prompt's completions, always on one rank; ``scale_rewards: batch`` divides by the
whole batch's std), and each micro-batch (:meth:`OnlineGRPO.micro`) scores its completions under the policy,
with gradients, and returns the loss of :func:`astrai.trainer.grpo.grpo_loss`. The log-probabilities at sampling
time are the policy's own before this step's update, so the ratio is 1 in value and its gradient is the policy
gradient's, as in TRL with ``num_iterations`` 1.

The loss normalisations hold across micro-batches and ranks: ``grpo`` and ``dr_grpo`` average equal-sized
micro-batches (divided by grad_accum_steps; DDP and FSDP average the ranks); ``dapo`` divides each micro-batch's
summed token losses by the step's completion tokens over every rank, per rank.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from astrai.common.contract import (
    COMPLETIONS_LOG,
    METRIC_CLIP_HIGH,
    METRIC_CLIP_LOW,
    METRIC_CLIP_REGION,
    METRIC_COMPLETION_CLIPPED,
    METRIC_COMPLETION_LENGTH,
    METRIC_COMPLETION_LENGTH_MAX,
    METRIC_ENTROPY,
    METRIC_FRAC_REWARD_ZERO_STD,
    METRIC_KL,
    METRIC_PAIRS_TIED,
    METRIC_REWARD,
    METRIC_REWARD_OF,
    METRIC_REWARD_STD,
    METRIC_REWARDS_ACCURACY,
    METRIC_REWARDS_CHOSEN,
    METRIC_REWARDS_MARGIN,
    METRIC_REWARDS_REJECTED,
)
from astrai.common.data_folder import DataError, TokenData, WindowSplit
from astrai.common.fit import SetupError
from astrai.trainer.distributed import DistEnv
from astrai.trainer.generate import Sampling, generate
from astrai.trainer.grpo import GRPOSettings, advantages, completion_logps, grpo_loss
from astrai.trainer.rewards import Reward, score


@dataclass(frozen=True)
class PromptUnits:
    """The prompts a run samples from: each kept prompt's record number and the tokens it keeps (its last ones)."""

    records: list[int]
    takes: list[int]
    truncated: int
    dropped: int

    def __len__(self) -> int:
        return len(self.records)


def prompt_units(lengths: list[int], limit: int, overlong: str) -> PromptUnits:
    """Prompts longer than ``limit`` tokens keep their last ``limit`` (truncate, as TRL cuts prompts on the left)
    or are left out (drop)."""
    records, takes = [], []
    truncated = dropped = 0
    for number, length in enumerate(lengths):
        if length > limit:
            if overlong == "drop":
                dropped += 1
                continue
            truncated += 1
        records.append(number)
        takes.append(min(length, limit))
    return PromptUnits(records, takes, truncated, dropped)


class PromptSet(torch.utils.data.Dataset):
    """Training prompt i as its number among the kept prompts; the objective looks its tokens and fields up."""

    def __init__(self, units: PromptUnits, split: WindowSplit):
        self.units, self.split = units, split

    def __len__(self) -> int:
        return self.split.num_train

    def __getitem__(self, item: int) -> int:
        return self.split.train_window(item)


class Prompts:
    """Every kept prompt's token ids, text and fields, held in memory (prompts are small)."""

    def __init__(self, data: TokenData, index, units: PromptUnits):
        records = data.prompt_records()
        kept = zip(units.records, units.takes, strict=True)
        self.ids = [index.sequence(number)[0][-take:].tolist() for number, take in kept]
        self.texts = [records[number]["prompt"] for number in units.records]
        self.fields = [records[number]["fields"] for number in units.records]
        self.names = sorted({name for fields in self.fields for name in fields})

    def fields_of(self, numbers: list[int], generations: int) -> dict[str, list]:
        """The reward functions' keyword arguments: each field, per completion (None where a record lacks it)."""
        return {
            name: [self.fields[number].get(name) for number in numbers for _ in range(generations)]
            for name in self.names
        }


@dataclass
class Rollout:
    """One micro-batch's completions, ready for the update."""

    prompts: list[list[int]]
    completions: list[list[int]]
    advantages: torch.Tensor | None
    reference: torch.Tensor | None
    mask: torch.Tensor
    """Which completions count in the loss (all, or those that ended, with mask_truncated_completions)."""
    old: torch.Tensor | None = None
    """With num_iterations > 1: the policy's log-probabilities before the round's first update (taken by that
    update's own forward pass), which the round's later updates take their ratio against."""

    def state_dict(self) -> dict:
        return {
            "prompts": self.prompts,
            "completions": self.completions,
            **{
                name: getattr(self, name).cpu()
                for name in ("advantages", "reference", "mask", "old")
                if getattr(self, name) is not None
            },
        }

    @classmethod
    def from_state(cls, state: dict, device: torch.device) -> Rollout:
        tensors = {name: state[name].to(device) if name in state else None for name in ("reference", "old")}
        advantages, mask = state["advantages"].to(device), state["mask"].to(device)
        return cls(state["prompts"], state["completions"], advantages, mask=mask, **tensors)


class RoundState:
    """The rollouts of the generation round under way (num_iterations > 1), every rank's, as a checkpoint part: a run
    stopped inside a round resumes it with the same completions, advantages and old log-probabilities."""

    def __init__(self, objective: OnlineGRPO):
        self.objective = objective

    def state_dict(self) -> dict:
        objective, env = self.objective, self.objective.env
        mine = {
            "rollouts": [rollout.state_dict() for rollout in objective._round],
            "tokens": objective.step_tokens,
            "loss_tokens": objective._step_loss_tokens,
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
            if state and objective.iterations > 1:
                objective.log(
                    f"note: the checkpoint holds the generation round of {ranks} process(es), this run has "
                    f"{env.world_size}: a new round starts at the next step"
                )
            objective._round_lost = bool(state)
            return
        mine = state[f"rank{env.rank}"]
        shape = (len(mine["rollouts"]), len(mine["rollouts"][0]["completions"]) if mine["rollouts"] else 0)
        if objective.round_shape is not None and shape != objective.round_shape:
            objective.log(
                f"note: the checkpoint's generation round has {shape[0]} micro-batch(es) of {shape[1]} completions, "
                f"a step of this run {objective.round_shape[0]} of {objective.round_shape[1]}: a new round starts"
            )
            objective._round_lost = True
            return
        objective._round = [Rollout.from_state(rollout, env.device) for rollout in mine["rollouts"]]
        objective.step_tokens, objective._step_loss_tokens = mine["tokens"], mine["loss_tokens"]


def flat_groups(totals: torch.Tensor, generations: int) -> int:
    """Groups whose completions all scored the same, or fewer than two of them at all: no signal (TRL's
    frac_reward_zero_std counts them by the group's own std, whatever scale_rewards divides by)."""
    flat = 0
    for group in totals.view(-1, generations):
        scored = group[~group.isnan()]
        flat += int(scored.numel() < 2 or bool(torch.isclose(scored.std(), torch.zeros((), dtype=scored.dtype))))
    return flat


def mean_std(column: torch.Tensor) -> tuple[float | None, float | None]:
    """The mean and std of the values that are not NaN (None for too few)."""
    scored = column[~column.isnan()]
    return float(scored.mean()) if scored.numel() else None, float(scored.std()) if scored.numel() > 1 else None


def rollout_seed(seed: int, step: int, rank: int, micro: int) -> int:
    """The sampling seed of one micro-batch of a step: the same for a resumed run as for the uninterrupted one, and
    another for every (seed, step, rank, micro-batch)."""
    digest = hashlib.sha256(f"{seed}/{step}/{rank}/{micro}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # 63 bits: what torch.Generator.manual_seed takes


class OnlineGRPO:
    """GRPO on completions sampled at each step (see the module's docstring)."""

    def __init__(
        self,
        env: DistEnv,
        prompts: Prompts,
        rewards: list[Reward],
        settings: GRPOSettings,
        sampling: Sampling,
        generations: int,
        stop: set[int],
        decode,
        seed: int,
        reference,
        mask_truncated: bool,
        job_dir: Path,
        log_interval: int,
        autocast,
        log,
        iterations: int = 1,
    ):
        self.env, self.prompts, self.rewards, self.settings = env, prompts, rewards, settings
        self.sampling, self.generations, self.stop, self.decode = sampling, generations, stop, decode
        self.seed, self.reference, self.mask_truncated = seed, reference, mask_truncated
        self.job_dir, self.log_interval, self.autocast, self.log = job_dir, log_interval, autocast, log
        self.step_tokens = 0
        """Prompt and completion tokens of the last step's rollouts, over every rank (the step's tokens)."""
        self._step_loss_tokens = 0.0
        self._rollouts: list[Rollout] = []
        self.iterations = iterations
        self._round: list[Rollout] = []
        """The rollouts of the current generation round, trained on ``iterations`` steps."""
        self._round_lost = False
        self._log_period: int | None = None
        self.round_shape: tuple[int, int] | None = None
        """(micro-batches, completions in each) of a step, which a round restored from a checkpoint must have."""
        self.parts = {"grpo_round": RoundState(self)} if iterations > 1 else {}
        """Checkpoint parts of this objective (astrai.trainer.checkpoint.state): the round under way."""
        self._reset()

    def _reset(self) -> None:
        # Since the last report: every completion's row (step_scale's table, all ranks), the groups without signal,
        # and this rank's loss statistics: clip low, high, region, KL (each a mean per micro-batch), micro-batches,
        # summed entropy, completion tokens.
        self._rows: list[torch.Tensor] = []
        self._flat_groups = self._unscored_steps = 0
        self._loss_stats = torch.zeros(7, dtype=torch.float64)

    # The step's rollouts ----------------------------------------------------------------------------------

    def takes_batch(self, step: int) -> bool:
        """Whether ``step`` starts a generation round (and takes new prompts); else it trains on the round's again."""
        return step % self.iterations == 0 or self._round_lost or not self._round

    def step_scale(self, batches, model=None, step: int = 0) -> None:
        """Sample, score and weigh the completions of every micro-batch of this step (on every rank); or, inside a
        generation round (num_iterations > 1), train on the round's rollouts again."""
        if batches[0] is None:
            self._rollouts = list(self._round)
            return None
        self._round_lost = False
        inner = getattr(model, "module", model)
        was_training = inner.training
        model.eval()
        rollouts, rows = [], []
        try:
            for micro, numbers in enumerate(batches):
                rollout, micro_rows = self._sample(model, [int(number) for number in numbers], step, micro)
                rollouts.append(rollout)
                rows += micro_rows
        finally:
            model.train(was_training)
        # Every rank's rows in rank order (each rank has as many): the advantages and the metrics see the whole step.
        table = torch.tensor(rows, dtype=torch.float64)
        if self.env.distributed:
            gathered = [torch.empty_like(table, device=self.env.device) for _ in range(self.env.world_size)]
            dist.all_gather(gathered, table.to(self.env.device))
            table = torch.cat(gathered).cpu()
        self._weigh(table, rollouts)
        self._rows.append(table)
        self._flat_groups += flat_groups(table[:, 0], self.generations)
        if table[:, 0].isnan().all():
            self._unscored_steps += 1
        # Columns: total, each function, prompt tokens, completion tokens, ended, counted in the loss.
        self.step_tokens = int(table[:, -4:-2].sum())
        self._step_loss_tokens = float((table[:, -3] * table[:, -1]).sum())
        self._rollouts = rollouts
        if self.iterations > 1:
            self._round = list(rollouts)
        return None

    def _weigh(self, table: torch.Tensor, rollouts: list[Rollout]) -> None:
        """Each completion's advantage, from the whole step's rewards (``table``, every rank's rows)."""
        totals = [None if math.isnan(value) else value for value in table[:, 0].tolist()]
        advantage, _ = advantages(totals, self.generations, self.settings.scale_rewards)
        rows = len(table) // self.env.world_size
        mine = advantage[self.env.rank * rows : (self.env.rank + 1) * rows]
        per_micro = rows // len(rollouts)
        for index, rollout in enumerate(rollouts):
            rollout.advantages = mine[index * per_micro : (index + 1) * per_micro].to(self.env.device)

    def _sample(self, model, numbers: list[int], step: int, micro: int) -> tuple[Rollout, list[list[float]]]:
        """One micro-batch's rollout, and a row per completion: its total reward and each function's (NaN where
        none), its prompt's tokens, its tokens, whether it ended and whether the loss counts it."""
        G = self.generations
        prompts = [self.prompts.ids[number] for number in numbers for _ in range(G)]
        generator = torch.Generator(device=self.env.device)
        generator.manual_seed(rollout_seed(self.seed, step, self.env.rank, micro))
        # FSDP gathers the weights in every forward pass: its ranks generate in step.
        together = self.env.control_group if self.env.parallel_mode == "fsdp" else None
        with self.autocast:
            completions = generate(model, prompts, self.sampling, self.stop, generator, together)
        ended = [completion[-1] in self.stop for completion in completions]
        texts = [self.decode(completion) for completion in completions]
        prompt_texts = [self.prompts.texts[number] for number in numbers for _ in range(G)]
        scores = score(self.rewards, prompt_texts, texts, self.prompts.fields_of(numbers, G))
        reference = None
        if self.reference is not None:
            with torch.no_grad(), self.autocast:
                reference = completion_logps(self.reference, prompts, completions)[0]
        counted = [end or not self.mask_truncated for end in ended]
        if self.env.master_process and micro == 0 and self._log_due(step):
            self._log_completions(step + 1, numbers[0], prompt_texts[0], texts[:G], scores, G)
        rows = [
            [
                math.nan if scores.total[row] is None else scores.total[row],
                *(math.nan if values[row] is None else values[row] for values in scores.by_function.values()),
                len(prompts[row]),
                len(completions[row]),
                float(ended[row]),
                float(counted[row]),
            ]
            for row in range(len(completions))
        ]
        mask = torch.tensor(counted, device=self.env.device)
        return Rollout(prompts, completions, None, reference, mask), rows

    def _log_due(self, step: int) -> bool:
        """Whether the rollouts sampled at ``step`` go into the completions log: the first ones at or after every
        log_interval steps (with num_iterations > 1 a round may begin after the interval's last step)."""
        period = (step + 1) // self.log_interval
        if self._log_period is None:
            self._log_period = step // self.log_interval
        if period <= self._log_period:
            return False
        self._log_period = period
        return True

    def _log_completions(self, step: int, number: int, prompt: str, texts: list[str], scores, G: int) -> None:
        """One group of completions with its rewards, appended to the job dir's completions log."""
        lines = [f"step {step} | prompt {number}: {json.dumps(prompt, ensure_ascii=False)}"]
        for row, text in enumerate(texts):
            total = scores.total[row]
            parts = ", ".join(
                f"{name} {'n/a' if values[row] is None else f'{values[row]:.3g}'}"
                for name, values in scores.by_function.items()
            )
            shown = "n/a" if total is None else f"{total:.3g}"
            lines.append(f"  [{row + 1}/{G}] reward {shown} ({parts}): {json.dumps(text, ensure_ascii=False)}")
        try:
            with open(self.job_dir / COMPLETIONS_LOG, "a", encoding="utf-8") as handle:
                handle.write("\n".join(lines) + "\n\n")
        except OSError:
            pass  # a full disk stops the run at its metrics or checkpoint, which say why; this log is for reading

    # The update -------------------------------------------------------------------------------------------

    def micro(self, model, batch, scale, accum: int) -> tuple[torch.Tensor, torch.Tensor]:
        rollout = self._rollouts.pop(0)
        logps, token_mask, entropy = completion_logps(model, rollout.prompts, rollout.completions)
        token_mask = token_mask * rollout.mask.unsqueeze(1)
        # dapo: the step's completion tokens the loss counts, over every rank and micro-batch, per rank.
        batch_tokens = self._step_loss_tokens / self.env.world_size if self.settings.loss == "dapo" else None
        if self.iterations > 1 and rollout.old is None:
            rollout.old = logps.detach()  # the round's first update: the policy the completions were sampled from
        loss, stats = grpo_loss(
            logps,
            logps.detach() if rollout.old is None else rollout.old,
            rollout.reference,
            rollout.advantages,
            token_mask,
            self.settings,
            batch_tokens,
        )
        self._loss_stats += torch.tensor(
            [
                stats.clip_low,
                stats.clip_high,
                stats.clip_region,
                stats.kl or 0.0,
                1.0,
                float((entropy * token_mask).sum()),
                float(token_mask.sum()),
            ],
            dtype=torch.float64,
        )
        if self.settings.loss == "dapo":
            # Each micro-batch's loss is already a share of the step's: summed over the micro-batches, not averaged.
            return loss, loss.detach() * accum
        return loss / accum, loss.detach()

    def eval_sums(self, model, batch) -> torch.Tensor:
        raise SetupError("online_grpo holds no prompts out for a validation loss; set data.val_fraction to 0")

    def metrics(self) -> dict | None:
        """Rewards, groups without signal, completion lengths (of the rounds sampled) and the loss's statistics (of
        every update) since the last call."""
        stats = self._loss_stats.to(self.env.device)
        if self.env.distributed:
            dist.all_reduce(stats)
        stats = stats.tolist()
        if not self._rows and not stats[4]:
            return None
        values = {}
        if self._rows:
            table = torch.cat(self._rows)
            values = self._reward_metrics(table)
            values[METRIC_FRAC_REWARD_ZERO_STD] = self._flat_groups / max(table.shape[0] // self.generations, 1)
        micros = max(stats[4], 1.0)
        values.update(
            {
                METRIC_CLIP_LOW: stats[0] / micros,
                METRIC_CLIP_HIGH: stats[1] / micros,
                METRIC_CLIP_REGION: stats[2] / micros,
                METRIC_KL: stats[3] / micros if self.settings.beta != 0 else None,
                METRIC_ENTROPY: stats[5] / max(stats[6], 1.0),
            }
        )
        self._reset()
        return {key: value for key, value in values.items() if value is not None}

    def _reward_metrics(self, table: torch.Tensor) -> dict:
        """The rewards' mean and std, in total and per function, and the completions' lengths, over ``table``."""
        if self._unscored_steps:
            why = (
                "(every function gave None): those steps learn nothing; check the fields the rewards read"
                if self.rewards
                else "(the data gives every one of them a null reward): those steps learn nothing"
            )
            self.log(
                f"warning: no completion of {self._unscored_steps} step(s) since the last report has a reward {why}"
            )
        reward, reward_std = mean_std(table[:, 0])
        values = {METRIC_REWARD: reward, METRIC_REWARD_STD: reward_std}
        for column, reward_function in enumerate(self.rewards, start=1):
            mean, std = mean_std(table[:, column])
            values[METRIC_REWARD_OF.format(name=reward_function.name)] = mean
            values[METRIC_REWARD_OF.format(name=reward_function.name) + "_std"] = std
        lengths, ended = table[:, -3], table[:, -2]
        values[METRIC_COMPLETION_LENGTH] = float(lengths.mean())
        values[METRIC_COMPLETION_LENGTH_MAX] = float(lengths.max())
        values[METRIC_COMPLETION_CLIPPED] = float(1.0 - ended.mean())
        return values


class OnlineDPO(OnlineGRPO):
    """``online_dpo``: two completions of each prompt, the one the rewards score higher chosen, and DPO's sigmoid loss
    against the frozen starting model (TRL's online DPO with reward functions as the judge).

    A pair whose completions score the same, or that a function left unscored, is skipped (``pairs_tied``
    counts them); the loss is the mean over the step's pairs on every rank.
    """

    def __init__(self, *args, beta: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.beta = beta
        self._step_pairs = 0

    def _reset(self) -> None:
        super()._reset()
        # Chosen and rejected rewards, margin, accuracy, pairs (this rank's), ties and pairs offered (every rank's).
        self._dpo = torch.zeros(5, dtype=torch.float64)
        self._tied = self._offered = 0

    def _weigh(self, table: torch.Tensor, rollouts: list[Rollout]) -> None:
        totals = table[:, 0].view(-1, 2)
        ranked = ~totals.isnan().any(dim=1) & (totals[:, 0] != totals[:, 1])
        self._step_pairs = int(ranked.sum())
        self._tied += int((~ranked).sum())
        self._offered += int(ranked.numel())
        pairs = len(table) // 2 // self.env.world_size
        mine = totals[self.env.rank * pairs : (self.env.rank + 1) * pairs]
        kept = ranked[self.env.rank * pairs : (self.env.rank + 1) * pairs]
        per_micro = pairs // len(rollouts)
        for index, rollout in enumerate(rollouts):
            rows = range(index * per_micro, (index + 1) * per_micro)
            # (chosen row, rejected row) of the rollout, for each ranked pair.
            rollout.advantages = torch.tensor(
                [
                    (2 * (row - rows.start), 2 * (row - rows.start) + 1)
                    if mine[row, 0] > mine[row, 1]
                    else (2 * (row - rows.start) + 1, 2 * (row - rows.start))
                    for row in rows
                    if kept[row]
                ],
                dtype=torch.long,
            ).view(-1, 2)

    def micro(self, model, batch, scale, accum: int) -> tuple[torch.Tensor, torch.Tensor]:
        rollout = self._rollouts.pop(0)
        logps, token_mask, _ = completion_logps(model, rollout.prompts, rollout.completions)
        policy = (logps * token_mask).sum(-1)
        reference = (rollout.reference * token_mask).sum(-1)
        pairs = rollout.advantages.to(policy.device)
        if not len(pairs):
            # No ranked pair here: a zero loss through the model, so every rank still takes part in the backward.
            loss = policy.sum() * 0.0
            return loss, loss.detach()
        ratios = policy - reference
        rewards = self.beta * torch.stack([ratios[pairs[:, 0]], ratios[pairs[:, 1]]], dim=1)
        margins = rewards[:, 0] - rewards[:, 1]
        # The mean over the step's ranked pairs on every rank; DDP and FSDP average the ranks' gradients.
        loss = -torch.nn.functional.logsigmoid(margins).sum() * self.env.world_size / self._step_pairs
        detached = rewards.detach().double().cpu()
        margin = detached[:, 0] - detached[:, 1]
        self._dpo += torch.tensor(
            [detached[:, 0].sum(), detached[:, 1].sum(), margin.sum(), (margin > 0).sum(), len(margin)],
            dtype=torch.float64,
        )
        return loss, loss.detach() * accum

    def metrics(self) -> dict | None:
        if not self._rows:
            return None
        table = torch.cat(self._rows)
        sums = self._dpo.to(self.env.device)
        if self.env.distributed:
            dist.all_reduce(sums)
        chosen, rejected, margin, right, pairs = sums.tolist()
        values = self._reward_metrics(table)
        values[METRIC_PAIRS_TIED] = self._tied / max(self._offered, 1)
        if pairs:
            values.update(
                {
                    METRIC_REWARDS_CHOSEN: chosen / pairs,
                    METRIC_REWARDS_REJECTED: rejected / pairs,
                    METRIC_REWARDS_MARGIN: margin / pairs,
                    METRIC_REWARDS_ACCURACY: right / pairs,
                }
            )
        self._reset()
        return {key: value for key, value in values.items() if value is not None}


class ScoredGroups:
    """Offline GRPO's data (``prepare --kind grpo``): each prompt's completions and their rewards, in memory.

    A completion longer than ``window`` tokens with its prompt is cut to them (``truncate``), or its whole group
    is left out (``drop``); a group whose prompt alone fills the window, or has no token, is always left out.
    """

    def __init__(self, data: TokenData, index, window: int, overlong: str):
        lines = data.prompt_records()
        self.groups: list[list[tuple[list[int], list[int], float | None, bool]]] = []
        """Each prompt's completions: (prompt ids, completion ids, reward, whether the window cut it)."""
        self.texts: list[str] = []
        self.truncated = self.dropped = 0
        sizes = set()
        group: list = []
        for number, line in enumerate(lines):
            ids, mask = index.sequence(number)
            start = int(mask.nonzero()[0]) if bool(mask.any()) else len(ids)
            group.append((ids.tolist(), start, line["reward"]))
            if line["index"] == line["of"] - 1:
                sizes.add(len(group))
                self._keep(group, line["prompt"], window, overlong)
                group = []
        if len(sizes) > 1:
            raise DataError(
                f"{data.root}: training.train_type grpo compares each completion with its group's, and the prompts "
                f"have {' and '.join(str(size) for size in sorted(sizes))} completions; give every prompt as many"
            )
        self.size = sizes.pop() if sizes else 0
        self.names: list[str] = []

    def _keep(self, group: list, text: str, window: int, overlong: str) -> None:
        if any(start == 0 or start >= window for _, start, _ in group) or (
            overlong == "drop" and any(len(ids) > window for ids, _, _ in group)
        ):
            self.dropped += 1
            return
        self.truncated += sum(len(ids) > window for ids, _, _ in group)
        kept = [(ids[:start], ids[start:window], reward, len(ids) > window) for ids, start, reward in group]
        self.groups.append(kept)
        self.texts.append(text)

    def __len__(self) -> int:
        return len(self.groups)


class OfflineGRPO(OnlineGRPO):
    """``grpo``: GRPO's step on completions scored elsewhere (``prepare --kind grpo``), with their rewards as given.

    Nothing is sampled: a step takes its groups from the data, weighs them as ``online_grpo`` does (advantages over
    the whole global batch, the same losses and metrics), and trains on them. The log-probabilities the ratio
    starts from are the policy's own before the step, as with one update per generation round.
    """

    def __init__(self, env: DistEnv, groups: ScoredGroups, settings: GRPOSettings, decode, reference, **kwargs):
        super().__init__(env, groups, [], settings, None, groups.size, set(), decode, 0, reference, False, **kwargs)
        self.groups = groups

    def _sample(self, model, numbers: list[int], step: int, micro: int) -> tuple[Rollout, list[list[float]]]:
        chosen = [(number, row) for number in numbers for row in self.groups.groups[number]]
        prompts = [prompt for _, (prompt, _, _, _) in chosen]
        completions = [completion for _, (_, completion, _, _) in chosen]
        reference = None
        if self.reference is not None:
            with torch.no_grad(), self.autocast:
                reference = completion_logps(self.reference, prompts, completions)[0]
        if self.env.master_process and micro == 0 and self._log_due(step):
            G = self.generations
            totals = [reward for _, (_, _, reward, _) in chosen[:G]]
            texts = [self.decode(completion) for completion in completions[:G]]
            scores = _Given(totals)
            self._log_completions(step + 1, numbers[0], self.groups.texts[numbers[0]], texts, scores, G)
        rows = [
            [math.nan if reward is None else reward, len(prompt), len(completion), float(not cut), 1.0]
            for _, (prompt, completion, reward, cut) in chosen
        ]
        mask = torch.ones(len(completions), dtype=torch.bool, device=self.env.device)
        return Rollout(prompts, completions, None, reference, mask), rows


@dataclass(frozen=True)
class _Given:
    """Rewards given with the data, shaped as :class:`astrai.trainer.rewards.Scores` for the completions log."""

    total: list[float | None]

    @property
    def by_function(self) -> dict:
        return {"given": self.total}
