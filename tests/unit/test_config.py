"""Trainer config: contract keys, YAML and command-line precedence, errors that name the key, dry run."""

from __future__ import annotations

import pytest

from astrai.common.config import KEY_SECTION, TrainerConfig, load_trainer_config, parse_args
from astrai.common.configfile import ConfigError
from astrai.trainer.run.loop import main
from tests.support import placeholder_checkpoint, run_python


def _yaml(tmp_path, text: str):
    path = tmp_path / "train.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_contract_keys_exist_in_their_sections():
    contract = {
        "data_root_path": "data",
        "window_size": "data",
        "num_workers": "data",
        "max_steps": "training",
        "batch_per_device": "training",
        "grad_accum_steps": "training",
        "max_lr": "training",
        "warmup_ratio": "training",
        "weight_decay": "training",
        "max_grad_norm": "training",
        "random_seed": "training",
        "ckpt_interval": "ckpt",
        "ckpt_dir": "ckpt",
        "param_path": "ckpt",
        "keep_last": "ckpt",
        "parallel_mode": "parallel",
        "log_interval": "log",
        "activation_checkpointing": "model",
        "compile": "model",
    }
    assert {key: KEY_SECTION[key] for key in contract} == contract
    defaults = TrainerConfig()
    assert defaults.data.data_root_path == "/data"
    assert defaults.data.window_size == 256
    assert defaults.parallel.parallel_mode == "none"
    assert defaults.ckpt.ckpt_dir == "/checkpoints/astrai-train"
    assert defaults.ckpt.param_path == "/models/base"
    assert defaults.ckpt.keep_last is None
    assert defaults.model.activation_checkpointing is False and defaults.model.compile == "auto"


def test_command_line_beats_yaml_and_runtime_is_ignored(tmp_path):
    path = _yaml(
        tmp_path,
        """
runtime:
  job_name: x
  anything: [goes, here]
training:
  max_steps: 50
  max_lr: 3e-4
ckpt:
  keep_last: 3
""",
    )
    config, dry_run = parse_args(["--config", str(path), "--max_steps", "70", "--keep_last=null", "--compile", "true"])
    assert not dry_run
    assert config.training.max_steps == 70
    # PyYAML reads 3e-4 as a string; it is still a number here.
    assert config.training.max_lr == pytest.approx(3e-4)
    assert config.ckpt.keep_last is None
    assert config.model.compile is True


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("training:\n  max_step: 5\n", "training.max_step: unknown key; did you mean 'max_steps'?"),
        ("training:\n  ckpt_interval: 5\n", "training.ckpt_interval: unknown key; it belongs in section 'ckpt'"),
        ("trainig:\n  max_steps: 5\n", "trainig: unknown section; did you mean 'training'?"),
        ("training:\n  max_steps: -3\n", "training.max_steps: expected an integer >= 1, got -3"),
        ("training:\n  max_steps: ten\n", "training.max_steps: expected an integer, got 'ten'"),
        ("parallel:\n  parallel_mode: dp\n", "parallel.parallel_mode: expected none | ddp | fsdp, got 'dp'"),
        ("model:\n  compile: maybe\n", "model.compile: expected auto, true or false, got 'maybe'"),
        ("training: [1, 2]\n", "training: expected a mapping of keys"),
        ("training:\n  max_steps: 5\n\twindow_size: 1\n", "train.yaml:3:1: YAML syntax error"),
    ],
)
def test_bad_yaml_names_the_key_and_what_is_allowed(tmp_path, text, message):
    with pytest.raises(ConfigError) as error:
        load_trainer_config(_yaml(tmp_path, text))
    assert message in str(error.value)


def test_unknown_command_line_option_gets_a_hint(tmp_path):
    path = _yaml(tmp_path, "")
    with pytest.raises(ConfigError, match="--max_step: unknown option; did you mean 'max_steps'"):
        parse_args(["--config", str(path), "--max_step", "5"])
    with pytest.raises(ConfigError, match=r"training.max_lr \(--max_lr\): expected a finite number, got 'fast'"):
        parse_args(["--config", str(path), "--max_lr", "fast"])


def test_bad_config_exits_2_with_one_line_on_stderr(tmp_path, capsys):
    path = _yaml(tmp_path, "log:\n  log_intervall: 5\n")
    assert main(["--config", str(path)]) == 2
    captured = capsys.readouterr()
    assert (
        captured.err.count("\n") == 1 and "log.log_intervall: unknown key; did you mean 'log_interval'?" in captured.err
    )
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "file not found (pass --config FILE)" in capsys.readouterr().err


def test_every_problem_of_the_trainer_sections_is_reported_at_once(tmp_path, capsys):
    path = _yaml(tmp_path, "training:\n  max_lr: abc\n  max_stepz: 5\nmodel:\n  compile: maybe\nlogs: {}\n")
    assert main(["--config", str(path)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 4 and all(line.startswith(f"error: {path}: ") for line in lines), lines
    assert ["training.max_lr", "training.max_stepz", "model.compile", "logs: unknown section"] == [
        next(
            part
            for part in ("training.max_lr", "training.max_stepz", "model.compile", "logs: unknown section")
            if part in line
        )
        for line in lines
    ]
    # The file reads well: the command line's problems, all of them; then each section's own check.
    good = _yaml(tmp_path, "training:\n  max_steps: 10\n")
    assert main(["--config", str(good), "--window_size", "y", "--max_lr", "fast"]) == 2
    err = capsys.readouterr().err
    assert "(--window_size): expected an integer" in err and "(--max_lr): expected a finite number" in err
    assert err.count("\n") == 2
    assert main(["--config", str(good), "--log_interval", "0", "--max_steps", "0"]) == 2
    err = capsys.readouterr().err
    assert "training.max_steps" in err and "log.log_interval" in err and err.count("\n") == 2


def test_parallel_mode_must_fit_the_process_count(tmp_path, monkeypatch, capsys):
    path = _yaml(tmp_path, "")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["--config", str(path), "--dry-run"]) == 2
    assert "none needs exactly 1 process, but 2 were requested (WORLD_SIZE is 2)" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert main(["--config", str(path), "--dry-run", "--parallel_mode", "fsdp"]) == 2
    assert "fsdp needs 2 or more processes" in capsys.readouterr().err


def test_dry_run_shows_the_derived_grad_accum_steps_or_why_the_batch_does_not_split(tmp_path, monkeypatch, capsys):
    path = _yaml(tmp_path, "training:\n  device: cpu\n  batch_per_device: 4\n  global_batch_size: 32\n")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["--config", str(path), "--dry-run", "--parallel_mode", "ddp"]) == 0
    out = capsys.readouterr().out
    assert "grad_accum_steps(4) (derived from global_batch_size) * world_size(2) = 32 sequences per step" in out
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main(["--config", str(path), "--dry-run", "--parallel_mode", "ddp"]) == 2
    assert "training.global_batch_size: 32 is not a whole multiple" in capsys.readouterr().err


def test_dry_run_prints_the_plan_and_changes_nothing(tmp_path, capsys):
    path = _yaml(tmp_path, "runtime:\n  job_name: x\ntraining:\n  max_steps: 10\n  device: cpu\n")
    ckpt_dir = tmp_path / "ckpt"
    assert main(["--config", str(path), "--dry-run", "--ckpt_dir", str(ckpt_dir), "--param_path", "/models/p"]) == 0
    out = capsys.readouterr().out
    assert "max_steps: 10" in out and "runtime" not in out
    assert "world size: 1" in out and "device: cpu" in out
    assert "checkpoints: full format (rank 0 gathers the state and writes it)" in out
    assert "global batch: batch_per_device(8) * grad_accum_steps(1) * world_size(1) = 8 sequences per step" in out
    assert "start from base model /models/p" in out
    assert not ckpt_dir.exists()

    placeholder_checkpoint(ckpt_dir, 0, 10)
    assert main(["--config", str(path), "--dry-run", "--ckpt_dir", str(ckpt_dir)]) == 0
    assert "already at max_steps (10)" in capsys.readouterr().out
    assert main(["--config", str(path), "--dry-run", "--ckpt_dir", str(ckpt_dir), "--max_steps", "20"]) == 0
    assert f"resume from {ckpt_dir / 'epoch_0_step_10'}" in capsys.readouterr().out


@pytest.mark.slow
def test_command_line_error_has_no_traceback(tmp_path, trainer_env):
    path = _yaml(tmp_path, "data:\n  window_size: 0\n")
    result = run_python("-m", "astrai.train", "--config", str(path), env=trainer_env, timeout=120)
    assert result.returncode == 2
    assert result.stderr == "error: data.window_size: expected an integer >= 1, got 0\n"


def test_global_batch_size_derives_grad_accum_steps_or_names_the_world_sizes_that_fit():
    from astrai.common.config import TrainingSection, resolve_grad_accum_steps

    training = TrainingSection(batch_per_device=2, grad_accum_steps=5, global_batch_size=24)
    assert [resolve_grad_accum_steps(training, size) for size in (1, 2, 3, 4, 6, 12)] == [12, 6, 4, 3, 2, 1]
    with pytest.raises(ConfigError) as caught:
        resolve_grad_accum_steps(training, 5)
    assert str(caught.value) == (
        "training.global_batch_size: 24 is not a whole multiple of batch_per_device(2) * world_size(5) = 10; "
        "world sizes that divide it with batch_per_device 2: 1, 2, 3, 4, 6, 12"
    )
    assert resolve_grad_accum_steps(TrainingSection(grad_accum_steps=5), 3) == 5
    with pytest.raises(ConfigError, match="no world size does: make it a multiple of batch_per_device"):
        resolve_grad_accum_steps(TrainingSection(batch_per_device=4, global_batch_size=6), 1)
    with pytest.raises(ConfigError, match="training.global_batch_size: expected an integer >= 1"):
        TrainingSection(global_batch_size=0)
