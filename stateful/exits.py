"""How a process ended, in words: one helper for the sweep, its redraws and replays."""

from __future__ import annotations

import signal


def ended_how(code: int | None) -> str | None:
    """``"exit status 3"``, ``"signal SIGSEGV"`` (``multiprocessing``'s negative exit codes), or None
    where no status is known (the process has not been reaped)."""
    if code is None:
        return None
    if code >= 0:
        return f"exit status {code}"
    try:
        return f"signal {signal.Signals(-code).name}"
    except ValueError:
        return f"signal {-code}"
