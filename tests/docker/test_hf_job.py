"""A job in the container from a sharded bf16 Hugging Face folder and data prepared with its tokenizer:
preflight says what it found, the run stops and resumes, and the final checkpoint loads in transformers."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from astrai.common.checkpoints import latest_complete_checkpoint
from tests.support import REPO, run_python

pytestmark = pytest.mark.docker

CORPUS = sorted((REPO / "examples" / "corpus").glob("*.txt"))


def _hf_folder(folder, vocab_size: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(folder, max_shard_size="100KB")


def _tokenizer(folder) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([path.read_text() for path in CORPUS], trainer)
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))


def test_a_job_from_a_sharded_hf_folder_trains_resumes_and_loads_in_transformers(make_job):
    from transformers import AutoModelForCausalLM

    job = make_job(trainer={"training": {"max_steps": 100000}, "ckpt": {"ckpt_interval": 1000}})
    shutil.rmtree(job.folder / "params")
    shutil.rmtree(job.folder / "data")
    _hf_folder(job.folder / "params", 512)
    _tokenizer(job.folder / "tokenizer")
    prepare = ["-m", "astrai.data", "prepare", "--tokenizer", str(job.folder / "tokenizer")]
    run_python(*prepare, "--out", str(job.folder / "data"), *map(str, CORPUS), check=True)
    shards = sorted(
        set(json.loads((job.folder / "params" / "model.safetensors.index.json").read_text())["weight_map"].values())
    )
    assert len(shards) > 1

    job.invoke("init")
    checklist = job.invoke("preflight").stdout
    line = next(line for line in checklist.splitlines() if "base model" in line)
    assert line.startswith("✓") and "llama (2 layers, dim 64, vocab 512, GQA 4/2)" in line, checklist
    assert "bfloat16" in line and f"{len(shards)} shards" in line

    stopped = job.stop_and_finish()
    # The corpus is small: the stop may fall in any epoch, so match the step alone.
    assert re.search(rf"resumed from \S+/epoch_\d+_step_{stopped}\b", job.logs()), job.logs()
    assert job.checkpoints()[-1] == (stopped + 10, "final")

    final = latest_complete_checkpoint(job.job_dir).path
    assert (final / "tokenizer.json").read_bytes() == (job.folder / "tokenizer" / "tokenizer.json").read_bytes()
    model, info = AutoModelForCausalLM.from_pretrained(final, output_loading_info=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
