"""User strings reach the container literally, secrets pass through unwritten, and the container is hardened."""

from __future__ import annotations

import json
import secrets
import shutil
import stat
import subprocess

import pytest
import yaml

from astrai.common.contract import TORCH_VERSION
from astrai.host import compose
from astrai.host.runtime import resolve_runtime
from tests.support import invoke_command

pytestmark = pytest.mark.docker

AWKWARD_FOLDER = "dol$ar ${HOME} $$x it's é 東京"
ENVIRONMENT = {"ODD": 'a$b ${HOME} $$c it\'s "q" é', "LR": "1e-3", "CODE": "0123", "WORD": "yes", "HF_TOKEN": None}
SECRET = "hf_from_the_shell_only"


def _in_container(container_id: str, code: str) -> str:
    return subprocess.run(
        ["docker", "exec", container_id, "python3", "-c", code], capture_output=True, text=True, check=True
    ).stdout


def test_awkward_paths_values_and_arguments_arrive_literally_and_the_job_trains(make_job):
    job = make_job(
        runtime={"environment": ENVIRONMENT},
        trainer={"training": {"max_steps": 100000}},
        env={"HF_TOKEN": SECRET},
        parent=AWKWARD_FOLDER,
    )
    assert AWKWARD_FOLDER in str(job.folder)
    job.invoke("init")

    # Trainer arguments as the shell passed them: spaces, a quote, $ and a number-like string.
    odd_path = "/models/base/it's a $x ${HOME} é"
    # A model of its own in that subfolder of runtime.paths.model: preflight checks the folder the trainer will read.
    shutil.copytree(job.folder / "params", job.folder / "params" / odd_path.removeprefix("/models/base/"))
    dry = job.invoke("start", "--foreground", "--", "--dry-run", "--param_path", odd_path, "--max_lr", "1e-3")
    resolved = yaml.safe_load(
        "\n".join(line for line in dry.stdout.splitlines() if line.strip().startswith(("param_path:", "max_lr:")))
    )
    assert resolved == {"param_path": odd_path, "max_lr": 0.001}, dry.stdout

    job.invoke("start", "--", "--max_lr", "1e-3")
    job.wait_for("progress", lambda: job.progress_step() >= 3)
    container = job.container()
    seen = json.loads(_in_container(container.id, "import json, os; print(json.dumps(dict(os.environ)))"))
    for name, value in ENVIRONMENT.items():
        assert seen.get(name) == (SECRET if value is None else value), name
    override = compose.override_path(resolve_runtime(job.config))
    assert SECRET not in override.read_text() and stat.S_IMODE(override.stat().st_mode) == 0o600

    # Hardened: no capabilities, read-only root, writable and executable scratch, the stack ulimit.
    probe = _in_container(
        container.id,
        (
            "import os, resource, subprocess, tempfile\n"
            "caps = [l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')]\n"
            "try:\n    open('/app/x', 'w')\n    root = 'writable'\nexcept OSError:\n    root = 'read-only'\n"
            "for folder in ('/tmp', os.environ['HOME']):\n"
            "    path = os.path.join(folder, 'run.sh')\n"
            "    open(path, 'w').write('#!/bin/sh\\necho ok\\n')\n    os.chmod(path, 0o755)\n"
            "    assert subprocess.run([path], capture_output=True, text=True).stdout == 'ok\\n', folder\n"
            "print(caps[0], root, resource.getrlimit(resource.RLIMIT_STACK)[0])\n"
        ),
    )
    assert probe.split() == ["0000000000000000", "read-only", "67108864"], probe

    status = job.invoke("status").stdout
    assert f"torch {TORCH_VERSION} (cpu) in image {job.project}-trainer" in status, status
    assert "✓ image torch" in job.invoke("preflight", check=False).stdout

    job.invoke("stop")
    step, reason = job.checkpoints()[-1]
    assert reason == "emergency" and step >= 3
    # Compose interpolating the path would have made Docker create a differently named folder beside it.
    assert [path.name for path in job.folder.parent.parent.iterdir()] == [AWKWARD_FOLDER]


def test_two_concurrent_starts_leave_one_container(make_job):
    job = make_job(trainer={"training": {"max_steps": 100000}})
    job.invoke("init")
    job.invoke("build")  # both starts then race on the start itself, not on a first build
    command = invoke_command("start", "--config", str(job.config))
    first, second = (
        subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)
    )
    results = [process.communicate(timeout=600) + (process.returncode,) for process in (first, second)]
    codes = sorted(code for _, _, code in results)
    assert codes[0] == 0 and codes[1] != 0, results
    refused = next(err for _, err, code in results if code != 0)
    assert "another `invoke start` (or a stop) of job" in refused or "is already running" in refused, refused
    assert "Traceback" not in refused
    listing = subprocess.run(
        ["docker", "ps", "--all", "--quiet", "--filter", f"label=com.docker.compose.project={job.project}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert len(listing) == 1, listing
    container = job.container()
    assert container.running
    job.wait_for("progress", lambda: job.progress_step() >= 1)
    assert job.container().id == container.id and job.container().started_at == container.started_at
    job.invoke("stop")


def test_a_base_image_with_another_torch_fails_the_build_with_the_reason(make_job, base_image):
    other = f"astrai-test-othertorch:{secrets.token_hex(4)}"
    recipe = (
        f"FROM {base_image}\nRUN mkdir -p /opt/other/torch && "
        "echo '__version__ = \"2.5.1+cu124\"' > /opt/other/torch/__init__.py\nENV PYTHONPATH=/opt/other\n"
    )
    subprocess.run(
        ["docker", "build", "--quiet", "--tag", other, "-"], input=recipe, text=True, check=True, capture_output=True
    )
    try:
        job = make_job(runtime={"container": {"base_image": other}})
        result = job.invoke("build", check=False)
        assert result.returncode != 0
        output = result.stdout + result.stderr
        assert f"holds torch 2.5.1+cu124, but astrai runs torch {TORCH_VERSION} only" in output, output[-3000:]
        assert "Traceback" not in result.stderr
    finally:
        subprocess.run(["docker", "image", "rm", "--force", other], capture_output=True)


def test_a_base_torch_built_for_another_cuda_tag_fails_the_build(make_job):
    job = make_job(runtime={"container": {"cuda_tag": "cu128"}})  # the test base holds torch 2.13.0+cpu
    result = job.invoke("build", check=False)
    assert result.returncode != 0
    assert "a build for cpu, but runtime.container.cuda_tag is cu128" in result.stdout + result.stderr
