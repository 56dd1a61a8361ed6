"""Faults that repeat (a flood of bad connections, of malformed messages): logged once per interval,
with a count of those held back, never once per occurrence."""

from __future__ import annotations

import time


class OncePer:
    """Lets a repeated fault through once per ``interval_s`` (with the count held back since)."""

    def __init__(self, interval_s: float = 60.0):
        self.interval_s, self.last, self.held = interval_s, -float("inf"), 0

    def allow(self) -> int | None:
        """None to hold this one back, else how many were held back before it."""
        now = time.monotonic()
        if now - self.last < self.interval_s:
            self.held += 1
            return None
        held, self.last, self.held = self.held, now, 0
        return held

    @staticmethod
    def since(held: int) -> str:
        return f"; {held} more since the last report" if held else ""
