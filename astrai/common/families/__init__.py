"""The model families the trainer computes itself, a spec each (:class:`astrai.common.families.base.FamilySpec`),
torch-free: a family is one file here, and one module of the model where it brings a new kind of layer.

Recipe, "add a family": write its spec in a new file of this folder (its ``model_type`` and transformers class, the
defaults its config class assumes, the features it fixes, how it reads and writes its own keys, what it refuses, its
RoPE rules and expert names), and list it in :data:`SPECS`; a test builds it with transformers and compares logits.
"""

from __future__ import annotations

from astrai.common.families import experts, gemma, granite, llama, olmo2, phi3, qwen
from astrai.common.families.base import FamilySpec

SPECS: tuple[FamilySpec, ...] = (
    llama.SPEC,
    qwen.QWEN2,
    qwen.QWEN3,
    gemma.GEMMA2,
    gemma.GEMMA3,
    phi3.SPEC,
    olmo2.SPEC,
    granite.SPEC,
    experts.QWEN3_MOE,
    experts.MIXTRAL,
)
DEFAULT_FAMILY = llama.SPEC.name
"""What a model made here without a family is written as (the presets)."""
FAMILIES: dict[str, FamilySpec] = {spec.name: spec for spec in SPECS}
"""Every family, by the name ModelConfig.family holds."""
BY_MODEL_TYPE: dict[str, FamilySpec] = {model_type: spec for spec in SPECS for model_type in spec.classes}
MODEL_TYPES = tuple(BY_MODEL_TYPE)
"""Every ``model_type`` the trainer computes itself."""
CLASSES = {model_type: cls for spec in SPECS for model_type, cls in spec.classes.items()}
"""Each ``model_type`` and the transformers class its folders name."""
FEATURES = sorted({name for spec in SPECS for name in spec.features})
"""The ModelConfig features some family fixes."""
OWNED = {name: tuple(spec.name for spec in SPECS if name in spec.owns) for spec in SPECS for name in spec.owns}
"""Each family-owned ModelConfig field, and the families that own it."""


def family(name: str) -> FamilySpec:
    """The spec of a family by ModelConfig.family's name; ValueError naming the ones there are."""
    spec = FAMILIES.get(name)
    if spec is None:
        raise ValueError(f"family: expected one of {', '.join(sorted(FAMILIES))}, got {name!r}")
    return spec
