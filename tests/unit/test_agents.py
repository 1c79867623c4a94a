"""Episodes in the trainer: the generation engine going on from its cache between turns, tools and environments
answering calls (errors as messages, never crashes), the limits, the loss masks token by token against the rendered
episode, the advantage on every assistant token, the metrics and the completions log, and exact resume.

The world: examples/agents' byte-level tokenizer with its chat template (Hermes-style calls), the tiny preset, prompts
asking for the digit a key hides, an environment class whose lookup tool tells it.
"""

from __future__ import annotations

import json
import math
import sys
import time

import pytest
import torch
from trainer_runs import TORCHRUN, TRAINER, Run, final_weights, metrics_step, run_to_end, stop_gracefully

from astrai.common.checkpoints import latest_complete_checkpoint
from astrai.common.config import load_trainer_config
from astrai.common.configfile import ConfigError
from astrai.common.contract import COMPLETIONS_LOG, EPISODE_METRICS, METRICS_FILE
from astrai.common.settings import Sampling
from astrai.data.chat import ChatTemplate, RecordEncoder
from astrai.data.pipeline import prepare
from astrai.data.tokenizing import HFTokenizer
from astrai.trainer.generation.decoding import Continuation, DecodeEngine, Draws, regenerated_episodes
from astrai.trainer.models.native import Transformer
from astrai.trainer.models.weights import PRESETS
from astrai.trainer.objectives.agents.tools import AgentError
from astrai.trainer.objectives.grpo import grpo_loss
from astrai.trainer.objectives.rewards import StepAbandoned
from astrai.trainer.objectives.rollouts import completion_logps
from tests.support import REPO

sys.path.insert(0, str(REPO / "examples" / "agents"))
import make_world  # noqa: E402

ENVIRONMENT = '''
import os, time

class Keeper:
    """A key hides a digit; lookup tells it."""

    def reset(self, key, answer, seed=None):
        self.key, self.answer, self.seed, self.lookups = key, answer, seed, 0
        if os.environ.get("SLOW_MARKER") and os.path.exists(os.environ["SLOW_MARKER"]):
            open(os.environ["SLEEPING"], "w").close()
            time.sleep(600)
        return " (ask the keeper)"

    def lookup(self, key: str) -> str:
        """Look a key up.

        Args:
            key: The key.
        """
        self.lookups += 1
        if key != self.key:
            raise KeyError(f"no key {key}")
        return self.answer

    def reward(self):
        return float(self.lookups > 0) * 0.5
'''

TOOLS = '''
import time

def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b

def sleepy(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "awake"
'''

AGENT = {
    "train_type": "online_grpo",
    "rewards": ["astrai.rewards:exact_answer"],
    "num_generations": 2,
    "batch_per_device": 2,
    "max_completion_length": 48,
    "max_episode_tokens": 200,
    "max_turns": 3,
    "max_tool_calls": 3,
    "tool_timeout": 0.5,
    "max_steps": 6,
    "ckpt_interval": 3,
    "log_interval": 2,
    "warmup_ratio": 0.0,
    "max_lr": 1e-3,
    "window_size": 32,
}


@pytest.fixture(scope="module")
def agent_world(tmp_path_factory, train_yaml, run_trainer):
    """The tokenizer (base) and the tiny model pre-trained on whole episodes (model: it calls tools, not always
    well), the prompts (prompts), the environment and tool files."""
    root = tmp_path_factory.mktemp("agent world")
    make_world.write_world(root, prompts=1, episodes=1500)
    base = root / "base"
    prepare(root / "episodes", [root / "episodes.jsonl"], tokenizer=HFTokenizer(base))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    keys = {"window_size": 160, "batch_per_device": 8, "max_steps": 120, "ckpt_interval": 120, "max_lr": 3e-3}
    run_trainer(
        train_yaml(
            root / "pre.yaml",
            data_root_path=str(root / "episodes"),
            param_path=str(base),
            ckpt_dir=str(root / "pre"),
            **keys,
        )
    )
    torch.set_num_threads(threads)
    checkpoint = latest_complete_checkpoint(root / "pre").path
    with open(root / "prompts.jsonl", "w", encoding="utf-8") as handle:
        for number in range(12):
            key, digit = f"k{number}", str(number % 10)
            prompt = [{"role": "user", "content": make_world.QUESTION.format(key=key)}]
            handle.write(json.dumps({"prompt": prompt, "key": key, "answer": digit}) + "\n")
    prepare(root / "prompts", [root / "prompts.jsonl"], tokenizer=HFTokenizer(base), kind="prompts")
    (root / "keeper.py").write_text(ENVIRONMENT, encoding="utf-8")
    (root / "tools.py").write_text(TOOLS, encoding="utf-8")
    (root / "model").symlink_to(checkpoint)
    return root


def _yaml(train_yaml, path, world, **keys):
    values = {
        **AGENT,
        "data_root_path": str(world / "prompts"),
        "param_path": str(world / "model"),
        "environment": f"{world / 'keeper.py'}:Keeper",
        "tools": [f"{world / 'tools.py'}:add", f"{world / 'tools.py'}:sleepy"],
        **keys,
    }
    return train_yaml(path, **values)


# --- The engine ---------------------------------------------------------------------------------------------------


class Script:
    """A handler that answers each row's turns with a few tokens, until the row has taken its turns, in its room."""

    def __init__(self, rooms: list[int], turns: int = 3):
        self.rooms, self.turns, self.log, self.used = rooms, turns, [], [0] * len(rooms)

    def after_turn(self, rows, turns):
        self.log.append((rows, turns))
        answers = []
        for row, turn in zip(rows, turns, strict=True):
            self.used[row] += len(turn)
            taken = sum(row in seen for seen, _ in self.log)
            reply = [(row * 7 + taken * 13 + k) % 250 + 1 for k in range(1 + (row + taken) % 5)]
            left = self.rooms[row] - self.used[row] - len(reply)
            if taken >= self.turns or row % 3 == 0 and taken >= 2 or left < 1:
                answers.append(None)
                continue
            self.used[row] += len(reply)
            answers.append(Continuation(reply, min(6, left)))
        return answers


def _by_row(log) -> dict[int, list[list[int]]]:
    """Each row's turns, in order."""
    turns: dict[int, list[list[int]]] = {}
    for rows, made in log:
        for row, turn in zip(rows, made, strict=True):
            turns.setdefault(row, []).append(turn)
    return turns


@pytest.fixture(scope="module")
def sharp_model():
    """The tiny preset with weights wide enough that greedy decoding does not repeat one token."""
    model = Transformer(PRESETS["tiny"])
    model.init_weights(torch.Generator().manual_seed(0))
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.mul_(8)
    return model.eval()


PROMPTS = [[(row * 11 + k) % 250 + 1 for k in range(3 + row % 4)] for row in range(6)]


@pytest.mark.parametrize(
    ("rooms", "stop"), [([40] * 6, {5, 17, 33}), ([30] * 6, {65, 185, 54, 238})], ids=["roomy", "tight"]
)
def test_going_on_from_the_cache_samples_what_generating_the_whole_episode_again_does(
    sharp_model, rooms, stop, monkeypatch
):
    """Greedy turns from the cache (rows waiting for the others, their spent slots hidden; the cache emptied and fed
    again when it has no room) equal turns generated from every episode whole, turn after turn."""
    from astrai.trainer.generation import decoding

    refeeds = []
    refeed = decoding._EpisodeRows.refeed
    monkeypatch.setattr(decoding._EpisodeRows, "refeed", lambda self: refeeds.append(1) or refeed(self))
    greedy = Sampling(max_new_tokens=6, temperature=0)
    ours, theirs = Script(rooms, turns=5), Script(rooms, turns=5)
    if rooms[0] == 30:  # the least capacity the rows' turns fit in: the slots waiting rows spend outgrow it
        monkeypatch.setattr(decoding, "decode_capacity", lambda needed, new, context: needed + new - 1)
    halves = [Draws(3), Draws(3)]  # two parts of three rows: each part's rows take their turns together
    DecodeEngine(sharp_model, graphs=False, rows_per_part=4).episodes(PROMPTS, greedy, stop, halves, ours, rooms)
    engine = DecodeEngine(sharp_model, graphs=False)
    regenerated_episodes(engine.generate, PROMPTS, greedy, stop, [Draws(6)], theirs, rooms)
    assert _by_row(ours.log) == _by_row(theirs.log) and max(len(turns) for turns in _by_row(ours.log).values()) >= 3
    assert all(len(turn) <= 6 for _, turns in ours.log for turn in turns)
    if rooms[0] == 30:
        assert refeeds  # the cache ran out of room and was fed again


def test_episodes_hold_one_cache_per_batch_size_across_turns(sharp_model, monkeypatch):
    from astrai.trainer.generation import decoding
    from astrai.trainer.models.cache import KVCache

    made = []
    monkeypatch.setattr(decoding, "KVCache", lambda *args: made.append(args[1:3]) or KVCache(*args))
    engine = DecodeEngine(sharp_model, graphs=False, capacity=64)
    sampling = Sampling(max_new_tokens=6, temperature=1.0)
    for step in range(2):
        generator = torch.Generator().manual_seed(step)
        engine.episodes(PROMPTS, sampling, {5}, [Draws(6, generator)], Script([40] * 6), [40] * 6)
    assert made == [(6, 64)]


# --- Tools, environments and limits ------------------------------------------------------------------------------


class ScriptedEngine:
    """An engine whose turns are given as text (each row's list of turns), the handler answering them as it would a
    model's."""

    def __init__(self, tokenizer, turns: dict[int, list[str]]):
        self.tokenizer, self.turns, self.seen = tokenizer, turns, []

    def episodes(self, prompts, sampling, stop, draws, handler, rooms):
        self.seen.append((prompts, rooms))
        going, number = list(range(len(prompts))), 0
        while going:
            turns = [self.tokenizer.ids([self.turns[row][min(number, len(self.turns[row]) - 1)]])[0] for row in going]
            answers = handler.after_turn(going, turns)
            going = [row for row, answer in zip(going, answers, strict=True) if answer is not None]
            number += 1


def _call(name: str, arguments: dict) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call><|im_end|>"


def _scripted(make_trainer, path, turns: dict[int, list[str]], **overrides):
    trainer = make_trainer(path, **overrides)
    source = trainer.objective.source
    source.engine = ScriptedEngine(source.tokenizer, turns)
    return trainer, source


def test_calls_that_fail_become_messages_that_say_why_and_are_counted(
    tmp_path, agent_world, train_yaml, make_trainer, one_thread
):
    path = _yaml(train_yaml, tmp_path / "t.yaml", agent_world, ckpt_dir=str(tmp_path / "ckpt"))
    turns = {
        0: [_call("lookup", {"key": "k0"}), "0<|im_end|>"],  # a good call, then the right answer
        1: [_call("lookup", {"key": "nope"}), _call("nothing", {}), _call("add", {"a": 1}), "x<|im_end|>"],
        2: ['<tool_call>{"name": "add", "arguments": {"a": 1, "b": }</tool_call><|im_end|>', "1<|im_end|>"],
        3: [_call("sleepy", {"seconds": 5}), _call("add", {"a": 2, "b": 3}), "5<|im_end|>"],
    }
    trainer, source = _scripted(make_trainer, path, turns, max_episode_tokens=400)
    try:
        began = time.monotonic()
        (rollouts,) = source.rollouts(trainer.model, [[0, 1]], step=0)
        assert time.monotonic() - began < 4  # sleepy's 5 s were given up at tool_timeout 0.5 s
    finally:
        trainer.close()
    said = [[text for role, text in transcript if role == "tool"] for transcript in rollouts.transcripts]
    assert said[0] == ["0"]
    assert said[1] == [
        '{"error": "tool lookup raised KeyError: \'no key nope\'"}',
        '{"error": "there is no tool nothing; the tools are lookup, add, sleepy"}',
    ]
    assert said[2] == [
        '{"error": "the tool call could not be read: not JSON (Expecting value: line 1 column 44 (char 43))"}'
    ]
    assert said[3] == ['{"error": "tool sleepy did not return within training.tool_timeout (0.5 s)"}', "5"]
    stats = rollouts.episodes
    assert stats["episode/turns"] == [2.0, 3.0, 2.0, 3.0]  # row 1 ended at max_turns (3), with a call: truncated
    assert stats["episode/tool_calls"] == [1.0, 2.0, 1.0, 2.0]
    assert stats["episode/tool_errors"] == [0.0, 2.0, 0.0, 1.0]
    assert stats["episode/unparsed_calls"] == [0.0, 0.0, 1.0, 0.0]
    assert stats["episode/truncated"] == [0.0, 1.0, 0.0, 0.0]
    # exact_answer on the answer (weight 1) plus the environment's reward (0.5 for a lookup); truncated: 0.
    assert rollouts.by_function["exact_answer"] == [1.0, 0.0, 1.0, 0.0]
    assert rollouts.by_function["Keeper"] == [0.5, 0.5, 0.0, 0.0]
    assert rollouts.rewards == [1.5, 0.0, 1.0, 0.0]


@pytest.mark.parametrize(
    ("overrides", "turns", "truncated", "said"),
    [
        ({"max_tool_calls": "1"}, [_call("add", {"a": 1, "b": 1}), _call("add", {"a": 1, "b": 1})], 1.0, 1),
        ({"max_episode_tokens": "60"}, [_call("add", {"a": 1, "b": 1})] * 3, 1.0, 1),
        ({"max_completion_length": "8"}, ["this turn is far longer than eight tokens<|im_end|>"], 1.0, 0),
        ({"truncated_reward": "null", "max_turns": "1"}, [_call("add", {"a": 1, "b": 1})], 1.0, 0),
    ],
    ids=["max_tool_calls", "max_episode_tokens", "cut-turn", "truncated-scored"],
)
def test_past_a_limit_the_episode_ends_as_truncated_with_the_reward_set(
    tmp_path, agent_world, train_yaml, make_trainer, one_thread, overrides, turns, truncated, said
):
    path = _yaml(train_yaml, tmp_path / "t.yaml", agent_world, ckpt_dir=str(tmp_path / "ckpt"), truncated_reward=-1.0)
    trainer, source = _scripted(make_trainer, path, dict.fromkeys(range(4), turns), **overrides)
    engine = source.engine
    if overrides.get("max_completion_length"):
        text = turns[0]
        engine.turns = {
            row: [source.tokenizer.tokenizer.decode(source.tokenizer.ids([text])[0][:8])] for row in range(4)
        }
    try:
        (rollouts,) = source.rollouts(trainer.model, [[0, 1]], step=0)
    finally:
        trainer.close()
    assert rollouts.episodes["episode/truncated"] == [truncated] * 4
    assert [len([1 for role, _ in transcript if role == "tool"]) for transcript in rollouts.transcripts] == [said] * 4
    if "truncated_reward" in overrides:
        # Scored as the others: the last turn's last number against the answer (prompts 0 and 1), no lookup.
        assert rollouts.rewards == [0.0, 0.0, 1.0, 1.0]
    else:
        assert rollouts.rewards == [-1.0] * 4
    assert all(room <= 200 for room in engine.seen[0][1])


def test_an_environment_that_cannot_start_an_episode_stops_the_run_naming_it(
    tmp_path, agent_world, train_yaml, make_trainer, one_thread
):
    (tmp_path / "broken.py").write_text(
        "class Broken:\n    def reset(self, key):\n        raise RuntimeError('no such world')\n", encoding="utf-8"
    )
    path = _yaml(train_yaml, tmp_path / "t.yaml", agent_world, environment=f"{tmp_path / 'broken.py'}:Broken")
    trainer = make_trainer(path, ckpt_dir=str(tmp_path / "ckpt"))
    try:
        with pytest.raises(
            AgentError, match=r"environment .*broken.py:Broken: reset raised RuntimeError: no such world"
        ):
            trainer.train(1)
    finally:
        trainer.close()


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("class E:\n    pass\n", "it has no reset method"),
        (
            "class E:\n    def reset(self):\n        pass\n    def act(self, x):\n        pass\n",
            "tool act: it has no doc",
        ),
        (
            "class E:\n    def __init__(self):\n        raise ValueError('x')\n    def reset(self):\n        pass\n",
            "making an instance raised ValueError: x",
        ),
    ],
)
def test_an_environment_class_that_cannot_serve_is_refused_at_start(
    tmp_path, agent_world, train_yaml, make_trainer, source, message
):
    (tmp_path / "env.py").write_text(source, encoding="utf-8")
    path = _yaml(train_yaml, tmp_path / "t.yaml", agent_world, environment=f"{tmp_path / 'env.py'}:E", tools=[])
    with pytest.raises(AgentError, match=message):
        make_trainer(path, ckpt_dir=str(tmp_path / "ckpt"))


def test_a_stop_inside_a_tool_gives_the_round_up(tmp_path, agent_world, train_yaml, make_trainer, one_thread):
    path = _yaml(train_yaml, tmp_path / "t.yaml", agent_world, ckpt_dir=str(tmp_path / "ckpt"), tool_timeout=30.0)
    turns = dict.fromkeys(range(4), [_call("sleepy", {"seconds": 30}), "1<|im_end|>"])
    trainer, source = _scripted(make_trainer, path, turns)
    began = time.monotonic()
    source.limits = type(source.limits)(30.0, lambda: time.monotonic() > began + 1.0)  # asked for inside sleepy
    try:
        with pytest.raises(StepAbandoned):
            source.rollouts(trainer.model, [[0, 1]], step=0)
        assert 1.0 < time.monotonic() - began < 5
    finally:
        trainer.close()


# --- Masks and advantages -------------------------------------------------------------------------------------------


def test_tool_tokens_never_reach_the_loss_checked_token_by_token_against_the_rendered_episode(
    tmp_path, agent_world, train_yaml, make_trainer, one_thread
):
    """The episode's tokens are the conversation as the template renders it (prompt with the tools and the
    observation, the calls, the tool messages, the answer), and the tokens the policy wrote are exactly those an SFT
    record of that conversation supervises: its turns through their end-of-turn tokens."""
    path = _yaml(train_yaml, tmp_path / "t.yaml", agent_world, ckpt_dir=str(tmp_path / "ckpt"))
    calls = [{"name": "lookup", "arguments": {"key": "k0"}}, {"name": "add", "arguments": {"a": 2, "b": 3}}]
    turns = dict.fromkeys(range(4), [_call(**calls[0]), _call(**calls[1]), "The digit is 0.<|im_end|>"])
    trainer, source = _scripted(make_trainer, path, turns)
    try:
        (rollouts,) = source.rollouts(trainer.model, [[0, 1]], step=0)
    finally:
        trainer.close()
    tokenizer = HFTokenizer(agent_world / "base")
    question = make_world.QUESTION.format(key="k0") + " (ask the keeper)"
    messages = [{"role": "user", "content": question}]
    for number, (call, result) in enumerate(zip(calls, ["0", "5"], strict=True)):
        entry = {"id": f"c{number}", "type": "function", "function": call}
        messages.append({"role": "assistant", "content": "", "tool_calls": [entry]})
        messages.append({"role": "tool", "tool_call_id": f"c{number}", "name": call["name"], "content": result})
    messages.append({"role": "assistant", "content": "The digit is 0."})
    template = ChatTemplate.of_folder(agent_world / "base")
    ids, mask = RecordEncoder(tokenizer, template, "sft")._conversation(messages, tools=source.world.agent.schemas)
    episode = rollouts.prompts[0] + rollouts.completions[0]
    assert episode == ids[: len(episode)] and tokenizer.decode(ids[len(episode) :]) == "\n"  # the template's last
    written = [0] * len(rollouts.prompts[0]) + [int(bit) for bit in rollouts.written[0]]
    assert written == mask[: len(episode)] and not any(mask[len(episode) :])
    assert sum(written) > 0 and len(written) - sum(written) > len(rollouts.prompts[0])  # replies are not written
    # What reaches the loss: completion_logps' mask is the written tokens, and every one of them carries the
    # episode's advantage: the loss's gradient is the same on the tokens of each turn, and none on a reply's.
    logps = torch.zeros(1, len(rollouts.completions[0]), requires_grad=True)
    model_mask = completion_logps(trainer.model, rollouts.prompts[:1], rollouts.completions[:1], rollouts.written[:1])[
        1
    ]
    assert model_mask[0].tolist() == [float(bit) for bit in rollouts.written[0]]
    from astrai.common.settings import GRPOSettings

    loss, _ = grpo_loss(logps, logps.detach(), None, torch.tensor([0.7]), model_mask, GRPOSettings(loss="grpo"))
    (gradient,) = torch.autograd.grad(loss, logps)
    own = gradient[0][model_mask[0] == 1]
    assert torch.allclose(own, own[0].expand_as(own)) and own[0] < 0
    assert (gradient[0][model_mask[0] == 0] == 0).all()


# --- Whole runs -----------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "keys", [{}, {"lora_rank": 4, "lora_alpha": 8}, {"num_iterations": 2}], ids=["full", "lora", "rounds"]
)
def test_a_run_of_episodes_reports_logs_and_resumes_bitwise(
    tmp_path, agent_world, train_yaml, make_trainer, run_trainer, one_thread, keys
):
    whole = _yaml(train_yaml, tmp_path / "whole.yaml", agent_world, ckpt_dir=str(tmp_path / "whole"), **keys)
    run_trainer(whole)
    parts = _yaml(train_yaml, tmp_path / "parts.yaml", agent_world, ckpt_dir=str(tmp_path / "parts"), **keys)
    run_trainer(parts, steps=4)  # stopped after step 4; the checkpoint of step 3 resumes
    run_trainer(parts)
    assert final_weights(tmp_path / "parts", 6) == final_weights(tmp_path / "whole", 6)
    records = [json.loads(line) for line in (tmp_path / "whole" / METRICS_FILE).read_text().splitlines()]
    sampled = [record for record in records if "reward" in record]
    for key in (*EPISODE_METRICS, "reward", "reward_exact_answer", "reward_Keeper", "completion_length"):
        assert math.isfinite(sampled[-1][key]), (key, sampled[-1])
    assert sampled[-1]["episode/turns"] >= 1
    log = (tmp_path / "whole" / COMPLETIONS_LOG).read_text(encoding="utf-8")
    assert "turns " in log and "      assistant: " in log
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "whole" / "tensorboard"), size_guidance={"scalars": 0}).Reload()
    assert {f"train/{name}" for name in EPISODE_METRICS} <= set(events.Tags()["scalars"])


@pytest.mark.slow
@pytest.mark.parametrize("train_type", ["online_dpo", "online_rloo"])
def test_pairs_and_leave_one_out_baselines_of_episodes_train_and_resume_bitwise(
    tmp_path, agent_world, train_yaml, run_trainer, one_thread, train_type
):
    keys = {"train_type": train_type, "max_steps": 4, "ckpt_interval": 2}
    whole = _yaml(train_yaml, tmp_path / "whole.yaml", agent_world, ckpt_dir=str(tmp_path / "whole"), **keys)
    run_trainer(whole)
    parts = _yaml(train_yaml, tmp_path / "parts.yaml", agent_world, ckpt_dir=str(tmp_path / "parts"), **keys)
    run_trainer(parts, steps=2)
    run_trainer(parts)
    assert final_weights(tmp_path / "parts", 4) == final_weights(tmp_path / "whole", 4)


@pytest.mark.slow
def test_a_stop_while_the_environment_works_saves_the_last_completed_step_and_resumes_bitwise(
    tmp_path, agent_world, train_yaml, trainer_env
):
    """SIGTERM while the environment's reset sleeps (an episode under way): the round is given up, the emergency
    checkpoint is the last completed step's, and the resumed run ends on the uninterrupted one's weights (the
    environments made again from their records and seeds)."""
    marker, sleeping = tmp_path / "slow", tmp_path / "sleeping"
    env = {**trainer_env, "SLOW_MARKER": str(marker), "SLEEPING": str(sleeping)}
    scripted = {"tool_timeout": 900.0, "max_steps": 5, "ckpt_interval": 100, "log_interval": 1}
    finals = {}
    for name in ("whole", "stopped"):
        ckpt_dir = tmp_path / name
        path = _yaml(train_yaml, tmp_path / f"{name}.yaml", agent_world, ckpt_dir=str(ckpt_dir), **scripted)
        command = [*TRAINER, "--config", str(path)]
        if name == "stopped":
            run = Run(command, env, tmp_path / "run.log")

            def asleep(ckpt_dir=ckpt_dir):
                if metrics_step(ckpt_dir) >= 2 and not marker.exists():
                    marker.touch()
                return sleeping.exists()

            stop_gracefully(run, asleep, timeout=60)
            latest = latest_complete_checkpoint(ckpt_dir)
            assert latest.meta.reason == "emergency" and latest.step == metrics_step(ckpt_dir), run.output()
            assert "that step is given up" in run.output(), run.output()
            marker.unlink()
        run_to_end(command, env, tmp_path / f"{name}.log")
        finals[name] = final_weights(ckpt_dir, 5)
    assert finals["stopped"] == finals["whole"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_processes_play_episodes_stop_and_resume_bitwise(tmp_path, agent_world, train_yaml, trainer_env, mode):
    """Each rank plays its own prompts' episodes (under FSDP the ranks take every turn together, the forward passes
    being collectives); a graceful stop and a restart end where an uninterrupted run does."""
    finals = {}
    for name in ("whole", "stopped"):
        ckpt_dir = tmp_path / name
        keys = {"max_steps": 6, "ckpt_interval": 100, "log_interval": 1, "num_workers": 1}
        path = _yaml(train_yaml, tmp_path / f"{name}.yaml", agent_world, ckpt_dir=str(ckpt_dir), **keys)
        command = [*TORCHRUN, "-m", "astrai.train", "--config", str(path), "--parallel_mode", mode]
        if name == "stopped":
            run = Run(command, trainer_env, tmp_path / "run.log")
            stop_gracefully(run, lambda ckpt_dir=ckpt_dir: metrics_step(ckpt_dir) >= 3, rank=1)
            latest = latest_complete_checkpoint(ckpt_dir)
            assert latest.meta.reason == "emergency" and 3 <= latest.step < 6, run.output()
        run_to_end(command, trainer_env, tmp_path / f"{name}.log")
        finals[name] = final_weights(ckpt_dir, 6)
    assert finals["stopped"] == finals["whole"]


# --- Settings -----------------------------------------------------------------------------------------------------


def test_episode_settings_out_of_range_are_refused_naming_the_key(tmp_path, agent_world, train_yaml):
    path = _yaml(train_yaml, tmp_path / "t.yaml", agent_world)
    for overrides, message in (
        ({"max_turns": "0"}, "training.max_turns: expected an integer >= 1, got 0"),
        ({"max_tool_calls": "-1"}, "training.max_tool_calls: expected an integer >= 0, got -1"),
        ({"max_episode_tokens": "0"}, "training.max_episode_tokens: expected an integer >= 1, got 0"),
        ({"tool_timeout": "0"}, "training.tool_timeout: expected a number of seconds > 0, got 0.0"),
        ({"environment": "nocolon"}, "training.environment (--environment): an environment must be 'FILE.py:Class'"),
        ({"environment": "{server: Not_Ok}"}, "training.environment (--environment): server 'Not_Ok': a name of"),
        ({"tools": "[a:b, c:b]"}, "training.tools (--tools): two tools named b"),
        ({"rewards": "[]", "environment": "null"}, "training.rewards: training.train_type online_grpo scores"),
    ):
        with pytest.raises(ConfigError) as raised:
            load_trainer_config(path, list(overrides.items()))
        assert any(message in line for line in raised.value.messages), raised.value.messages


def test_preflight_checks_the_tools_and_the_template_as_the_trainer_will(tmp_path, agent_world, train_yaml):
    """What `invoke preflight` runs in the job's image: the tools load, and the prompts' template renders them and
    writes calls in a format the episodes read; a template that renders no tools is refused, saying so."""
    from hf_folders import make_chat_tokenizer

    from astrai.data.tool_calls import ToolFormatError
    from astrai.trainer.objectives.agents.episodes import describe_agent

    path = _yaml(train_yaml, tmp_path / "t.yaml", agent_world)
    found = describe_agent(load_trainer_config(path))
    assert found == (
        f"tools lookup, add, sleepy in environment {agent_world / 'keeper.py'}:Keeper; the chat template renders them "
        "and writes calls as hermes"
    )
    plain = make_chat_tokenizer(tmp_path / "plain", ["What digit does k1 hide?"] * 20)
    records = tmp_path / "prompts.jsonl"
    records.write_text(json.dumps({"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}) + "\n")
    prepare(tmp_path / "plain-prompts", [records], tokenizer=HFTokenizer(plain), kind="prompts")
    with pytest.raises(ToolFormatError, match="does not show the tools to the model"):
        describe_agent(load_trainer_config(path, [("data_root_path", str(tmp_path / "plain-prompts"))]))
