"""The models the trainer does not compute itself, trained through ``transformers`` (``model.backend``).

:class:`TransformersModel` holds an ``AutoModelForCausalLM`` built from the folder's ``config.json`` and gives the
objectives and the loop what :class:`astrai.trainer.model.Transformer` gives them:

- ``model(tokens, positions, segments, score=TokenTargets(...))`` returns the same :class:`TokenScores`: the
  library's final hidden states go through the output projection a chunk of positions at a time
  (:func:`astrai.trainer.model.token_scores`); a family whose logits are shaped after the projection (a soft cap, a
  scale) is scored from the library's own logits instead. Packed records (``segments``) attend within their own
  record through a 4D mask, ``positions`` restart at each record; ``model(tokens)`` returns the logits.
- Its parameters are the library's modules under the library's names (``gpt_neox.layers.0.attention.dense.weight``),
  so checkpoints hold the family's own transformers folder: ``config.json`` as the base had it and
  ``model.safetensors`` under the names ``save_pretrained`` writes.
- LoRA (:func:`add_transformers_adapters`): the trainer's adapters on every ``nn.Linear`` inside the decoder blocks
  (the output projection is outside them), by the family's module names (``query_key_value``, ``dense``,
  ``dense_h_to_4h``, ``dense_4h_to_h`` in GPT-NeoX). Their PEFT names are the library's module names, so
  ``invoke export`` writes a PEFT folder and a merged one as for a native family.
- Generation (:class:`TransformersDecoding`): the online types' rollouts, a token at a time with the library's own
  key/value cache, left-padded rows with their own positions; eager, no CUDA graphs. Sampling and the generators
  are :mod:`astrai.trainer.decoding`'s, so a completion is the same whichever part of the batch it is in.

Slower than a native family (no fused steps, no compiled blocks, no captured decode): preflight and ``--dry-run``
say so.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from astrai.common.backends import TransformersConfig
from astrai.common.contract import WEIGHTS_FILE
from astrai.common.fit import SetupError
from astrai.common.model_folder import PEFT_PREFIX, weight_files
from astrai.common.plan import RunPlan
from astrai.common.safetensors_file import ModelLoadError
from astrai.common.settings import LoRASettings, Sampling
from astrai.trainer.decoding import Draws, checked_round, left_padded, pick_rows, regenerated_episodes, until_stop
from astrai.trainer.lora import AdapterError, LoRALinear, hold_base_in, is_adapter, load_adapters
from astrai.trainer.model import LogitsShape, TokenScores, TokenTargets, token_scores

SHAPED_LOGITS_KEYS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
"""config.json keys of a family whose logits are changed after the output projection: scored from its logits."""


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


class TransformersModel(nn.Module):
    """An ``AutoModelForCausalLM`` seen as the trainer's model (see the module's docstring). Its children are the
    library model's children, so every parameter keeps the library's name."""

    _library: tuple

    def __init__(self, config: TransformersConfig, activation_checkpointing: bool = False):
        super().__init__()
        transformers = _transformers()
        self.config = config
        hf_config = transformers.AutoConfig.for_model(**config.values)
        # Its weights are loaded next (load_weights): drawing random ones first would only cost time.
        from transformers.initialization import no_init_weights  # not among transformers' lazy attributes

        with no_init_weights():
            hf = transformers.AutoModelForCausalLM.from_config(
                hf_config, attn_implementation="sdpa", dtype=torch.float32
            )
        hf.tie_weights()  # what the skipped initialisation would have done: a tied output projection shares its tensor
        if activation_checkpointing:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # The library model's children are this module's, in the same dict: a layer replaced here (LoRA, a frozen
        # base) is replaced there, and every parameter is registered once, under the library's name.
        self._modules = hf._modules
        self._library = (hf, _decoder_blocks(hf, config))  # a tuple: not registered a second time
        self._shaped = any(key in config.values for key in SHAPED_LOGITS_KEYS)

    @property
    def library_model(self) -> nn.Module:
        """The transformers model itself (generation, comparisons)."""
        return self._library[0]

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder blocks."""
        return self._library[1]

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
        if tokens.shape[1] > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {tokens.shape[1]} exceeds max_position_embeddings {self.config.max_seq_len}"
            )
        mask = None
        if segments is not None:  # each token sees the earlier tokens of its own record: a 4D mask, True = attend
            causal = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool, device=tokens.device).tril()
            mask = (segments.unsqueeze(2) == segments.unsqueeze(1)).logical_and(causal).unsqueeze(1)
        hf = self.library_model
        if score is None or self._shaped:
            logits = hf(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=False).logits
            return logits if score is None else _scores_from_logits(logits, score)
        base = hf.get_decoder() if hasattr(hf, "get_decoder") else hf.base_model
        hidden = base(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=False).last_hidden_state
        if score.where is not None:  # only these positions: their hidden states alone go through the head
            hidden = hidden.gather(1, score.where.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
        head = hf.get_output_embeddings()
        if getattr(head, "bias", None) is not None:  # a head with a bias: its logits, as the library computes them
            return _scores_from_logits(head(hidden), score)
        flat = hidden.reshape(-1, hidden.shape[-1])
        logps, entropy = token_scores(flat, head.weight, score.targets.reshape(-1), score.entropy, LogitsShape())
        size = score.targets.shape
        return TokenScores(logps.view(size), None if entropy is None else entropy.view(size))


def _scores_from_logits(logits: torch.Tensor, score: TokenTargets) -> TokenScores:
    if score.where is not None:
        logits = logits.gather(1, score.where.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    logps = logprobs.gather(-1, score.targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if score.entropy:
        entropy = -(logprobs.exp() * logprobs).sum(-1).detach()
    return TokenScores(logps, entropy)


def _decoder_blocks(hf: nn.Module, config: TransformersConfig) -> nn.ModuleList:
    """The model's decoder blocks: its ModuleList of num_hidden_layers modules."""
    for module in hf.modules():
        if isinstance(module, nn.ModuleList) and len(module) == config.n_layers:
            return module
    raise SetupError(
        f"{config.model_type}: no list of {config.n_layers} decoder blocks found in the transformers model"
    )


def _tied_names(model: nn.Module) -> set[str]:
    """Parameter names that share their tensor with an earlier one (a tied output projection)."""
    seen, tied = set(), set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if tensor.data_ptr() in seen:
            tied.add(name)
        seen.add(tensor.data_ptr())
    return tied


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
    """The model of ``start`` (astrai.trainer.build's Start: its config, weights and LoRA adapters) on the CPU, as
    build_model builds ours: the base frozen and the adapters new (A from ``seed``, B zero) or the start's, the base
    held in the plan's dtype."""
    model = TransformersModel(start.model_config, activation_checkpointing)
    model.load_weights(start.weights, str(start.source))
    if plan.lora is not None:
        add_transformers_adapters(model, plan.lora, torch.Generator().manual_seed(seed))
        if start.adapters is not None:
            load_adapters(model, start.adapters, str(start.adapters_from))
        hold_base_in(model, getattr(torch, plan.base_dtype))
    return model


def add_transformers_adapters(
    model: TransformersModel, settings: LoRASettings, generator: torch.Generator | None = None
) -> list[str]:
    """Freeze every weight and put adapters on every ``nn.Linear`` inside the decoder blocks, in block order; the
    adapted layers' names (the library's). ``training.lora_targets`` names a Llama's layers: on this path it is left
    at its default (the run plan refuses another), and the rule above decides."""
    for param in model.parameters():
        param.requires_grad_(False)
    prefix = next(name for name, module in model.named_modules() if module is model.layers)
    adapted = []
    for index, block in enumerate(model.layers):
        for name, module in list(block.named_modules()):
            if type(module) is not nn.Linear:
                continue
            owner_name, _, leaf = name.rpartition(".")
            owner = block.get_submodule(owner_name) if owner_name else block
            setattr(owner, leaf, LoRALinear(module, settings, generator))
            adapted.append(f"{prefix}.{index}.{name}")
    if not adapted:
        raise SetupError(f"{model.config.model_type}: its decoder blocks hold no nn.Linear layer for LoRA to adapt")
    return adapted


class TransformersDecoding:
    """The online types' generation through the library model (its own key/value cache), a token at a time.

    Rows are left-padded; each row's positions count its own tokens and its padding is masked, so a row samples
    what it would alone. The next token is chosen as :class:`astrai.trainer.decoding.DecodeEngine` chooses it."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.inner = getattr(model, "module", model)  # DDP's wrapped model
        self.capture_seconds = 0.0

    def episodes(self, prompts, sampling: Sampling, stop, draws: list[Draws], handler, rooms: list[int]) -> None:
        """Multi-turn generation (astrai.trainer.decoding.DecodeEngine.episodes): the library's cache is not kept
        between turns, so each turn generates again from every going row's episode so far."""
        regenerated_episodes(self.generate, prompts, sampling, stop, draws, handler, rooms)

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        sampling: Sampling,
        stop: set[int] | frozenset[int] = frozenset(),
        draws: list[Draws] | None = None,
    ) -> list[list[int]]:
        draws, _ = checked_round(prompts, sampling, draws, self.inner.config.max_seq_len)
        device = next(self.inner.parameters()).device
        batch = len(prompts)
        tokens, real = left_padded(prompts)
        tokens, real = tokens.to(device), real.long().to(device)
        positions = (real.cumsum(-1) - 1).clamp(min=0)
        hf = self.inner.library_model
        out = hf(input_ids=tokens, attention_mask=real, position_ids=positions, use_cache=True)
        cache, logits = out.cache, out.logits[:, -1]
        stops = torch.tensor(sorted(stop), dtype=torch.long, device=device)
        done = torch.zeros(batch, dtype=torch.bool, device=device)
        made = []
        position = positions[:, -1:]
        while True:
            chosen = pick_rows(logits, sampling, draws).masked_fill(done, 0)
            made.append(chosen)
            done = done | torch.isin(chosen, stops)
            if len(made) == sampling.max_new_tokens or bool(done.all()):
                break
            real = torch.cat([real, torch.ones(batch, 1, dtype=real.dtype, device=device)], dim=1)
            position = position + 1
            out = hf(
                input_ids=chosen.view(-1, 1),
                attention_mask=real,
                position_ids=position,
                cache=cache,
                use_cache=True,
            )
            cache, logits = out.cache, out.logits[:, -1]
        rows = torch.stack(made, dim=1).tolist()
        return [until_stop(row, stop) for row in rows]
