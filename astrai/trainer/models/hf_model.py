"""The models the trainer does not compute itself, trained through ``transformers`` (``model.backend``).

:class:`TransformersModel` holds an ``AutoModelForCausalLM`` built from the folder's ``config.json`` (read as
``AutoConfig.from_pretrained`` reads it) and gives the objectives and the loop what
:class:`astrai.trainer.models.native.Transformer` gives them:

- ``model(tokens, positions, segments, score=TokenTargets(...))`` returns the same :class:`TokenScores`: the
  library's decoder gives the final hidden states, and the library's own ``ForCausalLM.forward`` turns them into
  logits a chunk of positions at a time (its decoder's output replaced by the chunk's hidden states), so whatever a
  family does after its output projection (a soft cap, Falcon-H1's ``lm_head_multiplier``, Cohere's ``logit_scale``,
  a bias) is in the loss, and the logits of the whole batch never exist at once (a chunk's are computed again in
  the backward pass when they would not fit :data:`astrai.common.memory.LOGITS_KEEP_BYTES`). Packed records
  (``segments``) attend within their own record through a 4D mask, ``positions`` restart at each record;
  ``model(tokens)`` returns the library's logits.
- Its parameters are the library's modules under the library's names (``gpt_neox.layers.0.attention.dense.weight``),
  so checkpoints hold the family's own transformers folder: ``config.json`` as the base had it and
  ``model.safetensors`` under the names ``save_pretrained`` writes.
- Attention: ``sdpa`` where the family supports it, else the best it does (transformers' own fallback, eager); the
  run plan says which.
- A mixture of experts (a family whose config has ``output_router_logits``): every pass under grad asks the decoder
  for its router logits, and the loop adds the router's load-balancing loss (transformers'
  ``load_balancing_loss_func``, weighted by ``router_aux_loss_coef``) and reports ``router_aux_loss`` and
  ``expert_load/<e>`` as on the native path (:class:`astrai.trainer.models.experts.RouterBalance`). A mixture whose
  router's loss cannot be computed so is refused, never trained without it.
- LoRA (:func:`add_transformers_adapters`): the trainer's adapters on every ``nn.Linear`` (and subclass of it, as
  PEFT takes them) inside the decoder blocks (the output projection is outside them), by the family's module names
  (``query_key_value``, ``dense``, ``dense_h_to_4h``, ``dense_4h_to_h`` in GPT-NeoX). Their PEFT names are the
  library's module names, so ``invoke export`` writes a PEFT folder and a merged one as for a native family.
- Generation (:class:`astrai.trainer.generation.library.TransformersDecoding`): the online types' rollouts and
  ``python -m astrai.model generate``, a token at a time with the library's own key/value cache, left-padded rows
  with their own positions; eager, no CUDA graphs. Sampling and the generators are
  :mod:`astrai.trainer.generation.decoding`'s, so a completion is the same whichever part of the batch it is in.
- :func:`inspect_folder`: all of that found without the weights (the model made on the meta device), for the run
  plan, ``--dry-run`` and preflight: a folder the trainer would refuse at its start is refused there.

Slower than a native family (no fused steps, no captured decode; its blocks compiled only with ``model.compile:
true``): preflight and ``--dry-run`` say so.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn
from torch.utils.checkpoint import checkpoint

from astrai.common.backends import LibraryModel, TransformersConfig
from astrai.common.contract import WEIGHTS_FILE
from astrai.common.fit import SetupError
from astrai.common.memory import LOGITS_CHUNK_BYTES, LOGITS_KEEP_BYTES
from astrai.common.model_folder import PEFT_PREFIX, weight_files
from astrai.common.plan import RunPlan
from astrai.common.safetensors_file import ModelLoadError
from astrai.common.settings import LoRASettings
from astrai.trainer.models.lora import AdapterError, LoRALinear, hold_base_in, is_adapter, load_adapters
from astrai.trainer.models.scoring import TokenScores, TokenTargets, segment_mask


def _transformers():
    try:
        import transformers
    except ImportError:
        raise SetupError(
            "model.backend is transformers, but the transformers package is not installed here; the trainer image "
            "installs it for such a job (invoke build), or pip install transformers"
        ) from None
    transformers.utils.logging.disable_progress_bar()
    return transformers


def _said(error: BaseException) -> str:
    """An error of the library's in one line (its first 300 characters)."""
    return " ".join(line.strip() for line in str(error).strip().splitlines() if line.strip())[:300] or repr(error)


def read_transformers_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder the trainer wrote (a checkpoint), stored under the model's module names."""
    weights: dict[str, torch.Tensor] = {}
    for path in weight_files(Path(folder)):
        try:
            weights.update(load_file(path, device="cpu"))
        except (OSError, ValueError, RuntimeError) as error:
            raise ModelLoadError(f"{path}: {error}") from None
    return weights


def read_transformers_checkpoint(folder: Path, adapters: bool) -> dict[str, torch.Tensor]:
    """A checkpoint's weights: the whole model's, or with ``adapters`` the LoRA adapters (PEFT's names: the
    library's module names after PEFT's prefix), by the model's parameter names."""
    tensors = read_transformers_weights(folder)
    if not adapters:
        return tensors
    ours = {}
    for name, tensor in tensors.items():
        if not name.startswith(PEFT_PREFIX) or not is_adapter(name):
            raise AdapterError(f"{folder / WEIGHTS_FILE}: {name} is not a LoRA weight of a layer")
        ours[name.removeprefix(PEFT_PREFIX)] = tensor
    return ours


def load_transformers_start(folder: Path) -> tuple[TransformersConfig, dict[str, torch.Tensor]]:
    """Config and weights (float32, by the model's module names) of a model folder, read by transformers itself:
    whatever names the folder stores its tensors under (a family's older ones: GPT-NeoX's ``embed_out``), the
    library maps them to its modules'."""
    config = TransformersConfig.load(folder)
    library_config(config)  # a config.json transformers cannot read is refused by name, before the weights
    try:
        hf, info = _transformers().AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, output_loading_info=True
        )
    except (OSError, ValueError, KeyError, RuntimeError) as error:
        raise ModelLoadError(f"{folder}: transformers cannot load it: {error}") from None
    # transformers starts a weight the files lack from random values and only warns: here that is an error.
    problems = {what: sorted(info.get(what) or ()) for what in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    problems = {what: names for what, names in problems.items() if names}
    if problems:
        found = "; ".join(f"{what.replace('_', ' ')} {names[:3]}" for what, names in problems.items())
        raise ModelLoadError(
            f"{folder}: its weights do not fit its config.json's model_type {config.model_type!r} as transformers "
            f"builds it ({found})"
        )
    tied = _tied_names(hf)
    return config, {name: tensor for name, tensor in hf.state_dict().items() if name not in tied}


def library_config(config: TransformersConfig):
    """The folder's config as transformers reads it (``AutoConfig.from_pretrained``: floats it saved tagged, as
    ``{"__float__": "Infinity"}``, the family's defaults for what the file leaves out); ModelLoadError naming the
    folder for one it cannot read (a model_type it does not know, code of its own, values its config refuses)."""
    transformers = _transformers()
    from huggingface_hub.errors import StrictDataclassError  # a config class's own check of its values

    try:
        return transformers.AutoConfig.from_pretrained(config.folder)
    except (OSError, ValueError, KeyError, TypeError, StrictDataclassError) as error:
        raise ModelLoadError(
            f"{config.folder}: transformers cannot read its config.json (model_type {config.model_type!r}): "
            f"{_said(error)}"
        ) from None


def _library_model(config: TransformersConfig, attention: str | None) -> nn.Module:
    """The family's ``AutoModelForCausalLM``, its weights not drawn (they are loaded next); ``attention`` None: sdpa
    where the family supports it, else transformers' own fallback. ModelLoadError naming the folder for a model_type
    that is not a causal language model transformers builds."""
    transformers = _transformers()
    from transformers.initialization import no_init_weights  # not among transformers' lazy attributes

    hf_config = library_config(config)
    try:
        with no_init_weights():
            return transformers.AutoModelForCausalLM.from_config(
                hf_config, attn_implementation=attention, dtype=torch.float32
            )
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as error:
        raise ModelLoadError(
            f"{config.folder}: transformers cannot build model_type {config.model_type!r} as a causal language "
            f"model (AutoModelForCausalLM): {_said(error)}"
        ) from None


class TransformersModel(nn.Module):
    """An ``AutoModelForCausalLM`` seen as the trainer's model (see the module's docstring). Its children are the
    library model's children, so every parameter keeps the library's name. ``attention``: the implementation the
    run plan chose (None: sdpa where the family supports it, else its best)."""

    _library: tuple

    def __init__(
        self, config: TransformersConfig, activation_checkpointing: bool = False, attention: str | None = None
    ):
        super().__init__()
        self.config = config
        hf = _library_model(config, attention)
        hf.tie_weights()  # what the skipped initialisation would have done: a tied output projection shares its tensor
        if activation_checkpointing:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # The library model's children are this module's, in the same dict: a layer replaced here (LoRA, a frozen
        # base) is replaced there, and every parameter is registered once, under the library's name.
        self._modules = hf._modules
        decoder = hf.get_decoder() if hasattr(hf, "get_decoder") else hf.base_model
        self._library = (hf, _decoder_blocks(hf, config), decoder)  # a tuple: not registered a second time
        self.attention: str = hf.config._attn_implementation
        self.top_k, self.router_aux_loss_coef = _router(hf, config)
        """A mixture of experts: how many experts a token goes to, and the weight of the router's loss (None,
        None: no router)."""
        self.router_logits: torch.Tensor | None = None
        """The router logits (tokens x layers, experts) of the last pass under grad, for the load-balancing loss
        (:class:`astrai.trainer.models.experts.RouterBalance` reads and clears them, as a native layer's)."""

    @property
    def library_model(self) -> nn.Module:
        """The transformers model itself (generation, comparisons)."""
        return self._library[0]

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder blocks."""
        return self._library[1]

    @property
    def library(self) -> LibraryModel:
        """What the library built, as the run plan says it."""
        coef = self.router_aux_loss_coef if self.top_k is not None else None
        return LibraryModel(self.config.model_type, self.attention, coef)

    def train(self, mode: bool = True) -> TransformersModel:
        super().train(mode)
        self.library_model.training = mode
        return self

    def load_weights(self, weights: dict[str, torch.Tensor], where: str) -> None:
        """The folder's tensors into the model; ModelLoadError naming what is missing or extra (a tied output
        projection may be left out, as transformers leaves it out)."""
        own = self.state_dict()
        tied = _tied_names(self)
        missing = sorted(set(own) - set(weights) - tied)
        extra = sorted(set(weights) - set(own))
        if missing or extra:
            raise ModelLoadError(
                f"{where}: its weights do not fit its config.json's {self.config.model_type}: "
                + "; ".join(f"{what} {names[:3]}" for what, names in (("missing", missing), ("extra", extra)) if names)
            )
        for name, tensor in weights.items():
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise ModelLoadError(
                    f"{where}: {name} is {list(tensor.shape)}, the config says {list(own[name].shape)}"
                )
        self.load_state_dict(weights, strict=False)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
        score: TokenTargets | None = None,
    ) -> torch.Tensor | TokenScores:
        """Logits of ``tokens`` (B, T), or with ``score`` the log-probabilities of its targets (TokenScores)."""
        if tokens.shape[1] > self.config.context:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds the model's context of {self.config.context}")
        mask = None if segments is None else segment_mask(segments)  # a 4D mask, as the library takes one
        routed = self.top_k is not None and torch.is_grad_enabled()
        inputs = dict(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=False)
        if routed:
            inputs["output_router_logits"] = True
        out = (self.library_model if score is None else self._library[2])(**inputs)
        if routed:
            self.router_logits = _router_logits(out, self.config)
        if score is None:
            return out.logits
        return self._scores(score.gathered(out.last_hidden_state), score)

    def _scores(self, hidden: torch.Tensor, score: TokenTargets) -> TokenScores:
        """The targets' log-probabilities under the library's logits of ``hidden`` (B, L, D), a chunk of positions
        at a time; each chunk's logits computed again in the backward pass unless the whole batch's are small."""
        batch, length = score.targets.shape
        vocab = self.config.vocab_size
        per_chunk = max(1, LOGITS_CHUNK_BYTES // (4 * vocab * batch))
        again = torch.is_grad_enabled() and batch * length * vocab * 4 > LOGITS_KEEP_BYTES
        logps, entropies = [], []
        for start in range(0, length, per_chunk):
            part = (hidden[:, start : start + per_chunk], score.targets[:, start : start + per_chunk], score.entropy)
            found = checkpoint(self._chunk_scores, *part, use_reentrant=False) if again else self._chunk_scores(*part)
            logps.append(found[0])
            entropies.append(found[1])
        entropy = torch.cat(entropies, dim=1) if score.entropy else None
        return TokenScores(torch.cat(logps, dim=1), entropy)

    def _chunk_scores(self, hidden: torch.Tensor, targets: torch.Tensor, entropy: bool):
        logprobs = torch.log_softmax(self.library_logits(hidden).float(), dim=-1)
        logps = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        if not entropy:
            return logps, None
        with torch.no_grad():
            return logps, -(logprobs.exp() * logprobs).sum(-1)

    def library_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits (B, T, V) the library's ``ForCausalLM.forward`` computes from final hidden states (B, T, D):
        its decoder's output replaced by them for one call, so its head and whatever it does after (or before) it
        are the library's own. SetupError naming the family when its forward does not take its decoder's output."""
        hf, decoder = self.library_model, self._library[2]
        used = []

        def given_states(*args, **kwargs):
            used.append(True)
            return _given_states_output()(last_hidden_state=hidden)

        own = decoder.__dict__.get("forward")
        decoder.forward = given_states
        try:
            placeholder = torch.zeros(hidden.shape[:2], dtype=torch.long, device=hidden.device)
            extra = {"output_router_logits": False} if self.top_k is not None else {}
            logits = hf(input_ids=placeholder, use_cache=False, **extra).logits
        except (AttributeError, TypeError, IndexError, KeyError, ValueError) as error:
            raise self._unscorable(_said(error)) from None
        finally:
            if own is None:
                del decoder.forward
            else:
                decoder.forward = own
        if not used or tuple(logits.shape) != (*hidden.shape[:2], self.config.vocab_size):
            raise self._unscorable(f"its logits were not computed from the decoder's output ({list(logits.shape)})")
        return logits

    def _unscorable(self, why: str) -> SetupError:
        return SetupError(
            f"{self.config.folder}: model_type {self.config.model_type!r}: its ForCausalLM does not compute its "
            f"logits from its decoder's final hidden states as the trainer scores them ({why}); it cannot be trained "
            "here without a wrong loss"
        )


@functools.cache
def _given_states_output() -> type:
    """The decoder output a ``ForCausalLM.forward`` is handed in :meth:`TransformersModel.library_logits`: the final
    hidden states, and None for whatever else a family's forward reads of its decoder's output (GPT-2's
    cross_attentions, a mixture's router_logits)."""
    from transformers.modeling_outputs import MoeModelOutputWithPast

    class GivenStates(MoeModelOutputWithPast):
        def __getattr__(self, name: str):  # only for what the class does not have
            if name.startswith("__"):
                raise AttributeError(name)
            return None

    return GivenStates


def _router(hf: nn.Module, config: TransformersConfig) -> tuple[int | None, float | None]:
    """(experts per token, the router loss's weight) of a mixture of experts, read as its ``ForCausalLM`` reads
    them; (None, None) for a family without a router. SetupError for a mixture whose loss cannot be computed so."""
    if not hasattr(hf.config, "output_router_logits"):
        return None, None
    found = {}
    for name in ("num_experts_per_tok", "router_aux_loss_coef"):
        value = getattr(hf, name, None)
        found[name] = getattr(hf.config, name, None) if value is None else value
    top_k, coef = found["num_experts_per_tok"], found["router_aux_loss_coef"]
    usable = isinstance(top_k, int) and top_k > 0 and isinstance(coef, (int, float)) and coef >= 0
    if isinstance(top_k, bool) or isinstance(coef, bool) or not usable:
        raise SetupError(
            f"{config.folder}: model_type {config.model_type!r} is a mixture of experts whose router's "
            f"load-balancing loss the trainer cannot compute (num_experts_per_tok {top_k!r}, router_aux_loss_coef "
            f"{coef!r}): it would train without it"
        )
    return top_k, float(coef)


def _router_logits(out, config: TransformersConfig) -> torch.Tensor:
    """Every layer's router logits of a pass, one row per token and layer (E columns)."""
    found = getattr(out, "router_logits", None)
    if not found:
        raise SetupError(
            f"{config.folder}: model_type {config.model_type!r} gave no router logits when asked "
            "(output_router_logits): its router's load-balancing loss cannot be computed"
        )
    return torch.cat([layer.reshape(-1, layer.shape[-1]) for layer in found])


def _decoder_blocks(hf: nn.Module, config: TransformersConfig) -> nn.ModuleList:
    """The model's decoder blocks: its ModuleList of num_hidden_layers modules."""
    for module in hf.modules():
        if isinstance(module, nn.ModuleList) and len(module) == config.n_layers:
            return module
    raise SetupError(
        f"{config.folder}: model_type {config.model_type}: no list of {config.n_layers} decoder blocks found in the "
        "transformers model"
    )


def _tied_names(model: nn.Module) -> set[str]:
    """Parameter names that share their tensor with an earlier one (a tied output projection)."""
    seen, tied = set(), set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.data_ptr() in seen:
            tied.add(name)
        seen.add(tensor.data_ptr())
    return tied


def inspect_folder(folder: Path, lora: bool) -> LibraryModel:
    """What the trainer builds for ``folder`` on the transformers path, found without its weights: the config read
    as transformers reads it, the model made on the meta device with its attention chosen, its output computed from
    hidden states, its router's loss, and with ``lora`` the layers its adapters go on. Every refusal the trainer's
    start makes of the folder itself, made the same way (ModelLoadError, SetupError: the folder and the reason) for
    the run plan, ``--dry-run`` and preflight."""
    config = TransformersConfig.load(folder)
    with torch.device("meta"):
        model = TransformersModel(config)
        head = model.library_model.get_output_embeddings()
        # The width the head takes: the decoder's output, which may be projected from hidden_size (OPT's project_out).
        width = head.weight.shape[-1] if isinstance(getattr(head, "weight", None), torch.Tensor) else config.dim
        model.library_logits(torch.zeros(1, 2, width))
    if lora:
        adaptable_layers(model)
    return model.library


def transformers_state_dict(state: dict[str, torch.Tensor], config: TransformersConfig) -> dict:
    """What ``model.safetensors`` holds: every tensor under its own name, a tied output projection once."""
    out, seen = {}, set()
    for name, tensor in state.items():
        if tensor.data_ptr() in seen and config.tie_embeddings:
            continue
        seen.add(tensor.data_ptr())
        out[name] = tensor.contiguous()
    return out


def transformers_model(start, plan: RunPlan, seed: int, activation_checkpointing: bool) -> TransformersModel:
    """The model of ``start`` (astrai.trainer.run.build's Start: its config, weights and LoRA adapters) on the CPU, as
    build_model builds ours: the attention the plan chose, the base frozen and the adapters new (A from ``seed``, B
    zero) or the start's, the base held in the plan's dtype."""
    attention = plan.library.attention if plan.library is not None else None
    model = TransformersModel(start.model_config, activation_checkpointing, attention)
    model.load_weights(start.weights, str(start.source))
    if plan.lora is not None:
        add_transformers_adapters(model, plan.lora, torch.Generator().manual_seed(seed))
        if start.adapters is not None:
            load_adapters(model, start.adapters, str(start.adapters_from))
        hold_base_in(model, getattr(torch, plan.base_dtype))
    return model


def adaptable_layers(model: TransformersModel) -> list[tuple[int, str, nn.Linear]]:
    """(block, name in it, layer) of every linear layer inside the decoder blocks, in block order: ``nn.Linear`` and
    its subclasses (Falcon's ``FalconLinear``), as PEFT takes them. SetupError naming the folder and the kind of
    layers there are when there is none (GPT-2's Conv1D)."""
    found = [
        (index, name, module)
        for index, block in enumerate(model.layers)
        for name, module in block.named_modules()
        if isinstance(module, nn.Linear)
    ]
    if not found:
        kinds = sorted(
            {type(m).__name__ for m in model.layers.modules() if getattr(m, "weight", None) is not None} - {"Embedding"}
        )
        raise SetupError(
            f"{model.config.folder}: {model.config.model_type}: its decoder blocks hold no nn.Linear layer for LoRA "
            f"to adapt (their layers with weights: {', '.join(kinds) or 'none'}); train it without lora_rank"
        )
    return found


def _behaves_as_linear(module: nn.Linear) -> bool:
    """Whether a linear layer computes ``x W^T + b`` (what the adapted layer computes): nn.Linear's own forward, or
    a subclass's that gives the same (Falcon's ``x @ W.T + b``), tried once on two random rows. A subclass that
    computes something else (a router built on nn.Linear, Phi-MoE's) takes no adapter, as PEFT's could not either.
    On the meta device (inspect_folder) nothing can be tried: it counts."""
    if type(module).forward is nn.Linear.forward or module.weight.is_meta:
        return True
    weight = module.weight
    generator = torch.Generator(device=weight.device).manual_seed(0)
    probe = torch.randn(2, module.in_features, generator=generator, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        theirs, ours = module(probe), F.linear(probe, weight, module.bias)
    if not isinstance(theirs, torch.Tensor) or theirs.shape != ours.shape:
        return False
    return bool((theirs - ours).abs().max() <= 1e-4 * ours.abs().max() + 1e-6)


def add_transformers_adapters(
    model: TransformersModel, settings: LoRASettings, generator: torch.Generator | None = None
) -> list[str]:
    """Freeze every weight and put adapters on every linear layer inside the decoder blocks (:func:`adaptable_layers`)
    that computes ``x W^T + b`` (:func:`_behaves_as_linear`), in block order; the adapted layers' names (the
    library's). ``training.lora_targets`` names a Llama's layers: on
    this path it is left at its default (the run plan refuses another), and the rule above decides."""
    layers = [(index, name, module) for index, name, module in adaptable_layers(model) if _behaves_as_linear(module)]
    if not layers:
        raise SetupError(
            f"{model.config.folder}: {model.config.model_type}: none of the linear layers of its decoder blocks "
            "computes x W^T + b, which LoRA's adapters add to; train it without lora_rank"
        )
    for param in model.parameters():
        param.requires_grad_(False)
    prefix = next(name for name, module in model.named_modules() if module is model.layers)
    adapted = []
    for index, name, module in layers:
        block = model.layers[index]
        owner_name, _, leaf = name.rpartition(".")
        owner = block.get_submodule(owner_name) if owner_name else block
        setattr(owner, leaf, LoRALinear(module, settings, generator))
        adapted.append(f"{prefix}.{index}.{name}")
    return adapted
