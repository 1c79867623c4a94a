"""`invoke eval`: lm-evaluation-harness on a checkpoint, in the job's own image, beside the job.

    invoke eval --config train.yaml --checkpoint epoch_0_step_1000 --tasks data/tasks/facts.yaml --limit 100

What it does, in order (:func:`evaluate_checkpoint`):

1. The checkpoint (a name in the job dir, the newest by default, or a folder in one of the job's mounts) and each task
   given as a path (a task YAML or a folder of them, in one of the job's mounts) are found on this host and named by
   their paths in the container; a LoRA checkpoint (adapters alone) is refused, naming the `invoke export` that merges
   it. The job's trainer config is read as `invoke start` reads it.
2. The job's image is built with lm-evaluation-harness added (:func:`astrai.host.compose.eval_packages`, pinned), as
   an image of its own (``<image>:eval``): the job's image and this one share every layer before the harness's.
3. One container of that image runs ``python -m astrai.evaluate`` (:mod:`astrai.trainer.run.harness`) with exactly what
   the trainer's container gets — the mounts, the user, the environment (the trackers' secrets passed by name), the
   GPUs, the hardening — under a Compose project of its own, so it never passes for the job's container in `invoke
   status` or `invoke stop`. Nothing is downloaded while it runs.
4. The results are read back from ``<job dir>/eval/<checkpoint name>.json`` and printed; `invoke status` lists them.

A job that is running is not evaluated beside it (its GPUs are the trainer's): stop it, or wait for it to end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from astrai.common.checkpoints import CheckpointMeta, DamagedCheckpoint, latest_complete_checkpoint
from astrai.common.contract import (
    CONTAINER_CONFIG,
    EVAL_RESULTS_DIR,
    LABEL_EVAL_PACKAGES,
    MODEL_CONFIG_FILE,
    container_job_dir,
)
from astrai.common.errors import AstraiError
from astrai.host import compose, engine
from astrai.host.checklist import PASS, SKIP, WARN, Check
from astrai.host.launch import mounts
from astrai.host.runtime import Runtime, check_paths
from astrai.host.trainer_config import read_trainer_config

NAME = "lm-eval"
"""Preflight's line for `invoke eval`'s image."""
EVAL_PROJECT_SUFFIX = "-eval"
"""`invoke eval`'s Compose project: the job's, and this."""


class HarnessError(AstraiError):
    """A checkpoint or a task `invoke eval` cannot take, or an evaluation that failed; the message says which."""


def container_path(runtime: Runtime, path: Path) -> str | None:
    """The path in the container of a host ``path`` inside one of the job's mounts (the data, the model, the
    checkpoints), or None."""
    resolved = Path(os.path.abspath(path))
    for mount in mounts(runtime):
        if mount.key == "config":
            continue
        source = Path(os.path.abspath(mount.source))
        if resolved == source or source in resolved.parents:
            return str(PurePosixPath(mount.target) / resolved.relative_to(source).as_posix())
    return None


def _outside(runtime: Runtime, what: str, path: Path) -> HarnessError:
    mounted = ", ".join(f"runtime.paths.{m.key} ({m.source})" for m in mounts(runtime) if m.key != "config")
    return HarnessError(f"{what} {path} is in no folder the job's container mounts ({mounted}); put it in one", 2)


def checkpoint_source(runtime: Runtime, given: str | None) -> tuple[Path, str]:
    """(the folder on this host, its path in the container) of ``--checkpoint``: a checkpoint's name in the job dir
    (the newest when None), or a model folder in one of the job's mounts."""
    folder = _job_checkpoint(runtime, given) if given is None or os.sep not in given else Path(given)
    if not (folder / MODEL_CONFIG_FILE).is_file():
        raise HarnessError(f"--checkpoint {folder}: no {MODEL_CONFIG_FILE}; give a checkpoint or a model folder", 2)
    try:
        lora = CheckpointMeta.read(folder).lora
    except DamagedCheckpoint:
        lora = None  # a model folder, not a checkpoint
    if lora is not None:
        raise HarnessError(
            f"--checkpoint {folder} holds LoRA adapters only; merge them into a model folder first, in the job's data "
            f"or model folder (`{runtime.command('export')} --checkpoint {folder.name} --out "
            f"{runtime.model_dir / (folder.name + '-merged')}`), and evaluate that folder",
            2,
        )
    inside = container_path(runtime, folder)
    if inside is None:
        raise _outside(runtime, "--checkpoint", folder)
    return folder, inside


def _job_checkpoint(runtime: Runtime, name: str | None) -> Path:
    """Checkpoint ``name`` of the job dir, or its newest when None."""
    if name is None:
        latest = latest_complete_checkpoint(runtime.job_dir)
        if latest is None:
            raise HarnessError(f"--checkpoint: job {runtime.job_name} has no checkpoint in {runtime.job_dir} yet", 2)
        return latest.path
    if (runtime.job_dir / name).is_dir():
        return runtime.job_dir / name
    if Path(name).is_dir():
        return Path(name)
    raise HarnessError(
        f"--checkpoint: no {name} in {runtime.job_dir} (nor here); `{runtime.command('list')}` shows the checkpoints",
        2,
    )


def task_arguments(runtime: Runtime, tasks: list[str]) -> list[str]:
    """``--tasks`` as the container reads them: a task's name as it is, a path (a task YAML or a folder of them, on
    this host) by its path in the container."""
    found = []
    for task in tasks:
        if not (task.endswith((".yaml", ".yml")) or os.sep in task):
            found.append(task)
            continue
        path = Path(task)
        if not path.exists():
            raise HarnessError(f"--tasks {task}: no such task file or folder", 2)
        inside = container_path(runtime, path)
        if inside is None:
            raise _outside(runtime, "--tasks", path)
        found.append(inside)
    return found


def results_path(runtime: Runtime, checkpoint: Path) -> Path:
    """Where `invoke eval` writes the results of ``checkpoint``: ``<job dir>/eval/<checkpoint name>.json``."""
    return runtime.job_dir / EVAL_RESULTS_DIR / f"{checkpoint.name}.json"


def eval_arguments(
    runtime: Runtime, checkpoint: str, tasks: list[str], limit: int | None, num_fewshot: int | None, device: str
) -> list[str]:
    """The arguments of ``python -m astrai.evaluate`` in the container."""
    out = (
        PurePosixPath(container_job_dir(runtime.job_name)) / EVAL_RESULTS_DIR / f"{PurePosixPath(checkpoint).name}.json"
    )
    arguments = ["--checkpoint", checkpoint, "--tasks", ",".join(tasks), "--out", str(out), "--device", device]
    arguments += ["--config", CONTAINER_CONFIG]
    if limit is not None:
        arguments += ["--limit", str(limit)]
    if num_fewshot is not None:
        arguments += ["--num_fewshot", str(num_fewshot)]
    return arguments


@dataclass(frozen=True)
class Evaluation:
    """What `invoke eval` was asked, checked and named for every place it may run."""

    folder: Path
    """The checkpoint on this host."""
    inside: str
    """Its path in the container."""
    tasks: list[str]
    """The tasks as the container reads them."""
    host_tasks: list[str]
    """The tasks as this host reads them (absolute paths)."""
    limit: int | None
    num_fewshot: int | None

    def image_arguments(self, runtime: Runtime) -> list[str]:
        """``python -m astrai.evaluate``'s arguments in the job's image."""
        device = "cuda" if runtime.uses_gpu else "cpu"
        return eval_arguments(runtime, self.inside, self.tasks, self.limit, self.num_fewshot, device)

    def host_arguments(self) -> list[str]:
        """``python -m astrai.host.harness``'s arguments (a Slurm node's task under the docker launcher)."""
        arguments = ["--checkpoint", str(self.folder), "--tasks", ",".join(self.host_tasks)]
        arguments += ["--limit", str(self.limit)] if self.limit is not None else []
        return arguments + (["--num_fewshot", str(self.num_fewshot)] if self.num_fewshot is not None else [])


def checked_evaluation(
    runtime: Runtime, checkpoint: str | None, tasks: list[str], limit: int | None, num_fewshot: int | None
) -> Evaluation:
    """The evaluation asked for, every refusal made: broken paths, no task, a config the trainer refuses, a checkpoint
    or a task outside the job's mounts."""
    check_paths(runtime, ("checkpoints",))
    if not tasks:
        raise HarnessError("--tasks is required: task YAMLs (local data), folders of them, or task names", 2)
    read_trainer_config(runtime, [])  # the job's config as `invoke start` reads it: the container reads it too
    folder, inside = checkpoint_source(runtime, checkpoint)
    given = task_arguments(runtime, tasks)
    host = [
        task if inside_task == task else os.path.abspath(task) for task, inside_task in zip(tasks, given, strict=True)
    ]
    return Evaluation(folder, inside, given, host, limit, num_fewshot)


def evaluate_checkpoint(
    runtime: Runtime, checkpoint: str | None, tasks: list[str], limit: int | None, num_fewshot: int | None
) -> dict:
    """Run the harness on the checkpoint in the job's image (see the module's docstring); the results document."""
    evaluation = checked_evaluation(runtime, checkpoint, tasks, limit, num_fewshot)
    folder = evaluation.folder
    if engine.daemon_up():
        running = engine.find_container(compose.job_project(runtime))
        if running is not None and running.running:
            raise HarnessError(
                f"job {runtime.job_name} is running (container {running.name}): its GPUs are the trainer's; stop it "
                f"(`{runtime.command('stop')}`) or wait for it to end, then evaluate"
            )
    compose.check_build_context()
    override = compose.write_override(runtime, evaluation=True)
    project = compose.job_project(runtime) + EVAL_PROJECT_SUFFIX
    print(f"building {compose.eval_image_name(runtime)}: the job's image with {' '.join(compose.eval_packages())}")
    _compose(runtime, override, project, ["build", compose.SERVICE], quiet=True)
    arguments = evaluation.image_arguments(runtime)
    run = ["run", "--rm", "--no-deps", "-T", "--entrypoint", "python3", compose.SERVICE, "-m", "astrai.evaluate"]
    try:
        code = _compose(runtime, override, project, [*run, *arguments], quiet=False)
    finally:
        _remove_networks(project)
    if code != 0:
        raise HarnessError(f"the evaluation of {folder.name} failed (exit code {code}); its output is above", code)
    path = results_path(runtime, folder)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise HarnessError(f"the evaluation ended but {path} cannot be read ({error})") from None


def _remove_networks(project: str) -> None:
    """`run --rm` removes the evaluation's container and leaves its project's network: remove it. Docker refuses to
    remove a network still in use, so another evaluation of the job still running keeps it, and removes it itself."""
    listed = engine.docker("network", "ls", "--quiet", "--filter", f"label=com.docker.compose.project={project}")
    for network in listed.stdout.split() if listed.returncode == 0 else []:
        engine.docker("network", "rm", network)


def _compose(runtime: Runtime, override: Path, project: str, args: list[str], quiet: bool) -> int:
    command = compose.compose_command(runtime, *args, override=override, project=project)
    if quiet:
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            print((result.stdout + result.stderr)[-4000:], file=sys.stderr)
            raise HarnessError(
                f"building {compose.eval_image_name(runtime)} failed: `{compose.format_command(command)}`"
            )
        return 0
    return subprocess.run(command, stdout=sys.stdout, stderr=sys.stderr).returncode


def results_of(runtime: Runtime) -> list[dict]:
    """Every results file of the job (``<job dir>/eval/*.json``) that reads, by its checkpoint's step then name."""
    found = []
    for path in sorted((runtime.job_dir / EVAL_RESULTS_DIR).glob("*.json")):
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(document, dict) and isinstance(document.get("results"), dict):
            found.append(document)
    return sorted(found, key=lambda document: (document.get("step") or 0, str(document.get("name"))))


def describe_results(document: dict) -> str:
    """One line of a results file: the checkpoint, each task's numbers, the settings."""
    tasks = []
    for task, values in sorted(document["results"].items()):
        numbers = ", ".join(
            f"{key.partition(',')[0]} {value:.4f}"
            for key, value in sorted(values.items())
            if "," in key and "stderr" not in key and isinstance(value, (int, float)) and not isinstance(value, bool)
        )
        tasks.append(f"{task} {numbers}")
    settings = []
    if document.get("limit") is not None:
        settings.append(f"limit {document['limit']}")
    if document.get("num_fewshot") is not None:
        settings.append(f"{document['num_fewshot']}-shot")
    shown = f" ({', '.join(settings)})" if settings else ""
    return f"{document.get('name')}: {'; '.join(tasks)}{shown}"


def harness_check(runtime: Runtime) -> Check | None:
    """Preflight's line for `invoke eval`'s image once it is built: whether it holds the pinned harness (None before
    the job's first `invoke eval`, which builds it)."""
    image, wanted = compose.eval_image_name(runtime), " ".join(compose.eval_packages())
    try:
        labels = engine.image_labels(image)
    except engine.EngineError as error:
        return Check(SKIP, NAME, f"not checked: {error}")
    if labels is None:
        return None
    held = labels.get(LABEL_EVAL_PACKAGES, "")
    if held != wanted:
        return Check(
            WARN, NAME, f"{image} holds {held or 'no harness'}, not {wanted}; `{runtime.command('eval')}` rebuilds it"
        )
    return Check(PASS, NAME, f"{image} holds {wanted}")


def main(argv: list[str] | None = None) -> int:
    """``python -m astrai.host.harness``: `invoke eval` on this host (a Slurm node's task under the docker launcher)."""
    from astrai.host.runtime import load_job_config

    parser = argparse.ArgumentParser(prog="python -m astrai.host.harness", description=main.__doc__)
    parser.add_argument("--config", required=True)
    parser.add_argument("--checkpoint")
    parser.add_argument("--tasks", required=True)
    parser.add_argument("--limit", type=int)
    parser.add_argument("--num_fewshot", type=int)
    args = parser.parse_args(argv)
    try:
        _, runtime = load_job_config(args.config)
        tasks = [task for task in args.tasks.split(",") if task]
        document = evaluate_checkpoint(runtime, args.checkpoint, tasks, args.limit, args.num_fewshot)
    except AstraiError as error:
        print(error.show(), file=sys.stderr)
        return error.exit_code
    print(describe_results(document))
    return 0


if __name__ == "__main__":
    sys.exit(main())
