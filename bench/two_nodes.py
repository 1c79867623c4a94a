"""Two nodes against one: what the rendezvous and host networking cost, and how fast a stop on node 1 ends both.

The same `small` job (26M parameters, the same global batch) runs in containers on this machine twice:
as 1 node with 2 CPU processes (`torchrun --standalone`), and as 2 nodes with 1 process each
(two Compose projects on one engine, host networking, rendezvous on 127.0.0.1 over the loopback
interface). tokens/s is the median of the jobs' own progress records after the first.
`stop_latency_two_nodes_s` is `invoke stop --node 1` until both containers have exited with
one emergency checkpoint written by node 0.
"""

from __future__ import annotations

import json
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from astrai.common.checkpoints import latest_complete_checkpoint
from astrai.host import compose, engine
from bench.common import Figures, invoke, wait_for_metrics, write_config
from bench.trainer_speed import make_assets

JOB = "bench-nodes"
PRESET, WINDOW, BATCH = "small", 64, 4


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _config(folder: Path, params: Path, data: Path, base_image: str, nodes: bool, steps: int) -> Path:
    runtime = {
        "job_name": JOB,
        "paths": {"data": str(data), "model": str(params), "checkpoints": str(folder / "ckpt")},
        "gpu": {"devices": "none", "processes": 1 if nodes else 2},
        "container": {"cuda_tag": "cpu", "base_image": base_image},
        # One thread per process in both layouts (torchrun sets it for 2 local processes, not for 1).
        "environment": {"OMP_NUM_THREADS": "1"},
    }
    if nodes:
        runtime["nodes"] = {"count": 2, "rendezvous": f"127.0.0.1:{_free_port()}", "network_interface": "lo"}
    return write_config(
        folder,
        runtime,
        {
            "data": {"data_root_path": "/data", "window_size": WINDOW, "num_workers": 1},
            "training": {"max_steps": steps, "batch_per_device": BATCH, "global_batch_size": 2 * BATCH},
            "ckpt": {"ckpt_interval": 10**6},
            "log": {"log_interval": 2},
        },
    )


def _wait_exit(project: str, timeout: float = 900) -> engine.Container:
    found = engine.find_container(project)
    subprocess.run(["docker", "wait", found.id], capture_output=True, timeout=timeout)
    return engine.inspect_container(found.id)


def _tokens_per_s(job_dir: Path) -> list[float]:
    """tokens/s of every progress record after the first (which includes the start-up)."""
    records = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [record["tokens_per_s"] for record in records[1:]]


def _projects(nodes: bool) -> list[str]:
    return [compose.project_name(JOB, node) for node in (0, 1)] if nodes else [compose.project_name(JOB)]


def _start(config: Path, nodes: bool) -> None:
    for node in (1, 0) if nodes else (0,):
        invoke("start", "--config", str(config), "--node", str(node))


def run(quick: bool, base_image: str) -> dict:
    steps = 20 if quick else 60
    figures = Figures()
    with tempfile.TemporaryDirectory(prefix="astrai-bench-nodes-") as work:
        folder = Path(work)
        params, data = make_assets(folder, PRESET)
        job_dir = folder / "ckpt" / JOB
        try:
            rates = {}
            for nodes in (False, True):
                config = _config(folder, params, data, base_image, nodes, steps)
                invoke("init", "--config", str(config))
                _start(config, nodes)
                for project in _projects(nodes):
                    if _wait_exit(project).exit_code != 0:
                        raise RuntimeError(f"the benchmark job {project} failed")
                rates[nodes] = _tokens_per_s(job_dir)
                subprocess.run(["rm", "-rf", str(job_dir)], check=True)
            figures.median("two_node_tokens_per_s", rates[True])
            figures.median("one_node_tokens_per_s", rates[False])
            figures.quotient("two_node_vs_one", "two_node_tokens_per_s", "one_node_tokens_per_s")

            latencies = []
            config = _config(folder, params, data, base_image, True, 10**6)
            for _ in range(1 if quick else 3):
                _start(config, True)
                wait_for_metrics(job_dir, 3, "the two-node benchmark job")
                start = time.perf_counter()
                invoke("stop", "--config", str(config), "--node", "1")
                codes = [_wait_exit(project).exit_code for project in _projects(True)]
                latencies.append(time.perf_counter() - start)
                latest = latest_complete_checkpoint(job_dir)
                if codes != [0, 0] or latest is None or latest.meta.reason != "emergency":
                    raise RuntimeError(f"the stop on node 1 did not end both nodes cleanly (exit codes {codes})")
                (job_dir / "metrics.jsonl").unlink()
            figures.median("stop_latency_two_nodes_s", latencies)
        finally:
            for project in _projects(False) + _projects(True):
                subprocess.run(
                    ["docker", "compose", "--project-name", project, "down", "--rmi", "local", "--timeout", "5"],
                    capture_output=True,
                )
    return figures
