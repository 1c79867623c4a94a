"""A model wrapped for its run's parallel mode: DDP replicates it (an NF4 base left out of its broadcast), FSDP shards
each block and the rest; and the gradient sync a step skips on all but its last micro-batch."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from astrai.trainer.launch.distributed import DistEnv
from astrai.trainer.models.nf4 import is_nf4


def parallelize(model: nn.Module, env: DistEnv) -> nn.Module:
    """Wrap for the parallel mode: DDP replicates the model, FSDP shards each block and the rest."""
    if env.parallel_mode == "ddp":
        # An NF4 base is not broadcast at start (DDP's collectives take plain tensors): each rank quantised the same
        # weights, which rank 0 sent it, the same way.
        held = [name for name, param in model.named_parameters() if is_nf4(param)]
        if held:
            DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, held)
        return DistributedDataParallel(model, device_ids=[env.device.index] if env.device.type == "cuda" else None)
    if env.parallel_mode == "fsdp":
        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
    return model


def set_gradient_sync(model: nn.Module, env: DistEnv, enabled: bool) -> None:
    """Skip the gradient all-reduce on all but the last micro-batch of an accumulated step."""
    if env.parallel_mode == "ddp":
        model.require_backward_grad_sync = enabled
    elif env.parallel_mode == "fsdp":
        model.set_requires_gradient_sync(enabled)
