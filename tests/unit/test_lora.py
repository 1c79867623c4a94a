"""LoRA adapters on our model, against PEFT on transformers' model of the same folder."""

from __future__ import annotations

import json

import pytest
import torch
from hf_folders import FAMILY_CASES, make_hf_model, save_peft_adapter

from astrai.common.fit import SetupError
from astrai.common.model_folder import ADAPTER_TARGETS, num_adapter_parameters, peft_modules_of
from astrai.common.settings import LoRASettings
from astrai.trainer.models import lora
from astrai.trainer.models.weights import load_pretrained

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

SETTINGS = LoRASettings(rank=4, alpha=8.0, dropout=0.0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp("lora") / "base", kv_heads=2, seed=3)


def _ours(folder, settings=SETTINGS, seed=0):
    model = load_pretrained(folder)
    lora.add_adapters(model, settings, torch.Generator().manual_seed(seed))
    return model


def _peft(folder, adapters: dict[str, torch.Tensor], settings=SETTINGS):
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    peft_names = {lora.peft_name(name): value for name, value in adapters.items()}
    config = peft.LoraConfig(  # the model's own module names (a Phi-3's qkv_proj)
        r=settings.rank, lora_alpha=settings.alpha, lora_dropout=0.0, target_modules=list(peft_modules_of(peft_names))
    )
    model = peft.get_peft_model(base, config)
    result = peft.set_peft_model_state_dict(model, peft_names)
    assert not [key for key in result.unexpected_keys if "lora" in key], result.unexpected_keys
    return model


def _nonzero_b(model, seed=1):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora.adapter_layers(model).values():
            layer.lora_B.weight.copy_(0.05 * torch.randn(layer.lora_B.weight.shape, generator=generator))


TOKENS = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))


def test_at_the_start_the_adapted_model_is_the_base_model_and_only_adapters_train(folder):
    base, model = load_pretrained(folder), _ours(folder)
    with torch.no_grad():
        assert torch.equal(model(TOKENS), base(TOKENS))
    adapted = lora.adapter_layers(model)
    assert len(adapted) == 2 * 7 and all(layer.lora_B.weight.abs().sum() == 0 for layer in adapted.values())
    trainable, frozen = lora.parameter_counts(model)
    assert frozen == sum(p.numel() for p in base.parameters())
    assert trainable == sum(4 * (layer.in_features + layer.out_features) for layer in adapted.values())
    model(TOKENS).sum().backward()
    assert all((p.grad is None) != lora.is_adapter(name) for name, p in model.named_parameters())
    # The base weights keep their names; the adapters are beside them.
    assert set(base.state_dict()) == {name for name in model.state_dict() if not lora.is_adapter(name)}


def test_logits_and_one_adamw_step_equal_peft_on_transformers(folder):
    ours = _ours(folder)
    _nonzero_b(ours)
    theirs = _peft(folder, lora.adapter_state_dict(ours))
    with torch.no_grad():
        difference = (ours(TOKENS) - theirs(input_ids=TOKENS).logits).abs().max().item()
    assert difference <= 1e-5, difference

    targets = torch.roll(TOKENS, -1, dims=1)
    before = {name: value.clone() for name, value in lora.adapter_state_dict(ours).items()}
    for logits_of, model in ((lambda: ours(TOKENS), ours), (lambda: theirs(input_ids=TOKENS).logits, theirs)):
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        loss = torch.nn.functional.cross_entropy(logits_of().reshape(-1, 300), targets.reshape(-1))
        loss.backward()
        optimizer.step()
    assert all(not torch.equal(before[name], value) for name, value in lora.adapter_state_dict(ours).items())
    after = {lora.peft_name(name): value for name, value in lora.adapter_state_dict(ours).items()}
    stepped = peft.get_peft_model_state_dict(theirs)
    assert after.keys() == stepped.keys()
    for name, value in after.items():
        torch.testing.assert_close(value, stepped[name], rtol=1e-6, atol=1e-7, msg=name)


def test_merged_weights_and_adapters_off_give_the_adapted_and_the_base_model(folder):
    settings = LoRASettings(rank=2, alpha=3.0, targets=("q_proj", "down_proj"))
    model = _ours(folder, settings)
    _nonzero_b(model)
    merged = _peft(folder, lora.adapter_state_dict(model), settings).merge_and_unload()
    with torch.no_grad():
        assert (merged(input_ids=TOKENS).logits - model(TOKENS)).abs().max().item() <= 1e-5
        with lora.adapters_off(model):
            assert torch.equal(model(TOKENS), load_pretrained(folder)(TOKENS))
        assert not torch.equal(model(TOKENS), load_pretrained(folder)(TOKENS))


def test_bf16_base_weights_keep_fp32_adapters(folder):
    model = load_pretrained(folder).to(torch.bfloat16)
    lora.add_adapters(model, SETTINGS)
    layer = next(iter(lora.adapter_layers(model).values()))
    assert layer.weight.dtype == torch.bfloat16 and layer.lora_A.weight.dtype == torch.float32
    assert model(TOKENS).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("targets", "kind"),
    [(ADAPTER_TARGETS, "llama"), (("q_proj", "v_proj"), "llama"), (ADAPTER_TARGETS, "qwen2")],
)
def test_a_bf16_base_computes_as_its_rounded_fp32_weights_would_and_holds_half_the_bytes(
    folder, tmp_path, targets, kind
):
    if kind == "qwen2":  # biases on q, k and v, a tied output head
        folder = make_hf_model(tmp_path / "qwen2", model_type="qwen2", kv_heads=2, tie=True, seed=4)
    settings = LoRASettings(rank=4, alpha=8.0, targets=targets)
    model, rounded = _ours(folder, settings), _ours(folder, settings)
    _nonzero_b(model)
    rounded.load_state_dict(model.state_dict())
    lora.hold_base_in(model, torch.bfloat16)
    with torch.no_grad():
        for param in rounded.parameters():
            if not param.requires_grad and param.dim() >= 2:
                param.copy_(param.to(torch.bfloat16).float())
    held = {name: param.dtype for name, param in model.named_parameters()}
    assert {held[name] for name in held if lora.is_adapter(name)} == {torch.float32}
    assert {held[name] for name in held if name.endswith("norm.weight")} == {torch.float32}
    assert {held[name] for name in held if not lora.is_adapter(name) and name.endswith("proj.weight")} <= {
        torch.bfloat16
    }
    assert held["tok_embeddings.weight"] == torch.bfloat16 and lora.frozen_dtype(model) == "bfloat16"
    assert set(model.state_dict()) == set(rounded.state_dict())  # same names: checkpoints and exports unchanged

    model.train()  # as the trainer runs it: the biased layers' outputs take the adapters' update in place
    logits = model(TOKENS)
    assert logits.dtype == torch.float32
    assert (logits - rounded(TOKENS)).abs().max().item() <= 1e-5
    logits.square().mean().backward()
    rounded(TOKENS).square().mean().backward()
    grads = dict(rounded.named_parameters())
    for name, param in model.named_parameters():
        assert (param.grad is None) != lora.is_adapter(name), name
        if lora.is_adapter(name):
            torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-5, atol=1e-7)
    with lora.adapters_off(model), torch.no_grad():
        assert (model(TOKENS) - lora.BaseModel(rounded)(TOKENS)).abs().max().item() <= 1e-5


def test_unknown_targets_and_a_zero_rank_are_refused(folder):
    with pytest.raises(ValueError, match=r"lora_targets: expected a non-empty list of q_proj.*got \['qkv'\]"):
        lora.add_adapters(load_pretrained(folder), LoRASettings(rank=2, alpha=2, targets=("qkv",)))
    with pytest.raises(ValueError, match="at least 1"):
        lora.add_adapters(load_pretrained(folder), LoRASettings(rank=0, alpha=2))


def test_a_peft_adapter_folder_goes_both_ways(folder, tmp_path):
    ours = _ours(folder)
    _nonzero_b(ours)
    save_peft_adapter(tmp_path / "ours", folder, lora.adapter_state_dict(ours), SETTINGS)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "ours").eval()
    with torch.no_grad():
        expected = ours(TOKENS)
        assert (loaded(input_ids=TOKENS).logits - expected).abs().max().item() <= 1e-5

    # An adapter PEFT wrote (someone's adapter to continue) reads back into our model with the same logits.
    loaded.save_pretrained(tmp_path / "theirs")
    settings, tensors = lora.read_peft_adapter(tmp_path / "theirs")
    assert (settings.rank, settings.alpha, set(settings.targets)) == (4, 8.0, set(lora.TARGETS))
    again = _ours(folder, settings, seed=9)
    lora.load_adapters(again, tensors, "theirs")
    with torch.no_grad():
        assert (again(TOKENS) - expected).abs().max().item() <= 1e-5

    smaller = _ours(folder, LoRASettings(rank=2, alpha=8.0))
    shapes = r"q_proj.lora_A.weight is \[4, 64\], this model's is \[2, 64\] \(its rank or its base model is another\)"
    with pytest.raises(lora.AdapterError, match=r"theirs: base_model.model.model.layers.0.self_attn." + shapes):
        lora.load_adapters(smaller, tensors, "theirs")
    fewer = _ours(folder, LoRASettings(rank=4, alpha=8.0, targets=("q_proj",)))
    with pytest.raises(lora.AdapterError, match="do not fit this model.s: not in the model base_model.model.model"):
        lora.load_adapters(fewer, tensors, "theirs")


def test_adapter_folders_lora_cannot_read_are_refused_naming_the_key(tmp_path):
    import json

    base = make_hf_model(tmp_path / "base")
    save_peft_adapter(tmp_path, base, lora.adapter_state_dict(_ours(base)), SETTINGS)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    for change, message in (
        ({"peft_type": "IA3"}, "peft_type must be LORA, got 'IA3'"),
        ({"use_dora": True}, "no DoRA.*'use_dora': True"),
        ({"target_modules": ["qkv"]}, r"target_modules \['qkv'\] are not among q_proj"),
        ({"r": "four"}, "r and lora_alpha must be numbers"),
    ):
        (tmp_path / "adapter_config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(lora.AdapterError, match=message):
            lora.read_peft_adapter(tmp_path)
    with pytest.raises(lora.AdapterError, match="not a PEFT adapter folder"):
        lora.read_peft_adapter(tmp_path / "base")


@pytest.mark.parametrize("family", ["phi3", "gemma2"])
def test_each_family_adapts_the_layers_peft_adapts_with_the_same_logits_and_step(tmp_path, family):
    """Phi-3's fused qkv_proj and gate_up_proj get one adapter each, as PEFT gives them (named by their parts in
    lora_targets); the adapters go both ways through a PEFT adapter folder."""
    folder = make_hf_model(tmp_path / "base", seed=5, **FAMILY_CASES[family])
    ours = _ours(folder)
    _nonzero_b(ours)
    modules = {name.split(".", 2)[2] for name in lora.adapter_layers(ours)}
    fused = {"attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2"}
    assert modules == (fused if family == "phi3" else set(lora.TARGETS.values()))
    theirs = _peft(folder, lora.adapter_state_dict(ours))
    with torch.no_grad():
        assert (ours(TOKENS) - theirs(input_ids=TOKENS).logits).abs().max().item() <= 1e-5
    targets = torch.roll(TOKENS, -1, dims=1)
    for logits_of, model in ((lambda: ours(TOKENS), ours), (lambda: theirs(input_ids=TOKENS).logits, theirs)):
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        torch.nn.functional.cross_entropy(logits_of().reshape(-1, 300), targets.reshape(-1)).backward()
        optimizer.step()
    stepped = peft.get_peft_model_state_dict(theirs)
    for name, value in lora.adapter_state_dict(ours).items():
        torch.testing.assert_close(value, stepped[lora.peft_name(name)], rtol=1e-6, atol=1e-7, msg=name)

    save_peft_adapter(tmp_path / "adapter", folder, lora.adapter_state_dict(ours), SETTINGS)
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["target_modules"]
    expected = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"} if family == "phi3" else set(lora.TARGETS)
    assert set(written) == expected
    settings, tensors = lora.read_peft_adapter(tmp_path / "adapter")
    assert set(settings.targets) == set(lora.TARGETS)  # a fused layer is named by its parts, as lora_targets says
    again = _ours(folder, settings, seed=9)
    lora.load_adapters(again, tensors, "adapter")
    with torch.no_grad():
        assert torch.equal(again(TOKENS), ours(TOKENS))


def test_part_of_a_fused_layer_alone_is_refused_with_what_to_name(tmp_path):
    model = load_pretrained(make_hf_model(tmp_path / "base", **FAMILY_CASES["phi3"]))
    with pytest.raises(SetupError, match="phi3 computes q_proj, k_proj, v_proj in one layer \\(qkv_proj\\), which is"):
        lora.add_adapters(model, LoRASettings(rank=2, alpha=2, targets=("q_proj", "v_proj")))
    # Preflight's estimate counts the fused layer whole, and does not fail.
    assert num_adapter_parameters(model.config, 2, ["q_proj"]) == 2 * 2 * (64 + 64 + 2 * 32)  # 2 layers, rank 2
    adapted = lora.add_adapters(model, LoRASettings(rank=2, alpha=2, targets=("o_proj", "gate_proj", "up_proj")))
    assert adapted == [
        "layers.0.attention.wo",
        "layers.0.feed_forward.w13",
        "layers.1.attention.wo",
        "layers.1.feed_forward.w13",
    ]
