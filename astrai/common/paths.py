"""Folders a command is about to use: does the path lead to a folder this process may read, write or create?

Shared by the host (``runtime.paths``), the data tools (``prepare --out``) and
``model init``: each reports a broken path as a sentence naming it, never a traceback.
Reads the disk, writes nothing.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from astrai.common.errors import AstraiError


class PathError(AstraiError):
    """A path given on a command line that cannot be used; the message names the option."""

    exit_code = 2


def output_folder(text: str, option: str) -> Path:
    """The folder a command was told to write into (``--out DIR``, ``init DIR``), checked before anything is written.

    An empty path is refused (it would mean the current folder), and so is a file, a dangling symlink or a
    folder this process may not create or write.
    """
    if not text.strip():
        raise PathError(f"{option}: the path is empty; name the folder to write")
    path = Path(text)
    problem = folder_problem(path, need="write" if path.is_dir() else "create", room=128)
    if problem is not None:
        raise PathError(f"{option}: {problem}")
    return path


def folder_problem(path: Path, *, need: str = "read", room: int = 0) -> str | None:
    """Why this process cannot use ``path`` as a folder for ``need``, else None.

    ``need`` is what the command does with an existing folder: "read" it, "write" into it, or only "create"
    it when missing. A folder that does not exist yet is fine unless it must be created and cannot be.
    ``room`` is how many bytes of path the command will add below ``path``.
    """
    existing = nearest_existing(path)
    if isinstance(existing, str):
        return existing
    too_long = length_problem(path, existing, room)
    if too_long is not None:
        return too_long
    uid = os.geteuid()
    if need != "read" and read_only(existing):
        return f"{existing} is on a read-only file system; remount it read-write or choose a folder on another disk"
    if existing != path:
        if need != "read" and not os.access(existing, os.W_OK | os.X_OK):
            return f"cannot create {path}: uid {uid} may not write in {existing}"
        return None
    if need == "write" and not os.access(path, os.W_OK | os.X_OK):
        return f"permission denied: uid {uid} may not write in {path}"
    if need == "read" and not os.access(path, os.R_OK | os.X_OK):
        return f"permission denied: uid {uid} may not read {path}"
    return None


def nearest_existing(path: Path) -> Path | str:
    """``path`` itself when it is a folder, else its nearest existing ancestor folder; a problem text if broken.

    Broken means: it or an ancestor is a file, a symlink whose target is missing, a symlink loop, or a folder
    on the way that this process may not enter.
    """
    try:
        info = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            return f"{path} is a symlink to {os.readlink(path)}, which does not exist"
        if path.parent == path:
            return f"{path} does not exist"
        return nearest_existing(path.parent)
    except NotADirectoryError:
        return next((problem for problem in map(_not_a_folder, path.parents) if problem), f"{path} is not a folder")
    except PermissionError:
        blocked = next((parent for parent in reversed(path.parents) if not os.access(parent, os.X_OK)), path.parent)
        return f"permission denied: uid {os.geteuid()} may not enter {blocked} (on the way to {path})"
    except OSError as error:
        if error.errno == errno.ELOOP:
            return f"a symlink on the way to {path} points round in a loop"
        return f"cannot inspect {path}: {error.strerror}"
    return _not_a_folder(path, info) or path


def _not_a_folder(path: Path, info: os.stat_result | None = None) -> str | None:
    """A problem text when ``path`` exists and is not a folder (None when it is one, or does not exist)."""
    try:
        info = info or os.stat(path)
    except OSError:
        return None
    if stat.S_ISDIR(info.st_mode):
        return None
    return f"{path} is a file, not a folder" if stat.S_ISREG(info.st_mode) else f"{path} is not a folder"


def read_only(path: Path) -> bool:
    """Whether ``path`` (an existing folder) sits on a file system mounted read-only."""
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def length_problem(path: Path, existing: Path, room: int) -> str | None:
    """A path too long for the file system, counting ``room`` bytes the command adds below it.

    ``existing`` is the nearest folder of ``path`` that exists (its file system sets the limits).
    """
    try:
        path_max = os.pathconf(existing, "PC_PATH_MAX")
        name_max = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        return None
    longest = max((len(os.fsencode(part)) for part in path.parts), default=0)
    if longest > name_max:
        return f"a folder name in {path} is {longest} bytes long; this file system allows {name_max}"
    length = len(os.fsencode(str(path)))
    if length + room >= path_max:
        return (
            f"the path is {length} bytes long; with the {room} bytes the job writes below it that passes this "
            f"system's limit of {path_max}: choose a shorter path"
        )
    return None
