"""The generation engine on CPU: its tokens against transformers' and against a plain loop without a cache, at the
batch sizes rollouts use; a compiled decode step against the eager one; how often the host is asked to wait; and a
round split for memory sampling what the whole round samples."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
import torch.utils._pytree as pytree
from hf_folders import make_hf_model
from torch.utils._python_dispatch import TorchDispatchMode

from astrai.common.memory import CAPACITY_STEP, DECODE_CACHE_SHARE, DEVICE_USABLE_SHARE, kv_cache_bytes
from astrai.common.settings import LoRASettings, Sampling
from astrai.trainer.generation import decoding
from astrai.trainer.generation.decoding import DecodeEngine, Draws, draw, pick
from astrai.trainer.models.lora import add_adapters, hold_base_in
from astrai.trainer.models.rope import rotary_tables
from astrai.trainer.models.weights import load_pretrained
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


def test_groups_of_rows_draw_from_their_own_generators_and_a_split_in_parts_changes_nothing(folder, monkeypatch):
    model, prompts, sampling = load_pretrained(folder), _prompts(6, seed=8), Sampling(6, temperature=1.0)

    def draws():
        return [Draws(2, torch.Generator().manual_seed(seed)) for seed in (1, 2, 3)]

    whole = DecodeEngine(model).generate(prompts, sampling, draws=draws())
    alone = [DecodeEngine(model).generate(prompts[2 * i : 2 * i + 2], sampling, draws=[draws()[i]]) for i in range(3)]
    assert whole == [row for part in alone for row in part]
    # Parts of two rows (as a plan on a small device fixes them): the round goes in three parts, drawing what it drew
    # at once, through one step.
    engine = DecodeEngine(model, rows_per_part=2)
    assert engine.generate(prompts, sampling, draws=draws()) == whole
    assert len(engine._steps) == 1
    with pytest.raises(MemoryError, match="a group of 2 rows drawn by one generator does not fit a part of 1 rows"):
        DecodeEngine(model, rows_per_part=1).generate(prompts, sampling, draws=draws())
    # Greedy draws nothing: its rows go in parts of any size.
    greedy = Sampling(6)
    assert DecodeEngine(model, rows_per_part=1).generate(prompts, greedy) == DecodeEngine(model).generate(
        prompts, greedy
    )
    # A cache that does not fit what the device has free now is refused, naming the keys that shrink it.
    monkeypatch.setattr(decoding, "free_memory", lambda device: 1000)
    with pytest.raises(MemoryError, match="does not fit the 0.00 GiB free on cpu; lower batch_per_device"):
        DecodeEngine(model).generate(prompts, sampling, draws=draws())


def test_the_split_of_a_round_follows_the_plan_not_the_memory_free_at_the_moment(folder, monkeypatch):
    """What a part takes is a function of the device's total memory: a resumed run, with other free memory, splits
    its rounds (and so computes its batches) as the uninterrupted run did."""
    model, prompts = load_pretrained(folder), _prompts(6, seed=8)
    sizes = []
    original = DecodeEngine._generate_part

    def part(self, model, prompts, *args):
        sizes.append(len(prompts))
        return original(self, model, prompts, *args)

    monkeypatch.setattr(DecodeEngine, "_generate_part", part)
    config = model.config
    row = kv_cache_bytes(config, 1, CAPACITY_STEP, 4)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    # A device whose usable memory leaves the weights room for exactly two rows' caches.
    total = int((held + 2 * row / DECODE_CACHE_SHARE) / DEVICE_USABLE_SHARE) + 1
    monkeypatch.setattr(decoding, "total_memory", lambda device: total)
    for free in (10**12, 10**9):
        monkeypatch.setattr(decoding, "free_memory", lambda device, free=free: free)
        DecodeEngine(model).generate(prompts, Sampling(4), draws=[Draws(1) for _ in prompts])
    assert sizes == [2, 2, 2, 2, 2, 2]


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


class _Reads(TorchDispatchMode):
    """The storages every op reads that no op under this mode made: what a captured step would read from outside."""

    def __init__(self):
        super().__init__()
        self.made: set[int] = set()
        self.read: dict[int, str] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for tensor in pytree.tree_leaves((args, kwargs)):
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in self.made:
                self.read[tensor.untyped_storage().data_ptr()] = f"{func} {tuple(tensor.shape)} {tensor.dtype}"
        out = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.made.add(tensor.untyped_storage().data_ptr())
        return out


def _foreign_reads(step, token: torch.Tensor, run=decoding._Step.run) -> list[str]:
    """What one run of a decode step reads that the step does not own (nothing, for a step a graph may capture); the
    token it is given is copied into its own buffer before the part a graph captures."""
    owned = {tensor.untyped_storage().data_ptr() for tensor in [*step.owned(), token]}
    with _Reads() as reads:
        run(step, token)
    return [what for pointer, what in reads.read.items() if pointer not in owned]


def test_a_step_reads_only_tensors_it_owns_after_longer_calls_replaced_the_models_rotary_tables(folder):
    """A captured step replays against the addresses it was captured with: the rotary tables it reads are its own,
    not the model's (which a longer sequence replaces), and an old step still computes what an eager pass does."""
    model = load_pretrained(folder)
    engine = DecodeEngine(model)
    engine.generate(_prompts(3, seed=1), Sampling(max_new_tokens=4))
    (first,) = engine._steps.values()
    tables = {kind: [t.data_ptr() for t in pair] for kind, pair in first.cache.rotary.items()}
    long_prompts = [[7] * (3 * CAPACITY_STEP), [9] * 5, [11] * 8]
    engine.generate(long_prompts, Sampling(max_new_tokens=4))  # a capacity of 4 steps: the step grows
    model(torch.tensor([[5] * (4 * CAPACITY_STEP)]))  # and the model's own tables grow past it
    (grown,) = engine._steps.values()
    assert grown is not first and grown.cache.capacity == 4 * CAPACITY_STEP  # one step per batch size
    assert {kind: [t.data_ptr() for t in pair] for kind, pair in first.cache.rotary.items()} == tables
    cos, sin = rotary_tables(model.config, CAPACITY_STEP)
    assert torch.equal(first.cache.rotary[False][0], cos) and torch.equal(first.cache.rotary[False][1], sin)
    # The old step, run again, reads nothing it does not own and gives the logits of a plain forward pass.
    prompt = [3, 1, 4, 1, 5]
    with torch.no_grad():
        first.cache.reset()
        model(torch.tensor([prompt] * 3), cache=first.cache, real=torch.ones(3, 5, dtype=torch.bool))
        assert _foreign_reads(first, torch.tensor([9, 9, 9])) == []
        expected = model(torch.tensor([prompt + [9]]))[0, -1]
        first.cache.reset()
        model(torch.tensor([prompt] * 3), cache=first.cache, real=torch.ones(3, 5, dtype=torch.bool))
        assert torch.allclose(first.run(torch.tensor([9, 9, 9]))[0], expected, atol=1e-5)


def test_with_lora_under_autocast_the_steps_read_no_cached_cast_and_follow_an_optimizer_step(folder):
    """LoRA's float32 adapters beside a bfloat16 base, under bfloat16 autocast (LoRA on a GPU; here a CPU's autocast):
    the decode steps cast the adapters themselves at every step (autocast's cache of casts is off), so a step never
    reads a cast that autocast frees when the caller's region ends, nor a stale one after an optimizer step."""
    model, prompts, sampling = load_pretrained(folder), _prompts(3, seed=4), Sampling(max_new_tokens=8)
    add_adapters(model, LoRASettings(4, 8.0), torch.Generator().manual_seed(0))
    hold_base_in(model, torch.bfloat16)
    adapters = [param for param in model.parameters() if param.requires_grad]
    optimizer = torch.optim.SGD(adapters, lr=50.0)
    engine = DecodeEngine(model)
    reads = []
    original = decoding._Step.run

    def run(step, chosen):
        reads.extend(_foreign_reads(step, chosen, original))
        step.cache.slot.sub_(1), step.cache.positions.sub_(1)  # the token again, as if the step had not run
        return original(step, chosen)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        before = engine.generate(prompts, sampling)
        # A training step in the same autocast region: its forward pass caches casts of the adapters.
        model(torch.tensor(prompts[:1])).float().logsumexp(-1).mean().backward()
        optimizer.step()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(decoding._Step, "run", run)
            after = engine.generate(prompts, sampling)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a new region: nothing cached from before the step
        fresh = DecodeEngine(model).generate(prompts, sampling)
    assert engine._copy is None  # the bfloat16 base is decoded as it is: no second copy of it
    assert after == fresh and after != before
    assert reads == []


@pytest.mark.parametrize("shape", [(1, 7), (5, 512), (64, 32000)])
def test_a_draw_is_multinomials_own_bit_for_bit_without_its_host_reads(shape):
    for seed in range(200):
        logits = torch.randn(shape, generator=torch.Generator().manual_seed(10_000 + seed)) * (1 + seed % 5)
        temperature = (0.3, 0.7, 1.0, 1.5)[seed % 4]
        probabilities = (logits / temperature).softmax(dim=-1)
        if seed % 3 == 0:  # a top-k-like cut: zeros where the filters left tokens out
            probabilities = probabilities.masked_fill(probabilities < probabilities.median(), 0.0)
        ours = draw(probabilities, torch.Generator().manual_seed(seed))
        theirs = torch.multinomial(probabilities, 1, generator=torch.Generator().manual_seed(seed)).squeeze(-1)
        assert torch.equal(ours, theirs), (shape, seed)


def test_top_k_then_top_p_keep_what_the_whole_vocabulary_sorted_keeps():
    """With top_k, only its k logits are sorted for top_p: the tokens kept (and so the draws) are those of filtering
    with the whole vocabulary sorted, transformers' order (temperature, top_k, then top_p)."""
    for seed in range(50):
        logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(seed)) * 3
        sampling = Sampling(1, temperature=0.8, top_k=40, top_p=0.7)
        scaled = logits / 0.8
        kth = torch.topk(scaled, 40).values[:, -1:]
        masked = scaled.masked_fill(scaled < kth, float("-inf"))
        ordered, order = torch.sort(masked, descending=True)
        probabilities = ordered.softmax(-1)
        removed = (probabilities.cumsum(-1) - probabilities) >= 0.7
        expected = masked.masked_fill(removed.scatter(-1, order, removed), float("-inf")).softmax(-1)
        ours = pick(logits, sampling, torch.Generator().manual_seed(seed))
        assert torch.equal(ours, draw(expected, torch.Generator().manual_seed(seed)))


def test_a_step_is_captured_on_a_side_stream_with_thread_local_errors_and_an_empty_cache(folder, monkeypatch):
    """The capture protocol, with CUDA's calls recorded (no GPU here): warm-up steps on a side stream, the cache
    emptied, the capture with capture_error_mode thread_local (the DataLoader's pin-memory thread cannot void it), the
    cache emptied again; a replay gives the captured step's logits buffer."""
    calls = []

    class Graph:
        def replay(self):
            calls.append("replay")

    @contextlib.contextmanager
    def graph(g, **options):
        calls.append(("capture", options, int(step_cache.slot)))
        yield

    @contextlib.contextmanager
    def stream(s):
        calls.append("side stream")
        yield

    class Stream:
        def wait_stream(self, other):
            pass

    for name, value in {"CUDAGraph": Graph, "graph": graph, "stream": stream, "Stream": Stream}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    model = load_pretrained(folder)
    cache = decoding.KVCache(model.config, 2, CAPACITY_STEP, torch.device("cpu"), torch.float32)
    step_cache = cache
    step = decoding._Step(model, cache, graphs=True, compile=False)
    assert calls == ["side stream", ("capture", {"capture_error_mode": "thread_local"}, 0)]
    assert int(cache.slot) == 0 and not cache.visible.any()
    assert step.run(torch.tensor([1, 2])) is step.logits and calls[-1] == "replay"


@pytest.mark.slow
def test_a_compiled_step_compiles_once_per_batch_size_whatever_the_prompt_lengths(tmp_path, monkeypatch):
    model = load_pretrained(make_hf_model(tmp_path / "m", kv_heads=2, seed=2))
    compiled = []
    real_compile = torch.compile

    def counting(fn, **options):
        def backend(graph, inputs):
            compiled.append(len(inputs))
            return graph.forward

        return real_compile(fn, backend=backend, **options)

    monkeypatch.setattr(torch, "compile", counting)
    torch._dynamo.reset()
    engine = DecodeEngine(model, compile=True, capacity=2 * CAPACITY_STEP)
    for length in (3, 9, 30, 70, 5):  # prompt lengths of rounds that need 1 or 2 capacity steps
        engine.generate([[7] * length, [8] * (length // 2 + 1)], Sampling(max_new_tokens=6))
    engine.generate([[7] * 4] * 3, Sampling(max_new_tokens=6))  # a second batch size
    assert len(compiled) == 2 and len(engine._steps) == 2
