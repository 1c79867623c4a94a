"""The generation engine: sampling completions from the trainer's own model, at the speed the device allows.

Prompts of different lengths go in one batch, padded on the left so that every row's next token is in the last
column. Each row's positions count its own tokens only, and no query sees a padding key, so a row samples what it
would sample alone. Settings follow ``transformers``' ``generate``: ``temperature`` 0 is greedy (on the same prompt
tokens its output equals ``generate(do_sample=False)``), otherwise the logits are divided by the temperature, cut to
the ``top_k`` most likely tokens and to the smallest set whose probability reaches ``top_p``, and a token is drawn.
A row ends at any of the ``stop`` tokens (which it keeps), or at ``max_new_tokens``.

How a call runs (:meth:`DecodeEngine.generate`):

1. The rows are split into parts of at most ``rows_per_part`` rows, a number the run's plan fixes from the model's
   shape, the rows, the cache's capacity and the device's total memory (:mod:`astrai.common.memory`), never from
   the memory free at the moment: a resumed run splits its rounds as the uninterrupted one did, so its batches, and
   with them its tokens, are the same. Parts are cut only between groups of rows that draw from one generator, so
   the split never changes what is drawn.
2. Each part's prompts go through one batched forward pass (the prefill) into a cache of fixed capacity.
3. Each new token is one decode step (:meth:`astrai.trainer.models.native.Transformer.decode_step`): device work on the
   same buffers every time. There is one step per batch size, made at the largest capacity the run reaches
   (``capacity``, from the plan: the longest prompt and ``max_new_tokens``) and reused by every shorter call, so the
   memory the steps hold is bounded, and a compiled step compiles once per batch size. On CUDA (one process, or DDP) the
   step is captured once as a CUDA graph and replayed: a step costs one launch, not one per kernel (not a mixture of
   experts, whose shapes depend on the routing, nor a RoPE that changes with the length: those steps run eagerly). With
   ``compile`` the step is compiled with ``torch.compile`` first (fused kernels). The next token is chosen on the device
   (:func:`pick`), without a host read; finished rows are tracked there too, and the host asks whether every row has
   ended only every :data:`STOP_CHECK_EVERY` tokens.
4. A captured step reads only tensors that live as long as it: its cache's buffers and rotary tables, the weights
   (updated in place), and what the step itself computes. So generation runs with autocast's cache of cast weights
   off (those casts are freed when the caller's autocast ends), and under autocast with float32 weights (full
   fine-tuning on a GPU) the steps read a copy of the weights in the autocast dtype, refreshed in place at each call,
   instead of casting every weight at every step.

Under FSDP every rank holds a shard of the weights and gathers them in each forward pass: the ranks generate in
step (``together``: they agree when to stop, and on how many parts), in eager mode.

Randomness comes only from the ``torch.Generator``s given, each drawing for its own rows, so a run that seeds
them from its seed and step samples the same completions after a resume.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from astrai.common.memory import decode_capacity, decode_rows_per_part, kv_cache_bytes
from astrai.common.settings import Sampling
from astrai.trainer.models.cache import KVCache
from astrai.trainer.models.compiling import failed_in_compiler
from astrai.trainer.models.nf4 import is_nf4

STOP_CHECK_EVERY = 16
"""Tokens between two host reads of whether every row has ended (the only host synchronisation of a decode)."""


def pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row (B,) from its logits (B, vocab), on the device, with no host read.

    ``top_k`` keeps the k most likely tokens (and any tied with the k-th, as transformers does); ``top_p`` then keeps
    the most likely tokens whose probability before them is below ``top_p`` (any tied with the last one kept too). With
    ``top_k`` set only its k logits are sorted, never the whole vocabulary."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / sampling.temperature
    vocab = logits.shape[-1]
    top_k = sampling.top_k if 0 < sampling.top_k < vocab else 0
    if top_k:
        ordered = torch.topk(logits, top_k, dim=-1).values  # descending
        logits = logits.masked_fill(logits < ordered[:, -1:], float("-inf"))
    if sampling.top_p < 1:
        if not top_k:
            ordered = torch.sort(logits, dim=-1, descending=True).values
        probabilities = (ordered - torch.logsumexp(logits, dim=-1, keepdim=True)).exp()
        # Keep a token while the more likely ones before it stay below top_p (the most likely always stays).
        kept = probabilities.cumsum(dim=-1) - probabilities < sampling.top_p
        lowest = ordered.masked_fill(~kept, float("inf")).amin(dim=-1, keepdim=True)
        logits = logits.masked_fill(logits < lowest, float("-inf"))
    return draw(logits.softmax(dim=-1), generator)


def draw(probabilities: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One index per row (B,) drawn with the given probabilities (B, N): ``torch.multinomial(probabilities, 1)``'s
    own one-sample draw (the exponential race: ``argmax(p / q)`` with ``q ~ Exp(1)``), the same numbers from the same
    generator, without multinomial's checks of its input, which read from the device every call."""
    race = torch.empty_like(probabilities).exponential_(1, generator=generator)
    return (probabilities / race).argmax(dim=-1)


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
    """Generation with one model, keeping what it builds (a decode step per batch size with its cache, the weights'
    copy) for the next call: an ``online_grpo`` run makes one and calls it every step.

    ``together``: the process group of ranks that generate in step (FSDP). ``graphs``: capture decode steps as CUDA
    graphs (None: on CUDA unless ``together``). ``compile``: compile the decode step with torch.compile first.
    ``capacity``: the positions the longest call of the run needs (:func:`astrai.common.memory.decode_capacity`);
    None: each batch size's step grows to the longest call so far. ``rows_per_part``: the most rows generated at once
    (:func:`astrai.common.memory.decode_rows_per_part`); None: worked out from the device's total memory and the
    weights alone.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        together=None,
        graphs: bool | None = None,
        compile: bool = False,
        capacity: int | None = None,
        rows_per_part: int | None = None,
    ):
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
        self.capacity = capacity
        self.rows_per_part = rows_per_part
        self._copy: torch.nn.Module | None = None
        self._steps: dict[tuple[int, torch.dtype], _Step] = {}
        """One decode step per (batch size, cache dtype), at the largest capacity asked of it."""
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
        limit = self.inner.config.context  # the model's context (astrai.common.model_config.context_length)
        draws, needed = checked_round(prompts, sampling, draws, limit)
        if sampling.temperature == 0:  # nothing is drawn: any row may go in any part
            draws = [Draws(1) for _ in prompts]
        capacity = decode_capacity(max(len(prompt) for prompt in prompts), sampling.max_new_tokens, limit)
        if self.capacity is not None and needed <= self.capacity:
            capacity = self.capacity  # the run's largest: one step per batch size serves every call
        completions, start = [], 0
        with _uncached_autocast(self.device.type):
            model = self._decoding_model()
            with _blocks_uncompiled(model):  # the training's compiled blocks would recompile for every decode shape
                for part in self._parts(draws, capacity):
                    rows = sum(draw.rows for draw in part)
                    part_prompts = prompts[start : start + rows]
                    completions += self._generate_part(model, part_prompts, sampling, stop, part, capacity)
                    start += rows
        return completions

    def _generate_part(self, model, prompts, sampling: Sampling, stop, draws: list[Draws], capacity: int):
        tokens, real = left_padded(prompts)
        step = self._step(model, len(prompts), capacity)
        step.cache.reset()
        logits = model(tokens.to(self.device), cache=step.cache, real=real.to(self.device))
        limits = [sampling.max_new_tokens] * len(prompts)
        return self._turn(step, logits, sampling, stop, draws, limits)[0]

    def _turn(self, step: _Step, logits, sampling: Sampling, stop, draws: list[Draws], limits: list[int]):
        """(each row's new tokens through its stop token, at most its ``limits``; the tokens chosen per row, of which
        all but the last went through the cache): the decode steps after ``logits``. A row whose limit is 0 takes no
        token; under FSDP every rank takes as many steps as the others (they agree when every row has ended)."""
        batch, device = len(limits), self.device
        stops = torch.tensor(sorted(stop), dtype=torch.long, device=device)
        limit = torch.tensor(limits, dtype=torch.long, device=device)
        done = limit == 0
        own = max(limits)
        cap = sampling.max_new_tokens if self.together is not None else own
        made = torch.empty(batch, cap, dtype=torch.long, device=device)
        count = 0
        while True:
            chosen = pick_rows(logits, sampling, draws).masked_fill(done, 0)
            made[:, count] = chosen
            count += 1
            done = done | torch.isin(chosen, stops) | (limit <= count)
            if count == cap:
                break
            if count % STOP_CHECK_EVERY == 0 and _all_done(done, self.together):
                break
            # Under FSDP a rank whose rows have all reached their limits keeps up with the others' forward passes
            # without its cache, which has room for its own rows' tokens only.
            logits = step.run(chosen) if count < own else step.model(chosen.view(-1, 1))[:, -1]
        count = min(count, own)
        rows = made[:, :count].tolist()
        return [until_stop(row[:most], stop) for row, most in zip(rows, limits, strict=True)], count

    # Episodes ---------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def episodes(
        self,
        prompts: list[list[int]],
        sampling: Sampling,
        stop: set[int] | frozenset[int],
        draws: list[Draws],
        handler: TurnHandler,
        rooms: list[int],
    ) -> None:
        """Multi-turn generation: each row generates a turn (at most ``sampling.max_new_tokens`` tokens, until a stop
        token), ``handler`` answers every row's turn with the tokens that follow it (a tool's reply) or ends the row's
        episode, and the rows that go on generate their next turn from the cache, which keeps every token so far.
        ``rooms``: the most tokens each row's episode adds to its prompt (the handler keeps its turns within it).

        A part's rows take their turns together: a row whose episode is over, or whose turn ended early, waits for
        the others' turn (its cache slots of that turn are hidden from attention afterwards, its positions count its
        own tokens only). When the cache has no room left for the next turn, every row's episode so far is fed again
        into an emptied cache (a row samples the same either way: the same tokens, the same positions)."""
        config = self.inner.config
        context = config.context
        if not prompts or any(not prompt for prompt in prompts) or sum(draw.rows for draw in draws) != len(prompts):
            raise ValueError("every prompt needs at least one token, and the draws must cover every row")
        needed = max(len(prompt) + room for prompt, room in zip(prompts, rooms, strict=True)) - 1
        if needed > context or min(rooms) < 1:
            raise ValueError(f"episodes need {needed} positions (a room of at least 1); the model takes {context}")
        # Rows share the cache's slots: one row's longest episode and another's longest turn fit together.
        capacity = decode_capacity(needed + 1, sampling.max_new_tokens, context)
        if self.capacity is not None and needed + sampling.max_new_tokens <= self.capacity:
            capacity = self.capacity
        start = 0
        with _uncached_autocast(self.device.type):
            model = self._decoding_model()
            with _blocks_uncompiled(model):
                for part in self._parts(draws, capacity):
                    rows = list(range(start, start + sum(draw.rows for draw in part)))
                    limits = [min(sampling.max_new_tokens, rooms[row]) for row in rows]
                    episode = _EpisodeRows([prompts[row] for row in rows], limits)
                    self._episode_part(model, episode, rows, sampling, stop, part, handler, capacity)
                    start = rows[-1] + 1

    def _episode_part(self, model, episode: _EpisodeRows, rows, sampling, stop, draws, handler, capacity) -> None:
        step = self._step(model, len(rows), capacity)
        cache = step.cache
        cache.reset()
        while True:
            if cache.length + episode.longest_feed + max(episode.limits) - 1 > capacity:
                cache.reset()
                episode.refeed()
            first = cache.length
            tokens, real = left_padded(episode.feed, at_least=1)
            logits = model(tokens.to(self.device), cache=cache, real=real.to(self.device))
            # Within a context that caps the cache, a turn takes the slots that are left (a row cut short ends).
            left = capacity - cache.length + 1
            turns, count = self._turn(step, logits, sampling, stop, draws, [min(most, left) for most in episode.limits])
            first += tokens.shape[1]
            taking = [number for number, most in enumerate(episode.limits) if most]
            episode.took(turns)
            # Slots of the turn past each row's tokens are hidden; the turn's last token of each row is fed again.
            fed = max(count - 1, 0)
            kept = torch.tensor([[slot < len(turn) - 1 for slot in range(fed)] for turn in turns], dtype=torch.bool)
            cache.visible[:, first : first + fed] = kept.to(self.device)
            cache.positions.copy_(torch.tensor(episode.cached, dtype=torch.long))
            cache.length = first + fed
            cache.slot.fill_(cache.length)
            answers = handler.after_turn([rows[number] for number in taking], [turns[number] for number in taking])
            episode.answered(taking, answers)
            if not _anyone(any(episode.limits), self.together):
                return

    # What a call builds -------------------------------------------------------------------------------------

    def _decoding_model(self) -> torch.nn.Module:
        """The model the steps run: under autocast with float32 matrices that are not LoRA's adapters (and not
        sharded), a copy of it in the autocast dtype, refreshed from the model now; else the model itself (LoRA's
        float32 adapters are cast at each step, with autocast's cache off: they are small)."""
        dtype = torch.get_autocast_dtype(self.device.type) if torch.is_autocast_enabled(self.device.type) else None
        if self.together is not None:
            return self.model
        if dtype is None or all(param.dtype == dtype for _, param in _base_matrices(self.inner)):
            return self.inner
        if self._copy is None:
            with _blocks_uncompiled(self.inner):  # a compiled block's wrapper is not copied
                self._copy = _inference_copy(self.inner, dtype)
        for copied, original in zip(self._copy.parameters(), self.inner.parameters(), strict=True):
            copied.copy_(original.detach())  # in place: captured steps keep reading the same tensors
        return self._copy

    def _step(self, model, batch: int, capacity: int) -> _Step:
        """The decode step of ``batch`` rows: made (and captured) once at ``capacity``, reused by calls that need no
        more; a call that needs more replaces it (freeing the old one's cache and graph)."""
        dtype = self._cache_dtype()
        key = (batch, dtype)
        step = self._steps.get(key)
        if step is not None and step.cache.capacity >= capacity and step.model is model:
            return step
        if step is not None:
            capacity = max(capacity, step.cache.capacity)
            del self._steps[key], step  # its cache and graph go before the larger ones are allocated
        _check_fits(kv_cache_bytes(self.inner.config, batch, capacity, dtype.itemsize), batch, capacity, self.device)
        cache = KVCache(self.inner.config, batch, capacity, self.device, dtype)
        step = self._steps[key] = _Step(model, cache, self.graphs, self.compile)
        self.capture_seconds += step.capture_seconds
        return step

    def _cache_dtype(self) -> torch.dtype:
        """What the keys and values come out in: the autocast dtype, else the model's."""
        if torch.is_autocast_enabled(self.device.type):
            return torch.get_autocast_dtype(self.device.type)
        return self.inner.norm.weight.dtype

    def _parts(self, draws: list[Draws], capacity: int) -> list[list[Draws]]:
        """The draws split into parts of at most ``rows_per_part`` rows (under FSDP, as many parts on every rank)."""
        widest = max(draw.rows for draw in draws)
        limit = self.rows_per_part or self._default_rows_per_part(capacity)
        if widest > limit:
            raise MemoryError(
                f"a group of {widest} rows drawn by one generator does not fit a part of {limit} rows, the most the "
                f"key/value cache of {capacity} positions may take on {self.device}; lower batch_per_device, "
                "num_generations or max_completion_length"
            )
        per_part = limit // widest  # whole groups a part takes at most (groups of one round have one size)
        parts = -(-len(draws) // per_part)
        if self.together is not None:
            agreed = torch.tensor([parts], dtype=torch.int64)
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX, group=self.together)
            parts = int(agreed)
        size = -(-len(draws) // parts)
        return [draws[index : index + size] for index in range(0, len(draws), size)]

    def _default_rows_per_part(self, capacity: int) -> int:
        """Without a plan's figure: what the device's total memory leaves after the weights (and their copy)."""
        held = sum(p.numel() * p.element_size() for p in self.inner.parameters())
        if self._copy is not None:
            held += sum(p.numel() * p.element_size() for p in self._copy.parameters())
        row = kv_cache_bytes(self.inner.config, 1, capacity, self._cache_dtype().itemsize)
        return decode_rows_per_part(total_memory(self.device), held, row)


def regenerated_episodes(
    generate,
    prompts: list[list[int]],
    sampling: Sampling,
    stop,
    draws: list[Draws],
    handler: TurnHandler,
    rooms: list[int],
) -> None:
    """:meth:`DecodeEngine.episodes` on an engine that cannot go on from its cache (``generate``: its call): each
    turn generates again from every going row's whole episode so far, its rows drawn by their own generators."""
    history = [list(prompt) for prompt in prompts]
    limits = [min(sampling.max_new_tokens, room) for room in rooms]
    owner = [number for number, draw in enumerate(draws) for _ in range(draw.rows)]
    while any(limits):
        taking = [row for row, most in enumerate(limits) if most]
        groups: list[Draws] = []
        for position, row in enumerate(taking):
            if position and owner[row] == owner[taking[position - 1]]:
                groups[-1] = Draws(groups[-1].rows + 1, groups[-1].generator)
            else:
                groups.append(Draws(1, draws[owner[row]].generator))
        most = max(limits[row] for row in taking)
        made = generate(
            [history[row] for row in taking], dataclasses.replace(sampling, max_new_tokens=most), stop, groups
        )
        turns = [until_stop(tokens[: limits[row]], stop) for row, tokens in zip(taking, made, strict=True)]
        for row, turn in zip(taking, turns, strict=True):
            history[row] += turn
        answers = handler.after_turn(taking, turns)
        if len(answers) != len(taking):
            raise ValueError(f"{len(answers)} answers to the turns of {len(taking)} rows")
        for row, answer in zip(taking, answers, strict=True):
            if answer is None:
                limits[row] = 0
            else:
                history[row] += answer.tokens
                limits[row] = answer.max_new_tokens


@dataclass(frozen=True)
class Continuation:
    """How a row's episode goes on after a turn: the tokens that follow the turn (a tool's reply, the template's text
    up to the next generation prompt) and the most tokens its next turn may take."""

    tokens: list[int]
    max_new_tokens: int


class TurnHandler(Protocol):
    """What answers the turns of :meth:`DecodeEngine.episodes` (the episodes' environment and tools)."""

    def after_turn(self, rows: list[int], turns: list[list[int]]) -> list[Continuation | None]:
        """For each of the round's ``rows`` that took a turn, what it generated (through its stop token when it met
        one): how its episode goes on, or None when it is over."""


class _EpisodeRows:
    """A part's episodes as the host keeps them between turns: each row's tokens so far, how many of them the cache
    holds, what is still to be fed, and the most tokens of its next turn (0: its episode is over)."""

    def __init__(self, prompts: list[list[int]], limits: list[int]):
        self.history = [list(prompt) for prompt in prompts]
        self.cached = [0] * len(prompts)
        self.feed = [list(prompt) for prompt in prompts]
        self.limits = list(limits)

    @property
    def longest_feed(self) -> int:
        return max(1, max(len(tokens) for tokens in self.feed))

    def refeed(self) -> None:
        """The cache was emptied: every episode that goes on is fed whole again."""
        self.feed = [list(history) if most else [] for history, most in zip(self.history, self.limits, strict=True)]
        self.cached = [0] * len(self.history)

    def took(self, turns: list[list[int]]) -> None:
        """Each row's turn: all its tokens but the last went through the cache."""
        for row, turn in enumerate(turns):
            self.cached[row] += len(self.feed[row]) + max(len(turn) - 1, 0)
            self.history[row] += turn
            self.feed[row] = turn[-1:]

    def answered(self, rows: list[int], answers: list[Continuation | None]) -> None:
        if len(answers) != len(rows):
            raise ValueError(f"{len(answers)} answers to the turns of {len(rows)} rows")
        for row, answer in zip(rows, answers, strict=True):
            if answer is None:
                self.limits[row], self.feed[row] = 0, []
            else:
                self.history[row] += answer.tokens
                self.feed[row] += answer.tokens
                self.limits[row] = answer.max_new_tokens


def _anyone(flag: bool, together) -> bool:
    """Whether ``flag`` holds on any rank of ``together`` (FSDP's ranks go on generating while one of them does)."""
    if together is None:
        return flag
    agreed = torch.tensor([int(flag)], dtype=torch.int32)
    torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MAX, group=together)
    return bool(agreed)


def _base_matrices(model: torch.nn.Module):
    """The model's floating-point matrices that are not LoRA's adapters: (name, parameter). An NF4 base's are not
    among them: a step reads them as they are held, dequantising one layer at a time, and no copy is made of them."""
    for name, param in model.named_parameters():
        if param.dim() >= 2 and param.is_floating_point() and ".lora_" not in name and not is_nf4(param):
            yield name, param


@contextlib.contextmanager
def _uncached_autocast(device_type: str):
    """Autocast as the caller set it, with its cache of cast weights off: a cast it caches is freed when the caller's
    autocast ends, and a captured step would go on reading its memory."""
    if not torch.is_autocast_enabled(device_type):
        yield
        return
    with torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=False):
        yield


def _check_fits(size: int, batch: int, capacity: int, device: torch.device) -> None:
    """MemoryError, naming the keys that shrink it, when a cache of ``size`` bytes does not fit what is free now."""
    free = free_memory(device)
    if size > free:
        raise MemoryError(
            f"a key/value cache of {batch} rows x {capacity} positions ({size / 2**30:.2f} GiB) does not fit the "
            f"{free / 2**30:.2f} GiB free on {device}; lower batch_per_device, num_generations or "
            "max_completion_length"
        )


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
        # thread_local: another thread's CUDA calls (the DataLoader's pin-memory thread) cannot void the capture.
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.logits = self.forward()
        self.cache.reset()

    def owned(self) -> list[torch.Tensor]:
        """Every tensor the step reads that it does not compute itself: its cache's buffers and rotary tables, its
        token buffer, and the model's parameters and buffers (updated in place, never replaced, while it lives)."""
        cache = self.cache
        tables = [table for pair in (cache.rotary or {}).values() for table in pair]
        state = [cache.visible, cache.slot, cache.positions, cache._slots, self.tokens]
        return [*cache.keys, *cache.values, *tables, *state, *self.model.parameters(), *self.model.buffers()]

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


def left_padded(prompts: list[list[int]], at_least: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids, which positions are real) of the prompts as one batch padded on the left, on the CPU, at least
    ``at_least`` columns wide."""
    longest = max(at_least, max(len(prompt) for prompt in prompts))
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
        finished = finished.to("cpu", torch.int32)  # the group is gloo's (astrai.trainer.launch.distributed.DistEnv)
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
    return _meminfo("MemAvailable") or os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def total_memory(device: torch.device) -> int:
    """Bytes of memory ``device`` has in all (a GPU's, or the host's): the same on every run on such a device."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return _meminfo("MemTotal") or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _meminfo(field: str) -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
