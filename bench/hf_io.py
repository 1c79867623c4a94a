"""Bringing your own model and tokenizer: what our wrappers cost over the libraries they wrap.

- ``prepare_vs_tokenizers``: tokens/s of ``python -m astrai.data prepare --tokenizer`` on every core, run as a
  command in a fresh process and timed from outside (starting, reading, encoding, writing shards, checksums and
  the manifest) over a plain ``Tokenizer.encode_batch`` of the same files' text in this process (already read,
  nothing written, the library's threads on every core). Above 1 means our batching beats the plain call.
- ``load_vs_safetensors``: loading a sharded fp32 base model for training (``load_base_model``: config,
  header checks against it, reading, renaming) over ``safetensors.torch.load_file`` of the same shards.
- ``load_bf16_vs_safetensors``: the same for bf16 shards, as most Hugging Face models ship (the widening
  to fp32 happens in the copy into the model that every load does, on either side of this comparison).

Both sides run in turns, from the page cache, and the medians are compared.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from astrai.data.sources import available_cpus
from astrai.trainer.models.weights import PRESETS, hf_state_dict, load_base_model, write_base_model
from bench.common import REPO, Figures, run_prepare

CORPUS = sorted((REPO / "examples" / "corpus").glob("*.txt"))


def _timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _corpus(folder: Path, megabytes: int) -> list[Path]:
    """Four text files of about ``megabytes`` MB in all, made of the demo corpus."""
    text = "\n".join(path.read_text() for path in CORPUS)
    copies = max(1, megabytes * 2**20 // (4 * len(text)))
    files = []
    for i in range(4):
        path = folder / f"text_{i}.txt"
        path.write_text((text + "\n") * copies)
        files.append(path)
    return files


def _tokenizer(folder: Path) -> Path:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=2000, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([path.read_text() for path in CORPUS], trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def prepare_vs_tokenizers(folder: Path, quick: bool, figures: Figures) -> None:
    # The same corpus in both modes (--quick takes fewer turns): on a smaller one the command's start, which
    # the plain call in this process does not pay, would weigh more in one mode than in the other.
    files = _corpus(folder, 8)
    tokenizer_path = _tokenizer(folder)
    plain = Tokenizer.from_file(str(tokenizer_path))
    texts = [path.read_text() for path in files]

    def plain_rate() -> float:
        start = time.perf_counter()
        tokens = sum(len(encoding.ids) for encoding in plain.encode_batch(texts, add_special_tokens=False))
        return tokens / (time.perf_counter() - start)

    def ours_rate() -> float:
        # Ours also counts one end-of-text token per file.
        return run_prepare(folder / "data", files, tokenizer_path, available_cpus())[0]

    ours_rate()  # warm the page cache and the command's imports
    rates = {"plain": [], "ours": []}
    for turn in range(3 if quick else 5):
        for side in ("plain", "ours") if turn % 2 == 0 else ("ours", "plain"):
            rates[side].append(plain_rate() if side == "plain" else ours_rate())
    figures.ratio("prepare_vs_tokenizers", rates["ours"], rates["plain"])
    figures.median("prepare_tokens_per_s", rates["ours"])


def _shard(folder: Path, dtype: torch.dtype, shards: int = 3) -> list[Path]:
    """Rewrite ``folder``'s model.safetensors as ``shards`` shard files plus an index, in ``dtype``."""
    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(state)
    weight_map, files = {}, []
    for i in range(shards):
        part = names[i::shards]
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: state[k].to(dtype) for k in part}, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
        files.append(folder / name)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return files


def load_vs_safetensors(folder: Path, quick: bool, figures: Figures) -> None:
    for key, dtype in (("load_vs_safetensors", torch.float32), ("load_bf16_vs_safetensors", torch.bfloat16)):
        model = folder / f"model-{key}"
        write_base_model(model, PRESETS["small"], seed=0)
        files = _shard(model, dtype)
        config, state = load_base_model(model)
        if set(hf_state_dict(state, config)) != {k for f in files for k in load_file(f)}:
            raise RuntimeError("the two loads read different tensors")
        ours, plain = [], []
        for _ in range(5 if quick else 11):
            plain.append(_timed(lambda files=files: [load_file(f) for f in files]))
            ours.append(_timed(lambda model=model: load_base_model(model)))
        figures.ratio(key, ours, plain)


def run(quick: bool) -> dict:
    figures = Figures()
    with tempfile.TemporaryDirectory(prefix="astrai-bench-hf-") as folder:
        prepare_vs_tokenizers(Path(folder), quick, figures)
        load_vs_safetensors(Path(folder), quick, figures)
    return figures


if __name__ == "__main__":
    print(json.dumps(run(quick=True), indent=2))
