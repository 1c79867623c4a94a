"""Trainer overhead: tokens/s of the trainer over tokens/s of a bare PyTorch loop.

Both train the same model (same weights), on the same token windows, with the
same batch, AdamW settings, clipping and learning rate, in this one process on
the CPU with ``bench.common.TORCH_THREADS`` threads. The bare loop is the
smallest honest training loop: batches already in memory, forward,
cross-entropy, backward, clip, step. The trainer adds what a user relies on: its
DataLoader, schedule, loss bookkeeping, progress lines and metrics file.

The two run in short turns, back to back, the order swapped every turn, and
each turn's ratio compares two neighbouring measurements.
``<preset>_trainer_vs_bare`` is the median of those ratios on the CPU time of
this process: with one torch thread and no DataLoader workers, all of either
loop's work is on that clock, and it does not run while another process holds
the core (this machine is shared; wall-clock turns swing by tens of percent).
``<preset>_trainer_vs_bare_wall`` is the same on wall time, as a cross-check.
Each comes with ``..._spread``, the relative half-width of the median's ~95%
confidence interval (``bench.common.ratio_with_spread``).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from astrai.common.config import build_config
from astrai.common.data_folder import TokenData
from astrai.data.pipeline import prepare
from astrai.trainer.feed.windows import WindowDataset, epoch_permutation
from astrai.trainer.launch.distributed import init_distributed
from astrai.trainer.models.native import Transformer
from astrai.trainer.models.weights import PRESETS, load_base_model, write_base_model
from astrai.trainer.run.loop import open_trainer
from bench.common import REPO, Figures, fix_threads

# preset: (window_size, batch_per_device, steps per turn)
SETUPS = {"tiny": (128, 16, 4), "small": (128, 4, 1)}


def make_assets(folder: Path, preset: str) -> tuple[Path, Path]:
    """A base model of ``preset`` and token data from the demo corpus."""
    params, data = folder / f"params-{preset}", folder / "data"
    write_base_model(params, PRESETS[preset], seed=0)
    if not data.exists():
        prepare(data, sorted((REPO / "examples" / "corpus").glob("*.txt")))
    return params, data


def trainer_config(params: Path, data: Path, job_dir: Path, window: int, batch: int, max_steps: int, **ckpt):
    return build_config(
        {
            "data": {"data_root_path": str(data), "window_size": window, "num_workers": 0},
            "training": {
                "max_steps": max_steps,
                "batch_per_device": batch,
                "max_lr": 1e-3,
                "warmup_ratio": 0.0,
                "device": "cpu",
            },
            "ckpt": {"ckpt_dir": str(job_dir), "param_path": str(params), "ckpt_interval": 10**9, **ckpt},
            "log": {"log_interval": 20},
        }
    )


class BareLoop:
    """The reference: a plain PyTorch training loop over the same windows."""

    def __init__(self, params: Path, data: Path, window: int, batch: int, lr: float, max_grad_norm: float):
        config, weights = load_base_model(params)
        self.model = Transformer(config)
        self.model.load_state_dict(weights)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
        dataset = WindowDataset(TokenData.open(data), window)
        order = epoch_permutation(len(dataset), seed=0, epoch=0)
        windows = [dataset[int(index)] for index in order[: (len(order) // batch) * batch]]
        self.batches = torch.stack(windows).view(-1, batch, window + 1)
        self.vocab_size, self.max_grad_norm, self.cursor = config.vocab_size, max_grad_norm, 0

    def train(self, steps: int) -> None:
        """Train ``steps`` steps."""
        self.model.train()
        for _ in range(steps):
            batch = self.batches[self.cursor % len(self.batches)]
            self.cursor += 1
            logits = self.model(batch[:, :-1])
            loss = F.cross_entropy(logits.view(-1, self.vocab_size), batch[:, 1:].reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


def _timed(run) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of ``run()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    run()
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(preset: str, repeats: int, folder: Path, figures: Figures) -> None:
    window, batch, steps = SETUPS[preset]
    params, data = make_assets(folder, preset)
    env = init_distributed("none", "cpu")
    config = trainer_config(params, data, folder / f"job-{preset}", window, batch, max_steps=10**6)
    trainer = open_trainer(config, env)
    bare = BareLoop(params, data, window, batch, config.training.max_lr, config.training.max_grad_norm)
    sides = {"trainer": lambda: trainer.train(steps=steps), "bare": lambda: bare.train(steps)}
    try:
        trainer.train(steps=3)  # warm up both: allocator, kernels, first batches
        bare.train(3)
        times: dict[str, list[tuple[float, float]]] = {"trainer": [], "bare": []}
        for turn in range(repeats):
            for side in ("trainer", "bare") if turn % 2 == 0 else ("bare", "trainer"):
                times[side].append(_timed(sides[side]))
    finally:
        trainer.close()
    tokens = steps * batch * window
    figures.median(f"{preset}_trainer_tokens_per_s", [tokens / wall for wall, _ in times["trainer"]])
    figures.median(f"{preset}_bare_tokens_per_s", [tokens / wall for wall, _ in times["bare"]])
    # Both sides train the same tokens per turn, so the ratio of rates is the inverse ratio of times.
    bare, ours = times["bare"], times["trainer"]
    figures.ratio(f"{preset}_trainer_vs_bare", [cpu for _, cpu in bare], [cpu for _, cpu in ours])
    figures.ratio(f"{preset}_trainer_vs_bare_wall", [wall for wall, _ in bare], [wall for wall, _ in ours])


def run(quick: bool) -> dict:
    fix_threads()
    figures = Figures()
    with tempfile.TemporaryDirectory(prefix="astrai-bench-speed-") as work:
        for preset in SETUPS:
            measure(preset, 7 if quick else 21, Path(work), figures)
    for key in ("trainer_vs_bare", "trainer_vs_bare_wall"):
        figures.lowest(key, [f"{preset}_{key}" for preset in SETUPS])
    return figures
