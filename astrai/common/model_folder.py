"""A model folder, read without torch: the architecture in ``config.json`` and what the weight files hold.

The host (preflight) and the trainer read folders through this module, so both
accept and refuse the same ones. ``config.json`` is a Hugging Face Llama-family
config (``model_type`` ``llama``, ``mistral``, ``qwen2`` or ``qwen3``: MODEL_TYPES), RoPE written the transformers
4.x way (``rope_theta``, ``rope_scaling``) or the 5.x way (``rope_parameters``).
Folders are written in that form (both RoPE spellings), so that
``transformers.AutoModelForCausalLM.from_pretrained(folder)`` loads them.

Weights are ``model.safetensors``, or shards listed in
``model.safetensors.index.json``, under Hugging Face's tensor names
(``model.layers.0.self_attn.q_proj.weight``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from astrai.common.contract import META_FILE, MODEL_CONFIG_FILE, WEIGHTS_FILE, WEIGHTS_INDEX_FILE
from astrai.common.safetensors_file import FLOAT_DTYPES, ModelLoadError, read_header, read_layout  # noqa: F401

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
FAMILIES["qwen3"] = "Qwen3ForCausalLM"
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE frequency scaling as transformers defines it (``linear`` or ``llama3``)."""

    rope_type: str
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class ModelConfig:
    """The architecture; stored as ``config.json`` (Hugging Face Llama form) next to the weights."""

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
    """Hidden width of the SwiGLU MLP (``intermediate_size``)."""
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
    """Mistral's attention window; None attends to the whole sequence. Training windows must fit in it."""
    bos_token_id: int | None = None
    """Kept from a Hugging Face config so that generation from a checkpoint behaves like the base model's."""
    eos_token_id: int | tuple[int, ...] | None = None
    """As ``bos_token_id``; Llama 3 lists several."""
    family: str = "llama"
    """Which Hugging Face model it is written as: llama (mistral when it has a sliding window), qwen2 or qwen3."""
    attention_bias: bool = False
    """Biases on the query, key and value projections (Qwen2 has them)."""
    qk_norm: bool = False
    """An RMSNorm over each query and key head before the rotary embedding (Qwen3)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden_dim", "max_seq_len"):
            _check_positive_int(name, getattr(self, name))
        for name in ("head_dim", "sliding_window"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name}: expected a positive finite number, got {value!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"tie_embeddings: expected true or false, got {self.tie_embeddings!r}")
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(f"dim({self.dim}) must be a multiple of n_heads({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads({self.n_heads}) must be a multiple of n_kv_heads({self.n_kv_heads})")
        if self.head_size % 2:
            raise ValueError(f"head dim {self.head_size} must be even for rotary embedding")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    @property
    def head_size(self) -> int:
        """Width of one attention head."""
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    @property
    def model_type(self) -> str:
        # A Llama with a sliding window is what transformers calls Mistral.
        if self.family == "llama":
            return "mistral" if self.sliding_window is not None else "llama"
        return self.family

    def to_hf_dict(self) -> dict:
        """``config.json`` in the form transformers 4.x and 5.x both read."""
        scaling = self.rope_scaling.to_dict() if self.rope_scaling is not None else None
        values = {
            "architectures": [FAMILIES[self.model_type]],
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
            "hidden_act": "silu",
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
        }
        if self.sliding_window is not None:
            values["sliding_window"] = self.sliding_window
        if self.family in ("qwen2", "qwen3"):
            # Qwen's attention is full unless use_sliding_window says otherwise; its bias is implied for qwen2.
            values.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.n_layers)
            del values["mlp_bias"]
            if self.family == "qwen2":
                del values["attention_bias"]
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


def _from_hf(values: dict) -> ModelConfig:
    model_type = values["model_type"]
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported; expected one of {', '.join(MODEL_TYPES)} "
            "(a Llama-family model)"
        )
    if values.get("mlp_bias", False) is not False:
        raise ValueError(f"mlp_bias {json.dumps(values['mlp_bias'])} is not supported; expected false")
    if model_type in ("llama", "mistral", "qwen3") and values.get("attention_bias", False) is not False:
        raise ValueError(f"attention_bias {json.dumps(values['attention_bias'])} is not supported; expected false")
    if model_type in ("qwen2", "qwen3") and values.get("use_sliding_window", False) is not False:
        raise ValueError(
            f"use_sliding_window {json.dumps(values['use_sliding_window'])} is not supported; expected false"
        )
    attention_bias = model_type == "qwen2"  # Qwen2 always has them, on q, k and v (not o)
    if values.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {values['hidden_act']!r} is not supported; expected 'silu'")
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
    head_dim = values.get("head_dim")
    if head_dim is None and values["hidden_size"] % heads:
        raise ValueError(
            f"hidden_size {values['hidden_size']} is not a multiple of num_attention_heads {heads} "
            "and head_dim is not given"
        )
    if head_dim is not None and head_dim * heads == values["hidden_size"]:
        head_dim = None  # the usual width, said explicitly (transformers 5.x always writes it)
    rope_theta, rope_scaling = _rope_from_hf(values)
    # transformers' MistralConfig attends within 4096 tokens unless the config says otherwise.
    sliding_window = values.get("sliding_window", 4096) if model_type == "mistral" else None
    if sliding_window is not None:
        _check_hf_int("sliding_window", sliding_window)
    eps = values.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise ValueError(f"rms_norm_eps {eps!r}: expected a positive number")
    tie = values.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ValueError(f"tie_word_embeddings {tie!r}: expected true or false")
    return ModelConfig(
        vocab_size=values["vocab_size"],
        dim=values["hidden_size"],
        n_layers=values["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=kv_heads,
        ffn_hidden_dim=values["intermediate_size"],
        max_seq_len=values.get("max_position_embeddings") or 2048,
        rope_theta=float(rope_theta),
        norm_eps=float(eps),
        tie_embeddings=tie,
        head_dim=head_dim,
        rope_scaling=rope_scaling,
        sliding_window=sliding_window,
        bos_token_id=_token_id("bos_token_id", values.get("bos_token_id")),
        eos_token_id=_token_id("eos_token_id", values.get("eos_token_id")),
        family="llama" if model_type in ("llama", "mistral") else model_type,
        attention_bias=attention_bias,
        qk_norm=model_type == "qwen3",
    )


def _check_hf_int(key: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} {value!r}: expected a positive integer")


def _token_id(key: str, value):
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    raise ValueError(f"{key} {value!r}: expected a token id, a list of them, or null")


def _rope_from_hf(values: dict) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from either spelling: 5.x ``rope_parameters``, else 4.x ``rope_theta`` + ``rope_scaling``."""
    if isinstance(values.get("rope_parameters"), dict):
        key, params = "rope_parameters", values["rope_parameters"]
        theta = params.get("rope_theta", values.get("rope_theta", 10000.0))
    elif values.get("rope_parameters") is not None:
        raise ValueError(f"rope_parameters {values['rope_parameters']!r}: expected an object")
    else:
        key, params = "rope_scaling", values.get("rope_scaling") or {}
        theta = values.get("rope_theta", 10000.0)
        if not isinstance(params, dict):
            raise ValueError(f"rope_scaling {params!r}: expected an object or null")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < math.inf:
        raise ValueError(f"{key}.rope_theta {theta!r}: expected a positive finite number")
    # transformers 4.x wrote the kind as "type" before it became "rope_type".
    kind_key = "rope_type" if "rope_type" in params or "type" not in params else "type"
    kind = params.get(kind_key, "default")
    if kind not in ROPE_TYPES:
        raise ValueError(f"{key}.{kind_key} {kind!r} is not supported; expected one of {', '.join(ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", values.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial!r} is not supported; expected 1.0")
    if kind == "default":
        return theta, None
    fields = {"factor": float}
    if kind == "llama3":
        fields.update(low_freq_factor=float, high_freq_factor=float, original_max_position_embeddings=int)
    found = {}
    for name, kind_of in fields.items():
        value = params.get(name)
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not 0 < value < math.inf
            or (kind_of is int and not isinstance(value, int))
        ):
            raise ValueError(f"{key}.{name} {value!r}: {kind} scaling needs a positive finite number here")
        found[name] = kind_of(value)
    if kind == "llama3" and found["high_freq_factor"] <= found["low_freq_factor"]:
        raise ValueError(
            f"{key}.high_freq_factor {found['high_freq_factor']} must exceed low_freq_factor {found['low_freq_factor']}"
        )
    return theta, RopeScaling(kind, **found)


# Tensor names


def tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the architecture holds, by our module name, with its shape."""
    d, hd, f = config.dim, config.head_size, config.ffn_hidden_dim
    shapes = {"tok_embeddings.weight": (config.vocab_size, d)}
    for i in range(config.n_layers):
        prefix = f"layers.{i}."
        shapes.update(
            {
                prefix + "attention_norm.weight": (d,),
                prefix + "attention.wq.weight": (config.n_heads * hd, d),
                prefix + "attention.wk.weight": (config.n_kv_heads * hd, d),
                prefix + "attention.wv.weight": (config.n_kv_heads * hd, d),
                prefix + "attention.wo.weight": (d, config.n_heads * hd),
                prefix + "ffn_norm.weight": (d,),
                prefix + "feed_forward.w1.weight": (f, d),
                prefix + "feed_forward.w3.weight": (f, d),
                prefix + "feed_forward.w2.weight": (d, f),
            }
        )
        if config.attention_bias:
            for name, heads in (("wq", config.n_heads), ("wk", config.n_kv_heads), ("wv", config.n_kv_heads)):
                shapes[f"{prefix}attention.{name}.bias"] = (heads * hd,)
        if config.qk_norm:
            shapes[prefix + "attention.q_norm.weight"] = (hd,)
            shapes[prefix + "attention.k_norm.weight"] = (hd,)
    shapes["norm.weight"] = (d,)
    if not config.tie_embeddings:
        shapes["output.weight"] = (config.vocab_size, d)
    return shapes


def num_parameters(config: ModelConfig) -> int:
    return sum(math.prod(shape) for shape in tensor_shapes(config).values())


def num_adapter_parameters(config: ModelConfig, rank: int, targets) -> int:
    """What LoRA of ``rank`` on ``targets`` (PEFT's names) trains: rank * (in + out) for each adapted matrix."""
    ours = {hf.rpartition(".")[2]: name for name, hf in LAYER_PARTS.items()}
    shapes = tensor_shapes(config)
    return sum(
        rank * sum(shapes[f"layers.{index}.{ours[target]}.weight"])
        for index in range(config.n_layers)
        for target in targets
    )


LAYER_PARTS = {
    # ours -> Hugging Face's, for the modules of a block
    "attention_norm": "input_layernorm",
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "attention.q_norm": "self_attn.q_norm",
    "attention.k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
}
ADAPTER_TARGETS = tuple(hf.rpartition(".")[2] for hf in LAYER_PARTS.values() if hf.endswith("_proj"))
"""The linear layers of a block LoRA adapts, by PEFT's (Hugging Face's) module names."""
PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a Hugging Face module name in an adapter file."""


def peft_adapter_config(rank: int, alpha: float, dropout: float, targets, base_model: str = "") -> str:
    """adapter_config.json of a plain LoRA adapter (no bias, DoRA or rsLoRA), as PEFT writes and reads it."""
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def peft_target(name: str) -> tuple[str, str] | None:
    """(the Hugging Face weight an adapter tensor of PEFT's name belongs to, "A" or "B"), or None.

    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` -> ``model.layers.0.self_attn.q_proj.weight``
    """
    head, found, part = name.removeprefix(PEFT_PREFIX).partition(".lora_")
    if not name.startswith(PEFT_PREFIX) or not found or part not in ("A.weight", "B.weight"):
        return None
    return f"{head}.weight", part[0]


_TOP_PARTS = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}


def hf_name(name: str) -> str:
    """Hugging Face's name for one of our tensor names.

    ``layers.0.attention.wq.weight`` -> ``model.layers.0.self_attn.q_proj.weight``
    """
    module, _, leaf = name.rpartition(".")
    if module in _TOP_PARTS:
        return f"{_TOP_PARTS[module]}.{leaf}"
    _, index, part = module.split(".", 2)
    return f"model.layers.{index}.{LAYER_PARTS[part]}.{leaf}"


def hf_names(config: ModelConfig) -> dict[str, str]:
    """Hugging Face name -> our name, for every tensor of the architecture."""
    return {hf_name(name): name for name in tensor_shapes(config)}


def _ignored(hf: str, config: ModelConfig) -> bool:
    # Older Llama exports store the RoPE frequencies (derived, not weights); tied models sometimes
    # store the output matrix although it is the embedding.
    return hf.endswith(".rotary_emb.inv_freq") or (config.tie_embeddings and hf == "lm_head.weight")


# Weight files


@dataclass(frozen=True)
class WeightsSummary:
    """What a folder's weight files hold, checked against its config."""

    files: tuple[Path, ...]
    names: dict[Path, dict[str, str]]
    """For each file: name in the file -> our tensor name (tensors the loader skips are not listed)."""
    layouts: dict[Path, tuple[int, dict[str, tuple[str, tuple[int, ...], tuple[int, int]]]]]
    """For each file: where its data starts, and each tensor's dtype, shape and byte range (read_layout)."""
    dtypes: tuple[str, ...]
    """torch dtype names found, e.g. ('bfloat16',)."""
    num_parameters: int


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder: ``model.safetensors``, or the shards its index names."""
    folder = Path(folder)
    single, index = folder / WEIGHTS_FILE, folder / WEIGHTS_INDEX_FILE
    if single.is_file():
        return [single]
    if not index.is_file():
        raise ModelLoadError(f"{folder}: {WEIGHTS_FILE} is missing (and no {WEIGHTS_INDEX_FILE} lists shards)")
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError("weight_map is not a non-empty object")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ModelLoadError(f"{index}: unreadable shard index ({type(error).__name__}: {error})") from None
    files = []
    for name in sorted(set(weight_map.values()), key=str):
        if not isinstance(name, str) or Path(name).name != name or name in (".", ".."):
            raise ModelLoadError(f"{index}: weight_map names {name!r}, expected a file name in {folder}")
        if not (folder / name).is_file():
            tensor = next(t for t, f in weight_map.items() if f == name)
            raise ModelLoadError(f"{index}: weight_map puts {tensor!r} in {name}, which is missing from {folder}")
        files.append(folder / name)
    return files


def model_digest(folder: Path) -> str:
    """SHA-256 over a model folder's config.json and weight files (in name order): which model it is exactly."""
    folder = Path(folder)
    digest = hashlib.sha256()
    for path in [folder / MODEL_CONFIG_FILE, *weight_files(folder)]:
        digest.update(path.name.encode() + b"\0")
        try:
            with path.open("rb") as handle:
                while chunk := handle.read(1 << 23):
                    digest.update(chunk)
        except OSError as error:
            raise ModelLoadError(f"{path}: cannot be read ({error.strerror})") from None
    return digest.hexdigest()


def _refuse_adapters_only(folder: Path) -> None:
    """A LoRA checkpoint's weights are adapters, not a model: say so, and how to get a model folder from it."""
    try:
        lora = json.loads((folder / META_FILE).read_bytes()).get("lora")
    except (OSError, ValueError, AttributeError):
        return
    if isinstance(lora, dict):
        base = lora.get("base", {}).get("path") if isinstance(lora.get("base"), dict) else None
        raise ModelLoadError(
            f"{folder} is a LoRA checkpoint: its weights are adapters of the base model {base}, not a whole model; "
            "`invoke export --checkpoint ... --out DIR` writes it merged into a model folder to start from"
        )


BASE_SAMPLES_PER_TENSOR = 8
BASE_SAMPLE_BYTES = 4096


def base_digest(folder: Path) -> str:
    """SHA-256 of what identifies a base model cheaply: config.json, each weight file's safetensors header and size,
    and eight evenly spaced 4 KiB samples of every tensor's data. A LoRA checkpoint records it: its adapters
    belong to that base alone.

    The header says which tensors there are (names, dtypes, shapes); the samples of every tensor tell two models of
    the same architecture apart (a base, its fine-tune, its merge with adapters, which changes whole matrices)
    while reading a few megabytes of an 8B model instead of all of it.
    """
    folder = Path(folder)
    digest = hashlib.sha256()
    try:
        digest.update((folder / MODEL_CONFIG_FILE).read_bytes())
        for path in weight_files(folder):
            data_start, layout = read_layout(path)
            with path.open("rb") as handle:
                digest.update(path.name.encode() + b"\0" + str(os.fstat(handle.fileno()).st_size).encode() + b"\0")
                digest.update(handle.read(data_start))
                for _, _, (begin, stop) in sorted(layout.values(), key=lambda entry: entry[2]):
                    step = max((stop - begin) // BASE_SAMPLES_PER_TENSOR, 1)
                    for offset in range(begin, stop, step)[:BASE_SAMPLES_PER_TENSOR]:
                        handle.seek(data_start + offset)
                        digest.update(handle.read(min(BASE_SAMPLE_BYTES, stop - offset)))
    except OSError as error:
        raise ModelLoadError(f"{folder}: cannot be read ({error.strerror})") from None
    return digest.hexdigest()


def inspect_weights(folder: Path, config: ModelConfig) -> WeightsSummary:
    """Check, from the file headers alone, that a folder's weights are exactly what its config implies."""
    _refuse_adapters_only(Path(folder))
    files = weight_files(folder)
    shapes, from_hf = _expected(config)
    names: dict[Path, dict[str, str]] = {}
    found: dict[str, Path] = {}
    dtypes = set()
    layouts = {}
    for path in files:
        names[path] = in_file = {}
        layouts[path] = layout = read_layout(path)
        for stored, (dtype, shape, _) in layout[1].items():
            name = from_hf.get(stored)
            if name is None:
                if _ignored(stored, config):
                    continue
                raise ModelLoadError(f"{path}: unexpected tensor {stored!r} (not in the architecture of config.json)")
            if name in found:
                raise ModelLoadError(f"{path}: tensor {stored!r} is stored twice (also in {found[name].name})")
            if shape != shapes[name]:
                raise ModelLoadError(
                    f"{path}: tensor {stored!r} has shape {list(shape)}, config.json expects {list(shapes[name])}"
                )
            if dtype not in FLOAT_DTYPES:
                raise ModelLoadError(
                    f"{path}: tensor {stored!r} has dtype {dtype}, expected one of {', '.join(FLOAT_DTYPES.values())}"
                )
            in_file[stored] = name
            found[name] = path
            dtypes.add(FLOAT_DTYPES[dtype])
    if len(found) < len(shapes):
        name = next(name for name in shapes if name not in found)
        raise ModelLoadError(
            f"{Path(folder)}: tensor {hf_name(name)!r} is missing from the weights "
            f"(config.json expects shape {list(shapes[name])})"
        )
    return WeightsSummary(tuple(files), names, layouts, tuple(sorted(dtypes)), num_parameters(config))


@functools.lru_cache(maxsize=8)
def _expected(config: ModelConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    # Computed once per architecture: the loader looks every stored tensor up in these.
    return tensor_shapes(config), hf_names(config)


def check_window(config: ModelConfig, window_size: int, source: Path | str) -> None:
    """Refuse training windows a Mistral-style sliding window would cut."""
    if config.sliding_window is not None and window_size > config.sliding_window:
        raise ModelLoadError(
            f"{source}: sliding_window {config.sliding_window} is shorter than data.window_size {window_size}; "
            f"train with data.window_size <= {config.sliding_window}"
        )


def describe(folder: Path, config: ModelConfig, weights: WeightsSummary) -> str:
    """One line: architecture, parameter count, dtype, files."""
    shards = f"{len(weights.files)} shards" if len(weights.files) > 1 else weights.files[0].name
    extras = []
    if config.n_kv_heads != config.n_heads:
        extras.append(f"GQA {config.n_heads}/{config.n_kv_heads}")
    if config.rope_scaling is not None:
        extras.append(f"rope {config.rope_scaling.rope_type}")
    if config.tie_embeddings:
        extras.append("tied")
    detail = f", {', '.join(extras)}" if extras else ""
    return (
        f"{config.model_type} ({config.n_layers} layers, dim {config.dim}, vocab {config.vocab_size}{detail}), "
        f"{_count(weights.num_parameters)} parameters, {'/'.join(weights.dtypes)}, {shards}"
    )


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)
