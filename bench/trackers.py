"""Tracker overhead: the trainer's tokens per CPU-second reporting to MLflow and W&B, over the same without them.

Two trainers of the same `tiny` job in this one process, one thread: one reports as by default (metrics.jsonl and
TensorBoard), the other to a real MLflow tracking server on this host (SQLite store) and to W&B offline as well.
They train in alternating turns of 100 steps (50 with --quick: a turn of 100 takes about 34 s on 2 CPU cores, so
--quick's 14 turns took this section alone to about 8 minutes) with the default log_interval of 10. A turn
of the reporting trainer ends only once its outboxes have sent everything the turn logged, so the sending threads'
CPU time is its own; that one extra request per turn costs a few milliseconds against seconds of training.
W&B's service process (wandb-core, a program of its own) is not on this process's clock.

- ``tracker_overhead``: CPU time of a turn without trackers over the same turn with them (tokens per CPU-second
  with over without); ``tracker_overhead_wall`` the same on wall time.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from astrai.common.config import MlflowSettings, WandbSettings, build_config
from astrai.trainer.launch.distributed import init_distributed
from astrai.trainer.run.loop import open_trainer
from bench.common import Figures, fix_threads
from bench.trainer_speed import make_assets
from tests.trackers_support import mlflow_server

WINDOW, BATCH, LOG_INTERVAL = 128, 16, 10
# steps per turn: (with --quick, without)
STEPS = (50, 100)


def _config(params: Path, data: Path, job_dir: Path, log: dict):
    return build_config(
        {
            "data": {"data_root_path": str(data), "window_size": WINDOW, "num_workers": 0},
            "training": {"max_steps": 10**6, "batch_per_device": BATCH, "max_lr": 1e-3, "device": "cpu"},
            "ckpt": {"ckpt_dir": str(job_dir), "param_path": str(params), "ckpt_interval": 10**9},
            "log": {"log_interval": LOG_INTERVAL, **log},
        }
    )


def _turn(trainer, steps: int) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.train(steps=steps)
    trackers = trainer.reporter.trackers
    for outbox in trackers.outboxes.values() if trackers is not None else ():
        outbox.drain()
    return time.perf_counter() - wall, time.process_time() - cpu


def run(quick: bool) -> Figures:
    figures = Figures()
    fix_threads()
    turns, steps = (6, STEPS[0]) if quick else (10, STEPS[1])
    with (
        tempfile.TemporaryDirectory(prefix="astrai-bench-trackers-") as work,
        mlflow_server(Path(work) / "mlflow") as server,
    ):
        folder = Path(work)
        params, data = make_assets(folder, "tiny")
        env = init_distributed("none", "cpu")
        trackers = {
            "report_to": ("tensorboard", "mlflow", "wandb"),
            "mlflow": MlflowSettings(tracking_uri=server.local_uri),
            "wandb": WandbSettings(mode="offline"),
        }
        sides = {
            "off": open_trainer(_config(params, data, folder / "off", {}), env),
            "on": open_trainer(_config(params, data, folder / "on", trackers), env),
        }
        try:
            for trainer in sides.values():
                _turn(trainer, steps)  # warm up; the tracker runs open
            opened = sides["on"].reporter.trackers
            deadline = time.monotonic() + 120
            while len(opened.ids()) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert len(opened.ids()) == 2, "the tracker runs did not open"
            times: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
            for turn in range(turns):
                for side in ("off", "on") if turn % 2 == 0 else ("on", "off"):
                    times[side].append(_turn(sides[side], steps))
            sent = {name: box.tracker.run.last_step for name, box in opened.outboxes.items()}
            dropped = sum(box.dropped for box in opened.outboxes.values())
        finally:
            for trainer in sides.values():
                trainer.close("finished")
    figures.ratio("tracker_overhead", [cpu for _, cpu in times["off"]], [cpu for _, cpu in times["on"]])
    figures.ratio("tracker_overhead_wall", [wall for wall, _ in times["off"]], [wall for wall, _ in times["on"]])
    figures.observed("tracker_updates_dropped", dropped, f"updates dropped over the run; last steps sent: {sent}")
    return figures
