"""`invoke demo`: a tiny CPU job through its whole lifecycle, narrated.

It makes a tiny base model and token data from the bundled corpus
(``examples/corpus``), writes a CPU ``train.yaml`` next to them, then runs
init → preflight → start → stop (emergency checkpoint) → start (resume) →
finish, printing each step and the command a user would type for it.

The trainer image needs a base image with Python. The demo uses, in order: the
locally built ``astrai-base`` image, a local ``python:3.11-slim``, a pull of
it, and when no registry can be reached, a base image built from Debian
packages (``astrai.host.baseimage``; needs root and debootstrap).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from astrai.common.checkpoints import list_complete_checkpoints
from astrai.common.contract import CONTAINER_DATA, CONTAINER_MODEL, METRICS_FILE, WEIGHTS_FILE
from astrai.common.metrics import MetricsFile
from astrai.host import baseimage, compose, engine, jobs, status
from astrai.host.runtime import load_job_config

CORPUS_DIR = compose.PROJECT_ROOT / "examples" / "corpus"
JOB_NAME = "astrai-demo"
PULL_TIMEOUT_SECONDS = 120
STOP_AFTER_STEP = 120
WAIT_TIMEOUT_SECONDS = 900

TRAINER_SETTINGS = {
    "model": {"activation_checkpointing": False, "compile": False},
    "data": {"data_root_path": CONTAINER_DATA, "window_size": 64, "num_workers": 1},
    "parallel": {"parallel_mode": "none"},
    "training": {
        "max_steps": 300,
        "batch_per_device": 16,
        "grad_accum_steps": 1,
        "max_lr": 3e-3,
        "warmup_ratio": 0.05,
        "weight_decay": 0.1,
        "max_grad_norm": 1.0,
        "random_seed": 1234,
    },
    "ckpt": {"ckpt_interval": 100, "param_path": CONTAINER_MODEL},
    "log": {"log_interval": 25},
}


class DemoError(jobs.JobError):
    """The demo could not continue; the message says why."""


def run_demo(workdir: Path, *, fresh: bool = False, job_name: str = JOB_NAME) -> None:
    workdir = workdir.resolve()
    _title(f"AstrAI demo in {workdir}")
    workdir.mkdir(parents=True, exist_ok=True)
    job_dir = workdir / "checkpoints" / job_name
    if list_complete_checkpoints(job_dir):
        if not fresh:
            raise DemoError(
                f"{job_dir} holds checkpoints of an earlier demo run; rerun with `invoke demo --fresh` "
                "to delete that job dir and start over"
            )
        shutil.rmtree(job_dir)
        _say(f"removed the earlier demo job dir {job_dir}")

    image = _choose_base_image()
    _make_base_model(workdir / "params")
    _prepare_data(workdir / "data")
    config = _write_config(workdir, image, job_name)
    _, runtime = load_job_config(config)

    _title(f"1. {runtime.command('init')}")
    for path in jobs.init_job(runtime):
        _say(f"created {path}")

    _title(f"2. {runtime.command('preflight')}")
    jobs.run_preflight(runtime)

    _title(f"3. {runtime.command('start')}  (in the background; preflight and build come first)")
    jobs.start_job(runtime, [], foreground=False)
    step = _wait_for_step(runtime, STOP_AFTER_STEP)
    _say(f"training reached step {step}")
    _say("\n".join(status.format_status(status.job_status(runtime))))

    _title(f"4. {runtime.command('stop')}  (graceful: the trainer writes an emergency checkpoint)")
    jobs.stop_job(runtime)

    _title(f"5. {runtime.command('start')}  (again: it resumes from the emergency checkpoint)")
    jobs.start_job(runtime, [], foreground=False)
    final = engine.wait_for_exit(jobs.job_container(runtime).id, timeout=WAIT_TIMEOUT_SECONDS)  # start_job found it
    resumed = [line for line in _logs(runtime) if "resumed from" in line]
    _say(resumed[0] if resumed else "warning: the log does not name a resumed checkpoint")
    if final.exit_code != 0:
        raise DemoError(f"the trainer exited with code {final.exit_code}; see `{runtime.command('logs')}`")

    _title(f"6. the result: {runtime.command('list')}")
    checkpoints = list_complete_checkpoints(runtime.job_dir)
    for checkpoint in checkpoints:
        _say(f"{checkpoint.path}  ({checkpoint.meta.reason})")
    _say("\n".join(status.format_status(status.job_status(runtime))))
    _say(f"\ndone. Everything lives in {workdir}; try `{runtime.command('status')}` or `{runtime.command('clean')}`.")


def _choose_base_image() -> str:
    _title("0. a base image for the trainer")
    if baseimage.image_exists(baseimage.DEFAULT_TAG):
        _say(f"using the local base image {baseimage.DEFAULT_TAG}")
        return baseimage.DEFAULT_TAG
    if baseimage.image_exists(compose.CPU_BASE_IMAGE):
        _say(f"using the local image {compose.CPU_BASE_IMAGE}")
        return compose.CPU_BASE_IMAGE
    _say(f"pulling {compose.CPU_BASE_IMAGE} ...")
    try:
        pulled = subprocess.run(
            ["docker", "pull", compose.CPU_BASE_IMAGE], capture_output=True, text=True, timeout=PULL_TIMEOUT_SECONDS
        )
        reason = (pulled.stderr.strip().splitlines() or ["unknown error"])[-1]
        if pulled.returncode == 0:
            return compose.CPU_BASE_IMAGE
    except subprocess.TimeoutExpired:
        reason = f"no answer within {PULL_TIMEOUT_SECONDS} s"
    _say(
        f"cannot pull {compose.CPU_BASE_IMAGE} ({reason});\nbuilding {baseimage.DEFAULT_TAG} from Debian packages "
        "instead (debootstrap + pip wheels; a few minutes, once)"
    )
    baseimage.ensure_base_image(baseimage.DEFAULT_TAG, log=_say)
    return baseimage.DEFAULT_TAG


def _make_base_model(folder: Path) -> None:
    if (folder / WEIGHTS_FILE).is_file():
        _say(f"base model: {folder} (already there)")
        return
    _run_host([sys.executable, "-m", "astrai.model", "init", str(folder), "--preset", "tiny"])


def _prepare_data(folder: Path) -> None:
    if folder.is_dir() and any(folder.iterdir()):
        _say(f"token data: {folder} (already there)")
        return
    corpus = sorted(str(path) for path in CORPUS_DIR.glob("*.txt"))
    if not corpus:
        raise DemoError(f"no corpus files in {CORPUS_DIR}")
    _run_host([sys.executable, "-m", "astrai.data", "prepare", "--out", str(folder), *corpus])


def _write_config(workdir: Path, image: str, job_name: str) -> Path:
    document = {
        "runtime": {
            "job_name": job_name,
            "paths": {"data": "./data", "model": "./params", "checkpoints": "./checkpoints"},
            "gpu": {"devices": "none", "processes": 1, "parallel_mode": "auto"},
            # One torch thread: the tiny model gains little from more, and a busy machine slows it far less.
            "environment": {"OMP_NUM_THREADS": "1"},
            "container": {
                "cuda_tag": "cpu",
                "base_image": image,
                "ipc": "host",
                "stop_grace_period": "2m",
                "stop_timeout_seconds": 120,
                "checkpoint_keep_last": 3,
            },
        },
        **TRAINER_SETTINGS,
    }
    config = workdir / "train.yaml"
    header = "# written by `invoke demo` (CPU, tiny model); edit freely, the demo rewrites it on its next run\n"
    config.write_text(header + yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    _say(f"config: {config}")
    return config


def _wait_for_step(runtime, step: int) -> int:
    deadline = time.monotonic() + WAIT_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        progress = MetricsFile(runtime.job_dir / METRICS_FILE).latest()
        if progress is not None and progress["step"] >= step:
            return int(progress["step"])
        container = jobs.job_container(runtime)
        if container is None or not container.running:
            raise DemoError(f"the trainer stopped early; see `{runtime.command('logs')}`")
        time.sleep(1)
    raise DemoError(f"no progress past step {step} within {WAIT_TIMEOUT_SECONDS} s")


def _logs(runtime) -> list[str]:
    command = compose.compose_command(runtime, "logs", "--no-log-prefix", compose.SERVICE)
    return subprocess.run(command, capture_output=True, text=True).stdout.splitlines()


def _run_host(command: list[str]) -> None:
    _say("$ " + compose.format_command([Path(command[0]).name, *command[1:]]))
    result = subprocess.run(command, text=True)
    if result.returncode != 0:
        raise DemoError(f"`{compose.format_command(command)}` failed with exit code {result.returncode}")


def _title(text: str) -> None:
    print(f"\n== {text}", flush=True)


def _say(message: str) -> None:
    print(message, flush=True)
