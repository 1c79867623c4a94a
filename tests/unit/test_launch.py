"""One job rendered three ways (Compose, the sbatch script, the Kubernetes manifests) gives its container the same
mounts, read-only flags, environment and trainer arguments: each renderer reads them from astrai.host.launch."""

from __future__ import annotations

import shlex

import pytest
import yaml

from astrai.common.contract import (
    CONTAINER_CHECKPOINTS,
    CONTAINER_CONFIG,
    CONTAINER_DATA,
    CONTAINER_MODEL,
    ENV_NODE_RANK,
    ENV_STOPPED_EXIT_CODE,
)
from astrai.host import compose, kubernetes, launch, slurm_script
from astrai.host.runtime import resolve_runtime
from tests.support import write_config

ODD = "a b $x $(y) 'q' é"
"""A value each renderer must pass on literally: a space, $, $( (Kubernetes expands it), a quote, non-ASCII."""
ARGS = ["--max_lr", "1e-3", "--run_note", ODD]
EXPECTED_MOUNTS = {CONTAINER_DATA: True, CONTAINER_MODEL: True, CONTAINER_CHECKPOINTS: False, CONTAINER_CONFIG: True}


def _job(tmp_path, gpu: dict):
    runtime = {
        "job_name": "three-ways",
        "gpu": gpu,
        "container": {"cuda_tag": "cpu" if gpu["devices"] == "none" else "cu128", "stop_timeout_seconds": 120},
        "nodes": {"count": 2, "rendezvous": "10.0.0.1:29500"},
        "environment": {"NCCL_DEBUG": "WARN", "NOTE": ODD},
        "slurm": {"launcher": "pyxis", "image": "docker://registry.example/astrai:v1", "time": "04:00:00"},
        "kubernetes": {
            "image": "registry.example/astrai:v1",
            "claims": {"data": "corpus", "model": "base", "checkpoints": "ckpts"},
        },
    }
    return resolve_runtime(write_config(tmp_path, runtime, {"training": {"max_steps": 10}}))


def _compose(runtime, node: int):
    import dataclasses

    service = compose.render_override(dataclasses.replace(runtime, node=node), ARGS, uid=1000, gid=1000)
    service = service["services"][compose.SERVICE]
    unescape = lambda text: text.replace("$$", "$")  # noqa: E731
    mounts = {volume["target"]: volume["read_only"] for volume in service["volumes"]}
    env = {name: unescape(value) for name, value in service["environment"].items()}
    return mounts, env, [unescape(arg) for arg in service["command"]]


def _sbatch(runtime):
    script = slurm_script.render_script(runtime, ARGS, python="/usr/bin/python3")
    (task,) = [line for line in script.splitlines() if line.startswith("srun ") and line.endswith(" &")]
    words = shlex.split(task[: -len(" &")])
    (option,) = [word for word in words if word.startswith("--container-mounts=")]
    mounts = {}
    for entry in option.removeprefix("--container-mounts=").split(","):
        _source, target, *flags = entry.split(":")
        mounts[target] = flags == ["ro"]
    env = {}
    for line in script.splitlines():
        if line.startswith("export ") and "=" in line and "$" not in line.split("=", 1)[0]:
            name, value = line.removeprefix("export ").split("=", 1)
            env[name] = shlex.split(value)[0] if value else ""
    for given in ("ASTRAI_RDZV_ENDPOINT", "ASTRAI_RDZV_ID"):  # from the allocation, in the batch shell
        env.pop(given, None)
    assert f'export {ENV_NODE_RANK}="$SLURM_NODEID"' in task  # each task's rank, from Slurm
    return mounts, env, words[words.index("astrai") + 1 :]


def _kubernetes(runtime):
    text = kubernetes.dump_manifests(runtime, kubernetes.render_manifests(runtime, ARGS))
    (job,) = [doc for doc in yaml.safe_load_all(text) if doc and doc["kind"] == "Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    unescape = lambda text: text.replace("$$(", "$(")  # noqa: E731
    mounts = {
        mount["mountPath"]: mount.get("readOnly", False)
        for mount in container["volumeMounts"]
        if mount["mountPath"] in EXPECTED_MOUNTS
    }
    env = {item["name"]: unescape(item["value"]) for item in container["env"] if "value" in item}
    given = {item["name"] for item in container["env"] if "valueFrom" in item}
    assert ENV_NODE_RANK in given  # each pod's rank, from its completion index
    env.pop("ASTRAI_RDZV_ENDPOINT")  # the headless Service's name for pod 0
    env.pop(ENV_STOPPED_EXIT_CODE)  # the Job's own retry rule
    return mounts, env, [unescape(arg) for arg in container["args"]]


@pytest.mark.parametrize("gpu", [{"devices": "none", "processes": 2}, {"devices": [0, 1]}], ids=["cpu", "gpu"])
def test_one_job_rendered_three_ways_gives_the_same_container(tmp_path, gpu):
    runtime = _job(tmp_path, gpu)
    spec = launch.scheduler_spec(runtime, ARGS)
    for node in (0, 1):
        mounts, env, args = _compose(runtime, node)
        assert mounts == EXPECTED_MOUNTS and args == ARGS
        # A node started by the host gets its rank, the rendezvous and its GPUs in its own environment.
        assert env[ENV_NODE_RANK] == str(node) and env["ASTRAI_RDZV_ENDPOINT"] == "10.0.0.1:29500"
        shared = {name: value for name, value in env.items() if name not in launch.SCHEDULER_GIVEN}
        if runtime.uses_gpu:
            assert shared.pop("ASTRAI_GPU_DEVICES") == "0,1" and spec.environment["ASTRAI_GPU_DEVICES"] == "all"
            assert shared.pop("CUDA_VISIBLE_DEVICES") == "0,1" and "CUDA_VISIBLE_DEVICES" not in spec.environment
            shared["ASTRAI_GPU_DEVICES"] = "all"
        else:
            assert shared["CUDA_VISIBLE_DEVICES"] == ""  # a CPU job hides every GPU, wherever it runs
        assert shared == spec.environment
    for render in (_sbatch, _kubernetes):
        mounts, env, args = render(runtime)
        assert mounts == EXPECTED_MOUNTS, render.__name__
        assert env == spec.environment, render.__name__
        assert args == ARGS, render.__name__
    assert spec.environment["NOTE"] == ODD and spec.environment["ASTRAI_NODES"] == "2"
