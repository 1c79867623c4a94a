"""A new objective needs only the members the contract declares: a toy REINFORCE loss over the sampled rollout source,
built without any change to the loop or the builders, trains, stops and resumes bitwise on CPU."""

from __future__ import annotations

import json

import pytest
import torch
from trainer_runs import final_weights

from astrai.common.checkpoints import latest_complete_checkpoint
from astrai.common.config import load_trainer_config
from astrai.common.contract import METRICS_FILE
from astrai.data.pipeline import prepare
from astrai.trainer.launch.distributed import GracefulStop, init_distributed
from astrai.trainer.objectives.contract import Objective
from astrai.trainer.objectives.rollouts import Rollouts, completion_logps, sample_step
from astrai.trainer.run import build
from astrai.trainer.run.loop import open_trainer

pytestmark = pytest.mark.slow

REWARD = """
def vowels(prompts, completions, **fields):
    return [sum(ch in "aeiou" for ch in completion) / max(len(completion), 1) for completion in completions]
"""


class Reinforce(Objective):
    """REINFORCE with the mean reward of the micro-batch as its baseline: -(r - mean r) * log p(completion)."""

    def __init__(self, parts: build.RunParts):
        self.env = parts.env
        self.source = build.sampled_rollouts(parts)
        self.autocast = build.autocast_for(parts.plan)
        self.completions = build.completions_log(parts)
        self.tokens = 0
        self.rewards: list[float] = []

    def prepare_step(self, batches, model, step: int) -> list[Rollouts]:
        rollouts = sample_step(self.source, model, batches, step, None, self.autocast, self.completions)
        self.tokens = sum(
            len(p) + len(c) for part in rollouts for p, c in zip(part.prompts, part.completions, strict=True)
        )
        return rollouts

    def micro(self, model, batch, prepared: Rollouts, accum: int) -> tuple[torch.Tensor, torch.Tensor]:
        logps, mask, _ = completion_logps(model, prepared.prompts, prepared.completions)
        rewards = torch.tensor([reward or 0.0 for reward in prepared.rewards])
        self.rewards += rewards.tolist()
        advantage = (rewards - rewards.mean()).unsqueeze(1)
        loss = -(advantage * logps * mask).sum() / mask.sum().clamp(min=1.0)
        return loss / accum, loss.detach()

    def step_tokens(self, planned: int) -> int:
        return self.tokens

    def metrics(self) -> dict | None:
        if not self.rewards:
            return None
        mean, self.rewards = sum(self.rewards) / len(self.rewards), []
        return {"reward": mean}


def reinforce(parts: build.RunParts) -> build.BuiltObjective:
    return build.BuiltObjective(Reinforce(parts))


class StopAt(GracefulStop):
    """A stop signal that arrives while step ``step`` trains (as SIGTERM would)."""

    def __init__(self, step: int):
        super().__init__()
        self.step = step
        self.trainer = None

    def agree(self, env, *others):
        if self.trainer is not None and self.trainer.progress.step == self.step:
            self.signal_name = "SIGTERM"
        return super().agree(env, *others)


@pytest.fixture
def job(tmp_path, train_yaml):
    records = tmp_path / "prompts.jsonl"
    records.write_text("".join(json.dumps({"prompt": f"say {w}:"}) + "\n" for w in ["ab", "io", "xy", "ue"] * 4))
    prepare(tmp_path / "data", [records], kind="prompts")
    (tmp_path / "reward.py").write_text(REWARD)

    def write(name: str):
        return train_yaml(
            tmp_path / f"{name}.yaml",
            train_type="online_grpo",  # the data and keys of the online types; the objective is ours
            data_root_path=str(tmp_path / "data"),
            rewards=[f"{tmp_path / 'reward.py'}:vowels"],
            num_generations=3,
            max_completion_length=5,
            batch_per_device=2,
            max_steps=6,
            ckpt_interval=6,
            log_interval=1,
            warmup_ratio=0.0,
            ckpt_dir=str(tmp_path / name),
        )

    return write


def _run(path, stop: GracefulStop | None = None) -> None:
    trainer = open_trainer(load_trainer_config(path), init_distributed("none", "cpu"), stop, objective=reinforce)
    if isinstance(stop, StopAt):
        stop.trainer = trainer
    try:
        trainer.train()
    finally:
        trainer.close()


def test_a_new_objective_trains_stops_and_resumes_bitwise(job, tmp_path, one_thread):
    _run(job("whole"))
    records = [json.loads(line) for line in (tmp_path / "whole" / METRICS_FILE).read_text().splitlines()]
    assert [record["step"] for record in records] == list(range(1, 7))
    assert all(0.0 <= record["reward"] <= 1.0 for record in records)
    assert all(record["tokens_seen"] > 0 for record in records)

    stopped = job("stopped")
    _run(stopped, StopAt(step=3))
    latest = latest_complete_checkpoint(tmp_path / "stopped")
    assert (latest.step, latest.meta.reason) == (3, "emergency")
    _run(stopped)
    assert final_weights(tmp_path / "stopped", 6) == final_weights(tmp_path / "whole", 6)
