"""Rollouts: completions of a micro-batch's prompts, with what the rewards gave them, from one of two sources.

- :class:`SampledRollouts` (``online_grpo``, ``online_dpo``): the policy samples ``generations`` completions of each
  prompt (:class:`astrai.trainer.generation.decoding.DecodeEngine`, the step's micro-batches at once, each drawn by a
  generator seeded from the run's seed, the step, the rank and the micro-batch: a resumed run samples what the
  uninterrupted one sampled), and ``training.rewards`` scores them in text, with each prompt record's other fields
  (:mod:`astrai.trainer.objectives.rewards`).
- :class:`GivenRollouts` (``grpo``): each prompt's completions and rewards as the data gives them.

Either returns a :class:`Rollouts` with named fields; the objectives (GRPO, online DPO) take a source and do not ask
which one it is. :class:`StepScores` gathers what every rank's rollouts of a step scored, so that advantages and
pairs are worked out on the whole global batch; :class:`RewardReport` turns the steps since the last report into the
reward metrics, and :class:`CompletionsLog` writes a group now and then into the job dir's completions log.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from astrai.common.contract import (
    COMPLETIONS_LOG,
    METRIC_COMPLETION_CLIPPED,
    METRIC_COMPLETION_LENGTH,
    METRIC_COMPLETION_LENGTH_MAX,
    METRIC_FRAC_REWARD_ZERO_STD,
    METRIC_JUDGE_FAILURES,
    METRIC_REWARD,
    METRIC_REWARD_STD,
)
from astrai.common.reward_specs import JudgeSpec, reward_metric_names
from astrai.common.settings import Sampling
from astrai.trainer.generation.decoding import DecodeEngine, Draws
from astrai.trainer.launch.distributed import DistEnv
from astrai.trainer.models.scoring import TokenTargets
from astrai.trainer.objectives.prompts import Prompts, ScoredGroups
from astrai.trainer.objectives.rewards import Reward, RewardLimits, StepAbandoned, score

GIVEN = "given"
"""The completions log's name for rewards the data gave (grpo)."""


@dataclass
class Rollouts:
    """One micro-batch's completions, ``generations`` consecutive rows per prompt, and what they scored."""

    numbers: list[int]
    """The prompts' numbers, one per group."""
    prompts: list[list[int]]
    """Each row's prompt tokens."""
    completions: list[list[int]]
    prompt_texts: list[str]
    texts: list[str]
    """Each completion as text."""
    rewards: list[float | None]
    """Each completion's total: the weighted sum of the functions that scored it; None where none did."""
    by_function: dict[str, list[float | None]]
    """Each reward function's values, by its name (empty for rewards the data gave)."""
    ended: list[bool]
    """Whether a completion ended with a stop token (False: max_completion_length, or the data's window, cut it)."""
    counted: list[bool]
    """Whether the loss counts a completion (all, or those that ended, with mask_truncated_completions)."""
    reference_logps: torch.Tensor | None = None
    """The completions' token log-probabilities under the frozen starting model, where the objective keeps one
    (:func:`sample_step`)."""
    written: list[list[bool]] | None = None
    """Episodes: which of each completion's tokens the policy wrote (its turns); the others (tool and environment
    replies) never reach the loss. None: every token (a single completion)."""
    episodes: dict[str, list[float]] | None = None
    """Episodes: each episode's counts by metric name (turns, tool calls, ...; astrai.common.contract)."""
    transcripts: list[list[tuple[str, str]]] | None = None
    """Episodes: each one's turns and replies as (role, text), for the completions log."""


class RolloutSource(Protocol):
    generations: int
    """Completions per prompt (a group)."""
    functions: tuple[str, ...]
    """The reward functions' names (their metrics); none for rewards the data gives."""
    judges: tuple[str, ...]
    """Those of them that are remote judges."""

    def rollouts(self, model: torch.nn.Module, batches: list[list[int]], step: int) -> list[Rollouts]:
        """The completions of each micro-batch's prompts (their numbers) of ``step`` on this rank, scored."""


def rollout_seed(seed: int, step: int, rank: int, micro: int) -> int:
    """The sampling seed of one micro-batch of a step: the same for a resumed run as for the uninterrupted one, and
    another for every (seed, step, rank, micro-batch)."""
    digest = hashlib.sha256(f"{seed}/{step}/{rank}/{micro}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # 63 bits: what torch.Generator.manual_seed takes


class SampledRollouts:
    """Completions the policy samples, scored by the reward functions (``online_grpo``, ``online_dpo``).

    A step's micro-batches are sampled together, in one batched generation (:mod:`astrai.trainer.generation.decoding`),
    each micro-batch's rows drawn by its own generator, seeded from (seed, step, rank, micro-batch)."""

    def __init__(
        self,
        env: DistEnv,
        engine: DecodeEngine,
        prompts: Prompts,
        rewards: list[Reward],
        sampling: Sampling,
        generations: int,
        stop: set[int],
        decode,
        seed: int,
        mask_truncated: bool,
        autocast,
        limits: RewardLimits | None = None,
    ):
        self.env, self.engine, self.prompts, self.rewards, self.sampling = env, engine, prompts, rewards, sampling
        self.generations, self.stop, self.decode, self.seed = generations, stop, decode, seed
        self.mask_truncated, self.autocast, self.limits = mask_truncated, autocast, limits
        self.functions = tuple(reward.name for reward in rewards)
        self.judges = tuple(reward.name for reward in rewards if isinstance(reward.spec, JudgeSpec))
        """The remote judges' names: a completion one left unscored is one it failed on (on_error: none)."""

    def rollouts(self, model: torch.nn.Module, batches: list[list[int]], step: int) -> list[Rollouts]:
        G = self.generations
        prompts = [self.prompts.ids[number] for numbers in batches for number in numbers for _ in range(G)]
        draws = []
        for micro, numbers in enumerate(batches):
            generator = torch.Generator(device=self.env.device)
            generator.manual_seed(rollout_seed(self.seed, step, self.env.rank, micro))
            draws.append(Draws(len(numbers) * G, generator))
        with self.autocast:
            completions = self.engine.generate(prompts, self.sampling, self.stop, draws)
        made, start, abandoned = [], 0, False
        try:
            for numbers in batches:
                count = len(numbers) * G
                made.append(self._scored(numbers, prompts[start : start + count], completions[start : start + count]))
                start += count
        except StepAbandoned:
            abandoned = True
        if self._anyone(abandoned):  # every rank gives the step up together, or none does
            raise StepAbandoned("a stop was asked for while the step's rewards were computed")
        return made

    def _anyone(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (a collective of every rank, each step)."""
        if not self.env.distributed:
            return flag
        agreed = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.env.control_group)
        return bool(agreed)

    def _scored(self, numbers: list[int], prompts: list[list[int]], completions: list[list[int]]) -> Rollouts:
        G = self.generations
        ended = [bool(completion) and completion[-1] in self.stop for completion in completions]
        texts = [self.decode(completion) for completion in completions]
        prompt_texts = [self.prompts.texts[number] for number in numbers for _ in range(G)]
        fields, messages = self.prompts.fields_of(numbers, G), self.prompts.messages_of(numbers, G)
        scores = score(self.rewards, prompt_texts, texts, fields, self.limits, messages)
        counted = [end or not self.mask_truncated for end in ended]
        return Rollouts(
            numbers, prompts, completions, prompt_texts, texts, scores.total, scores.by_function, ended, counted
        )


class GivenRollouts:
    """Each prompt's completions and rewards as the data gives them (``grpo``): nothing is sampled."""

    functions: tuple[str, ...] = ()
    judges: tuple[str, ...] = ()

    def __init__(self, groups: ScoredGroups, decode):
        self.groups, self.decode = groups, decode
        self.generations = groups.size

    def rollouts(self, model: torch.nn.Module, batches: list[list[int]], step: int) -> list[Rollouts]:
        return [self._given(numbers) for numbers in batches]

    def _given(self, numbers: list[int]) -> Rollouts:
        chosen = [(number, row) for number in numbers for row in self.groups.groups[number]]
        completions = [completion for _, (_, completion, _, _) in chosen]
        return Rollouts(
            numbers=numbers,
            prompts=[prompt for _, (prompt, _, _, _) in chosen],
            completions=completions,
            prompt_texts=[self.groups.texts[number] for number, _ in chosen],
            texts=[self.decode(completion) for completion in completions],
            rewards=[reward for _, (_, _, reward, _) in chosen],
            by_function={},
            ended=[not cut for _, (_, _, _, cut) in chosen],
            counted=[True] * len(chosen),
        )


def completion_logps(
    model: torch.nn.Module,
    prompts: list[list[int]],
    completions: list[list[int]],
    written: list[list[bool]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each completion token's log-probability given its prompt and the tokens before it, under ``model`` (with
    gradients when enabled): ``(logps, mask, entropy)``, each (B, longest completion), the rows padded at the end.

    A row is its prompt and completion, padded at the end (which no earlier token attends to), so one forward pass
    scores the batch; only the completions' positions go through the output projection and the softmax. ``mask``
    marks the completions' tokens, of an episode only those the policy ``written`` (its turns, not the replies).
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
        if written is None:
            mask[row, : len(completion)] = 1.0
        else:
            mask[row, : len(completion)] = torch.tensor(written[row], dtype=mask.dtype, device=device)
        targets[row, : len(completion)] = torch.tensor(completion, dtype=torch.long, device=device)
    scores = model(tokens, score=TokenTargets(targets, where, entropy=True))
    return scores.logps * mask, mask, scores.entropy * mask


def sample_step(
    source: RolloutSource, model: torch.nn.Module, batches: list, step: int, reference, autocast, log: CompletionsLog
) -> list[Rollouts]:
    """The rollouts of every micro-batch of a step on this rank, in eval mode (no dropout while sampling), each with
    its completions' log-probabilities under ``reference`` (the frozen starting model, or None); the first group
    goes to the completions log when it is due."""
    inner = getattr(model, "module", model)  # under DDP, the model it wraps
    was_training = inner.training
    model.eval()
    try:
        made = source.rollouts(model, [[int(number) for number in numbers] for numbers in batches], step)
        for rollouts in made:
            if reference is not None:
                with torch.no_grad(), autocast:
                    rollouts.reference_logps = completion_logps(
                        reference, rollouts.prompts, rollouts.completions, rollouts.written
                    )[0]
        log.offer(step, made[0], source.generations)
    finally:
        model.train(was_training)
    return made


@dataclass(frozen=True)
class StepScores:
    """What every rank's rollouts of one step scored, row by row in rank order (each rank has as many rows)."""

    rewards: torch.Tensor
    """Each completion's total reward (float64; NaN where no function scored it)."""
    by_function: dict[str, torch.Tensor]
    prompt_lengths: torch.Tensor
    completion_lengths: torch.Tensor
    ended: torch.Tensor
    counted: torch.Tensor
    reply_lengths: torch.Tensor
    """Episodes: each completion's tokens the policy did not write (tool and environment replies); 0 otherwise."""
    episodes: dict[str, torch.Tensor]
    """Episodes: each episode's counts by metric name (empty for single completions)."""

    @classmethod
    def gather(cls, rollouts: list[Rollouts], env: DistEnv) -> StepScores:
        """This rank's rollouts' scores, and every other rank's (a collective: every rank calls it)."""

        def column(values) -> torch.Tensor:
            return torch.tensor([math.nan if value is None else float(value) for value in values], dtype=torch.float64)

        mine = {
            "rewards": column(value for part in rollouts for value in part.rewards),
            **{
                f"function:{name}": column(value for part in rollouts for value in part.by_function[name])
                for name in (rollouts[0].by_function if rollouts else {})
            },
            **{
                f"episode:{name}": column(value for part in rollouts for value in part.episodes[name])
                for name in (rollouts[0].episodes or {} if rollouts else {})
            },
            "prompt_lengths": column(len(prompt) for part in rollouts for prompt in part.prompts),
            "completion_lengths": column(own for part in rollouts for own, _ in _token_counts(part)),
            "reply_lengths": column(replies for part in rollouts for _, replies in _token_counts(part)),
            "ended": column(value for part in rollouts for value in part.ended),
            "counted": column(value for part in rollouts for value in part.counted),
        }
        table = torch.stack(list(mine.values()), dim=1)
        if env.distributed:
            gathered = [torch.empty_like(table, device=env.device) for _ in range(env.world_size)]
            dist.all_gather(gathered, table.to(env.device))
            table = torch.cat(gathered).cpu()
        named = dict(zip(mine, table.unbind(dim=1), strict=True))
        by_function = {key.partition(":")[2]: named.pop(key) for key in list(named) if key.startswith("function:")}
        episodes = {key.partition(":")[2]: named.pop(key) for key in list(named) if key.startswith("episode:")}
        return cls(by_function=by_function, episodes=episodes, **named)

    def rows_of(self, env: DistEnv) -> slice:
        """This rank's rows."""
        rows = len(self.rewards) // env.world_size
        return slice(env.rank * rows, (env.rank + 1) * rows)

    @property
    def tokens(self) -> int:
        """Prompt and completion tokens of the step (an episode's replies too), over every rank."""
        return int((self.prompt_lengths + self.completion_lengths + self.reply_lengths).sum())

    @property
    def loss_tokens(self) -> float:
        """Completion tokens the loss counts (the policy's own), over every rank."""
        return float((self.completion_lengths * self.counted).sum())

    @staticmethod
    def concat(steps: list[StepScores]) -> StepScores:
        def cat(name: str) -> torch.Tensor:
            return torch.cat([getattr(step, name) for step in steps])

        named = ("by_function", "episodes")
        fields = [field.name for field in dataclasses.fields(StepScores) if field.name not in named]
        by_function = {name: torch.cat([step.by_function[name] for step in steps]) for name in steps[0].by_function}
        episodes = {name: torch.cat([step.episodes[name] for step in steps]) for name in steps[0].episodes}
        return StepScores(by_function=by_function, episodes=episodes, **{name: cat(name) for name in fields})


def _token_counts(rollouts: Rollouts) -> list[tuple[int, int]]:
    """Each completion's (tokens the policy wrote, tokens of the replies between its turns)."""
    if rollouts.written is None:
        return [(len(completion), 0) for completion in rollouts.completions]
    return [(sum(written), len(written) - sum(written)) for written in rollouts.written]


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


IDLE_UNSCORED = "no completion has a reward (every function gave None): check the fields the rewards read"
IDLE_UNSCORED_GIVEN = "the data gives every completion of the step a null reward"
IDLE_FLAT = "every group's completions scored the same: no advantage to learn from"
IDLE_MASKED = "every completion reached max_completion_length, and mask_truncated_completions left them all out"
IDLE_TIED = "every pair's completions scored the same (or one of them was unscored): no pair to rank"
IDLE_OVERFLOW = "rewards too large to take a group's mean and std of (not finite): those groups count for nothing"


class RewardReport:
    """The reward metrics of the rounds sampled since the last report: the rewards' mean and std in total and per
    function, the groups without signal, the completions' lengths; and, once per cause with a count, a warning for
    the steps that could not move the weights (:meth:`idle`)."""

    def __init__(self, source: RolloutSource, log):
        self.source, self.log = source, log
        self._steps: list[StepScores] = []
        self._flat_groups = 0
        self._idle: dict[str, int] = {}

    def add(self, scores: StepScores) -> None:
        self._steps.append(scores)
        self._flat_groups += flat_groups(scores.rewards, self.source.generations)
        if scores.rewards.isnan().all():
            self.idle(IDLE_UNSCORED if self.source.functions else IDLE_UNSCORED_GIVEN)

    def idle(self, cause: str, count: int = 1) -> None:
        """Count ``count`` steps (or groups) since the last report that learned nothing for ``cause``."""
        self._idle[cause] = self._idle.get(cause, 0) + count

    def take(self) -> dict[str, float]:
        """The metrics (empty when no round was sampled since the last call); counting starts again."""
        for cause, count in self._idle.items():
            what = "group(s)" if cause == IDLE_OVERFLOW else "step(s)"
            self.log(f"warning: {count} {what} since the last report learned nothing: {cause}")
        self._idle = {}
        if not self._steps:
            return {}
        scores = StepScores.concat(self._steps)
        reward, reward_std = mean_std(scores.rewards)
        values = {METRIC_REWARD: reward, METRIC_REWARD_STD: reward_std}
        for name in self.source.functions:
            mean_name, std_name = reward_metric_names(name)
            values[mean_name], values[std_name] = mean_std(scores.by_function[name])
        for name, counts in scores.episodes.items():
            values[name] = float(counts.mean())
        for name in self.source.judges:
            values[METRIC_JUDGE_FAILURES.format(name=name)] = float(scores.by_function[name].isnan().sum())
        values[METRIC_COMPLETION_LENGTH] = float(scores.completion_lengths.mean())
        values[METRIC_COMPLETION_LENGTH_MAX] = float(scores.completion_lengths.max())
        values[METRIC_COMPLETION_CLIPPED] = float(1.0 - scores.ended.mean())
        groups = len(scores.rewards) // self.source.generations
        values[METRIC_FRAC_REWARD_ZERO_STD] = self._flat_groups / max(groups, 1)
        self._steps, self._flat_groups = [], 0
        return {key: value for key, value in values.items() if value is not None}


class CompletionsLog:
    """One group of completions with its rewards, now and then, appended to the job dir's completions log (global
    rank 0 only): the first group sampled at or after every ``log_interval`` steps."""

    def __init__(self, job_dir: Path, log_interval: int, env: DistEnv):
        self.path = Path(job_dir) / COMPLETIONS_LOG
        self.log_interval, self.master = log_interval, env.master_process
        self._period: int | None = None

    def _due(self, step: int) -> bool:
        """Whether the rollouts sampled at ``step`` go into the log (with num_iterations > 1 a round may begin after
        the interval's last step)."""
        period = (step + 1) // self.log_interval
        if self._period is None:
            self._period = step // self.log_interval
        if period <= self._period:
            return False
        self._period = period
        return True

    def offer(self, step: int, rollouts: Rollouts, generations: int) -> None:
        """Log the first group of ``rollouts`` (micro-batch 0 of ``step``) when it is due."""
        if not self.master or not self._due(step):
            return
        by_function = rollouts.by_function or {GIVEN: rollouts.rewards}
        self.write_group(
            f"step {step + 1} | prompt {rollouts.numbers[0]}",
            rollouts.prompt_texts[0],
            rollouts.texts[:generations],
            rollouts.rewards[:generations],
            {name: values[:generations] for name, values in by_function.items()},
            None if rollouts.transcripts is None else rollouts.transcripts[:generations],
            {name: values[:generations] for name, values in (rollouts.episodes or {}).items()},
        )

    def write_group(
        self,
        title: str,
        prompt: str,
        texts: list[str],
        totals: list[float | None],
        by_function: dict[str, list[float | None]],
        transcripts: list | None = None,
        episodes: dict | None = None,
    ) -> None:
        """Append one prompt's completions with each one's total and every reward's score, under ``title``; episodes
        (``transcripts``: each one's turns, (role, text)) whole, with their counts (``episodes``: by metric)."""
        lines = [f"{title}: {json.dumps(prompt, ensure_ascii=False)}"]
        for row, text in enumerate(texts):
            parts = ", ".join(
                f"{name} {'n/a' if values[row] is None else f'{values[row]:.3g}'}"
                for name, values in by_function.items()
            )
            shown = "n/a" if totals[row] is None else f"{totals[row]:.3g}"
            if transcripts is None:
                lines.append(
                    f"  [{row + 1}/{len(texts)}] reward {shown} ({parts}): {json.dumps(text, ensure_ascii=False)}"
                )
                continue
            counts = ", ".join(f"{name.partition('/')[2]} {values[row]:g}" for name, values in episodes.items())
            lines.append(f"  [{row + 1}/{len(texts)}] reward {shown} ({parts}; {counts}):")
            for role, turn in transcripts[row]:
                marker = "assistant" if role == "assistant" else "  [tool]"
                lines.append(f"      {marker}: {json.dumps(turn, ensure_ascii=False)}")
        try:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write("\n".join(lines) + "\n\n")
        except OSError:
            pass  # a full disk stops the run at its metrics or checkpoint, which say why; this log is for reading
