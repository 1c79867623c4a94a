"""Values as users type them and read them: durations (``90s``, ``10m``, ``1h30m05s``, Compose's spelling), clocks
and local times, whole numbers and booleans."""

from __future__ import annotations

import re
import time

_DURATION = re.compile(r"(?:([0-9]+)h)?(?:([0-9]+)m)?(?:([0-9]+)s)?")


def parse_duration(text: str) -> int:
    """Seconds in a duration of whole hours, minutes and seconds: '90s', '10m', '1h30m'; ValueError otherwise."""
    match = _DURATION.fullmatch(text) if isinstance(text, str) and text else None
    if match is None:
        raise ValueError(f"expected a duration like 90s, 10m or 1h30m, got {text!r}"[:120])
    hours, minutes, seconds = (int(part or 0) for part in match.groups())
    total = hours * 3600 + minutes * 60 + seconds
    if total == 0:
        raise ValueError(f"a duration must be longer than zero, got {text!r}")
    return total


def format_duration(seconds: float) -> str:
    """``seconds`` in the same spelling, to the second: 1h02m03s, 2m03s, 0m05s (negative counts as zero)."""
    total = int(max(0, seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def format_clock(seconds: int) -> str:
    """Whole seconds as a clock, HH:MM:SS (Slurm's spelling of a time limit)."""
    return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def local_time(unix_time: float) -> str:
    """A moment as this host's local date and time, to the second."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix_time))


def format_bytes(count: float) -> str:
    """A size in binary units, as people read it: 512 B, 1.5 KiB, 3.2 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def whole_number(text, minimum: int, maximum: int | None = None) -> int:
    """``text`` as a whole number in range; ValueError saying what is allowed (``1e-3`` and ``one`` are refused)."""
    try:
        number = int(str(text), 10)
    except ValueError:
        number = None
    if number is None or number < minimum or (maximum is not None and number > maximum):
        allowed = f"from {minimum} to {maximum}" if maximum is not None else f"of at least {minimum}"
        raise ValueError(f"takes a whole number {allowed}, got {str(text)!r}")
    return number


TRUE_WORDS, FALSE_WORDS = ("true", "yes", "1"), ("false", "no", "0")


def boolean_word(text: str) -> bool | None:
    """A boolean as typed on a command line or in an environment (true/false, yes/no, 1/0, any case, spaces around
    it); None for any other text, which the caller refuses in its own words."""
    word = text.strip().lower() if isinstance(text, str) else None
    return True if word in TRUE_WORDS else False if word in FALSE_WORDS else None


def without_credentials(uri: str) -> str:
    """An address (or a text quoting one) with any ``user:password@`` taken out: fit to print, record or send."""
    return re.sub(r"(://)[^/@\s]*@", r"\1", uri)
