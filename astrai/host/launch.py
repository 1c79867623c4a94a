"""What a job's container is given: its mounts, its environment and the entrypoint's arguments, stated once.

Compose (:mod:`astrai.host.compose`), the Slurm script (:mod:`astrai.host.slurm_script`, for its pyxis and
apptainer launchers; its docker launcher runs Compose on each node) and the Kubernetes manifests
(:mod:`astrai.host.kubernetes`) render a :class:`LaunchSpec`; none of them states a mount or a variable of the
trainer's of its own (Kubernetes adds only its Job's retry rule, ASTRAI_STOPPED_EXIT_CODE). Two kinds of spec exist:

- :func:`node_spec`: one node's container, started by the host itself (``invoke start --node N``, and each
  node's task under Slurm's docker launcher). It holds that node's rank and the rendezvous.
- :func:`scheduler_spec`: the one description a scheduler starts on every node (a pyxis or apptainer ``srun``
  line, a Kubernetes pod template). Each node's rank, the rendezvous and the GPUs come from the scheduler.

The mounts are the same on every node: the data and the base model read-only, the checkpoints folder read-write,
the YAML read-only. Only node 0 reads the base model (it sends the weights to the others), but a pod template or an
``srun`` line describes all nodes at once, so every launcher mounts it everywhere: on the other nodes an empty
folder is enough, which ``invoke init`` creates.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from astrai.common.contract import (
    CONTAINER_CHECKPOINTS,
    CONTAINER_CONFIG,
    CONTAINER_DATA,
    CONTAINER_MODEL,
    ENV_CONFIG,
    ENV_ENVIRONMENTS,
    ENV_FAILURE_TIMEOUT_SECONDS,
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
    ENV_SUPERVISOR_PID,
    TRACKER_SECRETS,
)
from astrai.host.runtime import INTERFACE_VARIABLES, EnvironmentServer, Runtime
from astrai.host.trainer_config import judges_of, model_packages_of, trackers_of

SCHEDULER_GIVEN = (ENV_NODE_RANK, ENV_RDZV_ENDPOINT, ENV_RDZV_ID)
"""What each node's container gets from the scheduler that starts it, never from the spec (and, for a GPU job,
CUDA_VISIBLE_DEVICES: the GPUs the scheduler gave the task). A CPU job hides every GPU wherever it runs."""


@dataclass(frozen=True)
class Mount:
    key: str
    """``data``, ``model``, ``checkpoints`` (the runtime.paths key) or ``config`` (the YAML itself)."""
    source: Path
    target: str
    read_only: bool


@dataclass(frozen=True)
class LaunchSpec:
    mounts: tuple[Mount, ...]
    environment: dict[str, str | None]
    """None: passed through from the environment of the process that starts the container (a secret)."""
    arguments: tuple[str, ...]
    """The entrypoint's arguments: the user's words after ``--`` (the entrypoint puts the trainer's own first)."""
    trackers: tuple[str, ...] = ()
    """The remote trackers the trainer reports to (log.report_to): the image needs their clients, and the container
    their variables (:data:`TRACKER_SECRETS`), passed by name."""
    packages: tuple[str, ...] = ()
    """What the image installs for the job's model: transformers when it trains through it (model.backend), torchao
    for an NF4 base (training.lora_base_dtype)."""
    secrets: tuple[str, ...] = ()
    """Variables the container gets by name, never by value: the trackers' (:data:`TRACKER_SECRETS`) and the remote
    judges' keys (``api_key_env``)."""
    judges: tuple[str, ...] = ()
    """The remote judges' addresses (training.rewards, log.eval_rewards): servers the trainer asks, like a tracker's."""


ENVIRONMENT_SERVICE = "env-{name}"
"""A server environment's Compose service (and its host name on the job's network)."""
LOCALHOST = "localhost"
"""Where a server environment is for the trainer beside it in one pod (Kubernetes) or on one node (Slurm's steps)."""


def environment_service(server: EnvironmentServer) -> str:
    return ENVIRONMENT_SERVICE.format(name=server.name)


def environment_addresses(servers: tuple[EnvironmentServer, ...], beside: bool) -> str:
    """What the trainer is given in ASTRAI_ENVIRONMENTS: each server's address, by its service name on the job's
    network (Compose), or on localhost when it runs beside the trainer (``beside``: a sidecar, a step)."""
    return json.dumps(
        {
            server.name: f"http://{LOCALHOST if beside else environment_service(server)}:{server.port}"
            for server in servers
        },
        sort_keys=True,
    )


def mounts(runtime: Runtime) -> tuple[Mount, ...]:
    return (
        Mount("data", runtime.data_dir, CONTAINER_DATA, True),
        Mount("model", runtime.model_dir, CONTAINER_MODEL, True),
        Mount("checkpoints", runtime.checkpoints_dir, CONTAINER_CHECKPOINTS, False),
        Mount("config", runtime.config_path, CONTAINER_CONFIG, True),
    )


def container_environment(runtime: Runtime) -> dict[str, str | None]:
    """The environment of this node's container: the user's, plus what the entrypoint reads."""
    env = dict(runtime.environment)
    env.update(
        {
            ENV_JOB_NAME: runtime.job_name,
            ENV_CONFIG: CONTAINER_CONFIG,
            ENV_GPU_DEVICES: _devices_text(runtime.devices),
            ENV_PARALLEL_MODE: runtime.parallel_mode,
            ENV_STOP_TIMEOUT_SECONDS: str(runtime.stop_timeout_seconds),
        }
    )
    if runtime.devices == "none":
        env[ENV_PROCESSES] = str(runtime.processes)
    if runtime.cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = runtime.cuda_visible_devices
    if runtime.multi_node:
        env.update(
            {
                ENV_NODES: str(runtime.node_count),
                ENV_NODE_RANK: str(runtime.node),
                ENV_RDZV_BACKEND: runtime.rdzv_backend,
                ENV_FAILURE_TIMEOUT_SECONDS: str(runtime.failure_timeout_seconds),
            }
        )
        if runtime.rendezvous is not None:  # a job for a scheduler gets it from its allocation
            env[ENV_RDZV_ENDPOINT] = runtime.rendezvous
    if runtime.rdzv_id is not None:
        env[ENV_RDZV_ID] = runtime.rdzv_id
    if runtime.supervisor_pid is not None:
        env[ENV_SUPERVISOR_PID] = str(runtime.supervisor_pid)
    if runtime.network_interface is not None:
        env.update({name: runtime.network_interface for name in INTERFACE_VARIABLES})
    if runtime.environments:
        env[ENV_ENVIRONMENTS] = environment_addresses(runtime.environments, beside=False)
    return env


def scheduler_environment(runtime: Runtime) -> dict[str, str | None]:
    """The environment every node's container gets from one description: a node's, less what the scheduler gives
    each node (:data:`SCHEDULER_GIVEN`). A task sees only the GPUs the scheduler gave it, all of them the job's."""
    env = container_environment(dataclasses.replace(runtime, node=0))
    for name in SCHEDULER_GIVEN:
        env.pop(name, None)
    if runtime.uses_gpu:
        env[ENV_GPU_DEVICES] = "all"
        env.pop("CUDA_VISIBLE_DEVICES", None)
    env[ENV_NODES] = str(runtime.node_count)
    if runtime.environments:
        env[ENV_ENVIRONMENTS] = environment_addresses(runtime.environments, beside=True)
    return env


def node_spec(runtime: Runtime, trainer_args: list[str] | tuple[str, ...] = ()) -> LaunchSpec:
    return _spec(runtime, trainer_args, container_environment(runtime))


def scheduler_spec(runtime: Runtime, trainer_args: list[str] | tuple[str, ...] = ()) -> LaunchSpec:
    return _spec(runtime, trainer_args, scheduler_environment(runtime))


def _spec(runtime: Runtime, trainer_args, environment: dict[str, str | None]) -> LaunchSpec:
    trackers, judges = trackers_of(runtime, trainer_args), judges_of(runtime, trainer_args)
    keys = [judge.api_key_env for judge in judges if judge.api_key_env is not None]
    secrets = tuple(dict.fromkeys([*tracker_environment(trackers), *keys]))
    env = {**{name: None for name in secrets}, **environment}
    packages = model_packages_of(runtime, trainer_args)
    urls = tuple(judge.url for judge in judges)
    return LaunchSpec(mounts(runtime), env, tuple(trainer_args), trackers, packages, secrets, urls)


def tracker_environment(trackers: tuple[str, ...]) -> dict[str, None]:
    """The variables the trackers' clients read (their secrets among them), each passed through by name: its value
    never appears in a rendered file. A value the user gives in runtime.environment wins."""
    return {name: None for tracker in trackers for name in TRACKER_SECRETS[tracker]}


def _devices_text(devices: str | tuple[int, ...]) -> str:
    if isinstance(devices, str):
        return devices
    return ",".join(str(index) for index in devices)
