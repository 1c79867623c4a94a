"""Slurm, the script: `invoke submit` turns train.yaml into an sbatch script, and each node's task runs the trainer.

The script (:func:`render_script`) asks for ``runtime.nodes.count`` nodes, one
task each, and for a signal ``stop_timeout_seconds`` + 30 s before the time
limit. Its batch shell takes the rendezvous from the allocation (the first
node's ``NodeAddr``, a port derived from the job id) and starts one task per
node with ``srun``. What a task runs depends on ``runtime.slurm.launcher``:

- ``docker``: ``python -m astrai.host.slurm_node``, which starts the node's
  container on the host's engine exactly as ``invoke start --node N`` does, with
  the node rank from ``SLURM_NODEID``, and stops it gracefully on SIGTERM. The
  container watches that task's pid (:mod:`astrai.trainer.launch.entrypoint`), so it
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

This module renders the script (and checks what a job's own settings make impossible);
:mod:`astrai.host.slurm` submits it and follows the job from the login host, and
:mod:`astrai.host.slurm_node` is what runs inside the allocation.

The job's Slurm state lives in ``<job_dir>/.astrai/slurm/``: the script, the
submission record and the job's output (``slurm-<id>.out``, appended to by every
allocation).
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from astrai.common.contract import (
    ENV_NODE_RANK,
    ENV_RDZV_ENDPOINT,
    ENV_RDZV_ID,
    META_FILE,
    container_job_dir,
)
from astrai.common.errors import AstraiError
from astrai.common.values import format_clock
from astrai.host import compose, launch
from astrai.host.runtime import Runtime

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
REQUEUE_EXIT_MESSAGE = "requeued"


class SlurmError(AstraiError):
    """An expected failure of a Slurm command; the message says what to do."""


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
    settings = slurm_settings(runtime)
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
    problems += [
        f"{runtime.config_path}: runtime.environments.{server.name}.build: the {settings.launcher} launcher runs "
        "images, not Dockerfiles: build it, push it where the nodes pull from (or make an apptainer image of it) "
        "and give image: instead"
        for server in runtime.environments
        if server.build is not None and settings.launcher != "docker"
    ]
    limit = parse_time_limit(settings.time) if settings.time is not None else None
    lead = signal_lead_seconds(runtime)
    if limit is not None and limit < lead + MIN_WORK_SECONDS:
        problems.append(
            f"{runtime.config_path}: runtime.slurm.time: {settings.time} ({limit} s) leaves under {MIN_WORK_SECONDS} s "
            f"before the stop signal, which comes {lead} s before the end (runtime.container.stop_timeout_seconds "
            f"{runtime.stop_timeout_seconds} + {SIGNAL_MARGIN_SECONDS} s); make it at least "
            f"{format_clock(lead + MIN_WORK_SECONDS)}, or lower stop_timeout_seconds"
        )
    return problems


def rendezvous_port(job_id: str) -> str:
    """The rendezvous port as the batch shell computes it from ``job_id`` (a shell variable, SLURM_JOB_ID)."""
    return f"$(( {PORT_BASE} + {job_id} % {PORT_SPAN} ))"


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
    settings = slurm_settings(runtime)
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
    settings = slurm_settings(runtime)
    check_script_paths(runtime)
    header = [
        "#!/bin/bash",
        f"# Generated by `invoke submit` from {runtime.config_path}; render it again rather than edit it.",
        *(f"#SBATCH {option}" for option in sbatch_options(runtime)),
    ]
    task_of = {"docker": _docker_task, "pyxis": _pyxis_task, "apptainer": _apptainer_task}[settings.launcher]
    task, finished = task_of(runtime, list(trainer_args), python)
    requeue = "true" if settings.requeue else "false"
    stop_environments = ""
    if _environment_steps(runtime, settings.launcher):
        stop_environments = "kill $environments 2>/dev/null; wait $environments 2>/dev/null\n"
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
export {ENV_RDZV_ENDPOINT}="${{address:-$first}}:{rendezvous_port("SLURM_JOB_ID")}"
export {ENV_RDZV_ID}="slurm-$SLURM_JOB_ID"
{exports(runtime, trainer_args)}
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

{_environment_steps(runtime, settings.launcher)}{task} &
step=$!
while :; do
    wait "$step"
    kill -0 "$step" 2>/dev/null || break
done
wait "$step"
status=$?
{stop_environments}echo "astrai: the tasks ended with exit code $status${{reason:+ after a stop ($reason)}}"
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


def _environment_steps(runtime: Runtime, launcher: str) -> str:
    """The server environments (runtime.environments), each a step of its own beside the trainer's on every node,
    started before it (the trainer waits for them to answer) and stopped after it; the trainer reaches them on
    localhost. The docker launcher runs them with Compose, as `invoke start` does: no step."""
    if not runtime.environments or launcher == "docker":
        return ""
    lines = ["# The server environments: a step each beside the trainer's, on every node.", "environments="]
    for server in runtime.environments:
        if launcher == "pyxis":
            runner = [f"--container-image={server.image}", "--no-container-mount-home"]
        else:
            runner = ["apptainer", "run", "--contain", server.image]
        command = ["srun", "--overlap", f"--nodes={runtime.node_count}", "--ntasks-per-node=1", *runner]
        lines += [f"{shlex.join(command)} &", 'environments="$environments $!"']
    return "\n".join(lines) + "\n"


def _srun(runtime: Runtime) -> list[str]:
    return [
        "srun",
        "--label",
        "--kill-on-bad-exit=1",
        f"--nodes={runtime.node_count}",
        "--ntasks-per-node=1",
    ]


def _docker_task(runtime: Runtime, trainer_args: list[str], python: str) -> tuple[str, str]:
    command = [*_srun(runtime), python, "-m", "astrai.host.slurm_node", "--config", str(runtime.config_path)]
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


def mount_list(runtime: Runtime) -> str:
    """The spec's mounts as pyxis' --container-mounts and apptainer's --bind take them."""
    return ",".join(
        f"{mount.source}:{mount.target}{':ro' if mount.read_only else ''}" for mount in launch.mounts(runtime)
    )


def _pyxis_task(runtime: Runtime, trainer_args: list[str], _python: str) -> tuple[str, str]:
    image = image_of(runtime)
    mounts = mount_list(runtime)
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
    image = image_of(runtime)
    binds = mount_list(runtime)
    exec_ = ["apptainer", "exec", *(["--nv"] if runtime.uses_gpu else []), "--contain", "--bind", binds, image]
    command = [*_srun(runtime), *exec_, *_in_image_command(trainer_args)]
    finished = [*exec_, "python3", "-m", "astrai.common.finished", container_job_dir(runtime.job_name)]
    return shlex.join(command), shlex.join(finished)


def exports(runtime: Runtime, trainer_args: list[str] | tuple[str, ...] = ()) -> str:
    """The container's environment as exports, for the launchers that run the image inside the task.

    The docker launcher renders it per node (as `invoke start` does), so it needs none here. Slurm itself
    sets CUDA_VISIBLE_DEVICES to the GPUs it gave the task: the trainer uses every one it sees.
    """
    if slurm_settings(runtime).launcher == "docker":
        return ""
    # The rank per task from SLURM_NODEID, the rendezvous from the allocation (above).
    env = launch.scheduler_spec(runtime, trainer_args).environment
    lines = ["# The trainer's environment (the image's entrypoint reads it)."]
    for name, value in sorted(env.items()):
        if value is None:
            lines.append(f"# {name} is passed through from the environment sbatch was run in")
        else:
            lines.append(f"export {name}={shlex.quote(value)}")
    return "\n".join(lines) + "\n"


def image_of(runtime: Runtime) -> str:
    settings = slurm_settings(runtime)
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
    if slurm_settings(runtime).launcher != "docker":
        for mount in launch.mounts(runtime):
            key, source = mount.key, mount.source
            if re.search(r"[,:]", str(source)):
                where = "the config file" if key == "config" else f"runtime.paths.{key}"
                problems.append(
                    f"{runtime.config_path}: {where}: {source} holds ',' or ':', which split the "
                    f"{slurm_settings(runtime).launcher} mount list; choose a path without them"
                )
    if problems:
        raise SlurmError("\n".join(problems), code=2)


def slurm_settings(runtime: Runtime):
    """The job's runtime.slurm block; SlurmError (exit 2) when it has none."""
    if runtime.slurm is None:
        raise SlurmError(
            f"{runtime.config_path}: runtime.slurm: missing: add a runtime.slurm block (such as "
            "slurm: {partition: gpu, time: '04:00:00'}) to run this job through Slurm",
            code=2,
        )
    return runtime.slurm
