"""The generation engine on CPU: its tokens against transformers' and against a plain loop without a cache, at the
batch sizes rollouts use; a compiled decode step against the eager one; how often the host is asked to wait; and a
round split for memory sampling what the whole round samples."""

from __future__ import annotations

import random

import pytest
import torch
from hf_folders import make_hf_model

from astrai.common.settings import Sampling
from astrai.trainer import decoding
from astrai.trainer.decoding import DecodeEngine, Draws, pick
from astrai.trainer.model import load_pretrained
from tests.support import transformers_generate

transformers = pytest.importorskip("transformers")

FOLDERS = {
    "llama": {"model_type": "llama", "kv_heads": 2},
    "qwen2": {"model_type": "qwen2", "kv_heads": 2, "tie": True},
    "qwen3": {"model_type": "qwen3", "kv_heads": 1, "head_dim": 32, "tie": True},
}


@pytest.fixture(scope="module", params=sorted(FOLDERS))
def folder(request, tmp_path_factory):
    return make_hf_model(tmp_path_factory.mktemp(request.param) / "model", seed=5, **FOLDERS[request.param])


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 300) for _ in range(rng.randrange(1, 12))] for _ in range(count)]


@pytest.mark.parametrize("batch", [1, 7, 64])
def test_greedy_tokens_equal_transformers_at_the_batch_sizes_rollouts_use(folder, batch):
    prompts = _prompts(batch, seed=batch)
    ours = DecodeEngine(load_pretrained(folder)).generate(prompts, Sampling(max_new_tokens=9))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert ours == transformers_generate(theirs, prompts, 9)


def _plain_loop(model, prompts, sampling: Sampling, generator) -> list[list[int]]:
    """Sampling as the engine before this one did it: one draw over the batch per token, every row's logits from
    its whole sequence so far (no cache at all), until max_new_tokens."""
    made = [[] for _ in prompts]
    for _ in range(sampling.max_new_tokens):
        rows = [prompt + tokens for prompt, tokens in zip(prompts, made, strict=True)]
        width = max(len(row) for row in rows)
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        positions = torch.zeros(len(rows), width, dtype=torch.long)
        segments = torch.zeros(len(rows), width, dtype=torch.long)
        for index, row in enumerate(rows):
            tokens[index, width - len(row) :] = torch.tensor(row)
            positions[index, width - len(row) :] = torch.arange(len(row))
            segments[index, width - len(row) :] = 1  # the padding is a segment of its own: nothing real sees it
        with torch.no_grad():
            logits = model(tokens, positions, segments)[:, -1]
        for row, token in zip(made, pick(logits, sampling, generator).tolist(), strict=True):
            row.append(token)
    return made


def test_sampled_tokens_equal_a_plain_loop_for_the_same_seed(folder):
    model, prompts = load_pretrained(folder), _prompts(7, seed=3)
    for sampling in (Sampling(8, temperature=1.0), Sampling(8, temperature=0.7, top_k=20, top_p=0.9)):
        ours = DecodeEngine(model).generate(prompts, sampling, draws=[Draws(7, torch.Generator().manual_seed(4))])
        assert ours == _plain_loop(model, prompts, sampling, torch.Generator().manual_seed(4))


def test_groups_of_rows_draw_from_their_own_generators_and_a_split_for_memory_changes_nothing(folder, monkeypatch):
    model, prompts, sampling = load_pretrained(folder), _prompts(6, seed=8), Sampling(6, temperature=1.0)

    def draws():
        return [Draws(2, torch.Generator().manual_seed(seed)) for seed in (1, 2, 3)]

    whole = DecodeEngine(model).generate(prompts, sampling, draws=draws())
    alone = [DecodeEngine(model).generate(prompts[2 * i : 2 * i + 2], sampling, draws=[draws()[i]]) for i in range(3)]
    assert whole == [row for part in alone for row in part]
    # Room for the cache of two rows only: the round goes in three parts, drawing what it drew at once.
    config = model.config
    per_row = 2 * config.n_layers * config.n_kv_heads * config.head_size * decoding.CAPACITY_STEP * 4
    monkeypatch.setattr(decoding, "free_memory", lambda device: int(2.5 * per_row / decoding.MEMORY_HEADROOM))
    engine = DecodeEngine(model)
    assert engine.generate(prompts, sampling, draws=draws()) == whole
    assert len(engine._steps) == 1  # parts of one size share one cache
    monkeypatch.setattr(decoding, "free_memory", lambda device: int(per_row / 2))
    with pytest.raises(MemoryError, match="does not fit"):
        DecodeEngine(model).generate(prompts, sampling, draws=draws())


def test_the_host_is_asked_whether_every_row_ended_once_per_stop_check_interval(folder, monkeypatch):
    asked = []
    original = decoding._all_done

    def counting(done, together):
        asked.append(1)
        return original(done, together)

    monkeypatch.setattr(decoding, "_all_done", counting)
    engine = DecodeEngine(load_pretrained(folder))
    engine.generate(_prompts(4), Sampling(max_new_tokens=64))
    assert 0 < len(asked) <= 64 // decoding.STOP_CHECK_EVERY


def test_generation_stops_early_once_every_row_has_ended(folder):
    model, prompts = load_pretrained(folder), _prompts(3, seed=1)
    free = DecodeEngine(model).generate(prompts, Sampling(max_new_tokens=40))
    stop = {row[0] for row in free}  # every row ends at its first token
    assert DecodeEngine(model).generate(prompts, Sampling(max_new_tokens=40), stop) == [row[:1] for row in free]


@pytest.mark.slow
def test_a_compiled_decode_step_gives_the_eager_steps_tokens(tmp_path):
    model = load_pretrained(make_hf_model(tmp_path / "m", kv_heads=2, seed=2))
    prompts, sampling = _prompts(5, seed=6), Sampling(max_new_tokens=10)
    eager = DecodeEngine(model).generate(prompts, sampling)
    compiled = DecodeEngine(model, compile=True)
    assert compiled.generate(prompts, sampling) == eager
    assert compiled.generate(prompts[:3] + prompts[:2], sampling) == eager[:3] + eager[:2]  # the same step, again


def test_under_autocast_the_steps_read_a_copy_of_the_weights_that_follows_the_model(folder):
    """Float32 weights under bf16 autocast (full fine-tuning on a GPU; here a CPU's autocast): the engine decodes with
    a bf16 copy of them, taken again at every call, so a step of training shows in the next completions."""
    model, prompts = load_pretrained(folder), _prompts(3, seed=2)
    engine = DecodeEngine(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        before = engine.generate(prompts, Sampling(max_new_tokens=6))
        assert engine._copy is not None and engine._copy.layers[0].attention.wq.weight.dtype == torch.bfloat16
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(-1.0)
        after = engine.generate(prompts, Sampling(max_new_tokens=6))
        fresh = DecodeEngine(model).generate(prompts, Sampling(max_new_tokens=6))
    assert after == fresh and after != before
    assert model.layers[0].attention.wq.weight.dtype == torch.float32  # the model itself is left as it is
