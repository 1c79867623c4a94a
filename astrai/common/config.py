"""The trainer's configuration: the model/data/parallel/training/ckpt/log sections of train.yaml.

Every key is unique across sections, so the command line can name it flat:
``--max_steps 300`` overrides ``training.max_steps``. Explicit arguments beat
YAML values. The ``runtime:`` section belongs to the host and is ignored here;
any other unknown section or key is an error with a close-match hint.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import posixpath
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from astrai.common.agents import EnvironmentSpec, EpisodeSettings, parse_environment, parse_tools
from astrai.common.backends import BACKENDS
from astrai.common.configfile import ConfigError, load_yaml, show_value, unknown
from astrai.common.contract import (
    CKPT_FORMAT_SHARDED,
    CKPT_FORMATS,
    CONTAINER_DATA,
    CONTAINER_MODEL,
    PARALLEL_MODES,
    REPORT_TO,
    TRACKER_MLFLOW,
    TRACKER_NONE,
    TRACKER_PACKAGES,
    TRACKER_TENSORBOARD,
    TRACKER_WANDB,
    container_job_dir,
)
from astrai.common.model_folder import ADAPTER_TARGETS
from astrai.common.nf4 import NF4
from astrai.common.reward_specs import RewardSpec, check_eval_metric_names, parse_rewards
from astrai.common.safetensors_file import DTYPE_ALIASES
from astrai.common.settings import (
    EvalSettings,
    GRPOSettings,
    KTOSettings,
    LoRASettings,
    RewardModelSettings,
    RLOOSettings,
    Sampling,
    SettingError,
)
from astrai.common.train_types import TRAIN_TYPES, TYPE_KEYS, TrainType
from astrai.common.values import boolean_word

HOST_SECTION = "runtime"
"""The section the host reads (astrai/host/runtime.py); the trainer ignores it."""


COMPILE_CHOICES = ("auto", True, False)


@dataclass(frozen=True)
class ModelSection:
    activation_checkpointing: bool = False
    """Recompute each block's activations during backward: less memory for ~30% more compute."""
    backend: str = "auto"
    """Which code computes the model: native (the trainer's own families), transformers (any folder
    AutoModelForCausalLM loads, slower), or auto (the default): native for a family the trainer computes, else
    transformers (astrai/common/backends.py)."""
    compile: bool | str = "auto"
    """Compile each transformer block (and generation's decode step) with torch.compile: true, false, or auto (the
    default): on CUDA, not on a CPU (where it needs a C++ compiler and gains little). A compile that fails stops the
    run with an error naming this key."""

    def __post_init__(self) -> None:
        _check(self.compile in COMPILE_CHOICES, "model.compile", self.compile, "auto, true or false")
        _check(self.backend in BACKENDS, "model.backend", self.backend, " | ".join(BACKENDS))


@dataclass(frozen=True)
class DataSource:
    """One source of a mixture: a prepared data folder under data_root_path, and its weight."""

    path: str
    weight: float = 1.0


MAX_MIXTURE_RATIO = 1 << 16
"""A mixture's heaviest weight may be at most this many times its lightest (each source gets its share of
every block of that many windows)."""


@dataclass(frozen=True)
class DataSection:
    data_root_path: str = CONTAINER_DATA
    """Folder written by ``python -m astrai.data prepare`` (manifest.json + shards)."""
    window_size: int = 256
    """Tokens per training sequence; at most the model's max_seq_len."""
    num_workers: int = 1
    """DataLoader worker processes; one keeps reading off the training thread, 0 reads in the main process."""
    val_fraction: float = 0.0
    """Share of the windows held out for validation and never trained on (the last of every round(1/f)); 0 = none."""
    overlong: str = "truncate"
    """Post-training: a sequence longer than window_size is cut to it (truncate) or left out (drop)."""
    sources: tuple[DataSource, ...] | None = None
    """A weighted mixture: a list of {path, weight}, each path a prepared folder under data_root_path. Windows are
    drawn from each source in proportion to its weight; a source smaller than its share is repeated. null trains
    on data_root_path itself."""

    def __post_init__(self) -> None:
        if self.sources is not None:
            _check_sources(self.sources)
        _check(self.overlong in OVERLONG, "data.overlong", self.overlong, " | ".join(OVERLONG))
        _check(self.window_size >= 1, "data.window_size", self.window_size, "an integer >= 1")
        _check(self.num_workers >= 0, "data.num_workers", self.num_workers, "an integer >= 0")
        _check(0 <= self.val_fraction <= 0.5, "data.val_fraction", self.val_fraction, "a number in [0, 0.5]")


@dataclass(frozen=True)
class ParallelSection:
    parallel_mode: str = "none"
    """none (one process), ddp or fsdp (two or more processes under torchrun)."""

    def __post_init__(self) -> None:
        _check(
            self.parallel_mode in PARALLEL_MODES,
            "parallel.parallel_mode",
            self.parallel_mode,
            " | ".join(PARALLEL_MODES),
        )


def _check_sources(sources) -> None:
    if not sources:
        raise ConfigError("data.sources: expected a non-empty list of {path, weight}, or null for data_root_path")
    seen = set()
    for index, source in enumerate(sources):
        where = f"data.sources[{index}]"
        normal = posixpath.normpath(source.path) if source.path else ""
        if not normal or normal.startswith(("/", "..")) or normal == ".":
            raise ConfigError(
                f"{where}.path: expected a folder under data.data_root_path (like web or code/python), "
                f"got {_got(source.path)}"
            )
        if normal in seen:
            raise ConfigError(f"{where}.path: {normal!r} is listed twice")
        seen.add(normal)
        if not 0 < source.weight < math.inf:
            raise ConfigError(f"{where}.weight: expected a number > 0, got {_got(source.weight)}")
    weights = [source.weight for source in sources]
    if max(weights) / min(weights) > MAX_MIXTURE_RATIO:
        raise ConfigError(
            f"data.sources: the weights run from {min(weights):g} to {max(weights):g}, more than "
            f"{MAX_MIXTURE_RATIO}:1 apart; raise the smallest or leave that source out"
        )


def _sources(dotted: str, value, from_text: bool):
    """A mixture from YAML (a list of {path, weight}) or the command line (the same list in YAML flow style)."""
    if value is None:
        return None
    if from_text:
        if value.strip().lower() in ("null", "none", "~"):
            return None
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ConfigError(f"{dotted}: expected a list like '[{{path: web, weight: 3}}, {{path: code}}]'") from None
    if not isinstance(value, list):
        raise ConfigError(f"{dotted}: expected a list of {{path, weight}}, got {_got(value)}")
    parsed = []
    for index, entry in enumerate(value):
        if isinstance(entry, str):
            entry = {"path": entry}
        if not isinstance(entry, dict) or set(entry) - {"path", "weight"} or "path" not in entry:
            raise ConfigError(f"{dotted}[{index}]: expected {{path: FOLDER, weight: NUMBER}}, got {_got(entry)}")
        path = entry["path"]
        weight = _coerce(f"{dotted}[{index}].weight", entry.get("weight", 1.0), float, from_text=False)
        if not isinstance(path, str):
            raise ConfigError(f"{dotted}[{index}].path: expected a folder name, got {_got(path)}")
        parsed.append(DataSource(path, weight))
    return tuple(parsed)


EPISODE_LIMITS = ("max_turns", "max_tool_calls", "max_episode_tokens", "tool_timeout", "truncated_reward")
"""The training keys of astrai.common.agents.EpisodeSettings, in its fields' order."""
DEVICES = ("auto", "cpu", "cuda")
SCHEDULES = ("cosine", "wsd", "constant")
OPTIMIZERS = ("adamw", "muon")
OVERLONG = ("truncate", "drop")
DPO_REFERENCES = ("precomputed", "live")
LORA_BASE_DTYPES = ("auto", "float32", "bfloat16", NF4)


@dataclass(frozen=True)
class TrainingSection:
    max_steps: int = 1000
    """Optimizer steps of the whole run; the learning-rate schedule spans them."""
    batch_per_device: int = 8
    """Sequences per micro-batch on each process."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step; derived instead when global_batch_size is set."""
    global_batch_size: int | None = None
    """Sequences per optimizer step over all processes. When set, grad_accum_steps is derived as
    global_batch_size / (batch_per_device x world size), so a resume on another world size trains the same
    windows in every step; null uses grad_accum_steps as given."""
    train_type: str = "seq"
    """seq: next-token loss on every token (pre-training); sft: supervised fine-tuning on the assistant turns of
    chat data (or completions); dpo: direct preference optimisation on (prompt, chosen, rejected) pairs;
    grpo: GRPO on completions scored elsewhere, with their rewards (prepare --kind grpo); online_grpo: GRPO on
    completions the model samples for prompts, scored by training.rewards; online_dpo: DPO on two sampled
    completions of each prompt, the one the rewards score higher chosen; online_rloo: RLOO (each completion's reward
    against the mean of its group's others) on sampled completions; kto: KTO on unpaired examples, each a prompt and a
    completion labelled desirable or not (prepare --kind kto); reward_model: a Bradley-Terry reward model (a score
    head in place of the output projection) on DPO's pairs (prepare --kind dpo). The data folder must hold that kind
    (prepare --kind; prompts for the online types)."""
    dpo_beta: float = 0.1
    """DPO's beta (dpo, online_dpo): how far from the reference model the policy may move (higher: closer)."""
    kto_beta: float = KTOSettings.beta
    """KTO's beta (kto): how far from the reference model the policy may move (higher: closer)."""
    kto_desirable_weight: float = KTOSettings.desirable_weight
    """kto: the weight of a desirable example's loss (raise it when desirable examples are the fewer)."""
    kto_undesirable_weight: float = KTOSettings.undesirable_weight
    """kto: the weight of an undesirable example's loss."""
    dpo_reference: str = "precomputed"
    """precomputed: the reference scores every pair once, before the first step (kept in the job dir for
    resumes), and leaves memory; live: it stays loaded and scores each batch (a forward pass per step)."""
    rewards: tuple[RewardSpec, ...] = ()
    """online_grpo, online_rloo, online_dpo: the reward functions, each 'FILE.py:function' or 'module:function'
    (astrai.rewards:exact_answer), or {function: ..., weight: ...}; a completion's reward is their weighted sum.
    On the command line: the list in YAML flow style
    ('[astrai.rewards:exact_answer, {function: /data/r.py:short, weight: 0.2}]')."""
    num_generations: int = 8
    """online_grpo, online_rloo: completions sampled per prompt (a group; online_dpo samples two); batch_per_device
    counts prompts."""
    max_completion_length: int = GRPOSettings.max_completion_length
    """online_grpo: at most this many tokens per completion (with the prompt, at most the model's max_seq_len)."""
    mask_truncated_completions: bool = False
    """online_grpo, online_rloo: leave completions that reach max_completion_length without ending out of the loss."""
    temperature: float = 1.0
    """online_grpo: sampling temperature (0: greedy, which gives a group no spread)."""
    top_p: float = Sampling.top_p
    """online_grpo: sample among the most likely tokens reaching this probability (1: all)."""
    top_k: int = Sampling.top_k
    """online_grpo: sample among the k most likely tokens (0: all)."""
    grpo_epsilon: float = GRPOSettings.epsilon
    """online_grpo, online_rloo: clip the probability ratio to [1 - grpo_epsilon, 1 + grpo_epsilon_high] (online_rloo:
    the whole completion's)."""
    grpo_epsilon_high: float | None = GRPOSettings.epsilon_high
    """online_grpo, online_rloo: the upper clip (DAPO's clip-higher); null: grpo_epsilon."""
    grpo_beta: float = GRPOSettings.beta
    """online_grpo: weight of the KL penalty against the frozen starting model (0: none, and no reference kept)."""
    grpo_loss: str = GRPOSettings.loss
    """online_grpo: how token losses are averaged, as TRL names it: grpo (per completion, then over completions),
    dr_grpo (summed, over completions x max_completion_length) or dapo (over every token of the step's batch)."""
    reward_timeout: float = 300.0
    """online_grpo, online_dpo: seconds a reward function may take on one batch; past it, the run stops naming it.
    A stop asked for meanwhile does not wait for it: the step is given up, and the last one completed is saved."""
    num_iterations: int = GRPOSettings.num_iterations
    """online_grpo, grpo, online_rloo: optimizer steps on each generation round's completions (TRL's mu); the later
    ones take their probability ratio against the policy the completions were sampled from, and no new prompts."""
    scale_rewards: str = GRPOSettings.scale_rewards
    """online_grpo: divide each advantage by the std of its group's rewards (group), of the step's (batch), or
    not at all (none)."""
    rloo_beta: float = RLOOSettings.beta
    """online_rloo: weight of the KL penalty against the frozen starting model, taken off each completion's reward as
    the sum over its tokens of (log-probability when sampled - the starting model's), TRL's RLOO beta (0: none, and no
    reference kept)."""
    normalize_advantages: bool = RLOOSettings.normalize_advantages
    """online_rloo: take the step's mean off the advantages and divide them by their std."""
    tools: tuple[str, ...] = ()
    """online_grpo, online_rloo, online_dpo: Python functions the model may call in an episode, each 'FILE.py:function'
    or 'module:function'; their JSON schemas (from their signatures and docstrings) are rendered by the chat template
    (docs/agents.md). On the command line: the list in YAML flow style."""
    environment: EnvironmentSpec | None = None
    """online_grpo, online_rloo, online_dpo: the environment episodes run in: 'FILE.py:Class' or 'module:Class' (one
    instance per episode, reset(**fields), its public methods are tools, an optional reward()), or {server: NAME}, an
    OpenEnv-compatible server runtime.environments.NAME starts beside the trainer. null: tools alone, or no episodes."""
    max_turns: int = EpisodeSettings.max_turns
    """Episodes: assistant turns an episode may take; past it the episode ends as truncated."""
    max_tool_calls: int = EpisodeSettings.max_tool_calls
    """Episodes: tool calls an episode may make, over all its turns; past it the episode ends as truncated."""
    max_episode_tokens: int = EpisodeSettings.max_episode_tokens
    """Episodes: tokens after the prompt (assistant turns, tool and environment replies); with the prompt, within the
    model's context. Past it the episode ends as truncated."""
    tool_timeout: float = EpisodeSettings.tool_timeout
    """Episodes: seconds a tool call (an environment's reset, step or reward) may take; past it the call is answered
    with an error message, and the episode goes on."""
    truncated_reward: float | None = EpisodeSettings.truncated_reward
    """Episodes: the reward of an episode a limit ended (null: scored by the rewards like the others)."""
    center_rewards_coefficient: float | None = RewardModelSettings.center_rewards_coefficient
    """reward_model: the weight of (r_chosen + r_rejected) ** 2 in each pair's loss, which keeps the rewards centred on
    0 (TRL's; 0.01 is its suggestion); null: no such term."""
    optimizer: str = "adamw"
    """adamw, or muon: Muon for the 2-D weight matrices of the transformer blocks, AdamW for embeddings, norms,
    biases and the output head (not under FSDP, which shards the matrices Muon orthogonalises whole)."""
    lora_rank: int = 0
    """0 trains every weight (full fine-tuning); r >= 1 freezes the model and trains rank-r LoRA adapters
    (PEFT's) on the lora_targets layers of every block."""
    lora_alpha: float = 32.0
    """LoRA's alpha: an adapter's update is scaled by lora_alpha / lora_rank."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input (training only)."""
    lora_targets: tuple[str, ...] = ADAPTER_TARGETS
    """Which linear layers of a block get adapters, by PEFT's names: a list, or comma-separated on the command
    line (q_proj,v_proj)."""
    lora_base_dtype: str = "auto"
    """How LoRA's frozen base matrices are held: float32, bfloat16 (half the memory; the adapters stay float32 and
    every layer still computes in the activations' dtype), nf4 (QLoRA: the blocks' linear layers in 4 bits, torchao's
    NF4, the embeddings and head in bfloat16; about a quarter of bfloat16's memory), or auto: bfloat16 on CUDA, float32
    on CPU."""
    max_lr: float = 3e-4
    """Peak learning rate, reached at the end of warmup."""
    schedule: str = "cosine"
    """Learning rate after warmup: cosine (decay to min_lr_ratio), wsd (flat, then a linear decay over the
    last decay_ratio of the steps) or constant (flat). On resume the rate follows this run's config."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine or wsd decay, as a fraction of max_lr."""
    warmup_ratio: float = 0.02
    """Fraction of max_steps spent warming the learning rate up linearly."""
    decay_ratio: float = 0.2
    """wsd only: fraction of max_steps, at the end, over which the learning rate decays."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to matrices and embeddings but not to norm weights."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 turns clipping off."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    random_seed: int = 1337
    """All randomness derives from it: data order per epoch, and each rank's RNG (seed + rank)."""
    device: str = "auto"
    """auto (cuda when available, else cpu), cpu or cuda."""
    deterministic: bool = False
    """Deterministic kernels only (torch's deterministic algorithms, cuBLAS's fixed workspace, a deterministic
    attention backward): on one GPU, two runs, a run with periodic saves and a stopped and resumed run end on bitwise
    equal weights, as on a CPU always; it costs some tokens/s on a GPU (docs/checkpoints.md says how many)."""

    def __post_init__(self) -> None:
        for key in ("max_steps", "batch_per_device", "grad_accum_steps"):
            _check(getattr(self, key) >= 1, f"training.{key}", getattr(self, key), "an integer >= 1")
        _check(
            self.global_batch_size is None or self.global_batch_size >= 1,
            "training.global_batch_size",
            self.global_batch_size,
            "an integer >= 1, or null to use grad_accum_steps",
        )
        _check(self.max_lr > 0, "training.max_lr", self.max_lr, "a number > 0")
        _check(self.schedule in SCHEDULES, "training.schedule", self.schedule, " | ".join(SCHEDULES))
        _check(self.train_type in TRAIN_TYPES, "training.train_type", self.train_type, " | ".join(TRAIN_TYPES))
        _check(self.optimizer in OPTIMIZERS, "training.optimizer", self.optimizer, " | ".join(OPTIMIZERS))
        _check(self.lora_rank >= 0, "training.lora_rank", self.lora_rank, "an integer >= 0 (0 = full fine-tuning)")
        # Alpha, dropout and targets are checked with LoRA off too: a typo there is never silent.
        _settings(lambda: LoRASettings(self.lora_rank or 1, self.lora_alpha, self.lora_dropout, self.lora_targets))
        # bf16 and fp32 as `invoke export --dtype` takes them too.
        if DTYPE_ALIASES.get(self.lora_base_dtype) in LORA_BASE_DTYPES:
            object.__setattr__(self, "lora_base_dtype", DTYPE_ALIASES[self.lora_base_dtype])
        _check(
            self.lora_base_dtype in LORA_BASE_DTYPES,
            "training.lora_base_dtype",
            self.lora_base_dtype,
            " | ".join(LORA_BASE_DTYPES) + " (or fp32, f32, bf16)",
        )
        _check(
            self.optimizer != "muon" or self.lora_rank == 0,
            "training.optimizer",
            self.optimizer,
            "adamw with lora_rank >= 1 (Muon orthogonalises whole weight matrices; the adapters' thin A and B "
            "are not what it is for)",
        )
        _check(self.dpo_beta > 0, "training.dpo_beta", self.dpo_beta, "a number > 0")
        _check(
            self.dpo_reference in DPO_REFERENCES,
            "training.dpo_reference",
            self.dpo_reference,
            " | ".join(DPO_REFERENCES),
        )
        self._check_online()
        _check(0 <= self.min_lr_ratio <= 1, "training.min_lr_ratio", self.min_lr_ratio, "a number in [0, 1]")
        _check(0 < self.decay_ratio <= 1, "training.decay_ratio", self.decay_ratio, "a number in (0, 1]")
        _check(0 <= self.warmup_ratio < 1, "training.warmup_ratio", self.warmup_ratio, "a number in [0, 1)")
        _check(self.weight_decay >= 0, "training.weight_decay", self.weight_decay, "a number >= 0")
        _check(self.max_grad_norm >= 0, "training.max_grad_norm", self.max_grad_norm, "a number >= 0 (0 = no clipping)")
        for key in ("adam_beta1", "adam_beta2"):
            _check(0 <= getattr(self, key) < 1, f"training.{key}", getattr(self, key), "a number in [0, 1)")
        _check(self.adam_eps > 0, "training.adam_eps", self.adam_eps, "a number > 0")
        _check(self.random_seed >= 0, "training.random_seed", self.random_seed, "an integer >= 0")
        _check(self.device in DEVICES, "training.device", self.device, " | ".join(DEVICES))

    def _check_online(self) -> None:
        """The train type's limits on the shared keys, then the sampling and GRPO settings (checked by building them),
        so that the first message about a key states the limit that applies."""
        for key, value, allowed in self.kind.problems(self):
            _check(False, f"training.{key}", value, allowed)
        _check(self.num_generations >= 1, "training.num_generations", self.num_generations, "an integer >= 1")
        _check(self.reward_timeout > 0, "training.reward_timeout", self.reward_timeout, "a number of seconds > 0")
        _settings(self.sampling)
        for entry in TRAIN_TYPES.values():  # every type's own settings, whichever type trains: no typo is silent
            _settings(lambda entry=entry: entry.own_settings(self))
        _settings(lambda: EpisodeSettings(*(getattr(self, key) for key in EPISODE_LIMITS)))
        if self.kind.online and not self.rewards and self.environment is None:
            raise ConfigError(
                f"training.rewards: training.train_type {self.train_type} scores completions with reward functions; "
                "list at least one, such as [astrai.rewards:exact_answer] or ['/data/my_rewards.py:brevity'] (or "
                "run episodes in a training.environment whose reward scores them)"
            )

    @property
    def kind(self) -> TrainType:
        """The train type's entry (astrai.common.train_types)."""
        return TRAIN_TYPES[self.train_type]

    def episodes(self) -> EpisodeSettings | None:
        """The limits of the online types' episodes; None when the run has no tools and no environment (one
        completion per prompt)."""
        if not self.tools and self.environment is None:
            return None
        return EpisodeSettings(*(getattr(self, key) for key in EPISODE_LIMITS))

    def sampling(self) -> Sampling:
        """How the online types sample their completions."""
        return Sampling(self.max_completion_length, self.temperature, self.top_k, self.top_p)

    def grpo(self) -> GRPOSettings:
        """GRPO's settings (online_grpo, grpo)."""
        return GRPOSettings(
            epsilon=self.grpo_epsilon,
            epsilon_high=self.grpo_epsilon_high,
            beta=self.grpo_beta,
            loss=self.grpo_loss,
            scale_rewards=self.scale_rewards,
            max_completion_length=self.max_completion_length,
            num_iterations=self.num_iterations,
        )


def _settings(build) -> None:
    """Build a set of settings to check it; its SettingError becomes the config's error, named ``training.<key>``."""
    try:
        build()
    except SettingError as error:
        raise ConfigError(error.under("training.", Sampling.CONFIG_KEYS)) from None


EVAL_TRAINING_KEYS = ("rewards", "reward_timeout", "max_completion_length")
"""The training keys the generative evaluation reads (its default rewards and length, the rewards' time limit)."""


def ignored_keys(training: TrainingSection, log: LogSection | None = None) -> list[str]:
    """The training keys set (away from their defaults) that ``training.train_type`` does not use, nor the evaluation
    that ``log`` asks for."""
    used = set(training.kind.keys)
    if log is not None and log.eval_prompts is not None:
        used.update(EVAL_TRAINING_KEYS)
    default = TrainingSection()
    return sorted(key for key in TYPE_KEYS if key not in used and getattr(training, key) != getattr(default, key))


def ignored_keys_note(training: TrainingSection, log: LogSection | None = None) -> str | None:
    """What the trainer, --dry-run and preflight say of the keys this train type (and the evaluation of ``log``)
    ignores; None when none is set."""
    ignored = ignored_keys(training, log)
    if not ignored:
        return None
    keys = ", ".join(f"training.{key}" for key in ignored)
    left = "they are" if len(ignored) > 1 else "it is"
    return f"train_type {training.train_type} does not use {keys}; {left} left as set"


def resolve_grad_accum_steps(training: TrainingSection, world_size: int) -> int:
    """Micro-batches per optimizer step on ``world_size`` processes: grad_accum_steps, or derived from
    global_batch_size, which must then split exactly; the error names the world sizes that would fit."""
    global_batch = training.global_batch_size
    if global_batch is None:
        return training.grad_accum_steps
    per_step = training.batch_per_device * world_size
    if global_batch % per_step == 0:
        return global_batch // per_step
    fitting = [size for size in range(1, global_batch + 1) if global_batch % (training.batch_per_device * size) == 0]
    if fitting:
        shown = ", ".join(str(size) for size in fitting[:12]) + (", ..." if len(fitting) > 12 else "")
        hint = f"world sizes that divide it with batch_per_device {training.batch_per_device}: {shown}"
    else:
        hint = f"no world size does: make it a multiple of batch_per_device ({training.batch_per_device})"
    raise ConfigError(
        f"training.global_batch_size: {global_batch} is not a whole multiple of batch_per_device"
        f"({training.batch_per_device}) * world_size({world_size}) = {per_step}; {hint}"
    )


@dataclass(frozen=True)
class CkptSection:
    ckpt_interval: int = 500
    """Optimizer steps between periodic checkpoints."""
    ckpt_dir: str = container_job_dir("astrai-train")
    """The job's checkpoint folder; also holds metrics.jsonl."""
    param_path: str = CONTAINER_MODEL
    """Base model folder (config.json + model.safetensors) used when there is no checkpoint to resume."""
    keep_last: int | None = None
    """Keep only this many newest checkpoints (the newest is never deleted); null keeps all."""
    reference_path: str | None = None
    """DPO's frozen reference model (a model folder); null: the base model (param_path)."""
    format: str | None = None
    """full (rank 0 gathers and writes) | sharded (every rank writes its own rows); null: sharded under fsdp.
    With LoRA, checkpoints hold only the adapters, and rank 0 writes them (null or full)."""
    adapter_path: str | None = None
    """LoRA: a PEFT adapter folder (adapter_config.json, adapter_model.safetensors) of the base model that a fresh
    run starts from instead of new adapters; its rank and targets must be this run's. null: new adapters."""

    def __post_init__(self) -> None:
        _check(self.ckpt_interval >= 1, "ckpt.ckpt_interval", self.ckpt_interval, "an integer >= 1")
        _check(
            self.format is None or self.format in CKPT_FORMATS,
            "ckpt.format",
            self.format,
            " | ".join(CKPT_FORMATS) + ", or null (sharded under fsdp, full otherwise)",
        )
        _check(
            self.keep_last is None or self.keep_last >= 1,
            "ckpt.keep_last",
            self.keep_last,
            "an integer >= 1, or null to keep all",
        )


@dataclass(frozen=True)
class MlflowSettings:
    """log.mlflow: where an MLflow run goes (the address may come from MLFLOW_TRACKING_URI instead)."""

    tracking_uri: str | None = None
    """null: MLFLOW_TRACKING_URI from the environment, else a file store in the job dir (``<job dir>/mlruns``)."""
    experiment: str | None = None
    """null: ``astrai``."""
    run_name: str | None = None
    """null: the job's name (its checkpoint folder's name)."""


@dataclass(frozen=True)
class WandbSettings:
    """log.wandb: which Weights & Biases project a run goes to."""

    project: str | None = None
    """null: WANDB_PROJECT from the environment, else ``astrai``."""
    entity: str | None = None
    """null: the API key's default entity."""
    run_name: str | None = None
    """null: the job's name."""
    mode: str = "online"
    """online (to the server; needs WANDB_API_KEY) or offline (files in ``<job dir>/wandb`` for ``wandb sync``)."""


TRACKER_SETTINGS = {TRACKER_MLFLOW: MlflowSettings, TRACKER_WANDB: WandbSettings}
WANDB_MODES = ("online", "offline")


@dataclass(frozen=True)
class LogSection:
    log_interval: int = 10
    """Optimizer steps between progress lines (and metrics.jsonl records)."""
    eval_interval: int = 200
    """Optimizer steps between validation losses (when data.val_fraction holds windows out)."""
    eval_max_windows: int = 256
    """Validate on at most this many held-out windows, evenly spread, the same ones every time."""
    peak_tflops: float | None = None
    """Peak bf16 TFLOP/s of one device, for MFU; null looks the GPU up in a table (CPU and unknown GPUs: n/a)."""
    report_to: tuple[str, ...] = (TRACKER_TENSORBOARD,)
    """Where metrics go besides metrics.jsonl: tensorboard, mlflow, wandb (any of them), or none."""
    mlflow: MlflowSettings = field(default_factory=MlflowSettings)
    wandb: WandbSettings = field(default_factory=WandbSettings)
    upload_checkpoints: bool = False
    """Upload the last checkpoint to the trackers when the run ends (its weights leave the host: off by default)."""
    eval_prompts: str | None = None
    """Generative evaluation: a prompts data folder (prepare --kind prompts) whose prompts the model completes every
    eval_interval steps, scored by eval_rewards; a path in the container, or relative to data.data_root_path.
    null: none."""
    eval_generations: int = 1
    """Completions of each evaluation prompt (k of eval/pass@k); above 1 with eval_temperature above 0."""
    eval_rewards: tuple[RewardSpec, ...] | None = None
    """The rewards that score the evaluation's completions, as training.rewards lists them; null: training.rewards."""
    eval_max_completion_length: int | None = None
    """At most this many tokens per evaluation completion; null: training.max_completion_length."""
    eval_temperature: float = 0.0
    """Evaluation's sampling temperature: 0 is greedy (the default)."""
    eval_top_p: float = Sampling.top_p
    """Evaluation's nucleus sampling (1: all tokens)."""
    eval_top_k: int = Sampling.top_k
    """Evaluation's top-k sampling (0: all tokens)."""
    eval_batch_size: int = 8
    """Evaluation prompts a rank completes at once (each eval_generations times): the prompts go to the ranks in
    batches of this size, the same batches at any world size, so the figures are too."""
    eval_pass_threshold: float = 1.0
    """A completion passes (eval/pass@k) when its total reward is at least this."""
    eval_at_start: bool = False
    """Evaluate the starting model too, at step 0 (the baseline); a resume does not evaluate again."""

    def __post_init__(self) -> None:
        for name, cls in TRACKER_SETTINGS.items():
            if isinstance(getattr(self, name), dict):
                object.__setattr__(self, name, cls(**getattr(self, name)))
        _check(self.log_interval >= 1, "log.log_interval", self.log_interval, "an integer >= 1")
        _check(self.eval_interval >= 1, "log.eval_interval", self.eval_interval, "an integer >= 1")
        _check(self.eval_max_windows >= 1, "log.eval_max_windows", self.eval_max_windows, "an integer >= 1")
        _check(
            self.peak_tflops is None or self.peak_tflops > 0,
            "log.peak_tflops",
            self.peak_tflops,
            "a number > 0, or null to look the GPU up",
        )
        _check(self.wandb.mode in WANDB_MODES, "log.wandb.mode", self.wandb.mode, f"one of {', '.join(WANDB_MODES)}")
        _check(
            self.eval_max_completion_length is None or self.eval_max_completion_length >= 1,
            "log.eval_max_completion_length",
            self.eval_max_completion_length,
            "an integer >= 1, or null for training.max_completion_length",
        )
        if self.eval_prompts is not None:
            _check(bool(self.eval_prompts.strip()), "log.eval_prompts", self.eval_prompts, "a data folder, or null")
        try:
            check_eval_metric_names([spec.name for spec in self.eval_rewards or ()])
        except ValueError as error:
            raise ConfigError(f"log.eval_rewards: {error}") from None
        try:
            sampling = self._eval_sampling(1)
            EvalSettings(
                "",
                self.eval_interval,
                self.eval_generations,
                sampling,
                self.eval_pass_threshold,
                batch=self.eval_batch_size,
            )
        except SettingError as error:
            raise ConfigError(error.under("log.", EvalSettings.CONFIG_KEYS)) from None

    def _eval_sampling(self, max_completion_length: int) -> Sampling:
        return Sampling(
            self.eval_max_completion_length or max_completion_length,
            self.eval_temperature,
            self.eval_top_k,
            self.eval_top_p,
        )

    def evaluation(self, training: TrainingSection) -> EvalSettings | None:
        """Generative evaluation's settings (None without log.eval_prompts); ``training`` gives its defaults."""
        if self.eval_prompts is None:
            return None
        return EvalSettings(
            self.eval_prompts,
            self.eval_interval,
            self.eval_generations,
            self._eval_sampling(training.max_completion_length),
            self.eval_pass_threshold,
            self.eval_at_start,
            self.eval_batch_size,
        )

    def eval_reward_specs(self, training: TrainingSection) -> tuple[RewardSpec, ...]:
        """What scores the evaluation's completions: log.eval_rewards, else training.rewards."""
        return training.rewards if self.eval_rewards is None else self.eval_rewards

    @property
    def trackers(self) -> tuple[str, ...]:
        """The remote trackers asked for (mlflow, wandb), in report_to's order."""
        return tuple(name for name in self.report_to if name in TRACKER_PACKAGES)


@dataclass(frozen=True)
class TrainerConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    ckpt: CkptSection = field(default_factory=CkptSection)
    log: LogSection = field(default_factory=LogSection)

    def __post_init__(self) -> None:
        if self.data.sources is not None and not self.training.kind.mixtures:
            raise ConfigError(
                f"data.sources: mixtures are for pre-training data; training.train_type {self.training.train_type} "
                "trains on one data folder (data_root_path)"
            )
        if self.training.kind.learns_from_rewards and self.data.val_fraction > 0:
            raise ConfigError(
                f"data.val_fraction: training.train_type {self.training.train_type} has no validation loss to hold "
                "prompts out for; set it to 0 (the rewards in metrics.jsonl say how training goes)"
            )
        if self.training.lora_rank and self.ckpt.format == CKPT_FORMAT_SHARDED:
            raise ConfigError(
                "ckpt.format: sharded writes every rank's rows of the whole model, and a LoRA checkpoint (training."
                "lora_rank >= 1) holds only the adapters, which rank 0 writes; set ckpt.format to null or full"
            )
        if self.ckpt.adapter_path is not None and not self.training.lora_rank:
            raise ConfigError(
                "ckpt.adapter_path: a PEFT adapter folder trains as LoRA; set training.lora_rank to its rank (r)"
            )
        if self.log.eval_prompts is not None and self.training.kind.online and self.training.episodes() is not None:
            raise ConfigError(
                "log.eval_prompts: the evaluation in the loop completes each prompt in one turn, calling no tool, and "
                "this job's episodes use training.tools or training.environment; its figures would not be the "
                "episodes' (the training reward is); leave log.eval_prompts out"
            )
        if self.log.eval_prompts is not None and not self.log.eval_reward_specs(self.training):
            raise ConfigError(
                "log.eval_rewards: log.eval_prompts asks for an evaluation, and nothing scores it; list the rewards "
                "(as training.rewards lists them, such as [astrai.rewards:exact_answer]), or set training.rewards"
            )
        if self.log.eval_prompts is not None:
            try:
                check_eval_metric_names([spec.name for spec in self.log.eval_reward_specs(self.training)])
            except ValueError as error:
                raise ConfigError(f"training.rewards (which score log.eval_prompts): {error}") from None
        if self.log.eval_rewards is not None and self.log.eval_prompts is None:
            raise ConfigError(
                "log.eval_rewards: they score the evaluation of log.eval_prompts, which is not set; set it (a prompts "
                "data folder), or leave eval_rewards out"
            )
        if self.training.optimizer == "muon" and self.parallel.parallel_mode == "fsdp":
            raise ConfigError(
                "training.optimizer: muon orthogonalises each weight matrix whole, and parallel.parallel_mode fsdp "
                "gives every process only a shard of it; use parallel_mode ddp, or optimizer adamw"
            )

    def rewards_in_use(self) -> tuple:
        """Every reward the run scores with, each once: training.rewards for a type that samples completions, and the
        evaluation's (log.eval_rewards, else training.rewards) when log.eval_prompts is set."""
        used = list(self.training.rewards) if self.training.kind.online else []
        if self.log.eval_prompts is not None:
            used += self.log.eval_reward_specs(self.training)
        return tuple(dict.fromkeys(used))

    def eval_prompts_folder(self) -> Path | None:
        """log.eval_prompts as the trainer reads it: a path in the container, or relative to data.data_root_path."""
        if self.log.eval_prompts is None:
            return None
        return Path(self.data.data_root_path) / self.log.eval_prompts

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def config_hash(self) -> str:
        """Short stable hash of the resolved config, recorded in every checkpoint's meta.json."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


_SECTION_CLASSES = {
    "model": ModelSection,
    "data": DataSection,
    "parallel": ParallelSection,
    "training": TrainingSection,
    "ckpt": CkptSection,
    "log": LogSection,
}
SECTIONS = (HOST_SECTION, *_SECTION_CLASSES)
"""Every section train.yaml may hold."""
# Flat key -> section: the command line names keys without their section.
KEY_SECTION: dict[str, str] = {
    f.name: section for section, cls in _SECTION_CLASSES.items() for f in dataclasses.fields(cls)
}


def _check(ok: bool, key: str, value, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: expected {allowed}, got {_got(value)}")


def _got(value) -> str:
    """A value in a message: repr for plain values, bounded for anything large."""
    if isinstance(value, (str, int, float, bool, type(None))):
        text = repr(value)
        return text if len(text) <= 80 else text[:77] + "..."
    return show_value(value)


def _field_types(cls) -> dict[str, object]:
    return typing.get_type_hints(cls)


def _coerce(dotted: str, value, kind, from_text: bool):
    """Check (YAML) or parse (command line text) one value against its field type."""
    if dotted.split(" ")[0] == "data.sources":
        return _sources("data.sources", value, from_text)
    if dotted.split(" ")[0] == "training.lora_targets":
        return _targets(dotted, value, from_text)
    if dotted.split(" ")[0] == "training.rewards":
        return _rewards(dotted, value, from_text)
    if dotted.split(" ")[0] in ("training.tools", "training.environment"):
        return _agent_key(dotted, value, from_text)
    if dotted.split(" ")[0] == "log.eval_rewards":
        if value is None or (from_text and value.strip().lower() in ("null", "none", "~")):
            return None  # the job's training.rewards
        return _rewards(dotted, value, from_text)
    if dotted.split(" ")[0] == "model.compile":
        return _auto_or_bool(dotted, value, from_text)
    if dotted.split(" ")[0] == "log.report_to":
        return _report_to(dotted, value, from_text)
    if dotted.split(" ")[0] in ("log.mlflow", "log.wandb"):
        return _tracker_settings(dotted, value, from_text)
    optional = isinstance(kind, types.UnionType) and type(None) in kind.__args__
    if optional:
        kind = next(arg for arg in kind.__args__ if arg is not type(None))
        if value is None or (from_text and value.lower() in ("null", "none", "~")):
            return None
    if kind is bool:
        if from_text and boolean_word(value) is not None:
            return boolean_word(value)
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{dotted}: expected true or false, got {_got(value)}")
    if kind is int:
        if from_text:
            try:
                return int(value)
            except ValueError:
                pass
        elif isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{dotted}: expected an integer{' or null' if optional else ''}, got {_got(value)}")
    if kind is float:
        # PyYAML reads "3e-4" (no dot) as a string, so numeric strings are accepted from YAML too.
        number = None
        if isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        if number is not None and math.isfinite(number):
            return number
        raise ConfigError(f"{dotted}: expected a finite number{' or null' if optional else ''}, got {_got(value)}")
    if isinstance(value, str):
        return value
    if not from_text and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{dotted}: expected a string, got {_got(value)}")


def _auto_or_bool(dotted: str, value, from_text: bool) -> bool | str:
    """auto, or true / false (YAML's booleans, or their words on the command line)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and (from_text or value.lower() == "auto"):
        word = value.strip().lower()
        if word == "auto":
            return "auto"
        if boolean_word(word) is not None:
            return boolean_word(word)
    raise ConfigError(f"{dotted}: expected auto, true or false, got {_got(value)}")


def _targets(dotted: str, value, from_text: bool) -> tuple[str, ...]:
    """lora_targets: a YAML list of module names, or comma-separated text (LoRASettings checks the names)."""
    if from_text or isinstance(value, str):
        value = [name.strip() for name in value.split(",")]
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise ConfigError(
            f"{dotted}: expected a list of module names ({', '.join(ADAPTER_TARGETS)}), got {_got(value)}"
        )
    return tuple(value)


def _report_to(dotted: str, value, from_text: bool) -> tuple[str, ...]:
    """log.report_to: a YAML list (or one name), or comma-separated text; ``none`` alone."""
    if value is None:
        return (TRACKER_TENSORBOARD,)
    if from_text or isinstance(value, str):
        value = [name.strip() for name in str(value).strip().strip("[]").split(",")]
    allowed = ", ".join(REPORT_TO)
    if not isinstance(value, list) or not all(isinstance(name, str) and name in REPORT_TO for name in value):
        bad = [name for name in value if name not in REPORT_TO] if isinstance(value, list) else value
        raise ConfigError(f"{dotted}: expected a list of {allowed}, got {_got(bad)}")
    if len(set(value)) != len(value):
        raise ConfigError(f"{dotted}: each tracker once, got {_got(value)}")
    if TRACKER_NONE in value and len(value) > 1:
        raise ConfigError(f"{dotted}: none stands alone (it turns every tracker off), got {_got(value)}")
    return () if value in ([], [TRACKER_NONE]) else tuple(value)


def _tracker_settings(dotted: str, value, from_text: bool):
    """log.mlflow / log.wandb: a mapping of their keys (on the command line, the mapping in flow style)."""
    section = dotted.split(" ")[0]
    cls = TRACKER_SETTINGS[section.split(".")[1]]
    keys = [f.name for f in dataclasses.fields(cls)]
    example = "{" + ", ".join(f"{key}: ..." for key in keys[:2]) + "}"
    if from_text:
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ConfigError(f"{dotted}: expected a mapping in flow style, such as '{example}'") from None
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{dotted}: expected a mapping of {', '.join(keys)} such as {example}, got {_got(value)}")
    hints = _field_types(cls)
    settings = {}
    for key, item in value.items():
        if key not in hints:
            raise ConfigError(f"{section}.{key}: {unknown('unknown key', str(key), hints)}")
        if key == "mode" and item not in WANDB_MODES:
            raise ConfigError(f"{section}.mode: expected one of {', '.join(WANDB_MODES)}, got {_got(item)}")
        settings[key] = _coerce(f"{section}.{key}", item, hints[key], from_text=False)
    return settings  # the keys given: a layer's mapping adds to the one before (build_config), LogSection builds it


def _rewards(dotted: str, value, from_text: bool) -> tuple[RewardSpec, ...]:
    """training.rewards: a YAML list (on the command line, the list in flow style, or one function alone)."""
    if from_text:
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ConfigError(
                f"{dotted}: expected a list like '[astrai.rewards:exact_answer, {{function: /data/r.py:short, "
                "weight: 0.2}]'"
            ) from None
        if isinstance(value, (str, dict)):
            value = [value]
    try:
        return parse_rewards(value)
    except ValueError as error:
        raise ConfigError(f"{dotted}: {error}") from None


def _agent_key(dotted: str, value, from_text: bool):
    """training.tools (a list; on the command line in flow style, or one function) and training.environment (a
    class, or {server: NAME}; on the command line as YAML)."""
    key = dotted.split(" ")[0]
    if from_text:
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ConfigError(
                f"{dotted}: expected YAML such as '[/data/tools.py:lookup]' or '{{server: calc}}'"
            ) from None
        if key == "training.tools" and isinstance(value, str):
            value = [value]
    try:
        return parse_tools(value) if key == "training.tools" else parse_environment(value)
    except ValueError as error:
        raise ConfigError(f"{dotted}: {error}") from None


def trainer_sections(path: Path) -> dict:
    """The trainer sections of a YAML file, checked for unknown sections and keys (``runtime`` is dropped).

    Every problem of the file is reported at once (one ConfigError, a line each, in the file's order).
    """
    document = load_yaml(path)
    values: dict[str, dict] = {}
    problems: list[str] = []
    for section, body in document.items():
        if section == HOST_SECTION:
            continue
        if section not in _SECTION_CLASSES:
            problems.append(
                f"{path}: {section}: {unknown('unknown section', section, [*_SECTION_CLASSES, HOST_SECTION])}"
            )
            continue
        if body is None:
            continue
        if not isinstance(body, dict):
            problems.append(f"{path}: {section}: expected a mapping of keys, got {body!r}")
            continue
        hints = _field_types(_SECTION_CLASSES[section])
        for key, value in body.items():
            if key not in hints:
                problem = (
                    f"unknown key; it belongs in section {KEY_SECTION[key]!r}"
                    if key in KEY_SECTION
                    else unknown("unknown key", key, hints)
                )
                problems.append(f"{path}: {section}.{key}: {problem}")
                continue
            try:
                values.setdefault(section, {})[key] = _coerce(f"{section}.{key}", value, hints[key], from_text=False)
            except ConfigError as error:
                problems += [f"{path}: {message}" for message in error.messages]
    if problems:
        raise ConfigError(problems)
    return values


def parse_overrides(pairs: list[tuple[str, str]]) -> dict:
    """Command-line ``(key, text)`` pairs as section values; unknown keys raise with a hint, all at once."""
    values: dict[str, dict] = {}
    problems: list[str] = []
    for key, text in pairs:
        if key not in KEY_SECTION:
            problems.append(f"--{key}: {unknown('unknown option', key, KEY_SECTION)}")
            continue
        section = KEY_SECTION[key]
        kind = _field_types(_SECTION_CLASSES[section])[key]
        try:
            values.setdefault(section, {})[key] = _coerce(f"{section}.{key} (--{key})", text, kind, from_text=True)
        except ConfigError as error:
            problems += error.messages
    if problems:
        raise ConfigError(problems)
    return values


def build_config(*layers: dict) -> TrainerConfig:
    """Merge section values, later layers winning, then validate every section (each section's problem at once)."""
    merged: dict[str, dict] = {}
    for layer in layers:
        for section, body in layer.items():
            for key, value in body.items():
                before = merged.setdefault(section, {}).get(key)
                if isinstance(before, dict) and isinstance(value, dict):
                    value = {**before, **value}  # log.mlflow / log.wandb in the YAML and after --: both, later wins
                merged[section][key] = value
    sections, problems = {}, []
    for name, cls in _SECTION_CLASSES.items():
        try:
            sections[name] = cls(**merged.get(name, {}))
        except ConfigError as error:
            problems += error.messages
    if problems:
        raise ConfigError(problems)
    return TrainerConfig(**sections)


def load_trainer_config(path: Path, overrides: list[tuple[str, str]] = ()) -> TrainerConfig:
    """The resolved config: defaults, then the YAML file, then command-line overrides.

    The file's problems and the command line's are reported together; the sections' own checks, once both read.
    """
    layers, problems = [], []
    for read in (lambda: trainer_sections(path), lambda: parse_overrides(list(overrides))):
        try:
            layers.append(read())
        except ConfigError as error:
            problems += error.messages
    if problems:
        raise ConfigError(problems)
    return build_config(*layers)


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise ConfigError(message)


def parse_args(argv: list[str] | None = None) -> tuple[TrainerConfig, bool]:
    """(resolved config, dry_run) from the trainer's command line; bad input raises ConfigError.

    The host runs it too (no torch here), on the job's train.yaml and the arguments after ``--``, so that
    `invoke preflight` and `invoke start` refuse what the trainer would refuse before any container starts.
    """
    parser = _ArgumentParser(
        prog="python -m astrai.train",
        description="Train (or resume) a model from the trainer sections of train.yaml.",
        allow_abbrev=False,
    )
    parser.add_argument("--config", type=Path, default=Path("train.yaml"), help="YAML file (default ./train.yaml)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved config, world size, device and resume decision, then exit",
    )
    defaults = TrainerConfig().to_dict()
    for key, section in KEY_SECTION.items():
        parser.add_argument(
            f"--{key}",
            dest=f"key_{key}",
            metavar="VALUE",
            default=argparse.SUPPRESS,
            help=f"{section}.{key} (default {defaults[section][key]!r})",
        )
    args, leftover = parser.parse_known_args(argv)
    for token in leftover:
        if token.startswith("--"):
            key = token[2:].split("=", 1)[0]
            raise ConfigError(f"--{key}: {unknown('unknown option', key, [*KEY_SECTION, 'config', 'dry-run'])}")
        raise ConfigError(f"unexpected argument {token!r}")
    overrides = [(name[len("key_") :], value) for name, value in vars(args).items() if name.startswith("key_")]
    return load_trainer_config(args.config, overrides), args.dry_run


def describe(config: TrainerConfig) -> str:
    """The resolved config as YAML, sections in their usual order."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False, default_flow_style=False).rstrip()
