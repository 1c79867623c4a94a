"""Shared test setup: the `docker` marker skips without a Docker engine, unless ASTRAI_REQUIRE_DOCKER=1."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def _docker_unavailable_reason() -> str | None:
    if shutil.which("docker") is None:
        return "the docker CLI is not installed"
    try:
        info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "the Docker daemon did not answer within 30 s"
    if info.returncode != 0:
        return "the Docker daemon is not reachable"
    compose = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
    if compose.returncode != 0:
        return "Docker Compose v2 is not installed"
    return None


def pytest_collection_modifyitems(config, items):
    docker_items = [item for item in items if item.get_closest_marker("docker")]
    if not docker_items:
        return
    reason = _docker_unavailable_reason()
    if reason is None:
        return
    if os.environ.get("ASTRAI_REQUIRE_DOCKER") == "1":
        marker = pytest.mark.usefixtures("_docker_required_but_missing")
        config._astrai_docker_reason = reason
    else:
        marker = pytest.mark.skip(reason=f"{reason} (set ASTRAI_REQUIRE_DOCKER=1 to make this a failure)")
    for item in docker_items:
        item.add_marker(marker)


@pytest.fixture
def _docker_required_but_missing(request):
    pytest.fail(f"ASTRAI_REQUIRE_DOCKER=1 but {request.config._astrai_docker_reason}")
