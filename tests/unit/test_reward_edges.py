"""Reward jobs at their edges: metric names that cannot collide, steps that cannot learn saying so once per cause,
metrics.jsonl staying strict JSON, the keys a train type ignores noted, rewards as TRL returns them, a reward that
runs too long, a stop that comes while rewards run, and preflight's and --dry-run's start checks.

The model is the tiny preset on the byte-level tokenizer; the reward functions are a file of ours.
"""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
import yaml
from trainer_runs import TRAINER, Run, final_weights, metrics_step, run_to_end, stop_gracefully

from astrai.common.checkpoints import latest_complete_checkpoint
from astrai.common.config import KEY_SECTION, TrainingSection, ignored_keys_note, load_trainer_config
from astrai.common.configfile import ConfigError
from astrai.common.contract import METRIC_ENTROPY, METRIC_KL, METRICS_FILE
from astrai.common.reward_specs import RewardSpec, check_metric_names, parse_rewards
from astrai.data.pipeline import prepare
from astrai.host.checklist import FAIL
from astrai.host.reward_checks import file_problem, reward_checks
from astrai.host.runtime import resolve_runtime
from astrai.trainer.objectives.grpo import advantages, overflowing
from astrai.trainer.objectives.rewards import Reward, RewardError, RewardLimits, StepAbandoned, load_reward, score
from astrai.trainer.objectives.rollouts import IDLE_FLAT, IDLE_MASKED, IDLE_OVERFLOW, RewardReport
from tests.support import invoke

REWARDS = '''
import os, time

def digits(prompts, completions, **fields):
    return [sum(c == d for c in completion) / max(len(completion), 1)
            for d, completion in zip(fields["digit"], completions)]

def huge(prompts, completions, **fields):
    """Finite rewards whose group statistics overflow, in the mean (1e308 + 1e308) or in the spread."""
    return [1e308 if d in "02468" else (1e200 if i % 2 else -1e200) for i, d in enumerate(fields["digit"])]

def same(prompts, completions, **fields):
    return [1.0] * len(completions)

def slow_when_asked(prompts, completions, **fields):
    """Sleeps (far past a stop's grace) while the file $SLOW_MARKER exists, writing $SLEEPING first."""
    marker = os.environ.get("SLOW_MARKER")
    if marker and os.path.exists(marker):
        open(os.environ["SLEEPING"], "w").close()
        time.sleep(600)
    return [float(len(completion)) for completion in completions]

def sleeps(prompts, completions, **fields):
    time.sleep(30)
    return [0.0] * len(completions)
'''

REWARD = {"rewards": parse_rewards(["astrai.rewards:exact_answer"])}

ONLINE = {
    "train_type": "online_grpo",
    "num_generations": 4,
    "max_completion_length": 6,
    "batch_per_device": 2,
    "max_steps": 4,
    "ckpt_interval": 100,
    "log_interval": 1,
    "warmup_ratio": 0.0,
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Prompt data (byte-level, 16 prompts with a `digit` field) and the reward file, in a folder with a space."""
    root = tmp_path_factory.mktemp("reward edges")
    records = root / "prompts.jsonl"
    with open(records, "w", encoding="utf-8") as handle:
        for number in range(16):
            handle.write(json.dumps({"prompt": f"dis {number % 10} :", "digit": str(number % 10)}) + "\n")
    prepare(root / "data", [records], kind="prompts")
    (root / "my rewards.py").write_text(REWARDS, encoding="utf-8")
    return root


def _yaml(train_yaml, path, world, reward="digits", **keys):
    values = {**ONLINE, "data_root_path": str(world / "data"), "rewards": [f"{world / 'my rewards.py'}:{reward}"]}
    return train_yaml(path, **{**values, **keys})


def _metrics(ckpt_dir) -> list[dict]:
    # json.loads refuses NaN and Infinity only when told to: parse_constant makes any of them fail the test.
    def refuse(name):
        raise AssertionError(f"{METRICS_FILE} holds {name}: not strict JSON")

    lines = (ckpt_dir / METRICS_FILE).read_text(encoding="utf-8").splitlines()
    return [json.loads(line, parse_constant=refuse) for line in lines]


# --- metric names ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["X", "X_std"], "would report its (mean|standard deviation) as reward_X_std, which is already"),
        (["X_std", "X"], "reward_X_std, which is already"),
        (["std"], "would report its mean as reward_std, which is already the total's standard deviation"),
        (["a_std_std", "a_std", "a"], "which is already"),
        (["twice", "twice"], "two reward functions named twice"),
    ],
)
def test_reward_names_whose_metrics_collide_are_refused_saying_why(names, message):
    with pytest.raises(ValueError, match=message):
        check_metric_names(names)
    entries = [f"/data/r{i}.py:{name}" for i, name in enumerate(names)]
    with pytest.raises(ValueError, match=message):
        parse_rewards(entries)


def test_a_weight_yaml_reads_as_text_is_taken_as_the_number_it_spells(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("training:\n  rewards: [{function: /data/r.py:f, weight: 1e-3}]\n", encoding="utf-8")
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    assert document["training"]["rewards"][0]["weight"] == "1e-3"  # YAML 1.1's reading
    assert parse_rewards(document["training"]["rewards"])[0].weight == 0.001
    with pytest.raises(ValueError, match="weight must be a finite number, got 'x'"):
        parse_rewards([{"function": "/data/r.py:f", "weight": "x"}])


def test_names_that_only_look_alike_are_kept():
    check_metric_names(["X", "Y_std", "std_X", "Xstd", "reward"])


# --- steps that learn nothing ------------------------------------------------------------------------------------


def test_group_statistics_that_overflow_give_no_advantage_and_are_counted():
    G = 2
    # a group whose mean overflows, one whose spread overflows, one fine, one unscored
    totals = [1e308, 1e308, 1e200, -1e200, 1.0, 3.0, None, None]
    advantage, flat = advantages(totals, G, "group")
    assert torch.isfinite(advantage).all()
    assert advantage[:4].tolist() == [0.0] * 4 and advantage[4] < 0 < advantage[5]
    rewards = torch.tensor([math.nan if t is None else t for t in totals], dtype=torch.float64)
    assert overflowing(rewards, G) == 2
    assert overflowing(torch.tensor([1.0, 2.0, math.nan, math.nan], dtype=torch.float64), G) == 0


def test_each_cause_of_an_idle_step_is_said_once_with_its_count():
    said = []
    report = RewardReport(source=type("Source", (), {"generations": 2, "functions": ("r",)})(), log=said.append)
    report.idle(IDLE_MASKED)
    report.idle(IDLE_MASKED)
    report.idle(IDLE_OVERFLOW, 3)
    report.idle(IDLE_FLAT)
    report.take()
    assert said == [
        f"warning: 2 step(s) since the last report learned nothing: {IDLE_MASKED}",
        f"warning: 3 group(s) since the last report learned nothing: {IDLE_OVERFLOW}",
        f"warning: 1 step(s) since the last report learned nothing: {IDLE_FLAT}",
    ]
    report.take()
    assert len(said) == 3


@pytest.mark.slow
def test_overflowing_rewards_warn_and_metrics_stay_strict_json(
    tmp_path, world, train_yaml, run_trainer, one_thread, capsys
):
    ckpt_dir = tmp_path / "ckpt"
    run_trainer(_yaml(train_yaml, tmp_path / "t.yaml", world, reward="huge", ckpt_dir=str(ckpt_dir), max_steps=2))
    out = capsys.readouterr().out
    assert "learned nothing: rewards too large to take a group's mean and std" in out, out
    assert re.search(r"warning: reward(_huge)?(_std)? is (inf|nan) at step \d: written as null", out), out
    records = _metrics(ckpt_dir)
    assert all(math.isfinite(record["loss"]) for record in records)
    assert any(record.get("reward_std", 0) is None or record.get("reward") is None for record in records)


@pytest.mark.slow
@pytest.mark.parametrize("reward", ["digits", "same"])
def test_steps_that_cannot_learn_say_why_and_leave_token_statistics_out(
    tmp_path, world, train_yaml, run_trainer, one_thread, capsys, reward
):
    """digits with max_completion_length 1: no completion ends, and mask_truncated_completions leaves every one out
    (no token: no entropy, no KL, not 0); same: every group's completions score alike with no KL penalty."""
    ckpt_dir = tmp_path / "ckpt"
    keys = {"max_completion_length": 1, "mask_truncated_completions": True, "grpo_beta": 0.05}
    if reward == "same":
        keys = {"grpo_beta": 0.0}
    path = _yaml(train_yaml, tmp_path / "t.yaml", world, reward=reward, ckpt_dir=str(ckpt_dir), max_steps=2, **keys)
    run_trainer(path)
    out = capsys.readouterr().out
    records = _metrics(ckpt_dir)
    cause = IDLE_MASKED if reward == "digits" else IDLE_FLAT
    assert out.count(f"learned nothing: {cause}") == 2, out  # log_interval 1: once per report, with its count
    if reward == "digits":
        assert all(METRIC_ENTROPY not in record and METRIC_KL not in record for record in records), records
    else:
        assert all(METRIC_ENTROPY in record for record in records), records


# --- keys a train type ignores -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("train_type", "keys", "named"),
    [
        ("seq", {"grpo_beta": 0.1}, "training.grpo_beta"),
        ("sft", {"num_generations": 4, "reward_timeout": 5.0}, "training.num_generations, training.reward_timeout"),
        ("dpo", {"rewards": parse_rewards(["/nowhere/r.py:f"])}, "training.rewards"),
        ("online_dpo", {"grpo_epsilon": 0.3, **REWARD}, "training.grpo_epsilon"),
        ("online_grpo", {"dpo_beta": 0.3, **REWARD}, "training.dpo_beta"),
    ],
)
def test_every_train_type_notes_the_keys_it_ignores(train_type, keys, named):
    note = ignored_keys_note(TrainingSection(train_type=train_type, **keys))
    assert note is not None and note.startswith(f"train_type {train_type} does not use {named}"), note
    needed = REWARD if train_type.startswith("online") else {}
    assert ignored_keys_note(TrainingSection(train_type=train_type, **needed)) is None


def test_dry_run_says_the_note(tmp_path, train_yaml, capsys):
    from astrai.trainer.run.loop import main

    path = train_yaml(tmp_path / "t.yaml", grpo_beta=0.2, num_generations=3)
    main(["--config", str(path), "--dry-run"])
    out = capsys.readouterr().out
    assert "note: train_type seq does not use training.grpo_beta, training.num_generations; they are left as set" in out


# --- values, limits ------------------------------------------------------------------------------------------


def _reward(tmp_path, body: str) -> Reward:
    (tmp_path / "r.py").write_text(f"import numpy, torch, time\ndef f(prompts, completions, **fields):\n{body}\n")
    return load_reward(RewardSpec(f"{tmp_path / 'r.py'}:f"))


@pytest.mark.parametrize(
    "body",
    [
        "    return [1.0, None, True]",
        "    return (1.0, None, True)",
        "    return numpy.array([1.0, numpy.nan, 1.0])[[0, 0, 0]] * [1, 1, 1]",
        "    return torch.tensor([1.0, 2.0, 1.0])[[0, 0, 0]]",
        "    return [numpy.float32(1.0), None, numpy.bool_(True)]",
        "    return [torch.tensor(1.0), None, 1]",
    ],
)
def test_rewards_are_taken_in_every_shape_trl_takes(tmp_path, body):
    scores = score([_reward(tmp_path, body)], ["p"] * 3, ["a", "b", "c"], {})
    values = scores.by_function["f"]
    assert values[0] == 1.0 and values[2] == 1.0 and values[1] in (None, 1.0), values


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("    return numpy.array([[1.0, 2.0, 3.0]])", r"returned ndarray values for 3 completions"),
        ("    return {'a': 1}", r"returned dict values for 3 completions"),
        ("    return [1.0, [2.0], 3.0]", r"gave \[2.0\] \(a list\)"),
        ("    return [1.0, 'x', 3.0]", r"gave 'x' \(a str\)"),
        ("    return [1.0, float('inf'), 3.0]", r"gave inf for the completion of prompt 'p': it must be a finite"),
    ],
)
def test_wrong_reward_values_name_the_type(tmp_path, body, message):
    with pytest.raises(RewardError, match=message):
        score([_reward(tmp_path, body)], ["p"] * 3, ["a", "b", "c"], {})


def test_a_reward_past_its_timeout_is_its_error_and_a_stop_gives_the_step_up(tmp_path):
    reward = _reward(tmp_path, "    time.sleep(30)\n    return [0.0] * len(completions)")
    with pytest.raises(RewardError, match=r"reward f ran past training.reward_timeout \(0.3 s\) on a batch"):
        score([reward], ["p"], ["a"], {}, RewardLimits(0.3, lambda: False))
    with pytest.raises(StepAbandoned):
        score([reward], ["p"], ["a"], {}, RewardLimits(100.0, lambda: True))


def test_a_stop_gives_the_step_up_only_after_the_rewards_that_cannot_be_given_up_on(tmp_path):
    """A reward model's forward passes may be collectives of the ranks: it runs to its end before a stop can give the
    step up in a function listed before it, so that no rank is left inside one. The values keep the listed order."""
    called = []

    def model_scores(prompts, completions, **fields):
        called.append("model")
        return [2.0] * len(completions)

    model = Reward(RewardSpec("/models/rm:model"), model_scores, in_thread=False)
    function = _reward(tmp_path, "    return [1.0] * len(completions)")
    scores = score([function, model], ["p"], ["a"], {}, RewardLimits(100.0, lambda: False))
    assert list(scores.by_function) == ["f", "model"] and scores.total == [3.0]
    slow = _reward(tmp_path, "    time.sleep(30)\n    return [0.0] * len(completions)")
    called.clear()
    with pytest.raises(StepAbandoned):
        score([slow, model], ["p"], ["a"], {}, RewardLimits(100.0, lambda: True))
    assert called == ["model"]


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_reward_timeout_out_of_range_is_refused_naming_the_key(tmp_path, world, train_yaml, value):
    path = _yaml(train_yaml, tmp_path / "t.yaml", world)
    with pytest.raises(ConfigError) as raised:
        load_trainer_config(path, [("reward_timeout", value)])
    assert any("training.reward_timeout" in line for line in raised.value.messages), raised.value.messages


@pytest.mark.slow
def test_a_stop_during_a_slow_reward_saves_the_last_completed_step_and_resumes_bitwise(
    tmp_path, world, train_yaml, trainer_env
):
    finals = {}
    marker, sleeping = tmp_path / "slow", tmp_path / "sleeping"
    env = {**trainer_env, "SLOW_MARKER": str(marker), "SLEEPING": str(sleeping)}
    for name in ("whole", "stopped"):
        ckpt_dir = tmp_path / name
        path = _yaml(
            train_yaml, tmp_path / f"{name}.yaml", world, reward="slow_when_asked", ckpt_dir=str(ckpt_dir), max_steps=6
        )
        command = [*TRAINER, "--config", str(path)]
        if name == "stopped":
            run = Run(command, env, tmp_path / "run.log")

            def asleep(ckpt_dir=ckpt_dir):
                if metrics_step(ckpt_dir) >= 2 and not marker.exists():
                    marker.touch()
                return sleeping.exists()

            stop_gracefully(run, asleep, timeout=60)  # exits 0 long before the reward's 600 s
            latest = latest_complete_checkpoint(ckpt_dir)
            assert latest.meta.reason == "emergency" and latest.step == metrics_step(ckpt_dir), run.output()
            assert f"while the rewards of step {latest.step + 1} were computed" in run.output(), run.output()
            marker.unlink()
        run_to_end(command, env, tmp_path / f"{name}.log")
        finals[name] = final_weights(ckpt_dir, 6)
    assert finals["stopped"] == finals["whole"]


# --- preflight and --dry-run --------------------------------------------------------------------------------------


def _runtime(tmp_path, data, model):
    config = tmp_path / "train.yaml"
    runtime = {"job_name": "edges", "gpu": {"devices": "none"}, "container": {"cuda_tag": "cpu"}}
    runtime["paths"] = {"data": str(data), "model": str(model)}
    config.write_text(yaml.safe_dump({"runtime": runtime}), encoding="utf-8")
    return resolve_runtime(str(config))


def test_reward_files_the_container_cannot_read_are_named(tmp_path, world, tiny_model):
    runtime = _runtime(tmp_path, world / "data", tiny_model)
    (world / "data" / "bad.py").write_text("def f(:\n", encoding="utf-8")
    (world / "data" / "ok.py").write_text("def f(prompts, completions, **k):\n    return []\n", encoding="utf-8")
    try:
        cases = {
            "rel/r.py:f": "name the file by its path in the container (such as /data/r.py), not rel/r.py",
            "/elsewhere/r.py:f": "/elsewhere/r.py is in no folder the container mounts (runtime.paths.data at /data",
            "/data/missing.py:f": "no file /data/missing.py in the container",
            "/data/bad.py:f": "/data/bad.py line 1: invalid syntax",
        }
        for function, message in cases.items():
            problem = file_problem(runtime, RewardSpec(function))
            assert problem is not None and message in problem, problem
        assert file_problem(runtime, RewardSpec("/data/ok.py:f")) is None
        assert file_problem(runtime, RewardSpec("astrai.rewards:exact_answer")) is None
    finally:
        (world / "data" / "bad.py").unlink()
        (world / "data" / "ok.py").unlink()


def test_preflight_and_dry_run_make_the_trainers_start_checks(tmp_path, world, tiny_model, train_yaml):
    """max_completion_length leaving no room for a prompt: the trainer's refusal, made by preflight and --dry-run
    with the same words."""
    from astrai.trainer.run.loop import main

    config = tmp_path / "train.yaml"
    runtime = {"job_name": "edges", "gpu": {"devices": "none"}, "container": {"cuda_tag": "cpu"}}
    runtime["paths"] = {"data": str(world / "data"), "model": str(tiny_model)}
    document = {"runtime": runtime}
    keys = {**ONLINE, "max_completion_length": 5000, "rewards": ["astrai.rewards:exact_answer"]}
    for key, value in keys.items():
        document.setdefault(KEY_SECTION[key], {})[key] = value
    config.write_text(yaml.safe_dump(document), encoding="utf-8")
    said = "training.max_completion_length 5000 leaves no room for a prompt in the context of"
    result = invoke("preflight", "--config", str(config), check=False)
    line = next(line for line in result.stdout.splitlines() if "data fits model" in line)
    assert line.startswith("✗") and said in line and result.returncode != 0, result.stdout

    path = _yaml(train_yaml, tmp_path / "t.yaml", world, max_completion_length=5000, ckpt_dir=str(tmp_path / "c"))
    assert main(["--config", str(path), "--dry-run"]) == 2
    assert not (tmp_path / "c").exists()
    path = _yaml(train_yaml, tmp_path / "u.yaml", world, ckpt_dir=str(tmp_path / "c"))
    assert main(["--config", str(path), "--dry-run"]) == 0
    # A model folder that is there but refused is a refusal (exit 2); one that is not there is not checked here.
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": "llama"}', encoding="utf-8")
    path = _yaml(train_yaml, tmp_path / "v.yaml", world, param_path=str(tmp_path / "broken"))
    assert main(["--config", str(path), "--dry-run"]) == 2
    path = _yaml(train_yaml, tmp_path / "w.yaml", world, param_path=str(tmp_path / "nowhere"))
    assert main(["--config", str(path), "--dry-run"]) == 0


def test_reward_lines_of_preflight(tmp_path, world, tiny_model):
    runtime = _runtime(tmp_path, world / "data", tiny_model)
    config = load_trainer_config(
        tmp_path / "train.yaml", [("train_type", "online_grpo"), ("rewards", "[/data/nothere.py:f]")]
    )
    checks = reward_checks(runtime, config)
    assert len(checks) == 1 and checks[0].mark == FAIL, checks
    assert "no file /data/nothere.py in the container" in checks[0].detail, checks


# --- messages ----------------------------------------------------------------------------------------------------


def test_a_peft_folder_with_only_a_pickle_says_what_is_read_and_how_to_convert(tmp_path):
    from astrai.trainer.models.lora import AdapterError, read_peft_adapter

    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    (tmp_path / "adapter_config.json").write_text(json.dumps(config), encoding="utf-8")
    (tmp_path / "adapter_model.bin").write_bytes(b"\x80\x02}q\x00.")
    with pytest.raises(
        AdapterError, match=r"holds adapter_model.bin: only adapter_model.safetensors is read"
    ) as raised:
        read_peft_adapter(tmp_path)
    assert "save_pretrained(new_folder, safe_serialization=True)" in str(raised.value)


@pytest.mark.slow
def test_generate_speaks_of_a_completion_not_of_a_document(tmp_path, tiny_model):
    import subprocess
    import sys

    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tok.json"))
    for extra, said in (
        (["--eos", "a"], "an ordinary token would also end a completion wherever the text holds it"),
        ([], "cannot tell which token ends a completion"),
    ):
        command = [sys.executable, "-m", "astrai.model", "generate", str(tiny_model), "--tokenizer"]
        run = subprocess.run(
            [*command, str(tmp_path / "tok.json"), "--prompt", "a b", *extra], capture_output=True, text=True
        )
        assert run.returncode != 0 and said in run.stderr and "Traceback" not in run.stderr, run.stderr
        assert "document" not in run.stderr, run.stderr


@pytest.mark.parametrize(
    ("lengths", "completion", "lower_to"),
    [([412, 380, 398], 64, None), ([300, 210, 290], 100, 46)],
)
def test_prompts_all_left_out_name_the_prompts_the_context_and_only_remedies_that_can_work(
    tmp_path, lengths, completion, lower_to
):
    """data.overlong: drop with every prompt longer than the room: the refusal names the prompts' lengths and the
    context, and suggests a shorter max_completion_length only when one would leave room (prompts of 380+ tokens
    never fit a context of 256, however short the completion)."""
    from types import SimpleNamespace

    from astrai.common.fit import SetupError, fit_prompts
    from astrai.common.model_config import ModelConfig

    model = ModelConfig(max_seq_len=256)
    training = SimpleNamespace(max_completion_length=completion, episodes=lambda: None)
    with pytest.raises(SetupError) as refused:
        fit_prompts(SimpleNamespace(root=tmp_path), lengths, model, training, "drop", tmp_path / "model")
    said = str(refused.value)
    assert f"its prompts have {min(lengths)} to {max(lengths)} tokens" in said
    assert f"the context of 256 tokens of the model {tmp_path / 'model'}" in said
    assert f"at least {min(lengths) + completion} tokens for the shortest prompt" in said
    assert f"data.overlong: truncate (each prompt keeps its last {256 - completion} tokens)" in said
    assert ("max_completion_length " in said.split("what can work: ")[1]) == (lower_to is not None)
    if lower_to is not None:
        assert f"training.max_completion_length {lower_to} or less (room for the shortest prompt)" in said
