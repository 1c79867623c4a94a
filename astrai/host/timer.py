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
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from astrai.host import engine

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


def timer_file(state_dir: Path) -> Path:
    return state_dir / TIMER_FILE_NAME


def read_timer(state_dir: Path) -> TimerState | None:
    """The scheduled timer of a job, or None when there is none (or it has died)."""
    try:
        state = TimerState(**json.loads(timer_file(state_dir).read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None
    return state if _is_timer_process(state.pid) else None


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
    state_dir.mkdir(parents=True, exist_ok=True)
    path = timer_file(state_dir)
    deadline = time.time() + hours * 3600.0
    with open(state_dir / TIMER_LOG_NAME, "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "astrai.host.timer", "--state", str(path)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,  # own session: the shell's hangup or Ctrl-C never reaches it
            cwd="/",
        )
    state = TimerState(process.pid, deadline, container.id, container.started_at, stop_timeout_seconds, job_name)
    _write_state(path, state)
    return state


def cancel(state_dir: Path) -> bool:
    """Stop the job's timer if one runs; True when one was cancelled."""
    path = timer_file(state_dir)
    state = read_timer(state_dir)
    cancelled = False
    if state is not None:
        try:
            os.kill(state.pid, signal.SIGTERM)
            cancelled = True
        except ProcessLookupError:
            pass
    path.unlink(missing_ok=True)
    return cancelled


def seconds_left(state: TimerState, now: float | None = None) -> float:
    return max(0.0, state.deadline - (time.time() if now is None else now))


def stop_container(container_id: str, timeout_seconds: int) -> subprocess.CompletedProcess:
    """The graceful stop shared by `invoke stop` and the timer: SIGTERM, then SIGKILL after the grace."""
    return engine.docker("stop", "--time", str(timeout_seconds), container_id, timeout=timeout_seconds + 120)


def _write_state(path: Path, state: TimerState) -> None:
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(asdict(state), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(temporary, path)


def _is_timer_process(pid: int) -> bool:
    """True when ``pid`` is alive and is one of our timers (pids get reused)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            argv = handle.read().split(b"\0")
    except OSError:
        return False
    return b"astrai.host.timer" in argv


def _log(message: str) -> None:
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}", flush=True)


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
    _log(
        f"job {state.job_name}: stopping container {state.container_id[:12]} at "
        f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(state.deadline))}"
    )
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
        result = stop_container(state.container_id, state.stop_timeout_seconds)
        _log("stopped" if result.returncode == 0 else f"docker stop failed: {result.stderr.strip()}")
        return result.returncode
    finally:
        # Remove the state only if it is still ours (a new start may have replaced it).
        try:
            current = json.loads(path.read_text(encoding="utf-8"))
            if current.get("pid") == os.getpid():
                path.unlink()
        except (OSError, ValueError):
            pass


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
