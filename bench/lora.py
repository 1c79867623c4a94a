"""LoRA against full fine-tuning: the same data, model, window and batch, on `small` and `base`, on CPU.

LoRA here is rank 16 on every projection of every block (q, k, v, o, gate, up, down), as the defaults, with the
frozen base held in bfloat16 (``training.lora_base_dtype``; what ``auto`` gives on a GPU) and float32 adapters.

- ``<preset>_lora_tokens_per_s_vs_full``: tokens per CPU-second of LoRA over full fine-tuning, in alternating turns
  of a few steps in this one process (LoRA computes no gradient for the frozen weights and updates only the
  adapters).
- ``<preset>_lora_peak_mem_vs_full``: the peak resident memory while training a few steps, over the process's
  memory just before the trainer was built (so: the model, its gradients, the optimizer's state and the
  activations), LoRA's over full fine-tuning's; each side in a fresh process of its own, sampled every 2 ms.
  Reading the base model at start is in both: both sides read the same weights the same way.
  ``<preset>_lora_fp32_base_peak_mem_vs_full``: the same with the base held in float32 (``auto`` on a CPU).
- ``<preset>_lora_ckpt_bytes_vs_full``: the bytes of a LoRA checkpoint folder over a full one's, same step.
- ``<preset>_lora_save_vs_full``: the time of a final save (written and flushed) of LoRA over full, paired turns.

The headline keys without a preset are the worst of the two presets; the peak memory's is `base`'s, the preset its
target is set on (on `small` the activations, the same on both sides, outweigh the weights).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from astrai.common.checkpoints import folder_bytes, latest_complete_checkpoint
from astrai.common.config import build_config
from astrai.common.contract import REASON_EMERGENCY
from astrai.data.pipeline import prepare
from astrai.trainer.launch.distributed import init_distributed
from astrai.trainer.models.weights import PRESETS, write_base_model
from astrai.trainer.run.loop import open_trainer
from bench.common import REPO, TORCH_THREADS, Figures, fix_threads

CORPUS = sorted((REPO / "examples" / "corpus").glob("*.txt"))
WINDOW, BATCH, STEPS, RANK = 128, 4, 2, 16
PRESET_NAMES = ("small", "base")


def _sections(folder: Path, preset: str, lora: bool, job: str, base_dtype: str = "bfloat16") -> dict:
    return {
        "data": {"data_root_path": str(folder / "data"), "window_size": WINDOW, "num_workers": 0},
        "training": {
            "max_steps": 10**6,
            "batch_per_device": BATCH,
            "max_lr": 1e-4,
            "warmup_ratio": 0.0,
            "device": "cpu",
            "lora_rank": RANK if lora else 0,
            "lora_base_dtype": base_dtype,
        },
        "ckpt": {"ckpt_dir": str(folder / job), "param_path": str(folder / preset), "ckpt_interval": 10**9},
        "log": {"log_interval": 10**6, "eval_interval": 10**6},
    }


def _trainer(folder: Path, preset: str, lora: bool, job: str):
    return open_trainer(build_config(_sections(folder, preset, lora, job)), init_distributed("none", "cpu"))


_PEAK = """
import json, resource, sys, threading, time
import torch
torch.set_num_threads({threads})
from astrai.common.config import build_config
from astrai.trainer.launch.distributed import init_distributed
from astrai.trainer.run.loop import open_trainer

def rss():
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * resource.getpagesize()

config = build_config(json.loads(sys.argv[1]))
env = init_distributed("none", "cpu")
before = rss()
trainer = open_trainer(config, env)
peak, done = [rss()], threading.Event()

def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.002)

watcher = threading.Thread(target=sample)
watcher.start()
trainer.train(steps={steps})
done.set()
watcher.join()
trainer.close()
print(json.dumps({{"growth": peak[0] - before}}))
"""


def _peak_growth(folder: Path, preset: str, lora: bool, base_dtype: str = "bfloat16") -> int:
    sections = _sections(folder, preset, lora, f"peak-{preset}-{lora}-{base_dtype}", base_dtype)
    script = _PEAK.format(threads=TORCH_THREADS, steps=STEPS)
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(sections)], capture_output=True, text=True, check=True, cwd=REPO
    )
    return json.loads(done.stdout.strip().splitlines()[-1])["growth"]


def measure(folder: Path, preset: str, quick: bool, figures: Figures) -> None:
    write_base_model(folder / preset, PRESETS[preset], seed=0)
    turns = 3 if quick else 7
    full, lora = _trainer(folder, preset, False, f"full-{preset}"), _trainer(folder, preset, True, f"lora-{preset}")
    sides = {"full": full, "lora": lora}
    try:
        for trainer in sides.values():
            trainer.train(steps=1)  # warm-up
        times = {name: [] for name in sides}
        saves = {name: [] for name in sides}
        for turn in range(turns):
            for name in ("full", "lora") if turn % 2 == 0 else ("lora", "full"):
                start = time.process_time()
                sides[name].train(steps=STEPS)
                times[name].append(time.process_time() - start)
        for turn in range(max(3, turns // 2)):
            for name in ("full", "lora") if turn % 2 == 0 else ("lora", "full"):
                sides[name].progress.step += 1  # a new checkpoint name each time; nothing else reads it here
                start = time.perf_counter()
                sides[name].save_checkpoint(REASON_EMERGENCY)
                saves[name].append(time.perf_counter() - start)
        sizes = {name: folder_bytes(path) for name, path in _newest(sides).items()}
    finally:
        for trainer in sides.values():
            trainer.close()
    figures.ratio(f"{preset}_lora_tokens_per_s_vs_full", times["full"], times["lora"])
    figures.ratio(f"{preset}_lora_save_vs_full", saves["lora"], saves["full"])
    figures.fraction(f"{preset}_lora_ckpt_bytes_vs_full", sizes["lora"], sizes["full"], {"bytes": sizes})
    growth = {name: _peak_growth(folder, preset, name == "lora") for name in sides}
    growth["lora_fp32_base"] = _peak_growth(folder, preset, True, "float32")
    figures.fraction(f"{preset}_lora_peak_mem_vs_full", growth["lora"], growth["full"], {"bytes": growth})
    figures.fraction(
        f"{preset}_lora_fp32_base_peak_mem_vs_full", growth["lora_fp32_base"], growth["full"], {"bytes": growth}
    )


def _newest(sides: dict) -> dict[str, Path]:
    return {name: latest_complete_checkpoint(trainer.job_dir).path for name, trainer in sides.items()}


def run(quick: bool) -> Figures:
    figures = Figures()
    fix_threads()
    with tempfile.TemporaryDirectory(prefix="astrai-bench-lora-") as work:
        folder = Path(work)
        prepare(folder / "data", CORPUS)
        for preset in PRESET_NAMES:
            measure(folder, preset, quick, figures)
    for key in ("lora_tokens_per_s_vs_full",):
        figures.lowest(key, [f"{preset}_{key}" for preset in PRESET_NAMES])
    for key in ("lora_ckpt_bytes_vs_full", "lora_save_vs_full"):
        figures.highest(key, [f"{preset}_{key}" for preset in PRESET_NAMES])
    figures.highest("lora_peak_mem_vs_full", ["base_lora_peak_mem_vs_full"])
    return figures
