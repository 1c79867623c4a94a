"""``training.rewards`` as written: what scores a run's completions — reward functions, reward models and remote
judges — their weights, and the metric names they give. Torch-free, so the config, preflight and the trainer read the
list with the same rules.

Loading and calling them is the trainer's (:mod:`astrai.trainer.objectives.rewards` for functions,
:mod:`astrai.trainer.objectives.model_rewards` for reward models, :mod:`astrai.trainer.objectives.judges` for judges).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
import urllib.parse
from dataclasses import dataclass
from pathlib import PurePosixPath

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
    """One entry of ``training.rewards`` that is a function: where it is, and its weight in the total."""

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

    @property
    def where(self) -> str:
        """What it is, in messages and in what checkpoints record."""
        return self.function


@dataclass(frozen=True)
class ModelRewardSpec:
    """A reward model (``{model: DIR}``): a sequence-classification folder of one label that scores each prompt and
    completion as its own chat template renders them (:mod:`astrai.trainer.objectives.model_rewards`)."""

    model: str
    """The folder, as the trainer reads it (in the container: under /models/base or /data)."""
    name: str
    """Its name in metrics (``reward_<name>``): ``name`` as given, else the folder's own name."""
    weight: float = 1.0
    batch_size: int = 16
    """Sequences it scores in one forward pass."""

    @property
    def where(self) -> str:
        return f"model {self.model}"


JUDGE_KINDS = ("openai", "score")
"""A remote judge's protocol: an OpenAI-compatible chat completions endpoint asked with a prompt template, whose reply
holds the score; or a scoring endpoint taking and returning JSON (OpenRLHF's remote reward model's shape)."""
ON_ERROR = ("stop", "none")
"""What a judge's failure after its retries does: stop the run naming it, or leave the completion unscored."""
DEFAULT_JUDGE_PROMPT = (
    "Rate how well the response answers the prompt, from 0 (not at all) to 10 (perfectly). Reply with the number "
    "alone.\n\nPrompt:\n{prompt}\n\nResponse:\n{completion}"
)
"""What an ``openai`` judge is asked by default; ``{prompt}``, ``{completion}`` and ``{<record field>}`` are filled
in."""
DEFAULT_SCORE_PATTERN = r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"
"""Where an ``openai`` judge's score is in its reply by default: the last number in it."""


@dataclass(frozen=True)
class JudgeSpec:
    """A remote judge (``{url: ..., kind: openai | score}``): a server that scores each completion, asked concurrently,
    each request with a timeout and retried with backoff (:mod:`astrai.trainer.objectives.judges`)."""

    url: str
    kind: str
    name: str = "judge"
    weight: float = 1.0
    timeout: float = 30.0
    """Seconds one request may take."""
    retries: int = 3
    """Requests tried again after a failure (a connection refused, a timeout, HTTP 429 or 5xx)."""
    max_in_flight: int = 16
    """Requests waiting for an answer at once, at most."""
    on_error: str = "stop"
    backoff: float = 0.5
    """Seconds before the first retry, doubled for each next one."""
    model: str | None = None
    """``openai``: the model the server is asked for (its served name); None: sent without one."""
    prompt: str = DEFAULT_JUDGE_PROMPT
    """``openai``: the user message, ``{prompt}``, ``{completion}`` and record fields filled in."""
    pattern: str = DEFAULT_SCORE_PATTERN
    """``openai``: a regular expression whose last match in the reply (its first group, when it has one) is the
    score."""
    max_tokens: int = 16
    """``openai``: the reply's length limit."""
    label_field: str | None = None
    """``score``: the record field sent as each completion's label (OpenRLHF's ``labels``); None: none."""
    api_key_env: str | None = None
    """The environment variable holding the server's key, sent as ``Authorization: Bearer``; never written down."""

    @property
    def where(self) -> str:
        return f"judge {self.url}"


AnyRewardSpec = RewardSpec | ModelRewardSpec | JudgeSpec
"""An entry of ``training.rewards``: a function, a reward model or a remote judge."""

_COMMON_KEYS = {"weight", "name"}
_MODEL_KEYS = {"model", "batch_size", *_COMMON_KEYS}
_JUDGE_KEYS = {field.name for field in dataclasses.fields(JudgeSpec)}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_FORMS = (
    "'FILE.py:function', 'module:function', {function, weight}, {model: DIR, weight, name} or {url: URL, kind: openai "
    "| score, weight, timeout, retries, max_in_flight, on_error: stop | none, ...}"
)


def reward_metric_names(name: str) -> tuple[str, str]:
    """The metrics of one reward function: its mean and its standard deviation over the completions scored."""
    mean = METRIC_REWARD_OF.format(name=name)
    return mean, mean + STD_SUFFIX


def parse_rewards(value) -> tuple[AnyRewardSpec, ...]:
    """``training.rewards`` as written in YAML (a list of text, ``{function, weight}``, ``{model: DIR, ...}`` or
    ``{url: URL, ...}``); ValueError says which entry is wrong and what is allowed."""
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"expected a list of reward functions, got {value!r}")
    specs = []
    for index, entry in enumerate(value):
        where = f"entry {index}"
        if isinstance(entry, str):
            entry = {"function": entry}
        if isinstance(entry, dict) and "url" in entry:
            specs.append(_judge(entry, where))
        elif isinstance(entry, dict) and "model" in entry and "function" not in entry:
            specs.append(_model(entry, where))
        else:
            specs.append(_function(entry, where))
    check_metric_names([spec.name for spec in specs])
    return tuple(specs)


def _function(entry, where: str) -> RewardSpec:
    if not isinstance(entry, dict) or set(entry) - {"function", "weight"} or "function" not in entry:
        raise ValueError(f"{where}: expected {_FORMS}, got {entry!r}")
    function = entry["function"]
    head, colon, name = str(function).rpartition(":")
    if not isinstance(function, str) or not colon or not head or not name.isidentifier():
        raise ValueError(f"{where}: function must be 'FILE.py:function' or 'module:function', got {function!r}")
    return RewardSpec(function, _weight(entry, where))


def _weight(entry: dict, where: str) -> float:
    weight = entry.get("weight", 1.0)
    if isinstance(weight, str):  # YAML reads 1e-3 as text, as the other number keys are taken from it
        try:
            weight = float(weight)
        except ValueError:
            pass
    if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
        raise ValueError(f"{where}: weight must be a finite number, got {weight!r}")
    return float(weight)


def _name(entry: dict, where: str, default: str) -> str:
    name = entry.get("name", default)
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{where}: name must be letters, digits and _ (not first a digit), got {name!r}")
    return name


def _model(entry: dict, where: str) -> ModelRewardSpec:
    unknown = sorted(set(entry) - _MODEL_KEYS)
    if unknown:
        raise ValueError(f"{where}: a reward model takes {', '.join(sorted(_MODEL_KEYS))}; {unknown[0]!r} is not one")
    folder = entry["model"]
    if not isinstance(folder, str) or not folder.strip():
        raise ValueError(f"{where}: model must be a sequence-classification folder, got {folder!r}")
    default = re.sub(r"\W", "_", PurePosixPath(folder.rstrip("/")).name) or "model"
    if not _NAME.match(default):
        default = f"rm_{default}"
    batch = _whole(entry, "batch_size", where, 16, 1)
    return ModelRewardSpec(folder, _name(entry, where, default), _weight(entry, where), batch)


def _judge(entry: dict, where: str) -> JudgeSpec:
    unknown = sorted(set(entry) - _JUDGE_KEYS)
    if unknown:
        secret = " (a key comes from the environment: name its variable in api_key_env)" if "key" in unknown[0] else ""
        raise ValueError(f"{where}: a judge takes {', '.join(sorted(_JUDGE_KEYS))}; {unknown[0]!r} is not one{secret}")
    url = entry["url"]
    parsed = urllib.parse.urlsplit(url) if isinstance(url, str) else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"{where}: url must be an http:// or https:// address, got {url!r}")
    if parsed.username is not None or parsed.password is not None:
        raise ValueError(
            f"{where}: url holds credentials; a secret never goes in the YAML: put the key in an environment "
            "variable and name it in api_key_env"
        )
    kind = entry.get("kind")
    if kind not in JUDGE_KINDS:
        raise ValueError(f"{where}: kind must be one of {' | '.join(JUDGE_KINDS)}, got {kind!r}")
    values = {
        "url": url,
        "kind": kind,
        "name": _name(entry, where, "judge"),
        "weight": _weight(entry, where),
        "timeout": _number(entry, "timeout", where, 30.0, low=0.0, open_low=True),
        "retries": _whole(entry, "retries", where, 3, 0),
        "max_in_flight": _whole(entry, "max_in_flight", where, 16, 1),
        "backoff": _number(entry, "backoff", where, 0.5, low=0.0),
        "max_tokens": _whole(entry, "max_tokens", where, 16, 1),
    }
    on_error = entry.get("on_error", "stop")
    if on_error not in ON_ERROR:
        raise ValueError(f"{where}: on_error must be one of {' | '.join(ON_ERROR)}, got {on_error!r}")
    values["on_error"] = on_error
    for key in ("model", "label_field", "api_key_env"):
        text = entry.get(key)
        if text is not None and (not isinstance(text, str) or not text):
            raise ValueError(f"{where}: {key} must be text, got {text!r}")
        values[key] = text
    if values["api_key_env"] is not None and not _ENV_NAME.match(values["api_key_env"]):
        raise ValueError(f"{where}: api_key_env must name an environment variable, got {values['api_key_env']!r}")
    prompt = entry.get("prompt", DEFAULT_JUDGE_PROMPT)
    if not isinstance(prompt, str) or "{completion}" not in prompt:
        raise ValueError(f"{where}: prompt must be text holding {{completion}} (and {{prompt}}), got {prompt!r}")
    values["prompt"] = prompt
    pattern = entry.get("pattern", DEFAULT_SCORE_PATTERN)
    try:
        compiled = re.compile(pattern)
    except (re.error, TypeError) as error:
        raise ValueError(f"{where}: pattern must be a regular expression, got {pattern!r} ({error})") from None
    if compiled.groups > 1:
        raise ValueError(f"{where}: pattern may hold one group (the score), got {compiled.groups}")
    values["pattern"] = pattern
    return JudgeSpec(**values)


def _number(entry: dict, key: str, where: str, default: float, low: float, open_low: bool = False) -> float:
    value = entry.get(key, default)
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
    if not ok or value < low or (open_low and value == low):
        bound = f"> {low:g}" if open_low else f">= {low:g}"
        raise ValueError(f"{where}: {key} must be a number {bound}, got {value!r}")
    return float(value)


def _whole(entry: dict, key: str, where: str, default: int, low: int) -> int:
    value = entry.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{where}: {key} must be an integer >= {low}, got {value!r}")
    return value


def functions_of(specs) -> tuple[RewardSpec, ...]:
    """The entries that are functions (what the image imports)."""
    return tuple(spec for spec in specs if isinstance(spec, RewardSpec))


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
