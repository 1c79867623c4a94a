"""The optimizer and the learning-rate schedule, built from the config; on resume the config stays in charge.

A checkpoint restores the optimizer's *state* (AdamW's moments and step counts), never its
settings: the learning rate of every step is a function of that step and the current
``training`` section, and weight decay, betas and eps are the config's. So a run that
diverged resumes with a lowered ``max_lr`` from its first step on, and a run extended
with a larger ``max_steps`` follows the new schedule, which the trainer announces at start.

Schedules (``training.schedule``), each after a linear warmup of ``warmup_ratio * max_steps``:

- ``cosine``: cosine decay to ``max_lr * min_lr_ratio``, which the last step (the ``max_steps``-th) runs at;
- ``wsd`` (warmup-stable-decay): flat at ``max_lr``, then a linear decay over the last
  ``decay_ratio`` of the steps to ``max_lr * min_lr_ratio``, which the last step runs at; extending a
  run before its decay began only lengthens the plateau;
- ``constant``: flat at ``max_lr`` to the end; extending changes nothing.

Optimizers (``training.optimizer``):

- ``adamw``: AdamW over every parameter; matrices and embeddings decay, 1-D weights (norms, biases) do not.
- ``muon``: torch's Muon for the 2-D weight matrices of the transformer blocks (attention and MLP
  projections), AdamW for the rest (embeddings, the output head, norms, biases). Muon's learning rate
  is scaled per matrix to match AdamW's update size (``adjust_lr_fn="match_rms_adamw"``), so one
  ``max_lr`` and one schedule serve both. Muon orthogonalises each whole matrix, so it cannot run
  where a process holds only a shard of it (FSDP): that is refused with the reason.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from astrai.common.config import TrainingSection
from astrai.common.errors import AstraiError


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
            # The decay's steps are the last decay_steps ones: the last of them, step max_steps - 1, is at the floor.
            return 1.0 - (1.0 - floor) * min((step - decay_start + 1) / self.decay_steps, 1.0)
        # The last optimizer step (after max_steps - 1 completed ones) runs at the floor, as the docs say.
        progress = min((step - self.warmup_steps) / max(self.max_steps - 1 - self.warmup_steps, 1), 1.0)
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
MUON_MOMENTUM = 0.95


class Optimizers:
    """The run's optimizers as one: AdamW alone, or AdamW and Muon side by side over disjoint parameters.

    ``parts`` go to torch's distributed state-dict functions, which save and load several optimizers as
    one state keyed by parameter name; ``param_groups`` are every part's groups, AdamW's first.
    """

    def __init__(self, parts: list[torch.optim.Optimizer]):
        self.parts = tuple(parts)

    @property
    def param_groups(self) -> list[dict]:
        return [group for part in self.parts for group in part.param_groups]

    @property
    def state(self) -> dict:
        return {param: values for part in self.parts for param, values in part.state.items()}

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)


class MuonUnavailable(AstraiError):
    """training.optimizer muon where it cannot run."""


def build_optimizer(
    model: torch.nn.Module, training: TrainingSection, device: torch.device, parallel_mode: str = "none"
) -> Optimizers:
    """The optimizers of ``training.optimizer`` over the trainable parameters, with the config's settings."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    muon = [p for name, p in named if training.optimizer == "muon" and _is_block_matrix(name, p)]
    taken = {id(p) for p in muon}
    rest = [p for _, p in named if id(p) not in taken]
    groups = [{"params": [p for p in rest if p.dim() >= 2]}, {"params": [p for p in rest if p.dim() < 2]}]
    parts = [torch.optim.AdamW(groups, lr=training.max_lr, fused=device.type == "cuda")]
    if training.optimizer == "muon":
        if parallel_mode == "fsdp":
            raise MuonUnavailable(
                "training.optimizer: muon orthogonalises each weight matrix whole, and under FSDP every process "
                "holds only a shard of it; use parallel.parallel_mode ddp (or none), or training.optimizer adamw"
            )
        parts.append(torch.optim.Muon(muon, lr=training.max_lr, adjust_lr_fn="match_rms_adamw"))
    optimizer = Optimizers(parts)
    apply_settings(optimizer, training)
    return optimizer


def _is_block_matrix(name: str, param: torch.Tensor) -> bool:
    """A 2-D weight inside a transformer block (not an embedding, not the output head)."""
    return param.dim() == 2 and name.split(".")[-1] == "weight" and ".layers." in f".{name}"


def apply_settings(optimizer: Optimizers, training: TrainingSection) -> None:
    """Give every parameter group the config's settings (after a checkpoint's state was loaded, too)."""
    adamw, *muon = optimizer.parts
    decays = (training.weight_decay, 0.0)
    for group, decay in zip(adamw.param_groups, decays, strict=True):
        group.update(weight_decay=decay, betas=(training.adam_beta1, training.adam_beta2), eps=training.adam_eps)
    for part in muon:
        for group in part.param_groups:
            group.update(weight_decay=training.weight_decay, momentum=MUON_MOMENTUM)


def set_lr(optimizer: Optimizers, lr: float) -> None:
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
