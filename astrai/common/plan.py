"""The run plan: every decision a run makes from its config and where it runs, made once.

The trainer resolves a :class:`RunPlan` before it builds anything and hands it to every builder; ``python -m
astrai.train --dry-run`` prints it; `invoke preflight` resolves the same plan for the container's world size and
device, so the host and the trainer answer "is this LoRA, in which dtype is its base held, which checkpoint format,
how many completions per prompt" with one function. Torch-free: what torch makes of it (the autocast context, the
device) is the trainer's, from the names here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from astrai.common.agents import EpisodeSettings
from astrai.common.backends import (
    BACKEND_TRANSFORMERS,
    LibraryModel,
    describe_backend,
    folder_model_type,
    resolve_backend,
)
from astrai.common.config import TrainerConfig, resolve_grad_accum_steps
from astrai.common.configfile import ConfigError
from astrai.common.contract import CKPT_FORMAT_FULL, CKPT_FORMAT_LORA, CKPT_FORMAT_SHARDED, resolve_parallel_mode
from astrai.common.errors import AstraiError
from astrai.common.fit import BatchShape
from astrai.common.memory import GenerationCache, generation_cache, training_state_bytes
from astrai.common.model_folder import ADAPTER_TARGETS, num_adapter_parameters, num_parameters
from astrai.common.nf4 import BLOCK, NF4
from astrai.common.settings import EvalSettings, LoRASettings, Sampling, TypeSettings
from astrai.common.train_types import TRAIN_TYPES, TrainType


@dataclass(frozen=True)
class RunPlan:
    """What a run does, resolved from its config, its world size and its device type."""

    train_type: str
    device_type: str
    """cpu or cuda."""
    parallel_mode: str
    batch: BatchShape
    grad_accum_derived: bool
    """grad_accum_steps was derived from training.global_batch_size."""
    window_size: int
    lora: LoRASettings | None
    """None: full fine-tuning."""
    base_dtype: str | None
    """How LoRA's frozen base is held (float32, bfloat16, or nf4: the blocks' matrices in 4 bits); None for full
    fine-tuning."""
    ckpt_format: str
    """full, sharded (every rank writes its rows) or lora (the adapters alone, written by rank 0)."""
    generations: int | None
    """Completions per prompt of the online types (online_dpo: two); None for the others (grpo: the data's)."""
    sampling: Sampling | None
    """How the online types sample their completions; None for the others."""
    settings: TypeSettings | None
    """The train type's own settings (GRPO's for online_grpo and grpo); None for a type without."""
    autocast: str | None
    """The dtype the forward pass computes in under autocast (bfloat16 on CUDA); None: the weights' own."""
    compile: bool
    """Each transformer block, and a native model's decode step, compiled with torch.compile (model.compile resolved
    by :func:`resolve_compile`)."""
    deterministic: bool
    """Deterministic kernels only (training.deterministic)."""
    backend: str = "native"
    """Which code computes the model: native, or transformers (model.backend resolved for the folder's family)."""
    episodes: EpisodeSettings | None = None
    """The online types' episodes (tools, an environment) and their limits; None: one completion per prompt."""
    model_type: str | None = None
    """The model folder's model_type (None: not read)."""
    library: LibraryModel | None = None
    """On the transformers path, what the library builds for the folder (its attention, its router's loss); None
    when it was not looked at (native, or a folder not here)."""
    evaluation: EvalSettings | None = None
    """Generative evaluation in the loop (log.eval_prompts); None: none."""
    eval_rewards: tuple[str, ...] = ()
    """The names of the rewards that score the evaluation."""

    @property
    def model_backend(self) -> tuple[str, str | None, LibraryModel | None]:
        """(backend, model_type, library), as describe_backend takes them."""
        return self.backend, self.model_type, self.library

    @property
    def lora_description(self) -> str:
        """LoRA's settings and the layers it adapts (on the transformers path: every linear layer of the blocks)."""
        described = self.lora.describe()
        if self.backend != BACKEND_TRANSFORMERS:
            return described
        return described.partition(" on ")[0] + " on every linear layer of each decoder block (the family's names)"

    @property
    def base_description(self) -> str:
        """How LoRA's frozen base is held, in words."""
        if self.base_dtype != NF4:
            return str(self.base_dtype)
        return (
            f"nf4 (the blocks' linear layers in torchao's NF4: blocks of {BLOCK}, double-quantised scales, each "
            f"dequantised to {self.autocast or 'float32'} one layer at a time; the embeddings and head bfloat16)"
        )

    @property
    def grad_accum(self) -> int:
        return self.batch.grad_accum

    @property
    def global_batch(self) -> int:
        return self.batch.global_batch

    @property
    def kind(self) -> TrainType:
        """The train type's entry (astrai.common.train_types)."""
        return TRAIN_TYPES[self.train_type]

    @property
    def tokens_per_step(self) -> int:
        """Tokens of a step of the window-based types (DPO trains each pair as two rows)."""
        return self.global_batch * self.window_size * self.kind.rows_per_unit

    @property
    def rollout_rows(self) -> int:
        """The rows one round of generation samples on a rank: every micro-batch of a step, each prompt
        ``generations`` times."""
        return self.batch.batch_per_device * self.grad_accum * (self.generations or 1)

    def state_bytes(self, model) -> int:
        """What the training state of ``model`` (a ModelConfig) takes per rank, before activations: weights,
        gradients and AdamW's moments (FSDP shards them), and for generation under autocast a copy of float32 weights
        in the autocast dtype (an NF4 base is read as it is held)."""
        adapters = 0 if self.lora is None else num_adapter_parameters(model, self.lora.rank, self.lora.targets)
        held = training_state_bytes(model, adapters, self.base_dtype)
        if self.parallel_mode == "fsdp":
            held //= self.batch.world_size
        elif self.generations and self.autocast and self.base_dtype not in (self.autocast, NF4):
            # the decode steps' copy of the weights (astrai.trainer.generation.decoding)
            held += num_parameters(model) * 2
        return held

    def generation_cache(self, model, context: int, longest_prompt: int) -> GenerationCache:
        """The key/value caches of the online types' rounds of generation on a rank, at the largest capacity the run
        reaches (its longest prompt and max_completion_length)."""
        # Episodes: the rows of a round share the cache's slots, so one row's longest episode and another's longest
        # turn must fit together (astrai.trainer.generation.decoding.DecodeEngine.episodes).
        room = self.completion_room + (self.sampling.max_new_tokens if self.episodes is not None else 0)
        return generation_cache(model, context, self.rollout_rows, longest_prompt, room, self.autocast)

    @property
    def completion_room(self) -> int:
        """Tokens after a prompt the online types' context must hold: a completion's (max_completion_length), or an
        episode's (max_episode_tokens: its turns and the replies between them)."""
        return self.sampling.max_new_tokens if self.episodes is None else self.episodes.max_episode_tokens

    def lines(self) -> list[str]:
        """The plan as ``--dry-run`` prints it, a decision a line."""
        batch = self.batch
        derived = " (derived from global_batch_size)" if self.grad_accum_derived else ""
        lines = [
            f"train type: {self.train_type}",
            f"world size: {batch.world_size}",
            f"device: {self.device_type} (parallel mode {self.parallel_mode})",
            f"global batch: batch_per_device({batch.batch_per_device}) * grad_accum_steps({batch.grad_accum}){derived}"
            f" * world_size({batch.world_size}) = {batch.global_batch} {self._unit()} per step",
            f"compute: {'autocast ' + self.autocast if self.autocast else 'float32'}"
            f"{', each block compiled' if self.compile else ', eager'}"
            f"{', deterministic kernels only' if self.deterministic else ''}",
            f"model: {describe_backend(*self.model_backend)}",
        ]
        if self.lora is not None:
            base = self.base_description
            lines.append(f"lora: {self.lora_description}; the frozen base held in {base}, adapters float32")
        how = {
            CKPT_FORMAT_FULL: "rank 0 gathers the state and writes it",
            CKPT_FORMAT_SHARDED: "every rank writes its own rows",
            CKPT_FORMAT_LORA: "the adapters alone, written by rank 0; the base stays in ckpt.param_path",
        }[self.ckpt_format]
        lines.append(f"checkpoints: {self.ckpt_format} format ({how})")
        if self.sampling is not None:
            s = self.sampling
            lines.append(
                f"sampling: {self.generations} completions per prompt of at most {s.max_new_tokens} tokens, "
                f"temperature {s.temperature:g}, top_k {s.top_k}, top_p {s.top_p:g}"
            )
        if self.settings is not None:
            lines.append(f"{self.train_type}: {self.settings.describe()}")
        if self.episodes is not None:
            lines.append(f"episodes: {self.episodes.describe()}")
        if self.evaluation is not None:
            lines.append(f"evaluation: {self.evaluation.describe(list(self.eval_rewards))}")
        return lines

    def _unit(self) -> str:
        return self.kind.unit


def resolve_plan(
    config: TrainerConfig,
    device_type: str,
    world_size: int,
    parallel_mode: str | None = None,
    model_folder: Path | None = None,
    inspect: Callable[[Path, bool], LibraryModel] | None = None,
) -> RunPlan:
    """The plan of ``config`` on ``world_size`` processes of ``device_type`` (cpu, cuda); ``parallel_mode`` as the
    launcher resolved it (by default: the config's, ``auto`` resolved for the world size); ``model_folder``: where the
    base model is read from here (by default ckpt.param_path; the host gives its own path); ``inspect(folder, lora)``:
    what transformers builds for a folder on the transformers path (the trainer's
    :func:`astrai.trainer.models.hf_model.inspect_folder`), made without the weights. ConfigError when the world
    size does not fit the global batch, model.backend does not fit the model, or transformers refuses the folder."""
    training = config.training
    mode = parallel_mode or resolve_parallel_mode(config.parallel.parallel_mode, world_size)
    folder = Path(model_folder or config.ckpt.param_path)
    model_type = folder_model_type(folder)
    try:
        backend = resolve_backend(config.model.backend, model_type)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if backend == BACKEND_TRANSFORMERS and mode == "fsdp":
        raise ConfigError(
            "parallel.parallel_mode: fsdp is not supported with model.backend transformers; use none or ddp"
        )
    if backend == BACKEND_TRANSFORMERS and config.ckpt.format == CKPT_FORMAT_SHARDED:
        raise ConfigError("ckpt.format: sharded is not supported with model.backend transformers; use full")
    if backend == BACKEND_TRANSFORMERS and training.lora_rank and training.lora_base_dtype == NF4:
        raise ConfigError(
            "training.lora_base_dtype: nf4 is not supported with model.backend transformers (the NF4 base is the "
            "native model's); use bfloat16, or a family the trainer computes itself"
        )
    if backend == BACKEND_TRANSFORMERS and tuple(training.lora_targets) != ADAPTER_TARGETS:
        raise ConfigError(
            f"training.lora_targets {', '.join(training.lora_targets)}: with model.backend transformers the adapters "
            "go on every linear layer of each decoder block (the family's own names); leave lora_targets unset"
        )
    batch = BatchShape(training.batch_per_device, resolve_grad_accum_steps(training, world_size), world_size)
    lora = LoRASettings.of(training)
    kind = training.kind
    library = None
    if backend == BACKEND_TRANSFORMERS and inspect is not None and model_type is not None:
        try:
            library = inspect(folder, lora is not None)
        except AstraiError as error:  # a folder the trainer refuses: the run is refused before anything starts
            raise ConfigError(str(error)) from None
    return RunPlan(
        train_type=training.train_type,
        device_type=device_type,
        parallel_mode=mode,
        batch=batch,
        grad_accum_derived=training.global_batch_size is not None,
        window_size=config.data.window_size,
        lora=lora,
        base_dtype=None if lora is None else lora_base_dtype(training.lora_base_dtype, device_type),
        ckpt_format=CKPT_FORMAT_LORA if lora is not None else ckpt_format(config.ckpt.format, mode),
        generations=kind.completions_per_prompt(training),
        sampling=training.sampling() if kind.online else None,
        settings=kind.own_settings(training),
        autocast=autocast_dtype(device_type),
        compile=resolve_compile(config.model.compile, device_type, backend),
        deterministic=training.deterministic,
        backend=backend,
        model_type=model_type,
        library=library,
        episodes=training.episodes() if kind.online else None,
        evaluation=config.log.evaluation(training),
        eval_rewards=tuple(spec.name for spec in config.log.eval_reward_specs(training)),
    )


def resolve_compile(requested: bool | str, device_type: str, backend: str) -> bool:
    """``model.compile`` resolved: true compiles the blocks on either path (the transformers path: the library's
    decoder blocks); auto compiles a native model's on CUDA only, and leaves the library's code eager (it is not
    ours to vouch for under the compiler)."""
    if requested == "auto":
        return device_type == "cuda" and backend != BACKEND_TRANSFORMERS
    return requested is True


def autocast_dtype(device_type: str) -> str | None:
    """What autocast computes in on a device: bfloat16 on CUDA; None on a CPU, which trains in float32 (autocast would
    only slow it down)."""
    return "bfloat16" if device_type == "cuda" else None


def compute_dtype(device_type: str) -> str:
    """The dtype a device computes a model in, training or generating: autocast's, else float32."""
    return autocast_dtype(device_type) or "float32"


def lora_base_dtype(requested: str, device_type: str) -> str:
    """How LoRA's frozen base is held: ``auto`` is what the device computes in (bfloat16 on CUDA, float32 on a CPU);
    float32, bfloat16 and nf4 as asked."""
    return compute_dtype(device_type) if requested == "auto" else requested


def ckpt_format(requested: str | None, parallel_mode: str) -> str:
    """The format of full fine-tuning's checkpoints: ``ckpt.format``, or by default sharded under FSDP, else full."""
    if requested is not None:
        return requested
    return CKPT_FORMAT_SHARDED if parallel_mode == "fsdp" else CKPT_FORMAT_FULL
