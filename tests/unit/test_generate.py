"""Sampling with the trainer's own model and its key/value cache, against transformers' generate."""

from __future__ import annotations

import pytest
import torch
from hf_folders import FAMILY_CASES, make_hf_model

from astrai.common.settings import Sampling
from astrai.model import main as model_main
from astrai.trainer.generation.decoding import generate, pick
from astrai.trainer.models.cache import KVCache
from astrai.trainer.models.weights import load_pretrained
from tests.support import transformers_generate

transformers = pytest.importorskip("transformers")

# Prompts of different lengths in one batch (so the shorter ones are padded).
PROMPTS = [[5, 17, 42, 7, 99, 3, 12], [8, 250], [61, 62, 63, 64]]
FOLDERS = {
    # GQA, untied output head.
    "llama": {"model_type": "llama", "kv_heads": 2},
    # Biases on q, k, v; tied embeddings.
    "qwen2": {"model_type": "qwen2", "kv_heads": 2, "tie": True},
    # Per-head norms of queries and keys, a head size of its own.
    "qwen3": {"model_type": "qwen3", "kv_heads": 1, "head_dim": 32, "tie": True},
    # Soft-capped scores and logits; prompt and completion outgrow the local window of every other layer.
    "gemma2": FAMILY_CASES["gemma2"],
    # Fused projections, partial rotary, longrope (within its original context, as transformers' generate keeps
    # it); prompt and completion outgrow its sliding window, which limits attention, not the length.
    "phi3": {**FAMILY_CASES["phi3"], "sliding_window": 8},
    # A sliding window in every layer, shorter than the longest prompt.
    "mistral": {"model_type": "mistral", "kv_heads": 2, "sliding_window": 5},
    # Local layers with a RoPE base of their own.
    "gemma3_text": FAMILY_CASES["gemma3_text"],
}


@pytest.fixture(scope="module", params=sorted(FOLDERS))
def folder(request, tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp(request.param) / "model", seed=11, **FOLDERS[request.param])


def _theirs(folder, prompts: list[list[int]], new: int, eos: int | None = None) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return transformers_generate(model, prompts, new, eos)


def test_greedy_equals_transformers_token_for_token_on_a_padded_batch(folder):
    ours = generate(load_pretrained(folder), PROMPTS, Sampling(max_new_tokens=12))
    assert ours == _theirs(folder, PROMPTS, 12)
    # Alone, each prompt gives the same completion as in the batch: padding changes nothing.
    assert [generate(load_pretrained(folder), [prompt], Sampling(max_new_tokens=12))[0] for prompt in PROMPTS] == ours


def test_a_row_ends_at_its_stop_token_and_the_others_go_on(folder):
    model = load_pretrained(folder)
    free = generate(model, PROMPTS, Sampling(max_new_tokens=10))
    stop = free[1][3]  # a token the second row produces
    stopped = generate(model, PROMPTS, Sampling(max_new_tokens=10), stop={stop})
    for row, full in zip(stopped, free, strict=True):
        cut = full.index(stop) + 1 if stop in full else len(full)
        assert row == full[:cut]
    assert stopped == _theirs(folder, PROMPTS, 10, eos=stop)


def test_the_cache_gives_the_logits_of_the_whole_sequence(folder):
    model = load_pretrained(folder)
    tokens = torch.tensor([PROMPTS[0] + [4, 9, 1]])
    whole = model(tokens)[0]
    cache = KVCache(model.config, 1, 16, torch.device("cpu"), torch.float32)
    first = model.decode(tokens[:, :7], torch.ones(1, 7, dtype=torch.bool), cache)
    steps = [model.decode(tokens[:, i : i + 1], torch.ones(1, 1, dtype=torch.bool), cache) for i in range(7, 10)]
    torch.testing.assert_close(first[0], whole[6], rtol=1e-5, atol=1e-5)
    for offset, logits in enumerate(steps):
        torch.testing.assert_close(logits[0], whole[7 + offset], rtol=1e-5, atol=1e-5)


def test_sampling_is_a_function_of_the_generator_and_keeps_to_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    draws = {}
    for name, sampling in {
        "all": Sampling(temperature=1.0),
        "top_k": Sampling(temperature=1.0, top_k=2),
        "top_p": Sampling(temperature=1.0, top_p=0.8),
    }.items():
        first = pick(logits, sampling, torch.Generator().manual_seed(3))
        assert torch.equal(first, pick(logits, sampling, torch.Generator().manual_seed(3)))
        draws[name] = torch.bincount(first, minlength=4).float() / len(first)
    assert (draws["all"] - torch.tensor([0.5, 0.3, 0.15, 0.05])).abs().max() < 0.03
    assert draws["top_k"][2:].sum() == 0 and abs(draws["top_k"][0] - 0.5 / 0.8) < 0.03
    # 0.5 + 0.3 reaches 0.8: the third and fourth tokens are cut.
    assert draws["top_p"][2:].sum() == 0
    assert torch.equal(pick(logits[:2], Sampling()), torch.tensor([0, 0]))


def test_settings_and_prompts_it_cannot_take_are_refused(folder):
    for bad in ({"max_new_tokens": 0}, {"temperature": -1}, {"temperature": 1e-45}, {"top_k": -2}, {"top_p": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Sampling(**bad)
    model = load_pretrained(folder)
    with pytest.raises(ValueError, match="at least one token"):
        generate(model, [[1], []], Sampling())
    with pytest.raises(ValueError, match="need 259 positions; the model takes at most 256"):
        generate(model, [[1] * 250], Sampling(max_new_tokens=10))
    assert len(generate(model, [[1] * 247], Sampling(max_new_tokens=10))[0]) == 10  # the last is never fed back


def test_the_command_completes_a_chat_prompt_as_transformers_does(tmp_path, capsys):
    """`python -m astrai.model generate DIR --chat`: the folder's template and tokenizer, greedy, stopped at the
    end of the assistant's turn; the same text transformers gives. A folder without a tokenizer is refused."""
    import json
    import shutil

    from chat_data import make_chat_world

    from tests.support import run_python

    world = make_chat_world(tmp_path / "world")
    vocab = len(json.loads((world.tokenizer / "tokenizer.json").read_text())["model"]["vocab"])
    folder = make_hf_model(tmp_path / "model", vocab_size=vocab + 8, seed=5)
    for path in world.tokenizer.iterdir():
        shutil.copy(path, folder / path.name)
    done = run_python(
        "-m", "astrai.model", "generate", str(folder), "--chat", "--prompt", "cat sat", "--max_new_tokens", "8"
    )
    assert done.returncode == 0, done.stderr

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "cat sat"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    out = model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=tokenizer.eos_token_id)
    expected = tokenizer.decode(out[0, prompt.shape[1] :], skip_special_tokens=True)
    assert done.stdout == expected + "\n" and expected.strip(), (done.stdout, expected)

    small = make_hf_model(tmp_path / "small vocab", vocab_size=64, seed=5)
    assert model_main(["generate", str(small), "--tokenizer", str(folder), "--prompt", "cat sat"]) == 1
    assert "tokens and the model 64: it is not this model's tokenizer" in capsys.readouterr().err
    (folder / "tokenizer.json").unlink()
    assert model_main(["generate", str(folder), "--prompt", "x"]) == 1
    assert "holds no tokenizer.json" in capsys.readouterr().err
    assert model_main(["generate", str(folder), "--prompt", "x", "--top_p", "1e-3", "--top_k", "-1"]) == 2
    assert "--top_k: expected an integer >= 0" in capsys.readouterr().err
    assert model_main(["generate", str(folder / "nothing"), "--prompt", "x"]) == 1
    assert "not a folder" in capsys.readouterr().err


def test_a_model_of_byte_level_data_generates_with_the_byte_tokenizer(tmp_path, capsys):
    """The demo's models: data prepared without --tokenizer, so no tokenizer.json anywhere; --tokenizer bytes."""
    from astrai.trainer.models.weights import PRESETS, write_base_model

    folder = tmp_path / "tiny é $x"
    write_base_model(folder, PRESETS["tiny"], seed=0)
    assert model_main(["generate", str(folder), "--prompt", "héllo", "--max_new_tokens", "5"]) == 1
    assert "--tokenizer bytes" in capsys.readouterr().err
    args = ["generate", str(folder), "--prompt", "héllo", "--max_new_tokens", "5", "--tokenizer", "bytes"]
    assert model_main([*args, "--temperature", "0.8", "--seed", "3"]) == 0
    sampled = capsys.readouterr().out
    assert model_main([*args, "--temperature", "0.8", "--seed", "3"]) == 0
    assert capsys.readouterr().out == sampled  # the seed fixes the draws
    expected = generate(load_pretrained(folder), [list("héllo".encode())], Sampling(max_new_tokens=5), {256})[0]
    assert model_main(args) == 0
    assert capsys.readouterr().out == bytes(t for t in expected if t < 256).decode("utf-8", "replace") + "\n"
    assert model_main([*args, "--chat"]) == 1
    assert "byte-level tokenizer has no chat template" in capsys.readouterr().err
    assert model_main(["generate", str(folder), "--prompt", "", "--tokenizer", "bytes"]) == 2
    assert "--prompt gives no token" in capsys.readouterr().err
    job = tmp_path / "job"
    (job / "epoch_0_step_5").mkdir(parents=True)
    assert model_main(["generate", str(job), "--prompt", "x", "--tokenizer", "bytes"]) == 1
    assert "holds checkpoints: give one of them" in capsys.readouterr().err
    (job / "adapter_config.json").write_text("{}")
    assert model_main(["generate", str(job), "--prompt", "x"]) == 1
    assert "is a PEFT adapter folder" in capsys.readouterr().err
