"""What the tests (and the benchmarks) share: the repository, invoke as a user runs it, free ports, runtime files
and placeholder checkpoints.

Imported as ``tests.support`` (the repository's root is on pytest's path, and the benchmarks run from it).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def interruptible() -> None:
    """``preexec_fn`` of a process a test will interrupt with Ctrl-C (SIGINT): the signal's default action in it,
    as an interactive shell gives a foreground job. A suite started in the background (``python3 -m pytest &`` from
    a script) runs with SIGINT ignored, as POSIX shells start background jobs, and an ignored signal stays ignored
    in every child, across exec: without this the child would never see the Ctrl-C the test sends."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_python(
    *args: str,
    cwd: Path | None = None,
    env: dict | None = None,
    timeout: float = 900,
    check: bool = False,
    prefix: list[str] = (),
) -> subprocess.CompletedProcess:
    """Run this Python with ``args`` from the repository, ``env`` over ours, its output captured as text
    (``check``: raise with that output unless it exits 0; ``prefix``: a command to run it under)."""
    result = subprocess.run(
        [*prefix, sys.executable, *args],
        cwd=cwd or REPO,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )
    if check and result.returncode != 0:
        raise RuntimeError(f"python {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


INVOKE = ("-m", "invoke", "--search-root", str(REPO))


def invoke_command(*args: str) -> list[str]:
    """The command line of one invoke task of this project, as a user types it."""
    return [sys.executable, *INVOKE, *args]


def invoke(*args: str, **options) -> subprocess.CompletedProcess:
    """Run one invoke task of this project the way a user would (``options``: those of run_python)."""
    return run_python(*INVOKE, *args, **options)


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 now (held together while they are picked)."""
    probes = [socket.socket() for _ in range(count)]
    try:
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def free_port() -> int:
    return free_ports(1)[0]


def write_config(folder: Path, runtime: dict, trainer: dict | None = None, name: str = "train.yaml") -> Path:
    """A train.yaml in ``folder`` (created) with this runtime block and trainer sections; its path."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / name
    config.write_text(yaml.safe_dump({"runtime": runtime, **(trainer or {})}, sort_keys=False), encoding="utf-8")
    return config


def placeholder_checkpoint(
    job_dir: Path, epoch: int, step: int, *, files=None, reason: str = "periodic", meta: dict | None = None
) -> Path:
    """A folder that is a checkpoint by the folder rule (astrai.common.checkpoints) without holding real state.

    Every file is whole as far as its header tells: meta.json and config.json parse, model.safetensors is a
    safetensors file of one small tensor, optimizer.pt and scheduler.pt are zip archives. The trainer, which
    reads the tensors, refuses it; host commands (list, latest, clean) take it for a checkpoint. ``files``
    limits which files are written (a folder missing some is not a checkpoint).
    """
    from astrai.common.checkpoints import CheckpointMeta, checkpoint_name
    from astrai.common.contract import (
        META_FILE,
        MODEL_CONFIG_FILE,
        OPTIMIZER_FILE,
        REQUIRED_FILES,
        SCHEDULER_FILE,
        WEIGHTS_FILE,
    )
    from astrai.common.model_folder import ModelConfig

    folder = job_dir / checkpoint_name(epoch, step)
    folder.mkdir(parents=True)
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    header += b" " * (-len(header) % 8)
    record = CheckpointMeta(epoch=epoch, step=step, reason=reason, world_size=1).to_dict()
    contents = {
        META_FILE: json.dumps({**record, **(meta or {})}).encode(),
        MODEL_CONFIG_FILE: ModelConfig().to_json().encode(),
        WEIGHTS_FILE: len(header).to_bytes(8, "little") + header + b"\0" * 4,
    }
    for name in files or REQUIRED_FILES:
        if name in (OPTIMIZER_FILE, SCHEDULER_FILE):
            with zipfile.ZipFile(folder / name, "w") as archive:
                archive.writestr("data.pkl", b"placeholder")
        else:
            (folder / name).write_bytes(contents[name])
    return folder


def transformers_generate(
    model, prompts: list[list[int]], max_new_tokens: int, eos: int | None = None, sample: dict | None = None
) -> list:
    """transformers' greedy ``generate`` of a loaded model on prompts of any lengths (left-padded with 0, with their
    attention mask): each row's new tokens, up to and with ``eos`` when given (else all ``max_new_tokens``);
    ``sample``: sample instead, with these settings (temperature, top_p, top_k)."""
    import torch

    longest = max(len(prompt) for prompt in prompts)
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        min_new_tokens=None if eos is not None else max_new_tokens,
        do_sample=sample is not None,
        **(sample or {}),
        eos_token_id=eos,
        pad_token_id=0,
    )
    completions = out[:, longest:].tolist()
    return [row[: row.index(eos) + 1] if eos in row else row for row in completions]
