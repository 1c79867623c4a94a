"""How a run is put together, each part from the ones before it; every function returns what it builds.

The order is the order of :class:`astrai.trainer.run.loop.Trainer`'s construction, and each step's inputs are its
arguments: the data folders (:func:`open_run_data`), the weights the run starts from (:func:`read_start`), what
the data trains on (:func:`post_training_records`, :func:`build_feed`), the model (:func:`build_model`), the
objective with DPO's frozen reference (:func:`build_objective`) and the facts every checkpoint records
(:func:`run_facts`). Nothing here resumes state: the checkpoint manager restores the run's stateful parts last.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from astrai.common.backends import through_transformers
from astrai.common.config import TrainerConfig, ignored_keys_note
from astrai.common.contract import GENERATION_CONFIG_FILE, TOKENIZER_FILE
from astrai.common.data_folder import DataError, TokenData, WindowSplit, data_digest, data_kind, describe_units
from astrai.common.fit import (
    BatchShape,
    SetupError,
    check_fit,
    check_model_tokenizer,
    check_resume,
    check_same_tokenizer,
    fit_prompts,
    prompt_room,
    tokenizer_hint,
)
from astrai.common.model_folder import ModelConfig, ModelLoadError, base_digest, other_base
from astrai.common.nf4 import NF4
from astrai.common.plan import RunPlan
from astrai.common.settings import LoRASettings
from astrai.common.values import format_bytes
from astrai.trainer.checkpoint.files import LoadedCheckpoint
from astrai.trainer.checkpoint.manager import RunFacts
from astrai.trainer.feed.records import DPOPairs, PackedSFT, RecordIndex
from astrai.trainer.feed.windows import (
    MixtureBatchSampler,
    MixtureDataset,
    MixtureOrder,
    WindowBatchSampler,
    WindowDataset,
    ignore_stop_signals,
)
from astrai.trainer.generation.decoding import total_memory
from astrai.trainer.generation.engines import EngineSizes, generation_engine
from astrai.trainer.launch.distributed import DistEnv, GracefulStop, broadcast_from_master, gather_objects
from astrai.trainer.models.backend import backend_named
from astrai.trainer.models.compiling import compile_blocks
from astrai.trainer.models.lora import (
    AdapterError,
    BaseModel,
    frozen_dtype,
    parameter_counts,
    read_peft_adapter,
)
from astrai.trainer.models.nf4 import check_nf4_runs
from astrai.trainer.models.parallel import parallelize
from astrai.trainer.objectives.agents.environments import Limits
from astrai.trainer.objectives.agents.episodes import EpisodePrompts, EpisodeRollouts, episode_prompts
from astrai.trainer.objectives.contract import Objective
from astrai.trainer.objectives.dpo import Preference
from astrai.trainer.objectives.grpo import GRPO, RoundShape
from astrai.trainer.objectives.kto import KTO, KTOExamples
from astrai.trainer.objectives.online_dpo import OnlineDPO
from astrai.trainer.objectives.prompts import Prompts, PromptSet, ScoredGroups
from astrai.trainer.objectives.reference import check_same_reference, frozen_model, reference_table
from astrai.trainer.objectives.reward_model import RewardModelObjective, RewardPairs, classifier_start
from astrai.trainer.objectives.rloo import RLOO
from astrai.trainer.objectives.rollouts import CompletionsLog, GivenRollouts, SampledRollouts
from astrai.trainer.objectives.supervised import NextToken, Supervised

Log = Callable[[str], None]


def open_same_data(root: Path, env: DistEnv) -> TokenData:
    """The data folder, checked to be the same on every rank (each node reads its own copy).

    Every rank reports what it found, so a missing or different folder on one node is the same clear
    error on all of them, instead of one rank failing while the others wait.
    """
    try:
        data = TokenData.open(root)
        mine = data.fingerprint()
    except DataError as error:
        data, mine = None, f"error: {error}"
    everyone = gather_objects(env, mine)
    if all(report == everyone[0] for report in everyone) and data is not None:
        return data
    if len(everyone) == 1:
        raise DataError(str(mine).removeprefix("error: "))  # one process: no other rank to compare with
    lines = [f"node {env.node_of(rank)} rank {rank}: {report}" for rank, report in enumerate(everyone)]
    raise DataError(
        f"every node needs the same data in {root}, but the ranks found different data "
        f"(manifest digests):\n  " + "\n  ".join(lines)
    )


@dataclass(frozen=True)
class RunData:
    """The run's data folders: one, or a mixture's sources (``names``, in the config's order)."""

    datas: list[TokenData]
    names: list[str]
    digest: str
    """What checkpoints record of the data (a resume on other data says so)."""

    @property
    def first(self) -> TokenData:
        return self.datas[0]


def open_run_data(config: TrainerConfig, env: DistEnv) -> RunData:
    root = Path(config.data.data_root_path)
    sources = config.data.sources
    names = [source.path for source in sources] if sources else []
    datas = [open_same_data(root / name, env) for name in names] if sources else [open_same_data(root, env)]
    if sources:
        check_same_tokenizer(datas, names)
    return RunData(datas, names, data_digest(datas))


@dataclass(frozen=True)
class Start:
    """The weights the run starts from: a checkpoint's, or the base model's."""

    model_config: ModelConfig
    weights: dict[str, torch.Tensor] | None
    """None for a sharded resume: each rank reads its own rows once the model is sharded."""
    source: Path
    adapters: dict[str, torch.Tensor] | None = None
    """LoRA: the adapters to start from (a checkpoint's, or a PEFT adapter folder's); None: new ones."""
    base_sha256: str | None = None
    """LoRA: which base model the weights are (astrai.common.model_folder.base_digest)."""
    adapters_from: Path | None = None
    """LoRA: the folder the adapters to start from were read from (its name goes into a refusal)."""


def read_start(
    config: TrainerConfig, plan: RunPlan, env: DistEnv, data: RunData, loaded: LoadedCheckpoint | None
) -> Start:
    if plan.lora is not None:
        if plan.base_dtype == NF4:  # before the base is read: this process must be able to compute with it
            check_nf4_runs(env.device)
        return _lora_start(config, env, data, loaded, plan.lora, backend_named(plan.backend).read)
    if loaded is not None:
        source = loaded.checkpoint.path
        broadcast_from_master(env, lambda: check_model_tokenizer(data.first, source), errors=(SetupError, DataError))
        return Start(loaded.model_config, loaded.model_state, source)
    source = Path(config.ckpt.param_path)
    load = backend_named(plan.backend).read

    def read_base():
        check_model_tokenizer(data.first, source)
        return load(source)

    # Only node 0 needs the base model: rank 0 reads it, the others receive it.
    model_config, weights = broadcast_from_master(env, read_base, errors=(ModelLoadError, SetupError, DataError))
    return Start(model_config, weights, source)


def _lora_start(
    config: TrainerConfig,
    env: DistEnv,
    data: RunData,
    loaded: LoadedCheckpoint | None,
    settings: LoRASettings,
    load: Callable[[Path], tuple],
) -> Start:
    """LoRA: the frozen base model always comes from ckpt.param_path; the adapters from the checkpoint resumed, a
    PEFT adapter folder (ckpt.adapter_path), or nowhere (new ones). A checkpoint's adapters must be of this base."""
    base = Path(config.ckpt.param_path)

    def read_base():
        check_model_tokenizer(data.first, base)
        model_config, weights = load(base)
        return model_config, weights, base_digest(base)

    model_config, weights, digest = broadcast_from_master(
        env, read_base, errors=(ModelLoadError, SetupError, DataError)
    )
    if loaded is not None:
        problem = other_base(loaded.checkpoint.path, loaded.meta.lora, base, digest, f"ckpt.param_path {base}")
        if problem is not None:
            raise SetupError(f"{problem}; set ckpt.param_path back to that model")
        return Start(model_config, weights, loaded.checkpoint.path, loaded.model_state, digest, loaded.checkpoint.path)
    if config.ckpt.adapter_path is None:
        return Start(model_config, weights, base, None, digest)
    folder = Path(config.ckpt.adapter_path)

    def read_adapter():
        theirs, tensors = read_peft_adapter(folder)
        if theirs.identity != settings.identity:
            raise AdapterError(
                f"ckpt.adapter_path {folder}: its adapters are rank {theirs.rank}, alpha {theirs.alpha:g} on "
                f"{', '.join(theirs.targets)}, and this run's are rank {settings.rank}, alpha {settings.alpha:g} on "
                f"{', '.join(settings.targets)}; set training.lora_rank, lora_alpha and lora_targets to the folder's"
            )
        return tensors

    adapters = broadcast_from_master(env, read_adapter, errors=(AdapterError,))
    return Start(model_config, weights, base, adapters, digest, folder)


def resume_notes(loaded: LoadedCheckpoint | None, config: TrainerConfig, plan: RunPlan, digest: str) -> list[str]:
    """What changed since the checkpoint that the resume goes on with; SetupError for what it cannot."""
    if loaded is None:
        return []
    meta = loaded.meta
    groups = loaded.optimizer_state.get("param_groups", [])
    if meta.optimizer is None and groups:  # an older checkpoint: AdamW has two groups, Muon adds a third
        meta = dataclasses.replace(meta, optimizer="muon" if len(groups) == 3 else "adamw")
    return check_resume(meta, loaded.checkpoint.path, config.training, digest, plan.base_dtype)


@dataclass(frozen=True)
class Records:
    """Post-training data: every sequence of the folder, and what the run trains on (packed windows, pairs)."""

    index: RecordIndex
    units: object
    episodes: EpisodePrompts | None = None
    """Episodes (tools, an environment): the prompts' messages, the chat template and the agent that render them."""


def post_training_records(
    config: TrainerConfig, plan: RunPlan, data: RunData, log: Log, model: ModelConfig
) -> Records | None:
    """What the run trains on besides the token stream (its train type's records: packed windows, pairs, prompts),
    after checking that every data folder is of the kind the type trains on."""
    kind = config.training.kind
    for folder in data.datas:
        folder.check_kind(kind.data_kind, kind.name, tokenizer_hint(Path(config.ckpt.param_path)))
    return TRAINER_TYPES[kind.name].records(config, plan, data, log, model)


def _no_records(config: TrainerConfig, plan: RunPlan, data: RunData, log: Log, model: ModelConfig) -> None:
    return None


def _supervised_records(config: TrainerConfig, plan: RunPlan, data: RunData, log: Log, model: ModelConfig):
    """SFT's packed windows, DPO's pairs: the data kind's units at the window."""
    window, overlong = config.data.window_size, config.data.overlong
    index = RecordIndex(data.first)
    units = data_kind(data.first.kind).units(data.first, window, overlong)
    log(f"{config.training.train_type}: {describe_units(units, len(index), window, overlong)}")
    return Records(index, units)


def _scored_records(config: TrainerConfig, plan: RunPlan, data: RunData, log: Log, model: ModelConfig):
    """grpo's prompts with the completions and rewards the data gives."""
    index, overlong = RecordIndex(data.first), config.data.overlong
    groups = ScoredGroups(data.first, index, config.data.window_size, overlong)
    how = f"{groups.truncated:,} cut to it" if overlong == "truncate" else "their groups left out"
    log(
        f"{config.training.train_type}: {len(groups):,} prompts x {groups.size} scored completions "
        f"({groups.dropped:,} prompts left out); completions longer than data.window_size {config.data.window_size} "
        f"with their prompt: {how}"
    )
    if not len(groups):
        raise DataError(f"{data.first.root}: no prompt is left to train on; raise data.window_size")
    return Records(index, groups)


def _prompt_records(config: TrainerConfig, plan: RunPlan, data: RunData, log: Log, model: ModelConfig):
    index = RecordIndex(data.first)
    if plan.episodes is not None:
        limits = Limits(plan.episodes.tool_timeout)
        return Records(index, *episode_prompts(config, plan, index, log, model, limits))
    return Records(index, _prompt_units(config, plan, index, log, model))


def _prompt_units(config: TrainerConfig, plan: RunPlan, index: RecordIndex, log: Log, model: ModelConfig):
    """The prompts, each cut to leave room for max_completion_length in the model's context (or left out)."""
    training, overlong = config.training, config.data.overlong
    units = fit_prompts(index.data, index.length, model, training, overlong, Path(config.ckpt.param_path))
    room = prompt_room(model, training.max_completion_length, Path(config.ckpt.param_path))[1]
    how = f"{units.truncated:,} cut to their last {room}" if overlong == "truncate" else f"{units.dropped:,} left out"
    log(
        f"{training.train_type}: {len(units):,} prompts x {plan.generations} completions of at most "
        f"{training.max_completion_length} tokens; prompts longer than {room} tokens: {how} (data.overlong: {overlong})"
    )
    return units


@dataclass(frozen=True)
class Feed:
    """What the loader reads: the dataset, this rank's batch sampler, the held-out windows."""

    dataset: torch.utils.data.Dataset
    sampler: MixtureBatchSampler | WindowBatchSampler
    eval_windows: list[int]
    mixture: MixtureOrder | None
    splits: list


def build_feed(
    config: TrainerConfig,
    env: DistEnv,
    data: RunData,
    start: Start,
    batch: BatchShape,
    records: Records | None,
) -> Feed:
    training, window = config.training, config.data.window_size
    mixed = bool(config.data.sources)
    fraction = config.data.val_fraction
    units = len(records.units) if records is not None else None
    if training.kind.online:
        window = 1  # prompts are not windows: their room in the model's context was checked with them
    splits = [
        check_fit(folder, start.model_config, start.source, window, fraction, batch, repeated=mixed, units=units)
        for folder in data.datas
    ]
    per_rank = (training.batch_per_device, batch.grad_accum, env.rank, env.world_size)
    if mixed:  # a mixture of pre-training folders (the config allows it for such types only)
        weights = [source.weight for source in config.data.sources]
        mixture = MixtureOrder([split.num_train for split in splits], weights, training.random_seed)
        dataset = MixtureDataset(data.datas, window, splits)
        sampler = MixtureBatchSampler(mixture, dataset.train_offsets, *per_rank)
        eval_windows = [
            dataset.corpus_offsets[number] + held_out
            for number, split in enumerate(splits)
            for held_out in split.eval_windows(max(1, config.log.eval_max_windows // len(splits)))
        ]
        return Feed(dataset, sampler, eval_windows, mixture, splits)
    dataset = TRAINER_TYPES[training.train_type].dataset(data, records, window, splits[0])
    sampler = WindowBatchSampler(splits[0].num_train, *per_rank, training.random_seed)
    return Feed(dataset, sampler, splits[0].eval_windows(config.log.eval_max_windows), None, splits)


def make_loader(config: TrainerConfig, env: DistEnv, feed: Feed) -> DataLoader:
    workers = config.data.num_workers
    return DataLoader(
        feed.dataset,
        batch_sampler=feed.sampler,
        num_workers=workers,
        pin_memory=env.device.type == "cuda",
        persistent_workers=workers > 0,
        worker_init_fn=ignore_stop_signals if workers > 0 else None,
        # Its own generator: each new iterator (a start, a resume, an epoch) draws its workers' base seed from it,
        # never from the global RNG, which dropout draws from and a checkpoint restores exactly.
        generator=torch.Generator().manual_seed(config.training.random_seed),
    )


def build_model(config: TrainerConfig, plan: RunPlan, env: DistEnv, start: Start) -> torch.nn.Module:
    """The model with the start's weights, on the device and wrapped for the parallel mode."""
    checkpointing = config.model.activation_checkpointing
    model = backend_named(plan.backend).trained(start, plan, config.training.random_seed, checkpointing, env.device)
    if plan.compile:
        compile_blocks(model)  # ours, or the library's decoder blocks
    model = parallelize(model, env)
    if start.weights is None:  # a sharded resume: this rank's rows come from the checkpoint
        model.to_empty(device=env.device)
    return model


def autocast_for(plan: RunPlan) -> contextlib.AbstractContextManager:
    """The plan's autocast (bf16 on CUDA); CPU trains in fp32, where autocast would only slow it down."""
    if plan.autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(plan.device_type, dtype=getattr(torch, plan.autocast))


@dataclass(frozen=True)
class RunParts:
    """What an objective is built from: the run's config and plan, and the parts built before it."""

    config: TrainerConfig
    plan: RunPlan
    env: DistEnv
    log: Log
    start: Start
    records: Records | None
    feed: Feed
    model: torch.nn.Module
    loaded: LoadedCheckpoint | None
    stop: GracefulStop
    """The run's stop request: a part that waits on user code (reward functions) gives up when one comes."""
    rewards: dict = dataclasses.field(default_factory=dict)
    """The rewards loaded so far, by their entry (:func:`loaded_rewards`): a reward model the objective and the
    evaluation both score with is loaded once."""

    @property
    def model_config(self) -> ModelConfig:
        return self.start.model_config


@dataclass(frozen=True)
class BuiltObjective:
    """The objective of the run, and its frozen reference as checkpoints record it (path, sha256), else None."""

    objective: Objective
    reference: dict | None = None


ObjectiveBuilder = Callable[[RunParts], BuiltObjective]
"""What the trainer builds its objective with: :func:`build_objective`, or another of the same shape."""


def build_objective(parts: RunParts) -> BuiltObjective:
    """The objective ``training.train_type`` names (its entry of :data:`TRAINER_TYPES`), with what it needs (a
    reference, a rollout source)."""
    note = ignored_keys_note(parts.config.training, parts.config.log)
    if note is not None:
        parts.log(f"note: {note}")
    return TRAINER_TYPES[parts.plan.train_type].objective(parts)


def _next_token(parts: RunParts) -> BuiltObjective:
    return BuiltObjective(NextToken(parts.env))


def _supervised(parts: RunParts) -> BuiltObjective:
    return BuiltObjective(Supervised(parts.env))


def _preference(parts: RunParts) -> BuiltObjective:
    reference, recorded = _dpo_reference(parts)
    return BuiltObjective(Preference(parts.env, reference, parts.config.training.dpo_beta), recorded)


def _online_dpo(parts: RunParts) -> BuiltObjective:
    training = parts.config.training
    source = sampled_rollouts(parts)
    reference, recorded = starting_model(parts)
    parts.log(f"online_dpo: two completions a prompt, the higher-scored chosen, DPO beta {training.dpo_beta:g}")
    autocast, log = autocast_for(parts.plan), completions_log(parts)
    objective = OnlineDPO(parts.env, source, training.dpo_beta, reference, autocast, log, parts.log)
    return BuiltObjective(objective, recorded)


def _grpo_given(parts: RunParts) -> BuiltObjective:
    return _grpo(parts, given_rollouts(parts))


def _grpo_sampled(parts: RunParts) -> BuiltObjective:
    return _grpo(parts, sampled_rollouts(parts))


def _rloo(parts: RunParts) -> BuiltObjective:
    return _grpo(parts, sampled_rollouts(parts), RLOO)


def _grpo(parts: RunParts, source, objective: type[GRPO] = GRPO) -> BuiltObjective:
    """GRPO, or an algorithm on its rollouts and rounds (RLOO), with the plan's settings; the frozen starting model
    where the settings' beta asks for a KL penalty."""
    plan = parts.plan
    settings = plan.settings
    reference, recorded = starting_model(parts) if settings.beta != 0 else (None, None)
    parts.log(f"{plan.train_type}: {settings.describe()}")
    shape = RoundShape(plan.grad_accum, plan.batch.batch_per_device * source.generations)
    env, autocast, log = parts.env, autocast_for(plan), completions_log(parts)
    return BuiltObjective(objective(env, source, settings, reference, shape, autocast, log, parts.log), recorded)


def _kto(parts: RunParts) -> BuiltObjective:
    reference, recorded = starting_model(parts)
    what = "this model, adapters off" if isinstance(reference, BaseModel) else "a frozen copy"
    parts.log(f"kto: {parts.plan.settings.describe()}; reference {recorded['path']} ({what})")
    return BuiltObjective(KTO(parts.env, reference, parts.plan.settings), recorded)


def _windows(data: RunData, records: Records | None, window: int, split: WindowSplit):
    return WindowDataset(data.first, window, split)


def _packed(data: RunData, records: Records, window: int, split: WindowSplit):
    return PackedSFT(records.index, records.units, window, split)


def _pairs(data: RunData, records: Records, window: int, split: WindowSplit):
    return DPOPairs(records.index, records.units, window, split)


def _examples(data: RunData, records: Records, window: int, split: WindowSplit):
    return KTOExamples(records.index, records.units, window, split)


def _scored_pairs(data: RunData, records: Records, window: int, split: WindowSplit):
    return RewardPairs(records.index, records.units, window, split)


def _reward_model(parts: RunParts) -> BuiltObjective:
    parts.log(f"reward_model: {parts.plan.settings.describe()}")
    return BuiltObjective(RewardModelObjective(parts.env, parts.plan.settings, parts.model_config.pad_token_id))


def _classifier_start(start: Start, config: TrainerConfig) -> Start:
    """A reward model's start from a causal language model: its weights with a score head in place of the output
    projection (a checkpoint, or a folder that is a classifier already, starts as it is)."""
    if through_transformers(start.model_config):
        raise SetupError(
            f"train_type reward_model trains the families the trainer computes itself (model_type "
            f"{start.model_config.model_type} goes through transformers); start from a native family's folder"
        )
    if start.model_config.num_labels is not None:
        if start.model_config.num_labels != 1:
            raise SetupError(
                f"{start.source} is a sequence classifier of {start.model_config.num_labels} labels; a reward model "
                "has one (start from a causal language model, or from a classifier of one label)"
            )
        return start
    try:
        config_, weights = classifier_start(start.model_config, start.weights, config.training.random_seed)
    except ValueError as error:
        raise SetupError(f"train_type reward_model: {error}") from None
    return dataclasses.replace(start, model_config=config_, weights=weights)


def typed_start(config: TrainerConfig, start: Start) -> Start:
    """The weights the run starts from as its train type takes them (a reward model: with its score head)."""
    adapt = TRAINER_TYPES[config.training.train_type].start
    if adapt is None and getattr(start.model_config, "num_labels", None) is not None:
        raise SetupError(
            f"{start.source} is a sequence classifier (a reward model), which generates no text: train it with "
            f"train_type reward_model, or start train_type {config.training.train_type} from a causal language model"
        )
    return start if adapt is None or start.weights is None else adapt(start, config)


def _prompts(data: RunData, records: Records, window: int, split: WindowSplit):
    return PromptSet(records.units, split)


@dataclass(frozen=True)
class TrainerType:
    """The trainer's side of a train type (astrai.common.train_types holds the rest): what it trains on besides the
    token stream, the dataset the loader reads, and the objective a step minimises."""

    records: Callable[[TrainerConfig, RunPlan, RunData, Log, ModelConfig], Records | None]
    dataset: Callable[[RunData, Records | None, int, WindowSplit], torch.utils.data.Dataset]
    objective: ObjectiveBuilder
    start: Callable[[Start, TrainerConfig], Start] | None = None
    """How it takes the weights it starts from, when not as they are (a reward model adds its score head)."""


TRAINER_TYPES: dict[str, TrainerType] = {
    "seq": TrainerType(_no_records, _windows, _next_token),
    "sft": TrainerType(_supervised_records, _packed, _supervised),
    "dpo": TrainerType(_supervised_records, _pairs, _preference),
    "grpo": TrainerType(_scored_records, _prompts, _grpo_given),
    "online_grpo": TrainerType(_prompt_records, _prompts, _grpo_sampled),
    "online_dpo": TrainerType(_prompt_records, _prompts, _online_dpo),
    "online_rloo": TrainerType(_prompt_records, _prompts, _rloo),
    "kto": TrainerType(_supervised_records, _examples, _kto),
    "reward_model": TrainerType(_supervised_records, _scored_pairs, _reward_model, _classifier_start),
}
"""Every train type's trainer side, by the names of astrai.common.train_types.TRAIN_TYPES (a test holds them equal)."""


def _tokenizer(parts: RunParts):
    return data_tokenizer(parts.records.index.data)


def data_tokenizer(data: TokenData):
    """The tokenizer a data folder was prepared with: its tokenizer.json, or bytes."""
    from astrai.data.tokenizing import ByteTokenizer, HFTokenizer

    return ByteTokenizer() if data.tokenizer_sha256 is None else HFTokenizer(data.root / TOKENIZER_FILE)


def sampled_rollouts(parts: RunParts) -> SampledRollouts | EpisodeRollouts:
    """The online types' rollout source: the policy samples (``plan.sampling``, ``plan.generations``), the reward
    functions of ``training.rewards`` score, the model's stop tokens end a completion; with tools or an environment,
    each rollout is an episode (:mod:`astrai.trainer.objectives.agents.episodes`)."""
    from astrai.trainer.generation.generate import stop_tokens
    from astrai.trainer.objectives.rewards import RewardLimits

    env, plan, training, records = parts.env, parts.plan, parts.config.training, parts.records
    rewards = loaded_rewards(parts, training.rewards)
    tokenizer = _tokenizer(parts)
    stop = stop_tokens(parts.model_config, parts.start.source, tokenizer)
    sampling = plan.sampling
    described = ", ".join(f"{reward.name} x{reward.spec.weight:g}" for reward in rewards)
    parts.log(
        f"{plan.train_type}: rewards {described}; temperature {sampling.temperature:g}, top_p {sampling.top_p:g}, "
        f"top_k {sampling.top_k}; stop tokens {sorted(stop)}"
    )
    prompts = Prompts(records.index.data, records.index, records.units)
    longest = max(records.units.takes)
    engine = generation_engine(plan.backend, parts.model, lambda: engine_sizes(parts, longest))
    limits = RewardLimits(training.reward_timeout, lambda: parts.stop.requested)
    if plan.episodes is not None:
        parts.log(f"episodes: {plan.episodes.describe()}")
        context = prompt_room(parts.model_config, plan.completion_room, parts.start.source)[0]
        return EpisodeRollouts(
            env,
            engine,
            prompts,
            records.episodes,
            rewards,
            sampling,
            plan.episodes,
            plan.generations,
            stop,
            tokenizer.decode,
            training.random_seed,
            training.mask_truncated_completions,
            autocast_for(plan),
            limits,
            context,
        )
    return SampledRollouts(
        env,
        engine,
        prompts,
        rewards,
        sampling,
        plan.generations,
        stop,
        tokenizer.decode,
        training.random_seed,
        training.mask_truncated_completions,
        autocast_for(plan),
        limits,
    )


def loaded_rewards(parts: RunParts, specs) -> list:
    """The rewards of ``specs`` (functions, reward models, remote judges), each loaded once for the run."""
    from astrai.trainer.objectives.model_rewards import load_rewards

    missing = [spec for spec in specs if spec not in parts.rewards]
    parts.rewards.update(
        zip(missing, load_rewards(missing, parts.env, autocast_for(parts.plan), parts.log), strict=True)
    )
    return [parts.rewards[spec] for spec in specs]


def engine_sizes(parts: RunParts, longest_prompt: int) -> EngineSizes:
    """How the native generation engine of the online types sizes its caches, by the plan: one decode step per batch
    size at the largest capacity the run reaches, and rounds split into parts of a size that depends on the model's
    shape, the rows, that capacity and the device's total memory only, so that a resumed run splits them (and
    samples) as the uninterrupted one did."""
    plan, env, model = parts.plan, parts.env, parts.model_config
    context, _ = prompt_room(model, plan.completion_room, parts.start.source)
    cache = plan.generation_cache(model, context, longest_prompt)
    device_total = total_memory(env.device)
    rows = cache.rows_per_part(device_total, plan.state_bytes(model))
    parts.log(
        f"generation: key/value caches of {cache.capacity} positions, {rows} of a round's {cache.rows} rows at once "
        f"({format_bytes(rows * cache.row_bytes)}; the device has {format_bytes(device_total)})"
    )
    # FSDP gathers the weights in every forward pass: its ranks generate in step, eagerly.
    together = env.control_group if plan.parallel_mode == "fsdp" else None
    compiled = plan.compile and together is None
    return EngineSizes(capacity=cache.capacity, rows_per_part=rows, together=together, compile=compiled)


def given_rollouts(parts: RunParts) -> GivenRollouts:
    """``grpo``'s rollout source: the data's scored completions."""
    parts.log("grpo: the rewards given with the data")
    return GivenRollouts(parts.records.units, _tokenizer(parts).decode)


def completions_log(parts: RunParts) -> CompletionsLog:
    return CompletionsLog(Path(parts.config.ckpt.ckpt_dir), parts.config.log.log_interval, parts.env)


def starting_model(parts: RunParts) -> tuple[object, dict]:
    """The frozen starting model the reward types compare with (online_dpo's reference, GRPO's KL reference), and
    what checkpoints record of it: with LoRA the model itself with its adapters off, else a frozen copy (of
    ckpt.reference_path, or the base model)."""
    config = parts.config
    if parts.plan.lora is not None and config.ckpt.reference_path is None:
        recorded = {"path": config.ckpt.param_path, "sha256": parts.start.base_sha256}
        check_same_reference(recorded, parts.loaded)
        return BaseModel(parts.model), recorded
    path = Path(config.ckpt.reference_path or config.ckpt.param_path)
    return frozen_model(path, parts.env, parts.model_config, parts.records.index.data, parts.loaded)


def _dpo_reference(parts: RunParts) -> tuple[object, dict]:
    """DPO's frozen reference (ckpt.reference_path, or the base model; with LoRA the model, adapters off), live or
    as its table of log-probabilities. A resume must keep the same reference: meta.json records its checksum."""
    training = parts.config.training
    reference, recorded = starting_model(parts)
    how = f"beta {training.dpo_beta}, {training.dpo_reference}"
    if isinstance(reference, BaseModel):
        parts.log(
            f"dpo: reference is the base model {recorded['path']} (sha256 {recorded['sha256'][:12]}): this model, "
            f"adapters off, {how}"
        )
    else:
        parts.log(f"dpo: reference model {recorded['path']} (sha256 {recorded['sha256'][:12]}), frozen, {how}")
    if training.dpo_reference == "live":
        return reference, recorded
    facts = {
        "reference_sha256": recorded["sha256"],
        "data": parts.records.index.data.fingerprint(),
        "window_size": str(parts.config.data.window_size),
        "overlong": parts.config.data.overlong,
        "device_type": parts.env.device.type,
    }
    if isinstance(reference, BaseModel):  # LoRA: the base as held (a bf16 base scores otherwise than an fp32 one)
        facts["base_dtype"] = frozen_dtype(reference.model)
    table = reference_table(
        reference,
        parts.feed.dataset,
        len(parts.records.units),
        facts,
        Path(parts.config.ckpt.ckpt_dir),
        parts.env,
        training.batch_per_device,
        autocast_for(parts.plan),
        parts.log,
    )
    return table, recorded


def run_facts(config: TrainerConfig, plan: RunPlan, data: RunData, built: BuiltObjective, start: Start) -> RunFacts:
    training = config.training
    lora = None
    if plan.lora is not None:
        lora = plan.lora.record(config.ckpt.param_path, start.base_sha256, plan.base_dtype)
    return RunFacts(
        config.config_hash(),
        training.max_steps,
        config.data.window_size,
        plan.global_batch,
        training.train_type,
        reference=built.reference,
        optimizer=training.optimizer,
        data_digest=data.digest,
        lora=lora,
        rewards=training.kind.recorded_settings(training),
    )


def trainable_tag(model: torch.nn.Module, plan: RunPlan) -> str | None:
    """LoRA's rank and trainable share for the progress line (``lora r16 0.52%``); None for full fine-tuning."""
    if plan.lora is None:
        return None
    trainable, frozen = parameter_counts(model)
    return f"lora r{plan.lora.rank} {trainable / (trainable + frozen):.2%}"


def describe_trainable(model: torch.nn.Module, plan: RunPlan) -> str | None:
    """LoRA's line at start: its settings and how much of the model trains; None for full fine-tuning."""
    if plan.lora is None:
        return None
    trainable, frozen = parameter_counts(model)
    share = trainable / (trainable + frozen)
    return (
        f"lora: {plan.lora_description}: {trainable:,} trainable of {trainable + frozen:,} parameters ({share:.2%}); "
        f"the frozen base held in {frozen_dtype(model)}"
    )


def carried_files(data: TokenData, model_source: Path) -> dict[str, bytes]:
    """What every checkpoint carries beside the model: the data's tokenizer files and the generation config of the
    folder the run started from (a base model, or the checkpoint it resumed), read once."""
    files = {name: (data.root / name).read_bytes() for name in data.tokenizer_files}
    generation = model_source / GENERATION_CONFIG_FILE
    if generation.is_file():  # on node 0; only global rank 0 writes these files
        files[GENERATION_CONFIG_FILE] = generation.read_bytes()
    return files
