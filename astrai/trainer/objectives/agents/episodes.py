"""Episodes: the online types' rollouts when the model acts with tools, in an environment, over several turns.

An episode starts from a prompt record's messages, rendered by the chat template with the tools' schemas (and the
environment's opening observation, when its ``reset`` gives one, after the last message). Then, turn by turn:

1. the policy generates an assistant turn, until its end-of-turn (a stop token) or ``max_completion_length`` tokens;
2. the turn is read in the template's tool-call format (:mod:`astrai.data.tool_calls`); a turn without a call ends
   the episode, its text the answer the rewards score;
3. every call is answered (:mod:`astrai.trainer.objectives.agents.tools`: the environment's tool, a function of
   ``training.tools``, or an error message), and the tool messages are rendered as the template renders them after
   the turn, up to the next generation prompt; those tokens go into the model's context and the next turn is generated
   from the cache (:meth:`astrai.trainer.generation.decoding.DecodeEngine.episodes`).

The episode ends as *truncated* at ``max_turns`` turns, past ``max_tool_calls`` calls, when its tokens after the
prompt would pass ``max_episode_tokens`` (or the model's context), or when a turn is cut at ``max_completion_length``;
its reward is then ``truncated_reward`` (null: the rewards' as for any other). The reward of an episode is the
weighted sum of ``training.rewards`` on its answer (``fn(prompts, completions, **fields)``, ``completions`` the
answers) and, with weight 1, its environment's ``reward()`` (a server's: the sum of its steps' rewards).

What the update learns from: the episode's tokens after the prompt as one completion, with only the tokens the model
wrote counted (:attr:`astrai.trainer.objectives.rollouts.Rollouts.written`): the prompt's and every tool and
environment reply's tokens never reach the loss, and the episode's advantage is given to every token of its turns.

Exactness: the rows of a step and their generators are seeded as single-turn rollouts are, and each episode's
environment is made again from its record and its seed (``episode_seed``), so a resumed run plays the same episodes
as long as the environment's reset makes it deterministic. A stop between turns or inside a tool gives the step up on
every rank (as a stop during the rewards does): the emergency checkpoint is the last completed step's.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from astrai.common.agents import EpisodeSettings
from astrai.common.contract import (
    METRIC_EPISODE_TOOL_CALLS,
    METRIC_EPISODE_TOOL_ERRORS,
    METRIC_EPISODE_TRUNCATED,
    METRIC_EPISODE_TURNS,
    METRIC_EPISODE_UNPARSED,
    TOKENIZER_FILE,
)
from astrai.common.data_folder import DataError, prompt_units
from astrai.common.fit import SetupError, prompt_room
from astrai.common.reward_specs import JudgeSpec, check_metric_names
from astrai.common.settings import Sampling
from astrai.data.chat import ChatTemplate, RecordError
from astrai.data.tool_calls import ToolCall, ToolFormatError, UnparsedCall, call_id, template_tool_format
from astrai.trainer.generation.decoding import Continuation, Draws
from astrai.trainer.launch.distributed import DistEnv
from astrai.trainer.objectives.agents.environments import Episode, Limits, load_environment
from astrai.trainer.objectives.agents.tools import TOOL_ERROR, UNPARSED, AgentError, Tool, answer, load_tools, unparsed
from astrai.trainer.objectives.prompts import Prompts
from astrai.trainer.objectives.rewards import Reward, RewardLimits, StepAbandoned, score
from astrai.trainer.objectives.rollouts import Rollouts, rollout_seed


@dataclass
class Agent:
    """What a run's episodes act with: the functions of ``training.tools`` and the environment, their schemas."""

    functions: list[Tool]
    environment: object | None
    """:class:`astrai.trainer.objectives.agents.environments.ClassEnvironment` or ``ServerEnvironment``, or None."""

    @classmethod
    def load(cls, training, limits: Limits) -> Agent:
        functions = load_tools(training.tools)
        environment = load_environment(training.environment, limits)
        agent = cls(functions, environment)
        names = [tool.name for tool in agent.tools]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise AgentError(f"training.tools and training.environment both have a tool named {twice[0]}")
        return agent

    @property
    def tools(self) -> list[Tool]:
        return [*(self.environment.tools if self.environment is not None else []), *self.functions]

    @property
    def schemas(self) -> list[dict]:
        return [tool.schema for tool in self.tools]

    def describe(self) -> str:
        names = ", ".join(tool.name for tool in self.tools) or "none"
        where = f" in environment {self.environment.spec.describe()}" if self.environment is not None else ""
        return f"tools {names}{where}"


@dataclass
class EpisodePrompts:
    """The prompts of a run of episodes, as messages (prepare --kind prompts keeps them) with the chat template and
    tokenizer that render them, and the agent whose tools the template shows."""

    agent: Agent
    template: ChatTemplate
    tokenizer: object
    messages: list[list[dict]]
    """Each prompt's messages, by its number among the kept prompts (as the loader hands them out)."""

    def render(self, messages: list[dict]) -> tuple[str, list[int]]:
        """A prompt as the model sees it: rendered with the tools' schemas and the generation prompt."""
        text = self.template.render(messages, add_generation_prompt=True, tools=self.agent.schemas)
        return text, self.tokenizer.ids([text])[0]


def prompts_template(data) -> ChatTemplate:
    """The chat template the prompts were prepared with, which renders the episodes (SetupError when they have none)."""
    template = ChatTemplate.of_folder(data.root) if data.tokenizer_sha256 is not None else None
    if template is None:
        raise SetupError(
            f"{data.root}: episodes render tools with the prompts' chat template, and this data has none; prepare the "
            "prompts with --tokenizer (a folder whose chat template renders tools, or --chat_template FILE)"
        )
    return template


def stop_markers(tokenizer, stop) -> tuple[str, ...]:
    """The texts of the stop tokens: what ends an assistant turn in the template's tool-call format."""
    return tuple(sorted({tokenizer.tokenizer.id_to_token(token) or "" for token in stop} - {""}))


def episode_prompts(config, plan, index, log, model, limits: Limits):
    """(the prompts an episode run samples from, each rendered with the tools and left out when the room
    max_episode_tokens leaves in the context is too small; the run's :class:`EpisodePrompts`)."""
    from astrai.data.tokenizing import HFTokenizer

    data, training = index.data, config.training
    template = prompts_template(data)
    records = data.prompt_records()
    missing = [number for number, record in enumerate(records) if not isinstance(record.get("messages"), list)]
    if missing:
        raise DataError(
            f"{data.root}: prompt {missing[0]} (of {len(missing)}) keeps no messages: episodes need chat prompts "
            "(records whose prompt is a list of messages), prepared by this version of prepare --kind prompts"
        )
    agent = Agent.load(training, limits)
    world = EpisodePrompts(agent, template, HFTokenizer(data.root / TOKENIZER_FILE), [r["messages"] for r in records])
    try:
        lengths = [len(world.render(messages)[1]) for messages in world.messages]
    except RecordError as error:
        raise SetupError(f"{data.root}: the chat template cannot render the prompts with the tools: {error}") from None
    context, room = prompt_room(
        model, plan.episodes.max_episode_tokens, Path(config.ckpt.param_path), "max_episode_tokens"
    )
    units = prompt_units(lengths, room, "drop")
    world.messages = [world.messages[number] for number in units.records]  # by kept prompt, as the loader numbers
    if not len(units):
        raise SetupError(
            f"every prompt of {data.root} rendered with the tools is longer than {room} tokens, the room "
            f"max_episode_tokens {plan.episodes.max_episode_tokens} leaves in the model's context of {context}"
        )
    log(
        f"{training.train_type}: {len(units):,} prompts x {plan.generations} episodes, {agent.describe()}; prompts "
        f"rendered with the tools longer than {room} tokens: {units.dropped:,} left out (an episode's prompt is never "
        "cut)"
    )
    return units, world


def describe_agent(config) -> str:
    """What preflight says of a run's episodes, checked as the trainer checks them at its start: the tools and the
    environment class load and have schemas, and the prompts' chat template shows the tools and writes calls in a
    format the episodes read (AgentError, ToolFormatError, SetupError or DataError otherwise). A server environment's
    tool is named after it; whether the server answers is its own preflight line's (it needs the server running)."""
    from astrai.common.backends import load_model_config
    from astrai.common.data_folder import TokenData
    from astrai.data.tokenizing import HFTokenizer
    from astrai.trainer.generation.generate import stop_tokens

    training = config.training
    data = TokenData.open(Path(config.data.data_root_path))
    template = prompts_template(data)
    environment = training.environment
    if environment is not None and environment.server is not None:
        # A server's one tool is named after it; its schema (the server's action) is asked for once it runs.
        names = ", ".join([environment.server, *(tool.name for tool in load_tools(training.tools))])
        described = f"tools {names} in environment {environment.describe()}"
    else:
        described = Agent.load(training, Limits(training.tool_timeout)).describe()
    tokenizer = HFTokenizer(data.root / TOKENIZER_FILE)
    folder = Path(config.ckpt.param_path)
    found = template_tool_format(
        template, stop_markers(tokenizer, stop_tokens(load_model_config(folder), folder, tokenizer))
    )
    return f"{described}; the chat template renders them and writes calls as {found.format.name}"


def episode_seed(seed: int, step: int, rank: int, row: int) -> int:
    """The seed of one episode of a step (its environment's): the same for a resumed run."""
    digest = hashlib.sha256(f"{seed}/{step}/{rank}/episode/{row}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclass
class EpisodeState:
    """One episode as it goes: its prompt, its tokens after it and which of them the model wrote, what it did."""

    number: int
    prompt: list[int]
    room: int
    """The most tokens it may add after its prompt (max_episode_tokens, within the context)."""
    environment: Episode | None
    seed: int
    tokens: list[int] = field(default_factory=list)
    written: list[bool] = field(default_factory=list)
    transcript: list[tuple[str, str]] = field(default_factory=list)
    """(role, text) of its turns and replies, for the completions log."""
    answer: list[int] = field(default_factory=list)
    """The tokens of its last turn (what the rewards score)."""
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    unparsed: int = 0
    truncated: bool = False

    def stats(self) -> dict[str, float]:
        return {
            METRIC_EPISODE_TURNS: float(self.turns),
            METRIC_EPISODE_TOOL_CALLS: float(self.tool_calls),
            METRIC_EPISODE_TOOL_ERRORS: float(self.tool_errors),
            METRIC_EPISODE_UNPARSED: float(self.unparsed),
            METRIC_EPISODE_TRUNCATED: float(self.truncated),
        }


class Turns:
    """A round's episodes between turns (:class:`astrai.trainer.generation.decoding.TurnHandler`): reads each turn,
    answers its calls, renders the replies and says how each episode goes on."""

    def __init__(self, source: EpisodeRollouts, states: list[EpisodeState]):
        self.source, self.states = source, states
        self.abandoned = False

    def after_turn(self, rows: list[int], turns: list[list[int]]) -> list[Continuation | None]:
        answers = []
        for row, turn in zip(rows, turns, strict=True):
            state = self.states[row]
            state.tokens += turn
            state.written += [True] * len(turn)
            state.turns += 1
            state.answer = turn
            if self.abandoned or self.source.limits.stop_requested():
                self.abandoned = True
                answers.append(None)
                continue
            try:
                answers.append(self._next(state, turn))
            except StepAbandoned:
                self.abandoned = True
                answers.append(None)
        return answers

    def _next(self, state: EpisodeState, turn: list[int]) -> Continuation | None:
        source, settings = self.source, self.source.settings
        ended = bool(turn) and turn[-1] in source.stop
        text = source.marked_text(turn[:-1] if ended else turn)
        state.transcript.append(("assistant", text))
        parsed = source.tool_template.format.parse(text)
        if not ended or (parsed.calls_tools and state.turns >= settings.max_turns):
            state.truncated = True  # a turn cut at max_completion_length, or a call past max_turns
            return None
        if not parsed.calls_tools:
            return None
        calls: list[ToolCall | UnparsedCall] = [*parsed.calls, *parsed.unparsed]
        if state.tool_calls + len(calls) > settings.max_tool_calls:
            state.truncated = True
            return None
        state.tool_calls += len(calls)
        messages, results = [], []
        for number, call in enumerate(calls):
            given_id = call_id(state.seed, state.tool_calls - len(calls) + number)
            outcome, name = self._answer(state, call)
            state.tool_errors += outcome.problem == TOOL_ERROR
            state.unparsed += outcome.problem == UNPARSED
            identifier = call.id if isinstance(call, ToolCall) and call.id else given_id
            arguments = call.arguments if isinstance(call, ToolCall) else {}
            messages.append({"id": identifier, "type": "function", "function": {"name": name, "arguments": arguments}})
            results.append({"role": "tool", "tool_call_id": identifier, "name": name, "content": outcome.content})
            state.transcript.append(("tool", outcome.content))
        if state.environment is not None and state.environment.done:
            return None  # the environment ended the episode
        reply = source.tokenizer.ids([source.tool_template.reply(messages, results, source.world.agent.schemas)])[0]
        left = state.room - len(state.tokens) - len(reply)
        if left < 1:
            state.truncated = True
            return None
        state.tokens += reply
        state.written += [False] * len(reply)
        return Continuation(reply, min(source.sampling.max_new_tokens, left))

    def _answer(self, state: EpisodeState, call: ToolCall | UnparsedCall):
        """(the outcome of one call, the name its tool message carries)."""
        if isinstance(call, UnparsedCall):
            return unparsed(call), "unparsed_call"
        limits = self.source.limits
        if state.environment is not None:
            outcome = state.environment.call(call, limits)
            if outcome is not None:
                return outcome, call.name
        functions = {tool.name: tool.function for tool in self.source.world.agent.functions}
        known = [tool.name for tool in self.source.world.agent.tools]
        return answer(functions.get(call.name), call, known, limits.timeout, limits.stop_requested), call.name


class EpisodeRollouts:
    """The online types' rollout source when the run has tools or an environment: ``generations`` episodes of each
    prompt, played batched on the generation engine, scored when they end."""

    def __init__(
        self,
        env: DistEnv,
        engine,
        prompts: Prompts,
        world: EpisodePrompts,
        rewards: list[Reward],
        sampling: Sampling,
        settings: EpisodeSettings,
        generations: int,
        stop: set[int],
        decode,
        seed: int,
        mask_truncated: bool,
        autocast,
        limits: RewardLimits,
        context: int,
    ):
        self.env, self.engine, self.prompts, self.world, self.rewards = env, engine, prompts, world, rewards
        self.sampling, self.settings, self.generations, self.stop = sampling, settings, generations, stop
        self.decode, self.seed, self.mask_truncated, self.autocast = decode, seed, mask_truncated, autocast
        self.reward_limits, self.context = limits, context
        self.limits = Limits(settings.tool_timeout, limits.stop_requested)
        self.tokenizer = world.tokenizer
        try:
            self.tool_template = template_tool_format(world.template, stop_markers(self.tokenizer, stop))
        except ToolFormatError as error:
            raise AgentError(f"{error}") from None
        environment = world.agent.environment
        self.environment_reward = environment.name if environment is not None and environment.has_reward else None
        names = [reward.name for reward in rewards] + ([self.environment_reward] if self.environment_reward else [])
        try:
            check_metric_names(names)
        except ValueError as error:
            raise AgentError(f"training.environment: {error}") from None
        self.functions = tuple(names)
        self.judges = tuple(reward.name for reward in rewards if isinstance(reward.spec, JudgeSpec))
        """The remote judges' names: an answer one left unscored is one it failed on (on_error: none)."""

    def marked_text(self, tokens: list[int]) -> str:
        """A turn's text with its special tokens (a template's call markers among them)."""
        return self.tokenizer.tokenizer.decode(tokens, skip_special_tokens=False)

    def rollouts(self, model: torch.nn.Module, batches: list[list[int]], step: int) -> list[Rollouts]:
        G = self.generations
        numbers = [number for group in batches for number in group for _ in range(G)]
        draws = []
        for micro, group in enumerate(batches):
            generator = torch.Generator(device=self.env.device)
            generator.manual_seed(rollout_seed(self.seed, step, self.env.rank, micro))
            draws.append(Draws(len(group) * G, generator))
        states: list[EpisodeState] = []
        turns = Turns(self, states)
        made: list[Rollouts] = []
        try:
            for row, number in enumerate(numbers):
                states.append(self._start(number, step, row))
            with self.autocast:
                self.engine.episodes(
                    [state.prompt for state in states],
                    self.sampling,
                    self.stop,
                    draws,
                    turns,
                    [state.room for state in states],
                )
            start = 0
            if not turns.abandoned:
                for group in batches:
                    count = len(group) * G
                    made.append(self._scored(group, states[start : start + count]))
                    start += count
        except StepAbandoned:
            turns.abandoned = True
        finally:
            for state in states:
                if state.environment is not None:
                    state.environment.close()
        if self._anyone(turns.abandoned):
            raise StepAbandoned("a stop was asked for while the step's episodes were played or scored")
        return made

    def _start(self, number: int, step: int, row: int) -> EpisodeState:
        """An episode of prompt ``number``: its environment reset (with the observation added to the prompt's last
        message) and its prompt rendered with the tools."""
        seed = episode_seed(self.seed, step, self.env.rank, row)
        messages = [dict(message) for message in self.world.messages[number]]
        environment = self.world.agent.environment
        opened = None
        if environment is not None:
            opened = environment.open(seed, self.prompts.fields[number], messages, self.limits)
            if opened.observation:
                messages[-1] = {**messages[-1], "content": (messages[-1].get("content") or "") + opened.observation}
        prompt = self.world.render(messages)[1]
        room = min(self.settings.max_episode_tokens, self.context - len(prompt))
        if room < 1:
            raise AgentError(
                f"prompt {number} with its environment's observation takes {len(prompt):,} tokens: the model's context "
                f"of {self.context} leaves no room for an episode; shorten the observation or the prompts"
            )
        return EpisodeState(number, prompt, room, opened, seed)

    def _scored(self, numbers: list[int], states: list[EpisodeState]) -> Rollouts:
        G = self.generations
        answers = [self.decode(state.answer) for state in states]
        prompt_texts = [self.prompts.texts[number] for number in numbers for _ in range(G)]
        fields, messages = self.prompts.fields_of(numbers, G), self.prompts.messages_of(numbers, G)
        scores = score(self.rewards, prompt_texts, answers, fields, self.reward_limits, messages)
        by_function = dict(scores.by_function)
        totals = list(scores.total)
        if self.environment_reward is not None:
            values = [state.environment.reward(self.limits) for state in states]
            by_function[self.environment_reward] = values
            totals = [_plus(total, value) for total, value in zip(totals, values, strict=True)]
        if self.settings.truncated_reward is not None:
            totals = [self.settings.truncated_reward if s.truncated else t for s, t in zip(states, totals, strict=True)]
        ended = [not state.truncated for state in states]
        return Rollouts(
            numbers,
            [state.prompt for state in states],
            [state.tokens for state in states],
            prompt_texts,
            answers,
            totals,
            by_function,
            ended,
            [end or not self.mask_truncated for end in ended],
            written=[state.written for state in states],
            episodes={name: [state.stats()[name] for state in states] for name in states[0].stats()},
            transcripts=[state.transcript for state in states],
        )

    def _anyone(self, flag: bool) -> bool:
        if not self.env.distributed:
            return flag
        agreed = torch.tensor([int(flag)], dtype=torch.int32)
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX, group=self.env.control_group)
        return bool(agreed)


def _plus(total: float | None, value: float | None) -> float | None:
    """A total with one more weighted value (weight 1); None counts for nothing."""
    if value is None:
        return total
    return value if total is None or math.isnan(total) else total + value
