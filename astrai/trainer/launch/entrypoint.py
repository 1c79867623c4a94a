"""Container entrypoint: derive the process count and parallel mode, check the mounts, start the trainer.

It reads only the environment that the rendered Compose override sets
(astrai/host/compose.py), never the YAML's ``runtime:`` block:

    TRAIN_JOB_NAME                job name; the job dir is /checkpoints/<job_name>
    ASTRAI_CONFIG                 the mounted train.yaml
    ASTRAI_GPU_DEVICES            all | none | 0,1,...
    ASTRAI_PROCESSES              process count when ASTRAI_GPU_DEVICES=none
    ASTRAI_PARALLEL_MODE          auto | none | ddp | fsdp
    ASTRAI_STOP_TIMEOUT_SECONDS   Docker's grace period on stop
    ASTRAI_NODES                  hosts in the job (absent: 1)
    ASTRAI_NODE_RANK              this host's node index (--node)
    ASTRAI_RDZV_ENDPOINT          host:port of node 0
    ASTRAI_RDZV_BACKEND           static | c10d
    ASTRAI_RDZV_ID                c10d rendezvous id (absent: derived from the job name)
    ASTRAI_SUPERVISOR_PID         a host process (the Slurm task) the container must not outlive

SIGTERM and SIGINT are held (blocked, pending) from the start, so a stop that
comes while the container is still starting is not lost (astrai/trainer/launch/signals.py).
One process: the trainer replaces this process (exec), so Docker's SIGTERM
reaches it directly. Several: ``torchrun --standalone`` runs them (on several
hosts, ``torchrun --nnodes`` joins the rendezvous on node 0); this process
stays as their parent and forwards SIGTERM/SIGINT straight to each worker, so
every rank finishes its step and the job exits 0 once the emergency checkpoint
is written. Under a scheduler (ASTRAI_SUPERVISOR_PID) this process always stays
as the parent, and watches the host process that started the container: once it
is gone (its Slurm job was cancelled, timed out or lost a node), the trainer
stops gracefully, and after the stop timeout it is killed, so no container
outlives its Slurm job. torchrun's own shutdown timeout (30 s by default, after which it
SIGKILLs the workers) is raised to the stop timeout for the case it is signalled
itself.

Under Kubeflow Trainer the runtime sets torchrun's PET_NNODES, PET_NODE_RANK and
PET_MASTER_ADDR/PET_MASTER_PORT instead; each stands in for its ASTRAI_ name
when that is unset.

Arguments are passed on to the trainer. ``--print-plan`` as the first argument
prints the launch decision as JSON and exits without checking GPUs or mounts.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from astrai.common.checkpoints import emergency_since, latest_complete_checkpoint
from astrai.common.contract import (
    CONTAINER_CHECKPOINTS,
    CONTAINER_CONFIG,
    CONTAINER_DATA,
    CONTAINER_MODEL,
    ENV_CONFIG,
    ENV_GPU_DEVICES,
    ENV_JOB_NAME,
    ENV_NODE_RANK,
    ENV_NODES,
    ENV_PARALLEL_MODE,
    ENV_PROCESSES,
    ENV_RDZV_BACKEND,
    ENV_RDZV_ENDPOINT,
    ENV_RDZV_ID,
    ENV_STOP_TIMEOUT_SECONDS,
    ENV_STOPPED_EXIT_CODE,
    ENV_SUPERVISOR_PID,
    MODEL_CONFIG_FILE,
    TORCHRUN_MODULE,
    TRAINER_MODULE,
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    deterministic_environment,
    resolve_parallel_mode,
    trainer_arguments,
)
from astrai.common.values import whole_number
from astrai.trainer.launch import signals

DATA_DIR = Path(CONTAINER_DATA)
MODEL_DIR = Path(CONTAINER_MODEL)
CHECKPOINTS_DIR = Path(CONTAINER_CHECKPOINTS)
# torchrun must never cut an emergency save short; keep a floor in case the timeout is tiny.
MIN_SHUTDOWN_TIMEOUT_SECONDS = 30


class EntrypointError(Exception):
    """The container cannot start the trainer; the message says what to fix."""


@dataclass(frozen=True)
class LaunchPlan:
    processes: int
    """Processes on this node."""
    parallel_mode: str
    job_dir: str
    command: list[str]
    nodes: int = 1
    node: int = 0
    environment: dict[str, str] = field(default_factory=dict)
    """What the trainer's environment needs beside the container's (training.deterministic: cuBLAS's workspace,
    which must be set before CUDA starts)."""


def rendezvous_id(job_name: str) -> str:
    """The c10d rendezvous id: every node derives the same one from the job name alone."""
    return f"astrai-{job_name}"


def _whole(env: Mapping[str, str], name: str, default: str, minimum: int) -> int:
    try:
        return whole_number(env.get(name, default), minimum)
    except ValueError as error:
        raise EntrypointError(f"{name} {error}") from None


def resolve_process_count(devices: str, processes: str | None, cuda_device_count: Callable[[], int]) -> int:
    """Processes to start: one per listed GPU, every visible GPU for ``all``, ASTRAI_PROCESSES on CPU."""
    if devices == "none":
        return _whole({ENV_PROCESSES: processes or "1"}, ENV_PROCESSES, "1", 1)
    if devices == "all":
        count = cuda_device_count()
        if count == 0:
            raise EntrypointError(
                "runtime.gpu.devices is 'all' but the container sees no GPU (torch.cuda.device_count() == 0); "
                "check the NVIDIA container runtime with `invoke preflight`, or set runtime.gpu.devices: none"
            )
        return count
    indices = [part for part in devices.split(",") if part.strip()]
    if not indices:
        raise EntrypointError(f"{ENV_GPU_DEVICES} must be all, none or a list of GPU indices, got {devices!r}")
    return len(indices)


def plan_launch(
    env: Mapping[str, str],
    trainer_args: list[str],
    cuda_device_count: Callable[[], int],
    python: str = sys.executable,
) -> LaunchPlan:
    """Decide how to start the trainer from the container's environment."""
    env = scheduler_fallbacks(env)
    job_name = env.get(ENV_JOB_NAME)
    if not job_name:
        raise EntrypointError(f"{ENV_JOB_NAME} is not set; start the job with `invoke start`")
    devices = env.get(ENV_GPU_DEVICES, "all")
    processes = resolve_process_count(devices, env.get(ENV_PROCESSES), cuda_device_count)
    nodes = _whole(env, ENV_NODES, "1", 1)
    node = _whole(env, ENV_NODE_RANK, "0", 0)
    if node >= nodes:
        raise EntrypointError(f"{ENV_NODE_RANK} is {node} but the job has {nodes} node(s)")
    try:
        mode = resolve_parallel_mode(env.get(ENV_PARALLEL_MODE, "auto"), processes * nodes)
    except ValueError as error:
        raise EntrypointError(
            f"runtime.gpu.parallel_mode: {error} (runtime.gpu.devices: {devices}, {nodes} node(s))"
        ) from None
    job_dir = CHECKPOINTS_DIR / job_name
    arguments = trainer_arguments(job_name, mode, trainer_args, config=env.get(ENV_CONFIG, CONTAINER_CONFIG))
    trainer = ["-m", TRAINER_MODULE, *arguments]
    stop_timeout = str(max(int(env.get(ENV_STOP_TIMEOUT_SECONDS, "600")), MIN_SHUTDOWN_TIMEOUT_SECONDS))
    if nodes > 1:
        command = [
            python,
            "-m",
            TORCHRUN_MODULE,
            *_rendezvous_args(env, job_name, nodes, node),
            "--nproc-per-node",
            str(processes),
            "--max-restarts",
            "0",
            "--shutdown-timeout",
            stop_timeout,
            *trainer,
        ]
    elif processes == 1:
        command = [python, *trainer]
    else:
        command = [
            python,
            "-m",
            TORCHRUN_MODULE,
            "--standalone",
            "--nproc-per-node",
            str(processes),
            "--shutdown-timeout",
            stop_timeout,
            *trainer,
        ]
    return LaunchPlan(processes, mode, str(job_dir), command, nodes, node, _trainer_environment(arguments))


def _trainer_environment(arguments: list[str]) -> dict[str, str]:
    """The environment the trainer's config asks for before CUDA starts; nothing when the config cannot be read (the
    trainer says why, in its own words)."""
    from astrai.common.config import parse_args
    from astrai.common.configfile import ConfigError

    try:
        config, _ = parse_args(arguments)
    except ConfigError:
        return {}
    return deterministic_environment(os.environ) if config.training.deterministic else {}


def scheduler_fallbacks(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with Kubeflow Trainer's PET_ variables standing in for the ASTRAI_ ones it lacks."""
    env = dict(env)
    if ENV_NODES not in env and env.get("PET_NNODES", "").isdigit():
        env[ENV_NODES] = env["PET_NNODES"]
    if ENV_NODE_RANK not in env and "PET_NODE_RANK" in env:
        env[ENV_NODE_RANK] = env["PET_NODE_RANK"]
    if ENV_RDZV_ENDPOINT not in env and env.get("PET_MASTER_ADDR") and env.get("PET_MASTER_PORT"):
        env[ENV_RDZV_ENDPOINT] = f"{env['PET_MASTER_ADDR']}:{env['PET_MASTER_PORT']}"
    return env


def _rendezvous_args(env: Mapping[str, str], job_name: str, nodes: int, node: int) -> list[str]:
    """torchrun's rendezvous on node 0: static ranks nodes by --node; c10d lets node 0 host the store.

    A container that crashes is restarted by Docker (runtime.container.max_restarts), never by torchrun,
    so every restart resumes from the newest checkpoint on every node alike.
    """
    endpoint = env.get(ENV_RDZV_ENDPOINT)
    if not endpoint:
        raise EntrypointError(
            f"{ENV_RDZV_ENDPOINT} is not set for a job on {nodes} nodes; set runtime.nodes.rendezvous"
        )
    backend = env.get(ENV_RDZV_BACKEND, "static")
    args = [
        "--nnodes",
        str(nodes),
        "--rdzv-backend",
        backend,
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        env.get(ENV_RDZV_ID) or rendezvous_id(job_name),
    ]
    if backend == "static":
        return [*args, "--node-rank", str(node)]
    if backend == "c10d":
        # Node 0 hosts the rendezvous store; the others only connect (two nodes on one host would both claim it).
        return [*args, "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}"]
    raise EntrypointError(f"{ENV_RDZV_BACKEND} must be static or c10d, got {backend!r}")


def check_gpus(env: Mapping[str, str], plan: LaunchPlan, cuda_device_count: Callable[[], int]) -> None:
    """Listed GPUs must be visible: one process per GPU."""
    devices = env.get(ENV_GPU_DEVICES, "all")
    if devices in ("all", "none"):
        return
    visible = cuda_device_count()
    if visible < plan.processes:
        raise EntrypointError(
            f"runtime.gpu.devices lists {plan.processes} GPU(s) ({devices}) but the container sees {visible}; "
            "check the indices with `nvidia-smi -L` and the NVIDIA container runtime with `invoke preflight`"
        )


def check_mounts(job_dir: Path, data_dir: Path = DATA_DIR, model_dir: Path = MODEL_DIR, node: int = 0) -> None:
    """The data must be readable, the job dir writable, and a base model present unless resuming.

    Only node 0 reads checkpoints and the base model (the other nodes receive them), so only it needs them.
    """
    if not data_dir.is_dir() or not os.access(data_dir, os.R_OK | os.X_OK):
        raise EntrypointError(f"{data_dir} is missing or not readable; check runtime.paths.data")
    try:
        job_dir.mkdir(parents=True, exist_ok=True)
        probe = job_dir / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise EntrypointError(
            f"the job dir {job_dir} is not writable ({error.strerror}); check runtime.paths.checkpoints "
            "and that it belongs to the user who runs `invoke start` (`invoke init` creates it)"
        ) from None
    if node != 0 or latest_complete_checkpoint(job_dir) is not None:
        return
    weights = model_dir / WEIGHTS_FILE
    if not _has_content(weights) and _has_content(model_dir / WEIGHTS_INDEX_FILE):
        weights = model_dir / WEIGHTS_INDEX_FILE  # sharded; the trainer checks the shards themselves
    for path in (model_dir / MODEL_CONFIG_FILE, weights):
        if not _has_content(path):
            raise EntrypointError(
                f"no complete checkpoint in {job_dir} and the base model file {path} is missing or empty; "
                "check runtime.paths.model (make one with `python -m astrai.model init DIR --preset tiny`)"
            )


def _has_content(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


def _cuda_device_count() -> int:
    import torch  # only inside the container, where torch is installed

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def child_pids(parent: int) -> list[int]:
    """Direct children of ``parent``, read from /proc."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as handle:
                stat = handle.read()
        except OSError:
            continue
        # The command name may hold spaces and parentheses; fields after the last ')' are fixed.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1 and int(fields[1]) == parent:
            children.append(int(entry))
    return children


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (the SigCgt mask in /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as handle:
            for line in handle:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _launch(command: list[str], direct: bool) -> subprocess.Popen:
    if direct:
        launcher = subprocess.Popen(command)  # inherits the blocked stop signals, as across exec
        signals.release()
        return launcher
    signals.release()  # main() held them; the launcher must start with them unblocked
    return subprocess.Popen(command)


def _kill(launcher: subprocess.Popen) -> int:
    """SIGKILL the launcher and its workers; the exit code of a killed process."""
    for pid in [*child_pids(launcher.pid), launcher.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    launcher.wait()
    return 128 + signal.SIGKILL


def supervise_workers(
    command: list[str],
    poll_seconds: float = 0.1,
    *,
    direct: bool = False,
    supervisor: Supervisor | None = None,
    stop_timeout: float = 600,
    job_dir: Path | None = None,
    stopped_code: int = 0,
) -> int:
    """Run the launcher (torchrun) and hand each stop signal to its workers; return its exit code.

    The ranks are signalled themselves: torchrun, once signalled, tears the group
    down and exits non-zero even when every rank stopped cleanly. A signal that
    comes before the workers exist, or before they handle it, waits until they do.
    ``direct``: the command is the trainer itself (one process), which starts with the
    stop signals still blocked and takes a pending one when it is ready.
    ``supervisor``: once that host process is gone, stop as if signalled, and kill
    the launcher and its workers ``stop_timeout`` seconds later.
    ``job_dir``: where a scheduler signalled torchrun too (Slurm's scancel reaches every
    process of a step), torchrun exits non-zero although the ranks stopped cleanly; an
    emergency checkpoint written since the stop makes the exit 0 again (``stopped_code``).
    So does one written since the launch when no signal came here: another node's stop.
    """
    pending: list[int] = []
    asked: list[float] = []  # when the first stop signal came

    def record(signum: int, _frame) -> None:
        pending.append(signum)
        asked.append(time.time())

    for signum in signals.STOP_SIGNALS:
        signal.signal(signum, record)
    launched = time.time()
    launcher = _launch(command, direct)
    deadline = None
    while (status := launcher.poll()) is None:
        if deadline is None and supervisor is not None and not supervisor.alive():
            print(
                f"astrai entrypoint: {supervisor.what} (host pid {supervisor.pid}) is gone: stopping gracefully, "
                f"killed in {stop_timeout:.0f} s if not stopped by then",
                file=sys.stderr,
                flush=True,
            )
            pending.append(signal.SIGTERM)
            asked.append(time.time())
            deadline = time.monotonic() + stop_timeout
        if deadline is not None and time.monotonic() > deadline:
            return _kill(launcher)
        if direct and pending:
            with contextlib.suppress(ProcessLookupError):
                launcher.send_signal(pending.pop(0))
            continue
        workers = child_pids(launcher.pid) if pending else []
        # A worker still starting up would die of the signal: wait until each one catches it.
        if workers and all(_catches(pid, pending[0]) for pid in workers):
            signum = pending.pop(0)
            for pid in workers:
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass
        else:
            time.sleep(poll_seconds)
    code = 128 - status if status < 0 else status
    # Since the launch when no signal came here: a node's ranks learn of a stop from the others (they agree on it at
    # the step's end), so they may stop and write the emergency checkpoint before this node's own signal comes.
    if job_dir is not None and emergency_since(job_dir, asked[0] if asked else launched) is not None:
        if code != 0:
            print(
                f"astrai entrypoint: the launcher exited with {code} after the stop, but the emergency checkpoint "
                "is written: the stop succeeded",
                file=sys.stderr,
                flush=True,
            )
        return stopped_code  # 0, or what a scheduler that retries failures must see (ENV_STOPPED_EXIT_CODE)
    return code


@dataclass(frozen=True)
class Supervisor:
    """A host process, told apart from a later one with the same pid by its start time."""

    pid: int
    started: str | None
    what: str = "the Slurm task that started this container"

    @classmethod
    def of(cls, pid: int) -> Supervisor:
        return cls(pid, _start_time(pid))

    def alive(self) -> bool:
        return self.started is not None and _start_time(self.pid) == self.started


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks since boot); None when no such live process."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if not fields or fields[0] in ("Z", "X") else fields[19]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    print_only = bool(args) and args[0] == "--print-plan"
    if print_only:
        args = args[1:]
    else:
        # Until the trainer (or the loop forwarding to its workers) can act on it, a stop signal waits.
        signals.hold()
    try:
        plan = plan_launch(os.environ, args, _cuda_device_count)
        if print_only:
            print(json.dumps(asdict(plan), indent=2, sort_keys=True))
            return 0
        check_gpus(os.environ, plan, _cuda_device_count)
        check_mounts(Path(plan.job_dir), node=plan.node)
    except EntrypointError as error:
        print(f"astrai entrypoint: error: {error}", file=sys.stderr, flush=True)
        return 2
    where = f"node {plan.node} of {plan.nodes}, " if plan.nodes > 1 else ""
    print(
        f"astrai entrypoint: job {os.environ[ENV_JOB_NAME]}: {where}{plan.processes} process(es), "
        f"parallel_mode {plan.parallel_mode}",
        flush=True,
    )
    os.environ.update(plan.environment)
    supervisor = _supervisor(os.environ)
    direct = plan.processes == 1 and plan.nodes == 1
    if direct and supervisor is None:
        os.execv(plan.command[0], plan.command)
    stop_timeout = float(os.environ.get(ENV_STOP_TIMEOUT_SECONDS, "600"))
    # Workers stop with 0 (torchrun would report any other code as a failure); this process says it for them.
    stopped_code = int(os.environ.pop(ENV_STOPPED_EXIT_CODE, "0") or 0)
    return supervise_workers(
        plan.command,
        direct=direct,
        supervisor=supervisor,
        stop_timeout=stop_timeout,
        job_dir=Path(plan.job_dir),
        stopped_code=stopped_code,
    )


def _supervisor(env: Mapping[str, str]) -> Supervisor | None:
    text = env.get(ENV_SUPERVISOR_PID)
    if not text:
        return None
    supervisor = Supervisor.of(whole_number(text, 1))
    if supervisor.started is None:
        print(f"astrai entrypoint: the supervisor (host pid {text}) is not running", file=sys.stderr, flush=True)
    return supervisor


if __name__ == "__main__":
    sys.exit(main())
