"""Stop latency: from `invoke stop` to the container's exit with a complete emergency checkpoint.

A `small` job (26M parameters) runs in a container on the CPU; once it trains, `invoke stop` is
timed until it returns (it returns when the container has exited). The
latency is also given in units of (one step + one synchronous save), the least
a graceful stop can take: finish the step in flight, then write everything.
Step time comes from the job's own progress records; save time from a save of
the same model in this process.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from astrai.common.checkpoints import latest_complete_checkpoint
from astrai.host import compose
from astrai.trainer.launch.distributed import init_distributed
from astrai.trainer.run.loop import open_trainer
from bench.common import Figures, invoke, wait_for_metrics, write_config
from bench.trainer_speed import make_assets, trainer_config

JOB = "bench-stop"
PRESET, WINDOW, BATCH = "small", 64, 8


def _save_seconds(folder: Path, params: Path, data: Path) -> list[float]:
    trainer = open_trainer(
        trainer_config(params, data, folder / "save-probe", WINDOW, BATCH, 10**6), init_distributed("none", "cpu")
    )
    try:
        trainer.train(steps=2)
        times = []
        for _ in range(3):
            trainer.train(steps=1)
            start = time.perf_counter()
            trainer.save_checkpoint("emergency")
            times.append(time.perf_counter() - start)
    finally:
        trainer.close()
    return times


def _step_seconds(job_dir: Path) -> float:
    lines = (job_dir / "metrics.jsonl").read_text().splitlines()
    rates = [json.loads(line)["tokens_per_s"] for line in lines[1:-1] if line.strip()]
    return WINDOW * BATCH / statistics.median(rates)


def run(quick: bool, base_image: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="astrai-bench-stop-") as work:
        folder = Path(work)
        params, data = make_assets(folder, PRESET)
        config = write_config(
            folder,
            {
                "job_name": JOB,
                "paths": {"data": str(data), "model": str(params), "checkpoints": str(folder / "ckpt")},
                "gpu": {"devices": "none"},
                "container": {"cuda_tag": "cpu", "base_image": base_image},
            },
            {
                "data": {"data_root_path": "/data", "window_size": WINDOW, "num_workers": 1},
                "training": {"max_steps": 10**6, "batch_per_device": BATCH},
                "ckpt": {"ckpt_interval": 10**5},
                "log": {"log_interval": 3},
            },
        )
        job_dir = folder / "ckpt" / JOB
        latencies, step_times = [], []
        try:
            invoke("init", "--config", str(config))
            for _ in range(2 if quick else 5):
                invoke("start", "--config", str(config))
                wait_for_metrics(job_dir, 4)
                start = time.perf_counter()
                invoke("stop", "--config", str(config))
                latencies.append(time.perf_counter() - start)
                latest = latest_complete_checkpoint(job_dir)
                if latest is None or latest.meta.reason != "emergency":
                    raise RuntimeError("stop left no emergency checkpoint")
                step_times.append(_step_seconds(job_dir))
                (job_dir / "metrics.jsonl").unlink()
        finally:
            subprocess.run(
                [
                    "docker",
                    "compose",
                    "--project-name",
                    compose.project_name(JOB),
                    "down",
                    "--rmi",
                    "local",
                    "--timeout",
                    "5",
                ],
                capture_output=True,
            )
        save_times = _save_seconds(folder, params, data)
    figures = Figures()
    latency = figures.median("stop_latency_s", latencies)
    figures.median("stop_step_s", step_times)
    figures.median("stop_save_s", save_times)
    figures.fraction(
        "stop_latency_units",
        latency,
        figures["stop_step_s"] + figures["stop_save_s"],
        {"stop_seconds": latencies, "step_seconds": step_times, "save_seconds": save_times},
    )
    return figures
