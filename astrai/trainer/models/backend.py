"""The two ways the trainer computes a model, declared once: its own code (``native``) or a transformers model
(``transformers``, for the families it does not compute; ``model.backend``, decided by
:func:`astrai.common.backends.resolve_backend`).

What the rest of the trainer asks of a model is :class:`ScoringModel`; a :class:`Backend` makes one. It reads a
model folder (the start, a reference, a checkpoint's weights), builds the trained model and a frozen copy, names the
tensors a checkpoint saves, and says what it is (its generation engine: :mod:`astrai.trainer.generation.engines`).
The loop, the objectives, the checkpoints and the generate CLI hold a backend and never ask which one it is.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
from safetensors.torch import load_file
from torch import nn

from astrai.common.backends import BACKEND_NATIVE, BACKEND_TRANSFORMERS, TransformersConfig, describe_backend
from astrai.common.contract import WEIGHTS_FILE
from astrai.common.fit import SetupError, lora_modules
from astrai.common.model_config import ModelConfig
from astrai.common.model_folder import describe, inspect_weights
from astrai.common.nf4 import NF4, nf4_problem
from astrai.common.plan import RunPlan
from astrai.common.settings import LoRASettings
from astrai.trainer.models.experts import RouterBalance, router_balance
from astrai.trainer.models.lora import add_adapters, from_peft_names, hold_base_in, hold_base_in_nf4, load_adapters
from astrai.trainer.models.native import Transformer
from astrai.trainer.models.scoring import TokenScores, TokenTargets
from astrai.trainer.models.weights import describe_folder, hf_state_dict, load_base_model, load_pretrained, read_weights


class ScoringModel(Protocol):
    """A causal language model as the loop and the objectives use it (:class:`astrai.trainer.models.native.Transformer`,
    :class:`astrai.trainer.models.hf_model.TransformersModel`)."""

    config: ModelConfig | TransformersConfig

    def __call__(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
        *,
        score: TokenTargets | None = None,
    ) -> torch.Tensor | TokenScores:
        """Logits of ``tokens`` (B, T), several records a row with ``segments`` and ``positions``; with ``score``
        the log-probabilities of its targets instead, computed a chunk of positions at a time."""
        ...


class Backend:
    """What one way of computing a model does; :data:`NATIVE` and :data:`TRANSFORMERS` are the two."""

    name: str

    def read(self, folder: Path) -> tuple[ModelConfig | TransformersConfig, dict[str, torch.Tensor]]:
        """A model folder's config and weights (float32 or as stored), checked against each other."""
        raise NotImplementedError

    def trained(self, start, plan: RunPlan, seed: int, activation_checkpointing: bool, device) -> nn.Module:
        """The model a run trains, from its start (astrai.trainer.run.build.Start: config, weights, LoRA adapters), on
        ``device``: LoRA's base frozen and held in the plan's dtype, the adapters new (A from ``seed``) or the
        start's. Not yet compiled nor wrapped for the parallel mode."""
        raise NotImplementedError

    def frozen(self, config, weights: dict[str, torch.Tensor], where: str) -> nn.Module:
        """A frozen copy of a model (a reference, the generate CLI's model): eval mode, on the CPU; ``where`` names
        the weights' folder in errors."""
        raise NotImplementedError

    def pretrained(self, folder: Path) -> nn.Module:
        """A folder's model, float32, frozen on the CPU (the generate CLI)."""
        config, weights = self.read(folder)
        return self.frozen(config, weights, str(folder))

    def router_balance(self, model: nn.Module) -> RouterBalance | None:
        """A mixture of experts' load-balancing loss and metrics; None for a model without a router."""
        raise NotImplementedError

    def saved_names(self, config) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
        """How a checkpoint's ``model.safetensors`` names the model's state: a function of the state dict."""
        raise NotImplementedError

    def read_checkpoint_weights(self, folder: Path, config, adapters: bool) -> dict[str, torch.Tensor]:
        """A checkpoint's weights by the model's parameter names (with ``adapters``: the LoRA adapters alone)."""
        raise NotImplementedError

    def describe(self, folder: Path, plan: RunPlan) -> str:
        """What the run starts from, in the words of its starting line."""
        raise NotImplementedError

    def inspect(self, folder: Path, lora: bool) -> dict:
        """What the trainer builds of ``folder``, found without its weights (``python -m astrai.model check``):
        ``model``, its description, and what else this path chose; ``lora``: the adapters' layers checked too. The
        refusals of the run's start, made alike (AstraiError)."""
        raise NotImplementedError


class NativeBackend(Backend):
    """The trainer's own model (:mod:`astrai.trainer.models.native`), for the families it computes."""

    name = BACKEND_NATIVE

    def read(self, folder: Path):
        return load_base_model(folder)

    def trained(self, start, plan: RunPlan, seed: int, activation_checkpointing: bool, device) -> nn.Module:
        if start.weights is None:
            # Resuming a sharded run: the model is built without memory, sharded, and only then given this rank's
            # share of it, which the checkpoint's rows fill (CheckpointManager.restore). No rank holds it whole.
            with torch.device("meta"):
                return Transformer(start.model_config, activation_checkpointing=activation_checkpointing)
        model = Transformer(start.model_config, activation_checkpointing=activation_checkpointing)
        model.load_state_dict(start.weights)
        if plan.lora is not None:
            add_adapters(model, plan.lora, torch.Generator().manual_seed(seed))
            if start.adapters is not None:
                load_adapters(model, start.adapters, str(start.adapters_from))
            if plan.base_dtype == NF4:
                shards = plan.batch.world_size if plan.parallel_mode == "fsdp" else 1
                problem = nf4_problem(start.model_config, shards)
                if problem is not None:
                    raise SetupError(problem)
                hold_base_in_nf4(model, device)  # quantised on the device, a matrix at a time
            else:
                hold_base_in(model, getattr(torch, plan.base_dtype))
        return model.to(device)

    def frozen(self, config: ModelConfig, weights, where: str) -> nn.Module:
        model = Transformer(config)
        model.load_state_dict(weights)
        return model.eval().requires_grad_(False)

    def pretrained(self, folder: Path) -> nn.Module:
        return load_pretrained(folder)

    def router_balance(self, model: nn.Module) -> RouterBalance | None:
        return router_balance(model)

    def saved_names(self, config: ModelConfig):
        return lambda state: hf_state_dict(state, config)

    def read_checkpoint_weights(self, folder: Path, config: ModelConfig, adapters: bool):
        if adapters:  # saved under PEFT's names, as an adapter folder holds them
            return from_peft_names(load_file(folder / WEIGHTS_FILE, device="cpu"), f"{folder / WEIGHTS_FILE}")
        return read_weights(folder, config)

    def describe(self, folder: Path, plan: RunPlan) -> str:
        return describe_folder(folder)

    def inspect(self, folder: Path, lora: bool) -> dict:
        config = ModelConfig.load(folder)
        if lora:
            lora_modules(config, LoRASettings(rank=8, alpha=16.0))
        return {"model": describe(folder, config, inspect_weights(folder, config))}


class TransformersBackend(Backend):
    """A transformers model (:mod:`astrai.trainer.models.hf_model`), for any causal LM the library loads; imported only
    when
    a run takes this path."""

    name = BACKEND_TRANSFORMERS

    def read(self, folder: Path):
        from astrai.trainer.models.hf_model import load_transformers_start

        return load_transformers_start(folder)

    def trained(self, start, plan: RunPlan, seed: int, activation_checkpointing: bool, device) -> nn.Module:
        from astrai.trainer.models.hf_model import transformers_model

        return transformers_model(start, plan, seed, activation_checkpointing).to(device)

    def frozen(self, config: TransformersConfig, weights, where: str) -> nn.Module:
        from astrai.trainer.models.hf_model import TransformersModel

        model = TransformersModel(config)
        model.load_weights(weights, where)
        return model.eval().requires_grad_(False)

    def router_balance(self, model: nn.Module) -> RouterBalance | None:
        # The library's routers: the model keeps their logits as a native layer does.
        inner = getattr(model, "module", model)  # DDP's wrapped model
        return None if inner.top_k is None else RouterBalance([inner], inner.router_aux_loss_coef)

    def saved_names(self, config: TransformersConfig):
        from astrai.trainer.models.hf_model import transformers_state_dict

        return lambda state: transformers_state_dict(state, config)

    def read_checkpoint_weights(self, folder: Path, config, adapters: bool):
        from astrai.trainer.models.hf_model import read_transformers_checkpoint

        return read_transformers_checkpoint(folder, adapters)

    def describe(self, folder: Path, plan: RunPlan) -> str:
        return describe_backend(*plan.model_backend)

    def inspect(self, folder: Path, lora: bool) -> dict:
        from astrai.trainer.models.hf_model import inspect_folder

        library = inspect_folder(folder, lora)
        return {
            "model": f"{library.model_type} via transformers; {library.describe()}",
            "attention": library.attention,
            "router_aux_loss_coef": library.router_aux_loss_coef,
        }


NATIVE, TRANSFORMERS = NativeBackend(), TransformersBackend()
BACKENDS = {backend.name: backend for backend in (NATIVE, TRANSFORMERS)}


def backend_named(name: str) -> Backend:
    """The backend a plan resolved (``RunPlan.backend``: native or transformers)."""
    return BACKENDS[name]


def backend_of(config: ModelConfig | TransformersConfig) -> Backend:
    """The backend that computes a model of ``config``: the trainer's own for a :class:`ModelConfig`."""
    return TRANSFORMERS if isinstance(config, TransformersConfig) else NATIVE
