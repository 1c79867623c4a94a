"""Several hosts on one engine: two nodes as two containers with host networking and one CPU process each.

The nodes meet at 127.0.0.1:<free port> over the loopback interface, the same code path as two hosts.
Every job here is tiny: two CPU cores run both nodes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import pytest
import yaml
from conftest import REPO, Job, _tear_down

from astrai.common.checkpoints import list_complete_checkpoints
from astrai.host import compose, engine
from tests.support import free_port, run_python

pytestmark = pytest.mark.docker

# Long enough that a stop asked for at step 12 lands well before the end on a fast machine (30 steps did not).
GLOBAL_BATCH_STEPS = 80
GLOBAL_BATCH = {
    "training": {"max_steps": GLOBAL_BATCH_STEPS, "batch_per_device": 8, "global_batch_size": 16},
    "ckpt": {"ckpt_interval": 10},
    "log": {"log_interval": 1},
}


# Two containers share two busy cores: one thread each keeps their all-reduces from spinning against each other.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def _nodes(backend: str = "static", timeout: int = 300) -> dict:
    return {
        "count": 2,
        "rendezvous": f"127.0.0.1:{free_port()}",
        "backend": backend,
        "network_interface": "lo",
        "failure_timeout_seconds": timeout,
    }


@pytest.fixture
def node_jobs(make_job):
    """make_job for multi-node jobs: every node's Compose project and image go too when the test ends."""
    made = []

    def factory(**kwargs):
        job = make_job(**kwargs)
        made.append(job)
        return job

    yield factory
    for job in made:
        for node in (0, 1):
            _tear_down(_NodeView(job, node))


class _NodeView:
    """What the shared tear-down reads, for one node's Compose project."""

    def __init__(self, job, node: int):
        self.job_dir = job.job_dir
        self.project = compose.project_name(job.name, node)


def _container(job, node: int) -> engine.Container | None:
    return engine.find_container(compose.project_name(job.name, node))


def _logs(job, node: int) -> str:
    found = _container(job, node)
    if found is None:
        return ""
    result = subprocess.run(["docker", "logs", found.id], capture_output=True, text=True)
    return result.stdout + result.stderr


def _wait_exit(job, node: int, timeout: float) -> engine.Container:
    found = _container(job, node)
    assert found is not None
    subprocess.run(["docker", "wait", found.id], capture_output=True, timeout=timeout)
    return engine.inspect_container(found.id)


def _losses(job) -> dict[int, float]:
    lines = (job.job_dir / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record["loss"] for record in map(json.loads, lines)}


def _start_both(job) -> None:
    # Node 1 first: nodes may start in any order.
    assert "node 1 of 2" in job.invoke("start", "--node", "1").stdout
    job.invoke("start", "--node", "0")


def test_two_nodes_train_stop_from_node_1_and_resume_on_one_node_with_the_same_losses(node_jobs, tmp_path):
    job = node_jobs(runtime={"nodes": _nodes(), "environment": ONE_THREAD}, trainer=GLOBAL_BATCH)
    job.invoke("init")
    _start_both(job)
    status = job.invoke("status", "--node", "1").stdout
    assert "node        1 of 2, world size 2" in status and "running" in status, status
    job.wait_for(
        "step 12 and a periodic checkpoint", lambda: job.progress_step() >= 12 and job.checkpoints(), timeout=600
    )

    stopped = job.invoke("stop", "--node", "1")
    assert "emergency checkpoint" in stopped.stdout, stopped.stdout
    finals = [_wait_exit(job, node, 120) for node in (0, 1)]
    assert [final.exit_code for final in finals] == [0, 0], _logs(job, 0) + _logs(job, 1)
    reasons = [reason for _, reason in job.checkpoints()]
    assert reasons.count("emergency") == 1 and reasons[-1] == "emergency" and "periodic" in reasons
    assert "lost node" not in _logs(job, 0) + _logs(job, 1)

    # The same job on one node with one process: grad_accum_steps becomes 2, the global batch stays 16.
    document = yaml.safe_load(job.config.read_text())
    del document["runtime"]["nodes"]
    job.config.write_text(yaml.safe_dump(document, sort_keys=False))
    job.invoke("start")
    final = job.wait_for_exit(timeout=600)
    assert final.exit_code == 0, job.logs()
    assert job.checkpoints()[-1] == (GLOBAL_BATCH_STEPS, "final")

    # An uninterrupted single-node run of the same config, for reference (the trainer on the host).
    reference_dir = tmp_path / "reference"
    run = run_python(
        "-m",
        "astrai.train",
        "--config",
        str(job.config),
        "--ckpt_dir",
        str(reference_dir),
        "--param_path",
        str(job.folder / "params"),
        "--data_root_path",
        str(job.folder / "data"),
        timeout=600,
        env={"PYTHONPATH": str(REPO)},
    )
    assert run.returncode == 0, run.stderr
    expected = {
        record["step"]: record["loss"]
        for record in map(json.loads, (reference_dir / "metrics.jsonl").read_text().splitlines())
    }
    got = _losses(job)
    assert sorted(got) == sorted(expected) == list(range(1, GLOBAL_BATCH_STEPS + 1))
    # Two ranks' all-reduced gradients and one process's accumulated ones round apart: the losses agree to 1e-3 for
    # the first 20 steps, and float32's drift grows (lr 3e-3 on a tiny model) over the rest (1.03e-3 at step 26).
    # The order of the data and the schedule are held bitwise by the trainer's own resume tests.
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-3 if step <= 20 else 1e-2), step


def test_a_killed_node_ends_the_other_within_the_failure_timeout_and_both_restart(node_jobs):
    timeout = 20
    job = node_jobs(
        runtime={"nodes": _nodes(timeout=timeout), "environment": ONE_THREAD},
        trainer={"training": {"max_steps": 60}, "ckpt": {"ckpt_interval": 10}},
    )
    job.invoke("init")
    _start_both(job)
    job.wait_for("step 15", lambda: job.progress_step() >= 15, timeout=600)
    subprocess.run(["docker", "kill", _container(job, 1).id], check=True, capture_output=True)
    killed = time.monotonic()
    final = _wait_exit(job, 0, timeout + 30)
    elapsed = time.monotonic() - killed
    assert final.exit_code != 0
    assert elapsed <= timeout, elapsed
    assert "lost node 1" in _logs(job, 0), _logs(job, 0)

    _start_both(job)
    finals = [_wait_exit(job, node, 600) for node in (0, 1)]
    assert [f.exit_code for f in finals] == [0, 0], _logs(job, 0) + _logs(job, 1)
    assert "resumed from" in _logs(job, 0)
    assert job.checkpoints()[-1] == (60, "final")


def test_c10d_rendezvous_trains_two_nodes_to_the_end(node_jobs):
    job = node_jobs(
        runtime={"nodes": _nodes("c10d"), "environment": ONE_THREAD}, trainer={"training": {"max_steps": 20}}
    )
    job.invoke("init")
    _start_both(job)
    finals = [_wait_exit(job, node, 600) for node in (0, 1)]
    assert [f.exit_code for f in finals] == [0, 0], _logs(job, 0) + _logs(job, 1)
    assert "node 0 of 2" in _logs(job, 0) and "node 1 of 2" in _logs(job, 1)
    assert job.checkpoints()[-1] == (20, "final")


def test_a_crashed_trainer_is_restarted_and_finishes(make_job):
    job = make_job(
        runtime={"container": {"max_restarts": 2}, "environment": ONE_THREAD},
        trainer={"training": {"max_steps": 30}, "ckpt": {"ckpt_interval": 10}},
    )
    job.invoke("start")
    job.wait_for("step 12 (after the checkpoint at 10)", lambda: job.progress_step() >= 12, timeout=600)
    first = job.container()
    trainer = _trainer_pid(first.id)
    os.kill(trainer, signal.SIGKILL)  # as the OOM killer would
    job.wait_for("the restart", lambda: (job.container().restart_count or 0) >= 1, timeout=120)
    final = job.wait_for_exit(timeout=600)
    assert final.exit_code == 0 and final.id == first.id, job.logs()
    assert job.checkpoints()[-1] == (30, "final")
    assert "resumed from" in job.logs()
    status = job.invoke("status").stdout
    assert "restarts    1 of 2 allowed after a crash; last crash: exit code 137" in status, status


def _trainer_pid(container_id: str) -> int:
    """Host pid of the trainer process of a container (`docker top` lists host pids)."""
    listing = subprocess.run(
        ["docker", "top", container_id, "-eo", "pid,args"], capture_output=True, text=True, check=True
    ).stdout.splitlines()[1:]
    pids = [int(line.split()[0]) for line in listing if "astrai.train" in line]
    assert pids, listing
    return pids[0]


def test_sharded_checkpoints_on_two_nodes_need_one_shared_folder(node_jobs, tmp_path):
    runtime = {"nodes": _nodes(), "environment": ONE_THREAD, "gpu": {"parallel_mode": "fsdp"}}
    trainer = {"training": {"max_steps": 20}, "ckpt": {"ckpt_interval": 10}}
    # Both nodes' containers bind-mount the same host folder: the shared file system.
    shared = node_jobs(runtime=runtime, trainer=trainer)
    shared.invoke("init")
    checklist = shared.invoke("preflight", "--node", "1", check=False).stdout
    assert "shared checkpoints" in checklist and "one shared file system on all 2 nodes" in checklist, checklist
    _start_both(shared)
    finals = [_wait_exit(shared, node, 600) for node in (0, 1)]
    assert [f.exit_code for f in finals] == [0, 0], _logs(shared, 0) + _logs(shared, 1)
    written = list_complete_checkpoints(shared.job_dir)
    assert [c.step for c in written] == [10, 20] and {c.meta.format for c in written} == {"sharded"}

    # Node 1 on a host of its own: its checkpoints folder is another one, and the job refuses before any step.
    apart = node_jobs(runtime={**runtime, "nodes": _nodes()}, trainer=trainer)
    other = Job(apart.name, tmp_path / "other-host" / apart.name, apart.env)
    other.folder.mkdir(parents=True)
    for name in ("params", "data"):
        shutil.copytree(apart.folder / name, other.folder / name)
    shutil.copyfile(apart.config, other.config)
    apart.invoke("init")
    other.invoke("init")
    assert "node 1 of 2" in other.invoke("start", "--node", "1").stdout
    apart.invoke("start", "--node", "0")
    finals = [_wait_exit(apart, node, 300) for node in (0, 1)]
    output = _logs(apart, 0) + _logs(apart, 1)
    assert all(f.exit_code != 0 for f in finals), output
    assert "ckpt.format sharded: node(s) 1 do not share the job dir /checkpoints/" in output, output
    assert "ckpt.format: full" in output
    assert not list_complete_checkpoints(apart.job_dir) and not list_complete_checkpoints(other.job_dir)
