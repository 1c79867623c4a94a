"""Detached host processes of the product (the max-duration timer, a background board), known by a state file.

Each one runs in a session of its own, so it outlives the shell that started it
and a Ctrl-C there never reaches it. Its state file (JSON, written atomically)
names its pid; since pids get reused, a process counts as this daemon only while
its command line still names the daemon's module and it is not a zombie.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from astrai.common.atomic import write_text_atomically


class Daemon:
    """One kind of detached process, found through ``state_file``; ``marker`` is in its command line."""

    def __init__(self, state_file: Path, marker: str):
        self.state_file = Path(state_file)
        self.marker = marker.encode()

    def spawn(self, command: list[str], log_file: Path) -> subprocess.Popen:
        """Start ``command`` detached, its output appended to ``log_file``."""
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        with open(log_file, "ab") as log:
            return subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,  # own session: the shell's hangup or Ctrl-C never reaches it
                cwd="/",
            )

    def write(self, state: dict) -> None:
        """Record ``state`` (holding the daemon's ``pid``); readers see the old file or the new one, whole."""
        write_text_atomically(self.state_file, json.dumps(state, indent=2, sort_keys=True) + "\n", 0o644)

    def read(self, *, alive: bool = True) -> dict | None:
        """The recorded state; None when there is none, it is unreadable, or (``alive``) its process is gone."""
        try:
            state = json.loads(self.state_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(state, dict) or not isinstance(state.get("pid"), int):
            return None
        return state if not alive or self.is_running(state["pid"]) else None

    def read_as(self, record):
        """The recorded state as a ``record`` (a dataclass of its keys); None as for :meth:`read`, or when the
        file holds other keys (written by another version)."""
        state = self.read()
        try:
            return record(**state) if state is not None else None
        except TypeError:
            return None

    def is_running(self, pid: int) -> bool:
        """Whether ``pid`` is alive and is this daemon (a reused pid belongs to another program)."""
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            status = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        return any(self.marker in part for part in command) and status != "Z"

    def forget(self, pid: int | None = None) -> None:
        """Remove the state file (only if it still names ``pid``, when given: a newer daemon may have replaced it)."""
        if pid is not None:
            state = self.read(alive=False)
            if state is None or state["pid"] != pid:
                return
        self.state_file.unlink(missing_ok=True)

    def stop(self, timeout: float = 15.0) -> dict | None:
        """End the recorded daemon: SIGTERM, then SIGKILL after ``timeout``; its state, or None if none ran."""
        state = self.read()
        self.forget()
        if state is None:
            return None
        try:
            os.kill(state["pid"], signal.SIGTERM)
        except ProcessLookupError:
            return state
        deadline = time.monotonic() + timeout
        while self.is_running(state["pid"]):
            if time.monotonic() > deadline:
                os.kill(state["pid"], signal.SIGKILL)
                break
            time.sleep(0.1)
        return state
