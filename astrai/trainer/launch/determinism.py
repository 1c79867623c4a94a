"""``training.deterministic``: deterministic kernels only, set up before CUDA starts.

With it, a run on one GPU is a function of its inputs alone: two runs, a run with periodic saves and a stopped and
resumed one end on bitwise equal weights (on a CPU they always do). What it takes:

- ``torch.use_deterministic_algorithms(True)``: every op picks its deterministic kernel, and one that has none
  raises instead of running (among them the flash and memory-efficient attention backward passes, which then use
  their deterministic forms: no atomic adds in dQ, no split keys);
- ``CUBLAS_WORKSPACE_CONFIG=:4096:8``: cuBLAS's reductions in a fixed order (read when CUDA starts: the entrypoint
  sets it in the container's environment, and the trainer sets it again before it touches CUDA);
- cuDNN in deterministic mode, without benchmarking; cuDNN's attention off (it has no deterministic backward).
"""

from __future__ import annotations

import os

import torch

from astrai.common.contract import deterministic_environment
from astrai.common.errors import AstraiError


class TooLate(AstraiError):
    """Deterministic mode asked for in a process whose CUDA started without cuBLAS's setting."""


def make_deterministic() -> None:
    """Deterministic kernels only, from now on in this process (call it before CUDA starts: cuBLAS reads its
    workspace setting once, when CUDA starts). After CUDA started without that setting it changes nothing and raises
    TooLate: half of deterministic mode is not deterministic."""
    missing = deterministic_environment(os.environ)
    if missing and torch.cuda.is_initialized():
        setting = ", ".join(f"{name}={value}" for name, value in missing.items())
        raise TooLate(
            f"training.deterministic: CUDA started in this process before deterministic mode was set up, and cuBLAS "
            f"reads its setting only then; set {setting} in the environment before the process starts (the "
            "entrypoint and `python -m astrai.train` do), or set up deterministic mode before anything touches CUDA"
        )
    os.environ.update(missing)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.enable_cudnn_sdp(False)
