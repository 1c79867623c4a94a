"""Which base image the demo picks, and what it says, on hosts with and without a registry."""

from __future__ import annotations

import subprocess

import pytest

from astrai.host import baseimage, compose, demo


@pytest.fixture
def host(monkeypatch):
    """A fake host: which images exist, whether a pull works, and whether a base image gets built."""
    state = {"images": set(), "pull_ok": False, "pulled": [], "built": []}
    monkeypatch.setattr(baseimage, "image_exists", lambda tag: tag in state["images"])

    def fake_run(command, **kwargs):
        state["pulled"].append(command[-1])
        return subprocess.CompletedProcess(
            command,
            0 if state["pull_ok"] else 1,
            "",
            "" if state["pull_ok"] else "dial tcp: lookup registry: no such host",
        )

    monkeypatch.setattr(demo.subprocess, "run", fake_run)
    monkeypatch.setattr(baseimage, "ensure_base_image", lambda tag, log: state["built"].append(tag) or True)
    return state


def test_a_local_astrai_base_image_is_used_first(host):
    host["images"] = {baseimage.DEFAULT_TAG, compose.CPU_BASE_IMAGE}
    assert demo._choose_base_image() == baseimage.DEFAULT_TAG
    assert host["pulled"] == [] and host["built"] == []


def test_a_pullable_python_image_is_pulled(host):
    host["pull_ok"] = True
    assert demo._choose_base_image() == compose.CPU_BASE_IMAGE
    assert host["pulled"] == [compose.CPU_BASE_IMAGE] and host["built"] == []


def test_without_a_registry_it_builds_from_debian_packages_and_says_so(host, capsys):
    assert demo._choose_base_image() == baseimage.DEFAULT_TAG
    assert host["built"] == [baseimage.DEFAULT_TAG]
    said = capsys.readouterr().out
    assert "cannot pull" in said and "no such host" in said and "Debian packages" in said
