"""The generation engines and which one a model generates with: the native engine
(:class:`astrai.trainer.generation.decoding.DecodeEngine`, caches of its own sized by the run's plan) for the trainer's
own model, the transformers engine (:class:`astrai.trainer.generation.library.TransformersDecoding`) for a model
trained through transformers. The online types' rollouts, the evaluation in the loop, agents' episodes and
``python -m astrai.model generate`` all take theirs from :func:`generation_engine`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from torch import nn

from astrai.common.backends import BACKEND_NATIVE, BACKEND_TRANSFORMERS
from astrai.common.settings import Sampling
from astrai.trainer.generation.decoding import DecodeEngine, Draws, TurnHandler


class GenerationEngine(Protocol):
    """Sampling from a model for the online types, their evaluation and ``python -m astrai.model generate``
    (:class:`astrai.trainer.generation.decoding.DecodeEngine`,
    :class:`astrai.trainer.models.hf_model.TransformersDecoding`)."""

    capture_seconds: float
    """Time spent capturing decode steps (none through transformers), left out of the figures of a step."""

    def generate(
        self,
        prompts: list[list[int]],
        sampling: Sampling,
        stop: set[int] | frozenset[int] = frozenset(),
        draws: list[Draws] | None = None,
    ) -> list[list[int]]:
        """Each prompt's completion (its stop token included), each row's draws from its own generator."""
        ...

    def episodes(
        self,
        prompts: list[list[int]],
        sampling: Sampling,
        stop: set[int] | frozenset[int],
        draws: list[Draws],
        handler: TurnHandler,
        rooms: list[int],
    ) -> None:
        """Multi-turn generation: each row's turns, the handler's replies fed in between them."""
        ...


@dataclass(frozen=True)
class EngineSizes:
    """How the native engine sizes its caches (astrai.trainer.run.build.engine_sizes): a training run's are fixed by its
    plan; none given, the engine sizes them for each call."""

    capacity: int | None = None
    rows_per_part: int | None = None
    together: object = None
    compile: bool = False


def _native(model: nn.Module, sizes: Callable[[], EngineSizes] | None) -> GenerationEngine:
    given = EngineSizes() if sizes is None else sizes()
    return DecodeEngine(
        model,
        together=given.together,
        compile=given.compile,
        capacity=given.capacity,
        rows_per_part=given.rows_per_part,
    )


def _library(model: nn.Module, sizes: Callable[[], EngineSizes] | None) -> GenerationEngine:
    from astrai.trainer.generation.library import TransformersDecoding

    return TransformersDecoding(model)  # the library keeps its own cache: nothing to size


ENGINES: dict[str, Callable[[nn.Module, Callable[[], EngineSizes] | None], GenerationEngine]] = {
    BACKEND_NATIVE: _native,
    BACKEND_TRANSFORMERS: _library,
}
"""The engine of each backend (``RunPlan.backend``, :data:`astrai.trainer.models.backend.BACKENDS`)."""


def generation_engine(
    backend: str, model: nn.Module, sizes: Callable[[], EngineSizes] | None = None
) -> GenerationEngine:
    """The engine ``model`` (wrapped for the parallel mode or not) generates with on ``backend``; ``sizes`` is asked
    for by an engine that keeps caches of its own (the native one)."""
    return ENGINES[backend](model, sizes)
