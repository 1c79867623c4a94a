"""Reward functions that ship with the trainer, named ``astrai.rewards:exact_answer`` and so on (see
:mod:`astrai.trainer.objectives.rewards`; ``training.rewards`` names them for ``online_grpo``).

Each has TRL's shape, ``fn(prompts, completions, **fields) -> list[float | None]``, and needs neither torch
nor anything else: write your own the same way in a ``.py`` file (see :mod:`astrai.trainer.objectives.rewards`).

- :func:`exact_answer` — 1.0 when the completion's final answer (:func:`final_answer`) equals the record's
  ``answer`` field after normalisation (numbers by exact value, a unit or % after them left out), else 0.0.
- :func:`think_format` — 1.0 when the completion is ``<think>...</think>`` then ``<answer>...</answer>``
  (DeepSeek-R1's format), else 0.0.
- :func:`length_target` — 1.0 at the record's ``target_length`` (characters), falling linearly to 0.0 at
  twice or none of it.
"""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["exact_answer", "final_answer", "length_target", "normalise", "think_format", "value_of"]

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# A number as written: thousands grouped by commas (1,000), decimals, a fraction (1/2); a sign, ASCII or Unicode.
_NUMBER = re.compile(r"[-\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|[-\u2212]?\.\d+")
# A number, and after it at most a unit or a percent sign ("5 cm", "50%").
_QUANTITY = re.compile(r"(?P<number>" + _NUMBER.pattern + r")\s*(?:%|[^\W\d_]+\.?)?")
_THINK_FORMAT = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)


def final_answer(text: str) -> str | None:
    """The answer a completion ends on: its last ``\\boxed{...}``, else its last ``<answer>...</answer>``, else
    the rest of the line after its last ``####``, else its last number, else all of it; None for an empty one."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    tagged = _ANSWER_TAG.findall(text)
    if tagged:
        return tagged[-1]
    if "####" in text:
        return text.rpartition("####")[2].lstrip().partition("\n")[0]
    numbers = _NUMBER.findall(text)
    if numbers:
        return numbers[-1]
    return text.strip() or None


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            if depth == 0:
                return text[begin:index]
            depth -= 1
    return None


def value_of(answer) -> Fraction | None:
    """The exact value of an answer that is a number, with at most a unit or % after it (``1,000.50``, ``1/2``,
    ``5 cm``, ``50%``); None for any other answer."""
    text = " ".join(str(answer).replace("\u2212", "-").split()).rstrip(".").strip().strip("$").strip()
    match = _QUANTITY.fullmatch(text)
    if match is None:
        return None
    try:
        return Fraction(match["number"].replace(",", "").replace("\u2212", "-"))
    except (ValueError, ZeroDivisionError):
        return None


def normalise(answer) -> str:
    """An answer as compared: a number by its exact value (``1,000.50`` and ``2001/2`` alike, a unit or % after it
    left out), anything else trimmed, in lower case, spaces collapsed, without surrounding ``$`` or a final full
    stop."""
    value = value_of(answer)
    if value is not None:
        return str(value)
    return " ".join(str(answer).lower().split()).rstrip(".").strip().strip("$").strip()


def exact_answer(prompts, completions, answer=None, **fields) -> list[float | None]:
    """1.0 where the completion's final answer equals ``answer`` after :func:`normalise`; None where a record has
    no answer (and for all of them when no record has an ``answer`` field)."""
    scores = []
    for completion, expected in zip(completions, answer or [None] * len(completions), strict=True):
        if expected is None:
            scores.append(None)
            continue
        found = final_answer(completion)
        scores.append(1.0 if found is not None and normalise(found) == normalise(expected) else 0.0)
    return scores


def think_format(prompts, completions, **fields) -> list[float]:
    """1.0 where the completion is its reasoning in ``<think>`` tags, then its answer in ``<answer>`` tags."""
    return [1.0 if _THINK_FORMAT.fullmatch(completion) else 0.0 for completion in completions]


def length_target(prompts, completions, target_length=None, **fields) -> list[float | None]:
    """1.0 at ``target_length`` characters, less by the share of the target the completion is off by (0.0 from
    twice the target, or for an empty one); None where a record has no target."""
    targets = target_length if target_length is not None else [None] * len(completions)
    scores = []
    for completion, target in zip(completions, targets, strict=True):
        if target is None or target <= 0:
            scores.append(None)
            continue
        scores.append(max(0.0, 1.0 - abs(len(completion) - target) / target))
    return scores
