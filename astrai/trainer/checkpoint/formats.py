"""The checkpoint formats behind one interface: what a save snapshots, how it is written, how it is read.

A format (:data:`FORMATS`, by the run plan's name) takes a :class:`Snapshot` of the model and optimizer at the step
(a collective: every rank calls it), and the manager writes every snapshot the same way: check it,
copy it to host memory when training goes on meanwhile, stage, write, agree, publish, retain.

- **full**: the whole state is gathered on rank 0, which alone writes ``model.safetensors`` and
  ``optimizer.pt``; a resume is read by rank 0 and handed to every rank.
- **sharded**: every rank writes its own rows of the weights and the optimizer's moments into files
  laid out whole (:mod:`astrai.trainer.checkpoint.sharded`); under FSDP every rank reads its own rows
  back too, so no rank ever holds more than its share.
- **lora** (whenever ``training.lora_rank`` is set): the full format's files, holding only what
  trains: the adapters (gathered on rank 0, under PEFT's names) and their optimizer state; the frozen base
  weights stay in the base model's folder, which ``meta.json`` names with a digest.

Either format resumes from a folder written in either.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from astrai.common.checkpoints import SMALL_FILES_BYTES
from astrai.common.contract import (
    CKPT_FORMAT_FULL,
    CKPT_FORMAT_LORA,
    CKPT_FORMAT_SHARDED,
    OPTIMIZER_FILE,
    WEIGHTS_FILE,
)
from astrai.trainer.checkpoint.files import (
    CheckpointError,
    LoadedCheckpoint,
    first_non_finite,
    has_rows,
    own_copy,
    tree_bytes,
    write_file,
    write_safetensors,
)
from astrai.trainer.checkpoint.sharded import ShardedState, check_shared_job_dir, read_rows
from astrai.trainer.launch.distributed import DistEnv, failed_ranks
from astrai.trainer.models.backend import backend_of
from astrai.trainer.models.lora import adapter_parameters, peft_state_dict
from astrai.trainer.models.optim import Optimizers

Copy = Callable[[object], object]
"""Maps a tree of tensors to host copies of it (reused buffers: the manager's _HostCopy)."""


class Snapshot(Protocol):
    """One rank's share of a save, taken at the step."""

    writes: bool
    """Whether this rank writes anything (the full format: rank 0 only)."""

    def first_non_finite(self) -> str | None:
        """The name of a weight this rank holds that is NaN or infinite, or None."""

    def copy_to_host(self, copy: Copy) -> None:
        """Replace every value training goes on changing by a host copy, so the write may run meanwhile."""

    def nbytes(self) -> int:
        """About how much disk the whole checkpoint's tensors take (for the message of a full disk)."""

    def create(self, staging: Path) -> None:
        """Rank 0, before any rank writes: whatever the writing ranks need in the staging folder."""

    def write(self, staging: Path) -> None:
        """Write this rank's share into the staging folder and flush it to disk."""


class CheckpointFormat(Protocol):
    name: str
    every_rank_writes: bool
    """Whether every rank writes (and so agrees on the outcome), or rank 0 alone."""

    def reads_whole(self, env: DistEnv) -> bool:
        """Whether rank 0 reads a resume whole and hands it to every rank, or each rank reads its own rows."""

    def check_job_dir(self, job_dir: Path, env: DistEnv) -> None:
        """At start: refuse a job dir this format cannot write into."""

    def snapshot(self, model: torch.nn.Module, optimizer: Optimizers, env: DistEnv) -> Snapshot:
        """The state at this step (every rank calls it: it may gather)."""

    def restore(self, model: torch.nn.Module, optimizer: Optimizers, loaded: LoadedCheckpoint, env: DistEnv) -> None:
        """Load the optimizer's state of a resume (and, when each rank reads its own rows, the weights too)."""


# --- Full ------------------------------------------------------------------------------------------


class FullSnapshot:
    """The whole state on rank 0: FSDP gathers it into fresh CPU tensors; otherwise it is the live state itself."""

    def __init__(self, model_state: dict, optimizer_state: dict, master: bool, gathered: bool, names):
        self.model_state = model_state
        self.optimizer_state = optimizer_state
        self.writes = master
        self.gathered = gathered
        self.names = names
        """Our names to the file's: Hugging Face's for a model, PEFT's for adapters."""

    def first_non_finite(self) -> str | None:
        # The full weights are on rank 0 after the gather, so checking them there costs no extra collective.
        return first_non_finite(self.model_state) if self.writes else None

    def copy_to_host(self, copy: Copy) -> None:
        if not self.writes:
            return
        if not self.gathered:
            self.model_state, self.optimizer_state = copy((self.model_state, self.optimizer_state))
            return
        # Gathered tensors are fresh copies already, but not the step counters, which the optimizer goes on
        # updating in place while a periodic save is written.
        self.optimizer_state = {
            **self.optimizer_state,
            "state": {
                param: {key: value if has_rows(value) else own_copy(value) for key, value in values.items()}
                for param, values in self.optimizer_state["state"].items()
            },
        }

    def nbytes(self) -> int:
        return tree_bytes((self.model_state, self.optimizer_state)) + SMALL_FILES_BYTES

    def create(self, staging: Path) -> None:
        pass

    def write(self, staging: Path) -> None:
        """The two large files at once, ``model.safetensors`` by a helper thread and ``optimizer.pt`` by this one.

        Both go to the page cache in parallel (the kernel's copy runs without the GIL), and each file's fsync
        overlaps the other's serialization; tensors are written straight from their memory.
        """
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-model") as pool:
            # Hugging Face names and config.json: the folder loads in transformers as it is.
            model = pool.submit(
                write_file,
                staging / WEIGHTS_FILE,
                self.names(self.model_state),
                write_safetensors,
                {"format": "pt"},
            )
            write_file(staging / OPTIMIZER_FILE, self.optimizer_state, torch.save)
            model.result()


class FullFormat:
    name = CKPT_FORMAT_FULL
    every_rank_writes = False

    def reads_whole(self, env: DistEnv) -> bool:
        return True

    def check_job_dir(self, job_dir: Path, env: DistEnv) -> None:
        pass  # only node 0 writes and reads the job dir

    def snapshot(self, model: torch.nn.Module, optimizer: Optimizers, env: DistEnv) -> FullSnapshot:
        fsdp = env.parallel_mode == "fsdp"
        # Hugging Face's names in the model's family (a transformers model's: its own).
        config = _unwrapped(model).config
        names = backend_of(config).saved_names(config)
        if not fsdp:  # the live parameters and optimizer moments themselves
            state = (_unwrapped(model).state_dict(), named_optimizer_state(model, optimizer))
            return FullSnapshot(*state, env.master_process, gathered=False, names=names)
        # FSDP gathers into fresh CPU tensors on rank 0 (other ranks get empty dicts).
        model_state, optimizer_state = get_state_dict(
            model, optimizer.parts, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        return FullSnapshot(model_state, optimizer_state, env.master_process, gathered=True, names=names)

    def restore(self, model: torch.nn.Module, optimizer: Optimizers, loaded: LoadedCheckpoint, env: DistEnv) -> None:
        _restore_whole(model, optimizer, loaded)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside DDP's wrapper (whose parameter names start with ``module.``)."""
    return getattr(model, "module", model)


def named_optimizer_state(model: torch.nn.Module, optimizer: Optimizers) -> dict:
    """The optimizers' state keyed by parameter name, as torch's ``get_optimizer_state_dict`` gives it for a model
    that is not sharded (one process, DDP): the same dict, without that function's walk of every module at each
    save (half of a LoRA save's time). An optimizer that has not stepped yet goes through torch's function, which
    gives its state a form first."""
    if any(not part.state for part in optimizer.parts):
        return get_optimizer_state_dict(model, optimizer.parts, options=StateDictOptions(full_state_dict=True))
    names = {param: name for name, param in _unwrapped(model).named_parameters()}
    merged = {"state": {}, "param_groups": []}
    for part in optimizer.parts:
        params = [param for group in part.param_groups for param in group["params"]]
        raw = part.state_dict()
        merged["state"].update({names[params[index]]: values for index, values in raw["state"].items()})
        merged["param_groups"].extend(
            {**group, "params": [names[params[index]] for index in group["params"]]} for group in raw["param_groups"]
        )
    return merged


def _restore_whole(model: torch.nn.Module, optimizer: Optimizers, loaded: LoadedCheckpoint) -> None:
    """The optimizer's whole state, on every rank; the weights went into the model before it was wrapped
    (astrai.trainer.run.build.build_model)."""
    set_optimizer_state_dict(
        model, optimizer.parts, loaded.optimizer_state, options=StateDictOptions(full_state_dict=True)
    )


# --- Sharded ---------------------------------------------------------------------------------------


class ShardedFormat:
    name = CKPT_FORMAT_SHARDED
    every_rank_writes = True

    def reads_whole(self, env: DistEnv) -> bool:
        # Under DDP or one process every rank holds everything anyway: rank 0 reads once and hands it over.
        return env.parallel_mode != "fsdp"

    def check_job_dir(self, job_dir: Path, env: DistEnv) -> None:
        if env.distributed:
            check_shared_job_dir(job_dir, env)

    def snapshot(self, model: torch.nn.Module, optimizer: Optimizers, env: DistEnv) -> ShardedState:
        """This rank's shard (FSDP) or its chunk of rows of a whole tensor, and on rank 0 the rest."""
        model_state, optimizer_state = get_state_dict(
            model, optimizer.parts, options=StateDictOptions(full_state_dict=False)
        )
        return ShardedState(model_state, optimizer_state, env.rank, env.world_size, _unwrapped(model).config)

    def restore(self, model: torch.nn.Module, optimizer: Optimizers, loaded: LoadedCheckpoint, env: DistEnv) -> None:
        if loaded.model_state is not None:
            _restore_whole(model, optimizer, loaded)
            return
        # Every rank reads its own rows of the weights and the optimizer's moments, and loads them.
        model_state, optimizer_state = get_state_dict(
            model, optimizer.parts, options=StateDictOptions(full_state_dict=False)
        )
        error = None
        try:
            config = _unwrapped(model).config
            read_rows(loaded.checkpoint.path, loaded.optimizer_state, model_state, optimizer_state, config)
        except Exception as failure:  # every rank learns of it below, so none waits for the others alone
            error = failure
        failed = failed_ranks(env, error is not None, env.control_group)
        if failed:
            detail = f": {error}" if error is not None else f" (rank {failed[0]} could not read its part)"
            raise CheckpointError(f"reading {loaded.checkpoint.path} failed{detail}")
        set_state_dict(
            model,
            optimizer.parts,
            model_state_dict=model_state,
            optim_state_dict=optimizer_state,
            options=StateDictOptions(full_state_dict=False),
        )


# --- LoRA -------------------------------------------------------------------------------------------


class LoRAFormat(FullFormat):
    """The full format's files, of the adapters alone: what trains, gathered on rank 0 whatever the base's size."""

    def snapshot(self, model: torch.nn.Module, optimizer: Optimizers, env: DistEnv) -> FullSnapshot:
        fsdp = env.parallel_mode == "fsdp"
        adapters = {}
        for name, param in adapter_parameters(model).items():  # in the same order on every rank: FSDP gathers
            value = param.full_tensor() if isinstance(param, DTensor) else param
            if env.master_process:
                adapters[name] = value.detach().cpu() if fsdp else value.detach()
        # The optimizer holds the adapters alone, so this gathers only their moments.
        if fsdp:
            optimizer_state = get_optimizer_state_dict(
                model, optimizer.parts, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
        else:
            optimizer_state = named_optimizer_state(model, optimizer)
        return FullSnapshot(adapters, optimizer_state, env.master_process, gathered=fsdp, names=peft_state_dict)


FORMATS: dict[str, CheckpointFormat] = {
    CKPT_FORMAT_FULL: FullFormat(),
    CKPT_FORMAT_SHARDED: ShardedFormat(),
    CKPT_FORMAT_LORA: LoRAFormat(),
}
"""Each format by the run plan's name of it (:attr:`astrai.common.plan.RunPlan.ckpt_format`)."""
