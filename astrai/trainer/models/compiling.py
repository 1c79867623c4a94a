"""``model.compile``: what is compiled with torch.compile, and how its failures are told apart from the others.

The training compiles each transformer block (:func:`compile_blocks`); generation compiles its decode step
(:mod:`astrai.trainer.generation.decoding`). A failure of the compiler is the user's to act on
(``model.compile: false``), so the trainer names the setting (:func:`failed_in_compiler` tells it from any other
error) instead of falling back to eager code silently.
"""

from __future__ import annotations

import contextlib

import torch

COMPILER_MODULES = ("torch._dynamo", "torch._inductor")


def compile_blocks(model: torch.nn.Module) -> None:
    """Compile each transformer block of ``model`` (lazily: the first forward pass compiles them)."""
    for layer in model.layers:
        layer.compile()


@contextlib.contextmanager
def blocks_uncompiled(model: torch.nn.Module):
    """The model's modules with their torch.compile wrappers (:func:`compile_blocks`') set aside: generation, whose
    shapes change at every token, runs them eagerly."""
    stashed = [(module, module._compiled_call_impl) for module in model.modules() if module._compiled_call_impl]
    for module, _ in stashed:
        module._compiled_call_impl = None
    try:
        yield
    finally:
        for module, compiled in stashed:
            module._compiled_call_impl = compiled


def failed_in_compiler(error: BaseException | None) -> bool:
    """Whether an exception (or one it was raised from) is torch.compile's own: Dynamo's or Inductor's."""
    while error is not None:
        if type(error).__module__.startswith(COMPILER_MODULES):
            return True
        error = error.__cause__ or error.__context__
    return False
