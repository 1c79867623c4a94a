"""`invoke board` for real: TensorBoard serves a trained job's curves, a headless browser draws them, and it stops.

The browser is Debian's ``chromium`` (``.ci/setup`` installs it). Its screenshot is kept under
``$ASTRAI_TEST_ARTIFACTS`` (default ``.test-artifacts/`` in the repository); the test prints the path.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from astrai.common.config import load_trainer_config
from astrai.common.contract import METRICS_FILE, TAG_TRAIN_LOSS
from astrai.common.metrics import read_records
from astrai.trainer.launch.distributed import init_distributed
from astrai.trainer.run.loop import open_trainer
from tests.support import REPO, free_port, interruptible, invoke

pytestmark = pytest.mark.slow

ARTIFACTS = Path(os.environ.get("ASTRAI_TEST_ARTIFACTS", REPO / ".test-artifacts"))
JOB = "test"  # the job name the train_yaml fixture writes
RUN = f"{JOB}/tensorboard"


def _get_json(url: str):
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=10) as response:
        return json.loads(response.read())


def _answers(url: str) -> bool:
    try:
        _get_json(url + "data/runs")
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def trained_job(tmp_path_factory, train_yaml):
    """A 40-step job under <tmp>/checkpoints/test with its event files; returns (config path, logged steps)."""
    import torch

    root = tmp_path_factory.mktemp("board")
    config = train_yaml(root / "train.yaml", ckpt_dir=str(root / "checkpoints" / JOB), max_steps=40)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    trainer = open_trainer(load_trainer_config(config), init_distributed("none", "cpu"))
    try:
        trainer.train()
    finally:
        trainer.close()
        torch.set_num_threads(before)
    steps = [record["step"] for record in read_records(root / "checkpoints" / JOB / METRICS_FILE)]
    return config, steps


def _chromium(*args: str) -> subprocess.CompletedProcess:
    browser = shutil.which("chromium")
    assert browser, "Debian's chromium is needed for this test: run `bash .ci/setup` (or apt-get install chromium)"
    # forceSVG: TensorBoard draws its lines as SVG paths, which show in the DOM (WebGL needs a GPU).
    return subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
            "--window-size=1600,2000",
            "--virtual-time-budget=20000",
            "--run-all-compositor-stages-before-draw",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )


def _loss_chart_points(dom: str) -> int:
    """Vertices of the line drawn in the train/loss card of the rendered page (0 when there is none)."""
    for card in dom.split("<scalar-card-component")[1:]:
        if f'title="{TAG_TRAIN_LOSS}"' not in card:
            continue
        chart = card[card.find("<line-chart ") : card.find("</line-chart>")]
        lines = re.findall(r'<path d="M([-0-9.,L]+)"[^>]*stroke', chart)
        return max((line.count("L") + 1 for line in lines), default=0)
    return 0


def test_board_serves_the_loss_a_browser_draws_it_and_stop_ends_it(trained_job):
    config, steps = trained_job
    port = free_port()
    started = invoke("board", "--config", str(config), "--port", str(port), "--background")
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        url = f"http://127.0.0.1:{port}/"
        assert f"TensorBoard at {url}" in started.stdout
        assert _get_json(url + "data/runs") == [RUN]
        scalars = _get_json(url + f"data/plugin/scalars/scalars?run={RUN}&tag={TAG_TRAIN_LOSS}")
        assert [step for _, step, _ in scalars] == steps == [10, 20, 30, 40]

        dom = _chromium("--dump-dom", url + "?forceSVG=true")
        assert dom.returncode == 0, dom.stderr[-2000:]
        assert _loss_chart_points(dom.stdout) == len(steps), dom.stdout[-3000:]
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        screenshot = ARTIFACTS / "board-train-loss.png"
        screenshot.unlink(missing_ok=True)
        shot = _chromium(f"--screenshot={screenshot}", url + "?forceSVG=true")
        assert shot.returncode == 0 and screenshot.stat().st_size > 10_000, shot.stderr[-2000:]
        print(f"screenshot of the board: {screenshot}")

        again = invoke("board", "--config", str(config), "--port", str(free_port()), "--background")
        assert again.returncode == 1 and "already runs" in again.stderr
    finally:
        stopped = invoke("board", "--config", str(config), "--stop")
    assert stopped.returncode == 0 and f"stopped the board at {url}" in stopped.stdout, stopped
    assert not _answers(url)
    assert "no board is running" in invoke("board", "--config", str(config), "--stop").stdout


def test_board_in_the_foreground_serves_every_job_and_ctrl_c_ends_it(trained_job, tmp_path):
    config, _ = trained_job
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    log = tmp_path / "board.log"
    with open(log, "wb") as output:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "invoke",
                "--search-root",
                str(REPO),
                "board",
                "--config",
                str(config),
                "--port",
                str(port),
                "--all",
            ],
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=interruptible,  # reached by the Ctrl-C even when the suite runs in the background
        )
    try:
        deadline = time.monotonic() + 90
        while not _answers(url):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.25)
        # --all serves the checkpoints folder: runs are named <job>/tensorboard.
        assert RUN in _get_json(url + "data/runs")
        os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        assert process.wait(timeout=30) == 0, log.read_text()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert not _answers(url)
    assert "Traceback" not in log.read_text()


def test_board_refuses_a_port_in_use(trained_job):
    config, _ = trained_job
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        result = invoke("board", "--config", str(config), "--port", str(busy.getsockname()[1]))
    assert result.returncode == 1
    assert "choose another with --port" in result.stderr and "Traceback" not in result.stderr
