"""Processes, devices and the graceful stop: one process, or several under torchrun.

torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; without them the trainer is one
process. NCCL carries tensors between GPUs, gloo between CPU processes. A
separate small gloo group carries control messages (the stop flag, which
checkpoint to resume, RNG states), so they never wait on the GPU.
"""

from __future__ import annotations

import gc
import os
import signal
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from astrai import early_stop
from astrai.configfile import ConfigError
from astrai.contract import resolve_parallel_mode


@dataclass
class DistEnv:
    """Where this process sits in the job."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    parallel_mode: str
    control_group: dist.ProcessGroup | None
    """CPU (gloo) group for control messages; None with one process."""

    @property
    def master_process(self) -> bool:
        # Rank 0 does the logging, metrics and checkpoint writing.
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def world_from_environment() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) as torchrun sets them; (0, 0, 1) for a plain process."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def check_parallel_mode(parallel_mode: str, world_size: int) -> None:
    """Raise ConfigError when the mode does not fit the number of processes (the rule of DESIGN §3)."""
    try:
        resolve_parallel_mode(parallel_mode, world_size)
    except ValueError as error:
        hint = "use ddp or fsdp under torchrun" if parallel_mode == "none" else \
            "run under torchrun --nproc-per-node N, or use none"
        raise ConfigError(f"parallel.parallel_mode: {error} (WORLD_SIZE is {world_size}); {hint}") from None


def resolve_device(preference: str, local_rank: int) -> torch.device:
    """The device this process trains on, from training.device (auto | cpu | cuda)."""
    if preference == "cpu" or (preference == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"training.device: cuda requested, but torch {torch.__version__} sees no CUDA device")
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(
            f"training.device: local rank {local_rank} needs GPU {local_rank}, "
            f"but only {torch.cuda.device_count()} are visible"
        )
    return torch.device("cuda", local_rank)


def init_distributed(parallel_mode: str, device_preference: str) -> DistEnv:
    """Pick the device and, under torchrun, join the process group (NCCL on CUDA, gloo on CPU)."""
    rank, local_rank, world_size = world_from_environment()
    check_parallel_mode(parallel_mode, world_size)
    device = resolve_device(device_preference, local_rank)
    control_group = None
    if world_size > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
        control_group = dist.new_group(backend="gloo")
    return DistEnv(rank, local_rank, world_size, device, parallel_mode, control_group)


def shutdown_distributed(env: DistEnv) -> None:
    """Leave the process groups. Call it once the trainer is gone, after a run that ended normally.

    The gloo groups are freed here, while the interpreter is whole: a group still referenced (by a
    sharded module, an optimizer, this env) would be torn down during interpreter exit instead, which
    can abort the process.
    """
    if env.distributed and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
        env.control_group = None
        gc.collect()


def parallelize(model: nn.Module, env: DistEnv) -> nn.Module:
    """Wrap for the parallel mode: DDP replicates the model, FSDP shards each block and the rest."""
    if env.parallel_mode == "ddp":
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


class GracefulStop:
    """SIGTERM or SIGINT asks for a stop at the next step boundary; every rank then agrees on that step.

    The handler only records the request: a second signal, or one that arrives
    while a checkpoint is written, changes nothing else.
    """

    def __init__(self) -> None:
        self.signal_name: str | None = None

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._request)
        signal.signal(signal.SIGINT, self._request)
        # A signal that came while the process was starting (see astrai/early_stop.py) counts too.
        early = early_stop.received()
        if early is not None and self.signal_name is None:
            self.signal_name = early.name

    def finish(self) -> None:
        """The run is over and saved: ignore further signals until the process is gone.

        While exiting, Python resets its own handlers to the default action, which would turn a late
        second signal into a kill and the clean exit into a failure.
        """
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    def _request(self, signum: int, frame) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def agree(self, env: DistEnv) -> bool:
        """True on every rank when any rank was asked to stop.

        Every rank calls this once per step, so the all-reduce lines up even when
        only some ranks got the signal, or got it at different moments.
        """
        if not env.distributed:
            return self.requested
        flag = torch.tensor([int(self.requested)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=env.control_group)
        return bool(flag.item())
