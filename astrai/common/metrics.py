"""Training metrics: model FLOPs and MFU, step timing, TensorBoard event files, and metrics.jsonl read back.

The trainer uses all of it; the host (``invoke status``) only reads
``metrics.jsonl`` and draws the sparkline, so this module imports neither torch
nor TensorBoard at the top: the event writer loads them when it is created.
"""

from __future__ import annotations

import json
import math
import re
from collections import deque
from collections.abc import Callable
from pathlib import Path

from astrai.common.contract import METRIC_STEP, TAG_CHECKPOINT

# --- FLOPs and MFU ---------------------------------------------------------------------------------

# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) from the vendors' data sheets, matched against
# torch.cuda.get_device_name() in this order, so "H100 PCIe" wins over "H100" and "L40S" over "L4".
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"\bB200\b", 2250.0),
    (r"\bGH200\b", 989.0),
    (r"\bH200\b", 989.0),
    (r"\bH100\b.*\bPCIe\b", 756.0),
    (r"\bH100\b", 989.0),
    (r"\bH800\b", 989.0),
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


def matmul_params(model) -> int:
    """Weights that take part in a matrix multiply per token: attention, MLP and the output head.

    The input embedding is a lookup, not a multiply, and norm weights are negligible; with tied
    embeddings the output head is the embedding matrix, counted once here.
    """
    head_dim = model.dim // model.n_heads
    attention = model.dim * model.n_heads * head_dim * 2 + model.dim * model.n_kv_heads * head_dim * 2
    mlp = 3 * model.dim * model.ffn_hidden_dim
    return model.n_layers * (attention + mlp) + model.vocab_size * model.dim


def flops_per_token(model, seq_len: int) -> int:
    """Training FLOPs per token: 6N for the weights (2 forward, 4 backward) plus the attention term.

    Attention scores (Q·Kᵀ) and their use (A·V) cost 2·seq_len·(n_heads·head_dim) FLOPs each per
    token and layer forward, three times that with backward: 12·n_layers·n_heads·head_dim·seq_len.
    The causal mask is not discounted, as in the PaLM paper's MFU, so figures compare across tools.
    """
    head_dim = model.dim // model.n_heads
    return 6 * matmul_params(model) + 12 * model.n_layers * model.n_heads * head_dim * seq_len


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


# --- metrics.jsonl read back ---------------------------------------------------------------------------------


def read_records(path: Path) -> list[dict]:
    """The progress records of ``metrics.jsonl`` as the run stands: one per step, in step order.

    The file is an append-only history. A record whose step is not past the one before it starts a
    resumed run: the records it repeats or skips past belong to work lost in a crash, so they go, as
    TensorBoard purges them; the last record of a step wins. Unreadable lines are skipped.
    """
    kept: list[dict] = []
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or not isinstance(record.get(METRIC_STEP), int):
            continue
        while kept and kept[-1][METRIC_STEP] >= record[METRIC_STEP]:
            kept.pop()
        kept.append(record)
    return kept


SPARK_BLOCKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 40) -> str:
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
