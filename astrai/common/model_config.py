"""The architecture of a model, and its ``config.json`` as each family's transformers config holds it.

A model folder's ``config.json`` is a Hugging Face config of one of the families the trainer computes itself
(``model_type``: MODEL_TYPES; each family a spec in :mod:`astrai.common.families`). It is read as transformers 5.x
reads it — the keys it holds, and for the keys it leaves out the defaults that family's config class assumes; RoPE
written the 4.x way (``rope_theta``, ``rope_scaling``) or the 5.x way (``rope_parameters``) — into one
:class:`ModelConfig`, whose fields say what the model computes: the Llama block's sizes, and the features a family
adds to it (where the norms sit, fused projections, soft caps, windows, experts...). The model asks only those
features, never which family it is. It is written back as the same family's config (with both RoPE spellings where
the family has them), so that ``transformers.AutoModelForCausalLM.from_pretrained(folder)`` builds the same model.

The generic reader and writer here read and write what every family has; a family's spec reads and writes its own
keys and refuses what the trainer does not compute, naming the key, its value and what is allowed. Torch-free:
preflight and the trainer read folders through this module alike.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from astrai.common.contract import MODEL_CONFIG_FILE
from astrai.common.families import BY_MODEL_TYPE, DEFAULT_FAMILY, FEATURES, MODEL_TYPES, OWNED, SPECS, family
from astrai.common.families.base import ROPE_TYPES, check_hf_int  # noqa: F401  (read through this module)
from astrai.common.families.rope import RopeScaling, read_rope
from astrai.common.safetensors_file import ModelLoadError

ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
"""The MLP gates: SiLU (SwiGLU) and GELU's tanh approximation (GeGLU), by transformers' names."""
FAMILY_FIELDS = (*OWNED, *FEATURES, "pad_token_id")
"""ModelConfig fields read from a family's config.json (its own, and the features it fixes) rather than set by hand."""


@dataclass(frozen=True)
class ModelConfig:
    """The architecture; stored as ``config.json`` (its family's Hugging Face form) next to the weights."""

    vocab_size: int = 320
    """Embedding rows. The byte tokenizer needs 257; 320 rounds that up to a multiple of 64 for fast matmuls."""
    dim: int = 128
    """Width of the residual stream (``hidden_size``)."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Query heads per attention layer."""
    n_kv_heads: int = 4
    """Key/value heads; fewer than ``n_heads`` gives grouped-query attention. Must divide ``n_heads``."""
    ffn_hidden_dim: int = 384
    """Hidden width of the gated MLP (``intermediate_size``)."""
    max_seq_len: int = 1024
    """``max_position_embeddings``: the longest sequence the model is meant for, which its RoPE scaling may stretch
    (:attr:`context`); ``window_size`` must not exceed that."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    tie_embeddings: bool = True
    """Reuse the token embedding as the output projection (saves ``vocab_size * dim`` parameters)."""
    head_dim: int | None = None
    """Width of one attention head; None means ``dim / n_heads``."""
    rope_scaling: RopeScaling | None = None
    """RoPE frequency scaling of a long-context model; None for plain RoPE."""
    sliding_window: int | None = None
    """Mistral's (and Phi-3's, Mixtral's) attention window, the same for every layer: a token attends to itself and
    the sliding_window - 1 before it; None attends to the whole sequence. Not a limit of the sequence's length."""
    bos_token_id: int | None = None
    """Kept from a Hugging Face config so that generation from a checkpoint behaves like the base model's."""
    eos_token_id: int | tuple[int, ...] | None = None
    """As ``bos_token_id``; Llama 3 lists several."""
    pad_token_id: int | None = None
    """As ``bos_token_id``: transformers builds the embedding with it (Phi-3 assumes 32000 without it)."""
    family: str = DEFAULT_FAMILY
    """Which family's config.json it is written as (astrai.common.families; a llama with a sliding window is written
    as mistral). The model itself asks only the features below."""
    block_norms: str = "pre"
    """Where a block's RMSNorms are: ``pre`` (before attention and the MLP), ``post`` (after them: OLMo 2) or
    ``both`` (Gemma)."""
    norm_plus_one: bool = False
    """Every RMSNorm scales by (1 + weight), computed in float32, its weights stored around 0 (Gemma)."""
    fused_projections: bool = False
    """q, k and v come from one matrix, and the MLP's gate and up from one (Phi-3)."""
    scale_embeddings: bool = False
    """The token embeddings are multiplied by sqrt(dim) (Gemma)."""
    attention_bias: bool = False
    """Biases on the query, key and value projections (Qwen2 has them)."""
    qk_norm: str | None = None
    """An RMSNorm on the queries and keys before the rotary embedding: over each ``head`` (Qwen3, Gemma 3) or over
    the whole ``projection`` (OLMo 2); None for none."""
    activation: str = "silu"
    """The MLP's gate: silu or gelu_pytorch_tanh (Gemma)."""
    query_pre_attn_scalar: int | None = None
    """Gemma: attention scores are scaled by 1/sqrt(query_pre_attn_scalar) instead of 1/sqrt(head size)."""
    attention_multiplier: float | None = None
    """Granite: the attention scores' scale itself."""
    embedding_multiplier: float = 1.0
    """Granite: what the token embeddings are multiplied by."""
    residual_multiplier: float = 1.0
    """Granite: what each block's attention and MLP outputs are multiplied by before they join the residual."""
    logits_scaling: float = 1.0
    """Granite: what the logits are divided by."""
    attn_logit_softcapping: float | None = None
    """Gemma 2: attention scores become ``cap * tanh(score / cap)``; None for no cap."""
    final_logit_softcapping: float | None = None
    """Gemma: the logits become ``cap * tanh(logit / cap)``; None for no cap."""
    local_window: int | None = None
    """Gemma: the window of the local layers (transformers' ``sliding_window``): a token attends to itself and the
    local_window - 1 before it."""
    local_layers: tuple[int, ...] = ()
    """Gemma: the layers that attend within ``local_window`` (the others attend to the whole sequence)."""
    local_rope_theta: float | None = None
    """Gemma 3: the RoPE base of the local layers, which are never scaled; None: the same RoPE as the others."""
    partial_rotary_factor: float = 1.0
    """Phi-3 family: the share of each head the rotary embedding turns (the first ``rotary_dim`` dimensions)."""
    n_experts: int = 0
    """Mixture of experts: how many gated MLPs (experts) each sparse layer holds; 0 for a plain MLP everywhere."""
    experts_per_token: int = 0
    """Mixture of experts: how many experts each token goes to (the top-k of the router's probabilities)."""
    expert_hidden_dim: int | None = None
    """Mixture of experts: the hidden width of one expert (``moe_intermediate_size``; Mixtral's
    ``intermediate_size``)."""
    dense_layers: tuple[int, ...] = ()
    """Qwen3-MoE: the layers that keep a plain MLP of ``ffn_hidden_dim`` (``mlp_only_layers`` and those
    ``decoder_sparse_step`` skips)."""
    normalize_top_k: bool = True
    """Mixture of experts: the chosen experts' probabilities are divided by their sum (Mixtral always; Qwen3-MoE's
    ``norm_topk_prob``)."""
    router_aux_loss_coef: float = 0.0
    """Mixture of experts: the weight of the router's load-balancing loss in training; 0 turns it off."""
    num_labels: int | None = None
    """A sequence classifier (a reward model: ``XForSequenceClassification``): the scores its head gives each sequence,
    from the hidden state of its last token, in place of the output projection; None for a causal language model."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim", "max_seq_len"):
            _check_positive_int(name, getattr(self, name))
        for name in ("head_dim", "sliding_window", "local_window"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        for name in ("rope_theta", "norm_eps", "embedding_multiplier", "residual_multiplier", "logits_scaling"):
            _check_positive_number(name, getattr(self, name))
        if self.query_pre_attn_scalar is not None:
            _check_positive_int("query_pre_attn_scalar", self.query_pre_attn_scalar)
        for name in ("attention_multiplier", "local_rope_theta"):
            if getattr(self, name) is not None:
                _check_positive_number(name, getattr(self, name))
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(self, name) is not None:
                _check_positive_number(name, getattr(self, name))
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"tie_embeddings: expected true or false, got {self.tie_embeddings!r}")
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(f"dim({self.dim}) must be a multiple of n_heads({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads({self.n_heads}) must be a multiple of n_kv_heads({self.n_kv_heads})")
        if self.num_labels is not None:
            _check_positive_int("num_labels", self.num_labels)
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        object.__setattr__(self, "local_layers", tuple(self.local_layers))
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))
        self._check_choices()
        self._check_experts()
        self._check_rotary()
        self._check_family_fields()

    def _check_choices(self) -> None:
        family(self.family)
        if self.block_norms not in ("pre", "post", "both"):
            raise ValueError(f"block_norms: expected pre, post or both, got {self.block_norms!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation: expected one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")
        if self.qk_norm not in (None, "head", "projection"):
            raise ValueError(f"qk_norm: expected head, projection or None, got {self.qk_norm!r}")
        if any(not isinstance(i, int) or not 0 <= i < self.n_layers for i in self.local_layers):
            raise ValueError(
                f"local_layers: expected layer numbers below n_layers({self.n_layers}), got {self.local_layers}"
            )
        if self.local_layers and self.local_window is None:
            raise ValueError("local_layers need a local_window")

    def _check_experts(self) -> None:
        if self.n_experts == 0:
            return
        _check_positive_int("n_experts", self.n_experts)
        _check_positive_int("experts_per_token", self.experts_per_token)
        _check_positive_int("expert_hidden_dim", self.expert_hidden_dim)
        if self.experts_per_token > self.n_experts:
            raise ValueError(f"experts_per_token({self.experts_per_token}) must not exceed n_experts({self.n_experts})")
        if any(not isinstance(i, int) or not 0 <= i < self.n_layers for i in self.dense_layers):
            raise ValueError(
                f"dense_layers: expected layer numbers below n_layers({self.n_layers}), got {self.dense_layers}"
            )
        coef = self.router_aux_loss_coef
        if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not 0 <= coef < math.inf:
            raise ValueError(f"router_aux_loss_coef: expected a finite number >= 0, got {coef!r}")

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is a mixture of experts."""
        if self.n_experts == 0:
            return ()
        return tuple(i for i in range(self.n_layers) if i not in self.dense_layers)

    def _check_rotary(self) -> None:
        factor = self.partial_rotary_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            raise ValueError(f"partial_rotary_factor: expected a number in (0, 1], got {factor!r}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(
                f"the rotary embedding turns {self.rotary_dim} dimensions of each head (head dim {self.head_size} "
                f"* partial_rotary_factor {factor}): it must be even and at least 2"
            )

    def _check_family_fields(self) -> None:
        """The fields only some families set belong to this one, it sets what it needs, and has its features."""
        spec = family(self.family)
        defaults = {field.name: field.default for field in dataclasses.fields(ModelConfig)}
        for name, families in OWNED.items():
            if getattr(self, name) != defaults[name] and self.family not in families:
                raise ValueError(f"{name} belongs to {', '.join(families)}; family {self.family} has none")
        for name in spec.needs:
            if getattr(self, name) in (None, 0):
                raise ValueError(f"family {self.family} needs {name}")
        for name, value in spec.features.items():
            if getattr(self, name) != value:
                raise ValueError(f"family {self.family} has {name} {value!r}, not {getattr(self, name)!r}")

    @property
    def head_size(self) -> int:
        """Width of one attention head."""
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    @property
    def rotary_dim(self) -> int:
        """How many dimensions of each query and key head the rotary embedding turns (the first ones)."""
        return int(self.head_size * self.partial_rotary_factor)

    @property
    def model_type(self) -> str:
        """The ``model_type`` it is written as (its family's; a Llama with a sliding window is Mistral)."""
        return family(self.family).written_type(self)

    @property
    def embedding_scale(self) -> float:
        """What the token embeddings are multiplied by: sqrt(dim) (Gemma), Granite's multiplier, else 1."""
        return self.dim**0.5 if self.scale_embeddings else self.embedding_multiplier

    @property
    def attention_scale(self) -> float | None:
        """The attention scores' scale when it is not 1/sqrt(head size) (Gemma, Granite); None otherwise."""
        if self.query_pre_attn_scalar is not None:
            return self.query_pre_attn_scalar**-0.5
        return self.attention_multiplier

    @property
    def rope_depends_on_length(self) -> bool:
        """Whether the rotary tables change with the sequence's length (dynamic NTK, longrope)."""
        return self.rope_scaling is not None and self.rope_scaling.depends_on_length

    @property
    def context(self) -> int:
        """The longest sequence the model takes (:func:`context_length`): training windows, a prompt with its
        completion. A sliding window is not a limit of it."""
        scaling = self.rope_scaling
        if scaling is None:
            return context_length(self.max_seq_len)
        return context_length(
            self.max_seq_len, scaling.rope_type, scaling.factor, scaling.original_max_position_embeddings
        )

    @property
    def attention_window(self) -> int | None:
        """How many tokens a windowed layer attends to (itself and the ones before it): Mistral's, Phi-3's and
        Mixtral's ``sliding_window`` in every layer, Gemma's in its local layers; None: no layer has a window."""
        return self.local_window if self.local_layers else self.sliding_window

    @property
    def window_layers(self) -> tuple[int, ...]:
        """The layers that attend within :attr:`attention_window` (the others attend to the whole sequence)."""
        if self.local_layers:
            return self.local_layers
        return tuple(range(self.n_layers)) if self.sliding_window is not None else ()

    @property
    def architecture(self) -> str:
        """The transformers class its folders name: the family's causal language model, or its sequence classifier;
        ValueError for a family without one."""
        spec = family(self.family)
        if self.num_labels is None:
            return spec.classes[self.model_type]
        if self.model_type not in spec.classifiers:
            classifying = [model_type for spec in SPECS for model_type in spec.classifiers]
            raise ValueError(
                f"model_type {self.model_type} has no sequence classifier in transformers (a reward model); use one of "
                f"{', '.join(classifying)}"
            )
        return spec.classifiers[self.model_type]

    def to_hf_dict(self) -> dict:
        """``config.json`` in the form transformers 4.x and 5.x both read."""
        scaling = self.rope_scaling.to_dict() if self.rope_scaling is not None else None
        values = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "intermediate_size": self.ffn_hidden_dim,
            "num_hidden_layers": self.n_layers,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads,
            "head_dim": self.head_size,
            "max_position_embeddings": self.max_seq_len,
            "rms_norm_eps": self.norm_eps,
            "tie_word_embeddings": self.tie_embeddings,
            "hidden_act": self.activation,
            "attention_bias": self.attention_bias,
            "mlp_bias": False,
            # transformers 5.x reads rope_parameters, 4.x rope_theta and rope_scaling; both say the same.
            "rope_parameters": {**(scaling or {"rope_type": "default"}), "rope_theta": self.rope_theta},
            "rope_theta": self.rope_theta,
            "rope_scaling": scaling,
            # Checkpoints hold fp32 weights (5.x says dtype, 4.x torch_dtype).
            "dtype": "float32",
            "torch_dtype": "float32",
            # Written even when None: transformers would otherwise assume Llama 2's ids 1 and 2.
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.sliding_window is not None:
            values["sliding_window"] = self.sliding_window
        if self.num_labels is not None:  # as transformers writes a classifier's labels
            values["id2label"] = {str(label): f"LABEL_{label}" for label in range(self.num_labels)}
            values["label2id"] = {f"LABEL_{label}": label for label in range(self.num_labels)}
        spec = family(self.family)
        if spec.write is not None:  # a Llama (or Mistral) has none beyond these
            spec.write(self, values)
        return values

    def to_json(self) -> str:
        return json.dumps(self.to_hf_dict(), indent=2, sort_keys=True, allow_nan=False) + "\n"

    @classmethod
    def from_dict(cls, values: dict) -> ModelConfig:
        """Build from a parsed ``config.json`` of either form; anything unusable raises ValueError naming the key."""
        if not isinstance(values, dict):
            raise ValueError("expected a JSON object")
        refused = quantized_weights(values)
        if refused is not None:
            raise ValueError(refused)
        if "model_type" in values:
            return _from_hf(values)
        raise ValueError(f"model_type is missing; expected one of {', '.join(MODEL_TYPES)}")

    @classmethod
    def load(cls, folder: Path) -> ModelConfig:
        """Read ``folder/config.json``; any problem raises ModelLoadError naming the file."""
        values = read_config_json(folder)
        try:
            return cls.from_dict(values)
        except (ValueError, TypeError) as error:
            raise ModelLoadError(f"{Path(folder) / MODEL_CONFIG_FILE}: {error}") from None


def read_config_json(folder: Path) -> dict:
    """``folder/config.json`` as a dict, for every reader of a model folder (both backends, the host's checks);
    ModelLoadError naming the file for anything unreadable."""
    path = Path(folder) / MODEL_CONFIG_FILE
    try:
        with open(path, encoding="utf-8") as handle:
            values = json.load(handle)
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: not found") from None
    except PermissionError:
        raise ModelLoadError(f"{path}: cannot be read by uid {os.getuid()}; check its permissions") from None
    except (OSError, ValueError) as error:
        raise ModelLoadError(f"{path}: {error}") from None
    if not isinstance(values, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return values


def quantized_weights(values: dict) -> str | None:
    """Why a folder whose ``config.json`` (``values``) has a ``quantization_config`` is not read (bitsandbytes' 4-bit
    or 8-bit weights, torchao's, GPTQ's, AWQ's, FP8's...), with the remedy; None for any other folder."""
    quantization = values.get("quantization_config")
    if quantization is None:
        return None
    method = quantization.get("quant_method", "unnamed") if isinstance(quantization, dict) else "unreadable"
    four_bit = isinstance(quantization, dict) and quantization.get("bnb_4bit_quant_type")
    how = f"{method}, {four_bit}" if four_bit else method
    return (
        f"quantization_config: its weights are stored quantised ({how}), and the trainer reads unquantised weights "
        "(float32, bfloat16, float16) only; give the folder of the model it was quantised from, and set "
        "training.lora_base_dtype: nf4 to hold it in 4 bits while training (QLoRA)"
    )


def context_length(
    max_positions: int, rope_type: str | None = None, factor: float | None = None, original: int | None = None
) -> int:
    """The longest sequence a model takes, prompt and completion together: the one rule, for both backends, for
    training windows, prompts and generation.

    It is ``max_position_embeddings``, stretched where the RoPE scaling says how far: dynamic NTK scales the
    positions past ``max_position_embeddings`` itself (``factor`` times as many); a scaling that names the context
    it stretches (``original_max_position_embeddings``) and a ``factor`` reaches ``original x factor`` (Qwen's yarn
    keeps max_position_embeddings at the original). A sliding window is never a limit: it says what each token
    attends to, not how long a sequence is (a token past it attends to the last ``sliding_window`` tokens)."""
    if rope_type == "dynamic" and factor is not None and factor > 1:
        return int(max_positions * factor)
    if original is not None and factor is not None:
        return max(max_positions, int(original * factor))
    return max_positions


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")


def _check_positive_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name}: expected a positive finite number, got {value!r}")


# --- Reading: config.json as transformers reads it ---------------------------------------------------


def _from_hf(values: dict) -> ModelConfig:
    model_type = values["model_type"]
    spec = BY_MODEL_TYPE.get(model_type)
    if spec is None:
        hint = (
            "; gemma3 is Gemma 3 with its vision tower: train its text model's own folder (model_type gemma3_text)"
            if model_type == "gemma3"
            else ""
        )
        raise ValueError(
            f"model_type {model_type!r} is not supported; expected one of {', '.join(MODEL_TYPES)} "
            f"(the families the trainer computes itself){hint}; or set model.backend: transformers to train it "
            "through transformers (slower)"
        )
    _refuse_biases(values, spec)
    shape = _shape_from_hf(values, spec)
    head_size = shape["head_dim"] or shape["dim"] // shape["n_heads"]
    return ModelConfig(
        **shape,
        **read_rope(values, spec, head_size),
        **spec.features,
        **spec.read(values, model_type, shape["n_layers"]),
        bos_token_id=_token_id("bos_token_id", values.get("bos_token_id")),
        eos_token_id=_token_id("eos_token_id", values.get("eos_token_id")),
        pad_token_id=_pad_token_id(values.get("pad_token_id"), shape["vocab_size"]),
        family=spec.name,
        num_labels=_num_labels(values),
    )


def _num_labels(values: dict) -> int | None:
    """A sequence classifier's labels as transformers counts them (num_labels, else its id2label, else 2); None for a
    causal language model."""
    architectures = values.get("architectures") or []
    if not any(isinstance(name, str) and name.endswith("ForSequenceClassification") for name in architectures):
        return None
    if values.get("num_labels") is not None:
        check_hf_int("num_labels", values["num_labels"])
        return values["num_labels"]
    labels = values.get("id2label")
    return len(labels) if isinstance(labels, dict) and labels else 2


def _refuse_biases(values: dict, spec) -> None:
    """Biases the trainer does not compute: on the MLP, and on q, k and v where the family has none (Qwen2's are
    implied: its config has no key for them)."""
    if values.get("mlp_bias", False) is not False:
        raise ValueError(f"mlp_bias {json.dumps(values['mlp_bias'])} is not supported; expected false")
    if not spec.features.get("attention_bias") and values.get("attention_bias", False) is not False:
        raise ValueError(f"attention_bias {json.dumps(values['attention_bias'])} is not supported; expected false")


def _shape_from_hf(values: dict, spec) -> dict:
    """The fields every family has: sizes, norms' epsilon, tying, the MLP's gate."""
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in values:
            raise ValueError(f"{key} is missing")
        check_hf_int(key, values[key])
    heads = values["num_attention_heads"]
    for key in ("num_key_value_heads", "head_dim", "max_position_embeddings"):
        if values.get(key) is not None:
            check_hf_int(key, values[key])
    kv_heads = values.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    head_dim = values.get("head_dim") or spec.default("head_dim")
    if head_dim is None and values["hidden_size"] % heads:
        raise ValueError(
            f"hidden_size {values['hidden_size']} is not a multiple of num_attention_heads {heads} "
            "and head_dim is not given"
        )
    if head_dim is not None and head_dim * heads == values["hidden_size"]:
        head_dim = None  # the usual width, said explicitly (transformers 5.x always writes it)
    eps = values.get("rms_norm_eps", spec.default("rms_norm_eps"))
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise ValueError(f"rms_norm_eps {eps!r}: expected a positive number")
    tie = values.get("tie_word_embeddings", spec.default("tie_word_embeddings"))
    if not isinstance(tie, bool):
        raise ValueError(f"tie_word_embeddings {tie!r}: expected true or false")
    # Gemma's MLP reads hidden_activation (its configs also carry a hidden_act, which transformers ignores).
    act_key, act_default = spec.activation
    activation = values.get(act_key) or act_default
    if activation not in ACTIVATIONS:
        raise ValueError(f"{act_key} {activation!r} is not supported; expected one of {', '.join(ACTIVATIONS)}")
    return dict(
        vocab_size=values["vocab_size"],
        dim=values["hidden_size"],
        n_layers=values["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=kv_heads,
        ffn_hidden_dim=values["intermediate_size"],
        max_seq_len=values.get("max_position_embeddings") or spec.default("max_position_embeddings"),
        norm_eps=float(eps),
        tie_embeddings=tie,
        head_dim=head_dim,
        activation=activation,
    )


def _pad_token_id(value, vocab_size: int) -> int | None:
    # Kept only when it names a row of the embedding, which transformers' embedding needs (a config may name one
    # its model never uses).
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size:
        return value
    return None


def _token_id(key: str, value):
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    raise ValueError(f"{key} {value!r}: expected a token id, a list of them, or null")
