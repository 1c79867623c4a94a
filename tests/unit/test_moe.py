"""Mixtures of experts (Qwen3-MoE, Mixtral) computed natively as transformers computes them: folders read in either
layout of the experts, logits and gradients equal to transformers', the router's load-balancing loss equal to
transformers' own function, checkpoints that transformers loads, the experts' grouped products equal to a loop, and
the arithmetic preflight and MFU do with the experts (the real models' config.json values)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from chat_data import sft_records
from conftest import CORPUS_FILES
from hf_folders import MOE_CASES, hf_logits, make_hf_model
from real_chat_templates import make_family_folder
from safetensors.torch import load_file, save_file
from trainer_runs import Run, final_weights

from astrai.common.checkpoints import CheckpointMeta, latest_complete_checkpoint, list_complete_checkpoints
from astrai.common.contract import METRIC_EXPERT_LOAD, METRIC_ROUTER_AUX_LOSS, METRICS_FILE, TORCHRUN_MODULE
from astrai.common.fit import SetupError
from astrai.common.model_config import ModelConfig
from astrai.common.model_folder import (
    ModelLoadError,
    WeightsSummary,
    describe,
    hf_name,
    inspect_weights,
    num_active_parameters,
    num_parameters,
)
from astrai.common.settings import LoRASettings
from astrai.data.pipeline import prepare
from astrai.data.tokenizing import HFTokenizer
from astrai.host.export import export_checkpoint
from astrai.trainer.models import experts, lora
from astrai.trainer.models.weights import load_base_model, load_pretrained, save_model_folder
from astrai.trainer.run.report import matmul_params

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

QWEN3_30B_A3B = {
    # Qwen/Qwen3-30B-A3B's config.json (the keys that shape the model)
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-06,
    "router_aux_loss_coef": 0.001,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
MIXTRAL_8X7B = {
    # mistralai/Mixtral-8x7B-v0.1's config.json
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1e6,
    "rms_norm_eps": 1e-05,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@pytest.fixture(scope="module", params=sorted(MOE_CASES))
def moe_folder(request, tmp_path_factory):
    name = request.param
    return name, make_hf_model(tmp_path_factory.mktemp(name) / "base", **MOE_CASES[name])


def _tokens(seed: int = 0, length: int = 48) -> torch.Tensor:
    return torch.randint(0, 300, (3, length), generator=torch.Generator().manual_seed(seed))


def test_logits_equal_transformers(moe_folder):
    name, folder = moe_folder
    tokens = _tokens()
    with torch.no_grad():
        ours = load_pretrained(folder)(tokens)
    diff = (ours - hf_logits(folder, tokens)).abs().max().item()
    assert diff <= 1e-5, f"{name}: max logit difference {diff}"


def test_saved_folder_is_what_save_pretrained_writes_and_loads_in_transformers(moe_folder, tmp_path):
    _, folder = moe_folder
    config, state = load_base_model(folder)
    save_model_folder(tmp_path, config, state)
    assert set(load_file(tmp_path / "model.safetensors")) == set(load_file(folder / "model.safetensors"))
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and info["mismatched_keys"] == set()
    tokens = _tokens(1)
    with torch.no_grad():
        assert (hf.eval()(tokens).logits - load_pretrained(folder)(tokens)).abs().max().item() <= 1e-5


def test_stacked_experts_of_transformers_5_read_the_same(moe_folder, tmp_path):
    """The 5.x layout (``mlp.experts.gate_up_proj``, ``down_proj``) holds the same model: the sharded checkpoints
    write it, and transformers loads it as well."""
    _, folder = moe_folder
    config, state = load_base_model(folder)
    save_file({hf_name(n, config): t.contiguous() for n, t in state.items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(config.to_json())
    again = load_base_model(tmp_path)[1]
    assert all(torch.equal(again[name], state[name]) for name in state)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()


def test_an_expert_stored_twice_or_missing_is_refused(moe_folder, tmp_path):
    name, folder = moe_folder
    config, state = load_base_model(folder)
    tensors = load_file(folder / "model.safetensors")
    (tmp_path / "config.json").write_text(config.to_json())
    expert = next(key for key in tensors if ".experts.1." in key)
    save_file({k: v for k, v in tensors.items() if k != expert}, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="missing"):
        inspect_weights(tmp_path, config)
    stacked = {hf_name(n, config): t.contiguous() for n, t in state.items() if n.endswith("feed_forward.down")}
    save_file({**tensors, **stacked}, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="stored twice"):
        inspect_weights(tmp_path, config)


def test_gradients_equal_transformers(moe_folder):
    name, folder = moe_folder
    tokens = _tokens(2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()
    ours = load_pretrained(folder).train()
    config = ours.config
    hf_loss = hf(tokens, labels=tokens).loss
    logits = ours(tokens)
    vocab = logits.shape[-1]
    our_loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    assert abs(hf_loss.item() - our_loss.item()) <= 1e-5
    hf_loss.backward()
    our_loss.backward()
    hf_params = dict(hf.named_parameters())
    for param_name, param in ours.named_parameters():
        reference = hf_params[hf_name(param_name, config)].grad
        scale = reference.abs().max().item()
        assert (param.grad - reference).abs().max().item() <= 1e-5 * max(scale, 1.0), (name, param_name)


def test_router_loss_equals_transformers_load_balancing_loss(moe_folder):
    name, folder = moe_folder
    module = transformers.models.qwen3_moe.modeling_qwen3_moe
    tokens = _tokens(3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ours = load_pretrained(folder)
    config = ours.config
    balance = experts.router_balance(ours)
    ours(tokens)
    ours_aux = balance.loss(accumulation=4)
    with torch.no_grad():
        out = hf(tokens, output_router_logits=True)
    reference = module.load_balancing_loss_func(out.router_logits, config.n_experts, config.experts_per_token)
    expected = config.router_aux_loss_coef * reference / 4
    assert abs(ours_aux.item() - expected.item()) <= 1e-6 * expected.item()
    report = balance.report()
    assert abs(report["router_aux_loss"] - reference.item()) <= 1e-6 * reference.item()
    loads = [report[f"expert_load/{e}"] for e in range(config.n_experts)]
    assert abs(sum(loads) - 1) < 1e-6 and min(loads) >= 0
    # Taken once: the logits go with it; a pass without grad records nothing.
    assert balance.loss(1) is None
    with torch.no_grad():
        ours(tokens)
    assert balance.loss(1) is None


def test_grouped_mm_is_found_to_run_on_cpu_float32_even_when_first_asked_without_grad():
    experts.grouped_mm_runs.cache_clear()
    with torch.no_grad():
        assert experts.grouped_mm_runs("cpu", torch.float32, 24, 40)


def test_grouped_products_equal_padded_bmm_and_a_loop_forward_and_backward():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(30, 16, generator=generator, requires_grad=True)
    weight = torch.randn(5, 12, 16, generator=generator, requires_grad=True)
    counts = torch.tensor([7, 0, 11, 9, 3])  # an expert no token chose among them
    upstream = torch.randn(30, 12, generator=generator)
    results = []
    for grouped in ([True] if experts.grouped_mm_runs("cpu", torch.float32, 16, 12) else []) + [False]:
        x.grad = weight.grad = None
        out = experts.grouped_linear(x, weight, counts, grouped)
        (out * upstream).sum().backward()
        results.append((out.detach(), x.grad.clone(), weight.grad.clone()))
    x.grad = weight.grad = None
    group_of = torch.repeat_interleave(torch.arange(5), counts)
    loop = torch.cat([x[group_of == g] @ weight[g].T for g in range(5)])
    (loop * upstream).sum().backward()
    for out, grad_x, grad_w in results:
        assert torch.allclose(out, loop, atol=1e-5) and torch.allclose(grad_x, x.grad, atol=1e-5)
        assert torch.allclose(grad_w, weight.grad, atol=1e-5)


@pytest.mark.slow
def test_a_sparse_forward_compiles_whole_and_an_expert_without_tokens_gets_zero_gradients(moe_folder):
    """No host read in a sparse layer (the rows per expert are counted on the device): a model's forward and backward
    compile as one graph (fullgraph) and give the eager pass's loss and gradients; an expert that gets no token has
    zero gradients, not missing or stale ones, eager and compiled."""
    name, folder = moe_folder
    tokens = _tokens(4, length=6)
    eager, compiled = load_pretrained(folder).train(), load_pretrained(folder).train()
    torch._dynamo.reset()
    losses = []
    for run in (eager, torch.compile(compiled, fullgraph=True, backend="aot_eager")):
        logits = run(tokens)
        targets = tokens[:, 1:].reshape(-1)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets)
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) <= 1e-5, name
    for (param_name, ours), theirs in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        assert torch.allclose(ours.grad, theirs.grad, atol=1e-6), (name, param_name)
    layer = next(module for module in eager.modules() if isinstance(module, experts.MixtureOfExperts))
    k = layer.top_k
    x = torch.randn(5, layer.gate_up.shape[2], generator=torch.Generator().manual_seed(0))
    chosen = (torch.arange(5 * k).view(5, k) % (layer.gate_up.shape[0] - 1)) + 1  # expert 0 is never chosen
    weights = torch.full((5, k), 1.0 / k)
    for run in (layer.experts, torch.compile(layer.experts, fullgraph=True, backend="aot_eager")):
        layer.zero_grad(set_to_none=False)
        run(x, weights, chosen).square().sum().backward()
        assert layer.gate_up.grad[0].abs().max() == 0 and layer.down.grad[0].abs().max() == 0
        assert layer.gate_up.grad[1:].abs().max() > 0 and layer.down.grad[1:].abs().max() > 0


def test_real_configs_count_every_expert_and_the_active_parameters():
    qwen, mixtral = ModelConfig.from_dict(QWEN3_30B_A3B), ModelConfig.from_dict(MIXTRAL_8X7B)
    assert round(num_parameters(qwen) / 1e9, 2) == 30.53 and round(num_active_parameters(qwen) / 1e9, 2) == 3.35
    assert round(num_parameters(mixtral) / 1e9, 1) == 46.7 and round(num_active_parameters(mixtral) / 1e9, 1) == 12.9
    # MFU counts what a token is multiplied by: the active parameters but the embedding lookup and the norms.
    norms = 48 * (2 * 2048 + 2 * 128) + 2048
    assert matmul_params(qwen) == num_active_parameters(qwen) - 151936 * 2048 - norms
    assert qwen.sparse_layers == tuple(range(48)) and qwen.normalize_top_k and not qwen.dense_layers
    # The model line preflight and the trainer print (its weights as they would be found).
    weights = WeightsSummary((Path("model.safetensors"),), {}, {}, ("bfloat16",), num_parameters(qwen))
    line = describe(Path("Qwen3-30B-A3B"), qwen, weights)
    assert "30.53B parameters" in line and "128 experts, 8 per token, 3.35B active parameters per token" in line
    weights = dataclasses.replace(weights, num_parameters=num_parameters(mixtral))
    line = describe(Path("Mixtral-8x7B"), mixtral, weights)
    assert "46.70B parameters" in line and "8 experts, 2 per token, 12.88B active parameters per token" in line


def test_the_model_line_names_the_experts_and_the_active_parameters(moe_folder):
    name, folder = moe_folder
    config = ModelConfig.load(folder)
    line = describe(folder, config, inspect_weights(folder, config))
    assert f"{config.n_experts} experts, {config.experts_per_token} per token" in line
    assert "active parameters per token" in line
    if name == "qwen3_moe":
        assert "1 dense layers" in line and config.dense_layers == (1,)


@pytest.mark.parametrize(
    "values, key",
    [
        ({**MIXTRAL_8X7B, "router_jitter_noise": 0.1}, "router_jitter_noise 0.1"),
        ({**QWEN3_30B_A3B, "use_sliding_window": True}, "use_sliding_window true"),
        ({**QWEN3_30B_A3B, "attention_bias": True}, "attention_bias true"),
        ({**QWEN3_30B_A3B, "num_experts_per_tok": 200}, "num_experts_per_tok 200"),
        ({**QWEN3_30B_A3B, "mlp_only_layers": "all"}, "mlp_only_layers"),
        ({**QWEN3_30B_A3B, "decoder_sparse_step": 0}, "decoder_sparse_step 0"),
    ],
)
def test_what_is_not_computed_is_refused_naming_the_key(values, key):
    with pytest.raises(ValueError, match=key):
        ModelConfig.from_dict(values)


def test_decoder_sparse_step_makes_the_skipped_layers_dense():
    config = ModelConfig.from_dict({**QWEN3_30B_A3B, "num_hidden_layers": 6, "decoder_sparse_step": 2})
    assert config.dense_layers == (0, 2, 4) and config.sparse_layers == (1, 3, 5)
    written = json.loads(config.to_json())
    assert ModelConfig.from_dict(written) == config
    assert transformers.Qwen3MoeConfig(**written).mlp_only_layers == [0, 2, 4]


# --- Training, as the trainer trains (conftest's run_trainer and make_trainer, one thread) -----------------------

TEMPLATES = {"qwen3_moe": "chatml", "mixtral": "llama2"}
"""The chat template (real_chat_templates.py) of each family's instruction-tuned models' kind."""
RUN = {"max_steps": 4, "ckpt_interval": 2, "log_interval": 1, "val_fraction": 0.0}
SFT = {"train_type": "sft", "window_size": 96}
LORA = {"lora_rank": 4, "lora_alpha": 8}


@pytest.fixture(scope="module", params=sorted(MOE_CASES))
def family(request, tmp_path_factory):
    """(family, base model folder, seq data, sft data)."""
    name = request.param
    root = tmp_path_factory.mktemp(name)
    records = sft_records(40)
    texts = [path.read_text() for path in CORPUS_FILES] + [m["content"] for r in records for m in r["messages"]]
    tokenizer = HFTokenizer(make_family_folder(root / "tokenizer", TEMPLATES[name], texts * 3))
    assert tokenizer.vocab_size <= 1024
    base = make_hf_model(root / "base", **{**MOE_CASES[name], "vocab_size": 1024, "max_positions": 256, "seed": 2})
    seq, sft = root / "seq", root / "sft"
    prepare(seq, CORPUS_FILES, tokenizer=tokenizer)
    sft_file = root / "sft.jsonl"
    sft_file.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    prepare(sft, [sft_file], tokenizer=tokenizer, kind="sft")
    return name, base, seq, sft


def _whole_and_resumed(tmp_path, train_yaml, run_trainer, make_trainer, **keys):
    """Train max_steps at once, and again stopped at half and resumed: the same final checkpoint; its folder."""

    whole = train_yaml(tmp_path / "whole.yaml", ckpt_dir=str(tmp_path / "whole"), **RUN, **keys)
    run_trainer(whole)
    parts = train_yaml(tmp_path / "parts.yaml", ckpt_dir=str(tmp_path / "parts"), **RUN, **keys)
    assert run_trainer(parts, steps=2).steps == 2
    resumed = make_trainer(parts)
    try:
        assert resumed.progress.step == 2
        resumed.train()
    finally:
        resumed.close()
    assert final_weights(tmp_path / "parts", 4) == final_weights(tmp_path / "whole", 4)
    return latest_complete_checkpoint(tmp_path / "whole").path


def _loads_in_transformers_with_our_logits(checkpoint, base, vocab: int = 1024) -> None:
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and info["mismatched_keys"] == set()
    tokens = torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours = load_pretrained(checkpoint)(tokens)
        assert (hf.eval()(tokens).logits - ours).abs().max().item() <= 1e-5
        assert (load_pretrained(base)(tokens) - ours).abs().max().item() > 1e-3  # training changed the model


def _metrics(ckpt_dir) -> list[dict]:

    return [json.loads(line) for line in (ckpt_dir / METRICS_FILE).read_text().splitlines()]


@pytest.mark.slow
def test_pretraining_stops_resumes_exactly_logs_the_routers_and_loads_in_transformers(
    tmp_path, family, train_yaml, run_trainer, make_trainer, one_thread
):
    name, base, seq, _ = family
    keys = dict(param_path=str(base), data_root_path=str(seq))
    checkpoint = _whole_and_resumed(tmp_path, train_yaml, run_trainer, make_trainer, **keys)
    assert json.loads((checkpoint / "config.json").read_text())["model_type"] == name
    _loads_in_transformers_with_our_logits(checkpoint, base)
    records = [record for record in _metrics(tmp_path / "whole") if METRIC_ROUTER_AUX_LOSS in record]
    assert len(records) == 4 and all(record[METRIC_ROUTER_AUX_LOSS] > 0.5 for record in records)
    loads = [records[0][f"{METRIC_EXPERT_LOAD}/{e}"] for e in range(MOE_CASES[name].get("num_experts", 6))]
    assert abs(sum(loads) - 1) < 1e-6


@pytest.mark.slow
def test_the_router_loss_weight_changes_the_training_and_zero_turns_it_off(
    tmp_path, family, train_yaml, run_trainer, one_thread
):
    """Weighted by the config's router_aux_loss_coef: a run whose base says 0 trains otherwise than one that says
    0.05 (the loss is still logged)."""

    name, base, seq, _ = family
    off = tmp_path / "off"
    config, state = load_base_model(base)
    save_model_folder(off, dataclasses.replace(config, router_aux_loss_coef=0.0), state)
    for folder, job in ((base, "on"), (off, "off")):
        path = train_yaml(
            tmp_path / f"{job}.yaml",
            ckpt_dir=str(tmp_path / job),
            param_path=str(folder),
            data_root_path=str(seq),
            **{**RUN, "max_steps": 2},
        )
        run_trainer(path)
    assert final_weights(tmp_path / "on", 2) != final_weights(tmp_path / "off", 2)
    assert all(METRIC_ROUTER_AUX_LOSS in record for record in _metrics(tmp_path / "off") if "loss" in record)


@pytest.mark.slow
def test_sft_stops_resumes_exactly(tmp_path, family, train_yaml, run_trainer, make_trainer, one_thread):
    _, base, _, sft = family
    keys = dict(param_path=str(base), data_root_path=str(sft), **SFT)
    checkpoint = _whole_and_resumed(tmp_path, train_yaml, run_trainer, make_trainer, **keys)
    _loads_in_transformers_with_our_logits(checkpoint, base)


@pytest.mark.slow
def test_fsdp_on_two_processes_saves_sharded_checkpoints_that_resume_bit_for_bit(tmp_path, train_yaml, trainer_env):
    """torchrun, 2 CPU processes under FSDP (the experts sharded by expert), the sharded format: each rank writes
    the matrices of its experts as save_pretrained names them; the step-2 checkpoint resumed ends on the very
    weights of the uninterrupted run, and the folder is the full format's, tensor for tensor."""
    base = make_hf_model(tmp_path / "base", **{**MOE_CASES["qwen3_moe"], "vocab_size": 320, "seed": 3})
    keys = {**RUN, "param_path": str(base), "global_batch_size": 8}
    launcher = [sys.executable, "-m", TORCHRUN_MODULE, "--standalone", "--nproc-per-node", "2"]

    def train(config, format: str) -> None:
        command = [*launcher, "-m", "astrai.train", "--config", str(config), "--parallel_mode", "fsdp"]
        run = Run([*command, "--format", format], trainer_env, tmp_path / f"{config.stem}.log")
        assert run.wait() == 0, run.output()

    for format in ("sharded", "full"):
        train(train_yaml(tmp_path / f"{format}.yaml", ckpt_dir=str(tmp_path / format), **keys), format)
    sharded, full = latest_complete_checkpoint(tmp_path / "sharded"), latest_complete_checkpoint(tmp_path / "full")
    assert sharded.step == full.step == 4 and sharded.meta.format == "sharded"
    ours, theirs = load_file(sharded.path / "model.safetensors"), load_file(full.path / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in ours)
    assert "model.layers.0.mlp.experts.7.up_proj.weight" in ours
    _loads_in_transformers_with_our_logits(sharded.path, base, vocab=320)

    resumed = tmp_path / "resumed"
    step_2 = next(c.path for c in list_complete_checkpoints(tmp_path / "sharded") if c.step == 2)
    resumed.mkdir()
    shutil.copytree(step_2, resumed / step_2.name)
    train(train_yaml(tmp_path / "resumed.yaml", ckpt_dir=str(resumed), **keys), "sharded")
    assert final_weights(resumed, 4) == final_weights(tmp_path / "sharded", 4)


@pytest.mark.slow
def test_lora_on_the_attention_and_every_expert_stops_resumes_exactly_and_exports_merged_and_as_a_peft_adapter(
    tmp_path, family, train_yaml, run_trainer, make_trainer, one_thread
):
    """The default targets (all seven): q, k, v, o and the experts (one A and B per expert on gate and up
    together, one on down, PEFT's target_parameters), the dense layer's MLP left as PEFT leaves it."""
    name, base, _, sft = family
    keys = dict(param_path=str(base), data_root_path=str(sft), **SFT, **LORA)
    checkpoint = _whole_and_resumed(tmp_path, train_yaml, run_trainer, make_trainer, **keys)
    model = load_pretrained(base)
    record = CheckpointMeta.read(checkpoint).lora
    lora.add_adapters(model, LoRASettings(record["rank"], record["alpha"], record["dropout"], tuple(record["targets"])))
    lora.load_adapters(model, lora.from_peft_names(load_file(checkpoint / "model.safetensors"), "ckpt"), "ckpt")
    tokens = torch.randint(0, 1024, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = model(tokens)

    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    export_checkpoint(checkpoint, merged, "float32", 1 << 30, base=base)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    export_checkpoint(checkpoint, adapter, None, 1 << 30, adapter=True)
    written = json.loads((adapter / "adapter_config.json").read_text())
    assert set(written["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert written["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    loaded = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter
    ).eval()
    with torch.no_grad():
        assert (hf.eval()(tokens).logits - ours).abs().max().item() <= 1e-4
        assert (loaded(tokens).logits - ours).abs().max().item() <= 1e-5
        assert (load_pretrained(base)(tokens) - ours).abs().max().item() > 1e-4  # the adapters trained


def test_lora_on_part_of_the_experts_or_with_dropout_is_refused_naming_what_to_change(moe_folder):
    _, folder = moe_folder
    with pytest.raises(SetupError, match="name down_proj too"):
        lora.add_adapters(load_pretrained(folder), LoRASettings(4, 8.0, 0.0, ("q_proj", "gate_proj", "up_proj")))
    with pytest.raises(SetupError, match="lora_dropout 0.1"):
        lora.add_adapters(load_pretrained(folder), LoRASettings(4, 8.0, 0.1, ("gate_proj", "up_proj", "down_proj")))
    lora.add_adapters(load_pretrained(folder), LoRASettings(4, 8.0, 0.1, ("q_proj", "v_proj")))  # attention may
    # preflight and --dry-run make the same refusal from the folder's config alone (astrai.common.fit.start_checks)
    from astrai.common.config import TrainingSection
    from astrai.common.fit import check_lora_targets

    training = TrainingSection(lora_rank=4, lora_dropout=0.1)
    with pytest.raises(SetupError, match="training.lora_dropout 0.1: adapters on the experts cannot drop out"):
        check_lora_targets(ModelConfig.load(folder), training)


def test_expert_adapters_compute_what_peft_computes_on_transformers(moe_folder, tmp_path):
    """Random adapters everywhere (B not zero), ours against PEFT's on transformers' model, the same tensors."""
    from hf_folders import save_peft_adapter

    _, folder = moe_folder
    settings = LoRASettings(3, 6.0, 0.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    model = load_pretrained(folder)
    lora.add_adapters(model, settings, torch.Generator().manual_seed(0))
    with torch.no_grad():
        for param in lora.adapter_parameters(model).values():
            param.normal_(0.0, 0.1)
    tokens = _tokens(6)
    with torch.no_grad():
        ours = model(tokens)
    save_peft_adapter(tmp_path / "adapter", folder, lora.adapter_state_dict(model), settings)
    loaded = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), tmp_path / "adapter"
    ).eval()
    with torch.no_grad():
        assert (loaded(tokens).logits - ours).abs().max().item() <= 1e-5
    # And back: the folder PEFT wrote is read as the same adapters (a run may start from it).
    read, tensors = lora.read_peft_adapter(tmp_path / "adapter")
    assert set(read.targets) == set(settings.targets) and read.rank == 3
    mine = lora.adapter_state_dict(model)
    assert tensors.keys() == mine.keys() and all(torch.equal(tensors[k], mine[k]) for k in mine)


def test_export_folds_an_expert_adapter_into_either_layout_of_the_experts():
    """PEFT's 3-D layout folded into every expert at once (5.x's stacked weights) or one matrix, one half at a time
    (save_pretrained's), as B_e @ A_e of each expert."""
    from astrai.common.model_folder import ExpertPiece
    from astrai.host.export import _expert_delta

    experts, rank, width_in, width_out = 3, 2, 5, 8
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(rank * experts, width_in, generator=generator), torch.randn(width_out, rank * experts)
    each = torch.stack([b[:, e::experts] @ a[e * rank : (e + 1) * rank] for e in range(experts)])
    stacked = _expert_delta(a.numpy(), b.numpy(), ExpertPiece("gate_up", None, None), experts)
    assert torch.allclose(torch.from_numpy(stacked), each, atol=1e-5)
    up = _expert_delta(a.numpy(), b.numpy(), ExpertPiece("gate_up", 1, "up"), experts)
    assert torch.allclose(torch.from_numpy(up), each[1, 4:], atol=1e-5)


@pytest.mark.parametrize("batch", [1, 7])
def test_greedy_generation_equals_transformers_and_is_never_a_captured_graph(moe_folder, batch):
    import random

    from astrai.common.settings import Sampling
    from astrai.trainer.generation.decoding import DecodeEngine
    from tests.support import transformers_generate

    _, folder = moe_folder
    rng = random.Random(batch)
    prompts = [[rng.randrange(1, 300) for _ in range(rng.randrange(1, 12))] for _ in range(batch)]
    engine = DecodeEngine(load_pretrained(folder))
    assert engine.graphs is False
    ours = engine.generate(prompts, Sampling(max_new_tokens=9))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert ours == transformers_generate(theirs, prompts, 9)


@pytest.mark.slow
def test_activation_checkpointing_trains_the_same_steps(tmp_path, family, train_yaml, run_trainer, one_thread):
    """Each block's activations recomputed in the backward pass, the router's too: the same weights after the same
    steps, and the router loss still taken."""
    _, base, seq, _ = family
    for job, checkpointing in (("plain", False), ("recomputed", True)):
        path = train_yaml(
            tmp_path / f"{job}.yaml",
            ckpt_dir=str(tmp_path / job),
            param_path=str(base),
            data_root_path=str(seq),
            activation_checkpointing=checkpointing,
            **{**RUN, "max_steps": 2},
        )
        run_trainer(path)
    assert final_weights(tmp_path / "recomputed", 2) == final_weights(tmp_path / "plain", 2)
    assert [r[METRIC_ROUTER_AUX_LOSS] for r in _metrics(tmp_path / "recomputed") if METRIC_ROUTER_AUX_LOSS in r] == [
        r[METRIC_ROUTER_AUX_LOSS] for r in _metrics(tmp_path / "plain") if METRIC_ROUTER_AUX_LOSS in r
    ]


@pytest.mark.slow
def test_fsdp_lora_on_the_experts_resumes_bit_for_bit(tmp_path, train_yaml, trainer_env):
    """The same two FSDP processes training LoRA on the attention and the experts (the adapters' A and B sharded as
    every parameter is; a LoRA checkpoint is the adapters, written whole): stopped at step 2 and resumed, the same
    adapters as the uninterrupted run."""
    base = make_hf_model(tmp_path / "base", **{**MOE_CASES["mixtral"], "vocab_size": 320, "seed": 3})
    keys = {**RUN, "param_path": str(base), "global_batch_size": 8, **LORA}
    launcher = [sys.executable, "-m", TORCHRUN_MODULE, "--standalone", "--nproc-per-node", "2"]

    def train(config) -> None:
        command = [*launcher, "-m", "astrai.train", "--config", str(config), "--parallel_mode", "fsdp"]
        run = Run(command, trainer_env, tmp_path / f"{config.stem}.log")
        assert run.wait() == 0, run.output()

    train(train_yaml(tmp_path / "whole.yaml", ckpt_dir=str(tmp_path / "whole"), **keys))
    resumed = tmp_path / "resumed"
    step_2 = next(c.path for c in list_complete_checkpoints(tmp_path / "whole") if c.step == 2)
    resumed.mkdir()
    shutil.copytree(step_2, resumed / step_2.name)
    train(train_yaml(tmp_path / "resumed.yaml", ckpt_dir=str(resumed), **keys))
    assert final_weights(resumed, 4) == final_weights(tmp_path / "whole", 4)
    adapters = load_file(latest_complete_checkpoint(resumed).path / "model.safetensors")
    assert "base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight" in adapters
