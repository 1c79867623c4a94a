"""Llama, and Mistral: Llama with one attention window for every layer (``sliding_window``)."""

from __future__ import annotations

from astrai.common.families.base import FamilySpec, hf_int_or_none


def _read(values: dict, model_type: str, n_layers: int) -> dict:
    if model_type != "mistral":
        return {}
    # transformers' MistralConfig attends within 4096 tokens unless the config says otherwise.
    return {"sliding_window": hf_int_or_none("sliding_window", values.get("sliding_window", 4096))}


SPEC = FamilySpec(
    name="llama",
    classes={"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"},
    classifiers={"llama": "LlamaForSequenceClassification", "mistral": "MistralForSequenceClassification"},
    read=_read,
    # A Llama with a sliding window is what transformers calls Mistral.
    model_type_of=lambda config: "mistral" if config.sliding_window is not None else "llama",
)
