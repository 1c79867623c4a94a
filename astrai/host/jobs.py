"""The job lifecycle on the host: init, build, start, stop, logs, latest, list, clean.

Plain functions behind the Invoke tasks; expected failures raise ``JobError``
(or another :class:`~astrai.common.errors.AstraiError`) with a message that says
what to do, and the task turns it into an exit code. `invoke status` is
:mod:`astrai.host.status`.

Starting and stopping are safe to race. One `invoke start` of a job (and node)
runs at a time: it holds the job's start lock while it checks, builds and
starts. An `invoke stop` that comes meanwhile always wins: it records the
request, which the start checks just before it launches the container (and then
does not launch it), and waits for the lock, so a container the start did
launch is stopped right after. A Ctrl-C at any moment of a start leaves no
container behind, or stops the one that started gracefully, and says which.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

from astrai.common.checkpoints import (
    NotACheckpoint,
    emergency_since,
    plan_retention,
    remove_checkpoint,
    remove_job_entry,
    scan_job_dir,
)
from astrai.common.config import TrainerConfig
from astrai.common.configfile import ConfigError
from astrai.common.contract import METRIC_TIME, METRICS_FILE
from astrai.common.errors import AstraiError
from astrai.common.metrics import MetricsFile
from astrai.common.reward_specs import functions_of
from astrai.common.values import local_time
from astrai.host import compose, engine, launch, preflight, slurm, slurm_script, timer
from astrai.host.environment_checks import agent_problem, answer_problem
from astrai.host.hostuser import make_dirs
from astrai.host.reward_checks import import_in_image
from astrai.host.runtime import Runtime, check_paths
from astrai.host.trainer_config import fix_hint, read_trainer_config

START_LOCK_NAME = "start.node{node}.lock"
"""In the job's state folder: held by the one `invoke start` of that node running at a time (and by a stop
waiting for it)."""
STOP_REQUEST_NAME = "stop-requested.node{node}"
"""In the job's state folder: written by `invoke stop`; a start in progress that finds it newer than itself
does not launch the container."""
EXIT_INTERRUPTED = 130


class JobError(AstraiError):
    """An expected failure of a lifecycle command; ``code`` is the exit code."""


def _say(message: str = "") -> None:
    print(message, flush=True)


# --- init, preflight, build ---------------------------------------------------------------


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


def run_preflight(runtime: Runtime, trainer_args: list[str] = ()) -> None:
    checks = preflight.run_checks(runtime, list(trainer_args))
    _say(preflight.format_checklist(checks))
    if any(check.failed for check in checks):
        # A rejected config exits 2, as `start` does with it; any other failure 1.
        code = 2 if preflight.config_refused(checks) else 1
        raise JobError(f"fix the ✗ lines above, then run `{runtime.command('preflight')}` again", code=code)


def build_image(runtime: Runtime) -> None:
    check_paths(runtime, ("checkpoints",), need="create")
    compose.check_build_context()
    compose.write_override(runtime)
    _run_compose(runtime, "build", compose.SERVICE, what="building the trainer image")


def render(runtime: Runtime, trainer_args: list[str]) -> str:
    """The override `invoke render` prints, after the same checks of the trainer's config as `start`."""
    check_trainer_config(runtime, trainer_args)
    return compose.dump_override(runtime, compose.render_override(runtime, trainer_args))


def submit_job(runtime: Runtime, trainer_args: list[str], dry_run: bool) -> None:
    """`invoke submit`: the sbatch script of the job, checked, written under the job dir and submitted."""
    check_trainer_config(runtime, trainer_args)
    problems = slurm_script.config_problems(runtime)
    if problems:
        raise JobError("\nerror: ".join(problems), code=2)
    script = slurm_script.render_script(runtime, trainer_args)
    if dry_run:
        _say(script.rstrip("\n"))
        _say(f"# dry run: nothing was written or submitted; `{runtime.command('submit', per_node=False)}` submits it")
        return
    check_paths(runtime, ("checkpoints",), need="create")
    slurm.check_not_submitted(runtime)
    # What runs on this (login) host's engine and GPUs says nothing of the compute nodes: each node's task runs
    # the whole preflight there before it starts; here the Slurm checks stand for them.
    checks = preflight.run_checks(runtime, list(trainer_args), this_host=False) + slurm.submit_checks(runtime)
    _say(preflight.format_checklist(checks))
    if any(check.failed for check in checks):
        raise JobError(f"fix the ✗ lines above, then run `{runtime.command('submit', per_node=False)}` again")
    if runtime.slurm.launcher == "docker":
        compose.check_build_context()
    record, line = slurm.submit(runtime, trainer_args)
    _say(line)
    _say(
        f"script {record.script}; follow it: {runtime.command('logs', per_node=False)}    "
        f"stop it: {runtime.command('stop', per_node=False)}"
    )


def render_kubernetes(runtime: Runtime, trainer_args: list[str], trainjob: bool) -> str:
    """The manifests `invoke render --kubernetes` prints, after the same checks of the trainer's config as `start`."""
    from astrai.host import kubernetes

    check_trainer_config(runtime, trainer_args)
    return kubernetes.dump_manifests(runtime, kubernetes.render_manifests(runtime, trainer_args, trainjob=trainjob))


# --- start, stop, restart ---------------------------------------------------------------------


def check_trainer_config(runtime: Runtime, trainer_args: list[str]) -> TrainerConfig:
    """Refuse (exit 2) what the trainer would refuse in train.yaml or the arguments after ``--``; else the config."""
    try:
        return read_trainer_config(runtime, list(trainer_args))
    except ConfigError as error:
        raise JobError(f"{error}\n  → {fix_hint(error, runtime)}", code=2) from None


def check_startable(runtime: Runtime) -> None:
    """Refuse a start by hand of a job that Slurm queues or runs, or that leaves its rendezvous to a scheduler.

    The task Slurm runs on each node (``supervisor_pid`` set) is the start of the submitted job itself.
    """
    if runtime.supervisor_pid is None:
        submitted = slurm.active_job(runtime)
        if submitted is not None:
            raise JobError(
                f"job {runtime.job_name} is submitted to Slurm (job {submitted.job_id}, {submitted.state}); "
                f"a second trainer would write into the same job dir: stop it with "
                f"`{runtime.command('stop', per_node=False)}`, then `{runtime.command('submit', per_node=False)}`",
                code=2,
            )
    if runtime.multi_node and runtime.rendezvous is None:
        raise JobError(
            f"job {runtime.job_name} spans {runtime.node_count} nodes and has no runtime.nodes.rendezvous: its "
            f"scheduler gives one; submit it with `{runtime.command('submit', per_node=False)}`"
            ", or set runtime.nodes.rendezvous to start each node by hand",
            code=2,
        )


def start_job(runtime: Runtime, trainer_args: list[str], *, foreground: bool) -> int:
    """Preflight, build, then start (or resume) the job; returns the exit code for the task."""
    check_startable(runtime)
    check_trainer_config(runtime, trainer_args)  # bad input: refused before anything is created
    check_paths(runtime, ("checkpoints",), need="create")
    began = time.time()
    try:
        with start_lock(runtime):
            container = _start_container(runtime, trainer_args, began)
    except KeyboardInterrupt:
        _say(f"\nCtrl-C: {_undo_start(runtime, began)}")
        return EXIT_INTERRUPTED
    if not foreground:
        _say(f"follow it: {runtime.command('logs')}    stop it: {runtime.command('stop')}")
        return 0
    return _follow_until_exit(runtime, container)


@contextlib.contextmanager
def start_lock(runtime: Runtime, *, wait: bool = False):
    """Hold the start lock of this job and node; a second start refuses at once, a stop (``wait``) waits.

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
            if not wait:
                raise JobError(
                    f"another `invoke start` (or a stop) of job {runtime.job_name} is in progress (it holds {path}); "
                    f"wait for it, then see `{runtime.command('status')}`"
                ) from None
            _say(f"a start of job {runtime.job_name} is in progress: waiting for it to finish before stopping")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _check_rewards_in_image(runtime: Runtime, trainer_args: list[str]) -> None:
    """The reward functions imported in the image just built, before the trainer's container starts."""
    config = check_trainer_config(runtime, trainer_args)
    functions = functions_of(config.training.rewards if config.training.kind.online else ())
    functions += functions_of(config.log.eval_rewards or () if config.log.eval_prompts is not None else ())
    if not functions:
        return
    failures = import_in_image(runtime, tuple(dict.fromkeys(functions)))
    if failures:
        lines = "\n  ".join(failures)
        raise JobError(f"the reward functions do not import in the trainer image:\n  {lines}\nthe job was not started")


def _check_environments_answer(runtime: Runtime, trainer_args: list[str]) -> None:
    """The episodes' tools and template, and each server environment's answer to a reset, checked in the trainer
    image just built, before the trainer starts."""
    config = check_trainer_config(runtime, trainer_args)
    if config.training.kind.online and config.training.episodes() is not None:
        problem, _ = agent_problem(runtime, trainer_args)
        if problem is not None:
            raise JobError(f"the episodes cannot run: {problem}\nthe job was not started")
    failures = [
        f"runtime.environments.{server.name}: {problem}"
        for server in runtime.environments
        if (problem := answer_problem(runtime, server)) is not None
    ]
    if failures:
        lines = "\n  ".join(failures)
        raise JobError(f"a server environment does not answer:\n  {lines}\nthe job was not started")


def _stop_request(runtime: Runtime) -> Path:
    return compose.state_dir(runtime) / STOP_REQUEST_NAME.format(node=runtime.node)


def _stop_requested_since(runtime: Runtime, moment: float) -> bool:
    try:
        return _stop_request(runtime).stat().st_mtime >= moment
    except OSError:
        return False


def _start_container(runtime: Runtime, trainer_args: list[str], began: float) -> engine.Container:
    running = job_container(runtime) if engine.daemon_up() else None
    if running is not None and running.running:
        raise JobError(
            f"job {runtime.job_name} is already running (container {running.name}); "
            f"follow it with `{runtime.command('logs')}` or stop it with `{runtime.command('stop')}`"
        )
    run_preflight(runtime, trainer_args)
    for name in passthrough_unset(runtime):
        _say(
            f"note: runtime.environment.{name} is passed through from your shell, but {name} is not set here; "
            "the container will not have it"
        )
    compose.check_build_context()
    compose.write_override(runtime, trainer_args)
    _say("building the trainer image (`invoke build` shows the build output)")
    built = [launch.environment_service(server) for server in runtime.environments if server.build is not None]
    what = "building the trainer image" + (" and the environments' images" if built else "")
    _run_compose(runtime, "build", compose.SERVICE, *built, what=what, quiet=True)
    _check_rewards_in_image(runtime, trainer_args)
    _check_environments_answer(runtime, trainer_args)
    if _stop_requested_since(runtime, began):
        raise JobError(f"`{runtime.command('stop')}` was run while this start was in progress: the job was not started")
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
    scan = scan_job_dir(runtime.job_dir)
    origin = (
        f"resuming from {scan.complete[-1].path}"
        if scan.complete
        else f"starting from the base model {runtime.model_dir}"
    )
    if runtime.node != 0:
        origin = f"node {runtime.node} of {runtime.node_count}, meeting the others at {runtime.rendezvous}"
    elif runtime.multi_node and runtime.supervisor_pid is None:
        origin += f"; node 0 of {runtime.node_count}: start the other nodes with `invoke start --node N`"
    _say(f"started job {runtime.job_name} (container {container.name}), {origin}")
    if runtime.max_duration_hours:
        state = timer.schedule(
            compose.state_dir(runtime),
            hours=runtime.max_duration_hours,
            container=container,
            stop_timeout_seconds=runtime.stop_timeout_seconds,
            job_name=runtime.job_name,
        )
        _say(
            f"max duration {runtime.max_duration_hours} h: a timer stops it gracefully at {local_time(state.deadline)}"
        )
    return container


def _undo_start(runtime: Runtime, began: float) -> str:
    """After a Ctrl-C during a start: remove a container that did not run, stop one that did; say which."""
    with _ignoring_ctrl_c():
        try:
            container = job_container(runtime)
        except engine.EngineError as error:
            return f"interrupted; the engine does not answer ({error}), check `{runtime.command('status')}`"
        created = _created_at(container)
        if container is None or created is None or created.timestamp() < began - 1:
            return "interrupted before the container was created; nothing was started"
        if not container.running:
            engine.remove_container(container.id)
            timer.cancel(compose.state_dir(runtime))
            return "interrupted before the job started; its container was removed, nothing is running"
        _say("Ctrl-C: the container had started; stopping the job gracefully")
        stop_job(runtime)
        return "the job was started and is now stopped; `invoke start` resumes it"


def _created_at(container: engine.Container | None) -> datetime | None:
    return None if container is None else engine.parse_time(container.created_at)


@contextlib.contextmanager
def _ignoring_ctrl_c():
    """A graceful stop runs to its end: further Ctrl-C presses are ignored meanwhile."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def passthrough_unset(runtime: Runtime) -> list[str]:
    """Variables ``runtime.environment`` passes through (value null) that the invoking shell does not set."""
    return [name for name, value in runtime.environment.items() if value is None and name not in os.environ]


def _follow_until_exit(runtime: Runtime, container: engine.Container) -> int:
    """Stream the logs until the container exits; Ctrl-C stops the job gracefully."""
    command = compose.compose_command(runtime, "logs", "--follow", "--no-log-prefix", compose.SERVICE)
    try:
        if sys.stdout.isatty():
            subprocess.run(command)
        else:
            _copy_without_terminal_codes(command)
    except KeyboardInterrupt:
        why = "a stop signal" if runtime.supervisor_pid is not None else "Ctrl-C"
        _say(f"\n{why}: stopping the job gracefully (the trainer writes an emergency checkpoint)")
        with _ignoring_ctrl_c():
            stop_job(runtime)
    final = engine.wait_for_exit(container.id)
    _stop_environments(runtime)
    if final.exit_code != 0:
        _say(f"the trainer exited with code {final.exit_code}")
    return final.exit_code


TERMINAL_CODES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _copy_without_terminal_codes(command: list[str]) -> None:
    """Copy a command's output line by line, minus the colour and line-erase codes Compose writes anyway.

    Into a file (a Slurm job's output) they would only be noise.
    """
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        for line in process.stdout:
            sys.stdout.write(TERMINAL_CODES.sub("", line.decode("utf-8", "replace")))
            sys.stdout.flush()
        process.wait()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def stop_job(runtime: Runtime) -> None:
    """Graceful stop: SIGTERM, `stop_timeout_seconds` of grace, then report the emergency checkpoint.

    A start in progress loses: the stop is recorded first, then waits for the start's lock.
    A job submitted to Slurm that is still queued or running is stopped through Slurm.
    """
    check_paths(runtime, ("checkpoints",))
    if runtime.supervisor_pid is None:
        submitted = slurm.active_job(runtime)
        if submitted is not None:
            slurm.stop_submitted(runtime, submitted, _say)
            return
    request = _stop_request(runtime)
    try:
        make_dirs(request.parent)
        request.write_text(f"{time.time()}\n", encoding="utf-8")
    except OSError as error:
        raise JobError(f"cannot record the stop in {request}: {error.strerror}") from None
    with start_lock(runtime, wait=True):
        try:
            _stop_container(runtime)
        finally:
            _stop_environments(runtime)


def _stop_environments(runtime: Runtime) -> None:
    """The job's server environments stop with its trainer (they serve no one else)."""
    services = compose.environment_services(runtime)
    if not services or not compose.override_path(runtime).exists():
        return
    _run_compose(runtime, "stop", *services, what="stopping the environments", quiet=True)


def _stop_container(runtime: Runtime) -> None:
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
    result = engine.stop_container(container.id, runtime.stop_timeout_seconds)
    if result.returncode != 0:
        raise JobError(f"docker stop failed: {result.stderr.strip()}")
    final = engine.inspect_container(container.id) or container
    seconds = time.monotonic() - started
    started = container.started()
    emergency = emergency_since(runtime.job_dir, started.timestamp() if started is not None else None)
    if final.exit_code == 0 and emergency is not None:
        _say(f"stopped in {seconds:.1f} s; emergency checkpoint {emergency.path} (step {emergency.step})")
        return
    if final.exit_code == 128 + 9 and emergency is not None:
        # Killed at the timeout while exiting: the checkpoint was published whole before, so nothing is lost.
        _say(
            f"stopped in {seconds:.1f} s; emergency checkpoint {emergency.path} (step {emergency.step}); the trainer "
            "was killed while exiting after writing it, at runtime.container.stop_timeout_seconds "
            f"({runtime.stop_timeout_seconds} s): raise it if the checkpoint itself may need longer"
        )
        return
    latest = scan_job_dir(runtime.job_dir).complete
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
        f"the trainer exited with code {final.exit_code} after {seconds:.1f} s{killed}; newest checkpoint: {where}"
    )


def _progress_since(runtime: Runtime, container: engine.Container) -> bool:
    """True when the trainer reported progress during this container run."""
    entry = MetricsFile(runtime.job_dir / METRICS_FILE).latest()
    started = container.started()
    return entry is not None and (started is None or entry.get(METRIC_TIME, 0) >= started.timestamp())


# --- logs, latest, list -----------------------------------------------------------------------------


def show_logs(runtime: Runtime, tail: str, follow: bool) -> None:
    check_paths(runtime, ("checkpoints",))
    if slurm.follow_output(runtime, tail, follow):
        return  # a submitted job: its Slurm output holds every node's lines, allocation after allocation
    container = job_container(runtime)
    if container is None:
        raise JobError(f"job {runtime.job_name} has no container yet; start it with `{runtime.command('start')}`")
    if not compose.override_path(runtime).exists():
        compose.write_override(runtime)
    args = ["logs", "--no-log-prefix", "--tail", tail]
    # Following a container that has exited would wait for lines that never come: show what it wrote.
    args += ["--follow"] if follow and container.status in ("running", "restarting", "created") else []
    args += [] if sys.stdout.isatty() else ["--no-color"]  # a pipe or a file gets the lines, no terminal codes
    try:
        subprocess.run(compose.compose_command(runtime, *args, compose.SERVICE))
    except KeyboardInterrupt:
        pass


def latest_path(runtime: Runtime) -> Path:
    check_paths(runtime, ("checkpoints",))
    complete = scan_job_dir(runtime.job_dir).complete
    if not complete:
        raise JobError(f"no checkpoint in {runtime.job_dir}")
    return complete[-1].path


def list_checkpoints(runtime: Runtime) -> tuple[list[Path], list[NotACheckpoint]]:
    """Every checkpoint, oldest first, and apart from them the folders named like checkpoints that are not."""
    check_paths(runtime, ("checkpoints",))
    scan = scan_job_dir(runtime.job_dir)
    return [checkpoint.path for checkpoint in scan.complete], scan.damaged


# --- clean --------------------------------------------------------------------------------------------


def clean_job(runtime: Runtime, keep: int | None, force: bool, damaged: bool = False) -> None:
    """Preview (or with ``force`` delete) all but the ``keep`` newest checkpoints.

    Folders named like checkpoints that are not checkpoints never count toward ``keep``; they are listed
    apart and removed only with ``damaged``.
    """
    keep = runtime.checkpoint_keep_last if keep is None else keep
    if keep < 1:
        raise JobError(f"--keep must be at least 1 (the newest checkpoint is never removed), got {keep}", code=2)
    check_paths(runtime, ("checkpoints",), need="write" if force else "read")
    scan = scan_job_dir(runtime.job_dir)
    kept, removed = plan_retention(scan.complete, keep)
    verb = "removing" if force else "would remove"
    _say(f"job dir {runtime.job_dir}: {len(scan.complete)} checkpoint(s), keeping the {keep} newest")
    for checkpoint in kept:
        _say(f"  keep          {checkpoint.name}")
    for checkpoint in removed:
        _say(f"  {verb:<13} {checkpoint.name}")
    for folder in scan.damaged:
        fate = verb if damaged else "kept (--damaged removes it)"
        _say(f"  not a checkpoint: {folder.name} ({folder.reason}); {fate}")
    for staging in scan.staging:
        _say(f"  stale staging {staging.name}")
    if not force:
        _say("preview only: nothing was deleted; run again with --force to delete")
        return
    for checkpoint in removed:
        remove_checkpoint(runtime.job_dir, checkpoint)
    damaged_removed = 0
    if damaged:
        for folder in scan.damaged:
            remove_checkpoint(runtime.job_dir, folder)
        damaged_removed = len(scan.damaged)
    staging_removed = 0
    if scan.staging and _trainer_may_run(runtime):
        _say("staging folders kept: a trainer may be writing them (stop the job first)")
    elif scan.staging:
        for staging in scan.staging:
            remove_job_entry(runtime.job_dir, staging)
        staging_removed = len(scan.staging)
    _say(
        f"deleted {len(removed)} checkpoint(s), {damaged_removed} folder(s) that were not checkpoints "
        f"and {staging_removed} staging folder(s)"
    )


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
