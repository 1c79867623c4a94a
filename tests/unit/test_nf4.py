"""QLoRA's 4-bit base (training.lora_base_dtype: nf4): the format's round trip against torchao and its bound, an NF4
layer against its dequantised one, the model held in NF4, and what the config, the plan and the start checks say."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from astrai.common import nf4 as fmt
from astrai.common.config import build_config
from astrai.common.fit import SetupError, check_lora_targets
from astrai.common.memory import frozen_base_bytes, training_state_bytes
from astrai.common.model_folder import ModelConfig, num_adapter_parameters, num_parameters
from astrai.common.reward_specs import parse_rewards
from astrai.common.settings import LoRASettings
from astrai.common.values import format_bytes
from astrai.trainer.models import lora
from astrai.trainer.models.native import Transformer
from astrai.trainer.models.nf4 import dequantize, is_nf4, nf4_linear, torchao_nf4
from astrai.trainer.models.weights import PRESETS

NF4Tensor = torchao_nf4().NF4Tensor
to_nf4 = torchao_nf4().to_nf4
SETTINGS = LoRASettings(rank=4, alpha=8.0)


def _matrix(shape, seed: int, heavy: bool = False) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    weights = torch.randn(shape, generator=generator) * 0.02
    if heavy:  # a few outliers, as trained weights have: they set their blocks' absmax
        weights[::37, ::11] *= 40
    return weights


@pytest.mark.parametrize(("shape", "heavy"), [((128, 128), False), ((384, 256), True), ((256, 896), False)])
def test_the_round_trip_stays_within_the_formats_bound_and_numpy_gives_torchaos_values(shape, heavy):
    weights = _matrix(shape, seed=shape[0], heavy=heavy)
    held = to_nf4(weights)
    assert (held.block_size, held.scaler_block_size) == (fmt.BLOCK, fmt.SCALER_BLOCK)
    assert held.nf4.tolist() == list(np.float32(fmt.CODEBOOK))  # the codebook is torchao's, value for value
    ours = dequantize(held, torch.float32)
    assert torch.equal(ours, held.get_original_weight())  # our reading of its fields is torchao's, bit for bit
    # The bound: half the widest codebook step of each block's absmax, plus what the absmax loses to its int8 (half a
    # step of its scaler block: twice the block's largest distance from the mean absmax, over 256).
    blocks = weights.reshape(-1, fmt.BLOCK)
    absmax = blocks.abs().amax(dim=1)
    centred = (absmax - absmax.mean()).reshape(-1, fmt.SCALER_BLOCK)
    int8_step = (2 * centred.abs().amax(dim=1) / 256).repeat_interleave(fmt.SCALER_BLOCK)
    bound = fmt.LARGEST_GAP / 2 * absmax + int8_step / 2
    error = (ours.reshape(-1, fmt.BLOCK) - blocks).abs().amax(dim=1)
    assert bool((error <= bound * (1 + 1e-6)).all()), (error / bound).max()
    assert 0.2 < float((error / bound).max()) <= 1.0  # the bound is the format's, not a loose one
    numpy_side = fmt.round_trip(weights.numpy())  # invoke export's, torch-free
    assert np.abs(numpy_side - ours.numpy()).max() <= 1e-6 * float(weights.abs().max())


def test_an_nf4_layer_computes_forward_and_backward_as_its_dequantised_layer():
    base = torch.nn.Linear(128, 384, bias=True)
    with torch.no_grad():
        base.weight.copy_(_matrix((384, 128), seed=1))
        base.bias.normal_()
    quantized, plain = (lora.LoRALinear(base, SETTINGS, torch.Generator().manual_seed(0)) for _ in range(2))
    quantized.weight = torch.nn.Parameter(to_nf4(base.weight.detach()), requires_grad=False)
    quantized.nf4 = True
    plain.weight = torch.nn.Parameter(dequantize(quantized.weight, torch.float32), requires_grad=False)
    for layer in (quantized, plain):
        with torch.no_grad():
            layer.lora_B.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(2))
    grads = []
    for layer in (quantized, plain):
        x = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(3), requires_grad=True)
        out = layer(x)
        (out * torch.linspace(-1, 1, 384)).sum().backward()
        grads.append((out.detach(), x.grad, layer.lora_A.weight.grad, layer.lora_B.weight.grad))
    for ours, theirs in zip(*grads, strict=True):
        assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    assert quantized.weight.grad is None and is_nf4(quantized.weight)
    # Under autocast the product is in its dtype, from weights dequantised straight into it.
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = nf4_linear(x, quantized.weight)
        expected = torch.nn.functional.linear(x, dequantize(quantized.weight, torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)


def _held_model(config: ModelConfig) -> Transformer:
    model = Transformer(config)
    model.init_weights(torch.Generator().manual_seed(0))
    lora.add_adapters(model, SETTINGS, torch.Generator().manual_seed(0))
    return model


def test_a_model_holds_its_blocks_in_nf4_its_embeddings_in_bf16_and_computes_as_those_weights():
    config = PRESETS["tiny"]
    model = _held_model(config)
    expected = Transformer(config)
    expected.load_state_dict(model.state_dict(), strict=False)
    assert lora.hold_base_in_nf4(model, torch.device("cpu")) == 7 * config.n_layers
    assert lora.frozen_dtype(model) == "nf4"
    held = {name for name, param in model.named_parameters() if is_nf4(param)}
    assert held == set(fmt.held_matrices(config))
    assert model.tok_embeddings.weight.dtype == torch.bfloat16 and model.norm.weight.dtype == torch.float32
    with torch.no_grad():  # the weights it computes with: the blocks' dequantised, the embeddings rounded to bf16
        for name, param in expected.named_parameters():
            source = model.get_parameter(name)
            param.copy_(dequantize(source, torch.float32) if is_nf4(source) else source.float())
    tokens = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.allclose(model(tokens), expected(tokens), rtol=1e-5, atol=1e-5)
    # What it holds is what the memory model counts.
    nbytes = sum(_held_bytes(param) for name, param in model.named_parameters() if ".lora_" not in name)
    assert nbytes == pytest.approx(frozen_base_bytes(config, "nf4"), rel=0.01)


def _held_bytes(param) -> int:
    if not is_nf4(param):
        return param.numel() * param.element_size()
    inner = (param.quantized_data, param.quantized_scalers, param.quantization_factor, param.scaler_mean)
    return sum(tensor.numel() * tensor.element_size() for tensor in inner)


def test_nf4_is_a_base_dtype_the_plan_describes_and_the_memory_model_counts():
    training = build_config({"training": {"lora_rank": 16, "lora_base_dtype": "nf4"}}).training
    assert training.lora_base_dtype == "nf4"
    with pytest.raises(Exception, match=r"lora_base_dtype: expected auto \| float32 \| bfloat16 \| nf4 .*got 'int4'"):
        build_config({"training": {"lora_base_dtype": "int4"}})
    llama_70b = ModelConfig(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden_dim=28672, vocab_size=128256, tie_embeddings=False
    )
    total = num_parameters(llama_70b)
    quantized = sum(rows * cols for rows, cols in fmt.held_matrices(llama_70b).values())
    assert quantized / total > 0.96  # the blocks' matrices are nearly all of it
    nf4, bf16 = frozen_base_bytes(llama_70b, "nf4"), frozen_base_bytes(llama_70b, "bfloat16")
    assert nf4 == round(quantized * fmt.BYTES_PER_PARAMETER) + 2 * (total - quantized)
    assert 0.26 < nf4 / bf16 <= 0.30  # the target on base bytes held, NF4 over bf16
    adapters = num_adapter_parameters(llama_70b, 16, training.lora_targets)
    assert training_state_bytes(llama_70b, adapters, "nf4") == nf4 + 16 * adapters


def test_the_start_checks_refuse_what_nf4_cannot_hold_naming_the_key_and_what_would_do():
    training = build_config({"training": {"lora_rank": 4, "lora_base_dtype": "nf4"}}).training
    tiny = PRESETS["tiny"]
    check_lora_targets(tiny, training)  # every block matrix of tiny is whole scaler blocks
    with pytest.raises(SetupError, match=r"under FSDP on 2 ranks: layers.0.attention.wq.weight \[128, 128\] does not"):
        check_lora_targets(tiny, training, shards=2)
    odd = dataclasses.replace(tiny, dim=96, n_heads=3, n_kv_heads=3)
    with pytest.raises(
        SetupError, match=r"layers.0.attention.wq.weight \[96, 96\] holds 9,216 numbers, not a multiple"
    ):
        check_lora_targets(odd, training)
    moe = dataclasses.replace(tiny, family="mixtral", n_experts=4, experts_per_token=2, expert_hidden_dim=64)
    with pytest.raises(SetupError, match="a mixture of experts' experts are stacked 3-D tensors"):
        check_lora_targets(moe, training)
    wide = dataclasses.replace(tiny, dim=256, n_heads=4, n_kv_heads=2, ffn_hidden_dim=512)
    check_lora_targets(wide, training, shards=2)
    assert fmt.nf4_problem(wide, 4).endswith("FSDP world sizes that do: 1, 2; or use ddp, or bfloat16")


def _preflight_state(tmp_path, monkeypatch, gpus, training: dict, model_config: ModelConfig, **keys):
    from astrai.host import preflight
    from astrai.host.runtime import resolve_runtime
    from tests.support import write_config

    monkeypatch.setattr(preflight, "_gpus", lambda: gpus)
    monkeypatch.setattr(preflight, "_visible_gpus", lambda: len(gpus))
    runtime_block = {"gpu": {"devices": "all", "parallel_mode": "fsdp"}, "container": {"cuda_tag": "cu128"}}
    runtime = resolve_runtime(write_config(tmp_path, runtime_block))
    config = build_config({"training": training, **keys})
    return preflight._training_state_check(runtime, config, (model_config,))


LLAMA_70B = ModelConfig(
    dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_hidden_dim=28672, vocab_size=128256, tie_embeddings=False
)
H100 = ("NVIDIA H100 80GB HBM3", 81559 << 20, (9, 0))


def test_preflight_says_a_70b_llama_fits_two_80gb_gpus_with_an_nf4_base_and_not_with_bf16(tmp_path, monkeypatch):
    training = {"lora_rank": 16, "lora_base_dtype": "nf4", "batch_per_device": 1}
    keys = {"data": {"window_size": 4096}, "model": {"activation_checkpointing": True}}
    check = _preflight_state(tmp_path, monkeypatch, [H100, H100], training, LLAMA_70B, **keys)
    assert check.mark == "✓", check.detail
    adapters = num_adapter_parameters(LLAMA_70B, 16, build_config({"training": training}).training.lora_targets)
    nf4 = (frozen_base_bytes(LLAMA_70B, "nf4") + 16 * adapters) / 2
    assert "per rank (2 under FSDP)" in check.detail
    assert f"nf4 {format_bytes(nf4)} (this config)" in check.detail  # 21.4 GB a rank, beside bf16's and fp32's
    assert "bfloat16 67.3 GiB, float32 133.0 GiB;" in check.detail
    assert "4,096 tokens, with activation checkpointing" in check.detail
    assert check.detail.endswith("of each GPU's 79.6 GiB (90% usable): fits"), check.detail
    # The same with a bf16 base: the state alone nearly fills the GPU; with the activations it may not fit.
    check = _preflight_state(
        tmp_path, monkeypatch, [H100, H100], {**training, "lora_base_dtype": "bf16"}, LLAMA_70B, **keys
    )
    assert check.mark == "!" and "may not fit; try training.lora_base_dtype nf4" in check.detail, check.detail


def test_preflight_refuses_an_nf4_base_on_a_gpu_without_bfloat16(tmp_path, monkeypatch):
    v100 = ("Tesla V100-SXM2-32GB", 32510 << 20, (7, 0))
    training = {"lora_rank": 16, "lora_base_dtype": "nf4"}
    check = _preflight_state(tmp_path, monkeypatch, [v100, v100], training, PRESETS["tiny"])
    assert check.mark == "✗" and "Tesla V100-SXM2-32GB (compute capability 7.0) has no bfloat16" in check.detail
    check = _preflight_state(
        tmp_path, monkeypatch, [v100, v100], {**training, "lora_base_dtype": "float32"}, PRESETS["tiny"]
    )
    assert check.mark == "✓", check.detail


@pytest.mark.parametrize(
    ("quantization", "said"),
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "(bitsandbytes, nf4)"),
        ({"quant_method": "torchao", "quant_type": {"default": {"_type": "Int4WeightOnlyConfig"}}}, "(torchao)"),
    ],
)
def test_a_folder_of_quantised_weights_is_refused_naming_the_remedy(
    tmp_path, tiny_model, corpus_data, quantization, said, capsys
):
    """Refused, not read (docs/lora.md says so): the trainer, --dry-run and preflight read config.json the same way."""
    import json
    import shutil

    from astrai.common.backends import BACKEND_TRANSFORMERS, load_model_config
    from astrai.common.model_folder import ModelLoadError
    from astrai.trainer.run.loop import main
    from tests.support import write_config

    folder = tmp_path / "quantised"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
    remedy = "give the folder of the model it was quantised from, and set training.lora_base_dtype: nf4"
    for backend in ("native", BACKEND_TRANSFORMERS):
        with pytest.raises(ModelLoadError, match="config.json: quantization_config: its weights are stored quantised"):
            load_model_config(folder, backend)
    sections = {"ckpt": {"param_path": str(folder), "ckpt_dir": str(tmp_path / "c")}}
    path = write_config(tmp_path, {}, trainer={**sections, "data": {"data_root_path": str(corpus_data)}})
    code = main(["--config", str(path), "--lora_rank", "4", "--lora_base_dtype", "nf4", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code != 0 and f"stored quantised {said}" in err and remedy in err and "Traceback" not in err, err
    assert not (tmp_path / "c").exists()


def test_the_image_installs_torchao_only_for_a_job_with_an_nf4_base_at_the_version_setup_cfg_pins(tmp_path, tiny_model):
    import configparser

    from astrai.host import compose
    from astrai.host.runtime import resolve_runtime
    from tests.support import write_config

    for name in ("d", "c"):
        (tmp_path / name).mkdir()
    paths = {"data": "d", "model": str(tiny_model), "checkpoints": "c"}
    runtime = resolve_runtime(write_config(tmp_path, {"job_name": "q", "gpu": {"devices": "none"}, "paths": paths}))

    def packages(*args: str) -> str:
        return compose.render_override(runtime, list(args), uid=1000, gid=1000)["services"]["trainer"]["build"]["args"][
            "MODEL_PACKAGES"
        ]

    assert packages("--lora_rank", "4", "--lora_base_dtype", "nf4") == fmt.TORCHAO_PACKAGE == "torchao==0.18.0"
    assert packages("--lora_rank", "4", "--lora_base_dtype", "bf16") == ""
    assert packages("--lora_base_dtype", "nf4") == ""  # no LoRA: the key does nothing, nothing is installed
    setup = configparser.ConfigParser()
    setup.read(compose.PROJECT_ROOT / "setup.cfg")
    extras = setup["options.extras_require"]
    for extra in ("nf4", "dev"):
        assert fmt.TORCHAO_PACKAGE in extras[extra].split(), extra


def test_the_plan_says_how_an_nf4_base_is_held_and_counts_no_copy_for_generation(tiny_model):
    from astrai.common.configfile import ConfigError
    from astrai.common.plan import resolve_plan

    sections = {"training": {"lora_rank": 4, "lora_base_dtype": "nf4"}, "ckpt": {"param_path": str(tiny_model)}}
    plan = resolve_plan(build_config(sections), "cuda", 1)
    line = next(line for line in plan.lines() if line.startswith("lora:"))
    assert line.endswith(
        "held in nf4 (the blocks' linear layers in torchao's NF4: blocks of 64, double-quantised scales, each "
        "dequantised to bfloat16 one layer at a time; the embeddings and head bfloat16), adapters float32"
    )
    rewards = parse_rewards(["astrai.rewards:exact_answer"])
    online = {**sections["training"], "train_type": "online_grpo", "rewards": rewards}
    generating = resolve_plan(build_config({**sections, "training": online}), "cuda", 1)
    bf16 = resolve_plan(build_config({**sections, "training": {**online, "lora_base_dtype": "float32"}}), "cuda", 1)
    tiny = PRESETS["tiny"]
    adapters = num_adapter_parameters(tiny, 4, generating.lora.targets)
    assert generating.state_bytes(tiny) == training_state_bytes(tiny, adapters, "nf4")  # decoded as held
    assert bf16.state_bytes(tiny) == training_state_bytes(tiny, adapters, "float32") + 2 * num_parameters(tiny)
    with pytest.raises(ConfigError, match="lora_base_dtype: nf4 is not supported with model.backend transformers"):
        resolve_plan(build_config({**sections, "model": {"backend": "transformers"}}), "cpu", 1)


@pytest.mark.slow
def test_compiled_the_nf4_product_is_the_eager_one():
    """On CUDA the blocks are compiled (model.compile auto): the dequantisation's one fused kernel gives the values the
    eager chunks give, and the product its gradient."""
    weight = to_nf4(_matrix((384, 256), seed=9))
    compiled = torch.compile(lambda: dequantize(weight, torch.float32))()
    assert torch.equal(compiled, dequantize(weight, torch.float32))
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(10), requires_grad=True)
    out = torch.compile(lambda x: nf4_linear(x, weight))(x)
    out.sum().backward()
    eager = torch.randn(4, 256, generator=torch.Generator().manual_seed(10), requires_grad=True)
    expected = nf4_linear(eager, weight)
    expected.sum().backward()
    assert torch.allclose(out, expected, atol=1e-5) and torch.allclose(x.grad, eager.grad, atol=1e-5)
