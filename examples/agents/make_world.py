"""Write the toy agent world of docs/agents.md into a folder: a tokenizer with a chat template that renders tools, a
tiny base model of its vocabulary, the prompts, and two texts to pre-train the model on.

    python examples/agents/make_world.py WORLD

The tokenizer is byte-level (one token a byte) with the chat markers as special tokens, so that the ``tiny`` preset
(a vocabulary of 320) learns it in minutes on a CPU. ``episodes.jsonl`` holds whole episodes that call ``secret`` and
answer with the digit it told: the format, and reading the tool's reply. ``guesses.jsonl`` holds the habit that
reinforcement learning must undo: nine answers in ten are a guess given at once, without the call.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
QUESTION = "Which digit is hidden?"


def write_tokenizer(folder: Path) -> Path:
    """A byte-level tokenizer (each byte a token, ids 0-255) with the chat markers as special tokens after them, and
    the example chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    mapping = _byte_chars()
    vocabulary = {mapping[byte]: byte for byte in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocabulary, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIALS))
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": (HERE / "chat_template.jinja").read_text(encoding="utf-8"),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return folder


def _byte_chars() -> dict[int, str]:
    """GPT-2's map of bytes to printable characters (what a ByteLevel pre-tokenizer turns bytes into)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    characters, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            characters[byte] = chr(byte)
        else:
            characters[byte] = chr(256 + extra)
            extra += 1
    return characters


def episode_messages(digit: str, answer: str) -> list[dict]:
    """A whole episode as chat messages: the question, the call, the tool's reply, the answer."""
    call = {"id": "call00001", "type": "function", "function": {"name": "secret", "arguments": {}}}
    return [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "secret", "tool_call_id": "call00001", "content": digit},
        {"role": "assistant", "content": answer},
    ]


def guess_messages(answer: str) -> list[dict]:
    """An episode answered at once, without the tool."""
    return [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": answer}]


def write_world(root: Path, prompts: int = 400, episodes: int = 4000, called: float = 0.1, seed: int = 0) -> None:
    """The tokenizer folder and tiny base model (``base``), the prompts (``prompts.jsonl``) and the two pre-training
    texts (``episodes.jsonl``: every episode calls the tool; ``guesses.jsonl``: a share ``called`` does, the others
    guess; a document each) under ``root``."""
    sys.path.insert(0, str(HERE))
    from secret_keeper import SecretKeeper

    from astrai.data.chat import ChatTemplate
    from astrai.data.tool_schemas import json_schema
    from astrai.trainer.models.weights import PRESETS, write_base_model

    root = Path(root)
    base = write_tokenizer(root / "base")
    write_base_model(base, PRESETS["tiny"], seed=seed)
    template = ChatTemplate.of_folder(base)
    tools = [json_schema(SecretKeeper().secret)]
    rng = random.Random(seed)

    def digit() -> str:
        return str(rng.randrange(10))

    def write(name: str, conversations: list[list[dict]]) -> None:
        with open(root / name, "w", encoding="utf-8") as handle:
            for messages in conversations:
                handle.write(json.dumps({"text": template.render(messages, tools=tools)}) + "\n")

    told = [digit() for _ in range(episodes)]
    write("episodes.jsonl", [episode_messages(secret, secret) for secret in told])
    told = [digit() for _ in range(episodes)]
    write(
        "guesses.jsonl",
        [episode_messages(secret, secret) if rng.random() < called else guess_messages(digit()) for secret in told],
    )
    with open(root / "prompts.jsonl", "w", encoding="utf-8") as handle:
        for _ in range(prompts):
            record = {"prompt": [{"role": "user", "content": QUESTION}], "answer": digit()}
            handle.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    write_world(Path(sys.argv[1]))
