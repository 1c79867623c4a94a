"""The optimizer and the learning-rate schedule, built from the config; on resume the config stays in charge.

A checkpoint restores the optimizer's *state* (AdamW's moments and step counts), never its
settings: the learning rate of every step is a function of that step and the current
``training`` section, and weight decay, betas and eps are the config's. So a run that
diverged resumes with a lowered ``max_lr`` from its first step on, and a run extended
with a larger ``max_steps`` follows the new schedule, which the trainer announces at start.

Schedules (``training.schedule``), each after a linear warmup of ``warmup_ratio * max_steps``:

- ``cosine``: cosine decay to ``max_lr * min_lr_ratio`` at ``max_steps``;
- ``wsd`` (warmup-stable-decay): flat at ``max_lr``, then a linear decay over the last
  ``decay_ratio`` of the steps to ``max_lr * min_lr_ratio``; extending a run before its decay
  began only lengthens the plateau;
- ``constant``: flat at ``max_lr`` to the end; extending changes nothing.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from astrai.common.config import TrainingSection


@dataclass(frozen=True)
class Schedule:
    """The learning rate as a function of the optimizer step: what ``scheduler.pt`` records."""

    name: str
    max_lr: float
    min_lr_ratio: float
    warmup_steps: int
    max_steps: int
    decay_steps: int

    @classmethod
    def of(cls, training: TrainingSection) -> Schedule:
        decay = round(training.decay_ratio * training.max_steps) if training.schedule == "wsd" else 0
        return cls(
            training.schedule,
            training.max_lr,
            training.min_lr_ratio,
            int(training.warmup_ratio * training.max_steps),
            training.max_steps,
            decay,
        )

    def multiplier(self, step: int) -> float:
        """The fraction of max_lr used by the optimizer step taken after ``step`` completed steps."""
        if step < self.warmup_steps:
            return (step + 1) / (self.warmup_steps + 1)
        floor = self.min_lr_ratio
        if self.name == "constant":
            return 1.0
        if self.name == "wsd":
            decay_start = self.max_steps - self.decay_steps
            if step < decay_start or self.decay_steps == 0:
                return 1.0
            return 1.0 - (1.0 - floor) * min((step - decay_start) / self.decay_steps, 1.0)
        progress = min((step - self.warmup_steps) / max(self.max_steps - self.warmup_steps, 1), 1.0)
        return floor + 0.5 * (1.0 - floor) * (1.0 + math.cos(math.pi * progress))

    def lr(self, step: int) -> float:
        return self.max_lr * self.multiplier(step)

    def state_dict(self, step: int) -> dict:
        """Plain values for ``scheduler.pt``: the schedule's settings and the step it was saved at."""
        return {**asdict(self), "step": step}

    @classmethod
    def from_state(cls, state: dict) -> Schedule | None:
        """The schedule a checkpoint was trained with; None for a state this version cannot read."""
        try:
            return cls(
                str(state["name"]),
                float(state["max_lr"]),
                float(state["min_lr_ratio"]),
                int(state["warmup_steps"]),
                int(state["max_steps"]),
                int(state["decay_steps"]),
            )
        except (KeyError, TypeError, ValueError):
            return None


# The optimizer settings a resume takes from the config; the checkpoint's are only compared with them.
_GROUP_SETTINGS = ("weight_decay", "betas", "eps")


def build_optimizer(model: torch.nn.Module, training: TrainingSection, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the trainable parameters: matrices and embeddings decay, norm weights (1-D) do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2]}, {"params": [p for p in params if p.dim() < 2]}]
    optimizer = torch.optim.AdamW(groups, lr=training.max_lr, fused=device.type == "cuda")
    apply_settings(optimizer, training)
    return optimizer


def apply_settings(optimizer: torch.optim.Optimizer, training: TrainingSection) -> None:
    """Give every parameter group the config's settings (after a checkpoint's state was loaded, too)."""
    decays = (training.weight_decay, 0.0)
    for group, decay in zip(optimizer.param_groups, decays, strict=True):
        group.update(weight_decay=decay, betas=(training.adam_beta1, training.adam_beta2), eps=training.adam_eps)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def describe_changes(
    saved_schedule: dict, saved_groups: list[dict], schedule: Schedule, training: TrainingSection, step: int
) -> str | None:
    """What a resume at ``step`` changes against the checkpoint's settings, as one line; None if nothing.

    ``saved_groups`` are the checkpoint optimizer's parameter groups (their settings only).
    """
    changes = []
    old = Schedule.from_state(saved_schedule)
    if old is not None:
        for key in ("name", "max_lr", "min_lr_ratio", "warmup_steps", "max_steps", "decay_steps"):
            before, after = getattr(old, key), getattr(schedule, key)
            if before != after:
                changes.append(f"{'schedule' if key == 'name' else key} {_show(before)} → {_show(after)}")
    if saved_groups:
        first = saved_groups[0]
        current = {"weight_decay": training.weight_decay, "betas": (training.adam_beta1, training.adam_beta2)}
        current["eps"] = training.adam_eps
        for key in _GROUP_SETTINGS:
            before = tuple(first[key]) if key == "betas" and key in first else first.get(key)
            if before is not None and before != current[key]:
                changes.append(f"{key} {_show(before)} → {_show(current[key])}")
    if not changes:
        return None
    if old is None:
        lr = f"the learning rate now follows this run's {schedule.name} schedule (max_lr {schedule.max_lr:.1e})"
    else:
        lr = f"the learning rate of step {step + 1} goes from {old.lr(step):.1e} (as saved) to {schedule.lr(step):.1e}"
    return f"resuming with changed settings: {', '.join(changes)}; {lr}"


def _show(value) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return "(" + ", ".join(_show(item) for item in value) + ")"
    return str(value)
