"""online_rloo: the leave-one-out advantages and the sequence-level loss against TRL's RLOOTrainer on the same tensors
(TRL's own methods, driven through a stand-in for the trainer's state), and the train type in the trainer: a step's
advantages and loss, its KL penalty against the starting model, its settings, a stop and an exact resume, with LoRA.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict, deque
from types import SimpleNamespace

import pytest
import torch
import yaml
from trainer_runs import TRAINER, Run, final_weights, metrics_step, run_to_end, stop_gracefully

from astrai.common.checkpoints import latest_complete_checkpoint
from astrai.common.config import load_trainer_config
from astrai.common.configfile import ConfigError
from astrai.common.contract import METRICS_FILE
from astrai.common.reward_specs import RewardSpec
from astrai.common.settings import RLOOSettings
from astrai.data.pipeline import prepare
from astrai.trainer.objectives.rewards import Reward, score
from astrai.trainer.objectives.rloo import rloo_advantages, rloo_loss, sequence_kl
from astrai.trainer.objectives.rollouts import completion_logps
from astrai.trainer.run.loop import dry_run
from tests.support import invoke

trl = pytest.importorskip("trl")
from accelerate import PartialState  # noqa: E402
from trl.trainer.rloo_trainer import RLOOTrainer  # noqa: E402

G = 4
EOS = 7
COMPLETION_IDS = [[5, 6, 7], [5, 2], [9, 7], [1, 2, 3, 4], [7, 7], [8, 1, 2], [3, 7], [4, 5, 6, 7]]
COMPLETIONS = ["abc", "xa", "eio", "aaaa", "xx", "xbcd", "xu", "hello"]
"""Two groups of four; an x marks a completion no function scores: one in the first group, all but one in the
second (whose one scorable completion has no sibling to be its baseline)."""
B, T = len(COMPLETIONS), 4


def length(prompts, completions, **fields):
    return [None if c.startswith("x") else len(c) / 10 for c in completions]


def vowels(prompts, completions, **fields):
    return [
        None if c.startswith("x") or i % 3 == 0 else sum(ch in "aeiou" for ch in c) for i, c in enumerate(completions)
    ]


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([len(ids) for ids in COMPLETION_IDS])
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
    old = -torch.rand(B, T, generator=generator) * 3 * mask
    return {
        "mask": mask,
        "old": old,
        "ref": (old + 0.3 * torch.randn(B, T, generator=generator)) * mask,
        # Near the old ones, and some far enough from them to be clipped either way.
        "logps": (old + 0.25 * torch.randn(B, T, generator=generator)) * mask,
    }


def _trainer(settings: RLOOSettings, mask_truncated: bool, tensors: dict, weights=(1.0, 0.5)) -> SimpleNamespace:
    """A stand-in for RLOOTrainer's state, enough for its _generate_and_score_completions, _calculate_rewards and
    _compute_loss: generation and the models' log-probabilities are ours (``tensors``), the rest is TRL's."""
    PartialState(cpu=True)  # TRL's logging asks for accelerate's state
    model = SimpleNamespace(training=True, is_gradient_checkpointing=False)
    reference = SimpleNamespace(is_gradient_checkpointing=False)

    def logps(scored, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, **kwargs):
        if scored is reference:
            return tensors["ref"], None, None
        if compute_entropy:  # the loss's forward pass, with gradients
            return tensors["policy"], torch.zeros_like(tensors["policy"]), None
        return tensors["old"], None, None

    trainer = SimpleNamespace(
        accelerator=SimpleNamespace(
            device=torch.device("cpu"),
            process_index=0,
            is_main_process=True,
            reduce=lambda x, reduction: x,
            gather=lambda x: x,
        ),
        model=model,
        ref_model=reference,
        _generate=lambda prompts: ([[1, 2]] * len(prompts), COMPLETION_IDS, COMPLETIONS),
        _tokenizer=SimpleNamespace(pad_token_id=0),
        pad_to_multiple_of=None,
        mask_truncated_completions=mask_truncated,
        eos_token_ids=[EOS],
        args=SimpleNamespace(per_device_train_batch_size=B, gradient_checkpointing_kwargs=None, report_to=[]),
        _get_per_token_logps_and_entropies=logps,
        beta=settings.beta,
        epsilon_low=settings.epsilon,
        epsilon_high=settings.high,
        num_generations=G,
        reward_funcs=[length, vowels],
        reward_func_names=["length", "vowels"],
        reward_weights=torch.tensor(weights),
        reward_processing_classes=[None, None],
        reward_clip_range=None,
        normalize_advantages=settings.normalize_advantages,
        aux_loss_enabled=False,
        state=SimpleNamespace(global_step=0),
        _log_completion_extra=lambda *args: None,
        _log_metric=lambda *args: None,
        _metrics={"train": defaultdict(list)},
        _logs={
            "prompt": deque(),
            "completion": deque(),
            "rewards": defaultdict(deque),
            "advantages": deque(),
            "extra": defaultdict(deque),
        },
        _pending_extra_logs={},
        _pending_metrics={},
        log_multimodal=False,
    )
    trainer._calculate_rewards = lambda *args: RLOOTrainer._calculate_rewards(trainer, *args)
    return trainer


def _ours(settings: RLOOSettings, mask_truncated: bool, tensors: dict, weights=(1.0, 0.5)):
    """Our advantages of the same completions: the rewards scored as the trainer scores them, the KL over the tokens
    the loss counts."""
    rewards = [Reward(RewardSpec(f"tests:{f.__name__}", w), f) for f, w in zip((length, vowels), weights, strict=True)]
    totals = score(rewards, ["p0"] * G + ["p1"] * G, COMPLETIONS, {}).total
    counted = torch.tensor([ids[-1] == EOS or not mask_truncated for ids in COMPLETION_IDS]).unsqueeze(1)
    kl = sequence_kl(tensors["old"], tensors["ref"], tensors["mask"] * counted) if settings.beta else None
    rewards = torch.tensor([math.nan if total is None else total for total in totals], dtype=torch.float64)
    return rloo_advantages(rewards, kl, G, settings), tensors["mask"] * counted


@pytest.mark.parametrize("mask_truncated", [False, True], ids=["all", "truncated-masked"])
@pytest.mark.parametrize(
    "settings",
    [
        RLOOSettings(),
        RLOOSettings(beta=0.0),
        RLOOSettings(beta=0.2, normalize_advantages=True),
        RLOOSettings(beta=0.0, normalize_advantages=True),
    ],
    ids=lambda s: f"beta{s.beta}-normalize{s.normalize_advantages}",
)
def test_the_advantages_are_trls(settings, mask_truncated):
    tensors = _tensors()
    trainer = _trainer(settings, mask_truncated, tensors)
    inputs = [{"prompt": prompt} for prompt in ("p0", "p1") for _ in range(G)]
    theirs = RLOOTrainer._generate_and_score_completions(trainer, inputs)
    ours, mask = _ours(settings, mask_truncated, tensors)
    torch.testing.assert_close(ours, theirs["advantages"], rtol=1e-6, atol=1e-6)
    assert ours[1] == 0 and ours[4:7].eq(0).all()  # unscorable: no signal
    assert ours[7] == 0 or settings.normalize_advantages  # scorable, but no sibling to compare with
    assert ours[[0, 2, 3]].ne(0).all()
    if settings.beta:  # TRL's kl metric: the mean per-token old - ref of the tokens counted
        kl = sequence_kl(tensors["old"], tensors["ref"], mask).sum() / mask.sum()
        assert kl.item() == pytest.approx(trainer._metrics["train"]["kl"][0], rel=1e-6)


@pytest.mark.parametrize(
    "settings",
    [RLOOSettings(), RLOOSettings(epsilon=0.1, epsilon_high=0.3), RLOOSettings(epsilon=0.05)],
    ids=lambda s: f"eps{s.epsilon}-{s.high}",
)
def test_the_loss_and_its_gradient_are_trls(settings):
    tensors = _tensors(1)
    advantage = torch.randn(B, generator=torch.Generator().manual_seed(3))
    ours_logps = tensors["logps"].clone().requires_grad_(True)
    theirs_logps = tensors["logps"].clone().requires_grad_(True)
    trainer = _trainer(settings, False, {**tensors, "policy": theirs_logps})
    inputs = {
        "prompt_ids": torch.ones(B, 2, dtype=torch.long),
        "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.ones(B, T, dtype=torch.long),
        "completion_mask": tensors["mask"].long(),
        "old_logps": (tensors["old"] * tensors["mask"]).sum(1),
        "advantages": advantage,
    }
    theirs = RLOOTrainer._compute_loss(trainer, None, inputs)
    ours, stats = rloo_loss(ours_logps, tensors["old"], advantage, tensors["mask"], settings)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours_logps.grad, theirs_logps.grad, rtol=1e-6, atol=1e-9)
    metrics = trainer._metrics["train"]
    assert stats.clip_low == pytest.approx(metrics["clip_ratio/low_mean"][0], rel=1e-6)
    assert stats.clip_high == pytest.approx(metrics["clip_ratio/high_mean"][0], rel=1e-6)
    assert stats.clip_region == pytest.approx(metrics["clip_ratio/region_mean"][0], rel=1e-6)
    assert 0 < stats.clip_region < 1  # the tensors do exercise the clipping


def test_settings_are_trls_defaults_and_out_of_range_ones_are_refused():
    import dataclasses

    from trl import RLOOConfig

    theirs = {field.name: field.default for field in dataclasses.fields(RLOOConfig)}
    ours = RLOOSettings()
    assert (ours.epsilon, ours.epsilon_high, ours.beta, ours.normalize_advantages, ours.num_iterations) == (
        theirs["epsilon"],
        theirs["epsilon_high"],
        theirs["beta"],
        theirs["normalize_advantages"],
        theirs["num_iterations"],
    )
    with pytest.raises(ValueError, match="rloo_beta: expected a number >= 0"):
        RLOOSettings(beta=-0.1)


# --- In the trainer --------------------------------------------------------------------------------------------------

REWARDS = '''
def first_code(prompts, completions, **fields):
    """Differs between nearly any two completions: every group has a signal."""
    return [ord(completion[0]) / 1000 if completion else 0.0 for completion in completions]

def digits(prompts, completions, **fields):
    return [sum(c == d for c in completion) / max(len(completion), 1)
            for d, completion in zip(fields["digit"], completions)]
'''

RLOO = {
    "train_type": "online_rloo",
    "num_generations": 4,
    "max_completion_length": 6,
    "batch_per_device": 2,
    "max_steps": 6,
    "ckpt_interval": 3,
    "log_interval": 1,
    "warmup_ratio": 0.0,
}


@pytest.fixture(scope="module")
def rloo_world(tmp_path_factory):
    """Prompt data (byte-level, 24 prompts with a `digit` field) and the reward file."""
    root = tmp_path_factory.mktemp("rloo world")
    records = root / "prompts.jsonl"
    with open(records, "w", encoding="utf-8") as handle:
        for number in range(24):
            handle.write(json.dumps({"prompt": f"say {number % 10}:", "digit": str(number % 10)}) + "\n")
    prepare(root / "data", [records], kind="prompts")
    (root / "rewards.py").write_text(REWARDS, encoding="utf-8")
    return root


def _yaml(train_yaml, path, world, reward="first_code", **keys):
    values = {**RLOO, "data_root_path": str(world / "data"), "rewards": [f"{world / 'rewards.py'}:{reward}"]}
    return train_yaml(path, **{**values, **keys})


@pytest.mark.slow
@pytest.mark.parametrize("lora", [{}, {"lora_rank": 4, "lora_alpha": 8}], ids=["copy", "adapters-off"])
def test_a_step_is_rloos_on_the_steps_completions_and_the_kl_starts_at_zero(
    tmp_path, rloo_world, train_yaml, make_trainer, one_thread, lora
):
    """One step's rollouts, then its micro-batches: the advantages are the leave-one-out ones of the rewards less the
    KL penalty against the starting model (a frozen copy, or with LoRA the model with its adapters off), and the loss
    is RLOO's mean over the global batch; at the start the policy is the reference, so the KL is 0."""
    path = _yaml(train_yaml, tmp_path / "t.yaml", rloo_world, ckpt_dir=str(tmp_path / "ckpt"), grad_accum_steps=2)
    trainer = make_trainer(path, rloo_beta=0.5, **lora)
    try:
        objective = trainer.objective
        batches = [torch.tensor([0, 1]), torch.tensor([2, 3])]
        prepared = objective.prepare_step(batches, trainer.model, 0)
        assert all(part.reference is None for part in prepared)  # the KL went into the rewards
        total = sum(objective.micro(trainer.model, b, p, 2)[0] for b, p in zip(batches, prepared, strict=True))
        prompts = [p for part in prepared for p in part.prompts]
        completions = [c for part in prepared for c in part.completions]
        logps, mask, _ = completion_logps(trainer.model, prompts, completions)
        with torch.no_grad():
            reference = completion_logps(objective.reference, prompts, completions)[0]
        kl = sequence_kl(logps.detach(), reference, mask)
        assert kl.abs().max() < 1e-5  # the policy is the starting model
        texts = [bytes(t for t in c if t < 256).decode("utf-8", "replace") for c in completions]
        rewards = torch.tensor([ord(text[0]) / 1000 if text else 0.0 for text in texts], dtype=torch.float64)
        settings = RLOOSettings(beta=0.5)
        advantage = rloo_advantages(rewards, kl, 4, settings)
        assert torch.allclose(torch.cat([part.advantages for part in prepared]), advantage, atol=1e-6)
        expected, _ = rloo_loss(logps, logps.detach(), advantage, mask, settings)
        # At ratio 1 the loss is minus the mean advantage, about 0 (a group's leave-one-out advantages sum to 0): the
        # gradients say more.
        assert torch.allclose(total, expected, atol=1e-5)
        trained = [parameter for parameter in trainer.model.parameters() if parameter.requires_grad]
        ours, theirs = torch.autograd.grad(total, trained), torch.autograd.grad(expected, trained)
        assert all((a - b).norm() <= 1e-5 * b.norm() for a, b in zip(ours, theirs, strict=True))
        assert any(a.abs().max() > 0 for a in ours)
        assert objective.metrics()["kl"] == pytest.approx(0.0, abs=1e-6)
    finally:
        trainer.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [{}, {"lora_rank": 4, "lora_alpha": 8, "num_iterations": 2, "normalize_advantages": True}],
    ids=["full", "lora-rounds-normalized"],
)
def test_a_graceful_stop_then_a_restart_ends_bitwise_equal(tmp_path, rloo_world, train_yaml, trainer_env, case):
    """SIGTERM mid-run: an emergency checkpoint (inside a generation round, with num_iterations 2, when the stop falls
    there), and the resumed run ends on the weights of an uninterrupted one; it reports RLOO's KL and the rewards."""
    keys = {"max_steps": 16, "ckpt_interval": 50, "num_workers": 1, "max_lr": 1e-2, **case}
    finals = {}
    for name in ("whole", "stopped"):
        ckpt_dir = tmp_path / name
        path = _yaml(train_yaml, tmp_path / f"{name}.yaml", rloo_world, ckpt_dir=str(ckpt_dir), **keys)
        command = [*TRAINER, "--config", str(path)]
        if name == "whole":
            run_to_end(command, trainer_env, tmp_path / "whole.log")
        else:
            run = Run(command, trainer_env, tmp_path / "run.log")
            stop_gracefully(run, lambda ckpt_dir=ckpt_dir: metrics_step(ckpt_dir) >= 4, timeout=30)
            latest = latest_complete_checkpoint(ckpt_dir)
            assert latest.meta.reason == "emergency" and 4 <= latest.step < 16, run.output()
            assert latest.meta.train_type == "online_rloo"
            rerun = run_to_end(command, trainer_env, tmp_path / "rerun.log")
            assert f"resumed from {latest.path}" in rerun.output()
        finals[name] = final_weights(ckpt_dir, 16)
    assert finals["stopped"] == finals["whole"]
    records = [json.loads(line) for line in (tmp_path / "whole" / METRICS_FILE).read_text().splitlines()]
    sampled = [record for record in records if "reward" in record]  # a round's first step (num_iterations)
    assert len(sampled) == 16 // keys.get("num_iterations", 1)
    assert sampled[0]["kl"] == pytest.approx(0.0, abs=1e-6) and sampled[-1]["kl"] != 0.0
    for key in ("reward", "reward_first_code", "frac_reward_zero_std", "clip_ratio_region", "entropy"):
        assert math.isfinite(sampled[-1][key]), (key, sampled[-1])


def test_settings_out_of_range_are_refused_naming_the_key(tmp_path, rloo_world, train_yaml):
    path = _yaml(train_yaml, tmp_path / "t.yaml", rloo_world)
    for overrides, message in (
        ({"rloo_beta": "-1"}, "training.rloo_beta: expected a number >= 0 (0 = no KL penalty), got -1.0"),
        ({"num_generations": "1"}, "training.num_generations: expected an integer >= 2 with train_type online_rloo"),
        ({"grpo_epsilon": "1.5"}, "training.grpo_epsilon: expected a number in [0, 1), got 1.5"),
        ({"normalize_advantages": "maybe"}, "training.normalize_advantages (--normalize_advantages): expected"),
        ({"rewards": "[]"}, "training.rewards: training.train_type online_rloo scores completions"),
    ):
        with pytest.raises(ConfigError) as raised:
            load_trainer_config(path, list(overrides.items()))
        assert any(message in line for line in raised.value.messages), raised.value.messages


def test_dry_run_describes_rloo_and_names_the_keys_it_does_not_use(tmp_path, rloo_world, train_yaml, capsys):
    path = _yaml(train_yaml, tmp_path / "t.yaml", rloo_world, ckpt_dir=str(tmp_path / "ckpt"), grpo_loss="grpo")
    config = load_trainer_config(path, [("rloo_beta", "0.1"), ("normalize_advantages", "true")])
    assert dry_run(config) == 0
    out = capsys.readouterr().out
    assert "sampling: 4 completions per prompt of at most 6 tokens" in out
    assert (
        "online_rloo: leave-one-out baseline, epsilon 0.2/0.2, beta 0.1 (a KL penalty on the rewards), "
        "normalize_advantages true, num_iterations 1" in out
    )
    assert "note: train_type online_rloo does not use training.grpo_loss; it is left as set" in out
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow
def test_preflight_counts_the_prompts_and_the_generation_caches(tmp_path, tiny_model, rloo_world):
    config = tmp_path / "train.yaml"
    runtime = {"job_name": "j", "gpu": {"devices": "none"}, "container": {"cuda_tag": "cpu"}}
    runtime["paths"] = {"data": str(rloo_world / "data"), "model": str(tiny_model)}
    training = {"train_type": "online_rloo", "rewards": ["astrai.rewards:exact_answer"], "batch_per_device": 2}
    config.write_text(yaml.safe_dump({"runtime": runtime, "training": training}), encoding="utf-8")
    result = invoke("preflight", "--config", str(config), check=False)
    line = next(line for line in result.stdout.splitlines() if "data fits model" in line)
    assert line.startswith("✓") and "24 training prompts" in line, result.stdout
    state = next(line for line in result.stdout.splitlines() if "training state" in line)
    assert "generation's key/value caches" in state and "(16 rows of a round" in state, state
