"""Preflight's look at ``training.rewards``: each function where the container will find it, imported as the trainer
will import it.

A function in a file (``/data/my_rewards.py:brevity``) must be named by its path in the container, inside a folder
the container mounts, must exist there and parse; a module (``astrai.rewards:exact_answer``) must be importable on
the image's path. The first part is checked on the host, from the files themselves; the import itself runs in the
job's image (:func:`import_in_image`: a throwaway container with the job's mounts, read-only, and no network), as
the trainer would run it — when the image is built. `invoke start` checks again with the image it has just built,
before the trainer's container starts, so a reward that does not import never costs a start.
"""

from __future__ import annotations

import json
import os
import urllib.parse
from pathlib import PurePosixPath

from astrai.common.backends import BACKEND_TRANSFORMERS, folder_model_type, resolve_backend
from astrai.common.config import TrainerConfig
from astrai.common.contract import MODEL_CONFIG_FILE
from astrai.common.model_folder import ModelConfig, ModelLoadError, num_parameters
from astrai.common.reward_specs import JudgeSpec, ModelRewardSpec, RewardSpec, functions_of
from astrai.common.values import format_bytes
from astrai.host import compose, engine
from astrai.host.checklist import FAIL, PASS, SKIP, WARN, Check
from astrai.host.hostuser import host_user_ids
from astrai.host.launch import mounts
from astrai.host.runtime import Runtime
from astrai.host.trainer_config import host_path

NAME = "rewards"
IMPORT_TIMEOUT_SECONDS = 120

_IMPORT_SCRIPT = """
import json, sys
from astrai.common.reward_specs import RewardSpec
from astrai.trainer.objectives.rewards import RewardError, load_reward
found = {}
for function in json.loads(sys.argv[1]):
    try:
        load_reward(RewardSpec(function))
        found[function] = None
    except RewardError as error:
        found[function] = str(error)
print(json.dumps(found))
"""


def reward_checks(runtime: Runtime, config: TrainerConfig, plan=None) -> list[Check]:
    """The rewards' lines of the checklist (none for a run that scores nothing): the functions', each reward model's
    and each remote judge's (``plan``: the run plan in the container, for a reward model's memory)."""
    used = config.rewards_in_use()
    lines = [model_check(runtime, spec, plan) for spec in used if isinstance(spec, ModelRewardSpec)]
    lines += [judge_check(spec) for spec in used if isinstance(spec, JudgeSpec)]
    specs = functions_of(used)
    return (_function_checks(runtime, specs) if specs else []) + lines


def _function_checks(runtime: Runtime, specs: tuple[RewardSpec, ...]) -> list[Check]:
    problems = [problem for spec in specs if (problem := file_problem(runtime, spec)) is not None]
    if problems:
        fix = "put the file in runtime.paths.data and name it /data/..."
        return [Check(FAIL, NAME, problem, fix) for problem in problems]
    image = compose.image_name(runtime)
    try:
        built = engine.image_labels(image) is not None
    except engine.EngineError as error:
        return [Check(SKIP, NAME, f"{len(specs)} function(s) not imported: {error}")]
    if not built:
        return [
            Check(
                SKIP,
                NAME,
                f"{_named(specs)}: in place; imported in image {image} once `invoke start` has built it, before the "
                "trainer starts",
            )
        ]
    failures = import_in_image(runtime, specs)
    if failures:
        fix = "fix the reward's file or module, then run preflight again"
        return [Check(FAIL, NAME, failure, fix) for failure in failures]
    return [Check(PASS, NAME, f"{_named(specs)}: imported in image {image} as the trainer imports them")]


def file_problem(runtime: Runtime, spec: RewardSpec) -> str | None:
    """What keeps the container from reading a reward file, or None (None too for a module)."""
    if not spec.is_file:
        return None
    where = f"training.rewards: {spec.function}"
    path = PurePosixPath(spec.source)
    if not path.is_absolute():
        return f"{where}: name the file by its path in the container (such as /data/{path.name}), not {path}"
    found = host_path(runtime, str(path))
    if found is None:
        mounted = ", ".join(f"runtime.paths.{m.key} at {m.target}" for m in mounts(runtime) if m.key != "config")
        return f"{where}: {path} is in no folder the container mounts ({mounted})"
    if not found.is_file():
        return f"{where}: no file {path} in the container: {found} does not exist on this host"
    try:
        compile(found.read_bytes(), str(path), "exec")
    except SyntaxError as error:
        return f"{where}: {path} line {error.lineno}: {error.msg}"
    except (OSError, ValueError) as error:
        return f"{where}: {found} cannot be read ({error})"
    return None


def import_in_image(runtime: Runtime, specs: tuple[RewardSpec, ...]) -> list[str]:
    """Each reward function imported in the job's (built) image, with the job's mounts read-only; the failures, one
    line each naming the function (an empty list: every one imports)."""
    uid, gid = host_user_ids()
    volumes = [arg for mount in mounts(runtime) for arg in ("--volume", f"{mount.source}:{mount.target}:ro")]
    functions = [spec.function for spec in specs]
    result = engine.docker(
        "run",
        "--rm",
        "--network",
        "none",
        "--user",
        f"{uid}:{gid}",
        "--entrypoint",
        "python3",
        *volumes,
        compose.image_name(runtime),
        "-c",
        _IMPORT_SCRIPT,
        json.dumps(functions),
        timeout=IMPORT_TIMEOUT_SECONDS,
    )
    lines = result.stdout.strip().splitlines()
    try:
        found = json.loads(lines[-1]) if result.returncode == 0 and lines else None
    except ValueError:
        found = None
    if not isinstance(found, dict):
        detail = (result.stderr.strip() or result.stdout.strip())[-400:]
        return [f"training.rewards: the image could not import them (exit {result.returncode}): {detail}"]
    return [f"training.rewards: {error}" for function, error in found.items() if error is not None]


def _named(specs) -> str:
    return ", ".join(f"{spec.name} ({spec.source})" for spec in specs)


def model_check(runtime: Runtime, spec: ModelRewardSpec, plan=None) -> Check:
    """A reward model's line: the folder in a mount, a sequence classifier of one label, and what it holds in memory
    on each device of the job (bfloat16 on a GPU, float32 on a CPU; sharded under FSDP)."""
    where = f"training.rewards: model {spec.model}"
    folder = host_path(runtime, spec.model)
    if folder is None:
        mounted = ", ".join(f"runtime.paths.{m.key} at {m.target}" for m in mounts(runtime) if m.key != "config")
        return Check(FAIL, NAME, f"{where} is in no folder the container mounts ({mounted})")
    model_type = folder_model_type(folder)
    if model_type is None:
        return Check(FAIL, NAME, f"{where}: {folder / MODEL_CONFIG_FILE} is missing or has no model_type")
    if resolve_backend("auto", model_type) == BACKEND_TRANSFORMERS:
        return Check(
            PASS, NAME, f"{where}: {model_type} classifier, scored through transformers (the image installs it)"
        )
    try:
        model = ModelConfig.load(folder)
    except ModelLoadError as error:
        return Check(FAIL, NAME, f"{where}: {error}")
    if model.num_labels != 1:
        what = "a causal language model" if model.num_labels is None else f"a classifier of {model.num_labels} labels"
        fix = "train one with train_type reward_model, or give an XForSequenceClassification folder of one label"
        return Check(FAIL, NAME, f"{where} is {what}, not a sequence classifier of one label", fix)
    parameters = num_parameters(model)
    gpu = plan is not None and plan.device_type == "cuda"
    share = plan.batch.world_size if plan is not None and plan.parallel_mode == "fsdp" else 1
    held = parameters * (2 if gpu else 4) // share
    per = f"on each of {share} ranks (FSDP)" if share > 1 else "on each process"
    dtype = "bfloat16" if gpu else "float32"
    return Check(
        PASS,
        NAME,
        f"{where}: {model_type} classifier of {parameters:,} parameters, {format_bytes(held)} {per} ({dtype})",
    )


def judge_check(spec: JudgeSpec) -> Check:
    """A remote judge's line: its key's variable set in this shell (the container gets it from here, by name), and an
    address a container can reach."""
    where = f"training.rewards: judge {spec.name} ({spec.url})"
    if spec.api_key_env is not None and not os.environ.get(spec.api_key_env):
        return Check(
            FAIL,
            NAME,
            f"{where}: its key's variable {spec.api_key_env} (api_key_env) is not set in this shell",
            f"export {spec.api_key_env}=... before invoke (the container gets it by name; it is never written down)",
        )
    host = urllib.parse.urlsplit(spec.url).hostname
    if host in ("localhost", "127.0.0.1", "::1"):
        return Check(
            WARN,
            NAME,
            f"{where}: {host} inside the container is the container itself; a judge on this host is at "
            f"{compose.DOCKER_HOST_NAME} (on a job of several nodes, at localhost)",
        )
    return Check(PASS, NAME, f"{where}: {spec.kind}, at most {spec.max_in_flight} requests at once")
