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


def make_deterministic() -> None:
    """Deterministic kernels only, from now on in this process (call it before CUDA starts)."""
    os.environ.update(deterministic_environment(os.environ))
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.enable_cudnn_sdp(False)
