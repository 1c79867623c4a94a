"""One line of a preflight checklist: its mark, what was checked, what was found and how to fix it."""

from __future__ import annotations

from dataclasses import dataclass

PASS, FAIL, SKIP, WARN = "✓", "✗", "-", "!"


@dataclass(frozen=True)
class Check:
    mark: str
    """PASS, FAIL, SKIP (not applicable) or WARN (worth knowing); only FAIL fails the checklist."""
    name: str
    detail: str
    hint: str = ""

    @property
    def failed(self) -> bool:
        return self.mark == FAIL
