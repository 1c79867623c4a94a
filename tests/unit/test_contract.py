"""The host–container contract lives in astrai/common/contract.py alone, and both sides read it the same way."""

from __future__ import annotations

import json
import pkgutil
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from astrai.common import contract
from astrai.common.checkpoints import is_complete, latest_complete_checkpoint
from astrai.common.config import load_trainer_config
from astrai.common.configfile import ConfigError
from astrai.host.runtime import resolve_runtime
from astrai.trainer.loop import main as train_main

REPO = Path(__file__).resolve().parents[2]
TORCH_FREE_PACKAGES = ("astrai.common", "astrai.host", "astrai.data")
"""Layers that must import without torch: the shared rules, the host and the data tools."""
CONTAINER_START = ("astrai.trainer.entrypoint", "astrai.trainer.signals")
"""Trainer modules that run before torch is imported (the entrypoint decides how to start it)."""


def _torch_free_modules() -> list[str]:
    modules = ["tasks", "astrai", *TORCH_FREE_PACKAGES, *CONTAINER_START]
    for package in TORCH_FREE_PACKAGES:
        folder = REPO.joinpath(*package.split("."))
        modules += [info.name for info in pkgutil.walk_packages([str(folder)], prefix=f"{package}.")]
    return sorted(set(modules) - {"astrai.data.__main__"})


def test_every_layer_package_is_walked():
    found = _torch_free_modules()
    assert "astrai.host.jobs" in found and "astrai.common.contract" in found and "astrai.data.pipeline" in found


@pytest.mark.parametrize("module", _torch_free_modules())
def test_host_side_modules_import_without_torch(module):
    code = textwrap.dedent(f"""
        import sys

        class Blocker:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "safetensors", "numpy"):
                    raise ImportError("blocked " + name)
                return None

        sys.meta_path.insert(0, Blocker())
        import {module}
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


def _contract_literals() -> list[str]:
    """The string values of contract.py that are specific enough to spot when written out elsewhere.

    Metric field names are plain words ("step", "max_steps") that also name config keys, so they are left out.
    """
    values = []
    for name in dir(contract):
        value = getattr(contract, name)
        if name.isupper() and not name.startswith("METRIC_") and isinstance(value, str) and len(value) >= 6:
            values.append(value)
    return values


def test_no_module_writes_a_contract_name_out_again():
    literals = _contract_literals()
    offenders = []
    for path in sorted((REPO / "astrai").rglob("*.py")):
        if path.name == "contract.py":
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            for literal in literals:
                if re.search(r"""["']""" + re.escape(literal) + r"""["']""", code):
                    offenders.append(f"{path.name}:{number}: {literal}")
    assert offenders == [], "import these from astrai.common.contract instead:\n" + "\n".join(offenders)


def test_schema_allows_exactly_the_contract_parallel_modes():
    schema = json.loads((REPO / "schema" / "runtime.schema.json").read_text(encoding="utf-8"))
    text = json.dumps(schema)
    enums = [
        node["enum"] for node in _walk(schema) if isinstance(node, dict) and "enum" in node and "fsdp" in node["enum"]
    ]
    assert enums and all(tuple(enum) == contract.REQUESTED_PARALLEL_MODES for enum in enums), text


def _walk(node):
    yield node
    if isinstance(node, dict):
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def test_a_folder_without_rng_state_is_incomplete_for_host_and_trainer(tmp_path):
    job_dir = tmp_path / "job"
    for step, files in (
        (10, contract.REQUIRED_FILES),
        (20, [f for f in contract.REQUIRED_FILES if f != contract.RNG_FILE]),
    ):
        folder = job_dir / f"epoch_0_step_{step}"
        folder.mkdir(parents=True)
        for name in files:
            (folder / name).write_bytes(b"x")
    assert contract.RNG_FILE in contract.REQUIRED_FILES
    assert not is_complete(job_dir / "epoch_0_step_20")
    assert latest_complete_checkpoint(job_dir).step == 10


DUPLICATED = "runtime: {}\ntraining:\n  max_steps: 5\n  max_steps: 50\n"


def test_host_and_trainer_both_refuse_a_duplicated_key(tmp_path, capsys):
    path = tmp_path / "train.yaml"
    path.write_text(DUPLICATED, encoding="utf-8")
    with pytest.raises(ConfigError, match=r"train.yaml:4:3: .*duplicate key 'max_steps' \(first on line 3\)"):
        resolve_runtime(path)
    with pytest.raises(ConfigError, match=r"train.yaml:4:3: .*duplicate key 'max_steps' \(first on line 3\)"):
        load_trainer_config(path)
    assert train_main(["--config", str(path), "--dry-run"]) == 2
    assert "duplicate key 'max_steps'" in capsys.readouterr().err


def test_container_paths_derive_from_the_mount_points():
    assert contract.container_job_dir("j") == f"{contract.CONTAINER_CHECKPOINTS}/j"
    assert contract.resolve_parallel_mode("auto", 1) == "none"
    assert contract.resolve_parallel_mode("auto", 3) == "ddp"
    with pytest.raises(ValueError, match="fsdp needs 2 or more processes"):
        contract.resolve_parallel_mode("fsdp", 1)
