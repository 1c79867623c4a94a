"""``metrics.jsonl``: the run's progress records, and the one reader of them (host and tests alike).

The trainer's global rank 0 appends one JSON object per logged step (field names
in :mod:`astrai.common.contract`, ``METRIC_*``); the file is an append-only
history. A record whose step is not past the one before it starts a resumed run:
the records it repeats or skips past belong to work lost in a crash, so readers
drop them, as TensorBoard purges them, and the last record of a step wins.
Unreadable lines are skipped.

The host reads this file on every `invoke status`, and a long run makes it large
(two million logged steps are about 450 MB), so what the host reads costs the
same for a file of any length: the newest records from the end, and the curve as
an even sample of the file, each line found by seeking. Only :meth:`MetricsFile.records`
reads it whole (tests, small files).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from astrai.common.contract import METRIC_STEP, TRACKER_PACKAGES, TRACKERS_FILE

TAIL_BYTES = 1 << 20
"""How far back from the end the newest records are looked for."""
_CHUNK = 1 << 16


class MetricsFile:
    """The metrics.jsonl of one job; a missing or unreadable file reads as empty."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def records(self) -> list[dict]:
        """Every progress record as the run stands: one per step, in step order (reads the whole file)."""
        try:
            with open(self.path, "rb") as handle:
                return _as_run(_parse(line) for line in handle)
        except OSError:
            return []

    def latest(self, key: str | None = None, budget: int = TAIL_BYTES) -> dict | None:
        """The newest record (holding ``key``, when given) within ``budget`` bytes of the end, or None."""
        for record in self._backwards(budget):
            if key is None or key in record:
                return record
        return None

    def sample(self, count: int = 160) -> list[dict]:
        """About ``count`` records spread evenly over the run, in step order, plus the newest one.

        A file of up to ``count`` lines' worth of bytes is read whole; a larger one is read at ``count``
        evenly spaced offsets (one line each), so the cost does not grow with the file. Where the steps
        of two samples go backwards a resumed run began between them: its first record is found by
        bisection, so the records the crash made stale are dropped as a whole read would drop them.
        """
        try:
            with open(self.path, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                if size <= count * 512:
                    return _as_run(_parse(line) for line in handle)
                found = [(offset, _record_at(handle, offset)) for offset in (i * size // count for i in range(count))]
                found = [(offset, record) for offset, record in found if record is not None]
                starts = []
                for (low, before), (high, after) in zip(found, found[1:], strict=False):
                    if after[METRIC_STEP] < before[METRIC_STEP]:
                        starts.append(_resume_start(handle, low, high, before[METRIC_STEP]))
        except OSError:
            return []
        ordered = sorted([*found, *(start for start in starts if start is not None)], key=lambda item: item[0])
        return _as_run([record for _, record in ordered] + [self.latest()])

    def _backwards(self, budget: int) -> Iterator[dict]:
        """Records from the end of the file backwards, newest first, reading at most ``budget`` bytes."""
        try:
            handle = open(self.path, "rb")
        except OSError:
            return
        with handle:
            position = os.fstat(handle.fileno()).st_size
            stop = max(0, position - budget)
            carry = b""
            while position > stop:
                start = max(stop, position - _CHUNK)
                handle.seek(start)
                block = handle.read(position - start) + carry
                position = start
                lines = block.split(b"\n")
                # The first piece may be the end of a line that starts in an earlier block.
                carry = lines.pop(0) if position > 0 else b""
                for line in reversed(lines):
                    record = _parse(line)
                    if record is not None:
                        yield record
            if position == 0 and carry:
                record = _parse(carry)
                if record is not None:
                    yield record


def _record_at(handle, offset: int) -> dict | None:
    """The first whole record starting after ``offset`` (or at 0)."""
    handle.seek(offset)
    if offset:
        handle.readline()  # the rest of a line cut by the seek
    return _parse(handle.readline())


def _resume_start(handle, low: int, high: int, step: int) -> tuple[int, dict] | None:
    """The first record of the resumed run that begins between offsets ``low`` and ``high``.

    Records before it belong to the earlier run, whose steps at ``low`` onwards are at least ``step``;
    the resumed run's steps up to ``high`` are all lower.
    """
    while high - low > 1:
        middle = (low + high) // 2
        record = _record_at(handle, middle)
        if record is not None and record[METRIC_STEP] >= step:
            low = middle
        else:
            high = middle
    handle.seek(high)
    handle.readline()
    offset = handle.tell()
    record = _parse(handle.readline())
    return (offset, record) if record is not None else None


def _parse(line: bytes | None) -> dict | None:
    if not line:
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict) or isinstance(record.get(METRIC_STEP), bool):
        return None
    return record if isinstance(record.get(METRIC_STEP), int) else None


def _as_run(records) -> list[dict]:
    """The records that stand, in file order: a step not past the previous record's drops what it replays."""
    kept: list[dict] = []
    for record in records:
        if record is None:
            continue
        while kept and kept[-1][METRIC_STEP] >= record[METRIC_STEP]:
            kept.pop()
        kept.append(record)
    return kept


def read_records(path: Path) -> list[dict]:
    """Every progress record of a metrics.jsonl as the run stands (see :meth:`MetricsFile.records`)."""
    return MetricsFile(path).records()


# --- trackers.json: the job's experiment tracker runs --------------------------------------------------


@dataclass
class TrackerRun:
    """One tracker's run as the job dir records it."""

    run_id: str | None = None
    url: str | None = None
    last_step: int = 0
    """The last step whose metrics reached the tracker."""


def read_runs(job_dir: Path) -> dict[str, TrackerRun]:
    """The job dir's tracker runs by tracker name; none when the file is missing or unreadable."""
    try:
        saved = json.loads((Path(job_dir) / TRACKERS_FILE).read_text(encoding="utf-8"))
        return {name: TrackerRun(**fields) for name, fields in saved.items() if name in TRACKER_PACKAGES}
    except (OSError, ValueError, TypeError):
        return {}
