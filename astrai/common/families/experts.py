"""The mixtures of experts: Qwen3-MoE and Mixtral. A mixture of experts takes the place of the MLP (``n_experts``
gated MLPs of ``expert_hidden_dim``, a router that sends each token to ``experts_per_token`` of them). Qwen3-MoE
normalises each query and key head as Qwen3 does and may keep a plain MLP in some layers (``mlp_only_layers``,
``decoder_sparse_step``: ``dense_layers``); Mixtral may have a sliding window as Mistral does, and save_pretrained
writes its experts under its 4.x names (``block_sparse_moe``, w1, w3 and w2)."""

from __future__ import annotations

import json
import math

from astrai.common.families.base import ExpertNames, FamilySpec, check_hf_int, drop, hf_int_or_none, refuse_true

_OWNS = ("n_experts", "experts_per_token", "expert_hidden_dim", "router_aux_loss_coef")


def _experts(values: dict, qwen: bool) -> dict:
    """The mixture, as Qwen3MoeConfig and MixtralConfig read it (their defaults for what is left out)."""
    # Both configs call the count num_local_experts; Qwen3MoeConfig also takes num_experts for it.
    count_key = "num_experts" if qwen and "num_local_experts" not in values else "num_local_experts"
    fields = {"n_experts": values.get(count_key, 128 if qwen else 8)}
    check_hf_int(count_key, fields["n_experts"])
    fields["experts_per_token"] = values.get("num_experts_per_tok", 8 if qwen else 2)
    check_hf_int("num_experts_per_tok", fields["experts_per_token"])
    if fields["experts_per_token"] > fields["n_experts"]:
        raise ValueError(f"num_experts_per_tok {fields['experts_per_token']} exceeds {count_key} {fields['n_experts']}")
    width_key = "moe_intermediate_size" if qwen else "intermediate_size"
    fields["expert_hidden_dim"] = values.get(width_key, 768 if qwen else 14336)
    check_hf_int(width_key, fields["expert_hidden_dim"])
    coef = values.get("router_aux_loss_coef", 0.001)
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or not 0 <= coef < math.inf:
        raise ValueError(f"router_aux_loss_coef {coef!r}: expected a finite number >= 0")
    fields["router_aux_loss_coef"] = float(coef)
    return fields


def _read_qwen3_moe(values: dict, model_type: str, n_layers: int) -> dict:
    refuse_true(values, "use_sliding_window")
    fields = _experts(values, qwen=True)
    norm = values.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise ValueError(f"norm_topk_prob {norm!r}: expected true or false")
    fields["normalize_top_k"] = norm
    step = values.get("decoder_sparse_step", 1)
    check_hf_int("decoder_sparse_step", step)
    only = values.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ValueError(f"mlp_only_layers {only!r}: expected a list of layer numbers")
    # transformers' Qwen3MoeDecoderLayer: a layer is sparse unless listed, and only every decoder_sparse_step-th.
    fields["dense_layers"] = tuple(i for i in range(n_layers) if i in only or (i + 1) % step)
    return fields


def _write_qwen3_moe(config, values: dict) -> None:
    drop(values, "mlp_bias")
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


def _read_mixtral(values: dict, model_type: str, n_layers: int) -> dict:
    if values.get("router_jitter_noise", 0.0) not in (0, None):
        raise ValueError(
            f"router_jitter_noise {json.dumps(values['router_jitter_noise'])} is not supported; expected 0 "
            "(the router's inputs are not jittered)"
        )
    fields = _experts(values, qwen=False)
    fields["sliding_window"] = hf_int_or_none("sliding_window", values.get("sliding_window"))
    return fields


def _write_mixtral(config, values: dict) -> None:
    drop(values, "mlp_bias", "attention_bias")
    values.update(
        intermediate_size=config.expert_hidden_dim,
        num_local_experts=config.n_experts,
        num_experts_per_tok=config.experts_per_token,
        router_aux_loss_coef=config.router_aux_loss_coef,
        router_jitter_noise=0.0,
    )
    values.setdefault("sliding_window", None)


QWEN3_MOE = FamilySpec(
    name="qwen3_moe",
    classes={"qwen3_moe": "Qwen3MoeForCausalLM"},
    classifiers={"qwen3_moe": "Qwen3MoeForSequenceClassification"},
    defaults={"max_position_embeddings": 32768},
    features={"qk_norm": "head"},
    owns=(*_OWNS, "dense_layers", "normalize_top_k"),
    needs=("n_experts",),
    read=_read_qwen3_moe,
    write=_write_qwen3_moe,
    experts=ExpertNames("mlp", {"gate_up": (("gate_proj", "gate"), ("up_proj", "up")), "down": (("down_proj", None),)}),
)
MIXTRAL = FamilySpec(
    name="mixtral",
    classes={"mixtral": "MixtralForCausalLM"},
    classifiers={"mixtral": "MixtralForSequenceClassification"},
    defaults={"max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 1e6},
    owns=_OWNS,
    needs=("n_experts",),
    read=_read_mixtral,
    write=_write_mixtral,
    experts=ExpertNames(
        "block_sparse_moe", {"gate_up": (("w1", "gate"), ("w3", "up")), "down": (("w2", None),)}, "block_sparse_moe"
    ),
)
