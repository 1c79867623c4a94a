"""The parallel-mode rules, shared by the host (runtime block) and the container entrypoint.

``auto`` means ``none`` for one process and ``ddp`` for more; ``none`` needs
exactly one process; ``ddp`` and ``fsdp`` need two or more. Imports nothing
beyond the standard library, so both sides can use it.
"""

from __future__ import annotations

PARALLEL_MODES = ("auto", "none", "ddp", "fsdp")


def resolve_parallel_mode(requested: str, processes: int) -> str:
    """The concrete mode for ``processes`` processes; ValueError explains a mismatch."""
    if requested not in PARALLEL_MODES:
        raise ValueError(f"unknown parallel mode {requested!r}; allowed: {', '.join(PARALLEL_MODES)}")
    if processes < 1:
        raise ValueError(f"the process count must be at least 1, got {processes}")
    if requested == "auto":
        return "none" if processes == 1 else "ddp"
    if requested == "none" and processes != 1:
        raise ValueError(f"none needs exactly 1 process, but {processes} were requested")
    if requested in ("ddp", "fsdp") and processes < 2:
        raise ValueError(f"{requested} needs 2 or more processes, but {processes} was requested")
    return requested
