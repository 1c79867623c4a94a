"""A small chat world for the post-training tests: a tokenizer with a chat template, a base model, SFT and DPO data.

Every SFT record has the same system prompt, a user turn of lowercase words, and an assistant turn
that repeats them in capitals (a third of the records go on for a second user and assistant turn).
Every DPO pair prefers that answer to one of other, random, lowercase words. Both are learnable by
a tiny model in a few dozen steps.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from hf_folders import make_chat_tokenizer

SYSTEM_PROMPT = "You repeat what the user says, in capitals."
WORDS = "cat sat on mat and then ran to red door while birds sang over green hills by the old mill".split()


@dataclass(frozen=True)
class ChatWorld:
    tokenizer: Path
    model: Path
    sft_records: list[dict]
    dpo_records: list[dict]
    sft_file: Path
    dpo_file: Path


def _words(rng: random.Random, low: int = 3, high: int = 7) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def sft_records(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for number in range(count):
        question = _words(rng)
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": question},
            {"role": "assistant", "content": question.upper()},
        ]
        if number % 3 == 2:
            follow = _words(rng)
            messages += [{"role": "user", "content": follow}, {"role": "assistant", "content": follow.upper()}]
        records.append({"messages": messages})
    return records


def dpo_records(count: int, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    records = []
    for _ in range(count):
        question = _words(rng)
        records.append(
            {
                "prompt": [{"role": "user", "content": question}],
                "chosen": question.upper(),
                "rejected": _words(rng),
            }
        )
    return records


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def make_chat_world(root: Path, style: str = "chatml", sft_count: int = 240, dpo_count: int = 160) -> ChatWorld:
    """Tokenizer (with ``style``'s template), a tiny base model of its vocabulary, and the two record files.

    The chatml template sits in tokenizer_config.json, the header one in chat_template.jinja.
    """
    from astrai.common.model_folder import ModelConfig
    from astrai.trainer.models.weights import write_base_model

    root = Path(root)
    rng = random.Random(7)
    texts = [SYSTEM_PROMPT] * 20 + [_words(rng, 5, 12) for _ in range(300)]
    texts += [text.upper() for text in texts[20:200]]
    tokenizer = make_chat_tokenizer(root / "tokenizer", texts, style, in_config=style == "chatml")
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tokenizer / "tokenizer.json")).get_vocab_size()
    model = root / "base"
    write_base_model(model, ModelConfig(vocab_size=vocab, max_seq_len=256), seed=0)
    sft, dpo = sft_records(sft_count), dpo_records(dpo_count)
    return ChatWorld(
        tokenizer,
        model,
        sft,
        dpo,
        write_jsonl(root / "chat.jsonl", sft),
        write_jsonl(root / "pairs.jsonl", dpo),
    )
