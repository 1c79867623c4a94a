"""Preflight's look at a job's episodes: its tools and template, and its server environments (``runtime.environments``,
``training.environment: {server: NAME}``).

- The tools (``training.tools``, the environment class's methods) load and have schemas, and the prompts' chat
  template renders them and writes calls in a format the episodes read: the trainer's own check
  (:func:`astrai.trainer.objectives.agents.episodes.describe_agent`), run in the job's built image with its mounts
  read-only and no network, as the trainer will run. Before `invoke start` has built the image the line says so, and
  `invoke start` checks it after its build, before the trainer starts.

- The server ``training.environment`` names is one of ``runtime.environments``.
- Each server's image is there: its Dockerfile folder builds, through Compose as `invoke start` builds it (the same
  image, so a start after preflight reuses it and leaves no untagged copy behind), or its image is on the engine.
- It answers ``reset``: the server runs in a throwaway container on a throwaway internal network (no route out),
  hardened as the job runs it, and the job's trainer image asks it for a reset through OpenEnv's own client, as the
  trainer will. That needs the trainer image; before `invoke start` has built it the line says so, and `invoke
  start` asks again after its build, before the trainer starts.
"""

from __future__ import annotations

import json
import secrets
import subprocess

from astrai.common.config import TrainerConfig
from astrai.common.contract import trainer_arguments
from astrai.host import compose, engine, launch
from astrai.host.checklist import FAIL, PASS, SKIP, Check
from astrai.host.hostuser import host_user_ids
from astrai.host.runtime import EnvironmentServer, Runtime

NAME = "environments"
BUILD_TIMEOUT_SECONDS = 900
ANSWER_TIMEOUT_SECONDS = 180

_RESET_SCRIPT = """
import json, sys, time
from openenv.core.generic_client import GenericEnvClient
url, deadline, last = sys.argv[1], time.monotonic() + float(sys.argv[2]), None
while time.monotonic() < deadline:
    try:
        with GenericEnvClient(base_url=url, connect_timeout_s=5, message_timeout_s=30).sync() as client:
            result = client.reset(seed=0)
        print(json.dumps({"observation": result.observation, "done": result.done}, default=str)[:300])
        sys.exit(0)
    except Exception as error:
        last = f"{type(error).__name__}: {error}"
        time.sleep(1)
print(f"no answer to reset: {last}", file=sys.stderr)
sys.exit(1)
"""


_AGENT_SCRIPT = """
import json, sys
from astrai.common.config import parse_args
from astrai.common.errors import AstraiError
from astrai.trainer.objectives.agents.episodes import describe_agent
try:
    print(json.dumps({"found": describe_agent(parse_args(json.loads(sys.argv[1]))[0])}))
except (AstraiError, ValueError) as error:
    print(json.dumps({"problem": str(error)}))
"""
AGENTS = "tools"


def agent_checks(
    runtime: Runtime, config: TrainerConfig | None, trainer_args: list[str] | tuple[str, ...]
) -> list[Check]:
    """The episodes' line: the tools and environment class load, and the prompts' chat template renders the tools
    and writes calls in a format the episodes read, checked in the job's (built) image as the trainer will."""
    if config is None or not config.training.kind.online or config.training.episodes() is None:
        return []
    image = compose.image_name(runtime)
    if engine.image_labels(image) is None:
        return [
            Check(SKIP, AGENTS, f"checked in image {image} once `invoke start` has built it, before the trainer starts")
        ]
    problem, found = agent_problem(runtime, trainer_args)
    if problem is not None:
        return [
            Check(
                FAIL, AGENTS, problem, "fix the tools, the environment or the prompts' chat template (docs/agents.md)"
            )
        ]
    return [Check(PASS, AGENTS, found)]


def agent_problem(runtime: Runtime, trainer_args: list[str] | tuple[str, ...]) -> tuple[str | None, str]:
    """(why the episodes cannot run, or None; what they run with), from the trainer's own check in the job's image,
    with the job's mounts read-only and no network."""
    uid, gid = host_user_ids()
    volumes = [arg for mount in launch.mounts(runtime) for arg in ("--volume", f"{mount.source}:{mount.target}:ro")]
    mode = runtime.parallel_mode if runtime.processes is not None else None
    arguments = trainer_arguments(runtime.job_name, mode, list(trainer_args))
    result = engine.docker(
        "run", "--rm", "--network", "none", "--user", f"{uid}:{gid}", "--entrypoint", "python3", *volumes,
        compose.image_name(runtime), "-c", _AGENT_SCRIPT, json.dumps(arguments), timeout=ANSWER_TIMEOUT_SECONDS,
    )  # fmt: skip
    try:
        answer = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        detail = (result.stderr.strip() or result.stdout.strip())[-400:]
        return f"the image could not check the episodes (exit {result.returncode}): {detail}", ""
    return answer.get("problem"), answer.get("found", "")


def environment_checks(runtime: Runtime, config: TrainerConfig | None, *, answer: bool = True) -> list[Check]:
    """The environments' lines of the checklist (none for a job without server environments); ``answer``: ask each
    for a reset when the trainer image is built."""
    servers = {server.name: server for server in runtime.environments}
    spec = config.training.environment if config is not None and config.training.kind.online else None
    if spec is not None and spec.server is not None and spec.server not in servers:
        named = ", ".join(servers) or "none"
        return [
            Check(
                FAIL,
                NAME,
                f"training.environment {{server: {spec.server}}}: runtime.environments has no {spec.server} "
                f"(it has {named})",
                f"add runtime.environments.{spec.server}: {{build: DIR, port: N}} (or image:), or name one of those",
            )
        ]
    checks = []
    for server in runtime.environments:
        problem = image_problem(runtime, server)
        if problem is not None:
            checks.append(Check(FAIL, NAME, f"runtime.environments.{server.name}: {problem}", _fix(server)))
            continue
        checks.append(_answer_check(runtime, server) if answer else _built(server))
    return checks


def _compose_build(runtime: Runtime, server: EnvironmentServer) -> str | None:
    """Build the server's image as `invoke start` does (``docker compose build SERVICE`` on the job's files, the
    override rendered into a scratch folder); why it failed, or None."""
    try:
        with compose.scratch_override(runtime) as override:
            command = compose.compose_command(runtime, "build", launch.environment_service(server), override=override)
            result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_SECONDS)
    except compose.ComposeError as error:
        return f"build: not tried: {error}"
    except subprocess.TimeoutExpired:
        return f"build: {server.build} did not build within {BUILD_TIMEOUT_SECONDS} s"
    if result.returncode != 0:
        return f"build: {server.build} does not build: {(result.stderr.strip() or result.stdout.strip())[-400:]}"
    return None


def _built(server: EnvironmentServer) -> Check:
    return Check(PASS, NAME, f"{server.name}: its image is there")


def _fix(server: EnvironmentServer) -> str:
    if server.build is not None:
        return f"fix the Dockerfile in {server.build}, then run preflight again"
    return f"build or pull {server.image} on this host"


def image_tag(runtime: Runtime, server: EnvironmentServer) -> str:
    """The image a server runs: its own, or the one built from its folder (the tag Compose gives it)."""
    if server.image is not None:
        return server.image
    return compose.built_environment_image(runtime, server)


def image_problem(runtime: Runtime, server: EnvironmentServer) -> str | None:
    """Why the server has no image to run (a folder without a Dockerfile, a build that fails, an image that is not on
    the engine), or None; a folder's image is built here, as Compose builds it."""
    if server.build is not None:
        if not (server.build / "Dockerfile").is_file():
            return f"build: {server.build} holds no Dockerfile"
        return _compose_build(runtime, server)
    if engine.image_labels(server.image) is None:
        return f"image: {server.image} is not on this engine"
    return None


def _answer_check(runtime: Runtime, server: EnvironmentServer) -> Check:
    trainer_image = compose.image_name(runtime)
    if engine.image_labels(trainer_image) is None:
        return Check(
            SKIP,
            NAME,
            f"{server.name}: its image is there; asked for a reset once `invoke start` has built the trainer image "
            f"{trainer_image}, before the trainer starts",
        )
    problem = answer_problem(runtime, server)
    if problem is not None:
        return Check(FAIL, NAME, f"{server.name}: {problem}", "see the server's own output above; fix it, then retry")
    return Check(PASS, NAME, f"{server.name}: built, and answers reset through OpenEnv's client (port {server.port})")


def answer_problem(runtime: Runtime, server: EnvironmentServer) -> str | None:
    """Why the server does not answer a reset from the trainer image, or None: both in throwaway containers on a
    throwaway internal network, the server hardened as the job runs it."""
    uid, gid = host_user_ids()
    tag = secrets.token_hex(4)
    network, alias = f"astrai-check-{tag}", launch.environment_service(server)
    if engine.docker("network", "create", "--internal", network).returncode != 0:
        return f"cannot create a network to try it on ({network})"
    started = None
    try:
        result = engine.docker(
            "run", "--detach", "--rm", "--network", network, "--network-alias", alias,
            "--cap-drop", "ALL", "--security-opt", "no-new-privileges:true", "--read-only",
            "--tmpfs", "/tmp:mode=1777", "--user", f"{uid}:{gid}", "--label", f"ai.astrai.check={tag}",
            image_tag(runtime, server),
        )  # fmt: skip
        if result.returncode != 0:
            return f"does not start: {result.stderr.strip()[-400:]}"
        started = result.stdout.strip()
        url = f"http://{alias}:{server.port}"
        asked = engine.docker(
            "run", "--rm", "--network", network, "--user", f"{uid}:{gid}", "--entrypoint", "python3",
            compose.image_name(runtime), "-c", _RESET_SCRIPT, url, str(ANSWER_TIMEOUT_SECONDS - 30),
            timeout=ANSWER_TIMEOUT_SECONDS,
        )  # fmt: skip
        if asked.returncode != 0:
            logs = engine.docker("logs", "--tail", "20", started).stderr.strip()[-400:]
            return f"does not answer reset at {url}: {asked.stderr.strip()[-300:]} (its output: {logs or 'none'})"
        json.loads(asked.stdout.strip().splitlines()[-1])
        return None
    except (ValueError, IndexError):
        return "answered reset with something that is not OpenEnv's observation"
    finally:
        if started is not None:
            engine.docker("rm", "--force", started)
        engine.docker("network", "rm", network)
