"""The host–container contract lives in astrai/common/contract.py alone, and both sides read it the same way."""

from __future__ import annotations

import json
import pkgutil
import re
import subprocess
import sys
import textwrap

import pytest

from astrai.common import contract
from astrai.common.checkpoints import is_complete, latest_complete_checkpoint
from astrai.common.config import load_trainer_config
from astrai.common.configfile import ConfigError
from astrai.host.runtime import resolve_runtime
from astrai.trainer.run.loop import main as train_main
from tests.support import REPO, placeholder_checkpoint

TORCH_FREE_PACKAGES = ("astrai.common", "astrai.host", "astrai.data")
"""Layers that must import without torch: the shared rules, the host and the data tools."""
CONTAINER_START = ("astrai.trainer.launch.entrypoint", "astrai.trainer.launch.signals")
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


def test_the_seed_s_five_files_make_a_checkpoint_for_host_and_trainer_alike(tmp_path):
    """1000 folders with the seed's five files (no rng_state.safetensors) are all listed, newest last."""
    job_dir = tmp_path / "job"
    assert contract.REQUIRED_FILES == ("meta.json", "config.json", "model.safetensors", "optimizer.pt", "scheduler.pt")
    for step in range(1, 1001):
        placeholder_checkpoint(job_dir, 0, step)
    assert not (job_dir / "epoch_0_step_1" / contract.RNG_FILE).exists()
    assert is_complete(job_dir / "epoch_0_step_1000")
    assert latest_complete_checkpoint(job_dir).step == 1000


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


def test_no_file_cites_a_document_outside_the_repository():
    cited = []
    for path in [*REPO.glob("*.md"), *REPO.glob("*.py"), *(REPO / "docs").rglob("*.md")]:
        cited += [f"{path.name}: {m}" for m in re.findall(r"DESIGN(?:\.md)? ?§?\d*|\.\./shared/\w+", path.read_text())]
    for folder in ("astrai", "tests", "bench"):
        for path in (REPO / folder).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            cited += [f"{path.relative_to(REPO)}: {m}" for m in re.findall(r"DESIGN(?:\.md)?(?: ?§\d+| section)", text)]
    assert cited == [], cited


@pytest.mark.slow
def test_a_wheel_carries_the_schema_and_the_compose_file(tmp_path):
    """A non-editable install has no schema/ or compose/ beside it: the package must hold both."""
    import shutil
    import zipfile

    source = tmp_path / "source"
    skipped = (".git", "build", "*.egg-info", "__pycache__", ".*cache", "demo", "checkpoints", ".test-artifacts")
    shutil.copytree(REPO, source, symlinks=True, ignore=shutil.ignore_patterns(*skipped))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            ".",
        ],
        cwd=source,
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("astrai_train-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read("astrai/host/runtime.schema.json") == (REPO / "schema" / "runtime.schema.json").read_bytes()
        assert archive.read("astrai/host/docker-compose.yml") == (REPO / "compose" / "docker-compose.yml").read_bytes()
        assert "astrai/trainer/checkpoint/manager.py" in archive.namelist()
