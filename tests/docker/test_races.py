"""Two commands at once, and Ctrl-C at the wrong moment: a stop always wins, and nothing is left half started."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest

pytestmark = pytest.mark.docker

LONG = {"training": {"max_steps": 100000}}


def _read_until(process: subprocess.Popen, marker: str, timeout: float = 300) -> list[str]:
    """Lines of ``process`` up to and including the first holding ``marker``; the rest keeps being collected."""
    lines: list[str] = []
    seen = threading.Event()

    def pump():
        for line in process.stdout:
            lines.append(line)
            if marker in line:
                seen.set()
        seen.set()

    threading.Thread(target=pump, daemon=True).start()
    assert seen.wait(timeout), f"no {marker!r} within {timeout} s: {''.join(lines)}"
    process.lines = lines
    return lines


def _finish(process: subprocess.Popen, timeout: float = 300) -> str:
    process.wait(timeout=timeout)
    time.sleep(0.2)  # the reader thread takes the last lines
    return "".join(process.lines)


def test_a_stop_that_comes_while_a_start_builds_wins(make_job):
    job = make_job(trainer=LONG)
    job.invoke("init")
    start = job.popen("start")
    try:
        _read_until(start, "building the trainer image")
        stop = job.invoke("stop", check=False)
        started = _finish(start)
    finally:
        start.kill()
    final = job.container()
    assert final is None or not final.running, (started, stop.stdout)
    if final is None or final.status == "created":
        assert "the job was not started" in started and start.returncode == 1, started
    else:
        assert "stopping job" in stop.stdout and final.exit_code in (0, 143), (started, stop.stdout)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert job.invoke("start").returncode == 0, "a later start is not blocked by the stop"
    job.wait_for("progress", lambda: job.progress_step() >= 5)
    assert job.container().running
    job.invoke("stop")


@pytest.mark.parametrize("moment", ["building", "container created", "training"])
def test_ctrl_c_during_a_foreground_start_leaves_no_container_or_stops_gracefully(make_job, moment):
    job = make_job(trainer=LONG)
    job.invoke("init")
    start = job.popen("start", "--foreground")
    try:
        if moment == "building":
            _read_until(start, "building the trainer image")
        elif moment == "container created":
            _read_until(start, "building the trainer image: done")
            deadline = time.monotonic() + 120
            while job.container() is None:
                assert time.monotonic() < deadline, "no container appeared"
                time.sleep(0.02)
        else:
            _read_until(start, "started job")
            job.wait_for("progress", lambda: job.progress_step() >= 5)
        os.killpg(start.pid, signal.SIGINT)  # what a terminal does on Ctrl-C
        output = _finish(start)
    finally:
        if start.poll() is None:
            os.killpg(start.pid, signal.SIGKILL)
    assert "Traceback" not in output, output
    final = job.container()
    assert final is None or not final.running, output
    said_nothing_runs = "nothing was started" in output or "nothing is running" in output
    said_stopped = "stopping the job gracefully" in output
    assert said_nothing_runs or said_stopped, output
    if said_stopped:
        # A SIGTERM before the interpreter has even started the entrypoint ends it at once (143): nothing ran.
        before_any_step = "while the trainer was still starting (no step taken, nothing lost)" in output
        assert final is not None and final.exit_code in ((0, 143) if before_any_step else (0,)), output
    if moment == "training":
        assert said_stopped and job.checkpoints()[-1][1] == "emergency", output
