"""online_grpo: that it learns, what its update costs against an SFT step, and how much of a step is rollouts.

- **It learns** (``grpo_reward_start``, ``grpo_reward_end``): a toy task with a verifiable reward that the
  ``tiny`` preset can pick up. Prompts ``repeat: D`` (a digit); the reward is the share of the first four
  characters of the completion that are ``D``. The model is first pre-trained (``seq``, 400 steps) on lines
  ``repeat: D`` followed by four digits, each ``D`` with probability 0.2 and a random digit otherwise: it
  learns the format and a weak lean to copy, so its completions score about 0.2 to 0.3, as a base model
  with a latent skill does. Then ``online_grpo`` trains it for 400 steps (4 prompts x 8 completions, lr
  5e-4): the median of the first 20 steps' mean rewards, and of the last 20. The curve (every 10 steps) is kept
  with the figures and drawn in docs/post-training.md.
- ``grpo_update_vs_sft``: completion tokens per CPU-second of GRPO's update (the forward and backward pass of
  :func:`astrai.trainer.objectives.rollouts.completion_logps` and the loss) over an SFT step's on the same rows
  (prompt and completion, the loss on the completion's tokens), on the ``small`` preset, in alternating turns.
- ``grpo_rollout_share``: the share of an ``online_grpo`` step's CPU time spent before its update (sampling the
  completions, scoring them, the advantages), in the learning run above.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from astrai.common.config import KEY_SECTION, load_trainer_config
from astrai.common.contract import METRICS_FILE
from astrai.common.settings import GRPOSettings
from astrai.data.pipeline import prepare
from astrai.trainer.launch.distributed import init_distributed
from astrai.trainer.models.native import Transformer
from astrai.trainer.models.weights import PRESETS, write_base_model
from astrai.trainer.objectives.grpo import grpo_loss
from astrai.trainer.objectives.rollouts import completion_logps
from astrai.trainer.run.loop import open_trainer
from bench.common import Figures, fix_threads

REWARD = '''
def repeated(prompts, completions, digit, **fields):
    """The share of the completion's first four characters that are the prompt's digit."""
    return [sum(character == d for character in completion[:4]) / 4 for d, completion in zip(digit, completions)]
'''
STEPS, WINDOW, PRETRAIN = 400, 20, 400


def _world(root: Path) -> None:
    rng = random.Random(0)
    lines = []
    for _ in range(6000):
        digit = rng.randrange(10)
        rest = "".join(str(digit) if rng.random() < 0.2 else str(rng.randrange(10)) for _ in range(4))
        lines.append(f"repeat: {digit}{rest}\n")
    (root / "pre.txt").write_text("".join(lines), encoding="utf-8")
    with open(root / "prompts.jsonl", "w", encoding="utf-8") as handle:
        for _ in range(200):
            digit = rng.randrange(10)
            handle.write(json.dumps({"prompt": f"repeat: {digit}", "digit": str(digit)}) + "\n")
    (root / "reward.py").write_text(REWARD, encoding="utf-8")
    prepare(root / "pre", [root / "pre.txt"])
    prepare(root / "prompts", [root / "prompts.jsonl"], kind="prompts")
    write_base_model(root / "base", PRESETS["tiny"], seed=0)


def _open(root: Path, name: str, **keys):
    """A trainer of the job ``name`` in this process, from flat keys (CPU, no loader workers)."""
    document: dict = {}
    values = {"device": "cpu", "num_workers": 0, "warmup_ratio": 0.05, "ckpt_dir": str(root / name), **keys}
    for key, value in values.items():
        document.setdefault(KEY_SECTION[key], {})[key] = value
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    return open_trainer(load_trainer_config(path), init_distributed("none", "cpu"))


def _train(trainer) -> None:
    try:
        trainer.train()
    finally:
        trainer.close()


def _learning(figures: Figures, root: Path) -> None:
    _world(root)
    pre = _open(
        root,
        "pre",
        data_root_path=str(root / "pre"),
        param_path=str(root / "base"),
        window_size=64,
        batch_per_device=16,
        max_steps=PRETRAIN,
        max_lr=3e-3,
        ckpt_interval=PRETRAIN,
        log_interval=100,
    )
    _train(pre)
    grpo = _open(
        root,
        "grpo",
        data_root_path=str(root / "prompts"),
        param_path=str(next((root / "pre").glob(f"epoch_*_step_{PRETRAIN}"))),
        train_type="online_grpo",
        rewards=[f"{root / 'reward.py'}:repeated"],
        num_generations=8,
        max_completion_length=5,
        batch_per_device=4,
        max_steps=STEPS,
        max_lr=5e-4,
        schedule="constant",
        ckpt_interval=STEPS,
        log_interval=1,
    )
    rollout = [0.0]
    prepare_step = grpo.objective.prepare_step

    def timed(*args, **kwargs):
        start = time.process_time()
        try:
            return prepare_step(*args, **kwargs)
        finally:
            rollout[0] += time.process_time() - start

    grpo.objective.prepare_step = timed
    start = time.process_time()
    _train(grpo)
    total = time.process_time() - start
    records = [json.loads(line) for line in (root / "grpo" / METRICS_FILE).read_text().splitlines()]
    rewards = [record["reward"] for record in records]
    curve = {record["step"]: round(record["reward"], 4) for record in records if record["step"] % 10 == 0}
    figures.median("grpo_reward_start", rewards[:WINDOW])
    figures.median("grpo_reward_end", rewards[-WINDOW:])
    figures.observed("grpo_reward_curve", curve, "mean reward of every 10th step's 32 completions")
    figures.fraction("grpo_rollout_share", rollout[0], total, {"steps": STEPS})


def _update_vs_sft(figures: Figures, quick: bool) -> None:
    """GRPO's update against an SFT step on the same rows: 32 rows of a 32-token prompt and a 96-token completion."""
    torch.manual_seed(0)
    model = Transformer(PRESETS["small"])
    model.init_weights(torch.Generator().manual_seed(0))
    vocab = model.config.vocab_size
    rows, prompt_length, completion_length = 32, 32, 96
    prompts = torch.randint(0, vocab, (rows, prompt_length)).tolist()
    completions = torch.randint(0, vocab, (rows, completion_length)).tolist()
    tokens = torch.tensor([p + c for p, c in zip(prompts, completions, strict=True)])
    weights = torch.zeros(rows, prompt_length + completion_length - 1)
    weights[:, prompt_length - 1 :] = 1.0
    advantage = torch.randn(rows)
    settings = GRPOSettings(loss="dapo", max_completion_length=completion_length)

    def grpo_step():
        logps, mask, _ = completion_logps(model, prompts, completions)
        loss, _ = grpo_loss(logps, logps.detach(), None, advantage, mask, settings)
        loss.backward()
        model.zero_grad(set_to_none=True)

    def sft_step():
        logits = model(tokens[:, :-1])
        losses = F.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1), reduction="none")
        ((losses * weights.reshape(-1)).sum() / weights.sum()).backward()
        model.zero_grad(set_to_none=True)

    sides = {"grpo": grpo_step, "sft": sft_step}
    for side in sides.values():
        side()  # warm-up
    times = {name: [] for name in sides}
    for turn in range(3 if quick else 7):
        for name in sides if turn % 2 == 0 else reversed(list(sides)):
            start = time.process_time()
            sides[name]()
            times[name].append(time.process_time() - start)
    # The same completion tokens on both sides: tokens per second's ratio is the time's inverse ratio.
    figures.ratio("grpo_update_vs_sft", times["sft"], times["grpo"])


def run(quick: bool) -> Figures:
    figures = Figures()
    fix_threads()
    _update_vs_sft(figures, quick)
    with tempfile.TemporaryDirectory(prefix="astrai-bench-grpo-") as work:
        _learning(figures, Path(work))
    return figures
