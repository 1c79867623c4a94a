"""The max-duration timer's decisions: stop only the container run it was scheduled for."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict

import pytest

from astrai.host import engine, timer


def _container(started_at: str = "2026-11-30T10:00:00.123456789Z", status: str = "running") -> engine.Container:
    return engine.Container("abc123", "astrai-j-trainer-1", status, 0, started_at, "")


def _state(path, deadline: float, started_at: str = "2026-11-30T10:00:00.123456789Z") -> None:
    state = timer.TimerState(os.getpid(), deadline, "abc123", started_at, 42, "j")
    path.write_text(json.dumps(asdict(state)))


@pytest.fixture
def stops(monkeypatch):
    calls = []
    monkeypatch.setattr(
        engine,
        "stop_container",
        lambda cid, grace: calls.append((cid, grace)) or type("Done", (), {"returncode": 0, "stderr": ""})(),
    )
    return calls


def test_deadline_reached_stops_its_container_with_the_grace_and_cleans_up(tmp_path, monkeypatch, stops):
    path = tmp_path / "timer.json"
    _state(path, deadline=time.time() - 1)
    monkeypatch.setattr(engine, "inspect_container", lambda cid: _container())
    assert timer._wait_and_stop(path) == 0
    assert stops == [("abc123", 42)]
    assert not path.exists()


def test_a_later_run_of_the_same_container_is_never_stopped(tmp_path, monkeypatch, stops):
    path = tmp_path / "timer.json"
    _state(path, deadline=time.time() - 1)
    monkeypatch.setattr(engine, "inspect_container", lambda cid: _container(started_at="2026-12-01T00:00:00Z"))
    assert timer._wait_and_stop(path) == 0
    assert stops == []


@pytest.mark.parametrize("found", [None, _container(status="exited")])
def test_a_run_that_ended_first_ends_the_timer(tmp_path, monkeypatch, stops, found):
    path = tmp_path / "timer.json"
    _state(path, deadline=time.time() + 3600)
    monkeypatch.setattr(engine, "inspect_container", lambda cid: found)
    assert timer._wait_and_stop(path) == 0
    assert stops == [] and not path.exists()


def test_a_state_file_of_another_timer_is_left_alone(tmp_path, monkeypatch, stops):
    path = tmp_path / "timer.json"
    state = timer.TimerState(os.getpid() + 1, time.time() - 1, "abc123", "x", 42, "j")
    path.write_text(json.dumps(asdict(state)))
    assert timer._wait_and_stop(path) == 0
    assert stops == [] and path.exists()


def test_read_timer_ignores_dead_or_foreign_pids(tmp_path):
    (tmp_path / "timer.json").write_text(json.dumps(asdict(timer.TimerState(os.getpid(), 1.0, "c", "s", 1, "j"))))
    assert timer.read_timer(tmp_path) is None, "this pytest process is not a timer"
    assert timer.cancel(tmp_path) is False
    assert not (tmp_path / "timer.json").exists()


def test_docker_times_parse_with_nanoseconds():
    moment = _container().started()
    assert moment is not None and (moment.year, moment.microsecond) == (2026, 123456)
    assert engine.Container("i", "n", "created", 0, "0001-01-01T00:00:00Z", "").started() is None
