"""What the loop asks of an objective: the members of :class:`Objective`, every one of them declared here.

A step of the loop (:meth:`astrai.trainer.run.loop.Trainer.train_step`) is::

    fresh = objective.takes_batch(step)                   # new data this step, or the round's again
    prepared = objective.prepare_step(batches, model, step)   # one entry per micro-batch
    for batch, extra in zip(batches, prepared):
        loss, reported = objective.micro(model, batch, extra, accum)
        loss.backward()
    ...
    tokens = objective.step_tokens(plan.tokens_per_step)

then ``metrics()`` at each report, ``eval_sums`` for validation, and ``parts()`` once, for the checkpoint. A new
objective subclasses :class:`Objective` and overrides what it needs: ``micro`` always; ``prepare_step`` when a
micro-batch's loss needs something of the whole step (SFT's token count over every rank, GRPO's rollouts and their
advantages); ``parts`` when it holds state a stop must not lose.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from astrai.common.fit import SetupError
from astrai.trainer.checkpoint.state import Stateful
from astrai.trainer.launch.distributed import DistEnv


class Objective:
    """What a step minimises; the defaults are those of an objective with no state and nothing to prepare."""

    def parts(self) -> dict[str, Stateful]:
        """This objective's own checkpoint parts by name (a generation round under way, say); none by default."""
        return {}

    def takes_batch(self, step: int) -> bool:
        """Whether ``step`` takes new data from the loader (False: it trains on what an earlier step prepared)."""
        return True

    def prepare_step(self, batches: list, model: torch.nn.Module, step: int) -> list:
        """Work out what each micro-batch's loss needs beyond its batch, once for the whole step (every rank calls
        it, so it may take part in collectives); one entry per micro-batch. ``batches`` are None on a step that
        takes no new data."""
        return [None] * len(batches)

    def micro(self, model: torch.nn.Module, batch, prepared, accum: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One micro-batch: (the loss to backpropagate, the loss to report), such that the gradients of a step's
        micro-batches add up to the gradient of the step's loss over its whole global batch."""
        raise NotImplementedError

    def step_tokens(self, planned: int) -> int:
        """The tokens the step just taken trained on, over every rank: ``planned`` (the window-based types' fixed
        count), or what the step's prompts and completions held."""
        return planned

    def eval_sums(self, model: torch.nn.Module, batch) -> torch.Tensor:
        """(summed loss, count, ...) of a held-out batch in float64, for the validation loss; any further entries are
        sums for :meth:`eval_metrics`."""
        raise SetupError(f"{type(self).__name__} has no validation loss; set data.val_fraction to 0")

    def eval_metrics(self, totals: list[float]) -> dict[str, float]:
        """More validation metrics from the held-out batches' summed ``eval_sums`` (every rank's); none by default."""
        return {}

    def metrics(self) -> dict | None:
        """The objective's own metrics since the last call (every rank's), or None; then counting starts again."""
        return None


class RunningSums:
    """Running sums of the fields of ``kind`` (a dataclass whose fields are floats): added on the device, so a
    micro-batch never waits for the host, and read summed over every rank once per report."""

    def __init__(self, kind: type):
        self.kind = kind
        self.names = tuple(field.name for field in dataclasses.fields(kind))
        self._total: torch.Tensor | None = None

    def add(self, device: torch.device, **values) -> None:
        """Add a value (a number or a 0-d tensor) to each named field; a field not given adds nothing."""
        unknown = set(values) - set(self.names)
        if unknown:
            raise ValueError(f"{self.kind.__name__} has no field {sorted(unknown)[0]}")
        row = torch.stack(
            [
                torch.as_tensor(values.get(name, 0.0), dtype=torch.float64, device=device).reshape(())
                for name in self.names
            ]
        )
        self._total = row if self._total is None else self._total + row

    def take(self, env: DistEnv):
        """The sums over every rank as a ``kind`` (a collective: every rank calls it); counting starts again."""
        total = self._total if self._total is not None else torch.zeros(len(self.names), dtype=torch.float64)
        total = total.to(env.device)
        if env.distributed:
            dist.all_reduce(total)
        self._total = None
        return self.kind(*total.tolist())
