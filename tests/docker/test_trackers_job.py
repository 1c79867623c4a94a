"""A job in its container reports to a real MLflow tracking server on this host and to W&B offline, through a stop
and a resume: one tracker run each, every step once, values equal to metrics.jsonl's; secrets passed by name only."""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess

import pytest

from astrai.common.contract import (
    METRICS_FILE,
    TAG_FINAL_CHECKPOINT,
    TAG_REPLAYED,
    TAG_STATE,
    TRACKERS_FILE,
    WANDB_DIR,
    container_job_dir,
)
from astrai.common.metrics import read_records
from tests.trackers_support import mlflow_server, wandb_records, wandb_runs

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as running:
        yield running


def test_a_stopped_and_resumed_job_reports_each_step_once_to_mlflow_and_wandb(make_job, server):
    token, key = f"tok-{secrets.token_hex(8)}", f"key-{secrets.token_hex(8)}"
    trainer = {
        "training": {"max_steps": 60},
        "ckpt": {"ckpt_interval": 10},
        "log": {
            "log_interval": 2,
            "report_to": ["tensorboard", "mlflow", "wandb"],
            "mlflow": {"tracking_uri": f"http://host.docker.internal:{server.port}"},
            "wandb": {"mode": "offline", "project": "astrai tests"},
        },
    }
    job = make_job(trainer=trainer, env={"MLFLOW_TRACKING_TOKEN": token, "WANDB_API_KEY": key})
    job.invoke("init")
    preflight = job.invoke("preflight").stdout
    assert f"host.docker.internal:{server.port} answers" in preflight, preflight

    # Secrets by name: not in the rendered override, present in the container.
    rendered = job.invoke("render").stdout
    assert "MLFLOW_TRACKING_TOKEN" in rendered and "WANDB_API_KEY" in rendered
    assert token not in rendered and key not in rendered

    # Stop it, then take its newest checkpoint away, so the resume trains steps the trackers were already sent.
    job.invoke("start")
    job.wait_for("step 24", lambda: job.progress_step() >= 24)
    assert "emergency checkpoint" in job.invoke("stop").stdout
    *_, (resumed, _), (stopped, _) = job.checkpoints()
    shutil.rmtree(job.job_dir / f"epoch_0_step_{stopped}")
    job.invoke("start")
    assert job.wait_for_exit().exit_code == 0, job.logs()
    environment = subprocess.run(
        ["docker", "inspect", "--format", "{{json .Config.Env}}", job.container().id], capture_output=True, text=True
    ).stdout
    assert f"MLFLOW_TRACKING_TOKEN={token}" in environment and f"WANDB_API_KEY={key}" in environment

    expected = {record["step"]: record["loss"] for record in read_records(job.job_dir / METRICS_FILE)}
    # Every second step, and the stop's own step if the resumed run did not log past it before reaching it.
    assert set(range(2, 61, 2)) <= set(expected) <= set(range(2, 61, 2)) | {stopped} and resumed < stopped < 60

    # MLflow: one run in the experiment, each step's loss once and equal, parameters, final tags.
    client = server.client()
    experiment = client.get_experiment_by_name("astrai")
    runs = client.search_runs([experiment.experiment_id], filter_string=f"tags.`astrai.job` = '{job.name}'")
    assert len(runs) == 1
    run = runs[0]
    history = client.get_metric_history(run.info.run_id, "loss")
    first, last = map(int, run.data.tags[TAG_REPLAYED].split("-"))  # trained again after the resume
    assert first == resumed + 1 and last >= stopped - 1
    sent = {point.step: point.value for point in history}
    assert len(history) == len(sent)  # each step once
    # Every step of the run; and the stop's own step (odd), which the resumed run, reporting every 2 steps, never
    # reaches again: it keeps its value from the first time, as a replayed step.
    assert set(expected) <= set(sent) and all(first <= step <= last for step in set(sent) - set(expected))
    assert {step: sent[step] for step in expected} == expected
    assert run.data.params["training.max_steps"] == "60" and run.data.params["world_size"] == "1"
    assert run.data.tags[TAG_STATE] == "finished" and run.info.status == "FINISHED"
    final = max(path for path in job.job_dir.glob("epoch_*_step_60"))
    assert run.data.tags[TAG_FINAL_CHECKPOINT] == f"{container_job_dir(job.name)}/{final.name}"
    saved = json.loads((job.job_dir / TRACKERS_FILE).read_text())
    assert saved["mlflow"]["run_id"] == run.info.run_id
    meta = json.loads((final / "meta.json").read_text())
    assert meta["trackers"] == {"mlflow": run.info.run_id, "wandb": saved["wandb"]["run_id"]}

    # W&B offline: the two processes wrote two files of the same run id; together, each step once.
    files = wandb_runs(job.job_dir / WANDB_DIR)
    assert len(files) == 2
    runs = [wandb_records(path) for path in files]
    assert {each["id"] for each in runs} == {saved["wandb"]["run_id"]}
    steps = [step for each in runs for step in each["history"]]
    losses = {step: values[0]["loss"] for each in runs for step, values in each["history"].items()}
    assert len(steps) == len(losses) and losses.keys() == sent.keys()
    assert {step: losses[step] for step in expected} == expected
    assert runs[0]["config"]["training.max_lr"] == "0.003"

    status = job.invoke("status").stdout
    assert f"/#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}" in status
    assert str(job.job_dir / WANDB_DIR) in status, status
    # The secrets are nowhere in the job dir (logs, W&B's files, the rendered override) or the container's output.
    for path in job.job_dir.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert token.encode() not in data and key.encode() not in data, path
    assert token not in job.logs() and key not in job.logs()
