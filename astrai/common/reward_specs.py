"""``training.rewards`` as written: which reward functions a run scores with, their weights, and the metric names
they give. Torch-free, so the config, preflight and the trainer read the list with the same rules.

Loading and calling the functions is the trainer's (:mod:`astrai.trainer.objectives.rewards`).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from astrai.common.contract import (
    METRIC_EVAL_COMPLETION_LENGTH,
    METRIC_EVAL_PASS_AT_K,
    METRIC_EVAL_REWARD,
    METRIC_EVAL_REWARD_OF,
    METRIC_EVAL_UNSCORED,
    METRIC_REWARD,
    METRIC_REWARD_OF,
    METRIC_REWARD_STD,
    STD_SUFFIX,
)


@dataclass(frozen=True)
class RewardSpec:
    """One entry of ``training.rewards``: where the function is, and its weight in the total."""

    function: str
    weight: float = 1.0

    @property
    def name(self) -> str:
        """The function's own name (``exact_answer``), as metrics and messages call it."""
        return self.function.rpartition(":")[2]

    @property
    def source(self) -> str:
        """The file (``/data/my_rewards.py``) or module (``astrai.rewards``) the function is in."""
        return self.function.rpartition(":")[0]

    @property
    def is_file(self) -> bool:
        return self.source.endswith(".py")


def reward_metric_names(name: str) -> tuple[str, str]:
    """The metrics of one reward function: its mean and its standard deviation over the completions scored."""
    mean = METRIC_REWARD_OF.format(name=name)
    return mean, mean + STD_SUFFIX


def parse_rewards(value) -> tuple[RewardSpec, ...]:
    """``training.rewards`` as written in YAML (a list of text or ``{function, weight}``); ValueError says which
    entry is wrong and what is allowed."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"expected a list of reward functions, got {value!r}")
    specs = []
    for index, entry in enumerate(value):
        where = f"entry {index}"
        if isinstance(entry, str):
            entry = {"function": entry}
        if not isinstance(entry, dict) or set(entry) - {"function", "weight"} or "function" not in entry:
            raise ValueError(
                f"{where}: expected 'FILE.py:function', 'module:function' or {{function, weight}}, got {entry!r}"
            )
        function, weight = entry["function"], entry.get("weight", 1.0)
        head, colon, name = str(function).rpartition(":")
        if not isinstance(function, str) or not colon or not head or not name.isidentifier():
            raise ValueError(f"{where}: function must be 'FILE.py:function' or 'module:function', got {function!r}")
        if isinstance(weight, str):  # YAML reads 1e-3 as text, as the other number keys are taken from it
            try:
                weight = float(weight)
            except ValueError:
                pass
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise ValueError(f"{where}: weight must be a finite number, got {weight!r}")
        specs.append(RewardSpec(function, float(weight)))
    check_metric_names([spec.name for spec in specs])
    return tuple(specs)


def check_metric_names(names: list[str]) -> None:
    """ValueError when two functions share a name, or when one's metrics would be written under a name another
    metric of the rewards already has (``X_std`` beside ``X``, or ``std``, whose mean would be the total's std)."""
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"two reward functions named {', '.join(twice)}: metrics tell them apart by name")
    owners = {METRIC_REWARD: "the total's mean", METRIC_REWARD_STD: "the total's standard deviation"}
    for name in names:
        mean, std = reward_metric_names(name)
        owners.setdefault(mean, f"{name}'s mean")
        owners.setdefault(std, f"{name}'s standard deviation")
    for name in names:
        for metric, what in zip(reward_metric_names(name), ("mean", "standard deviation"), strict=True):
            if owners[metric] != f"{name}'s {what}":
                raise ValueError(
                    f"a reward function named {name} would report its {what} as {metric}, which is already "
                    f"{owners[metric]}; rename the function (metrics.jsonl, TensorBoard and the trackers key by it)"
                )


EVAL_METRICS = {
    METRIC_EVAL_REWARD: "the evaluation's mean total reward",
    METRIC_EVAL_PASS_AT_K: "the evaluation's pass@k",
    METRIC_EVAL_COMPLETION_LENGTH: "the evaluation's mean completion length",
    METRIC_EVAL_UNSCORED: "the evaluation's share of unscored completions",
}
"""The evaluation's own metrics, which a reward's ``eval/<name>`` may not take."""


def eval_metric_name(name: str) -> str:
    """The evaluation's metric of one reward: its mean over the completions it scored."""
    return METRIC_EVAL_REWARD_OF.format(name=name)


def check_eval_metric_names(names: list[str]) -> None:
    """ValueError when a reward of the evaluation would report under a name the evaluation's own metrics have."""
    for name in names:
        taken = EVAL_METRICS.get(eval_metric_name(name))
        if taken is not None:
            raise ValueError(
                f"a reward named {name} would report as {eval_metric_name(name)}, which is already {taken}; rename it"
            )
