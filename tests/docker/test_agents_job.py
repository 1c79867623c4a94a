"""A job whose episodes run in a server environment: a tiny OpenEnv-compatible server (tests/docker/openenv_server.py,
built here from the test base image) the product starts beside the trainer, which reaches it through OpenEnv's own
client. Preflight builds it and asks it for a reset; the job trains through `invoke start`, `stop` and `start`; the
server's container is on the job's own network only, hardened like the trainer, and stops with it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from astrai.common.contract import EPISODE_METRICS, LABEL_ENVIRONMENT, METRICS_FILE
from astrai.data.pipeline import prepare
from astrai.data.tokenizing import HFTokenizer
from astrai.host import launch
from astrai.host.runtime import EnvironmentServer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "agents"))
import make_world  # noqa: E402

pytestmark = pytest.mark.docker

SERVER = Path(__file__).resolve().parent / "openenv_server.py"


def _environment_container(job) -> dict:
    listing = subprocess.run(
        ["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={job.project}",
         "--filter", f"label={LABEL_ENVIRONMENT}=guess"],
        capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert listing, "no environment container"
    (info,) = json.loads(subprocess.run(["docker", "inspect", listing[0]], capture_output=True, text=True).stdout)
    return info


def test_a_job_trains_in_a_server_environment_beside_it_through_start_stop_start(make_job, base_image, tmp_path):
    job = make_job(
        runtime={"environments": {"guess": {"build": "./guess", "port": 8000}}},
        trainer={
            "training": {
                "train_type": "online_grpo",
                "environment": {"server": "guess"},
                "rewards": ["astrai.rewards:exact_answer"],
                "num_generations": 2,
                "batch_per_device": 2,
                "max_completion_length": 16,
                "max_episode_tokens": 96,
                "max_turns": 2,
                "max_steps": 500,
                "max_lr": 1e-3,
            },
            "ckpt": {"ckpt_interval": 1000},
            "log": {"log_interval": 1},
        },
    )
    for name in ("params", "data"):
        shutil.rmtree(job.folder / name)
    make_world.write_tokenizer(job.folder / "params")
    subprocess.run(
        [sys.executable, "-m", "astrai.model", "init", str(job.folder / "params"), "--preset", "tiny"],
        check=True, capture_output=True,
    )  # fmt: skip
    records = tmp_path / "prompts.jsonl"
    question = [{"role": "user", "content": "Guess the number."}]
    records.write_text("".join(json.dumps({"prompt": question, "answer": str(n)}) + "\n" for n in range(8)))
    prepare(job.folder / "data", [records], tokenizer=HFTokenizer(job.folder / "params"), kind="prompts")
    (job.folder / "guess").mkdir()
    shutil.copy(SERVER, job.folder / "guess" / "server.py")
    (job.folder / "guess" / "Dockerfile").write_text(
        f'FROM {base_image}\nCOPY server.py /srv/server.py\nCMD ["python3", "/srv/server.py", "8000"]\n',
        encoding="utf-8",
    )
    image = f"{job.project}-{launch.environment_service(EnvironmentServer('guess', 8000))}"
    try:
        job.invoke("init")
        checklist = job.invoke("preflight", check=False).stdout
        line = next(line for line in checklist.splitlines() if "environments" in line)
        # Built here; the reset is asked for once `invoke start` has built the trainer image (with OpenEnv's client).
        assert "guess: its image is there" in line and "once `invoke start` has built" in line, checklist

        job.invoke("start")
        job.wait_for("step 2", lambda: job.progress_step() >= 2, timeout=900)
        server = _environment_container(job)
        networks = list(server["NetworkSettings"]["Networks"])
        assert networks == [f"{job.project}_default"], networks  # the job's own network only
        assert not server["NetworkSettings"]["Ports"] and not server["HostConfig"]["PortBindings"]
        host = server["HostConfig"]
        assert host["CapDrop"] == ["ALL"] and host["ReadonlyRootfs"] is True, host
        assert "no-new-privileges:true" in host["SecurityOpt"] and server["Config"]["User"], server["Config"]
        resets = subprocess.run(["docker", "exec", server["Id"], "cat", "/tmp/resets"], capture_output=True, text=True)
        assert len(resets.stdout.split()) >= 2 * 4, resets  # every episode of the steps so far reset the server

        assert "emergency checkpoint" in job.invoke("stop").stdout
        assert not _environment_container(job)["State"]["Running"]  # it stopped with the trainer
        stopped, reason = job.checkpoints()[-1]
        assert reason == "emergency"
        job.invoke("start", "--", "--max_steps", str(stopped + 3))
        assert job.wait_for_exit(timeout=900).exit_code == 0, job.logs()
        assert job.checkpoints()[-1] == (stopped + 3, "final")
        logs = job.logs()
        assert f"resumed from /checkpoints/{job.name}/epoch_" in logs and "tools guess in environment" in logs, logs
        records = [json.loads(line) for line in (job.job_dir / METRICS_FILE).read_text().splitlines()]
        for key in EPISODE_METRICS:  # the server's reward comes with its steps: a model that never calls it has none
            assert any(key in record for record in records), (key, records[-1])
        status = job.invoke("status").stdout
        assert f"step {stopped + 3}" in status, status
        # With the trainer image built, preflight checks the tools' template and asks the server for a reset.
        checklist = job.invoke("preflight", check=False).stdout
        tools = next(line for line in checklist.splitlines() if " tools" in line)
        assert tools.startswith("✓") and "tools guess in environment server guess" in tools, checklist
        server = next(line for line in checklist.splitlines() if "environments" in line)
        assert server.startswith("✓") and "answers reset through OpenEnv's client (port 8000)" in server, checklist
        # Preflight builds the server's image as `invoke start` does: the same image, no untagged copy left behind.
        label = f"label=com.docker.compose.project={job.project}"
        untagged = subprocess.run(
            ["docker", "images", "--quiet", "--filter", "dangling=true", "--filter", label],
            capture_output=True,
            text=True,
        )
        assert untagged.returncode == 0 and untagged.stdout.split() == [], untagged
    finally:
        # The image goes with its containers gone first: one still there (stopped) would keep it, untagged.
        label = f"label=com.docker.compose.project={job.project}"
        containers = subprocess.run(["docker", "ps", "-aq", "--filter", label], capture_output=True, text=True)
        if containers.stdout.split():
            subprocess.run(["docker", "rm", "--force", *containers.stdout.split()], capture_output=True)
        subprocess.run(["docker", "image", "rm", "--force", image], capture_output=True)
