"""`invoke preflight` and the rendered Compose config against the real engine."""

from __future__ import annotations

import json
import subprocess

import pytest

from astrai.common.contract import TORCHRUN_MODULE
from astrai.host import compose

pytestmark = pytest.mark.docker


def test_preflight_passes_on_a_ready_host(make_job):
    job = make_job()
    job.invoke("init")
    result = job.invoke("preflight")
    lines = result.stdout.splitlines()
    for name in (
        "schema",
        "docker CLI",
        "docker daemon",
        "compose v2",
        "data",
        "checkpoint dir",
        "base model",
        "data fits model",
        "compose config",
    ):
        assert any(line.startswith(f"✓ {name}") for line in lines), (name, result.stdout)
    assert "✗" not in result.stdout
    assert lines[-1] == "preflight passed"


def test_preflight_fails_on_an_unreachable_daemon_with_a_hint(make_job, tmp_path):
    job = make_job()
    job.env = {"DOCKER_HOST": f"unix://{tmp_path}/no-such-docker.sock"}
    result = job.invoke("preflight", check=False)
    assert result.returncode != 0
    daemon = [line for line in result.stdout.splitlines() if "docker daemon" in line]
    assert daemon and daemon[0].startswith("✗"), result.stdout
    hint = result.stdout.splitlines()[result.stdout.splitlines().index(daemon[0]) + 1]
    assert "start it" in hint and "DOCKER_HOST" in hint
    assert "Traceback" not in result.stderr


def test_preflight_names_a_missing_base_model_and_a_wrong_data_path(make_job):
    job = make_job(trainer={"data": {"data_root_path": "/elsewhere"}})
    (job.folder / "params" / "model.safetensors").unlink()
    result = job.invoke("preflight", check=False)
    assert result.returncode != 0
    assert "✗ base model" in result.stdout and "model.safetensors is missing" in result.stdout
    assert "✗ trainer config" in result.stdout and "data.data_root_path: /elsewhere is outside /data" in result.stdout


def test_listed_gpus_render_one_reservation_and_the_entrypoint_picks_ddp(make_job):
    """No GPU here: check what Compose itself makes of the override, and what the entrypoint decides."""
    job = make_job(runtime={"gpu": {"devices": [0, 1], "parallel_mode": "auto"}, "container": {"cuda_tag": "cu128"}})
    job.invoke("init")
    rendered = subprocess.run(
        [
            *compose.compose_program(),
            "--project-name",
            job.project,
            "--file",
            str(compose.BASE_COMPOSE_FILE),
            "--file",
            "-",
            "config",
            "--format",
            "json",
        ],
        input=job.invoke("render").stdout,
        capture_output=True,
        text=True,
        check=True,
    )
    service = json.loads(rendered.stdout)["services"]["trainer"]
    assert service["deploy"]["resources"]["reservations"]["devices"] == [
        {"capabilities": ["gpu"], "count": -1, "driver": "nvidia"}
    ]
    assert service["environment"]["CUDA_VISIBLE_DEVICES"] == "0,1"

    # The test base holds the CPU build of torch, which a cu128 build refuses; the entrypoint's decision
    # depends only on the environment, so a CPU job's image (same Dockerfile, same entrypoint) shows it.
    cpu_job = make_job()
    cpu_job.invoke("build")
    plan = subprocess.run(
        [
            "docker",
            "run",
            "--rm",
            *[f"--env={k}={v}" for k, v in service["environment"].items()],
            f"{cpu_job.project}-trainer",
            "--print-plan",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    decision = json.loads(plan.stdout)
    assert (decision["processes"], decision["parallel_mode"]) == (2, "ddp")
    assert decision["command"][1:6] == ["-m", TORCHRUN_MODULE, "--standalone", "--nproc-per-node", "2"]
