"""Who a job belongs to on the host: the invoking user, or under sudo the user who ran sudo.

The container runs as this user's UID:GID and the folders the tasks create
belong to it, so checkpoints never end up owned by root just because a
command was run with sudo.
"""

from __future__ import annotations

import os
from pathlib import Path


def host_user_ids() -> tuple[int, int]:
    """(uid, gid) of the user a job runs for."""
    if os.geteuid() == 0 and os.environ.get("SUDO_UID", "").isdigit() and os.environ.get("SUDO_GID", "").isdigit():
        return int(os.environ["SUDO_UID"]), int(os.environ["SUDO_GID"])
    return os.getuid(), os.getgid()


def make_dirs(path: Path) -> list[Path]:
    """Create ``path`` and missing parents, owned by the host user; return the folders created."""
    missing = []
    current = path
    while not current.exists():
        missing.append(current)
        current = current.parent
    uid, gid = host_user_ids()
    for folder in reversed(missing):
        folder.mkdir()
        if (uid, gid) != (os.getuid(), os.getgid()):
            os.chown(folder, uid, gid)
    return list(reversed(missing))
