"""The whole job lifecycle on the real engine, on CPU: what a user runs and what they see."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from astrai.host import compose, timer
from tests.support import interruptible, invoke_command

pytestmark = pytest.mark.docker

LONG = {"training": {"max_steps": 100000}}


def _stop_after_progress(job, steps: int = 20) -> int:
    job.wait_for(f"step {steps}", lambda: job.progress_step() >= steps)
    result = job.invoke("stop")
    assert "emergency checkpoint" in result.stdout, result.stdout
    final = job.container()
    assert final is not None and final.status == "exited" and final.exit_code == 0
    step, reason = job.checkpoints()[-1]
    assert reason == "emergency" and step >= steps
    return step


def test_init_preflight_start_stop_resume_finish(make_job):
    job = make_job(trainer=LONG)
    job.invoke("init")
    job.invoke("preflight")
    started = job.invoke("start")
    assert "invoke logs" in started.stdout and "starting from the base model" in started.stdout

    job.wait_for("a progress line", lambda: job.progress_step() >= 10)
    logs = job.invoke("logs", "--no-follow", "--tail", "20").stdout
    assert re.search(r"step \d+/100000", logs), logs
    status = job.invoke("status").stdout
    assert "running" in status and "step " in status, status

    stopped_at = _stop_after_progress(job)
    status = job.invoke("status").stdout
    assert "exited (exit code 0)" in status, status
    assert re.search(rf"latest .*epoch_\d+_step_{stopped_at} \(emergency", status), status

    target = stopped_at + 30
    job.invoke("start", "--", "--max_steps", str(target))
    final = job.wait_for_exit()
    assert final.exit_code == 0, job.logs()
    logs = job.logs()
    assert re.search(rf"resumed from /checkpoints/{re.escape(job.name)}/epoch_\d+_step_{stopped_at}\b", logs), logs
    step, reason = job.checkpoints()[-1]
    assert (step, reason) == (target, "final")
    # Following the logs of a container that has exited shows them and returns (it waited forever), and a pipe
    # gets no terminal codes.
    followed = job.invoke("logs", "--tail", "5", timeout=60)
    assert f"final checkpoint /checkpoints/{job.name}/" in followed.stdout and "\x1b[" not in followed.stdout
    assert job.invoke("latest").stdout.strip().endswith(f"_step_{target}")
    assert "not running; nothing to stop" in job.invoke("stop").stdout

    leftover = job.job_dir / ".staging-epoch_9_step_999-1-dead"
    leftover.mkdir()
    before = job.checkpoints()
    assert "would remove" in job.invoke("clean", "--keep", "1").stdout and job.checkpoints() == before
    cleaned = job.invoke("clean", "--keep", "1", "--force")
    assert "1 staging folder(s)" in cleaned.stdout and not leftover.exists()
    assert job.checkpoints() == [(target, "final")]


def test_start_refuses_a_running_job(make_job):
    job = make_job(trainer=LONG)
    job.invoke("init")
    job.invoke("start")
    again = job.invoke("start", check=False)
    assert again.returncode != 0 and "already running" in again.stderr
    job.wait_for("progress", lambda: job.progress_step() >= 1)  # past the trainer's own start-up clean-up
    leftover = job.job_dir / ".staging-epoch_9_step_999-1-dead"
    leftover.mkdir()
    cleaned = job.invoke("clean", "--force")
    assert "staging folders kept: a trainer may be writing them" in cleaned.stdout and leftover.exists()
    job.invoke("stop")


def test_foreground_dry_run_prints_the_resolved_config_and_exits_0(make_job):
    job = make_job()
    job.invoke("init")
    result = job.invoke("start", "--foreground", "--", "--dry-run")
    assert result.returncode == 0
    assert "max_steps" in result.stdout and "world size" in result.stdout.lower(), result.stdout
    assert job.checkpoints() == []


def test_foreground_ctrl_c_stops_gracefully(make_job):
    job = make_job(trainer=LONG)
    job.invoke("init")
    process = subprocess.Popen(
        invoke_command("start", "--foreground", "--config", str(job.config)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=interruptible,  # reached by the Ctrl-C even when the suite runs in the background
    )
    try:
        job.wait_for("progress", lambda: job.progress_step() >= 10, timeout=300)
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=120)
    finally:
        process.kill()
    assert "stopping the job gracefully" in output, output
    final = job.container()
    assert final is not None and not final.running and final.exit_code == 0
    assert job.checkpoints()[-1][1] == "emergency"


def test_two_jobs_run_side_by_side(make_job):
    first, second = make_job(trainer=LONG), make_job(trainer=LONG)
    for job in (first, second):
        job.invoke("init")
        job.invoke("start")
    for job in (first, second):
        job.wait_for(f"{job.name} progress", lambda job=job: job.progress_step() >= 10)
    _stop_after_progress(first)
    assert second.container().running, "stopping one job must not touch the other"
    _stop_after_progress(second)
    assert first.container().id != second.container().id
    assert {c for c in os.listdir(first.folder / "checkpoints")} == {first.name}


def test_cpu_ddp_with_two_processes_stops_and_resumes(make_job):
    job = make_job(runtime={"gpu": {"devices": "none", "processes": 2}}, trainer=LONG)
    job.invoke("init")
    job.invoke("start")
    stopped_at = _stop_after_progress(job)
    logs = job.logs()
    assert "2 process(es), parallel_mode ddp" in logs
    job.invoke("start", "--", "--max_steps", str(stopped_at + 20))
    final = job.wait_for_exit()
    assert final.exit_code == 0, job.logs()
    assert f"_step_{stopped_at}" in job.logs() and job.checkpoints()[-1] == (stopped_at + 20, "final")


@pytest.mark.parametrize("runtime", [None, {"gpu": {"devices": "none", "processes": 2}}], ids=["one", "ddp"])
def test_a_stop_while_the_trainer_starts_is_still_graceful(make_job, runtime):
    job = make_job(runtime=runtime, trainer=LONG)
    job.invoke("init")
    job.invoke("start")
    result = job.invoke("stop")  # at once: the container is still importing torch
    final = job.container()
    assert final.exit_code == 0, result.stdout + job.logs()
    assert "emergency checkpoint" in result.stdout, result.stdout
    checkpoints = job.checkpoints()
    assert len(checkpoints) == 1 and checkpoints[0][1] == "emergency", checkpoints


def test_max_duration_stops_the_job_on_its_own(make_job):
    job = make_job(runtime={"container": {"max_duration_hours": 0.006}}, trainer=LONG)  # about 22 s
    job.invoke("init")
    started = job.invoke("start")
    assert "a timer stops it gracefully" in started.stdout
    assert "graceful stop in" in job.invoke("status").stdout
    final = job.wait_for_exit(timeout=300)
    assert final.exit_code == 0
    assert job.checkpoints()[-1][1] == "emergency"
    state_dir = job.job_dir / compose.STATE_DIR_NAME
    job.wait_for("the timer to clean up", lambda: not (state_dir / timer.TIMER_FILE_NAME).exists(), timeout=30)


def test_manual_stop_cancels_the_timer(make_job):
    job = make_job(runtime={"container": {"max_duration_hours": 1}}, trainer=LONG)
    job.invoke("init")
    job.invoke("start")
    state_dir = job.job_dir / compose.STATE_DIR_NAME
    scheduled = timer.read_timer(state_dir)
    assert scheduled is not None
    job.wait_for("progress", lambda: job.progress_step() >= 5)
    job.invoke("stop")
    assert timer.read_timer(state_dir) is None
    assert not (state_dir / timer.TIMER_FILE_NAME).exists()
    time.sleep(0.5)
    assert (
        not os.path.exists(f"/proc/{scheduled.pid}")
        or b"astrai.host.timer" not in open(f"/proc/{scheduled.pid}/cmdline", "rb").read()
    )
    assert "timer       none" in job.invoke("status").stdout


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act for another user, as under sudo")
def test_files_written_by_the_container_belong_to_the_host_user(make_job):
    job = make_job(trainer={"training": {"max_steps": 20}}, env={"SUDO_UID": "4321", "SUDO_GID": "4321"})
    job.invoke("init")
    assert job.job_dir.stat().st_uid == 4321
    job.invoke("start", "--foreground")
    assert job.checkpoints()[-1] == (20, "final")
    owners = {
        (path.stat().st_uid, path.stat().st_gid)
        for path in job.job_dir.rglob("*")
        if compose.STATE_DIR_NAME not in path.parts
    }
    assert owners == {(4321, 4321)}, owners
