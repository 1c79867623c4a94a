"""`invoke demo` end to end, as the README's first command runs it."""

from __future__ import annotations

import secrets
import subprocess
import sys

import pytest

from astrai.common.checkpoints import list_complete_checkpoints
from astrai.host import compose

pytestmark = pytest.mark.docker


def test_demo_runs_the_whole_lifecycle(tmp_path, base_image):
    job_name = f"t-demo-{secrets.token_hex(3)}"
    workdir = tmp_path / "demo"
    demo = [sys.executable, "-m", "invoke", "--search-root", str(compose.PROJECT_ROOT), "demo"]
    demo += ["--workdir", str(workdir), "--job-name", job_name]
    try:
        result = subprocess.run(demo, capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr
        output = result.stdout
        for expected in ("preflight passed", "emergency checkpoint", "resumed from", "(final)"):
            assert expected in output, expected
        reasons = [c.meta.reason for c in list_complete_checkpoints(workdir / "checkpoints" / job_name)]
        assert "emergency" in reasons and reasons[-1] == "final"
        again = subprocess.run(demo, capture_output=True, text=True, timeout=60)
        assert again.returncode != 0 and "--fresh" in again.stderr
    finally:
        project = compose.project_name(job_name)
        subprocess.run(
            ["docker", "compose", "--project-name", project, "down", "--rmi", "local", "--timeout", "5"],
            capture_output=True,
        )
        subprocess.run(["docker", "image", "rm", "--force", f"{project}-trainer"], capture_output=True)
