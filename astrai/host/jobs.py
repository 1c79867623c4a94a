"""The job lifecycle on the host: init, build, start, stop, logs, status, latest, list, clean.

Plain functions behind the Invoke tasks; expected failures raise ``JobError``
with a message that says what to do, and the task turns it into an exit code.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from astrai.common.checkpoints import (
    Checkpoint,
    list_complete_checkpoints,
    plan_retention,
    read_meta,
    remove_checkpoint,
    remove_job_entry,
    scan_job_dir,
)
from astrai.common.configfile import ConfigError
from astrai.common.contract import (
    METRIC_ETA_S,
    METRIC_LOSS,
    METRIC_MAX_ALLOCATED_GIB,
    METRIC_MAX_STEPS,
    METRIC_MFU,
    METRIC_STEP,
    METRIC_TIME,
    METRIC_TOKENS_PER_S,
    METRIC_VAL_LOSS,
    METRICS_FILE,
    REASON_EMERGENCY,
)
from astrai.common.metrics import read_records, sparkline
from astrai.host import compose, engine, preflight, timer
from astrai.host.hostuser import make_dirs
from astrai.host.runtime import PATH_KEYS, Runtime, path_problems

START_LOCK_NAME = "start.node{node}.lock"
"""In the job's state folder: held by the one `invoke start` of that node running at a time."""


class JobError(Exception):
    """An expected failure of a lifecycle command; ``code`` is the exit code."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def _say(message: str = "") -> None:
    print(message, flush=True)


# --- init, preflight, build ---------------------------------------------------------------


def check_paths(runtime: Runtime, keys=PATH_KEYS, *, need: str = "read") -> None:
    """Refuse broken ``runtime.paths`` (a file where a folder belongs, a dangling symlink, no permission).

    Every command runs this before it touches a path, so a broken one ends in a message naming its key,
    not a traceback, and with nothing changed on disk.
    """
    problems = path_problems(runtime, keys, need=need)
    if problems:
        raise ConfigError(problems)


def init_job(runtime: Runtime) -> list[Path]:
    """Create the declared runtime folders and the job dir; return the ones that were new."""
    check_paths(runtime, need="create")
    created = []
    for path in (runtime.data_dir, runtime.model_dir, runtime.checkpoints_dir, runtime.job_dir):
        try:
            created += make_dirs(path)
        except OSError as error:
            raise JobError(f"cannot create {error.filename}: {error.strerror}") from None
    return created


def run_preflight(runtime: Runtime, document: dict, trainer_args: list[str] = ()) -> None:
    checks = preflight.run_checks(runtime, document, list(trainer_args))
    _say(preflight.format_checklist(checks))
    if any(check.failed for check in checks):
        raise JobError(f"fix the ✗ lines above, then run `{runtime.command('preflight')}` again")


def build_image(runtime: Runtime) -> None:
    check_paths(runtime, ("checkpoints",), need="create")
    compose.write_override(runtime)
    _run_compose(runtime, "build", compose.SERVICE, what="building the trainer image")


# --- start, stop, restart ---------------------------------------------------------------------


def check_trainer_config(runtime: Runtime, trainer_args: list[str]) -> None:
    """Refuse (exit 2) what the trainer would refuse in train.yaml or the arguments after ``--``."""
    trainer = preflight.trainer_config_check(runtime, trainer_args)
    if trainer.failed:
        raise JobError(f"{trainer.detail}\n  → {trainer.hint}", code=2)


def start_job(runtime: Runtime, document: dict, trainer_args: list[str], *, foreground: bool) -> int:
    """Preflight, build, then start (or resume) the job; returns the exit code for the task."""
    check_trainer_config(runtime, trainer_args)  # bad input: refused before anything is created
    check_paths(runtime, ("checkpoints",), need="create")
    with start_lock(runtime):
        container = _start_container(runtime, document, trainer_args)
    if not foreground:
        _say(f"follow it: {runtime.command('logs')}    stop it: {runtime.command('stop')}")
        return 0
    return _follow_until_exit(runtime, container)


@contextlib.contextmanager
def start_lock(runtime: Runtime):
    """Hold the start lock of this job and node while a start runs; a second start refuses at once.

    An flock on a file in the job's state folder: the kernel drops it when the
    holder exits, however it exits, so a crashed start never blocks the next one.
    """
    path = compose.state_dir(runtime) / START_LOCK_NAME.format(node=runtime.node)
    try:
        make_dirs(path.parent)
        handle = open(path, "a")
    except OSError as error:
        raise JobError(
            f"cannot create the start lock {path}: {error.strerror}; check runtime.paths.checkpoints "
            f"in {runtime.config_path}"
        ) from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise JobError(
                f"another `invoke start` of job {runtime.job_name} is in progress (it holds {path}); "
                f"wait for it, then see `{runtime.command('status')}`"
            ) from None
        yield


def _start_container(runtime: Runtime, document: dict, trainer_args: list[str]) -> engine.Container:
    running = job_container(runtime) if _daemon_up() else None
    if running is not None and running.running:
        raise JobError(
            f"job {runtime.job_name} is already running (container {running.name}); "
            f"follow it with `{runtime.command('logs')}` or stop it with `{runtime.command('stop')}`"
        )
    run_preflight(runtime, document, trainer_args)
    for name in passthrough_unset(runtime):
        _say(
            f"note: runtime.environment.{name} is passed through from your shell, but {name} is not set here; "
            "the container will not have it"
        )
    compose.write_override(runtime, trainer_args)
    _say("building the trainer image (`invoke build` shows the build output)")
    _run_compose(runtime, "build", compose.SERVICE, what="building the trainer image", quiet=True)
    timer.cancel(compose.state_dir(runtime))
    # A fresh container per run: its id and start time tell this run apart from later ones.
    _run_compose(
        runtime,
        "up",
        "--detach",
        "--no-build",
        "--force-recreate",
        compose.SERVICE,
        what="starting the container",
        quiet=True,
    )
    container = job_container(runtime)
    if container is None:
        raise JobError(f"the container of job {runtime.job_name} did not appear; see `{runtime.command('logs')}`")
    latest = list_complete_checkpoints(runtime.job_dir)
    origin = f"resuming from {latest[-1].path}" if latest else f"starting from the base model {runtime.model_dir}"
    if runtime.node != 0:
        origin = f"node {runtime.node} of {runtime.nodes}, meeting the others at {runtime.rendezvous}"
    elif runtime.multi_node:
        origin += f"; node 0 of {runtime.nodes}: start the other nodes with `invoke start --node N`"
    _say(f"started job {runtime.job_name} (container {container.name}), {origin}")
    if runtime.max_duration_hours:
        state = timer.schedule(
            compose.state_dir(runtime),
            hours=runtime.max_duration_hours,
            container=container,
            stop_timeout_seconds=runtime.stop_timeout_seconds,
            job_name=runtime.job_name,
        )
        _say(f"max duration {runtime.max_duration_hours} h: a timer stops it gracefully at {_clock(state.deadline)}")
    return container


def passthrough_unset(runtime: Runtime) -> list[str]:
    """Variables ``runtime.environment`` passes through (value null) that the invoking shell does not set."""
    return [name for name, value in runtime.environment.items() if value is None and name not in os.environ]


def _follow_until_exit(runtime: Runtime, container: engine.Container) -> int:
    """Stream the logs until the container exits; Ctrl-C stops the job gracefully."""
    try:
        subprocess.run(compose.compose_command(runtime, "logs", "--follow", "--no-log-prefix", compose.SERVICE))
    except KeyboardInterrupt:
        _say("\nCtrl-C: stopping the job gracefully (the trainer writes an emergency checkpoint)")
        stop_job(runtime)
    final = wait_for_exit(container.id)
    if final.exit_code != 0:
        _say(f"the trainer exited with code {final.exit_code}")
    return final.exit_code


def stop_job(runtime: Runtime) -> None:
    """Graceful stop: SIGTERM, `stop_timeout_seconds` of grace, then report the emergency checkpoint."""
    check_paths(runtime, ("checkpoints",))
    cancelled = timer.cancel(compose.state_dir(runtime))
    container = job_container(runtime)
    if container is None or not container.running:
        extra = " (its max-duration timer was cancelled)" if cancelled else ""
        _say(f"job {runtime.job_name} is not running; nothing to stop{extra}")
        return
    _say(
        f"stopping job {runtime.job_name}: SIGTERM, up to {runtime.stop_timeout_seconds} s for the emergency checkpoint"
    )
    started = time.monotonic()
    result = timer.stop_container(container.id, runtime.stop_timeout_seconds)
    if result.returncode != 0:
        raise JobError(f"docker stop failed: {result.stderr.strip()}")
    final = engine.inspect_container(container.id) or container
    seconds = time.monotonic() - started
    emergency = _emergency_checkpoint_since(runtime, container)
    if final.exit_code == 0 and emergency is not None:
        _say(f"stopped in {seconds:.1f} s; emergency checkpoint {emergency.path} (step {emergency.step})")
        return
    latest = list_complete_checkpoints(runtime.job_dir)
    where = latest[-1].path if latest else "none"
    if final.exit_code == 0 and runtime.node != 0:
        _say(
            f"stopped in {seconds:.1f} s; every node stops at the same step and node 0 writes the emergency "
            "checkpoint of the whole job"
        )
        return
    if final.exit_code == 0:
        _say(f"stopped in {seconds:.1f} s (the trainer had no step to save); newest checkpoint: {where}")
        return
    if final.exit_code == 128 + 15 and not _progress_since(runtime, container):
        # SIGTERM arrived in the first instant of the container, before the entrypoint could hold it.
        _say(
            f"stopped in {seconds:.1f} s while the trainer was still starting (no step taken, nothing lost); "
            f"newest checkpoint: {where}"
        )
        return
    killed = (
        " (killed: it did not finish within runtime.container.stop_timeout_seconds)" if final.exit_code == 137 else ""
    )
    raise JobError(
        f"the trainer exited with code {final.exit_code} after {seconds:.1f} s{killed}; "
        f"newest complete checkpoint: {where}"
    )


def _emergency_checkpoint_since(runtime: Runtime, container: engine.Container) -> Checkpoint | None:
    started = container.started()
    for checkpoint in reversed(list_complete_checkpoints(runtime.job_dir)):
        try:
            meta = read_meta(checkpoint)
        except (OSError, ValueError):
            continue
        written = datetime.fromtimestamp(checkpoint.path.stat().st_mtime, timezone.utc)
        if meta.get("reason") == REASON_EMERGENCY and (started is None or written >= started):
            return checkpoint
        break
    return None


def _progress_since(runtime: Runtime, container: engine.Container) -> bool:
    """True when the trainer reported progress during this container run."""
    entry = last_progress(runtime.job_dir)
    started = container.started()
    return entry is not None and (started is None or entry.get("time", 0) >= started.timestamp())


def wait_for_exit(container_id: str, timeout: float | None = None) -> engine.Container:
    """Block until the container exits (at most ``timeout`` seconds); return its final state."""
    try:
        subprocess.run(["docker", "wait", container_id], capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise JobError(f"container {container_id[:12]} still runs after {timeout:.0f} s") from None
    final = engine.inspect_container(container_id)
    if final is None:
        raise JobError(f"container {container_id[:12]} disappeared")
    return final


# --- logs, status, latest, list -----------------------------------------------------------------


def show_logs(runtime: Runtime, tail: str, follow: bool) -> None:
    check_paths(runtime, ("checkpoints",))
    if job_container(runtime) is None:
        raise JobError(f"job {runtime.job_name} has no container yet; start it with `{runtime.command('start')}`")
    if not compose.override_path(runtime).exists():
        compose.write_override(runtime)
    args = ["logs", "--no-log-prefix", "--tail", tail] + (["--follow"] if follow else [])
    try:
        subprocess.run(compose.compose_command(runtime, *args, compose.SERVICE))
    except KeyboardInterrupt:
        pass


def status_lines(runtime: Runtime) -> list[str]:
    """What `invoke status` prints: container state, progress, latest checkpoint, timer."""
    check_paths(runtime, ("checkpoints",))
    lines = [f"job         {runtime.job_name}  ({runtime.config_path})", f"node        {_placement(runtime)}"]
    running = False
    container = None
    try:
        container = job_container(runtime)
        if container is None:
            state = "not started"
        elif container.running:
            running = True
            state = f"{container.status} for {_age(container.started())} ({container.name})"
        else:
            state = f"{container.status} (exit code {container.exit_code}) {_age(container.finished())} ago"
    except engine.EngineError as error:
        state = f"unknown: {error}"
    lines.append(f"container   {state}")
    lines.append(f"image       {preflight.image_torch(runtime)[1]}")
    if runtime.max_restarts or (container is not None and container.restart_count):
        lines.append(f"restarts    {_restarts(container, runtime.max_restarts)}")
    records = read_records(runtime.job_dir / METRICS_FILE)
    lines.append(f"progress    {_progress(records, running)}")
    loss = _loss_summary(records)
    if loss:
        lines.append(f"loss        {loss}")
    complete = list_complete_checkpoints(runtime.job_dir)
    if complete:
        lines.append(f"latest      {complete[-1].path} ({_reason(complete[-1])}; {len(complete)} complete)")
    else:
        lines.append("latest      no complete checkpoint")
    state_timer = timer.read_timer(compose.state_dir(runtime))
    if state_timer is None:
        lines.append("timer       none")
    else:
        left = timer.seconds_left(state_timer)
        lines.append(f"timer       graceful stop in {_duration(left)} (at {_clock(state_timer.deadline)})")
    return lines


def _placement(runtime: Runtime) -> str:
    """Which node this host is, and the job's world size."""
    if runtime.world_size is not None:
        world = f"world size {runtime.world_size} ({runtime.processes} process(es) on each of {runtime.nodes} node(s))"
    else:
        world = f"one process per GPU on each of {runtime.nodes} node(s)"
    where = f"; rendezvous {runtime.rendezvous} ({runtime.rdzv_backend})" if runtime.multi_node else ""
    return f"{runtime.node} of {runtime.nodes}, {world}{where}"


def _restarts(container: engine.Container | None, allowed: int) -> str:
    """Crash restarts so far, and the exit code of the last crash."""
    count = 0 if container is None else container.restart_count
    text = f"{count} of {allowed} allowed after a crash"
    try:
        crashes = engine.crash_exit_codes(container) if container is not None else []
    except engine.EngineError as error:
        return f"{text}; last crash unknown ({error})"
    return f"{text}; last crash: exit code {crashes[-1]}" if crashes else f"{text}; no crash"


def latest_path(runtime: Runtime) -> Path:
    check_paths(runtime, ("checkpoints",))
    complete = list_complete_checkpoints(runtime.job_dir)
    if not complete:
        raise JobError(f"no complete checkpoint in {runtime.job_dir}")
    return complete[-1].path


def list_paths(runtime: Runtime) -> list[Path]:
    check_paths(runtime, ("checkpoints",))
    return [checkpoint.path for checkpoint in list_complete_checkpoints(runtime.job_dir)]


# --- clean --------------------------------------------------------------------------------------------


def clean_job(runtime: Runtime, keep: int | None, force: bool) -> None:
    """Preview (or with ``force`` delete) all but the ``keep`` newest complete checkpoints."""
    keep = runtime.checkpoint_keep_last if keep is None else keep
    if keep < 1:
        raise JobError(f"--keep must be at least 1 (the newest checkpoint is never removed), got {keep}", code=2)
    check_paths(runtime, ("checkpoints",), need="write" if force else "read")
    scan = scan_job_dir(runtime.job_dir)
    kept, removed = plan_retention(scan.complete, keep)
    verb = "removing" if force else "would remove"
    _say(f"job dir {runtime.job_dir}: {len(scan.complete)} complete checkpoint(s), keeping the {keep} newest")
    for checkpoint in kept:
        _say(f"  keep          {checkpoint.name}")
    for checkpoint in removed:
        _say(f"  {verb:<13} {checkpoint.name}")
    for checkpoint in scan.incomplete:
        _say(f"  incomplete    {checkpoint.name} (missing files; not touched)")
    for staging in scan.staging:
        _say(f"  stale staging {staging.name}")
    if not force:
        _say("preview only: nothing was deleted; run again with --force to delete")
        return
    for checkpoint in removed:
        remove_checkpoint(runtime.job_dir, checkpoint)
    staging_removed = 0
    if scan.staging and _trainer_may_run(runtime):
        _say("staging folders kept: a trainer may be writing them (stop the job first)")
    elif scan.staging:
        for staging in scan.staging:
            remove_job_entry(runtime.job_dir, staging)
        staging_removed = len(scan.staging)
    _say(f"deleted {len(removed)} checkpoint(s) and {staging_removed} staging folder(s)")


def _trainer_may_run(runtime: Runtime) -> bool:
    try:
        container = job_container(runtime)
    except engine.EngineError:
        return True  # cannot tell, so assume the worst
    return container is not None and container.running


# --- helpers --------------------------------------------------------------------------------------------


def job_container(runtime: Runtime) -> engine.Container | None:
    """The job's newest container, running or not (None before its first start)."""
    return engine.find_container(compose.job_project(runtime))


def _run_compose(runtime: Runtime, *args: str, what: str, quiet: bool = False) -> None:
    """Run one compose command; ``quiet`` keeps its output unless it fails."""
    command = compose.compose_command(runtime, *args)
    started = time.monotonic()
    if quiet:
        result = subprocess.run(command, capture_output=True, text=True)
    else:
        result = subprocess.run(command, stdout=sys.stdout, stderr=sys.stderr)
    if result.returncode != 0:
        if quiet:
            print((result.stdout + result.stderr)[-4000:], file=sys.stderr)
        raise JobError(f"{what} failed (exit {result.returncode}): {compose.format_command(command)}")
    if quiet:
        _say(f"{what}: done in {time.monotonic() - started:.1f} s")


def _daemon_up() -> bool:
    try:
        engine.daemon_version()
    except engine.EngineError:
        return False
    return True


def last_progress(job_dir: Path) -> dict | None:
    """The newest progress report of a job (a line of metrics.jsonl), or None."""
    last = _last_line(job_dir / METRICS_FILE)
    try:
        entry = json.loads(last) if last is not None else None
    except ValueError:
        return None
    return entry if isinstance(entry, dict) and METRIC_STEP in entry and METRIC_MAX_STEPS in entry else None


def _number(record: dict, key: str) -> bool:
    return isinstance(record.get(key), (int, float)) and not isinstance(record.get(key), bool)


def _progress(records: list[dict], running: bool) -> str:
    entry = records[-1] if records else None
    if entry is None or not isinstance(entry.get(METRIC_MAX_STEPS), int):
        return "no progress reported yet"
    step, max_steps = entry[METRIC_STEP], entry[METRIC_MAX_STEPS]
    parts = [f"step {step}/{max_steps} ({100.0 * step / max(max_steps, 1):.0f}%)"]
    if _number(entry, METRIC_LOSS):
        parts.append(f"loss {entry[METRIC_LOSS]:.4f}")
    if _number(entry, METRIC_TOKENS_PER_S) and running:
        parts.append(f"{entry[METRIC_TOKENS_PER_S]:.0f} tok/s")
        parts.append(f"mfu {entry[METRIC_MFU]:.1%}" if _number(entry, METRIC_MFU) else "mfu n/a")
    if _number(entry, METRIC_MAX_ALLOCATED_GIB):
        parts.append(f"peak mem {entry[METRIC_MAX_ALLOCATED_GIB]:.2f} GiB")
    if isinstance(entry.get(METRIC_ETA_S), (int, float)) and running and step < max_steps:
        parts.append(f"eta {_duration(entry[METRIC_ETA_S])}")
    if _number(entry, METRIC_TIME):
        parts.append(f"reported {_duration(time.time() - entry[METRIC_TIME])} ago")
    return ", ".join(parts)


def _loss_summary(records: list[dict]) -> str | None:
    """The latest loss, the curve so far as a sparkline, and the latest validation loss."""
    points = [(record[METRIC_STEP], record[METRIC_LOSS]) for record in records if _number(record, METRIC_LOSS)]
    if not points:
        return None
    losses = [loss for _, loss in points]
    text = f"{losses[-1]:.4f} {sparkline(losses)} (steps {points[0][0]}-{points[-1][0]}, min {min(losses):.4f})"
    validated = [(r[METRIC_STEP], r[METRIC_VAL_LOSS]) for r in records if _number(r, METRIC_VAL_LOSS)]
    if validated:
        text += f"; val_loss {validated[-1][1]:.4f} at step {validated[-1][0]}"
    return text


def _last_line(path: Path, chunk: int = 8192) -> str | None:
    """The last non-empty line of a file, read from its end (metrics files grow large)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - chunk))
            lines = [line for line in handle.read().splitlines() if line.strip()]
    except OSError:
        return None
    return lines[-1].decode("utf-8", errors="replace") if lines else None


def _reason(checkpoint: Checkpoint) -> str:
    try:
        return str(read_meta(checkpoint).get("reason", "unknown reason"))
    except (OSError, ValueError):
        return "unreadable meta.json"


def _duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def _age(moment: datetime | None) -> str:
    if moment is None:
        return "?"
    return _duration((datetime.now(timezone.utc) - moment).total_seconds())


def _clock(unix_time: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix_time))
