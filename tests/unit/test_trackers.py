"""Experiment trackers (log.report_to): settings, the outbox that never holds training up, trainer runs against a
real MLflow server (up, down at start, killed mid-run) and W&B offline, and what the host renders for them."""

from __future__ import annotations

import http.server
import io
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from astrai.common.config import build_config, parse_overrides
from astrai.common.configfile import ConfigError
from astrai.common.contract import METRICS_FILE, TAG_REPLAYED, TAG_STATE, TRACKERS_FILE, WANDB_DIR
from astrai.common.metrics import TrackerRun, read_records
from astrai.trainer.run import loop
from astrai.trainer.run.trackers import Outbox, flat_params, metric_values
from tests.support import free_port
from tests.trackers_support import mlflow_server, wandb_records, wandb_runs
from tests.unit.test_kubernetes import _validate_k8s
from tests.unit.trainer_runs import TRAINER, Run, metrics_step, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture
def health_server():
    """A stand-in that answers /health as an MLflow server does (the real server is the Docker test's)."""

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the handler's API
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
            self.wfile.write(b"OK")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


# --- Settings -------------------------------------------------------------------------------------------------


def _log(*pairs):
    return build_config(parse_overrides(list(pairs))).log


def test_report_to_takes_a_list_or_text_and_none_stands_alone():
    assert _log().report_to == ("tensorboard",)
    assert _log(("report_to", "mlflow, wandb")).trackers == ("mlflow", "wandb")
    assert _log(("report_to", "none")).report_to == ()
    settings = _log(("wandb", "{mode: offline, project: my project}"), ("mlflow", "{experiment: 1e-3}"))
    assert settings.wandb.mode == "offline" and settings.wandb.project == "my project"
    assert settings.mlflow.experiment == "1e-3"  # text stays text
    for pair, message in [
        (("report_to", "mlflow,none"), "none stands alone"),
        (("report_to", "comet"), "expected a list of tensorboard, mlflow, wandb, none"),
        (("report_to", "wandb,wandb"), "each tracker once"),
        (("wandb", "{mode: cloud}"), "log.wandb.mode: expected one of online, offline"),
        (("wandb", "{projct: x}"), "log.wandb.projct: unknown key; did you mean 'project'?"),
        (("mlflow", "[1]"), "expected a mapping of tracking_uri, experiment, run_name"),
        (("mlflow", "{"), "expected a mapping in flow style"),
    ]:
        with pytest.raises(ConfigError) as error:
            _log(pair)
        assert message in error.value.messages[0], error.value.messages


def test_metrics_become_tracker_values_and_the_config_parameters():
    record = {"step": 4, "max_steps": 9, "time": 1.0, "loss": 2.5, "lr": 1e-3, "tokens_per_source": {"wiki/ä b": 64}}
    assert metric_values(record) == {"loss": 2.5, "lr": 1e-3, "tokens/wiki/ä b": 64.0}
    assert metric_values({"loss": float("nan"), "tokens_per_source": {"a|b": 1}}) == {"tokens/a_b": 1.0}
    params = flat_params({"training": {"max_lr": 3e-4, "rewards": []}, "log": {"wandb": {"mode": "offline"}}})
    assert params == {"training.max_lr": "0.0003", "training.rewards": "[]", "log.wandb.mode": "offline"}


# --- The outbox -----------------------------------------------------------------------------------------------


class FakeTracker:
    name = "fake"

    def __init__(self, failures: int = 0, pause: float = 0.0, error: Exception | None = None):
        self.run = TrackerRun("r1")
        self.skip_through = 0
        self.sent: list[int] = []
        self.requests = 0
        self.failures, self.pause, self.error = failures, pause, error

    def metrics(self, records):
        self.requests += 1
        time.sleep(self.pause)
        if self.failures:
            self.failures -= 1
            raise self.error or ConnectionError("connection refused")
        self.sent += [step for step, _ in records]


def test_metrics_records_go_out_together_at_most_once_a_flush_period(monkeypatch):
    monkeypatch.setattr("astrai.trainer.run.trackers.FLUSH_SECONDS", 0.5)
    tracker = FakeTracker()
    outbox = Outbox(tracker, print, lambda: None)
    for step in range(1, 21):
        outbox.put("metrics", step, {"loss": 1.0})
        time.sleep(0.02)
    began = time.monotonic()
    outbox.close(5.0)
    assert time.monotonic() - began < 1.0  # the rest goes out at once, and the worker ends
    assert tracker.sent == list(range(1, 21)) and tracker.run.last_step == 20
    assert 2 <= tracker.requests <= 4  # the first at once, then one a period, the rest at the end


def test_a_slow_tracker_never_holds_the_trainer_up_and_what_overflows_is_counted():
    lines: list[str] = []
    tracker = FakeTracker(pause=0.2)
    outbox = Outbox(tracker, lines.append, lambda: None, capacity=3)
    began = time.perf_counter()
    for step in range(1, 11):
        outbox.put("metrics", step, {"loss": 1.0})
        time.sleep(0.001)
    assert time.perf_counter() - began < 0.1
    outbox.close(5.0)
    assert len(tracker.sent) + outbox.dropped == 10 and outbox.dropped >= 6
    assert tracker.sent == sorted(tracker.sent)
    assert any("not keeping up" in line for line in lines)
    assert any(f"{outbox.dropped} update(s) to fake were dropped" in line for line in lines)


def test_an_unreachable_tracker_gets_its_updates_in_order_once_it_answers(monkeypatch):
    monkeypatch.setattr("astrai.trainer.run.trackers.RETRY_SECONDS", (0.05,))
    lines: list[str] = []
    tracker = FakeTracker(failures=3)
    outbox = Outbox(tracker, lines.append, lambda: None)
    for step in (2, 4, 6):
        outbox.put("metrics", step, {"loss": 1.0})
    outbox.close(5.0)
    assert tracker.sent == [2, 4, 6] and outbox.dropped == 0 and tracker.run.last_step == 6
    assert [line.split(" (")[0] for line in lines] == ["warning: fake cannot be reached", "fake reached again"]


def test_a_refused_update_is_dropped_and_said_once():
    lines: list[str] = []
    tracker = FakeTracker(failures=2, error=ValueError("INVALID_PARAMETER_VALUE: bad key"))
    outbox = Outbox(tracker, lines.append, lambda: None)
    for step in (1, 2, 3):
        outbox.put("metrics", step, {})
        outbox.drain()  # a request each
    outbox.close(5.0)
    assert tracker.sent == [3] and outbox.dropped == 2
    assert sum("refused an update" in line for line in lines) == 1


# --- Trainer runs -----------------------------------------------------------------------------------------------


def _train(path: Path, **overrides) -> str:
    """Run the trainer in this process; its output."""
    argv = ["--config", str(path)]
    for key, value in overrides.items():
        argv += [f"--{key}", str(value)]
    output = io.StringIO()
    # main() installs the trainer's stop handlers and, at its end, ignores SIGINT and SIGTERM: put this process's
    # own back, or every process it starts later (a Ctrl-C test's `invoke start`) would inherit "ignore".
    handlers = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        with redirect_stdout(output):
            assert loop.main(argv) == 0
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
    # What the trainer's process does as it exits (W&B's atexit hook): wait for W&B's service to close the run's
    # files. run.finish() returns once the service has the last record, and the service writes and closes the file
    # on its own time after that: read in the same process at once, a loaded machine's file could still lack it all.
    wandb = sys.modules.get("wandb")
    if wandb is not None:
        wandb.teardown()
    return output.getvalue()


def test_wandb_offline_and_mlflow_file_store_continue_the_same_runs_after_a_resume(tmp_path, job_yaml, one_thread):
    from mlflow.tracking import MlflowClient

    config = job_yaml(max_steps=12, ckpt_interval=4, log_interval=1, report_to="mlflow,wandb")
    settings = {"wandb": "{mode: offline}"}
    job = tmp_path / "ckpt"
    _train(config, **settings)
    shutil.rmtree(job / "epoch_0_step_12")  # resume at 8: steps 9 to 12 are trained again
    # The job dir's record wrong both ways, as a kill leaves it: a request that got through unrecorded (MLflow), a
    # block of W&B's file lost. The resume goes by what the trackers hold.
    record = json.loads((job / TRACKERS_FILE).read_text())
    record["mlflow"]["last_step"], record["wandb"]["last_step"] = 2, 20
    (job / TRACKERS_FILE).write_text(json.dumps(record))
    output = _train(config, **settings)
    assert "resumed from" in output
    expected = {record["step"]: record["loss"] for record in read_records(job / METRICS_FILE)}
    saved = json.loads((job / TRACKERS_FILE).read_text())
    assert saved["wandb"]["last_step"] == saved["mlflow"]["last_step"] == 12

    runs = [wandb_records(path) for path in wandb_runs(job / WANDB_DIR)]
    assert [each["id"] for each in runs] == [saved["wandb"]["run_id"]] * 2
    assert [sorted(each["history"]) for each in runs] == [list(range(1, 13)), []]
    assert {step: values[0]["loss"] for step, values in runs[0]["history"].items()} == expected

    client = MlflowClient(f"file://{job}/mlruns")
    run = client.get_run(saved["mlflow"]["run_id"])
    assert {point.step: point.value for point in client.get_metric_history(run.info.run_id, "loss")} == expected
    assert len(client.get_metric_history(run.info.run_id, "loss")) == 12
    assert run.data.tags[TAG_REPLAYED] == "9-12" and run.data.tags[TAG_STATE] == "finished"
    assert run.data.params["log.report_to"] == '["mlflow", "wandb"]'


def test_an_offline_run_that_opens_late_is_still_written_whole_before_the_trainer_ends(
    tmp_path, job_yaml, one_thread, monkeypatch
):
    """On a loaded machine W&B's service may take longer to open a run than a short (resumed) run takes to train:
    the end waits for a tracker that needs no network (its files are this machine's), so the offline run holds
    its run record, every step and its end; a tracker with a server gets CLOSE_SECONDS."""
    from astrai.trainer.run import trackers

    monkeypatch.setattr(trackers, "CLOSE_SECONDS", 0.5)
    opened = trackers.WandbTracker.open

    def late(self, *args):
        time.sleep(3)  # longer than the run lasts after it is asked to end
        return opened(self, *args)

    monkeypatch.setattr(trackers.WandbTracker, "open", late)
    output = _train(job_yaml(max_steps=2, log_interval=1, report_to="wandb"), wandb="{mode: offline}")
    assert "dropped" not in output, output
    run_id = json.loads((tmp_path / "ckpt" / TRACKERS_FILE).read_text())["wandb"]["run_id"]
    (run,) = [wandb_records(path) for path in wandb_runs(tmp_path / "ckpt" / WANDB_DIR)]
    assert run["id"] == run_id and sorted(run["history"]) == [1, 2]
    settings = SimpleNamespace(tracking_uri=None, experiment=None, run_name=None)
    store, server = trackers.MlflowTracker(settings, tmp_path, "job"), trackers.MlflowTracker(settings, tmp_path, "job")
    store.uri, server.uri = f"file://{tmp_path}/mlruns", "http://127.0.0.1:5000"
    assert store.local and not server.local
    assert not trackers.WandbTracker(SimpleNamespace(mode="online"), tmp_path, "job").local


def test_a_run_from_scratch_opens_new_tracker_runs(tmp_path, job_yaml, one_thread):
    config = job_yaml(max_steps=2, log_interval=1, report_to="wandb")
    _train(config, wandb="{mode: offline}")
    first = json.loads((tmp_path / "ckpt" / TRACKERS_FILE).read_text())["wandb"]["run_id"]
    for folder in (tmp_path / "ckpt").glob("epoch_*"):
        shutil.rmtree(folder)
    _train(config, wandb="{mode: offline}")
    assert json.loads((tmp_path / "ckpt" / TRACKERS_FILE).read_text())["wandb"]["run_id"] != first


def test_a_tracker_that_is_down_at_start_is_warned_and_training_finishes(tmp_path, job_yaml, one_thread):
    config = job_yaml(max_steps=6, log_interval=1, report_to="mlflow")
    began = time.monotonic()
    output = _train(config, mlflow=f"{{tracking_uri: 'http://127.0.0.1:{free_port()}'}}")
    assert "warning: mlflow cannot be reached" in output
    assert "update(s) to mlflow were dropped in this run" in output
    assert time.monotonic() - began < 60
    assert read_records(tmp_path / "ckpt" / METRICS_FILE)[-1]["step"] == 6


def test_a_tracker_killed_mid_run_never_stops_training(tmp_path, train_yaml):
    """A real server of the test's own, killed once the run has sent a few steps: the run goes on to its end."""
    job = tmp_path / "ckpt"
    config = train_yaml(tmp_path / "train.yaml", ckpt_dir=str(job), max_steps=400, log_interval=2)
    with mlflow_server(tmp_path / "mlflow") as own:
        overrides = ["--report_to", "mlflow", "--mlflow", f"{{tracking_uri: '{own.local_uri}'}}"]
        run = Run([*TRAINER, "--config", str(config), *overrides], {**_env(), "OMP_NUM_THREADS": "1"}, tmp_path / "log")
        wait_for(lambda: _sent(job) >= 2, run, timeout=180)  # the first request got through
        own.stop()
        assert run.wait(timeout=300) == 0, run.output()[-3000:]
    output = run.output()
    assert metrics_step(job) == 400
    assert "warning: mlflow cannot be reached" in output, output[-3000:]
    assert "update(s) to mlflow were dropped in this run" in output


def test_preflight_says_whether_each_tracker_answers(tmp_path, health_server, monkeypatch):
    from astrai.host.runtime import resolve_runtime
    from astrai.host.tracker_checks import mlflow_check, wandb_check

    (tmp_path / "train.yaml").write_text(yaml.safe_dump({"runtime": {"job_name": "t", "gpu": {"devices": "none"}}}))
    runtime = resolve_runtime(tmp_path / "train.yaml")
    log = _log(("mlflow", f"{{tracking_uri: 'http://host.docker.internal:{health_server}'}}"))
    assert mlflow_check(runtime, log.mlflow).mark == "✓"
    down = mlflow_check(runtime, _log(("mlflow", f"{{tracking_uri: 'http://127.0.0.2:{free_port()}'}}")).mlflow)
    assert down.mark == "!" and "does not answer" in down.detail and "log.mlflow.tracking_uri" in down.detail
    local = mlflow_check(runtime, _log(("mlflow", "{tracking_uri: 'http://localhost:5000'}")).mlflow)
    assert local.mark == "!" and "host.docker.internal:5000" in local.hint
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    missing = wandb_check(runtime, _log().wandb)
    assert missing.mark == "!" and "WANDB_API_KEY" in missing.detail
    monkeypatch.setenv("WANDB_API_KEY", "k")
    assert wandb_check(runtime, _log().wandb).mark == "✓"


# --- What the host renders ----------------------------------------------------------------------------------------


def _job(tmp_path: Path, runtime: dict | None = None) -> Path:
    block = {"job_name": "trk", "gpu": {"devices": "none"}, "paths": {"data": "d", "model": "m", "checkpoints": "c"}}
    block.update(runtime or {})
    trainer = {"log": {"report_to": ["mlflow", "wandb"], "wandb": {"mode": "offline"}}}
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({"runtime": block, **trainer}))
    for name in ("d", "m", "c"):
        (tmp_path / name).mkdir(exist_ok=True)
    return path


SECRET = "s3cret-value-never-written"


@pytest.fixture
def secrets_set(monkeypatch):
    for name in ("MLFLOW_TRACKING_TOKEN", "WANDB_API_KEY", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(name, SECRET)


def test_the_compose_override_passes_the_tracker_variables_by_name_and_builds_the_clients_in(tmp_path, secrets_set):
    from astrai.host import compose
    from astrai.host.runtime import resolve_runtime

    runtime = resolve_runtime(_job(tmp_path))
    document = compose.render_override(runtime, uid=1000, gid=1000)
    service = document["services"]["trainer"]
    assert service["build"]["args"]["TRACKER_PACKAGES"] == "mlflow-skinny==3.17.2 wandb==0.28.2"
    assert service["environment"]["WANDB_API_KEY"] is None and service["environment"]["MLFLOW_TRACKING_TOKEN"] is None
    assert service["extra_hosts"] == ["host.docker.internal:host-gateway"]
    assert SECRET not in compose.dump_override(runtime, document)
    # Asked after -- only: the same.
    plain = _job(tmp_path)
    plain.write_text(yaml.safe_dump({"runtime": yaml.safe_load(plain.read_text())["runtime"]}))
    runtime = resolve_runtime(plain)
    assert (
        "WANDB_API_KEY"
        not in compose.render_override(runtime, uid=1000, gid=1000)["services"]["trainer"]["environment"]
    )
    args = compose.render_override(runtime, ["--report_to", "wandb"], uid=1000, gid=1000)["services"]["trainer"]
    assert args["build"]["args"]["TRACKER_PACKAGES"] == "wandb==0.28.2" and "WANDB_API_KEY" in args["environment"]


def test_manifests_and_the_sbatch_script_name_the_secrets_without_their_values(tmp_path, secrets_set):
    from astrai.host import kubernetes, slurm_script
    from astrai.host.runtime import resolve_runtime

    kube = {"kubernetes": {"image": "r/i:1", "claims": {"data": "d", "model": "m", "checkpoints": "c"}}}
    runtime = resolve_runtime(_job(tmp_path, {**kube, "slurm": {"launcher": "pyxis", "image": "r/i:1"}}))
    objects = kubernetes.render_manifests(runtime)
    text = kubernetes.dump_manifests(runtime, objects)
    assert SECRET not in text
    job = next(item for item in objects if item["kind"] == "Job")
    env = {item["name"]: item for item in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    reference = env["WANDB_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert reference == {"name": "astrai-trk-trackers", "key": "WANDB_API_KEY", "optional": True}
    assert "value" not in env["MLFLOW_TRACKING_TOKEN"]
    for document in objects:
        if document["kind"] != "ConfigMap":
            _validate_k8s(document)  # the Secret references as the API server reads them
    script = slurm_script.render_script(runtime)
    assert SECRET not in script and "# WANDB_API_KEY is passed through from the environment sbatch was run in" in script


def _sent(job: Path) -> int:
    try:
        return json.loads((job / TRACKERS_FILE).read_text())["mlflow"]["last_step"]
    except (OSError, ValueError, KeyError):
        return 0


def _env() -> dict:
    import os

    return {key: value for key, value in os.environ.items() if not key.startswith(("MLFLOW_", "WANDB_"))}


def test_the_trainer_runs_without_the_clients_installed(tmp_path, job_yaml):
    """No MLflow client in this interpreter: one clear warning, and training goes on."""
    config = job_yaml(max_steps=2, log_interval=1, report_to="mlflow")
    blocker = (
        "import sys\n"
        "class B:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'mlflow': raise ImportError(name)\n"
        "sys.meta_path.insert(0, B())\n"
        "from astrai.trainer.run.loop import main\n"
        f"raise SystemExit(main(['--config', {str(config)!r}]))\n"
    )
    result = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "mlflow-skinny==3.17.2 is not installed here" in result.stdout
    assert threading.active_count() >= 1


def test_status_shows_each_tracker_run_as_the_host_sees_it(tmp_path):
    from astrai.host.runtime import resolve_runtime
    from astrai.host.status import _tracker_line

    runtime = resolve_runtime(_job(tmp_path))
    offline = TrackerRun("k2m9", "/checkpoints/trk/wandb/offline-run-1-k2m9", 40)
    assert _tracker_line(runtime, offline) == f"{runtime.job_dir}/wandb/offline-run-1-k2m9 (run k2m9, step 40 sent)"
    store = TrackerRun("1a", "file:///checkpoints/trk/mlruns/#/experiments/1/runs/1a", 3)
    assert _tracker_line(runtime, store).startswith(f"file://{runtime.job_dir}/mlruns/#/")
    host_run = TrackerRun("k2", "/srv/x/checkpoints/trk/wandb/offline-run-1-k2", 4)  # a host-run job: left alone
    assert _tracker_line(runtime, host_run).startswith("/srv/x/checkpoints/trk/wandb/")
    online = TrackerRun("8c1f", "http://mlflow:5000/#/experiments/3/runs/8c1f", 12)
    assert _tracker_line(runtime, online) == "http://mlflow:5000/#/experiments/3/runs/8c1f (run 8c1f, step 12 sent)"


def test_a_resume_sends_the_steps_a_tracker_never_got(tmp_path, job_yaml, one_thread):
    """MLflow down for the whole first run: the resume's run gets those steps from metrics.jsonl, each once."""
    from mlflow.tracking import MlflowClient

    config = job_yaml(max_steps=6, ckpt_interval=3, log_interval=1, report_to="mlflow")
    output = _train(config, mlflow=f"{{tracking_uri: 'http://127.0.0.1:{free_port()}'}}")
    assert "update(s) to mlflow were dropped" in output
    _train(config, max_steps=9)  # no server named: the job dir's file store
    job = tmp_path / "ckpt"
    saved = json.loads((job / TRACKERS_FILE).read_text())["mlflow"]
    client = MlflowClient(f"file://{job}/mlruns")
    history = client.get_metric_history(saved["run_id"], "loss")
    expected = {record["step"]: record["loss"] for record in read_records(job / METRICS_FILE)}
    assert sorted(point.step for point in history) == list(range(1, 10))
    assert {point.step: point.value for point in history} == expected
