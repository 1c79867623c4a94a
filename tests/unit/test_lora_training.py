"""LoRA in the trainer: only the adapters train and are saved, a resume is exact, DPO's reference is the base.

In-process runs on one thread for what one process shows; real ``python -m astrai.train`` subprocesses (DDP and
FSDP under torchrun) for stops, kills and several ranks.
"""

from __future__ import annotations

import json
import math
import random
import time

import pytest
import torch
from hf_folders import save_peft_adapter
from safetensors.torch import load_file
from trainer_runs import (
    TORCHRUN,
    Run,
    final_weights,
    kill_at_moments,
    metrics_step,
    run_to_end,
    stop_gracefully,
)

from astrai.common.checkpoints import examine, folder_bytes, latest_complete_checkpoint, list_complete_checkpoints
from astrai.common.config import build_config
from astrai.common.contract import REASON_EMERGENCY
from astrai.common.fit import SetupError, check_resume
from astrai.common.model_folder import (
    ADAPTER_TARGETS,
    ModelConfig,
    base_digest,
    num_adapter_parameters,
    num_parameters,
)
from astrai.common.settings import LoRASettings
from astrai.common.values import format_bytes
from astrai.host import preflight
from astrai.host.export import ExportError, export_checkpoint, lora_base
from astrai.host.runtime import resolve_runtime
from astrai.host.status import _lora_line
from astrai.trainer.models.lora import (
    AdapterError,
    BaseModel,
    adapter_parameters,
    adapter_state_dict,
    adapters_off,
    parameter_counts,
)
from astrai.trainer.models.weights import PRESETS, write_base_model
from tests.support import write_config

LORA = {"lora_rank": 4, "lora_alpha": 8}


def _adapters(trainer) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in adapter_parameters(trainer.model).items()}


def test_only_the_adapters_train_and_a_checkpoint_holds_only_them(
    tmp_path, job_yaml, make_trainer, tiny_model, one_thread
):
    path = job_yaml(max_steps=4, ckpt_interval=2, **LORA)
    trainer = make_trainer(path)
    try:
        base = {name: value.clone() for name, value in trainer.model.state_dict().items() if ".lora_" not in name}
        trained = {id(param) for group in trainer.optimizer.param_groups for param in group["params"]}
        adapters = adapter_parameters(trainer.model)
        assert trained == {id(param) for param in adapters.values()}
        assert len(adapters) == 2 * len(ADAPTER_TARGETS) * PRESETS["tiny"].n_layers
        # What preflight and status count from config.json alone is what the trainer trains.
        counted = num_adapter_parameters(trainer.model_config, 4, ADAPTER_TARGETS)
        assert parameter_counts(trainer.model) == (counted, num_parameters(trainer.model_config))
        trainer.train()
        after = trainer.model.state_dict()
        assert all(torch.equal(after[name], value) for name, value in base.items()), "a frozen weight moved"
        assert any(after[name].abs().sum() > 0 for name in after if ".lora_B." in name), "B never left zero"
    finally:
        trainer.close()
    checkpoints = list_complete_checkpoints(tmp_path / "ckpt")
    assert [c.step for c in checkpoints] == [2, 4]  # a checkpoint by the one rule: list, latest, retention
    final = checkpoints[-1]
    assert examine(final.path).meta.lora["base"] == {"path": str(tiny_model), "sha256": base_digest(tiny_model)}
    assert examine(final.path).meta.lora["base_dtype"] == "float32"  # auto, on a CPU
    held_otherwise = build_config({"training": {**LORA, "lora_base_dtype": "bfloat16"}}).training
    note = f"lora_base_dtype float32 -> bfloat16 since {final.path.name}: the frozen base is held differently"
    assert check_resume(examine(final.path).meta, final.path, held_otherwise, None) == [note]
    # auto, resumed on a GPU (where it holds the base in bf16): announced too
    auto = build_config({"training": LORA}).training
    assert check_resume(examine(final.path).meta, final.path, auto, None, "bfloat16") == [note]
    assert check_resume(examine(final.path).meta, final.path, auto, None, "float32") == []
    saved = load_file(final.path / "model.safetensors")
    assert set(saved) == {
        f"base_model.model.model.layers.{i}.{part}.lora_{ab}.weight"
        for i in range(PRESETS["tiny"].n_layers)
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
        + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
        for ab in "AB"
    }
    assert _lora_line(final).startswith(
        f"rank 4 on q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj: {counted:,}"
    )
    assert json.loads((final.path / "config.json").read_text()) == json.loads((tiny_model / "config.json").read_text())
    # The adapters and their two moments against the base's weights: a few percent of a full checkpoint.
    assert folder_bytes(final.path) < 0.2 * folder_bytes(tiny_model) * 3


@pytest.mark.parametrize("base_dtype", ["float32", "bfloat16"])
def test_a_resume_takes_the_steps_an_uninterrupted_run_takes(
    tmp_path, train_yaml, make_trainer, run_trainer, one_thread, base_dtype
):
    keys = {"max_steps": 6, "ckpt_interval": 3, "lora_dropout": 0.1, "lora_base_dtype": base_dtype, **LORA}
    whole = train_yaml(tmp_path / "whole.yaml", ckpt_dir=str(tmp_path / "whole"), **keys)
    run_trainer(whole)
    parts = train_yaml(tmp_path / "parts.yaml", ckpt_dir=str(tmp_path / "parts"), **keys)
    run_trainer(parts, steps=3)
    resumed = make_trainer(parts)
    try:
        assert resumed.progress.step == 3
        assert {p.dtype for p in resumed.model.parameters() if p.dim() == 2 and not p.requires_grad} == {
            getattr(torch, base_dtype)
        }
        resumed.train()
    finally:
        resumed.close()
    assert final_weights(tmp_path / "parts", 6) == final_weights(tmp_path / "whole", 6)


def test_a_resume_with_another_base_or_other_adapters_is_refused_naming_both(
    tmp_path, job_yaml, train_yaml, run_trainer, make_trainer, one_thread
):
    path = job_yaml(max_steps=4, ckpt_interval=2, **LORA)
    run_trainer(path, steps=2)
    other = tmp_path / "other-base"
    write_base_model(other, PRESETS["tiny"], seed=1)
    before = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "ckpt").rglob("*"))
    with pytest.raises(SetupError, match=r"holds LoRA adapters of the base model .*another model"):
        make_trainer(path, param_path=other)
    with pytest.raises(SetupError, match=r"rank 4, alpha 8 on .* asks for rank 8, alpha 8"):
        make_trainer(path, lora_rank=8)
    with pytest.raises(SetupError, match=r"holds LoRA adapters \(rank 4\), and this config trains full fine-tuning"):
        make_trainer(path, lora_rank=0)
    assert sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "ckpt").rglob("*")) == before  # nothing changed
    full = train_yaml(tmp_path / "full.yaml", max_steps=4, ckpt_interval=1, ckpt_dir=str(tmp_path / "full"))
    run_trainer(full, steps=1)
    with pytest.raises(SetupError, match=r"holds full fine-tuning weights, and this config trains lora_rank 4"):
        make_trainer(full, **LORA)


def test_a_run_starts_from_a_peft_adapter_folder_and_refuses_one_that_does_not_fit(
    tmp_path, train_yaml, make_trainer, one_thread
):
    def job_yaml(name, **keys):
        return train_yaml(tmp_path / f"{name}.yaml", ckpt_dir=str(tmp_path / name), **keys)

    source = make_trainer(job_yaml("first", **LORA))
    try:
        for param in adapter_parameters(source.model).values():
            with torch.no_grad():
                param.copy_(torch.randn_like(param))
        folder = tmp_path / "adapter folder é"
        save_peft_adapter(folder, source.config.ckpt.param_path, adapter_state_dict(source.model), LoRASettings(4, 8.0))
        expected = _adapters(source)
    finally:
        source.close()
    started = make_trainer(job_yaml("second", adapter_path=str(folder), **LORA))
    try:
        got = _adapters(started)
        assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    finally:
        started.close()
    with pytest.raises(AdapterError, match=r"its adapters are rank 4, alpha 8 on .* this run's are rank 2, alpha 8"):
        make_trainer(job_yaml("third", adapter_path=str(folder), lora_rank=2, lora_alpha=8))
    with pytest.raises(AdapterError, match=r"rank 4, alpha 8 on .* this run's are rank 4, alpha 16"):
        make_trainer(job_yaml("fourth", adapter_path=str(folder), lora_rank=4, lora_alpha=16))


@pytest.mark.parametrize("reference", ["live", "precomputed"])
def test_dpo_uses_the_model_with_its_adapters_off_as_reference_and_starts_at_ln2(
    tmp_path, post_yaml, make_trainer, one_thread, reference
):
    path = post_yaml(
        tmp_path / "dpo.yaml",
        "dpo",
        ckpt_dir=str(tmp_path / "ckpt"),
        max_steps=2,
        log_interval=1,
        batch_per_device=2,
        dpo_reference=reference,
        **LORA,
    )
    trainer = make_trainer(path)
    try:
        held = trainer.objective.reference
        assert isinstance(held, BaseModel if reference == "live" else torch.Tensor)
        trainer.train()
    finally:
        trainer.close()
    first = json.loads((tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()[0])
    assert abs(first["loss"] - math.log(2)) <= 1e-6 and abs(first["rewards_margin"]) <= 1e-7, first
    assert latest_complete_checkpoint(tmp_path / "ckpt").meta.reference["sha256"] == base_digest(
        trainer.config.ckpt.param_path
    )


@pytest.mark.slow
def test_sft_on_two_ddp_ranks_killed_twice_ends_bitwise_as_an_uninterrupted_run(tmp_path, post_yaml, trainer_env):
    keys = {"max_steps": 16, "batch_per_device": 2, "ckpt_interval": 4, "parallel_mode": "ddp", **LORA}
    keys["lora_base_dtype"] = "bfloat16"  # the frozen base in bf16 beside fp32 adapters, through DDP
    command = [*TORCHRUN, "-m", "astrai.train", "--config"]
    whole = post_yaml(tmp_path / "whole.yaml", "sft", ckpt_dir=str(tmp_path / "whole"), **keys)
    run_to_end([*command, str(whole)], trainer_env, tmp_path / "whole.log")
    path = post_yaml(tmp_path / "killed.yaml", "sft", ckpt_dir=str(tmp_path / "killed"), **keys)
    rng = random.Random(27)

    def at_random(run: Run) -> None:
        time.sleep(rng.uniform(0.0, 0.5))

    run, kills = kill_at_moments(
        [*command, str(path)], trainer_env, tmp_path / "killed.log", tmp_path / "killed", [at_random] * 2
    )
    assert kills >= 1, run.output()
    assert final_weights(tmp_path / "killed", 16) == final_weights(tmp_path / "whole", 16)


@pytest.mark.slow
def test_dpo_under_fsdp_with_adapters_starts_at_ln2_stops_and_resumes(tmp_path, post_yaml, trainer_env):
    ckpt_dir = tmp_path / "ckpt"
    path = post_yaml(
        tmp_path / "dpo.yaml",
        "dpo",
        ckpt_dir=str(ckpt_dir),
        max_steps=10,
        batch_per_device=2,
        dpo_reference="live",
        log_interval=1,
        lora_base_dtype="bfloat16",  # FSDP shards a bf16 frozen base beside fp32 adapters
        **LORA,
    )
    command = [*TORCHRUN, "-m", "astrai.train", "--config", str(path), "--parallel_mode", "fsdp"]
    stop_gracefully(Run(command, trainer_env, tmp_path / "run1.log"), lambda: metrics_step(ckpt_dir) >= 3, rank=1)
    first = json.loads((ckpt_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert abs(first["loss"] - math.log(2)) <= 1e-5, first
    stopped = latest_complete_checkpoint(ckpt_dir)
    assert stopped.meta.parallel_mode == "fsdp" and stopped.meta.lora["rank"] == 4
    assert stopped.meta.lora["base_dtype"] == "bfloat16"
    run = run_to_end(command, trainer_env, tmp_path / "run2.log")
    assert f"resumed from {stopped.path}" in run.output()
    final = latest_complete_checkpoint(ckpt_dir)
    assert final.step == 10 and all(".lora_" in name for name in load_file(final.path / "model.safetensors"))


def test_export_writes_a_merged_model_and_a_peft_folder_with_the_trainers_logits(
    tmp_path, job_yaml, make_trainer, tiny_model, one_thread
):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    trainer = make_trainer(job_yaml(max_steps=4, lora_targets="q_proj,v_proj,down_proj", **LORA))
    try:
        generator = torch.Generator().manual_seed(3)
        for param in adapter_parameters(trainer.model).values():
            with torch.no_grad():
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
        tokens = torch.randint(0, PRESETS["tiny"].vocab_size, (2, 24), generator=generator)
        trainer.model.eval()
        with torch.no_grad():
            ours = trainer.model(tokens)
            with adapters_off(trainer.model):
                base_logits = trainer.model(tokens)
        checkpoint = trainer.save_checkpoint(REASON_EMERGENCY)
    finally:
        trainer.close()
    assert (ours - base_logits).abs().max() > 1e-2  # the adapters change what the model says
    with pytest.raises(ExportError, match="holds LoRA adapters of the base model .*: give the base model folder with"):
        export_checkpoint(checkpoint, tmp_path / "nowhere", None, 1 << 30)
    (tmp_path / "moved").mkdir()  # the recorded base moved away: the folder export looks in holds no model
    with pytest.raises(
        ExportError, match=r"looked for at .*moved, which holds no model \(moved\?\): give .* --base DIR"
    ):
        export_checkpoint(checkpoint, tmp_path / "nowhere", None, 1 << 30, base=tmp_path / "moved")
    other = tmp_path / "other-base"
    write_base_model(other, PRESETS["tiny"], seed=1)
    with pytest.raises(ExportError, match=r"is another model \(sha256"):
        export_checkpoint(checkpoint, tmp_path / "nowhere", None, 1 << 30, base=other)
    assert not (tmp_path / "nowhere").exists()

    merged = tmp_path / "merged"
    export_checkpoint(checkpoint, merged, "float32", 1 << 30, base=tiny_model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (hf(tokens).logits - ours).abs().max() <= 1e-4

    folder = tmp_path / "adapter"
    export_checkpoint(checkpoint, folder, None, 1 << 30, adapter=True)
    assert json.loads((folder / "adapter_config.json").read_text())["target_modules"] == [
        "down_proj",
        "q_proj",
        "v_proj",
    ]
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, folder).eval()
    with torch.no_grad():
        assert (loaded(tokens).logits - ours).abs().max() <= 1e-4


def test_the_base_digest_tells_a_base_from_its_merge_and_a_changed_matrix(tmp_path, tiny_model):
    """Two models of one architecture whose embeddings and headers are the same still differ."""
    from astrai.trainer.models.lora import adapter_layers, add_adapters, is_adapter
    from astrai.trainer.models.native import Transformer
    from astrai.trainer.models.weights import load_base_model, save_model_folder

    config, weights = load_base_model(tiny_model)
    model = Transformer(config)
    model.load_state_dict(weights)
    add_adapters(model, LoRASettings(4, 8.0))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.01)
        merged = {name: value for name, value in model.state_dict().items() if not is_adapter(name)}
        for name, layer in adapter_layers(model).items():
            merged[f"{name}.weight"] = layer.weight + layer.scaling * (layer.lora_B.weight @ layer.lora_A.weight)
    save_model_folder(tmp_path / "merged", config, merged)
    assert base_digest(tmp_path / "merged") != base_digest(tiny_model)
    save_model_folder(tmp_path / "same", config, weights)
    assert base_digest(tmp_path / "same") == base_digest(tiny_model)


def test_damaged_lora_facts_and_adapters_only_folders_are_refused_with_a_reason(tmp_path, job_yaml, run_trainer):
    from astrai.common.checkpoints import DamagedCheckpoint, is_complete
    from astrai.common.model_folder import ModelConfig, ModelLoadError, inspect_weights

    run_trainer(job_yaml(max_steps=2, ckpt_interval=2, **LORA))
    folder = latest_complete_checkpoint(tmp_path / "ckpt").path
    with pytest.raises(ModelLoadError, match="is a LoRA checkpoint: its weights are adapters of the base model"):
        inspect_weights(folder, ModelConfig.load(folder))  # what a base model or a DPO reference is read with
    meta = json.loads((folder / "meta.json").read_text())
    for bad in ({"targets": ["bogus"]}, {"rank": True}, {"dropout": "abc"}, {"base": {"path": "/m"}}):
        (folder / "meta.json").write_text(json.dumps({**meta, "lora": {**meta["lora"], **bad}}))
        with pytest.raises(DamagedCheckpoint, match="lora must be an object with rank"):
            examine(folder)
        assert not is_complete(folder)
    (folder / "meta.json").unlink()
    assert lora_base(folder, None) is None  # `invoke export` asks before the export reads (and refuses) it
    with pytest.raises(ExportError, match="is not a complete checkpoint: incomplete: meta.json missing"):
        export_checkpoint(folder, tmp_path / "out", None, 1 << 30)


@pytest.mark.parametrize(("devices", "held", "bytes_each"), [("all", "bfloat16", 2), ("none", "float32", 4)])
def test_preflight_sizes_an_8b_models_training_state_with_the_base_held_as_the_device_gets_it(
    tmp_path, devices, held, bytes_each
):

    llama_8b = ModelConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden_dim=14336, vocab_size=128256, tie_embeddings=False
    )
    cuda_tag = "cu128" if devices == "all" else "cpu"
    runtime_block = {"gpu": {"devices": devices}, "container": {"cuda_tag": cuda_tag}}
    runtime = resolve_runtime(write_config(tmp_path, runtime_block))
    config = build_config({"training": {"lora_rank": 16}})
    check = preflight._training_state_check(runtime, config, (llama_8b,))
    total, adapters = num_parameters(llama_8b), num_adapter_parameters(llama_8b, 16, ADAPTER_TARGETS)
    assert 8.0e9 < total < 8.1e9
    assert f"full fine-tuning {format_bytes(16 * total)}" in check.detail
    assert f"LoRA rank 16 on 7 projections ({adapters:,} trainable" in check.detail
    assert f"{total:,} frozen held in nf4 " in check.detail  # each way of holding it, beside the others
    assert f"{held} {format_bytes(bytes_each * total + 16 * adapters)} (this config)" in check.detail


def test_the_base_dtype_takes_the_short_names_export_takes_and_names_what_it_allows():
    assert build_config({"training": {"lora_base_dtype": "bf16"}}).training.lora_base_dtype == "bfloat16"
    assert build_config({"training": {"lora_base_dtype": "fp32"}}).training.lora_base_dtype == "float32"
    with pytest.raises(Exception, match=r"training.lora_base_dtype: expected auto \| float32 \| bfloat16.*got 'fp16'"):
        build_config({"training": {"lora_base_dtype": "fp16"}})
