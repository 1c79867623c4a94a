"""Malformed and seed runtime blocks, shared by the validation tests and the command-line tests."""

from __future__ import annotations

import copy
import math

import yaml

# The runtime block with every seed field written out, as docs/runtime.md describes it.
SEED_YAML = """\
runtime:
  job_name: astrai-train            # ^[A-Za-z0-9][A-Za-z0-9._-]*$
  paths:                            # relative paths resolve from the YAML's folder
    data: ./data                    # -> /data (read-only)
    model: ./params                 # -> /models/base (read-only)
    checkpoints: ./checkpoints      # -> /checkpoints (read-write); job dir = <checkpoints>/<job_name>
  gpu:
    devices: all                    # all | non-empty list of GPU indices | none (CPU, extension)
    parallel_mode: auto             # auto | none | ddp | fsdp
  container:
    cuda_tag: cu128                 # cuNNN or cpu: which torch build the image gets
    ipc: host
    stop_grace_period: 10m
    stop_timeout_seconds: 600
    checkpoint_keep_last: 5         # default for `clean --keep`
    max_duration_hours: 12          # optional: detached host timer calls graceful stop
  environment:                      # optional: passed to the container as-is
    NCCL_P2P_DISABLE: "1"
"""
SEED = yaml.safe_load(SEED_YAML)
DELETE = object()


def mutated(changes: dict) -> dict:
    """The seed document with each dotted key set to a value (or removed with DELETE)."""
    doc = copy.deepcopy(SEED)
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        node = doc
        for key in parents:
            node = node.setdefault(key, {})
        if value is DELETE:
            del node[last]
        else:
            node[last] = value
    return doc


MALFORMED = [
    # (test id, changes to the seed, dotted key the error must name, text the message must hold)
    ("job-name-leading-dash", {"runtime.job_name": "-bad"}, "runtime.job_name", "starting with a letter or digit"),
    ("job-name-empty", {"runtime.job_name": ""}, "runtime.job_name", 'got ""'),
    ("job-name-too-long", {"runtime.job_name": "a" * 64}, "runtime.job_name", "at most 63"),
    ("job-name-space", {"runtime.job_name": "my job"}, "runtime.job_name", '"my job"'),
    ("job-name-slash", {"runtime.job_name": "a/b"}, "runtime.job_name", '"a/b"'),
    ("job-name-number", {"runtime.job_name": 123}, "runtime.job_name", "got 123"),
    ("paths-not-mapping", {"runtime.paths": "./x"}, "runtime.paths", "expected a mapping"),
    ("path-empty", {"runtime.paths.data": ""}, "runtime.paths.data", "non-empty path"),
    ("path-null", {"runtime.paths.model": None}, "runtime.paths.model", "got null"),
    ("path-list", {"runtime.paths.checkpoints": ["a"]}, "runtime.paths.checkpoints", '["a"]'),
    ("path-unknown", {"runtime.paths.logs": "./logs"}, "runtime.paths.logs", "unknown key"),
    (
        "devices-typo",
        {"runtime.gpu.devices": "al"},
        "runtime.gpu.devices",
        'expected "all", "none" or a non-empty list of distinct GPU indices (0, 1, ...), got "al"',
    ),
    ("devices-empty", {"runtime.gpu.devices": []}, "runtime.gpu.devices", "got []"),
    ("devices-repeated", {"runtime.gpu.devices": [0, 0]}, "runtime.gpu.devices", "distinct"),
    ("devices-negative", {"runtime.gpu.devices": [-1]}, "runtime.gpu.devices", "got [-1]"),
    ("devices-bool", {"runtime.gpu.devices": [True]}, "runtime.gpu.devices", "got [true]"),
    ("devices-comma-string", {"runtime.gpu.devices": "0,1"}, "runtime.gpu.devices", 'got "0,1"'),
    ("devices-bare-int", {"runtime.gpu.devices": 0}, "runtime.gpu.devices", "got 0"),
    ("devices-fraction", {"runtime.gpu.devices": [1.5]}, "runtime.gpu.devices", "got [1.5]"),
    ("gpu-key-typo", {"runtime.gpu.device": [0]}, "runtime.gpu.device", "did you mean 'devices'?"),
    ("gpu-null", {"runtime.gpu": None}, "runtime.gpu", "expected a mapping, got null"),
    (
        "mode-typo",
        {"runtime.gpu.parallel_mode": "dpp"},
        "runtime.gpu.parallel_mode",
        "expected one of auto, none, ddp, fsdp, got \"dpp\" (did you mean 'ddp'?)",
    ),
    (
        "ddp-one-gpu",
        {"runtime.gpu.devices": [0], "runtime.gpu.parallel_mode": "ddp"},
        "runtime.gpu.parallel_mode",
        "ddp needs 2 or more processes, but runtime.gpu.devices [0] gives 1",
    ),
    (
        "none-two-gpus",
        {"runtime.gpu.devices": [0, 1], "runtime.gpu.parallel_mode": "none"},
        "runtime.gpu.parallel_mode",
        "none needs exactly 1 process, but runtime.gpu.devices [0, 1] gives 2",
    ),
    (
        "fsdp-cpu-default-processes",
        {"runtime.gpu.devices": "none", "runtime.gpu.parallel_mode": "fsdp", "runtime.container.cuda_tag": "cpu"},
        "runtime.gpu.parallel_mode",
        "fsdp needs 2 or more processes, but runtime.gpu.processes is 1 (the default)",
    ),
    (
        "none-cpu-three-processes",
        {"runtime.gpu.devices": "none", "runtime.gpu.processes": 3, "runtime.gpu.parallel_mode": "none"},
        "runtime.gpu.parallel_mode",
        "none needs exactly 1 process, but runtime.gpu.processes is 3",
    ),
    ("processes-with-gpus", {"runtime.gpu.processes": 2}, "runtime.gpu.processes", "only applies with"),
    (
        "processes-zero",
        {"runtime.gpu.devices": "none", "runtime.gpu.processes": 0},
        "runtime.gpu.processes",
        "must be 1 or more, got 0",
    ),
    (
        "processes-bool",
        {"runtime.gpu.devices": "none", "runtime.gpu.processes": True},
        "runtime.gpu.processes",
        "expected an integer, got true",
    ),
    (
        "cuda-tag-two-digits",
        {"runtime.container.cuda_tag": "cu12"},
        "runtime.container.cuda_tag",
        "a build of torch 2.13.0: cpu, cu126, cu128, cu130",
    ),
    ("cuda-tag-word", {"runtime.container.cuda_tag": "cuda128"}, "runtime.container.cuda_tag", "cpu, cu126"),
    ("cuda-tag-number", {"runtime.container.cuda_tag": 128}, "runtime.container.cuda_tag", "got 128"),
    ("cuda-tag-trailing-newline", {"runtime.container.cuda_tag": "cpu\n"}, "runtime.container.cuda_tag", "cu126"),
    (
        "cuda-tag-not-built-for-torch",
        {"runtime.container.cuda_tag": "cu118"},
        "runtime.container.cuda_tag",
        'cu128, cu130, got "cu118"',
    ),
    (
        "cpu-image-with-gpus",
        {"runtime.container.cuda_tag": "cpu"},
        "runtime.container.cuda_tag",
        'cannot use GPUs, but runtime.gpu.devices is "all"',
    ),
    ("ipc-typo", {"runtime.container.ipc": "hots"}, "runtime.container.ipc", "container:NAME or service:NAME"),
    ("ipc-container-without-name", {"runtime.container.ipc": "container:"}, "runtime.container.ipc", "got"),
    (
        "grace-with-space",
        {"runtime.container.stop_grace_period": "10 m"},
        "runtime.container.stop_grace_period",
        "like 90s, 10m or 1h30m",
    ),
    ("grace-empty", {"runtime.container.stop_grace_period": ""}, "runtime.container.stop_grace_period", 'got ""'),
    (
        "grace-bare-number",
        {"runtime.container.stop_grace_period": 600},
        "runtime.container.stop_grace_period",
        "got 600",
    ),
    (
        "grace-missing-unit",
        {"runtime.container.stop_grace_period": "1m30"},
        "runtime.container.stop_grace_period",
        '"1m30"',
    ),
    (
        "grace-zero",
        {"runtime.container.stop_grace_period": "0s"},
        "runtime.container.stop_grace_period",
        "longer than zero",
    ),
    (
        "grace-zero-with-broken-timeout",
        {"runtime.container.stop_grace_period": "0m", "runtime.container.stop_timeout_seconds": "x"},
        "runtime.container.stop_grace_period",
        "longer than zero",
    ),
    (
        "grace-shorter-than-timeout",
        {"runtime.container.stop_grace_period": "5m"},
        "runtime.container.stop_grace_period",
        "(300 seconds) is shorter than runtime.container.stop_timeout_seconds (600 seconds)",
    ),
    (
        "timeout-zero",
        {"runtime.container.stop_timeout_seconds": 0},
        "runtime.container.stop_timeout_seconds",
        "must be 1 or more",
    ),
    (
        "timeout-string",
        {"runtime.container.stop_timeout_seconds": "600"},
        "runtime.container.stop_timeout_seconds",
        'expected an integer, got "600"',
    ),
    (
        "timeout-bool",
        {"runtime.container.stop_timeout_seconds": True},
        "runtime.container.stop_timeout_seconds",
        "got true",
    ),
    (
        "timeout-key-typo",
        {"runtime.container.stop_timout_seconds": 600},
        "runtime.container.stop_timout_seconds",
        "unknown key; did you mean 'stop_timeout_seconds'?",
    ),
    (
        "keep-last-zero",
        {"runtime.container.checkpoint_keep_last": 0},
        "runtime.container.checkpoint_keep_last",
        "must be 1 or more",
    ),
    (
        "keep-last-fraction",
        {"runtime.container.checkpoint_keep_last": 2.5},
        "runtime.container.checkpoint_keep_last",
        "expected an integer, got 2.5",
    ),
    (
        "hours-zero",
        {"runtime.container.max_duration_hours": 0},
        "runtime.container.max_duration_hours",
        "greater than 0",
    ),
    ("hours-negative", {"runtime.container.max_duration_hours": -1}, "runtime.container.max_duration_hours", "got -1"),
    (
        "hours-with-unit",
        {"runtime.container.max_duration_hours": "12h"},
        "runtime.container.max_duration_hours",
        'got "12h"',
    ),
    (
        "hours-infinite",
        {"runtime.container.max_duration_hours": math.inf},
        "runtime.container.max_duration_hours",
        "finite",
    ),
    ("base-image-empty", {"runtime.container.base_image": ""}, "runtime.container.base_image", "without spaces"),
    ("base-image-space", {"runtime.container.base_image": "my image"}, "runtime.container.base_image", '"my image"'),
    ("base-image-number", {"runtime.container.base_image": 3}, "runtime.container.base_image", "got 3"),
    ("container-not-mapping", {"runtime.container": "big"}, "runtime.container", "expected a mapping"),
    ("environment-list", {"runtime.environment": ["A=1"]}, "runtime.environment", "expected a mapping"),
    (
        "environment-name-digit",
        {"runtime.environment": {"1BAD": "x"}},
        "runtime.environment.1BAD",
        "environment variable name",
    ),
    (
        "environment-name-dash",
        {"runtime.environment": {"BAD-NAME": "x"}},
        "runtime.environment.BAD-NAME",
        'got "BAD-NAME"',
    ),
    (
        "environment-list-value",
        {"runtime.environment": {"X": [1]}},
        "runtime.environment.X",
        "or null to pass the variable through from the invoking shell, got [1]",
    ),
    ("environment-map-value", {"runtime.environment": {"X": {"a": 1}}}, "runtime.environment.X", '{"a": 1}'),
    (
        "environment-cuda-visible",
        {"runtime.environment": {"CUDA_VISIBLE_DEVICES": "0"}},
        "runtime.environment.CUDA_VISIBLE_DEVICES",
        "runtime.gpu.devices",
    ),
    (
        "environment-job-name",
        {"runtime.environment": {"TRAIN_JOB_NAME": "x"}},
        "runtime.environment.TRAIN_JOB_NAME",
        "reserved",
    ),
    (
        "environment-astrai-prefix",
        {"runtime.environment": {"ASTRAI_DEBUG": 1}},
        "runtime.environment.ASTRAI_DEBUG",
        "ASTRAI_",
    ),
    (
        "runtime-unknown-key",
        {"runtime.extras": 1},
        "runtime.extras",
        "unknown key; allowed: container, environment, environments, gpu, job_name",
    ),
    ("runtime-not-mapping", {"runtime": "gpu"}, "runtime", 'expected a mapping of runtime settings, got "gpu"'),
    ("runtime-empty", {"runtime": None}, "runtime", "got null"),
    ("runtime-missing", {"runtime": DELETE}, "runtime", "missing"),
    ("section-typo", {"trainig": {"max_steps": 1}}, "trainig", "unknown section; did you mean 'training'?"),
    ("nodes-count-zero", {"runtime.nodes": {"count": 0}}, "runtime.nodes.count", "must be 1 or more, got 0"),
    (
        "nodes-rendezvous-no-port",
        {"runtime.nodes": {"count": 2, "rendezvous": "10.0.0.1"}},
        "runtime.nodes.rendezvous",
        'host:port of node 0, such as 10.0.0.1:29500 or node0.example:29500, got "10.0.0.1"',
    ),
    (
        "nodes-rendezvous-port-range",
        {"runtime.nodes": {"count": 2, "rendezvous": "10.0.0.1:70000"}},
        "runtime.nodes.rendezvous",
        "port 70000 is out of range",
    ),
    ("nodes-rendezvous-missing", {"runtime.nodes": {"count": 2}}, "runtime.nodes.rendezvous", "missing"),
    (
        "nodes-backend",
        {"runtime.nodes": {"backend": "etcd"}},
        "runtime.nodes.backend",
        'expected one of static, c10d, got "etcd"',
    ),
    (
        "nodes-interface",
        {"runtime.nodes": {"network_interface": "eth 0"}},
        "runtime.nodes.network_interface",
        'got "eth 0"',
    ),
    (
        "nodes-interface-and-env",
        {"runtime.nodes": {"network_interface": "eth0"}, "runtime.environment": {"NCCL_SOCKET_IFNAME": "eth1"}},
        "runtime.environment.NCCL_SOCKET_IFNAME",
        "runtime.nodes.network_interface",
    ),
    (
        "nodes-timeout",
        {"runtime.nodes": {"failure_timeout_seconds": 1}},
        "runtime.nodes.failure_timeout_seconds",
        "must be 5 or more",
    ),
    ("nodes-unknown", {"runtime.nodes": {"cont": 2}}, "runtime.nodes.cont", "did you mean 'count'?"),
    (
        "nodes-mode-none",
        {"runtime.nodes": {"count": 2, "rendezvous": "h:1"}, "runtime.gpu.parallel_mode": "none"},
        "runtime.gpu.parallel_mode",
        "runtime.nodes.count is 2",
    ),
    (
        "environments-name",
        {"runtime.environments": {"Calc_1": {"image": "calc:1", "port": 8000}}},
        "runtime.environments.Calc_1",
        "expected a server name: lowercase letters, digits and '-'",
    ),
    (
        "environments-port",
        {"runtime.environments": {"calc": {"image": "calc:1", "port": 70000}}},
        "runtime.environments.calc.port",
        "expected a port number from 1 to 65535, got 70000",
    ),
    (
        "environments-no-port",
        {"runtime.environments": {"calc": {"image": "calc:1"}}},
        "runtime.environments.calc",
        "'port' is a required property",
    ),
    (
        "environments-both",
        {"runtime.environments": {"calc": {"image": "calc:1", "build": "./calc", "port": 8000}}},
        "runtime.environments.calc",
        "give exactly one of build (a folder holding the server's Dockerfile) and image (an image name), not both",
    ),
    (
        "environments-neither",
        {"runtime.environments": {"calc": {"port": 8000}}},
        "runtime.environments.calc",
        "give exactly one of build",
    ),
    (
        "environments-unknown",
        {"runtime.environments": {"calc": {"image": "calc:1", "port": 8000, "ports": 1}}},
        "runtime.environments.calc.ports",
        "did you mean 'port'?",
    ),
    (
        "environments-several-hosts",
        {
            "runtime.environments": {"calc": {"image": "calc:1", "port": 8000}},
            "runtime.nodes": {"count": 2, "rendezvous": "h:1"},
        },
        "runtime.environments",
        "a job of 2 hosts (runtime.nodes.count) cannot have server environments yet",
    ),
    (
        "max-restarts-negative",
        {"runtime.container.max_restarts": -1},
        "runtime.container.max_restarts",
        "must be 0 or more",
    ),
]
