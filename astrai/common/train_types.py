"""The train types: each ``training.train_type`` is one entry here, saying everything the torch-free side needs of it.

An entry names the kind of data folder it trains on (``prepare --kind``), the unit a batch counts and how many rows
of ``window_size`` tokens a unit takes, whether it samples completions with the policy (online) or learns from
rewards at all, the training keys that are its own (and the named set of settings it builds of them), and the limits
it puts on the shared ones. The config, the run plan, preflight and `--dry-run` read these entries; the trainer's side
of each type (its records, its dataset and its objective) is an entry of ``TRAINER_TYPES`` in
:mod:`astrai.trainer.run.build` under the same name. Adding an algorithm is one entry here, one there, and its
objective's module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from astrai.common.agents import AGENT_KEYS
from astrai.common.settings import MIN_TEMPERATURE, KTOSettings, RewardModelSettings, RLOOSettings, TypeSettings

Problem = tuple[str, object, str]
"""A setting a train type refuses: (the training key, its value, what the type allows)."""

SAMPLING_KEYS = ("rewards", "reward_timeout", "max_completion_length", "temperature", "top_p", "top_k", *AGENT_KEYS)
"""What every online type samples and scores with (its completions may be episodes: astrai.common.agents)."""
GRPO_KEYS = ("grpo_epsilon", "grpo_epsilon_high", "grpo_beta", "grpo_loss", "scale_rewards", "num_iterations")
"""GRPO's own settings (astrai.common.settings.GRPOSettings)."""
RLOO_KEYS = ("grpo_epsilon", "grpo_epsilon_high", "num_iterations", "rloo_beta", "normalize_advantages")
"""RLOO's own settings (astrai.common.settings.RLOOSettings): GRPO's clip and rounds, its KL penalty, normalising."""


@dataclass(frozen=True)
class TrainType:
    """One ``training.train_type``."""

    name: str
    data_kind: str
    """The kind of data folder it trains on (``python -m astrai.data prepare --kind``)."""
    unit: str
    """What a batch counts: sequences, pairs, prompts, examples."""
    trains_on: str
    """What preflight says it trains on (``{window}``: data.window_size)."""
    rows_per_unit: int = 1
    """Rows of window_size tokens a unit takes in a step (DPO: the chosen and the rejected sequence)."""
    online: bool = False
    """It samples completions of prompts with the policy and scores them with training.rewards."""
    learns_from_rewards: bool = False
    """No validation loss to hold data out for; checkpoints record its keys, and a resume names each change."""
    keys: tuple[str, ...] = ()
    """The training keys it uses that some other type does not."""
    generations: int | None = None
    """Completions it samples per prompt, when the type fixes it (online_dpo: 2); None: training.num_generations."""
    min_generations: int = 1
    """The least num_generations it learns from (a group's baseline needs another completion)."""
    settings: Callable[[object], TypeSettings] | None = None
    """Its own named set of settings, built from the training section (GRPO's: astrai.common.settings.GRPOSettings):
    the config checks them by building them, the run plan holds them and --dry-run prints them."""
    mixtures: bool = False
    """Its data may be a mixture of folders (data.sources)."""
    reference: bool = False
    """It always scores against a frozen reference model (ckpt.reference_path, or the base model), which preflight
    checks."""
    checks: tuple[Callable[[object], Problem | None], ...] = ()
    """Its limits on the shared keys: each takes the training section and returns what it refuses, or None."""

    def completions_per_prompt(self, training) -> int | None:
        """Completions each prompt gets in a step (online types), else None."""
        if not self.online:
            return None
        return self.generations or training.num_generations

    def own_settings(self, training) -> TypeSettings | None:
        """Its own settings of ``training`` (SettingError for one out of range), or None for a type without."""
        return None if self.settings is None else self.settings(training)

    def problems(self, training) -> list[Problem]:
        """Every setting of ``training`` this type refuses, in the order its checks go."""
        found = []
        if self.online and training.temperature < MIN_TEMPERATURE:
            allowed = f"a number >= {MIN_TEMPERATURE:g} with train_type {self.name} (greedy sampling, 0, gives every "
            found.append(("temperature", training.temperature, allowed + "completion of a prompt the same tokens)"))
        if training.num_generations < self.min_generations:
            found.append(
                (
                    "num_generations",
                    training.num_generations,
                    f"an integer >= {self.min_generations} with train_type {self.name} (a group's advantages are each "
                    "completion's reward against the others')",
                )
            )
        found += [problem for check in self.checks if (problem := check(training)) is not None]
        return found

    def recorded_settings(self, training) -> dict | None:
        """What checkpoints record of a reward-learning type's settings (None for the others), in plain JSON."""
        if not self.learns_from_rewards:
            return None
        values = {key: getattr(training, key) for key in self.keys}
        if "rewards" in values:
            values["rewards"] = [f"{spec.where} x{spec.weight:g}" for spec in training.rewards]
        if "environment" in values:
            values["environment"] = None if training.environment is None else training.environment.describe()
        if "tools" in values:
            values["tools"] = list(training.tools)
        return values


def _grpo_settings(training) -> TypeSettings:
    return training.grpo()


def _rloo_settings(training) -> TypeSettings:
    return RLOOSettings(
        epsilon=training.grpo_epsilon,
        epsilon_high=training.grpo_epsilon_high,
        beta=training.rloo_beta,
        normalize_advantages=training.normalize_advantages,
        num_iterations=training.num_iterations,
    )


def _kto_settings(training) -> TypeSettings:
    return KTOSettings(training.kto_beta, training.kto_desirable_weight, training.kto_undesirable_weight)


def _reward_model_settings(training) -> TypeSettings:
    return RewardModelSettings(training.center_rewards_coefficient)


def _whole_model(training) -> Problem | None:
    if training.lora_rank:
        return (
            "lora_rank",
            training.lora_rank,
            "0 with reward_model (its score head is a new layer that trains whole; train the reward model without "
            "adapters)",
        )
    return None


def _mismatched_pairs(training) -> Problem | None:
    if training.batch_per_device < 2:
        return (
            "batch_per_device",
            training.batch_per_device,
            "an integer >= 2 with kto (an example's KL partner is another completion of its micro-batch; alone, the "
            "KL estimate would be its own reward)",
        )
    return None


def _one_iteration(training) -> Problem | None:
    if training.num_iterations != 1:
        return ("num_iterations", training.num_iterations, "1 with online_dpo (each step ranks new completions)")
    return None


def _ranks_cut_completions(training) -> Problem | None:
    if training.mask_truncated_completions:
        return (
            "mask_truncated_completions",
            training.mask_truncated_completions,
            "false with online_dpo (a pair is ranked by its completions' rewards, cut or not)",
        )
    return None


SEQ = TrainType("seq", "seq", "sequences", "windows of {window}+1 tokens", mixtures=True)
SFT = TrainType("sft", "sft", "sequences", "packed windows of {window}")
DPO = TrainType("dpo", "dpo", "pairs", "pairs", rows_per_unit=2, keys=("dpo_beta", "dpo_reference"), reference=True)
GRPO = TrainType(
    "grpo",
    "grpo",
    "prompts",
    "prompts with their scored completions",
    learns_from_rewards=True,
    keys=GRPO_KEYS,
    settings=_grpo_settings,
)
ONLINE_GRPO = TrainType(
    "online_grpo",
    "prompts",
    "prompts",
    "prompts",
    online=True,
    learns_from_rewards=True,
    keys=(*SAMPLING_KEYS, "num_generations", "mask_truncated_completions", *GRPO_KEYS),
    min_generations=2,
    settings=_grpo_settings,
)
ONLINE_DPO = TrainType(
    "online_dpo",
    "prompts",
    "prompts",
    "prompts",
    online=True,
    learns_from_rewards=True,
    keys=(*SAMPLING_KEYS, "dpo_beta"),
    generations=2,
    checks=(_one_iteration, _ranks_cut_completions),
)

ONLINE_RLOO = TrainType(
    "online_rloo",
    "prompts",
    "prompts",
    "prompts",
    online=True,
    learns_from_rewards=True,
    keys=(*SAMPLING_KEYS, "num_generations", "mask_truncated_completions", *RLOO_KEYS),
    min_generations=2,
    settings=_rloo_settings,
)

KTO = TrainType(
    "kto",
    "kto",
    "examples",
    "examples",
    keys=("kto_beta", "kto_desirable_weight", "kto_undesirable_weight"),
    reference=True,
    settings=_kto_settings,
    checks=(_mismatched_pairs,),
)

REWARD_MODEL = TrainType(
    "reward_model",
    "dpo",
    "pairs",
    "pairs",
    rows_per_unit=2,
    keys=("center_rewards_coefficient",),
    settings=_reward_model_settings,
    checks=(_whole_model,),
)

TRAIN_TYPES: dict[str, TrainType] = {
    entry.name: entry for entry in (SEQ, SFT, DPO, GRPO, ONLINE_GRPO, ONLINE_DPO, ONLINE_RLOO, KTO, REWARD_MODEL)
}
"""Every train type, by name, in the order the docs list them."""
TYPE_KEYS = sorted({key for entry in TRAIN_TYPES.values() for key in entry.keys})
"""The training keys that only some train types use."""


def train_type(name: str) -> TrainType:
    """The entry of ``name``; ValueError naming the ones there are."""
    entry = TRAIN_TYPES.get(name)
    if entry is None:
        raise ValueError(f"train_type {name!r} is not one of {' | '.join(TRAIN_TYPES)}")
    return entry
