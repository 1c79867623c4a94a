"""The per-job Compose override and the `docker compose` command line, compared exactly."""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest
import yaml

from astrai.common.contract import LABEL_TORCH, TORCH_CUDA_TAGS, TORCH_VERSION
from astrai.host import compose
from astrai.host.runtime import resolve_runtime

BASE = "astrai-base:test"


def _runtime(
    tmp_path: Path,
    gpu: dict,
    environment: dict | None = None,
    nodes: dict | None = None,
    node: int = 0,
    container: dict | None = None,
):
    runtime = {
        "job_name": "demo.Job",
        "paths": {"data": "./data", "model": "/srv/models/base", "checkpoints": "./ckpt"},
        "gpu": gpu,
        "container": {
            "cuda_tag": "cpu" if gpu["devices"] == "none" else "cu128",
            "base_image": BASE,
            "ipc": "host",
            "stop_grace_period": "10m",
            "stop_timeout_seconds": 600,
        },
    }
    if environment is not None:
        runtime["environment"] = environment
    if nodes is not None:
        runtime["nodes"] = nodes
    runtime["container"].update(container or {})
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump({"runtime": runtime}), encoding="utf-8")
    return resolve_runtime(config, node)


def _expected(tmp_path: Path, environment: dict, cuda_tag: str, gpu: bool) -> dict:
    service = {
        "build": {
            "args": {
                "BASE_IMAGE": BASE,
                "CUDA_TAG": cuda_tag,
                "GID": "1001",
                "TORCH_VERSION": "2.13.0",
                "TRACKER_PACKAGES": "",
                "MODEL_PACKAGES": "",
                "UID": "1000",
            },
            "context": str(compose.PROJECT_ROOT),
            "dockerfile": "Dockerfile",
        },
        "cap_drop": ["ALL"],
        "environment": {
            "ASTRAI_CONFIG": "/run/astrai/train.yaml",
            "ASTRAI_STOP_TIMEOUT_SECONDS": "600",
            "TRAIN_JOB_NAME": "demo.Job",
            **environment,
        },
        "ipc": "host",
        "labels": {
            "ai.astrai.common.config": str(tmp_path / "train.yaml"),
            "ai.astrai.job": "demo.Job",
            "ai.astrai.node": "0",
        },
        "read_only": True,
        "security_opt": ["no-new-privileges:true"],
        "stop_grace_period": "10m",
        "tmpfs": ["/tmp:exec,mode=1777", "/home/astrai:exec,mode=1777"],
        "ulimits": {"stack": 67108864, **({"memlock": -1} if gpu else {})},
        "user": "1000:1001",
        "volumes": [
            {"read_only": True, "source": str(tmp_path / "data"), "target": "/data", "type": "bind"},
            {"read_only": True, "source": "/srv/models/base", "target": "/models/base", "type": "bind"},
            {"read_only": False, "source": str(tmp_path / "ckpt"), "target": "/checkpoints", "type": "bind"},
            {
                "read_only": True,
                "source": str(tmp_path / "train.yaml"),
                "target": "/run/astrai/train.yaml",
                "type": "bind",
            },
        ],
    }
    if gpu:
        service["deploy"] = {
            "resources": {"reservations": {"devices": [{"capabilities": ["gpu"], "count": "all", "driver": "nvidia"}]}}
        }
    return {"name": compose.project_name("demo.Job"), "services": {"trainer": service}}


def test_cpu_override_has_no_gpu_reservation_and_hides_gpus(tmp_path):
    runtime = _runtime(tmp_path, {"devices": "none", "processes": 2})
    expected = _expected(
        tmp_path,
        {
            "ASTRAI_GPU_DEVICES": "none",
            "ASTRAI_PARALLEL_MODE": "ddp",
            "ASTRAI_PROCESSES": "2",
            "CUDA_VISIBLE_DEVICES": "",
        },
        "cpu",
        gpu=False,
    )
    assert compose.render_override(runtime, uid=1000, gid=1001) == expected


def test_all_gpus_reserves_every_gpu_once_and_sets_no_filter(tmp_path):
    runtime = _runtime(tmp_path, {"devices": "all"})
    expected = _expected(tmp_path, {"ASTRAI_GPU_DEVICES": "all", "ASTRAI_PARALLEL_MODE": "auto"}, "cu128", gpu=True)
    assert compose.render_override(runtime, uid=1000, gid=1001) == expected


def test_listed_gpus_reserve_all_once_and_filter_with_cuda_visible_devices(tmp_path):
    runtime = _runtime(tmp_path, {"devices": [0, 1]})
    expected = _expected(
        tmp_path,
        {"ASTRAI_GPU_DEVICES": "0,1", "ASTRAI_PARALLEL_MODE": "ddp", "CUDA_VISIBLE_DEVICES": "0,1"},
        "cu128",
        gpu=True,
    )
    assert compose.render_override(runtime, uid=1000, gid=1001) == expected


def test_user_environment_is_passed_as_strings_and_trainer_args_become_the_command(tmp_path):
    runtime = _runtime(
        tmp_path, {"devices": [3]}, {"NCCL_P2P_DISABLE": "1", "OMP_NUM_THREADS": 4, "WANDB_MODE": "offline"}
    )
    document = compose.render_override(runtime, ["--max_steps", "50"], uid=1000, gid=1001)
    service = document["services"]["trainer"]
    assert service["environment"]["NCCL_P2P_DISABLE"] == "1"
    assert service["environment"]["OMP_NUM_THREADS"] == "4"
    assert service["environment"]["WANDB_MODE"] == "offline"
    assert service["environment"]["CUDA_VISIBLE_DEVICES"] == "3"
    assert service["environment"]["ASTRAI_PARALLEL_MODE"] == "none"
    assert service["command"] == ["--max_steps", "50"]


def test_rendered_text_is_deterministic_sorted_and_marked_generated(tmp_path):
    runtime = _runtime(tmp_path, {"devices": [0, 1]})
    first = compose.dump_override(runtime, compose.render_override(runtime, uid=1, gid=1))
    second = compose.dump_override(runtime, compose.render_override(runtime, uid=1, gid=1))
    assert first == second
    assert first.startswith("# generated by astrai") and "do not edit" in first.splitlines()[0]
    body = yaml.safe_load(first)
    service_keys = list(body["services"]["trainer"])
    assert service_keys == sorted(service_keys)


def test_write_override_goes_to_the_job_state_folder(tmp_path):
    runtime = _runtime(tmp_path, {"devices": "none"})
    path = compose.write_override(runtime, ["--dry-run"])
    assert path == tmp_path / "ckpt" / "demo.Job" / ".astrai" / "compose.override.yml"
    assert yaml.safe_load(path.read_text())["services"]["trainer"]["command"] == ["--dry-run"]


def test_project_names_are_valid_for_compose_and_never_collide():
    names = ["astrai-train", "Astrai-Train", "job.1", "job-1", "job_1", "A", "a"]
    projects = [compose.project_name(name) for name in names]
    assert len(set(projects)) == len(names)
    for project in projects:
        assert project == project.lower()
        assert all(ch.isalnum() or ch in "-_" for ch in project)
    assert compose.project_name("astrai-train") == "astrai-astrai-train"


def test_base_image_derives_from_cuda_tag_when_not_set(tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text("runtime:\n  container:\n    cuda_tag: cpu\n  gpu:\n    devices: none\n")
    assert compose.base_image(resolve_runtime(config)) == compose.CPU_BASE_IMAGE
    for cuda_tag in TORCH_CUDA_TAGS[1:]:
        config.write_text(f"runtime:\n  container:\n    cuda_tag: {cuda_tag}\n")
        # A CUDA runtime image without torch: the Dockerfile installs the tested torch, and only that one.
        assert compose.base_image(resolve_runtime(config)).startswith("nvidia/cuda:")
    assert set(compose.CUDA_BASE_IMAGES) == set(TORCH_CUDA_TAGS) - {"cpu"}


def test_the_image_is_built_for_the_tested_torch_only(tmp_path):
    runtime = _runtime(tmp_path, {"devices": [0]})
    args = compose.render_override(runtime, uid=1, gid=1)["services"]["trainer"]["build"]["args"]
    assert args["TORCH_VERSION"] == TORCH_VERSION == "2.13.0"
    dockerfile = (compose.PROJECT_ROOT / "Dockerfile").read_text()
    assert f"ARG TORCH_VERSION={TORCH_VERSION}" in dockerfile
    assert '"torch==${TORCH_VERSION}"' in dockerfile and f'{LABEL_TORCH}="${{TORCH_VERSION}}"' in dockerfile
    setup = (compose.PROJECT_ROOT / "setup.cfg").read_text()
    assert setup.count(f"torch=={TORCH_VERSION}") == setup.count("torch==") >= 1


def test_compose_command_names_project_and_both_files(tmp_path, monkeypatch):
    runtime = _runtime(tmp_path, {"devices": "none"})
    monkeypatch.setattr(compose, "compose_program", lambda: ("docker", "compose"))
    assert compose.compose_command(runtime, "up", "--detach", "trainer") == [
        "docker",
        "compose",
        "--project-name",
        compose.project_name("demo.Job"),
        "--file",
        str(compose.BASE_COMPOSE_FILE),
        "--file",
        str(tmp_path / "ckpt" / "demo.Job" / ".astrai" / "compose.override.yml"),
        "up",
        "--detach",
        "trainer",
    ]


def _fake_tools(tmp_path: Path, monkeypatch, docker_compose: str | None, standalone: str | None) -> None:
    """Put fake `docker` and `docker-compose` programs on PATH that print the given versions."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {"docker": docker_compose, "docker-compose": standalone}
    for name, version in scripts.items():
        if version is None:
            continue
        script = bin_dir / name
        if version == "broken":
            script.write_text("#!/bin/sh\necho 'unknown command' >&2\nexit 1\n")
        else:
            script.write_text(f"#!/bin/sh\necho '{version}'\n")
        script.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    compose.compose_program.cache_clear()


@pytest.mark.parametrize(
    ("plugin", "standalone", "expected"),
    [
        ("2.40.3", None, ("docker", "compose")),
        ("broken", "v2.27.0", "docker-compose"),
        (None, "2.1.0", "docker-compose"),
    ],
)
def test_compose_program_prefers_the_plugin_then_a_v2_standalone(tmp_path, monkeypatch, plugin, standalone, expected):
    _fake_tools(tmp_path, monkeypatch, plugin, standalone)
    try:
        program = compose.compose_program()
    finally:
        compose.compose_program.cache_clear()
    if expected == "docker-compose":
        assert program == (str(tmp_path / "bin" / "docker-compose"),)
    else:
        assert program == expected


@pytest.mark.parametrize(
    ("plugin", "standalone", "message"),
    [
        ("broken", "1.29.2", "v1 but v2 or later is needed"),
        ("broken", None, "Compose v2 was not found"),
        (None, None, "Compose v2 was not found"),
    ],
)
def test_compose_program_explains_what_is_missing(tmp_path, monkeypatch, plugin, standalone, message):
    _fake_tools(tmp_path, monkeypatch, plugin, standalone)
    try:
        with pytest.raises(compose.ComposeError, match=message):
            compose.compose_program()
    finally:
        compose.compose_program.cache_clear()


TWO_NODES = {"count": 2, "rendezvous": "10.0.0.1:29500", "network_interface": "eth0", "failure_timeout_seconds": 60}


@pytest.mark.parametrize("node", [0, 1])
def test_each_node_of_a_multi_node_job_is_its_own_project_on_the_host_network(tmp_path, node):
    runtime = _runtime(tmp_path, {"devices": "none"}, nodes=TWO_NODES, node=node)
    expected = _expected(
        tmp_path,
        {
            "ASTRAI_GPU_DEVICES": "none",
            "ASTRAI_PARALLEL_MODE": "ddp",
            "ASTRAI_PROCESSES": "1",
            "CUDA_VISIBLE_DEVICES": "",
            "ASTRAI_NODES": "2",
            "ASTRAI_NODE_RANK": str(node),
            "ASTRAI_RDZV_ENDPOINT": "10.0.0.1:29500",
            "ASTRAI_RDZV_BACKEND": "static",
            "ASTRAI_FAILURE_TIMEOUT_SECONDS": "60",
            "GLOO_SOCKET_IFNAME": "eth0",
            "NCCL_SOCKET_IFNAME": "eth0",
        },
        "cpu",
        gpu=False,
    )
    expected["name"] = f"{compose.project_name('demo.Job')}-node{node}"
    service = expected["services"]["trainer"]
    service["labels"]["ai.astrai.node"] = str(node)
    service["network_mode"] = "host"
    service["pid"] = "host"
    # Every node mounts the base model (only node 0 reads it): the same mounts as a Slurm task or a pod gets.
    assert compose.render_override(runtime, uid=1000, gid=1001) == expected
    # The override and the timer of each node live apart, even in one shared checkpoints folder.
    assert (
        compose.override_path(runtime)
        == tmp_path / "ckpt" / "demo.Job" / ".astrai" / f"node{node}" / "compose.override.yml"
    )


def test_node_projects_never_collide_with_each_other_or_a_one_host_job():
    names = {compose.project_name("job"), compose.project_name("job", 0), compose.project_name("job", 1)}
    assert len(names) == 3


def test_max_restarts_becomes_a_restart_on_failure_policy(tmp_path):
    runtime = _runtime(tmp_path, {"devices": "none"}, container={"max_restarts": 2})
    assert compose.render_override(runtime, uid=1000, gid=1001)["services"]["trainer"]["restart"] == "on-failure:2"
    plain = _runtime(tmp_path, {"devices": "none"})
    assert "restart" not in compose.render_override(plain, uid=1000, gid=1001)["services"]["trainer"]


# Strings Compose or a YAML 1.2 reader would change if they were written raw.
AWKWARD = [
    "a$b ${HOME} $$c",
    "${X:-default}",
    "$",
    "it's",
    'say "hi"',
    "two  spaces",
    "é ü 東京",
    "1e-3",
    "yes",
    "no",
    "on",
    "0123",
    "0x1F",
    "null",
    "~",
    "true",
    "12:30",
    "-",
    "#hash",
    "a: b",
    "",
    "line\nbreak",
]


def _compose_reads(text: str) -> dict:
    """What Compose's YAML reader sees (YAML 1.2 core scalars), with its `$$` unescaped back to `$`."""

    class Yaml12(yaml.SafeLoader):
        pass

    resolvers = yaml.SafeLoader.yaml_implicit_resolvers
    Yaml12.yaml_implicit_resolvers = {key: list(rules) for key, rules in resolvers.items()}
    float_12 = re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$")
    Yaml12.add_implicit_resolver("tag:yaml.org,2002:float", float_12, list("-+0123456789."))
    Yaml12.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"^(0o[0-7]+|0x[0-9a-fA-F]+)$"), ["0"])

    def unescape(value):
        if isinstance(value, str):
            return value.replace("$$", "$")
        if isinstance(value, dict):
            return {key: unescape(item) for key, item in value.items()}
        if isinstance(value, list):
            return [unescape(item) for item in value]
        return value

    return unescape(yaml.load(text, Loader=Yaml12))


def test_every_user_string_reaches_compose_literally(tmp_path):
    folder = tmp_path / "dol$ar ${HOME} it's é"
    folder.mkdir()
    environment = {f"V{index}": value for index, value in enumerate(AWKWARD)}
    runtime = _runtime(folder, {"devices": "none"}, environment)
    document = compose.render_override(runtime, AWKWARD, uid=1000, gid=1001)
    text = compose.dump_override(runtime, document)
    service = _compose_reads(text)["services"]["trainer"]
    assert service["command"] == AWKWARD
    for name, value in environment.items():
        assert service["environment"][name] == value, name
    assert service["volumes"][0]["source"] == str(folder / "data")
    assert service["labels"]["ai.astrai.common.config"] == str(folder / "train.yaml")
    assert "$HOME" not in text.replace("$$", "")


def test_dollars_are_doubled_in_every_string_of_the_document(tmp_path):
    runtime = _runtime(tmp_path, {"devices": "none"}, {"A": "x$y", "B": "$$"})
    document = compose.render_override(runtime, ["--a", "${HOME}"], uid=1, gid=1)
    service = document["services"]["trainer"]
    assert service["environment"]["A"] == "x$$y" and service["environment"]["B"] == "$$$$"
    assert service["command"] == ["--a", "$${HOME}"]


def test_every_string_scalar_is_quoted_in_the_text(tmp_path):
    runtime = _runtime(tmp_path, {"devices": "none"}, {"LR": "1e-3", "FLAG": "yes", "CODE": "0123", "N": "null"})
    text = compose.dump_override(runtime, compose.render_override(runtime, ["--max_lr", "1e-3"], uid=1, gid=1))
    for value in ("1e-3", "yes", "0123", "null"):
        assert f'"{value}"' in text
    assert '- "1e-3"' in text


def test_a_null_environment_value_is_passed_through_and_never_written(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    runtime = _runtime(tmp_path, {"devices": "none"}, {"HF_TOKEN": None, "OTHER": "kept"})
    path = compose.write_override(runtime)
    text = path.read_text()
    assert "hf_secret_value" not in text
    environment = yaml.safe_load(text)["services"]["trainer"]["environment"]
    assert "HF_TOKEN" in environment and environment["HF_TOKEN"] is None
    assert environment["OTHER"] == "kept"


def test_the_rendered_file_is_readable_by_its_owner_only(tmp_path):
    runtime = _runtime(tmp_path, {"devices": "none"})
    path = compose.write_override(runtime)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)
    assert stat.S_IMODE(compose.write_override(runtime).stat().st_mode) == 0o600


def test_the_container_is_hardened_and_gets_scratch_space(tmp_path):
    cpu = compose.render_override(_runtime(tmp_path, {"devices": "none"}), uid=1, gid=1)["services"]["trainer"]
    assert cpu["cap_drop"] == ["ALL"] and cpu["read_only"] is True
    assert "no-new-privileges:true" in cpu["security_opt"]
    assert [entry.split(":")[0] for entry in cpu["tmpfs"]] == ["/tmp", "/home/astrai"]
    assert all("exec" in entry.split(":")[1].split(",") for entry in cpu["tmpfs"]), "compiled kernels load from there"
    assert cpu["ulimits"] == {"stack": 67108864}
    gpu = compose.render_override(_runtime(tmp_path, {"devices": [0]}), uid=1, gid=1)["services"]["trainer"]
    assert gpu["ulimits"] == {"memlock": -1, "stack": 67108864}
