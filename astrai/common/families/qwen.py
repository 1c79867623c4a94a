"""Qwen2 (biases on q, k and v) and Qwen3 (an RMSNorm over each query and key head): Llama blocks whose attention is
full unless ``use_sliding_window`` says otherwise, which the trainer does not compute."""

from __future__ import annotations

from astrai.common.families.base import FamilySpec, drop, refuse_true


def _read(values: dict, model_type: str, n_layers: int) -> dict:
    refuse_true(values, "use_sliding_window")
    return {}


def write_full_attention(config, values: dict) -> None:
    """Qwen's keys: attention full in every layer."""
    values.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.n_layers)


def _write_qwen2(config, values: dict) -> None:
    write_full_attention(config, values)
    drop(values, "mlp_bias", "attention_bias")  # its biases are implied: Qwen2Config has no key for them


def _write_qwen3(config, values: dict) -> None:
    write_full_attention(config, values)
    drop(values, "mlp_bias")


QWEN2 = FamilySpec(
    name="qwen2",
    classes={"qwen2": "Qwen2ForCausalLM"},
    classifiers={"qwen2": "Qwen2ForSequenceClassification"},
    features={"attention_bias": True},
    read=_read,
    write=_write_qwen2,
)
QWEN3 = FamilySpec(
    name="qwen3",
    classes={"qwen3": "Qwen3ForCausalLM"},
    classifiers={"qwen3": "Qwen3ForSequenceClassification"},
    features={"qk_norm": "head"},
    read=_read,
    write=_write_qwen3,
)
