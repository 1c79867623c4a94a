"""The trainer's view of token data: windows read from memory-mapped shards, and deterministic sampling.

The order of windows in an epoch is a permutation drawn from ``(random_seed, epoch)``
only, so the data position of a run is two integers: the epoch, and how many
windows of it were consumed. The folder itself is read by
:mod:`astrai.common.data_folder`.
"""

from __future__ import annotations

import bisect
import signal

import torch
from torch.utils.data import Dataset, Sampler

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
        return self.window(self.split.train_window(index))

    def window(self, index: int) -> torch.Tensor:
        """Corpus window ``index``, training or held out."""
        if self._shards is None:
            # shared=False maps the file copy-on-write: read-only files work and pages load on demand.
            dtype = torch.uint16 if self.data.dtype == "uint16" else torch.uint32
            self._shards = [
                torch.from_file(str(path), shared=False, size=count, dtype=dtype)
                for path, count in zip(self.data.shard_files, self.data.shard_tokens, strict=True)
            ]
        shard = bisect.bisect_right(self.first_window, index) - 1
        start = (index - self.first_window[shard]) * self.window_size
        return self._shards[shard][start : start + self.window_size + 1].to(torch.int64)


def epoch_permutation(num_windows: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of windows in ``epoch``: a function of (seed, epoch) alone."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_windows, generator=generator)


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
        self.num_windows = num_windows
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.global_batch = batch_size * grad_accum_steps * world_size
        self.epoch = 0
        self.start = 0

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
