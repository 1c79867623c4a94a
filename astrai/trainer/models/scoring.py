"""What turns final hidden states into a loss: a frozen (narrower) weight's product, the targets to score and their
log-probabilities, the shaping of logits (scaling, soft cap), the packed-segment mask, and the chunked log-probability
whose logits never exist for a whole batch at once (its own backward pass)."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from astrai.common.memory import LOGITS_CHUNK_BYTES, LOGITS_KEEP_BYTES


class _UpcastLinear(torch.autograd.Function):
    """``x @ W.T + b`` in x's dtype for a frozen ``W`` stored narrower: the wide copy of ``W`` lives only while one
    product is computed (autograd keeps the narrow one for the backward pass, and no gradient for ``W``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)
        # The bias added afterwards: F.linear with a bias may return a view, which LoRA's in-place add refuses.
        out = F.linear(x, weight.to(x.dtype))
        return out if bias is None else out.add_(bias.to(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        grad_x = grad @ weight.to(grad.dtype) if ctx.needs_input_grad[0] else None
        return grad_x, None, None


def frozen_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for a weight that may be held in a narrower dtype than ``x`` (LoRA's bfloat16 base): computed in
    x's dtype, or as autocast says. A weight of x's dtype is plain ``F.linear`` (it may train)."""
    if weight.dtype == x.dtype or torch.is_autocast_enabled(x.device.type):
        return F.linear(x, weight, bias)
    if weight.requires_grad:
        raise ValueError(f"a {weight.dtype} weight that trains cannot compute in {x.dtype}: it would get no gradient")
    return _UpcastLinear.apply(x, weight, bias)


LOGITS_BACKWARD_CHUNK_BYTES = 512 << 20
"""The float32 logits of at most this many bytes exist at once in the backward pass of an output projection that
trains: each chunk adds its share of the projection's gradient (vocabulary x dim, float32) in one read and write of
it, so larger chunks spread that traffic over more rows."""


class TokenTargets(NamedTuple):
    """Which tokens to score: ``targets`` (B, L), the token each scored position predicts; ``where`` (B, L), the
    positions scored (None: every one, L = T); ``entropy``: the distribution's entropy at each of them too."""

    targets: torch.Tensor
    where: torch.Tensor | None = None
    entropy: bool = False

    def gathered(self, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden states (B, T, D) of the scored positions (B, L, D): only they go through the head."""
        if self.where is None:
            return hidden
        return hidden.gather(1, self.where.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))


class TokenScores(NamedTuple):
    """Each scored position's log-probability of its target (B, L), and its entropy (detached) when asked."""

    logps: torch.Tensor
    entropy: torch.Tensor | None


def segment_mask(segments: torch.Tensor) -> torch.Tensor:
    """Which keys each query may attend to (B, 1, T, T; True = attend) in rows that pack several records:
    ``segments`` (B, T) numbers each token's record, and a token sees the earlier tokens of its own record only."""
    length = segments.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segments.device).tril()
    return (segments.unsqueeze(2) == segments.unsqueeze(1)).logical_and(causal).unsqueeze(1)


def soft_cap(values: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(values / cap)``: Gemma 2's soft cap, of attention scores and of the final logits alike."""
    return torch.tanh(values / cap) * cap


@dataclasses.dataclass(frozen=True)
class LogitsShape:
    """What comes after the output projection: a division (Granite's logits_scaling), then a soft cap
    ``cap * tanh(logits / cap)`` (Gemma 2's final_logit_softcapping)."""

    scaling: float = 1.0
    cap: float | None = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scaling != 1.0:
            logits = logits / self.scaling
        return logits if self.cap is None else soft_cap(logits, self.cap)

    def slope(self, shaped: torch.Tensor) -> torch.Tensor | float:
        """d shaped / d raw logits, from the shaped logits."""
        slope = 1.0 / self.scaling
        return slope if self.cap is None else slope * (1.0 - (shaped / self.cap) ** 2)


def token_scores(
    hidden: torch.Tensor,
    head: torch.Tensor,
    targets: torch.Tensor,
    entropy: bool = False,
    shape: LogitsShape = LogitsShape(),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) (N,) in float32 for hidden states (N, D) and the output projection ``head`` (V, D) (its logits
    shaped by ``shape``), and the entropy of each distribution (N,), detached, when asked.

    The same numbers as ``log_softmax(shape(F.linear(hidden, head)).float())`` picked at the targets, and the same
    gradients, but a chunk of rows at a time (:data:`LOGITS_CHUNK_BYTES` of float32 logits), forward and backward:
    the float32 logits of the whole batch are never held, and its logits in the head's dtype only when they are
    small (:data:`LOGITS_KEEP_BYTES`), else each chunk's are computed again in the backward pass."""
    return _ChunkedLogProbs.apply(hidden, head, targets, entropy, shape)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype


def _chunk_rows(vocab: int, budget: int) -> int:
    return max(1, budget // (4 * vocab))


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, head, targets, entropy: bool, shape: LogitsShape):
        dtype = _compute_dtype(hidden)
        weight = head.to(dtype)
        count, vocab = hidden.shape[0], head.shape[0]
        rows = _chunk_rows(vocab, LOGITS_CHUNK_BYTES)
        kept = None
        if count * vocab * dtype.itemsize <= LOGITS_KEEP_BYTES:
            kept = torch.empty(count, vocab, dtype=dtype, device=hidden.device)
        logps = torch.empty(count, dtype=torch.float32, device=hidden.device)
        entropies = torch.empty_like(logps) if entropy else None
        for start in range(0, count, rows):
            chunk = F.linear(hidden[start : start + rows].to(dtype), weight)
            if kept is not None:
                kept[start : start + rows] = chunk
            logits = shape.apply(chunk).float()
            total = torch.logsumexp(logits, dim=-1)
            logps[start : start + rows] = logits.gather(-1, targets[start : start + rows, None]).squeeze(-1) - total
            if entropy:
                entropies[start : start + rows] = total - (logits.softmax(dim=-1) * logits).sum(dim=-1)
        ctx.save_for_backward(hidden, head, targets, *([] if kept is None else [kept]))
        ctx.dtype, ctx.shape = dtype, shape
        if entropies is not None:
            ctx.mark_non_differentiable(entropies)
        return logps, entropies

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        hidden, head, targets, *kept = ctx.saved_tensors
        dtype, shape = ctx.dtype, ctx.shape
        weight = head.to(dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_head = None
        if ctx.needs_input_grad[1]:
            grad_head = torch.zeros(head.shape, dtype=torch.float32, device=head.device)
        budget = LOGITS_CHUNK_BYTES if grad_head is None else LOGITS_BACKWARD_CHUNK_BYTES
        rows = _chunk_rows(head.shape[0], budget)
        for start in range(0, hidden.shape[0], rows):
            chunk = hidden[start : start + rows].to(dtype)
            logits = shape.apply(kept[0][start : start + rows] if kept else F.linear(chunk, weight)).float()
            grad = grad_logps[start : start + rows].float().unsqueeze(-1)
            # d log p(t) / d logits = onehot(t) - softmax(logits), then through the shaping of the logits.
            grad_logits = (-logits.softmax(dim=-1) * grad).scatter_add_(-1, targets[start : start + rows, None], grad)
            grad_logits = (grad_logits * shape.slope(logits)).to(dtype)
            if grad_hidden is not None:
                grad_hidden[start : start + rows] = (grad_logits @ weight).to(hidden.dtype)
            if grad_head is not None:
                add_product(grad_head, grad_logits.transpose(0, 1), chunk)
        return grad_hidden, None if grad_head is None else grad_head.to(head.dtype), None, None, None


def add_product(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``total += a @ b`` for a float32 ``total``, as one matrix product that accumulates into it: for bfloat16 or
    float16 ``a`` and ``b``, the products are summed in float32 by the kernel itself where the device has such a kernel
    (CUDA's ``out_dtype``), so no narrow product, float32 copy and separate addition pass over ``total``."""
    if a.dtype == total.dtype:
        total.addmm_(a, b)
    elif widening_addmm_runs(str(total.device), a.dtype):
        torch.addmm(total, a, b, out_dtype=total.dtype, out=total)
    else:
        total += (a @ b).to(total.dtype)


@functools.cache
def widening_addmm_runs(device: str, dtype: torch.dtype) -> bool:
    """Whether ``addmm`` with ``out_dtype`` float32 accumulates ``dtype`` products into its float32 input in place
    here (tried once on a tiny case, and checked against the widened product)."""
    try:
        a = torch.arange(12, dtype=torch.float32, device=device).view(3, 4).to(dtype)
        b = torch.ones(4, 2, dtype=dtype, device=device)
        total = torch.full((3, 2), 0.5, device=device)
        torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return bool(torch.equal(total, a.float() @ b.float() + 0.5))
