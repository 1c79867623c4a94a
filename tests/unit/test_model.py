"""The model: presets, causality, grouped KV heads, tied output, init CLI, strict loading."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from astrai.common.model_folder import ModelConfig, ModelLoadError, num_parameters
from astrai.trainer.generation import cli as model_module
from astrai.trainer.models.native import Transformer
from astrai.trainer.models.weights import PRESETS, load_base_model, write_base_model


def test_presets_have_the_advertised_sizes():
    assert 0.8e6 <= num_parameters(PRESETS["tiny"]) <= 1.2e6
    assert 22e6 <= num_parameters(PRESETS["small"]) <= 28e6
    assert 115e6 <= num_parameters(PRESETS["base"]) <= 135e6


def test_logits_at_a_position_do_not_depend_on_later_tokens(one_thread):
    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"]).eval()
    tokens = torch.randint(0, 257, (2, 24))
    changed = tokens.clone()
    changed[:, 12:] = torch.randint(0, 257, (2, 12))
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert a.shape == (2, 24, PRESETS["tiny"].vocab_size)
    torch.testing.assert_close(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_grouped_kv_heads_shrink_the_key_value_projections(one_thread):
    config = dataclasses.replace(PRESETS["tiny"], n_kv_heads=2)
    model = Transformer(config)
    assert model.layers[0].attention.wk.weight.shape == (2 * config.head_size, config.dim)
    assert model(torch.randint(0, 257, (1, 8))).shape == (1, 8, config.vocab_size)


def test_tied_model_stores_one_embedding_untied_stores_two():
    tied = Transformer(PRESETS["tiny"]).state_dict()
    untied = Transformer(dataclasses.replace(PRESETS["tiny"], tie_embeddings=False)).state_dict()
    assert "output.weight" not in tied
    assert untied["output.weight"].shape == tied["tok_embeddings.weight"].shape
    # Rotary tables derive from the config and are never saved.
    assert not any("rope" in name for name in tied)


def test_activation_checkpointing_gives_the_same_gradients(one_thread):
    torch.manual_seed(0)
    tokens = torch.randint(0, 257, (2, 16))
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(1)
        model = Transformer(PRESETS["tiny"], activation_checkpointing=checkpointing)
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        grads.append(model.layers[0].attention.wq.weight.grad)
    torch.testing.assert_close(grads[0], grads[1])


def test_sequence_longer_than_max_seq_len_is_refused():
    model = Transformer(dataclasses.replace(PRESETS["tiny"], max_seq_len=8))
    said = r"length 9 exceeds the model's context of 8 tokens \(max_position_embeddings 8"
    with pytest.raises(ValueError, match=said):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_config_validation_shows_the_arithmetic():
    with pytest.raises(ValueError, match=r"dim\(128\) must be a multiple of n_heads\(3\)"):
        dataclasses.replace(PRESETS["tiny"], n_heads=3)
    with pytest.raises(ValueError, match="model_type is missing; expected one of llama, mistral"):
        ModelConfig.from_dict({"dim": 64, "depth": 2})


def test_init_cli_writes_a_loadable_model_and_is_reproducible(tmp_path, capsys):
    assert model_module.main(["init", str(tmp_path / "a"), "--preset", "tiny", "--vocab_size", "300"]) == 0
    assert "tiny model" in capsys.readouterr().out
    model_module.main(["init", str(tmp_path / "b"), "--preset", "tiny", "--vocab_size", "300"])
    config, state = load_base_model(tmp_path / "a")
    assert config.vocab_size == 300
    assert json.loads((tmp_path / "a" / "config.json").read_text())["vocab_size"] == 300
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    Transformer(config).load_state_dict(state)


def test_init_cli_sets_the_end_and_begin_token_ids_and_refuses_ids_outside_the_vocabulary(tmp_path, capsys):
    argv = ["init", str(tmp_path / "m"), "--preset", "tiny", "--vocab_size", "300"]
    assert model_module.main([*argv, "--eos_token_id", "256", "--bos_token_id", "1"]) == 0
    written = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (written["eos_token_id"], written["bos_token_id"]) == (256, 1)
    assert load_base_model(tmp_path / "m")[0].eos_token_id == 256
    assert model_module.main([*argv, "--force", "--eos_token_id", "300"]) == 2
    assert "--eos_token_id 300: expected a token id from 0 to 299 (vocab_size)" in capsys.readouterr().err
    assert json.loads((tmp_path / "m" / "config.json").read_text()) == written


def test_init_cli_does_not_overwrite_without_force(tmp_path, capsys):
    model_module.main(["init", str(tmp_path), "--preset", "tiny"])
    before = (tmp_path / "model.safetensors").read_bytes()
    assert model_module.main(["init", str(tmp_path), "--preset", "tiny", "--seed", "5"]) == 1
    assert "--force" in capsys.readouterr().err
    assert (tmp_path / "model.safetensors").read_bytes() == before
    assert model_module.main(["init", str(tmp_path), "--preset", "tiny", "--seed", "5", "--force"]) == 0
    assert (tmp_path / "model.safetensors").read_bytes() != before


def test_loading_names_the_tensor_that_does_not_fit(tmp_path):
    model_module.main(["init", str(tmp_path), "--preset", "tiny"])
    state = load_file(tmp_path / "model.safetensors")
    state["model.layers.1.mlp.gate_proj.weight"] = torch.zeros(7, 128)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(
        ModelLoadError,
        match=r"'model\.layers\.1\.mlp\.gate_proj\.weight' has shape \[7, 128\], config.json expects \[384, 128\]",
    ):
        load_base_model(tmp_path)

    del state["model.layers.1.mlp.gate_proj.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.1\.mlp\.gate_proj\.weight' is missing"):
        load_base_model(tmp_path)

    state["model.layers.1.mlp.gate_proj.weight"] = torch.zeros(384, 128)
    state["model.layers.1.self_attn.q_proj.bias"] = torch.zeros(128)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model\.layers\.1\.self_attn\.q_proj\.bias'"):
        load_base_model(tmp_path)


def test_loading_reports_a_damaged_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json: not found"):
        load_base_model(tmp_path)
    model_module.main(["init", str(tmp_path), "--preset", "tiny"])
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        load_base_model(tmp_path)
    model_module.main(["init", str(tmp_path), "--preset", "tiny", "--force"])
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_base_model(tmp_path)


def test_written_weights_are_readable_by_other_users(tmp_path):
    """safetensors makes owner-only files; the container may run as another user than the one who made the model."""
    write_base_model(tmp_path / "m", PRESETS["tiny"])
    mode = (tmp_path / "m" / "model.safetensors").stat().st_mode & 0o777
    assert mode == 0o666 & ~_current_umask()


def _current_umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current
