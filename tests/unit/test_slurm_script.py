"""The sbatch script `invoke submit` writes, for each launcher, against reviewed golden files.

The docker launcher runs for real on a Slurm cluster (tests/slurm); pyxis and apptainer
cannot run here, so their scripts are compared line for line with tests/unit/golden/
(regenerate with ASTRAI_UPDATE_GOLDEN=1 and review the diff) and parsed by bash.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from astrai.host import slurm_node, slurm_script
from astrai.host.runtime import resolve_runtime
from tests.support import REPO, write_config

GOLDEN = Path(__file__).parent / "golden"
PYTHON = "/opt/venv/bin/python"


def _runtime(root: Path, launcher: str, gpu=None, slurm_block=None, nodes=2, name="llm-7b"):
    block = {
        "job_name": name,
        "paths": {"data": "./data", "model": "./params", "checkpoints": "./checkpoints"},
        "gpu": gpu or {"devices": [0, 1, 2, 3]},
        "container": {"cuda_tag": "cu128", "stop_timeout_seconds": 300, "stop_grace_period": "6m"},
        "nodes": {"count": nodes},
        "environment": {"NCCL_DEBUG": "WARN", "NOTE": "a b $x 'q'"},
        "slurm": {
            "partition": "gpu",
            "account": "ml-team",
            "time": "04:00:00",
            "launcher": launcher,
            "image": "docker://registry.example/astrai-train:v1",
            "extra": ["--constraint=a100", "--exclusive"],
            **(slurm_block or {}),
        },
    }
    if block["gpu"].get("devices") == "none":
        block["container"]["cuda_tag"] = "cpu"
    return resolve_runtime(write_config(root, block))


def _script(runtime, args=("--max_lr", "1e-3")) -> str:
    return slurm_script.render_script(runtime, list(args), python=PYTHON)


@pytest.mark.parametrize("launcher", ["docker", "pyxis", "apptainer"])
def test_the_script_matches_its_reviewed_golden_file(tmp_path, launcher):
    root = tmp_path / "cluster home"
    text = _script(_runtime(root, launcher)).replace(str(root), "/home/me/job")
    golden = GOLDEN / f"slurm-{launcher}.sbatch"
    if os.environ.get("ASTRAI_UPDATE_GOLDEN"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text, encoding="utf-8")
    assert text == golden.read_text(encoding="utf-8")
    parsed = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
    assert parsed.returncode == 0, parsed.stderr


def test_options_follow_the_yaml(tmp_path):
    runtime = _runtime(tmp_path, "docker", slurm_block={"requeue": False, "partition": None, "account": None})
    options = slurm_script.sbatch_options(runtime)
    assert "--nodes=2" in options and "--ntasks-per-node=1" in options and "--gpus-per-node=4" in options
    assert "--no-requeue" in options and not any(o.startswith(("--partition", "--account", "--qos")) for o in options)
    # The warning: the stop's whole timeout plus the margin before the end; output appended across requeues.
    assert f"--signal=B:USR1@{300 + slurm_script.SIGNAL_MARGIN_SECONDS}" in options and "--open-mode=append" in options
    assert options[-2:] == ["--constraint=a100", "--exclusive"]
    whole = slurm_script.sbatch_options(_runtime(tmp_path, "docker", gpu={"devices": "all"}))
    assert "--exclusive" in whole and not any(o.startswith("--gpus") for o in whole)
    cpu = slurm_script.sbatch_options(_runtime(tmp_path, "docker", gpu={"devices": "none", "processes": 2}, nodes=1))
    assert not any(o.startswith("--gpus") for o in cpu)


def test_in_image_launchers_take_gpus_and_rank_from_slurm(tmp_path):
    text = _script(_runtime(tmp_path, "pyxis"))
    assert "export ASTRAI_GPU_DEVICES=all" in text and "CUDA_VISIBLE_DEVICES" not in text
    assert 'export ASTRAI_NODE_RANK="$SLURM_NODEID"' in text
    assert "export NOTE='a b $x '\"'\"'q'\"'\"''" in text  # literal, as the Docker job has it
    cpu = _script(_runtime(tmp_path, "apptainer", gpu={"devices": "none", "processes": 2}))
    assert "export ASTRAI_PROCESSES=2" in cpu and "--nv" not in cpu


def test_the_allocations_rendezvous_wins_over_one_left_in_the_yaml(tmp_path):
    runtime = dataclasses.replace(_runtime(tmp_path, "pyxis"), rendezvous="10.9.9.9:29500", rdzv_id="old")
    text = _script(runtime)
    assert "10.9.9.9" not in text and "old" not in text
    assert text.count("export ASTRAI_RDZV_ENDPOINT=") == text.count("export ASTRAI_RDZV_ID=") == 1


def test_the_rendezvous_port_is_one_rule_below_the_ephemeral_ports():
    expression = slurm_script.rendezvous_port("SLURM_JOB_ID")
    ports = [
        int(
            subprocess.run(
                ["bash", "-c", f"echo {expression}"],
                env={"SLURM_JOB_ID": str(job)},
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        for job in (1, 12345, 29999, 10_000_000)
    ]
    assert ports == [20001, 22345, 29999, 20000]
    assert all(port < 32768 for port in ports)  # Linux's ephemeral ports start there


def test_invoke_stop_after_the_time_limit_warning_still_means_no_requeue(tmp_path):
    text = _script(_runtime(tmp_path, "docker"))
    assert "trap 'requeue=false; stop_tasks stop" in text
    assert '[ "$requeue" = true ]' in text


def test_what_the_script_cannot_carry_is_refused(tmp_path):
    with pytest.raises(slurm_script.SlurmError, match=r"runtime\.slurm\.image: missing"):
        _script(_runtime(tmp_path / "a", "pyxis", slurm_block={"image": None}))
    with pytest.raises(slurm_script.SlurmError, match=r"runtime\.paths\.checkpoints: .*'%'"):
        _script(_runtime(tmp_path / "100%", "docker"))
    with pytest.raises(slurm_script.SlurmError, match=r"runtime\.paths\.data: .*','"):
        _script(_runtime(tmp_path / "a,b", "apptainer"))
    assert "srun" in _script(_runtime(tmp_path / "a,b", "docker"))  # docker mounts take any path
    with pytest.raises(slurm_script.SlurmError, match=r"runtime\.paths\.checkpoints: .*double quote"):
        _script(_runtime(tmp_path / 'say "hi"', "docker"))
    spaced = _script(_runtime(tmp_path / "a b $x ü", "docker"))
    assert f'#SBATCH --output="{tmp_path}/a b $x ü/checkpoints/llm-7b/.astrai/slurm/slurm-%j.out"' in spaced


@pytest.mark.parametrize(
    "text, seconds",
    [("04:00:00", 14400), ("1-00:00:00", 86400), ("2-03", 183600), ("30", 1800), ("5:30", 330), ("UNLIMITED", None)],
)
def test_slurm_time_limits_are_read_as_slurm_writes_them(text, seconds):
    assert slurm_script.parse_time_limit(text) == seconds


def test_submit_dry_run_prints_the_script_and_writes_nothing(tmp_path):
    runtime = _runtime(tmp_path, "docker", gpu={"devices": "none"}, nodes=2)
    task = [sys.executable, "-m", "invoke", "--search-root", str(REPO), "submit", "--config", str(runtime.config_path)]
    done = subprocess.run([*task, "--dry-run", "--", "--max_lr", "1e-3"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("#!/bin/bash\n") and "--max_lr 1e-3" in done.stdout
    assert not (tmp_path / "checkpoints").exists()
    done = subprocess.run([*task, "--dry-run", "--", "--max_step", "5"], capture_output=True, text=True)
    assert done.returncode == 2 and "max_step" in done.stderr and "Traceback" not in done.stderr
    plain = tmp_path / "plain.yaml"
    plain.write_text("runtime: {job_name: p, gpu: {devices: none}, container: {cuda_tag: cpu}}\n", encoding="utf-8")
    done = subprocess.run([*task[:-1], str(plain), "--dry-run"], capture_output=True, text=True)
    assert done.returncode == 2 and "runtime.slurm: missing" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("extra", "owner"),
    [
        ("--signal=B:USR1@10", "runtime.container.stop_timeout_seconds"),
        ("--no-requeue", "runtime.slurm.requeue"),
        ("--nodes=4", "runtime.nodes.count"),
        ("-N 4", "runtime.nodes.count"),
        ("--output=/tmp/x.out", "the job's one output file"),
        ("-pdebug", "runtime.slurm.partition"),
        ("--time=10:00:00", "runtime.slurm.time"),
    ],
)
def test_extra_options_that_would_override_the_script_s_own_are_refused_naming_the_key(tmp_path, extra, owner):
    runtime = _runtime(tmp_path, "docker", slurm_block={"extra": ["--constraint=a100", extra]})
    (problem,) = slurm_script.config_problems(runtime)
    assert f"runtime.slurm.extra[1]: {extra!r} would override the script's own" in problem and owner in problem
    assert slurm_script.config_problems(_runtime(tmp_path / "ok", "docker")) == []


def test_a_time_limit_shorter_than_the_stop_signal_s_lead_is_refused_without_a_cluster(tmp_path):
    runtime = _runtime(tmp_path, "docker", gpu={"devices": "none"}, slurm_block={"time": "00:05:00"})
    task = [sys.executable, "-m", "invoke", "--search-root", str(REPO), "submit", "--config", str(runtime.config_path)]
    done = subprocess.run([*task, "--dry-run"], capture_output=True, text=True)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "runtime.slurm.time: 00:05:00 (300 s) leaves under 60 s before the stop signal" in done.stderr
    assert "make it at least 00:06:30" in done.stderr and not done.stdout


def test_a_multi_node_job_left_to_its_scheduler_cannot_be_started_by_hand(tmp_path):
    runtime = _runtime(tmp_path, "docker", gpu={"devices": "none"}, nodes=2)
    task = [sys.executable, "-m", "invoke", "--search-root", str(REPO), "start", "--config", str(runtime.config_path)]
    for verb in ("start", "restart"):  # restart refuses before it would stop anything
        task[task.index("--config") - 1] = verb
        done = subprocess.run(task, capture_output=True, text=True)
        assert done.returncode == 2 and "invoke submit" in done.stderr and "Traceback" not in done.stderr
        assert "stopping" not in done.stdout
    assert not (tmp_path / "checkpoints").exists()


def test_each_nodes_container_is_watched_and_never_restarted_by_docker(tmp_path):
    from astrai.host import compose

    runtime = _runtime(tmp_path, "docker", gpu={"devices": [0, 1]}, nodes=2)
    runtime = dataclasses.replace(runtime, max_restarts=3, node=1)
    env = {"ASTRAI_RDZV_ENDPOINT": "127.0.0.1:24711", "SLURM_JOB_ID": "4711", "SLURM_STEP_GPUS": "2,3"}
    node = slurm_node.allocation_runtime(runtime, env)
    service = compose.render_override(node, uid=1000, gid=1000)["services"][compose.SERVICE]
    environment = service["environment"]
    assert environment["ASTRAI_SUPERVISOR_PID"] == str(os.getpid())
    assert environment["ASTRAI_RDZV_ENDPOINT"] == "127.0.0.1:24711" and environment["ASTRAI_RDZV_ID"] == "slurm-4711"
    assert environment["ASTRAI_NODE_RANK"] == "1"
    # The GPUs Slurm gave this task, by their host indices (the engine's containers see every GPU).
    assert environment["CUDA_VISIBLE_DEVICES"] == "2,3" and environment["ASTRAI_GPU_DEVICES"] == "2,3"
    assert service["pid"] == "host" and "restart" not in service
    # `invoke start` of a job with a rendezvous keeps Docker's restarts and watches nothing.
    plain = compose.render_override(dataclasses.replace(runtime, rendezvous="10.0.0.1:29500"), uid=1000, gid=1000)
    assert plain["services"][compose.SERVICE]["restart"] == "on-failure:3"
    assert "ASTRAI_SUPERVISOR_PID" not in plain["services"][compose.SERVICE]["environment"]


def test_a_multi_node_job_without_a_rendezvous_needs_a_scheduler_block(tmp_path):
    from astrai.common.configfile import ConfigError

    config = tmp_path / "train.yaml"
    config.write_text("runtime: {gpu: {devices: none}, container: {cuda_tag: cpu}, nodes: {count: 2}}\n")
    with pytest.raises(ConfigError, match=r"runtime\.nodes\.rendezvous: missing.*runtime\.slurm"):
        resolve_runtime(config)
    config.write_text("runtime: {gpu: {devices: none}, container: {cuda_tag: cpu}, nodes: {count: 2}, slurm: {}}\n")
    assert resolve_runtime(config).slurm.launcher == "docker"
    config.write_text("runtime: {slurm: {time: '4:00', launcher: pyxsi, requeue: 'yes', extra: [\"--x\\ny\"]}}\n")
    with pytest.raises(ConfigError) as raised:
        resolve_runtime(config)
    message = str(raised.value)
    for key in ("runtime.slurm.time", "runtime.slurm.launcher", "runtime.slurm.requeue", "runtime.slurm.extra.0"):
        assert key in message
    assert "did you mean 'pyxis'" in message


def test_a_requeue_needs_progress_in_the_allocation(tmp_path):
    """An allocation whose time limit leaves no room to train must not be requeued forever."""
    runtime = _runtime(tmp_path / "a b", "docker")
    script = _script(runtime)
    function = script[script.index("newest_step() {") : script.index("start_step=")]
    job = runtime.job_dir

    def newest() -> str:
        done = subprocess.run(["bash", "-c", function + "newest_step"], capture_output=True, text=True, check=True)
        return done.stdout.strip()

    assert newest() == "-1"  # no job folder yet
    for name in ("epoch_0_step_40", "epoch_1_step_120", "epoch_1_step_99x", "epoch_2_step_130"):
        (job / name).mkdir(parents=True)
    for name in ("epoch_0_step_40", "epoch_1_step_120", "epoch_1_step_99x"):
        (job / name / "meta.json").write_text("{}")
    assert newest() == "120"  # a folder without meta.json is still being written; a malformed name is no step
    guard = script.index('elif [ "$(newest_step)" -le "$start_step" ]')
    assert script.index("the run is finished; not requeued") < guard < script.index('scontrol requeue "$SLURM_JOB_ID"')


@pytest.mark.parametrize("launcher", ["pyxis", "apptainer"])
def test_in_image_launchers_ask_for_gpus_as_gpus(tmp_path, launcher):
    runtime = _runtime(tmp_path, launcher, gpu={"devices": [0, 1]})
    assert "--gpus-per-node=2" in slurm_script.sbatch_options(runtime) and slurm_script.config_problems(runtime) == []
    (problem,) = slurm_script.config_problems(_runtime(tmp_path / "all", launcher, gpu={"devices": "all"}))
    assert "runtime.gpu.devices: all takes a whole node (--exclusive)" in problem and "--gpus-per-node=8" in problem
