"""The invoke tasks as a user runs them: exit codes, messages, and a disk left alone on bad input."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from runtime_cases import MALFORMED, mutated

from astrai.common.contract import REQUIRED_FILES
from tests.support import REPO, invoke, placeholder_checkpoint

# What makes a task act at once, without asking or waiting (clean deletes nothing without --force).
ACT_NOW = {
    "clean": ["--force"],
    "logs": ["--no-follow"],
    "board": ["--stop"],
    "export": ["--out", "exported"],
    "submit": ["--dry-run"],
}


def _config_tasks() -> list[list[str]]:
    """Every task that reads a job's config (from the task namespace itself), with what makes it act now."""
    from invoke import Collection

    import tasks

    collection = Collection.from_module(tasks)
    names = [
        name for name in sorted(collection.task_names) if "config" in [a.name for a in collection[name].get_arguments()]
    ]
    return [[name, *ACT_NOW.get(name, [])] for name in names]


# Every task that reads a config must reject a bad one before it does anything.
COMMANDS = _config_tasks()


def _snapshot(folder: Path) -> list[tuple[str, int]]:
    return sorted((str(path.relative_to(folder)), path.stat().st_mtime_ns) for path in folder.rglob("*"))


def test_the_command_lists_come_from_the_task_namespace():
    names = [command[0] for command in COMMANDS]
    assert {"submit", "export", "start", "clean", "board"} <= set(names) and "demo" not in names
    assert sorted({command[0] for command in PATH_COMMANDS} | set(READS_NO_CHECKPOINTS)) == names


# The messages of every malformed case are checked in-process (test_runtime); here each command runs once as a
# user runs it, on a case of its own, for the exit code, the message on stderr and a disk left as it was.
@pytest.mark.parametrize(
    ("command", "changes", "key"),
    [(command, MALFORMED[index][1], MALFORMED[index][2]) for index, command in enumerate(COMMANDS)],
    ids=[f"{command[0]}-{MALFORMED[index][0]}" for index, command in enumerate(COMMANDS)],
)
def test_malformed_config_exits_non_zero_names_the_key_and_changes_nothing(tmp_path, command, changes, key):
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump(mutated(changes), sort_keys=False), encoding="utf-8")
    before = _snapshot(tmp_path)
    result = invoke(*command, "--config", str(config), cwd=tmp_path)
    assert result.returncode == 2, result
    assert f"{config}: {key}: " in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert _snapshot(tmp_path) == before


def test_yaml_syntax_error_gives_the_line_and_exit_2(tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text("runtime:\n  job_name: x\n  gpu: [\n", encoding="utf-8")
    result = invoke("init", "--config", str(config))
    assert result.returncode == 2
    assert f"{config}:4:" in result.stderr and "YAML syntax error" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_config_is_a_clear_error(tmp_path):
    result = invoke("preflight", "--config", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2
    assert "nope.yaml: file not found" in result.stderr


def test_config_defaults_to_train_yaml_in_the_working_directory(tmp_path):
    (tmp_path / "train.yaml").write_text(
        "runtime:\n  job_name: here\n  gpu: {devices: none}\n  container: {cuda_tag: cpu}\n"
    )
    result = invoke("init", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "checkpoints" / "here").is_dir()


def test_every_verb_is_listed_with_help():
    result = invoke("--list")
    assert result.returncode == 0
    for verb in (
        "init",
        "preflight",
        "build",
        "start",
        "stop",
        "restart",
        "logs",
        "status",
        "latest",
        "list",
        "clean",
        "render",
        "demo",
        "bench",
        "board",
    ):
        assert f"  {verb} " in result.stdout, verb


@pytest.fixture
def job(tmp_path):
    return _cpu_job(tmp_path, container={"checkpoint_keep_last": 2}), tmp_path / "checkpoints" / "j"


def _cpu_job(folder: Path, paths: dict | None = None, container: dict | None = None) -> Path:
    """train.yaml of a CPU job named j in ``folder``."""
    runtime = {"job_name": "j", "gpu": {"devices": "none"}, "container": {"cuda_tag": "cpu", **(container or {})}}
    config = folder / "train.yaml"
    config.write_text(yaml.safe_dump({"runtime": {**runtime, **({"paths": paths} if paths else {})}}))
    return config


def _checkpoint(job_dir: Path, epoch: int, step: int, complete: bool = True) -> Path:
    return placeholder_checkpoint(job_dir, epoch, step, files=None if complete else REQUIRED_FILES[:2])


def test_init_creates_the_runtime_folders_and_never_touches_the_yaml(job):
    config, job_dir = job
    text = config.read_text()
    result = invoke("init", "--config", str(config))
    assert result.returncode == 0, result.stderr
    for name in ("data", "params", "checkpoints", "checkpoints/j"):
        assert (config.parent / name).is_dir()
    assert config.read_text() == text
    again = invoke("init", "--config", str(config))
    assert again.returncode == 0 and "nothing to create" in again.stdout


def test_latest_and_list_order_numerically_and_skip_incomplete(job):
    config, job_dir = job
    for epoch, step in [(0, 900), (1, 1000), (0, 100), (1, 950)]:
        _checkpoint(job_dir, epoch, step)
    _checkpoint(job_dir, 9, 9999, complete=False)
    (job_dir / ".staging-epoch_9_step_10000-1-abcd").mkdir()
    listed = invoke("list", "--config", str(config))
    assert listed.stdout.split() == [
        str(job_dir / name)
        for name in ("epoch_0_step_100", "epoch_0_step_900", "epoch_1_step_950", "epoch_1_step_1000")
    ]
    latest = invoke("latest", "--config", str(config))
    assert latest.returncode == 0 and latest.stdout.strip() == str(job_dir / "epoch_1_step_1000")


def test_latest_without_checkpoints_fails_clearly(job):
    config, _ = job
    result = invoke("latest", "--config", str(config))
    assert result.returncode == 1 and "no checkpoint in" in result.stderr


def test_clean_previews_without_force_then_keeps_exactly_the_newest(job):
    config, job_dir = job
    folders = [_checkpoint(job_dir, 0, step) for step in (100, 200, 300, 400, 500)]
    partial = _checkpoint(job_dir, 0, 600, complete=False)
    outside = config.parent / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me")
    (job_dir / "epoch_0_step_50").symlink_to(outside, target_is_directory=True)
    before = _snapshot(config.parent)

    preview = invoke("clean", "--config", str(config), "--keep", "3")
    assert preview.returncode == 0, preview.stderr
    assert "would remove  epoch_0_step_100" in preview.stdout and "nothing was deleted" in preview.stdout
    assert _snapshot(config.parent) == before

    forced = invoke("clean", "--config", str(config), "--keep", "3", "--force")
    assert forced.returncode == 0, forced.stderr
    assert [path.exists() for path in folders] == [False, False, True, True, True]
    assert partial.exists(), "incomplete folders are not checkpoints and are left alone"
    assert (outside / "precious.txt").read_text() == "keep me"
    assert (job_dir / "epoch_0_step_50").is_symlink()


def test_clean_keep_defaults_to_checkpoint_keep_last(job):
    config, job_dir = job
    for step in (1, 2, 3, 4):
        _checkpoint(job_dir, 0, step)
    invoke("clean", "--config", str(config), "--force")
    assert sorted(path.name for path in job_dir.iterdir()) == ["epoch_0_step_3", "epoch_0_step_4"]


@pytest.mark.parametrize("keep", ["0", "-1", "two"])
def test_clean_rejects_a_keep_below_one(job, keep):
    config, job_dir = job
    _checkpoint(job_dir, 0, 1)
    result = invoke("clean", "--config", str(config), "--keep", keep, "--force")
    assert result.returncode == 2 and "--keep" in result.stderr
    assert (job_dir / "epoch_0_step_1").exists()


def test_words_after_the_double_dash_reach_the_trainer_as_the_shell_passed_them(job):
    config, _ = job
    odd = '/data/it\'s a$b ${HOME} "q" é'
    words = ["--param_path", "/models/base/a b", "--data_root_path", odd, "--max_lr", "1e-3"]
    result = invoke("render", "--config", str(config), "--", *words)
    assert result.returncode == 0, result.stderr
    command = yaml.safe_load(result.stdout)["services"]["trainer"]["command"]
    assert [word.replace("$$", "$") for word in command] == words


def test_the_shipped_train_yaml_sets_no_host_workaround_and_its_example_renders(tmp_path):
    config = tmp_path / "train.yaml"
    config.write_text((REPO / "train.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    assert yaml.safe_load(config.read_text())["runtime"]["environment"] == {}
    assert "# NCCL_P2P_DISABLE" in config.read_text(), "kept as a commented-out example"
    assert "invoke start -- --max_lr 1e-3" in config.read_text()
    result = invoke("render", "--config", str(config), "--", "--max_lr", "1e-3")
    assert result.returncode == 0, result.stderr
    assert '- "--max_lr"\n    - "1e-3"\n' in result.stdout, result.stdout
    assert "NCCL_P2P_DISABLE" not in result.stdout


def test_a_second_start_of_a_job_refuses_while_the_first_holds_the_lock(job):
    from astrai.host.jobs import JobError, start_lock
    from astrai.host.runtime import resolve_runtime

    config, job_dir = job
    runtime = resolve_runtime(config)
    with start_lock(runtime):
        with pytest.raises(JobError, match=r"another `invoke start` \(or a stop\) of job j is in progress"):
            with start_lock(runtime):
                pass
        result = invoke("start", "--config", str(config))
        assert result.returncode == 1 and "another `invoke start` (or a stop) of job j is in progress" in result.stderr
        assert "Traceback" not in result.stderr
        with start_lock(dataclasses.replace(runtime, node=1)):
            pass  # another node's start is not this one
    with start_lock(runtime):
        pass  # released when the first start ends
    assert (job_dir / ".astrai" / "start.node0.lock").is_file()


def test_the_start_lock_dies_with_its_holder(job):
    config, _ = job
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom astrai.host.jobs import start_lock\nfrom astrai.host.runtime import "
            "resolve_runtime\nwith start_lock(resolve_runtime(sys.argv[1])):\n    print('held', flush=True)\n"
            "    time.sleep(600)\n",
            str(config),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
    finally:
        holder.kill()
        holder.wait()
    from astrai.host.jobs import start_lock
    from astrai.host.runtime import resolve_runtime

    with start_lock(resolve_runtime(config)):
        pass


# --- broken runtime.paths (issue 9, item 3) -----------------------------------------------------------

# Tasks that never read the checkpoints folder, and so cannot find it broken.
READS_NO_CHECKPOINTS = {
    "render": "prints the Compose override",
    "submit": "with --dry-run prints the sbatch script",
    "board": "with --stop reads only the board's own state",
}
# clean without --force too: it reads the folder it would list.
PATH_COMMANDS = [
    *([command[0]] for command in COMMANDS if command[0] == "clean"),
    *(command for command in COMMANDS if command[0] not in READS_NO_CHECKPOINTS),
]
# Without these capabilities root meets permission bits as any user does (tests run as root).
NO_OVERRIDE = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search"]


def _tree(folder: Path) -> list[tuple[str, int, int]]:
    """Every entry under ``folder`` (symlinks not followed) with its mode and mtime: any change shows."""
    entries = []
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            info = os.lstat(os.path.join(root, name))
            entries.append((os.path.relpath(os.path.join(root, name), folder), info.st_mode, info.st_mtime_ns))
    return sorted(entries)


def _break_checkpoints(folder: Path, how: str) -> str:
    """Break ``folder/checkpoints`` in one way; return what the message must say about it."""
    target = folder / "checkpoints"
    if how == "file":
        target.write_text("not a folder")
        return f"runtime.paths.checkpoints: {target} is a file, not a folder"
    if how == "dangling-symlink":
        target.symlink_to(folder / "gone")
        return f"runtime.paths.checkpoints: {target} is a symlink to {folder / 'gone'}, which does not exist"
    (target / "j").mkdir(parents=True)
    target.chmod(0o000)
    return "runtime.paths.checkpoints: permission denied"


@pytest.mark.parametrize("how", ["file", "dangling-symlink", "no-permission"])
@pytest.mark.parametrize("command", PATH_COMMANDS, ids=" ".join)
def test_a_broken_checkpoints_path_names_the_key_without_a_traceback_and_changes_nothing(job, command, how):
    config, _ = job
    prefix = []
    if how == "no-permission" and os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("setpriv (util-linux) is needed to take root's permission override away")
        prefix = NO_OVERRIDE
    expected = _break_checkpoints(config.parent, how)
    before = _tree(config.parent)
    result = invoke(*command, "--config", str(config), cwd=config.parent, prefix=prefix)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert expected in output, output
    assert "Traceback" not in output
    assert _tree(config.parent) == before


@pytest.mark.parametrize("key", ["data", "model"])
def test_init_creates_nothing_when_one_path_is_broken(tmp_path, key):
    config = _cpu_job(tmp_path, paths={key: "./broken/inside"})
    (tmp_path / "broken").write_text("a file where a folder belongs")
    before = _tree(tmp_path)
    result = invoke("init", "--config", str(config))
    assert result.returncode != 0
    assert f"{config}: runtime.paths.{key}: {tmp_path / 'broken'} is a file, not a folder" in result.stderr
    assert "Traceback" not in result.stderr
    assert _tree(tmp_path) == before


def test_preflight_names_a_broken_data_and_model_path(tmp_path):
    config = _cpu_job(tmp_path, paths={"data": "./data", "model": "./params"})
    (tmp_path / "data").write_text("not a folder")
    (tmp_path / "params").symlink_to(tmp_path / "gone")
    before = _tree(tmp_path)
    result = invoke("preflight", "--config", str(config))
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    data = next(line for line in lines if line.startswith("✗ data "))
    assert f"runtime.paths.data: {tmp_path / 'data'} is a file, not a folder" in data
    model = next(line for line in lines if line.startswith("✗ base model"))
    assert f"runtime.paths.model: {tmp_path / 'params'} is a symlink to {tmp_path / 'gone'}, which does not" in model
    assert "Traceback" not in result.stdout + result.stderr
    assert _tree(tmp_path) == before


# --- preflight is read-only (issue 9, item 4) ----------------------------------------------------------


def test_preflight_creates_no_job_dir_and_says_who_will(job):
    config, job_dir = job
    (config.parent / "checkpoints").mkdir()
    before = _tree(config.parent)
    result = invoke("preflight", "--config", str(config))
    assert "Traceback" not in result.stdout + result.stderr
    line = next(line for line in result.stdout.splitlines() if "checkpoint dir" in line)
    assert line.startswith("✓") and f"{job_dir} does not exist yet: `invoke init` or `start` creates it" in line
    assert _tree(config.parent) == before
    assert not job_dir.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="stands in for another user through SUDO_UID, which needs root")
def test_preflight_fails_when_the_container_user_may_not_create_the_job_dir(job):
    config, job_dir = job
    (config.parent / "checkpoints").mkdir(mode=0o755)
    before = _tree(config.parent)
    # Under sudo the container runs as the invoking user: here uid 65534, who may not write a root-owned 755 folder.
    result = invoke("preflight", "--config", str(config), env={"SUDO_UID": "65534", "SUDO_GID": "65534"})
    assert result.returncode == 1
    line = next(line for line in result.stdout.splitlines() if "checkpoint dir" in line)
    assert line.startswith("✗") and "not writable by uid 65534, which the container runs as" in line
    assert f"(where {job_dir} will be created)" in line
    assert _tree(config.parent) == before


# --- checkpoint space (issue 9, item 7) ----------------------------------------------------------------


def _space_line(tmp_path, tiny_model, checkpoints: Path) -> str:
    config = _cpu_job(tmp_path, paths={"model": str(tiny_model), "checkpoints": str(checkpoints)})
    result = invoke("preflight", "--config", str(config))
    assert "Traceback" not in result.stdout + result.stderr
    return next(line for line in result.stdout.splitlines() if "checkpoint space" in line)


def test_preflight_warns_when_the_checkpoint_disk_holds_fewer_than_two_checkpoints(tmp_path, tiny_model, small_disk):
    before = _tree(small_disk)
    line = _space_line(tmp_path, tiny_model, small_disk)
    # The tiny model has 894,080 weights: 4 bytes each, twice more for AdamW's moments, plus 1 MiB of small files.
    assert line.startswith("! checkpoint space")
    assert "a checkpoint takes about 11.2 MiB: room for fewer than two" in line
    assert f"16.0 MiB free in {small_disk}" in line
    assert _tree(small_disk) == before


def test_preflight_counts_the_checkpoints_a_large_disk_holds(tmp_path, tiny_model):
    line = _space_line(tmp_path, tiny_model, tmp_path / "checkpoints")
    assert line.startswith("✓ checkpoint space") and f"free in {tmp_path}, a checkpoint takes about 11.2 MiB" in line


@pytest.mark.skipif(os.geteuid() != 0, reason="stands in for another user through SUDO_UID, which needs root")
def test_preflight_names_a_dangling_symlink_inside_the_data_dir(job):
    config, _ = job
    data = config.parent / "data"
    data.mkdir(mode=0o755)
    (data / "shard-0.bin").symlink_to(config.parent / "gone")
    result = invoke("preflight", "--config", str(config), env={"SUDO_UID": "65534", "SUDO_GID": "65534"})
    assert "Traceback" not in result.stdout + result.stderr
    line = next(line for line in result.stdout.splitlines() if line[2:].startswith("data "))
    assert line.startswith("✗") and f"{data / 'shard-0.bin'} is not readable by uid 65534" in line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["start", "--node", "1e-3"], "--node takes a whole number of at least 0, got '1e-3'"),
        (["status", "--node", "one"], "--node takes a whole number of at least 0, got 'one'"),
        (["board", "--port", "6e3"], "--port takes a whole number from 1 to 65535, got '6e3'"),
        (["board", "--port", "65536"], "--port takes a whole number from 1 to 65535, got '65536'"),
        (["clean", "--keep", "1e-3"], "--keep takes a whole number of at least 1, got '1e-3'"),
    ],
)
def test_a_number_option_that_is_not_a_whole_number_is_named_without_a_traceback(job, args, message):
    config, job_dir = job
    before = _snapshot(job_dir.parent)
    result = invoke(*args, "--config", str(config))
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert _snapshot(job_dir.parent) == before


def test_preflight_and_start_refuse_what_the_trainer_would_before_any_container(job):
    config, job_dir = job
    document = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump({**document, "training": {"max_stepz": 5}}))
    result = invoke("preflight", "--config", str(config))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "✗ trainer config" in result.stdout and "training.max_stepz: unknown key; did you mean 'max_steps'?" in (
        result.stdout
    )
    result = invoke("preflight", "--config", str(config), "--", "--max_steps", "5")
    assert "max_stepz" in result.stdout and "fix the trainer sections of train.yaml" in result.stdout
    config.write_text(yaml.safe_dump(document))
    before = _snapshot(config.parent)
    for task in ("preflight", "start", "restart"):  # restart refuses before it stops anything
        result = invoke(task, "--config", str(config), "--", "--max_lr", "fast")
        assert result.returncode == 2 and "Traceback" not in result.stderr
        output = result.stdout + result.stderr
        assert "training.max_lr (--max_lr): expected a finite number, got 'fast'" in output, output
        assert "fix the arguments after --" in output
    assert _snapshot(config.parent) == before  # nothing created: no job folder, no override, no container
    result = invoke("preflight", "--config", str(config), "--", "--max_lr", "1e-3", "--max_steps", "50")
    assert "✓ trainer config" in result.stdout and "with --max_lr 1e-3 --max_steps 50" in result.stdout
    result = invoke("preflight", "--config", str(config), "--", "--param_path", "/models/base/a b")
    assert "with --param_path '/models/base/a b'" in result.stdout


def test_every_task_answers_dash_h_with_its_help():
    """-h is help for every task: invoke's automatic short flags once gave it to --host and --checkpoint."""
    from invoke import Collection

    import tasks

    names = Collection.from_module(tasks).task_names
    assert {"export", "board", "submit", "start"} <= set(names)
    for name in names:
        result = invoke(name, "-h")
        assert result.returncode == 0 and result.stdout.startswith(f"Usage: inv[oke] [--core-opts] {name}"), name


def _stopped_container(monkeypatch, exit_code: int) -> list[str]:
    """Make the job's container one that `docker stop` ends with ``exit_code``; what stop prints goes in the list."""
    from astrai.host import engine, jobs

    running = engine.Container("c1", "j-trainer-1", "running", 0, "2026-01-01T00:00:00Z", "")
    monkeypatch.setattr(jobs, "job_container", lambda runtime: running)
    monkeypatch.setattr(engine, "stop_container", lambda *args: subprocess.CompletedProcess(args, 0, "", ""))
    monkeypatch.setattr(
        engine, "inspect_container", lambda _: dataclasses.replace(running, status="exited", exit_code=exit_code)
    )
    said: list[str] = []
    monkeypatch.setattr(jobs, "_say", said.append)
    return said


def test_a_trainer_killed_at_the_stop_timeout_after_its_emergency_checkpoint_has_stopped_cleanly(job, monkeypatch):
    # Under load, the exit after the checkpoint can outlast the timeout: Docker's SIGKILL loses nothing then.
    from astrai.host import jobs
    from astrai.host.runtime import resolve_runtime

    config, job_dir = job
    runtime = resolve_runtime(config)
    placeholder_checkpoint(job_dir, 0, 40)
    said = _stopped_container(monkeypatch, 137)
    with pytest.raises(jobs.JobError, match=r"exited with code 137 .*killed: it did not finish.*epoch_0_step_40"):
        jobs._stop_container(runtime)  # the newest checkpoint is a periodic one: the stop's was lost
    placeholder_checkpoint(job_dir, 0, 43, reason="emergency")
    jobs._stop_container(runtime)
    assert "emergency checkpoint" in said[-1] and "(step 43)" in said[-1], said
    assert "killed while exiting after writing it" in said[-1] and "stop_timeout_seconds" in said[-1], said
