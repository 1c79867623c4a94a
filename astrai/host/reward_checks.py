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
from pathlib import PurePosixPath

from astrai.common.config import TrainerConfig
from astrai.common.reward_specs import RewardSpec
from astrai.host import compose, engine
from astrai.host.checklist import FAIL, PASS, SKIP, Check
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


def reward_checks(runtime: Runtime, config: TrainerConfig) -> list[Check]:
    """The rewards' lines of the checklist (none for a train type that takes no reward functions)."""
    specs = config.training.rewards
    if not config.training.kind.online or not specs:
        return []
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
