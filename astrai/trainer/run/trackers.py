"""Experiment trackers: a job's MLflow and Weights & Biases runs, fed by global rank 0.

Each tracker the config's ``log.report_to`` names gets a :class:`Outbox`: a bounded queue and a worker thread
that opens the tracker run, sends the parameters, every logged metric and, at the end, how the run ended. The
trainer only puts updates in the queue, so a slow or unreachable server never holds up a step:

- an update that fails because the server cannot be reached is kept and sent again (1 s, 2 s, ... 30 s apart),
  in order; meanwhile the queue fills, and once it is full new updates are dropped and counted;
- an update the server refuses is dropped and counted; a tracker whose run cannot be opened at all (no API key,
  no client in the image) is switched off with one warning;
- at the end, what is still queued after :data:`CLOSE_SECONDS` is dropped and counted; a tracker that writes to the
  job dir alone (W&B offline, MLflow's file store) has nothing to wait for but this machine, and its run would be
  lost (an offline W&B file without its run record, never linked to its run) if the trainer ended first: its
  queue gets :data:`LOCAL_CLOSE_SECONDS`, which on a loaded machine covers opening the run (W&B starts a service
  process) and finishing it.

A resumed job continues the same tracker runs. ``<job dir>/trackers.json`` keeps each run's id, address and the
last step it was sent, and every checkpoint's ``meta.json`` keeps the ids. The steps a resume trains again (those
after its checkpoint that the interrupted run had already sent) are not sent twice: the tracker keeps the values
it has, which an exact resume reproduces, and the run gets the tag :data:`TAG_REPLAYED` naming them.
"""

from __future__ import annotations

import json
import math
import os
import queue
import re
import secrets
import string
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from astrai.common.atomic import write_text_atomically
from astrai.common.config import LogSection
from astrai.common.contract import (
    LM_EVAL_PREFIX,
    LM_EVAL_STEP,
    METRIC_LOSS,
    METRIC_MAX_STEPS,
    METRIC_STEP,
    METRIC_TIME,
    METRICS_FILE,
    TAG_FINAL_CHECKPOINT,
    TAG_REPLAYED,
    TAG_STATE,
    TRACKER_MLFLOW,
    TRACKER_PACKAGES,
    TRACKER_WANDB,
    TRACKERS_FILE,
    WANDB_DIR,
)
from astrai.common.metrics import TrackerRun, read_records, read_runs
from astrai.common.values import without_credentials

OUTBOX_SIZE = 2000
"""Updates a tracker may have waiting (a metrics record each log_interval steps) before new ones are dropped."""
WANDB_INIT_SECONDS = 15
"""How long opening a W&B run may take before the attempt counts as failed (and is tried again)."""
FLUSH_SECONDS = 5.0
"""Metrics records reach a tracker together, at most one request this often (and at the end of the run)."""
CLOSE_SECONDS = 10.0
"""How long the end of a run waits for each tracker's queue to empty."""
LOCAL_CLOSE_SECONDS = 180.0
"""How long the end of a run waits for a tracker that needs no network (W&B offline, MLflow's file store): its
updates are this machine's work, which a loaded machine slows but never loses."""
RESULTS_FINISH_SECONDS = 180.0
"""How long `invoke eval`'s report to a W&B run may wait for W&B's service to write it (offline: this machine's own
work, which a loaded machine slows)."""
UPLOAD_SECONDS = 1800.0
"""With log.upload_checkpoints, how long a finished run waits for its last checkpoint to reach the trackers (a
stopped one does not upload: a stop's time is the emergency checkpoint's)."""
RETRY_SECONDS = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)
"""Pauses between attempts to reach an unreachable tracker, the last one repeated."""
STATES = ("finished", "stopped", "diverged", "failed")
"""How a run ended, as the tracker run's TAG_STATE says."""
DEFAULT_EXPERIMENT = "astrai"


class TrackerUnavailable(Exception):
    """The tracker cannot be used in this run at all (no client installed, no credentials): switch it off."""


def metric_values(record: dict) -> dict[str, float]:
    """A metrics.jsonl record as tracker metrics: every number but the step's own fields, mixtures' counts
    flattened (``tokens/<source>``), names reduced to what MLflow accepts."""
    values = {}
    for key, value in record.items():
        if key in (METRIC_STEP, METRIC_MAX_STEPS, METRIC_TIME):
            continue
        items = value.items() if isinstance(value, dict) else [("", value)]
        for sub, number in items:
            name = f"tokens/{sub}" if sub else key
            if isinstance(number, (int, float)) and not isinstance(number, bool) and math.isfinite(number):
                values[re.sub(r"[^\w.\-/ ]", "_", name)] = float(number)
    return values


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as ``section.key`` parameters, values as text (lists and mappings as JSON)."""
    params = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            params.update(flat_params(value, f"{name}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            params[name] = without_credentials(text)[:500]
    return params


def _transient(error: BaseException) -> bool:
    """Whether a failure means the server could not be reached (try again later), not that it refused."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, (ConnectionError, TimeoutError)):
            return True
        text = f"{type(error).__name__} {error}"
        if re.search(r"Connection|Timeout|timed out|Max retries|Temporary failure|\b(429|502|503|504)\b", text):
            return True
        error = error.__cause__ or error.__context__
    return False


# --- The trackers' clients ------------------------------------------------------------------------------------


class MlflowTracker:
    """One MLflow run through ``MlflowClient``; its requests fail fast so that the outbox decides about retries."""

    name = TRACKER_MLFLOW

    def __init__(self, settings, job_dir: Path, job_name: str):
        self.settings, self.job_dir, self.job_name = settings, Path(job_dir), job_name
        self.client = None
        self.uri: str | None = None
        self._created = None
        self.run = TrackerRun()
        self.skip_through = 0
        """Steps up to this one were sent before the resume: not again."""

    def prepare(self) -> None:
        """Import the client (seconds of CPU) and set its environment before training starts, in the main thread."""
        try:
            import mlflow.entities  # noqa: F401
            import mlflow.tracking  # noqa: F401
        except Exception as error:  # not installed, or a dependency that does not import
            raise TrackerUnavailable(_not_installed(self.name, error)) from None
        # MLflow's own retries would wait minutes on a dead server; the outbox retries instead.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        # MLflow prints the run's address when it ends, credentials and all; status shows it without them.
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
        self.uri = self.settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if self.uri is None:
            # No server named: MLflow's file store in the job dir (`mlflow ui --backend-store-uri` reads it), which
            # MLflow keeps in maintenance mode and refuses unless asked.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            self.uri = f"file://{self.job_dir.resolve()}/mlruns"

    @property
    def local(self) -> bool:
        """Whether the runs are files on this machine (the file store), no server: nothing can be unreachable."""
        return self.uri is not None and urllib.parse.urlparse(self.uri).scheme in ("", "file")

    def open(self, previous: TrackerRun | None, params: dict[str, str], tags: dict[str, str], resumed_step) -> None:
        from mlflow.entities import Param, RunStatus
        from mlflow.tracking import MlflowClient

        uri = self.uri
        client = MlflowClient(tracking_uri=uri)
        name = self.settings.experiment or DEFAULT_EXPERIMENT
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            experiment_id = client.create_experiment(name)
        else:
            experiment_id = experiment.experiment_id
            if experiment.lifecycle_stage != "active":  # deleted in the UI: brought back
                client.restore_experiment(experiment_id)
        # A retry after a failure past create_run continues the run it created.
        run = self._created or self._existing(client, previous)
        if run is None:
            run = client.create_run(experiment_id, run_name=self.settings.run_name or self.job_name, tags=tags)
            self._created = run
            new, held = params, 0
        else:
            client.update_run(run.info.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
            old = run.data.params
            new = {key: value for key, value in params.items() if key not in old}
            changed = {f"astrai.changed.{key}": value for key, value in params.items() if old.get(key, value) != value}
            for key, value in {**tags, **changed}.items():
                client.set_tag(run.info.run_id, key, value)
            # What the server holds, not what the job dir says: a request may have got through just before a kill.
            held = max((point.step for point in client.get_metric_history(run.info.run_id, METRIC_LOSS)), default=0)
        replayed = _replayed(held, resumed_step)
        if replayed:
            client.set_tag(run.info.run_id, TAG_REPLAYED, replayed)
        items = [Param(key, value) for key, value in new.items()]
        for first in range(0, len(items), 100):  # MLflow takes at most 100 parameters a request
            client.log_batch(run.info.run_id, params=items[first : first + 100])
        self.client = client
        url = f"{without_credentials(uri).rstrip('/')}/#/experiments/{experiment_id}/runs/{run.info.run_id}"
        self.run, self.skip_through = TrackerRun(run.info.run_id, url, held), held

    @staticmethod
    def _existing(client, previous: TrackerRun | None):
        if previous is None or previous.run_id is None:
            return None
        try:
            run = client.get_run(previous.run_id)
        except Exception as error:
            if _transient(error):
                raise
            return None  # on another server: a new run
        return run if run.info.lifecycle_stage == "active" else None  # deleted: a new run

    def metrics(self, records: list[tuple[int, dict[str, float]]]) -> None:
        """Send ``records`` (at most 1000 metrics a request, MLflow's limit); each request's records leave the list
        once it is through, so a retry after a failure sends only the rest."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        while records:
            count, size = 0, 0
            while count < len(records) and (count == 0 or size + len(records[count][1]) <= 1000):
                size += len(records[count][1])
                count += 1
            metrics = [
                Metric(key, value, now, step) for step, values in records[:count] for key, value in values.items()
            ]
            self.client.log_batch(self.run.run_id, metrics=metrics)
            del records[:count]

    def tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run.run_id, key, value)

    def finish(self, state: str, checkpoint: str | None, upload: bool) -> None:
        self.tag(TAG_STATE, state)
        if checkpoint is not None:
            self.tag(TAG_FINAL_CHECKPOINT, checkpoint)
        status = {"finished": "FINISHED", "stopped": "KILLED"}.get(state, "FAILED")
        self.client.set_terminated(self.run.run_id, status=status)
        if upload and checkpoint is not None:  # last: the run's state is told even if the upload runs out of time
            self.client.log_artifacts(self.run.run_id, checkpoint, artifact_path=Path(checkpoint).name)


class WandbTracker:
    """One Weights & Biases run, online or offline, its files in ``<job dir>/wandb``."""

    name = TRACKER_WANDB

    def __init__(self, settings, job_dir: Path, job_name: str):
        self.settings, self.job_dir, self.job_name = settings, Path(job_dir), job_name
        self.handle = None
        self.run = TrackerRun()
        self.skip_through = 0

    def prepare(self) -> None:
        try:
            import wandb  # noqa: F401
        except Exception as error:
            raise TrackerUnavailable(_not_installed(self.name, error)) from None
        if self.settings.mode == "online" and not os.environ.get("WANDB_API_KEY"):
            raise TrackerUnavailable(
                "log.wandb.mode is online, but WANDB_API_KEY is not set in the trainer's environment: set it in the "
                "shell that runs `invoke start` (it is passed by name), or set log.wandb.mode to offline"
            )

    @property
    def local(self) -> bool:
        """Offline: the run is W&B's files in the job dir, for ``wandb sync`` to send later."""
        return self.settings.mode == "offline"

    def open(self, previous: TrackerRun | None, params: dict[str, str], tags: dict[str, str], resumed_step) -> None:
        import wandb

        mode = self.settings.mode
        folder = self.job_dir / WANDB_DIR
        folder.mkdir(exist_ok=True)
        run_id = previous.run_id if previous is not None and previous.run_id else _new_run_id()
        self.handle = wandb.init(
            id=run_id,
            # Offline, W&B cannot look the run up: each process writes a folder of its own under the same id.
            resume="allow" if mode == "online" else None,
            project=self.settings.project or os.environ.get("WANDB_PROJECT") or DEFAULT_EXPERIMENT,
            entity=self.settings.entity,
            name=self.settings.run_name or self.job_name,
            mode=mode,
            dir=str(self.job_dir),
            config=params,
            # The trainer's own output stays untouched: W&B does not wrap stdout, keep code or send the console.
            # Bounded waits: a slow server must not hold up the end of a run (W&B's default is to wait for ever).
            settings=wandb.Settings(
                console="off",
                save_code=False,
                silent=True,
                init_timeout=WANDB_INIT_SECONDS,
                finish_timeout=int(CLOSE_SECONDS),
            ),
        )
        held = previous.last_step if previous is not None else 0
        if mode == "online" and not self.handle.resumed:
            held = 0  # a new run (another project or entity): it gets every step
        elif mode == "offline" and previous is not None:
            # W&B writes its file in blocks: a kill loses the last one. What the files hold is what was sent.
            held = min(held, _offline_steps(folder, run_id, held))
        replayed = _replayed(held, resumed_step)
        self.handle.config.update(params, allow_val_change=True)
        self.handle.summary.update({**tags, **({TAG_REPLAYED: replayed} if replayed else {})})
        url = self.handle.url if mode == "online" else str(Path(self.handle.dir).parent.resolve())
        self.run, self.skip_through = TrackerRun(self.handle.id, url, held), held

    def metrics(self, records: list[tuple[int, dict[str, float]]]) -> None:
        for step, values in records:
            self.handle.log(values, step=step)

    def tag(self, key: str, value: str) -> None:
        self.handle.summary[key] = value

    def finish(self, state: str, checkpoint: str | None, upload: bool) -> None:
        import wandb

        self.tag(TAG_STATE, state)
        if checkpoint is not None:
            self.tag(TAG_FINAL_CHECKPOINT, checkpoint)
            if upload:
                # An artifact's name takes letters, digits, dashes, underscores and dots only.
                name = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{self.job_name}-checkpoint")
                artifact = wandb.Artifact(name, type="model")
                # Read in place: the default policy copies the whole folder to W&B's staging area first.
                artifact.add_dir(checkpoint, policy="immutable")
                logged = self.handle.log_artifact(artifact)
                if self.settings.mode == "online":  # finish() itself waits only CLOSE_SECONDS
                    logged.wait(timeout=UPLOAD_SECONDS)
        self.handle.finish(exit_code=0 if state in ("finished", "stopped") else 1)


def _replayed(held: int, resumed_step: int | None) -> str | None:
    """The steps a resume trains again that the tracker already holds (``41-60``), or None."""
    return f"{resumed_step + 1}-{held}" if resumed_step is not None and held > resumed_step else None


def _offline_steps(folder: Path, run_id: str, at_most: int) -> int:
    """The last step W&B's offline files of ``run_id`` hold (its own reader), or ``at_most`` if they cannot be read."""
    try:
        from wandb.proto import wandb_internal_pb2
        from wandb.sdk.internal import datastore
    except Exception:  # a W&B without its reader: the job dir's word
        return at_most
    last = 0
    for path in folder.glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"):
        store = datastore.DataStore()
        try:
            store.open_for_scan(str(path))
            while (data := store.scan_data()) is not None:
                record = wandb_internal_pb2.Record()
                record.ParseFromString(data)
                if record.WhichOneof("record_type") == "history":
                    last = max(last, record.history.step.num)
        except Exception:  # the end of a file cut short by the kill
            pass
    return last


def _not_installed(name: str, error: Exception) -> str:
    if not isinstance(error, ImportError) or getattr(error, "name", name) not in (name, None):
        return f"log.report_to lists {name}, but its client does not import ({_short(error)})"
    return (
        f"log.report_to lists {name}, but {TRACKER_PACKAGES[name]} is not installed here; the trainer image gets "
        "it when `invoke start` or `invoke build` sees report_to ask for it (on the host: pip install it)"
    )


def _new_run_id() -> str:
    """A W&B run id: eight lower-case letters and digits."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


CLIENTS = {TRACKER_MLFLOW: MlflowTracker, TRACKER_WANDB: WandbTracker}


# --- The outbox: one worker thread a tracker -----------------------------------------------------------------


_END = ("end", ())
"""The last item of an outbox's queue: the worker stops there."""


class Outbox:
    """Sends one tracker's updates in order from a worker thread; :meth:`put` never waits."""

    def __init__(self, tracker, log: Callable[[str], None], changed: Callable[[], None], capacity: int = OUTBOX_SIZE):
        self.tracker = tracker
        self.log = log
        self.changed = changed
        self.capacity = capacity
        # Unbounded underneath: metrics stop at ``capacity``, but the end of the run always finds room.
        self.queue: queue.Queue = queue.Queue()
        self.dropped = 0
        self.off = False
        self._closing = threading.Event()
        self._hurry = threading.Event()
        """Set: metrics go out without waiting for FLUSH_SECONDS (the run is ending, or a drain)."""
        self._sent_at = 0.0
        self._unreachable = False
        self._refused: set[str] = set()
        self._thread = threading.Thread(target=self._work, name=f"astrai-{tracker.name}", daemon=True)
        self._thread.start()

    def put(self, method: str, *args) -> None:
        if method == "metrics" and self.queue.qsize() >= self.capacity:
            self.dropped += 1
            if self.dropped == 1:
                self.log(
                    f"warning: {self.tracker.name} is not keeping up ({self.capacity} updates waiting): new "
                    "updates are dropped until it does; training goes on (the count comes at the end)"
                )
            return
        self.queue.put_nowait((method, args))

    def _work(self) -> None:
        held = None  # an update taken from the queue while gathering metrics, sent next
        while True:
            item, held = held or self.queue.get(), None
            if item is _END:
                self.queue.task_done()
                return
            method, args = item
            taken = 1
            if method == "catch_up":  # after the open: only what the tracker turned out not to hold
                method, args = "metrics", ([record for record in args[0] if record[0] > self.tracker.run.last_step],)
            elif method == "metrics":
                # Metrics records go out together, at most one request every FLUSH_SECONDS: a request costs the
                # trainer's process milliseconds of CPU, whatever it carries.
                self._hurry.wait(max(self._sent_at + FLUSH_SECONDS - time.monotonic(), 0.0))
                records = [args]
                while held is None:
                    try:
                        following = self.queue.get_nowait()
                    except queue.Empty:
                        break
                    if following[0] == "metrics":
                        records.append(following[1])
                        taken += 1
                    else:
                        held = following
                # Step 0 is the starting model's evaluation (log.eval_at_start), which only a fresh run makes.
                args = ([record for record in records if record[0] > self.tracker.skip_through or record[0] == 0],)
            try:
                if self.off or self._closing.is_set():
                    self.dropped += taken
                elif method != "metrics" or args[0]:  # records sent before a resume are not sent again
                    self._deliver(method, args, taken)
            except Exception as error:  # a defect of ours: never let it end the worker (the queue would fill)
                self.dropped += taken
                self.log(f"warning: {self.tracker.name} {method} failed ({_short(error)}); dropped")
            finally:
                self._sent_at = time.monotonic()
                for _ in range(taken):
                    self.queue.task_done()

    def drain(self) -> None:
        """Send what is queued now and wait until it is sent or dropped (benchmarks: that CPU is the sender's)."""
        self._hurry.set()
        self.queue.join()
        if not self._closing.is_set():
            self._hurry.clear()

    def _deliver(self, method: str, args: tuple, updates: int) -> None:
        steps = [step for step, _ in args[0]] if method == "metrics" else []  # the client empties the list
        pauses = iter(RETRY_SECONDS)
        while True:
            try:
                getattr(self.tracker, method)(*args)
            except TrackerUnavailable as error:
                self.log(f"warning: {error}; {self.tracker.name} is off for this run")
                self.off = True
                return
            except Exception as error:
                if method == "open" and not _transient(error):
                    self.log(f"warning: {self.tracker.name} could not open its run ({_short(error)}); off for this run")
                    self.off = True
                    return
                if self._closing.is_set():
                    self.dropped += updates
                    return
                if not _transient(error):
                    self.dropped += updates
                    if method not in self._refused:
                        self._refused.add(method)
                        self.log(f"warning: {self.tracker.name} refused an update ({method}), dropped: {_short(error)}")
                    return
                if not self._unreachable:
                    self._unreachable = True
                    self.log(f"warning: {self.tracker.name} cannot be reached ({_short(error)}); trying again")
                if self._closing.wait(next(pauses, RETRY_SECONDS[-1])):
                    self.dropped += updates
                    return
                continue
            if self._unreachable:
                self._unreachable = False
                self.log(f"{self.tracker.name} reached again")
            if steps:
                self.tracker.run.last_step = max(self.tracker.run.last_step, *steps)
            self.changed()
            return

    def end(self) -> None:
        """No more updates: send what is queued without waiting for the next flush, then stop."""
        self._hurry.set()
        if self._unreachable:
            self._closing.set()  # waiting would only delay the exit: drop what is queued now
        self.queue.put_nowait(_END)

    def close(self, seconds: float) -> None:
        """End, let the queue empty for at most ``seconds``, then stop; what is left is dropped and counted."""
        if self._thread.is_alive() and not self._hurry.is_set():
            self.end()
        self._thread.join(seconds)
        if self._thread.is_alive():
            self._closing.set()  # no more retries: the current attempt is the last
            self._thread.join(1.0)
            self.dropped += self.queue.qsize()
        if self.dropped and not self.off:
            self.log(f"warning: {self.dropped} update(s) to {self.tracker.name} were dropped in this run")


def _short(error: BaseException) -> str:
    """The first line of an error, without any credentials in an address it quotes."""
    text = without_credentials(str(error)).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:200]


# --- What the trainer uses -------------------------------------------------------------------------------------


class Trackers:
    """The trackers ``log.report_to`` asks for, for one run on global rank 0.

    ``resumed_step`` is the step of the checkpoint this run resumed (None: a fresh start, which opens new runs);
    ``saved`` the tracker run ids that checkpoint recorded.
    """

    def __init__(
        self,
        log_section: LogSection,
        job_dir: Path,
        *,
        resumed_step: int | None,
        saved: dict | None,
        params: dict[str, str],
        log: Callable[[str], None],
    ):
        self.job_dir = Path(job_dir)
        self.upload = log_section.upload_checkpoints
        self._lock = threading.Lock()
        previous = self._previous(resumed_step, saved or {})
        self.outboxes: dict[str, Outbox] = {}
        logged = []
        if resumed_step is not None and log_section.trackers:
            logged = [(r[METRIC_STEP], metric_values(r)) for r in read_records(self.job_dir / METRICS_FILE)]
        for name in log_section.trackers:
            tracker = CLIENTS[name](getattr(log_section, name), self.job_dir, self.job_dir.name)
            try:
                tracker.prepare()
            except TrackerUnavailable as error:
                log(f"warning: {error}; {name} is off for this run")
                continue
            before = previous.get(name)
            tags = {"astrai.job": self.job_dir.name, "astrai.config_hash": params.get("config_hash", "")}
            outbox = Outbox(tracker, log, self._save)
            # The open finds what the tracker holds: the steps past it that a resume trains again are not sent
            # again (it keeps the values it has), and those up to the checkpoint that it lacks (the interrupted run
            # dropped them, or its tracker was down) come from metrics.jsonl.
            outbox.put("open", before, params, tags, resumed_step)
            if resumed_step is not None:
                outbox.put("catch_up", [(step, values) for step, values in logged if step <= resumed_step])
            self.outboxes[name] = outbox

    def _previous(self, resumed_step: int | None, saved: dict) -> dict[str, TrackerRun]:
        """The tracker runs to continue: none for a fresh start (the job dir's record of older runs goes); on a
        resume, the job dir's record where it names the checkpoint's runs, else the checkpoint's run ids."""
        if resumed_step is None:
            (self.job_dir / TRACKERS_FILE).unlink(missing_ok=True)
            return {}
        previous = read_runs(self.job_dir)
        for name, run_id in saved.items():
            if name in CLIENTS and (name not in previous or previous[name].run_id != run_id):
                previous[name] = TrackerRun(run_id)
        return previous

    def metrics(self, step: int, record: dict) -> None:
        values = metric_values(record)
        for outbox in self.outboxes.values():
            outbox.put("metrics", step, values)

    def ids(self) -> dict[str, str]:
        """The tracker run ids known so far, for the checkpoint's meta.json."""
        return {name: box.tracker.run.run_id for name, box in self.outboxes.items() if box.tracker.run.run_id}

    def close(self, state: str, checkpoint: Path | None) -> None:
        # The end reaches every tracker first; then one deadline for all of them, a stop's time is short: but a
        # tracker that writes to this machine alone gets the time its files need (LOCAL_CLOSE_SECONDS).
        upload = self.upload and state == "finished"
        for outbox in self.outboxes.values():
            outbox.put("finish", state, None if checkpoint is None else str(checkpoint), upload)
            outbox.end()
        began = time.monotonic()
        for outbox in self.outboxes.values():
            local = LOCAL_CLOSE_SECONDS if outbox.tracker.local else 0.0
            seconds = max(UPLOAD_SECONDS if upload else CLOSE_SECONDS, local)
            outbox.close(max(began + seconds - time.monotonic(), 0.0))

    def _save(self) -> None:
        """Record every tracker's run in the job dir (from the workers, after each update that arrived)."""
        with self._lock:
            runs = {name: asdict(box.tracker.run) for name, box in self.outboxes.items() if box.tracker.run.run_id}
            try:
                write_text_atomically(self.job_dir / TRACKERS_FILE, json.dumps(runs, indent=1, sort_keys=True) + "\n")
            except OSError:
                pass  # a full disk: the checkpoint's meta.json still names the runs


def report_results(
    log_section: LogSection, job_dir: Path, run_ids: dict[str, str], step: int, values: dict[str, float], log
) -> dict[str, str]:
    """Numbers computed after a run (``invoke eval``'s) into the tracker runs that made the checkpoint (``run_ids``,
    from its meta.json), at its ``step``: the MLflow run takes them as metrics at that step; the W&B run, which takes
    each of its own steps once, against a step axis of their own (``lm_eval/step``). Returns where they went (tracker
    -> run id); a tracker that cannot take them is warned about and left out."""
    sent = {}
    for name in log_section.trackers:
        run_id = run_ids.get(name)
        if run_id is None:
            log(f"warning: the checkpoint names no {name} run; the results go to metrics of the job dir only")
            continue
        tracker = CLIENTS[name](getattr(log_section, name), Path(job_dir), Path(job_dir).name)
        try:
            tracker.prepare()
            if name == TRACKER_MLFLOW:
                _mlflow_results(tracker, run_id, step, values)
            else:
                _wandb_results(tracker, run_id, step, values)
        except TrackerUnavailable as error:
            log(f"warning: {error}; the results do not go to {name}")
            continue
        except Exception as error:  # the server's or the client's: the results are on disk whatever it says
            log(f"warning: {name} did not take the results ({_short(error)}); they are in the job dir")
            continue
        sent[name] = run_id
    return sent


def _mlflow_results(tracker: MlflowTracker, run_id: str, step: int, values: dict[str, float]) -> None:
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    now = int(time.time() * 1000)
    client = MlflowClient(tracking_uri=tracker.uri)
    client.log_batch(run_id, metrics=[Metric(key, value, now, step) for key, value in values.items()])


def _wandb_results(tracker: WandbTracker, run_id: str, step: int, values: dict[str, float]) -> None:
    import wandb

    settings = tracker.settings
    handle = wandb.init(
        id=run_id,
        resume="allow" if settings.mode == "online" else None,
        project=settings.project or os.environ.get("WANDB_PROJECT") or DEFAULT_EXPERIMENT,
        entity=settings.entity,
        name=settings.run_name or tracker.job_name,
        mode=settings.mode,
        dir=str(tracker.job_dir),
        settings=wandb.Settings(
            console="off",
            save_code=False,
            silent=True,
            init_timeout=WANDB_INIT_SECONDS,
            finish_timeout=RESULTS_FINISH_SECONDS,
        ),
    )
    handle.define_metric(LM_EVAL_STEP)
    handle.define_metric(LM_EVAL_PREFIX + "*", step_metric=LM_EVAL_STEP)
    handle.log({**values, LM_EVAL_STEP: step})
    handle.finish()
    # The service writes the run's file after finish returns: wait for it (the command ends next).
    wandb.teardown()
