"""QLoRA's frozen base in 4 bits (``training.lora_base_dtype: nf4``): the blocks' linear weights held as torchao's NF4
tensor, each product computed from it one layer at a time.

The format and which matrices it holds are :mod:`astrai.common.nf4`'s. Here:

- :func:`quantize_base` replaces each of those weights by ``torchao.quantization.to_nf4`` of its float32 values (block
  64, scaler block 256), made on the run's device, one matrix at a time;
- :func:`nf4_linear` is the product: the weight is dequantised into the compute dtype (autocast's, bfloat16 on CUDA;
  else the activations', float32 on CPU) for the forward product and again for the backward one, and dropped after
  each; autograd keeps the 4-bit tensor, never a dequantised copy. The weight gets no gradient.

torchao's tensor is what FSDP shards: ``fully_shard`` cuts each NF4 weight into row blocks (its own ``split``) and
all-gathers the 4-bit codes and scales (its ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``), as torchtune composes
the two; :func:`astrai.common.nf4.nf4_problem` refuses a model whose matrices do not cut into whole scaler blocks. DDP
broadcasts no NF4 weight at start (:mod:`astrai.trainer.launch.distributed`): every rank quantises the same base
the same way.

:func:`dequantize` is our own reading of torchao's fields (its ``get_original_weight`` gives the same float32 values,
tested): it writes the compute dtype directly, through a 256-entry table of code pairs, where torchao's goes through
int64 indices and float32.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

from astrai.common import nf4 as nf4_format
from astrai.common.fit import SetupError

_NF4_MODULE = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"
"""Where the pinned torchao defines NF4Tensor."""


def torchao_nf4():
    """torchao's NF4 module, imported quietly; SetupError naming the package to install when it is missing or another
    version than the one the trainer is tested with."""
    # torchao's compiled kernels serve other formats; NF4 is plain torch. Not loading them keeps a CPU build's import
    # from warning that they do not load (a user who wants them sets the variable to 0).
    os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
    try:
        with _quiet("torchao", "torch.utils._pytree"):
            import torchao
            import torchao.quantization  # noqa: F401
    except ImportError:
        raise SetupError(
            f"training.lora_base_dtype nf4 needs torchao, which is not installed here: pip install "
            f"'{nf4_format.TORCHAO_PACKAGE}' (the trainer image installs it for such a job)"
        ) from None
    if torchao.__version__.partition("+")[0] != nf4_format.TORCHAO_VERSION:
        raise SetupError(
            f"training.lora_base_dtype nf4: torchao {torchao.__version__} is installed, and the trainer computes with "
            f"the NF4 tensor of torchao {nf4_format.TORCHAO_VERSION}: pip install '{nf4_format.TORCHAO_PACKAGE}'"
        )
    return sys.modules[_NF4_MODULE]


@contextlib.contextmanager
def _quiet(*names: str):
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def check_nf4_runs(device: torch.device) -> None:
    """SetupError when this process cannot compute with an NF4 base: torchao missing (or another version), a torch
    older than torchao is built for, a GPU without bfloat16 products."""
    found = tuple(int(part) for part in torch.__version__.split(".")[:2])
    if found < nf4_format.MIN_TORCH:
        raise SetupError(
            f"training.lora_base_dtype nf4: torch {torch.__version__} is older than torchao "
            f"{nf4_format.TORCHAO_VERSION} runs on ({'.'.join(map(str, nf4_format.MIN_TORCH))}); use bfloat16"
        )
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < nf4_format.MIN_CUDA_CAPABILITY:
            raise SetupError(
                f"training.lora_base_dtype nf4: {torch.cuda.get_device_name(device)} (compute capability "
                f"{capability[0]}.{capability[1]}) has no bfloat16 matrix products, which the NF4 base is computed "
                "in on a GPU; use float32, or a GPU of compute capability 8.0 or newer"
            )
    elif device.type != "cpu":
        raise SetupError(f"training.lora_base_dtype nf4 runs on cpu and cuda, not {device.type}; use bfloat16")
    torchao_nf4()


def is_nf4(tensor) -> bool:
    """Whether ``tensor`` (or the local shard of a DTensor) is torchao's NF4 tensor."""
    module = sys.modules.get(_NF4_MODULE)
    return module is not None and isinstance(getattr(tensor, "_local_tensor", tensor), module.NF4Tensor)


def quantize_base(model: nn.Module, device: torch.device) -> int:
    """Hold each matrix :func:`astrai.common.nf4.held_matrices` names as an NF4 tensor on ``device``, quantised from
    its float32 values; the layers owning them compute through :func:`nf4_linear` (their ``nf4`` flag). The count of
    matrices. Each owner must be a frozen layer with that flag (astrai.trainer.models.lora.FrozenLinear)."""
    to_nf4 = torchao_nf4().to_nf4
    held = set(nf4_format.held_matrices(model.config))
    count = 0
    for name, module in model.named_modules():
        if f"{name}.weight" not in held:
            continue
        if not hasattr(module, "nf4") or module.weight.requires_grad:
            raise ValueError(f"{name} is not a frozen layer that computes from an NF4 weight")
        with torch.no_grad():
            quantized = to_nf4(module.weight.detach().to(device=device, dtype=torch.float32))
        module.weight = nn.Parameter(quantized, requires_grad=False)
        module.nf4 = True
        count += 1
    return count


def _pair_table(codebook: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(256, 2): the two values a byte of codes stands for (its high half first), in ``dtype``."""
    values = codebook.to(dtype)
    return torch.stack((values.repeat_interleave(16), values.repeat(16)), dim=-1)


DEQUANTIZE_BLOCKS = 1 << 14
"""Eager dequantisation writes the matrix this many blocks (a million numbers) at a time, so that its only
transient beyond the matrix itself is a chunk's indices and values (compiled, the steps fuse into one kernel)."""


def dequantize(weight, dtype: torch.dtype) -> torch.Tensor:
    """The matrix an NF4 tensor stands for, in ``dtype``: each code's value times its block's scale (the int8 scale
    over its scaler block's factor, plus the mean), computed in ``dtype``."""
    table = _pair_table(weight.nf4, dtype)
    scaled = weight.quantized_scalers.view(-1, weight.scaler_block_size).to(torch.float32)
    scales = ((scaled / weight.quantization_factor.unsqueeze(-1)).view(-1) + weight.scaler_mean).to(dtype)
    codes = weight.quantized_data.view(scales.shape[0], -1)  # a block's codes, two a byte
    if torch.compiler.is_compiling():
        return (table[codes.to(torch.int32)].view(codes.shape[0], -1) * scales.unsqueeze(-1)).view(weight.shape)
    out = torch.empty(codes.shape[0], weight.block_size, dtype=dtype, device=codes.device)
    for start in range(0, codes.shape[0], DEQUANTIZE_BLOCKS):
        part = slice(start, start + DEQUANTIZE_BLOCKS)
        values = table[codes[part].to(torch.int32)].view(-1, weight.block_size)
        torch.mul(values, scales[part].unsqueeze(-1), out=out[part])
    return out.view(weight.shape)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype


class _NF4Linear(torch.autograd.Function):
    """``x @ W.T + b`` for a frozen NF4 ``W``: dequantised for this product only, and again for the backward one."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)
        out = F.linear(x, dequantize(weight, _compute_dtype(x)))
        # The bias added afterwards, in place: LoRA's update is added in place to what this returns.
        return out if bias is None else out.add_(bias.to(out.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        grad_x = grad @ dequantize(weight, grad.dtype) if ctx.needs_input_grad[0] else None
        return grad_x, None, None


def nf4_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` of a frozen NF4 weight, in autocast's dtype or else ``x``'s."""
    return _NF4Linear.apply(x, weight, bias)
