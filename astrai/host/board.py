"""`invoke board`: TensorBoard for a job's event files (or every job's), served from the host.

TensorBoard comes with the project's ``dev`` and ``train`` extras (``.ci/setup``
installs ``dev``), so nothing else needs setting up. It listens on 127.0.0.1
unless ``--host`` says otherwise: the event files are the job's, not the
network's. In the foreground Ctrl-C ends it; ``--background`` detaches it and
records it in ``<job_dir>/.astrai/board.json``, and ``--stop`` ends that one.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass

from astrai.common.contract import TENSORBOARD_DIR
from astrai.common.errors import AstraiError
from astrai.host import compose
from astrai.host.daemon import Daemon
from astrai.host.hostuser import make_dirs
from astrai.host.runtime import Runtime

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 6006
BOARD_FILE_NAME = "board.json"
BOARD_LOG_NAME = "board.log"
START_TIMEOUT_SECONDS = 90.0
_MODULE = "tensorboard.main"


class BoardError(AstraiError):
    """The board cannot be served or stopped; the message says what to do."""


@dataclass(frozen=True)
class BoardState:
    pid: int
    url: str


def board_command(runtime: Runtime, all_jobs: bool, host: str, port: int) -> list[str]:
    """The TensorBoard command line: one job's event files under its job name, or the checkpoints folder."""
    if all_jobs:
        source = ["--logdir", str(runtime.checkpoints_dir)]
    else:
        # Named after the job, so its run reads <job>/tensorboard as it does with --all.
        source = ["--logdir_spec", f"{runtime.job_name}:{runtime.job_dir}"]
    return [sys.executable, "-m", _MODULE, *source, "--host", host, "--port", str(port), "--reload_interval", "5"]


def board_url(host: str, port: int) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://[{shown}]:{port}/" if ":" in shown else f"http://{shown}:{port}/"


def check_can_serve(runtime: Runtime, all_jobs: bool, host: str, port: int) -> list[str]:
    """Raise BoardError when TensorBoard is missing or the port is taken; return notes and warnings for the user."""
    if importlib.util.find_spec(_MODULE.partition(".")[0]) is None:
        raise BoardError(
            "tensorboard is not installed on this host; install it with: python3 -m pip install -e '.[dev]' "
            "(or pip install tensorboard)"
        )
    if not 1 <= port <= 65535:
        raise BoardError(f"--port must be between 1 and 65535, got {port}")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as error:
        raise BoardError(f"cannot listen on {host}:{port} ({error.strerror}); choose another with --port") from None
    notes = []
    if not _loopback(host):
        notes.append(
            f"warning: TensorBoard has no authentication: anyone who can reach this machine on port {port} can read "
            f"the job's metrics; to watch from another machine, keep the default {DEFAULT_HOST} and tunnel "
            f"(ssh -L {port}:{DEFAULT_HOST}:{port} THIS_HOST)"
        )
    folder = runtime.checkpoints_dir if all_jobs else runtime.job_dir / TENSORBOARD_DIR
    if not folder.is_dir():
        notes.append(f"note: no event files yet in {folder}; TensorBoard shows them once the trainer writes them")
    return notes


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def serve_foreground(command: list[str]) -> int:
    """Run TensorBoard until it exits or Ctrl-C; returns its exit code (0 after Ctrl-C)."""
    process = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    try:
        return process.wait()
    except KeyboardInterrupt:
        # The terminal sent SIGINT to TensorBoard too; give it a moment to close, then make sure.
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        return 0


def _daemon(runtime: Runtime) -> Daemon:
    return Daemon(compose.state_dir(runtime) / BOARD_FILE_NAME, _MODULE)


def start_background(runtime: Runtime, command: list[str], url: str) -> BoardState:
    """Start TensorBoard detached, wait until it answers, and record it for ``stop_background``."""
    daemon = _daemon(runtime)
    running = read_board(runtime)
    if running is not None:
        raise BoardError(
            f"a board for job {runtime.job_name} already runs at {running.url} (pid {running.pid}); "
            f"`{runtime.command('board')} --stop` ends it"
        )
    make_dirs(daemon.state_file.parent)
    log = daemon.state_file.with_name(BOARD_LOG_NAME)
    process = daemon.spawn(command, log)
    state = BoardState(process.pid, url)
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while not _answers(url):
        if process.poll() is not None or time.monotonic() > deadline:
            if process.poll() is None:
                process.kill()
            process.wait()
            raise BoardError(f"TensorBoard did not start (see {log})")
        time.sleep(0.25)
    daemon.write(asdict(state))
    return state


def stop_background(runtime: Runtime, timeout: float = 15.0) -> BoardState | None:
    """End the job's background board; None when there was none."""
    state = _daemon(runtime).stop(timeout)
    return BoardState(**state) if state is not None else None


def read_board(runtime: Runtime) -> BoardState | None:
    """The job's background board, or None when there is none (or its process has gone)."""
    return _daemon(runtime).read_as(BoardState)


def _answers(url: str) -> bool:
    # Straight to the local server, whatever proxy the environment names.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url + "data/environment", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False
