"""Gemma 2 and Gemma 3: embeddings scaled by sqrt(hidden_size), RMSNorms that scale by (1 + weight), norms before and
after attention and the MLP, GELU (tanh) gating, the attention scale 1/sqrt(query_pre_attn_scalar), soft-capped
attention scores and logits (``cap * tanh(x / cap)``), layers alternating between a local window and the whole
sequence (``layer_types``). Gemma 3 also normalises each query and key head and gives its local layers a RoPE base of
their own (5.x: one set of RoPE parameters per layer type)."""

from __future__ import annotations

from astrai.common.families.base import (
    GLOBAL_LAYER,
    LOCAL_LAYER,
    FamilySpec,
    RopeRules,
    check_hf_int,
    drop,
    hf_int_or_none,
    hf_number,
    refuse_true,
)
from astrai.common.families.rope import rope_params, rope_source

_OWNS = ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "local_window")
_FEATURES = {"block_norms": "both", "norm_plus_one": True, "scale_embeddings": True}
_DEFAULTS = {"tie_word_embeddings": True, "head_dim": 256}


def _read(values: dict, model_type: str, n_layers: int) -> dict:
    refuse_true(values, "use_bidirectional_attention")
    gemma2 = model_type == "gemma2"
    if not gemma2 and values.get("attn_logit_softcapping") is not None:
        raise ValueError(
            f"attn_logit_softcapping {values['attn_logit_softcapping']!r} is not supported for gemma3_text "
            "(transformers' Gemma 3 does not apply it); expected null"
        )
    capped = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0} if gemma2 else {}
    fields = {
        key: None if values.get(key, capped.get(key)) is None else hf_number(key, values.get(key, capped.get(key)))
        for key in ("attn_logit_softcapping", "final_logit_softcapping")
    }
    scalar = values.get("query_pre_attn_scalar", 256)
    check_hf_int("query_pre_attn_scalar", scalar)
    fields["query_pre_attn_scalar"] = scalar
    types = values.get("layer_types")
    if types is None:
        # Older configs: Gemma 2 alternates local and global layers; Gemma 3 has one global layer in every
        # sliding_window_pattern (6).
        pattern = 2 if gemma2 else values.get("sliding_window_pattern", 6)
        check_hf_int("sliding_window_pattern", pattern)
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
        fields["local_window"] = hf_int_or_none("sliding_window", window)
    return fields


def _write(config, values: dict) -> None:
    drop(values, "mlp_bias")
    values.update(
        hidden_activation=config.activation,
        query_pre_attn_scalar=config.query_pre_attn_scalar,
        attn_logit_softcapping=config.attn_logit_softcapping,
        final_logit_softcapping=config.final_logit_softcapping,
        sliding_window=config.local_window,
        layer_types=[LOCAL_LAYER if i in config.local_layers else GLOBAL_LAYER for i in range(config.n_layers)],
        use_bidirectional_attention=False,
    )


def _write_gemma3(config, values: dict) -> None:
    _write(config, values)
    # 5.x: one set of RoPE parameters per layer type; 4.x: rope_theta, rope_scaling (the global layers'),
    # rope_local_base_freq.
    local = {"rope_type": "default", "rope_theta": config.local_rope_theta or config.rope_theta}
    values["rope_parameters"] = {GLOBAL_LAYER: values["rope_parameters"], LOCAL_LAYER: local}
    values["rope_local_base_freq"] = local["rope_theta"]


def _gemma3_rope(values: dict, head_size: int) -> dict:
    """Gemma 3's two RoPEs: the global layers' (scaled, base rope_theta) and the local layers' (plain, base
    rope_local_base_freq); 5.x keeps one object per layer type in rope_parameters."""
    nested = values.get("rope_parameters")
    if nested is None:
        key, params, theta = rope_source(values)
        theta, scaling = rope_params(key, params, values.get("rope_theta", 1e6), values, GEMMA3, head_size)
        local = values.get("rope_local_base_freq", 10000.0)
        return {
            "rope_theta": theta,
            "rope_scaling": scaling,
            "local_rope_theta": hf_number("rope_local_base_freq", local),
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
        theta = params.get("rope_theta", default_theta)
        found[kind] = rope_params(f"rope_parameters.{kind}", params, theta, values, GEMMA3, head_size)
    (theta, scaling), (local, local_scaling) = found[GLOBAL_LAYER], found[LOCAL_LAYER]
    if local_scaling is not None:
        raise ValueError(
            f"rope_parameters.{LOCAL_LAYER}.rope_type {local_scaling.rope_type!r} is not supported; expected default"
        )
    return {"rope_theta": theta, "rope_scaling": scaling, "local_rope_theta": local}


GEMMA2 = FamilySpec(
    name="gemma2",
    classes={"gemma2": "Gemma2ForCausalLM"},
    classifiers={"gemma2": "Gemma2ForSequenceClassification"},
    defaults={**_DEFAULTS, "max_position_embeddings": 8192},
    activation=("hidden_activation", "gelu_pytorch_tanh"),
    features=_FEATURES,
    owns=_OWNS,
    needs=("query_pre_attn_scalar",),
    read=_read,
    write=_write,
)
GEMMA3 = FamilySpec(
    name="gemma3_text",
    classes={"gemma3_text": "Gemma3ForCausalLM"},
    classifiers={"gemma3_text": "Gemma3TextForSequenceClassification"},
    defaults={**_DEFAULTS, "max_position_embeddings": 131072},
    activation=("hidden_activation", "gelu_pytorch_tanh"),
    features={**_FEATURES, "qk_norm": "head"},
    owns=(*_OWNS, "local_rope_theta"),
    needs=("query_pre_attn_scalar",),
    read=_read,
    write=_write_gemma3,
    rope=RopeRules(reader=_gemma3_rope),
)
