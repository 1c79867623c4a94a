"""online_grpo in the trainer: prompt data, a step's rollouts and update, its metrics and log, exact resume on one
and two processes, and the errors of bad rewards and settings.

The model is the tiny preset on the byte-level tokenizer; the reward is a file of ours, in TRL's shape.
"""

from __future__ import annotations

import json
import math
import random
import re
import time

import pytest
import torch
import yaml
from trainer_runs import (
    TORCHRUN,
    TRAINER,
    Run,
    final_weights,
    kill_at_moments,
    metrics_step,
    run_to_end,
    staging,
    stop_gracefully,
)

from astrai.common.checkpoints import latest_complete_checkpoint
from astrai.common.config import load_trainer_config
from astrai.common.configfile import ConfigError
from astrai.common.contract import COMPLETIONS_LOG, METRICS_FILE
from astrai.common.data_folder import DataError, TokenData
from astrai.common.memory import kv_cache_bytes
from astrai.common.settings import GRPOSettings
from astrai.common.values import format_bytes
from astrai.data.pipeline import prepare
from astrai.host.status import _grpo_summary
from astrai.trainer.models.cache import KVCache
from astrai.trainer.models.weights import load_pretrained
from astrai.trainer.objectives.grpo import advantages, grpo_loss
from astrai.trainer.objectives.rewards import RewardError
from astrai.trainer.objectives.rollouts import completion_logps, flat_groups
from tests.support import invoke

pytestmark = pytest.mark.slow

REWARDS = '''
def digits(prompts, completions, **fields):
    """The share of the completion's characters that are the digit the prompt ends with."""
    return [sum(c == fields_digit for c in completion) / max(len(completion), 1)
            for fields_digit, completion in zip(fields["digit"], completions)]

def first_code(prompts, completions, **fields):
    """Differs between nearly any two completions: every group has a signal."""
    return [ord(completion[0]) / 1000 if completion else 0.0 for completion in completions]

def raises(prompts, completions, **fields):
    raise KeyError("no such field")

def too_few(prompts, completions, **fields):
    return [1.0]

def not_finite(prompts, completions, **fields):
    return [float("nan")] * len(completions)
'''

ONLINE = {
    "train_type": "online_grpo",
    "num_generations": 4,
    "max_completion_length": 6,
    "batch_per_device": 2,
    "max_steps": 6,
    "ckpt_interval": 3,
    "log_interval": 2,
    "warmup_ratio": 0.0,
}


@pytest.fixture(scope="module")
def prompts_world(tmp_path_factory):
    """Prompt data (byte-level, 24 prompts with a `digit` field) and the reward file."""
    root = tmp_path_factory.mktemp("prompts world")  # a space in every path
    records = root / "prompts.jsonl"
    with open(records, "w", encoding="utf-8") as handle:
        for number in range(24):
            digit = str(number % 10)
            handle.write(json.dumps({"prompt": f"répète {digit} $x:", "digit": digit}, ensure_ascii=False) + "\n")
    prepare(root / "data", [records], kind="prompts")
    (root / "my rewards.py").write_text(REWARDS, encoding="utf-8")
    return root


def _yaml(train_yaml, path, world, reward="digits", **keys):
    values = {**ONLINE, "data_root_path": str(world / "data"), "rewards": [f"{world / 'my rewards.py'}:{reward}"]}
    return train_yaml(path, **{**values, **keys})


def test_prompt_data_keeps_each_prompt_with_its_fields(prompts_world):
    data = TokenData.open(prompts_world / "data")
    assert data.kind == "prompts" and sum(data.record_counts) == 24
    records = data.prompt_records()
    assert records[3] == {"prompt": "répète 3 $x:", "fields": {"digit": "3"}}
    assert data.sequence_lengths(0)[3] == len("répète 3 $x:".encode())


def test_groups_without_signal_are_counted_by_their_own_rewards():
    nan = math.nan
    totals = torch.tensor([1.0, 1.0, 0.0, 1.0, nan, nan, 2.0, nan], dtype=torch.float64)
    # equal, differing, none scored, one scored
    assert flat_groups(totals, 2) == 3


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ('{"prompt": 42}', "field 'prompt' holds int: expected text, or a list of chat messages"),
        ('{"prompt": "x", "completions": 1}', "has a field named 'completions', which reward functions receive"),
    ],
)
def test_prompt_records_the_rewards_could_not_take_are_refused(tmp_path, record, message):
    (tmp_path / "r.jsonl").write_text(record + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=re.escape(message)):
        prepare(tmp_path / "out", [tmp_path / "r.jsonl"], kind="prompts")


def test_prompt_records_without_a_prompt_are_refused_naming_the_record(tmp_path):
    records = tmp_path / "bad.jsonl"
    records.write_text('{"prompt": "fine"}\n{"question": "where is the prompt"}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"bad.jsonl:2: has no 'prompt' field \(its keys: question\)"):
        prepare(tmp_path / "out", [records], kind="prompts")
    assert not (tmp_path / "out").exists()


def test_a_run_samples_scores_reports_and_resumes_bitwise(
    tmp_path, prompts_world, train_yaml, make_trainer, run_trainer, one_thread
):
    whole = _yaml(train_yaml, tmp_path / "whole.yaml", prompts_world, ckpt_dir=str(tmp_path / "whole"))
    run_trainer(whole)
    parts = _yaml(train_yaml, tmp_path / "parts.yaml", prompts_world, ckpt_dir=str(tmp_path / "parts"))
    run_trainer(parts, steps=4)  # resumes from the checkpoint at step 3: step 4 is taken again
    resumed = make_trainer(parts)
    try:
        assert resumed.progress.step == 3
        resumed.train()
    finally:
        resumed.close()
    assert final_weights(tmp_path / "parts", 6) == final_weights(tmp_path / "whole", 6)
    records = [json.loads(line) for line in (tmp_path / "whole" / METRICS_FILE).read_text().splitlines()]
    last = records[-1]
    for key in (
        "reward",
        "reward_std",
        "reward_digits",
        "frac_reward_zero_std",
        "completion_length",
        "completion_length_max",
        "completion_clipped",
        "clip_ratio_region",
        "entropy",
    ):
        assert math.isfinite(last[key]), (key, last)
    assert "kl" not in last  # grpo_beta 0: no reference, no KL
    assert _grpo_summary(last).startswith(f"reward {last['reward']:.4f} ± ")  # invoke status's line
    assert 1 <= last["completion_length"] <= last["completion_length_max"] <= 6
    # Tokens counted are the prompts' and completions' own.
    assert 0 < last["tokens_seen"] <= 6 * 2 * 4 * (len("répète 0 $x:".encode()) + 6)
    log = (tmp_path / "whole" / COMPLETIONS_LOG).read_text(encoding="utf-8")
    assert log.startswith("step 2 | prompt ") and '"répète' in log and log.count("reward ") >= 3 * 4
    assert latest_complete_checkpoint(tmp_path / "whole").meta.train_type == "online_grpo"


@pytest.mark.parametrize("lora", [{}, {"lora_rank": 4, "lora_alpha": 8}], ids=["copy", "adapters-off"])
def test_the_kl_penalty_against_the_starting_model_is_zero_at_the_start(
    tmp_path, prompts_world, train_yaml, make_trainer, one_thread, lora
):
    path = _yaml(
        train_yaml,
        tmp_path / "t.yaml",
        prompts_world,
        reward="first_code",
        ckpt_dir=str(tmp_path / "ckpt"),
        grpo_beta=0.1,
        log_interval=1,
        **lora,
    )
    trainer = make_trainer(path, max_steps=2)
    try:
        trainer.train()
    finally:
        trainer.close()
    first, second = [json.loads(line) for line in (tmp_path / "ckpt" / METRICS_FILE).read_text().splitlines()]
    assert first["kl"] == 0.0 and second["kl"] > 0.0


def test_the_step_loss_is_grpos_on_the_steps_completions(tmp_path, prompts_world, train_yaml, make_trainer, one_thread):
    """One step's rollouts, then the micro-batches' losses: the loss of the whole global batch at once."""
    path = _yaml(
        train_yaml,
        tmp_path / "t.yaml",
        prompts_world,
        ckpt_dir=str(tmp_path / "ckpt"),
        grad_accum_steps=2,
        grpo_loss="dapo",
        scale_rewards="batch",
    )
    trainer = make_trainer(path)
    try:
        objective = trainer.objective
        batches = [torch.tensor([0, 1]), torch.tensor([2, 3])]
        rollouts = objective.prepare_step(batches, trainer.model, 0)
        total = sum(objective.micro(trainer.model, batch, r, 2)[0] for batch, r in zip(batches, rollouts, strict=True))
        prompts = [p for r in rollouts for p in r.prompts]
        completions = [c for r in rollouts for c in r.completions]
        logps, mask, _ = completion_logps(trainer.model, prompts, completions)
        digits = [str(n % 10) for n in range(4) for _ in range(4)]
        texts = [bytes(t for t in c if t < 256).decode("utf-8", "replace") for c in completions]
        rewards = [sum(ch == d for ch in text) / max(len(text), 1) for d, text in zip(digits, texts, strict=True)]
        advantage, _ = advantages(rewards, 4, "batch")
        expected, _ = grpo_loss(logps, logps.detach(), None, advantage, mask, GRPOSettings(loss="dapo"))
        assert torch.allclose(total, expected, rtol=1e-5, atol=1e-7)
        assert torch.allclose(torch.cat([r.advantages for r in rollouts]), advantage)
    finally:
        trainer.close()


@pytest.mark.parametrize(
    ("reward", "message"),
    [
        ("raises", r"reward raises raised KeyError: 'no such field' \(on a batch whose first prompt is 'répète"),
        ("too_few", r"reward too_few returned 1 values for 8 completions"),
        ("not_finite", r"reward not_finite gave nan for the completion of prompt 'répète"),
    ],
)
def test_a_bad_reward_stops_the_run_naming_it_and_keeps_the_checkpoint(
    tmp_path, prompts_world, train_yaml, make_trainer, run_trainer, one_thread, reward, message
):
    ckpt_dir = tmp_path / "ckpt"
    good = _yaml(train_yaml, tmp_path / "good.yaml", prompts_world, ckpt_dir=str(ckpt_dir))
    run_trainer(good, steps=3)
    bad = _yaml(train_yaml, tmp_path / "bad.yaml", prompts_world, reward=reward, ckpt_dir=str(ckpt_dir))
    trainer = make_trainer(bad)
    try:
        with pytest.raises(RewardError, match=message):
            trainer.train()
    finally:
        trainer.close()
    assert latest_complete_checkpoint(ckpt_dir).step == 3


def test_settings_out_of_range_are_refused_naming_the_key(tmp_path, prompts_world, train_yaml):
    path = _yaml(train_yaml, tmp_path / "t.yaml", prompts_world)
    for overrides, message in (
        ({"grpo_loss": "ppo"}, "training.grpo_loss: expected grpo | dr_grpo | dapo, got 'ppo'"),
        ({"scale_rewards": "std"}, "training.scale_rewards: expected group | batch | none"),
        # The first message about a key states the limit of this train type (a general 0-or-0.001 would mislead).
        ({"temperature": "1e-4"}, "training.temperature: expected a number >= 0.001 with train_type online_grpo"),
        ({"rewards": "[]"}, "training.rewards: training.train_type online_grpo scores completions"),
        ({"rewards": "[nocolon]"}, "training.rewards (--rewards): entry 0: function must be"),
        ({"val_fraction": "0.1"}, "data.val_fraction: training.train_type online_grpo has no validation loss"),
        ({"num_generations": "1"}, "training.num_generations: expected an integer >= 2 with train_type online_grpo"),
        ({"num_generations": "-1"}, "training.num_generations: expected an integer >= 2 with train_type online_grpo"),
        ({"temperature": "0"}, "training.temperature: expected a number >= 0.001 with train_type online_grpo (greedy"),
    ):
        with pytest.raises(ConfigError) as raised:
            load_trainer_config(path, list(overrides.items()))
        assert any(message in line for line in raised.value.messages), raised.value.messages


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_processes_stop_and_resume_bitwise(tmp_path, prompts_world, train_yaml, trainer_env, mode):
    """Each rank samples its own prompts' groups (under FSDP in step with the other's forward passes); a graceful
    stop and a restart end where an uninterrupted run does."""
    finals = {}
    for name in ("whole", "stopped"):
        ckpt_dir = tmp_path / name
        path = _yaml(
            train_yaml,
            tmp_path / f"{name}.yaml",
            prompts_world,
            ckpt_dir=str(ckpt_dir),
            max_steps=10,
            ckpt_interval=100,
            scale_rewards="batch",
            grpo_beta=0.05,
            num_workers=1,
        )
        command = [*TORCHRUN, "-m", "astrai.train", "--config", str(path), "--parallel_mode", mode]
        if name == "stopped":
            run = Run(command, trainer_env, tmp_path / "run.log")
            stop_gracefully(run, lambda ckpt_dir=ckpt_dir: metrics_step(ckpt_dir) >= 4, rank=1)
            latest = latest_complete_checkpoint(ckpt_dir)
            assert latest.meta.reason == "emergency" and 4 <= latest.step < 10, run.output()
        run_to_end(command, trainer_env, tmp_path / f"{name}.log")
        finals[name] = final_weights(ckpt_dir, 10)
    assert finals["stopped"] == finals["whole"]


def test_one_process_runs_under_the_trainers_command(tmp_path, prompts_world, train_yaml, trainer_env):
    ckpt_dir = tmp_path / "ckpt"
    path = _yaml(train_yaml, tmp_path / "t.yaml", prompts_world, ckpt_dir=str(ckpt_dir), max_steps=2)
    run = run_to_end([*TRAINER, "--config", str(path)], trainer_env, tmp_path / "run.log")
    output = run.output()
    assert "online_grpo: 24 prompts x 4 completions of at most 6 tokens" in output
    assert "| reward " in output and "| length " in output


def test_online_dpo_ranks_two_completions_and_takes_dpos_step_resuming_bitwise(
    tmp_path, prompts_world, train_yaml, make_trainer, run_trainer, one_thread
):
    keys = {"train_type": "online_dpo", "reward": "first_code", "dpo_beta": 0.2}
    whole = _yaml(train_yaml, tmp_path / "whole.yaml", prompts_world, ckpt_dir=str(tmp_path / "whole"), **keys)
    run_trainer(whole)
    parts = _yaml(train_yaml, tmp_path / "parts.yaml", prompts_world, ckpt_dir=str(tmp_path / "parts"), **keys)
    run_trainer(parts, steps=3)
    run_trainer(parts)
    assert final_weights(tmp_path / "parts", 6) == final_weights(tmp_path / "whole", 6)
    last = json.loads((tmp_path / "whole" / METRICS_FILE).read_text().splitlines()[-1])
    for key in ("rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy", "pairs_tied", "reward"):
        assert math.isfinite(last[key]), (key, last)

    # One step by hand: the higher-scored completion of each prompt is chosen, and the loss is DPO's mean over pairs.
    trainer = make_trainer(whole, ckpt_dir=str(tmp_path / "fresh"), grad_accum_steps=2)
    try:
        objective = trainer.objective
        batches = [torch.tensor([0, 1]), torch.tensor([2, 3])]
        rollouts = objective.prepare_step(batches, trainer.model, 0)
        total = sum(objective.micro(trainer.model, batch, r, 2)[0] for batch, r in zip(batches, rollouts, strict=True))
        margins = []
        for rollout in rollouts:
            logps, mask, _ = completion_logps(trainer.model, rollout.prompts, rollout.completions)
            with torch.no_grad():
                reference = completion_logps(objective.reference, rollout.prompts, rollout.completions)[0]
            ratio = ((logps - reference) * mask).sum(-1)
            texts = [bytes(t for t in c if t < 256).decode("utf-8", "replace") for c in rollout.completions]
            scores = [ord(text[0]) / 1000 if text else 0.0 for text in texts]
            for pair in range(len(scores) // 2):
                a, b = 2 * pair, 2 * pair + 1
                if scores[a] != scores[b]:
                    chosen, rejected = (a, b) if scores[a] > scores[b] else (b, a)
                    margins.append(0.2 * (ratio[chosen] - ratio[rejected]))
        assert margins
        expected = -torch.nn.functional.logsigmoid(torch.stack(margins)).mean()
        assert torch.allclose(total, expected, rtol=1e-5), (total, expected)
        assert torch.allclose(total, torch.tensor(math.log(2.0)), rtol=1e-5)  # the policy is the reference
    finally:
        trainer.close()


@pytest.mark.parametrize("processes", [1, 2])
def test_sigkill_at_random_moments_then_a_restart_ends_bitwise_equal(
    tmp_path, prompts_world, train_yaml, trainer_env, processes
):
    """Killed twice mid-run (periodic saves every 2 steps), on one process or two DDP ones: the rollouts of the
    steps taken again are sampled as before, and the run ends where an uninterrupted one does."""
    keys = {"max_steps": 16, "ckpt_interval": 2, "log_interval": 1, "grpo_beta": 0.05, "num_workers": 1}
    finals = {}
    rng = random.Random("online_grpo")

    def at_random(run: Run) -> None:
        time.sleep(rng.uniform(0.0, 0.25))

    for name in ("whole", "killed"):
        ckpt_dir = tmp_path / name
        path = _yaml(train_yaml, tmp_path / f"{name}.yaml", prompts_world, ckpt_dir=str(ckpt_dir), **keys)
        command = [*TRAINER, "--config", str(path)]
        if processes == 2:
            command = [*TORCHRUN, "-m", "astrai.train", "--config", str(path), "--parallel_mode", "ddp"]
        if name == "whole":
            run_to_end(command, trainer_env, tmp_path / "whole.log")
        else:
            run, kills = kill_at_moments(command, trainer_env, tmp_path / "run.log", ckpt_dir, [at_random] * 2)
            assert kills >= 1, run.output()
            assert not staging(ckpt_dir)
        finals[name] = final_weights(ckpt_dir, 16)
    assert finals["killed"] == finals["whole"]


@pytest.fixture(scope="module")
def scored_world(tmp_path_factory):
    """grpo data: 12 prompts, each with four completions scored elsewhere (one left unscored)."""
    root = tmp_path_factory.mktemp("scored")
    with open(root / "scored.jsonl", "w", encoding="utf-8") as handle:
        for number in range(12):
            completions = [f"{number}", f"{number + 1} ü", "$'\"", "x" * (number + 1)]
            rewards = [1.0, 0.5, None if number % 3 == 0 else 0.0, 0.25]
            record = {"prompt": f"echo {number}:", "completions": completions, "rewards": rewards}
            handle.write(json.dumps(record) + "\n")
    prepare(root / "data", [root / "scored.jsonl"], kind="grpo")
    return root


def test_grpo_trains_on_completions_scored_elsewhere_with_their_rewards(
    tmp_path, scored_world, train_yaml, make_trainer, run_trainer, one_thread
):
    keys = {"train_type": "grpo", "data_root_path": str(scored_world / "data"), "window_size": 32, "grpo_beta": 0.1}
    keys.update(batch_per_device=2, max_steps=6, ckpt_interval=3, grpo_loss="grpo", warmup_ratio=0.0, log_interval=2)
    whole = train_yaml(tmp_path / "whole.yaml", ckpt_dir=str(tmp_path / "whole"), **keys)
    run_trainer(whole)
    parts = train_yaml(tmp_path / "parts.yaml", ckpt_dir=str(tmp_path / "parts"), **keys)
    run_trainer(parts, steps=4)
    run_trainer(parts)
    assert final_weights(tmp_path / "parts", 6) == final_weights(tmp_path / "whole", 6)
    log = (tmp_path / "whole" / COMPLETIONS_LOG).read_text(encoding="utf-8")
    assert '[3/4] reward n/a (given n/a): "$\'\\"' in log, log

    trainer = make_trainer(whole, ckpt_dir=str(tmp_path / "fresh"))
    try:
        objective = trainer.objective
        (rollout,) = objective.prepare_step([torch.tensor([0, 4])], trainer.model, 0)
        loss = objective.micro(trainer.model, None, rollout, 1)[0]
        texts = [bytes(t for t in c if t < 256).decode() for c in rollout.completions]
        assert texts == ["0", "1 ü", "$'\"", "x", "4", "5 ü", "$'\"", "xxxxx"]  # with their end-of-text token
        rewards = [1.0, 0.5, None, 0.25, 1.0, 0.5, 0.0, 0.25]
        advantage, _ = advantages(rewards, 4, "group")
        logps, mask, _ = completion_logps(trainer.model, rollout.prompts, rollout.completions)
        with torch.no_grad():
            reference = completion_logps(objective.reference, rollout.prompts, rollout.completions)[0]
        settings = GRPOSettings(loss="grpo", beta=0.1)
        expected, _ = grpo_loss(logps, logps.detach(), reference, advantage, mask, settings)
        assert torch.allclose(loss, expected, rtol=1e-6)
    finally:
        trainer.close()


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ('{"prompt": "p", "completions": ["a"], "rewards": [1]}', "field 'completions' must be a list of at least two"),
        ('{"prompt": "p", "completions": ["a", "b"], "rewards": [1]}', "field 'rewards' must be a list of one number"),
        ('{"prompt": "p", "completions": ["a", "b"], "rewards": [1, "x"]}', "rewards[1] is 'x': expected a finite"),
        ('{"prompt": "p", "completions": ["a", "b"]}', "has no 'rewards' field (its keys: completions, prompt)"),
    ],
)
def test_scored_records_that_cannot_train_are_refused(tmp_path, record, message):
    (tmp_path / "r.jsonl").write_text(record + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=re.escape(message)):
        prepare(tmp_path / "out", [tmp_path / "r.jsonl"], kind="grpo")


def test_num_iterations_trains_each_round_again_and_resumes_inside_a_round_bitwise(
    tmp_path, prompts_world, train_yaml, make_trainer, run_trainer, one_thread
):
    """Rounds at steps 0, 2, 4; the checkpoint at step 3 is inside the third round (step 3 trains on step 2's
    completions): the resume takes the round's rollouts and old log-probabilities from it."""
    keys = {"num_iterations": 2, "reward": "first_code", "grpo_epsilon": 0.05, "max_lr": 1e-2, "log_interval": 1}
    whole = _yaml(train_yaml, tmp_path / "whole.yaml", prompts_world, ckpt_dir=str(tmp_path / "whole"), **keys)
    run_trainer(whole)
    records = [json.loads(line) for line in (tmp_path / "whole" / METRICS_FILE).read_text().splitlines()]
    # A round's first step samples (a reward is reported) with the ratio at 1; its second clips some tokens.
    assert ["reward" in record for record in records] == [True, False] * 3
    clipped = [record["clip_ratio_region"] for record in records]
    assert all(share == 0.0 for share in clipped[::2]) and any(share > 0.0 for share in clipped[1::2]), clipped
    # Prompts are taken once a round: three rounds of 2 prompts.
    assert latest_complete_checkpoint(tmp_path / "whole").meta.step == 6
    parts = _yaml(train_yaml, tmp_path / "parts.yaml", prompts_world, ckpt_dir=str(tmp_path / "parts"), **keys)
    run_trainer(parts, steps=3)
    resumed = make_trainer(parts)
    try:
        assert resumed.progress.step == 3 and resumed.progress.samples_in_epoch == 2 * 2
        assert not resumed.objective.takes_batch(3) and len(resumed.objective.round) == 1
        resumed.train()
    finally:
        resumed.close()
    assert final_weights(tmp_path / "parts", 6) == final_weights(tmp_path / "whole", 6)


@pytest.mark.parametrize(
    ("train_type", "world", "said"),
    [("online_grpo", "prompts_world", "24 training prompts"), ("grpo", "scored_world", "12 training prompts with")],
)
def test_preflight_counts_the_prompts_of_the_reward_types(tmp_path, tiny_model, train_type, world, said, request):
    data = request.getfixturevalue(world) / "data"
    config = tmp_path / "train.yaml"
    runtime = {"job_name": "j", "gpu": {"devices": "none"}, "container": {"cuda_tag": "cpu"}}
    runtime["paths"] = {"data": str(data), "model": str(tiny_model)}
    rewards = ["astrai.rewards:exact_answer"]
    trainer = {"training": {"train_type": train_type, "rewards": rewards, "batch_per_device": 2}}
    config.write_text(yaml.safe_dump({"runtime": runtime, **trainer}), encoding="utf-8")
    result = invoke("preflight", "--config", str(config), check=False)
    line = next(line for line in result.stdout.splitlines() if "data fits model" in line)
    assert line.startswith("✓") and said in line, result.stdout
    state = next(line for line in result.stdout.splitlines() if "training state" in line)
    if train_type == "online_grpo":  # 2 prompts x 8 generations, the longest prompt (13 bytes) and 256 new tokens
        config = load_pretrained(tiny_model).config
        cache = kv_cache_bytes(config, 16, 320, 4)
        assert f"generation's key/value caches {format_bytes(cache)} (16 rows of a round x 320 positions" in state
    else:
        assert "generation" not in state


def test_a_resume_with_other_reward_settings_names_each_change(
    tmp_path, prompts_world, train_yaml, make_trainer, run_trainer, one_thread, capsys
):
    path = _yaml(train_yaml, tmp_path / "t.yaml", prompts_world, ckpt_dir=str(tmp_path / "ckpt"))
    run_trainer(path, steps=3)
    capsys.readouterr()
    trainer = make_trainer(path, grpo_loss="grpo", num_generations=2)
    trainer.close()
    out = capsys.readouterr().out
    assert "note: training.grpo_loss dapo -> grpo since epoch_0_step_3" in out, out
    assert "note: training.num_generations 4 -> 2 since epoch_0_step_3" in out, out


def test_prompts_of_changing_lengths_hold_one_cache_per_batch_size_at_the_plans_capacity(
    tmp_path, train_yaml, make_trainer, one_thread, monkeypatch
):
    """Generation's memory is bounded: the engine makes one decode step (and one key/value cache) per batch size, at
    the largest capacity the run reaches (its longest prompt and max_completion_length), and every round reuses it,
    whatever its own prompts' lengths."""
    from astrai.common.memory import CAPACITY_STEP
    from astrai.trainer.generation import decoding

    records = tmp_path / "prompts.jsonl"
    lengths = [3 + (number * 37) % 150 for number in range(16)]  # a round's longest prompt changes every step
    with open(records, "w", encoding="utf-8") as handle:
        for length in lengths:
            handle.write(json.dumps({"prompt": "x" * length, "digit": "1"}) + "\n")
    prepare(tmp_path / "data", [records], kind="prompts")
    (tmp_path / "r.py").write_text(REWARDS, encoding="utf-8")
    made = []
    monkeypatch.setattr(decoding, "KVCache", lambda *args: made.append(args[1:3]) or KVCache(*args))
    path = train_yaml(
        tmp_path / "t.yaml",
        **{**ONLINE, "max_steps": 5, "num_generations": 2},
        data_root_path=str(tmp_path / "data"),
        rewards=[f"{tmp_path / 'r.py'}:first_code"],
        ckpt_dir=str(tmp_path / "ckpt"),
    )
    trainer = make_trainer(path)
    try:
        trainer.train()
    finally:
        trainer.close()
    capacity = -(-(max(lengths) + ONLINE["max_completion_length"] - 1) // CAPACITY_STEP) * CAPACITY_STEP
    assert made == [(4, capacity)]  # 2 prompts x 2 generations a round, every round
