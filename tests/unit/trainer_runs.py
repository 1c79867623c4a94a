"""Trainer subprocesses for the tests that kill, stop and restart them: launch, find the workers, wait, compare."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from astrai.common.checkpoints import STAGING_PREFIX, latest_complete_checkpoint
from astrai.trainer.entrypoint import child_pids

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
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
        "torch.distributed.run",
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
