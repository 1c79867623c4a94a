"""Do the data, the model and the batch fit together? One set of checks for the trainer and `invoke preflight`.

Torch-free: preflight runs them on the host, before a container starts, with the
same messages the trainer would print inside it.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from astrai.common.backends import through_transformers
from astrai.common.checkpoints import CheckpointMeta
from astrai.common.contract import TOKENIZER_FILE, resolve_parallel_mode
from astrai.common.data_folder import (
    DATA_KINDS,
    DataError,
    PromptUnits,
    TokenData,
    WindowSplit,
    data_kind,
    prompt_units,
    tokenizer_digest,
)
from astrai.common.errors import AstraiError
from astrai.common.model_folder import EXPERT_ADAPTERS, ModelConfig, adapted_modules
from astrai.common.nf4 import NF4, nf4_problem
from astrai.common.settings import LoRASettings


class SetupError(AstraiError):
    """Inputs that do not fit together (data vs model vs batch); the message shows the numbers."""


@dataclass(frozen=True)
class BatchShape:
    """How many windows one optimizer step takes, and how they are split."""

    batch_per_device: int
    grad_accum: int
    world_size: int

    @property
    def global_batch(self) -> int:
        return self.batch_per_device * self.grad_accum * self.world_size


def check_fit(
    data: TokenData,
    model: ModelConfig,
    model_source: Path,
    window_size: int,
    val_fraction: float,
    batch: BatchShape,
    repeated: bool = False,
    units: int | None = None,
) -> WindowSplit:
    """The train/validation split of ``data``; SetupError when data, model and batch do not fit together.

    ``model_source`` names the model folder in messages (the base model or the checkpoint it came from).
    A source of a mixture (``repeated``) is repeated as often as its share needs: one window is enough.
    ``units`` counts what post-training data trains on instead of windows: packed SFT windows, DPO pairs.
    """
    if data.vocab_size > model.vocab_size:
        fix = (
            f"prepare the data with this model's own tokenizer ({tokenizer_hint(Path(model_source))})"
            if data.tokenizer_sha256 is not None
            else f"init a model with --vocab_size {data.vocab_size} or more"
        )
        raise SetupError(
            f"data vocabulary {data.vocab_size} ({data.tokenizer_description}, {data.root}) does not fit "
            f"the model's vocab_size {model.vocab_size} ({model_source}); {fix}"
        )
    if window_size > model.context:
        raise SetupError(
            f"data.window_size {window_size} exceeds the model's context of {model.context} tokens "
            f"({_context_words(model)}; {model_source}); lower data.window_size to {model.context} or less"
        )
    split = WindowSplit.from_fraction(data.num_windows(window_size) if units is None else units, val_fraction)
    held_out = f" ({split.num_val} held out for validation)" if split.num_val else ""
    if val_fraction > 0 and not split.num_val:
        raise SetupError(
            f"data.val_fraction {val_fraction} holds out no window: {data.root} has only "
            f"{split.num_windows} windows of {window_size}+1 (lower window_size or add data)"
        )
    if repeated and split.num_train < 1:
        raise SetupError(
            f"{data.root} holds {data.num_tokens} tokens, not one training window of {window_size}+1{held_out}; "
            "add data to this source, or lower window_size"
        )
    if units is not None and split.num_train < batch.global_batch:
        what = data_kind(data.kind).trains.format(window=window_size)
        raise SetupError(
            f"{data.root} holds {split.num_train} training {what}{held_out}, fewer than one global batch of "
            f"batch_per_device({batch.batch_per_device}) * grad_accum_steps({batch.grad_accum}) * "
            f"world_size({batch.world_size}) = {batch.global_batch}"
        )
    if units is None and not repeated and split.num_train < batch.global_batch:
        raise SetupError(
            f"{data.root} holds {data.num_tokens} tokens = {split.num_train} training windows of {window_size}+1"
            f"{held_out}, fewer than one global batch of batch_per_device({batch.batch_per_device}) * "
            f"grad_accum_steps({batch.grad_accum}) * world_size({batch.world_size}) = {batch.global_batch}"
        )
    return split


def tokenizer_hint(model_folder: Path) -> str:
    """The ``--tokenizer`` argument to suggest: the model folder when it holds a tokenizer, else a placeholder (a
    hint naming a folder without one would only fail in its turn)."""
    if (Path(model_folder) / TOKENIZER_FILE).is_file():
        return f"--tokenizer {shlex.quote(str(model_folder))}"
    return f"--tokenizer PATH (the {TOKENIZER_FILE} the model was trained with; {model_folder} holds none)"


def check_model_tokenizer(data: TokenData, model_folder: Path) -> None:
    """Data must be tokenized by the model folder's own tokenizer, when the folder has one: another tokenizer
    of the same vocabulary size gives ids that mean other text, and would replace the model's in checkpoints."""
    model_file = Path(model_folder) / TOKENIZER_FILE
    if not model_file.is_file():
        return
    ours = data.tokenizer_meaning()
    if ours == tokenizer_digest(model_file):
        return
    what = "byte by byte" if ours is None else f"with another tokenizer ({data.tokenizer_description})"
    raise SetupError(
        f"{data.root} was prepared {what}, but the model {model_folder} has its own {TOKENIZER_FILE} "
        f"(sha256 {_file_sha256(model_file)[:12]}): the same ids would mean other text; prepare the data with "
        f"the model's tokenizer (python -m astrai.data prepare {tokenizer_hint(model_folder)} ...)"
    )


def _file_sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_same_tokenizer(datas: list[TokenData], names: list[str]) -> None:
    """The sources of a mixture must share one tokenizer: the same ids must mean the same text in all of them."""
    first = datas[0]
    for data, name in zip(datas[1:], names[1:], strict=True):
        if data.tokenizer_identity != first.tokenizer_identity:
            raise SetupError(
                f"data.sources: {name} was prepared with {data.tokenizer_description} (vocabulary {data.vocab_size}), "
                f"{names[0]} with {first.tokenizer_description} (vocabulary {first.vocab_size}); prepare every source "
                "with the same --tokenizer"
            )


def _check_same_lora(meta: CheckpointMeta, folder: Path, training) -> None:
    """A LoRA checkpoint resumes only as LoRA with the same adapters' shapes and scaling, and a full one only as full
    fine-tuning: one job dir holds one run."""
    lora, ours = meta.lora, LoRASettings.of(training)
    if lora is None and ours is None:
        return
    if lora is None or ours is None:
        held = "full fine-tuning weights" if lora is None else f"LoRA adapters (rank {lora['rank']})"
        wanted = f"lora_rank {ours.rank}" if ours is not None else "full fine-tuning (lora_rank 0)"
        raise SetupError(
            f"{folder} holds {held}, and this config trains {wanted}: a job dir holds one run. Set "
            f"training.lora_rank back to {lora['rank'] if lora else 0}, or start a new job (its own ckpt_dir)"
        )
    theirs = LoRASettings(lora["rank"], float(lora["alpha"]), float(lora.get("dropout", 0.0)), tuple(lora["targets"]))
    if theirs.identity != ours.identity:
        (rank, alpha, targets), (our_rank, our_alpha, our_targets) = theirs.identity, ours.identity
        raise SetupError(
            f"{folder} holds LoRA adapters of rank {rank}, alpha {alpha:g} on {', '.join(targets)}, and "
            f"this config asks for rank {our_rank}, alpha {our_alpha:g} on {', '.join(our_targets)}: they cannot carry "
            "over. Set training.lora_rank, lora_alpha and lora_targets back, or start a new job (its own ckpt_dir)"
        )


def _shown(value) -> str:
    return ", ".join(value) if isinstance(value, list) else str(value)


def check_resume(
    meta: CheckpointMeta, folder: Path, training, data_digest: str | None, base_dtype: str | None = None
) -> list[str]:
    """What a resume from checkpoint ``meta`` (in ``folder``) cannot carry over raises SetupError; what it carries
    over differently comes back as notes to announce. One rule for the trainer and `invoke preflight`.
    ``base_dtype``: what LoRA's base is held in on this device (``training.lora_base_dtype`` resolved)."""
    train_type = meta.train_type or "seq"
    if train_type != training.train_type:
        raise SetupError(
            f"{folder} is a checkpoint of a {train_type} run, and this config trains {training.train_type}: a job "
            f"dir holds one run. To train {training.train_type} from that checkpoint, start a new job (its own "
            "ckpt_dir) with ckpt.param_path set to it"
        )
    if meta.optimizer is not None and meta.optimizer != training.optimizer:
        raise SetupError(
            f"{folder} holds {meta.optimizer} moments, and this config asks for training.optimizer "
            f"{training.optimizer}: they cannot carry over. Resume with training.optimizer: {meta.optimizer}, or "
            f"start a new job (its own ckpt_dir) with ckpt.param_path set to that checkpoint"
        )
    _check_same_lora(meta, folder, training)
    notes = []
    if meta.lora is not None and meta.lora.get("dropout") != training.lora_dropout:
        notes.append(f"lora_dropout {meta.lora.get('dropout')} -> {training.lora_dropout} since {folder.name}")
    held, wanted = (meta.lora or {}).get("base_dtype", "float32"), base_dtype or training.lora_base_dtype
    if meta.lora is not None and wanted != "auto" and held != wanted:
        notes.append(f"lora_base_dtype {held} -> {wanted} since {folder.name}: the frozen base is held differently")
    now = training.kind.recorded_settings(training) or {}
    for key, before in (meta.rewards or {}).items():
        if key in now and now[key] != before:
            notes.append(f"training.{key} {_shown(before)} -> {_shown(now[key])} since {folder.name}")
    if meta.data_digest is not None and data_digest is not None and meta.data_digest != data_digest:
        notes.append(
            f"the data was prepared again since {folder.name} was written (data digest {meta.data_digest} -> "
            f"{data_digest}): training goes on at the same position of another data set, whose windows differ "
            "from those the run would have seen"
        )
    return notes


def _context_words(model) -> str:
    """Where a model's context comes from, in a few words."""
    if model.context == model.max_seq_len:
        return f"its max_position_embeddings {model.max_seq_len}"
    return f"max_position_embeddings {model.max_seq_len} as its RoPE scaling stretches it"


def completion_room(training) -> tuple[int, str]:
    """(the tokens after a prompt the online types' context must hold, the key that says so): max_completion_length,
    or max_episode_tokens for a run of episodes (tools, an environment)."""
    episodes = training.episodes()
    if episodes is None:
        return training.max_completion_length, "max_completion_length"
    return episodes.max_episode_tokens, "max_episode_tokens"


def prompt_room(
    model: ModelConfig, completion: int, model_source: Path, key: str = "max_completion_length"
) -> tuple[int, int]:
    """(the model's context, the tokens of it a prompt may keep) for the online types, which score prompt and
    completion (``completion`` tokens at most, ``training.<key>``) in one pass; SetupError when it leaves no room."""
    limit = model.context
    room = limit - completion
    if room < 1:
        raise SetupError(
            f"training.{key} {completion} leaves no room for a prompt in the context of "
            f"{limit} tokens of the model {model_source}; lower it below {limit}"
        )
    return limit, room


def fit_prompts(data: TokenData, lengths: list[int], model: ModelConfig, training, overlong: str, source: Path):
    """The prompts an online run samples from (astrai.common.data_folder.PromptUnits), each cut or left out to leave
    room for max_completion_length (an episode's max_episode_tokens); SetupError when none is left."""
    completion, key = completion_room(training)
    limit, room = prompt_room(model, completion, source, key)
    units = prompt_units(lengths, room, overlong)
    if not len(units):
        raise SetupError(_no_prompt_left(data.root, lengths, limit, completion, source, key))
    return units


def _no_prompt_left(
    root: Path, lengths: list[int], limit: int, completion: int, source: Path, key: str = "max_completion_length"
) -> str:
    """Why data.overlong: drop left out every prompt, and only the remedies that would leave some in."""
    shortest, longest = min(lengths, default=0), max(lengths, default=0)
    remedies = [
        f"a model with a longer context (at least {shortest + completion} tokens for the shortest prompt, "
        f"{longest + completion} for all)",
        "shorter prompts (prepare them again)",
        f"data.overlong: truncate (each prompt keeps its last {limit - completion} tokens)",
    ]
    if shortest < limit:  # only then can a shorter completion leave room for one
        remedies.insert(0, f"training.{key} {limit - shortest} or less (room for the shortest prompt)")
    return (
        f"every prompt of {root} is longer than the {limit - completion} tokens {key} {completion} "
        f"leaves of the context of {limit} tokens of the model {source} (its prompts have {shortest} to {longest} "
        f"tokens), and data.overlong: drop leaves them all out; what can work: {'; '.join(remedies)}"
    )


def open_eval_prompts(folder: Path) -> TokenData:
    """The prompts folder of log.eval_prompts; DataError naming the key when it cannot be read."""
    try:
        return TokenData.open(folder)
    except DataError as error:
        raise DataError(f"log.eval_prompts: {error}") from None


def eval_prompt_units(
    evaluation, eval_data: TokenData, data: TokenData, model: ModelConfig, overlong: str, source: Path
) -> PromptUnits:
    """The prompts of log.eval_prompts the evaluation completes (astrai.common.data_folder.PromptUnits), each cut or
    left out to leave room for its completions in the model's context; SetupError (or DataError) naming the key for a
    folder of another kind, of another tokenizer than the run's data, or with no prompt left."""
    where = f"log.eval_prompts: {eval_data.root}"
    if eval_data.kind != "prompts":
        raise DataError(
            f"{where} holds {DATA_KINDS[eval_data.kind].holds} (kind {eval_data.kind}); the evaluation completes "
            f"prompts: prepare them with `python -m astrai.data prepare --kind prompts {tokenizer_hint(source)} --out "
            "DIR FILE...`"
        )
    if eval_data.tokenizer_identity != data.tokenizer_identity:
        raise SetupError(
            f"{where} was prepared with {eval_data.tokenizer_description}, the run's data {data.root} with "
            f"{data.tokenizer_description}: the same ids would mean other text; prepare both with the same --tokenizer"
        )
    try:
        limit, room = prompt_room(model, evaluation.sampling.max_new_tokens, source)
    except SetupError as error:
        what = "log.eval_max_completion_length (its default: training.max_completion_length)"
        raise SetupError(f"{what}: {error}") from None
    lengths = [length for shard in range(len(eval_data.shard_files)) for length in eval_data.sequence_lengths(shard)]
    units = prompt_units(lengths, room, overlong)
    if not len(units):
        raise SetupError(
            f"{where}: every prompt is longer than {room} tokens, the room its completions of "
            f"{evaluation.sampling.max_new_tokens} tokens leave in the model's context of {limit}; lower "
            "log.eval_max_completion_length, or set data.overlong: truncate"
        )
    return units


def check_lora_targets(model: ModelConfig, training, shards: int = 1) -> None:
    """LoRA's targets must name layers this model's family has, a fused layer whole (astrai.common.model_folder); an
    NF4 base must fit the model, sharded over ``shards`` ranks under FSDP (astrai.common.nf4)."""
    settings = LoRASettings.of(training)
    if settings is None or through_transformers(model):  # the transformers path: its plan checks the targets
        return
    lora_modules(model, settings)
    if training.lora_base_dtype == NF4:
        problem = nf4_problem(model, shards)
        if problem is not None:
            raise SetupError(problem)


def fsdp_shards(config, world_size: int) -> int:
    """How many ranks FSDP shards each weight over: the world size under fsdp, else 1."""
    try:
        mode = resolve_parallel_mode(config.parallel.parallel_mode, world_size)
    except ValueError:  # the run plan refuses it, with its own words
        return 1
    return world_size if mode == "fsdp" else 1


def lora_modules(model: ModelConfig, settings: LoRASettings) -> tuple[str, ...]:
    """The layers of each block LoRA of ``settings`` adapts in ``model``'s family; SetupError naming the key for
    targets it cannot take, and for dropout on a mixture of experts' adapters (they have none, as in PEFT)."""
    try:
        modules = adapted_modules(model, settings.targets)
    except ValueError as error:
        raise SetupError(f"training.{error}") from None
    if settings.dropout > 0 and set(modules) & set(EXPERT_ADAPTERS):
        raise SetupError(
            f"training.lora_dropout {settings.dropout}: adapters on the experts cannot drop out (PEFT refuses it "
            "too: the update is computed on the experts' stacked weights); set lora_dropout 0, or leave gate_proj, "
            "up_proj and down_proj out of lora_targets"
        )
    return modules


@dataclass(frozen=True)
class StartFit:
    """What start_checks found: each data folder's train/validation split, and the post-training units (prompts,
    packed windows, pairs; None for seq; grpo's count of prompts with their completions)."""

    splits: list[WindowSplit]
    units: object


def start_checks(config, batch: BatchShape, datas: list[TokenData], model: ModelConfig, model_source: Path) -> StartFit:
    """Every refusal the trainer makes at its start from the config, the data and the model folders alone, made the
    same way for `invoke preflight` and `--dry-run` (SetupError): the tokenizer, the prompts' room, the LoRA targets,
    and each data folder's fit (check_fit)."""
    training, window = config.training, config.data.window_size
    check_model_tokenizer(datas[0], model_source)
    check_lora_targets(model, training, fsdp_shards(config, batch.world_size))
    units = None
    if training.kind.online:
        lengths = [length for shard in range(len(datas[0].shard_files)) for length in datas[0].sequence_lengths(shard)]
        window, units = 1, fit_prompts(datas[0], lengths, model, training, config.data.overlong, model_source)
    elif (count_units := data_kind(training.kind.data_kind).units) is not None:
        units = count_units(datas[0], window, config.data.overlong)
    mixed, count = config.data.sources is not None, None if units is None else _count(units)
    splits = [
        check_fit(data, model, model_source, window, config.data.val_fraction, batch, repeated=mixed, units=count)
        for data in datas
    ]
    return StartFit(splits, units)


def _count(units) -> int:
    return units if isinstance(units, int) else len(units)
