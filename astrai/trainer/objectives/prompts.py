"""What the reward types train on, held in memory: the prompts of ``online_grpo`` and ``online_dpo`` (``prepare
--kind prompts``) with their fields, and ``grpo``'s prompts with completions scored elsewhere (``prepare --kind
grpo``). The loader hands out prompt numbers; the rollout sources (:mod:`astrai.trainer.objectives.rollouts`) look
the tokens, texts and fields up here.
"""

from __future__ import annotations

import torch

from astrai.common.data_folder import DataError, PromptUnits, TokenData, WindowSplit


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
        self.messages = [records[number].get("messages") for number in units.records]
        """Each prompt's chat messages, None for a text prompt (a reward model renders them with its own template)."""
        self.names = sorted({name for fields in self.fields for name in fields})

    def messages_of(self, numbers: list[int], generations: int) -> list[list[dict] | None]:
        """Each completion's prompt as chat messages (None for a text prompt)."""
        return [self.messages[number] for number in numbers for _ in range(generations)]

    def fields_of(self, numbers: list[int], generations: int) -> dict[str, list]:
        """The reward functions' keyword arguments: each field, per completion (None where a record lacks it)."""
        return {
            name: [self.fields[number].get(name) for number in numbers for _ in range(generations)]
            for name in self.names
        }


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
