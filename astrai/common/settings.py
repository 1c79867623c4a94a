"""The named sets of settings the trainer's parts take, each with its one owner: the checks and defaults live here.

The config (:mod:`astrai.common.config`) validates ``training.*`` by building these, so a rule is written once:
a setting out of range raises :class:`SettingError` naming the setting, which the config reports as
``training.<key>`` and ``python -m astrai.model generate`` as ``--<key>``. Torch-free: preflight builds them too.

- :class:`LoRASettings`: low-rank adapters (``training.lora_*``).
- :class:`Sampling`: how a completion's next token is chosen (``training.temperature``, ``top_k``, ``top_p``,
  ``max_completion_length``; ``generate``'s options of the same names).
- :class:`GRPOSettings`: GRPO's clip, KL weight, loss averaging and reward scaling (``training.grpo_*``,
  ``scale_rewards``, ``num_iterations``). Its defaults are TRL's ``GRPOConfig``'s.
- :class:`RLOOSettings`: RLOO's clip (GRPO's keys), its KL penalty on the rewards and the advantages' normalisation
  (``training.rloo_beta``, ``normalize_advantages``). Its defaults are TRL's ``RLOOConfig``'s.
- :class:`KTOSettings`: KTO's beta and the weights of its desirable and undesirable examples (``training.kto_*``).
  Its defaults are TRL's ``KTOConfig``'s.
- :class:`RewardModelSettings`: the Bradley–Terry reward model's centring term (``training.center_rewards_coefficient``,
  TRL's ``RewardConfig``'s).
- :class:`EvalSettings`: generative evaluation in the loop (``log.eval_*``): the prompts, k completions of each, how
  they are sampled (greedy by default) and the score that passes.

A train type's own set (GRPO's, RLOO's, KTO's) is a :class:`TypeSettings`: its train type's entry builds it from the
training section (:mod:`astrai.common.train_types`), the run plan holds it, and ``--dry-run`` prints what it says of
itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from astrai.common.model_folder import ADAPTER_TARGETS

MIN_TEMPERATURE = 1e-3
"""Below it the scaled logits overflow float32; 0 is greedy."""
GRPO_LOSSES = ("grpo", "dr_grpo", "dapo")
"""How GRPO's token losses are averaged, as TRL names them."""
SCALE_REWARDS = ("group", "batch", "none")
"""What GRPO divides each advantage by: its group's reward std, the step's, or nothing."""


class SettingError(ValueError):
    """A setting out of range: ``key`` names it, ``expected`` says what is allowed."""

    def __init__(self, key: str, expected: str, value):
        super().__init__(f"{key}: expected {expected}, got {value!r}")
        self.key, self.expected, self.value = key, expected, value

    def under(self, prefix: str, names: dict[str, str] | None = None) -> str:
        """The message with the key as its caller names it (``training.`` + the config's key, ``--`` + an option)."""
        return f"{prefix}{(names or {}).get(self.key, self.key)}: expected {self.expected}, got {self.value!r}"


def _check(ok: bool, key: str, value, expected: str) -> None:
    if not ok:
        raise SettingError(key, expected, value)


class TypeSettings(Protocol):
    """A train type's own settings, checked when built (:class:`SettingError`)."""

    def describe(self) -> str:
        """What they are, in a line of the run plan (``--dry-run``) after the train type's name."""


@dataclass(frozen=True)
class LoRASettings:
    """Rank-``rank`` adapters on the ``targets`` layers of every block, their update scaled by alpha / rank."""

    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = ADAPTER_TARGETS

    def __post_init__(self) -> None:
        _check(self.rank >= 1, "lora_rank", self.rank, "an integer at least 1 to add adapters (0 = full fine-tuning)")
        _check(self.alpha > 0, "lora_alpha", self.alpha, "a number > 0")
        _check(0 <= self.dropout < 1, "lora_dropout", self.dropout, "a number in [0, 1)")
        unknown = [name for name in self.targets if name not in ADAPTER_TARGETS]
        _check(
            bool(self.targets) and not unknown,
            "lora_targets",
            unknown or list(self.targets),
            f"a non-empty list of {', '.join(ADAPTER_TARGETS)}",
        )
        _check(len(set(self.targets)) == len(self.targets), "lora_targets", list(self.targets), "each module once")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def identity(self) -> tuple[int, float, tuple[str, ...]]:
        """What makes two runs' adapters the same shape and scale: rank, alpha and the targets (in any order)."""
        return self.rank, float(self.alpha), tuple(sorted(self.targets))

    @classmethod
    def of(cls, training) -> LoRASettings | None:
        """The settings of a config's training section; None for full fine-tuning (lora_rank 0)."""
        if not training.lora_rank:
            return None
        return cls(training.lora_rank, training.lora_alpha, training.lora_dropout, tuple(training.lora_targets))

    def record(self, base_path: str, base_sha256: str, base_dtype: str = "float32") -> dict:
        """What meta.json records of a LoRA run: these settings and the base model the adapters belong to (and the
        dtype its frozen weights were held in)."""
        return {
            "rank": self.rank,
            "alpha": self.alpha,
            "dropout": self.dropout,
            "targets": list(self.targets),
            "base": {"path": base_path, "sha256": base_sha256},
            "base_dtype": base_dtype,
        }

    def describe(self) -> str:
        return f"rank {self.rank}, alpha {self.alpha:g}, dropout {self.dropout:g} on {', '.join(self.targets)}"


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen; the defaults are greedy decoding."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    """0 picks the most likely token; above 0 the logits are divided by it and a token drawn."""
    top_k: int = 0
    """Draw among the k most likely tokens only; 0 = all."""
    top_p: float = 1.0
    """Draw among the smallest set of most likely tokens whose probability reaches top_p; 1 = all."""

    CONFIG_KEYS = {"max_new_tokens": "max_completion_length"}
    """The config's name of a setting where it differs (``training.max_completion_length``)."""

    def __post_init__(self) -> None:
        _check(self.max_new_tokens >= 1, "max_new_tokens", self.max_new_tokens, "an integer >= 1")
        _check(
            self.temperature == 0 or MIN_TEMPERATURE <= self.temperature < math.inf,
            "temperature",
            self.temperature,
            f"0 (greedy) or a number >= {MIN_TEMPERATURE:g}",
        )
        _check(self.top_k >= 0, "top_k", self.top_k, "an integer >= 0 (0 = every token)")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "a number in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class GRPOSettings:
    """GRPO's step (:mod:`astrai.trainer.objectives.grpo`): the defaults are TRL's ``GRPOConfig``'s."""

    epsilon: float = 0.2
    """Clip of the probability ratio below 1 (and above, unless epsilon_high is given)."""
    epsilon_high: float | None = None
    """Clip above 1 (DAPO's clip-higher); None = epsilon."""
    beta: float = 0.0
    """Weight of the KL penalty against the frozen starting model; 0 computes no reference at all."""
    loss: str = "dapo"
    """How token losses are averaged: grpo (per completion, then over completions), dr_grpo (summed, over
    completions x max_completion_length) or dapo (over every token of the step's batch)."""
    scale_rewards: str = "group"
    """Divide each advantage by the std of its group's rewards (group), of the step's (batch), or not (none)."""
    max_completion_length: int = 256
    """dr_grpo's constant denominator (with the number of completions)."""
    num_iterations: int = 1
    """Optimizer steps on each generation round's completions (TRL's mu)."""

    def __post_init__(self) -> None:
        _check(self.loss in GRPO_LOSSES, "grpo_loss", self.loss, " | ".join(GRPO_LOSSES))
        _check(self.scale_rewards in SCALE_REWARDS, "scale_rewards", self.scale_rewards, " | ".join(SCALE_REWARDS))
        _check_clip(self.epsilon, self.epsilon_high, self.num_iterations)
        _check(self.beta >= 0, "grpo_beta", self.beta, "a number >= 0 (0 = no KL penalty)")
        _check(self.max_completion_length >= 1, "max_completion_length", self.max_completion_length, "an integer >= 1")

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def describe(self) -> str:
        return (
            f"loss {self.loss}, epsilon {self.epsilon:g}/{self.high:g}, beta {self.beta:g}, scale_rewards "
            f"{self.scale_rewards}, num_iterations {self.num_iterations}"
        )


def _check_clip(epsilon: float, epsilon_high: float | None, num_iterations: int) -> None:
    """The clipped ratio's keys, which GRPO and RLOO share (``training.grpo_epsilon``, ...)."""
    _check(0 <= epsilon < 1, "grpo_epsilon", epsilon, "a number in [0, 1)")
    _check(
        epsilon_high is None or epsilon_high >= 0,
        "grpo_epsilon_high",
        epsilon_high,
        "a number >= 0, or null for grpo_epsilon",
    )
    _check(num_iterations >= 1, "num_iterations", num_iterations, "an integer >= 1")


@dataclass(frozen=True)
class RLOOSettings:
    """RLOO's step (:mod:`astrai.trainer.objectives.rloo`): the defaults are TRL's ``RLOOConfig``'s."""

    epsilon: float = 0.2
    """Clip of the sequence's probability ratio below 1 (and above, unless epsilon_high is given): grpo_epsilon."""
    epsilon_high: float | None = None
    """Clip above 1; None = epsilon: grpo_epsilon_high."""
    beta: float = 0.05
    """Weight of the KL penalty taken off each completion's reward (first order, summed over its tokens) against the
    frozen starting model; 0 computes no reference at all."""
    normalize_advantages: bool = False
    """Take the step's mean off the advantages and divide them by their std."""
    num_iterations: int = 1
    """Optimizer steps on each generation round's completions (TRL's mu)."""

    def __post_init__(self) -> None:
        _check_clip(self.epsilon, self.epsilon_high, self.num_iterations)
        _check(self.beta >= 0, "rloo_beta", self.beta, "a number >= 0 (0 = no KL penalty)")

    @property
    def high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def describe(self) -> str:
        normalized = "true" if self.normalize_advantages else "false"
        return (
            f"leave-one-out baseline, epsilon {self.epsilon:g}/{self.high:g}, beta {self.beta:g} (a KL penalty on the "
            f"rewards), normalize_advantages {normalized}, num_iterations {self.num_iterations}"
        )


@dataclass(frozen=True)
class KTOSettings:
    """KTO's loss (:mod:`astrai.trainer.objectives.kto`, TRL's ``loss_type: kto``): the defaults are TRL's
    ``KTOConfig``'s."""

    beta: float = 0.1
    """How far from the reference model the policy may move (higher: closer)."""
    desirable_weight: float = 1.0
    """The weight of a desirable example's loss."""
    undesirable_weight: float = 1.0
    """The weight of an undesirable example's loss."""

    def __post_init__(self) -> None:
        _check(self.beta > 0, "kto_beta", self.beta, "a number > 0")
        for key, value in (
            ("kto_desirable_weight", self.desirable_weight),
            ("kto_undesirable_weight", self.undesirable_weight),
        ):
            _check(0 < value < math.inf, key, value, "a number > 0")

    def describe(self) -> str:
        return (
            f"beta {self.beta:g}, desirable_weight {self.desirable_weight:g}, undesirable_weight "
            f"{self.undesirable_weight:g}; the KL estimate from each micro-batch's mismatched pairs"
        )


@dataclass(frozen=True)
class RewardModelSettings:
    """``reward_model``'s loss (:mod:`astrai.trainer.objectives.reward_model`): TRL's ``RewardConfig``'s default."""

    center_rewards_coefficient: float | None = None
    """The weight of ``(r_c + r_r) ** 2`` in each pair's loss, which keeps the rewards centred on 0; None: none."""

    def __post_init__(self) -> None:
        coefficient = self.center_rewards_coefficient
        _check(
            coefficient is None or 0 <= coefficient < math.inf,
            "center_rewards_coefficient",
            coefficient,
            "a number >= 0, or null for no centring term",
        )

    def describe(self) -> str:
        center = self.center_rewards_coefficient
        term = "no centring term" if center is None else f"center_rewards_coefficient {center:g}"
        return f"Bradley-Terry loss on each pair's rewards (the score head at the last token), {term}"


@dataclass(frozen=True)
class EvalSettings:
    """Generative evaluation in the loop (:mod:`astrai.trainer.run.evaluation`): every ``interval`` steps (and at step 0
    with ``at_start``) the model completes each prompt of ``prompts`` ``generations`` times, sampled as ``sampling``
    says, and the rewards score them."""

    prompts: str
    """The prompts data folder (``prepare --kind prompts``), as the trainer reads it."""
    interval: int
    generations: int = 1
    """k: completions of each prompt; pass@k counts a prompt with at least one that passes."""
    sampling: Sampling = Sampling()
    pass_threshold: float = 1.0
    """The total reward at which a completion passes."""
    at_start: bool = False
    """Evaluate the starting model too (step 0): the baseline."""
    batch: int = 8
    """Prompts a rank completes at once: the ranks take batches of this size in turn, the same at any world size."""

    CONFIG_KEYS = {
        "max_new_tokens": "eval_max_completion_length",
        "temperature": "eval_temperature",
        "top_k": "eval_top_k",
        "top_p": "eval_top_p",
    }
    """The config's names of the sampling settings (``log.eval_temperature``, ...)."""

    def __post_init__(self) -> None:
        _check(self.generations >= 1, "eval_generations", self.generations, "an integer >= 1")
        _check(
            self.generations == 1 or not self.sampling.greedy,
            "eval_generations",
            self.generations,
            "1 with eval_temperature 0 (greedy decoding gives every completion of a prompt the same tokens; set "
            "log.eval_temperature above 0 for pass@k over k > 1 samples)",
        )
        _check(math.isfinite(self.pass_threshold), "eval_pass_threshold", self.pass_threshold, "a finite number")
        _check(self.batch >= 1, "eval_batch_size", self.batch, "an integer >= 1")

    def describe(self, rewards: list[str]) -> str:
        how = (
            "greedy"
            if self.sampling.greedy
            else (
                f"temperature {self.sampling.temperature:g}, top_k {self.sampling.top_k}, top_p {self.sampling.top_p:g}"
            )
        )
        start = " and at the start" if self.at_start else ""
        return (
            f"every {self.interval} steps{start}: {self.generations} completion(s) of each prompt of {self.prompts} "
            f"({how}, at most {self.sampling.max_new_tokens} tokens, {self.batch} prompts at a time), scored by "
            f"{', '.join(rewards)}; pass@k: a total reward >= {self.pass_threshold:g}"
        )
