"""Build a trainer base image from distribution packages, for hosts that cannot pull images.

Some GPU hosts (and every CI machine of this project) reach package mirrors but
no image registry. This module makes an image that holds Python, torch,
safetensors, PyYAML, NumPy and TensorBoard (for the trainer's event files)
without pulling anything:

1. ``debootstrap --variant=minbase`` a Debian root file system with python3 and pip;
2. ``pip download`` the wheels on the host (so a local wheel cache or the
   host's pip configuration is honoured) and install them inside the root
   file system with ``chroot`` — no network needed inside it;
3. copy the host's CA bundle in, so later package downloads from inside a
   container trust the same certificates as the host;
4. ``docker import`` the tree under a tag.

The image is cached by tag: an existing tag is reused, never rebuilt.

Run it by hand::

    sudo python -m astrai.host.baseimage --tag astrai-base:bookworm-torch2.13.0-tb2.21.0-cpu

Needs root (debootstrap, chroot), ``debootstrap`` and a reachable Docker daemon.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from astrai.common.contract import TORCH_VERSION
from astrai.common.errors import AstraiError

DEFAULT_SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
DEFAULT_TORCH = f"torch=={TORCH_VERSION}"
TENSORBOARD_REQUIREMENT = "tensorboard==2.21.0"
"""Pinned alike here, in the Dockerfile and in setup.cfg (a unit test keeps them equal)."""
# The tag names what the image holds, so an image cached before TensorBoard was added is not mistaken for this one.
DEFAULT_TAG = f"astrai-base:bookworm-torch{TORCH_VERSION}-tb2.21.0-cpu"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
_DEBIAN_PACKAGES = ("python3", "python3-pip", "ca-certificates")


class BaseImageError(AstraiError):
    """The base image could not be built; the message says which step failed and why."""


def image_exists(tag: str) -> bool:
    """True when the Docker daemon already holds an image with this tag."""
    probe = subprocess.run(["docker", "image", "inspect", tag], capture_output=True, text=True)
    return probe.returncode == 0


def ensure_base_image(
    tag: str = DEFAULT_TAG,
    *,
    suite: str = DEFAULT_SUITE,
    mirror: str = DEFAULT_MIRROR,
    torch_requirement: str = DEFAULT_TORCH,
    log=print,
) -> bool:
    """Build ``tag`` unless it exists; return True when it was built now.

    Two builds of one tag at once (two test workers, two terminals) take turns: the second waits for the
    first and then finds the image there.
    """
    if image_exists(tag):
        log(f"base image {tag} is already present; reusing it")
        return False
    with _build_lock(tag):
        if image_exists(tag):
            log(f"base image {tag} was built meanwhile; reusing it")
            return False
        _build(tag, suite, mirror, torch_requirement, log)
    return True


@contextlib.contextmanager
def _build_lock(tag: str):
    name = hashlib.sha256(tag.encode()).hexdigest()[:16]
    with open(Path(tempfile.gettempdir()) / f"astrai-baseimage-{name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build(tag: str, suite: str, mirror: str, torch_requirement: str, log) -> None:
    _check_prerequisites()
    with tempfile.TemporaryDirectory(prefix="astrai-baseimage-") as work:
        rootfs = Path(work) / "rootfs"
        wheels = Path(work) / "wheels"
        log(f"debootstrap {suite} (minbase with {', '.join(_DEBIAN_PACKAGES)}) from {mirror}")
        _run(
            ["debootstrap", "--variant=minbase", f"--include={','.join(_DEBIAN_PACKAGES)}", suite, str(rootfs), mirror],
            "debootstrap",
        )
        python_version = _chroot_python_version(rootfs)
        requirements = [torch_requirement, "safetensors", "pyyaml", "numpy", TENSORBOARD_REQUIREMENT]
        log(f"pip download {' '.join(requirements)} for Python {python_version}")
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--only-binary=:all:",
                "--python-version",
                python_version,
                "--dest",
                str(wheels),
                *requirements,
            ],
            "pip download",
        )
        _install_wheels(rootfs, wheels, requirements)
        _copy_ca_bundle(rootfs)
        _trim(rootfs)
        log(f"docker import as {tag}")
        _docker_import(rootfs, tag)


def _check_prerequisites() -> None:
    if os.geteuid() != 0:
        raise BaseImageError("building a base image needs root (debootstrap and chroot); run it with sudo")
    if shutil.which("debootstrap") is None:
        raise BaseImageError("debootstrap is not installed; install it with: apt-get install debootstrap")
    if shutil.which("docker") is None:
        raise BaseImageError("the docker CLI is not installed")


def _run(command: list[str], step: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-15:])
        raise BaseImageError(f"{step} failed (exit {result.returncode}):\n{tail}")


def _chroot_python_version(rootfs: Path) -> str:
    result = subprocess.run(
        ["chroot", str(rootfs), "python3", "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise BaseImageError(f"python3 does not run inside the new root file system: {result.stderr.strip()}")
    return result.stdout.strip()


def _install_wheels(rootfs: Path, wheels: Path, requirements: list[str]) -> None:
    inside = rootfs / "tmp" / "astrai-wheels"
    shutil.copytree(wheels, inside)
    try:
        _run(
            [
                "chroot",
                str(rootfs),
                "python3",
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-index",
                "--no-cache-dir",
                "--break-system-packages",
                "--find-links",
                "/tmp/astrai-wheels",
                *requirements,
            ],
            "pip install inside the root file system",
        )
    finally:
        shutil.rmtree(inside)


def _copy_ca_bundle(rootfs: Path) -> None:
    if HOST_CA_BUNDLE.is_file():
        target = rootfs / "etc" / "ssl" / "certs" / "ca-certificates.crt"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(HOST_CA_BUNDLE, target)


def _trim(rootfs: Path) -> None:
    # Package caches are half the size of a minbase tree and useless in an image.
    for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
        folder = rootfs / cache
        if folder.is_dir():
            for entry in folder.iterdir():
                if entry.is_file():
                    entry.unlink()


def _docker_import(rootfs: Path, tag: str) -> None:
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
    importer = subprocess.run(
        [
            "docker",
            "import",
            "--change",
            "ENV LANG=C.UTF-8",
            "--change",
            "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "--change",
            'CMD ["python3"]',
            "-",
            tag,
        ],
        stdin=tar.stdout,
        capture_output=True,
        text=True,
    )
    tar.stdout.close()
    tar_status = tar.wait()
    if tar_status != 0 or importer.returncode != 0:
        raise BaseImageError(f"docker import failed: {importer.stderr.strip() or f'tar exit {tar_status}'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m astrai.host.baseimage", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default=DEFAULT_TAG, help=f"image tag to build or reuse (default {DEFAULT_TAG})")
    parser.add_argument("--suite", default=DEFAULT_SUITE, help="Debian suite for debootstrap")
    parser.add_argument("--mirror", default=DEFAULT_MIRROR, help="Debian mirror for debootstrap")
    parser.add_argument("--torch", default=DEFAULT_TORCH, help="pip requirement for torch")
    args = parser.parse_args(argv)
    try:
        ensure_base_image(args.tag, suite=args.suite, mirror=args.mirror, torch_requirement=args.torch)
    except BaseImageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
