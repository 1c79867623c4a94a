"""OLMo 2: norms after attention and the MLP instead of before, RMSNorms over the whole query and key projections."""

from __future__ import annotations

from astrai.common.families.base import FamilySpec, drop

SPEC = FamilySpec(
    name="olmo2",
    classes={"olmo2": "Olmo2ForCausalLM"},
    classifiers={"olmo2": "Olmo2ForSequenceClassification"},
    defaults={"rms_norm_eps": 1e-5},
    features={"block_norms": "post", "qk_norm": "projection"},
    write=lambda config, values: drop(values, "mlp_bias"),
)
