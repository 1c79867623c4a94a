"""Slurm, from the login host: submit the script (:mod:`astrai.host.slurm_script`), then status, logs and stop.

What runs inside the allocation is :mod:`astrai.host.slurm_node`; this module never imports it (nor anything
that imports this one), so the host's job commands and the node task stay apart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from astrai.common.atomic import write_text_atomically
from astrai.common.checkpoints import emergency_since, latest_complete_checkpoint
from astrai.common.values import format_clock
from astrai.host.hostuser import make_dirs
from astrai.host.preflight import FAIL, PASS, WARN, Check
from astrai.host.runtime import Runtime
from astrai.host.slurm_script import (
    MIN_WORK_SECONDS,
    OUTPUT_NAME,
    SCRIPT_NAME,
    SIGNAL_MARGIN_SECONDS,
    SUBMITTED_NAME,
    SlurmError,
    gpus_per_node,
    parse_time_limit,
    render_script,
    signal_lead_seconds,
    slurm_dir,
    slurm_settings,
)

ACTIVE_STATES = (
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "SPECIAL_EXIT",
    "RESIZING",
    "SUSPENDED",
    "STOPPED",
)
NOT_STARTED_STATES = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SPECIAL_EXIT")
"""States in which no allocation runs: a stop is a plain scancel."""
# --- submit ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Submission:
    job_id: int
    submitted_at: float
    script: str


@dataclass(frozen=True)
class SlurmJob:
    """What Slurm says about a submitted job (``scontrol show job``); state None when it no longer knows it."""

    job_id: int
    state: str | None
    reason: str | None = None
    nodes: str | None = None
    run_time: str | None = None
    time_limit: str | None = None
    restarts: int = 0

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES


def submission(runtime: Runtime) -> Submission | None:
    """The newest `invoke submit` of this job, or None."""
    try:
        record = json.loads((slurm_dir(runtime) / SUBMITTED_NAME).read_text(encoding="utf-8"))
        return Submission(int(record["job_id"]), float(record["submitted_at"]), str(record["script"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def submit(runtime: Runtime, trainer_args: list[str]) -> tuple[Submission, str]:
    """Write the script under the job dir and submit it; return the record and sbatch's own line."""
    script = render_script(runtime, trainer_args)
    folder = slurm_dir(runtime)
    make_dirs(folder)
    with _submit_lock(runtime):
        check_not_submitted(runtime)
        path = folder / SCRIPT_NAME
        write_text_atomically(path, script, 0o700)
        result = run_slurm(["sbatch", str(path)])
        if result.returncode != 0:
            raise SlurmError(f"sbatch refused the job (exit {result.returncode}): {result.stderr.strip()}")
        line = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
        match = re.search(r"Submitted batch job (\d+)", line)
        if match is None:
            raise SlurmError(f"sbatch did not say which job it submitted: {result.stdout.strip()!r}")
        record = Submission(int(match.group(1)), time.time(), str(path))
        write_text_atomically(folder / SUBMITTED_NAME, json.dumps(dataclasses.asdict(record)) + "\n", 0o600)
    return record, line


def check_not_submitted(runtime: Runtime) -> None:
    """Refuse a second submit of a job Slurm still queues or runs."""
    earlier = submission(runtime)
    if earlier is None:
        return
    job = query_job(earlier.job_id)
    if job.active:
        status, stop = runtime.command("status", per_node=False), runtime.command("stop", per_node=False)
        raise SlurmError(
            f"job {runtime.job_name} is already submitted: Slurm job {job.job_id} is {job.state}; "
            f"see `{status}`, or stop it with `{stop}`"
        )


@contextlib.contextmanager
def _submit_lock(runtime: Runtime):
    path = slurm_dir(runtime) / "submit.lock"
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SlurmError(f"another `invoke submit` of job {runtime.job_name} is in progress") from None
        yield


def run_slurm(command: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    if shutil.which(command[0]) is None:
        raise SlurmError(f"{command[0]} is not installed here: run this on a host of the Slurm cluster (a login node)")
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{command[0]} did not answer within {timeout:.0f} s; is slurmctld up (`sinfo`)?") from None


def query_job(job_id: int) -> SlurmJob:
    """The job's state from ``scontrol show job`` (None once Slurm forgot it, MinJobAge after its end)."""
    result = run_slurm(["scontrol", "show", "job", "--oneliner", str(job_id)])
    if result.returncode != 0:
        if "Invalid job id" in result.stderr:
            return SlurmJob(job_id, None)
        raise SlurmError(f"scontrol show job {job_id} failed: {result.stderr.strip()}")
    fields = dict(re.findall(r"(\w+)=(\S*)", result.stdout))
    return SlurmJob(
        job_id,
        fields.get("JobState"),
        fields.get("Reason"),
        fields.get("NodeList"),
        fields.get("RunTime"),
        fields.get("TimeLimit"),
        int(fields.get("Restarts", "0") or 0),
    )


def output_path(runtime: Runtime, job_id: int) -> Path:
    return slurm_dir(runtime) / OUTPUT_NAME.replace("%j", str(job_id))


# --- status, logs, stop ---------------------------------------------------------------------------------


def active_job(runtime: Runtime) -> SlurmJob | None:
    """The submitted job while Slurm still runs (or queues) it; None otherwise or without runtime.slurm."""
    if runtime.slurm is None:
        return None
    record = submission(runtime)
    if record is None:
        return None
    job = query_job(record.job_id)
    return job if job.active else None


def status_line(runtime: Runtime) -> str | None:
    """One `invoke status` line about the submitted job, or None when there is none."""
    record = submission(runtime) if runtime.slurm is not None else None
    if record is None:
        return None
    try:
        job = query_job(record.job_id)
    except SlurmError as error:
        return f"job {record.job_id}: state unknown ({error})"
    if job.state is None:
        where = output_path(runtime, job.job_id)
        return f"job {record.job_id}: ended (Slurm no longer lists it); its output: {where}"
    detail = (
        f"on {job.nodes}" if job.state == "RUNNING" else f"({job.reason})" if job.reason not in (None, "None") else ""
    )
    times = f", {job.run_time} of {job.time_limit}" if job.run_time and job.state == "RUNNING" else ""
    restarts = f", requeued {job.restarts}×" if job.restarts else ""
    return f"job {job.job_id} {job.state} {detail}{times}{restarts}".rstrip()


def follow_output(runtime: Runtime, tail: str, follow: bool, poll: float = 0.5) -> bool:
    """Print the submitted job's output (the last ``tail`` lines), following it while the job is active.

    Returns False when this job was never submitted (the caller then shows the container's logs).
    """
    record = submission(runtime) if runtime.slurm is not None else None
    if record is None:
        return False
    path = output_path(runtime, record.job_id)
    offset = 0
    if path.exists():
        data = path.read_bytes()
        lines = data.splitlines(keepends=True)
        shown = lines if tail == "all" else lines[-int(tail) :] if int(tail) else []
        sys.stdout.write(b"".join(shown).decode("utf-8", "replace"))
        sys.stdout.flush()
        offset = len(data)
    elif not follow:
        print(f"no output yet: {path}")
    try:
        while follow:
            job = query_job(record.job_id)
            if path.exists() and path.stat().st_size > offset:
                with open(path, "rb") as handle:
                    handle.seek(offset)
                    chunk = handle.read()
                offset += len(chunk)
                sys.stdout.write(chunk.decode("utf-8", "replace"))
                sys.stdout.flush()
            elif not job.active:
                break
            time.sleep(poll)
    except KeyboardInterrupt:
        pass
    return True


def stop_submitted(runtime: Runtime, job: SlurmJob, say=print) -> None:
    """`invoke stop` of a submitted job: a graceful stop on every node, no requeue; wait until it ended."""
    if job.state in NOT_STARTED_STATES:
        result = run_slurm(["scancel", str(job.job_id)])
        if result.returncode != 0:
            raise SlurmError(f"scancel {job.job_id} failed: {result.stderr.strip()}")
        say(f"Slurm job {job.job_id} was {job.state} (nothing ran yet); cancelled it")
        return
    say(
        f"stopping Slurm job {job.job_id} of {runtime.job_name}: every node stops gracefully, up to "
        f"{runtime.stop_timeout_seconds} s for the emergency checkpoint; no requeue"
    )
    started, asked = time.monotonic(), time.time()
    result = run_slurm(["scancel", "--batch", "--signal=USR2", str(job.job_id)])
    if result.returncode != 0:
        raise SlurmError(f"scancel --batch --signal=USR2 {job.job_id} failed: {result.stderr.strip()}")
    deadline = started + runtime.stop_timeout_seconds + SIGNAL_MARGIN_SECONDS + 60
    while time.monotonic() < deadline:
        now = query_job(job.job_id)
        if not now.active:
            break
        time.sleep(1)
    else:
        raise SlurmError(f"Slurm job {job.job_id} is still {now.state} after the stop; see `{runtime.command('logs')}`")
    seconds = time.monotonic() - started
    emergency = emergency_since(runtime.job_dir, asked)
    if emergency is not None:
        say(f"stopped in {seconds:.1f} s; emergency checkpoint {emergency.path} (step {emergency.step})")
    else:
        newest = latest_complete_checkpoint(runtime.job_dir)
        say(f"stopped in {seconds:.1f} s; newest checkpoint: {newest.path if newest else 'none'}")


# --- preflight for a submit -------------------------------------------------------------------------


def submit_checks(runtime: Runtime):
    """The Slurm side of a submit: the commands answer, the partition exists, the time and GPUs fit it."""
    try:
        return _submit_checks(runtime)
    except SlurmError as error:
        return [Check(FAIL, "slurm", str(error), "check SLURM_CONF and that the controller is up (`scontrol ping`)")]


def _submit_checks(runtime: Runtime):
    settings = slurm_settings(runtime)
    checks = []
    missing = [name for name in ("sbatch", "squeue", "scontrol", "scancel") if shutil.which(name) is None]
    if missing:
        return [
            Check(
                FAIL,
                "slurm",
                f"{', '.join(missing)} not found on this host",
                "submit from a login node of the cluster, where the Slurm client commands are installed",
            )
        ]
    reply = run_slurm(["scontrol", "ping"], timeout=15)
    if reply.returncode != 0 or "UP" not in reply.stdout:
        return [
            Check(
                FAIL,
                "slurm",
                f"slurmctld does not answer: {(reply.stdout + reply.stderr).strip()}",
                "check SLURM_CONF and that the controller is up (`scontrol ping`)",
            )
        ]
    checks.append(Check(PASS, "slurm", "sbatch, squeue, scontrol and scancel answer; slurmctld is UP"))
    partition = _partition(settings.partition)
    if partition is None:
        name = settings.partition or "(the default)"
        known = run_slurm(["sinfo", "--noheader", "--format=%R"]).stdout.split()
        return checks + [
            Check(
                FAIL,
                "partition",
                f"no partition {name} on this cluster (found: {', '.join(sorted(set(known))) or 'none'})",
                "set runtime.slurm.partition to one of them",
            )
        ]
    pname = partition["PartitionName"]
    nodes = int(partition.get("TotalNodes", "0") or 0)
    if runtime.node_count > nodes:
        checks.append(
            Check(
                FAIL,
                "partition",
                f"{pname} has {nodes} node(s), the job asks for {runtime.node_count} (runtime.nodes.count)",
                "lower runtime.nodes.count or choose a larger partition",
            )
        )
    else:
        checks.append(Check(PASS, "partition", f"{pname}: {nodes} node(s), the job takes {runtime.node_count}"))
    checks.append(_time_check(runtime, settings.time, partition))
    checks.append(_kill_wait_check(runtime))
    gpus = gpus_per_node(runtime)
    if gpus:
        checks.append(_gpu_check(pname, gpus))
    return checks


def _partition(name: str | None) -> dict | None:
    result = run_slurm(["scontrol", "show", "partition", "--oneliner", *([name] if name else [])])
    if result.returncode != 0:
        return None
    for line in result.stdout.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if name is not None or fields.get("Default") == "YES":
            return fields
    return None


def _time_check(runtime: Runtime, time_limit: str | None, partition: dict):
    lead = signal_lead_seconds(runtime)
    if time_limit is None:
        default = partition.get("DefaultTime", "NONE")
        limit = parse_time_limit(default if default != "NONE" else partition.get("MaxTime", "UNLIMITED"))
        source = f"the partition's default ({default if default != 'NONE' else partition.get('MaxTime')})"
    else:
        limit = parse_time_limit(time_limit)
        source = f"runtime.slurm.time {time_limit}"
        maximum = parse_time_limit(partition.get("MaxTime", "UNLIMITED"))
        if maximum is not None and limit > maximum:
            return Check(
                FAIL,
                "time limit",
                f"{source} is longer than partition {partition['PartitionName']}'s MaxTime {partition['MaxTime']}",
                "shorten runtime.slurm.time; with requeue on, the job goes on in the next allocation",
            )
    if limit is None:
        return Check(PASS, "time limit", f"{source}: unlimited; the stop signal comes {lead} s before any end")
    if limit < lead + MIN_WORK_SECONDS:
        return Check(
            FAIL,
            "time limit",
            f"{source} ({limit} s) leaves under {MIN_WORK_SECONDS} s before the stop signal, which comes {lead} s "
            f"before the end (runtime.container.stop_timeout_seconds {runtime.stop_timeout_seconds} + "
            f"{SIGNAL_MARGIN_SECONDS} s)",
            f"make runtime.slurm.time at least {format_clock(lead + MIN_WORK_SECONDS)}, or lower stop_timeout_seconds",
        )
    return Check(
        PASS,
        "time limit",
        f"{source}: the stop signal comes {lead} s before the end, after at least {limit - lead} s of training",
    )


def _kill_wait_check(runtime: Runtime):
    """A plain scancel leaves the stop KillWait seconds before SIGKILL: say so when the stop may need longer."""
    config = run_slurm(["scontrol", "show", "config"]).stdout
    match = re.search(r"^KillWait\s*=\s*(\d+)", config, re.MULTILINE)
    if match is None:
        return Check(PASS, "kill wait", "KillWait unknown; `invoke stop` leaves the stop its whole time")
    kill_wait = int(match.group(1))
    if kill_wait >= runtime.stop_timeout_seconds:
        return Check(PASS, "kill wait", f"KillWait {kill_wait} s: even a plain scancel leaves the stop its time")
    return Check(
        WARN,
        "kill wait",
        f"a plain scancel kills the job {kill_wait} s after its SIGTERM (KillWait), but the stop may take up to "
        f"{runtime.stop_timeout_seconds} s (runtime.container.stop_timeout_seconds)",
        f"stop it with `{runtime.command('stop', per_node=False)}` (or scancel --batch --signal=USR2), which leaves "
        "the stop its whole time",
    )


def _gpu_check(partition: str, gpus: int):
    result = run_slurm(["sinfo", "--noheader", f"--partition={partition}", "--Node", "--format=%G"])
    best = 0
    for gres in result.stdout.split():
        for match in re.finditer(r"gpu(?::[^:,(]+)?:(\d+)", gres):
            best = max(best, int(match.group(1)))
    if best < gpus:
        return Check(
            FAIL,
            "gpus",
            f"the job asks for {gpus} GPU(s) per node, but partition {partition}'s nodes have at most {best}",
            "list fewer GPUs in runtime.gpu.devices, or choose a GPU partition",
        )
    return Check(PASS, "gpus", f"{gpus} GPU(s) per node; partition {partition}'s nodes have up to {best}")


if __name__ == "__main__":
    # A script written before the node task moved (`python -m astrai.host.slurm node --config ...`) runs again on
    # every requeue: hand it to astrai.host.slurm_node in this same process (the container watches this pid).
    arguments = sys.argv[2:] if sys.argv[1:2] == ["node"] else sys.argv[1:]
    os.execv(sys.executable, [sys.executable, "-m", "astrai.host.slurm_node", *arguments])
