"""QLoRA in the trainer (training.lora_base_dtype: nf4): every LoRA path with a 4-bit base — seq, sft, dpo with the
base as reference, online_grpo and online_dpo sampling from the NF4 base plus adapters, PEFT folders in and out, the
merged export, exact resume on one process, and FSDP on two (bitwise, and resumed on one).

The one-process runs use the tiny preset, whose every block matrix is whole NF4 scaler blocks; FSDP on two ranks
needs them whole per shard, so its runs use a model twice as wide.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hf_folders import save_peft_adapter
from safetensors.torch import load_file
from trainer_runs import TORCHRUN, TRAINER, Run, final_weights, metrics_step, run_to_end, stop_gracefully

from astrai.common.checkpoints import latest_complete_checkpoint
from astrai.common.contract import REASON_EMERGENCY
from astrai.common.model_folder import ModelConfig
from astrai.common.settings import LoRASettings
from astrai.data.pipeline import prepare
from astrai.host.export import export_checkpoint
from astrai.trainer.generation.decoding import _base_matrices
from astrai.trainer.models.lora import adapter_parameters, frozen_dtype
from astrai.trainer.models.nf4 import dequantize, is_nf4
from astrai.trainer.models.weights import PRESETS, write_base_model

NF4 = {"lora_rank": 4, "lora_alpha": 8, "lora_base_dtype": "nf4"}
REWARD = '''
def length(prompts, completions, **fields):
    """Longer completions score higher: every group has a signal."""
    return [len(completion) / 10 for completion in completions]
'''


def test_seq_trains_the_adapters_alone_over_an_nf4_base_and_resumes_bitwise(
    tmp_path, train_yaml, make_trainer, run_trainer, one_thread
):
    keys = {"max_steps": 6, "ckpt_interval": 3, "lora_dropout": 0.1, **NF4}
    whole = train_yaml(tmp_path / "whole.yaml", ckpt_dir=str(tmp_path / "whole"), **keys)
    run_trainer(whole)
    parts = train_yaml(tmp_path / "parts.yaml", ckpt_dir=str(tmp_path / "parts"), **keys)
    run_trainer(parts, steps=3)
    resumed = make_trainer(parts)
    try:
        assert resumed.progress.step == 3 and frozen_dtype(resumed.model) == "nf4"
        base = {name: param for name, param in resumed.model.named_parameters() if is_nf4(param)}
        assert len(base) == 7 * PRESETS["tiny"].n_layers
        trained = {id(param) for group in resumed.optimizer.param_groups for param in group["params"]}
        assert trained == {id(param) for param in adapter_parameters(resumed.model).values()}
        resumed.train()
    finally:
        resumed.close()
    assert final_weights(tmp_path / "parts", 6) == final_weights(tmp_path / "whole", 6)
    final = latest_complete_checkpoint(tmp_path / "parts")
    assert final.meta.lora["base_dtype"] == "nf4"
    assert all(".lora_" in name for name in load_file(final.path / "model.safetensors"))


def test_sft_and_dpo_with_the_nf4_base_as_reference_start_where_they_should(
    tmp_path, post_yaml, run_trainer, make_trainer, one_thread
):
    sft = post_yaml(tmp_path / "sft.yaml", "sft", ckpt_dir=str(tmp_path / "sft"), max_steps=2, log_interval=1, **NF4)
    run_trainer(sft)
    assert latest_complete_checkpoint(tmp_path / "sft").meta.lora["base_dtype"] == "nf4"
    path = post_yaml(
        tmp_path / "dpo.yaml", "dpo", ckpt_dir=str(tmp_path / "dpo"), max_steps=2, log_interval=1, batch_per_device=2
    )
    trainer = make_trainer(path, **NF4)
    try:
        assert frozen_dtype(trainer.model) == "nf4"
        trainer.train()
    finally:
        trainer.close()
    first = json.loads((tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines()[0])
    # The reference is the same NF4 model with its adapters off: B starts at zero, so the first loss is ln 2.
    assert abs(first["loss"] - math.log(2)) <= 1e-6, first


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    root = tmp_path_factory.mktemp("nf4 prompts")
    records = root / "prompts.jsonl"
    records.write_text("".join(json.dumps({"prompt": f"say {n}:"}) + "\n" for n in range(8)), encoding="utf-8")
    prepare(root / "data", [records], kind="prompts")
    (root / "rewards.py").write_text(REWARD, encoding="utf-8")
    return root


@pytest.mark.parametrize("train_type", ["online_grpo", "online_dpo"])
def test_online_types_sample_from_the_nf4_base_and_its_adapters_without_a_copy(
    tmp_path, train_yaml, make_trainer, prompts, one_thread, train_type
):
    keys = {"train_type": train_type, "data_root_path": str(prompts / "data"), "num_generations": 2}
    keys |= {"rewards": [f"{prompts / 'rewards.py'}:length"], "max_completion_length": 4, "batch_per_device": 2}
    trainer = make_trainer(train_yaml(tmp_path / "t.yaml", ckpt_dir=str(tmp_path / "ckpt"), max_steps=2, **keys, **NF4))
    try:
        trainer.train()
        engine = trainer.objective.source.engine
        # The engine decodes from the model itself: no NF4 weight is a matrix it would copy, even under autocast.
        assert not [name for name, param in _base_matrices(engine.inner) if param.dim() == 2 and ".layers." in name]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert engine._decoding_model() is engine.inner
    finally:
        trainer.close()
    records = [json.loads(line) for line in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert records and all(any("reward" in key for key in record) for record in records)


def test_peft_folders_go_in_and_out_and_the_merged_export_is_the_nf4_model_it_trained(
    tmp_path, job_yaml, make_trainer, tiny_model, one_thread
):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    generator = torch.Generator().manual_seed(7)
    given = {}
    for name, param in _adapter_shapes(make_trainer, job_yaml).items():
        given[name] = 0.05 * torch.randn(param, generator=generator)
    save_peft_adapter(tmp_path / "given", tiny_model, given, LoRASettings(4, 8.0))
    trainer = make_trainer(job_yaml(max_steps=2, adapter_path=str(tmp_path / "given"), **NF4))
    try:
        started = {name: param.detach().clone() for name, param in adapter_parameters(trainer.model).items()}
        assert all(torch.equal(started[name], value) for name, value in given.items())  # the folder's adapters
        tokens = torch.randint(0, PRESETS["tiny"].vocab_size, (2, 24), generator=generator)
        trainer.model.eval()
        with torch.no_grad():
            ours = trainer.model(tokens)
        checkpoint = trainer.save_checkpoint(REASON_EMERGENCY)
    finally:
        trainer.close()
    merged = tmp_path / "merged"
    export_checkpoint(checkpoint, merged, "float32", 1 << 30, base=tiny_model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (hf(tokens).logits - ours).abs().max() <= 1e-4  # NF4 dequantised once, the adapters folded in
    adapter = tmp_path / "adapter"
    export_checkpoint(checkpoint, adapter, None, 1 << 30, adapter=True)
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, adapter).eval()
    saved = load_file(adapter / "adapter_model.safetensors")
    assert set(saved) == set(load_file(checkpoint / "model.safetensors"))
    with torch.no_grad(), loaded.disable_adapter():
        unadapted = loaded(tokens).logits
    with torch.no_grad():  # PEFT puts the trained adapters on the unquantised base (what they add, not the NF4 error)
        assert (loaded(tokens).logits - unadapted).abs().max() > 1e-3


def _adapter_shapes(make_trainer, job_yaml) -> dict[str, tuple[int, ...]]:
    trainer = make_trainer(job_yaml(max_steps=1, **NF4))
    try:
        return {name: tuple(param.shape) for name, param in adapter_parameters(trainer.model).items()}
    finally:
        trainer.close()


WIDE = ModelConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=512)
"""Every block matrix splits into two shards of whole NF4 scaler blocks (16,384 numbers)."""


@pytest.mark.slow
def test_fsdp_on_two_ranks_shards_the_nf4_base_stops_and_resumes_bitwise_and_on_one_process(
    tmp_path, train_yaml, trainer_env
):
    write_base_model(tmp_path / "wide", WIDE, seed=0)
    keys = {"param_path": str(tmp_path / "wide"), "max_steps": 8, "ckpt_interval": 2, "batch_per_device": 2}
    keys |= {"log_interval": 1, **NF4}
    command = [*TORCHRUN, "-m", "astrai.train", "--parallel_mode", "fsdp", "--config"]
    whole = train_yaml(tmp_path / "whole.yaml", ckpt_dir=str(tmp_path / "whole"), **keys)
    run = run_to_end([*command, str(whole)], trainer_env, tmp_path / "whole.log")
    assert "the frozen base held in nf4" in run.output()
    parts = train_yaml(tmp_path / "parts.yaml", ckpt_dir=str(tmp_path / "parts"), **keys)
    stop_gracefully(
        Run([*command, str(parts)], trainer_env, tmp_path / "p1.log"),
        lambda: metrics_step(tmp_path / "parts") >= 3,
        rank=1,
    )
    stopped = latest_complete_checkpoint(tmp_path / "parts")
    assert stopped.meta.parallel_mode == "fsdp" and stopped.meta.lora["base_dtype"] == "nf4" and stopped.step < 8
    run = run_to_end([*command, str(parts)], trainer_env, tmp_path / "p2.log")
    assert f"resumed from {stopped.path}" in run.output()
    assert final_weights(tmp_path / "parts", 8) == final_weights(tmp_path / "whole", 8)
    # Across world sizes: the two ranks' checkpoint goes on in one process (the base quantised again from the folder).
    single = train_yaml(tmp_path / "single.yaml", ckpt_dir=str(tmp_path / "parts"), **{**keys, "max_steps": 10})
    run = run_to_end([*TRAINER, "--config", str(single)], trainer_env, tmp_path / "single.log")
    assert "resumed from" in run.output() and latest_complete_checkpoint(tmp_path / "parts").step == 10


@pytest.mark.slow
def test_ddp_on_two_ranks_trains_over_an_nf4_base_no_rank_broadcasts(tmp_path, train_yaml, trainer_env):
    """DDP broadcasts the model's tensors at start; the NF4 weights are left out (each rank quantised the same base)."""
    path = train_yaml(tmp_path / "ddp.yaml", ckpt_dir=str(tmp_path / "ddp"), max_steps=3, ckpt_interval=3, **NF4)
    command = [*TORCHRUN, "-m", "astrai.train", "--parallel_mode", "ddp", "--config", str(path)]
    run = run_to_end(command, trainer_env, tmp_path / "ddp.log")
    assert "the frozen base held in nf4" in run.output()
    final = latest_complete_checkpoint(tmp_path / "ddp")
    assert final.step == 3 and final.meta.parallel_mode == "ddp" and final.meta.lora["base_dtype"] == "nf4"


def test_the_nf4_base_dequantises_to_what_the_export_folds_adapters_into(tiny_model):
    """invoke export's NumPy round trip gives the weights the trainer computes with (to float32 rounding)."""
    from astrai.common.nf4 import round_trip
    from astrai.trainer.models.lora import add_adapters, hold_base_in_nf4
    from astrai.trainer.models.native import Transformer
    from astrai.trainer.models.weights import load_base_model

    config, weights = load_base_model(tiny_model)
    model = Transformer(config)
    model.load_state_dict(weights)
    add_adapters(model, LoRASettings(4, 8.0))
    hold_base_in_nf4(model, torch.device("cpu"))
    for name, param in model.named_parameters():
        if is_nf4(param):
            exported = torch.from_numpy(round_trip(weights[name].numpy()))
            assert torch.allclose(dequantize(param, torch.float32), exported, rtol=0, atol=1e-7), name
