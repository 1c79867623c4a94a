"""GRPO's advantages and loss against TRL's own code on the same tensors (TRL is a test-only reference)."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from astrai.common.settings import GRPOSettings
from astrai.trainer.objectives.grpo import advantages, grpo_loss

trl = pytest.importorskip("trl")
from trl.trainer.grpo_trainer import GRPOTrainer  # noqa: E402
from trl.trainer.utils import nanstd  # noqa: E402

B, T, G = 6, 7, 3  # 2 prompts x 3 generations, completions of up to 7 tokens


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 3, 5, 1, 6, 7])
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
    old = -torch.rand(B, T, generator=generator) * 3
    return {
        "mask": mask,
        "old": old,
        # Near the old ones, and some far enough from them to be clipped either way.
        "logps": old + 0.4 * torch.randn(B, T, generator=generator),
        "ref": old + 0.2 * torch.randn(B, T, generator=generator),
        "advantages": torch.randn(B, generator=generator),
    }


def _trl_loss(settings: GRPOSettings, tensors: dict, logps: torch.Tensor) -> torch.Tensor:
    """TRL's GRPOTrainer._compute_loss on these log-probabilities, through a stand-in for the trainer's state."""
    accelerator = SimpleNamespace(
        num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x, gather_for_metrics=lambda x: x
    )
    trainer = SimpleNamespace(
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=settings.beta,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        loss_type=settings.loss,
        epsilon_low=settings.epsilon,
        epsilon_high=settings.high,
        use_vllm=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=settings.max_completion_length,
        accelerator=accelerator,
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logps, torch.zeros_like(logps), None),
    )
    mask = tensors["mask"]
    inputs = {
        "prompt_ids": torch.zeros(B, 2, dtype=torch.long),
        "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": tensors["advantages"],
        "old_per_token_logps": tensors["old"],
        "ref_per_token_logps": tensors["ref"],
        "num_items_in_batch": mask.sum(),
    }
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    return loss, trainer._metrics["train"]


@pytest.mark.parametrize(
    "settings",
    [
        GRPOSettings(loss="grpo"),
        GRPOSettings(loss="dr_grpo", max_completion_length=T),
        GRPOSettings(loss="dapo", epsilon=0.2, epsilon_high=0.28),
        GRPOSettings(beta=0.04),
        GRPOSettings(loss="dapo", beta=0.1, epsilon=0.1, epsilon_high=0.3),
        GRPOSettings(loss="dr_grpo", beta=0.04, epsilon=0.3, max_completion_length=16),
    ],
    ids=lambda s: f"{s.loss}-eps{s.epsilon}-{s.high}-beta{s.beta}",
)
def test_the_loss_and_its_gradient_are_trls(settings):
    tensors = _tensors()
    ours_logps = tensors["logps"].clone().requires_grad_(True)
    theirs_logps = tensors["logps"].clone().requires_grad_(True)
    ref = tensors["ref"] if settings.beta else None
    ours, stats = grpo_loss(ours_logps, tensors["old"], ref, tensors["advantages"], tensors["mask"], settings)
    theirs, metrics = _trl_loss(settings, tensors, theirs_logps)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours_logps.grad, theirs_logps.grad, rtol=1e-6, atol=1e-9)
    assert stats.clip_low == pytest.approx(metrics["clip_ratio/low_mean"][0], rel=1e-6)
    assert stats.clip_high == pytest.approx(metrics["clip_ratio/high_mean"][0], rel=1e-6)
    assert stats.clip_region == pytest.approx(metrics["clip_ratio/region_mean"][0], rel=1e-6)
    assert 0 < stats.clip_region < 1  # the tensors do exercise the clipping
    if settings.beta:
        assert stats.kl == pytest.approx(metrics["kl"][0], rel=1e-6)


def _trl_advantages(rewards: torch.Tensor, scale: str) -> torch.Tensor:
    """TRL's sum_then_normalize advantages (GRPOTrainer._generate_and_score_completions), step by step."""
    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards)
    else:
        std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G)
    advantage = rewards - mean
    if scale != "none":
        advantage = advantage / (std + 1e-4)
    return torch.nan_to_num(advantage, nan=0.0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_trls_with_unscored_completions_left_out(scale):
    totals = [1.0, 0.0, 0.5, 2.0, None, 2.0, 0.25, 0.25, 0.25]
    ours, zero_std = advantages(totals, G, scale)
    rewards = torch.tensor([float("nan") if t is None else t for t in totals])
    torch.testing.assert_close(ours, _trl_advantages(rewards, scale), rtol=1e-6, atol=1e-7)
    assert ours[4] == 0  # no function scored it: no signal either way
    if scale != "batch":
        assert zero_std.tolist() == [False] * 3 + [True] * 3 + [True] * 3  # {2, 2}, and three equal rewards
    with pytest.raises(ValueError, match="9 completions do not make groups of 2"):
        advantages(totals, 2, scale)


def test_settings_it_cannot_take_name_the_key():
    for bad, key in (({"loss": "ppo"}, "grpo_loss"), ({"scale_rewards": "max"}, "scale_rewards")):
        with pytest.raises(ValueError, match=key):
            GRPOSettings(**bad)
    with pytest.raises(ValueError, match="grpo_epsilon"):
        GRPOSettings(epsilon=1.5)
    with pytest.raises(ValueError, match="grpo_beta"):
        GRPOSettings(beta=-0.1)


def test_completion_log_probabilities_of_a_padded_batch_are_each_rows_own():
    from astrai.trainer.models.native import Transformer
    from astrai.trainer.models.weights import PRESETS
    from astrai.trainer.objectives.rollouts import completion_logps

    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"])
    prompts, completions = [[5, 6, 7], [9], [1, 2, 3, 4, 5]], [[8, 9], [10, 11, 12, 13], [6]]
    logps, mask, entropy = completion_logps(model, prompts, completions)
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        alone = model(torch.tensor([prompt + completion]))[0].log_softmax(-1)
        for index, token in enumerate(completion):
            position = len(prompt) - 1 + index
            torch.testing.assert_close(logps[row, index], alone[position, token], rtol=1e-5, atol=1e-6)
            expected_entropy = -(alone[position].exp() * alone[position]).sum()
            torch.testing.assert_close(entropy[row, index], expected_entropy, rtol=1e-5, atol=1e-6)
    assert (logps[mask == 0] == 0).all() and logps.requires_grad
    logps.sum().backward()
    assert model.tok_embeddings.weight.grad is not None


def test_the_defaults_are_trls_in_one_place():
    """GRPOSettings owns GRPO's defaults (the config's training keys take theirs from it), and they are TRL's."""
    import dataclasses

    from astrai.common.config import TrainingSection

    theirs = {field.name: field.default for field in dataclasses.fields(trl.GRPOConfig)}
    ours = GRPOSettings()
    assert (ours.loss, ours.scale_rewards, ours.epsilon, ours.epsilon_high, ours.beta, ours.num_iterations) == (
        theirs["loss_type"],
        theirs["scale_rewards"],
        theirs["epsilon"],
        theirs["epsilon_high"],
        theirs["beta"],
        theirs["num_iterations"],
    )
    assert TrainingSection().grpo() == ours
