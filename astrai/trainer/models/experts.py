"""A mixture of experts in place of a block's MLP (Qwen3-MoE, Mixtral), computed as transformers computes it.

Each token goes to ``k`` of ``E`` experts (gated MLPs) and gets the sum of their outputs, weighted by the router::

    p = softmax(router(x))                    in float32, over the E experts
    top, chosen = topk(p, k)                  (divided by their sum when the family normalises them)
    y = sum_j top_j * down_j(act(gate_j(x)) * up_j(x))       j over the chosen experts

The experts of a layer are held stacked (``gate_up`` (E, 2H, D): gate rows then up rows; ``down`` (E, D, H)), and
computed without a Python loop over experts: the (token, expert) pairs are sorted by expert, and each projection is
one ``torch._grouped_mm`` over the sorted rows (its own autograd function, so the backward pass is two more grouped
products per projection). Where ``_grouped_mm`` cannot run (an old torch, a dtype or shape its kernels refuse on the
device: probed once per kind; under torch.compile, anything but bfloat16) the groups are padded to the busiest expert
and multiplied with ``torch.bmm``.

The router's load-balancing loss is transformers' ``load_balancing_loss_func`` (the Switch Transformer's), over the
sparse layers of one forward pass taken together (R rows in all, L layers of N tokens)::

    aux = E * sum_e (count_e / R) * (sum of p_e / R)      count_e: how often e is among a row's top-k

Each micro-batch adds ``router_aux_loss_coef * aux / accumulation`` to its loss (:class:`RouterBalance`), and logs
the loss and each expert's share of the assignments.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from astrai.common.contract import METRIC_EXPERT_LOAD, METRIC_ROUTER_AUX_LOSS
from astrai.common.model_config import ModelConfig


class _GroupedLinear(torch.autograd.Function):
    """``x_g @ W_g.T`` for each group g of rows of x (``ends``: where each group ends), W (G, out, in)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight, ends)
        return torch._grouped_mm(x, weight.transpose(1, 2), offs=ends)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, ends = ctx.saved_tensors
        grad = grad.contiguous()  # the kernels refuse broadcast (stride 0) gradients
        grad_x = torch._grouped_mm(grad, weight, offs=ends) if ctx.needs_input_grad[0] else None
        grad_w = torch._grouped_mm(grad.t(), x, offs=ends) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


@functools.cache
def grouped_mm_runs(device: str, dtype: torch.dtype, width_in: int, width_out: int) -> bool:
    """Whether ``torch._grouped_mm`` computes these products here, forward and backward (tried once on a tiny case:
    its kernels depend on the device, the dtype and the alignment of the widths)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        with torch.enable_grad():  # the first call may come from a pass without grad
            x = torch.ones(4, width_in, device=device, dtype=dtype, requires_grad=True)
            w = torch.ones(2, width_out, width_in, device=device, dtype=dtype, requires_grad=True)
            ends = torch.tensor([1, 4], device=device, dtype=torch.int32)
            _GroupedLinear.apply(x, w, ends).sum().backward()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, grouped: bool | None = None
) -> torch.Tensor:
    """Each group of rows of ``x`` (N, in) times its matrix of ``weight`` (G, out, in) transposed, the rows sorted by
    group (``counts`` (G,) rows each): one grouped product where it runs (``grouped`` None: as grouped_mm_runs
    finds), else the groups padded to the largest and multiplied by ``torch.bmm``."""
    if grouped is None:
        # torch.compile traces _grouped_mm in bfloat16 only (as transformers, which falls back there too).
        traced = torch.compiler.is_compiling() and x.dtype != torch.bfloat16
        grouped = not traced and grouped_mm_runs(str(x.device), x.dtype, weight.shape[2], weight.shape[1])
    if grouped:
        return _GroupedLinear.apply(x, weight, counts.cumsum(0).to(torch.int32))
    groups, rows = weight.shape[0], x.shape[0]
    starts = counts.cumsum(0) - counts
    group_of = torch.repeat_interleave(torch.arange(groups, device=x.device), counts, output_size=rows)
    slot = torch.arange(rows, device=x.device) - starts[group_of]
    # The busiest group's rows: read from the device in eager mode; under torch.compile every row (the most a group
    # can hold), so that the graph has no host read.
    widest = rows if torch.compiler.is_compiling() else int(counts.max()) if rows else 0
    padded = x.new_zeros(groups, widest, x.shape[1])
    padded = padded.index_put((group_of, slot), x)
    return torch.bmm(padded, weight.transpose(1, 2))[group_of, slot]


class ExpertLoRA(nn.Module):
    """Low-rank adapters on a stacked expert parameter (E, out, in), one A and one B per expert, held in PEFT's 3-D
    layout (its ``target_parameters``): ``lora_A.weight`` (rank * E, in), expert e's A its rows e * rank ... ; and
    ``lora_B.weight`` (out, rank * E), expert e's B the columns e, e + E, e + 2E, ... Expert e's weight is
    ``W_e + scaling * B_e @ A_e``; the update is computed on the sorted rows with the same grouped products."""

    def __init__(self, experts: int, width_in: int, width_out: int, rank: int, scaling: float, device=None):
        super().__init__()
        self.experts, self.rank, self.scaling = experts, rank, scaling
        self.lora_A = nn.Linear(width_in, rank * experts, bias=False, device=device, dtype=torch.float32)
        self.lora_B = nn.Linear(rank * experts, width_out, bias=False, device=device, dtype=torch.float32)
        self.adapters_on = True

    def reset(self, generator: torch.Generator | None) -> None:
        """As PEFT starts it: A Kaiming-uniform (a = sqrt(5)) over the whole (rank * E, in) matrix, B zero."""
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5), generator=generator)
            nn.init.zeros_(self.lora_B.weight)

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A (E, rank, in), B (E, out, rank)) of every expert."""
        a = self.lora_A.weight.view(self.experts, self.rank, -1)
        b = self.lora_B.weight.view(-1, self.rank, self.experts).permute(2, 0, 1).contiguous()
        return a, b

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        a, b = self.factors()
        return grouped_linear(grouped_linear(x, a.to(x.dtype), counts), b.to(x.dtype), counts) * self.scaling


class MixtureOfExperts(nn.Module):
    """The router and the stacked experts of one sparse layer."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        experts, width, hidden = config.n_experts, config.dim, config.expert_hidden_dim
        self.router = nn.Linear(width, experts, bias=False)
        self.gate_up = nn.Parameter(torch.empty(experts, 2 * hidden, width))
        self.down = nn.Parameter(torch.empty(experts, width, hidden))
        self.top_k = config.experts_per_token
        self.normalize = config.normalize_top_k
        self.gelu = config.activation == "gelu_pytorch_tanh"
        self.gate_up_lora: ExpertLoRA | None = None
        self.down_lora: ExpertLoRA | None = None
        """LoRA's adapters on the experts (:func:`astrai.trainer.models.lora.add_adapters`), or None."""
        self.router_logits: torch.Tensor | None = None
        """This layer's router logits (tokens, E) of the last forward pass under grad mode: what the load-balancing
        loss is computed from (which clears them). Each such pass replaces them, so no graph outlives the next."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = self.router(x)
        if torch.is_grad_enabled():  # a pass without grad (evaluation, a reference model) leaves them
            self.router_logits = logits
        weights, chosen = route(logits, self.top_k, self.normalize)
        return self.experts(x, weights, chosen).reshape(shape)

    def experts(self, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """sum_j weights_j * expert_{chosen_j}(x) for each row of x (N, D); weights and chosen (N, k).

        No host read (a compiled graph and a captured step take it whole): the rows per expert are counted on the
        device. The k outputs of each row are put back in the rows' order and summed in float32 (not added into
        the rows one by one in the compute dtype, with atomics whose order varies)."""
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        x, gate_up, down = x.to(dtype), self.gate_up.to(dtype), self.down.to(dtype)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        counts = expert_counts(flat, gate_up.shape[0])
        rows = x[order // self.top_k]
        gate, up = _adapted(grouped_linear(rows, gate_up, counts), self.gate_up_lora, rows, counts).chunk(2, dim=-1)
        hidden = (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up
        out = _adapted(grouped_linear(hidden, down, counts), self.down_lora, hidden, counts)
        each = out[order.argsort()].view(-1, self.top_k, out.shape[-1])  # (N, k, D): row n's k experts' outputs
        return (each.float() * weights.float().unsqueeze(-1)).sum(dim=1).to(dtype)


def expert_counts(chosen: torch.Tensor, experts: int) -> torch.Tensor:
    """How many of the (token, expert) pairs go to each expert (E,), counted on the device (``bincount`` reads the
    largest index back to the host to size its output)."""
    return torch.zeros(experts, dtype=torch.long, device=chosen.device).scatter_add_(0, chosen, torch.ones_like(chosen))


def _adapted(out: torch.Tensor, adapter: ExpertLoRA | None, rows, counts):
    """A projection's output with its adapters' update added (while they are on)."""
    if adapter is not None and adapter.adapters_on:
        out = out + adapter(rows, counts)
    return out


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, chosen experts), each (N, k): the top-k of the softmax in float32, divided by their sum when
    ``normalize``."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)
    top, chosen = torch.topk(probs, top_k, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top, chosen


def load_balancing_loss(logits: list[torch.Tensor], top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux, each expert's share of the assignments (E,)) of the router logits of the sparse layers (each (N, E)),
    as transformers' ``load_balancing_loss_func`` computes aux (see the module's docstring)."""
    experts = logits[0].shape[-1]
    counts = torch.zeros(experts, dtype=torch.float32, device=logits[0].device)
    prob_sum = torch.zeros(experts, dtype=torch.float32, device=logits[0].device)
    rows = 0
    for layer in logits:
        probs = F.softmax(layer, dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        counts = counts + expert_counts(chosen.reshape(-1), experts).float()
        prob_sum = prob_sum + probs.float().sum(dim=0)
        rows += layer.shape[0]
    aux = experts * torch.sum((counts / rows) * (prob_sum / rows))
    return aux, counts / counts.sum()


class RouterBalance:
    """The load-balancing loss of a model's routers, added to each micro-batch's loss, and what it logs.

    ``loss(accumulation)`` after each micro-batch's forward pass: ``coef * aux / accumulation`` (None when there is
    nothing to add); ``report()``: the mean aux loss and each expert's share of the assignments since the last
    report."""

    def __init__(self, layers: list[MixtureOfExperts], coef: float):
        self.layers = layers
        self.coef = coef
        self.top_k = layers[0].top_k
        self._aux: torch.Tensor | None = None
        self._count = 0
        self._load: torch.Tensor | None = None
        """Summed on the device, read at a report: a micro-batch never waits for it."""

    def loss(self, accumulation: int) -> torch.Tensor | None:
        logits = [layer.router_logits for layer in self.layers if layer.router_logits is not None]
        for layer in self.layers:
            layer.router_logits = None  # the graph goes with the loss (or now, when no loss is taken)
        if not logits:
            return None
        aux, load = load_balancing_loss(logits, self.top_k)
        self._aux = aux.detach() if self._aux is None else self._aux + aux.detach()
        self._load = load if self._load is None else self._load + load
        self._count += 1
        return aux * (self.coef / accumulation) if self.coef else None

    def report(self) -> dict[str, float]:
        if not self._count:
            return {}
        shares = (self._load / self._load.sum()).tolist()
        values = {METRIC_ROUTER_AUX_LOSS: float(self._aux) / self._count}
        values.update({f"{METRIC_EXPERT_LOAD}/{e}": share for e, share in enumerate(shares)})
        self._aux, self._load, self._count = None, None, 0
        return values


def router_balance(model: nn.Module) -> RouterBalance | None:
    """The model's router balance (None for a model without experts)."""
    layers = [module for module in model.modules() if isinstance(module, MixtureOfExperts)]
    if not layers:
        return None
    config = next(module for module in model.modules() if hasattr(module, "config")).config
    return RouterBalance(layers, config.router_aux_loss_coef)
