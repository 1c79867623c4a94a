"""Image rebuild after a code-only change, against a full build with no cache.

Both build the trainer image of a throwaway job from a copy of the project, so
the real working tree is never touched. The base image is the local one the
job names, so neither build downloads anything.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from astrai.host import compose
from bench.common import REPO, Figures, write_config

JOB = "bench-build"


def _copy_project(target: Path) -> Path:
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        source = REPO / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


def _build(project: Path, config: Path, *extra: str) -> float:
    # Run the copy's own compose files through its own `docker compose` command line.
    code = (
        "import sys; from astrai.host import compose, runtime; r = runtime.resolve_runtime(sys.argv[1]); "
        "compose.write_override(r); import subprocess; "
        "sys.exit(subprocess.run(compose.compose_command(r, 'build', *sys.argv[2:], 'trainer'), "
        "capture_output=True).returncode)"
    )
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", code, str(config), *extra],
        cwd=project,
        check=True,
        env={"PYTHONPATH": str(project), "PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(Path.home())},
    )
    return time.perf_counter() - start


def _image_id(image: str) -> str:
    found = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", image], capture_output=True, text=True)
    return found.stdout.strip()


def run(quick: bool, base_image: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="astrai-bench-build-") as work:
        project = _copy_project(Path(work) / "project")
        jobs = Path(work) / "job"
        (jobs / "checkpoints" / JOB).mkdir(parents=True)
        config = write_config(
            jobs,
            {"job_name": JOB, "gpu": {"devices": "none"}, "container": {"cuda_tag": "cpu", "base_image": base_image}},
        )
        image = f"{compose.project_name(JOB)}-trainer"
        built = []  # every build leaves an image; earlier ones lose their tag but still take space
        try:
            full = _build(project, config, "--no-cache")
            built.append(_image_id(image))
            rebuilds = []
            for attempt in range(2 if quick else 3):
                with open(project / "astrai" / "__init__.py", "a", encoding="utf-8") as handle:
                    handle.write(f"# code change {attempt}\n")
                rebuilds.append(_build(project, config))
                built.append(_image_id(image))
        finally:
            subprocess.run(["docker", "image", "rm", "--force", image, *filter(None, built)], capture_output=True)
    figures = Figures()
    figures.median("full_build_s", [full])
    figures.median("rebuild_code_change_s", rebuilds)
    figures.quotient("rebuild_vs_full", "rebuild_code_change_s", "full_build_s")
    return figures
