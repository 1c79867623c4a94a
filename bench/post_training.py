"""Post-training: what packing SFT records and scoring DPO pairs cost against plain pre-training steps.

The data is chat records built from the demo corpus (a fixed system prompt, a user sentence, an
assistant sentence), rendered with a ChatML template by a BPE tokenizer trained here; the pre-training
side trains on the same conversations as plain text, with the same tokenizer, model, window and batch.
Every side runs in this one process, in alternating turns, on its CPU time.

- ``sft_vs_seq``: SFT tokens per CPU-second over pre-training's. SFT counts the tokens of its records
  (a packed window's padding is not a token), so the figure holds both costs of packing: the attention
  mask that keeps records apart, and the room left at the end of each window.
- ``dpo_step_vs_two_seq``: a DPO step of B pairs over a pre-training step of 2B sequences of the same
  window, i.e. two forward and backward passes of the chosen and the rejected rows' tokens; for each
  ``training.dpo_reference`` mode, ``dpo_<mode>_step_vs_two_seq``: the live reference adds its forward
  pass to every step, the precomputed one scored every pair once, before the first step.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from astrai.common.config import build_config
from astrai.data.pipeline import prepare
from astrai.data.tokenizing import HFTokenizer
from astrai.trainer.launch.distributed import init_distributed
from astrai.trainer.models.weights import PRESETS, write_base_model
from astrai.trainer.run.loop import open_trainer
from bench.common import REPO, Figures, fix_threads

CORPUS = sorted((REPO / "examples" / "corpus").glob("*.txt"))
SYSTEM = "You are a helpful assistant who answers in one sentence."
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WINDOW, BATCH, STEPS = 256, 8, 3


def _sentences() -> list[str]:
    text = " ".join(path.read_text() for path in CORPUS).replace("\n", " ")
    return [s.strip() + "." for s in text.split(". ") if len(s.strip()) > 20]


def _assets(folder: Path) -> dict[str, Path]:
    """Tokenizer (with the template), base model, and the three data folders: seq, sft, dpo."""
    sentences = _sentences()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=2000, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(sentences, trainer)
    tok = folder / "tokenizer"
    tok.mkdir()
    tokenizer.save(str(tok / "tokenizer.json"))
    config = {"chat_template": CHATML, "eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (tok / "tokenizer_config.json").write_text(json.dumps(config))
    rng = random.Random(0)
    chats, pairs, plain = [], [], []
    for _ in range(3000):
        question, answer, other = (rng.choice(sentences) for _ in range(3))
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
        chats.append({"messages": messages})
        pairs.append({"prompt": messages[:2], "chosen": answer, "rejected": other})
        plain.append("".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages))
    for name, rows in (("chat.jsonl", chats), ("pairs.jsonl", pairs)):
        (folder / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "plain.txt").write_text("".join(plain))
    hf = HFTokenizer(tok)
    prepare(folder / "seq", [folder / "plain.txt"], tokenizer=hf)
    prepare(folder / "sft", [folder / "chat.jsonl"], tokenizer=hf, kind="sft")
    prepare(folder / "dpo", [folder / "pairs.jsonl"], tokenizer=hf, kind="dpo")
    model = folder / "base"
    config = PRESETS["tiny"]
    write_base_model(model, type(config)(**{**config.__dict__, "vocab_size": hf.vocab_size}), seed=0)
    return {"model": model, "seq": folder / "seq", "sft": folder / "sft", "dpo": folder / "dpo"}


def _trainer(assets: dict, folder: Path, kind: str, batch: int, **training):
    config = build_config(
        {
            "data": {"data_root_path": str(assets[kind]), "window_size": WINDOW, "num_workers": 0},
            "training": {
                "train_type": kind,
                "max_steps": 10**6,
                "batch_per_device": batch,
                "max_lr": 1e-4,
                "warmup_ratio": 0.0,
                "device": "cpu",
                **training,
            },
            "ckpt": {"ckpt_dir": str(folder / f"job-{kind}-{len(training)}"), "param_path": str(assets["model"])},
            "log": {"log_interval": 10**6, "eval_interval": 10**6},
        }
    )
    config = build_config({**config.to_dict(), "ckpt": {**config.to_dict()["ckpt"], "ckpt_interval": 10**9}})
    return open_trainer(config, init_distributed("none", "cpu"))


def _turns(sides: dict, turns: int) -> dict[str, list[float]]:
    """CPU seconds of ``STEPS`` steps of each side, in alternating order, after a warm-up."""
    for trainer in sides.values():
        trainer.train(steps=2)
    times = {name: [] for name in sides}
    names = list(sides)
    for turn in range(turns):
        for name in names if turn % 2 == 0 else names[::-1]:
            start = time.process_time()
            sides[name].train(steps=STEPS)
            times[name].append(time.process_time() - start)
    return times


def measure(folder: Path, quick: bool, figures: Figures) -> None:
    fix_threads()
    assets = _assets(folder)
    turns = 5 if quick else 13
    seq, sft = _trainer(assets, folder, "seq", BATCH), _trainer(assets, folder, "sft", BATCH)
    try:
        windows = sft.dataset.packing.windows
        fill = sum(take - 1 for window in windows for _, take in window) / (len(windows) * WINDOW)
        times = _turns({"seq": seq, "sft": sft}, turns)
    finally:
        seq.close()
        sft.close()
    # Tokens per CPU-second: seq trains WINDOW tokens per row, SFT fill * WINDOW of its records.
    figures.ratio("sft_vs_seq", [t / 1.0 for t in times["seq"]], [t / fill for t in times["sft"]])
    figures.observed("sft_window_fill", round(fill, 4), "record tokens over window positions, over the packing")

    two_seq = _trainer(assets, folder, "seq", 2 * BATCH)
    modes = {mode: _trainer(assets, folder, "dpo", BATCH, dpo_reference=mode) for mode in ("live", "precomputed")}
    try:
        times = _turns({"seq": two_seq, **modes}, turns)
    finally:
        two_seq.close()
        for trainer in modes.values():
            trainer.close()
    for mode in modes:
        figures.ratio(f"dpo_{mode}_step_vs_two_seq", times[mode], times["seq"])
    default = build_config({}).training.dpo_reference
    figures.lowest("dpo_step_vs_two_seq", [f"dpo_{default}_step_vs_two_seq"])


def run(quick: bool) -> Figures:
    figures = Figures()
    with tempfile.TemporaryDirectory(prefix="astrai-bench-post-") as work:
        measure(Path(work), quick, figures)
    return figures
