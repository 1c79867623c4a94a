"""QLoRA: LoRA r16 with its frozen base in 4 bits (``training.lora_base_dtype: nf4``) against the same LoRA with the
base in bfloat16, on CPU: the same data, window, batch and adapters.

- ``nf4_base_bytes_vs_bf16``: the bytes the frozen base takes in memory (every NF4 field counted: codes, int8 scales,
  factors, means), NF4's over bfloat16's, on the model below.
- ``nf4_peak_mem_vs_bf16``: the peak resident memory while training a few steps over the process's memory just before
  the trainer was built, NF4's over bfloat16's, each side in a fresh process of its own, sampled every 2 ms from the
  first step on (so: the base as held, the adapters and their moments, a step's activations and the product's
  dequantised layer; not the float32 weights read at start, which both sides read alike and free). glibc's allocator
  is told to hand back every freed block over 64 KiB (``MALLOC_MMAP_THRESHOLD_``), so that the figure is memory in
  use, as the GPU block's ``max_memory_allocated`` is, and not the free blocks its heap keeps from one layer's
  transient to the next. The model is one whose weights dominate: dim 2048, 16 layers, 16/4 heads, MLP 5632 (713M
  parameters in its blocks), batch 1 x 64.
- ``nf4_tokens_per_s_vs_bf16``: tokens per CPU-second, NF4's over bfloat16's, alternating turns of a few steps in one
  process on the same model (each NF4 product dequantises its layer, forward and backward: the cost shown here is
  the CPU's, eager; the GPU block's figure is the one with a target).
- ``nf4_step0_loss_vs_bf16``: the loss at step 0 (one batch of 8 x 64, the adapters at their start: B is zero, so it
  is the base's loss) with the base in NF4 over that with the base in bfloat16, on `small` trained first (full
  fine-tuning, 60 steps) so that its weights carry what the quantisation can lose; ``nf4_logits_top1_vs_bf16``: the
  share of that batch's positions whose most likely next token is the same under both (the error the quantisation
  brings, stated).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from astrai.common.checkpoints import latest_complete_checkpoint
from astrai.common.config import build_config
from astrai.common.model_folder import ModelConfig
from astrai.data.pipeline import prepare
from astrai.trainer.launch.distributed import init_distributed
from astrai.trainer.models.weights import PRESETS, write_base_model
from astrai.trainer.run.loop import open_trainer
from bench.common import REPO, TORCH_THREADS, Figures, fix_threads
from bench.lora import _PEAK

CORPUS = sorted((REPO / "examples" / "corpus").glob("*.txt"))
WEIGHTY = ModelConfig(dim=2048, n_layers=16, n_heads=16, n_kv_heads=4, ffn_hidden_dim=5632)
"""A model whose weights dominate a step of batch 1 x 64: 713M parameters in its blocks."""
WINDOW, BATCH, STEPS, RANK = 64, 1, 2, 16
TRAINED_STEPS = 60


def _sections(folder: Path, params: Path, job: str, base_dtype: str | None, **training) -> dict:
    lora = {"lora_rank": RANK, "lora_base_dtype": base_dtype} if base_dtype else {"lora_rank": 0}
    return {
        "data": {"data_root_path": str(folder / "data"), "window_size": WINDOW, "num_workers": 0},
        "training": {
            "max_steps": 10**6,
            "batch_per_device": BATCH,
            "max_lr": 1e-4,
            "warmup_ratio": 0.0,
            "device": "cpu",
            **lora,
            **training,
        },
        "ckpt": {"ckpt_dir": str(folder / job), "param_path": str(params), "ckpt_interval": 10**9},
        "log": {"log_interval": 10**6, "eval_interval": 10**6, "report_to": ["none"]},
    }


def _trainer(folder: Path, params: Path, job: str, base_dtype: str | None, **training):
    config = build_config(_sections(folder, params, job, base_dtype, **training))
    return open_trainer(config, init_distributed("none", "cpu"))


def _base_bytes(model) -> int:
    from astrai.trainer.models.nf4 import is_nf4

    total = 0
    for name, param in model.named_parameters():
        if ".lora_" in name:
            continue
        parts = (param,)
        if is_nf4(param):
            parts = (param.quantized_data, param.quantized_scalers, param.quantization_factor, param.scaler_mean)
        for part in parts:
            total += part.numel() * part.element_size()
    return total


def _peak_growth(folder: Path, params: Path, base_dtype: str) -> int:
    sections = _sections(folder, params, f"peak-{base_dtype}", base_dtype)
    script = _PEAK.format(threads=TORCH_THREADS, steps=STEPS)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(64 << 10)}
    command = [sys.executable, "-c", script, json.dumps(sections)]
    done = subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])["growth"]


def speed_and_memory(folder: Path, quick: bool, figures: Figures) -> None:
    params = folder / "weighty"
    write_base_model(params, WEIGHTY, seed=0)
    sides = {dtype: _trainer(folder, params, f"speed-{dtype}", dtype) for dtype in ("bfloat16", "nf4")}
    try:
        bytes_held = {dtype: _base_bytes(trainer.model) for dtype, trainer in sides.items()}
        for trainer in sides.values():
            trainer.train(steps=1)  # warm-up
        times = {dtype: [] for dtype in sides}
        for turn in range(3 if quick else 7):
            for dtype in ("bfloat16", "nf4") if turn % 2 == 0 else ("nf4", "bfloat16"):
                start = time.process_time()
                sides[dtype].train(steps=STEPS)
                times[dtype].append(time.process_time() - start)
    finally:
        for trainer in sides.values():
            trainer.close()
    figures.fraction("nf4_base_bytes_vs_bf16", bytes_held["nf4"], bytes_held["bfloat16"], {"bytes": bytes_held})
    figures.ratio("nf4_tokens_per_s_vs_bf16", times["bfloat16"], times["nf4"])
    growth = {dtype: _peak_growth(folder, params, dtype) for dtype in ("bfloat16", "nf4")}
    figures.fraction("nf4_peak_mem_vs_bf16", growth["nf4"], growth["bfloat16"], {"bytes": growth})


def step0_loss(folder: Path, figures: Figures) -> None:
    """The base's loss on one batch held both ways, on `small` after some full fine-tuning."""
    import torch

    params = folder / "small"
    write_base_model(params, PRESETS["small"], seed=0)
    trainer = _trainer(folder, params, "pretrain", None, max_steps=TRAINED_STEPS, max_lr=1e-3, batch_per_device=8)
    try:
        trainer.train()
    finally:
        trainer.close()
    trained = latest_complete_checkpoint(folder / "pretrain").path
    losses, top1 = {}, {}
    for dtype in ("bfloat16", "nf4"):
        trainer = _trainer(folder, trained, f"step0-{dtype}", dtype, batch_per_device=8)
        try:
            tokens = torch.stack([trainer.loader.dataset[i] for i in range(8)])
            trainer.model.eval()
            with torch.no_grad():
                logits = trainer.model(tokens[:, :-1])
            losses[dtype] = float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()))
            top1[dtype] = logits.argmax(-1)
        finally:
            trainer.close()
    figures.fraction("nf4_step0_loss_vs_bf16", losses["nf4"], losses["bfloat16"], {"loss": losses})
    same = float((top1["nf4"] == top1["bfloat16"]).float().mean())
    figures.observed("nf4_logits_top1_vs_bf16", round(same, 4), {"positions": top1["nf4"].numel()})


def run(quick: bool) -> Figures:
    figures = Figures()
    fix_threads()
    with tempfile.TemporaryDirectory(prefix="astrai-bench-qlora-") as work:
        folder = Path(work)
        prepare(folder / "data", CORPUS)
        speed_and_memory(folder, quick, figures)
        step0_loss(folder, figures)
    return figures
