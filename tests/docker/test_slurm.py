"""`invoke submit` on a real Slurm cluster (one controller, two compute nodes on this host), launcher docker.

Each node's task starts its container on the local engine as `invoke start --node N`
does; the rendezvous comes from the allocation (the first node's NodeAddr). The
tests: a time limit shorter than the run stops, checkpoints, requeues and finishes
in a later allocation with bitwise the final weights of an uninterrupted run beside
it (which is also the test of a two-node job trained to the end); `invoke stop` and
a plain `scancel` stop a job with an emergency checkpoint and no requeue; a task
killed outright takes its container with it. After each, no trainer container runs.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import _tear_down
from test_nodes import _NodeView

from astrai.common.checkpoints import list_complete_checkpoints
from astrai.common.contract import WEIGHTS_FILE
from astrai.host import compose, engine, slurm_script

pytestmark = [pytest.mark.docker, pytest.mark.slow]

ONE_THREAD = {"OMP_NUM_THREADS": "1"}
STOP_TIMEOUT = 15
"""The warning comes STOP_TIMEOUT + 30 s before the time limit."""


@pytest.fixture
def slurm_job(make_job, cluster):
    """make_job for a two-node Slurm job; every node's Compose project goes when the test ends."""
    made = []

    def factory(time_limit: str = "00:10:00", max_steps: int = 120, requeue: bool = True, **trainer):
        job = make_job(
            runtime={
                "nodes": {"count": 2, "network_interface": "lo", "failure_timeout_seconds": 20},
                "container": {"stop_timeout_seconds": STOP_TIMEOUT, "stop_grace_period": f"{STOP_TIMEOUT + 10}s"},
                "environment": ONE_THREAD,
                "slurm": {"time": time_limit, "requeue": requeue},
            },
            trainer={"training": {"max_steps": max_steps}, "ckpt": {"ckpt_interval": 40}, **trainer},
            env={"SLURM_CONF": cluster.env["SLURM_CONF"]},
        )
        made.append(job)
        return job

    yield factory
    for job in made:
        _cancel_all(cluster, job)
        for node in (0, 1):
            _tear_down(_NodeView(job, node))


def _cancel_all(cluster, job) -> None:
    cluster.run("scancel", f"--name={job.name}", check=False)


def _submit(job) -> int:
    done = job.invoke("submit")
    match = re.search(r"^Submitted batch job (\d+)$", done.stdout, re.MULTILINE)
    assert match, done.stdout
    return int(match.group(1))


def _state(cluster, job_id: int) -> dict:
    result = cluster.run("scontrol", "show", "job", "--oneliner", str(job_id), check=False)
    return dict(re.findall(r"(\w+)=(\S*)", result.stdout))


def _wait_state(cluster, job, job_id: int, states: tuple[str, ...], timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fields = _state(cluster, job_id)
        if fields.get("JobState") in states:
            return fields
        time.sleep(1)
    raise AssertionError(f"job {job_id} not {states} after {timeout} s: {fields}\n{_output(job, job_id)}")


def _output(job, job_id: int) -> str:
    path = job.job_dir / compose.STATE_DIR_NAME / slurm_script.SLURM_DIR_NAME / f"slurm-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else "(no output)"


def _running_containers(job) -> list[str]:
    names = []
    for node in (0, 1):
        project = compose.project_name(job.name, node)
        names += subprocess.run(
            ["docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={project}"],
            capture_output=True,
            text=True,
        ).stdout.split()
    return names


def _final_weights(job) -> tuple[int, str, str]:
    newest = list_complete_checkpoints(job.job_dir)[-1]
    return newest.step, newest.meta.reason, hashlib.sha256((newest.path / WEIGHTS_FILE).read_bytes()).hexdigest()


def _wait_requeued(cluster, job, job_id: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fields = _state(cluster, job_id)
        if fields.get("JobState") == "PENDING" and int(fields.get("Restarts", "0")) >= 1:
            return fields
        time.sleep(1)
    raise AssertionError(f"job {job_id} was not requeued within {timeout} s: {fields}\n{_output(job, job_id)}")


def _skip_the_requeue_delay(cluster, job_id: int) -> None:
    """Slurm makes a requeued job wait about two minutes before it is eligible again; the test waits only
    until the first allocation's step daemons are gone (started any sooner, the job fails to launch), and gives
    the next allocation room to finish."""
    deadline = time.monotonic() + 120
    while _step_daemons(job_id) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _step_daemons(job_id), f"the first allocation of job {job_id} did not end"
    time.sleep(2)
    # The next allocation finishes the run: its own time limit is not what the test is about, and on a loaded
    # machine the rest of the steps may not fit in the first one's.
    cluster.run("scontrol", "update", f"JobId={job_id}", "TimeLimit=00:15:00")
    cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")


def _step_daemons(job_id: int) -> list[int]:
    """Pids of the slurmstepd processes of ``job_id`` (their titles read "slurmstepd: [ID.STEP]")."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                title = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if title.startswith(f"slurmstepd: [{job_id}.".encode()):
                found.append(int(entry.name))
    return found


def test_a_time_limit_stops_checkpoints_requeues_and_finishes_bitwise_as_an_uninterrupted_run(slurm_job, cluster):
    """The uninterrupted run beside the limited one is also the plain case: a two-node job trained to the end, which
    status shows while it runs, a second start refuses, and whose logs the host reads."""
    # The limited run must still be training when the warning comes, 75 s into its allocation: 400 steps once ended
    # in 57 s on a quiet machine; 1200 take two minutes or more here.
    steps, saves = 1200, {"ckpt_interval": 200}
    reference = slurm_job(max_steps=steps, ckpt=saves)
    limited = slurm_job(time_limit="00:02:00", max_steps=steps, ckpt=saves)
    reference_id, limited_id = _submit(reference), _submit(limited)  # side by side: one CPU of each node each
    for job, job_id in ((reference, reference_id), (limited, limited_id)):
        assert _wait_state(cluster, job, job_id, ("RUNNING",), 60)["NodeList"] == "n[1-2]"
    reference.wait_for("training on both nodes", lambda: reference.progress_step() >= 5, timeout=300)
    status = reference.invoke("status").stdout
    assert re.search(rf"slurm\s+job {reference_id} RUNNING on n\[1-2\]", status), status
    by_hand = reference.invoke("start", check=False)  # a second trainer on the same job dir
    assert by_hand.returncode == 2 and f"submitted to Slurm (job {reference_id}" in by_hand.stderr, by_hand
    # The warning comes STOP_TIMEOUT + 30 s before the limit (Slurm may send it up to a minute early).
    _wait_requeued(cluster, limited, limited_id, 180)
    first = _output(limited, limited_id)
    assert "the time limit is near" in first and "requeued: the next allocation resumes" in first, first
    assert [reason for _, reason in limited.checkpoints()][-1] == "emergency", first
    assert _running_containers(limited) == []
    _skip_the_requeue_delay(cluster, limited_id)
    _wait_state(cluster, limited, limited_id, ("RUNNING",), 120)
    for job, job_id in ((limited, limited_id), (reference, reference_id)):
        _wait_state(cluster, job, job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 900)
    fields = _state(cluster, limited_id)
    output = _output(limited, limited_id)
    assert fields["JobState"] == "COMPLETED" and int(fields["Restarts"]) >= 1, output
    assert "allocation 2" in output and "resumed from" in output
    assert _final_weights(limited) == _final_weights(reference), output
    assert _final_weights(limited)[:2] == (steps, "final")
    plain = _output(reference, reference_id)
    assert _state(cluster, reference_id)["JobState"] == "COMPLETED", plain
    assert "0: astrai: node 0 of 2" in plain and "1: astrai: node 1 of 2" in plain
    logs = reference.invoke("logs", "--no-follow", "--tail", "all").stdout
    assert "final checkpoint" in logs and f"Slurm job {reference_id}" in logs
    assert _running_containers(limited) == _running_containers(reference) == []


@pytest.mark.parametrize("how", ["invoke stop", "scancel"])
def test_a_stop_checkpoints_on_every_node_and_never_requeues(slurm_job, cluster, how):
    job = slurm_job(max_steps=100_000)
    job_id = _submit(job)
    job.wait_for("training on both nodes", lambda: job.progress_step() >= 5, timeout=300)
    if how == "invoke stop":
        stopped = job.invoke("stop")
        assert f"stopping Slurm job {job_id}" in stopped.stdout and "emergency checkpoint" in stopped.stdout, stopped
        expected = "COMPLETED"
    else:
        cluster.run("scancel", str(job_id))
        expected = "CANCELLED"
    fields = _wait_state(cluster, job, job_id, ("COMPLETED", "CANCELLED", "FAILED"), STOP_TIMEOUT + 60)
    output = _output(job, job_id)
    assert fields["JobState"] == expected and fields["Restarts"] == "0", output
    assert job.checkpoints()[-1][1] == "emergency", output
    time.sleep(3)
    assert _state(cluster, job_id)["JobState"] == expected  # not requeued
    assert _running_containers(job) == []


def test_a_task_killed_outright_takes_its_container_with_it(slurm_job, cluster):
    """SIGKILL (a time limit's end, a node's supervisor dying): no stop runs on the host, the container ends itself."""
    job = slurm_job(max_steps=100_000)
    job_id = _submit(job)
    job.wait_for("training on both nodes", lambda: job.progress_step() >= 5, timeout=300)
    task = _node_task(job, node=1)
    os.kill(task, signal.SIGKILL)
    killed = time.monotonic()
    _wait_state(cluster, job, job_id, ("COMPLETED", "CANCELLED", "FAILED"), STOP_TIMEOUT + 90)
    deadline = killed + STOP_TIMEOUT + 60
    while _running_containers(job) and time.monotonic() < deadline:
        time.sleep(1)
    assert _running_containers(job) == [], _output(job, job_id)
    assert _state(cluster, job_id).get("Restarts") == "0"
    watched = _container_logs(job, node=1)
    assert "the Slurm task that started this container (host pid" in watched and "is gone" in watched, watched


def _container_logs(job, node: int) -> str:
    found = engine.find_container(compose.project_name(job.name, node))
    assert found is not None, f"no container of node {node}"
    done = subprocess.run(["docker", "logs", found.id], capture_output=True, text=True)
    return done.stdout + done.stderr


def _node_task(job, node: int) -> int:
    """The pid of `python -m astrai.host.slurm_node` for one node of this job."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"astrai.host.slurm_node" in command and str(job.config).encode() in command:
            if f"SLURM_NODEID={node}".encode() in environ:
                return int(entry.name)
    raise AssertionError(f"no task of node {node} for {job.name}")
