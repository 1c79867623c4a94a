"""Episodes (tools, an environment): that a model learns to act with a tool, what a step of episodes costs against a
single-turn step, and that no tool or environment token reaches the loss.

- **It learns** (``agent_reward_start``, ``agent_reward_end``): the toy world of examples/agents (docs/agents.md).
  Each episode hides a digit that only the environment's ``secret`` tool tells; the reward
  (``astrai.rewards:exact_answer``) is 1 for the right digit. The ``tiny`` preset, on the example's byte-level
  tokenizer, is pre-trained (``seq``) in two parts: :data:`PRETRAIN` steps on whole episodes that call ``secret`` and
  answer with the digit it told (the format, and reading the tool's reply), then :data:`HABIT` steps on episodes of
  which nine in ten answer at once with a guess (the habit to undo). Then ``online_grpo`` plays 4 prompts x 8
  episodes a step for :data:`STEPS` steps. The start is the pre-trained model's own reward: :data:`WINDOW` steps of
  episodes whose updates are nil (every advantage zeroed, no weight decay; the weights are checked unchanged after
  them), their median; the end is the median of the learning run's last :data:`WINDOW` steps. The curve (the first
  step and every 10th) is kept with the figures and drawn in docs/agents.md.
- ``episode_step_vs_single_turn``: tokens per CPU-second of a step of episodes (two turns, the tool's reply between
  them: the model of the first part of the pre-training, which always calls) over a single-turn ``online_grpo``
  step's, on the same model and prompts, in alternating turns (15 of each); a step's tokens are its prompts',
  completions' and replies' (what the trainer counts).
- ``tool_tokens_in_loss``: over steps of the learning run, the tokens of tool and environment replies whose
  log-probability gets a gradient from the loss (the update's own tensors, counted): 0.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from astrai.common.config import KEY_SECTION, load_trainer_config
from astrai.common.contract import METRICS_FILE
from astrai.data.pipeline import prepare
from astrai.data.tokenizing import HFTokenizer
from astrai.trainer.launch.distributed import init_distributed
from astrai.trainer.objectives.grpo import grpo_loss
from astrai.trainer.objectives.rollouts import completion_logps
from astrai.trainer.run.loop import open_trainer
from bench.common import REPO, Figures, fix_threads

EXAMPLE = REPO / "examples" / "agents"
STEPS, WINDOW, PRETRAIN, HABIT = 200, 20, 1500, 200
EPISODE = {
    "train_type": "online_grpo",
    "environment": f"{EXAMPLE / 'secret_keeper.py'}:SecretKeeper",
    "rewards": ["astrai.rewards:exact_answer"],
    "num_generations": 8,
    "batch_per_device": 4,
    "max_completion_length": 48,
    "max_episode_tokens": 160,
    "max_turns": 3,
}


def _world(root: Path) -> None:
    sys.path.insert(0, str(EXAMPLE))
    import make_world

    make_world.write_world(root)  # the world docs/agents.md's worked example writes
    tokenizer = HFTokenizer(root / "base")
    prepare(root / "pre", [root / "episodes.jsonl"], tokenizer=tokenizer)
    prepare(root / "habit", [root / "guesses.jsonl"], tokenizer=tokenizer)
    prepare(root / "prompts", [root / "prompts.jsonl"], tokenizer=tokenizer, kind="prompts")


def _open(root: Path, name: str, **keys):
    """A trainer of the job ``name`` in this process, from flat keys (CPU, no loader workers)."""
    document: dict = {}
    values = {"device": "cpu", "num_workers": 0, "warmup_ratio": 0.05, "ckpt_dir": str(root / name), **keys}
    for key, value in values.items():
        document.setdefault(KEY_SECTION[key], {})[key] = value
    path = root / f"{name}.yaml"
    path.write_text(json.dumps(document), encoding="utf-8")
    return open_trainer(load_trainer_config(path), init_distributed("none", "cpu"))


def _train(trainer, steps: int | None = None) -> None:
    try:
        trainer.train(steps)
    finally:
        trainer.close()


def _pretrained(root: Path) -> list[Path]:
    """The format (whole episodes, the tool always called), then the habit of guessing: both checkpoints."""
    models = [root / "base"]
    for name, steps, lr in (("pre", PRETRAIN, 3e-3), ("habit", HABIT, 1e-3)):
        keys = {"window_size": 160, "batch_per_device": 8, "max_steps": steps, "max_lr": lr, "log_interval": 100}
        start = str(models[-1])
        _train(_open(root, name, data_root_path=str(root / name), param_path=start, ckpt_interval=steps, **keys))
        models.append(next((root / name).glob(f"epoch_*_step_{steps}")))
    return models[1:]


def _reply_tokens_in_loss(trainer, counts: list[list[int]]) -> None:
    """Wrap the objective's prepare_step: each step's batches, scored again, the loss's gradient counted on the
    tokens the policy did not write."""
    objective = trainer.objective
    prepare_step = objective.prepare_step

    def counted(batches, model, step):
        prepared = prepare_step(batches, model, step)
        for batch in prepared:
            logps, mask, _ = completion_logps(model, batch.prompts, batch.completions, batch.written)
            loss, _ = grpo_loss(logps, logps.detach(), None, batch.advantages, mask, objective.settings)
            (gradient,) = torch.autograd.grad(loss, logps)
            replies = torch.zeros_like(mask, dtype=torch.bool)
            for row, written in enumerate(batch.written):
                replies[row, : len(written)] = ~torch.tensor(written)
            counts.append([int((gradient[replies] != 0).sum()), int(replies.sum())])
        return prepared

    objective.prepare_step = counted


def _episodes(root: Path, name: str, start: Path, steps: int, **keys):
    return _open(
        root,
        name,
        data_root_path=str(root / "prompts"),
        param_path=str(start),
        max_steps=steps,
        max_lr=5e-4,
        schedule="constant",
        ckpt_interval=steps,
        log_interval=1,
        **EPISODE,
        **keys,
    )


def _rewards(root: Path, name: str) -> dict[int, float]:
    """Each step's mean reward, from the run's metrics (every step is reported)."""
    records = [json.loads(line) for line in (root / name / METRICS_FILE).read_text().splitlines()]
    return {record["step"]: record["reward"] for record in records}


def _start_rewards(root: Path, start: Path) -> list[float]:
    """The start model's reward, step by step: episodes as the learning run plays them, every advantage zeroed (and
    no weight decay), so that no update moves the weights; checked."""
    trainer = _episodes(root, "start", start, WINDOW, weight_decay=0.0)
    objective = trainer.objective
    prepare_step = objective.prepare_step

    def nil(batches, model, step):
        prepared = prepare_step(batches, model, step)
        for batch in prepared:
            batch.advantages.zero_()
        return prepared

    objective.prepare_step = nil
    before = [parameter.detach().clone() for parameter in trainer.model.parameters()]
    try:
        trainer.train()
        after = list(trainer.model.parameters())
        assert all(torch.equal(old, new) for old, new in zip(before, after, strict=True)), "the start run moved"
    finally:
        trainer.close()
    return list(_rewards(root, "start").values())


def _learning(figures: Figures, root: Path, start: Path) -> None:
    figures.median("agent_reward_start", _start_rewards(root, start))
    trainer = _episodes(root, "episodes", start, STEPS)
    counts: list[list[int]] = []
    _reply_tokens_in_loss(trainer, counts)
    _train(trainer)
    rewards = _rewards(root, "episodes")
    assert sorted(rewards) == list(range(1, STEPS + 1)), sorted(rewards)
    curve = {step: round(reward, 4) for step, reward in rewards.items() if step == 1 or step % 10 == 0}
    figures.median("agent_reward_end", [rewards[step] for step in range(STEPS - WINDOW + 1, STEPS + 1)])
    figures.observed("agent_reward_curve", curve, "mean reward of the first step's and every 10th step's 32 episodes")
    reached = sum(count for count, _ in counts)
    figures.observed("tool_tokens_in_loss", reached, {"reached_and_reply_tokens_per_micro_batch": counts})


def _step_vs_single_turn(figures: Figures, root: Path, start: Path, quick: bool) -> None:
    """Steps of episodes and single-turn steps in alternating turns, each trainer going on from its last step."""
    keys = {"data_root_path": str(root / "prompts"), "param_path": str(start), "max_lr": 1e-5, "log_interval": 1000}
    turns = 3 if quick else 15
    sides = {
        "episodes": _open(root, "timed-episodes", max_steps=turns + 1, ckpt_interval=1000, **keys, **EPISODE),
        "single": _open(
            root,
            "timed-single",
            max_steps=turns + 1,
            ckpt_interval=1000,
            **keys,
            **{key: value for key, value in EPISODE.items() if key not in ("environment", "max_turns")},
        ),
    }
    rates: dict[str, list[float]] = {name: [] for name in sides}
    try:
        for trainer in sides.values():
            trainer.train(1)  # warm-up: the first step allocates
        for turn in range(turns):
            for name in sides if turn % 2 == 0 else reversed(list(sides)):
                trainer = sides[name]
                before, began = trainer.progress.tokens_seen, time.process_time()
                trainer.train(1)
                rates[name].append((trainer.progress.tokens_seen - before) / (time.process_time() - began))
    finally:
        for trainer in sides.values():
            trainer.close()
    figures.ratio("episode_step_vs_single_turn", rates["episodes"], rates["single"])


def run(quick: bool) -> Figures:
    figures = Figures()
    fix_threads()
    with tempfile.TemporaryDirectory(prefix="astrai-bench-agents-") as work:
        root = Path(work)
        _world(root)
        calling, guessing = _pretrained(root)
        _step_vs_single_turn(figures, root, calling, quick)  # its episodes call the tool: two turns each
        _learning(figures, root, guessing)
    return figures
