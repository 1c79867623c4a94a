"""Processes, devices and the graceful stop: one process, or several under torchrun, on one host or several.

torchrun sets RANK, LOCAL_RANK and WORLD_SIZE; without them the trainer is one
process. NCCL carries tensors between GPUs, gloo between CPU processes. A
separate small gloo group carries control messages (the stop flag, the resumed
state, RNG states), so they never wait on the GPU.

On several hosts (ASTRAI_NODE_RANK set by the entrypoint), global ranks are
ordered by node, so rank 0 — the one that reads and writes checkpoints — is
always on node 0, whatever order torchrun's c10d rendezvous chose. A heartbeat
thread then watches the other ranks through the rendezvous store, so a lost
node ends the job within ASTRAI_FAILURE_TIMEOUT_SECONDS while the collectives
themselves keep their long timeout (a big save or a first compile may take long).
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from astrai.common.configfile import ConfigError
from astrai.common.contract import ENV_FAILURE_TIMEOUT_SECONDS, ENV_NODE_RANK, EXIT_LOST_NODE, resolve_parallel_mode
from astrai.trainer.launch import signals


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
    node: int = 0
    """The host this process runs on (``--node``); 0 for a one-host job."""
    local_world_size: int = 1
    """Processes on each node."""
    watch: NodeWatch | None = None
    """Heartbeats of the other ranks, on a multi-node job."""
    checkpoint_group: dist.ProcessGroup | None = None
    """CPU (gloo) group of the checkpoint writer threads only (a sharded save's ranks agree on it while
    training goes on); None with one process."""

    def node_of(self, rank: int) -> int:
        return rank // self.local_world_size

    @property
    def master_process(self) -> bool:
        # Rank 0 does the logging, metrics and checkpoint writing.
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def world_from_environment() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) as torchrun sets them; (0, 0, 1) for a plain process.

    On several nodes the rank is node * processes_per_node + local_rank, so it is the same whichever
    rendezvous backend ran; every node runs the same number of processes, so the ranks stay a permutation.
    """
    rank, local_rank, world_size = (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("LOCAL_RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
    )
    node, local_world_size = _node_placement()
    if node is not None and local_world_size * (world_size // local_world_size) == world_size:
        rank = node * local_world_size + local_rank
    return rank, local_rank, world_size


def _node_placement() -> tuple[int | None, int]:
    """(node index or None on one host, processes per node)."""
    node = os.environ.get(ENV_NODE_RANK)
    return (int(node) if node is not None else None), int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def check_parallel_mode(parallel_mode: str, world_size: int) -> None:
    """Raise ConfigError when the mode does not fit the number of processes (the rule in astrai/common/contract.py)."""
    try:
        resolve_parallel_mode(parallel_mode, world_size)
    except ValueError as error:
        hint = (
            "use ddp or fsdp under torchrun"
            if parallel_mode == "none"
            else "run under torchrun --nproc-per-node N, or use none"
        )
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
    node, local_world_size = _node_placement()
    env = DistEnv(rank, local_rank, world_size, device, parallel_mode, None, node or 0, local_world_size)
    if world_size > 1:
        # The rank torchrun chose may differ from ours (c10d); the process group takes ours.
        os.environ["RANK"] = str(rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device, rank=rank, world_size=world_size)
        else:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        env.control_group = dist.new_group(backend="gloo")
        env.checkpoint_group = dist.new_group(backend="gloo")
        timeout = os.environ.get(ENV_FAILURE_TIMEOUT_SECONDS)
        if node is not None and timeout is not None:
            env.watch = NodeWatch(env, int(timeout))
            env.watch.start()
    return env


def shutdown_distributed(env: DistEnv) -> None:
    """Leave the process groups. Call it once the trainer is gone, after a run that ended normally.

    The gloo groups are freed here, while the interpreter is whole: a group still referenced (by a
    sharded module, an optimizer, this env) would be torn down during interpreter exit instead, which
    can abort the process.
    """
    if env.watch is not None:
        env.watch.finish()
    if env.distributed and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
        env.control_group = env.checkpoint_group = None
        gc.collect()


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
        # A signal that came while the process was starting (see astrai/trainer/launch/signals.py) counts too.
        early = signals.received()
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

    def agree(self, env: DistEnv, *others: bool) -> tuple[bool, ...]:
        """(stop?, *others) each true on every rank when it is true on any rank.

        Every rank calls this once per step, so the all-reduce lines up even when
        only some ranks got the signal, or got it at different moments. ``others``
        are more flags agreed on in the same all-reduce (a failed background save).
        """
        flags = (self.requested, *others)
        if not env.distributed:
            return flags
        agreed = torch.tensor([int(flag) for flag in flags], dtype=torch.int32)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=env.control_group)
        return tuple(bool(flag) for flag in agreed.tolist())


# --- State from rank 0 ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TensorSlot:
    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def broadcast_from_master(env: DistEnv, produce, errors: tuple[type[Exception], ...] = ()):
    """``produce()`` run on rank 0 only, its result on every rank; an expected error is raised on every rank.

    Only node 0 holds the checkpoints and the base model: it reads them, and the others receive the state.
    The structure (dicts, lists, dataclasses, plain values) travels pickled; tensors travel one by one over
    the gloo control group, so no rank ever holds a pickled copy of the weights.
    """
    if not env.distributed:
        return produce()
    tensors: list[torch.Tensor] = []
    header = [None]
    if env.master_process:
        try:
            header[0] = ("ok", _strip_tensors(produce(), tensors))
        except errors as error:
            header[0] = ("error", error)
    dist.broadcast_object_list(header, src=0, group=env.control_group)
    kind, payload = header[0]
    if kind == "error":
        raise payload
    if not env.master_process:
        tensors = [torch.empty(slot.shape, dtype=slot.dtype) for slot in _slots(payload)]
    for tensor in tensors:
        dist.broadcast(tensor, src=0, group=env.control_group)
    return _fill_tensors(payload, tensors)


def _map_leaves(tree, is_leaf, change):
    """``tree`` (dicts, lists, tuples, dataclasses) with every leaf for which ``is_leaf`` holds replaced by
    ``change(leaf)``, in a fixed order (the order the leaves are met in)."""
    if is_leaf(tree):
        return change(tree)
    if isinstance(tree, dict):
        return {key: _map_leaves(value, is_leaf, change) for key, value in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_map_leaves(value, is_leaf, change) for value in tree)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        fields = [f.name for f in dataclasses.fields(tree) if f.init]  # the others follow from them
        return dataclasses.replace(tree, **{name: _map_leaves(getattr(tree, name), is_leaf, change) for name in fields})
    return tree


def _strip_tensors(tree, tensors: list[torch.Tensor]):
    def slot(tensor: torch.Tensor) -> _TensorSlot:
        tensors.append(tensor.detach().cpu().contiguous())
        return _TensorSlot(len(tensors) - 1, tuple(tensor.shape), tensor.dtype)

    return _map_leaves(tree, lambda node: isinstance(node, torch.Tensor), slot)


def _slots(tree) -> list[_TensorSlot]:
    found: list[_TensorSlot] = []
    _map_leaves(tree, lambda node: isinstance(node, _TensorSlot), found.append)
    return sorted(found, key=lambda slot: slot.index)


def _fill_tensors(tree, tensors: list[torch.Tensor]):
    return _map_leaves(tree, lambda node: isinstance(node, _TensorSlot), lambda slot: tensors[slot.index])


def failed_ranks(env: DistEnv, failed: bool, group) -> list[int]:
    """Every rank's answer to "did yours fail?", on every rank: the ranks that did (no rank alone decides)."""
    if not env.distributed:
        return [env.rank] if failed else []
    flags = torch.zeros(env.world_size, dtype=torch.int32)
    flags[env.rank] = int(failed)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return [rank for rank, flag in enumerate(flags.tolist()) if flag]


def gather_objects(env: DistEnv, value) -> list:
    """Every rank's ``value``, in rank order, on every rank (small picklable values only)."""
    if not env.distributed:
        return [value]
    gathered = [None] * env.world_size
    dist.all_gather_object(gathered, value, group=env.control_group)
    return gathered


# --- Lost nodes ------------------------------------------------------------------------------------


class NodeWatch:
    """A heartbeat per rank in the rendezvous store; a rank silent for too long means its node was lost.

    Each rank bumps its counter every few seconds from a thread of its own (collectives release the GIL,
    so a rank blocked in one still beats). Counters are compared, never clocks, so hosts need no common
    time. When another rank stays silent (or the store on node 0 stops answering) for the limit, this
    process says which node was lost and exits with EXIT_LOST_NODE, ending the job on this node, while
    the process group's own timeout stays long enough for any legitimate wait.
    """

    def __init__(self, env: DistEnv, failure_timeout_seconds: int):
        self.env = env
        self.timeout = failure_timeout_seconds
        self.interval = max(1.0, failure_timeout_seconds / 10)
        # Silence longer than this means lost. It leaves time within the timeout for the beat missed between
        # checks and for torchrun and the container to wind down after this process exits.
        margin = self.interval + min(10.0, 0.3 * failure_timeout_seconds)
        self.limit = max(failure_timeout_seconds - margin, 2 * self.interval)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        run = os.environ.get("TORCHELASTIC_RUN_ID", "")
        self.prefix = f"astrai/heartbeat/{run}/{attempt}/"
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-watch", daemon=True)
        self._store = None
        self.before_exit: Callable[[float], None] | None = None
        """Called with the seconds left before this process must exit (the trainer finishes a save in flight)."""

    def start(self) -> None:
        host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        self._store = dist.TCPStore(
            host, port, is_master=False, timeout=datetime.timedelta(seconds=max(self.interval, 5))
        )
        self._store.set(self._key(self.env.rank), "0")
        self._thread.start()

    def finish(self) -> None:
        """This rank ends in order: the others stop watching it."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._thread.join()
        try:
            self._store.set(self._key(self.env.rank), "done")
        except RuntimeError:
            pass  # the store is gone with node 0, which has finished too

    def explain(self) -> None:
        """A collective failed: give the watch time to name a lost node (it exits the process if so)."""
        deadline = time.monotonic() + self.limit + 2 * self.interval
        while time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.2)

    def _key(self, rank: int) -> str:
        return f"{self.prefix}{rank}"

    def _run(self) -> None:
        others = [rank for rank in range(self.env.world_size) if rank != self.env.rank]
        now = time.monotonic()
        seen = {rank: None for rank in others}
        changed = {rank: now for rank in others}
        answered = now
        beat = 0
        while not self._stopped.wait(self.interval):
            beat += 1
            now = time.monotonic()
            try:
                self._store.set(self._key(self.env.rank), str(beat))
                keys = [self._key(rank) for rank in seen]
                values = self._store.multi_get(keys) if keys and self._store.check(keys) else None
                answered = now
            except RuntimeError:
                values = None
            if now - answered > self.limit:
                self._lost(
                    0,
                    f"the rendezvous store on node 0 ({os.environ['MASTER_ADDR']}:"
                    f"{os.environ['MASTER_PORT']}) has not answered for {now - answered:.0f} s",
                )
            if values is None:
                continue
            for rank, raw in zip(list(seen), values, strict=True):
                value = raw.decode()
                if value == "done":
                    del seen[rank]
                elif value != seen[rank]:
                    seen[rank], changed[rank] = value, now
            for rank in seen:
                if now - changed[rank] > self.limit:
                    self._lost(
                        self.env.node_of(rank), f"rank {rank} has sent no heartbeat for {now - changed[rank]:.0f} s"
                    )

    def _lost(self, node: int, detail: str) -> None:
        sys.stderr.write(
            f"error: lost node {node}: {detail} (runtime.nodes.failure_timeout_seconds is {self.timeout}); "
            f"node {self.env.node} exits so that the job can be started again on every node, resuming from "
            "the newest complete checkpoint\n"
        )
        sys.stderr.flush()
        if self.before_exit is not None:
            try:
                # What is left of the timeout once the silence was noticed, keeping a few seconds for the exit.
                self.before_exit(max(0.0, self.timeout - self.limit - self.interval - 2.0))
            except Exception as error:  # the process exits either way; say why the save did not finish
                sys.stderr.write(f"warning: the checkpoint being written could not be finished: {error}\n")
        os._exit(EXIT_LOST_NODE)
