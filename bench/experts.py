"""A mixture of experts' training step on the CPU: one sparse layer's forward and backward pass, ours against
transformers' own block with the same weights, at shapes scaled down from the real models.

- ``qwen3_moe_step_vs_transformers``: CPU time of transformers' ``Qwen3MoeSparseMoeBlock`` (its default experts
  implementation, ``grouped_mm``) over ours (:mod:`astrai.trainer.models.experts`), forward and backward of 512 tokens,
  at Qwen3-30B-A3B's shape scaled down: 128 experts, 8 per token, width 512, expert width 192 (the real 2048 and
  768 divided by 4), in alternating turns. ``mixtral_step_vs_transformers``: the same for ``MixtralSparseMoeBlock``
  at Mixtral-8x7B's shape scaled down: 8 experts, 2 per token, width 512, expert width 1,792 (4096 and 14336 / 8).
  ``moe_step_vs_transformers``: the worse of the two.
- ``moe_step_vs_transformers_eager``: the same, worse of the two, against transformers' eager experts (a Python
  loop over the experts a batch uses), which transformers 5.x used before grouped_mm became its default.
"""

from __future__ import annotations

import time

import torch

from astrai.common.model_config import ModelConfig
from astrai.trainer.models.experts import MixtureOfExperts
from bench.common import Figures, fix_threads

TOKENS = 512
SHAPES = {
    # name: (transformers config class and keys, ours)
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=192, norm_topk_prob=True),
        dict(n_experts=128, experts_per_token=8, expert_hidden_dim=192, normalize_top_k=True),
    ),
    "mixtral": (
        "MixtralConfig",
        dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=1792),
        dict(n_experts=8, experts_per_token=2, expert_hidden_dim=1792),
    ),
}
WIDTH = 512


def _blocks(name: str, implementation: str):
    """(transformers' sparse block, ours) with the same random weights."""
    import transformers

    config_class, hf_keys, our_keys = SHAPES[name]
    hf_config = getattr(transformers, config_class)(
        hidden_size=WIDTH, num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=1, **hf_keys
    )
    hf_config._experts_implementation = implementation
    module = transformers.models.qwen3_moe.modeling_qwen3_moe if name == "qwen3_moe" else None
    module = module or transformers.models.mixtral.modeling_mixtral
    hf_block = (module.Qwen3MoeSparseMoeBlock if name == "qwen3_moe" else module.MixtralSparseMoeBlock)(hf_config)
    ours = MixtureOfExperts(ModelConfig(family=name, dim=WIDTH, n_heads=8, n_kv_heads=8, n_layers=1, **our_keys))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in (hf_block.gate.weight, hf_block.experts.gate_up_proj, hf_block.experts.down_proj):
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
        ours.router.weight.copy_(hf_block.gate.weight)
        ours.gate_up.copy_(hf_block.experts.gate_up_proj)
        ours.down.copy_(hf_block.experts.down_proj)
    return hf_block, ours


def _step(block, x: torch.Tensor, upstream: torch.Tensor) -> None:
    block.zero_grad(set_to_none=True)
    inputs = x.detach().requires_grad_()
    (block(inputs) * upstream).sum().backward()


def _compare(name: str, implementation: str, turns: int) -> tuple[list[float], list[float]]:
    """(transformers' times, ours) over ``turns`` alternating turns; their outputs checked equal first."""
    hf_block, ours = _blocks(name, implementation)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1, TOKENS, WIDTH, generator=generator)
    upstream = torch.randn(1, TOKENS, WIDTH, generator=generator)
    with torch.no_grad():
        difference = (hf_block(x) - ours(x)).abs().max().item()
    if difference > 1e-4:
        raise SystemExit(f"{name}: our block's output differs from transformers' by {difference}")
    sides = {"transformers": hf_block, "ours": ours}
    for block in sides.values():  # warm-up
        _step(block, x, upstream)
    times = {side: [] for side in sides}
    for turn in range(turns):
        for side in sides if turn % 2 == 0 else reversed(list(sides)):
            start = time.process_time()
            _step(sides[side], x, upstream)
            times[side].append(time.process_time() - start)
    return times["transformers"], times["ours"]


def run(quick: bool) -> Figures:
    fix_threads()
    figures = Figures()
    worst: dict[str, tuple[float, str]] = {}
    for implementation, key in (("grouped_mm", "moe_step_vs_transformers"), ("eager", "_eager")):
        # transformers' eager experts are a Python loop over 128 experts: fewer turns keep the section short.
        turns = (7 if quick else 15) if implementation == "grouped_mm" else (3 if quick else 5)
        for name in SHAPES:
            theirs, ours = _compare(name, implementation, turns)
            own = f"{name}_step_vs_transformers" + ("" if implementation == "grouped_mm" else "_eager")
            value = figures.ratio(own, theirs, ours)
            if key not in worst or value < worst[key][0]:
                worst[key] = (value, own)
    for key, (_, own) in worst.items():
        headline = "moe_step_vs_transformers" + ("" if key == "moe_step_vs_transformers" else "_eager")
        pairs = figures.samples[own]["pairs"]
        figures.ratio(headline, [a for a, _ in pairs], [b for _, b in pairs])
    return figures
