"""What a model family is to the trainer: :class:`FamilySpec`, and the small readers every spec's code shares.

A spec says everything that is particular to one family: its ``model_type`` names and transformers classes, the
defaults its transformers config assumes for keys a ``config.json`` leaves out, the features it fixes for the model
(where its norms sit, fused projections, ...), how it reads its own keys into the model's feature fields and writes
them back, what it refuses, its RoPE rules and the names it saves its experts under. The generic reader and writer
(:mod:`astrai.common.model_config`) do the rest, the same for every family.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field

LOCAL_LAYER, GLOBAL_LAYER = "sliding_attention", "full_attention"
"""transformers' ``layer_types``: a layer that attends within the local window, or to the whole sequence."""
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
GENERIC_DEFAULTS = {
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "head_dim": None,
}
"""What a transformers config assumes for a key ``config.json`` leaves out, unless the family's says otherwise."""


@dataclass(frozen=True)
class RopeRules:
    """A family's RoPE: the scalings it takes, the older names transformers maps onto them, whether a part of each
    head turns, the original context its config assumes, and a reader of its own (Gemma 3's two RoPEs)."""

    types: tuple[str, ...] = ROPE_TYPES
    aliases: dict[str, str] = field(default_factory=dict)
    partial: bool = False
    original_context: int | None = None
    """The top-level ``original_max_position_embeddings`` the family's config assumes when it is left out."""
    reader: Callable[[dict, int], dict] | None = None
    """(config.json, head size) -> rope_theta, rope_scaling and the family's other RoPE fields."""


@dataclass(frozen=True)
class ExpertNames:
    """Where ``save_pretrained`` writes a mixture's experts, one matrix per expert and projection: under
    ``model.layers.{i}.{parent}.experts.{e}.{matrix}.weight``, each matrix of the stacked gate_up (its ``gate`` or
    ``up`` half) or down; and the router's saved parent, when it is not ``mlp``."""

    parent: str
    matrices: dict[str, tuple[tuple[str, str | None], ...]]
    router_parent: str = "mlp"


def _nothing(*args) -> dict:
    return {}


@dataclass(frozen=True)
class FamilySpec:
    """One family the trainer computes itself."""

    name: str
    """What ``ModelConfig.family`` holds."""
    classes: dict[str, str]
    """Each ``model_type`` of the family and the transformers class its folders name (the first: its own)."""
    classifiers: dict[str, str] = field(default_factory=dict)
    """Each ``model_type``'s sequence classifier in transformers (a reward model: a score head on the last token in
    place of the output projection); a family without one has none."""
    defaults: dict[str, object] = field(default_factory=dict)
    """The family config's defaults that differ from :data:`GENERIC_DEFAULTS`."""
    activation: tuple[str, str] = ("hidden_act", "silu")
    """The key the MLP's gate is read from, and its default."""
    features: dict[str, object] = field(default_factory=dict)
    """The ModelConfig features every model of the family has (where the norms sit, fused projections, ...)."""
    owns: tuple[str, ...] = ()
    """The ModelConfig fields only this family sets (and writes back): another family's config with one of them set
    would lose it."""
    needs: tuple[str, ...] = ()
    """The fields a config of the family must set."""
    read: Callable[[dict, str, int], dict] = _nothing
    """(config.json, model_type, n_layers) -> the family's own fields; ValueError naming a key it refuses."""
    write: Callable[[object, dict], None] | None = None
    """(the ModelConfig, config.json's values) -> the family's own keys written into the values."""
    rope: RopeRules = field(default_factory=RopeRules)
    experts: ExpertNames | None = None
    model_type_of: Callable[[object], str] | None = None
    """The model_type a config is written as (Llama with a sliding window is Mistral); by default the first."""

    def default(self, key: str):
        return self.defaults.get(key, GENERIC_DEFAULTS[key])

    def written_type(self, config) -> str:
        return next(iter(self.classes)) if self.model_type_of is None else self.model_type_of(config)


def check_hf_int(key: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} {value!r}: expected a positive integer")


def hf_int_or_none(key: str, value) -> int | None:
    if value is not None:
        check_hf_int(key, value)
    return value


def hf_number(key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{key} {value!r}: expected a positive finite number")
    return float(value)


def refuse_true(values: dict, *keys: str) -> None:
    """A key of a setting the trainer does not compute, which must be false or absent."""
    for key in keys:
        if values.get(key) not in (None, False):
            raise ValueError(f"{key} {json.dumps(values[key])} is not supported; expected false")


def drop(values: dict, *keys: str) -> None:
    """Keys the family's config does not have, out of the values the generic writer wrote."""
    for key in keys:
        values.pop(key, None)
