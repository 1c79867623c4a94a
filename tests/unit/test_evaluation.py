"""Generative evaluation in the loop (log.eval_prompts): its figures on hand-made cases, its settings refused by key,
runs that evaluate at the start and every eval_interval steps for a window type and a reward type, the same figures on
one process and two, a stop during an evaluation that resumes bitwise, and the checks preflight and --dry-run make.

The model is the tiny preset on the byte-level tokenizer; the rewards are a file of ours.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml
from trainer_runs import TORCHRUN, TRAINER, Run, final_weights, metrics_step, run_to_end, stop_gracefully

from astrai.common.checkpoints import latest_complete_checkpoint
from astrai.common.config import load_trainer_config
from astrai.common.configfile import ConfigError
from astrai.common.contract import (
    COMPLETIONS_LOG,
    METRIC_EVAL_COMPLETION_LENGTH,
    METRIC_EVAL_PASS_AT_K,
    METRIC_EVAL_REWARD,
    METRIC_EVAL_UNSCORED,
    METRIC_TOKENS_SEEN,
    METRICS_FILE,
)
from astrai.common.metrics import MetricsFile
from astrai.data.pipeline import prepare
from astrai.host.checklist import FAIL, PASS
from astrai.host.eval_checks import evaluation_check
from astrai.host.runtime import resolve_runtime
from astrai.host.status import evaluation_line
from astrai.trainer.run.evaluation import PromptResult, eval_metrics

REWARDS = '''
import os, time

def digits(prompts, completions, **fields):
    """The share of the completion's characters that are the record's digit."""
    return [sum(c == d for c in completion) / max(len(completion), 1)
            for d, completion in zip(fields["digit"], completions)]

def length(prompts, completions, **fields):
    """1 for a completion of 4 bytes or more; None for a record without a digit."""
    return [None if d is None else float(len(c.encode()) >= 4) for d, c in zip(fields["digit"], completions)]

def slow_when_asked(prompts, completions, **fields):
    """Sleeps (far past a stop's grace) while the file $SLOW_MARKER exists, writing $SLEEPING first."""
    marker = os.environ.get("SLOW_MARKER")
    if marker and os.path.exists(marker):
        open(os.environ["SLEEPING"], "w").close()
        time.sleep(600)
    return [float(len(completion)) for completion in completions]

def half_second(prompts, completions, **fields):
    time.sleep(0.5)
    return [1.0] * len(completions)
'''

RUN = {"max_steps": 6, "ckpt_interval": 3, "log_interval": 2, "eval_interval": 3, "max_completion_length": 6}


@pytest.fixture(scope="module")
def eval_world(tmp_path_factory):
    """Evaluation prompts (byte-level, 10 of them with a `digit` field, one without) and the rewards' file."""
    root = tmp_path_factory.mktemp("eval world")  # a space in every path
    records = root / "prompts.jsonl"
    with open(records, "w", encoding="utf-8") as handle:
        for number in range(10):
            handle.write(json.dumps({"prompt": f"say {number % 10} $x:", "digit": str(number % 10)}) + "\n")
        handle.write(json.dumps({"prompt": "no digit:"}) + "\n")
    prepare(root / "prompts", [records], kind="prompts")
    (root / "my rewards.py").write_text(REWARDS, encoding="utf-8")
    return root


def _yaml(train_yaml, path, world, names=("digits", "length"), **keys):
    """A train.yaml whose training.rewards are ``names`` of the rewards' file (``rewards`` in ``keys`` replaces them;
    None leaves them out)."""
    values = {
        **RUN,
        "eval_prompts": str(world / "prompts"),
        "rewards": [f"{world / 'my rewards.py'}:{n}" for n in names],
    }
    values.update(keys)
    return train_yaml(path, **{key: value for key, value in values.items() if value is not None})


def _records(ckpt_dir) -> list[dict]:
    return MetricsFile(ckpt_dir / METRICS_FILE).records()


# --- the figures ---------------------------------------------------------------------------------------------------


def test_pass_at_k_and_the_means_on_hand_made_cases():
    results = [
        PromptResult(2, (0.5, None), {"a": (0.5, None), "b": (None, None)}, (3, 5)),
        PromptResult(0, (1.0, 0.0), {"a": (1.0, 0.0), "b": (None, 0.0)}, (2, 2)),
        PromptResult(1, (0.25, 1.5), {"a": (0.25, 0.5), "b": (None, 1.0)}, (4, 6)),
    ]
    metrics = eval_metrics(results, ("a", "b"), threshold=1.0)
    assert metrics == {
        METRIC_EVAL_REWARD: (1.0 + 0.0 + 0.25 + 1.5 + 0.5) / 5,  # the unscored completion counts for nothing
        "eval/a": (1.0 + 0.0 + 0.25 + 0.5 + 0.5) / 5,
        "eval/b": (0.0 + 1.0) / 2,
        METRIC_EVAL_PASS_AT_K: 2 / 3,  # prompt 0 (1.0 >= 1) and prompt 1 (1.5); prompt 2's best is 0.5
        METRIC_EVAL_COMPLETION_LENGTH: (3 + 5 + 2 + 2 + 4 + 6) / 6,
        METRIC_EVAL_UNSCORED: 1 / 6,
    }
    # The order the ranks hand their results in changes nothing; a threshold of 0.5 passes prompt 2 too.
    assert eval_metrics(results[::-1], ("a", "b"), 1.0) == metrics
    assert eval_metrics(results, ("a", "b"), 0.5)[METRIC_EVAL_PASS_AT_K] == 1.0
    # Nothing scored: no mean to give, and no prompt passes.
    nothing = eval_metrics([PromptResult(0, (None,), {"a": (None,)}, (1,))], ("a",), 1.0)
    assert nothing == {METRIC_EVAL_PASS_AT_K: 0.0, METRIC_EVAL_COMPLETION_LENGTH: 1.0, METRIC_EVAL_UNSCORED: 1.0}


# --- the settings --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"eval_generations": 4}, "log.eval_generations: expected 1 with eval_temperature 0 (greedy decoding"),
        ({"eval_generations": 0}, "log.eval_generations: expected an integer >= 1, got 0"),
        ({"eval_temperature": -1}, "log.eval_temperature: expected 0 (greedy) or a number >= 0.001, got -1.0"),
        ({"eval_top_p": 0}, "log.eval_top_p: expected a number in (0, 1], got 0.0"),
        ({"eval_max_completion_length": 0}, "log.eval_max_completion_length: expected an integer >= 1"),
        ({"eval_pass_threshold": "nan"}, "log.eval_pass_threshold: expected a finite number"),
        ({"rewards": None}, "log.eval_rewards: log.eval_prompts asks for an evaluation, and nothing scores it"),
        ({"eval_prompts": None, "eval_rewards": ["astrai.rewards:exact_answer"]}, "log.eval_rewards: they score"),
        ({"eval_rewards": ["m:unscored"]}, "log.eval_rewards: a reward named unscored would report as eval/unscored"),
        ({"rewards": ["m:reward"]}, "a reward named reward would report as eval/reward, which is already"),
        ({"eval_batch_size": 0}, "log.eval_batch_size: expected an integer >= 1, got 0"),
        (
            {"train_type": "online_grpo", "environment": "astrai.rewards:Nothing"},
            "log.eval_prompts: the evaluation in the loop completes each prompt in one turn, calling no tool",
        ),
        (
            {"train_type": "online_grpo", "tools": ["astrai.rewards:exact_answer"]},
            "log.eval_prompts: the evaluation in the loop completes each prompt in one turn, calling no tool",
        ),
    ],
)
def test_evaluation_settings_out_of_range_are_refused_naming_the_key(tmp_path, eval_world, train_yaml, keys, message):
    path = _yaml(train_yaml, tmp_path / "t.yaml", eval_world, **keys)
    with pytest.raises(ConfigError) as raised:
        load_trainer_config(path)
    assert any(message in line for line in raised.value.messages), raised.value.messages


def test_eval_rewards_default_to_the_jobs_and_the_plan_says_what_is_evaluated(tmp_path, eval_world, train_yaml):
    config = load_trainer_config(_yaml(train_yaml, tmp_path / "t.yaml", eval_world, eval_at_start=True))
    assert [spec.name for spec in config.log.eval_reward_specs(config.training)] == ["digits", "length"]
    settings = config.log.evaluation(config.training)
    assert settings.sampling.greedy and settings.generations == 1 and settings.sampling.max_new_tokens == 6
    assert settings.describe(["digits"]).startswith("every 3 steps and at the start: 1 completion(s) of each prompt")
    own = load_trainer_config(
        _yaml(train_yaml, tmp_path / "u.yaml", eval_world), [("eval_rewards", "[astrai.rewards:exact_answer]")]
    )
    assert [spec.name for spec in own.log.eval_reward_specs(own.training)] == ["exact_answer"]
    # A seq job's rewards and max_completion_length serve the evaluation: no note calls them unused.
    from astrai.common.config import ignored_keys_note

    assert ignored_keys_note(config.training, config.log) is None
    assert "training.rewards" in ignored_keys_note(config.training)
    # An environment left in a job that plays no episodes is only noted as unused: the evaluation stays.
    unused = load_trainer_config(_yaml(train_yaml, tmp_path / "v.yaml", eval_world, environment="astrai.rewards:X"))
    assert unused.log.evaluation(unused.training) is not None and unused.training.environment is not None


# --- runs ----------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_evaluates_at_the_start_and_every_interval_and_reports_it_everywhere(
    tmp_path, eval_world, train_yaml, run_trainer, one_thread, capsys
):
    ckpt = tmp_path / "job"
    path = _yaml(
        train_yaml,
        tmp_path / "t.yaml",
        eval_world,
        ckpt_dir=str(ckpt),
        eval_at_start=True,
        report_to=["tensorboard", "mlflow"],
    )
    run_trainer(path)
    records = _records(ckpt)
    evaluated = {record["step"]: record for record in records if METRIC_EVAL_REWARD in record}
    assert sorted(evaluated) == [0, 3, 6]
    for record in evaluated.values():
        assert set(record) >= {"eval/digits", "eval/length", METRIC_EVAL_PASS_AT_K, METRIC_EVAL_COMPLETION_LENGTH}
        assert 0 <= record[METRIC_EVAL_PASS_AT_K] <= 1 and 1 <= record[METRIC_EVAL_COMPLETION_LENGTH] <= 6
        assert record[METRIC_EVAL_UNSCORED] == 0.0  # length scores the record without a digit: 0 or 1, never None
    assert "loss" not in evaluated[0] and evaluated[0]["tokens_seen"] == 0  # the starting model's baseline
    assert "loss" in evaluated[3] and "loss" in evaluated[6]
    out = capsys.readouterr().out
    assert "step 0/6 | evaluation: eval reward " in out and re.search(r"step 3/6 .* \| eval reward \S+ \| pass@k", out)
    log = (ckpt / COMPLETIONS_LOG).read_text(encoding="utf-8")
    assert log.startswith('evaluation at step 0 | prompt 0: "say 0 $x:"') and "evaluation at step 6" in log
    # TensorBoard holds them under their own names, at their steps.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(ckpt / "tensorboard"))
    events.Reload()
    assert [event.step for event in events.Scalars(METRIC_EVAL_REWARD)] == [0, 3, 6]
    # MLflow too, the starting model's baseline at step 0 included.
    from mlflow.tracking import MlflowClient

    from astrai.common.metrics import read_runs

    client = MlflowClient(tracking_uri=f"file://{ckpt}/mlruns")
    history = client.get_metric_history(read_runs(ckpt)["mlflow"].run_id, METRIC_EVAL_REWARD)
    assert sorted(point.step for point in history) == [0, 3, 6]
    assert evaluation_line(records[-1]) == (
        f"reward {records[-1][METRIC_EVAL_REWARD]:.4f} (digits {records[-1]['eval/digits']:.4f}, length "
        f"{records[-1]['eval/length']:.4f}), pass@k {records[-1][METRIC_EVAL_PASS_AT_K]:.0%}, completions of "
        f"{records[-1][METRIC_EVAL_COMPLETION_LENGTH]:.1f} tokens at step 6"
    )


@pytest.mark.slow
def test_a_reward_type_evaluates_with_its_own_rewards_and_the_time_is_left_out_of_tokens_per_s(
    tmp_path, eval_world, train_yaml, run_trainer, one_thread
):
    ckpt = tmp_path / "job"
    path = _yaml(
        train_yaml,
        tmp_path / "t.yaml",
        eval_world,
        ckpt_dir=str(ckpt),
        data_root_path=str(eval_world / "prompts"),
        train_type="online_grpo",
        num_generations=2,
        batch_per_device=2,
        eval_rewards=[f"{eval_world / 'my rewards.py'}:half_second"],
        eval_interval=2,
        log_interval=1,
    )
    run_trainer(path)
    records = _records(ckpt)
    assert [r["step"] for r in records if "eval/half_second" in r] == [2, 4, 6]
    evaluations = [r for r in records if "eval/half_second" in r]
    assert all(r["eval/half_second"] == 1.0 and r[METRIC_EVAL_PASS_AT_K] == 1.0 for r in evaluations)
    # Each evaluation sleeps 1 s (two batches of at most 8 prompts); the steps take a few milliseconds. The seconds
    # that tokens/s implies for an evaluated step's interval (a report every step) leave the second out, whatever
    # the machine's load does to the steps themselves.
    seen = {r["step"]: r[METRIC_TOKENS_SEEN] for r in records if METRIC_TOKENS_SEEN in r}
    implied = [(seen[r["step"]] - seen[r["step"] - 1]) / r["tokens_per_s"] for r in records if "eval/half_second" in r]
    assert max(implied) < 0.5, implied


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "sampling"),
    [("ddp", {}), ("fsdp", {"eval_temperature": 1.0, "eval_generations": 3})],
    ids=["ddp-greedy", "fsdp-sampled"],
)
def test_the_figures_are_the_same_on_one_process_and_two(tmp_path, eval_world, train_yaml, trainer_env, mode, sampling):
    """11 prompts in batches of 4: rank 0 takes two, rank 1 one (under FSDP it generates its batch again, in step
    with rank 0's second, and counts nothing of it)."""
    figures = {}
    for world in (1, 2):
        ckpt = tmp_path / f"world{world}"
        # Two processes of two sequences each train what one process of four does (one global batch).
        keys = {"batch_per_device": 4 // world, "global_batch_size": 4, "max_steps": 3, "eval_batch_size": 4}
        path = _yaml(train_yaml, tmp_path / f"w{world}.yaml", eval_world, ckpt_dir=str(ckpt), **keys, **sampling)
        command = [*TORCHRUN, "-m", "astrai.train", "--parallel_mode", mode] if world == 2 else TRAINER
        run_to_end([*command, "--config", str(path)], trainer_env, tmp_path / f"w{world}.log")
        figures[world] = [
            {key: value for key, value in record.items() if key.startswith("eval/")}
            for record in _records(ckpt)
            if METRIC_EVAL_REWARD in record
        ]
    assert figures[1] == figures[2] and len(figures[1]) == 1, figures


@pytest.mark.slow
def test_a_reward_model_scores_alike_on_one_process_and_sharded_on_two(
    tmp_path, eval_world, train_yaml, trainer_env, tiny_model
):
    """A reward model of ours (the tiny base with a score head) as the reward of an online_grpo run and of its
    evaluation at the start: under FSDP it is sharded like the reference, and the rank out of evaluation batches scores
    its stand-in batch through the same collectives. Step 0's figures equal one process's; the run trains to its end."""
    from astrai.trainer.models.native import Transformer
    from astrai.trainer.models.weights import load_base_model, save_model_folder
    from astrai.trainer.objectives.reward_model import classifier_start

    config, weights = classifier_start(*load_base_model(tiny_model), seed=3)
    scorer = Transformer(config)
    scorer.load_state_dict(weights)
    save_model_folder(tmp_path / "rm", config, scorer.state_dict())
    rewards = [{"model": str(tmp_path / "rm"), "name": "rm", "batch_size": 3}, f"{eval_world / 'my rewards.py'}:digits"]
    figures = {}
    for world in (1, 2):
        ckpt = tmp_path / f"world{world}"
        keys = {"batch_per_device": 4 // world, "global_batch_size": 4, "eval_batch_size": 4}
        path = _yaml(
            train_yaml,
            tmp_path / f"w{world}.yaml",
            eval_world,
            **keys,
            ckpt_dir=str(ckpt),
            train_type="online_grpo",
            data_root_path=str(eval_world / "prompts"),
            num_generations=2,
            rewards=rewards,
            eval_at_start=True,
            max_steps=2,
            eval_interval=2,
            ckpt_interval=2,
        )
        command = [*TORCHRUN, "-m", "astrai.train", "--parallel_mode", "fsdp"] if world == 2 else TRAINER
        run_to_end([*command, "--config", str(path)], trainer_env, tmp_path / f"w{world}.log")
        records = _records(ckpt)
        assert [r["step"] for r in records if METRIC_EVAL_REWARD in r] == [0, 2], records
        assert all("reward_rm" in r for r in records if r["step"] > 0 and "loss" in r), records
        (start,) = [r for r in records if r["step"] == 0 and METRIC_EVAL_REWARD in r]
        figures[world] = {key: value for key, value in start.items() if key.startswith("eval/")}
    assert figures[1] == figures[2] and "eval/rm" in figures[1], figures


@pytest.mark.slow
def test_a_stop_during_an_evaluation_resumes_bitwise_and_evaluates_that_step_first(
    tmp_path, eval_world, train_yaml, trainer_env
):
    finals, evaluations = {}, {}
    marker, sleeping = tmp_path / "slow", tmp_path / "sleeping"
    env = {**trainer_env, "SLOW_MARKER": str(marker), "SLEEPING": str(sleeping)}
    for name in ("whole", "stopped"):
        ckpt = tmp_path / name
        path = _yaml(
            train_yaml, tmp_path / f"{name}.yaml", eval_world, ("slow_when_asked",), ckpt_dir=str(ckpt), max_steps=9
        )
        command = [*TRAINER, "--config", str(path)]
        if name == "stopped":
            run = Run(command, env, tmp_path / "run.log")

            def asleep(ckpt=ckpt):
                if metrics_step(ckpt) >= 4 and not marker.exists():
                    marker.touch()  # the evaluation of step 6 sleeps
                return sleeping.exists()

            stop_gracefully(run, asleep, timeout=60)  # exits 0 long before the reward's 600 s
            latest = latest_complete_checkpoint(ckpt)
            assert latest.meta.reason == "emergency" and latest.step == 6, run.output()
            assert "during the evaluation of step 6: it is given up" in run.output(), run.output()
            marker.unlink()
        run_to_end(command, env, tmp_path / f"{name}.log")
        finals[name] = final_weights(ckpt, 9)
        evaluations[name] = {
            record["step"]: {key: value for key, value in record.items() if key.startswith("eval/")}
            for record in _records(ckpt)
            if METRIC_EVAL_REWARD in record
        }
    assert finals["stopped"] == finals["whole"]
    assert evaluations["stopped"] == evaluations["whole"] and sorted(evaluations["whole"]) == [3, 6, 9]
    resumed = (tmp_path / "stopped.log").read_text()
    assert "step 6/9 | evaluation: eval reward" in resumed, resumed


# --- preflight and --dry-run ---------------------------------------------------------------------------------------


def _runtime(tmp_path, data, model):
    config = tmp_path / "train.yaml"
    runtime = {"job_name": "evals", "gpu": {"devices": "none"}, "container": {"cuda_tag": "cpu"}}
    runtime["paths"] = {"data": str(data), "model": str(model)}
    config.write_text(yaml.safe_dump({"runtime": runtime}), encoding="utf-8")
    return resolve_runtime(str(config))


def test_preflight_checks_the_prompts_where_the_container_finds_them(tmp_path, eval_world, tiny_model, corpus_data):
    from astrai.common.data_folder import TokenData
    from astrai.common.model_folder import ModelConfig

    runtime = _runtime(tmp_path, eval_world, tiny_model)
    rewards = ["/data/my rewards.py:digits"]
    model = (ModelConfig.load(tiny_model), tiny_model)
    datas = [TokenData.open(corpus_data)]

    def check(**log):
        config = load_trainer_config(
            _write(tmp_path / "c.yaml", {"training": {"rewards": rewards, "max_completion_length": 6}, "log": log})
        )
        return evaluation_check(runtime, config, datas, model)

    assert check() is None
    found = check(eval_prompts="/data/prompts", eval_at_start=True)
    assert found.mark == PASS, found
    assert found.detail.startswith("11 prompts of /data/prompts x 1 completion(s) (greedy")
    assert "every 200 steps and at step 0, scored by digits" in found.detail
    outside = check(eval_prompts="/elsewhere/prompts")
    assert outside.mark == FAIL and "log.eval_prompts: /elsewhere/prompts is in no folder the container mounts" in (
        outside.detail
    )
    missing = check(eval_prompts="/data/nothing")
    assert missing.mark == FAIL and missing.detail.startswith("log.eval_prompts: ")
    (tmp_path / "text.txt").write_text("plain text, not prompts", encoding="utf-8")
    prepare(eval_world / "text-data", [tmp_path / "text.txt"])
    wrong = check(eval_prompts="/data/text-data")
    assert wrong.mark == FAIL and "holds" in wrong.detail and "--kind prompts" in wrong.detail


def _write(path, document):
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    return path


def test_dry_run_prints_the_evaluation_and_refuses_what_the_trainer_would(tmp_path, eval_world, train_yaml, capsys):
    from astrai.trainer.run.loop import main

    path = _yaml(train_yaml, tmp_path / "t.yaml", eval_world, ckpt_dir=str(tmp_path / "job"))
    assert main(["--config", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "evaluation: every 3 steps: 1 completion(s) of each prompt of" in out and "scored by digits, length" in out
    assert main(["--config", str(path), "--dry-run", "--eval_max_completion_length", "100000"]) == 2
    refused = capsys.readouterr().out
    assert "start checks: refused: log.eval_max_completion_length (its default: training.max_completion_length)" in (
        refused
    )


def test_the_host_refuses_a_prompts_folder_outside_the_data_mount(tmp_path, eval_world, tiny_model):
    from astrai.host.trainer_config import read_trainer_config

    runtime = {"job_name": "evals", "gpu": {"devices": "none"}, "container": {"cuda_tag": "cpu"}}
    runtime["paths"] = {"data": str(eval_world), "model": str(tiny_model)}
    trainer = {"training": {"rewards": ["astrai.rewards:exact_answer"]}}
    for where, refused in (("/models/base/prompts", True), ("/data/prompts", False), ("prompts", False)):
        path = _write(tmp_path / "train.yaml", {"runtime": runtime, **trainer, "log": {"eval_prompts": where}})
        if refused:
            with pytest.raises(ConfigError, match=r"log\.eval_prompts: /models/base/prompts is outside /data"):
                read_trainer_config(resolve_runtime(str(path)), [])
        else:
            assert read_trainer_config(resolve_runtime(str(path)), []).log.eval_prompts == where


def test_status_shows_the_newest_evaluation(tmp_path, tiny_model):
    from astrai.host.status import format_status, job_status

    runtime = {"job_name": "evals", "gpu": {"devices": "none"}, "container": {"cuda_tag": "cpu"}}
    runtime["paths"] = {"data": str(tmp_path / "data"), "model": str(tiny_model), "checkpoints": str(tmp_path / "ck")}
    resolved = resolve_runtime(str(_write(tmp_path / "train.yaml", {"runtime": runtime})))
    resolved.job_dir.mkdir(parents=True)
    evaluated = {METRIC_EVAL_REWARD: 0.5, "eval/digits": 0.25, METRIC_EVAL_PASS_AT_K: 0.4, METRIC_EVAL_UNSCORED: 0.0}
    lines = [
        {"step": 10, "max_steps": 20, "loss": 2.0, **evaluated, METRIC_EVAL_COMPLETION_LENGTH: 5.0},
        {"step": 12, "max_steps": 20, "loss": 1.9},
    ]
    (resolved.job_dir / METRICS_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    shown = [line for line in format_status(job_status(resolved)) if line.startswith("evaluation")]
    assert shown == ["evaluation  reward 0.5000 (digits 0.2500), pass@k 40%, completions of 5.0 tokens at step 10"]
