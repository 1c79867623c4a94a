"""Settings shared by the unit and Docker tests."""

from __future__ import annotations

import shutil
import tempfile


def pytest_configure(config):
    # Two test runs at once (two checkouts, a developer and CI) must not share pytest's numbered
    # temp folders, which each run prunes; give every run its own unless --basetemp names one.
    if config.option.basetemp is None and not hasattr(config, "workerinput"):
        config.option.basetemp = tempfile.mkdtemp(prefix="astrai-pytest-")
        config._astrai_own_basetemp = config.option.basetemp


def pytest_unconfigure(config):
    own = getattr(config, "_astrai_own_basetemp", None)
    if own is not None:
        shutil.rmtree(own, ignore_errors=True)
