"""Which code computes a model: the trainer's own (``native``), or ``transformers`` for the families it lacks.

``model.backend: auto`` (the default) is ``native`` when the model folder's ``model_type`` is one of the families
the trainer computes itself (:data:`astrai.common.model_config.MODEL_TYPES`), else ``transformers``: any folder
``transformers.AutoModelForCausalLM`` loads trains through :mod:`astrai.trainer.models.hf_model`, slower than a native
family. ``native`` with another family is refused, naming ``model.backend: transformers`` as the way to train it.

A folder trained through transformers is described by :class:`TransformersConfig`: its ``config.json`` as it is
(written back unchanged into every checkpoint), and the few sizes the trainer checks a run against. Torch-free:
the host (preflight, ``--dry-run``, the image) and the trainer decide the backend with the same function.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from astrai.common.contract import MODEL_CONFIG_FILE
from astrai.common.model_config import MODEL_TYPES, ModelConfig, context_length, quantized_weights, read_config_json
from astrai.common.safetensors_file import ModelLoadError

BACKEND_AUTO, BACKEND_NATIVE, BACKEND_TRANSFORMERS = "auto", "native", "transformers"
BACKENDS = (BACKEND_AUTO, BACKEND_NATIVE, BACKEND_TRANSFORMERS)
"""What ``model.backend`` takes."""
TRANSFORMERS_PACKAGE = "transformers==5.25.0"
"""What the trainer image installs for a job whose plan trains through transformers (the version the tests run)."""


def folder_model_type(folder: Path) -> str | None:
    """The ``model_type`` of a model folder's config.json; None when there is none to read (the run says why)."""
    try:
        model_type = read_config_json(folder).get("model_type")
    except ModelLoadError:
        return None
    return model_type if isinstance(model_type, str) else None


def resolve_backend(requested: str, model_type: str | None) -> str:
    """``native`` or ``transformers`` for ``model.backend`` and the folder's ``model_type`` (None: unknown, which
    ``auto`` takes as native, whose loader then says what is wrong with the folder). ValueError for ``native`` with a
    family the trainer does not compute."""
    if requested == BACKEND_TRANSFORMERS:
        return BACKEND_TRANSFORMERS
    native = model_type is None or model_type in MODEL_TYPES
    if requested == BACKEND_NATIVE and not native:
        raise ValueError(
            f"model.backend: native, but model_type {model_type!r} has no native implementation (native families: "
            f"{', '.join(MODEL_TYPES)}); set model.backend: transformers (or auto) to train it through transformers"
        )
    return BACKEND_NATIVE if native else BACKEND_TRANSFORMERS


def describe_backend(backend: str, model_type: str | None, library: LibraryModel | None = None) -> str:
    """One line saying which code computes the model, as preflight and ``--dry-run`` print it (on the transformers
    path, with what the library builds when it was looked at)."""
    name = model_type or "the model"
    if backend == BACKEND_NATIVE:
        return f"{name} native"
    why = "no native implementation" if model_type not in MODEL_TYPES else "model.backend: transformers"
    built = f"; {library.describe()}" if library is not None else ""
    return f"{name} via transformers ({why}: slower than native families){built}"


ATTENTION_PREFERRED = "sdpa"
"""The attention a model trained through transformers computes with, when its family supports it."""


@dataclass(frozen=True)
class LibraryModel:
    """What transformers builds for a model folder, found without its weights (:func:`astrai.trainer.models.hf_model.
    inspect_folder`: the config read as ``AutoConfig.from_pretrained`` reads it, the model made on the meta device,
    its output and its adapters' layers looked at), for the run plan to say."""

    model_type: str
    attention: str
    """The attention implementation: sdpa, or the one transformers falls back to for a family without it (eager)."""
    router_aux_loss_coef: float | None = None
    """A mixture of experts: the weight of its router's load-balancing loss, which the trainer adds to the loss as
    the native path does (None: no router)."""

    def describe(self) -> str:
        attention = f"attention {self.attention}"
        if self.attention != ATTENTION_PREFERRED:
            attention += f" ({self.model_type} does not support {ATTENTION_PREFERRED}; the best it supports)"
        if self.router_aux_loss_coef is None:
            return attention
        return f"{attention}; the router's load-balancing loss x {self.router_aux_loss_coef:g} added to the loss"


@dataclass(frozen=True)
class TransformersConfig:
    """A model trained through transformers: its ``config.json`` (``values``) and the sizes a run is checked
    against, read with the names transformers' configs commonly use."""

    model_type: str
    vocab_size: int
    max_seq_len: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden_dim: int
    tie_embeddings: bool
    bos_token_id: object = None
    eos_token_id: object = None
    pad_token_id: object = None
    values: dict = field(default_factory=dict, compare=False, repr=False)
    folder: Path | None = field(default=None, compare=False, repr=False)
    """The folder it was read from: transformers reads its config.json there itself (AutoConfig.from_pretrained)."""
    rope_depends_on_length: bool = False

    @classmethod
    def from_dict(cls, values: dict, where: str = MODEL_CONFIG_FILE, folder: Path | None = None) -> TransformersConfig:
        refused = quantized_weights(values)
        if refused is not None:
            raise ModelLoadError(f"{where}: {refused}")

        def number(*keys, default=None) -> int:
            for key in keys:
                value = values.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
            if default is not None:
                return default
            raise ModelLoadError(f"{where}: {' or '.join(keys)} must be a positive integer")

        dim = number("hidden_size", "n_embd", "d_model")
        heads = number("num_attention_heads", "n_head")
        return cls(
            model_type=values["model_type"],
            vocab_size=number("vocab_size"),
            max_seq_len=number("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"),
            dim=dim,
            n_layers=number("num_hidden_layers", "n_layer"),
            n_heads=heads,
            n_kv_heads=number("num_key_value_heads", "multi_query_group_num", default=heads),
            ffn_hidden_dim=number("intermediate_size", "n_inner", "ffn_hidden_size", default=4 * dim),
            tie_embeddings=bool(values.get("tie_word_embeddings", False)),
            bos_token_id=values.get("bos_token_id"),
            eos_token_id=values.get("eos_token_id"),
            pad_token_id=values.get("pad_token_id"),
            values=values,
            folder=folder,
        )

    @classmethod
    def load(cls, folder: Path) -> TransformersConfig:
        values, where = read_config_json(folder), str(Path(folder) / MODEL_CONFIG_FILE)
        if not isinstance(values.get("model_type"), str):
            raise ModelLoadError(f"{where}: expected a JSON object with a model_type")
        return cls.from_dict(values, where, Path(folder))

    @property
    def head_size(self) -> int:
        return self.dim // self.n_heads

    @property
    def context(self) -> int:
        """The longest sequence the model takes: max_position_embeddings as its RoPE scaling stretches it (the rule
        of :func:`astrai.common.model_config.context_length`; a RoPE per kind of layer: the longest)."""
        return max(context_length(self.max_seq_len, *_stretch(rope, self.values)) for rope in _ropes(self.values))

    # The layer features astrai.common.layers reads (the FLOP count, the key/value cache): this path's model is
    # described as plain grouped-query attention and a dense gated MLP of its sizes, the estimate its MFU already is
    # (a mixture of experts counted as dense).
    sparse_layers: tuple[int, ...] = ()
    n_experts: int = 0
    experts_per_token: int = 0
    expert_hidden_dim: int | None = None
    fused_projections: bool = False
    attention_bias: bool = False
    qk_norm: str | None = None
    block_norms: str = "pre"

    def to_json(self) -> str:
        """config.json as the folder had it: a checkpoint loads in transformers as its base model does."""
        return json.dumps(self.values, indent=2, sort_keys=True, allow_nan=False) + "\n"


def _ropes(values: dict) -> list[dict]:
    """The RoPE settings of a config.json: 5.x's rope_parameters (one object, or one per kind of layer) or 4.x's
    rope_scaling; [{}] for none."""
    found = values.get("rope_parameters") or values.get("rope_scaling")
    if not isinstance(found, dict):
        return [{}]
    return [rope for rope in found.values() if isinstance(rope, dict)] or [found]


def _stretch(rope: dict, values: dict) -> tuple[str | None, float | None, int | None]:
    """(rope_type, factor, original_max_position_embeddings) of one RoPE's settings, None for what it lacks."""
    kind = rope.get("rope_type", rope.get("type"))
    factor = rope.get("factor")
    original = rope.get("original_max_position_embeddings", values.get("original_max_position_embeddings"))
    return (
        kind if isinstance(kind, str) else None,
        float(factor) if isinstance(factor, (int, float)) and not isinstance(factor, bool) and factor > 0 else None,
        original if isinstance(original, int) and not isinstance(original, bool) and original > 0 else None,
    )


def through_transformers(config: ModelConfig | TransformersConfig) -> bool:
    """Whether a model of ``config`` is computed by transformers (a :class:`TransformersConfig`), not the trainer."""
    return isinstance(config, TransformersConfig)


def load_model_config(folder: Path, backend: str | None = None) -> ModelConfig | TransformersConfig:
    """A model folder's config for ``backend`` (native or transformers; None: by its model_type, as ``auto``)."""
    if backend is None:
        backend = resolve_backend(BACKEND_AUTO, folder_model_type(folder))
    return TransformersConfig.load(folder) if backend == BACKEND_TRANSFORMERS else ModelConfig.load(folder)
