"""The run plan: every decision a run makes from its config and where it runs, made once.

The trainer resolves a :class:`RunPlan` before it builds anything and hands it to every builder; ``python -m
astrai.train --dry-run`` prints it; `invoke preflight` resolves the same plan for the container's world size and
device, so the host and the trainer answer "is this LoRA, in which dtype is its base held, which checkpoint format,
how many completions per prompt" with one function. Torch-free: what torch makes of it (the autocast context, the
device) is the trainer's, from the names here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from astrai.common.backends import BACKEND_TRANSFORMERS, describe_backend, folder_model_type, resolve_backend
from astrai.common.config import TrainerConfig, resolve_grad_accum_steps
from astrai.common.configfile import ConfigError
from astrai.common.contract import CKPT_FORMAT_FULL, CKPT_FORMAT_LORA, CKPT_FORMAT_SHARDED, resolve_parallel_mode
from astrai.common.fit import BatchShape
from astrai.common.memory import GenerationCache, generation_cache, training_state_bytes
from astrai.common.model_folder import ADAPTER_TARGETS, num_adapter_parameters, num_parameters
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
    """The dtype LoRA's frozen base is held in (float32 or bfloat16); None for full fine-tuning."""
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
    """Each transformer block, and generation's decode step, compiled with torch.compile (model.compile resolved:
    auto is on CUDA only)."""
    deterministic: bool
    """Deterministic kernels only (training.deterministic)."""
    backend: str = "native"
    """Which code computes the model: native, or transformers (model.backend resolved for the folder's family)."""
    model_type: str | None = None
    """The model folder's model_type (None: not read)."""
    evaluation: EvalSettings | None = None
    """Generative evaluation in the loop (log.eval_prompts); None: none."""
    eval_rewards: tuple[str, ...] = ()
    """The names of the rewards that score the evaluation."""

    @property
    def model_backend(self) -> tuple[str, str | None]:
        """(backend, model_type), as describe_backend takes them."""
        return self.backend, self.model_type

    @property
    def lora_description(self) -> str:
        """LoRA's settings and the layers it adapts (on the transformers path: every linear layer of the blocks)."""
        described = self.lora.describe()
        if self.backend != BACKEND_TRANSFORMERS:
            return described
        return described.partition(" on ")[0] + " on every linear layer of each decoder block (the family's names)"

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
        in the autocast dtype."""
        adapters = 0 if self.lora is None else num_adapter_parameters(model, self.lora.rank, self.lora.targets)
        parameters = num_parameters(model)
        held = training_state_bytes(parameters, adapters, self.base_dtype)
        if self.parallel_mode == "fsdp":
            held //= self.batch.world_size
        elif self.generations and self.autocast and self.base_dtype != self.autocast:
            held += parameters * 2  # the decode steps' copy of the weights (astrai.trainer.decoding)
        return held

    def generation_cache(self, model, context: int, longest_prompt: int) -> GenerationCache:
        """The key/value caches of the online types' rounds of generation on a rank, at the largest capacity the run
        reaches (its longest prompt and max_completion_length)."""
        return generation_cache(
            model, context, self.rollout_rows, longest_prompt, self.sampling.max_new_tokens, self.autocast
        )

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
            lines.append(f"lora: {self.lora_description}; the frozen base held in {self.base_dtype}, adapters float32")
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
) -> RunPlan:
    """The plan of ``config`` on ``world_size`` processes of ``device_type`` (cpu, cuda); ``parallel_mode`` as the
    launcher resolved it (by default: the config's, ``auto`` resolved for the world size); ``model_folder``: where the
    base model is read from here (by default ckpt.param_path; the host gives its own path). ConfigError when the
    world size does not fit the global batch, or model.backend does not fit the model."""
    training = config.training
    mode = parallel_mode or resolve_parallel_mode(config.parallel.parallel_mode, world_size)
    model_type = folder_model_type(Path(model_folder or config.ckpt.param_path))
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
    if backend == BACKEND_TRANSFORMERS and tuple(training.lora_targets) != ADAPTER_TARGETS:
        raise ConfigError(
            f"training.lora_targets {', '.join(training.lora_targets)}: with model.backend transformers the adapters "
            "go on every linear layer of each decoder block (the family's own names); leave lora_targets unset"
        )
    batch = BatchShape(training.batch_per_device, resolve_grad_accum_steps(training, world_size), world_size)
    lora = LoRASettings.of(training)
    kind = training.kind
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
        autocast="bfloat16" if device_type == "cuda" else None,
        # The transformers path runs eagerly: its blocks are the library's, not ours to compile.
        compile=backend != BACKEND_TRANSFORMERS
        and (config.model.compile is True or (config.model.compile == "auto" and device_type == "cuda")),
        deterministic=training.deterministic,
        backend=backend,
        model_type=model_type,
        evaluation=config.log.evaluation(training),
        eval_rewards=tuple(spec.name for spec in config.log.eval_reward_specs(training)),
    )


def lora_base_dtype(requested: str, device_type: str) -> str:
    """The dtype LoRA's frozen base is held in: ``auto`` is bfloat16 on CUDA (where autocast computes in bfloat16
    anyway) and float32 on CPU (which computes in float32)."""
    if requested != "auto":
        return requested
    return "bfloat16" if device_type == "cuda" else "float32"


def ckpt_format(requested: str | None, parallel_mode: str) -> str:
    """The format of full fine-tuning's checkpoints: ``ckpt.format``, or by default sharded under FSDP, else full."""
    if requested is not None:
        return requested
    return CKPT_FORMAT_SHARDED if parallel_mode == "fsdp" else CKPT_FORMAT_FULL
