"""Rewards from models: the Bradley–Terry loss against TRL's RewardTrainer, a reward model's scores against
transformers' AutoModelForSequenceClassification (ours, one transformers wrote, one of a family the trainer does not
compute), what it scores (its own chat template), the folders it refuses, and train_type reward_model end to end: a
tiny reward model that ranks held-out pairs above chance, exported, and an online_grpo run that takes it as its reward.
"""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
import torch
from hf_folders import make_chat_tokenizer, make_hf_model

from astrai.common.config import load_trainer_config
from astrai.common.configfile import ConfigError
from astrai.common.contract import (
    METRIC_REWARD_MODEL_ACCURACY,
    METRIC_REWARD_MODEL_MARGIN,
    METRIC_REWARD_MODEL_VAL_ACCURACY,
    METRIC_REWARD_MODEL_VAL_MARGIN,
    METRICS_FILE,
)
from astrai.common.metrics import MetricsFile
from astrai.common.reward_specs import parse_rewards
from astrai.data.pipeline import prepare
from astrai.host.status import objective_lines
from astrai.trainer.launch.distributed import init_distributed
from astrai.trainer.models.native import Transformer
from astrai.trainer.models.weights import PRESETS, load_base_model, save_model_folder
from astrai.trainer.objectives.model_rewards import load_model_reward
from astrai.trainer.objectives.reward_model import bradley_terry_loss, classifier_start
from astrai.trainer.objectives.rewards import RewardError


def _transformers_rewards(folder, rows: list[list[int]]) -> list[float]:
    """transformers' own scores of each row, one at a time."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return [float(model(torch.tensor([row])).logits[0, 0]) for row in rows]


def _reward(folder, name: str = "rm", **keys):
    (spec,) = parse_rewards([{"model": str(folder), "name": name, **keys}])
    return load_model_reward(spec, init_distributed("none", "cpu"), torch.autocast("cpu", enabled=False))


ROWS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [1, 2, 3, 4, 5], [40] * 30]


# --- the loss ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("center", [None, 0.01])
@pytest.mark.parametrize("with_margin", [False, True], ids=["no-margin", "margin"])
def test_the_bradley_terry_loss_and_its_gradient_equal_trls(center, with_margin):
    from trl import RewardTrainer

    generator = torch.Generator().manual_seed(0)
    chosen, rejected = torch.randn(8, generator=generator) * 3, torch.randn(8, generator=generator) * 3
    margin = torch.rand(8, generator=generator) if with_margin else None

    def trls(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
        """TRL 1.16's RewardTrainer.compute_loss on these rewards (a model that returns them, one process)."""
        model = types.SimpleNamespace(training=True)
        logits = torch.cat([chosen, rejected]).unsqueeze(-1)
        identity = types.SimpleNamespace(gather_for_metrics=lambda x: x, gather=lambda x: x)
        trainer = types.SimpleNamespace(
            model=model,
            args=types.SimpleNamespace(center_rewards_coefficient=center),
            accelerator=identity,
            _metrics={"train": {"num_tokens": [], **{key: [] for key in ("min_reward", "mean_reward", "max_reward")}}},
            _total_train_tokens=0,
            _tp_size=1,
        )
        trainer._metrics["train"].update(accuracy=[], margin=[])
        inputs = {"attention_mask": torch.ones(16, 4, dtype=torch.long)}
        if margin is not None:
            inputs["margin"] = margin
        return RewardTrainer.compute_loss(trainer, lambda **_: types.SimpleNamespace(logits=logits), inputs)

    ours_c, ours_r = chosen.clone().requires_grad_(), rejected.clone().requires_grad_()
    theirs_c, theirs_r = chosen.clone().requires_grad_(), rejected.clone().requires_grad_()
    ours = bradley_terry_loss(ours_c, ours_r, center, margin).mean()
    theirs = trls(theirs_c, theirs_r)
    ours.backward()
    theirs.backward()
    assert abs(ours.item() - theirs.item()) <= 1e-6
    assert torch.allclose(ours_c.grad, theirs_c.grad, atol=1e-6) and torch.allclose(
        ours_r.grad, theirs_r.grad, atol=1e-6
    )


# --- reward models and transformers --------------------------------------------------------------------------------


def test_a_reward_model_of_ours_scores_as_transformers_loads_it(tmp_path):
    config, weights = load_base_model(make_hf_model(tmp_path / "base", vocab_size=64, pad_token_id=0))
    config, weights = classifier_start(config, weights, seed=3)
    model = Transformer(config)
    model.load_state_dict(weights)
    save_model_folder(tmp_path / "rm", config, model.state_dict())
    written = json.loads((tmp_path / "rm" / "config.json").read_text())
    assert written["architectures"] == ["LlamaForSequenceClassification"] and written["id2label"] == {"0": "LABEL_0"}
    # Batched (rows of other lengths padded with the pad token, id 0) against transformers one row at a time.
    ours = _reward(tmp_path / "rm").function.score_rows(ROWS)
    theirs = _transformers_rewards(tmp_path / "rm", ROWS)
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) <= 1e-5, (ours, theirs)
    assert len(set(round(value, 4) for value in ours)) == len(ROWS)  # the rows score apart: a real comparison


@pytest.mark.parametrize("pad", [None, 2], ids=["no-pad-token", "pad-token"])
def test_a_folder_transformers_wrote_scores_as_transformers_scores_it(tmp_path, pad):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        num_labels=1,
        pad_token_id=pad,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path / "rm")
    # The pad token inside a row: transformers reads the last token that is not it; so does the trainer.
    rows = [*ROWS, [7, 8, 2, 9, 2, 2]]
    ours = _reward(tmp_path / "rm").function.score_rows(rows)
    theirs = _transformers_rewards(tmp_path / "rm", rows)
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) <= 1e-5, (ours, theirs)


def test_a_family_the_trainer_does_not_compute_scores_through_transformers(tmp_path):
    import transformers

    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, num_labels=1)
    torch.manual_seed(1)
    transformers.GPT2ForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    reward = _reward(tmp_path / "rm", batch_size=2)
    assert reward.function.library
    rows = [*ROWS, [9, 9, 9, 9, 9], [1, 1]]  # rows of one length go through it together
    ours = reward.function.score_rows(rows)
    assert max(abs(a - b) for a, b in zip(ours, _transformers_rewards(tmp_path / "rm", rows), strict=True)) <= 1e-5


def test_it_scores_the_prompt_and_completion_as_its_own_chat_template_renders_them(tmp_path):
    from transformers import AutoTokenizer

    folder = make_hf_model(tmp_path / "rm", vocab_size=400, pad_token_id=0)
    config, weights = classifier_start(*load_base_model(folder), seed=0)
    model = Transformer(config)
    model.load_state_dict(weights)
    save_model_folder(folder, config, model.state_dict())
    make_chat_tokenizer(folder, ["What is the capital of France?", "Paris, of course.", "hello there"])
    scorer = _reward(folder).function
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    conversation = [*messages, {"role": "assistant", "content": "Paris."}]
    expected = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"]
    assert scorer.sequence("<rendered by the policy>", "Paris.", messages) == list(expected)
    # A text prompt: its tokens, the completion's and the end of text, as prepare --kind dpo writes a text pair.
    end = tokenizer.eos_token_id  # the tokenizer's end of text: its eos_token
    text = (
        tokenizer("hello ", add_special_tokens=False)["input_ids"]
        + tokenizer("there", add_special_tokens=False)["input_ids"]
    )
    assert scorer.sequence("hello ", "there", None) == [*text, end]
    # Called as a reward: each completion with its own prompt's messages.
    values = scorer(["a", "b"], ["Paris.", "Lyon."], prompt_messages=[messages, messages])
    assert values == scorer.score_rows([scorer.sequence("a", c, messages) for c in ("Paris.", "Lyon.")])


def test_folders_that_are_not_a_reward_model_are_refused_naming_it(tmp_path):
    with pytest.raises(RewardError, match="reward model rm .* is a causal language model; a reward model is"):
        _reward(make_hf_model(tmp_path / "lm", vocab_size=64))
    config = dataclasses.replace(PRESETS["tiny"], num_labels=2)
    save_model_folder(tmp_path / "two", config, Transformer(config).state_dict())
    with pytest.raises(RewardError, match="is a classifier of 2 labels"):
        _reward(tmp_path / "two")
    with pytest.raises(RewardError, match="config.json: not found"):
        _reward(tmp_path / "nothing")


# --- train_type reward_model ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """Byte-level preference pairs: a prompt `q N:`, the answer ` yes yes` chosen over ` no no no`."""
    root = tmp_path_factory.mktemp("reward pairs")
    records = root / "pairs.jsonl"
    lines = [json.dumps({"prompt": f"q {n}:", "chosen": " yes yes", "rejected": " no no no"}) for n in range(48)]
    records.write_text("\n".join(lines) + "\n", encoding="utf-8")
    prepare(root / "dpo", [records], kind="dpo")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"q {n}:"}) + "\n" for n in range(8)), encoding="utf-8")
    prepare(root / "prompts", [prompts], kind="prompts")
    return root


def _rm_yaml(train_yaml, path, pairs, **keys):
    values = {
        "train_type": "reward_model",
        "data_root_path": str(pairs / "dpo"),
        "window_size": 24,
        "val_fraction": 0.25,
        "batch_per_device": 4,
        "max_steps": 24,
        "eval_interval": 12,
        "log_interval": 4,
        "ckpt_interval": 12,
        "warmup_ratio": 0.0,
    }
    return train_yaml(path, **{**values, **keys})


@pytest.mark.slow
def test_a_tiny_reward_model_ranks_held_out_pairs_and_an_online_run_takes_it_as_its_reward(
    tmp_path, pairs, train_yaml, run_trainer, one_thread
):
    from astrai.common.checkpoints import latest_complete_checkpoint
    from astrai.host.export import export_checkpoint

    ckpt = tmp_path / "rm-job"
    run_trainer(_rm_yaml(train_yaml, tmp_path / "rm.yaml", pairs, ckpt_dir=str(ckpt)))
    records = MetricsFile(ckpt / METRICS_FILE).records()
    first, last = records[0], records[-1]
    assert first[METRIC_REWARD_MODEL_ACCURACY] <= 1 and first["loss"] > last["loss"]
    assert last[METRIC_REWARD_MODEL_ACCURACY] == 1.0 and last[METRIC_REWARD_MODEL_MARGIN] > 1.0
    assert objective_lines(last) == [
        f"pairs       accuracy 100.0%, margin {last[METRIC_REWARD_MODEL_MARGIN]:.4f} (chosen over rejected)"
    ]
    validated = [record for record in records if METRIC_REWARD_MODEL_VAL_ACCURACY in record]
    assert [record["step"] for record in validated] == [12, 24]
    assert validated[-1][METRIC_REWARD_MODEL_VAL_ACCURACY] > 0.5 and validated[-1][METRIC_REWARD_MODEL_VAL_MARGIN] > 0
    assert "val_loss" in validated[-1]
    # Exported, it is a sequence-classification folder transformers scores as the trainer does.
    latest = latest_complete_checkpoint(ckpt)
    export_checkpoint(latest.path, tmp_path / "exported", None, 5 * 2**30)
    rows = [list(b"q 99: yes yes") + [256], list(b"q 99: no no no") + [256]]
    ours = _reward(tmp_path / "exported").function.score_rows(rows)
    theirs = _transformers_rewards(tmp_path / "exported", rows)
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) <= 1e-5
    assert ours[0] > ours[1]  # a pair it never saw, ranked right
    # An online run scores its completions with it.
    run = tmp_path / "grpo"
    grpo = train_yaml(
        tmp_path / "grpo.yaml",
        train_type="online_grpo",
        data_root_path=str(pairs / "prompts"),
        ckpt_dir=str(run),
        rewards=[{"model": str(tmp_path / "exported"), "name": "rm", "weight": 0.5}],
        num_generations=2,
        batch_per_device=2,
        max_completion_length=6,
        max_steps=2,
        log_interval=1,
    )
    run_trainer(grpo)
    scored = MetricsFile(run / METRICS_FILE).records()
    assert all(abs(record["reward"] - 0.5 * record["reward_rm"]) < 1e-6 for record in scored), scored


def test_reward_model_settings_and_starts_it_refuses(tmp_path, pairs, train_yaml, make_trainer):
    from astrai.common.fit import SetupError

    with pytest.raises(ConfigError, match="training.lora_rank: expected 0 with reward_model"):
        load_trainer_config(_rm_yaml(train_yaml, tmp_path / "a.yaml", pairs, lora_rank=4))
    with pytest.raises(ConfigError, match="training.center_rewards_coefficient: expected a number >= 0"):
        load_trainer_config(_rm_yaml(train_yaml, tmp_path / "b.yaml", pairs, center_rewards_coefficient=-1))
    granite = make_hf_model(tmp_path / "granite", model_type="granite", vocab_size=300)
    with pytest.raises(SetupError, match="model_type granite has no sequence classifier in transformers"):
        make_trainer(
            _rm_yaml(train_yaml, tmp_path / "c.yaml", pairs, param_path=str(granite), ckpt_dir=str(tmp_path / "c"))
        )
    config = dataclasses.replace(PRESETS["tiny"], num_labels=1)
    save_model_folder(tmp_path / "rm", config, Transformer(config).state_dict())
    sft = train_yaml(tmp_path / "d.yaml", param_path=str(tmp_path / "rm"), ckpt_dir=str(tmp_path / "d"))
    with pytest.raises(SetupError, match="is a sequence classifier \\(a reward model\\), which generates no text"):
        make_trainer(sft)


def test_preflight_checks_the_reward_model_and_says_its_memory(tmp_path, tiny_model):
    import yaml

    from astrai.host.checklist import FAIL, PASS
    from astrai.host.reward_checks import model_check
    from astrai.host.runtime import resolve_runtime

    models = tmp_path / "models"
    config = dataclasses.replace(PRESETS["tiny"], num_labels=1)
    save_model_folder(models / "rm", config, Transformer(config).state_dict())
    save_model_folder(models / "lm", PRESETS["tiny"], Transformer(PRESETS["tiny"]).state_dict())
    runtime = {"job_name": "rm", "gpu": {"devices": "none"}, "container": {"cuda_tag": "cpu"}}
    runtime["paths"] = {"data": str(tmp_path / "data"), "model": str(models)}
    (tmp_path / "train.yaml").write_text(yaml.safe_dump({"runtime": runtime}), encoding="utf-8")
    resolved = resolve_runtime(str(tmp_path / "train.yaml"))

    def check(folder: str):
        (spec,) = parse_rewards([{"model": folder}])
        return model_check(resolved, spec)

    found = check("/models/base/rm")
    assert found.mark == PASS and "llama classifier of 894,208 parameters, 3.4 MiB on each process (float32)" in (
        found.detail
    ), found.detail
    assert check("/models/base/lm").mark == FAIL and "is a causal language model" in check("/models/base/lm").detail
    outside = check("/elsewhere/rm")
    assert outside.mark == FAIL and "/elsewhere/rm is in no folder the container mounts" in outside.detail


def test_a_pairs_margin_is_kept_by_prepare_and_taken_by_the_loss(tmp_path, one_thread):
    from torch.utils.data import default_collate

    from astrai.common.data_folder import DataError, TokenData, data_kind
    from astrai.common.settings import RewardModelSettings
    from astrai.trainer.feed.records import RecordIndex
    from astrai.trainer.launch.distributed import init_distributed
    from astrai.trainer.objectives.reward_model import RewardModelObjective, RewardPairs, sequence_rewards

    records = tmp_path / "pairs.jsonl"
    rows = [{"prompt": "q 1:", "chosen": " yes", "rejected": " no", "margin": 2.5}]
    rows += [{"prompt": "q 2:", "chosen": " yes!", "rejected": " no!"}]
    records.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    prepare(tmp_path / "dpo", [records], kind="dpo")
    data = TokenData.open(tmp_path / "dpo")
    assert data.margins() == [2.5, 2.5, 0.0, 0.0]  # each pair's two sequences
    # A folder prepared before margins were kept reads as it did: no margin.
    manifest = json.loads((tmp_path / "dpo" / "manifest.json").read_text())
    for shard in manifest["shards"]:
        (tmp_path / "dpo" / shard.pop("fields")).unlink()
    (tmp_path / "dpo" / "manifest.json").write_text(json.dumps(manifest))
    assert TokenData.open(tmp_path / "dpo").margins() is None
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**rows[0], "margin": "big"}) + "\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"bad.jsonl:1: field 'margin' holds 'big': expected a finite number"):
        prepare(tmp_path / "bad", [bad], kind="dpo")
    # The loss of a batch takes each pair's margin off its reward difference.
    prepare(tmp_path / "again", [records], kind="dpo")
    data = TokenData.open(tmp_path / "again")
    index = RecordIndex(data)
    units = data_kind("dpo").units(data, 16, "truncate")
    from astrai.common.data_folder import WindowSplit

    pairs = RewardPairs(index, units, 16, WindowSplit(len(units), 0))
    batch = default_collate([pairs.item(0), pairs.item(1)])
    assert batch.margin.tolist() == [2.5, 0.0]
    config, weights = classifier_start(PRESETS["tiny"], Transformer(PRESETS["tiny"]).state_dict(), seed=0)
    model = Transformer(config)
    model.load_state_dict(weights)
    objective = RewardModelObjective(init_distributed("none", "cpu"), RewardModelSettings(0.01), None)
    loss, _ = objective.micro(model, batch, None, 1)
    rewards = sequence_rewards(model, batch.tokens.view(-1, 17), batch.lengths.view(-1), None).view(-1, 2)
    expected = bradley_terry_loss(rewards[:, 0], rewards[:, 1], 0.01, torch.tensor([2.5, 0.0])).mean()
    assert torch.allclose(loss, expected)
