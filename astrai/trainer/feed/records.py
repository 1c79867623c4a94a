"""Post-training data on the trainer's side: SFT sequences packed into windows, and DPO pairs.

A post-training data folder (``prepare --kind sft|dpo``) holds whole sequences, each with a mask of
the tokens the loss covers (astrai/common/data_folder.py). For SFT they are packed, in file order,
into windows of ``window_size`` predictions: a sequence of L tokens takes L - 1 of them, and inside a
window attention is confined to each sequence and positions restart at each one, so a sequence
packed among others is computed exactly as alone. DPO keeps each pair (chosen, rejected) in two rows
of its own, padded. A sequence longer than the window is cut to it (``data.overlong: truncate``) or
left out (``drop``); the trainer says how many at start.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils.data import Dataset

from astrai.common.data_folder import Packing, Pairs, TokenData, WindowSplit
from astrai.trainer.feed.windows import map_token_shards


class SFTWindow(NamedTuple):
    """One packed SFT window, or (collated) a batch of them: each field ``window`` entries per row."""

    inputs: torch.Tensor
    targets: torch.Tensor
    weights: torch.Tensor
    """1.0 where the target is a supervised token, else 0.0."""
    positions: torch.Tensor
    """Each token's position inside its own sequence (restarting at every sequence)."""
    segments: torch.Tensor
    """Which sequence of the window each token belongs to; attention stays inside a segment."""

    def to(self, device: torch.device) -> SFTWindow:
        return SFTWindow(*(part.to(device, non_blocking=True) for part in self))


class DPOPair(NamedTuple):
    """One DPO pair, or (collated) a batch of them: rows (2, window) per pair, row 0 chosen, row 1 rejected."""

    inputs: torch.Tensor
    targets: torch.Tensor
    weights: torch.Tensor
    """1.0 where the target is a token of the answer, else 0.0."""
    number: int | torch.Tensor
    """The pair's number: its row in a precomputed reference table."""

    def to(self, device: torch.device) -> DPOPair:
        moved = (part.to(device, non_blocking=True) if isinstance(part, torch.Tensor) else part for part in self)
        return DPOPair(*moved)


class RecordIndex:
    """Every sequence of a post-training data folder: its shard, where it starts there, and its length."""

    def __init__(self, data: TokenData):
        self.data = data
        self.shard: list[int] = []
        self.start: list[int] = []
        self.length: list[int] = []
        for index in range(len(data.shard_files)):
            position = 0
            for length in data.sequence_lengths(index):
                self.shard.append(index)
                self.start.append(position)
                self.length.append(length)
                position += length
        self._tokens: list[torch.Tensor] | None = None
        self._masks: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self.length)

    def sequence(self, index: int, take: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids, mask) of sequence ``index``, its first ``take`` tokens (all by default)."""
        if self._tokens is None:
            self._tokens = map_token_shards(self.data)
            self._masks = [
                torch.from_file(str(self.data.mask_file(i)), shared=False, size=count, dtype=torch.uint8)
                for i, count in enumerate(self.data.shard_tokens)
            ]
        shard, start = self.shard[index], self.start[index]
        end = start + (self.length[index] if take is None else take)
        return self._tokens[shard][start:end].to(torch.int64), self._masks[shard][start:end]


class _Units(Dataset):
    """Training units of a post-training folder; ``item(n)`` is unit n, training or held out (the split's)."""

    def __init__(self, index: RecordIndex, window: int, split: WindowSplit):
        self.index, self.window_size, self.split = index, window, split

    def __len__(self) -> int:
        return self.split.num_train

    def __getitem__(self, item: int):
        return self.item(self.split.train_window(item))

    def item(self, number: int):
        raise NotImplementedError


class PackedSFT(_Units):
    """Training window i as an :class:`SFTWindow`.

    ``weights`` is 1 where the target is a supervised token; padding (after the last sequence) is its own
    segment per position, attends only to itself and has weight 0.
    """

    def __init__(self, index: RecordIndex, packing: Packing, window: int, split: WindowSplit):
        super().__init__(index, window, split)
        self.packing = packing

    def item(self, number: int) -> SFTWindow:
        """Window ``number`` of the packing (training or held out)."""
        size = self.window_size
        inputs = torch.zeros(size, dtype=torch.int64)
        targets = torch.zeros(size, dtype=torch.int64)
        weights = torch.zeros(size, dtype=torch.float32)
        positions = torch.zeros(size, dtype=torch.int64)
        segments = torch.arange(size, dtype=torch.int64) + size  # padding: a segment per position
        at = 0
        for segment, (sequence, take) in enumerate(self.packing.windows[number]):
            ids, mask = self.index.sequence(sequence, take)
            count = take - 1
            inputs[at : at + count] = ids[:-1]
            targets[at : at + count] = ids[1:]
            weights[at : at + count] = mask[1:].to(torch.float32)
            positions[at : at + count] = torch.arange(count)
            segments[at : at + count] = segment
            at += count
        return SFTWindow(inputs, targets, weights, positions, segments)


class DPOPairs(_Units):
    """Training pair i as a :class:`DPOPair`."""

    def __init__(self, index: RecordIndex, pairs: Pairs, window: int, split: WindowSplit):
        super().__init__(index, window, split)
        self.pairs = pairs

    def item(self, number: int) -> DPOPair:
        size = self.window_size
        inputs = torch.zeros(2, size, dtype=torch.int64)
        targets = torch.zeros(2, size, dtype=torch.int64)
        weights = torch.zeros(2, size, dtype=torch.float32)
        chosen, rejected, take = self.pairs.pairs[number]
        for row, sequence in enumerate((chosen, rejected)):
            ids, mask = self.index.sequence(sequence, min(take, self.index.length[sequence]))
            count = len(ids) - 1
            inputs[row, :count] = ids[:-1]
            targets[row, :count] = ids[1:]
            weights[row, :count] = mask[1:].to(torch.float32)
        return DPOPair(inputs, targets, weights, number)
