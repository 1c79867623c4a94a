"""Keep a stop signal that arrives while the trainer is still starting.

Starting the trainer takes seconds (the interpreter, importing torch). A SIGTERM
in that window would take its default action and kill the process with 143
before :class:`astrai.trainer.launch.distributed.GracefulStop` is installed. So:

- the entrypoint calls :func:`hold` first: SIGTERM and SIGINT are blocked, and a
  blocked signal stays pending across ``exec`` into the trainer;
- the trainer, as its very first statement, calls :func:`catch`: a handler that
  only records the signal, then unblocks, which delivers a pending one;
- ``GracefulStop.install`` takes the record over, so the run stops at its first
  step boundary with an emergency checkpoint, as for any other stop.

Nothing here imports torch.
"""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

_received: list[int] = []


def hold() -> None:
    """Block the stop signals; they wait, pending, for :func:`catch` or :func:`release`."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def release() -> None:
    """Unblock the stop signals (delivering any pending one to the handlers now installed)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def catch() -> None:
    """Record stop signals from now on instead of dying of them, and take any pending one."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, _record)
    release()


def received() -> signal.Signals | None:
    """The first stop signal recorded by :func:`catch`, if any."""
    return signal.Signals(_received[0]) if _received else None


def _record(signum: int, _frame) -> None:
    _received.append(signum)
