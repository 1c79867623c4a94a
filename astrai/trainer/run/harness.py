"""lm-evaluation-harness on a checkpoint, inside the job's image: what ``invoke eval`` runs (``python -m
astrai.evaluate``, :mod:`astrai.host.harness` on the host).

The checkpoint is read as the Hugging Face folder it is (``AutoModelForCausalLM``, its own tokenizer), by lm-eval's
``hf`` model, in bfloat16 on a GPU and float32 on a CPU. Nothing is downloaded: the process runs with the Hugging Face
libraries offline, so a task must read its data from local files — a task YAML of the harness's own format whose
``dataset_path: json`` (or ``parquet``) names a JSONL or Parquet file (``docs/evaluation.md`` shows one). A task given
as a path (a YAML file, or a folder of them) is loaded from there; a name is looked up among the folders given with
``--include`` and the harness's own tasks. The process runs in the first task folder, so a task's ``data_files`` may
name its file relative to its YAML.

The results go to ``<job dir>/eval/<checkpoint name>.json`` (written whole or not at all): the harness's results per
task, the settings, lm-eval's version, and the checkpoint's step. Every number of them goes as well to the tracker runs
that made the checkpoint (its ``meta.json`` names them) at the checkpoint's step, as ``lm_eval/<task>/<metric>``.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from astrai.common.atomic import write_text_atomically
from astrai.common.checkpoints import CheckpointMeta, DamagedCheckpoint
from astrai.common.contract import (
    LM_EVAL_METRIC,
    LM_EVAL_PACKAGE,
    META_FILE,
    MODEL_CONFIG_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
)
from astrai.common.errors import AstraiError

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_EVALUATE_OFFLINE": "1"}
"""Nothing is fetched at run time: the Hugging Face libraries read only what is on disk."""


class HarnessError(AstraiError):
    """A checkpoint or task the evaluation cannot run, or lm-eval missing from the image; the message says which."""


@dataclass(frozen=True)
class Tasks:
    """What the harness is asked: task names, and the folders of task YAMLs to find them in."""

    names: tuple[str, ...]
    folders: tuple[Path, ...]


def resolve_tasks(given: list[str], include: list[Path]) -> Tasks:
    """Each of ``given`` a task name, a task YAML, or a folder of them (its every task); HarnessError for a path that is
    not there or a YAML that names no task."""
    names, folders = [], [Path(folder) for folder in include]
    for entry in given:
        path = Path(entry)
        if not (entry.endswith((".yaml", ".yml")) or "/" in entry):
            names.append(entry)
            continue
        if path.is_dir():
            found = [name for file in sorted(path.glob("*.y*ml")) for name in _task_names(file)]
            if not found:
                raise HarnessError(f"--tasks {entry}: the folder holds no task YAML (a file with a 'task:' key)")
            names += found
            folders.append(path)
        elif path.is_file():
            found = _task_names(path)
            if not found:
                raise HarnessError(f"--tasks {entry}: it has no 'task:' key naming the task")
            names += found
            folders.append(path.parent)
        else:
            raise HarnessError(f"--tasks {entry}: no such task file or folder")
    if not names:
        raise HarnessError("--tasks: name at least one task (a task YAML, a folder of them, or a task's name)")
    return Tasks(tuple(dict.fromkeys(names)), tuple(dict.fromkeys(folders)))


def _task_names(file: Path) -> list[str]:
    """The task (or tasks) a harness YAML defines (the harness's own tags, ``!function``, read as nothing)."""

    class _Loader(yaml.SafeLoader):
        pass

    _Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    try:
        document = yaml.load(file.read_text(encoding="utf-8"), Loader=_Loader)
    except (OSError, yaml.YAMLError) as error:
        raise HarnessError(f"--tasks {file}: cannot be read as YAML ({error})") from None
    task = document.get("task") if isinstance(document, dict) else None
    if isinstance(task, str):
        return [task]
    return [name for name in task if isinstance(name, str)] if isinstance(task, list) else []


def check_checkpoint(folder: Path) -> None:
    """A folder lm-eval's ``hf`` model reads: a model config and a Hugging Face tokenizer of its own."""
    if not (folder / MODEL_CONFIG_FILE).is_file():
        raise HarnessError(f"--checkpoint {folder}: no {MODEL_CONFIG_FILE}; give a checkpoint or a model folder")
    config = json.loads((folder / MODEL_CONFIG_FILE).read_text(encoding="utf-8"))
    if any(str(name).endswith("ForSequenceClassification") for name in config.get("architectures") or []):
        raise HarnessError(f"--checkpoint {folder} is a reward model (a sequence classifier): it generates no text")
    if not (folder / TOKENIZER_FILE).is_file() or not (folder / TOKENIZER_CONFIG_FILE).is_file():
        raise HarnessError(
            f"--checkpoint {folder} holds no Hugging Face tokenizer ({TOKENIZER_FILE} and {TOKENIZER_CONFIG_FILE}), "
            "which lm-eval reads text with: train on data prepared with --tokenizer (a byte-level run has none)"
        )


def flat_results(results: dict) -> dict[str, float]:
    """The harness's per-task numbers as metrics: ``lm_eval/<task>/<metric>`` (``/<filter>`` after it when the filter
    is not ``none``), finite numbers only."""
    flat = {}
    for task, values in results.items():
        for key, value in values.items():
            metric, _, kind = key.partition(",")
            if not kind or isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            name = metric if kind == "none" else f"{metric}/{kind}"
            flat[LM_EVAL_METRIC.format(task=task, metric=name)] = float(value)
    return flat


def run_harness(
    checkpoint: Path, tasks: Tasks, device: str, limit: int | None, num_fewshot: int | None, batch_size: int
) -> dict:
    """lm-eval's ``simple_evaluate`` on the checkpoint, offline; the part of its output the results file keeps."""
    os.environ.update(OFFLINE)
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError as error:
        raise HarnessError(
            f"lm-eval cannot be imported here ({error}); `invoke eval` builds the job's image with {LM_EVAL_PACKAGE}"
        ) from None
    if tasks.folders:
        os.chdir(tasks.folders[0])  # a task's data_files may be relative to its YAML
    manager = TaskManager(include_path=[str(folder) for folder in tasks.folders] or None)
    unknown = [name for name in tasks.names if name not in manager.all_tasks]
    if unknown:
        raise HarnessError(
            f"--tasks: no task named {unknown[0]} among the harness's own and those of "
            f"{', '.join(str(folder) for folder in tasks.folders) or 'no task folder'}; give its YAML's path"
        )
    try:
        out = lm_eval.simple_evaluate(
            model="hf",
            model_args={"pretrained": str(checkpoint), "dtype": "bfloat16" if device == "cuda" else "float32"},
            tasks=list(tasks.names),
            num_fewshot=num_fewshot,
            limit=limit,
            batch_size=batch_size,
            device=device,
            task_manager=manager,
            log_samples=False,
        )
    except (OSError, ConnectionError) as error:
        raise HarnessError(
            f"the harness needed something it does not have on disk ({type(error).__name__}: {str(error)[:300]}); "
            "nothing is downloaded at run time: give tasks whose data are local files (docs/evaluation.md)"
        ) from None
    return {key: out[key] for key in ("results", "n-shot", "versions", "higher_is_better", "n-samples") if key in out}


def results_document(checkpoint: Path, tasks: Tasks, limit, num_fewshot, harness: dict) -> dict:
    """What ``<job dir>/eval/<checkpoint name>.json`` holds: the checkpoint (and its step), the settings, the harness's
    output and its version."""
    step = epoch = None
    if (checkpoint / META_FILE).is_file():
        try:
            meta = CheckpointMeta.read(checkpoint)
            step, epoch = meta.step, meta.epoch
        except (DamagedCheckpoint, OSError, ValueError):
            pass
    from importlib.metadata import version

    return {
        "name": checkpoint.name,
        "path": str(checkpoint),
        "step": step,
        "epoch": epoch,
        "tasks": list(tasks.names),
        "limit": limit,
        "num_fewshot": num_fewshot,
        "lm_eval_version": version("lm-eval"),
        "time": time.time(),
        **harness,
    }


def write_results(path: Path, document: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(document, indent=1, sort_keys=True, default=str, allow_nan=False) + "\n"
    write_text_atomically(path, text, 0o644)


def summary_lines(document: dict) -> list[str]:
    """The results as lines: a task and its numbers."""
    lines = []
    for task, values in sorted(document.get("results", {}).items()):
        shown = ", ".join(
            f"{key.partition(',')[0]} {value:.4f}"
            for key, value in values.items()
            if "," in key and "stderr" not in key and isinstance(value, (int, float)) and not isinstance(value, bool)
        )
        lines.append(f"{task}: {shown}")
    return lines
