"""Read-only questions to the Docker engine: is it there, and what is this job's container doing.

Containers are found by the labels Compose puts on them (project and
service), so these probes need neither the Compose files nor the YAML.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from datetime import datetime, timezone

from astrai.common.errors import AstraiError
from astrai.host.compose import SERVICE

PROBE_TIMEOUT_SECONDS = 60


class EngineError(AstraiError):
    """The docker CLI is missing or the daemon did not answer."""


@dataclass(frozen=True)
class Container:
    """The state of one trainer container, from `docker inspect`."""

    id: str
    name: str
    status: str
    """Docker's word: created, running, paused, restarting, removing, exited or dead."""
    exit_code: int
    started_at: str
    finished_at: str
    restart_count: int = 0
    """How many times Docker restarted it after a crash (runtime.container.max_restarts)."""
    created_at: str = ""

    @property
    def running(self) -> bool:
        return self.status in ("running", "restarting", "paused")

    def started(self) -> datetime | None:
        return parse_time(self.started_at)

    def finished(self) -> datetime | None:
        return parse_time(self.finished_at)


def docker(
    *args: str, timeout: float | None = PROBE_TIMEOUT_SECONDS, detached: bool = False
) -> subprocess.CompletedProcess:
    """Run one docker CLI command and capture its output (never raises on a non-zero exit).

    ``detached`` runs it in a session of its own, so a Ctrl-C at the terminal cannot cut it short
    (a graceful stop must run to its end).
    """
    if shutil.which("docker") is None:
        raise EngineError(
            "the docker CLI was not found on PATH; install Docker Engine (package docker.io or docker-ce)"
        )
    try:
        return subprocess.run(
            ["docker", *args], capture_output=True, text=True, timeout=timeout, start_new_session=detached
        )
    except subprocess.TimeoutExpired:
        raise EngineError(f"`docker {' '.join(args)}` did not answer within {timeout} s") from None


def daemon_up() -> bool:
    """Whether the engine answers at all."""
    try:
        daemon_version()
    except EngineError:
        return False
    return True


def stop_container(container_id: str, timeout_seconds: int) -> subprocess.CompletedProcess:
    """The graceful stop `invoke stop`, Ctrl-C and the max-duration timer share: SIGTERM, SIGKILL after the grace."""
    return docker("stop", "--time", str(timeout_seconds), container_id, timeout=timeout_seconds + 120, detached=True)


def remove_container(container_id: str) -> None:
    """Remove a container that never ran (created, not started); a missing one is fine."""
    docker("rm", "--force", container_id, detached=True)


def wait_for_exit(container_id: str, timeout: float | None = None) -> Container:
    """Block until the container exits (at most ``timeout`` seconds); return its final state."""
    result = docker("wait", container_id, timeout=timeout)
    final = inspect_container(container_id)
    if final is None:
        raise EngineError(f"container {container_id[:12]} disappeared")
    if result.returncode != 0 and final.running:
        raise EngineError(f"cannot wait for container {container_id[:12]}: {result.stderr.strip()}")
    return final


def daemon_version() -> str:
    """The engine's version; EngineError with Docker's own words when it is unreachable."""
    result = docker("version", "--format", "{{.Server.Version}}")
    version = result.stdout.strip()
    if result.returncode != 0 or not version:
        detail = (result.stderr.strip().splitlines() or ["no answer"])[-1]
        raise EngineError(f"the Docker daemon is not reachable: {detail}")
    return version


def find_container(project: str) -> Container | None:
    """The newest trainer container of a Compose project, running or not."""
    listing = docker(
        "ps",
        "--all",
        "--quiet",
        "--no-trunc",
        "--filter",
        f"label=com.docker.compose.project={project}",
        "--filter",
        f"label=com.docker.compose.service={SERVICE}",
    )
    if listing.returncode != 0:
        raise EngineError(f"cannot list containers: {listing.stderr.strip()}")
    ids = listing.stdout.split()
    if not ids:
        return None
    containers = [c for c in (inspect_container(i) for i in ids) if c is not None]
    return max(containers, key=lambda c: c.started_at, default=None)


def inspect_container(container_id: str) -> Container | None:
    """State of a container by id, or None when it no longer exists."""
    result = docker("inspect", "--type", "container", container_id)
    if result.returncode != 0:
        return None
    (info,) = json.loads(result.stdout)
    state = info["State"]
    return Container(
        id=info["Id"],
        name=info["Name"].lstrip("/"),
        status=state["Status"],
        exit_code=int(state["ExitCode"]),
        started_at=state["StartedAt"],
        finished_at=state["FinishedAt"],
        restart_count=int(info.get("RestartCount", 0)),
        created_at=info.get("Created", ""),
    )


def crash_exit_codes(container: Container) -> list[int]:
    """The non-zero exit codes of a container's runs so far, oldest first (from the engine's event log).

    Docker keeps only the newest exit code in the container's state, and a restart resets it to 0.
    """
    result = docker(
        "events",
        "--since",
        container.created_at or "0",
        "--until",
        datetime.now(timezone.utc).isoformat(),
        "--filter",
        f"container={container.id}",
        "--filter",
        "event=die",
        "--format",
        "{{json .}}",
    )
    if result.returncode != 0:
        raise EngineError(f"cannot read the engine's events: {result.stderr.strip()}")
    codes = []
    for line in result.stdout.splitlines():
        try:
            code = int(json.loads(line)["Actor"]["Attributes"]["exitCode"])
        except (ValueError, KeyError, TypeError):
            continue
        if code != 0:
            codes.append(code)
    return codes


def image_labels(image: str) -> dict[str, str] | None:
    """The labels of a local image, or None when there is no image of that name."""
    result = docker("image", "inspect", "--format", "{{json .Config.Labels}}", image)
    if result.returncode != 0:
        return None
    return json.loads(result.stdout or "null") or {}


def parse_time(text: str) -> datetime | None:
    """Docker's RFC 3339 times carry nanoseconds; Python takes microseconds."""
    if not text or text.startswith("0001-"):
        return None
    head, _, rest = text.partition(".")
    zone = "+00:00"
    if rest:
        digits = "".join(ch for ch in rest if ch.isdigit())
        zone = rest[len(digits) :] or zone
        head = f"{head}.{digits[:6]}"
    zone = "+00:00" if zone == "Z" else zone
    try:
        return datetime.fromisoformat(head + zone).astimezone(timezone.utc)
    except ValueError:
        return None
