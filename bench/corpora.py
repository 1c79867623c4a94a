"""Real corpora: `prepare` on JSON Lines against the tokenizers library, on every core, in bounded memory; mixtures.

- ``prepare_jsonl_vs_tokenizers``: tokens/s of ``python -m astrai.data prepare`` (all cores: reading the
  JSON Lines files, parsing every record, encoding, writing shards, checksums and the manifest) over the
  tokenizers library's own ``encode_batch`` of the same records, driven from all cores by its thread pool
  (records already parsed into memory, nothing written). Both run as fresh processes, in turns.
- ``prepare_parallel_speedup``: tokens/s of `prepare` on all cores over ``--workers 1``; ``cores`` beside it.
- ``prepare_memory_10x``: peak resident memory of `prepare` (the largest of its processes) on a corpus ten
  times larger than another, over the smaller one's.
- ``mixture_vs_single``: trainer tokens per CPU-second with three data sources over one, same model, window
  and batch, in alternating turns in one process.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from astrai.common.config import DataSource
from astrai.data.pipeline import prepare
from astrai.data.sources import available_cpus
from astrai.trainer.launch.distributed import init_distributed
from astrai.trainer.run.loop import open_trainer
from bench.common import REPO, Figures, fix_threads, run_prepare
from bench.hf_io import _tokenizer
from bench.trainer_speed import make_assets, trainer_config

CORPUS = sorted((REPO / "examples" / "corpus").glob("*.txt"))


def _jsonl_corpus(folder: Path, megabytes: float, files: int = 4, seed: int = 0) -> list[Path]:
    """``files`` JSON Lines files of about ``megabytes`` MB in all: records of shuffled demo-corpus sentences."""
    sentences = [s.strip() for path in CORPUS for s in path.read_text().replace("\n", " ").split(". ") if s.strip()]
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    budget = int(megabytes * 2**20 / files)
    paths = []
    for index in range(files):
        path = folder / f"part-{index:03d}.jsonl"
        with open(path, "w", encoding="utf-8") as handle:
            written = 0
            while written < budget:
                text = ". ".join(rng.choice(sentences) for _ in range(rng.randint(3, 30))) + "."
                line = json.dumps({"id": written, "text": text, "meta": {"source": "bench"}}) + "\n"
                handle.write(line)
                written += len(line)
        paths.append(path)
    return paths


_LIBRARY = """
import json, sys, time
from tokenizers import Tokenizer
tokenizer = Tokenizer.from_file(sys.argv[1])
texts = [json.loads(line)["text"] for path in sys.argv[2:] for line in open(path, encoding="utf-8")]
start = time.perf_counter()
tokens = sum(len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False)) + len(texts)
print(tokens / (time.perf_counter() - start))
"""


def _library_rate(tokenizer: Path, files: list[Path]) -> float:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "true", "RAYON_NUM_THREADS": str(available_cpus())}
    result = subprocess.run(
        [sys.executable, "-c", _LIBRARY, str(tokenizer), *map(str, files)], capture_output=True, text=True, env=env
    )
    if result.returncode != 0:
        raise RuntimeError(result.stderr)
    return float(result.stdout)


def prepare_speed(folder: Path, quick: bool, figures: Figures) -> None:
    files = _jsonl_corpus(folder / "jsonl", 12 if quick else 24)
    tokenizer = _tokenizer(folder)
    cores = available_cpus()
    ours, library, single = [], [], []
    run_prepare(folder / "out", files, tokenizer, cores)  # warm the page cache and the imports
    for turn in range(3 if quick else 5):
        ways = [("ours", cores), ("library", None), ("single", 1)]
        for name, workers in ways if turn % 2 == 0 else ways[::-1]:
            if name == "library":
                library.append(_library_rate(tokenizer, files))
            else:
                rate = run_prepare(folder / "out", files, tokenizer, workers)[0]
                (ours if name == "ours" else single).append(rate)
    figures.ratio("prepare_jsonl_vs_tokenizers", ours, library)
    figures.ratio("prepare_parallel_speedup", ours, single)
    figures.observed("cores", cores, "os.sched_getaffinity(0)")
    figures.median("prepare_jsonl_tokens_per_s", ours)
    figures.quotient("prepare_parallel_efficiency", "prepare_parallel_speedup", "cores")


def prepare_memory(folder: Path, quick: bool, figures: Figures) -> None:
    # Files of 20 MB on both sides, larger than the pieces prepare cuts them into: the larger corpus has ten
    # times the files (and ten times the pieces), so only what grows with the corpus can tell them apart.
    files = 2 if quick else 3
    small = _jsonl_corpus(folder / "small", 20 * files, files=files, seed=1)
    large = _jsonl_corpus(folder / "large", 200 * files, files=10 * files, seed=2)
    cores = available_cpus()
    peaks = {"small": [], "large": []}
    for turn in range(2 if quick else 3):
        for name in ("small", "large") if turn % 2 == 0 else ("large", "small"):
            files = small if name == "small" else large
            peaks[name].append(run_prepare(folder / f"out-{name}", files, None, cores)[1])
    figures.ratio("prepare_memory_10x", peaks["large"], peaks["small"])


def mixture_speed(folder: Path, quick: bool, figures: Figures) -> None:
    fix_threads()
    params, data = make_assets(folder, "tiny")
    root = folder / "mixture"
    for name, part in (("web", CORPUS), ("code", CORPUS[:2]), ("books", CORPUS[3:])):
        prepare(root / name, part)
    window, batch, steps = 64, 8, 20
    env = init_distributed("none", "cpu")
    single = open_trainer(trainer_config(params, data, folder / "job-single", window, batch, 10**6), env)
    mixed_config = trainer_config(params, root, folder / "job-mixed", window, batch, 10**6)
    sources = (DataSource("web", 3.0), DataSource("code", 1.0), DataSource("books", 1.0))
    mixed_config = replace(mixed_config, data=replace(mixed_config.data, sources=sources))
    mixed = open_trainer(mixed_config, env)
    times = {"single": [], "mixed": []}
    try:
        single.train(steps=3)
        mixed.train(steps=3)
        for turn in range(7 if quick else 15):
            for name in ("single", "mixed") if turn % 2 == 0 else ("mixed", "single"):
                trainer = single if name == "single" else mixed
                start = time.process_time()
                trainer.train(steps=steps)
                times[name].append(time.process_time() - start)
    finally:
        single.close()
        mixed.close()
    # The same tokens per turn on both sides: the ratio of rates is the inverse ratio of CPU times.
    figures.ratio("mixture_vs_single", times["single"], times["mixed"])


def run(quick: bool) -> Figures:
    figures = Figures()
    with tempfile.TemporaryDirectory(prefix="astrai-bench-corpora-") as work:
        prepare_speed(Path(work), quick, figures)
        prepare_memory(Path(work), quick, figures)
        mixture_speed(Path(work), quick, figures)
    return figures
