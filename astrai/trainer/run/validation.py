"""Validation: the mean loss over a fixed set of held-out windows, shared by the ranks.

The windows are chosen by :class:`astrai.common.data_folder.WindowSplit` (the last window
of every round(1/val_fraction), never trained on), at most ``log.eval_max_windows`` of
them, evenly spread and the same every time, so the result is identical before and
after a resume.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from astrai.trainer.launch.distributed import DistEnv


@dataclass(eq=False)
class Validator:
    """Evaluates a model on the fixed held-out windows; every rank gets the same result.

    ``dataset.item(n)`` is held-out unit n (a window, a packed SFT window, a DPO pair) and
    ``objective.eval_sums`` its summed loss and count, so the mean is over tokens (seq, sft) or pairs (dpo).
    """

    dataset: object
    objective: object
    windows: list[int]
    batch_size: int
    env: DistEnv
    autocast: contextlib.AbstractContextManager
    interval: int
    last_seconds: float = 0.0
    """How long the last validation took (the ETA counts the ones still to come)."""

    @property
    def enabled(self) -> bool:
        return bool(self.windows)

    def due(self, step: int) -> bool:
        return self.enabled and step % self.interval == 0

    def left(self, step: int, max_steps: int) -> int:
        """Validations still to come after ``step``."""
        return max_steps // self.interval - step // self.interval if self.enabled else 0

    def run(self, model: torch.nn.Module) -> tuple[float, dict[str, float]]:
        """Mean held-out loss, and the objective's other validation metrics (the model is put back in training
        mode)."""
        windows, ranks = self.windows, self.env.world_size
        mine = windows[self.env.rank :: ranks]
        batches = math.ceil(math.ceil(len(windows) / ranks) / self.batch_size)
        totals = None
        model.eval()
        with torch.no_grad():
            for index in range(batches):
                chunk = mine[index * self.batch_size : (index + 1) * self.batch_size]
                # Every rank runs the same number of forward passes (FSDP gathers weights in each one);
                # a rank out of windows computes one stand-in window and does not count it.
                batch = default_collate([self.dataset.item(w) for w in chunk or windows[:1]])
                with self.autocast:
                    sums = self.objective.eval_sums(model, batch)
                if totals is None:
                    totals = torch.zeros_like(sums)
                if chunk:
                    totals += sums
        model.train()
        if self.env.distributed:
            dist.all_reduce(totals)
        loss = (totals[0] / totals[1].clamp(min=1)).item()
        return loss, self.objective.eval_metrics(totals.tolist())
