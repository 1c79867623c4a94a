"""`invoke status`: what a job is doing, computed into one record, then printed.

:func:`job_status` asks the engine, the job dir and the timer, and returns a
:class:`JobStatus`; :func:`format_status` turns it into the lines the task prints.
Its cost does not grow with the run: ``metrics.jsonl`` is read from its end and
sampled for the curve (astrai/common/metrics.py), and the job dir is scanned once.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from astrai.common.checkpoints import Checkpoint, scan_job_dir
from astrai.common.contract import (
    METRIC_COMPLETION_CLIPPED,
    METRIC_COMPLETION_LENGTH,
    METRIC_ETA_S,
    METRIC_EVAL_COMPLETION_LENGTH,
    METRIC_EVAL_PASS_AT_K,
    METRIC_EVAL_PREFIX,
    METRIC_EVAL_REWARD,
    METRIC_EVAL_UNSCORED,
    METRIC_FRAC_REWARD_ZERO_STD,
    METRIC_KL,
    METRIC_LOSS,
    METRIC_MAX_ALLOCATED_GIB,
    METRIC_MAX_STEPS,
    METRIC_MFU,
    METRIC_REWARD,
    METRIC_REWARD_MODEL_ACCURACY,
    METRIC_REWARD_MODEL_MARGIN,
    METRIC_REWARD_OF,
    METRIC_REWARD_STD,
    METRIC_REWARDS_ACCURACY,
    METRIC_REWARDS_CHOSEN,
    METRIC_REWARDS_MARGIN,
    METRIC_REWARDS_REJECTED,
    METRIC_STEP,
    METRIC_TIME,
    METRIC_TOKENS_PER_S,
    METRIC_TOKENS_PER_SOURCE,
    METRIC_VAL_LOSS,
    METRICS_FILE,
    container_job_dir,
)
from astrai.common.metrics import MetricsFile, TrackerRun, read_runs
from astrai.common.model_folder import ModelConfig, ModelLoadError, num_adapter_parameters, num_parameters
from astrai.common.values import format_duration, local_time
from astrai.host import compose, engine, preflight, slurm, timer
from astrai.host.harness import describe_results, results_of
from astrai.host.runtime import Runtime, check_paths

SPARK_BLOCKS = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 40


@dataclass(frozen=True)
class JobStatus:
    """Everything `invoke status` shows about one job on one node."""

    runtime: Runtime
    container: engine.Container | None
    container_problem: str | None
    """Why the container state is unknown (the engine did not answer), else None."""
    image: str
    crashes: list[int] | None
    """Exit codes of the container's crashed runs, oldest first; None when unknown."""
    latest_record: dict | None
    curve: list[tuple[int, float]]
    """(step, loss) over the whole run, sampled evenly."""
    latest_val: tuple[int, float] | None
    latest: Checkpoint | None
    checkpoints: int
    not_checkpoints: int
    timer: timer.TimerState | None
    slurm: str | None = None
    """The submitted Slurm job's state in words, for a job with runtime.slurm that was submitted."""
    trackers: dict[str, TrackerRun] = field(default_factory=dict)
    """The MLflow and W&B runs the job reports to (log.report_to), from the job dir."""
    latest_eval: dict | None = None
    """The newest record holding the generative evaluation's figures (log.eval_prompts)."""
    harness: list[dict] = field(default_factory=list)
    """`invoke eval`'s results files (``<job dir>/eval/*.json``), by their checkpoint's step."""

    @property
    def running(self) -> bool:
        return self.container is not None and self.container.running


def job_status(runtime: Runtime) -> JobStatus:
    """Ask the engine, the job dir and the timer about ``runtime``'s job; prints nothing."""
    check_paths(runtime, ("checkpoints",))
    container = problem = crashes = None
    try:
        container = engine.find_container(compose.job_project(runtime))
        if container is not None and (runtime.max_restarts or container.restart_count):
            crashes = engine.crash_exit_codes(container)
    except engine.EngineError as error:
        problem = str(error)
    metrics = MetricsFile(runtime.job_dir / METRICS_FILE)
    curve = [(r[METRIC_STEP], r[METRIC_LOSS]) for r in metrics.sample() if _number(r, METRIC_LOSS)]
    validated = metrics.latest(METRIC_VAL_LOSS)
    scan = scan_job_dir(runtime.job_dir)
    return JobStatus(
        runtime=runtime,
        container=container,
        container_problem=problem,
        image=preflight.image_torch(runtime)[1],
        crashes=crashes,
        latest_record=metrics.latest(),
        curve=curve,
        latest_val=(validated[METRIC_STEP], validated[METRIC_VAL_LOSS])
        if validated and _number(validated, METRIC_VAL_LOSS)
        else None,
        latest=scan.complete[-1] if scan.complete else None,
        checkpoints=len(scan.complete),
        not_checkpoints=len(scan.damaged),
        timer=timer.read_timer(compose.state_dir(runtime)),
        slurm=slurm.status_line(runtime),
        trackers=read_runs(runtime.job_dir),
        latest_eval=metrics.latest(METRIC_EVAL_PASS_AT_K),
        harness=results_of(runtime),
    )


DPO_METRICS = (METRIC_REWARDS_CHOSEN, METRIC_REWARDS_REJECTED, METRIC_REWARDS_MARGIN, METRIC_REWARDS_ACCURACY)
KTO_METRICS = (METRIC_REWARDS_CHOSEN, METRIC_REWARDS_REJECTED, METRIC_REWARDS_MARGIN, METRIC_KL)
"""KTO's last record: its rewards of the desirable and undesirable completions, their margin, the KL estimate (it
has no accuracy: its examples are not pairs)."""
REWARD_MODEL_METRICS = (METRIC_REWARD_MODEL_ACCURACY, METRIC_REWARD_MODEL_MARGIN)


def _grpo_summary(record: dict) -> str:
    """The reward types' last record: the reward (and each function's), the groups without signal, the lengths."""
    text = f"reward {record[METRIC_REWARD]:.4f}"
    if _number(record, METRIC_REWARD_STD):
        text += f" ± {record[METRIC_REWARD_STD]:.4f}"
    functions = [
        (key.removeprefix(REWARD_PREFIX), value)
        for key, value in sorted(record.items())
        if key.startswith(REWARD_PREFIX) and not key.endswith("_std") and _number(record, key)
    ]
    if functions:
        text += " (" + ", ".join(f"{name} {value:.4f}" for name, value in functions) + ")"
    if _number(record, METRIC_FRAC_REWARD_ZERO_STD):
        text += f", {record[METRIC_FRAC_REWARD_ZERO_STD]:.0%} of groups without signal"
    if _number(record, METRIC_COMPLETION_LENGTH):
        text += f", completions of {record[METRIC_COMPLETION_LENGTH]:.1f} tokens"
        if _number(record, METRIC_COMPLETION_CLIPPED):
            text += f" ({record[METRIC_COMPLETION_CLIPPED]:.0%} at the limit)"
    return text


REWARD_PREFIX = METRIC_REWARD_OF.format(name="")
EVAL_OWN = (METRIC_EVAL_REWARD, METRIC_EVAL_PASS_AT_K, METRIC_EVAL_COMPLETION_LENGTH, METRIC_EVAL_UNSCORED)


def evaluation_line(record: dict) -> str:
    """The generative evaluation's figures of a record: the mean reward (and each reward's), pass@k, the length."""
    parts = []
    if _number(record, METRIC_EVAL_REWARD):
        parts.append(f"reward {record[METRIC_EVAL_REWARD]:.4f}")
        each = [
            f"{key.removeprefix(METRIC_EVAL_PREFIX)} {value:.4f}"
            for key, value in sorted(record.items())
            if key.startswith(METRIC_EVAL_PREFIX) and key not in EVAL_OWN and _number(record, key)
        ]
        if each:
            parts[-1] += f" ({', '.join(each)})"
    else:
        parts.append("no completion scored")
    if _number(record, METRIC_EVAL_PASS_AT_K):
        parts.append(f"pass@k {record[METRIC_EVAL_PASS_AT_K]:.0%}")
    if _number(record, METRIC_EVAL_COMPLETION_LENGTH):
        parts.append(f"completions of {record[METRIC_EVAL_COMPLETION_LENGTH]:.1f} tokens")
    return ", ".join(parts) + f" at step {record.get(METRIC_STEP)}"


def format_status(status: JobStatus) -> list[str]:
    """The lines `invoke status` prints for ``status``."""
    runtime = status.runtime
    lines = [f"job         {runtime.job_name}  ({runtime.config_path})", f"node        {_placement(runtime)}"]
    if status.slurm is not None:
        lines.append(f"slurm       {status.slurm}")
    container = status.container
    if status.container_problem is not None:
        state = f"unknown: {status.container_problem}"
    elif container is None:
        state = "not started"
    elif container.running:
        state = f"{container.status} for {_age(container.started())} ({container.name})"
    else:
        state = f"{container.status} (exit code {container.exit_code}) {_age(container.finished())} ago"
    lines.append(f"container   {state}")
    lines.append(f"image       {status.image}")
    if runtime.max_restarts or (container is not None and container.restart_count):
        lines.append(f"restarts    {_restarts(status)}")
    lines.append(f"progress    {_progress(status.latest_record, status.running)}")
    loss = _loss_summary(status)
    if loss:
        lines.append(f"loss        {loss}")
    record = status.latest_record or {}
    lines += objective_lines(record)
    if status.latest_eval is not None:
        lines.append(f"evaluation  {evaluation_line(status.latest_eval)}")
    per_source = record.get(METRIC_TOKENS_PER_SOURCE)
    if isinstance(per_source, dict) and per_source:
        total = sum(value for value in per_source.values() if isinstance(value, int)) or 1
        shown = ", ".join(
            f"{name} {tokens:,} tokens ({tokens / total:.0%})"
            for name, tokens in per_source.items()
            if isinstance(tokens, int)
        )
        lines.append(f"sources     {shown}")
    for document in status.harness:
        lines.append(f"eval        {describe_results(document)}")
    if status.latest is not None:
        reason = status.latest.meta.reason
        lines.append(f"latest      {status.latest.path} ({reason}; {status.checkpoints} checkpoint(s))")
        lora = _lora_line(status.latest)
        if lora:
            lines.append(f"lora        {lora}")
    else:
        lines.append("latest      no checkpoint")
    if status.not_checkpoints:
        lines.append(
            f"damaged     {status.not_checkpoints} folder(s) named like checkpoints are not checkpoints; "
            f"`{runtime.command('clean')}` lists them"
        )
    for name, run in status.trackers.items():
        lines.append(f"{name:<11} {_tracker_line(runtime, run)}")
    if status.timer is None:
        lines.append("timer       none")
    else:
        left = timer.seconds_left(status.timer)
        lines.append(f"timer       graceful stop in {format_duration(left)} (at {local_time(status.timer.deadline)})")
    return lines


def objective_lines(record: dict) -> list[str]:
    """What a train type's own metrics say in a record: DPO's rewards and accuracy, KTO's rewards and KL, a reward
    model's accuracy on its pairs, the reward types' rewards."""
    lines = []
    if all(_number(record, key) for key in DPO_METRICS):
        chosen, rejected, margin, accuracy = (record[key] for key in DPO_METRICS)
        lines.append(
            f"dpo         rewards chosen {chosen:+.4f}, rejected {rejected:+.4f}, margin {margin:.4f}, "
            f"accuracy {accuracy:.1%}"
        )
    elif all(_number(record, key) for key in KTO_METRICS):
        desirable, undesirable, margin, kl = (record[key] for key in KTO_METRICS)
        lines.append(
            f"kto         rewards desirable {desirable:+.4f}, undesirable {undesirable:+.4f}, margin {margin:.4f}, "
            f"kl {kl:.4f}"
        )
    if all(_number(record, key) for key in REWARD_MODEL_METRICS):
        accuracy, margin = (record[key] for key in REWARD_MODEL_METRICS)
        lines.append(f"pairs       accuracy {accuracy:.1%}, margin {margin:.4f} (chosen over rejected)")
    if _number(record, METRIC_REWARD):
        lines.append(f"rewards     {_grpo_summary(record)}")
    return lines


def _tracker_line(runtime: Runtime, run: TrackerRun) -> str:
    """A tracker run's address (an offline W&B run: its folder, as the host sees it), id and last step sent."""
    where = run.url or ""
    inside = container_job_dir(runtime.job_name)
    # Only where the container's job dir starts the address (a host-run job's own path may end the same way).
    host = str(runtime.job_dir)
    where = re.sub(r"^(file://)?" + re.escape(inside) + r"(?=/|$)", lambda m: (m[1] or "") + host, where)
    return f"{where} (run {run.run_id}, step {run.last_step} sent)"


def sparkline(values: list[float], width: int = SPARK_WIDTH) -> str:
    """``values`` as one line of Unicode blocks, lowest ▁ to highest █; at most ``width`` characters.

    More values than characters are averaged in equal buckets, so the line keeps the curve's shape.
    """
    values = [value for value in values if isinstance(value, (int, float)) and math.isfinite(value)]
    if not values:
        return ""
    if len(values) > width:
        buckets = [values[i * len(values) // width : (i + 1) * len(values) // width] for i in range(width)]
        values = [sum(bucket) / len(bucket) for bucket in buckets]
    low, high = min(values), max(values)
    if high == low:
        return SPARK_BLOCKS[len(SPARK_BLOCKS) // 2] * len(values)
    top = len(SPARK_BLOCKS) - 1
    return "".join(SPARK_BLOCKS[round((value - low) / (high - low) * top)] for value in values)


def _placement(runtime: Runtime) -> str:
    """Which node this host is, and the job's world size."""
    if runtime.world_size is not None:
        each = f"{runtime.processes} process(es) on each of {runtime.node_count} node(s)"
        world = f"world size {runtime.world_size} ({each})"
    else:
        world = f"one process per GPU on each of {runtime.node_count} node(s)"
    meeting = runtime.rendezvous or "from the scheduler's allocation"
    where = f"; rendezvous {meeting} ({runtime.rdzv_backend})" if runtime.multi_node else ""
    return f"{runtime.node} of {runtime.node_count}, {world}{where}"


def _restarts(status: JobStatus) -> str:
    """Crash restarts so far, and the exit code of the last crash."""
    count = 0 if status.container is None else status.container.restart_count
    text = f"{count} of {status.runtime.max_restarts} allowed after a crash"
    if status.crashes is None:
        return f"{text}; last crash unknown"
    return f"{text}; last crash: exit code {status.crashes[-1]}" if status.crashes else f"{text}; no crash"


def _number(record: dict, key: str) -> bool:
    value = record.get(key)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _progress(entry: dict | None, running: bool) -> str:
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
    if _number(entry, METRIC_ETA_S) and running and step < max_steps:
        parts.append(f"eta {format_duration(entry[METRIC_ETA_S])}")
    if _number(entry, METRIC_TIME):
        parts.append(f"reported {format_duration(time.time() - entry[METRIC_TIME])} ago")
    return ", ".join(parts)


def _loss_summary(status: JobStatus) -> str | None:
    """The latest loss, the curve so far as a sparkline, and the latest validation loss."""
    points = status.curve
    if not points:
        return None
    losses = [loss for _, loss in points]
    text = f"{losses[-1]:.4f} {sparkline(losses)} (steps {points[0][0]}-{points[-1][0]}, min {min(losses):.4f})"
    if status.latest_val is not None:
        text += f"; val_loss {status.latest_val[1]:.4f} at step {status.latest_val[0]}"
    return text


def _age(moment: datetime | None) -> str:
    if moment is None:
        return "?"
    return format_duration((datetime.now(timezone.utc) - moment).total_seconds())


def _lora_line(latest: Checkpoint) -> str | None:
    """A LoRA checkpoint's rank, targets and trainable share, and the base its adapters belong to."""
    lora = latest.meta.lora
    if lora is None:
        return None
    try:
        model = ModelConfig.load(latest.path)
    except ModelLoadError:
        return f"rank {lora['rank']} on {', '.join(lora['targets'])}; base {lora['base']['path']}"
    trainable = num_adapter_parameters(model, lora["rank"], lora["targets"])
    share = trainable / (trainable + num_parameters(model))
    return (
        f"rank {lora['rank']} on {', '.join(lora['targets'])}: {trainable:,} trainable parameters ({share:.2%}); "
        f"base {lora['base']['path']}"
    )
