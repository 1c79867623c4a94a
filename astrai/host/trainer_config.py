"""The trainer sections of train.yaml and the words after ``--``, read on the host as the container will read them.

`invoke preflight`, `render`, `start` and `restart` parse the trainer's configuration
here, with the arguments the entrypoint adds (the mounts' paths and the derived
parallel mode, :func:`astrai.common.contract.trainer_arguments`), so what the host
accepts is what the trainer accepts, and the one resolved config is handed to every
check. Paths the container mounts are the runtime block's business: a trainer path
outside its mount would train on nothing, or write checkpoints into the container's
scratch space, lost when it exits; such a value is refused here, naming the
``runtime.paths`` key to change instead.
"""

from __future__ import annotations

import posixpath
from pathlib import Path

from astrai.common.backends import BACKEND_TRANSFORMERS, TRANSFORMERS_PACKAGE, folder_model_type, resolve_backend
from astrai.common.config import TrainerConfig, parse_args, parse_overrides, trainer_sections
from astrai.common.configfile import ConfigError
from astrai.common.contract import (
    CONTAINER_DATA,
    CONTAINER_MODEL,
    EPISODE_PACKAGES,
    OPENENV_PACKAGE,
    container_job_dir,
    resolve_parallel_mode,
    trainer_arguments,
)
from astrai.common.nf4 import NF4, TORCHAO_PACKAGE
from astrai.common.reward_specs import JudgeSpec, ModelRewardSpec
from astrai.host.runtime import Runtime

_FLAGS = ("--dry-run",)
"""Trainer options that take no value."""
# Trainer keys holding a path in the container, with the mount they must stay inside.
_MOUNTED = {
    "data_root_path": ("data", CONTAINER_DATA),
    "param_path": ("model", CONTAINER_MODEL),
    # DPO's reference model; null (the base model) needs no mount of its own.
    "reference_path": ("model", CONTAINER_MODEL),
    # LoRA: a PEFT adapter folder to start from; null (new adapters) needs no mount.
    "adapter_path": ("model", CONTAINER_MODEL),
    # The evaluation's prompts; null needs none, and a relative path is inside data_root_path.
    "eval_prompts": ("data", CONTAINER_DATA),
}
_OPTIONAL = ("reference_path", "adapter_path", "eval_prompts")
"""Keys whose null needs no mount."""


def read_trainer_config(runtime: Runtime, user_args: list[str]) -> TrainerConfig:
    """The trainer's resolved config in this job's container; ConfigError names the file or argument at fault."""
    path = runtime.config_path
    try:
        yaml_values = trainer_sections(path)
        parse_args(["--config", str(path)])
    except ConfigError as error:
        named = (line if line.startswith(f"{path}:") else f"{path}: {line}" for line in error.messages)
        raise ConfigError(named) from None
    problems = [
        f"{path}: {section}.{key}: {problem}"
        for section, values in yaml_values.items()
        for key, value in values.items()
        if (problem := mount_problem(runtime, key, value)) is not None
    ]
    try:
        overrides = parse_overrides(_pairs(user_args))
    except ConfigError:
        overrides = {}  # parse_args below names the problem in the trainer's own words
    problems += [
        f"after --: --{key} {value}: {problem}"
        for values in overrides.values()
        for key, value in values.items()
        if (problem := mount_problem(runtime, key, value)) is not None
    ]
    if problems:
        raise ConfigError(problems)
    mode = runtime.parallel_mode if runtime.processes is not None else None
    arguments = trainer_arguments(runtime.job_name, mode, user_args, config=str(path))
    try:
        config = parse_args(arguments)[0]
    except ConfigError as error:
        raise ConfigError(f"after --: {line}" for line in error.messages) from None
    problems = _container_problems(runtime, config, overrides)
    if problems:
        raise ConfigError(problems)
    return config


def _container_problems(runtime: Runtime, config: TrainerConfig, overrides: dict) -> list[str]:
    """What the trainer would refuse in this job's container though the config reads well: a parallel mode given
    after ``--`` that the job's process count does not allow, a GPU asked for in a container without one."""
    problems = []
    if "parallel_mode" in overrides.get("parallel", {}) and runtime.world_size is not None:
        # The entrypoint passes the runtime's mode; an argument after -- comes later and wins.
        try:
            resolve_parallel_mode(config.parallel.parallel_mode, runtime.world_size)
        except ValueError as error:
            problems.append(
                f"after --: --parallel_mode {config.parallel.parallel_mode}: {error} by runtime.gpu "
                f"({runtime.world_size} in this job); leave it out (the runtime's {runtime.parallel_mode} applies) "
                "or change runtime.gpu"
            )
    if config.training.device == "cuda" and (not runtime.uses_gpu or runtime.cuda_tag == "cpu"):
        why = "runtime.gpu.devices is none" if not runtime.uses_gpu else "runtime.container.cuda_tag is cpu"
        given = "device" in overrides.get("training", {})
        where = "after --: --device" if given else f"{runtime.config_path}: training.device:"
        problems.append(f"{where} cuda, but {why}: the container has no GPU; use auto or cpu")
    return problems


def fix_hint(error: ConfigError, runtime: Runtime) -> str:
    """What to fix for a refused trainer config: the arguments after -- or the file's trainer sections."""
    where = (
        "the arguments after --"
        if any(line.startswith("after --") for line in error.messages)
        else f"the trainer sections of {runtime.config_path.name}"
    )
    return f"fix {where}; `python -m astrai.train --help` lists the keys"


def mount_problem(runtime: Runtime, key: str, value) -> str | None:
    """Why the trainer path ``key`` = ``value`` does not fit this job's mounts, or None (also for other keys)."""
    if key == "ckpt_dir":
        job_dir = container_job_dir(runtime.job_name)
        if isinstance(value, str) and posixpath.normpath(value) == job_dir:
            return None
        return (
            f"{value} is not the job dir {job_dir}: checkpoints written anywhere else in the container are "
            f"lost when it exits; to keep them in another folder, change runtime.paths.checkpoints "
            f"(the job dir is <runtime.paths.checkpoints>/<runtime.job_name>)"
        )
    if key not in _MOUNTED or (key in _OPTIONAL and value in (None, "null", "")):
        return None
    if key == "eval_prompts" and isinstance(value, str) and not value.startswith("/"):
        return None  # under data.data_root_path, which is checked itself
    runtime_key, mount = _MOUNTED[key]
    if isinstance(value, str) and _inside(value, mount):
        return None
    return (
        f"{value} is outside {mount}, where runtime.paths.{runtime_key} is mounted; "
        f"to use another folder, point runtime.paths.{runtime_key} at it"
    )


def host_path(runtime: Runtime, container_path: str) -> Path | None:
    """The host folder a container path inside the data or model mount stands for, or None."""
    for folder, mount in ((runtime.data_dir, CONTAINER_DATA), (runtime.model_dir, CONTAINER_MODEL)):
        if _inside(container_path, mount):
            rest = posixpath.relpath(posixpath.normpath(container_path), mount)
            return folder if rest == "." else folder / rest
    return None


def _inside(value: str, mount: str) -> bool:
    normal = posixpath.normpath(value)
    return value.startswith("/") and (normal == mount or normal.startswith(mount + "/"))


def _pairs(user_args: list[str]) -> list[tuple[str, str]]:
    """``--KEY VALUE`` and ``--KEY=VALUE`` pairs of the user's words (the others are parse_args' to judge)."""
    pairs = []
    index = 0
    while index < len(user_args):
        word = user_args[index]
        if word in _FLAGS:
            pass
        elif word.startswith("--") and "=" in word:
            key, _, value = word[2:].partition("=")
            pairs.append((key, value))
        elif word.startswith("--") and index + 1 < len(user_args):
            pairs.append((word[2:], user_args[index + 1]))
            index += 1
        index += 1
    return [(key, value) for key, value in pairs if key != "config"]


def model_packages_of(runtime: Runtime, user_args: list[str] | tuple[str, ...] = ()) -> tuple[str, ...]:
    """What the image installs for this job's models: transformers when its plan trains through it (model.backend,
    resolved for the model_type of runtime.paths.model), or when a reward model of training.rewards is of a family
    the trainer does not compute; torchao when LoRA holds its base in NF4 (training.lora_base_dtype); for episodes
    (training.tools, training.environment) the chat template's and the tokenizer's packages, and OpenEnv's client for a
    server environment; none where the config does not read or does not fit."""
    try:
        config = read_trainer_config(runtime, list(user_args))
        folder = host_path(runtime, config.ckpt.param_path) or runtime.model_dir
        backend = resolve_backend(config.model.backend, folder_model_type(folder))
    except (ConfigError, ValueError):
        return ()
    library = backend == BACKEND_TRANSFORMERS or any(
        resolve_backend("auto", folder_model_type(found)) == BACKEND_TRANSFORMERS
        for spec in config.rewards_in_use()
        if isinstance(spec, ModelRewardSpec) and (found := host_path(runtime, spec.model)) is not None
    )
    nf4 = config.training.lora_rank > 0 and config.training.lora_base_dtype == NF4
    packages = (TRANSFORMERS_PACKAGE,) * library + (TORCHAO_PACKAGE,) * nf4
    environment = config.training.environment
    if config.training.kind.online and config.training.episodes() is not None:
        packages += EPISODE_PACKAGES
        if environment is not None and environment.server is not None:
            packages += (OPENENV_PACKAGE,)
    return packages


def judges_of(runtime: Runtime, user_args: list[str] | tuple[str, ...] = ()) -> tuple[JudgeSpec, ...]:
    """This job's remote judges (training.rewards, log.eval_rewards); none where its config does not read."""
    try:
        config = read_trainer_config(runtime, list(user_args))
    except ConfigError:
        return ()
    return tuple(spec for spec in config.rewards_in_use() if isinstance(spec, JudgeSpec))


def trackers_of(runtime: Runtime, user_args: list[str] | tuple[str, ...] = ()) -> tuple[str, ...]:
    """The remote trackers (log.report_to: mlflow, wandb) this job's trainer reports to; none where its config does
    not read (the commands that start a job refuse such a config before they render anything)."""
    try:
        return read_trainer_config(runtime, list(user_args)).log.trackers
    except ConfigError:
        return ()
