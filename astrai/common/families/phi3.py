"""Phi-3 and Phi-4: q, k and v computed by one matrix (``qkv_proj``), gate and up by one (``gate_up_proj``), longrope
scaling (``su`` and ``yarn`` are its earlier names for it), RoPE over a part of each head (``partial_rotary_factor``),
and maybe a sliding window in every layer."""

from __future__ import annotations

from astrai.common.families.base import FamilySpec, RopeRules, drop, hf_int_or_none


def _read(values: dict, model_type: str, n_layers: int) -> dict:
    return {"sliding_window": hf_int_or_none("sliding_window", values.get("sliding_window"))}


def _write(config, values: dict) -> None:
    drop(values, "mlp_bias", "attention_bias")
    values["partial_rotary_factor"] = config.partial_rotary_factor
    values["rope_parameters"]["partial_rotary_factor"] = config.partial_rotary_factor
    values.setdefault("sliding_window", None)
    scaling = config.rope_scaling
    if scaling is not None and scaling.original_max_position_embeddings is not None:
        # Phi3Config takes this top-level key over the one in rope_parameters (and assumes 4096 without it).
        values["original_max_position_embeddings"] = scaling.original_max_position_embeddings


SPEC = FamilySpec(
    name="phi3",
    classes={"phi3": "Phi3ForCausalLM"},
    classifiers={"phi3": "Phi3ForSequenceClassification"},
    defaults={"max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
    features={"fused_projections": True},
    owns=("partial_rotary_factor",),
    read=_read,
    write=_write,
    rope=RopeRules(
        types=("default", "longrope"),
        aliases={"su": "longrope", "yarn": "longrope"},
        partial=True,
        original_context=4096,
    ),
)
