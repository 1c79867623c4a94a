"""The GPU's settings, tested where no GPU is: model.compile's auto per device, training.deterministic set before
CUDA starts (in the entrypoint and in a bare trainer), a compile failure named, and a CPU run that a periodic save or
deterministic mode leaves bitwise unchanged."""

from __future__ import annotations

import os

import pytest
import torch
from trainer_runs import final_weights

from astrai.common.config import load_trainer_config, parse_args
from astrai.common.contract import DETERMINISTIC_CUBLAS_WORKSPACE, ENV_CUBLAS_WORKSPACE_CONFIG
from astrai.common.errors import AstraiError
from astrai.common.plan import resolve_plan
from astrai.trainer.launch import entrypoint
from astrai.trainer.launch.distributed import init_distributed
from astrai.trainer.run import loop
from astrai.trainer.run.loop import CompileError, open_trainer


@pytest.fixture
def restore_determinism(monkeypatch):
    monkeypatch.delenv(ENV_CUBLAS_WORKSPACE_CONFIG, raising=False)
    yield
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = False
    torch.backends.cuda.enable_cudnn_sdp(True)


@pytest.mark.parametrize(
    ("compile", "device", "compiled"),
    [("auto", "cuda", True), ("auto", "cpu", False), ("true", "cpu", True), ("false", "cuda", False)],
)
def test_model_compile_auto_compiles_on_cuda_only(tmp_path, job_yaml, compile, device, compiled):
    config = load_trainer_config(job_yaml(), [("compile", compile)])
    assert resolve_plan(config, device, 1).compile is compiled


def test_the_entrypoint_gives_a_deterministic_trainer_cublas_workspace(tmp_path, job_yaml, monkeypatch):
    monkeypatch.delenv(ENV_CUBLAS_WORKSPACE_CONFIG, raising=False)
    env = {"TRAIN_JOB_NAME": "job", "ASTRAI_CONFIG": str(job_yaml()), "ASTRAI_GPU_DEVICES": "none"}
    plan = entrypoint.plan_launch(env, ["--deterministic", "true"], lambda: 0)
    assert plan.environment == {ENV_CUBLAS_WORKSPACE_CONFIG: DETERMINISTIC_CUBLAS_WORKSPACE}
    assert entrypoint.plan_launch(env, [], lambda: 0).environment == {}
    # A config the trainer will refuse: the trainer says why, the entrypoint adds nothing.
    assert entrypoint.plan_launch(env, ["--max_steps", "zero"], lambda: 0).environment == {}


def test_a_bare_trainer_is_deterministic_before_cuda_starts(job_yaml, monkeypatch, restore_determinism):
    seen = {}

    def init_distributed_spy(mode, device):  # where CUDA would start
        seen["deterministic"] = torch.are_deterministic_algorithms_enabled()
        seen["cublas"] = os.environ.get(ENV_CUBLAS_WORKSPACE_CONFIG)
        seen["cudnn"] = (torch.backends.cudnn.deterministic, torch.backends.cuda.cudnn_sdp_enabled())
        raise AstraiError("stopped here by the test")

    monkeypatch.setattr(loop, "init_distributed", init_distributed_spy)
    assert loop.main(["--config", str(job_yaml()), "--deterministic", "true"]) == 1
    assert seen == {"deterministic": True, "cublas": DETERMINISTIC_CUBLAS_WORKSPACE, "cudnn": (True, False)}


def test_a_compile_failure_stops_the_run_naming_model_compile(job_yaml, monkeypatch, one_thread):
    class Unsupported(Exception):
        """Shaped as one of torch.compile's own errors."""

    Unsupported.__module__ = "torch._dynamo.exc"
    config, _ = parse_args(["--config", str(job_yaml()), "--compile", "true"])
    trainer = open_trainer(config, init_distributed("none", "cpu"))
    try:

        def fails():
            raise RuntimeError("while compiling") from Unsupported("a graph break it cannot take")

        monkeypatch.setattr(trainer, "train_step", fails)
        with pytest.raises(CompileError, match=r"model.compile: compiling the model failed .* model.compile: false"):
            trainer.train(steps=1)
    finally:
        trainer.close()


@pytest.mark.slow
def test_periodic_saves_and_deterministic_mode_leave_a_cpu_run_bitwise_unchanged(
    tmp_path, train_yaml, run_trainer, one_thread, restore_determinism
):
    runs = {"plain": {"ckpt_interval": 8}, "saved": {"ckpt_interval": 2}, "deterministic": {"deterministic": True}}
    for name, keys in runs.items():
        run_trainer(train_yaml(tmp_path / f"{name}.yaml", ckpt_dir=str(tmp_path / name), max_steps=8, **keys))
    weights = {name: final_weights(tmp_path / name, 8) for name in runs}
    assert weights["saved"] == weights["plain"] == weights["deterministic"]


def test_deterministic_mode_after_cuda_started_without_cublas_setting_refuses_and_changes_nothing(
    monkeypatch, restore_determinism
):
    from astrai.trainer.launch import determinism

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(determinism.TooLate, match="CUDA started in this process before deterministic mode"):
        determinism.make_deterministic()
    assert not torch.are_deterministic_algorithms_enabled() and ENV_CUBLAS_WORKSPACE_CONFIG not in os.environ
    # With cuBLAS's setting there before CUDA started, the rest can still be switched on.
    monkeypatch.setenv(ENV_CUBLAS_WORKSPACE_CONFIG, DETERMINISTIC_CUBLAS_WORKSPACE)
    determinism.make_deterministic()
    assert torch.are_deterministic_algorithms_enabled()
