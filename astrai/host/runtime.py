"""The ``runtime:`` block of train.yaml: load, validate, resolve.

Host-side only (imports neither torch nor Invoke). The block's shape lives in
``schema/runtime.schema.json``; this module adds the rules a schema cannot
express (process counts against parallel modes, grace period against stop
timeout, reserved environment names) and turns a valid block into a
:class:`Runtime` with absolute paths and derived values.

    doc, runtime = load_job_config("train.yaml")   # raises ConfigError on bad input

Every problem is reported at once, sorted by dotted path, as
``FILE: runtime.gpu.devices: what is wrong and what is allowed``. Nothing here
writes to disk.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import fnmatch
import functools
import json
import math
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import jsonschema

from astrai.common.config import SECTIONS
from astrai.common.configfile import ConfigError, close_match, load_yaml, show_value, unknown
from astrai.common.contract import (
    ENV_JOB_NAME,
    RESERVED_ENV_PREFIX,
    TORCH_CUDA_TAGS,
    TORCH_VERSION,
    resolve_parallel_mode,
)
from astrai.common.errors import AstraiError
from astrai.common.paths import folder_problem
from astrai.common.values import parse_duration

# Shipped inside the package (a wheel has no schema/ folder); in a checkout it is a link to schema/.
SCHEMA_PATH = Path(__file__).parent / "runtime.schema.json"
RESERVED_ENVIRONMENT = {
    "CUDA_VISIBLE_DEVICES": "the product sets it from runtime.gpu.devices (choose GPUs there)",
    ENV_JOB_NAME: "the product sets it from runtime.job_name",
}
INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""Set from runtime.nodes.network_interface: the interface NCCL and gloo talk over."""
# What a value must look like, for keys whose rule a bare schema message would not explain.
_EXPECTED = {
    "job_name": "a job name of at most 63 ASCII letters, digits, '.', '_' or '-', starting with a letter or digit",
    "paths.*": "a non-empty path",
    "gpu.devices": '"all", "none" or a non-empty list of distinct GPU indices (0, 1, ...)',
    "container.cuda_tag": f"a build of torch {TORCH_VERSION}: {', '.join(TORCH_CUDA_TAGS)}",
    "container.base_image": "an image reference without spaces such as python:3.11-slim, or null",
    "container.ipc": "host, private, shareable, container:NAME or service:NAME",
    "container.stop_grace_period": "a duration like 90s, 10m or 1h30m",
    "container.max_duration_hours": "a number of hours greater than 0, or null for no timer",
    "environment.*": "a string, number or boolean, or null to pass the variable through from the invoking shell",
    "nodes.rendezvous": "host:port of node 0, such as 10.0.0.1:29500 or node0.example:29500",
    "nodes.network_interface": "a network interface name such as eth0 or ib0, or null",
    "slurm.time": "Slurm's time limit [D-]HH:MM:SS such as 04:00:00 or 1-12:00:00, or null for the partition's",
    "slurm.partition": "a partition name (letters, digits, '_', '.', '-'), or null",
    "slurm.account": "an account name (letters, digits, '_', '.', '-'), or null",
    "slurm.qos": "a QOS name (letters, digits, '_', '.', '-'), or null",
    "slurm.image": "an image reference without spaces, or null for runtime.kubernetes.image",
    "slurm.extra.*": "an sbatch option on one line, starting with - or --, such as --constraint=a100",
    "kubernetes.namespace": "a namespace name: lowercase letters, digits and '-', at most 63",
    "kubernetes.image": "an image reference without spaces such as registry.example/astrai-train:v1, or null",
    "kubernetes.claims.*": "the name of a persistent volume claim (lowercase letters, digits, '-', '.'), or null",
    "environments.*.image": "an image reference without spaces such as my-env:1",
    "environments.*.port": "a port number from 1 to 65535",
    "environments.*.build": "a non-empty path of a folder holding the server's Dockerfile",
}
_TYPE_WORDS = {
    "object": "a mapping",
    "array": "a list",
    "string": "a string",
    "integer": "an integer",
    "number": "a number",
    "boolean": "true or false",
    "null": "null",
}


class SchemaError(AstraiError):
    """The product's own runtime schema is missing or broken: an installation bug, not a user's mistake."""

    exit_code = 3
    prefix = "internal error: "


@dataclass(frozen=True)
class Runtime:
    """A valid ``runtime:`` block with defaults filled in, paths made absolute and derived values computed."""

    config_path: Path
    job_name: str
    data_dir: Path
    model_dir: Path
    checkpoints_dir: Path
    job_dir: Path
    devices: str | tuple[int, ...]
    processes: int | None
    parallel_mode: str
    cuda_visible_devices: str | None
    cuda_tag: str
    base_image: str | None
    ipc: str
    stop_grace_period: str
    stop_grace_seconds: int
    stop_timeout_seconds: int
    checkpoint_keep_last: int
    max_duration_hours: float | None
    environment: dict[str, str | None]
    """Values are literal strings; None passes the variable through from the invoking shell."""
    max_restarts: int = 0
    node_count: int = 1
    """Hosts in the job (runtime.nodes.count)."""
    node: int = 0
    """Which of them this host is (``--node``)."""
    rendezvous: str | None = None
    rdzv_backend: str = "static"
    network_interface: str | None = None
    failure_timeout_seconds: int = 300
    rdzv_id: str | None = None
    """The c10d rendezvous id when a scheduler gives one (its job id); None: derived from the job name."""
    supervisor_pid: int | None = None
    """A host process the container may not outlive (the Slurm task that starts it); None for `invoke start`."""
    slurm: SlurmSettings | None = None
    """runtime.slurm with its defaults, when the block is given."""
    kubernetes: KubernetesSettings | None = None
    """runtime.kubernetes with its defaults, when the block is given."""
    environments: tuple[EnvironmentServer, ...] = ()
    """runtime.environments: the servers a job's episodes run in, by name."""

    @property
    def uses_gpu(self) -> bool:
        return self.devices != "none"

    @property
    def multi_node(self) -> bool:
        return self.node_count > 1

    def command(self, verb: str, *, per_node: bool = True) -> str:
        """The invoke command line for ``verb`` on this job (and node), quoted so that it can be pasted into a shell.

        ``per_node`` False: a command for the whole job (`submit`, or `stop` of a submitted job).
        """
        node = f" --node {self.node}" if self.multi_node and per_node else ""
        return f"invoke {verb} --config {shlex.quote(str(self.config_path))}{node}"

    @property
    def world_size(self) -> int | None:
        """Processes over all nodes, or None when each node counts its own GPUs (devices: all)."""
        return None if self.processes is None else self.processes * self.node_count


@dataclass(frozen=True)
class EnvironmentServer:
    """One of runtime.environments: an OpenEnv-compatible server a job's episodes run in."""

    name: str
    port: int
    build: Path | None = None
    """A folder holding its Dockerfile."""
    image: str | None = None
    """An image already there."""


@dataclass(frozen=True)
class SlurmSettings:
    partition: str | None
    account: str | None
    qos: str | None
    time: str | None
    requeue: bool
    launcher: str
    image: str | None
    extra: tuple[str, ...]


@dataclass(frozen=True)
class KubernetesSettings:
    namespace: str
    image: str | None
    claims: dict[str, str | None]
    node_selector: dict[str, str]
    tolerations: tuple[dict, ...]


def load_job_config(config_path, node: int = 0) -> tuple[dict, Runtime]:
    """Read, validate and resolve one YAML file: its whole document and its runtime, as seen by ``node``."""
    doc = load_yaml(config_path)
    problems = validate_config(doc, config_path)
    if problems:
        raise ConfigError(problems)
    runtime = _build_runtime(doc["runtime"], Path(os.path.abspath(config_path)))
    overlaps = _overlap_problems(runtime)
    if overlaps:
        raise ConfigError(overlaps)
    if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < runtime.node_count:
        raise ConfigError(
            f"--node: {node!r} is not a node of this job; runtime.nodes.count is {runtime.node_count} "
            f"in {config_path}, "
            f"so --node takes {'0' if runtime.node_count == 1 else f'0 to {runtime.node_count - 1}'}"
        )
    return doc, dataclasses.replace(runtime, node=node)


def _overlap_problems(runtime: Runtime) -> list[str]:
    """The checkpoints folder may not be, hold or sit inside the data or model folder (both mounted read-only)."""
    checkpoints = Path(os.path.realpath(runtime.checkpoints_dir))
    problems = []
    for key, folder in (("data", runtime.data_dir), ("model", runtime.model_dir)):
        other = Path(os.path.realpath(folder))
        if checkpoints == other:
            relation = "are the same folder"
        elif checkpoints.is_relative_to(other):
            relation = f"overlap: the checkpoints folder is inside the {key} folder"
        elif other.is_relative_to(checkpoints):
            relation = f"overlap: the {key} folder is inside the checkpoints folder"
        else:
            continue
        problems.append(
            f"{runtime.config_path}: runtime.paths.checkpoints: {runtime.checkpoints_dir} and runtime.paths.{key} "
            f"{folder} {relation}; the {key} folder is mounted read-only and the checkpoints folder read-write, "
            "so give them folders apart (such as ./checkpoints beside ./data and ./params)"
        )
    return problems


def resolve_runtime(config_path, node: int = 0) -> Runtime:
    return load_job_config(config_path, node)[1]


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``("10.0.0.1", 29500)`` from ``"10.0.0.1:29500"``; brackets of an IPv6 address are removed."""
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


PATH_KEYS = ("data", "model", "checkpoints")
JOB_DIR_ROOM = 160
"""Bytes of path the product adds below a job dir at most (state files, a checkpoint's staging folder)."""


def path_folder(runtime: Runtime, key: str) -> Path:
    """The folder a ``runtime.paths`` key leads to; for checkpoints that is the job dir inside it."""
    return {"data": runtime.data_dir, "model": runtime.model_dir, "checkpoints": runtime.job_dir}[key]


def check_paths(runtime: Runtime, keys=PATH_KEYS, *, need: str = "read") -> None:
    """Refuse broken ``runtime.paths`` (a file where a folder belongs, a dangling symlink, no permission).

    Every command runs this before it touches a path, so a broken one ends in a message naming its key,
    not a traceback, and with nothing changed on disk.
    """
    problems = path_problems(runtime, keys, need=need)
    if problems:
        raise ConfigError(problems)


def path_problems(runtime: Runtime, keys=PATH_KEYS, *, need: str = "read") -> list[str]:
    """Broken ``runtime.paths`` folders as ``FILE: runtime.paths.KEY: problem`` lines; reads the disk, writes nothing.

    ``need`` is what the command does with an existing folder: "read" it, "write" into it, or only "create"
    it when missing. A folder that does not exist yet is fine unless it must be created and cannot be.
    """
    problems = []
    for key in keys:
        # The job dir gets files and folders of its own below it: leave room for their names.
        room = JOB_DIR_ROOM if key == "checkpoints" else 0
        problem = folder_problem(path_folder(runtime, key), need=need, room=room)
        if problem is not None:
            problems.append(f"{runtime.config_path}: runtime.paths.{key}: {problem}")
    return problems


def trainer_value(doc: dict, section: str, key: str, default=None):
    """One trainer setting as written, or ``default``; trainer sections are validated in the container, not here."""
    values = doc.get(section) if isinstance(doc, dict) else None
    return values.get(key, default) if isinstance(values, dict) else default


def validate_config(doc: dict, config_path) -> list[str]:
    """Every problem of the top level and of the runtime block, sorted by dotted path."""
    if not isinstance(doc, dict):
        return [f"{config_path}: expected a mapping with a runtime: block at the top level, got {_show(doc)}"]
    problems = _section_problems(doc)
    runtime = doc.get("runtime")
    if isinstance(runtime, dict):
        schema_problems = _schema_problems(runtime)
        broken = {path for path, _ in schema_problems}
        problems += schema_problems + _rule_problems(runtime, broken)
    return [f"{config_path}: {path}: {message}" for path, message in sorted(set(problems))]


def _section_problems(doc: dict) -> list[tuple[str, str]]:
    problems = [(str(key), unknown("unknown section", key, SECTIONS)) for key in doc if key not in SECTIONS]
    if "runtime" not in doc:
        problems.append(("runtime", "missing: the file needs a runtime: block (write runtime: {} for all defaults)"))
    elif not isinstance(doc["runtime"], dict):
        problems.append(("runtime", f"expected a mapping of runtime settings, got {_show(doc['runtime'])}"))
    return problems


def _schema_problems(runtime: dict) -> list[tuple[str, str]]:
    problems = []
    for error in _validator().iter_errors(runtime):
        where = ["runtime", *error.absolute_path]
        if error.validator == "additionalProperties" and error.validator_value is False:
            allowed = list(error.schema.get("properties", {}))
            problems += [
                (_dotted(*where, key), unknown("unknown key", key, allowed))
                for key in error.instance
                if key not in allowed
            ]
        elif "propertyNames" in error.relative_schema_path and where[1:2] == ["environments"]:
            problems.append(
                (
                    _dotted(*where, error.instance),
                    "expected a server name: lowercase letters, digits and '-', starting with a letter or digit, at "
                    f"most 40 (a service and a host are named after it), got {_show(error.instance)}",
                )
            )
        elif "propertyNames" in error.relative_schema_path:
            problems.append(
                (
                    _dotted(*where, error.instance),
                    "expected an environment variable name: letters, "
                    f"digits and '_', not starting with a digit, got {_show(error.instance)}",
                )
            )
        else:
            problems.append((_dotted(*where), _schema_message(error, _dotted(*where[1:]))))
    return problems


def _schema_message(error: jsonschema.ValidationError, key: str) -> str:
    got = _show(error.instance)
    expected = next((text for pattern, text in _EXPECTED.items() if fnmatch.fnmatchcase(key, pattern)), None)
    if expected:
        return f"expected {expected}, got {got}"
    if error.validator == "type":
        types = [error.validator_value] if isinstance(error.validator_value, str) else error.validator_value
        return f"expected {' or '.join(_TYPE_WORDS.get(name, name) for name in types)}, got {got}"
    if error.validator == "enum":
        allowed = [str(value) for value in error.validator_value]
        match = close_match(error.instance, allowed)
        return f"expected one of {', '.join(allowed)}, got {got}{f' (did you mean {match!r}?)' if match else ''}"
    if error.validator == "minimum":
        return f"must be {error.validator_value} or more, got {got}"
    return error.message


def _rule_problems(raw: dict, broken: set[str]) -> list[tuple[str, str]]:
    """The cross-field rules, each run only when the keys it reads passed the schema."""
    runtime = _with_defaults(raw)

    def usable(*keys: str) -> bool:
        return all(_is_clean(f"runtime.{key}", broken) for key in keys)

    problems = []
    for name in ("data", "model", "checkpoints"):
        if usable(f"paths.{name}"):
            try:
                Path(runtime["paths"][name]).expanduser()
            except RuntimeError as exc:
                problems.append((f"runtime.paths.{name}", f"cannot expand ~ in {_show(runtime['paths'][name])}: {exc}"))
    if usable("gpu.devices", "gpu.processes", "gpu.parallel_mode"):
        nodes = runtime["nodes"]["count"] if usable("nodes.count") else 1
        problems += _gpu_problems(runtime["gpu"], processes_given="processes" in raw.get("gpu", {}), nodes=nodes)
    if (
        usable("gpu.devices", "container.cuda_tag")
        and runtime["container"]["cuda_tag"] == "cpu"
        and runtime["gpu"]["devices"] != "none"
    ):
        problems.append(
            (
                "runtime.container.cuda_tag",
                "the cpu image has no CUDA and cannot use GPUs, but "
                f"runtime.gpu.devices is {_show(runtime['gpu']['devices'])}; "
                "use a cuNNN tag such as cu128, or set runtime.gpu.devices: none",
            )
        )
    if usable("container.stop_grace_period"):
        timeout = runtime["container"]["stop_timeout_seconds"] if usable("container.stop_timeout_seconds") else None
        problems += _stop_problems(runtime["container"]["stop_grace_period"], timeout)
    hours = runtime["container"].get("max_duration_hours") if usable("container.max_duration_hours") else None
    if hours is not None and not math.isfinite(hours):
        problems.append(("runtime.container.max_duration_hours", f"expected a finite number of hours, got {hours}"))
    if usable("nodes.count", "nodes.rendezvous"):
        scheduled = runtime["slurm"] is not None or runtime["kubernetes"] is not None
        problems += _node_problems(runtime["nodes"], scheduled=scheduled)
    if (
        usable("nodes.network_interface")
        and runtime["nodes"]["network_interface"] is not None
        and isinstance(runtime["environment"], dict)
    ):
        problems += [
            (f"runtime.environment.{name}", "set from runtime.nodes.network_interface; give the interface there only")
            for name in INTERFACE_VARIABLES
            if name in runtime["environment"]
        ]
    if isinstance(runtime["environment"], dict):
        problems += [
            (f"runtime.environment.{name}", _reserved_reason(name))
            for name in runtime["environment"]
            if usable(f"environment.{name}") and _reserved_reason(name)
        ]
    if isinstance(runtime["environments"], dict):
        problems += _environments_problems(runtime, usable)
    return problems


def _environments_problems(runtime: dict, usable) -> list[tuple[str, str]]:
    """Each server environment has its image or its Dockerfile folder, and the job runs on one host."""
    problems = []
    for name, server in runtime["environments"].items():
        if not usable(f"environments.{name}") or not isinstance(server, dict):
            continue
        given = [key for key in ("build", "image") if key in server]
        if len(given) != 1:
            problems.append(
                (
                    f"runtime.environments.{name}",
                    "give exactly one of build (a folder holding the server's Dockerfile) and image (an image name)"
                    + (
                        f", not both ({_show(server['build'])} and {_show(server['image'])})" if len(given) == 2 else ""
                    ),
                )
            )
    if runtime["environments"] and usable("nodes.count") and runtime["nodes"]["count"] > 1:
        problems.append(
            (
                "runtime.environments",
                f"a job of {runtime['nodes']['count']} hosts (runtime.nodes.count) cannot have server environments "
                "yet: each host would need its own; run the job on one host, or make the environment a class "
                "(training.environment: module:Class)",
            )
        )
    return problems


def _gpu_problems(gpu: dict, processes_given: bool, nodes: int = 1) -> list[tuple[str, str]]:
    devices, mode = gpu["devices"], gpu["parallel_mode"]
    problems = []
    if devices != "none" and processes_given:
        problems.append(
            (
                "runtime.gpu.processes",
                "only applies with runtime.gpu.devices: none (CPU); with devices "
                f"{_show(devices)} there is one process per GPU, so remove it",
            )
        )
    count = _process_count(devices, gpu["processes"])
    if nodes > 1 and mode == "none":
        return problems + [
            (
                "runtime.gpu.parallel_mode",
                f"none needs exactly 1 process, but runtime.nodes.count is {nodes}; auto picks the right mode",
            )
        ]
    if count is None or count < 1:
        return problems
    try:
        resolve_parallel_mode(mode, count * nodes)
    except ValueError:
        if devices == "none":
            source = f"runtime.gpu.processes is {count}{'' if processes_given else ' (the default)'}"
        else:
            source = f"runtime.gpu.devices {_show(devices)} gives {count}"
        if nodes > 1:
            source += f" per node on {nodes} nodes"
        needs = "exactly 1 process" if mode == "none" else "2 or more processes"
        problems.append(("runtime.gpu.parallel_mode", f"{mode} needs {needs}, but {source}; auto picks the right mode"))
    return problems


def _node_problems(nodes: dict, scheduled: bool = False) -> list[tuple[str, str]]:
    endpoint = nodes["rendezvous"]
    if endpoint is not None:
        port = split_endpoint(endpoint)[1]
        if not 1 <= port <= 65535:
            return [
                (
                    "runtime.nodes.rendezvous",
                    f"port {port} is out of range; use a port from 1 to 65535, such as 29500, in {_show(endpoint)}",
                )
            ]
    elif nodes["count"] > 1 and not scheduled:
        return [
            (
                "runtime.nodes.rendezvous",
                f"missing: runtime.nodes.count is {nodes['count']}, so the nodes need "
                "a meeting point: host:port of node 0 that every node can reach, such as 10.0.0.1:29500 "
                "(or add a runtime.slurm or runtime.kubernetes block: a scheduler gives it)",
            )
        ]
    return []


def _stop_problems(grace: str, timeout: int | None) -> list[tuple[str, str]]:
    """A grace period Docker can honour: longer than zero, and not shorter than the trainer's stop timeout."""
    try:
        grace_seconds = parse_duration(grace)
    except ValueError as exc:
        return [("runtime.container.stop_grace_period", str(exc))]
    if timeout is None or grace_seconds >= timeout:
        return []
    return [
        (
            "runtime.container.stop_grace_period",
            f"{grace} ({grace_seconds} seconds) is shorter than "
            f"runtime.container.stop_timeout_seconds ({timeout} seconds): Docker would kill the trainer before "
            f"its emergency checkpoint is written; make it at least {timeout}s",
        )
    ]


def _reserved_reason(name: str) -> str | None:
    if name in RESERVED_ENVIRONMENT:
        return f"reserved: {RESERVED_ENVIRONMENT[name]}; remove it from runtime.environment"
    if name.startswith(RESERVED_ENV_PREFIX):
        return f"reserved: names starting with {RESERVED_ENV_PREFIX} belong to the product; rename it"
    return None


def _build_runtime(raw: dict, config_path: Path) -> Runtime:
    runtime = _with_defaults(raw)
    paths, gpu, container, nodes = runtime["paths"], runtime["gpu"], runtime["container"], runtime["nodes"]
    devices = gpu["devices"] if isinstance(gpu["devices"], str) else tuple(int(index) for index in gpu["devices"])
    count = _process_count(devices, int(gpu["processes"]))
    checkpoints_dir = _absolute_path(paths["checkpoints"], config_path.parent)
    hours = container["max_duration_hours"]
    return Runtime(
        config_path=config_path,
        job_name=runtime["job_name"],
        data_dir=_absolute_path(paths["data"], config_path.parent),
        model_dir=_absolute_path(paths["model"], config_path.parent),
        checkpoints_dir=checkpoints_dir,
        job_dir=checkpoints_dir / runtime["job_name"],
        devices=devices,
        processes=count,
        parallel_mode=gpu["parallel_mode"]
        if count is None
        else resolve_parallel_mode(gpu["parallel_mode"], count * int(nodes["count"])),
        cuda_visible_devices=_cuda_visible_devices(devices),
        cuda_tag=container["cuda_tag"],
        base_image=container["base_image"],
        ipc=container["ipc"],
        stop_grace_period=container["stop_grace_period"],
        stop_grace_seconds=parse_duration(container["stop_grace_period"]),
        stop_timeout_seconds=int(container["stop_timeout_seconds"]),
        checkpoint_keep_last=int(container["checkpoint_keep_last"]),
        max_duration_hours=None if hours is None else float(hours),
        environment={name: _environment_text(value) for name, value in runtime["environment"].items()},
        max_restarts=int(container["max_restarts"]),
        node_count=int(nodes["count"]),
        rendezvous=nodes["rendezvous"],
        rdzv_backend=nodes["backend"],
        network_interface=nodes["network_interface"],
        failure_timeout_seconds=int(nodes["failure_timeout_seconds"]),
        slurm=None if runtime["slurm"] is None else _slurm_settings(runtime["slurm"]),
        kubernetes=None if runtime["kubernetes"] is None else _kubernetes_settings(runtime["kubernetes"]),
        environments=tuple(
            EnvironmentServer(
                name,
                int(server["port"]),
                _absolute_path(server["build"], config_path.parent) if "build" in server else None,
                server.get("image"),
            )
            for name, server in sorted(runtime["environments"].items())
        ),
    )


def _slurm_settings(block: dict) -> SlurmSettings:
    return SlurmSettings(
        partition=block["partition"],
        account=block["account"],
        qos=block["qos"],
        time=block["time"],
        requeue=bool(block["requeue"]),
        launcher=block["launcher"],
        image=block["image"],
        extra=tuple(block["extra"]),
    )


def _kubernetes_settings(block: dict) -> KubernetesSettings:
    return KubernetesSettings(
        namespace=block["namespace"],
        image=block["image"],
        claims={name: block["claims"].get(name) for name in ("data", "model", "checkpoints")},
        node_selector=dict(block["node_selector"]),
        tolerations=tuple(block["tolerations"]),
    )


def _process_count(devices, processes: int) -> int | None:
    """Processes the job runs, or None when devices is "all": only the container can count the host's GPUs."""
    if devices == "all":
        return None
    return processes if devices == "none" else len(devices)


def _cuda_visible_devices(devices) -> str | None:
    if devices == "all":
        return None
    return "" if devices == "none" else ",".join(str(index) for index in devices)


def _environment_text(value) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _absolute_path(text: str, base: Path) -> Path:
    """``text`` with ~ expanded, relative to ``base``, normalised; reads nothing from disk."""
    return Path(os.path.normpath(base / Path(text).expanduser()))


def _with_defaults(raw: dict) -> dict:
    """A copy of ``raw`` with the schema's defaults filled in wherever the enclosing value is a mapping."""

    def fill(schema: dict, value: dict) -> dict:
        for name, rule in schema.get("properties", {}).items():
            if name not in value and "default" in rule:
                value[name] = copy.deepcopy(rule["default"])
            if isinstance(value.get(name), dict):
                fill(rule, value[name])
        return value

    return fill(_validator().schema, copy.deepcopy(raw))


def _validator() -> jsonschema.Draft202012Validator:
    return _load_validator(SCHEMA_PATH)


@functools.cache
def _load_validator(schema_path: Path) -> jsonschema.Draft202012Validator:
    try:
        schema = json.loads(schema_path.read_text(encoding="utf-8"))
        jsonschema.Draft202012Validator.check_schema(schema)
    except OSError as exc:
        raise SchemaError(f"cannot read the runtime schema {schema_path}: {exc.strerror}") from exc
    except ValueError as exc:
        raise SchemaError(f"the runtime schema {schema_path} is not valid JSON: {exc}") from exc
    except jsonschema.SchemaError as exc:
        raise SchemaError(f"the runtime schema {schema_path} is not a valid JSON Schema: {exc.message}") from exc
    if not isinstance(schema, dict):
        raise SchemaError(f"the runtime schema {schema_path} must be a JSON object")
    return _EcmaValidator(schema)


def _ecma_pattern(validator, pattern: str, instance, schema):
    """``pattern`` as JSON Schema means it (ECMA-262), where a final ``$`` matches only at the very end.

    Python's ``$`` also matches before a trailing newline, which would let ``"cpu\\n"`` pass as a cuda_tag.
    """
    anchored = pattern[:-1] + "\\Z" if pattern.endswith("$") and not pattern.endswith("\\$") else pattern
    if validator.is_type(instance, "string") and not re.search(anchored, instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


_EcmaValidator = jsonschema.validators.extend(jsonschema.Draft202012Validator, {"pattern": _ecma_pattern})


def _is_clean(path: str, broken: set[str]) -> bool:
    """True when no schema problem sits at ``path``, inside it, or at any key enclosing it."""
    return not any(bad == path or bad.startswith(path + ".") or path.startswith(bad + ".") for bad in broken)


def _dotted(*keys) -> str:
    return ".".join(str(key) for key in keys)


def _show(value) -> str:
    """A value as a user would recognise it in a message: JSON-like, cut short when long."""
    if isinstance(value, datetime.date):
        return f"the date {value} (quote it to keep it as text)"
    return show_value(value)
