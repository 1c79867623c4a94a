"""Preflight's look at the experiment trackers a job reports to (log.report_to): does each one answer?

A tracker that does not answer is worth a warning, never a refusal: training runs without it, and its updates
wait (up to a point) for it to come back. The MLflow server is asked from this host: an address the container
reaches as ``host.docker.internal`` is this host's loopback here.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.parse
import urllib.request

from astrai.common.config import MlflowSettings, TrainerConfig, WandbSettings
from astrai.common.contract import TRACKER_MLFLOW, TRACKER_WANDB, WANDB_DIR
from astrai.common.values import without_credentials
from astrai.host.checklist import PASS, WARN, Check
from astrai.host.compose import DOCKER_HOST_NAME
from astrai.host.runtime import Runtime

TIMEOUT_SECONDS = 3
LOOPBACK = ("localhost", "127.0.0.1", "::1")


def tracker_checks(runtime: Runtime, config: TrainerConfig) -> list[Check]:
    checks = []
    for name in config.log.trackers:
        if name == TRACKER_MLFLOW:
            checks.append(mlflow_check(runtime, config.log.mlflow))
        elif name == TRACKER_WANDB:
            checks.append(wandb_check(runtime, config.log.wandb))
    return checks


def mlflow_check(runtime: Runtime, settings: MlflowSettings) -> Check:
    key = "log.mlflow.tracking_uri" if settings.tracking_uri else "MLFLOW_TRACKING_URI"
    uri = settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri is None:
        return Check(PASS, TRACKER_MLFLOW, f"no tracking_uri: a file store in the job dir ({runtime.job_dir}/mlruns)")
    parts, shown = urllib.parse.urlsplit(uri), without_credentials(uri)
    address = parts.netloc.rsplit("@", 1)[-1]
    if parts.scheme not in ("http", "https"):
        return Check(PASS, TRACKER_MLFLOW, f"{shown}: not a server address; not checked")
    if parts.hostname in LOOPBACK and not runtime.multi_node:
        return Check(
            WARN,
            TRACKER_MLFLOW,
            f"{key}: {shown}: inside the container, {parts.hostname} is the container itself",
            f"use http://{DOCKER_HOST_NAME}:{parts.port or 80} for a server on this host",
        )
    if parts.hostname == DOCKER_HOST_NAME and runtime.multi_node:
        return Check(
            WARN,
            TRACKER_MLFLOW,
            f"{key}: {shown}: a job of several nodes shares each host's network, where {DOCKER_HOST_NAME} is not set",
            "name the server by an address every node reaches (localhost for a server on each node's host)",
        )
    # An API path, with the Host header the container sends: MLflow answers /health to any host name, but refuses
    # its API to a name it was not started to allow (--allowed-hosts).
    local = address.replace(DOCKER_HOST_NAME, "127.0.0.1", 1)  # the container's name for this host
    request = urllib.request.Request(
        parts._replace(netloc=local).geturl().rstrip("/") + "/api/2.0/mlflow/experiments/search?max_results=1",
        headers={"Host": address},
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS) as answer:
            answer.read(64)
    except urllib.error.HTTPError as error:
        if error.code == 403 and "host" in error.read(512).decode(errors="replace").lower():
            return Check(
                WARN,
                TRACKER_MLFLOW,
                f"{key}: {shown} refuses the host name {parts.hostname} (403)",
                f"start the server with --allowed-hosts {address}",
            )
        if error.code >= 500:
            return _not_answering(key, shown, error)
    except (urllib.error.URLError, OSError, ValueError) as error:
        return _not_answering(key, shown, error)
    return Check(PASS, TRACKER_MLFLOW, f"{shown} answers")


def _not_answering(key: str, shown: str, error: Exception) -> Check:
    reason = getattr(error, "reason", error)
    return Check(
        WARN,
        TRACKER_MLFLOW,
        f"{key}: {shown} does not answer ({reason}); training runs without it, its updates wait for it",
        "start the MLflow server (with --host 0.0.0.0 for a container to reach it), or fix the address",
    )


def wandb_check(runtime: Runtime, settings: WandbSettings) -> Check:
    if settings.mode == "offline":
        folder = runtime.job_dir / WANDB_DIR
        return Check(PASS, TRACKER_WANDB, f"offline: the run's files go to {folder} for `wandb sync`")
    if not os.environ.get("WANDB_API_KEY"):
        return Check(
            WARN,
            TRACKER_WANDB,
            "log.wandb.mode is online, but WANDB_API_KEY is not set in this shell: the trainer would run without W&B",
            "export WANDB_API_KEY (it is passed to the container by name, never written down), or set "
            "log.wandb.mode: offline",
        )
    return Check(PASS, TRACKER_WANDB, "online; WANDB_API_KEY is set here and passed to the container by name")
