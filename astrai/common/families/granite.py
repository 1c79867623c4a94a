"""Granite: multipliers on the embeddings, the attention scores and each block's outputs, and a divisor of the
logits."""

from __future__ import annotations

from astrai.common.families.base import FamilySpec, hf_number

_KEYS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


def _read(values: dict, model_type: str, n_layers: int) -> dict:
    return {key: hf_number(key, values.get(key, 1.0)) for key in _KEYS}


def _write(config, values: dict) -> None:
    values.update({key: getattr(config, key) for key in _KEYS})


SPEC = FamilySpec(
    name="granite",
    classes={"granite": "GraniteForCausalLM"},
    owns=_KEYS,
    needs=("attention_multiplier",),
    read=_read,
    write=_write,
)
