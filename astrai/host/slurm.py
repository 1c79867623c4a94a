"""Slurm: `invoke submit` turns train.yaml into an sbatch script, and each node's task runs the trainer.

The script (:func:`render_script`) asks for ``runtime.nodes.count`` nodes, one
task each, and for a signal ``stop_timeout_seconds`` + 30 s before the time
limit. Its batch shell takes the rendezvous from the allocation (the first
node's ``NodeAddr``, a port derived from the job id) and starts one task per
node with ``srun``. What a task runs depends on ``runtime.slurm.launcher``:

- ``docker``: ``python -m astrai.host.slurm node``, which starts the node's
  container on the host's engine exactly as ``invoke start --node N`` does, with
  the node rank from ``SLURM_NODEID``, and stops it gracefully on SIGTERM. The
  container watches that task's pid (:mod:`astrai.trainer.entrypoint`), so it
  never outlives the task, however the task ends;
- ``pyxis`` / ``apptainer``: the trainer image's entrypoint itself, inside
  ``srun --container-image`` or ``apptainer exec``, a child of the task.

Stopping, all through the batch shell's traps, which pass SIGTERM to every
task (each writes its part of one emergency checkpoint):

- USR1, Slurm's warning before the time limit (or a preemption): stop, then
  ``scontrol requeue`` unless the run is finished or ``runtime.slurm.requeue``
  is off; the next allocation resumes from the emergency checkpoint;
- USR2, sent by `invoke stop` (``scancel --batch --signal=USR2``): stop, no
  requeue. It leaves the stop its whole ``stop_timeout_seconds``;
- TERM, a plain ``scancel``: stop, no requeue, but Slurm kills every process
  ``KillWait`` seconds later (30 s by default), so a stop that needs longer is cut
  short; prefer `invoke stop`.

The job's Slurm state lives in ``<job_dir>/.astrai/slurm/``: the script, the
submission record and the job's output (``slurm-<id>.out``, appended to by every
allocation).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from astrai.common.contract import (
    CONTAINER_CHECKPOINTS,
    CONTAINER_CONFIG,
    CONTAINER_DATA,
    CONTAINER_MODEL,
    ENV_GPU_DEVICES,
    ENV_NODE_RANK,
    ENV_RDZV_ENDPOINT,
    ENV_RDZV_ID,
    META_FILE,
    REASON_EMERGENCY,
    container_job_dir,
)
from astrai.common.errors import AstraiError
from astrai.host import compose
from astrai.host.hostuser import make_dirs
from astrai.host.preflight import FAIL, PASS, WARN, Check
from astrai.host.runtime import Runtime, load_job_config, split_endpoint

SLURM_DIR_NAME = "slurm"
"""In the job's state folder (``.astrai``): everything `invoke submit` wrote and Slurm appends to."""
SCRIPT_NAME = "job.sbatch"
SUBMITTED_NAME = "submitted.json"
OUTPUT_NAME = "slurm-%j.out"
"""The job's output file; Slurm replaces %j with the job id."""
SIGNAL_MARGIN_SECONDS = 30
"""The warning signal comes this long before the stop timeout would run past the time limit."""
MIN_WORK_SECONDS = 60
"""An allocation must leave at least this long for training before the warning signal."""
PORT_BASE, PORT_SPAN = 20000, 10000
"""The rendezvous port is PORT_BASE + job id % PORT_SPAN: the same on every node and in every allocation, and
below Linux's ephemeral ports (from 32768), which outgoing connections take."""
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
REQUEUE_EXIT_MESSAGE = "requeued"


class SlurmError(AstraiError):
    """An expected failure of a Slurm command; the message says what to do."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.exit_code = code


def slurm_dir(runtime: Runtime) -> Path:
    return runtime.job_dir / compose.STATE_DIR_NAME / SLURM_DIR_NAME


def signal_lead_seconds(runtime: Runtime) -> int:
    """How long before the time limit the batch shell gets USR1: the stop's time plus a margin."""
    return runtime.stop_timeout_seconds + SIGNAL_MARGIN_SECONDS


# sbatch options the script sets itself, each with what decides it: one in runtime.slurm.extra would override it.
MANAGED_OPTIONS = {
    ("--job-name", "-J"): "runtime.job_name",
    ("--nodes", "-N"): "runtime.nodes.count",
    ("--ntasks-per-node",): "invoke submit (one task per node)",
    ("--gpus-per-node",): "runtime.gpu.devices",
    ("--partition", "-p"): "runtime.slurm.partition",
    ("--account", "-A"): "runtime.slurm.account",
    ("--qos", "-q"): "runtime.slurm.qos",
    ("--time", "-t"): "runtime.slurm.time",
    ("--signal",): "runtime.container.stop_timeout_seconds (the stop signal comes that long + 30 s before the end)",
    ("--requeue", "--no-requeue"): "runtime.slurm.requeue",
    ("--open-mode",): "invoke submit (the job's output is appended to across allocations)",
    ("--output", "-o", "--error", "-e"): "invoke submit (the job's one output file, which invoke logs follows)",
    ("--chdir", "-D"): "invoke submit (the folder of the YAML)",
}


def config_problems(runtime: Runtime) -> list[str]:
    """What the job's own settings make impossible, before any cluster is asked: an extra option that would
    override one the script manages, a time limit shorter than the stop signal's lead plus a minute of work."""
    settings = _settings(runtime)
    problems = []
    for index, option in enumerate(settings.extra):
        name = re.split(r"[=\s]", option.strip(), maxsplit=1)[0]
        if name.startswith("-") and not name.startswith("--") and len(name) > 2:
            name = name[:2]  # -p gpu and -pgpu alike
        for names, owner in MANAGED_OPTIONS.items():
            if name in names:
                problems.append(
                    f"{runtime.config_path}: runtime.slurm.extra[{index}]: {option!r} would override the script's own "
                    f"{names[0]}, which {owner} decides; set that instead"
                )
    if runtime.devices == "all" and settings.launcher != "docker":
        # Docker reaches every GPU of the node it runs on; a pyxis or apptainer task only those Slurm gave it.
        problems.append(
            f"{runtime.config_path}: runtime.gpu.devices: all takes a whole node (--exclusive), and under the "
            f"{settings.launcher} launcher a task sees only the GPUs Slurm allocates to it: list them, such as "
            "[0, 1, 2, 3, 4, 5, 6, 7], and the job asks for that many (--gpus-per-node=8)"
        )
    limit = parse_time_limit(settings.time) if settings.time is not None else None
    lead = signal_lead_seconds(runtime)
    if limit is not None and limit < lead + MIN_WORK_SECONDS:
        problems.append(
            f"{runtime.config_path}: runtime.slurm.time: {settings.time} ({limit} s) leaves under {MIN_WORK_SECONDS} s "
            f"before the stop signal, which comes {lead} s before the end (runtime.container.stop_timeout_seconds "
            f"{runtime.stop_timeout_seconds} + {SIGNAL_MARGIN_SECONDS} s); make it at least "
            f"{_clock(lead + MIN_WORK_SECONDS)}, or lower stop_timeout_seconds"
        )
    return problems


def rendezvous_port(job_id: int) -> int:
    return PORT_BASE + job_id % PORT_SPAN


def parse_time_limit(text: str) -> int | None:
    """Seconds of a Slurm time limit such as ``1-02:03:04``, ``02:03:04``, ``30`` (minutes); None: unlimited."""
    text = text.strip()
    if text in ("UNLIMITED", "INFINITE", "Partition_Limit", "NONE", ""):
        return None
    days, _, rest = text.rpartition("-")
    parts = [int(part) for part in rest.split(":")]
    if days:  # D-H, D-H:M, D-H:M:S
        hours, minutes, seconds = (parts + [0, 0])[:3]
    elif len(parts) == 3:
        hours, minutes, seconds = parts
    else:  # M or M:S
        hours, (minutes, seconds) = 0, (parts + [0])[:2]
    return ((int(days or 0) * 24 + hours) * 60 + minutes) * 60 + seconds


# --- the script -------------------------------------------------------------------------------------


def gpus_per_node(runtime: Runtime) -> int | None:
    """GPUs each node asks Slurm for: one per listed index; None for devices all (the whole node) or none."""
    return len(runtime.devices) if isinstance(runtime.devices, tuple) else None


def sbatch_options(runtime: Runtime) -> list[str]:
    """The ``#SBATCH`` options of the job, in order."""
    settings = _settings(runtime)
    options = [
        f"--job-name={runtime.job_name}",
        f"--nodes={runtime.node_count}",
        "--ntasks-per-node=1",
    ]
    gpus = gpus_per_node(runtime)
    if gpus:
        options.append(f"--gpus-per-node={gpus}")
    elif runtime.devices == "all":
        options.append("--exclusive")  # every GPU of each node: the whole node
    for name in ("partition", "account", "qos", "time"):
        value = getattr(settings, name)
        if value is not None:
            options.append(f"--{name}={value}")
    options += [
        f"--signal=B:USR1@{signal_lead_seconds(runtime)}",
        "--requeue" if settings.requeue else "--no-requeue",
        "--open-mode=append",
        # Quoted: sbatch splits a directive at spaces otherwise (it expands nothing inside the quotes).
        f'--output="{slurm_dir(runtime) / OUTPUT_NAME}"',
        f'--chdir="{runtime.config_path.parent}"',
    ]
    return options + list(settings.extra)


def render_script(runtime: Runtime, trainer_args: list[str] = (), python: str = sys.executable) -> str:
    """The sbatch script of the job for its launcher (deterministic: golden-testable)."""
    settings = _settings(runtime)
    check_script_paths(runtime)
    header = [
        "#!/bin/bash",
        f"# Generated by `invoke submit` from {runtime.config_path}; render it again rather than edit it.",
        *(f"#SBATCH {option}" for option in sbatch_options(runtime)),
    ]
    launch = {"docker": _docker_task, "pyxis": _pyxis_task, "apptainer": _apptainer_task}[settings.launcher]
    task, finished = launch(runtime, list(trainer_args), python)
    requeue = "true" if settings.requeue else "false"
    body = f"""
set -u
requeue={requeue}  # runtime.slurm.requeue
allocation=$(( ${{SLURM_RESTART_COUNT:-0}} + 1 ))
echo "astrai: Slurm job $SLURM_JOB_ID, allocation $allocation, nodes $SLURM_JOB_NODELIST, $(date -Is)"

# The step of the newest checkpoint (-1: none), from the checkpoint names: a requeue needs this allocation's progress.
newest_step() {{
    local best=-1 meta step
    for meta in {shlex.quote(str(runtime.job_dir))}/epoch_*_step_*/{META_FILE}; do
        step=${{meta%/{META_FILE}}}
        step=${{step##*_step_}}
        case $step in ''|*[!0-9]*) continue ;; esac
        [ "$step" -gt "$best" ] && best=$step
    done
    echo "$best"
}}
start_step=$(newest_step)

# The rendezvous: the first node's address (NodeAddr: node names need not resolve), a port from the job id.
first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
address=$(scontrol show node "$first" | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p' | head -n 1)
export {ENV_RDZV_ENDPOINT}="${{address:-$first}}:$(( {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN} ))"
export {ENV_RDZV_ID}="slurm-$SLURM_JOB_ID"
{_exports(runtime)}
# Every stop is graceful: each task gets SIGTERM, finishes its step, and the job writes one emergency checkpoint.
reason=""
stop_tasks() {{
    [ -n "$reason" ] && return
    reason=$1
    echo "astrai: $2: stopping every node gracefully (up to {runtime.stop_timeout_seconds} s)"
    scancel --signal=TERM "$SLURM_JOB_ID"
}}
trap 'stop_tasks time-limit "the time limit is near (or the job is preempted)"' USR1
trap 'requeue=false; stop_tasks stop "invoke stop"' USR2
trap 'stop_tasks cancel "scancel: Slurm kills what still runs after its KillWait"' TERM INT

{task} &
step=$!
while :; do
    wait "$step"
    kill -0 "$step" 2>/dev/null || break
done
wait "$step"
status=$?
echo "astrai: the tasks ended with exit code $status${{reason:+ after a stop ($reason)}}"
if [ "$reason" = time-limit ] && [ "$status" = 0 ] && [ "$requeue" = true ]; then
    if {finished}; then
        echo "astrai: the run is finished; not requeued"
    elif [ "$(newest_step)" -le "$start_step" ]; then
        # Requeued, it would start, stop at the same point and be requeued again, forever.
        echo "astrai: no checkpoint past step $start_step in this allocation: not requeued; the time limit leaves" \
            "no room to train (raise runtime.slurm.time, or lower runtime.container.stop_timeout_seconds)"
    else
        scontrol requeue "$SLURM_JOB_ID" && echo "astrai: {REQUEUE_EXIT_MESSAGE}: the next allocation resumes"
    fi
fi
exit "$status"
"""
    return "\n".join(header) + "\n" + body


def _srun(runtime: Runtime) -> list[str]:
    return [
        "srun",
        "--label",
        "--kill-on-bad-exit=1",
        f"--nodes={runtime.node_count}",
        "--ntasks-per-node=1",
    ]


def _docker_task(runtime: Runtime, trainer_args: list[str], python: str) -> tuple[str, str]:
    command = [*_srun(runtime), python, "-m", "astrai.host.slurm", "node", "--config", str(runtime.config_path)]
    if trainer_args:
        command += ["--", *trainer_args]
    finished = [python, "-m", "astrai.common.finished", str(runtime.job_dir)]
    return shlex.join(command), shlex.join(finished)


def _in_image_command(trainer_args: list[str]) -> list[str]:
    """The entrypoint, with this node's rank from Slurm (set inside the task, where SLURM_NODEID is known)."""
    return [
        "bash",
        "-c",
        f'export {ENV_NODE_RANK}="$SLURM_NODEID"; exec python3 -m astrai.trainer.entrypoint "$@"',
        "astrai",
        *trainer_args,
    ]


def _mounts(runtime: Runtime) -> list[tuple[Path, str, bool]]:
    return [
        (runtime.data_dir, CONTAINER_DATA, True),
        (runtime.model_dir, CONTAINER_MODEL, True),
        (runtime.checkpoints_dir, CONTAINER_CHECKPOINTS, False),
        (runtime.config_path, CONTAINER_CONFIG, True),
    ]


def _pyxis_task(runtime: Runtime, trainer_args: list[str], _python: str) -> tuple[str, str]:
    image = _image(runtime)
    mounts = ",".join(f"{source}:{target}{':ro' if ro else ''}" for source, target, ro in _mounts(runtime))
    container = [f"--container-image={image}", f"--container-mounts={mounts}", "--no-container-mount-home"]
    command = [*_srun(runtime), *container, *_in_image_command(trainer_args)]
    finished = [
        "srun",
        "--nodes=1",
        "--ntasks=1",
        *container,
        "python3",
        "-m",
        "astrai.common.finished",
        container_job_dir(runtime.job_name),
    ]
    return shlex.join(command), shlex.join(finished)


def _apptainer_task(runtime: Runtime, trainer_args: list[str], _python: str) -> tuple[str, str]:
    image = _image(runtime)
    binds = ",".join(f"{source}:{target}{':ro' if ro else ''}" for source, target, ro in _mounts(runtime))
    exec_ = ["apptainer", "exec", *(["--nv"] if runtime.uses_gpu else []), "--contain", "--bind", binds, image]
    command = [*_srun(runtime), *exec_, *_in_image_command(trainer_args)]
    finished = [*exec_, "python3", "-m", "astrai.common.finished", container_job_dir(runtime.job_name)]
    return shlex.join(command), shlex.join(finished)


def _exports(runtime: Runtime) -> str:
    """The container's environment as exports, for the launchers that run the image inside the task.

    The docker launcher renders it per node (as `invoke start` does), so it needs none here. Slurm itself
    sets CUDA_VISIBLE_DEVICES to the GPUs it gave the task: the trainer uses every one it sees.
    """
    if _settings(runtime).launcher == "docker":
        return ""
    env = compose.container_environment(dataclasses.replace(runtime, node=0))
    for name in (ENV_NODE_RANK, ENV_RDZV_ENDPOINT, ENV_RDZV_ID):
        env.pop(name, None)  # the rank per task from SLURM_NODEID, the rendezvous from the allocation (above)
    if runtime.uses_gpu:
        env[ENV_GPU_DEVICES] = "all"
        env.pop("CUDA_VISIBLE_DEVICES", None)
    lines = ["# The trainer's environment (the image's entrypoint reads it)."]
    for name, value in sorted(env.items()):
        if value is None:
            lines.append(f"# {name} is passed through from the environment sbatch was run in")
        else:
            lines.append(f"export {name}={shlex.quote(value)}")
    return "\n".join(lines) + "\n"


def _image(runtime: Runtime) -> str:
    settings = _settings(runtime)
    image = settings.image or (runtime.kubernetes.image if runtime.kubernetes is not None else None)
    if image is None:
        raise SlurmError(
            f"{runtime.config_path}: runtime.slurm.image: missing: the {settings.launcher} launcher runs an image "
            "from a registry or a file; set runtime.slurm.image (or runtime.kubernetes.image), such as "
            "docker://registry.example/astrai-train:v1",
            code=2,
        )
    return image


def check_script_paths(runtime: Runtime) -> None:
    """Refuse paths the script cannot carry: % is a pattern in --output, ',' and ':' split container mounts."""
    problems = []
    for where, path in (("runtime.paths.checkpoints", runtime.job_dir), ("the config file", runtime.config_path)):
        if re.search(r'["\n\r]', str(path)):
            problems.append(
                f"{runtime.config_path}: {where}: {path} holds a double quote or a line break, which an #SBATCH "
                "line cannot carry; choose a path without them"
            )
    if "%" in str(runtime.job_dir):
        problems.append(
            f"{runtime.config_path}: runtime.paths.checkpoints: {runtime.job_dir} holds '%', which Slurm reads as a "
            "pattern in the job's output file name; choose a folder without '%'"
        )
    if _settings(runtime).launcher != "docker":
        for key, (source, _target, _ro) in zip(
            ("data", "model", "checkpoints", "config"), _mounts(runtime), strict=True
        ):
            if re.search(r"[,:]", str(source)):
                where = "the config file" if key == "config" else f"runtime.paths.{key}"
                problems.append(
                    f"{runtime.config_path}: {where}: {source} holds ',' or ':', which split the "
                    f"{_settings(runtime).launcher} mount list; choose a path without them"
                )
    if problems:
        raise SlurmError("\n".join(problems), code=2)


def _settings(runtime: Runtime):
    if runtime.slurm is None:
        raise SlurmError(
            f"{runtime.config_path}: runtime.slurm: missing: add a runtime.slurm block (such as "
            "slurm: {partition: gpu, time: '04:00:00'}) to run this job through Slurm",
            code=2,
        )
    return runtime.slurm


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
        _write_atomically(path, script, 0o700)
        result = _slurm(["sbatch", str(path)])
        if result.returncode != 0:
            raise SlurmError(f"sbatch refused the job (exit {result.returncode}): {result.stderr.strip()}")
        line = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
        match = re.search(r"Submitted batch job (\d+)", line)
        if match is None:
            raise SlurmError(f"sbatch did not say which job it submitted: {result.stdout.strip()!r}")
        record = Submission(int(match.group(1)), time.time(), str(path))
        _write_atomically(folder / SUBMITTED_NAME, json.dumps(dataclasses.asdict(record)) + "\n", 0o600)
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


def _write_atomically(path: Path, text: str, mode: int) -> None:
    temporary = path.with_name(path.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        temporary.unlink()
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with open(descriptor, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(temporary, path)


def _slurm(command: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    if shutil.which(command[0]) is None:
        raise SlurmError(f"{command[0]} is not installed here: run this on a host of the Slurm cluster (a login node)")
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{command[0]} did not answer within {timeout:.0f} s; is slurmctld up (`sinfo`)?") from None


def query_job(job_id: int) -> SlurmJob:
    """The job's state from ``scontrol show job`` (None once Slurm forgot it, MinJobAge after its end)."""
    result = _slurm(["scontrol", "show", "job", "--oneliner", str(job_id)])
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
        result = _slurm(["scancel", str(job.job_id)])
        if result.returncode != 0:
            raise SlurmError(f"scancel {job.job_id} failed: {result.stderr.strip()}")
        say(f"Slurm job {job.job_id} was {job.state} (nothing ran yet); cancelled it")
        return
    say(
        f"stopping Slurm job {job.job_id} of {runtime.job_name}: every node stops gracefully, up to "
        f"{runtime.stop_timeout_seconds} s for the emergency checkpoint; no requeue"
    )
    started = time.monotonic()
    result = _slurm(["scancel", "--batch", "--signal=USR2", str(job.job_id)])
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
    from astrai.common.checkpoints import scan_job_dir

    complete = scan_job_dir(runtime.job_dir).complete
    newest = complete[-1] if complete else None
    seconds = time.monotonic() - started
    if newest is not None and newest.meta.reason == REASON_EMERGENCY:
        say(f"stopped in {seconds:.1f} s; emergency checkpoint {newest.path} (step {newest.step})")
    else:
        say(f"stopped in {seconds:.1f} s; newest checkpoint: {newest.path if newest else 'none'}")


# --- preflight for a submit -------------------------------------------------------------------------


def submit_checks(runtime: Runtime):
    """The Slurm side of a submit: the commands answer, the partition exists, the time and GPUs fit it."""
    try:
        return _submit_checks(runtime)
    except SlurmError as error:
        return [Check(FAIL, "slurm", str(error), "check SLURM_CONF and that the controller is up (`scontrol ping`)")]


def _submit_checks(runtime: Runtime):
    settings = _settings(runtime)
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
    reply = _slurm(["scontrol", "ping"], timeout=15)
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
        known = _slurm(["sinfo", "--noheader", "--format=%R"]).stdout.split()
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
    result = _slurm(["scontrol", "show", "partition", "--oneliner", *([name] if name else [])])
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
            f"make runtime.slurm.time at least {_clock(lead + MIN_WORK_SECONDS)}, or lower stop_timeout_seconds",
        )
    return Check(
        PASS,
        "time limit",
        f"{source}: the stop signal comes {lead} s before the end, after at least {limit - lead} s of training",
    )


def _kill_wait_check(runtime: Runtime):
    """A plain scancel leaves the stop KillWait seconds before SIGKILL: say so when the stop may need longer."""
    config = _slurm(["scontrol", "show", "config"]).stdout
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
    result = _slurm(["sinfo", "--noheader", f"--partition={partition}", "--Node", "--format=%G"])
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


def _clock(seconds: int) -> str:
    return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


# --- the task on each node (launcher docker) -------------------------------------------------------------


def allocation_runtime(runtime: Runtime, env) -> Runtime:
    """The job as this node of the allocation sees it: its rank, the rendezvous and GPUs Slurm gave."""
    endpoint = env.get(ENV_RDZV_ENDPOINT)
    if not endpoint:
        raise SlurmError(f"{ENV_RDZV_ENDPOINT} is not set: run this through the script `invoke submit` writes")
    split_endpoint(endpoint)
    changes = {
        "rendezvous": endpoint,
        "rdzv_id": env.get(ENV_RDZV_ID) or f"slurm-{env.get('SLURM_JOB_ID', '0')}",
        "supervisor_pid": os.getpid(),
        # Slurm's rank order is the node order: node 0 hosts the rendezvous, reads and writes checkpoints.
        "rdzv_backend": "static",
    }
    gpus = env.get("SLURM_STEP_GPUS") or env.get("SLURM_JOB_GPUS")
    if runtime.uses_gpu and gpus:
        indices = tuple(int(index) for index in gpus.split(",") if index.strip().isdigit())
        changes.update(devices=indices, processes=len(indices), cuda_visible_devices=",".join(map(str, indices)))
    return dataclasses.replace(runtime, **changes)


def run_node(config: str, trainer_args: list[str]) -> int:
    """One node's task: start its container as `invoke start --node N --foreground`; SIGTERM stops it."""
    from astrai.host.jobs import EXIT_INTERRUPTED, start_job

    env = os.environ
    nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or "1")
    node = int(env.get("SLURM_NODEID", "0"))
    _, runtime = load_job_config(config, node)
    if nodes != runtime.node_count:
        raise SlurmError(f"the allocation has {nodes} node(s) but runtime.nodes.count is {runtime.node_count}")
    runtime = allocation_runtime(runtime, env)

    def stop(signum, _frame):
        for name in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(name, signal.SIG_IGN)  # one graceful stop; further signals wait for it
        raise KeyboardInterrupt

    for name in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(name, stop)
    print(f"astrai: node {node} of {nodes} on {os.uname().nodename}, rendezvous {runtime.rendezvous}", flush=True)
    code = start_job(runtime, trainer_args, foreground=True)
    if code == EXIT_INTERRUPTED:
        # Stopped before the trainer ran: nothing to save, and the allocation may still be requeued.
        return 0
    return code


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[0] != "node" or args[1] != "--config":
        print("usage: python -m astrai.host.slurm node --config FILE [-- TRAINER ARGS]", file=sys.stderr)
        return 2
    rest = args[3:]
    trainer_args = rest[1:] if rest[:1] == ["--"] else rest
    try:
        return run_node(args[2], trainer_args)
    except AstraiError as error:
        print(error.show(), file=sys.stderr, flush=True)
        return error.exit_code


if __name__ == "__main__":
    sys.exit(main())
