"""Low-rank adapters (LoRA) on the model's linear layers, computed as PEFT computes them.

An adapted layer keeps its weight ``W`` frozen and adds two small trainable matrices::

    y = W x + b + (alpha / r) * B (A dropout(x))        A: (r, in), B: (out, r)

``A`` starts as PEFT starts it (Kaiming-uniform with a = sqrt(5)) and ``B`` at zero, so before the
first step the adapted model is the base model exactly. The adapters are float32 whatever the base
weights' dtype; their output is cast back to the layer's.

The frozen base may be held in bfloat16 (``training.lora_base_dtype``, :func:`hold_base_in`): half the
memory of its weights, while every layer still computes in the activations' dtype (float32 on CPU, as
autocast says on CUDA), widening one weight at a time. Or in 4 bits (``nf4``, QLoRA, :func:`hold_base_in_nf4`): the
blocks' linear weights as torchao's NF4 tensor (:mod:`astrai.trainer.models.nf4`), dequantised one layer at a time.

The adapted layer is still an ``nn.Linear`` holding its own ``weight`` (and ``bias``), so the base
weights keep their names (``layers.0.attention.wq.weight``) and load, shard and export as before;
the adapters are ``<layer>.lora_A.weight`` and ``<layer>.lora_B.weight``. Which layers are adapted
is said with PEFT's (Hugging Face's) module names: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
``gate_proj``, ``up_proj``, ``down_proj``. A model that computes several of them in one matrix (Phi-3's
``qkv_proj`` and ``gate_up_proj``) gets one adapter on that matrix, as PEFT gives it, when all its parts are
named (:func:`astrai.common.model_folder.adapted_modules`); its adapter files and PEFT folders name it as the model
does, so PEFT and ``invoke export`` read them as they read any other.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from astrai.common.contract import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, PICKLED_ADAPTER_FILE
from astrai.common.errors import AstraiError
from astrai.common.fit import lora_modules
from astrai.common.model_folder import (
    ADAPTER_TARGETS,
    EXPERT_ADAPTERS,
    EXPERT_TARGETS,
    PEFT_EXPERT_MODULES,
    PEFT_EXPERT_PARAMETERS,
    PEFT_MODULES,
    PEFT_PREFIX,
    PROJECTIONS,
    canonical_targets,
    peft_expert_adapter,
)
from astrai.common.nf4 import NF4
from astrai.common.settings import LoRASettings, SettingError
from astrai.trainer.models.experts import ExpertLoRA, MixtureOfExperts
from astrai.trainer.models.nf4 import is_nf4, nf4_linear, quantize_base
from astrai.trainer.models.scoring import frozen_linear

TARGETS = {name: PEFT_MODULES[name] for name in ADAPTER_TARGETS}
"""PEFT's name of each linear layer of a Llama block, and ours (a fused layer is named by these parts)."""


class FrozenLinear(nn.Linear):
    """A linear layer whose weight (and bias) do not train, and may be held narrower than the activations (bfloat16
    under float32, or 4-bit NF4): it computes in the activations' dtype. Same parameter names as the layer it
    replaces."""

    nf4 = False
    """The weight is torchao's NF4 tensor (:func:`hold_base_in_nf4`): each product dequantises it."""

    def __init__(self, base: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(x)

    def frozen(self, x: torch.Tensor) -> torch.Tensor:
        """The frozen layer's output (without adapters)."""
        if self.nf4:
            return nf4_linear(x, self.weight, self.bias)
        return frozen_linear(x, self.weight, self.bias)


class LoRALinear(FrozenLinear):
    """A linear layer with its weight frozen and a low-rank update beside it."""

    def __init__(self, base: nn.Linear, settings: LoRASettings, generator: torch.Generator | None = None):
        super().__init__(base)
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
        out = self.frozen(x)
        if not self.adapters_on:
            return out
        # Under autocast the adapters compute in its dtype: a float32 copy of the activations would only be cast back.
        source = x if torch.is_autocast_enabled(x.device.type) else x.to(self.lora_A.weight.dtype)
        update = self.lora_B(self.lora_A(self.dropout(source)))
        # In place: the base layer's backward does not need its output, and no second full-width tensor is made.
        return out.add_(update.to(out.dtype), alpha=self.scaling)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.out_features}, scaling={self.scaling:g}"


def add_adapters(model: nn.Module, settings: LoRASettings, generator: torch.Generator | None = None) -> list[str]:
    """Freeze every weight of ``model`` and put adapters on the target layers of each block; their names.

    ``generator`` makes the adapters' start a function of the seed (one A per layer, in layer order).
    """
    modules = lora_modules(model.config, settings)  # the same refusals as preflight's and --dry-run's
    for param in model.parameters():
        param.requires_grad_(False)
    adapted = []
    for index, block in enumerate(model.layers):
        for module in modules:
            owner_name, _, leaf = module.partition(".")
            owner = getattr(block, owner_name)
            if module in EXPERT_ADAPTERS:
                if isinstance(owner, MixtureOfExperts):  # a dense layer's MLP is not adapted (as PEFT does)
                    _adapt_experts(owner, leaf, settings, generator)
                    adapted.append(f"layers.{index}.{module}")
                continue
            base = getattr(owner, leaf)
            if isinstance(base, LoRALinear):
                raise ValueError(f"layers.{index}.{module} already has adapters")
            setattr(owner, leaf, LoRALinear(base, settings, generator))
            adapted.append(f"layers.{index}.{module}")
    return adapted


def _adapt_experts(owner: MixtureOfExperts, leaf: str, settings: LoRASettings, generator) -> None:
    stacked = getattr(owner, leaf)
    if getattr(owner, f"{leaf}_lora") is not None:
        raise ValueError(f"{leaf} already has adapters")
    experts, width_out, width_in = stacked.shape
    adapter = ExpertLoRA(experts, width_in, width_out, settings.rank, settings.scaling, stacked.device)
    adapter.reset(generator)
    setattr(owner, f"{leaf}_lora", adapter)


def hold_base_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Hold the frozen matrices of a model with adapters (every linear weight but the adapters', the embeddings)
    in ``dtype``; the norms and biases stay as they are, and so does what the layers compute in. NF4 weights stay
    NF4."""
    _freeze_linear_layers(model)
    with torch.no_grad():
        for param in model.parameters():
            if not param.requires_grad and param.dim() >= 2 and param.dtype != dtype and not is_nf4(param):
                param.data = param.data.to(dtype)


def hold_base_in_nf4(model: nn.Module, device: torch.device) -> int:
    """QLoRA's base: the blocks' linear weights as NF4 tensors on ``device`` (quantised from their float32 values,
    :mod:`astrai.trainer.models.nf4`), the other frozen matrices (the embeddings, the head) in bfloat16. The count of
    NF4 matrices."""
    _freeze_linear_layers(model)
    count = quantize_base(model, device)
    hold_base_in(model, torch.bfloat16)
    return count


def _freeze_linear_layers(model: nn.Module) -> None:
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and not child.weight.requires_grad:
                setattr(module, name, FrozenLinear(child))


def frozen_dtype(model: nn.Module) -> str:
    """How the frozen block matrices are held (``float32``, ``bfloat16``, ``nf4``); ``-`` when nothing is frozen."""
    held = [param for param in model.parameters() if not param.requires_grad and param.dim() >= 2]
    if any(is_nf4(param) for param in held):
        return NF4
    return str(held[0].dtype).removeprefix("torch.") if held else "-"


def adapter_layers(model: nn.Module) -> dict[str, LoRALinear | ExpertLoRA]:
    return {name: module for name, module in model.named_modules() if isinstance(module, (LoRALinear, ExpertLoRA))}


def is_adapter(name: str) -> bool:
    """Whether a parameter name (ours, with or without a wrapper's prefix) is an adapter's."""
    return ".lora_A." in name or ".lora_B." in name


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' weights by our names (``layers.0.attention.wq.lora_A.weight``)."""
    return {name: value for name, value in model.state_dict().items() if is_adapter(name)}


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The adapters' parameters by our names, whatever wraps the model (DDP's ``module.`` prefix left out)."""
    inner = getattr(model, "module", model)
    return {name: param for name, param in inner.named_parameters() if is_adapter(name)}


def peft_state_dict(adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adapter tensors by PEFT's names, as ``adapter_model.safetensors`` (and a LoRA checkpoint) hold them."""
    return {peft_name(name): value for name, value in adapters.items()}


def from_peft_names(tensors: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """Adapter tensors by our names; AdapterError for a tensor that is not a LoRA weight of a block's layer."""
    ours = {}
    for name, value in tensors.items():
        mine = _our_name(name)
        if mine is None:
            raise AdapterError(f"{where}: {name} is not a LoRA weight of a layer this model has")
        ours[mine] = value
    return ours


class BaseModel:
    """The model with its adapters off, scoring as the base model did: DPO's reference without a second copy."""

    def __init__(self, model: nn.Module):
        self.model = model

    def eval(self) -> BaseModel:
        self.model.eval()
        return self

    def parameters(self):
        return self.model.parameters()

    def __call__(self, *args, **kwargs):
        with adapters_off(self.model):
            return self.model(*args, **kwargs)


def peft_name(name: str) -> str:
    """PEFT's name in ``adapter_model.safetensors`` for one of our adapter names.

    ``layers.0.attention.wq.lora_A.weight`` -> ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``
    """
    if not name.startswith("layers."):  # a transformers model's own module names (model.backend: transformers)
        return f"{PEFT_PREFIX}{name}"
    layer, _, part = name.rpartition(".lora_")
    _, index, module = layer.split(".", 2)
    if module.endswith("_lora"):  # an expert adapter: layers.0.feed_forward.gate_up_lora
        return f"{PEFT_PREFIX}model.layers.{index}.{PEFT_EXPERT_MODULES[module.removesuffix('_lora')]}.lora_{part}"
    return f"{PEFT_PREFIX}model.layers.{index}.{PROJECTIONS[module]}.lora_{part}"


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


# --- PEFT adapter folders ----------------------------------------------------------------------------


class AdapterError(AstraiError):
    """A PEFT adapter folder that cannot be read, or does not fit the model it is meant for."""


def read_peft_adapter(folder: Path) -> tuple[LoRASettings, dict[str, torch.Tensor]]:
    """The settings and weights (by our names) of a PEFT LoRA adapter folder; AdapterError says what does not fit."""
    folder = Path(folder)
    if not (folder / ADAPTER_WEIGHTS_FILE).exists() and (folder / PICKLED_ADAPTER_FILE).exists():
        raise AdapterError(
            f"{folder} holds {PICKLED_ADAPTER_FILE}: only {ADAPTER_WEIGHTS_FILE} is read (a pickle file can run code "
            "when it is loaded); convert it with peft: PeftModel.from_pretrained(base_model, folder)"
            ".save_pretrained(new_folder, safe_serialization=True)"
        )
    try:
        raw = json.loads((folder / ADAPTER_CONFIG_FILE).read_text(encoding="utf-8"))
        tensors = load_file(folder / ADAPTER_WEIGHTS_FILE, device="cpu")
    except (OSError, ValueError) as error:
        raise AdapterError(f"{folder}: not a PEFT adapter folder ({error})") from None
    if not isinstance(raw, dict) or raw.get("peft_type") != "LORA":
        raise AdapterError(f"{folder / ADAPTER_CONFIG_FILE}: peft_type must be LORA, got {raw.get('peft_type')!r}")
    unsupported = {
        key: raw.get(key)
        for key in ("use_dora", "use_rslora", "fan_in_fan_out", "rank_pattern", "alpha_pattern", "layers_to_transform")
        if raw.get(key)
    }
    if raw.get("bias", "none") != "none" or raw.get("modules_to_save") or unsupported:
        raise AdapterError(
            f"{folder / ADAPTER_CONFIG_FILE}: only plain LoRA adapters are read (bias none, no modules_to_save, "
            f"no DoRA, rsLoRA, fan_in_fan_out, per-layer rank or alpha patterns, or layers_to_transform); it has "
            f"{unsupported or {'bias': raw.get('bias'), 'modules_to_save': raw.get('modules_to_save')}}"
        )
    targets = raw.get("target_modules")
    targets = [targets] if isinstance(targets, str) else list(targets or ())
    parameters = raw.get("target_parameters") or []
    if parameters:
        # PEFT's stacked experts (transformers 5.x): both of them, adapted whole; in any order (PEFT keeps them in a
        # set, so a folder it writes lists them in an order that changes from one process to the next).
        if sorted(parameters) != sorted(PEFT_EXPERT_PARAMETERS):
            raise AdapterError(
                f"{folder / ADAPTER_CONFIG_FILE}: target_parameters {parameters} are not read; expected "
                f"{list(PEFT_EXPERT_PARAMETERS)} (a mixture of experts' experts, adapted whole)"
            )
        targets += list(EXPERT_TARGETS)
    unknown = sorted(set(targets) - set(PEFT_MODULES))
    if not targets or unknown:
        raise AdapterError(
            f"{folder / ADAPTER_CONFIG_FILE}: target_modules {unknown or targets} are not among "
            f"{', '.join(PEFT_MODULES)}"
        )
    try:
        numbers = int(raw["r"]), float(raw["lora_alpha"]), float(raw.get("lora_dropout", 0.0))
    except (KeyError, TypeError, ValueError) as error:
        raise AdapterError(f"{folder / ADAPTER_CONFIG_FILE}: r and lora_alpha must be numbers ({error})") from None
    try:
        # A fused layer (qkv_proj) is named by its parts, as training.lora_targets names it.
        settings = LoRASettings(*numbers, canonical_targets(targets))
    except SettingError as error:
        raise AdapterError(f"{folder / ADAPTER_CONFIG_FILE}: {error}") from None
    return settings, from_peft_names(tensors, str(folder / ADAPTER_WEIGHTS_FILE))


_OURS_BY_HF = {hf: ours for ours, hf in PROJECTIONS.items()}


def _our_name(peft: str) -> str | None:
    """Ours for a PEFT adapter tensor name (the inverse of peft_name), or None."""
    head, found, part = peft.removeprefix(PEFT_PREFIX + "model.layers.").partition(".lora_")
    index, _, module = head.partition(".")
    if not peft.startswith(PEFT_PREFIX) or not found or not index.isdigit() or part not in ("A.weight", "B.weight"):
        return None
    expert = peft_expert_adapter(peft)
    if expert is not None:
        return f"{expert[0]}_lora.lora_{part}"
    ours = _OURS_BY_HF.get(module)
    return None if ours is None else f"layers.{index}.{ours}.lora_{part}"


def load_adapters(model: nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    """Put adapter weights (by our names) into a model that has adapters of the same shapes; AdapterError if not."""
    state = adapter_state_dict(model)
    missing, extra = sorted(set(state) - set(tensors)), sorted(set(tensors) - set(state))
    if missing or extra:  # said with PEFT's names, the ones the adapter folder holds
        raise AdapterError(
            f"{where}: its adapters do not fit this model's: "
            + "; ".join(
                f"{what} {peft_name(names[0])}{' and more' if len(names) > 1 else ''}"
                for what, names in (("missing", missing), ("not in the model", extra))
                if names
            )
        )
    for name, target in state.items():  # every shape checked before any is loaded: a refusal changes nothing
        if tuple(tensors[name].shape) != tuple(target.shape):
            raise AdapterError(
                f"{where}: {peft_name(name)} is {list(tensors[name].shape)}, this model's is {list(target.shape)} "
                "(its rank or its base model is another)"
            )
    with torch.no_grad():
        for name, target in state.items():
            target.copy_(tensors[name])
