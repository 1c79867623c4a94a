"""Generation: the trainer's own cached sampling against transformers' ``generate`` on the same folder.

A `small`-shaped Llama folder (dim 512, 8 layers, a vocabulary of 2,000) written by ``astrai.model``, which
transformers loads as it is. Both sides take the same 8 prompts of 12 to 40 tokens (left-padded in one batch)
and make 128 new tokens each, greedily and with no stop token, so every row makes all 128; in alternating
turns in this one process, on CPU time, with one thread.

- ``generate_vs_transformers``: new tokens per CPU-second of ours over transformers'.
"""

from __future__ import annotations

import dataclasses
import random
import tempfile
import time
from pathlib import Path

import torch

from astrai.common.settings import Sampling
from astrai.trainer.generation.decoding import generate
from astrai.trainer.models.weights import PRESETS, load_pretrained, write_base_model
from bench.common import Figures, fix_threads
from tests.support import transformers_generate

PROMPTS, NEW_TOKENS, VOCAB = 8, 128, 2000


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(12, 40))] for _ in range(PROMPTS)]


def run(quick: bool) -> Figures:
    from transformers import AutoModelForCausalLM

    figures = Figures()
    fix_threads()
    turns = 3 if quick else 7
    prompts = _prompts()
    sampling = Sampling(max_new_tokens=NEW_TOKENS)
    with tempfile.TemporaryDirectory(prefix="astrai-bench-generate-") as work:
        folder = Path(work) / "model"
        write_base_model(folder, dataclasses.replace(PRESETS["small"], vocab_size=VOCAB), seed=0)
        ours = load_pretrained(folder)
        theirs = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        sides = {
            "ours": lambda: generate(ours, prompts, sampling),
            "transformers": lambda: transformers_generate(theirs, prompts, NEW_TOKENS),
        }
        same = sides["ours"]() == sides["transformers"]()  # warm-up, and the same tokens on both sides
        times = {name: [] for name in sides}
        for turn in range(turns):
            for name in sides if turn % 2 == 0 else reversed(list(sides)):
                start = time.process_time()
                made = sides[name]()
                times[name].append(time.process_time() - start)
                assert all(len(row) == NEW_TOKENS for row in made)
    figures.ratio("generate_vs_transformers", times["transformers"], times["ours"])
    figures.observed("generate_same_tokens", same, "greedy completions of both sides compared, all 8 rows")
    return figures
