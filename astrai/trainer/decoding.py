"""The generation engine: sampling completions from the trainer's own model, at the speed the device allows.

Prompts of different lengths go in one batch, padded on the left so that every row's next token is in the last
column. Each row's positions count its own tokens only, and no query sees a padding key, so a row samples what it
would sample alone. Settings follow ``transformers``' ``generate``: ``temperature`` 0 is greedy (on the same prompt
tokens its output equals ``generate(do_sample=False)``), otherwise the logits are divided by the temperature, cut to
the ``top_k`` most likely tokens and to the smallest set whose probability reaches ``top_p``, and a token is drawn.
A row ends at any of the ``stop`` tokens (which it keeps), or at ``max_new_tokens``.

How a call runs (:meth:`DecodeEngine.generate`):

1. The rows are split only where the device's free memory cannot hold the key/value cache of them all (measured,
   with the cache's size worked out from the model's shape), and only between groups of rows that draw from one
   generator, so the split never changes what is drawn.
2. Each part's prompts go through one batched forward pass (the prefill) into a cache of fixed capacity.
3. Each new token is one decode step (:meth:`astrai.trainer.model.Transformer.decode_step`): device work on the same
   buffers every time. On CUDA (one process, or DDP) the step is captured once as a CUDA graph per batch size and
   capacity, and replayed: a step costs one launch, not one per kernel (not a mixture of experts, whose shapes
   depend on the routing, nor a RoPE that changes with the length: those steps run eagerly). With ``compile`` the
   step is compiled with ``torch.compile`` first (fused kernels). The next token is chosen on the device
   (:func:`pick`); finished rows are tracked there too, and the host asks whether every row has ended only every
   :data:`STOP_CHECK_EVERY` tokens.
4. Under autocast with float32 weights (full fine-tuning on a GPU), the steps read a copy of the weights in the
   autocast dtype, refreshed at each call, instead of casting every weight at every step.

Under FSDP every rank holds a shard of the weights and gathers them in each forward pass: the ranks generate in
step (``together``: they agree when to stop, and on how many parts), in eager mode.

Randomness comes only from the ``torch.Generator``s given, each drawing for its own rows, so a run that seeds
them from its seed and step samples the same completions after a resume.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import time
from dataclasses import dataclass

import torch

from astrai.common.settings import Sampling
from astrai.trainer.compiling import failed_in_compiler
from astrai.trainer.model import KVCache

STOP_CHECK_EVERY = 16
"""Tokens between two host reads of whether every row has ended (the only host synchronisation of a decode)."""
CAPACITY_STEP = 64
"""Caches (and captured steps) are sized in steps of this many positions, so calls of nearby lengths share them."""
MEMORY_HEADROOM = 0.8
"""The share of the measured free memory the caches of one part may take."""


def pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row (B,) from its logits (B, vocab)."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        probabilities = ordered.softmax(dim=-1)
        # Drop a token once the more likely ones before it already reach top_p (the most likely always stays).
        before = probabilities.cumsum(dim=-1) - probabilities
        ordered = ordered.masked_fill(before >= sampling.top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


@dataclass(frozen=True)
class Draws:
    """``rows`` consecutive rows whose tokens one generator draws (None: the default generator; greedy needs none)."""

    rows: int
    generator: torch.Generator | None = None


def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    sampling: Sampling,
    stop: set[int] | frozenset[int] = frozenset(),
    generator: torch.Generator | None = None,
    together=None,
) -> list[list[int]]:
    """The completion of each prompt (token ids, ending with its stop token when it met one), by a one-off
    :class:`DecodeEngine` (eager: nothing captured or compiled)."""
    engine = DecodeEngine(model, together=together, graphs=False)
    return engine.generate(prompts, sampling, stop, [Draws(len(prompts), generator)])


class DecodeEngine:
    """Generation with one model, keeping what it builds (caches, captured steps, the weights' copy) for the next
    call: an ``online_grpo`` run makes one and calls it every step.

    ``together``: the process group of ranks that generate in step (FSDP). ``graphs``: capture decode steps as CUDA
    graphs (None: on CUDA unless ``together``). ``compile``: compile the decode step with torch.compile first.
    """

    def __init__(self, model: torch.nn.Module, *, together=None, graphs: bool | None = None, compile: bool = False):
        self.model = model
        self.inner = getattr(model, "module", model)  # DDP's wrapped model; FSDP's is the model itself
        self.together = together
        self.device = self.inner.norm.weight.device
        cuda = self.device.type == "cuda"
        # A RoPE that changes with the length (dynamic NTK, longrope) reads the longest row at every step; a
        # mixture of experts' groups of tokens per expert have sizes known only on the device.
        config = self.inner.config
        capturable = cuda and together is None and not config.rope_depends_on_length and not config.n_experts
        self.graphs = capturable if graphs is None else graphs
        if self.graphs and not capturable:
            raise ValueError(
                "CUDA graphs need a CUDA model that is not sharded (FSDP generates eagerly), whose RoPE does not "
                "change with the length and that has no mixture of experts"
            )
        self.compile = compile
        self._copy: torch.nn.Module | None = None
        self._steps: dict[tuple[int, int, torch.dtype | None], _Step] = {}
        self.capture_seconds = 0.0
        """Time spent compiling and capturing decode steps so far (the first call of each shape pays it)."""

    # The call -----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        sampling: Sampling,
        stop: set[int] | frozenset[int] = frozenset(),
        draws: list[Draws] | None = None,
    ) -> list[list[int]]:
        """The completion of each prompt; ``draws`` say which generator draws for which rows (in order)."""
        config = self.inner.config
        limit = min(config.max_seq_len, config.sliding_window or config.max_seq_len)
        draws, capacity = checked_round(prompts, sampling, draws, limit)
        sized = min(limit, -(-capacity // CAPACITY_STEP) * CAPACITY_STEP)
        model = self._decoding_model()
        completions, start = [], 0
        with _blocks_uncompiled(model):  # the training's compiled blocks would recompile for every decode shape
            for part in self._parts(draws, sized):
                rows = sum(draw.rows for draw in part)
                completions += self._generate_part(model, prompts[start : start + rows], sampling, stop, part, sized)
                start += rows
        return completions

    def _generate_part(self, model, prompts, sampling: Sampling, stop, draws: list[Draws], capacity: int):
        batch = len(prompts)
        tokens, real = left_padded(prompts)
        step = self._step(model, batch, capacity)
        step.cache.reset()
        logits = model(tokens.to(self.device), cache=step.cache, real=real.to(self.device))
        stops = torch.tensor(sorted(stop), dtype=torch.long, device=self.device)
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)
        made = torch.empty(batch, sampling.max_new_tokens, dtype=torch.long, device=self.device)
        count = 0
        while True:
            chosen = pick_rows(logits, sampling, draws).masked_fill(done, 0)
            made[:, count] = chosen
            count += 1
            done = done | torch.isin(chosen, stops)
            if count == sampling.max_new_tokens:
                break
            if count % STOP_CHECK_EVERY == 0 and _all_done(done, self.together):
                break
            logits = step.run(chosen)
        return [until_stop(row, stop) for row in made[:, :count].tolist()]

    # What a call builds -------------------------------------------------------------------------------------

    def _decoding_model(self) -> torch.nn.Module:
        """The model the steps run: under autocast with float32 linear weights (and not sharded), a copy of it in
        the autocast dtype, refreshed from the model now; else the model itself."""
        dtype = torch.get_autocast_dtype(self.device.type) if torch.is_autocast_enabled(self.device.type) else None
        weight = next(param for param in self.inner.layers[0].parameters() if param.dim() >= 2)
        if dtype is None or weight.dtype == dtype or self.together is not None:
            return self.model if self.together is not None else self.inner
        if self._copy is None:
            with _blocks_uncompiled(self.inner):  # a compiled block's wrapper is not copied
                self._copy = _inference_copy(self.inner, dtype)
        for copied, original in zip(self._copy.parameters(), self.inner.parameters(), strict=True):
            copied.copy_(original.detach())  # in place: captured steps keep reading the same tensors
        return self._copy

    def _step(self, model, batch: int, capacity: int) -> _Step:
        """The decode step of ``batch`` rows and ``capacity`` positions: made (and captured) once, then reused."""
        dtype = self._cache_dtype()
        key = (batch, capacity, dtype)
        step = self._steps.get(key)
        if step is None:
            cache = KVCache(self.inner.config, batch, capacity, self.device, dtype)
            self.inner.prepare_decode(capacity, self.device)
            if self._copy is not None:
                self._copy.prepare_decode(capacity, self.device)
            step = _Step(model, cache, self.graphs, self.compile)
            self.capture_seconds += step.capture_seconds
            self._steps[key] = step
        return step

    def _cache_dtype(self) -> torch.dtype:
        """What the keys and values come out in: the autocast dtype, else the model's."""
        if torch.is_autocast_enabled(self.device.type):
            return torch.get_autocast_dtype(self.device.type)
        return self.inner.norm.weight.dtype

    def _parts(self, draws: list[Draws], capacity: int) -> list[list[Draws]]:
        """The draws split into parts whose caches fit the free memory (under FSDP, as many parts on every rank)."""
        config = self.inner.config
        itemsize = self._cache_dtype().itemsize
        per_row = 2 * config.n_layers * config.n_kv_heads * config.head_size * capacity * itemsize
        rows = sum(draw.rows for draw in draws)
        free = free_memory(self.device) * MEMORY_HEADROOM
        parts = max(1, min(len(draws), -(-int(per_row * rows) // max(int(free), 1))))
        if self.together is not None:
            agreed = torch.tensor([parts], dtype=torch.int64)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX, group=self.together)
            parts = int(agreed)
        if parts > len(draws) or per_row * max(draw.rows for draw in draws) > free:
            raise MemoryError(
                f"a key/value cache of {max(d.rows for d in draws)} rows x {capacity} positions "
                f"({per_row * max(d.rows for d in draws) / 2**30:.2f} GiB) does not fit the "
                f"{free / MEMORY_HEADROOM / 2**30:.2f} GiB free on {self.device}; lower batch_per_device, "
                "num_generations or max_completion_length"
            )
        size = -(-len(draws) // parts)
        return [draws[index : index + size] for index in range(0, len(draws), size)]


class _Step:
    """One decode step of a fixed batch and capacity: its cache, and how it runs (captured, or eagerly)."""

    def __init__(self, model, cache: KVCache, graphs: bool, compile: bool):
        self.model, self.cache = model, cache
        self.tokens = torch.zeros(cache.visible.shape[0], 1, dtype=torch.long, device=cache.visible.device)
        began = time.perf_counter()
        forward = self._forward
        if compile:
            forward = torch.compile(forward, dynamic=False)
        self.forward = forward
        self.graph = None
        if graphs:
            try:
                self._capture()
            except Exception as error:
                if failed_in_compiler(error):
                    raise  # model.compile's to name: never a silent fallback
                # The step runs, only without its graph: say so once, and go on.
                print(
                    f"warning: generation's decode step could not be captured as a CUDA graph ({error}); each "
                    "step launches its kernels one by one instead",
                    file=sys.stderr,
                    flush=True,
                )
                self.graph = None
                self.cache.reset()
        self.capture_seconds = time.perf_counter() - began

    def _forward(self) -> torch.Tensor:
        return self.model(self.tokens, cache=self.cache)

    def _capture(self) -> None:
        """Warm the step up on a side stream (it compiles and allocates), empty the cache again, and capture it."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.forward()
        torch.cuda.current_stream().wait_stream(side)
        self.cache.reset()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self.forward()
        self.cache.reset()

    def run(self, chosen: torch.Tensor) -> torch.Tensor:
        """The logits after feeding each row its chosen token (B,)."""
        self.tokens.copy_(chosen.view(-1, 1))
        if self.graph is None:
            return self.forward()
        self.graph.replay()
        return self.logits


def _inference_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A frozen copy of ``model`` whose matrices are held in ``dtype`` (its norms and biases as they are), for
    decode steps that would otherwise cast every weight at every step."""
    copied = copy.deepcopy(model)
    copied.requires_grad_(False).eval()
    for param in copied.parameters():
        if param.dim() >= 2 and param.is_floating_point():
            param.data = param.data.to(dtype)
    return copied


@contextlib.contextmanager
def _blocks_uncompiled(model: torch.nn.Module):
    """The model's modules with their torch.compile wrappers (``model.compile``'s, for training) set aside."""
    stashed = [(module, module._compiled_call_impl) for module in model.modules() if module._compiled_call_impl]
    for module, _ in stashed:
        module._compiled_call_impl = None
    try:
        yield
    finally:
        for module, compiled in stashed:
            module._compiled_call_impl = compiled


def checked_round(
    prompts: list[list[int]], sampling: Sampling, draws: list[Draws] | None, limit: int
) -> tuple[list[Draws], int]:
    """(the draws, one for all rows when none are given; the positions the round needs: the longest prompt and
    every new token but the last, which is never fed back); ValueError for prompts and draws that cannot make one
    round in a context of ``limit`` positions."""
    if not prompts or any(not prompt for prompt in prompts):
        raise ValueError("every prompt needs at least one token")
    draws = draws or [Draws(len(prompts))]
    if sum(draw.rows for draw in draws) != len(prompts):
        raise ValueError(f"the draws cover {sum(d.rows for d in draws)} rows, not the {len(prompts)} prompts")
    longest = max(len(prompt) for prompt in prompts)
    capacity = longest + sampling.max_new_tokens - 1
    if capacity > limit:
        raise ValueError(
            f"the longest prompt ({longest} tokens) and max_new_tokens ({sampling.max_new_tokens}) need "
            f"{capacity} positions; the model takes at most {limit}"
        )
    return draws, capacity


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, which positions are real) of the prompts as one batch padded on the left, on the CPU."""
    longest = max(len(prompt) for prompt in prompts)
    tokens = torch.zeros(len(prompts), longest, dtype=torch.long)
    real = torch.zeros(len(prompts), longest, dtype=torch.bool)
    for row, prompt in enumerate(prompts):
        tokens[row, longest - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        real[row, longest - len(prompt) :] = True
    return tokens, real


def pick_rows(logits: torch.Tensor, sampling: Sampling, draws: list[Draws]) -> torch.Tensor:
    """The next token of every row, each group of rows drawn with its own generator."""
    if sampling.temperature == 0 or len(draws) == 1:
        return pick(logits, sampling, draws[0].generator)
    chosen, start = [], 0
    for draw in draws:
        chosen.append(pick(logits[start : start + draw.rows], sampling, draw.generator))
        start += draw.rows
    return torch.cat(chosen)


def _all_done(done: torch.Tensor, together) -> bool:
    """Whether every row has ended (on every rank of ``together``): a host synchronisation."""
    finished = done.all()
    if together is not None:
        finished = finished.to("cpu", torch.int32)  # the group is gloo's (astrai.trainer.distributed.DistEnv)
        torch.distributed.all_reduce(finished, op=torch.distributed.ReduceOp.MIN, group=together)
    return bool(finished)


def until_stop(row: list[int], stop) -> list[int]:
    for index, token in enumerate(row):
        if token in stop:
            return row[: index + 1]
    return row


def free_memory(device: torch.device) -> int:
    """Bytes free for new tensors on ``device``: the GPU's free memory and what torch's allocator holds unused;
    the host's available memory for a CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
