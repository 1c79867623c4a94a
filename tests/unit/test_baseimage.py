"""The base image is built once per tag, even when two builds of it start at once."""

from __future__ import annotations

import threading
import time

from astrai.host import baseimage


def test_two_builds_of_one_tag_at_once_build_it_once(monkeypatch):
    built: list[str] = []

    def build(tag, *_args):
        time.sleep(0.3)  # long enough for the other caller to be waiting on the lock
        built.append(tag)

    monkeypatch.setattr(baseimage, "image_exists", lambda tag: tag in built)
    monkeypatch.setattr(baseimage, "_build", build)
    results, logs = [], []
    callers = [
        threading.Thread(target=lambda: results.append(baseimage.ensure_base_image("astrai-test:one", log=logs.append)))
        for _ in range(2)
    ]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert built == ["astrai-test:one"] and sorted(results) == [False, True]
    assert any("built meanwhile; reusing it" in line for line in logs), logs
