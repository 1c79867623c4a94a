"""`invoke bench --gpu`: the GPU figures, as one prepared run on one H100/H200-class GPU (at most about 8 minutes).

    invoke bench --gpu                      # on a host with a GPU: bench/results.json's `gpu` block
    python -m bench.gpu --device cpu --out /tmp/gpu.json    # the same code at tiny sizes on a CPU (the tests do)

Everything runs on the 0.63B configuration the issue names (dim 2048, 12 layers, 16/8 heads, vocabulary 32,000,
window 2048, batch 8, bf16 autocast, fused AdamW), except the checkpoint and exactness runs (the `base` preset,
window 512, as when the trainer was first measured on a GPU). Each figure is measured side by side in this one run:

- ``mfu``: the trainer's model FLOP utilisation at its default settings (model.compile auto: compiled; the loss
  over the vocabulary in chunks); ``trainer_vs_bare``: its tokens/s over a bare loop's (the same model, compiled
  alike, plain cross-entropy on the whole logits, fused AdamW, batches already on the GPU);
  ``trainer_vs_transformers``: over transformers' ``LlamaForCausalLM`` (sdpa, bf16 autocast, the same batches);
  ``compile_speedup``: compiled over eager; ``activation_checkpointing_vs_default``: tokens/s with it over without.
- ``chunked_loss_peak_mem_vs_plain``, ``chunked_loss_tokens_per_s_vs_plain``: the peak memory and the speed of one
  forward and backward with the vocabulary of Qwen (151,936), the loss in chunks over the plain loss on the whole
  logits.
- ``lora_tokens_per_s_vs_full``, ``lora_peak_mem_vs_full``, ``lora_ckpt_bytes_vs_full``: LoRA r16 (its base in
  bf16) against full fine-tuning, on the same batches.
- ``nf4_tokens_per_s_vs_bf16``, ``nf4_peak_mem_vs_bf16``, ``nf4_step0_loss_vs_bf16``: LoRA r16 with its base in
  NF4 (training.lora_base_dtype) over the same with it in bf16: tokens/s on the 0.63B model, the peak memory of a
  step on a model whose weights dominate (four Llama-8B-shaped blocks, batch 1 x 256, eager), the step-0 loss.
- ``generate_vs_transformers``: new tokens/s of the generation engine over transformers' ``generate`` (64 prompts
  of 16-64 tokens, 256 new tokens each, greedy, the model in bf16); ``generate_sampled_vs_transformers``: the same,
  sampled as online_grpo samples (temperature 1, top_p 0.95); ``decode_vs_roofline``: one decode step's time over
  one read of the weights and the key/value cache at the bandwidth a device-to-device copy reaches here (the step
  replayed on a cache filled again, never past its capacity); ``generate_same_rows``: the share of rows whose greedy
  tokens equal transformers', with why the others differ.
- ``rollout_share``: the share of an ``online_grpo`` step spent sampling its completions (8 prompts x 8
  generations x 256 tokens).
- ``ckpt_save_vs_disk``: a checkpoint's write over the disk's own durable write of its bytes;
  ``ckpt_stall_vs_sync``: the pause of a periodic save over a synchronous save; ``ckpt_peak_host_mem_vs_state``: the
  host memory a periodic save's copy takes at its peak over the state's bytes.
- ``deterministic_bitwise``: with training.deterministic, compiled as CUDA's default is, two runs, a run with a
  periodic save, a stop and resume and a kill and resume all end on bitwise equal weights (``..._eager``: the same
  with model.compile false); ``default_save_max_abs_diff``: in the default mode, how far a run with a periodic save
  ends from one without, beside ``default_two_runs_max_abs_diff``, two runs' own distance;
  ``deterministic_tokens_per_s_vs_default``: what deterministic mode costs.

Each part runs in a process of its own within its time budget (:data:`BUDGET_S`, 8 minutes in all): a crash, an
out-of-memory, a sticky CUDA error or an overrun costs only that part, recorded under ``errors`` with the part's
wall time under ``part_seconds``, and the block is written after every part. Without CUDA (and without ``--device
cpu``) it says so and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from bench.common import REPO, Figures, status_kib

RESULTS = REPO / "bench" / "results.json"
GPU_BLOCK = "gpu"


@dataclass(frozen=True)
class Sizes:
    """How large each part runs: the GPU's, or tiny ones for a CPU (so the tests run this code)."""

    model: dict
    window: int
    batch: int
    steps: int
    """Optimizer steps timed per throughput run (after warm-up steps)."""
    qwen_vocab: int
    lora_rank: int
    prompts: int
    new_tokens: int
    rollout: tuple[int, int, int]
    """online_grpo: prompts per step, generations per prompt, new tokens."""
    exact_preset: dict
    exact_window: int
    exact_steps: int
    nf4_memory_model: dict
    """QLoRA's peak memory: a model whose weights dominate a step of batch 1 x ``nf4_memory_window``."""
    nf4_memory_window: int


GPU_SIZES = Sizes(
    model={"vocab_size": 32000, "dim": 2048, "n_layers": 12, "n_heads": 16, "n_kv_heads": 8, "ffn_hidden_dim": 5632},
    window=2048,
    batch=8,
    steps=10,
    qwen_vocab=151936,
    lora_rank=16,
    prompts=64,
    new_tokens=256,
    rollout=(8, 8, 256),
    exact_preset={"dim": 768, "n_layers": 18, "n_heads": 12, "n_kv_heads": 4, "ffn_hidden_dim": 2304},
    exact_window=512,
    exact_steps=40,
    nf4_memory_model={
        "vocab_size": 32000,
        "dim": 4096,
        "n_layers": 4,
        "n_heads": 32,
        "n_kv_heads": 8,
        "ffn_hidden_dim": 14336,
    },
    nf4_memory_window=256,
)
CPU_SIZES = Sizes(
    model={"vocab_size": 512, "dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden_dim": 64},
    window=32,
    batch=2,
    steps=1,
    qwen_vocab=2048,
    lora_rank=2,
    prompts=3,
    new_tokens=4,
    rollout=(2, 2, 4),
    exact_preset={"dim": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden_dim": 64},
    exact_window=16,
    exact_steps=4,
    nf4_memory_model={
        "vocab_size": 512,
        "dim": 128,
        "n_layers": 2,
        "n_heads": 2,
        "n_kv_heads": 2,
        "ffn_hidden_dim": 256,
    },
    nf4_memory_window=16,
)


CORPUS_BYTES = {"cuda": 8 << 20, "cpu": 256 << 10}
"""The benchmark corpus (byte-level: a token a byte): enough that no timed run of the GPU's reaches the end of an
epoch (13 steps of 8 x 2,049 tokens take 0.2M tokens a run)."""


def make_assets(device: str, work: Path) -> None:
    """The base model (the 0.63B configuration on a GPU) and the corpus, made once for every part."""
    from astrai.common.model_folder import ModelConfig
    from astrai.data.pipeline import prepare
    from astrai.trainer.models.weights import write_base_model

    sizes = GPU_SIZES if device == "cuda" else CPU_SIZES
    write_base_model(work / "params", ModelConfig(**sizes.model, max_seq_len=max(sizes.window, 2048)), seed=0)
    texts = [path.read_text(encoding="utf-8") for path in sorted((REPO / "examples" / "corpus").glob("*.txt"))]
    corpus, written = work / "corpus.txt", 0
    with open(corpus, "w", encoding="utf-8") as handle:
        while written < CORPUS_BYTES[device]:
            for text in texts:
                written += handle.write(f"{written}: {text}\n")
    prepare(work / "data", [corpus])


class Bench:
    """One part of the GPU section: the device, the sizes, the scratch folder with the assets, the part's figures."""

    def __init__(self, device: str, work: Path):
        import torch

        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.sizes = GPU_SIZES if self.cuda else CPU_SIZES
        self.work = work
        self.params, self.data = work / "params", work / "data"
        self.figures = Figures()
        self.errors: dict[str, str] = {}

    def config(self, job: str, **keys):
        """The trainer's config of a throughput run on the 0.63B model (flat keys override)."""
        from astrai.common.config import KEY_SECTION, build_config

        values = {
            "data_root_path": str(self.data),
            "window_size": self.sizes.window,
            "num_workers": 1 if self.cuda else 0,
            "max_steps": 10**6,
            "batch_per_device": self.sizes.batch,
            "max_lr": 1e-4,
            "warmup_ratio": 0.0,
            "device": self.device.type,
            "ckpt_dir": str(self.work / job),
            "param_path": str(self.params),
            "ckpt_interval": 10**9,
            "log_interval": 10**6,
            "report_to": "none",
            **keys,
        }
        if "rewards" in values:
            from astrai.common.reward_specs import parse_rewards

            values["rewards"] = parse_rewards(values["rewards"])
        sections: dict[str, dict] = {}
        for key, value in values.items():
            sections.setdefault(KEY_SECTION[key], {})[key] = value
        return build_config(sections)


# --- Throughput -----------------------------------------------------------------------------------------


def _trainer_rate(bench: Bench, job: str, **keys) -> tuple[float, float, object]:
    """(tokens/s, peak GiB) of the trainer after warm-up steps; and its plan."""
    import torch

    from astrai.trainer.launch.distributed import init_distributed
    from astrai.trainer.run.loop import open_trainer

    trainer = open_trainer(bench.config(job, **keys), init_distributed("none", bench.device.type))
    try:
        trainer.train(steps=3)  # allocation, kernel choice, compilation
        if bench.cuda:
            torch.cuda.reset_peak_memory_stats()
        stats = trainer.train(steps=bench.sizes.steps)
        peak = torch.cuda.max_memory_allocated() / 2**30 if bench.cuda else 0.0
        return stats.tokens_per_s, peak, trainer.plan
    finally:
        trainer.close()
        del trainer


def _batches(bench: Bench, count: int):
    import torch

    from astrai.common.data_folder import TokenData
    from astrai.trainer.feed.windows import WindowDataset

    dataset = WindowDataset(TokenData.open(bench.data), bench.sizes.window)
    rows = [dataset[index % len(dataset)] for index in range(count * bench.sizes.batch)]
    return torch.stack(rows).view(count, bench.sizes.batch, -1).to(bench.device)


def _loop_rate(bench: Bench, model, loss_of, batches) -> float:
    """Tokens/s of a bare training loop: forward, loss, backward, clip, fused AdamW, on batches already there."""
    import contextlib

    import torch

    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if bench.cuda else contextlib.nullcontext()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=bench.cuda)

    def step(batch):
        with autocast:
            loss = loss_of(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for batch in batches[:3]:
        step(batch)
    _sync(bench)
    began = time.perf_counter()
    for batch in batches[3:]:
        step(batch)
    _sync(bench)
    return (len(batches) - 3) * bench.sizes.batch * bench.sizes.window / (time.perf_counter() - began)


def _sync(bench: Bench) -> None:
    import torch

    if bench.cuda:
        torch.cuda.synchronize()


def throughput(bench: Bench) -> None:
    """The trainer against a bare loop and transformers, compile on and off, activation checkpointing."""
    import torch
    import torch.nn.functional as F

    from astrai.trainer.models.weights import load_pretrained
    from astrai.trainer.run.report import flops_per_token, mfu, peak_tflops

    rate, peak, plan = _trainer_rate(bench, "default")
    eager, _, _ = _trainer_rate(bench, "eager", compile=False)
    checkpointed, checkpointed_peak, _ = _trainer_rate(bench, "checkpointed", activation_checkpointing=True)
    figures = bench.figures
    figures.median("trainer_tokens_per_s", [rate])
    figures.median("trainer_peak_gib", [peak])
    figures.ratio("compile_speedup", [rate], [eager])
    figures.ratio("activation_checkpointing_vs_default", [checkpointed], [rate])
    figures.fraction("activation_checkpointing_peak_mem_vs_default", checkpointed_peak, peak or 1.0)
    config = load_pretrained(bench.params).config
    name = torch.cuda.get_device_name(bench.device) if bench.cuda else None
    utilisation = mfu(rate, flops_per_token(config, bench.sizes.window), peak_tflops(name))
    if utilisation is not None:
        figures.observed("mfu", utilisation, {"tokens_per_s": rate, "device": name, "compile": plan.compile})

    batches = _batches(bench, bench.sizes.steps + 3)
    model = load_pretrained(bench.params).to(bench.device).train()
    if plan.compile:
        for layer in model.layers:
            layer.compile()

    def plain(model, batch):
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    bare = _loop_rate(bench, model, plain, batches)
    del model
    figures.ratio("trainer_vs_bare", [rate], [bare])
    theirs = _transformers_rate(bench, batches)
    figures.ratio("trainer_vs_transformers", [rate], [theirs])


def _transformers_rate(bench: Bench, batches) -> float:
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(bench.params, dtype=torch.float32, attn_implementation="sdpa")
    model = model.to(bench.device).train()

    def loss_of(model, batch):
        logits = model(input_ids=batch[:, :-1]).logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    try:
        return _loop_rate(bench, model, loss_of, batches)
    finally:
        del model


def chunked_loss(bench: Bench) -> None:
    """Peak memory and speed of one forward and backward with Qwen's vocabulary: the loss in chunks over the plain
    loss on the whole logits."""
    import contextlib

    import torch
    import torch.nn.functional as F

    from astrai.common.model_folder import ModelConfig
    from astrai.trainer.models.native import Transformer
    from astrai.trainer.models.scoring import TokenTargets

    config = ModelConfig(**{**bench.sizes.model, "vocab_size": bench.sizes.qwen_vocab}, max_seq_len=bench.sizes.window)
    model = Transformer(config).to(bench.device)
    tokens = torch.randint(0, config.vocab_size, (bench.sizes.batch, bench.sizes.window + 1), device=bench.device)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if bench.cuda else contextlib.nullcontext()

    def peak(loss_of) -> float:
        """Bytes allocated at the peak of one forward and backward, above what was allocated before (CUDA only: on a
        CPU the code runs and no figure is kept)."""
        model.zero_grad(set_to_none=True)
        _sync(bench)
        if bench.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if bench.cuda else 0
        with autocast:
            loss = loss_of()
        loss.backward()
        _sync(bench)
        return torch.cuda.max_memory_allocated() - before if bench.cuda else 0.0

    def plain():
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.float().view(-1, config.vocab_size), tokens[:, 1:].reshape(-1))

    def chunked():
        return -model(tokens[:, :-1], score=TokenTargets(tokens[:, 1:])).logps.mean()

    peaks = {"plain": peak(plain), "chunked": peak(chunked)}
    if bench.cuda:
        bench.figures.fraction("chunked_loss_peak_mem_vs_plain", peaks["chunked"], peaks["plain"], inputs=peaks)

    def seconds(loss_of) -> float:
        model.zero_grad(set_to_none=True)

        def step():
            with autocast:
                loss = loss_of()
            loss.backward()

        return _timed(bench, step)

    times = {"plain": [], "chunked": []}
    for turn in range(4):  # alternating turns; the first warms both up
        for name, loss_of in (("plain", plain), ("chunked", chunked)):
            took = seconds(loss_of)
            if turn:
                times[name].append(took)
    # Tokens/s of the chunked loss over the plain one's: the plain one's time over the chunked one's, turn by turn.
    bench.figures.ratio("chunked_loss_tokens_per_s_vs_plain", times["plain"], times["chunked"])


def lora(bench: Bench) -> None:
    """LoRA r16 with its base in bf16 against full fine-tuning: tokens/s, peak memory, checkpoint bytes."""
    from astrai.common.checkpoints import folder_bytes, latest_complete_checkpoint
    from astrai.trainer.launch.distributed import init_distributed
    from astrai.trainer.run.loop import open_trainer

    full, full_peak, _ = _trainer_rate(bench, "full")
    keys = {"lora_rank": bench.sizes.lora_rank, "lora_alpha": 2 * bench.sizes.lora_rank}
    adapted, adapted_peak, _ = _trainer_rate(bench, "lora", **keys)
    figures = bench.figures
    figures.ratio("lora_tokens_per_s_vs_full", [adapted], [full])
    figures.fraction("lora_peak_mem_vs_full", adapted_peak, full_peak or 1.0)
    sizes = {}
    for job, extra in (("full-ckpt", {}), ("lora-ckpt", keys)):
        config = bench.config(job, max_steps=1, compile=False, **extra)  # one step to save: not worth compiling
        trainer = open_trainer(config, init_distributed("none", bench.device.type))
        try:
            trainer.train()
            trainer.save_checkpoint("final")
        finally:
            trainer.close()
        sizes[job] = folder_bytes(latest_complete_checkpoint(bench.work / job).path)
    figures.fraction("lora_ckpt_bytes_vs_full", sizes["lora-ckpt"], sizes["full-ckpt"], inputs=sizes)


def nf4(bench: Bench) -> None:
    """QLoRA: LoRA r16 with its base in NF4 against the same with it in bf16. Tokens/s on the throughput model (its
    matrices whole NF4 scaler blocks; on a CPU the tiny NF4 model), the peak memory of a step on a model whose weights
    dominate (batch 1, eager on both sides), and the step-0 loss of one batch both ways."""
    from astrai.common.model_folder import ModelConfig
    from astrai.trainer.models.weights import write_base_model

    keys = {"lora_rank": bench.sizes.lora_rank, "lora_alpha": 2 * bench.sizes.lora_rank}
    memory_params = bench.work / "nf4-memory"
    write_base_model(memory_params, ModelConfig(**bench.sizes.nf4_memory_model, max_seq_len=2048), seed=0)
    speed = {} if bench.cuda else {"param_path": str(memory_params)}  # the CPU's throughput model is not NF4-able
    rates, peaks, losses = {}, {}, {}
    for dtype in ("bfloat16", "nf4"):
        rates[dtype], _, _ = _trainer_rate(bench, f"nf4-speed-{dtype}", lora_base_dtype=dtype, **speed, **keys)
        memory = {"param_path": str(memory_params), "batch_per_device": 1, "compile": False}
        memory["window_size"] = bench.sizes.nf4_memory_window
        _, peaks[dtype], _ = _trainer_rate(bench, f"nf4-memory-{dtype}", lora_base_dtype=dtype, **memory, **keys)
        losses[dtype] = _step0_loss(bench, f"nf4-loss-{dtype}", lora_base_dtype=dtype, **speed, **keys)
    figures = bench.figures
    figures.ratio("nf4_tokens_per_s_vs_bf16", [rates["nf4"]], [rates["bfloat16"]])
    figures.fraction("nf4_peak_mem_vs_bf16", peaks["nf4"], peaks["bfloat16"] or 1.0, inputs={"peak_gib": peaks})
    figures.fraction("nf4_step0_loss_vs_bf16", losses["nf4"], losses["bfloat16"], inputs={"loss": losses})


def _step0_loss(bench: Bench, job: str, **keys) -> float:
    """The loss of the trainer's model, adapters at their start (the base's), on the first rows of the corpus."""
    import torch

    from astrai.trainer.launch.distributed import init_distributed
    from astrai.trainer.run.build import autocast_for
    from astrai.trainer.run.loop import open_trainer

    trainer = open_trainer(bench.config(job, compile=False, **keys), init_distributed("none", bench.device.type))
    try:
        rows = torch.stack([trainer.loader.dataset[index] for index in range(bench.sizes.batch)]).to(bench.device)
        with torch.no_grad(), autocast_for(trainer.plan):
            logits = trainer.model(rows[:, :-1])
        return float(torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten()))
    finally:
        trainer.close()


# --- Generation -----------------------------------------------------------------------------------------


def _prompts(bench: Bench, count: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    low, high = (16, 64) if bench.cuda else (2, 6)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]


def generation(bench: Bench) -> None:
    """The generation engine against transformers' generate, greedy and sampled as online_grpo samples; its decode
    step against the bandwidth bound."""
    import torch
    from transformers import AutoModelForCausalLM

    from astrai.common.settings import Sampling
    from astrai.trainer.generation.decoding import DecodeEngine, Draws
    from astrai.trainer.models.weights import load_pretrained
    from tests.support import transformers_generate

    dtype = torch.bfloat16 if bench.cuda else torch.float32
    model = load_pretrained(bench.params).to(bench.device, dtype)
    config = model.config
    prompts = _prompts(bench, bench.sizes.prompts, config.vocab_size)
    sampling = Sampling(max_new_tokens=bench.sizes.new_tokens)
    sampled = Sampling(max_new_tokens=bench.sizes.new_tokens, temperature=1.0, top_p=0.95)
    new_tokens = len(prompts) * bench.sizes.new_tokens
    runs = {}
    for name, compiled in (("graphs", False), ("compiled", bench.cuda)):
        engine = DecodeEngine(model, compile=compiled)
        try:
            made = engine.generate(prompts, sampling)  # the first call compiles and captures
            runs[name] = (engine, made, _timed(bench, lambda engine=engine: engine.generate(prompts, sampling)))
        except Exception as error:  # the other variant still measures
            bench.errors[f"generation ({name})"] = f"{type(error).__name__}: {error}"
            traceback.print_exc()
    best = "compiled" if "compiled" in runs else "graphs"
    engine, ours, ours_s = runs[best]

    def draw_sampled():
        return engine.generate(prompts, sampled, draws=[Draws(len(prompts), _generator(bench))])

    ours_sampled_s = _timed(bench, draw_sampled)
    theirs_model = AutoModelForCausalLM.from_pretrained(bench.params, dtype=dtype).to(bench.device).eval()
    transformers_generate(theirs_model, prompts[:4], 4)  # warm-up
    theirs_s = _timed(bench, lambda: transformers_generate(theirs_model, prompts, bench.sizes.new_tokens))
    sample = {"temperature": 1.0, "top_p": 0.95}
    theirs_sampled_s = _timed(
        bench, lambda: transformers_generate(theirs_model, prompts, bench.sizes.new_tokens, sample=sample)
    )
    theirs = transformers_generate(theirs_model, prompts, bench.sizes.new_tokens) if not bench.cuda else None
    figures = bench.figures
    figures.ratio("generate_vs_transformers", [theirs_s], [ours_s])
    figures.ratio("generate_sampled_vs_transformers", [theirs_sampled_s], [ours_sampled_s])
    figures.median("generate_new_tokens_per_s", [new_tokens / ours_s])
    figures.observed("generate_engine", best, {name: run[2] for name, run in runs.items()})
    if len(runs) == 2:
        figures.ratio("generate_compiled_vs_graphs", [runs["graphs"][2]], [runs["compiled"][2]])
    figures.observed("generate_capture_s", round(engine.capture_seconds, 2), "the first call's compile and capture")
    _roofline(bench, engine, len(prompts))
    for run in runs.values():
        run[0]._steps.clear()  # captured steps and caches: memory the reference below needs
    if theirs is None:
        theirs = transformers_generate(theirs_model, prompts, bench.sizes.new_tokens)
    same = sum(a == b for a, b in zip(ours, theirs, strict=True))
    why = _why_rows_differ(bench, prompts, ours, theirs)
    figures.fraction("generate_same_rows", same, len(prompts), inputs=why)


def _generator(bench: Bench):
    import torch

    generator = torch.Generator(device=bench.device)
    generator.manual_seed(0)
    return generator


def _timed(bench: Bench, run) -> float:
    _sync(bench)
    began = time.perf_counter()
    run()
    _sync(bench)
    return time.perf_counter() - began


def _why_rows_differ(bench: Bench, prompts, ours, theirs) -> dict:
    """For rows whose greedy tokens differ: at the first token that differs, how far apart the two tokens' logits
    are under the model in float32 (a near tie that bf16 rounding decides, or a real difference), and the largest
    gap between the top two logits anywhere else, for scale."""
    import torch

    from astrai.trainer.models.weights import load_pretrained

    reference = load_pretrained(bench.params).to(bench.device)
    gaps = []
    for prompt, a, b in zip(prompts, ours, theirs, strict=True):
        if a == b:
            continue
        at = next((index for index, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        if at >= min(len(a), len(b)):
            continue
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + a[:at]], device=bench.device))[0, -1]
        gaps.append(abs(float(logits[a[at]] - logits[b[at]])))
    del reference
    return {"rows_differing": len(gaps), "float32_logit_gaps_at_first_difference": sorted(gaps)[:16]}


def _roofline(bench: Bench, engine, rows: int) -> None:
    """One decode step's time over one read of the weights and the key/value cache at the copy bandwidth: the step of
    ``rows`` rows replayed on a cache filled again with a prompt, never past its capacity."""
    import torch

    if not bench.cuda:
        return
    step = next(step for (batch, _), step in engine._steps.items() if batch == rows)
    if step.graph is None:
        return
    cache, prompt = step.cache, 16
    replays = min(50, cache.capacity - prompt - 1)
    with torch.no_grad():
        cache.reset()
        tokens = torch.ones(rows, prompt, dtype=torch.long, device=bench.device)
        step.model(tokens, cache=cache, real=torch.ones_like(tokens, dtype=torch.bool))
        step.run(torch.zeros(rows, dtype=torch.long, device=bench.device))  # warm
        _sync(bench)
        began = time.perf_counter()
        for _ in range(replays):
            step.graph.replay()  # each replay writes the next slot: prompt + 1 + replays <= capacity
        _sync(bench)
    step_s = (time.perf_counter() - began) / replays
    weights = sum(param.numel() * param.element_size() for param in step.model.parameters())
    cache_bytes = sum(tensor.numel() * tensor.element_size() for tensor in (*cache.keys, *cache.values))
    bandwidth = _copy_bandwidth(bench)
    bound = (weights + cache_bytes) / bandwidth
    bench.figures.fraction(
        "decode_vs_roofline",
        step_s,
        bound,
        inputs={"step_s": step_s, "weight_bytes": weights, "cache_bytes": cache_bytes, "copy_bytes_per_s": bandwidth},
    )
    bench.figures.observed("generate_cache_gib", round(cache_bytes / 2**30, 3), "the key/value cache of the timed step")


def _copy_bandwidth(bench: Bench) -> float:
    """Bytes per second a device-to-device copy of 2 GiB reaches (read and write counted), best of five."""
    import torch

    source = torch.empty(1 << 30, dtype=torch.uint8, device=bench.device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        best = min(best, _timed(bench, lambda: target.copy_(source)))
    return 2 * (1 << 30) / best


def rollouts(bench: Bench) -> None:
    """The share of an online_grpo step spent sampling and scoring its completions."""
    import torch

    from astrai.data.pipeline import prepare

    prompts, generations, new_tokens = bench.sizes.rollout
    records = bench.work / "prompts.jsonl"
    with open(records, "w", encoding="utf-8") as handle:
        for number in range(4 * prompts):
            handle.write(json.dumps({"prompt": f"Question {number}: how many?", "answer": str(number)}) + "\n")
    prepare(bench.work / "prompt-data", [records], kind="prompts")
    config = bench.config(
        "rollouts",
        data_root_path=str(bench.work / "prompt-data"),
        train_type="online_grpo",
        rewards=["astrai.rewards:exact_answer"],
        batch_per_device=prompts,
        num_generations=generations,
        max_completion_length=new_tokens,
        window_size=64,
        num_workers=0,
    )
    try:
        share, spent, steps = _rollout_share(bench, config)
    except Exception as error:  # say why, then measure with the decode step eager (model.compile false)
        bench.errors["rollouts (compiled)"] = f"{type(error).__name__}: {error}"
        traceback.print_exc()
        share, spent, steps = _rollout_share(
            bench, dataclasses.replace(config, model=dataclasses.replace(config.model, compile=False))
        )
    bench.figures.fraction("rollout_share", share[0], share[1], inputs={"rollouts_s": spent, "steps": steps})
    if bench.cuda:
        torch.cuda.empty_cache()


def _rollout_share(bench: Bench, config) -> tuple[tuple[float, float], list[float], int]:
    from astrai.trainer.launch.distributed import init_distributed
    from astrai.trainer.run.loop import open_trainer

    trainer = open_trainer(config, init_distributed("none", bench.device.type))
    spent = []
    prepare_step = trainer.objective.prepare_step

    def timed_prepare(batches, model, step):
        _sync(bench)
        began = time.perf_counter()
        prepared = prepare_step(batches, model, step)
        _sync(bench)
        spent.append(time.perf_counter() - began)
        return prepared

    trainer.objective.prepare_step = timed_prepare
    try:
        trainer.train(steps=2)  # compilation and capture
        spent.clear()
        steps = 3
        total = _timed(bench, lambda: trainer.train(steps=steps))
    finally:
        trainer.close()
    return (sum(spent), total), spent, steps


# --- Checkpoints and exactness ----------------------------------------------------------------------------


def checkpoints(bench: Bench) -> None:
    """A checkpoint's write over the disk's own durable write of its bytes; a periodic save's pause over a sync one;
    the host memory a periodic save's copy of the state takes at its peak over the state's bytes."""
    import torch

    from astrai.common.checkpoints import folder_bytes, latest_complete_checkpoint
    from astrai.trainer.launch.distributed import init_distributed
    from astrai.trainer.run.loop import open_trainer
    from bench.checkpoint_cost import stream_to_disk

    params = _exact_params(bench)
    config = bench.config("ckpt", param_path=str(params), window_size=bench.sizes.exact_window, compile=False)
    trainer = open_trainer(config, init_distributed("none", bench.device.type))
    try:
        trainer.train(steps=1)
        times = {"save": [], "disk": [], "pause": []}
        for repeat in range(4):
            os.sync()
            sync_s = _timed(bench, lambda: trainer.save_checkpoint("final"))
            size = folder_bytes(latest_complete_checkpoint(trainer.job_dir).path)
            _clear_job(trainer.job_dir)
            os.sync()
            disk_s = _timed(bench, lambda size=size: stream_to_disk(bench.work / "stream", size, direct=False))
            Path("/proc/self/clear_refs").write_text("5")  # the peak resident size starts again from now
            resident = status_kib("VmRSS")
            pause_s = _timed(bench, lambda: trainer.save_checkpoint("periodic"))
            trainer.checkpointer.wait()
            if not repeat:  # the first periodic save allocates the host copy: its peak
                peak = (status_kib("VmHWM") - resident) * 1024
            _clear_job(trainer.job_dir)
            if repeat:  # the first repetition warms up (buffers, page cache)
                times["save"].append(sync_s)
                times["disk"].append(disk_s)
                times["pause"].append(pause_s)
        state = [*trainer.model.state_dict().values()]
        state += [value for values in trainer.optimizer.state.values() for value in values.values()]
        state_bytes = sum(t.numel() * t.element_size() for t in state if isinstance(t, torch.Tensor))
    finally:
        trainer.close()
    sizes = {"peak_growth_bytes": peak, "state_bytes": state_bytes}
    bench.figures.fraction("ckpt_peak_host_mem_vs_state", peak, state_bytes, inputs=sizes)
    bench.figures.ratio("ckpt_save_vs_disk", times["save"], times["disk"])
    bench.figures.ratio("ckpt_stall_vs_sync", times["pause"], times["save"])


def _clear_job(job_dir: Path) -> None:
    from astrai.common.checkpoints import list_complete_checkpoints

    for checkpoint in list_complete_checkpoints(job_dir):
        shutil.rmtree(checkpoint.path)


def _exact_params(bench: Bench) -> Path:
    """The exactness and checkpoint runs' model (`base`'s shape on a GPU)."""
    from astrai.common.model_folder import ModelConfig
    from astrai.trainer.models.weights import write_base_model

    folder = bench.work / "params-exact"
    if not folder.exists():
        write_base_model(folder, ModelConfig(**bench.sizes.exact_preset, max_seq_len=2048), seed=0)
    return folder


EXACTNESS_RUNS = (("default", "auto"), ("deterministic", "auto"), ("deterministic", "false"))
"""(mode, model.compile) of each exactness worker: both modes as the defaults run (compiled on CUDA), and
deterministic mode eagerly too."""


def exactness(bench: Bench) -> None:
    """Default and deterministic mode, compiled (CUDA's default) and eager, each in a fresh process (cuBLAS reads its
    workspace setting once)."""
    figures = bench.figures
    params = _exact_params(bench)
    outcome = {}
    for mode, compiled in EXACTNESS_RUNS:
        out = bench.work / f"exact-{mode}-{compiled}.json"
        command = [sys.executable, "-m", "bench.gpu", "--exactness-worker", mode, "--compile", compiled]
        command += ["--device", bench.device.type, "--work", str(bench.work), "--params", str(params)]
        command += ["--out", str(out)]
        done = subprocess.run(command, cwd=REPO, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"the {mode} exactness worker (compile {compiled}) exited {done.returncode}")
        outcome[(mode, compiled)] = json.loads(out.read_text())
    for (mode, compiled), name in ((("deterministic", "auto"), ""), (("deterministic", "false"), "_eager")):
        det = outcome[(mode, compiled)]
        checks = {key: det["max_abs_diff"][key] == 0.0 for key in ("two_runs", "periodic_save", "stop_resume", "kill")}
        figures.observed(f"deterministic_bitwise{name}", all(checks.values()), {"checks": checks, **det})
    default = outcome[("default", "auto")]
    figures.observed("default_save_max_abs_diff", default["max_abs_diff"]["periodic_save"], default)
    figures.observed("default_two_runs_max_abs_diff", default["max_abs_diff"]["two_runs"], default)
    figures.observed("default_stop_resume_max_abs_diff", default["max_abs_diff"]["stop_resume"], default)
    figures.ratio(
        "deterministic_tokens_per_s_vs_default",
        [outcome[("deterministic", "auto")]["tokens_per_s"]],
        [default["tokens_per_s"]],
    )


def exactness_worker(mode: str, compiled: str, device: str, work: Path, params: Path, out: Path) -> None:
    """Runs of one mode in this process: two plain ones, one with a periodic save, one stopped (SIGTERM's way) and
    resumed, one whose process 'dies' after a periodic save (SIGKILL's way: no emergency save) and resumes. Their
    final weights' distances from the first run, and the first run's tokens/s."""

    from astrai.common.checkpoints import latest_complete_checkpoint
    from astrai.trainer.launch.distributed import GracefulStop, init_distributed
    from astrai.trainer.models.weights import load_base_model
    from astrai.trainer.run.loop import open_trainer

    bench = Bench(device, work)
    bench.params = params
    steps, half = bench.sizes.exact_steps, bench.sizes.exact_steps // 2
    env = init_distributed("none", device)
    # model.compile as given (auto: compiled on CUDA); the runs of one process share what the compiler made.
    keys = {"window_size": bench.sizes.exact_window, "max_steps": steps, "deterministic": mode == "deterministic"}
    keys["compile"] = False if compiled == "false" else "auto"

    def run(job: str, *, stop_at: int | None = None, die_at: int | None = None, **extra) -> float:
        stop = _StopAt(stop_at) if stop_at is not None else GracefulStop()
        trainer = open_trainer(bench.config(f"{mode}-{compiled}-{job}", **keys, **extra), env, stop)
        if trainer is None:
            raise RuntimeError(f"{mode}-{compiled}-{job} is at its last step already")
        stop.trainer = trainer
        try:
            warm = trainer.train(steps=3)  # the first steps allocate and pick kernels: not the pace
            if warm.stopped:
                return 0.0
            # die_at: training ends there and the process 'dies': nothing is saved beyond the periodic checkpoints.
            stats = trainer.train(steps=None if die_at is None else die_at - trainer.progress.step)
        finally:
            trainer.close()
        return stats.tokens_per_s

    rate = run("a")
    run("b")
    run("saved", ckpt_interval=half)
    run("stopped", stop_at=half // 2 + 1)
    run("stopped")
    run("killed", ckpt_interval=half, die_at=half + max(1, half // 4))
    run("killed", ckpt_interval=half)

    def weights(job: str) -> dict:
        checkpoint = latest_complete_checkpoint(work / f"{mode}-{compiled}-{job}")
        assert checkpoint.step == steps, (job, checkpoint.step)
        return load_base_model(checkpoint.path)[1]

    first = weights("a")

    def distance(job: str) -> float:
        other = weights(job)
        return max(float((first[name].float() - other[name].float()).abs().max()) for name in first)

    result = {
        "mode": mode,
        "compile": compiled,
        "steps": steps,
        "tokens_per_s": rate,
        "max_abs_diff": {
            "two_runs": distance("b"),
            "periodic_save": distance("saved"),
            "stop_resume": distance("stopped"),
            "kill": distance("killed"),
        },
    }
    out.write_text(json.dumps(result, indent=2))


class _StopAt:
    """A graceful stop that arrives once the trainer has taken ``step`` steps (as SIGTERM would, in between)."""

    def __init__(self, step: int):
        from astrai.trainer.launch.distributed import GracefulStop

        self._stop = GracefulStop()
        self.step = step
        self.trainer = None

    @property
    def signal_name(self):
        return self._stop.signal_name

    def agree(self, env, *others):
        if self.trainer is not None and self.trainer.progress.step >= self.step:
            self._stop.signal_name = "SIGTERM"
        return self._stop.agree(env, *others)


# --- The run ----------------------------------------------------------------------------------------------

PARTS = {
    "throughput": throughput,
    "chunked loss": chunked_loss,
    "lora": lora,
    "nf4": nf4,
    "generation": generation,
    "rollouts": rollouts,
    "checkpoints": checkpoints,
    "exactness": exactness,
}
BUDGET_S = {
    "throughput": 85,
    "chunked loss": 30,
    "lora": 55,
    "nf4": 60,
    "generation": 65,
    "rollouts": 45,
    "checkpoints": 30,
    "exactness": 110,
}
"""Each part's wall-time budget (its own process, its start included): together 8 minutes, the section's limit."""
FAULTS = ("raise", "kill")


def run(device: str, out: Path, only: list[str] | None = None, faults: dict[str, str] | None = None) -> dict:
    """Measure every part (or ``only`` those) on ``device``, each in its own process within its budget, and write the
    block into ``out`` (a results.json, whose other figures stay as they are) after each part; return the block.

    A part's crash, out-of-memory, sticky CUDA error or overrun costs only that part: it is recorded under ``errors``
    and the next part starts in a fresh process. ``faults`` (tests): make a part raise, or kill its own process."""
    began = time.perf_counter()
    block = Block()
    with tempfile.TemporaryDirectory(prefix="astrai-bench-gpu-") as work:
        make_assets(device, Path(work))
        for name in PARTS:
            if only is None or name in only:
                block.add(name, *_run_part(name, device, Path(work), (faults or {}).get(name)))
                _write(out, block.render(began))  # after every part: a run cut short keeps what it measured
    return block.render(began)


class Block:
    """The gpu block as the parts report it: every part's figures and samples, errors and wall time."""

    def __init__(self):
        self.figures = Figures()
        self.errors: dict[str, str] = {}
        self.seconds: dict[str, float] = {}
        self.device = None
        self.torch = None

    def add(self, name: str, report: dict, seconds: float) -> None:
        self.figures.update(report.get("figures", {}))
        self.figures.samples.update(report.get("samples", {}))
        self.errors.update(report.get("errors", {}))
        self.device = self.device or report.get("device")
        self.torch = self.torch or report.get("torch")
        self.seconds[name] = round(seconds, 1)

    def render(self, began: float) -> dict:
        return {
            "device": self.device,
            "torch": self.torch,
            "date": time.strftime("%Y-%m-%d"),
            "seconds": round(time.perf_counter() - began, 1),
            "part_seconds": self.seconds,
            "errors": self.errors,
            **self.figures,
            "samples": self.figures.samples,
        }


def _run_part(name: str, device: str, work: Path, fault: str | None) -> tuple[dict, float]:
    """(what the part reported, its wall time): the part run in a fresh process of its own within its budget."""
    report_file = work / f"part-{name.replace(' ', '-')}.json"
    command = [sys.executable, "-m", "bench.gpu", "--part", name, "--device", device, "--work", str(work)]
    command += ["--out", str(report_file)] + (["--fault", f"{name}={fault}"] if fault else [])
    print(f"== gpu: {name} (budget {BUDGET_S[name]} s)", flush=True)
    began = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=REPO, timeout=BUDGET_S[name], stderr=subprocess.PIPE, text=True)
        failure = _exit_failure(done.returncode, done.stderr)
        sys.stderr.write(done.stderr[-20000:])
    except subprocess.TimeoutExpired as expired:  # subprocess.run has killed it
        failure = f"stopped after its budget of {BUDGET_S[name]} s"
        sys.stderr.write((expired.stderr or b"").decode(errors="replace")[-20000:])
    seconds = time.perf_counter() - began
    report = json.loads(report_file.read_text()) if report_file.exists() else {}
    if failure is not None and name not in report.get("errors", {}):
        report.setdefault("errors", {})[name] = failure
    print(f"   {name}: {seconds:.1f} s{'' if failure is None else ' -- ' + failure}", flush=True)
    return report, seconds


def _exit_failure(code: int, stderr: str) -> str | None:
    """None for a part that exited 0; else what its exit says (a signal's name, or the code and its last line)."""
    if code == 0:
        return None
    if code < 0:
        return f"its process was killed by {signal.Signals(-code).name}"
    last = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
    return f"its process exited {code}: {last}"


def part_main(name: str, device: str, work: Path, out: Path, fault: str | None) -> int:
    """One part in this process: its figures, samples and errors into ``out`` (written also when it fails)."""
    import torch

    bench = Bench(device, work)
    device_name = torch.cuda.get_device_name(bench.device) if bench.cuda else CPU_DEVICE
    report = {"device": device_name, "torch": torch.__version__}
    code = 0
    try:
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "raise":
            raise RuntimeError(f"a fault asked for in {name}")
        PARTS[name](bench)
    except Exception as error:  # recorded with what the part measured before it
        bench.errors[name] = f"{type(error).__name__}: {error}"
        traceback.print_exc()
        code = 1
    report.update(figures=dict(bench.figures), samples=bench.figures.samples, errors=bench.errors)
    out.write_text(json.dumps(report), encoding="utf-8")
    return code


CPU_DEVICE = "cpu (tiny sizes: a check of the code)"


def _write(out: Path, block: dict) -> None:
    results = json.loads(out.read_text(encoding="utf-8")) if out.exists() else {}
    results[GPU_BLOCK] = block
    out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device", default="cuda", choices=("cuda", "cpu"), help="cuda (default), or cpu at tiny sizes"
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="the results file to write the gpu block into")
    parser.add_argument("--only", action="append", choices=sorted(PARTS), help="measure only this part (repeatable)")
    parser.add_argument("--fault", action="append", default=[], help=argparse.SUPPRESS)  # PART=raise|kill (tests)
    parser.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)
    parser.add_argument("--exactness-worker", choices=("default", "deterministic"), help=argparse.SUPPRESS)
    parser.add_argument("--compile", choices=("auto", "false"), default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--params", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    faults = dict(fault.split("=", 1) for fault in args.fault)
    if args.part:
        return part_main(args.part, args.device, args.work, args.out, faults.get(args.part))
    if args.exactness_worker:
        if args.exactness_worker == "deterministic":
            from astrai.trainer.launch.determinism import make_deterministic

            make_deterministic()
        exactness_worker(args.exactness_worker, args.compile, args.device, args.work, args.params, args.out)
        return 0
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("invoke bench --gpu: no GPU found (torch sees no CUDA device); nothing measured", flush=True)
        return 0
    block = run(args.device, args.out, args.only, faults)
    print(json.dumps({key: value for key, value in block.items() if key != "samples"}, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
