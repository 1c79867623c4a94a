"""Real trackers for the tests: an MLflow tracking server (SQLite store, a free port, this test's folder) and W&B's own
reader of an offline run's files."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.support import free_port


@dataclass
class MlflowServer:
    process: subprocess.Popen
    port: int
    folder: Path

    @property
    def local_uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(self.local_uri)

    def stop(self) -> None:
        """Kill the server and its workers (its own process group)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)


@contextlib.contextmanager
def mlflow_server(folder: Path, port: int | None = None):
    """`mlflow server` on 0.0.0.0 (a container reaches it at host.docker.internal), stopped when the block ends."""
    folder.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    hosts = ",".join(f"{host}:{port}" for host in ("127.0.0.1", "localhost", "host.docker.internal"))
    command = [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}",
        "--artifacts-destination", str(folder / "artifacts"),
        "--host", "0.0.0.0", "--port", str(port), "--workers", "1",
        "--allowed-hosts", hosts,
    ]  # fmt: skip
    log = open(folder / "server.log", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=folder)
    server = MlflowServer(process, port, folder)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{server.local_uri}/health", timeout=2):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    log_text = (folder / "server.log").read_text()[-3000:]
                    raise AssertionError("mlflow server did not start:\n" + log_text) from None
                time.sleep(0.5)
        yield server
    finally:
        server.stop()
        log.close()


def wandb_runs(folder: Path) -> list[Path]:
    """The offline run files (``run-<id>.wandb``) under a W&B folder, oldest first."""
    return sorted(Path(path) for path in glob.glob(str(folder / "offline-run-*" / "run-*.wandb")))


def wandb_records(path: Path) -> dict:
    """An offline run's file read with W&B's own reader: its id, config and history (step -> values)."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal import datastore

    store = datastore.DataStore()
    store.open_for_scan(str(path))
    run_id, config, history = None, {}, {}
    while (data := store.scan_data()) is not None:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            items = record.history.item
            values = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in items}
            history.setdefault(record.history.step.num, []).append(values)
    return {"id": run_id, "config": config, "history": history}
