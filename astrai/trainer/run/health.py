"""The divergence record: every step's loss and gradient norm, kept on the device and checked without stalling.

Reading a loss back from a GPU makes the host wait for the device, so the loop
never does it per step. Each step leaves its summed micro-batch losses and its
gradient norm in a small on-device table; the table is read only where the loop
waits for the device anyway (progress reports and checkpoint saves), in the same
all-reduce as the reported loss. A non-finite value found there ends the run
with the step it happened at and the last finite loss; no save happens after it.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist

from astrai.common.errors import AstraiError
from astrai.trainer.launch.distributed import DistEnv


class Diverged(AstraiError):
    """The loss, the gradient norm or the weights turned non-finite; the message says when and what to do."""


class DivergenceRecord:
    """Losses and gradient norms of the steps since the last check, on the device (``capacity`` rows at most)."""

    def __init__(self, capacity: int, env: DistEnv, grad_accum: int, job_dir: Path, step: int):
        self.env = env
        self.grad_accum = grad_accum
        self.job_dir = Path(job_dir)
        self._rows = torch.zeros((capacity, 2), device=env.device)
        self._checked_step = step
        self._last_finite: tuple[int, float] | None = None

    def record(self, step: int, loss_sum: torch.Tensor, grad_norm: torch.Tensor | None) -> None:
        """Keep the summed micro-batch losses and the gradient norm of the step taken after ``step`` steps."""
        row = self._rows[step - self._checked_step]
        row[0].copy_(loss_sum)
        if grad_norm is not None:
            row[1].copy_(grad_norm)

    def check(self, step: int, loss: torch.Tensor | None = None) -> float | None:
        """Raise Diverged when a step up to ``step`` was not finite; return ``loss`` averaged over the ranks.

        ``loss`` (a report's) travels in the same all-reduce as the record: one small copy at a point where
        the loop waits for the device anyway.
        """
        count = step - self._checked_step
        if count == 0 and loss is None:
            return None
        head = loss.view(1) if loss is not None else self._rows.new_zeros(1)
        packed = torch.cat([head, self._rows[:count].view(-1)])
        if self.env.distributed:
            dist.all_reduce(packed)
            packed /= self.env.world_size
        values = packed.tolist()
        first = self._checked_step + 1
        self._checked_step = step
        for offset in range(count):
            at, loss_sum, grad_norm = first + offset, values[1 + 2 * offset], values[2 + 2 * offset]
            step_loss = loss_sum / self.grad_accum
            if math.isfinite(step_loss) and math.isfinite(grad_norm):
                self._last_finite = (at, step_loss)
                continue
            what = f"the loss is {step_loss}" if not math.isfinite(step_loss) else f"the gradient norm is {grad_norm}"
            raise Diverged(self.message(f"{what} at step {at}"))
        return values[0]

    def message(self, what: str) -> str:
        """The divergence message: what went wrong, the last finite loss, and how to resume."""
        last = (
            f"last finite loss {self._last_finite[1]:.4f} at step {self._last_finite[0]}"
            if self._last_finite
            else "no finite loss seen in this run"
        )
        return (
            f"training diverged: {what} ({last}). Nothing of this state was saved: every checkpoint in "
            f"{self.job_dir} is from before it. Lower training.max_lr or set training.max_grad_norm, then start "
            "again: the run resumes from there with the new settings."
        )
