"""kto: unpaired preference data (`prepare --kind kto`) tokenized as TRL's KTOTrainer tokenizes it, its mismatched
pairs TRL's rotation, the loss, its gradient and metrics TRL's on the same log-probabilities (TRL's own methods,
driven through a stand-in for the trainer's state), and the train type in the trainer: it learns, it is refused
where it cannot train, it stops and resumes bitwise, with LoRA.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import yaml
from torch.utils.data import default_collate
from trainer_runs import TRAINER, Run, final_weights, metrics_step, run_to_end, stop_gracefully

from astrai.common.checkpoints import latest_complete_checkpoint
from astrai.common.config import load_trainer_config
from astrai.common.configfile import ConfigError
from astrai.common.contract import METRICS_FILE
from astrai.common.data_folder import DataError, Examples, TokenData, WindowSplit
from astrai.common.fit import SetupError
from astrai.common.settings import KTOSettings
from astrai.data.pipeline import describe_folder, prepare
from astrai.data.tokenizing import HFTokenizer
from astrai.host.status import objective_lines
from astrai.trainer.feed.records import RecordIndex
from astrai.trainer.objectives.kto import KTOExamples, KTOMetrics, Scored, kl_estimate, kto_loss, mismatched
from astrai.trainer.run.loop import dry_run
from tests.support import invoke

trl = pytest.importorskip("trl")
from accelerate import PartialState  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from trl.trainer.kto_trainer import KTOTrainer  # noqa: E402

TEXT_RECORDS = [
    {"prompt": "cat sat on", "completion": " the mat", "label": True},
    {"prompt": "red door", "completion": " green hills by", "label": False},
    {"prompt": "birds sang", "completion": " over the old mill", "label": True},
    {"prompt": "and then", "completion": " ran", "label": False},
]
CHAT_RECORDS = [
    {"prompt": [{"role": "user", "content": "cat sat"}], "completion": "CAT SAT"},
    {
        "prompt": [{"role": "system", "content": "Be loud."}, {"role": "user", "content": "red door"}],
        "completion": "GR",
    },
    {"prompt": [{"role": "user", "content": "old mill"}], "completion": "OLD"},
    {"prompt": [{"role": "user", "content": "ran"}], "completion": "to"},
]
CHAT_RECORDS = [
    {**record, "completion": [{"role": "assistant", "content": record["completion"]}], "label": number != 1}
    for number, record in enumerate(CHAT_RECORDS)
]
"""TRL's conversational shape: the completion a list of (assistant) messages."""


def _write(path, records):
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


def _trls_examples(tokenizer_folder, records, batch_size: int):
    """TRL's KTOTrainer._prepare_dataset on the records: each example's prompt_ids, completion_ids and
    KL_completion_ids (the completions rotated by one within each batch of ``batch_size``)."""
    PartialState(cpu=True)  # TRL's logging asks for accelerate's state
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    trainer = SimpleNamespace(calculate_KL=True, _tokenizer=tokenizer, desirable_weight=1.0, undesirable_weight=1.0)
    args = SimpleNamespace(dataset_num_proc=None, max_length=None, per_device_train_batch_size=batch_size)
    return list(KTOTrainer._prepare_dataset(trainer, Dataset.from_list(records), tokenizer, args, "train"))


@pytest.mark.parametrize("records", [TEXT_RECORDS, CHAT_RECORDS], ids=["text", "chat"])
def test_examples_are_tokenized_as_trl_does_and_paired_as_its_rotation(tmp_path, chat_world, records):
    world = chat_world[0]
    prepare(
        tmp_path / "kto", [_write(tmp_path / "r.jsonl", records)], tokenizer=HFTokenizer(world.tokenizer), kind="kto"
    )
    data = TokenData.open(tmp_path / "kto")
    assert data.kind == "kto" and data.labels() == [record["label"] for record in records]
    theirs = _trls_examples(world.tokenizer, records, batch_size=2)
    index = RecordIndex(data)
    end_of_turn = AutoTokenizer.from_pretrained(world.tokenizer).eos_token_id
    for number, example in enumerate(theirs):
        ids, mask = index.sequence(number)
        prompt, completion = example["prompt_ids"], example["completion_ids"]
        assert ids.tolist() == prompt + completion
        # The completion is supervised through its end of turn; TRL also counts a template's newline after it.
        through = completion.index(end_of_turn) + 1
        assert mask.tolist() == [0] * len(prompt) + [1] * through + [0] * (len(completion) - through)
    # Our mismatched pairs of each micro-batch are TRL's: each prompt with the completion before it, cycled.
    window = 64
    examples = Examples([(n, index.length[n]) for n in range(len(index))], data.labels(), 0, 0)
    dataset = KTOExamples(index, examples, window, WindowSplit(len(examples)))
    for start in (0, 2):
        batch = default_collate([dataset.item(start), dataset.item(start + 1)])
        tokens, mask = mismatched(batch)
        for row in range(2):
            ours = theirs[start + row]
            expected = ours["prompt_ids"] + ours["KL_completion_ids"]
            assert tokens[row].tolist() == expected + [0] * (window + 1 - len(expected))
            assert mask[row, : len(ours["prompt_ids"])].eq(0).all() and mask[row].sum() > 0
    assert "kind        kto: 4 examples (" in describe_folder(tmp_path / "kto")


B, T = 6, 9
LABELS = [True, False, True, True, False, False]


def _logps(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([9, 4, 7, 2, 8, 5])
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
    per_token = -torch.rand(B, T, generator=generator) * 2 * mask
    return {
        "per_token": per_token,
        "reference": (per_token + 0.3 * torch.randn(B, T, generator=generator) * mask).sum(-1),
        "kl_policy": -torch.rand(B, generator=generator) * 8,
        "kl_reference": -torch.rand(B, generator=generator) * 8,
        "mask": mask,
    }


def _trls_loss(settings: KTOSettings, tensors: dict, per_token: torch.Tensor):
    """TRL's KTOTrainer._compute_loss (loss_type kto, precomputed reference log-probabilities), through a stand-in
    for the trainer's state: the model gives ``per_token`` as its completion tokens' log-probabilities."""
    PartialState(cpu=True)
    # As a model gives them for labels of -100 outside the completion: 0.
    log_probs = per_token * tensors["mask"]
    outputs = SimpleNamespace(log_probs=log_probs, entropy=torch.zeros(B, T), mean_logits=torch.zeros(B, T))
    trainer = SimpleNamespace(
        accelerator=SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x),
        model=SimpleNamespace(training=True),
        calculate_KL=True,
        precompute_ref_logps=True,
        loss_type="kto",
        beta=settings.beta,
        desirable_weight=settings.desirable_weight,
        undesirable_weight=settings.undesirable_weight,
        aux_loss_enabled=False,
        _compute_kl_logps=lambda model, batch: tensors["kl_policy"],
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": torch.ones(B, T + 1, dtype=torch.long),
        "attention_mask": torch.ones(B, T + 1, dtype=torch.long),
        "completion_mask": torch.cat([torch.zeros(B, 1), tensors["mask"]], dim=1).long(),
        "label": torch.tensor(LABELS),
        "ref_logps": tensors["reference"],
        "ref_KL_logps": tensors["kl_reference"],
    }
    loss = KTOTrainer._compute_loss(trainer, lambda **kwargs: outputs, inputs, return_outputs=False)
    return loss, trainer._metrics["train"]


@pytest.mark.parametrize(
    ("settings", "kl_shift"),
    [
        (KTOSettings(), 0.0),
        (KTOSettings(beta=0.5, desirable_weight=1.33, undesirable_weight=0.7), 0.0),
        (KTOSettings(beta=0.05), 2.0),  # the policy's pairs above the reference's: z0 > 0
        (KTOSettings(beta=2.0, undesirable_weight=3.0), -2.0),  # below: z0 clamped to 0
    ],
    ids=["defaults", "weighted", "kl-positive", "kl-clamped"],
)
def test_the_loss_its_gradient_and_metrics_are_trls(settings, kl_shift):
    tensors = _logps(7)
    tensors["kl_policy"] = tensors["kl_reference"] + kl_shift + 0.5 * torch.randn(B)
    ours_tokens = tensors["per_token"].clone().requires_grad_(True)
    theirs_tokens = tensors["per_token"].clone().requires_grad_(True)
    theirs, metrics = _trls_loss(settings, tensors, theirs_tokens)
    labels = torch.tensor(LABELS)
    policy = (ours_tokens * tensors["mask"]).sum(-1)
    kl = kl_estimate(tensors["kl_policy"], tensors["kl_reference"])
    losses, rewards = kto_loss(policy, tensors["reference"], kl, labels, settings)
    ours = losses.mean()
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours_tokens.grad, theirs_tokens.grad, rtol=1e-6, atol=1e-9)
    assert not kl_shift or (kl > 0) == (kl_shift > 0)  # the cases do exercise the clamp
    collected = KTOMetrics(torch.device("cpu"))
    empty = torch.zeros(())
    collected.add(Scored(losses, rewards, policy, kl, labels, empty, empty))
    values = collected.take(SimpleNamespace(device=torch.device("cpu"), distributed=False))
    for ours_key, their_key in (
        ("kl", "kl"),
        ("rewards_chosen", "rewards/chosen"),
        ("rewards_rejected", "rewards/rejected"),
        ("rewards_margin", "rewards/margins"),
        ("logps_chosen", "logps/chosen"),
        ("logps_rejected", "logps/rejected"),
    ):
        assert values[ours_key] == pytest.approx(metrics[their_key][0], rel=1e-6, abs=1e-7), ours_key


def test_settings_are_trls_defaults():
    import dataclasses

    from trl import KTOConfig

    theirs = {field.name: field.default for field in dataclasses.fields(KTOConfig)}
    ours = KTOSettings()
    assert (ours.beta, ours.desirable_weight, ours.undesirable_weight) == (
        theirs["beta"],
        theirs["desirable_weight"],
        theirs["undesirable_weight"],
    )
    assert theirs["loss_type"] == "kto"


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"prompt": "p", "completion": "c"}, "has no 'label' field (its keys: completion, prompt); a kto record holds"),
        ({"prompt": "p", "completion": "c", "label": 1}, "field 'label' holds 1: expected true (a desirable"),
        ({"prompt": "p", "completion": ["c"], "label": True}, "field 'completion' holds list: with a text prompt"),
        ({"prompt": 3, "completion": "c", "label": False}, "field 'prompt' holds int: expected text, or a list"),
        ({"chosen": "c", "label": False}, "has no 'prompt' field"),
    ],
)
def test_records_that_cannot_train_are_refused_naming_the_line(tmp_path, record, message):
    records = _write(tmp_path / "r.jsonl", [TEXT_RECORDS[0], record])
    with pytest.raises(DataError, match=r"r\.jsonl:2: " + re.escape(message)):
        prepare(tmp_path / "out", [records], kind="kto")
    assert not (tmp_path / "out").exists()


def test_a_chat_completion_is_a_string_a_message_or_a_list_of_them(tmp_path, chat_world):
    """As DPO's answers: the three forms of one assistant turn make the same example."""
    tokenizer = HFTokenizer(chat_world[0].tokenizer)
    prompt = [{"role": "user", "content": "cat sat"}]
    turn = {"role": "assistant", "content": "CAT SAT"}
    sequences = []
    for number, completion in enumerate(("CAT SAT", turn, [turn])):
        folder = tmp_path / str(number)
        records = [{"prompt": prompt, "completion": completion, "label": False}]
        prepare(folder, [_write(tmp_path / f"{number}.jsonl", records)], tokenizer=tokenizer, kind="kto")
        ids, mask = RecordIndex(TokenData.open(folder)).sequence(0)
        sequences.append((ids.tolist(), mask.tolist()))
    assert sequences[0] == sequences[1] == sequences[2] and sum(sequences[0][1]) > 0


# --- In the trainer --------------------------------------------------------------------------------------------------

KTO_RUN = {
    "train_type": "kto",
    "window_size": 24,
    "batch_per_device": 4,
    "max_steps": 40,
    "max_lr": 3e-3,
    "warmup_ratio": 0.0,
    "ckpt_interval": 100,
    "log_interval": 1,
    "val_fraction": 0.0,
}


@pytest.fixture(scope="module")
def kto_world(tmp_path_factory):
    """Byte-level KTO data: prompts `q N:`, a completion of `yes` desirable and one of `no` undesirable for each."""
    root = tmp_path_factory.mktemp("kto world")
    records = []
    for number in range(24):
        records.append({"prompt": f"q {number}:", "completion": " yes yes", "label": True})
        records.append({"prompt": f"q {number}:", "completion": " no no no", "label": False})
    prepare(root / "data", [_write(root / "kto.jsonl", records)], kind="kto")
    return root


def _yaml(train_yaml, path, world, **keys):
    return train_yaml(path, **{**KTO_RUN, "data_root_path": str(world / "data"), **keys})


@pytest.mark.slow
def test_a_tiny_run_learns_to_prefer_the_desirable_completions(
    tmp_path, kto_world, train_yaml, run_trainer, one_thread
):
    """At the first step the policy is the reference: every reward and the KL are 0, the loss 1 - sigmoid(0) = 0.5.
    Then the desirable completions' reward rises above the undesirable ones', and the loss falls."""
    path = _yaml(train_yaml, tmp_path / "t.yaml", kto_world, ckpt_dir=str(tmp_path / "ckpt"))
    run_trainer(path)
    records = [json.loads(line) for line in (tmp_path / "ckpt" / METRICS_FILE).read_text().splitlines()]
    first, last = records[0], records[-1]
    assert first["loss"] == pytest.approx(0.5, abs=1e-6)
    assert first["rewards_chosen"] == pytest.approx(0.0, abs=1e-6) and first["kl"] == pytest.approx(0.0, abs=1e-6)
    late = records[-10:]
    assert sum(r["loss"] for r in late) / len(late) < 0.4, [r["loss"] for r in records]
    margins = [r["rewards_margin"] for r in late if "rewards_margin" in r]  # a batch may hold one label only
    assert len(margins) >= 5 and all(margin > 0 for margin in margins), margins
    chosen = [r["logps_chosen"] for r in records if "logps_chosen" in r]
    rejected = [r["logps_rejected"] for r in records if "logps_rejected" in r]
    assert chosen[-1] > chosen[0] and rejected[-1] < rejected[0]
    assert math.isfinite(last["entropy"])
    # invoke status's line for it, from a record the run wrote
    shown = next(r for r in reversed(records) if "rewards_margin" in r)
    assert objective_lines(shown) == [
        f"kto         rewards desirable {shown['rewards_chosen']:+.4f}, undesirable {shown['rewards_rejected']:+.4f}, "
        f"margin {shown['rewards_margin']:.4f}, kl {shown['kl']:.4f}"
    ]


@pytest.mark.slow
@pytest.mark.parametrize("case", [{}, {"lora_rank": 4, "lora_alpha": 8, "grad_accum_steps": 2}], ids=["full", "lora"])
def test_a_graceful_stop_then_a_restart_ends_bitwise_equal(tmp_path, kto_world, train_yaml, trainer_env, case):
    keys = {"max_steps": 16, "num_workers": 1, **case}
    finals = {}
    for name in ("whole", "stopped"):
        ckpt_dir = tmp_path / name
        path = _yaml(train_yaml, tmp_path / f"{name}.yaml", kto_world, ckpt_dir=str(ckpt_dir), **keys)
        command = [*TRAINER, "--config", str(path)]
        if name == "whole":
            run_to_end(command, trainer_env, tmp_path / "whole.log")
        else:
            run = Run(command, trainer_env, tmp_path / "run.log")
            stop_gracefully(run, lambda ckpt_dir=ckpt_dir: metrics_step(ckpt_dir) >= 4, timeout=30)
            latest = latest_complete_checkpoint(ckpt_dir)
            assert latest.meta.reason == "emergency" and 4 <= latest.step < 16, run.output()
            assert latest.meta.train_type == "kto" and latest.meta.reference is not None
            rerun = run_to_end(command, trainer_env, tmp_path / "rerun.log")
            assert f"resumed from {latest.path}" in rerun.output()
        finals[name] = final_weights(ckpt_dir, 16)
    assert finals["stopped"] == finals["whole"]


def test_settings_out_of_range_and_data_of_another_kind_are_refused_naming_the_key(
    tmp_path, kto_world, corpus_data, train_yaml, make_trainer
):
    path = _yaml(train_yaml, tmp_path / "t.yaml", kto_world, ckpt_dir=str(tmp_path / "ckpt"))
    for overrides, message in (
        ({"kto_beta": "0"}, "training.kto_beta: expected a number > 0, got 0.0"),
        ({"kto_desirable_weight": "-1"}, "training.kto_desirable_weight: expected a number > 0, got -1.0"),
        ({"kto_undesirable_weight": "inf"}, "training.kto_undesirable_weight (--kto_undesirable_weight): expected"),
        ({"batch_per_device": "1"}, "training.batch_per_device: expected an integer >= 2 with kto (an example's KL"),
    ):
        with pytest.raises(ConfigError) as raised:
            load_trainer_config(path, list(overrides.items()))
        assert any(message in line for line in raised.value.messages), raised.value.messages
    with pytest.raises(DataError, match=r"holds pre-training text \(kind seq\) but training.train_type is kto; .*"):
        make_trainer(path, data_root_path=str(corpus_data))
    with pytest.raises(SetupError, match=r"holds 48 training examples, fewer than one global batch"):
        make_trainer(path, batch_per_device=50)
    assert not (tmp_path / "ckpt").exists()


def test_dry_run_describes_kto(tmp_path, kto_world, train_yaml, capsys):
    path = _yaml(train_yaml, tmp_path / "t.yaml", kto_world, ckpt_dir=str(tmp_path / "ckpt"), dpo_beta=0.2)
    assert dry_run(load_trainer_config(path, [("kto_desirable_weight", "1.5")])) == 0
    out = capsys.readouterr().out
    assert "global batch: batch_per_device(4) * grad_accum_steps(1) * world_size(1) = 4 examples per step" in out
    assert (
        "kto: beta 0.1, desirable_weight 1.5, undesirable_weight 1; the KL estimate from each micro-batch's "
        "mismatched pairs" in out
    )
    assert "note: train_type kto does not use training.dpo_beta; it is left as set" in out
    assert "start checks: passed" in out
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow
def test_preflight_counts_the_examples(tmp_path, tiny_model, kto_world):
    config = tmp_path / "train.yaml"
    runtime = {"job_name": "j", "gpu": {"devices": "none"}, "container": {"cuda_tag": "cpu"}}
    runtime["paths"] = {"data": str(kto_world / "data"), "model": str(tiny_model)}
    trainer = {"data": {"window_size": 24}, "training": {"train_type": "kto", "batch_per_device": 4}}
    config.write_text(yaml.safe_dump({"runtime": runtime, **trainer}), encoding="utf-8")
    result = invoke("preflight", "--config", str(config), check=False)
    line = next(line for line in result.stdout.splitlines() if "data fits model" in line)
    assert line.startswith("✓") and "48 training examples, 12 steps per epoch" in line, result.stdout
    assert "(48 sequences as 48 examples (24 desirable, 24 undesirable)" in line, line
