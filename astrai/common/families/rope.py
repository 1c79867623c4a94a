"""RoPE as transformers reads it from a ``config.json``: the 4.x spelling (``rope_theta``, ``rope_scaling``) or the 5.x
one (``rope_parameters``), each scaling with its keys checked, into :class:`RopeScaling`; a family's rules
(:class:`astrai.common.families.base.RopeRules`) say which scalings it takes."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from astrai.common.families.base import check_hf_int


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


def rope_source(values: dict, default_theta: float = 10000.0) -> tuple[str, dict, object]:
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


def read_rope(values: dict, spec, head_size: int) -> dict:
    """rope_theta, rope_scaling and partial_rotary_factor from either spelling, by the family's rules (``spec``, a
    FamilySpec)."""
    if spec.rope.reader is not None:
        return spec.rope.reader(values, head_size)
    key, params, theta = rope_source(values, spec.default("rope_theta"))
    partial = params.get("partial_rotary_factor", values.get("partial_rotary_factor", 1.0))
    if not spec.rope.partial and partial != 1.0:
        raise ValueError(f"partial_rotary_factor {partial!r} is not supported; expected 1.0")
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise ValueError(f"partial_rotary_factor {partial!r}: expected a number in (0, 1]")
    theta, scaling = rope_params(key, params, theta, values, spec, int(head_size * partial))
    return {"rope_theta": theta, "rope_scaling": scaling, "partial_rotary_factor": float(partial)}


def rope_params(key: str, params: dict, theta, values: dict, spec, rotary_dim: int) -> tuple[float, RopeScaling | None]:
    """(base, scaling) of one set of RoPE settings, ``key`` naming where they are."""
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not 0 < theta < math.inf:
        raise ValueError(f"{key}.rope_theta {theta!r}: expected a positive finite number")
    # transformers 4.x wrote the kind as "type" before it became "rope_type".
    kind_key = "rope_type" if "rope_type" in params or "type" not in params else "type"
    kind = params.get(kind_key, "default")
    kind = spec.rope.aliases.get(kind, kind)  # what the family's config makes of its earlier names
    if kind not in spec.rope.types:
        raise ValueError(f"{key}.{kind_key} {kind!r} is not supported; expected one of {', '.join(spec.rope.types)}")
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
        found["original_max_position_embeddings"] = _original_context(found, values, spec)
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


def _original_context(found: dict, values: dict, spec) -> int:
    """The original context of llama3, yarn and longrope scaling: a top-level original_max_position_embeddings wins
    (the family's config may assume one: Phi-3's 4096), then the scaling's own, then max_position_embeddings."""
    top = values.get("original_max_position_embeddings", spec.rope.original_context)
    if top is not None:
        check_hf_int("original_max_position_embeddings", top)
        return top
    if "original_max_position_embeddings" in found:
        return found["original_max_position_embeddings"]
    return values.get("max_position_embeddings") or spec.default("max_position_embeddings")


def _frequency_factors(key: str, value, count: int) -> tuple[float, ...]:
    if (
        not isinstance(value, list)
        or len(value) != count
        or not all(not isinstance(v, bool) and isinstance(v, (int, float)) and 0 < v < math.inf for v in value)
    ):
        raise ValueError(f"{key}: longrope scaling needs a list of {count} positive numbers (one per frequency)")
    return tuple(float(v) for v in value)
