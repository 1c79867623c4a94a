"""The architecture of a model, and its ``config.json`` as each family's transformers config holds it.

A model folder's ``config.json`` is a Hugging Face config of one of the families the trainer computes itself
(``model_type``: MODEL_TYPES). It is read as transformers 5.x reads it — the keys it holds, and for the keys it
leaves out the defaults that family's config class assumes; RoPE written the 4.x way (``rope_theta``,
``rope_scaling``) or the 5.x way (``rope_parameters``) — into one :class:`ModelConfig`, whose fields say what the
model computes. It is written back as the same family's config (with both RoPE spellings where the family has
them), so that ``transformers.AutoModelForCausalLM.from_pretrained(folder)`` builds the same model.

What each family adds to the Llama block (``ModelConfig``'s fields and properties carry it to the model):

- ``mistral``: one attention window for every layer (``sliding_window``); ``qwen2``: biases on q, k and v;
  ``qwen3``: an RMSNorm over each query and key head;
- ``gemma2``, ``gemma3_text``: embeddings scaled by sqrt(hidden_size), RMSNorms that scale by (1 + weight), norms
  before and after attention and the MLP, GELU (tanh) gating, the attention scale 1/sqrt(query_pre_attn_scalar),
  soft-capped attention scores and logits (``cap * tanh(x / cap)``), layers alternating between a local window
  and the whole sequence (``layer_types``); Gemma 3 also normalises each query and key head and gives its local
  layers a RoPE base of their own;
- ``phi3`` (Phi-3, Phi-4): q, k and v computed by one matrix (``qkv_proj``), gate and up by one
  (``gate_up_proj``), longrope scaling, RoPE over a part of each head (``partial_rotary_factor``);
- ``olmo2``: norms after attention and the MLP instead of before, RMSNorms over the whole query and key projections;
- ``granite``: the embedding, attention, residual multipliers and the logits' divisor;
- ``qwen3_moe``, ``mixtral``: a mixture of experts in place of the MLP (``n_experts`` gated MLPs of
  ``expert_hidden_dim``, a router that sends each token to ``experts_per_token`` of them); Qwen3-MoE normalises each
  query and key head as Qwen3 does and may keep a plain MLP in some layers (``mlp_only_layers``,
  ``decoder_sparse_step``: ``dense_layers``); Mixtral may have a sliding window as Mistral does.

Anything else (another ``model_type``, biases a family does not have, a setting the trainer does not compute)
is refused, naming the key, its value and what is allowed. Torch-free: preflight and the trainer read folders
through this module alike.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from astrai.common.contract import MODEL_CONFIG_FILE
from astrai.common.safetensors_file import ModelLoadError

FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "granite": "GraniteForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
"""Each ``model_type`` the trainer computes itself, and the transformers class its folders name."""
SEQUENCE_CLASSIFIERS = {
    "llama": "LlamaForSequenceClassification",
    "mistral": "MistralForSequenceClassification",
    "qwen2": "Qwen2ForSequenceClassification",
    "qwen3": "Qwen3ForSequenceClassification",
    "gemma2": "Gemma2ForSequenceClassification",
    "gemma3_text": "Gemma3TextForSequenceClassification",
    "phi3": "Phi3ForSequenceClassification",
    "olmo2": "Olmo2ForSequenceClassification",
    "qwen3_moe": "Qwen3MoeForSequenceClassification",
    "mixtral": "MixtralForSequenceClassification",
}
"""The transformers class of each family's sequence classifier (a reward model: a score head on the last token in place
of the output projection); Granite has none."""
MODEL_TYPES = tuple(FAMILIES)
GEMMA = ("gemma2", "gemma3_text")
MIXTURES = ("qwen3_moe", "mixtral")
"""The families whose MLP is a mixture of experts."""
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
"""The MLP gates: SiLU (SwiGLU) and GELU's tanh approximation (GeGLU), by transformers' names."""
LOCAL_LAYER, GLOBAL_LAYER = "sliding_attention", "full_attention"
"""transformers' ``layer_types``: a layer that attends within the local window, or to the whole sequence."""

_FAMILY_FIELDS = {
    "query_pre_attn_scalar": GEMMA,
    "attn_logit_softcapping": GEMMA,
    "final_logit_softcapping": GEMMA,
    "local_window": GEMMA,
    "local_rope_theta": ("gemma3_text",),
    "partial_rotary_factor": ("phi3",),
    "attention_multiplier": ("granite",),
    "embedding_multiplier": ("granite",),
    "residual_multiplier": ("granite",),
    "logits_scaling": ("granite",),
    "n_experts": MIXTURES,
    "experts_per_token": MIXTURES,
    "expert_hidden_dim": MIXTURES,
    "dense_layers": ("qwen3_moe",),
    "normalize_top_k": ("qwen3_moe",),
    "router_aux_loss_coef": MIXTURES,
}
FAMILY_FIELDS = (*_FAMILY_FIELDS, "pad_token_id")
"""ModelConfig fields read from a family's config.json rather than set by hand."""


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE frequency scaling as transformers defines it: linear, llama3, yarn, dynamic (NTK) or longrope."""

    rope_type: str
    factor: float | None = None
    """How much the context is stretched; longrope may leave it out (max_position_embeddings / original)."""
    low_freq_factor: float | None = None
    """llama3: wavelengths above original_max_position_embeddings / low_freq_factor are slowed by ``factor``."""
    high_freq_factor: float | None = None
    """llama3: wavelengths below original_max_position_embeddings / high_freq_factor are kept."""
    original_max_position_embeddings: int | None = None
    """llama3, yarn, longrope: the context length the model was first trained for."""
    attention_factor: float | None = None
    """yarn, longrope: what cos and sin are multiplied by; None: derived from ``factor`` as transformers does."""
    beta_fast: float | None = None
    """yarn: the rotations above which a frequency is kept (transformers' default 32)."""
    beta_slow: float | None = None
    """yarn: the rotations below which a frequency is interpolated (transformers' default 1)."""
    mscale: float | None = None
    """yarn: with mscale_all_dim, gives the attention factor."""
    mscale_all_dim: float | None = None
    truncate: bool | None = None
    """yarn: round the ramp's ends to whole dimensions (transformers' default true)."""
    short_factor: tuple[float, ...] | None = None
    """longrope: each frequency's divisor while the sequence fits original_max_position_embeddings."""
    long_factor: tuple[float, ...] | None = None
    """longrope: each frequency's divisor for longer sequences."""

    def to_dict(self) -> dict:
        values = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items() if v is not None}

    @property
    def depends_on_length(self) -> bool:
        """Whether the frequencies change with the length of the sequence (dynamic NTK, longrope)."""
        return self.rope_type in ("dynamic", "longrope")


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
    """Longest sequence the model is meant for (``max_position_embeddings``); ``window_size`` must not exceed it."""
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
    """Mistral's (and Phi-3's) attention window, the same for every layer; None attends to the whole sequence.
    Training windows must fit in it."""
    bos_token_id: int | None = None
    """Kept from a Hugging Face config so that generation from a checkpoint behaves like the base model's."""
    eos_token_id: int | tuple[int, ...] | None = None
    """As ``bos_token_id``; Llama 3 lists several."""
    pad_token_id: int | None = None
    """As ``bos_token_id``: transformers builds the embedding with it (Phi-3 assumes 32000 without it)."""
    family: str = "llama"
    """Which Hugging Face model it is written as: a ``model_type`` (llama is written as mistral when it has a
    sliding window)."""
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
        families = sorted({*MODEL_TYPES} - {"mistral"})
        if self.family not in families:
            raise ValueError(f"family: expected one of {', '.join(families)}, got {self.family!r}")
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
        defaults = {field.name: field.default for field in dataclasses.fields(ModelConfig)}
        for name, families in _FAMILY_FIELDS.items():
            if getattr(self, name) != defaults[name] and self.family not in families:
                raise ValueError(f"{name} belongs to {', '.join(families)}; family {self.family} has none")
        if self.family in GEMMA and self.query_pre_attn_scalar is None:
            raise ValueError(f"family {self.family} needs query_pre_attn_scalar")
        if self.family == "granite" and self.attention_multiplier is None:
            raise ValueError("family granite needs attention_multiplier")
        if self.family in MIXTURES and self.n_experts == 0:
            raise ValueError(f"family {self.family} needs n_experts")

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
        # A Llama with a sliding window is what transformers calls Mistral.
        if self.family == "llama":
            return "mistral" if self.sliding_window is not None else "llama"
        return self.family

    @property
    def block_norms(self) -> str:
        """Where a block's RMSNorms are: ``pre`` (before attention and the MLP), ``post`` (after them: OLMo 2) or
        ``both`` (Gemma)."""
        return "both" if self.family in GEMMA else "post" if self.family == "olmo2" else "pre"

    @property
    def norm_plus_one(self) -> bool:
        """Whether every RMSNorm scales by (1 + weight), computed in float32, its weights stored around 0 (Gemma)."""
        return self.family in GEMMA

    @property
    def fused_projections(self) -> bool:
        """Whether q, k and v come from one matrix, and the MLP's gate and up from one (Phi-3)."""
        return self.family == "phi3"

    @property
    def embedding_scale(self) -> float:
        """What the token embeddings are multiplied by: sqrt(hidden_size) for Gemma, Granite's multiplier."""
        return self.dim**0.5 if self.family in GEMMA else self.embedding_multiplier

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
    def architecture(self) -> str:
        """The transformers class its folders name: the family's causal language model, or its sequence classifier;
        ValueError for a family without one."""
        if self.num_labels is None:
            return FAMILIES[self.model_type]
        if self.model_type not in SEQUENCE_CLASSIFIERS:
            raise ValueError(
                f"model_type {self.model_type} has no sequence classifier in transformers (a reward model); use one of "
                f"{', '.join(SEQUENCE_CLASSIFIERS)}"
            )
        return SEQUENCE_CLASSIFIERS[self.model_type]

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
        family_keys = _FAMILY_KEYS.get(self.family)  # a Llama (or Mistral) has none beyond these
        if family_keys is not None:
            family_keys(self, values)
        return values

    def to_json(self) -> str:
        return json.dumps(self.to_hf_dict(), indent=2, sort_keys=True, allow_nan=False) + "\n"

    @classmethod
    def from_dict(cls, values: dict) -> ModelConfig:
        """Build from a parsed ``config.json`` of either form; anything unusable raises ValueError naming the key."""
        if not isinstance(values, dict):
            raise ValueError("expected a JSON object")
        if "model_type" in values:
            return _from_hf(values)
        raise ValueError(f"model_type is missing; expected one of {', '.join(MODEL_TYPES)}")

    @classmethod
    def load(cls, folder: Path) -> ModelConfig:
        """Read ``folder/config.json``; any problem raises ModelLoadError naming the file."""
        path = Path(folder) / MODEL_CONFIG_FILE
        try:
            with open(path, encoding="utf-8") as handle:
                return cls.from_dict(json.load(handle))
        except FileNotFoundError:
            raise ModelLoadError(f"{path}: not found") from None
        except PermissionError:
            raise ModelLoadError(f"{path}: cannot be read by uid {os.getuid()}; check its permissions") from None
        except (OSError, ValueError, TypeError) as error:
            raise ModelLoadError(f"{path}: {error}") from None


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: expected a positive integer, got {value!r}")


def _check_positive_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name}: expected a positive finite number, got {value!r}")


# --- Writing: each family's own keys -------------------------------------------------------------------


def _qwen_keys(config: ModelConfig, values: dict) -> None:
    # Qwen's attention is full unless use_sliding_window says otherwise; its bias is implied for qwen2.
    values.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.n_layers)
    del values["mlp_bias"]
    if config.family == "qwen2":
        del values["attention_bias"]


def _gemma_keys(config: ModelConfig, values: dict) -> None:
    del values["mlp_bias"]
    values.update(
        hidden_activation=config.activation,
        query_pre_attn_scalar=config.query_pre_attn_scalar,
        attn_logit_softcapping=config.attn_logit_softcapping,
        final_logit_softcapping=config.final_logit_softcapping,
        sliding_window=config.local_window,
        layer_types=[LOCAL_LAYER if i in config.local_layers else GLOBAL_LAYER for i in range(config.n_layers)],
        use_bidirectional_attention=False,
    )
    if config.family == "gemma3_text":
        # 5.x: one set of RoPE parameters per layer type; 4.x: rope_theta, rope_scaling (the global layers'),
        # rope_local_base_freq.
        local = {"rope_type": "default", "rope_theta": config.local_rope_theta or config.rope_theta}
        values["rope_parameters"] = {GLOBAL_LAYER: values["rope_parameters"], LOCAL_LAYER: local}
        values["rope_local_base_freq"] = local["rope_theta"]


def _phi3_keys(config: ModelConfig, values: dict) -> None:
    del values["mlp_bias"], values["attention_bias"]
    values["partial_rotary_factor"] = config.partial_rotary_factor
    values["rope_parameters"]["partial_rotary_factor"] = config.partial_rotary_factor
    values.setdefault("sliding_window", None)
    scaling = config.rope_scaling
    if scaling is not None and scaling.original_max_position_embeddings is not None:
        # Phi3Config takes this top-level key over the one in rope_parameters (and assumes 4096 without it).
        values["original_max_position_embeddings"] = scaling.original_max_position_embeddings


def _qwen3_moe_keys(config: ModelConfig, values: dict) -> None:
    del values["mlp_bias"]
    sparse = set(config.sparse_layers)
    values.update(
        use_sliding_window=False,
        sliding_window=None,
        num_experts=config.n_experts,
        num_experts_per_tok=config.experts_per_token,
        moe_intermediate_size=config.expert_hidden_dim,
        norm_topk_prob=config.normalize_top_k,
        router_aux_loss_coef=config.router_aux_loss_coef,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(config.n_layers) if i not in sparse],
    )


def _mixtral_keys(config: ModelConfig, values: dict) -> None:
    del values["mlp_bias"], values["attention_bias"]
    values.update(
        intermediate_size=config.expert_hidden_dim,
        num_local_experts=config.n_experts,
        num_experts_per_tok=config.experts_per_token,
        router_aux_loss_coef=config.router_aux_loss_coef,
        router_jitter_noise=0.0,
    )
    values.setdefault("sliding_window", None)


def _olmo2_keys(config: ModelConfig, values: dict) -> None:
    del values["mlp_bias"]


def _granite_keys(config: ModelConfig, values: dict) -> None:
    values.update(
        embedding_multiplier=config.embedding_multiplier,
        residual_multiplier=config.residual_multiplier,
        attention_multiplier=config.attention_multiplier,
        logits_scaling=config.logits_scaling,
    )


_FAMILY_KEYS = {
    "qwen2": _qwen_keys,
    "qwen3": _qwen_keys,
    "gemma2": _gemma_keys,
    "gemma3_text": _gemma_keys,
    "phi3": _phi3_keys,
    "olmo2": _olmo2_keys,
    "granite": _granite_keys,
    "qwen3_moe": _qwen3_moe_keys,
    "mixtral": _mixtral_keys,
}


# --- Reading: config.json as transformers reads it ---------------------------------------------------

_DEFAULTS = {
    # What each family's transformers config assumes for a key config.json leaves out (else the last value).
    "max_position_embeddings": (
        {"gemma2": 8192, "gemma3_text": 131072, "phi3": 4096, "qwen3_moe": 32768, "mixtral": 131072},
        2048,
    ),
    "rms_norm_eps": ({"phi3": 1e-5, "olmo2": 1e-5, "mixtral": 1e-5}, 1e-6),
    "rope_theta": ({"mixtral": 1e6}, 10000.0),
    "tie_word_embeddings": ({"gemma2": True, "gemma3_text": True}, False),
    "head_dim": ({"gemma2": 256, "gemma3_text": 256}, None),
}


def _default(key: str, family: str):
    by_family, otherwise = _DEFAULTS[key]
    return by_family.get(family, otherwise)


def _from_hf(values: dict) -> ModelConfig:
    model_type = values["model_type"]
    if model_type not in MODEL_TYPES:
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
    family = "llama" if model_type in ("llama", "mistral") else model_type
    _refuse_what_is_not_computed(values, model_type)
    shape = _shape_from_hf(values, family)
    head_size = shape["head_dim"] or shape["dim"] // shape["n_heads"]
    rope = _gemma3_rope(values, head_size) if family == "gemma3_text" else _rope_from_hf(values, family, head_size)
    return ModelConfig(
        **shape,
        **rope,
        **_family_fields(values, model_type, shape["n_layers"]),
        bos_token_id=_token_id("bos_token_id", values.get("bos_token_id")),
        eos_token_id=_token_id("eos_token_id", values.get("eos_token_id")),
        pad_token_id=_pad_token_id(values.get("pad_token_id"), shape["vocab_size"]),
        family=family,
        num_labels=_num_labels(values),
    )


def _num_labels(values: dict) -> int | None:
    """A sequence classifier's labels as transformers counts them (num_labels, else its id2label, else 2); None for a
    causal language model."""
    architectures = values.get("architectures") or []
    if not any(isinstance(name, str) and name.endswith("ForSequenceClassification") for name in architectures):
        return None
    if values.get("num_labels") is not None:
        _check_hf_int("num_labels", values["num_labels"])
        return values["num_labels"]
    labels = values.get("id2label")
    return len(labels) if isinstance(labels, dict) and labels else 2


def _refuse_what_is_not_computed(values: dict, model_type: str) -> None:
    """Keys whose values would make a model the trainer does not compute."""
    if values.get("mlp_bias", False) is not False:
        raise ValueError(f"mlp_bias {json.dumps(values['mlp_bias'])} is not supported; expected false")
    # Qwen2 always has biases on q, k and v (its config has no key for them); no other family here does.
    if model_type != "qwen2" and values.get("attention_bias", False) is not False:
        raise ValueError(f"attention_bias {json.dumps(values['attention_bias'])} is not supported; expected false")
    refused = {
        "use_sliding_window": ("qwen2", "qwen3", "qwen3_moe"),
        "use_bidirectional_attention": GEMMA,
    }
    for key, types in refused.items():
        if model_type in types and values.get(key) not in (None, False):
            raise ValueError(f"{key} {json.dumps(values[key])} is not supported; expected false")
    if model_type == "mixtral" and values.get("router_jitter_noise", 0.0) not in (0, None):
        raise ValueError(
            f"router_jitter_noise {json.dumps(values['router_jitter_noise'])} is not supported; expected 0 "
            "(the router's inputs are not jittered)"
        )
    if model_type == "gemma3_text" and values.get("attn_logit_softcapping") is not None:
        raise ValueError(
            f"attn_logit_softcapping {values['attn_logit_softcapping']!r} is not supported for gemma3_text "
            "(transformers' Gemma 3 does not apply it); expected null"
        )


def _shape_from_hf(values: dict, family: str) -> dict:
    """The fields every family has: sizes, norms' epsilon, tying, the MLP's gate."""
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in values:
            raise ValueError(f"{key} is missing")
        _check_hf_int(key, values[key])
    heads = values["num_attention_heads"]
    for key in ("num_key_value_heads", "head_dim", "max_position_embeddings"):
        if values.get(key) is not None:
            _check_hf_int(key, values[key])
    kv_heads = values.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    head_dim = values.get("head_dim") or _default("head_dim", family)
    if head_dim is None and values["hidden_size"] % heads:
        raise ValueError(
            f"hidden_size {values['hidden_size']} is not a multiple of num_attention_heads {heads} "
            "and head_dim is not given"
        )
    if head_dim is not None and head_dim * heads == values["hidden_size"]:
        head_dim = None  # the usual width, said explicitly (transformers 5.x always writes it)
    eps = values.get("rms_norm_eps", _default("rms_norm_eps", family))
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise ValueError(f"rms_norm_eps {eps!r}: expected a positive number")
    tie = values.get("tie_word_embeddings", _default("tie_word_embeddings", family))
    if not isinstance(tie, bool):
        raise ValueError(f"tie_word_embeddings {tie!r}: expected true or false")
    # Gemma's MLP reads hidden_activation (its configs also carry a hidden_act, which transformers ignores).
    act_key, act_default = ("hidden_activation", "gelu_pytorch_tanh") if family in GEMMA else ("hidden_act", "silu")
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
        max_seq_len=values.get("max_position_embeddings") or _default("max_position_embeddings", family),
        norm_eps=float(eps),
        tie_embeddings=tie,
        head_dim=head_dim,
        activation=activation,
    )


def _family_fields(values: dict, model_type: str, n_layers: int) -> dict:
    """What each family adds to the Llama block (see the module's docstring)."""
    fields: dict = {}
    if model_type == "mistral":
        # transformers' MistralConfig attends within 4096 tokens unless the config says otherwise.
        fields["sliding_window"] = _hf_int_or_none("sliding_window", values.get("sliding_window", 4096))
    elif model_type == "phi3":
        fields["sliding_window"] = _hf_int_or_none("sliding_window", values.get("sliding_window"))
    elif model_type == "qwen2":
        fields["attention_bias"] = True
    elif model_type == "mixtral":
        fields["sliding_window"] = _hf_int_or_none("sliding_window", values.get("sliding_window"))
    elif model_type in ("qwen3", "gemma3_text", "qwen3_moe"):
        fields["qk_norm"] = "head"
    elif model_type == "olmo2":
        fields["qk_norm"] = "projection"
    elif model_type == "granite":
        for key in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
            fields[key] = _hf_number(key, values.get(key, 1.0))
    if model_type in GEMMA:
        fields.update(_gemma_fields(values, model_type, n_layers))
    if model_type in MIXTURES:
        fields.update(_expert_fields(values, model_type, n_layers))
    return fields


def _expert_fields(values: dict, model_type: str, n_layers: int) -> dict:
    """The mixture of experts, as Qwen3MoeConfig and MixtralConfig read it (their defaults for what is left out)."""
    qwen = model_type == "qwen3_moe"
    # Both configs call the count num_local_experts; Qwen3MoeConfig also takes num_experts for it.
    count_key = "num_experts" if qwen and "num_local_experts" not in values else "num_local_experts"
    fields = {"n_experts": values.get(count_key, 128 if qwen else 8)}
    _check_hf_int(count_key, fields["n_experts"])
    fields["experts_per_token"] = values.get("num_experts_per_tok", 8 if qwen else 2)
    _check_hf_int("num_experts_per_tok", fields["experts_per_token"])
    if fields["experts_per_token"] > fields["n_experts"]:
        raise ValueError(f"num_experts_per_tok {fields['experts_per_token']} exceeds {count_key} {fields['n_experts']}")
    width_key = "moe_intermediate_size" if qwen else "intermediate_size"
    fields["expert_hidden_dim"] = values.get(width_key, 768 if qwen else 14336)
    _check_hf_int(width_key, fields["expert_hidden_dim"])
    coef = values.get("router_aux_loss_coef", 0.001)
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not 0 <= coef < math.inf:
        raise ValueError(f"router_aux_loss_coef {coef!r}: expected a finite number >= 0")
    fields["router_aux_loss_coef"] = float(coef)
    if not qwen:
        return fields
    norm = values.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise ValueError(f"norm_topk_prob {norm!r}: expected true or false")
    fields["normalize_top_k"] = norm
    step = values.get("decoder_sparse_step", 1)
    _check_hf_int("decoder_sparse_step", step)
    only = values.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ValueError(f"mlp_only_layers {only!r}: expected a list of layer numbers")
    # transformers' Qwen3MoeDecoderLayer: a layer is sparse unless listed, and only every decoder_sparse_step-th.
    fields["dense_layers"] = tuple(i for i in range(n_layers) if i in only or (i + 1) % step)
    return fields


def _gemma_fields(values: dict, model_type: str, n_layers: int) -> dict:
    capped = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0} if model_type == "gemma2" else {}
    fields = {
        key: None if values.get(key, capped.get(key)) is None else _hf_number(key, values.get(key, capped.get(key)))
        for key in ("attn_logit_softcapping", "final_logit_softcapping")
    }
    scalar = values.get("query_pre_attn_scalar", 256)
    _check_hf_int("query_pre_attn_scalar", scalar)
    fields["query_pre_attn_scalar"] = scalar
    types = values.get("layer_types")
    if types is None:
        # Older configs: Gemma 2 alternates local and global layers; Gemma 3 has one global layer in every
        # sliding_window_pattern (6).
        pattern = 2 if model_type == "gemma2" else values.get("sliding_window_pattern", 6)
        _check_hf_int("sliding_window_pattern", pattern)
        types = [LOCAL_LAYER if (i + 1) % pattern else GLOBAL_LAYER for i in range(n_layers)]
    if not isinstance(types, list) or len(types) != n_layers or not set(types) <= {LOCAL_LAYER, GLOBAL_LAYER}:
        raise ValueError(
            f"layer_types {types!r}: expected a list of {n_layers} (num_hidden_layers) {LOCAL_LAYER!r} or "
            f"{GLOBAL_LAYER!r}"
        )
    fields["local_layers"] = tuple(i for i, kind in enumerate(types) if kind == LOCAL_LAYER)
    if fields["local_layers"]:
        window = values.get("sliding_window", 4096)
        if window is None:
            raise ValueError(f"sliding_window null: the {LOCAL_LAYER} layers of layer_types need a window")
        fields["local_window"] = _hf_int_or_none("sliding_window", window)
    return fields


def _check_hf_int(key: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} {value!r}: expected a positive integer")


def _hf_int_or_none(key: str, value) -> int | None:
    if value is not None:
        _check_hf_int(key, value)
    return value


def _hf_number(key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{key} {value!r}: expected a positive finite number")
    return float(value)


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


# --- Reading: RoPE ------------------------------------------------------------------------------------------

_SCALING_KEYS = {
    # For each kind: key -> (type, required). Checked in this order.
    "linear": {"factor": (float, True)},
    "dynamic": {"factor": (float, True)},
    "llama3": {
        "factor": (float, True),
        "low_freq_factor": (float, True),
        "high_freq_factor": (float, True),
        "original_max_position_embeddings": (int, False),
    },
    "yarn": {
        "factor": (float, True),
        "original_max_position_embeddings": (int, False),
        "attention_factor": (float, False),
        "beta_fast": (float, False),
        "beta_slow": (float, False),
        "mscale": (float, False),
        "mscale_all_dim": (float, False),
    },
    "longrope": {
        "factor": (float, False),
        "original_max_position_embeddings": (int, False),
        "attention_factor": (float, False),
    },
}


def _rope_source(values: dict, default_theta: float = 10000.0) -> tuple[str, dict, object]:
    """Where the RoPE settings are: (its key, the settings, the base) of 5.x ``rope_parameters`` or 4.x
    ``rope_theta`` + ``rope_scaling``."""
    if isinstance(values.get("rope_parameters"), dict):
        params = values["rope_parameters"]
        return "rope_parameters", params, params.get("rope_theta", values.get("rope_theta", default_theta))
    if values.get("rope_parameters") is not None:
        raise ValueError(f"rope_parameters {values['rope_parameters']!r}: expected an object")
    params = values.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_scaling {params!r}: expected an object or null")
    return "rope_scaling", params, values.get("rope_theta", default_theta)


def _rope_from_hf(values: dict, family: str, head_size: int) -> dict:
    """rope_theta, rope_scaling and partial_rotary_factor from either spelling."""
    key, params, theta = _rope_source(values, _default("rope_theta", family))
    partial = params.get("partial_rotary_factor", values.get("partial_rotary_factor", 1.0))
    if family != "phi3" and partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial!r} is not supported; expected 1.0")
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise ValueError(f"partial_rotary_factor {partial!r}: expected a number in (0, 1]")
    theta, scaling = _rope_params(key, params, theta, values, family, int(head_size * partial))
    return {"rope_theta": theta, "rope_scaling": scaling, "partial_rotary_factor": float(partial)}


def _gemma3_rope(values: dict, head_size: int) -> dict:
    """Gemma 3's two RoPEs: the global layers' (scaled, base rope_theta) and the local layers' (plain, base
    rope_local_base_freq); 5.x keeps one object per layer type in rope_parameters."""
    nested = values.get("rope_parameters")
    if nested is None:
        key, params, theta = _rope_source(values)
        theta, scaling = _rope_params(key, params, values.get("rope_theta", 1e6), values, "gemma3_text", head_size)
        local = values.get("rope_local_base_freq", 10000.0)
        return {
            "rope_theta": theta,
            "rope_scaling": scaling,
            "local_rope_theta": _hf_number("rope_local_base_freq", local),
        }
    if not isinstance(nested, dict) or not set(nested) <= {GLOBAL_LAYER, LOCAL_LAYER}:
        raise ValueError(
            f"rope_parameters {nested!r}: gemma3_text expects an object per layer type ({GLOBAL_LAYER}, {LOCAL_LAYER})"
        )
    found = {}
    for kind, default_theta in (
        (GLOBAL_LAYER, values.get("rope_theta", 1e6)),
        (LOCAL_LAYER, values.get("rope_local_base_freq", 10000.0)),
    ):
        params = nested.get(kind) or {}
        if not isinstance(params, dict):
            raise ValueError(f"rope_parameters.{kind} {params!r}: expected an object")
        found[kind] = _rope_params(
            f"rope_parameters.{kind}", params, params.get("rope_theta", default_theta), values, "gemma3_text", head_size
        )
    (theta, scaling), (local, local_scaling) = found[GLOBAL_LAYER], found[LOCAL_LAYER]
    if local_scaling is not None:
        raise ValueError(
            f"rope_parameters.{LOCAL_LAYER}.rope_type {local_scaling.rope_type!r} is not supported; expected default"
        )
    return {"rope_theta": theta, "rope_scaling": scaling, "local_rope_theta": local}


def _rope_params(
    key: str, params: dict, theta, values: dict, family: str, rotary_dim: int
) -> tuple[float, RopeScaling | None]:
    """(base, scaling) of one set of RoPE settings, ``key`` naming where they are."""
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < math.inf:
        raise ValueError(f"{key}.rope_theta {theta!r}: expected a positive finite number")
    # transformers 4.x wrote the kind as "type" before it became "rope_type".
    kind_key = "rope_type" if "rope_type" in params or "type" not in params else "type"
    kind = params.get(kind_key, "default")
    if family == "phi3" and kind in ("su", "yarn"):
        kind = "longrope"  # what transformers' Phi3Config makes of Phi-3's earlier names for it
    allowed = ("default", "longrope") if family == "phi3" else ROPE_TYPES
    if kind not in allowed:
        raise ValueError(f"{key}.{kind_key} {kind!r} is not supported; expected one of {', '.join(allowed)}")
    if kind == "default":
        return float(theta), None
    found = {}
    for name, (kind_of, required) in _SCALING_KEYS[kind].items():
        value = params.get(name)
        if value is None and not required:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not 0 < value < math.inf
            or (kind_of is int and not isinstance(value, int))
        ):
            raise ValueError(f"{key}.{name} {value!r}: {kind} scaling needs a positive finite number here")
        found[name] = kind_of(value)
    if kind in ("llama3", "yarn", "longrope"):
        found["original_max_position_embeddings"] = _original_context(key, found, values, family)
    if kind == "llama3" and found["high_freq_factor"] <= found["low_freq_factor"]:
        raise ValueError(
            f"{key}.high_freq_factor {found['high_freq_factor']} must exceed low_freq_factor {found['low_freq_factor']}"
        )
    if kind == "yarn":
        truncate = params.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ValueError(f"{key}.truncate {truncate!r}: expected true or false")
        found["truncate"] = truncate
    if kind == "longrope":
        for name in ("short_factor", "long_factor"):
            found[name] = _frequency_factors(f"{key}.{name}", params.get(name), rotary_dim // 2)
    return float(theta), RopeScaling(kind, **found)


def _original_context(key: str, found: dict, values: dict, family: str) -> int:
    """The original context of llama3, yarn and longrope scaling: a top-level original_max_position_embeddings wins
    (Phi-3's config always has one, 4096 by default), then the scaling's own, then max_position_embeddings."""
    top = values.get("original_max_position_embeddings", 4096 if family == "phi3" else None)
    if top is not None:
        _check_hf_int("original_max_position_embeddings", top)
        return top
    if "original_max_position_embeddings" in found:
        return found["original_max_position_embeddings"]
    return values.get("max_position_embeddings") or _default("max_position_embeddings", family)


def _frequency_factors(key: str, value, count: int) -> tuple[float, ...]:
    if (
        not isinstance(value, list)
        or len(value) != count
        or not all(not isinstance(v, bool) and isinstance(v, (int, float)) and 0 < v < math.inf for v in value)
    ):
        raise ValueError(f"{key}: longrope scaling needs a list of {count} positive numbers (one per frequency)")
    return tuple(float(v) for v in value)
