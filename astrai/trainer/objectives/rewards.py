"""Reward functions for the reinforcement-learning train types, in TRL's shape, and the scores they give.

A reward function is any Python callable ``fn(prompts, completions, **fields) -> list[float | None]``:
``prompts`` and ``completions`` are lists of text of the same length, ``fields`` the prompt records'
other fields (``answer``, say), one list each. ``None`` means "does not apply to this completion".
``online_grpo`` takes them from ``training.rewards``, each entry as text or as an object::

    rewards:
      - astrai.rewards:exact_answer                 # module:function, importable in the container
      - {function: /data/my_rewards.py:brevity, weight: 0.2}   # a .py file in a mounted folder

A file is read from where it is (never fetched) and runs inside the container with the trainer's
rights. A function that raises, returns the wrong number of values, or a value that is neither
``None`` nor a finite number stops the run with :class:`RewardError`, naming the function and the
prompt: a broken reward is never a silent zero.

A completion's total is the weighted sum of the functions that apply to it (``None`` counts for
nothing), as TRL sums them.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import numbers
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from astrai.common.errors import AstraiError
from astrai.common.reward_specs import RewardSpec, check_metric_names


class RewardError(AstraiError):
    """A reward function that cannot be loaded, or that failed on a batch; the message names it."""


@dataclass(frozen=True)
class Reward:
    spec: RewardSpec
    function: Callable
    takes_messages: bool = False
    """It is also given each completion's prompt as chat messages (``prompt_messages``, None for a text prompt): a
    reward model renders them with its own template."""
    in_thread: bool = True
    """With limits, it runs beside the caller, given up on past training.reward_timeout or at a stop; False: in the
    caller's thread (a reward model on the trainer's device, whose forward passes may be collectives of the ranks)."""

    @property
    def name(self) -> str:
        return self.spec.name


def load_reward(spec: RewardSpec) -> Reward:
    """The callable a spec names: from a ``.py`` file (its path as written) or an importable module."""
    return Reward(spec, user_object(spec.function, "reward", "function", RewardError))


def user_object(target: str, what: str, kind: str, error: type[AstraiError]):
    """What ``target`` (``FILE.py:name`` or ``module:name``) names, callable: the user's code, loaded from a ``.py``
    file (its path as written) or imported; ``error``
    names ``what`` it is for and ``target`` when it cannot be."""
    source, _, name = target.rpartition(":")
    if source.endswith(".py"):
        module = _load_file(Path(source), f"{what} {target}", error)
    else:
        try:
            module = importlib.import_module(source)
        except Exception as raised:  # the module's own code runs here: any error of it is reported as its own
            raise error(
                f"{what} {target}: module {source} cannot be imported ({type(raised).__name__}: {raised})"
            ) from None
    found = getattr(module, name, None)
    if not callable(found):
        raise error(f"{what} {target}: {source} has no {kind} {name}")
    return found


def _load_file(path: Path, what: str, error: type[AstraiError]):
    if not path.is_file():
        raise error(f"{what}: {path} is not a file (in a container: a file in a mounted folder)")
    module_name = f"astrai_reward_{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16]}"
    loader = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(loader)
    sys.modules[module_name] = module
    try:
        loader.loader.exec_module(module)
    except (Exception, SystemExit) as raised:  # the user's code: any error of it is reported as theirs
        del sys.modules[module_name]
        raise error(f"{what}: {path} failed to load ({type(raised).__name__}: {raised})") from None
    return module


@dataclass(frozen=True)
class Scores:
    """What the rewards gave a batch: each function's values (None where it does not apply) and each total."""

    by_function: dict[str, list[float | None]]
    total: list[float | None]
    """The weighted sum of the functions that scored a completion; None where none did (TRL's NaN)."""


class StepAbandoned(Exception):
    """A stop arrived while a step's rewards were being computed: the step is given up, and the run stops at the
    last step it completed (the loop writes that step's emergency checkpoint)."""


@dataclass(frozen=True)
class RewardLimits:
    """How long one reward function may run on one batch (``training.reward_timeout``), and what tells that a stop
    was asked for meanwhile."""

    timeout: float
    stop_requested: Callable[[], bool] = lambda: False

    POLL_SECONDS = 0.05


def score(
    rewards: list[Reward],
    prompts: list[str],
    completions: list[str],
    fields: dict[str, list],
    limits: RewardLimits | None = None,
    messages: list | None = None,
) -> Scores:
    """Every reward function on the batch, checked; RewardError names the function and the prompt at fault. With
    ``limits``, each function runs beside this thread, which gives up on it past the timeout (RewardError) or when a
    stop is asked for (StepAbandoned). ``messages``: each completion's prompt as chat messages (None for a text prompt),
    for the rewards that take them (a reward model)."""
    check_metric_names([reward.name for reward in rewards])
    clash = sorted({"prompts", "completions"} & set(fields))
    if clash:
        raise RewardError(f"the prompt records have a field named {clash[0]}, which reward functions take as text")
    values = {}
    # The rewards a stop cannot give up on (a reward model: its forward passes may be collectives of the ranks) first,
    # so that no rank is still in one when another gives the step up.
    for reward in sorted(rewards, key=lambda reward: reward.in_thread):
        given = {**fields, "prompt_messages": messages or [None] * len(prompts)} if reward.takes_messages else fields
        values[reward.name] = _call(reward, prompts, completions, given, limits)
    by_function = {reward.name: values[reward.name] for reward in rewards}
    total = []
    for row in range(len(completions)):
        scored = [
            reward.spec.weight * by_function[reward.name][row]
            for reward in rewards
            if by_function[reward.name][row] is not None
        ]
        total.append(float(sum(scored)) if scored else None)
    return Scores(by_function, total)


def _call(
    reward: Reward, prompts: list[str], completions: list[str], fields: dict[str, list], limits: RewardLimits | None
) -> list[float | None]:
    try:
        values = _run(reward, prompts, completions, fields, limits)
    except (StepAbandoned, RewardError):
        raise
    except (Exception, SystemExit) as error:  # the user's code: stop the run, saying whose error it is
        raise RewardError(
            f"reward {reward.name} raised {type(error).__name__}: {error} (on a batch whose first prompt is "
            f"{_short(prompts[0] if prompts else '')})"
        ) from None
    if hasattr(values, "tolist") and getattr(values, "ndim", 1) == 1:  # a NumPy array, a 1-D tensor
        values = values.tolist()
    if not isinstance(values, (list, tuple)) or len(values) != len(completions):
        count = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
        raise RewardError(
            f"reward {reward.name} returned {count} values for {len(completions)} completions (first prompt "
            f"{_short(prompts[0] if prompts else '')}): it must return one float or None per completion (a list, "
            "a tuple, a 1-D NumPy array or tensor)"
        )
    return [_checked(reward, value, prompts[row]) for row, value in enumerate(values)]


def _checked(reward: Reward, value, prompt: str) -> float | None:
    """One value as TRL takes it: None, a bool (0 or 1), or a finite number (a NumPy scalar too)."""
    if value is None:
        return None
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:  # a NumPy or torch scalar
        value = value.item()
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, numbers.Real):
        raise RewardError(
            f"reward {reward.name} gave {repr(value)[:80]} (a {type(value).__name__}) for the completion of prompt "
            f"{_short(prompt)}: it must be a number, a bool, or None where it does not apply"
        )
    if not math.isfinite(value):
        raise RewardError(
            f"reward {reward.name} gave {value!r} for the completion of prompt {_short(prompt)}: it must be a finite "
            "number, or None where it does not apply"
        )
    return float(value)


def _run(reward: Reward, prompts: list[str], completions: list[str], fields: dict[str, list], limits):
    """The function's values: called here, or with ``limits`` in a thread of its own that is given up on (a daemon:
    a function that never returns does not keep the process from exiting)."""
    if limits is None or not reward.in_thread:
        return reward.function(prompts=prompts, completions=completions, **fields)
    outcome: dict = {}
    done = threading.Event()

    def call() -> None:
        try:
            outcome["values"] = reward.function(prompts=prompts, completions=completions, **fields)
        except BaseException as error:  # handed to the waiting thread, which names it
            outcome["error"] = error
        finally:
            done.set()

    threading.Thread(target=call, name=f"reward-{reward.name}", daemon=True).start()
    began = time.monotonic()
    while not done.wait(RewardLimits.POLL_SECONDS):
        if limits.stop_requested():
            raise StepAbandoned(f"a stop was asked for while reward {reward.name} was running")
        if time.monotonic() - began > limits.timeout:
            raise RewardError(
                f"reward {reward.name} ran past training.reward_timeout ({limits.timeout:g} s) on a batch whose "
                f"first prompt is {_short(prompts[0] if prompts else '')}: it must return; raise reward_timeout if "
                "it needs longer"
            )
    if "error" in outcome:
        raise outcome["error"]
    return outcome["values"]


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")
