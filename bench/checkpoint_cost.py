"""Checkpoint cost, on the `small` preset (26M parameters, ~300 MB with the optimizer state).

- ``ckpt_save_vs_raw``: a synchronous trainer checkpoint (staging folder, every
  file, meta, RNG states, fsync, rename) over ``safetensors.save_file`` of the
  model plus ``torch.save`` of the optimizer and scheduler state, same state.
  ``ckpt_save_vs_raw_fsync`` compares with the same raw writes followed by an
  fsync of each file, which is what makes a checkpoint survive a power cut.
  ``ckpt_raw_fsync_vs_raw`` is that durable baseline over the raw one: what the
  disk alone adds, a floor for any writer that flushes.
- ``ckpt_stall_vs_sync``: how long a periodic checkpoint pauses the training
  loop (the state is copied, then written by a background thread) over the
  time of one synchronous save.
- ``ckpt_contention_vs_sync``: the extra wall time per periodic save of a run
  with saves over the same run without, over one synchronous save. On a CPU
  host every core trains, so the background writer's work still costs time.
- ``resume_s``: building a trainer that resumes from a `small` checkpoint.

Every timed save starts after ``os.sync()``, so no writer inherits the other's
dirty pages.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from astrai.checkpoints import list_complete_checkpoints
from astrai.distributed import init_distributed
from astrai.train import Trainer
from bench.trainer_speed import make_assets, trainer_config

PRESET, WINDOW, BATCH = "small", 128, 4


def _clear(job_dir: Path) -> None:
    for checkpoint in list_complete_checkpoints(job_dir):
        shutil.rmtree(checkpoint.path)


def _raw_save(trainer: Trainer, target: Path, durable: bool) -> None:
    target.mkdir()
    save_file({k: v.contiguous() for k, v in trainer.model.state_dict().items()}, target / "model.safetensors")
    torch.save(trainer.optimizer.state_dict(), target / "optimizer.pt")
    torch.save(trainer.scheduler.state_dict(), target / "scheduler.pt")
    if durable:
        for name in ("model.safetensors", "optimizer.pt", "scheduler.pt"):
            fd = os.open(target / name, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def _save_costs(trainer: Trainer, folder: Path, repeats: int) -> dict:
    """Median seconds of each way to save, each measured right after a training step, in turns."""
    ways = {
        "save": lambda: trainer.save_checkpoint("final"),
        "raw": lambda: _raw_save(trainer, folder / "raw", durable=False),
        "durable": lambda: _raw_save(trainer, folder / "raw", durable=True),
        "pause": lambda: trainer.save_checkpoint("periodic"),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, save in ways.items():
            trainer.train(steps=1)
            os.sync()
            start = time.perf_counter()
            save()
            times[name].append(time.perf_counter() - start)
            trainer.checkpointer.wait()
            _clear(trainer.job_dir)
            shutil.rmtree(folder / "raw", ignore_errors=True)
    return {name: statistics.median(values) for name, values in times.items()}


def _loop_seconds(trainer: Trainer, steps: int) -> float:
    start = time.perf_counter()
    trainer.train(steps=steps)
    trainer.checkpointer.wait()
    return time.perf_counter() - start


def run(quick: bool) -> dict:
    repeats = 5 if quick else 9
    interval, saves = 4, 4
    with tempfile.TemporaryDirectory(prefix="astrai-bench-ckpt-") as work:
        folder = Path(work)
        params, data = make_assets(folder, PRESET)
        env = init_distributed("none", "cpu")

        plain = Trainer(trainer_config(params, data, folder / "plain", WINDOW, BATCH, 10**6), env)
        periodic = Trainer(trainer_config(params, data, folder / "periodic", WINDOW, BATCH, 10**6,
                                          ckpt_interval=interval), env)
        try:
            costs = _save_costs(plain, folder, repeats)
            plain.train(steps=2)
            periodic.train(steps=interval - 2)  # the next periodic save falls inside the measured runs
            periodic.checkpointer.wait()
            extra = []
            for _ in range(3 if quick else 5):
                without = _loop_seconds(plain, interval * saves)
                with_saves = _loop_seconds(periodic, interval * saves)
                extra.append((with_saves - without) / saves)
                _clear(periodic.job_dir)
            plain.save_checkpoint("final")
        finally:
            plain.close()
            periodic.close()

        resume = []
        for _ in range(repeats):
            start = time.perf_counter()
            resumed = Trainer(trainer_config(params, data, folder / "plain", WINDOW, BATCH, 10**6), env)
            resume.append(time.perf_counter() - start)
            resumed.close()
    contention = max(statistics.median(extra), 0.0)
    return {
        "ckpt_save_s": costs["save"],
        "ckpt_raw_save_s": costs["raw"],
        "ckpt_save_vs_raw": costs["save"] / costs["raw"],
        "ckpt_save_vs_raw_fsync": costs["save"] / costs["durable"],
        "ckpt_raw_fsync_vs_raw": costs["durable"] / costs["raw"],
        "ckpt_stall_s": costs["pause"],
        "ckpt_stall_vs_sync": costs["pause"] / costs["save"],
        "ckpt_contention_vs_sync": contention / costs["save"],
        "resume_s": statistics.median(resume),
    }
