"""Metrics from a job in its container: event files from the product's image, status's sparkline, and a base image
without TensorBoard that still builds offline and trains."""

from __future__ import annotations

import secrets
import subprocess

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from astrai.common.contract import METRICS_FILE, TAG_TRAIN_LOSS, TAG_VAL_LOSS, TENSORBOARD_DIR
from astrai.common.metrics import read_records
from astrai.host.status import SPARK_BLOCKS
from tests.support import REPO

pytestmark = pytest.mark.docker

SHORT = {"training": {"max_steps": 40}, "data": {"val_fraction": 0.1}, "log": {"log_interval": 5, "eval_interval": 20}}


def _scalars(folder, tag: str) -> list[int]:
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    accumulator.Reload()
    return [event.step for event in accumulator.Scalars(tag)] if tag in accumulator.Tags()["scalars"] else []


def test_the_trainer_image_writes_event_files_and_status_draws_the_loss(make_job):
    job = make_job(trainer=SHORT)
    job.invoke("init")
    job.invoke("start", "--foreground", timeout=900)
    steps = [record["step"] for record in read_records(job.job_dir / METRICS_FILE)]
    assert steps == list(range(5, 41, 5))
    assert _scalars(job.job_dir / TENSORBOARD_DIR, TAG_TRAIN_LOSS) == steps
    assert _scalars(job.job_dir / TENSORBOARD_DIR, TAG_VAL_LOSS) == [20, 40]
    status = job.invoke("status").stdout
    loss_line = next(line for line in status.splitlines() if line.startswith("loss "))
    assert any(block in loss_line for block in SPARK_BLOCKS) and "val_loss" in loss_line, status
    assert "event files are off" not in job.logs()


@pytest.fixture
def base_without_tensorboard(base_image):
    """The test base image with TensorBoard uninstalled (offline), removed afterwards."""
    tag = f"astrai-test-no-tensorboard:{secrets.token_hex(4)}"
    recipe = f"FROM {base_image}\nRUN python3 -m pip uninstall --yes --break-system-packages tensorboard\n"
    built = subprocess.run(
        ["docker", "build", "--network", "none", "--tag", tag, "-"], input=recipe, capture_output=True, text=True
    )
    assert built.returncode == 0, built.stderr
    yield tag
    subprocess.run(["docker", "image", "rm", "--force", tag], capture_output=True)


def test_a_base_without_tensorboard_builds_offline_and_trains_without_event_files(make_job, base_without_tensorboard):
    # The Dockerfile on its own, with no network at all: it must not try to fetch TensorBoard.
    tag = f"astrai-test-offline-build:{secrets.token_hex(4)}"
    built = subprocess.run(
        [
            "docker",
            "build",
            "--network",
            "none",
            "--build-arg",
            f"BASE_IMAGE={base_without_tensorboard}",
            "--tag",
            tag,
            str(REPO),
        ],
        capture_output=True,
        text=True,
    )
    subprocess.run(["docker", "image", "rm", "--force", tag], capture_output=True)
    output = built.stdout + built.stderr  # the legacy builder and BuildKit print the steps' output apart
    assert built.returncode == 0, output[-3000:]
    assert "TensorBoard event files will be off" in output

    job = make_job(
        runtime={"container": {"base_image": base_without_tensorboard}}, trainer={"training": {"max_steps": 10}}
    )
    job.invoke("init")
    job.invoke("start", "--foreground", timeout=900)
    logs = job.logs()
    assert logs.count("TensorBoard event files are off") == 1, logs
    assert not (job.job_dir / TENSORBOARD_DIR).exists()
    assert [record["step"] for record in read_records(job.job_dir / METRICS_FILE)] == [5, 10]
