"""The container entrypoint's decisions (process count, parallel mode, command) and its checks."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from astrai.common.contract import TORCHRUN_MODULE
from astrai.trainer.launch import entrypoint
from astrai.trainer.launch.entrypoint import EntrypointError, check_mounts, plan_launch
from tests.support import REPO, placeholder_checkpoint

PY = "/usr/bin/python3"


def _env(**values: str) -> dict[str, str]:
    return {
        "TRAIN_JOB_NAME": "job",
        "ASTRAI_CONFIG": "/run/astrai/train.yaml",
        "ASTRAI_STOP_TIMEOUT_SECONDS": "600",
        **values,
    }


def _no_gpu() -> int:
    return 0


def _trainer(mode: str, *extra: str) -> list[str]:
    return [
        "-m",
        "astrai.train",
        "--config",
        "/run/astrai/train.yaml",
        "--ckpt_dir",
        "/checkpoints/job",
        "--param_path",
        "/models/base",
        "--parallel_mode",
        mode,
        *extra,
    ]


def test_two_listed_gpus_mean_ddp_with_two_processes_under_torchrun():
    plan = plan_launch(_env(ASTRAI_GPU_DEVICES="0,1", ASTRAI_PARALLEL_MODE="auto"), [], _no_gpu, python=PY)
    assert (plan.processes, plan.parallel_mode) == (2, "ddp")
    assert plan.command == [
        PY,
        "-m",
        TORCHRUN_MODULE,
        "--standalone",
        "--nproc-per-node",
        "2",
        "--shutdown-timeout",
        "600",
        *_trainer("ddp"),
    ]


def test_one_listed_gpu_runs_the_trainer_directly():
    plan = plan_launch(
        _env(ASTRAI_GPU_DEVICES="3", ASTRAI_PARALLEL_MODE="auto"), ["--max_steps", "9"], _no_gpu, python=PY
    )
    assert (plan.processes, plan.parallel_mode) == (1, "none")
    assert plan.command == [PY, *_trainer("none", "--max_steps", "9")]


def test_all_gpus_counts_what_the_container_sees():
    plan = plan_launch(_env(ASTRAI_GPU_DEVICES="all", ASTRAI_PARALLEL_MODE="fsdp"), [], lambda: 4, python=PY)
    assert (plan.processes, plan.parallel_mode) == (4, "fsdp")
    assert "--nproc-per-node" in plan.command and plan.command[plan.command.index("--nproc-per-node") + 1] == "4"


def test_all_gpus_with_none_visible_fails_clearly():
    with pytest.raises(EntrypointError, match=r"sees no GPU"):
        plan_launch(_env(ASTRAI_GPU_DEVICES="all"), [], _no_gpu)


def test_cpu_mode_takes_the_process_count_from_the_runtime_block():
    plan = plan_launch(
        _env(ASTRAI_GPU_DEVICES="none", ASTRAI_PROCESSES="2", ASTRAI_PARALLEL_MODE="auto"), [], _no_gpu, python=PY
    )
    assert (plan.processes, plan.parallel_mode) == (2, "ddp")


def test_shutdown_timeout_follows_the_stop_timeout_with_a_floor():
    plan = plan_launch(
        _env(ASTRAI_GPU_DEVICES="none", ASTRAI_PROCESSES="2", ASTRAI_STOP_TIMEOUT_SECONDS="5"), [], _no_gpu
    )
    assert plan.command[plan.command.index("--shutdown-timeout") + 1] == "30"
    plan = plan_launch(
        _env(ASTRAI_GPU_DEVICES="none", ASTRAI_PROCESSES="2", ASTRAI_STOP_TIMEOUT_SECONDS="900"), [], _no_gpu
    )
    assert plan.command[plan.command.index("--shutdown-timeout") + 1] == "900"


@pytest.mark.parametrize(
    ("devices", "mode", "message"),
    [
        ("0", "ddp", r"ddp needs 2 or more processes, but 1 was requested"),
        ("0,1", "none", r"none needs exactly 1 process, but 2 were requested"),
        ("0", "fsdp", r"fsdp needs 2 or more"),
    ],
)
def test_parallel_mode_rules_are_checked_in_the_container_too(devices, mode, message):
    with pytest.raises(EntrypointError, match=message):
        plan_launch(_env(ASTRAI_GPU_DEVICES=devices, ASTRAI_PARALLEL_MODE=mode), [], _no_gpu)


def test_missing_job_name_is_an_error():
    with pytest.raises(EntrypointError, match="TRAIN_JOB_NAME"):
        plan_launch({"ASTRAI_GPU_DEVICES": "none"}, [], _no_gpu)


def test_listed_gpus_must_be_visible():
    env = _env(ASTRAI_GPU_DEVICES="0,1")
    plan = plan_launch(env, [], _no_gpu)
    with pytest.raises(EntrypointError, match=r"lists 2 GPU\(s\) \(0,1\) but the container sees 1"):
        entrypoint.check_gpus(env, plan, lambda: 1)
    entrypoint.check_gpus(env, plan, lambda: 2)


def _model(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"x")
    return folder


def test_mount_checks_pass_and_create_the_job_dir(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    entrypoint.check_mounts(tmp_path / "ckpt" / "job", data, _model(tmp_path / "model"))
    assert (tmp_path / "ckpt" / "job").is_dir()
    assert list((tmp_path / "ckpt" / "job").iterdir()) == []


def test_mount_checks_name_the_missing_piece(tmp_path):
    model = _model(tmp_path / "model")
    with pytest.raises(EntrypointError, match=r"/missing-data is missing or not readable"):
        entrypoint.check_mounts(tmp_path / "job", tmp_path / "missing-data", model)
    data = tmp_path / "data"
    data.mkdir()
    (tmp_path / "blocked").write_text("a file, not a folder")
    with pytest.raises(EntrypointError, match=r"job dir .* is not writable"):
        entrypoint.check_mounts(tmp_path / "blocked" / "job", data, model)
    (model / "model.safetensors").write_bytes(b"")
    with pytest.raises(EntrypointError, match=r"model.safetensors is missing or empty"):
        entrypoint.check_mounts(tmp_path / "job", data, model)


def test_a_complete_checkpoint_makes_the_base_model_optional(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    placeholder_checkpoint(tmp_path / "job", 0, 10)
    entrypoint.check_mounts(tmp_path / "job", data, tmp_path / "no-model")


def test_print_plan_prints_json_without_checking_mounts(monkeypatch, capsys):
    monkeypatch.setattr(os, "environ", _env(ASTRAI_GPU_DEVICES="0,1", ASTRAI_PARALLEL_MODE="auto"))
    assert entrypoint.main(["--print-plan", "--max_steps", "3"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["processes"], plan["parallel_mode"]) == (2, "ddp")
    assert plan["command"][-2:] == ["--max_steps", "3"]


def test_errors_exit_2_with_a_message_and_no_traceback():
    env = {**os.environ, **_env(ASTRAI_GPU_DEVICES="0", ASTRAI_PARALLEL_MODE="ddp")}
    result = subprocess.run(
        [sys.executable, "-m", "astrai.trainer.launch.entrypoint"],
        env=env,
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 2
    assert "runtime.gpu.parallel_mode: ddp needs 2 or more processes" in result.stderr
    assert "Traceback" not in result.stderr


def _two_rank_launcher(setup: str, worker_setup: str = "", worker_catching: str = "") -> str:
    """A fake torchrun: ``setup``, then two workers (ranks 0 and 1) that run ``worker_setup``, catch SIGTERM, run
    ``worker_catching``, and once stopped write saved-<rank> in the folder given; it exits with the worst worker code.
    """
    worker = "\n".join(
        [
            "import signal, sys, time",
            "rank, out = sys.argv[1], sys.argv[2]",
            worker_setup,
            "stop = []",
            "signal.signal(signal.SIGTERM, lambda *_: stop.append(1))",
            worker_catching,
            "while not stop: time.sleep(0.01)",
            "open(out + '/saved-' + rank, 'w').close()",
        ]
    )
    return "\n".join(
        [
            "import signal, subprocess, sys, time",
            "out = sys.argv[1]",
            setup,
            f"worker = {worker!r}",
            "workers = [subprocess.Popen([sys.executable, '-c', worker, str(rank), out]) for rank in range(2)]",
            "sys.exit(max(w.wait() for w in workers))",
        ]
    )


def _wait_for_files(folder: Path, names: list[str], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not all((folder / name).exists() for name in names):
        assert time.monotonic() < deadline, f"not all of {names} appeared"
        time.sleep(0.01)


def _entrypoint_loop(setup: str, arguments: str) -> subprocess.Popen:
    """supervise_workers(``arguments``) in a process of its own, after the stop signals are held (as main() holds
    them) and ``setup`` ran."""
    code = (
        "import pathlib, sys\n"
        "from astrai.trainer.launch import signals\n"
        "from astrai.trainer.launch.entrypoint import Supervisor, supervise_workers\n"
        "signals.hold()\n"
        f"{setup}\n"
        f"sys.exit(supervise_workers({arguments}))\n"
    )
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})


def _supervise_and_stop(
    tmp_path: Path,
    launcher_source: str,
    signal_when: list[str],
    *launcher_args: str,
    job_dir: Path | None = None,
    settle: float = 0,
) -> int:
    """Run supervise_workers (signals held, as main() does) over a fake launcher given tmp_path and
    ``launcher_args``; once every file in ``signal_when`` exists under tmp_path (and ``settle`` seconds more), send
    it SIGTERM; return its exit code."""
    launcher = tmp_path / "launcher.py"
    launcher.write_text(launcher_source)
    command = [sys.executable, str(launcher), str(tmp_path), *launcher_args]
    job_dir_arg = "" if job_dir is None else f", job_dir=pathlib.Path({str(job_dir)!r})"
    process = _entrypoint_loop(f"pathlib.Path({str(tmp_path / 'held')!r}).touch()", f"{command!r}{job_dir_arg}")
    try:
        _wait_for_files(tmp_path, signal_when)
        time.sleep(settle)
        process.send_signal(signal.SIGTERM)
        return process.wait(timeout=30)
    finally:
        process.kill()
        process.wait()


# Like torchrun: a launcher that would tear everything down if it were signalled itself.
_FAKE_LAUNCHER = _two_rank_launcher(
    setup='signal.signal(signal.SIGTERM, lambda *_: (open(out + "/launcher-signalled", "w").close(), sys.exit(1)))',
    worker_catching="open(out + '/ready-' + rank, 'w').close()",
)


def test_stop_signal_reaches_every_worker_and_not_the_launcher(tmp_path):
    assert _supervise_and_stop(tmp_path, _FAKE_LAUNCHER, ["ready-0", "ready-1"]) == 0
    assert (tmp_path / "saved-0").exists() and (tmp_path / "saved-1").exists()
    assert not (tmp_path / "launcher-signalled").exists()


# torchrun importing torch (no worker yet), then workers importing torch (no handler yet).
_SLOW_LAUNCHER = _two_rank_launcher(setup="time.sleep(1)", worker_setup="time.sleep(1)")


def test_a_stop_before_the_workers_can_catch_it_waits_for_them(tmp_path):
    # Signalled as soon as the supervisor runs: before any worker exists.
    assert _supervise_and_stop(tmp_path, _SLOW_LAUNCHER, ["held"]) == 0
    assert (tmp_path / "saved-0").exists() and (tmp_path / "saved-1").exists()


def _node_env(node: int, backend: str) -> dict[str, str]:
    return _env(
        ASTRAI_GPU_DEVICES="none",
        ASTRAI_PROCESSES="1",
        ASTRAI_NODES="2",
        ASTRAI_NODE_RANK=str(node),
        ASTRAI_RDZV_ENDPOINT="10.0.0.1:29500",
        ASTRAI_RDZV_BACKEND=backend,
    )


def _node_command(backend: str, *rendezvous: str) -> list[str]:
    """The command planned for one node of _node_env's job: torchrun meeting at 10.0.0.1:29500 (``rendezvous``: the
    backend's own arguments)."""
    return [
        PY,
        "-m",
        TORCHRUN_MODULE,
        "--nnodes",
        "2",
        "--rdzv-backend",
        backend,
        "--rdzv-endpoint",
        "10.0.0.1:29500",
        "--rdzv-id",
        "astrai-job",
        *rendezvous,
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "0",
        "--shutdown-timeout",
        "600",
        *_trainer("ddp"),
    ]


@pytest.mark.parametrize("node", [0, 1])
def test_static_rendezvous_gives_each_node_its_rank(node):
    plan = plan_launch(_node_env(node, "static"), [], _no_gpu, python=PY)
    assert (plan.nodes, plan.node, plan.processes, plan.parallel_mode) == (2, node, 1, "ddp")
    assert plan.command == _node_command("static", "--node-rank", str(node))


@pytest.mark.parametrize("node", [0, 1])
def test_c10d_rendezvous_is_hosted_by_node_0_under_an_id_from_the_job_name(node):
    plan = plan_launch(_node_env(node, "c10d"), [], _no_gpu, python=PY)
    assert plan.command == _node_command("c10d", "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}")


def test_a_node_outside_the_job_is_refused():
    with pytest.raises(EntrypointError, match="ASTRAI_NODE_RANK is 2 but the job has 2 node"):
        plan_launch({**_node_env(0, "static"), "ASTRAI_NODE_RANK": "2"}, [], _no_gpu)


def test_only_node_0_needs_the_base_model(tmp_path):
    data, model, job = tmp_path / "data", tmp_path / "model", tmp_path / "job"
    data.mkdir()
    model.mkdir()
    with pytest.raises(EntrypointError, match="base model file"):
        check_mounts(job, data, model, node=0)
    check_mounts(job, data, model, node=1)


def test_a_schedulers_rendezvous_id_replaces_the_one_from_the_job_name():
    plan = plan_launch({**_node_env(1, "c10d"), "ASTRAI_RDZV_ID": "slurm-4711"}, [], _no_gpu, python=PY)
    assert plan.command[plan.command.index("--rdzv-id") + 1] == "slurm-4711"


def test_kubeflow_trainers_pet_variables_stand_in_for_unset_astrai_ones():
    env = _env(ASTRAI_GPU_DEVICES="none", PET_NNODES="3", PET_NODE_RANK="2", PET_MASTER_ADDR="job-node-0-0.job")
    env["PET_MASTER_PORT"] = "29400"
    plan = plan_launch(env, [], _no_gpu, python=PY)
    assert (plan.nodes, plan.node) == (3, 2)
    assert plan.command[plan.command.index("--rdzv-endpoint") + 1] == "job-node-0-0.job:29400"
    # The product's own names win where both are set.
    plan = plan_launch({**env, "ASTRAI_NODE_RANK": "0"}, [], _no_gpu, python=PY)
    assert plan.node == 0


_FAKE_TRAINER = textwrap.dedent(
    """
    import signal, sys, time
    from astrai.trainer.launch import signals
    out, mode = sys.argv[1], sys.argv[2]
    signals.catch()  # as the trainer does first: takes a stop held since the entrypoint
    while signals.received() is None:
        time.sleep(0.01)
    open(out + "/stopping", "w").close()
    if mode == "hang":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        while True:
            time.sleep(1)
    open(out + "/saved", "w").close()
    """
)


@contextlib.contextmanager
def _supervised(tmp_path: Path, mode: str, stop_timeout: float):
    """The entrypoint's loop over one direct trainer, watching a supervisor process the test can kill:
    (supervisor, entrypoint), both killed at the end."""
    trainer = tmp_path / "trainer.py"
    trainer.write_text(_FAKE_TRAINER)
    supervisor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    command = [sys.executable, str(trainer), str(tmp_path), mode]
    entry = _entrypoint_loop(
        f"watched = Supervisor.of({supervisor.pid})",
        f"{command!r}, direct=True, supervisor=watched, stop_timeout={stop_timeout}",
    )
    try:
        yield supervisor, entry
    finally:
        for process in (supervisor, entry):
            process.kill()
            process.wait()


def test_when_the_supervisor_is_gone_the_trainer_stops_gracefully(tmp_path):
    with _supervised(tmp_path, "save", stop_timeout=30) as (supervisor, entry):
        time.sleep(1.5)
        assert entry.poll() is None and not (tmp_path / "stopping").exists()  # watched and alive: it trains on
        supervisor.kill()
        supervisor.wait()
        assert entry.wait(timeout=30) == 0
        assert (tmp_path / "saved").exists()


def test_a_trainer_that_does_not_stop_in_time_is_killed_once_its_supervisor_is_gone(tmp_path):
    with _supervised(tmp_path, "hang", stop_timeout=2) as (supervisor, entry):
        time.sleep(1.5)
        supervisor.kill()
        supervisor.wait()
        started = time.monotonic()
        assert entry.wait(timeout=30) == 128 + signal.SIGKILL
        assert (tmp_path / "stopping").exists() and not (tmp_path / "saved").exists()
        assert time.monotonic() - started < 10


def test_a_supervisor_is_told_apart_from_a_later_process_with_its_pid():
    watched = entrypoint.Supervisor.of(os.getpid())
    assert watched.alive()
    assert not entrypoint.Supervisor(os.getpid(), "0").alive()  # same pid, another start time
    assert not entrypoint.Supervisor.of(2**22 + 7).alive()


_LAUNCHER_SIGNALLED_TOO = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    out, save = sys.argv[1], sys.argv[2] == "save"
    # Like torchrun under Slurm's scancel: the launcher is signalled too and exits 1 once its worker is done.
    signal.signal(signal.SIGTERM, lambda *_: None)
    worker = (
        "import signal, sys, time\\n"
        "stop = []\\n"
        "signal.signal(signal.SIGTERM, lambda *_: stop.append(1))\\n"
        "open(sys.argv[1] + '/ready', 'w').close()\\n"
        "while not stop: time.sleep(0.01)\\n"
        + ("from tests.support import placeholder_checkpoint\\n"
           "from pathlib import Path\\n"
           "placeholder_checkpoint(Path(sys.argv[1]) / 'job', 0, 7, reason='emergency')\\n" if save else "")
    )
    subprocess.Popen([sys.executable, "-c", worker, out]).wait()
    sys.exit(1)
    """
)


@pytest.mark.parametrize("saved", [True, False], ids=["emergency-checkpoint", "none"])
def test_a_launcher_signalled_with_its_ranks_exits_0_when_the_emergency_checkpoint_is_written(tmp_path, saved):
    (tmp_path / "job").mkdir()
    code = _supervise_and_stop(
        tmp_path, _LAUNCHER_SIGNALLED_TOO, ["ready"], "save" if saved else "none", job_dir=tmp_path / "job", settle=0.3
    )
    assert code == (0 if saved else 1)


_STOPPED_BY_ANOTHER_NODE = textwrap.dedent(
    """
    import subprocess, sys
    out, save = sys.argv[1], sys.argv[2] == "save"
    # A rank told of the stop by another node's rank: no signal here, an emergency checkpoint (or the end), exit 0.
    worker = (
        "import sys\\n"
        + ("from tests.support import placeholder_checkpoint\\n"
           "from pathlib import Path\\n"
           "placeholder_checkpoint(Path(sys.argv[1]) / 'job', 0, 7, reason='emergency')\\n" if save else "")
    )
    sys.exit(subprocess.Popen([sys.executable, "-c", worker, out]).wait())
    """
)


@pytest.mark.parametrize("saved", [True, False], ids=["emergency-checkpoint", "finished"])
def test_a_node_whose_ranks_stopped_for_another_node_exits_with_the_stopped_code(tmp_path, saved):
    # A Kubernetes pod's ranks may agree on another pod's stop before their own SIGTERM comes (or with none):
    # the emergency checkpoint, not the signal, says the run stopped short, so the Job retries it.
    (tmp_path / "job").mkdir()
    launcher = tmp_path / "launcher.py"
    launcher.write_text(_STOPPED_BY_ANOTHER_NODE)
    command = [sys.executable, str(launcher), str(tmp_path), "save" if saved else "none"]
    process = _entrypoint_loop("", f"{command!r}, job_dir=pathlib.Path({str(tmp_path / 'job')!r}), stopped_code=76")
    try:
        assert process.wait(timeout=60) == (76 if saved else 0)
    finally:
        process.kill()
        process.wait()


def test_torchrun_reports_a_failed_rank_in_one_line_without_a_traceback(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text('import os, sys\nsys.exit(3 if os.environ["RANK"] == "1" else 0)\n')
    command = [sys.executable, "-m", TORCHRUN_MODULE, "--standalone", "--nproc-per-node", "2", str(script)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1, done.stderr
    assert f"torchrun: rank 1 of {script} ended with exit code 3" in done.stderr and "Traceback" not in done.stderr
