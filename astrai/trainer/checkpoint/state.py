"""The run's stateful parts: each saves and restores its own state, and a checkpoint holds them as one collection.

A part has torchtitan's ``Stateful`` shape: ``state_dict()`` and ``load_state_dict(state)``. The trainer builds a
:class:`RunState` of its parts; the checkpoint manager calls ``state_dict()`` on every rank at a save (a part may
take part in a collective there, as the RNG states do) and ``load_state_dict`` at a resume, in the collection's
order. Where each part's state is written is the file format's business (:mod:`astrai.trainer.checkpoint.files`):
progress into ``meta.json``, the schedule into ``scheduler.pt``, the RNG states into ``rng_state.safetensors``,
any other part into ``trainer_state.pt`` under its name. Adding a part to a run is one entry in the collection.

The model and the optimizer are not parts here: how their tensors are gathered or sharded is the format's
(full or sharded), and the manager loads them before the parts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from astrai.trainer.checkpoint.files import PROGRESS, RNG, SCHEDULE, Progress
from astrai.trainer.launch.distributed import DistEnv
from astrai.trainer.models.optim import Schedule


class Stateful(Protocol):
    def state_dict(self) -> dict:
        """Plain values and tensors (``torch.load(weights_only=True)`` reads them back). A periodic save copies them
        before training goes on, so a part may hand out its live values."""

    def load_state_dict(self, state: dict | None) -> None:
        """Restore the saved state; None when the checkpoint holds none for this part (an older one, say)."""


class RunState:
    """The run's parts by name, saved and restored together; the progress comes first, the others read it."""

    def __init__(self, parts: dict[str, Stateful]):
        if list(parts)[:3] != [PROGRESS, SCHEDULE, RNG]:
            raise ValueError(
                f"the parts must start with {PROGRESS!r}, {SCHEDULE!r}, {RNG!r}: every checkpoint holds them"
            )
        self.parts = dict(parts)

    @property
    def progress(self) -> Progress:
        return self.parts[PROGRESS]

    def state_dict(self) -> dict[str, dict]:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def load_state_dict(self, states: dict[str, dict | None]) -> None:
        for name, part in self.parts.items():
            part.load_state_dict(states.get(name))


def run_state(
    progress: Progress, schedule: Schedule, env: DistEnv, seed: int, log: Callable[[str], None], **others: Stateful
) -> RunState:
    """The parts every run has (progress, schedule, RNG), then the run's own (``others``, by name)."""
    taken = {PROGRESS, SCHEDULE, RNG} & set(others)
    if taken:
        raise ValueError(f"a part of the run's own may not be called {sorted(taken)[0]!r}: every run has one")
    return RunState(
        {
            PROGRESS: progress,
            SCHEDULE: ScheduleState(schedule, progress),
            RNG: RNGState(env, seed, progress, log),
            **others,
        }
    )


class ScheduleState:
    """The learning-rate schedule as ``scheduler.pt`` records it: its settings and the step it was saved at.

    The schedule itself is this run's config; a resume keeps what the checkpoint recorded (``saved``) only to
    say what changed since (the trainer's resume note).
    """

    def __init__(self, schedule: Schedule, progress: Progress):
        self.schedule = schedule
        self.progress = progress
        self.saved: dict | None = None

    def state_dict(self) -> dict:
        return self.schedule.state_dict(self.progress.step)

    def load_state_dict(self, state: dict | None) -> None:
        self.saved = state


def resumed_rank_seed(seed: int, step: int, rank: int) -> int:
    """The RNG seed of ``rank`` when resuming at ``step`` without that rank's saved RNG state."""
    return (seed * 1_000_003 + step) * 1_009 + rank


class RNGState:
    """Every rank's torch RNG states (``rank<R>.cpu``, ``rank<R>.cuda``), gathered at a save on every rank.

    Saved RNG states belong to the world size that wrote them. On another world size, or from a folder without
    rng_state.safetensors, each rank's RNG is seeded from (seed, step, rank) instead: nothing blocks the resume,
    and it is reproducible.
    """

    def __init__(self, env: DistEnv, seed: int, progress: Progress, log: Callable[[str], None]):
        self.env = env
        self.seed = seed
        self.progress = progress
        self.log = log

    def state_dict(self) -> dict[str, torch.Tensor]:
        env = self.env
        local = {"cpu": torch.get_rng_state()}
        if env.device.type == "cuda":
            local["cuda"] = torch.cuda.get_rng_state(env.device)
        if not env.distributed:
            return {f"rank{env.rank}.{kind}": state for kind, state in local.items()}
        states = {}
        for kind, state in local.items():
            gathered = [torch.empty_like(state) for _ in range(env.world_size)]
            dist.all_gather(gathered, state, group=env.control_group)
            states.update({f"rank{rank}.{kind}": tensor for rank, tensor in enumerate(gathered)})
        return states

    def load_state_dict(self, state: dict[str, torch.Tensor] | None) -> None:
        env = self.env
        cpu_key, cuda_key = f"rank{env.rank}.cpu", f"rank{env.rank}.cuda"
        saved_world = sum(1 for key in state or {} if key.endswith(".cpu"))
        if state is None or saved_world != env.world_size or cpu_key not in state:
            torch.manual_seed(resumed_rank_seed(self.seed, self.progress.step, env.rank))
            why = (
                "the checkpoint has no rng_state.safetensors"
                if state is None
                else f"the checkpoint holds the RNG states of {saved_world} process(es), this run has {env.world_size}"
            )
            self.log(f"note: {why}: each rank's RNG is seeded from random_seed, step and rank")
            return
        torch.set_rng_state(state[cpu_key])
        if cuda_key in state and env.device.type == "cuda":
            torch.cuda.set_rng_state(state[cuda_key], env.device)
