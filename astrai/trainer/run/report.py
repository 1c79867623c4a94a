"""Progress reporting: the progress line, ``metrics.jsonl``, TensorBoard event files, tokens/s, MFU and the ETA.

Global rank 0 reports; every rank takes part in the step timing so that all of
them leave the same pauses out. The clock is read only where the loop already
waits for the device (reports, saves, validation), so timing adds no
synchronisation to ordinary steps. The format of ``metrics.jsonl`` (what the
host reads back) is :mod:`astrai.common.metrics`.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from astrai.common.contract import (
    METRIC_COMPLETION_LENGTH,
    METRIC_EPOCH,
    METRIC_ETA_S,
    METRIC_EVAL_COMPLETION_LENGTH,
    METRIC_EVAL_PASS_AT_K,
    METRIC_EVAL_REWARD,
    METRIC_GRAD_NORM,
    METRIC_LOSS,
    METRIC_LR,
    METRIC_MAX_ALLOCATED_GIB,
    METRIC_MAX_STEPS,
    METRIC_MFU,
    METRIC_REWARD,
    METRIC_REWARD_MODEL_ACCURACY,
    METRIC_REWARD_MODEL_MARGIN,
    METRIC_REWARD_MODEL_VAL_ACCURACY,
    METRIC_REWARDS_ACCURACY,
    METRIC_REWARDS_MARGIN,
    METRIC_STEP,
    METRIC_TIME,
    METRIC_TOKENS_PER_S,
    METRIC_TOKENS_PER_SOURCE,
    METRIC_TOKENS_SEEN,
    METRIC_VAL_LOSS,
    METRICS_FILE,
    TAG_CHECKPOINT,
    TAG_MAX_ALLOCATED_GIB,
    TAG_MFU,
    TAG_TOKENS_PER_S,
    TAG_TOKENS_PREFIX,
    TAG_TRAIN_GRAD_NORM,
    TAG_TRAIN_LOSS,
    TAG_TRAIN_LR,
    TAG_VAL_LOSS,
    TENSORBOARD_DIR,
)
from astrai.common.errors import AstraiError
from astrai.common.layers import flops_per_token, matmul_params  # noqa: F401  (the MFU's, read here)
from astrai.common.metrics import MetricsFile
from astrai.common.values import format_duration
from astrai.trainer.run.trackers import Trackers


class ReportError(AstraiError):
    """metrics.jsonl cannot be written (a full disk, most often)."""


# --- FLOPs and MFU ---------------------------------------------------------------------------------

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from the vendors' data sheets, matched against
# torch.cuda.get_device_name() in this order, so "H100 NVL" and "H100 PCIe" win over "H100" (the SXM part) and
# "L40S" over "L4".
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"\bGB200\b", 2500.0),
    (r"\bB200\b", 2250.0),
    (r"\bB100\b", 1750.0),
    (r"\bGH200\b", 989.0),
    (r"\bH200\b.*\bNVL\b", 835.0),
    (r"\bH200\b", 989.0),
    (r"\bH100\b.*\bNVL\b", 835.0),
    (r"\bH100\b.*\bPCIe\b", 756.0),
    (r"\bH100\b", 989.0),
    (r"\bH800\b.*\bPCIe\b", 756.0),
    (r"\bH800\b", 989.0),
    (r"\bH20\b", 148.0),
    (r"\bA100\b", 312.0),
    (r"\bA800\b", 312.0),
    (r"\bL40S\b", 362.0),
    (r"\bL40\b", 181.0),
    (r"\bL4\b", 121.0),
    (r"\bA40\b", 150.0),
    (r"\bA30\b", 165.0),
    (r"\bA10\b", 125.0),
    (r"\bRTX 4090\b", 165.0),
    (r"\bRTX 3090\b", 71.0),
    (r"\bRTX A6000\b", 155.0),
)


def peak_tflops(device_name: str | None, override: float | None = None) -> float | None:
    """One device's peak bf16 TFLOP/s: the override, else the table entry for a GPU name, else None."""
    if override is not None:
        return override
    if not device_name:
        return None
    for pattern, tflops in PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name):
            return tflops
    return None


def mfu(tokens_per_s_per_device: float, flops_per_token_: int, peak: float | None) -> float | None:
    """Achieved model FLOP/s over the peak, as a fraction; None when the peak is unknown."""
    if peak is None:
        return None
    return tokens_per_s_per_device * flops_per_token_ / (peak * 1e12)


# --- Step timing ---------------------------------------------------------------------------------------


class StepClock:
    """Seconds per training step between progress reports, with pauses (checkpoints, validation, the
    first, compiling step) left out, and a moving average of the recent intervals for the ETA.

    The trainer reads the clock only where it already waits for the device (reports, saves,
    validation), so timing adds no synchronisation to ordinary steps.
    """

    def __init__(self, now: float, window: int = 20):
        self._recent: deque[tuple[float, int]] = deque(maxlen=window)
        self.restart(now)

    def restart(self, now: float) -> None:
        """Start a new interval at ``now``, forgetting pauses noted so far."""
        self._mark, self._paused, self._excluded_steps = now, 0.0, 0

    def pause(self, seconds: float, steps: int = 0) -> None:
        """Leave ``seconds`` (and ``steps`` steps, for a slow first step) out of the current interval."""
        self._paused += seconds
        self._excluded_steps += steps

    def lap(self, now: float, steps: int) -> tuple[float, int]:
        """End the interval of ``steps`` steps: (training seconds, steps counted); the next one starts now.

        An interval of nothing but excluded steps is returned whole, pauses included, and not averaged.
        """
        seconds = max(now - self._mark - self._paused, 0.0)
        counted = max(steps - self._excluded_steps, 0)
        if counted > 0 and seconds > 0:
            self._recent.append((seconds, counted))
        else:
            seconds, counted = now - self._mark, steps
        self.restart(now)
        return seconds, counted

    def seconds_per_step(self) -> float | None:
        """Average over the recent intervals, weighted by their steps; None before the first one."""
        steps = sum(count for _, count in self._recent)
        return sum(seconds for seconds, _ in self._recent) / steps if steps else None


def eta_seconds(steps_left: int, seconds_per_step: float | None, evals_left: int, seconds_per_eval: float) -> float:
    """Time to the end: the remaining steps at the average pace plus the remaining validations."""
    return steps_left * (seconds_per_step or 0.0) + evals_left * seconds_per_eval


# --- TensorBoard event files ----------------------------------------------------------------------------


class EventWriter:
    """TensorBoard event files of a job, written by global rank 0.

    A run that resumed at step ``resumed_step`` purges what an earlier run logged past that step (it
    was lost with the crash and is trained and logged again): TensorBoard's ``purge_step``, which
    readers apply. Without TensorBoard installed, the writer says so once and does nothing.
    """

    def __init__(self, folder: Path, resumed_step: int, log: Callable[[str], None]):
        self.folder = folder
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            log(
                "tensorboard is not installed in this image: TensorBoard event files are off "
                "(metrics.jsonl still records every logged step)"
            )
            self._writer = None
            return
        self._writer = SummaryWriter(log_dir=str(folder), purge_step=resumed_step + 1, flush_secs=30)

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    def scalars(self, step: int, values: dict[str, float | None]) -> None:
        """One value per tag at ``step``; None values are skipped."""
        if self._writer is None:
            return
        for tag, value in values.items():
            if value is not None:
                self._writer.add_scalar(tag, value, step)

    def checkpoint(self, step: int, folder_name: str, reason: str) -> None:
        """Record a checkpoint save as a text event, and flush: the steps it covers are then on disk."""
        if self._writer is None:
            return
        self._writer.add_text(TAG_CHECKPOINT, f"{reason} checkpoint `{folder_name}`", step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


@dataclass(frozen=True)
class StepReport:
    """What one progress report says (global rank 0's view, losses averaged over the ranks)."""

    step: int
    epoch: int
    loss: float
    lr: float
    tokens_seen: int
    grad_norm: float | None = None
    val_loss: float | None = None
    max_allocated_gib: float | None = None
    extra: dict | None = None
    """More fields for metrics.jsonl and the event files (post-training metrics), by metrics key."""
    tokens_per_source: dict[str, int] | None = None
    """Tokens trained from each source of a mixture so far."""
    evaluation: dict | None = None
    """The generative evaluation's metrics (``eval/...``) on an evaluation step."""
    validation: dict | None = None
    """The objective's validation metrics beside val_loss (the reward model's held-out accuracy), by metrics key."""


class ProgressReporter:
    """Turns the loop's numbers into the progress line, a metrics.jsonl record and event-file scalars."""

    def __init__(
        self,
        job_dir: Path,
        *,
        master: bool,
        max_steps: int,
        tokens_per_step: int,
        world_size: int,
        flops_per_token_: int,
        peak: float | None,
        resumed_step: int,
        log: Callable[[str], None],
        tag: str | None = None,
        tensorboard: bool = True,
        trackers: Trackers | None = None,
    ):
        self.job_dir = Path(job_dir)
        self.tag = tag
        """Said on every progress line (LoRA's rank and trainable share)."""
        self._said_not_finite: set[str] = set()
        self.master = master
        self.max_steps = max_steps
        self.tokens_per_step = tokens_per_step
        self.world_size = world_size
        self.flops_per_token = flops_per_token_
        self.peak = peak
        self.log = log
        self.clock = StepClock(time.perf_counter())
        self.events = EventWriter(self.job_dir / TENSORBOARD_DIR, resumed_step, log) if master and tensorboard else None
        self.trackers = trackers
        """MLflow and W&B (log.report_to), global rank 0 only."""

    def _nulled(self, record: dict, step: int) -> None:
        """metrics.jsonl stays strict JSON: a value that is not finite is written as null, and said (once per key)."""
        for key, value in record.items():
            if isinstance(value, float) and not math.isfinite(value):
                record[key] = None
                if key not in self._said_not_finite:
                    self._said_not_finite.add(key)
                    self.log(f"warning: {key} is {value} at step {step}: written as null in {METRICS_FILE}")

    def report(self, report: StepReport, steps: int, pauses: list[tuple[int, float]]) -> None:
        """Close the timing interval of ``steps`` steps and, on rank 0, print and record ``report``; ``pauses``: the
        validations and evaluations still to come, (how many, seconds each), which the ETA adds."""
        seconds, counted = self.clock.lap(time.perf_counter(), steps)
        if not self.master:
            return
        tokens_per_s = counted * self.tokens_per_step / seconds if seconds > 0 else 0.0
        utilization = mfu(tokens_per_s / self.world_size, self.flops_per_token, self.peak)
        pace = self.clock.seconds_per_step()
        eta_s = None
        if pace:
            eta_s = eta_seconds(self.max_steps - report.step, pace, 0, 0.0) + sum(left * each for left, each in pauses)
        record = {
            METRIC_STEP: report.step,
            METRIC_MAX_STEPS: self.max_steps,
            METRIC_EPOCH: report.epoch,
            METRIC_LOSS: report.loss,
            METRIC_LR: report.lr,
            METRIC_TOKENS_PER_S: tokens_per_s,
            METRIC_TOKENS_SEEN: report.tokens_seen,
            METRIC_TIME: time.time(),
        }
        optional = {
            METRIC_GRAD_NORM: report.grad_norm,
            METRIC_VAL_LOSS: report.val_loss,
            METRIC_MFU: utilization,
            METRIC_MAX_ALLOCATED_GIB: report.max_allocated_gib,
            METRIC_ETA_S: eta_s,
            METRIC_TOKENS_PER_SOURCE: report.tokens_per_source,
            **(report.extra or {}),
            **(report.validation or {}),
            **(report.evaluation or {}),
        }
        record.update({key: value for key, value in optional.items() if value is not None})
        self._nulled(record, report.step)
        self.log(self._line(report, record, tokens_per_s, utilization, eta_s))
        self._append(record)
        if self.trackers is not None:
            self.trackers.metrics(report.step, record)
        if self.events is None:
            return
        self.events.scalars(
            report.step,
            {
                TAG_TRAIN_LOSS: report.loss,
                TAG_TRAIN_LR: report.lr,
                TAG_TRAIN_GRAD_NORM: report.grad_norm,
                TAG_VAL_LOSS: report.val_loss,
                TAG_TOKENS_PER_S: tokens_per_s,
                TAG_MFU: utilization,
                TAG_MAX_ALLOCATED_GIB: report.max_allocated_gib,
                **{f"train/{key}": value for key, value in (report.extra or {}).items()},
                **(report.validation or {}),
                **(report.evaluation or {}),
                **{f"{TAG_TOKENS_PREFIX}{name}": count for name, count in (report.tokens_per_source or {}).items()},
            },
        )

    def _line(self, report: StepReport, record: dict, tokens_per_s: float, utilization, eta_s) -> str:
        """The progress line of ``report``."""
        line = f"step {report.step}/{self.max_steps} | epoch {report.epoch} | loss {report.loss:.4f}"
        line += f" | lr {report.lr:.3e}"
        if report.grad_norm is not None:
            line += f" | grad_norm {report.grad_norm:.3f}"
        if report.val_loss is not None:
            line += f" | val_loss {report.val_loss:.4f}"
        if report.extra and METRIC_REWARDS_MARGIN in report.extra:
            line += f" | margin {report.extra[METRIC_REWARDS_MARGIN]:.3f}"
            if METRIC_REWARDS_ACCURACY in report.extra:  # DPO's pairs (KTO's examples are unpaired)
                line += f" | accuracy {report.extra[METRIC_REWARDS_ACCURACY]:.2f}"
        if report.extra and METRIC_REWARD_MODEL_ACCURACY in report.extra:
            line += f" | accuracy {report.extra[METRIC_REWARD_MODEL_ACCURACY]:.2f}"
            line += f" | margin {report.extra[METRIC_REWARD_MODEL_MARGIN]:.3f}"
        if report.validation and METRIC_REWARD_MODEL_VAL_ACCURACY in report.validation:
            line += f" | val_accuracy {report.validation[METRIC_REWARD_MODEL_VAL_ACCURACY]:.2f}"
        if report.extra and record.get(METRIC_REWARD) is not None:
            line += f" | reward {report.extra[METRIC_REWARD]:.3f}"
        if report.extra and METRIC_COMPLETION_LENGTH in report.extra:
            line += f" | length {report.extra[METRIC_COMPLETION_LENGTH]:.1f}"
        if report.evaluation:
            line += f" | {evaluation_summary(report.evaluation)}"
        line += f" | {tokens_per_s:,.0f} tokens/s | mfu {'n/a' if utilization is None else f'{utilization:.1%}'}"
        if report.max_allocated_gib is not None:
            line += f" | mem {report.max_allocated_gib:.2f} GiB"
        if self.tag:
            line += f" | {self.tag}"
        line += f" | eta {format_duration(eta_s) if eta_s is not None else 'n/a'}"
        return line

    def report_evaluation(self, step: int, epoch: int, tokens_seen: int, evaluation: dict[str, float]) -> None:
        """On rank 0, print and record an evaluation made outside a step's report: the starting model's (step 0), or
        one a stop cut short, made when the run resumed. Its record is the step's last one with the evaluation added
        (readers take the last record of a step), or a record of the step alone at step 0."""
        if not self.master:
            return
        last = MetricsFile(self.job_dir / METRICS_FILE).latest()
        if last is not None and last.get(METRIC_STEP) == step:
            record = {**last, **evaluation, METRIC_TIME: time.time()}
        else:
            record = {
                METRIC_STEP: step,
                METRIC_MAX_STEPS: self.max_steps,
                METRIC_EPOCH: epoch,
                METRIC_TOKENS_SEEN: tokens_seen,
                METRIC_TIME: time.time(),
                **evaluation,
            }
        self._nulled(record, step)
        self.log(f"step {step}/{self.max_steps} | evaluation: {evaluation_summary(evaluation)}")
        self._append(record)
        if self.trackers is not None:
            self.trackers.metrics(step, record)
        if self.events is not None:
            self.events.scalars(step, evaluation)

    def _append(self, record: dict) -> None:
        try:
            with open(self.job_dir / METRICS_FILE, "a", encoding="utf-8") as handle:
                handle.write(json.dumps(record, sort_keys=True, allow_nan=False) + "\n")
        except OSError as error:
            raise ReportError(f"cannot append to {self.job_dir / METRICS_FILE}: {error.strerror}") from None

    def checkpoint(self, step: int, folder_name: str, reason: str) -> None:
        if self.events is not None:
            self.events.checkpoint(step, folder_name, reason)

    def close(self, state: str = "stopped", checkpoint: Path | None = None) -> None:
        """Flush the event files and end the tracker runs with ``state`` and the last ``checkpoint``."""
        if self.events is not None:
            # After an emergency stop too: the steps logged since the last flush reach the disk.
            self.events.close()
        if self.trackers is not None:
            self.trackers.close(state, checkpoint)
            self.trackers = None


def evaluation_summary(evaluation: dict[str, float]) -> str:
    """The evaluation's figures on a progress line: the mean reward, pass@k and the completions' length."""
    parts = []
    if METRIC_EVAL_REWARD in evaluation:
        parts.append(f"eval reward {evaluation[METRIC_EVAL_REWARD]:.3f}")
    if METRIC_EVAL_PASS_AT_K in evaluation:
        parts.append(f"pass@k {evaluation[METRIC_EVAL_PASS_AT_K]:.2f}")
    if METRIC_EVAL_COMPLETION_LENGTH in evaluation:
        parts.append(f"eval length {evaluation[METRIC_EVAL_COMPLETION_LENGTH]:.1f}")
    return " | ".join(parts) or "no completion scored"


def print_line(message: str) -> None:
    """One line to stdout as a single write, so lines from the checkpoint thread never interleave."""
    sys.stdout.write(message + "\n")
    sys.stdout.flush()
