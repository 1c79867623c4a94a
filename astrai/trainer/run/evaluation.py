"""Generative evaluation in the loop: every ``log.eval_interval`` steps the model completes held-out prompts and the
rewards score them.

``log.eval_prompts`` is a prompts data folder (``prepare --kind prompts``, the records' other fields going to the
rewards as in training). Each prompt gets k completions (``log.eval_generations``), sampled as ``log.eval_temperature``,
``eval_top_k`` and ``eval_top_p`` say (greedy by default), of at most ``eval_max_completion_length`` tokens; the rewards
of ``log.eval_rewards`` (by default the job's ``training.rewards``) score them. With ``t`` a completion's total (the
weighted sum of the rewards that scored it, None where none did)::

    eval/reward             mean of t over the completions scored
    eval/<reward name>      mean of that reward over the completions it scored
    eval/pass@k             share of prompts with at least one of their k completions at t >= log.eval_pass_threshold
    eval/completion_length  mean tokens per completion
    eval/unscored           share of completions no reward scored

How a run evaluates (:class:`GenerativeEval`):

- The prompts are cut into batches of a fixed size, in their order in the folder, and the ranks take the batches in
  turn (batch b on rank b mod world size). A batch's rows, their padding and their draws are the same whatever the
  world size, and the results are gathered and taken in prompt order: the figures are the same on one process or
  several. Under FSDP, whose ranks generate together, a rank out of batches generates its first one again and counts
  nothing of it.
- A prompt's k completions are drawn by a generator of their own, seeded from the run's seed, the step and the
  prompt's number: a resumed run samples what the uninterrupted one did, and training's random state is not touched.
- The time it takes is a pause of the step timing (tokens/s), and the ETA counts the evaluations still to come, as it
  counts validation's.
- A stop that comes during an evaluation does not wait for it (:class:`astrai.trainer.objectives.rewards.StepAbandoned`
  on every rank): the step's record is written without it, the emergency checkpoint records that the evaluation of
  that step is still due (:class:`PendingEvaluation`), and the resumed run evaluates it first, so the job's records end
  as an uninterrupted run's would.
- The first prompt's completions go into the job dir's completions log, with each reward's score.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from astrai.common.contract import (
    METRIC_EVAL_COMPLETION_LENGTH,
    METRIC_EVAL_PASS_AT_K,
    METRIC_EVAL_REWARD,
    METRIC_EVAL_UNSCORED,
)
from astrai.common.data_folder import TokenData
from astrai.common.fit import eval_prompt_units, open_eval_prompts, prompt_room
from astrai.common.memory import generation_cache
from astrai.common.reward_specs import eval_metric_name
from astrai.common.settings import EvalSettings
from astrai.common.values import format_bytes
from astrai.trainer.feed.records import RecordIndex
from astrai.trainer.generation.decoding import Draws, total_memory
from astrai.trainer.generation.engines import EngineSizes, GenerationEngine, generation_engine
from astrai.trainer.launch.distributed import DistEnv, gather_objects
from astrai.trainer.objectives.prompts import Prompts
from astrai.trainer.objectives.rewards import Reward, RewardLimits, StepAbandoned, score
from astrai.trainer.objectives.rollouts import CompletionsLog

PART_NAME = "evaluation"
"""The evaluation's part of the run's state (checkpoints record an evaluation still due)."""


@dataclass(frozen=True)
class PromptResult:
    """What one evaluation prompt's k completions scored."""

    number: int
    totals: tuple[float | None, ...]
    """Each completion's total reward; None where no reward scored it."""
    by_reward: dict[str, tuple[float | None, ...]]
    lengths: tuple[int, ...]
    """Each completion's length in tokens."""


def eval_metrics(results: list[PromptResult], rewards: tuple[str, ...], threshold: float) -> dict[str, float]:
    """The evaluation's metrics of ``results`` (taken in prompt order, so any split of them gives the same sums); a
    mean over nothing (no completion scored) is left out."""
    ordered = sorted(results, key=lambda result: result.number)
    totals = [total for result in ordered for total in result.totals]
    metrics: dict[str, float] = {}
    reward = _mean([total for total in totals if total is not None])
    if reward is not None:
        metrics[METRIC_EVAL_REWARD] = reward
    for name in rewards:
        mean = _mean([value for result in ordered for value in result.by_reward[name] if value is not None])
        if mean is not None:
            metrics[eval_metric_name(name)] = mean
    if ordered:
        passed = sum(any(t is not None and t >= threshold for t in result.totals) for result in ordered)
        metrics[METRIC_EVAL_PASS_AT_K] = passed / len(ordered)
        metrics[METRIC_EVAL_COMPLETION_LENGTH] = _mean([length for result in ordered for length in result.lengths])
        metrics[METRIC_EVAL_UNSCORED] = sum(total is None for total in totals) / len(totals)
    return metrics


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def eval_seed(seed: int, step: int, number: int) -> int:
    """The seed of the generator that draws prompt ``number``'s completions at ``step``."""
    digest = hashlib.sha256(f"eval/{seed}/{step}/{number}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # 63 bits: what torch.Generator.manual_seed takes


class PendingEvaluation:
    """The step whose evaluation is due and not done (a stop came during it, or the start's evaluation has not run):
    a part of the run's state, so a resume evaluates it first."""

    def __init__(self, step: int | None):
        self.step = step

    def state_dict(self) -> dict:
        return {"pending": self.step}

    def load_state_dict(self, state: dict | None) -> None:
        self.step = None if state is None else state.get("pending")


class GenerativeEval:
    """The evaluation of one run: its prompts, rewards and generation engine, and the step whose evaluation is due."""

    def __init__(
        self,
        env: DistEnv,
        settings: EvalSettings,
        prompts: Prompts,
        rewards: list[Reward],
        engine,
        stop: set[int],
        decode,
        seed: int,
        autocast: contextlib.AbstractContextManager,
        limits: RewardLimits,
        log: CompletionsLog,
        together: bool = False,
    ):
        self.env, self.settings, self.prompts, self.rewards, self.engine = env, settings, prompts, rewards, engine
        self.stop, self.decode, self.seed, self.autocast = stop, decode, seed, autocast
        self.limits, self.log, self.together = limits, log, together
        self.names = tuple(reward.name for reward in rewards)
        self.pending = PendingEvaluation(0 if settings.at_start else None)
        self.last_seconds = 0.0
        """How long the last evaluation took (the ETA counts the ones still to come)."""

    def parts(self) -> dict:
        return {PART_NAME: self.pending}

    def due(self, step: int) -> bool:
        return step % self.settings.interval == 0

    def left(self, step: int, max_steps: int) -> int:
        """Evaluations still to come after ``step``."""
        return max_steps // self.settings.interval - step // self.settings.interval

    def batches(self) -> list[list[int]]:
        """The prompts' numbers in batches of a fixed size, in the folder's order."""
        count, size = len(self.prompts.ids), self.settings.batch
        return [list(range(start, min(start + size, count))) for start in range(0, count, size)]

    def run(self, model: torch.nn.Module, step: int) -> dict[str, float]:
        """Evaluate the model at ``step`` (a collective: every rank calls it); StepAbandoned on every rank when a stop
        comes meanwhile, the evaluation then still due. The model is put back in the mode it was in."""
        self.pending.step = step
        began = time.perf_counter()
        inner = getattr(model, "module", model)
        was_training = inner.training
        model.eval()
        try:
            results = self._results(model, step)
        finally:
            model.train(was_training)
        everyone = [result for part in gather_objects(self.env, results) for result in part]
        self.pending.step = None
        self.last_seconds = time.perf_counter() - began
        return eval_metrics(everyone, self.names, self.settings.pass_threshold)

    def _results(self, model: torch.nn.Module, step: int) -> list[PromptResult]:
        batches = self.batches()
        rank, world = self.env.rank, self.env.world_size
        mine = batches[rank::world]
        results: list[PromptResult] = []
        for turn in range(-(-len(batches) // world)):
            numbers = mine[turn] if turn < len(mine) else None
            # Every rank decides together before it generates: under FSDP generation is a collective of the ranks.
            abandoned = self._anyone(self.limits.stop_requested())
            if not abandoned and (numbers is not None or self.together):
                # Under FSDP a rank out of batches generates and scores its first one again (generation and a reward
                # model's forward passes are collectives of the ranks), and keeps nothing of it.
                completions = self._generate(model, numbers or batches[0], step)
                try:
                    scored = self._scored(numbers or batches[0], completions, step, first=turn == 0 and rank == 0)
                except StepAbandoned:
                    abandoned = True
                else:
                    results += scored if numbers is not None else []
            if self._anyone(abandoned):
                raise StepAbandoned(f"a stop was asked for during the evaluation of step {step}")
        return results

    def _generate(self, model: torch.nn.Module, numbers: list[int], step: int) -> list[list[int]]:
        k, device = self.settings.generations, self.env.device
        prompts = [self.prompts.ids[number] for number in numbers for _ in range(k)]
        draws = []
        for number in numbers:
            generator = None
            if not self.settings.sampling.greedy:
                generator = torch.Generator(device=device)
                generator.manual_seed(eval_seed(self.seed, step, number))
            draws.append(Draws(k, generator))
        with self.autocast:
            return self.engine.generate(prompts, self.settings.sampling, self.stop, draws)

    def _scored(self, numbers: list[int], completions: list[list[int]], step: int, first: bool) -> list[PromptResult]:
        k = self.settings.generations
        texts = [self.decode(completion) for completion in completions]
        prompt_texts = [self.prompts.texts[number] for number in numbers for _ in range(k)]
        fields, messages = self.prompts.fields_of(numbers, k), self.prompts.messages_of(numbers, k)
        scores = score(self.rewards, prompt_texts, texts, fields, self.limits, messages)
        results = []
        for row, number in enumerate(numbers):
            rows = slice(row * k, (row + 1) * k)
            results.append(
                PromptResult(
                    number,
                    tuple(scores.total[rows]),
                    {name: tuple(values[rows]) for name, values in scores.by_function.items()},
                    tuple(len(completion) for completion in completions[rows]),
                )
            )
        if first and self.env.master_process:
            self.log.write_group(
                f"evaluation at step {step} | prompt {numbers[0]}",
                prompt_texts[0],
                texts[:k],
                scores.total[:k],
                {name: values[:k] for name, values in scores.by_function.items()},
            )
        return results

    def _anyone(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (a collective of every rank)."""
        if not self.env.distributed:
            return flag
        agreed = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.env.control_group)
        return bool(agreed)


def open_evaluation(parts, run_data: TokenData) -> GenerativeEval | None:
    """The run's evaluation (None without log.eval_prompts), from the run's parts (:class:`astrai.trainer.run.build.
    RunParts`) and its training data: the prompts checked as the trainer checks them at start, the rewards loaded, an
    engine of its own."""
    config, plan, env = parts.config, parts.plan, parts.env
    settings = plan.evaluation
    if settings is None:
        return None
    from astrai.trainer.generation.generate import stop_tokens
    from astrai.trainer.run.build import autocast_for, completions_log, data_tokenizer, loaded_rewards

    data = open_eval_prompts(config.eval_prompts_folder())
    model = parts.model_config
    units = eval_prompt_units(settings, data, run_data, model, config.data.overlong, parts.start.source)
    index = RecordIndex(data)
    prompts = Prompts(data, index, units)
    rewards = loaded_rewards(parts, config.log.eval_reward_specs(config.training))
    tokenizer = data_tokenizer(data)
    stop = stop_tokens(model, parts.start.source, tokenizer)
    engine = _engine(parts, settings, max(units.takes))
    parts.log(
        f"evaluation: {len(units):,} prompts of {data.root} x {settings.generations} completion(s) of at most "
        f"{settings.sampling.max_new_tokens} tokens, {settings.batch} prompts at a time; rewards "
        f"{', '.join(f'{reward.name} x{reward.spec.weight:g}' for reward in rewards)}"
    )
    limits = RewardLimits(config.training.reward_timeout, lambda: parts.stop.requested)
    together = plan.parallel_mode == "fsdp"
    log = completions_log(parts)
    return GenerativeEval(
        env,
        settings,
        prompts,
        rewards,
        engine,
        stop,
        tokenizer.decode,
        config.training.random_seed,
        autocast_for(plan),
        limits,
        log,
        together,
    )


def _engine(parts, settings: EvalSettings, longest_prompt: int) -> GenerationEngine:
    """The evaluation's engine: one decode step per batch size at the capacity its longest prompt needs, a batch's
    rows split into parts (whole prompts' k completions) where the device's total memory calls for it."""
    plan, env, model = parts.plan, parts.env, parts.model_config

    def sizes() -> EngineSizes:
        context, _ = prompt_room(model, settings.sampling.max_new_tokens, parts.start.source)
        rows = settings.batch * settings.generations
        cache = generation_cache(model, context, rows, longest_prompt, settings.sampling.max_new_tokens, plan.autocast)
        at_once = cache.rows_per_part(total_memory(env.device), plan.state_bytes(model))
        parts.log(
            f"evaluation: key/value caches of {cache.capacity} positions, {at_once} of a batch's {rows} rows at once "
            f"({format_bytes(at_once * cache.row_bytes)})"
        )
        together = env.control_group if plan.parallel_mode == "fsdp" else None
        compiled = plan.compile and together is None
        return EngineSizes(capacity=cache.capacity, rows_per_part=at_once, together=together, compile=compiled)

    return generation_engine(plan.backend, parts.model, sizes)
