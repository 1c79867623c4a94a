"""The trainer's view of token data: windows read from memory-mapped shards, and deterministic sampling.

The order of windows in an epoch is a permutation drawn from ``(random_seed, epoch)``
only, so the data position of a run is two integers: the epoch, and how many
windows of it were consumed. The folder itself is read by
:mod:`astrai.common.data_folder`.
"""

from __future__ import annotations

import bisect
import signal
import sys

import torch
from torch.utils.data import Dataset, Sampler

from astrai.common.config import MAX_MIXTURE_RATIO
from astrai.common.data_folder import TokenData, WindowSplit


class WindowDataset(Dataset):
    """Training window ``i`` as an int64 tensor of ``window_size + 1`` tokens (all windows without a split)."""

    def __init__(self, data: TokenData, window_size: int, split: WindowSplit | None = None):
        self.data = data
        self.window_size = window_size
        counts = [max(count - 1, 0) // window_size for count in data.shard_tokens]
        self.first_window = [sum(counts[:i]) for i in range(len(counts))]
        self.split = split or WindowSplit(sum(counts))
        # Mapped on first use in each process: DataLoader workers then map the files themselves.
        self._shards: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return self.split.num_train

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.item(self.split.train_window(index))

    def item(self, index: int) -> torch.Tensor:
        """Corpus window ``index``, training or held out."""
        if self._shards is None:
            self._shards = map_token_shards(self.data)
        shard = bisect.bisect_right(self.first_window, index) - 1
        start = (index - self.first_window[shard]) * self.window_size
        return self._shards[shard][start : start + self.window_size + 1].to(torch.int64)


def map_token_shards(data: TokenData) -> list[torch.Tensor]:
    """Every token shard of a data folder, mapped copy-on-write in its width (read-only files work; pages load on
    demand). Each process maps them on first use."""
    dtype = getattr(torch, data.dtype)  # uint16 or uint32: data_folder.token_dtype
    return [
        torch.from_file(str(path), shared=False, size=count, dtype=dtype)
        for path, count in zip(data.shard_files, data.shard_tokens, strict=True)
    ]


def epoch_permutation(num_windows: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of windows in ``epoch``: a function of (seed, epoch) alone."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_windows, generator=generator)


def _take_share(sampler, batch_size: int, grad_accum_steps: int, rank: int, world_size: int) -> None:
    """A rank's share of every step: micro-batches of ``batch_size``, from position 0 until set_position."""
    sampler.batch_size, sampler.rank, sampler.world_size = batch_size, rank, world_size
    sampler.global_batch = batch_size * grad_accum_steps * world_size
    sampler.start = 0


class WindowBatchSampler(Sampler[list[int]]):
    """Micro-batches of window indices for one rank, from a data position onwards.

    One optimizer step consumes ``global_batch = batch_size * grad_accum_steps * world_size``
    windows of the epoch's permutation. Rank ``r`` takes every ``world_size``-th
    of them starting at ``r``, so ranks never overlap, and after ``k`` steps from
    position ``p`` exactly ``perm[p : p + k * global_batch]`` has been used —
    whatever the world size, which keeps the position meaningful across restarts.
    Windows that do not fill a whole step at the end of an epoch are skipped.
    """

    def __init__(self, num_windows: int, batch_size: int, grad_accum_steps: int, rank: int, world_size: int, seed: int):
        _take_share(self, batch_size, grad_accum_steps, rank, world_size)
        self.num_windows = num_windows
        self.seed = seed
        self.epoch = 0

    def set_position(self, epoch: int, samples_in_epoch: int) -> None:
        """Start the next iteration at this position (``samples_in_epoch`` windows of ``epoch`` already used)."""
        self.epoch = epoch
        self.start = samples_in_epoch

    def steps_left(self) -> int:
        """Full optimizer steps left in the epoch from the current position."""
        return max(self.num_windows - self.start, 0) // self.global_batch

    def __len__(self) -> int:
        return self.steps_left() * self.global_batch // (self.batch_size * self.world_size)

    def __iter__(self):
        order = epoch_permutation(self.num_windows, self.seed, self.epoch)
        end = self.start + self.steps_left() * self.global_batch
        mine = order[self.start + self.rank : end : self.world_size].tolist()
        for i in range(0, len(mine), self.batch_size):
            yield mine[i : i + self.batch_size]


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: the main process handles SIGTERM/SIGINT and stops its workers itself."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


# --- Weighted mixtures -------------------------------------------------------------------------------------------

MIXTURE_BLOCK = MAX_MIXTURE_RATIO
"""Samples of the mixture's stream per block: every block holds each source's share of it, in a shuffled order."""


def block_quotas(weights: list[float], block: int = MIXTURE_BLOCK) -> list[int]:
    """How many samples of each block each source gets: its weight's share, by largest remainder, at least 1."""
    total = sum(weights)
    exact = [block * weight / total for weight in weights]
    quotas = [max(1, int(share)) for share in exact]
    order = sorted(range(len(weights)), key=lambda s: (-(exact[s] - int(exact[s])), s))
    index = 0
    while sum(quotas) < block:
        quotas[order[index % len(order)]] += 1
        index += 1
    while sum(quotas) > block:
        heaviest = max(range(len(quotas)), key=lambda s: (quotas[s] - exact[s], quotas[s]))
        quotas[heaviest] -= 1
    return quotas


class MixtureOrder:
    """Which source and which of its windows the k-th sample of a run's stream is: a function of (seed, k) alone.

    The stream is cut in blocks of MIXTURE_BLOCK samples; each block holds every source's quota, shuffled by a
    permutation drawn from (seed, block). Source s's j-th sample is window ``perm[j % n]`` of its epoch
    ``j // n`` (n its training windows), the permutation drawn from (seed, s, epoch), so a source smaller than
    its share is repeated, each pass in a new order. Nothing depends on the world size or on what came
    before: a resume at sample k continues the same stream.
    """

    def __init__(self, windows: list[int], weights: list[float], seed: int):
        self.windows = windows
        self.seed = seed
        self.quotas = block_quotas(weights)
        self._blocks: dict[int, tuple[list[int], list[int]]] = {}
        self._epochs: dict[int, tuple[int, list[int]]] = {}

    def sample(self, k: int) -> tuple[int, int]:
        """(source, training window) of sample ``k``."""
        block, offset = divmod(k, MIXTURE_BLOCK)
        sources, ranks = self._block(block)
        source = sources[offset]
        drawn = block * self.quotas[source] + ranks[offset]
        epoch, position = divmod(drawn, self.windows[source])
        return source, self._epoch(source, epoch)[position]

    def drawn(self, k: int) -> list[int]:
        """How many of the first ``k`` samples came from each source."""
        block, offset = divmod(k, MIXTURE_BLOCK)
        counts = [block * quota for quota in self.quotas]
        if offset:
            for source in self._block(block)[0][:offset]:
                counts[source] += 1
        return counts

    def _block(self, block: int) -> tuple[list[int], list[int]]:
        cached = self._blocks.get(block)
        if cached is None:
            multiset = torch.repeat_interleave(torch.arange(len(self.quotas)), torch.tensor(self.quotas))
            generator = torch.Generator().manual_seed((self.seed * 1_000_003 + block) * 2 + 1)
            sources = multiset[torch.randperm(MIXTURE_BLOCK, generator=generator)].tolist()
            seen = [0] * len(self.quotas)
            ranks = []
            for source in sources:
                ranks.append(seen[source])
                seen[source] += 1
            if len(self._blocks) > 2:
                self._blocks.clear()
            cached = self._blocks[block] = (sources, ranks)
        return cached

    def _epoch(self, source: int, epoch: int) -> list[int]:
        cached = self._epochs.get(source)
        if cached is None or cached[0] != epoch:
            order = epoch_permutation(self.windows[source], self.seed * 7_919 + source + 1, epoch).tolist()
            cached = self._epochs[source] = (epoch, order)
        return cached[1]


class MixtureDataset(Dataset):
    """Windows of several data folders behind one index: training window w of source s is ``offset[s] + w``."""

    def __init__(self, datas: list[TokenData], window_size: int, splits: list[WindowSplit]):
        self.parts = [WindowDataset(data, window_size, split) for data, split in zip(datas, splits, strict=True)]
        self.train_offsets = _offsets([part.split.num_train for part in self.parts])
        self.corpus_offsets = _offsets([part.split.num_windows for part in self.parts])

    def __len__(self) -> int:
        return self.train_offsets[-1] + len(self.parts[-1])

    def __getitem__(self, index: int) -> torch.Tensor:
        source = bisect.bisect_right(self.train_offsets, index) - 1
        return self.parts[source][index - self.train_offsets[source]]

    def item(self, index: int) -> torch.Tensor:
        """Corpus window ``index`` of the concatenated sources (held-out ones included)."""
        source = bisect.bisect_right(self.corpus_offsets, index) - 1
        return self.parts[source].item(index - self.corpus_offsets[source])


def _offsets(counts: list[int]) -> list[int]:
    offsets, total = [], 0
    for count in counts:
        offsets.append(total)
        total += count
    return offsets


class MixtureBatchSampler(Sampler[list[int]]):
    """Micro-batches of one rank from a mixture's stream, as WindowBatchSampler takes them from an epoch.

    The stream never ends (its sources repeat), so the run has one epoch; the data position is the number of
    samples of the stream already trained on.
    """

    def __init__(
        self,
        order: MixtureOrder,
        offsets: list[int],
        batch_size: int,
        grad_accum_steps: int,
        rank: int,
        world_size: int,
    ):
        _take_share(self, batch_size, grad_accum_steps, rank, world_size)
        self.order = order
        self.offsets = offsets
        self.num_windows = sys.maxsize
        """Never exhausted: the trainer's epoch never ends."""

    def set_position(self, epoch: int, samples_in_epoch: int) -> None:
        self.start = samples_in_epoch

    def __len__(self) -> int:
        return sys.maxsize

    def __iter__(self):
        position = self.start + self.rank
        while True:
            batch = []
            for _ in range(self.batch_size):
                source, window = self.order.sample(position)
                batch.append(self.offsets[source] + window)
                position += self.world_size
            yield batch
