"""Fixtures for tests that drive the real Docker engine and Compose v2 through the invoke tasks.

Each test job gets its own job name, folder and Compose project; whatever it
started (containers, networks, images, timers) is removed when the test ends,
pass or fail. The expensive base image is built once and cached by tag.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import slurm_cluster
import yaml

from astrai.common.checkpoints import list_complete_checkpoints
from astrai.host import baseimage, compose, engine, harness, timer
from tests.support import REPO, free_ports, interruptible, invoke_command

BASE_IMAGE = os.environ.get("ASTRAI_TEST_BASE_IMAGE", baseimage.DEFAULT_TAG)
CORPUS = REPO / "examples" / "corpus"

# A tiny job that trains in a few seconds per hundred steps on two CPU cores.
TRAINER = {
    "data": {"data_root_path": "/data", "window_size": 32, "num_workers": 0},
    "training": {
        "max_steps": 120,
        "batch_per_device": 8,
        "grad_accum_steps": 1,
        "max_lr": 3e-3,
        "warmup_ratio": 0.1,
        "weight_decay": 0.1,
        "max_grad_norm": 1.0,
        "random_seed": 7,
    },
    "ckpt": {"ckpt_interval": 40},
    "log": {"log_interval": 5},
}


@pytest.fixture(scope="module")
def cluster():
    """A private Slurm cluster on this host (:mod:`slurm_cluster`), one per test module."""
    why = slurm_cluster.available()
    if why is not None:
        if os.environ.get("ASTRAI_REQUIRE_DOCKER") == "1":
            pytest.fail(why)
        pytest.skip(why)
    root = Path(tempfile.mkdtemp(prefix="astrai-slurm-"))
    ctld, n1, n2 = free_ports(3)
    try:
        with slurm_cluster.Cluster(root, ctld_port=ctld, node_ports=(n1, n2)) as running:
            yield running
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def base_image() -> str:
    baseimage.ensure_base_image(BASE_IMAGE)
    return BASE_IMAGE


@pytest.fixture(scope="session")
def assets(tmp_path_factory) -> Path:
    """A tiny base model and token data, made once per session on the host."""
    folder = tmp_path_factory.mktemp("assets")
    subprocess.run(
        [sys.executable, "-m", "astrai.model", "init", str(folder / "params"), "--preset", "tiny"],
        check=True,
        capture_output=True,
    )
    corpus = sorted(str(path) for path in CORPUS.glob("*.txt"))
    subprocess.run(
        [sys.executable, "-m", "astrai.data", "prepare", "--out", str(folder / "data"), *corpus],
        check=True,
        capture_output=True,
    )
    return folder


@dataclass
class Job:
    """One test job: its folder, YAML and the commands a user would run on it."""

    name: str
    folder: Path
    env: dict = field(default_factory=dict)

    @property
    def config(self) -> Path:
        return self.folder / "train.yaml"

    @property
    def job_dir(self) -> Path:
        return self.folder / "checkpoints" / self.name

    @property
    def project(self) -> str:
        return compose.project_name(self.name)

    def invoke(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        """Run `invoke TASK --config <this job> ...` the way a user would."""
        task, *rest = args
        head, sep, tail = _split_remainder(rest)
        command = invoke_command(task, "--config", str(self.config), *head, *sep, *tail)
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env={**os.environ, **self.env}, cwd=self.folder
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"{' '.join(args)} exited {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
            )
        return result

    def popen(self, *args: str) -> subprocess.Popen:
        """`invoke TASK --config <this job> ...` in the background, in a process group of its own (as a terminal
        runs a foreground command: a Ctrl-C goes to the whole group); output merged, line by line."""
        task, *rest = args
        head, sep, tail = _split_remainder(rest)
        return subprocess.Popen(
            invoke_command(task, "--config", str(self.config), *head, *sep, *tail),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **self.env},
            cwd=self.folder,
            start_new_session=True,
            preexec_fn=interruptible,  # a Ctrl-C test must reach it even when the suite runs in the background
        )

    def container(self) -> engine.Container | None:
        return engine.find_container(self.project)

    def logs(self) -> str:
        found = self.container()
        if found is None:
            return ""
        return subprocess.run(["docker", "logs", found.id], capture_output=True, text=True).stdout

    def progress_step(self) -> int:
        metrics = self.job_dir / "metrics.jsonl"
        if not metrics.exists():
            return -1
        lines = [line for line in metrics.read_text().splitlines() if line.strip()]
        return json.loads(lines[-1])["step"] if lines else -1

    def wait_for(self, what: str, predicate, timeout: float = 300, pause: float = 0.5):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(pause)
        raise AssertionError(f"timed out after {timeout} s waiting for {what}\nlogs:\n{self.logs()[-3000:]}")

    def wait_for_exit(self, timeout: float = 600) -> engine.Container:
        found = self.container()
        assert found is not None, "no container"
        subprocess.run(["docker", "wait", found.id], capture_output=True, timeout=timeout)
        final = engine.inspect_container(found.id)
        assert final is not None
        return final

    def checkpoints(self) -> list[tuple[int, str]]:
        """(step, reason) of every complete checkpoint, oldest first."""
        return [(c.step, c.meta.reason) for c in list_complete_checkpoints(self.job_dir)]

    def stop_and_finish(self, at: int = 10, more: int = 10) -> int:
        """Start the job, stop it once it logged step ``at`` (with an emergency checkpoint), then start it again to
        train ``more`` steps past the stop and end with exit code 0; the step it stopped at."""
        self.invoke("start")
        self.wait_for(f"step {at}", lambda: self.progress_step() >= at)
        assert "emergency checkpoint" in self.invoke("stop").stdout
        stopped, reason = self.checkpoints()[-1]
        assert reason == "emergency"
        self.invoke("start", "--", "--max_steps", str(stopped + more))
        assert self.wait_for_exit().exit_code == 0, self.logs()
        return stopped


def _split_remainder(args: list[str]) -> tuple[list[str], list[str], list[str]]:
    if "--" in args:
        index = args.index("--")
        return args[:index], ["--"], args[index + 1 :]
    return args, [], []


@pytest.fixture
def make_job(tmp_path, base_image, assets, request):
    """Factory: make_job(runtime={...}, trainer={...}) -> Job with its own name, data, model and YAML."""
    made: list[Job] = []

    def factory(
        runtime: dict | None = None, trainer: dict | None = None, env: dict | None = None, parent: str = ""
    ) -> Job:
        """``parent``: a folder name the job folder goes into (to test awkward paths)."""
        name = f"t-{request.node.name[:24].strip('_-').replace('[', '-').replace(']', '')}-{secrets.token_hex(3)}"
        folder = tmp_path / parent / name
        folder.mkdir(parents=True)
        shutil.copytree(assets / "params", folder / "params")
        shutil.copytree(assets / "data", folder / "data")
        block = {
            "job_name": name,
            "paths": {"data": "./data", "model": "./params", "checkpoints": "./checkpoints"},
            "gpu": {"devices": "none"},
            # One torch thread per trainer process: two threads on a CPU that the other test worker shares spend
            # most of their time waiting for each other.
            "environment": {"OMP_NUM_THREADS": "1"},
            "container": {
                "cuda_tag": "cpu",
                "base_image": base_image,
                "stop_grace_period": "2m",
                "stop_timeout_seconds": 60,
                "checkpoint_keep_last": 2,
            },
        }
        for key, value in (runtime or {}).items():
            block[key] = {**block.get(key, {}), **value} if isinstance(value, dict) else value
        document = {"runtime": block}
        for section, values in TRAINER.items():
            document[section] = {**values, **(trainer or {}).get(section, {})}
        for section, values in (trainer or {}).items():
            document.setdefault(section, values)
        job = Job(name, folder, env or {})
        job.config.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
        made.append(job)
        return job

    yield factory
    for job in made:
        _tear_down(job)


def _tear_down(job: Job) -> None:
    timer.cancel(job.job_dir / compose.STATE_DIR_NAME)
    subprocess.run(
        [
            "docker",
            "compose",
            "--project-name",
            job.project,
            "down",
            "--volumes",
            "--remove-orphans",
            "--rmi",
            "local",
            "--timeout",
            "5",
        ],
        capture_output=True,
    )
    for project in (job.project, job.project + harness.EVAL_PROJECT_SUFFIX):  # `invoke eval`'s runs have their own
        leftovers = subprocess.run(
            ["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={project}"],
            capture_output=True,
            text=True,
        ).stdout.split()
        if leftovers:
            subprocess.run(["docker", "rm", "-f", *leftovers], capture_output=True)
        networks = subprocess.run(
            ["docker", "network", "ls", "-q", "--filter", f"label=com.docker.compose.project={project}"],
            capture_output=True,
            text=True,
        ).stdout.split()
        if networks:
            subprocess.run(["docker", "network", "rm", *networks], capture_output=True)
    image = f"{job.project}-{compose.SERVICE}"
    subprocess.run(["docker", "image", "rm", "--force", image, f"{image}:{compose.EVAL_TAG}"], capture_output=True)
