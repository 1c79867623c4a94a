"""Low-rank adapters (LoRA) on the model's linear layers, computed as PEFT computes them.

An adapted layer keeps its weight ``W`` frozen and adds two small trainable matrices::

    y = W x + b + (alpha / r) * B (A dropout(x))        A: (r, in), B: (out, r)

``A`` starts as PEFT starts it (Kaiming-uniform with a = sqrt(5)) and ``B`` at zero, so before the
first step the adapted model is the base model exactly. The adapters are float32 whatever the base
weights' dtype; their output is cast back to the layer's.

The adapted layer is still an ``nn.Linear`` holding its own ``weight`` (and ``bias``), so the base
weights keep their names (``layers.0.attention.wq.weight``) and load, shard and export as before;
the adapters are ``<layer>.lora_A.weight`` and ``<layer>.lora_B.weight``. Which layers are adapted
is said with PEFT's (Hugging Face's) module names: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
``gate_proj``, ``up_proj``, ``down_proj``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from astrai.common.model_folder import hf_name

TARGETS = {
    "q_proj": "attention.wq",
    "k_proj": "attention.wk",
    "v_proj": "attention.wv",
    "o_proj": "attention.wo",
    "gate_proj": "feed_forward.w1",
    "up_proj": "feed_forward.w3",
    "down_proj": "feed_forward.w2",
}
"""PEFT's name of each linear layer of a block, and ours."""
DEFAULT_TARGETS = tuple(TARGETS)
PEFT_PREFIX = "base_model.model."
"""What PEFT puts before a Hugging Face module name in an adapter file."""


@dataclass(frozen=True)
class LoRASettings:
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class LoRALinear(nn.Linear):
    """A linear layer with its weight frozen and a low-rank update beside it."""

    def __init__(self, base: nn.Linear, settings: LoRASettings, generator: torch.Generator | None = None):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        device = base.weight.device
        self.lora_A = nn.Linear(self.in_features, settings.rank, bias=False, device=device, dtype=torch.float32)
        self.lora_B = nn.Linear(settings.rank, self.out_features, bias=False, device=device, dtype=torch.float32)
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5), generator=generator)
            nn.init.zeros_(self.lora_B.weight)
        self.scaling = settings.scaling
        self.dropout = nn.Dropout(settings.dropout) if settings.dropout > 0 else nn.Identity()
        self.adapters_on = True
        """Off: the layer is the base layer (DPO's reference is the same model with its adapters off)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.adapters_on:
            return out
        update = self.lora_B(self.lora_A(self.dropout(x.to(self.lora_A.weight.dtype))))
        return out + (update * self.scaling).to(out.dtype)

    def merged_weight(self) -> torch.Tensor:
        """The base weight with the update folded in, in the base weight's dtype."""
        delta = (self.lora_B.weight @ self.lora_A.weight) * self.scaling
        return (self.weight.float() + delta).to(self.weight.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.out_features}, scaling={self.scaling:g}"


def add_adapters(model: nn.Module, settings: LoRASettings, generator: torch.Generator | None = None) -> list[str]:
    """Freeze every weight of ``model`` and put adapters on the target layers of each block; their names.

    ``generator`` makes the adapters' start a function of the seed (one A per layer, in layer order).
    """
    unknown = sorted(set(settings.targets) - set(TARGETS))
    if unknown:
        raise ValueError(f"lora_targets: unknown {', '.join(unknown)}; choose from {', '.join(TARGETS)}")
    if settings.rank < 1:
        raise ValueError(f"lora_rank must be at least 1 to add adapters, got {settings.rank}")
    for param in model.parameters():
        param.requires_grad_(False)
    adapted = []
    for index, block in enumerate(model.layers):
        for target in settings.targets:
            owner_name, _, leaf = TARGETS[target].partition(".")
            owner = getattr(block, owner_name)
            base = getattr(owner, leaf)
            if isinstance(base, LoRALinear):
                raise ValueError(f"layers.{index}.{TARGETS[target]} already has adapters")
            setattr(owner, leaf, LoRALinear(base, settings, generator))
            adapted.append(f"layers.{index}.{TARGETS[target]}")
    return adapted


def adapter_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, LoRALinear)}


def is_adapter(name: str) -> bool:
    """Whether a parameter name (ours, with or without a wrapper's prefix) is an adapter's."""
    return ".lora_A." in name or ".lora_B." in name


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' weights by our names (``layers.0.attention.wq.lora_A.weight``)."""
    return {name: value for name, value in model.state_dict().items() if is_adapter(name)}


def peft_name(name: str) -> str:
    """PEFT's name in ``adapter_model.safetensors`` for one of our adapter names.

    ``layers.0.attention.wq.lora_A.weight`` -> ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``
    """
    layer, _, part = name.rpartition(".lora_")
    base = hf_name(f"{layer}.weight").removesuffix(".weight")
    return f"{PEFT_PREFIX}{base}.lora_{part}"


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state with every adapter folded into its layer's weight, and no adapter tensors."""
    layers = adapter_layers(model)
    state = {}
    for name, value in model.state_dict().items():
        if is_adapter(name):
            continue
        layer = name.removesuffix(".weight")
        state[name] = layers[layer].merged_weight().detach() if layer in layers and name.endswith(".weight") else value
    return state


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """The base model, for as long as the block runs (DPO's reference without a second copy)."""
    layers = list(adapter_layers(model).values())
    for layer in layers:
        layer.adapters_on = False
    try:
        yield model
    finally:
        for layer in layers:
            layer.adapters_on = True


def parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, frozen) parameters."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters()) - trainable
