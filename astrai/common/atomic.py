"""Small host files replaced whole: a reader sees the old content or the new one, never a part."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def write_text_atomically(path: Path, text: str, mode: int = 0o600) -> None:
    """Write ``text`` into a temporary file beside ``path`` (created with ``mode``), then rename it over ``path``.

    A temporary file left by an interrupted write is replaced; ``mode`` holds from the first byte (0o600: the
    owner only, for files that name mounts, environments or pids).
    """
    temporary = path.with_name(path.name + ".tmp")
    with contextlib.suppress(FileNotFoundError):
        temporary.unlink()
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with open(descriptor, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(temporary, path)
