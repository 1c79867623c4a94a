"""The run plan: one resolution of a run's decisions, which `--dry-run` prints and preflight asks the same questions of
as the trainer in the container (LoRA and its base dtype, the checkpoint format, completions per prompt)."""

from __future__ import annotations

import dataclasses

import pytest

from astrai.common.config import parse_args
from astrai.common.contract import trainer_arguments
from astrai.common.plan import resolve_plan
from astrai.host import preflight
from astrai.host.runtime import resolve_runtime
from astrai.host.trainer_config import read_trainer_config
from astrai.trainer.run.loop import dry_run
from tests.support import write_config

CASES = {
    "full, one process": (1, "auto", {}, {}),
    "ddp": (2, "ddp", {}, {}),
    "fsdp: sharded by default": (2, "fsdp", {}, {}),
    "fsdp, full asked for": (2, "fsdp", {}, {"format": "full"}),
    "lora on one process": (1, "auto", {"lora_rank": 8, "lora_alpha": 16}, {}),
    "lora under fsdp": (2, "fsdp", {"lora_rank": 4, "lora_base_dtype": "bf16"}, {}),
    "online_grpo": (1, "auto", {"train_type": "online_grpo", "num_generations": 6, "rewards": ["m:f"]}, {}),
    "online_dpo: two generations": (2, "ddp", {"train_type": "online_dpo", "rewards": ["m:f"]}, {}),
    "grpo: the data's groups": (1, "auto", {"train_type": "grpo", "grpo_loss": "grpo", "grpo_beta": 0.1}, {}),
    "online_rloo": (2, "ddp", {"train_type": "online_rloo", "rewards": ["m:f"], "normalize_advantages": True}, {}),
    "global batch": (2, "ddp", {"batch_per_device": 2, "global_batch_size": 8}, {}),
}


@pytest.mark.parametrize("case", CASES)
def test_preflight_and_the_trainer_resolve_the_same_plan(tmp_path, monkeypatch, capsys, case):
    processes, mode, training, ckpt = CASES[case]
    runtime_block = {
        "job_name": "plan",
        "gpu": {"devices": "none", "processes": processes, "parallel_mode": mode},
        "container": {"cuda_tag": "cpu"},
    }
    path = write_config(tmp_path, runtime_block, {"training": training, "ckpt": ckpt})
    runtime = resolve_runtime(path)
    host = preflight.container_plan(runtime, read_trainer_config(runtime, []))

    # The trainer in the container: the entrypoint's arguments, the world size torchrun gives it, a CPU.
    config, _ = parse_args(trainer_arguments("plan", runtime.parallel_mode, [], str(path)))
    trainer = resolve_plan(config, "cpu", processes, config.parallel.parallel_mode)
    assert host == trainer
    assert (host.lora is None) == (not training.get("lora_rank"))
    if case == "online_dpo: two generations":
        assert host.generations == 2
    if case == "lora under fsdp":
        assert (host.ckpt_format, host.base_dtype) == ("lora", "bfloat16")
    if case == "fsdp: sharded by default":
        assert host.ckpt_format == "sharded"
    if case == "online_rloo":
        assert host.settings.normalize_advantages and host.generations == 8

    # --dry-run prints that plan, line for line.
    monkeypatch.setenv("WORLD_SIZE", str(processes))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert dry_run(dataclasses.replace(config, training=dataclasses.replace(config.training, device="cpu"))) == 0
    printed = capsys.readouterr().out.splitlines()
    assert all(line in printed for line in host.lines()), (host.lines(), printed)


def test_the_plan_resolves_lora_base_dtype_and_autocast_by_device(tmp_path):
    path = write_config(tmp_path, {"job_name": "p"}, {"training": {"lora_rank": 2}})
    config, _ = parse_args(["--config", str(path)])
    cpu, cuda = resolve_plan(config, "cpu", 1), resolve_plan(config, "cuda", 1)
    assert (cpu.base_dtype, cpu.autocast) == ("float32", None)
    assert (cuda.base_dtype, cuda.autocast) == ("bfloat16", "bfloat16")
    assert cpu.ckpt_format == cuda.ckpt_format == "lora"
