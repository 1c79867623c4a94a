"""The transformers path (``model.backend: transformers``) against the native one and against a bare loop, on CPU.

All three train the same Llama folder (the ``small`` preset, window 128, batch 4), on the same token windows, with
the same AdamW settings, in this one process with ``bench.common.TORCH_THREADS`` threads, in short turns whose
order changes every turn; each figure is the median of per-turn ratios of CPU time (as ``trainer_speed``).

- ``native_vs_transformers_backend``: the trainer's tokens per CPU-second on the native path over the same trainer
  with ``model.backend: transformers`` (the library's Llama): what the native path is worth.
- ``transformers_backend_vs_bare``: the trainer on the transformers path over a bare PyTorch loop around the same
  ``AutoModelForCausalLM`` (batches in memory, forward, cross-entropy over its logits, backward, clip, step): what
  the trainer adds around the library's model.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from astrai.common.data_folder import TokenData
from astrai.trainer.feed.windows import WindowDataset, epoch_permutation
from astrai.trainer.launch.distributed import init_distributed
from astrai.trainer.run.loop import open_trainer
from bench.common import Figures, fix_threads
from bench.trainer_speed import make_assets, trainer_config

PRESET, WINDOW, BATCH, STEPS = "small", 128, 4, 1


class BareTransformersLoop:
    """The reference: a plain PyTorch training loop around transformers' own model of the folder."""

    def __init__(self, params: Path, data: Path, lr: float, max_grad_norm: float):
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(params, dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
        dataset = WindowDataset(TokenData.open(data), WINDOW)
        order = epoch_permutation(len(dataset), seed=0, epoch=0)
        windows = [dataset[int(index)] for index in order[: (len(order) // BATCH) * BATCH]]
        self.batches = torch.stack(windows).view(-1, BATCH, WINDOW + 1)
        self.max_grad_norm, self.cursor = max_grad_norm, 0

    def train(self, steps: int) -> None:
        self.model.train()
        for _ in range(steps):
            batch = self.batches[self.cursor % len(self.batches)]
            self.cursor += 1
            logits = self.model(input_ids=batch[:, :-1], use_cache=False).logits
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


def _cpu_seconds(run) -> float:
    start = time.process_time()
    run()
    return time.process_time() - start


def run(quick: bool) -> Figures:
    fix_threads()
    figures = Figures()
    repeats = 7 if quick else 21
    with tempfile.TemporaryDirectory(prefix="astrai-bench-backend-") as work:
        folder = Path(work)
        params, data = make_assets(folder, PRESET)
        env = init_distributed("none", "cpu")
        native_config = trainer_config(params, data, folder / "native", WINDOW, BATCH, max_steps=10**6)
        through_config = trainer_config(params, data, folder / "through", WINDOW, BATCH, max_steps=10**6)
        through_config = dataclasses.replace(
            through_config, model=dataclasses.replace(through_config.model, backend="transformers")
        )
        native, through = open_trainer(native_config, env), open_trainer(through_config, env)
        training = native_config.training
        bare = BareTransformersLoop(params, data, training.max_lr, training.max_grad_norm)
        sides = {
            "native": lambda: native.train(steps=STEPS),
            "transformers": lambda: through.train(steps=STEPS),
            "bare": lambda: bare.train(STEPS),
        }
        try:
            native.train(steps=2)  # warm up every side: allocator, kernels, first batches
            through.train(steps=2)
            bare.train(2)
            times: dict[str, list[float]] = {name: [] for name in sides}
            for turn in range(repeats):
                order = list(sides)[turn % 3 :] + list(sides)[: turn % 3]
                for name in order if turn % 2 == 0 else reversed(order):
                    times[name].append(_cpu_seconds(sides[name]))
        finally:
            native.close()
            through.close()
    # Each side trains the same tokens per turn: the ratio of rates is the inverse ratio of CPU times.
    figures.ratio("native_vs_transformers_backend", times["transformers"], times["native"])
    figures.ratio("transformers_backend_vs_bare", times["bare"], times["transformers"])
    return figures
