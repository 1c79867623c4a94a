"""The max-duration timer: a detached host process that stops one run gracefully at a deadline.

``invoke start`` schedules it when ``runtime.container.max_duration_hours`` is
set. It runs in its own session, so it outlives the shell that started it, and
keeps its state in ``<job_dir>/.astrai/timer.json``: its pid, the deadline and
the container (id and start time) it belongs to. It only ever stops that very
container run: a later run gets a new container, which the timer ignores. It
ends by itself when its container exits first; ``invoke stop`` cancels it.

Run by ``invoke start``, not by hand::

    python -m astrai.host.timer --state JOB_DIR/.astrai/timer.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from astrai.common.values import local_time
from astrai.host import engine
from astrai.host.daemon import Daemon

_MODULE = "astrai.host.timer"
TIMER_FILE_NAME = "timer.json"
TIMER_LOG_NAME = "timer.log"
POLL_SECONDS = 30.0


@dataclass(frozen=True)
class TimerState:
    pid: int
    deadline: float
    """Unix time at which the graceful stop begins."""
    container_id: str
    container_started_at: str
    stop_timeout_seconds: int
    job_name: str


def _daemon(state_dir: Path) -> Daemon:
    return Daemon(state_dir / TIMER_FILE_NAME, _MODULE)


def timer_file(state_dir: Path) -> Path:
    return state_dir / TIMER_FILE_NAME


def read_timer(state_dir: Path) -> TimerState | None:
    """The scheduled timer of a job, or None when there is none (or it has died)."""
    return _daemon(state_dir).read_as(TimerState)


def schedule(
    state_dir: Path,
    *,
    hours: float,
    container: engine.Container,
    stop_timeout_seconds: int,
    job_name: str,
) -> TimerState:
    """Start a detached timer for ``container``; cancels the job's previous timer first."""
    cancel(state_dir)
    daemon = _daemon(state_dir)
    deadline = time.time() + hours * 3600.0
    process = daemon.spawn(
        [sys.executable, "-m", _MODULE, "--state", str(daemon.state_file)], state_dir / TIMER_LOG_NAME
    )
    state = TimerState(process.pid, deadline, container.id, container.started_at, stop_timeout_seconds, job_name)
    daemon.write(asdict(state))
    return state


def cancel(state_dir: Path) -> bool:
    """Stop the job's timer if one runs; True when one was cancelled."""
    return _daemon(state_dir).stop() is not None


def seconds_left(state: TimerState, now: float | None = None) -> float:
    return max(0.0, state.deadline - (time.time() if now is None else now))


def _log(message: str) -> None:
    print(f"{local_time(time.time())} {message}", flush=True)


def _wait_and_stop(path: Path) -> int:
    # The state file is written right after this process starts; give it a moment.
    for _ in range(100):
        try:
            state = TimerState(**json.loads(path.read_text(encoding="utf-8")))
            break
        except (OSError, ValueError, TypeError):
            time.sleep(0.1)
    else:
        _log(f"no timer state at {path}; exiting")
        return 1
    if state.pid != os.getpid():
        _log("the state file belongs to another timer; exiting")
        return 0
    _log(f"job {state.job_name}: stopping container {state.container_id[:12]} at {local_time(state.deadline)}")
    try:
        while True:
            container = engine.inspect_container(state.container_id)
            if container is None or not container.running or container.started_at != state.container_started_at:
                _log("the container run ended before the deadline; nothing to do")
                return 0
            left = seconds_left(state)
            if left <= 0:
                break
            time.sleep(min(left, POLL_SECONDS))
        _log(f"max duration reached: stopping gracefully (grace {state.stop_timeout_seconds} s)")
        result = engine.stop_container(state.container_id, state.stop_timeout_seconds)
        _log("stopped" if result.returncode == 0 else f"docker stop failed: {result.stderr.strip()}")
        return result.returncode
    finally:
        # Remove the state only if it is still ours (a new start may have replaced it).
        Daemon(path, _MODULE).forget(os.getpid())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m astrai.host.timer", description="max-duration timer (internal)")
    parser.add_argument("--state", required=True, type=Path, help="the timer.json this process belongs to")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        return _wait_and_stop(args.state)
    except engine.EngineError as error:
        _log(f"error: {error}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
