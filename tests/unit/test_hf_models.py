"""Hugging Face folders of every family in and out: logit parity with transformers, both config forms, clear
refusals."""

from __future__ import annotations

import json

import pytest
import torch
from hf_folders import FAMILY_CASES, MOE_CASES, ROPE_LLAMA3, hf_logits, make_hf_model, to_transformers_4_config
from safetensors.torch import load_file, save_file

from astrai.common.model_folder import ModelConfig, ModelLoadError
from astrai.trainer.models.weights import describe_folder, load_pretrained, save_model_folder, write_base_model

# (batch, seq) shapes every model is compared on.
SHAPES = [(1, 1), (2, 17), (3, 48)]

MODELS = {
    "mha-tied-fp32": dict(tie=True),
    "gqa-llama3-headdim-sharded": dict(
        heads=8, kv_heads=2, head_dim=24, rope=ROPE_LLAMA3, rope_theta=500000.0, shard_size="60KB"
    ),
    "mqa-linear-bf16-sharded": dict(
        heads=4, kv_heads=1, rope={"rope_type": "linear", "factor": 2.0}, dtype=torch.bfloat16, shard_size="40KB"
    ),
    "gqa-tied-fp16": dict(hidden_size=96, heads=6, kv_heads=3, tie=True, dtype=torch.float16),
    "mistral-window": dict(model_type="mistral", heads=4, kv_heads=2, sliding_window=64),
}


def _tokens(batch: int, seq: int, vocab: int = 300) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(batch * 100 + seq))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_match_transformers(tmp_path, name):
    folder = make_hf_model(tmp_path / name, **MODELS[name])
    model = load_pretrained(folder)
    assert not model.training and all(p.dtype == torch.float32 for p in model.parameters())
    for batch, seq in SHAPES:
        tokens = _tokens(batch, seq)
        with torch.no_grad():
            ours = model(tokens)
        assert ours.shape == (batch, seq, 300)
        expected = hf_logits(folder, tokens)
        # Large enough logits that a real mistake would show.
        assert expected.abs().max() > 1.0
        assert (ours - expected).abs().max().item() <= 1e-4, (name, batch, seq)


@pytest.mark.parametrize("kind_key", ["rope_type", "type"])
def test_transformers_4_config_form_gives_the_same_model(tmp_path, kind_key):
    folder = make_hf_model(tmp_path / "m", heads=8, kv_heads=2, rope=ROPE_LLAMA3, rope_theta=500000.0)
    tokens = _tokens(2, 40)
    with torch.no_grad():
        before = load_pretrained(folder)(tokens)
    written = to_transformers_4_config(folder, kind_key)
    assert "rope_parameters" not in written and written["rope_scaling"][kind_key] == "llama3"
    config = ModelConfig.load(folder)
    assert config.rope_theta == 500000.0 and config.rope_scaling.factor == 8.0
    with torch.no_grad():
        assert torch.equal(load_pretrained(folder)(tokens), before)


@pytest.mark.parametrize(("tie", "sliding_window"), [(True, None), (False, None), (False, 64)])
def test_our_folders_load_in_transformers_with_every_key_and_the_same_logits(tmp_path, tie, sliding_window):
    from transformers import AutoModelForCausalLM

    config = ModelConfig(
        vocab_size=300,
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_hidden_dim=128,
        tie_embeddings=tie,
        sliding_window=sliding_window,
    )
    write_base_model(tmp_path, config, seed=3)
    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(hf).__name__ == ("MistralForCausalLM" if sliding_window else "LlamaForCausalLM")
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and info["mismatched_keys"] == set()
    tokens = _tokens(2, 30)
    with torch.no_grad():
        diff = (hf.eval()(tokens).logits - load_pretrained(tmp_path)(tokens)).abs().max().item()
    assert diff <= 1e-4
    # The written config reads back as the same architecture.
    assert ModelConfig.load(tmp_path) == config


def test_tied_folder_that_also_stores_lm_head_and_old_rotary_buffers_loads(tmp_path):
    folder = make_hf_model(tmp_path / "m", tie=True)
    state = load_file(folder / "model.safetensors")
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    tokens = _tokens(2, 9)
    with torch.no_grad():
        assert (load_pretrained(folder)(tokens) - hf_logits(folder, tokens)).abs().max() <= 1e-4


def _edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(model_type="gpt2"), "model_type 'gpt2' is not supported; expected one of llama, mistral"),
        (
            dict(rope_parameters={"rope_type": "proportional", "factor": 4.0, "rope_theta": 1e4}),
            "rope_parameters.rope_type 'proportional' is not supported; expected one of default, linear, llama3, "
            "yarn, dynamic, longrope",
        ),
        (
            dict(rope_parameters=None, rope_theta=1e4, rope_scaling={"type": "dynamic"}),
            "rope_scaling.factor None: dynamic scaling needs a positive finite number",
        ),
        (
            dict(rope_parameters={"rope_type": "longrope", "short_factor": [1.0], "rope_theta": 1e4}),
            "rope_parameters.short_factor: longrope scaling needs a list of 8 positive numbers",
        ),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5 is not supported; expected 1.0"),
        (
            dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}),
            "rope_parameters.low_freq_factor None: llama3 scaling needs a positive finite number",
        ),
        (dict(attention_bias=True), "attention_bias true is not supported"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
        (dict(num_key_value_heads=3), "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ],
)
def test_unsupported_configs_are_refused_naming_the_key_and_value(tmp_path, changes, message):
    folder = make_hf_model(tmp_path / "m")
    _edit_config(folder, **changes)
    with pytest.raises(ModelLoadError, match="config.json: " + message.replace("(", r"\(").replace(")", r"\)")):
        load_pretrained(folder)


def _sharded(tmp_path):
    folder = make_hf_model(tmp_path / "m", shard_size="40KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return folder, index


def test_bad_weight_files_are_refused_naming_the_file(tmp_path):
    folder, index = _sharded(tmp_path)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2

    (folder / shards[1]).rename(tmp_path / "aside")
    with pytest.raises(ModelLoadError, match=rf"index.json: weight_map puts '.*' in {shards[1]}, which is missing"):
        load_pretrained(folder)
    (tmp_path / "aside").rename(folder / shards[1])

    renamed = {k: ("model-99-of-99.safetensors" if v == shards[0] else v) for k, v in index["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": renamed}))
    with pytest.raises(ModelLoadError, match="in model-99-of-99.safetensors, which is missing"):
        load_pretrained(folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))

    data = (folder / shards[2]).read_bytes()
    (folder / shards[2]).write_bytes(data[: len(data) - 100])
    with pytest.raises(ModelLoadError, match=rf"{shards[2]}: truncated"):
        load_pretrained(folder)

    (folder / "model.safetensors.index.json").write_text('{"weight_map": ')
    with pytest.raises(ModelLoadError, match="index.json: unreadable shard index"):
        load_pretrained(folder)
    (folder / "model.safetensors.index.json").unlink()
    with pytest.raises(ModelLoadError, match="model.safetensors is missing"):
        load_pretrained(folder)


def test_tensors_that_the_config_does_not_expect_are_refused(tmp_path):
    folder = make_hf_model(tmp_path / "m")
    state = load_file(folder / "model.safetensors")
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'"):
        load_pretrained(folder)
    del state["model.layers.0.self_attn.q_proj.bias"], state["lm_head.weight"]
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"tensor 'lm_head\.weight' is missing"):
        load_pretrained(folder)


# A window shorter than the sequences compared, in every layer: Mistral, Phi-3 (with longrope), Mixtral (experts).
WINDOWED = {
    "mistral": dict(model_type="mistral", heads=4, kv_heads=2, sliding_window=6),
    "phi3": {**FAMILY_CASES["phi3"], "sliding_window": 8},
    "mixtral": {**MOE_CASES["mixtral"], "sliding_window": 7},
}


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_past_the_sliding_window_a_token_attends_within_it_as_in_transformers(tmp_path, family):
    """The window limits attention, not length: a sequence several windows long, and packed records, give
    transformers' logits; the context is max_position_embeddings."""
    folder = make_hf_model(tmp_path / "m", **WINDOWED[family])
    model = load_pretrained(folder)
    assert model.config.context == 256
    tokens = _tokens(2, 40)
    with torch.no_grad():
        assert (model(tokens) - hf_logits(folder, tokens)).abs().max().item() <= 1e-4
        segments = torch.tensor([[0] * 25 + [1] * 15] * 2)
        positions = torch.cat([torch.arange(25), torch.arange(15)]).expand(2, -1)
        packed = model(tokens, positions, segments)
        assert (packed[:, 25:] - model(tokens[:, 25:])).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="sequence length 257 exceeds the model's context of 256 tokens"):
        model(_tokens(1, 257))


def test_the_context_is_max_position_embeddings_as_the_rope_scaling_stretches_it(tmp_path):
    from astrai.common.model_config import context_length

    assert context_length(4096) == 4096
    assert context_length(2048, "dynamic", 2.0) == 4096  # dynamic NTK: made for positions past the config's
    assert context_length(32768, "yarn", 4.0, 32768) == 131072  # Qwen's yarn keeps the original in the config
    assert context_length(131072, "llama3", 8.0, 8192) == 131072  # Llama 3.1 names the stretched one
    assert context_length(4096, "linear", 4.0) == 4096  # linear does not say which it names: the config's word
    folder = make_hf_model(tmp_path / "m", model_type="mistral", sliding_window=16, max_positions=64)
    assert ModelConfig.load(folder).context == 64
    # Without the key, transformers' Mistral default applies.
    _edit_config(folder, sliding_window=None)
    assert ModelConfig.load(folder).sliding_window == 4096


@pytest.mark.parametrize(
    ("model_type", "tie", "extra"),
    [("qwen2", False, {}), ("qwen2", True, {}), ("qwen3", False, {}), ("qwen3", True, {})],
)
def test_qwen_families_match_transformers_and_are_written_back_as_themselves(tmp_path, model_type, tie, extra):
    """Qwen2 (biases on q, k and v) and Qwen3 (per-head q and k norms): the bases people fine-tune."""
    from transformers import AutoModelForCausalLM

    folder = make_hf_model(tmp_path / "base", model_type=model_type, heads=4, kv_heads=2, tie=tie, **extra)
    tokens = _tokens(2, 13)
    ours = load_pretrained(folder)
    with torch.no_grad():
        assert torch.allclose(ours(tokens), hf_logits(folder, tokens), atol=1e-4)
    write_back = tmp_path / "written"
    from astrai.trainer.models.weights import save_model_folder

    save_model_folder(write_back, ours.config, ours.state_dict())
    assert json.loads((write_back / "config.json").read_text())["model_type"] == model_type
    loaded = AutoModelForCausalLM.from_pretrained(write_back, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.allclose(loaded(tokens).logits, hf_logits(folder, tokens), atol=1e-4)


def test_a_qwen3_with_attention_biases_is_refused_naming_the_key(tmp_path):
    folder = make_hf_model(tmp_path / "base", model_type="qwen3", attention_bias=True)
    with pytest.raises(ModelLoadError, match="attention_bias true is not supported; expected false"):
        load_pretrained(folder)


@pytest.mark.parametrize("family", sorted(FAMILY_CASES))
def test_each_family_matches_transformers_with_every_feature_on_and_is_written_back_as_itself(tmp_path, family):
    """Gemma 2 and 3, Phi-3, OLMo 2 and Granite at fp32: the logits within 1e-5 of transformers' on short and long
    sequences (past the local window, past longrope's original context, past dynamic NTK's max_position_embeddings),
    and a folder written from our model loads in transformers as the same family with the same logits."""
    from transformers import AutoModelForCausalLM

    folder = make_hf_model(tmp_path / "base", **FAMILY_CASES[family])
    model = load_pretrained(folder)
    assert model.config.model_type == family
    for batch, seq in SHAPES:
        tokens = _tokens(batch, seq)
        with torch.no_grad():
            ours = model(tokens)
        expected = hf_logits(folder, tokens)
        assert expected.abs().max() > 1.0
        assert (ours - expected).abs().max().item() <= 1e-5, (family, batch, seq)

    save_model_folder(tmp_path / "written", model.config, model.state_dict())
    assert ModelConfig.load(tmp_path / "written") == model.config
    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path / "written", output_loading_info=True)
    assert type(hf).__name__ == json.loads((folder / "config.json").read_text())["architectures"][0]
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set() and info["mismatched_keys"] == set()
    tokens = _tokens(2, 40)
    with torch.no_grad():
        assert (hf.eval()(tokens).logits - model(tokens)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "phi3"])
def test_packed_records_give_the_logits_each_record_has_alone(tmp_path, family):
    """SFT packs records in one row: positions restart and attention stays in each record, local windows included."""
    model = load_pretrained(make_hf_model(tmp_path / "base", **FAMILY_CASES[family]))
    lengths = [13, 20, 7]
    tokens = _tokens(1, sum(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)
    with torch.no_grad():
        packed = model(tokens, positions, segments)[0]
        alone = torch.cat([model(part)[0] for part in tokens.split(lengths, dim=1)])
    assert (packed - alone).abs().max().item() <= 1e-5


def _hf_config(folder, **changes) -> dict:
    _edit_config(folder, **changes)
    return json.loads((folder / "config.json").read_text())


def test_older_gemma_and_phi3_configs_give_the_same_models(tmp_path):
    """What transformers 4.x wrote: Gemma 2 without layer_types (it alternates), Gemma 3 with rope_theta,
    rope_local_base_freq, rope_scaling and sliding_window_pattern, Phi-3's longrope under its old name su."""
    tokens = _tokens(2, 30)
    cases = {
        "gemma2": dict(layer_types=None, hidden_act="gelu_pytorch_tanh"),
        "gemma3_text": dict(
            layer_types=None,
            sliding_window_pattern=3,
            rope_parameters=None,
            rope_theta=1e6,
            rope_local_base_freq=1e4,
            rope_scaling={"rope_type": "linear", "factor": 4.0},
        ),
        "phi3": dict(
            rope_parameters=None,
            rope_scaling={
                "type": "su",
                **{k: FAMILY_CASES["phi3"]["rope"][k] for k in ("short_factor", "long_factor")},
            },
        ),
    }
    for family, changes in cases.items():
        folder = make_hf_model(tmp_path / family, **FAMILY_CASES[family])
        with torch.no_grad():
            before = load_pretrained(folder)(tokens)
        _edit_config(folder, **changes)
        with torch.no_grad():
            assert torch.equal(load_pretrained(folder)(tokens), before), family


@pytest.mark.parametrize(
    ("family", "changes", "message"),
    [
        ("gemma3_text", dict(model_type="gemma3"), "train its text model's own folder \\(model_type gemma3_text\\)"),
        ("gemma3_text", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping 50.0 is not supported for gemma3"),
        ("gemma2", dict(use_bidirectional_attention=True), "use_bidirectional_attention true is not supported"),
        ("gemma2", dict(layer_types=["full_attention"]), "layer_types \\['full_attention'\\]: expected a list of 3"),
        ("gemma2", dict(hidden_activation="relu"), "hidden_activation 'relu' is not supported; expected one of silu"),
        ("phi3", dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "rope_type 'linear' is not supported"),
        ("olmo2", dict(attention_bias=True), "attention_bias true is not supported; expected false"),
        ("granite", dict(mlp_bias=True), "mlp_bias true is not supported; expected false"),
        ("granite", dict(residual_multiplier=0), "residual_multiplier 0: expected a positive finite number"),
    ],
)
def test_what_a_family_has_and_the_trainer_does_not_compute_is_refused_naming_the_key(
    tmp_path, family, changes, message
):
    folder = make_hf_model(tmp_path / "m", **FAMILY_CASES[family])
    _edit_config(folder, **changes)
    with pytest.raises(ModelLoadError, match="config.json: .*" + message):
        load_pretrained(folder)


def test_the_model_line_names_the_family_and_its_features(tmp_path):
    lines = {
        family: describe_folder(make_hf_model(tmp_path / family, **FAMILY_CASES[family])) for family in FAMILY_CASES
    }
    assert lines["gemma2"].startswith(
        "gemma2 (3 layers, dim 64, vocab 300, GQA 4/2, sliding window 8 on 1 of every 2 layers, "
        "soft-capping attention 4, logits 6, rope yarn, tied)"
    )
    assert (
        "sliding window 8 on 2 of every 3 layers, soft-capping logits 6, rope linear (global layers), "
        in lines["gemma3_text"]
    )
    assert "local rope base 10000, q/k norms per head" in lines["gemma3_text"]
    assert (
        "phi3 (2 layers, dim 64, vocab 300, GQA 4/2, sliding window 100, rope longrope, rotary 12/16 " in lines["phi3"]
    )
    assert "fused qkv_proj, gate_up_proj" in lines["phi3"]
    assert "olmo2 (2 layers, dim 64, vocab 300, GQA 4/2, rope yarn, q/k norms per projection)" in lines["olmo2"]
    assert "multipliers embedding 3, attention 0.2, residual 0.6, logits /2.5" in lines["granite"]
