"""Reward functions that ship with the trainer, for ``training.rewards`` (``astrai.rewards:exact_answer``).

Each has TRL's shape, ``fn(prompts, completions, **fields) -> list[float | None]``, and needs neither torch
nor anything else: write your own the same way in a ``.py`` file (see :mod:`astrai.trainer.rewards`).

- :func:`exact_answer` — 1.0 when the completion's final answer (:func:`final_answer`) equals the record's
  ``answer`` field after normalisation, else 0.0.
- :func:`think_format` — 1.0 when the completion is ``<think>...</think>`` then ``<answer>...</answer>``
  (DeepSeek-R1's format), else 0.0.
- :func:`length_target` — 1.0 at the record's ``target_length`` (characters), falling linearly to 0.0 at
  twice or none of it.
"""

from __future__ import annotations

import re

__all__ = ["exact_answer", "final_answer", "length_target", "normalise", "think_format"]

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_THINK_FORMAT = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)


def final_answer(text: str) -> str | None:
    """The answer a completion ends on: its last ``\\boxed{...}``, else its last ``<answer>...</answer>``, else
    what follows its last ``####``, else its last number, else all of it; None for an empty one."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    tagged = _ANSWER_TAG.findall(text)
    if tagged:
        return tagged[-1]
    if "####" in text:
        return text.rpartition("####")[2]
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


def normalise(answer) -> str:
    """An answer as compared: trimmed, lower case, spaces collapsed, without surrounding ``$`` or a final full stop,
    and a number written plainly (``1,000.50`` -> ``1000.5``)."""
    text = " ".join(str(answer).lower().split()).rstrip(".").strip().strip("$").strip()
    plain = text.replace(",", "")
    if _NUMBER.fullmatch(plain):
        number = float(plain)
        return str(int(number)) if number.is_integer() else repr(number)
    return text


def exact_answer(prompts, completions, answer, **fields) -> list[float | None]:
    """1.0 where the completion's final answer equals ``answer`` after :func:`normalise`; None where a record has
    no answer."""
    scores = []
    for completion, expected in zip(completions, answer, strict=True):
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
