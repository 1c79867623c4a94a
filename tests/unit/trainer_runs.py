"""Trainer subprocesses for the tests that kill, stop and restart them: launch, find the workers, stop or kill them,
wait, compare."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from astrai.common.checkpoints import STAGING_PREFIX, latest_complete_checkpoint
from astrai.common.contract import TORCHRUN_MODULE
from astrai.trainer.launch.entrypoint import child_pids

TORCHRUN = [sys.executable, "-m", TORCHRUN_MODULE, "--standalone", "--nproc-per-node", "2"]
TRAINER = [sys.executable, "-m", "astrai.train"]


class Run:
    """One trainer launch (plain or torchrun) in its own session, with its output in a file."""

    def __init__(self, command: list[str], env: dict, log: Path):
        self.log = log
        with open(log, "ab") as handle:
            self.proc = subprocess.Popen(
                command, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def workers(self) -> dict[int, int]:
        """rank -> pid of the torchrun workers (they run in sessions of their own)."""
        ranks = {}
        for pid in child_pids(self.proc.pid):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for item in environ:
                if item.startswith(b"RANK="):
                    ranks[int(item[5:])] = pid
        return ranks

    def kill(self) -> None:
        """SIGKILL everything this run started: the launcher, its session, torchrun's workers."""
        for pid in [*self.workers().values(), self.proc.pid]:
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        self.proc.wait(timeout=30)

    def wait(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.kill()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def metrics_steps(ckpt_dir: Path) -> list[int]:
    """Steps of the progress records so far, in the order they were written (restarts append)."""
    try:
        lines = (ckpt_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    return [json.loads(line)["step"] for line in lines if line.endswith("}")]


def metrics_step(ckpt_dir: Path) -> int:
    return max(metrics_steps(ckpt_dir), default=0)


def wait_for(condition, run: Run, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert run.proc.poll() is None, f"trainer exited early:\n{run.output()}"
        assert time.monotonic() < deadline, f"timed out:\n{run.output()}"
        time.sleep(0.02)


def run_to_end(command: list[str], env: dict, log: Path, timeout: float = 240) -> Run:
    """A run waited for until it ends, which must be with exit code 0."""
    run = Run(command, env, log)
    assert run.wait(timeout) == 0, run.output()
    return run


def stop_gracefully(run: Run, condition, rank: int | None = None, timeout: float = 60) -> None:
    """Once ``condition()`` holds, SIGTERM the run (its whole session, or torchrun's worker of ``rank``): it must exit
    0 within ``timeout`` seconds. Whatever is left of it is killed."""
    try:
        wait_for(condition, run)
        if rank is None:
            os.killpg(run.proc.pid, signal.SIGTERM)
        else:
            os.kill(run.workers()[rank], signal.SIGTERM)
        assert run.proc.wait(timeout=timeout) == 0, run.output()
    finally:
        run.kill()


def _killed_once_training(run: Run, ckpt_dir: Path, moment) -> bool:
    """Once the run writes a progress record of its own (60 s at most), wait for ``moment(run)`` and SIGKILL it if
    it still runs; whether it was killed."""
    reported = len(metrics_steps(ckpt_dir))
    deadline = time.monotonic() + 60
    while run.proc.poll() is None and len(metrics_steps(ckpt_dir)) <= reported and time.monotonic() < deadline:
        time.sleep(0.01)
    moment(run)
    if run.proc.poll() is not None:
        return False
    run.kill()
    return True


def kill_at_moments(command: list[str], env: dict, log: Path, ckpt_dir: Path, moments) -> tuple[Run, int]:
    """Start the trainer again and again, each time SIGKILLed at the next of ``moments`` once it trains; the run after
    them, or one that ended before its kill, must exit 0. That last run and the number of kills."""
    kills = 0
    for moment in moments:
        run = Run(command, env, log)
        try:
            if not _killed_once_training(run, ckpt_dir, moment):
                assert run.wait() == 0, run.output()
                return run, kills
        finally:
            run.kill()
        kills += 1
    return run_to_end(command, env, log), kills


def final_weights(ckpt_dir: Path, step: int) -> bytes:
    latest = latest_complete_checkpoint(ckpt_dir)
    assert latest is not None and latest.step == step
    return (latest.path / "model.safetensors").read_bytes()


def staging(ckpt_dir: Path) -> list[str]:
    return [name for name in os.listdir(ckpt_dir) if name.startswith(STAGING_PREFIX)] if ckpt_dir.exists() else []


def node_command(node: int, port: int, backend: str = "static", parallel_mode: str = "ddp") -> list[str]:
    """One node of a two-node torchrun launch (one process each) meeting at 127.0.0.1:``port``."""
    rendezvous = (
        ["--node-rank", str(node)]
        if backend == "static"
        else ["--rdzv-id", "test", "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}"]
    )
    return [
        sys.executable,
        "-m",
        TORCHRUN_MODULE,
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        backend,
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        *rendezvous,
        "--max-restarts",
        "0",
        "-m",
        "astrai.train",
        "--parallel_mode",
        parallel_mode,
    ]
