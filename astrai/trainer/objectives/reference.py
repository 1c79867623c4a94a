"""The frozen starting model the preference and reward types compare with: loaded and checked, and for DPO kept
live or turned into a table of log-probabilities.

:func:`frozen_model` loads a model folder (``ckpt.reference_path``, or the base model) frozen on the device, and
says what checkpoints record of it (path and sha256), which a resume must keep (:func:`check_same_reference`).
With LoRA the reference is the trained model itself with its adapters off
(:class:`astrai.trainer.models.lora.BaseModel`).

With ``training.dpo_reference: precomputed`` (the default) the reference scores every pair of the data
once, before the first step: each rank scores its share, the shares are summed into one table
``(pairs, 2)`` of summed log-probabilities (chosen, rejected), and the reference model is freed. Rank 0
keeps the table in the job dir (``reference_logps.safetensors``), with what it was computed from
(the reference's checksum, the data's fingerprint, the window, ``data.overlong``, the device type), so
a resume reads it back instead of scoring again; a table from anything else is computed afresh.
With ``live`` the reference stays in memory and scores each micro-batch as it trains.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch.utils.data import default_collate

from astrai.common.checkpoints import fsync_path
from astrai.common.contract import REFERENCE_LOG_PROBS_FILE
from astrai.common.data_folder import DataError, TokenData
from astrai.common.fit import SetupError, check_model_tokenizer
from astrai.common.model_folder import ModelConfig, ModelLoadError, model_digest
from astrai.trainer.checkpoint.files import LoadedCheckpoint
from astrai.trainer.feed.records import DPOPair
from astrai.trainer.launch.distributed import DistEnv, broadcast_from_master
from astrai.trainer.models.backend import backend_of
from astrai.trainer.models.native import Transformer
from astrai.trainer.models.parallel import parallelize
from astrai.trainer.models.scoring import TokenTargets
from astrai.trainer.models.weights import save_tensors

TABLE_KEY = "log_probs"


def summed_log_probs(model, pairs: DPOPair) -> torch.Tensor:
    """Summed log-probability of each row's supervised tokens under ``model``: (pairs, 2) for (pairs, 2, T) rows."""
    width = pairs.inputs.shape[-1]
    scores = model(pairs.inputs.view(-1, width), score=TokenTargets(pairs.targets.view(-1, width)))
    return (scores.logps * pairs.weights.view(-1, width)).view(-1, 2, width).sum(-1)


def reference_table(
    reference,
    dataset,
    count: int,
    facts: dict[str, str],
    job_dir: Path,
    env: DistEnv,
    batch_size: int,
    autocast: contextlib.AbstractContextManager,
    log,
) -> torch.Tensor:
    """The (count, 2) table of the reference's log-probabilities of pairs 0..count-1, on ``env.device``.

    Read from the job dir when a table of the same ``facts`` is there; otherwise every rank scores its
    share (the same number of forward passes on each, as FSDP needs) and rank 0 writes the table.
    """
    path = Path(job_dir) / REFERENCE_LOG_PROBS_FILE
    cached = broadcast_from_master(env, lambda: _read(path, facts, count))
    if cached is not None:
        log(f"dpo: reference log-probabilities of {count:,} pairs read from {path}")
        return cached.to(env.device)
    table = torch.zeros(count, 2, dtype=torch.float32, device=env.device)
    mine = list(range(env.rank, count, env.world_size))
    batches = math.ceil(math.ceil(count / env.world_size) / batch_size)
    reference.eval()
    with torch.no_grad():
        for index in range(batches):
            chunk = mine[index * batch_size : (index + 1) * batch_size]
            batch = default_collate([dataset.item(number) for number in chunk or [0]])
            batch = batch.to(env.device)
            with autocast:
                scores = summed_log_probs(reference, batch)
            if chunk:
                table[torch.tensor(chunk, device=env.device)] = scores.float()
    if env.distributed:
        dist.all_reduce(table)
    if env.master_process:
        _write(path, table, facts)
    log(f"dpo: reference log-probabilities of {count:,} pairs computed and kept in {path}")
    return table


def _read(path: Path, facts: dict[str, str], count: int) -> torch.Tensor | None:
    """The table at ``path`` if it was computed from ``facts`` (and is whole), else None."""
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        tensors = load_file(str(path))
    except (OSError, SafetensorError):
        return None
    table = tensors.get(TABLE_KEY)
    if metadata != facts or table is None or tuple(table.shape) != (count, 2) or not torch.isfinite(table).all():
        return None
    return table


def _write(path: Path, table: torch.Tensor, facts: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.tmp")
    save_tensors({TABLE_KEY: table.cpu().contiguous()}, staging, metadata=facts)
    fsync_path(staging)
    os.replace(staging, path)
    fsync_path(path.parent)


def frozen_model(
    path: Path, env: DistEnv, model_config: ModelConfig, data: TokenData, loaded: LoadedCheckpoint | None
) -> tuple[Transformer, dict]:
    """A frozen copy of the model folder ``path`` on the device (sharded under FSDP), which must score the tokens of
    the trained model (``model_config``) and of the data, and be the one the checkpoint resumed (``loaded``) was
    trained against; and what checkpoints record of it."""

    backend = backend_of(model_config)  # model.backend transformers: the reference too

    def read_reference():
        check_model_tokenizer(data, path)  # a reference with its own tokenizer must be the data's
        return (*backend.read(path), model_digest(path))

    reference_config, weights, digest = broadcast_from_master(
        env, read_reference, errors=(ModelLoadError, SetupError, DataError)
    )
    if reference_config.vocab_size != model_config.vocab_size:
        raise SetupError(
            f"the reference {path} has a vocabulary of {reference_config.vocab_size}, the trained model "
            f"{model_config.vocab_size}: the reference must score the same tokens"
        )
    recorded = {"path": str(path), "sha256": digest}
    check_same_reference(recorded, loaded)
    reference = backend.frozen(reference_config, weights, str(path))
    del weights
    reference.to(env.device)
    if env.parallel_mode == "fsdp":
        reference = parallelize(reference, env)
    return reference, recorded


def check_same_reference(recorded: dict, loaded: LoadedCheckpoint | None) -> None:
    """A resume keeps the reference its checkpoint was trained against (meta.json's ``reference``)."""
    before = loaded.meta.reference if loaded is not None else None
    if before is not None and before.get("sha256") != recorded["sha256"]:
        raise SetupError(
            f"this run's DPO reference {recorded['path']} (sha256 {recorded['sha256'][:12]}) is not the one its "
            f"checkpoint {loaded.checkpoint.path} was trained against ({before.get('path')}, sha256 "
            f"{before.get('sha256', '')[:12]}); set ckpt.reference_path back to it"
        )
