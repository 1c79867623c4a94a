"""AstrAI training deployment: every command a user runs. `invoke --list` shows them.

Each task parses its arguments, calls one plain function from ``astrai/`` and
turns expected failures into a message and an exit code (never a traceback).
Arguments after ``--`` on `start`, `restart`, `submit` and `render` go to the trainer:

    invoke start --config train.yaml -- --max_steps 500 --max_lr 1e-3
"""

from __future__ import annotations

import contextlib
import sys

from invoke import Collection, Exit, task

CONFIG_HELP = "the job's YAML file (default: ./train.yaml)"
NODE_HELP = "which node of a multi-node job this host is (runtime.nodes; default 0)"
DEFAULT_CONFIG = "train.yaml"


@contextlib.contextmanager
def _user_errors():
    """Expected failures end as a message on stderr and their exit code, not a traceback.

    A reader that went away (`invoke status | head -5`) ends the command quietly.
    """
    from astrai.common.errors import AstraiError, detach_stdout

    try:
        yield
        sys.stdout.flush()
    except AstraiError as error:
        raise Exit(error.show(), code=error.exit_code) from None
    except BrokenPipeError:
        detach_stdout()
        raise Exit(code=1) from None


def _whole(option: str, value, minimum: int, maximum: int | None = None) -> int:
    """A whole-number option as typed: invoke would turn a bad one into a traceback, so it arrives as text."""
    from astrai.common.values import whole_number

    try:
        return whole_number(value, minimum, maximum)
    except ValueError as error:
        raise Exit(f"error: --{option} {error}", code=2) from None


def _load(config: str, node="0"):
    from astrai.host.runtime import load_job_config

    return load_job_config(config, _whole("node", node, 0))


def _trainer_args(c) -> list[str]:
    """The words after ``--`` exactly as the shell passed them.

    Invoke only keeps them joined into one string (``c.remainder``), which loses
    the quoting of ``-- --x "a b"``; it splits its argv at the first ``--``, so
    the same words are the ones after the first ``--`` of ``sys.argv``.
    """
    if not c.remainder:
        return []
    return sys.argv[sys.argv.index("--") + 1 :]


@task(help={"config": CONFIG_HELP, "node": NODE_HELP})
def init(c, config=DEFAULT_CONFIG, node="0"):
    """Create the runtime folders (data, model, checkpoints, job dir); never writes the YAML."""
    from astrai.host.jobs import init_job

    with _user_errors():
        _, runtime = _load(config, node)
        created = init_job(runtime)
        for path in created:
            print(f"created {path}")
        print(f"ready: job dir {runtime.job_dir}" if created else f"nothing to create: all folders of {config} exist")


@task(help={"config": CONFIG_HELP, "node": NODE_HELP})
def preflight(c, config=DEFAULT_CONFIG, node="0"):
    """Check the config and the trainer arguments after --, Docker, Compose, paths, model, GPUs; non-zero on failure."""
    from astrai.host.jobs import run_preflight

    with _user_errors():
        _, runtime = _load(config, node)
        run_preflight(runtime, _trainer_args(c))


@task(
    help={
        "config": CONFIG_HELP,
        "node": NODE_HELP,
        "kubernetes": "print the job as Kubernetes manifests (ConfigMap, headless Service, Indexed Job) instead",
        "trainjob": "with --kubernetes: a Kubeflow Trainer v2.3.0 TrainJob instead of the Service and Job",
    }
)
def render(c, config=DEFAULT_CONFIG, node="0", kubernetes=False, trainjob=False):
    """Print the generated Compose override of a job, or its Kubernetes manifests (-- ARGS go to the trainer)."""
    from astrai.host.jobs import render as render_override
    from astrai.host.jobs import render_kubernetes

    if trainjob and not kubernetes:
        raise Exit("error: --trainjob goes with --kubernetes", code=2)
    with _user_errors():
        _, runtime = _load(config, node)
        if kubernetes:
            print(render_kubernetes(runtime, _trainer_args(c), trainjob), end="")
        else:
            print(render_override(runtime, _trainer_args(c)), end="")


@task(help={"config": CONFIG_HELP, "node": NODE_HELP})
def build(c, config=DEFAULT_CONFIG, node="0"):
    """Build the trainer image of a job."""
    from astrai.host.jobs import build_image

    with _user_errors():
        _, runtime = _load(config, node)
        build_image(runtime)


@task(
    help={
        "config": CONFIG_HELP,
        "node": NODE_HELP,
        "foreground": "stay attached to the logs; Ctrl-C stops the job gracefully",
    }
)
def start(c, config=DEFAULT_CONFIG, node="0", foreground=False):
    """Preflight, build, then start or resume the job (-- ARGS override trainer settings)."""
    from astrai.host.jobs import start_job

    with _user_errors():
        _, runtime = _load(config, node)
        code = start_job(runtime, _trainer_args(c), foreground=foreground)
    if code:
        raise Exit(code=code)


@task(help={"config": CONFIG_HELP, "dry_run": "print the sbatch script; write and submit nothing"})
def submit(c, config=DEFAULT_CONFIG, dry_run=False):
    """Submit the job to Slurm (runtime.slurm): check, write the sbatch script, sbatch it (-- ARGS to the trainer)."""
    from astrai.host.jobs import submit_job

    with _user_errors():
        _, runtime = _load(config)
        submit_job(runtime, _trainer_args(c), dry_run)


@task(help={"config": CONFIG_HELP, "node": NODE_HELP})
def stop(c, config=DEFAULT_CONFIG, node="0"):
    """Stop gracefully: SIGTERM, emergency checkpoint, exit; cancels the max-duration timer."""
    from astrai.host.jobs import stop_job

    with _user_errors():
        _, runtime = _load(config, node)
        stop_job(runtime)


@task(help={"config": CONFIG_HELP, "node": NODE_HELP, "foreground": "stay attached to the logs after starting"})
def restart(c, config=DEFAULT_CONFIG, node="0", foreground=False):
    """Stop the job gracefully, then start it again (it resumes from the emergency checkpoint)."""
    from astrai.host.jobs import check_startable, check_trainer_config, start_job, stop_job

    with _user_errors():
        _, runtime = _load(config, node)
        check_startable(runtime)  # before the stop: what cannot start again must not be stopped
        check_trainer_config(runtime, _trainer_args(c))  # nor after a typo
        stop_job(runtime)
        code = start_job(runtime, _trainer_args(c), foreground=foreground)
    if code:
        raise Exit(code=code)


@task(
    help={
        "config": CONFIG_HELP,
        "node": NODE_HELP,
        "tail": "lines of history to show first (a number or 'all')",
        "follow": "keep following new lines (default on; --no-follow prints and exits)",
    }
)
def logs(c, config=DEFAULT_CONFIG, node="0", tail="100", follow=True):
    """Follow the trainer's logs (progress lines name the step)."""
    from astrai.host.jobs import show_logs

    if tail != "all" and not tail.isdigit():
        raise Exit(f"error: --tail takes a number of lines or 'all', got {tail!r}", code=2)
    with _user_errors():
        _, runtime = _load(config, node)
        show_logs(runtime, tail, follow)


@task(help={"config": CONFIG_HELP, "node": NODE_HELP})
def status(c, config=DEFAULT_CONFIG, node="0"):
    """Show the container state, progress, latest checkpoint and timer of a job."""
    from astrai.host.status import format_status, job_status

    with _user_errors():
        _, runtime = _load(config, node)
        print("\n".join(format_status(job_status(runtime))))


# No short flags: invoke would give -h to --host (and to --checkpoint below), and then `-h` asks for no help.
@task(
    auto_shortflags=False,
    help={
        "config": CONFIG_HELP,
        "node": NODE_HELP,
        "all": "serve every job under runtime.paths.checkpoints, not just this one",
        "host": "address to listen on (default 127.0.0.1: this machine only)",
        "port": "port to listen on (default 6006)",
        "background": "detach; `invoke board --stop` ends it",
        "stop": "end the board started with --background",
    },
)
def board(c, config=DEFAULT_CONFIG, node="0", all=False, host=None, port=None, background=False, stop=False):
    """Serve TensorBoard for the job (Ctrl-C ends it), or --background / --stop a detached one."""
    from astrai.host import board as tb

    with _user_errors():
        _, runtime = _load(config, node)
        if stop:
            state = tb.stop_background(runtime)
            print(f"stopped the board at {state.url}" if state else f"no board is running for job {runtime.job_name}")
            return
        host = tb.DEFAULT_HOST if host is None else host
        port = tb.DEFAULT_PORT if port is None else _whole("port", port, 1, 65535)
        command = tb.board_command(runtime, all, host, port)
        for note in tb.check_can_serve(runtime, all, host, port):
            print(note, file=sys.stderr if note.startswith("warning") else sys.stdout)
        url = tb.board_url(host, port)
        if background:
            tb.start_background(runtime, command, url)
            print(f"TensorBoard at {url} (in the background; `{runtime.command('board')} --stop` ends it)")
            return
        print(f"TensorBoard at {url} (Ctrl-C ends it)", flush=True)
        code = tb.serve_foreground(command)
    if code:
        raise Exit(code=code)


@task(help={"config": CONFIG_HELP, "node": NODE_HELP})
def latest(c, config=DEFAULT_CONFIG, node="0"):
    """Print the path of the newest complete checkpoint."""
    from astrai.host.jobs import latest_path

    with _user_errors():
        _, runtime = _load(config, node)
        print(latest_path(runtime))


@task(name="list", help={"config": CONFIG_HELP, "node": NODE_HELP})
def list_(c, config=DEFAULT_CONFIG, node="0"):
    """Print the path of every complete checkpoint, oldest first by (epoch, step)."""
    from astrai.host.jobs import list_checkpoints

    with _user_errors():
        _, runtime = _load(config, node)
        paths, damaged = list_checkpoints(runtime)
        for path in paths:
            print(path)
        for folder in damaged:
            print(f"not a checkpoint: {folder.path} ({folder.reason})", file=sys.stderr)


@task(
    help={
        "config": CONFIG_HELP,
        "node": NODE_HELP,
        "keep": "how many newest complete checkpoints to keep (default: runtime.container.checkpoint_keep_last)",
        "force": "really delete; without it, only show what would go",
        "damaged": "also remove the folders named like checkpoints that are not checkpoints (listed apart)",
    }
)
def clean(c, config=DEFAULT_CONFIG, node="0", keep=None, force=False, damaged=False):
    """Preview removal of old checkpoints; delete only with --force."""
    from astrai.host.jobs import clean_job

    keep = None if keep is None else _whole("keep", keep, 1)
    with _user_errors():
        _, runtime = _load(config, node)
        clean_job(runtime, keep, force, damaged)


@task(
    auto_shortflags=False,
    help={
        "config": CONFIG_HELP,
        "node": NODE_HELP,
        "checkpoint": "a checkpoint folder, a checkpoint name in the job dir (epoch_0_step_200), or any model folder "
        "(default: the newest checkpoint)",
        "out": "the folder to write (required; must be new or empty; missing parents are created)",
        "dtype": "float32, bfloat16 or float16 (fp32, bf16, fp16) (default: as stored)",
        "max_shard_size": "largest weight file, e.g. 5GB, 500MB, 2GiB or bytes; beyond it, shards and an index "
        "(default: 5GB)",
        "adapter": "a LoRA checkpoint as a PEFT adapter folder (adapter_config.json, adapter_model.safetensors) "
        "instead of merged into its base model",
        "base": "a LoRA checkpoint's base model folder (default: the one it records, under the job's model folder)",
    },
)
def export(
    c,
    config=DEFAULT_CONFIG,
    node="0",
    checkpoint=None,
    out=None,
    dtype=None,
    max_shard_size=None,
    adapter=False,
    base=None,
):
    """Write a checkpoint as a standalone Hugging Face model folder (weights, config, tokenizer; no training state).

    A LoRA checkpoint is written merged into its base model, or with --adapter as a PEFT adapter folder.
    """
    from pathlib import Path

    from astrai.host import export as ex

    if not out:
        raise Exit("error: --out is required: the folder to write the model into", code=2)
    try:
        dtype = ex.parse_dtype(dtype)
    except ValueError as error:
        raise Exit(f"error: --dtype {error}", code=2) from None
    try:
        max_shard_bytes = ex.parse_size(ex.DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size)
    except ValueError as error:
        raise Exit(f"error: --max-shard-size {error}", code=2) from None
    with _user_errors():
        runtime = None
        if ex.needs_job_dir(checkpoint):
            _, runtime = _load(config, node)
            source = ex.job_checkpoint(runtime, checkpoint)
        else:
            source = Path(checkpoint)
        base = Path(base) if base else None if adapter else ex.lora_base(source, runtime)
        print(ex.export_checkpoint(source, Path(out), dtype, max_shard_bytes, base=base, adapter=adapter).summary())


@task(
    name="eval",
    auto_shortflags=False,
    help={
        "config": CONFIG_HELP,
        "node": NODE_HELP,
        "checkpoint": "a checkpoint name in the job dir (epoch_0_step_200), or a model folder in one of the job's "
        "mounts (default: the newest checkpoint)",
        "tasks": "comma-separated: task YAMLs of lm-evaluation-harness (local data), folders of them, or task names",
        "limit": "at most this many examples of each task",
        "num_fewshot": "examples shown before each question (default: the task's own)",
        "submit": "as a Slurm job of one node (runtime.slurm) instead of here",
        "dry_run": "with --submit: print the sbatch script; submit nothing",
        "kubernetes": "print the evaluation as a Kubernetes Job (runtime.kubernetes) instead",
    },
)
def eval_(
    c,
    config=DEFAULT_CONFIG,
    node="0",
    checkpoint=None,
    tasks=None,
    limit=None,
    num_fewshot=None,
    submit=False,
    dry_run=False,
    kubernetes=False,
):
    """Run lm-evaluation-harness on a checkpoint in the job's image; results to <job dir>/eval/ and the trackers."""
    from pathlib import Path

    from astrai.host.eval_jobs import schedule_eval
    from astrai.host.harness import checked_evaluation, describe_results, evaluate_checkpoint, results_path

    if dry_run and not submit:
        raise Exit("error: --dry-run goes with --submit", code=2)
    limit = None if limit is None else _whole("limit", limit, 1)
    num_fewshot = None if num_fewshot is None else _whole("num_fewshot", num_fewshot, 0)
    with _user_errors():
        _, runtime = _load(config, node)
        given = [task for task in (tasks or "").split(",") if task]
        if submit or kubernetes:
            evaluation = checked_evaluation(runtime, checkpoint, given, limit, num_fewshot)
            print(schedule_eval(runtime, evaluation, kubernetes_manifests=kubernetes, dry_run=dry_run), end="")
            return
        document = evaluate_checkpoint(runtime, checkpoint, given, limit, num_fewshot)
        print(describe_results(document))
        print(f"results: {results_path(runtime, Path(document['path']))}")


@task(
    help={
        "workdir": "where the demo writes its model, data, config and checkpoints (default: ./demo)",
        "fresh": "delete the demo job dir of an earlier run first",
        "job_name": "the demo job's name (default: astrai-demo)",
    }
)
def demo(c, workdir="demo", fresh=False, job_name="astrai-demo"):
    """Run a tiny CPU job end to end: init, preflight, start, stop, resume, finish."""
    from pathlib import Path

    from astrai.host.demo import run_demo

    with _user_errors():
        run_demo(Path(workdir), fresh=fresh, job_name=job_name)


@task(
    help={
        "quick": "fewer repetitions and no `base` checkpoint run (36 minutes measured on a shared 2-core machine; "
        "a full run takes about an hour)",
        "only": "measure only this section (repeatable, e.g. --only 'host commands at scale'); the rest stay",
        "gpu": "the GPU section instead (one H100/H200-class GPU, at most about 8 minutes): results.json's gpu block",
    },
    iterable=["only"],
)
def bench(c, quick=False, only=None, gpu=False):
    """Measure speed and robustness side by side; merges into bench/results.json, writes docs/benchmarks.md."""
    from astrai.host.baseimage import DEFAULT_TAG

    if gpu:
        from bench import gpu as gpu_bench

        with _user_errors():
            code = gpu_bench.main([])
        if code:
            raise Exit(code=code)
        from bench.run import load_results, write_docs

        write_docs(load_results())
        return
    from bench.run import run

    with _user_errors():
        run(quick, DEFAULT_TAG, only or None)


namespace = Collection(
    init,
    preflight,
    render,
    build,
    start,
    submit,
    stop,
    restart,
    logs,
    status,
    board,
    latest,
    list_,
    clean,
    export,
    eval_,
    demo,
    bench,
)
