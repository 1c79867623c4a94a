"""Trust at the edges: what a clean, a stray argument or a hostile file may never do to a run (issue 16).

Each test drives the commands the way a user types them and checks what they would notice: which
checkpoints survive, what is refused and in which words, that nothing was changed on disk.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import yaml
from test_tasks import _cpu_job, _snapshot, invoke

from astrai.common.configfile import ConfigError, load_yaml
from astrai.common.metrics import MetricsFile
from astrai.host.board import check_can_serve
from astrai.host.runtime import resolve_runtime
from tests.support import REPO, free_port, placeholder_checkpoint

# --- Never lose a run ------------------------------------------------------------------------------------


@pytest.fixture
def eleven_and_a_fake(tmp_path):
    """Eleven checkpoints and, newest by its name, a folder holding the required names with unreadable content."""
    config = _cpu_job(tmp_path, container={"checkpoint_keep_last": 3})
    job_dir = tmp_path / "checkpoints" / "j"
    good = [placeholder_checkpoint(job_dir, 0, step * 10) for step in range(1, 12)]
    fake = placeholder_checkpoint(job_dir, 9, 999)
    for name in os.listdir(fake):
        (fake / name).write_bytes(b"\x00garbage")
    return config, good, fake


def test_a_folder_that_is_not_a_checkpoint_never_becomes_the_newest(eleven_and_a_fake):
    config, good, fake = eleven_and_a_fake
    latest = invoke("latest", "--config", str(config))
    assert latest.stdout.strip() == str(good[-1])
    listed = invoke("list", "--config", str(config))
    assert listed.stdout.split() == [str(path) for path in good]
    assert f"not a checkpoint: {fake} (meta.json: not valid JSON" in listed.stderr
    preflight = invoke("preflight", "--config", str(config))
    assert f"not needed: the job resumes from {good[-1]}" in preflight.stdout
    space = next(line for line in preflight.stdout.splitlines() if "checkpoint space" in line)
    assert "takes about 48 B" not in space


def test_clean_keep_1_keeps_the_newest_loadable_checkpoint_and_never_counts_a_fake(eleven_and_a_fake):
    config, good, fake = eleven_and_a_fake
    preview = invoke("clean", "--config", str(config), "--keep", "1")
    assert f"not a checkpoint: {fake.name} (meta.json: not valid JSON" in preview.stdout
    assert "kept (--damaged removes it)" in preview.stdout
    forced = invoke("clean", "--config", str(config), "--keep", "1", "--force")
    assert forced.returncode == 0, forced.stderr
    assert [path.exists() for path in good] == [False] * 10 + [True]
    assert fake.is_dir(), "a folder that is not a checkpoint goes only when asked"
    removed = invoke("clean", "--config", str(config), "--keep", "1", "--force", "--damaged")
    assert removed.returncode == 0 and not fake.exists() and good[-1].is_dir()
    assert "deleted 0 checkpoint(s), 1 folder(s) that were not checkpoints" in removed.stdout


@pytest.mark.parametrize(
    ("words", "key"),
    [
        (["--ckpt_dir", "/tmp/x"], "runtime.paths.checkpoints"),
        (["--ckpt_dir", "/checkpoints/other-job"], "runtime.paths.checkpoints"),
        (["--ckpt_dir=/checkpoints/j/../elsewhere"], "runtime.paths.checkpoints"),
        (["--data_root_path", "/elsewhere/data"], "runtime.paths.data"),
        (["--data_root_path", "data"], "runtime.paths.data"),
        (["--param_path", "/models/basement"], "runtime.paths.model"),
    ],
)
@pytest.mark.parametrize("task", ["preflight", "render", "start", "restart"])
def test_a_trainer_path_outside_the_mounts_is_refused_naming_the_runtime_key(tmp_path, words, key, task):
    config = _cpu_job(tmp_path)
    before = _snapshot(tmp_path)
    result = invoke(task, "--config", str(config), "--", *words)
    assert result.returncode == 2, result  # a rejected config: 2 from every command
    output = result.stdout + result.stderr
    assert f"to use another folder, point {key} at it" in output or f"change {key}" in output, output
    assert "Traceback" not in output
    assert _snapshot(tmp_path) == before


def test_a_trainer_path_in_the_yaml_outside_the_mounts_is_refused_too(tmp_path):
    config = _cpu_job(tmp_path)
    document = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump({**document, "ckpt": {"ckpt_dir": "/tmp/elsewhere"}}))
    result = invoke("render", "--config", str(config))
    assert result.returncode == 2
    assert f"{config}: ckpt.ckpt_dir: /tmp/elsewhere is not the job dir /checkpoints/j" in result.stderr


def test_paths_inside_the_mounts_pass_and_the_trainer_on_a_host_takes_any_path(tmp_path, train_yaml):
    config = _cpu_job(tmp_path)
    inside = ["--ckpt_dir", "/checkpoints/j/", "--data_root_path", "/data/web", "--param_path", "/models/base/a"]
    result = invoke("render", "--config", str(config), "--", *inside)
    assert result.returncode == 0, result.stderr
    path = train_yaml(tmp_path / "host.yaml", ckpt_dir=str(tmp_path / "anywhere"))
    dry = subprocess.run(
        [sys.executable, "-m", "astrai.train", "--config", str(path), "--ckpt_dir", "/tmp/x", "--dry-run"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert dry.returncode == 0 and "ckpt_dir: /tmp/x" in dry.stdout


@pytest.mark.parametrize(
    ("paths", "relation"),
    [
        ({"data": "./same", "checkpoints": "./same"}, "runtime.paths.data"),
        ({"model": "./params", "checkpoints": "./params/ckpt"}, "the checkpoints folder is inside the model folder"),
        ({"data": "./ckpt/data", "checkpoints": "./ckpt"}, "the data folder is inside the checkpoints folder"),
    ],
)
def test_a_checkpoints_folder_overlapping_the_read_only_mounts_is_refused(tmp_path, paths, relation):
    config = _cpu_job(tmp_path, paths=paths)
    result = invoke("init", "--config", str(config))
    assert result.returncode == 2 and "runtime.paths.checkpoints:" in result.stderr and relation in result.stderr
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "same").exists()


# --- Tracebacks instead of messages --------------------------------------------------------------------------


@pytest.mark.parametrize("tool", ["data", "model"])
@pytest.mark.parametrize(
    ("out", "message"),
    [("/etc/hostname", "is a file, not a folder"), ("", "the path is empty"), ("/proc/x/y", "cannot write")],
)
def test_the_data_and_model_tools_refuse_a_bad_output_folder_with_a_message(tmp_path, tool, out, message):
    if tool == "data":
        command = [
            "-m",
            "astrai.data",
            "prepare",
            "--out",
            out,
            str(REPO / "examples" / "corpus" / "01_training_jobs.txt"),
        ]
    else:
        command = ["-m", "astrai.model", "init", out, "--preset", "tiny"]
    result = subprocess.run([sys.executable, *command], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode != 0 and message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_numbers_are_refused_in_model_and_trainer_settings(tmp_path, train_yaml, value):
    init = subprocess.run(
        [
            sys.executable,
            "-m",
            "astrai.model",
            "init",
            str(tmp_path / "m"),
            "--preset",
            "tiny",
            f"--rope_theta={value}",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert init.returncode == 2 and "rope_theta: expected a positive finite number" in init.stderr
    assert not (tmp_path / "m").exists()
    path = train_yaml(tmp_path / "train.yaml")
    train = subprocess.run(
        [sys.executable, "-m", "astrai.train", "--config", str(path), f"--max_lr={value}", "--dry-run"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert train.returncode == 2 and "training.max_lr (--max_lr): expected a finite number" in train.stderr


def test_a_checkpoints_path_too_long_for_the_system_is_refused_before_anything_is_written(tmp_path):
    deep = "/".join(["d" * 200] * 20)  # 4 KiB: at Linux's PATH_MAX once the job's own files are added
    config = _cpu_job(tmp_path, paths={"checkpoints": f"./{deep}"})
    for task in ("preflight", "init", "start"):
        result = invoke(task, "--config", str(config))
        output = result.stdout + result.stderr
        assert result.returncode != 0 and "runtime.paths.checkpoints" in output and "Traceback" not in output
        assert "choose a shorter path" in output
    assert os.listdir(tmp_path) == ["train.yaml"]


def test_status_into_a_closed_pipe_ends_quietly(tmp_path):
    config = _cpu_job(tmp_path)
    result = subprocess.run(
        f"{sys.executable} -m invoke --search-root {REPO} status --config {config} | head -1",
        shell=True,
        capture_output=True,
        text=True,
    )
    assert result.stdout.startswith("job ") and "BrokenPipeError" not in result.stderr, result.stderr


def test_board_on_every_interface_warns_that_it_has_no_authentication(tmp_path):
    runtime = resolve_runtime(_cpu_job(tmp_path))
    assert not any("warning" in note for note in check_can_serve(runtime, False, "127.0.0.1", free_port()))
    notes = check_can_serve(runtime, False, "0.0.0.0", free_port())
    assert any(note.startswith("warning: TensorBoard has no authentication") for note in notes)


# --- Preflight passes only what the trainer accepts ------------------------------------------------------------


def _line(result, name: str) -> str:
    return next(line for line in result.stdout.splitlines() if line[2:].startswith(f"{name} "))


def test_preflight_opens_the_data_the_way_the_trainer_does(tmp_path, tiny_model, corpus_data):
    import shutil

    config = _cpu_job(tmp_path, paths={"data": "./data", "model": str(tiny_model)})
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "notes.txt").write_text("not prepared")
    result = invoke("preflight", "--config", str(config))
    line = _line(result, "data")
    assert line.startswith("✗") and "has no manifest.json" in line
    assert f"runtime.paths.data: data folder {tmp_path / 'data'} has" in line
    shutil.rmtree(tmp_path / "data")
    shutil.copytree(corpus_data, tmp_path / "data")
    result = invoke("preflight", "--config", str(config), "--", "--data_root_path", "/data/missing")
    assert "runtime.paths.data (/data/missing)" in _line(result, "data")
    result = invoke("preflight", "--config", str(config), "--", "--batch_per_device", "100000")
    fits = _line(result, "data fits model")
    assert fits.startswith("✗") and "fewer than one global batch of batch_per_device(100000)" in fits
    result = invoke("preflight", "--config", str(config), "--", "--window_size", "4096")
    said = "data.window_size 4096 exceeds the model's context of 1024 tokens (its max_position_embeddings 1024"
    assert said in _line(result, "data fits model")
    result = invoke("preflight", "--config", str(config))
    assert _line(result, "data fits model").startswith("✓")
    small = subprocess.run(
        [
            sys.executable,
            "-m",
            "astrai.model",
            "init",
            str(tmp_path / "small"),
            "--preset",
            "tiny",
            "--vocab_size",
            "200",
        ],
        capture_output=True,
        cwd=REPO,
    )
    assert small.returncode == 0
    config = _cpu_job(tmp_path, paths={"data": "./data", "model": "./small"})
    fits = _line(invoke("preflight", "--config", str(config)), "data fits model")
    assert fits.startswith("✗") and "data vocabulary 257" in fits and "does not fit the model's vocab_size 200" in fits


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--parallel_mode", "ddp"], "--parallel_mode ddp: ddp needs 2 or more processes, but 1 was requested"),
        (["--device", "cuda"], "--device cuda, but runtime.gpu.devices is none: the container has no GPU"),
    ],
)
def test_preflight_and_start_refuse_what_the_container_s_trainer_would(tmp_path, args, expected):
    config = _cpu_job(tmp_path)
    before = _snapshot(tmp_path)
    result = invoke("preflight", "--config", str(config), "--", *args)
    line = _line(result, "trainer config")
    assert line.startswith("✗") and expected in line
    assert result.returncode == 2  # a rejected config exits 2 from preflight, as from start
    result = invoke("start", "--config", str(config), "--", *args)
    assert result.returncode == 2 and expected in result.stderr and "Traceback" not in result.stderr
    assert _snapshot(tmp_path) == before


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a read-only file system needs root")
def test_a_read_only_checkpoint_disk_is_named_as_such_not_as_permissions(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        config = _cpu_job(tmp_path, paths={"checkpoints": str(folder)})
        line = _line(invoke("preflight", "--config", str(config)), "checkpoint dir")
        assert line.startswith("✗") and "is on a read-only file system" in line and "chown" not in line
    finally:
        subprocess.run(["umount", str(folder)], check=True)


# --- Hostile files and long runs --------------------------------------------------------------------------------


def _alias_bomb(path: Path, levels: int) -> Path:
    lines = ["runtime:", "  job_name: x", 'l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * 9)}]" for n in range(1, levels)]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_an_alias_bomb_is_refused_at_once_naming_file_and_line(tmp_path):
    path = _alias_bomb(tmp_path / "train.yaml", levels=9)
    started = time.monotonic()
    with pytest.raises(ConfigError, match=r"train.yaml:\d+: its anchors and aliases expand \d+ written values to"):
        load_yaml(path)
    for command in (["-m", "invoke", "--search-root", str(REPO), "preflight"], ["-m", "astrai.train", "--dry-run"]):
        result = subprocess.run(
            [sys.executable, *command, "--config", str(path)], capture_output=True, text=True, cwd=REPO, timeout=60
        )
        assert result.returncode == 2 and "its anchors and aliases expand" in result.stderr, result.stderr
        assert "Traceback" not in result.stderr and "MemoryError" not in result.stderr
    assert time.monotonic() - started < 30


def test_plain_anchors_and_a_self_reference(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text("runtime: &r\n  job_name: x\nextra: {copy: *r}\n")
    assert load_yaml(path)["extra"]["copy"] == {"job_name": "x"}
    path.write_text("runtime: &r\n  job_name: x\n  paths: {data: *r}\n")
    with pytest.raises(ConfigError, match="train.yaml:1: an alias refers to the value that contains it"):
        load_yaml(path)


def test_a_long_bad_value_is_shown_short(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({"runtime": {"job_name": ["x" * 1000] * 1000}}))
    with pytest.raises(ConfigError) as raised:
        resolve_runtime(path)
    assert len(str(raised.value)) < 400


def _metrics(path: Path, steps: range, loss=lambda step: 5.0 / step) -> None:
    with open(path, "a", encoding="utf-8") as handle:
        for step in steps:
            record = {"step": step, "max_steps": 10**7, "loss": loss(step), "lr": 1e-3, "time": 1.0}
            handle.write(json.dumps(record) + "\n")


def test_metrics_are_read_from_the_end_and_sampled_in_bounded_memory(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _metrics(path, range(1, 200_001))
    _metrics(path, range(150_001, 160_001), loss=lambda step: 9.0)  # a resumed run replays steps a crash lost
    tracemalloc.start()
    metrics = MetricsFile(path)
    latest, sample = metrics.latest(), metrics.sample(100)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 << 20, peak  # the file is 20 MB
    assert latest["step"] == 160_000 and latest["loss"] == 9.0
    steps = [record["step"] for record in sample]
    assert steps == sorted(steps) and steps[-1] == 160_000 and len(sample) > 50
    assert all(record["loss"] == 9.0 for record in sample if record["step"] > 150_000)


def test_the_newest_record_survives_a_half_written_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _metrics(path, range(1, 4))
    with open(path, "a") as handle:
        handle.write('{"step": 4, "lo')
    assert MetricsFile(path).latest()["step"] == 3
    assert MetricsFile(tmp_path / "missing.jsonl").latest() is None
    assert [record["step"] for record in MetricsFile(path).records()] == [1, 2, 3]


def test_a_missing_data_folder_in_a_one_process_run_is_named_as_such(tmp_path, train_yaml, make_trainer):
    from astrai.common.data_folder import DataError

    path = train_yaml(tmp_path / "t.yaml", data_root_path=str(tmp_path / "nowhere"), ckpt_dir=str(tmp_path / "c"))
    with pytest.raises(DataError) as caught:
        make_trainer(path)
    assert str(tmp_path / "nowhere") in str(caught.value) and "every node" not in str(caught.value)
