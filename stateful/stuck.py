"""Where a check abandoned past its time limit is stuck: read off its thread's stack.

``run_with_limit`` (``conform.py``) cannot stop a check whose backend hangs, only stop waiting for
it; the thread is still there, stuck, and its frames say where (``sys._current_frames``).
"""

from __future__ import annotations

import sys

from .frames import frame_place, not_the_backends
from .lockstep import Lockstep


def stuck_at(ident: int | None) -> str:
    """``; its thread is at ...`` (``waiting_at``) for an abandoned check's thread; "" once it is gone."""
    where = waiting_at(ident)
    return f"; its thread is {where}" if where else ""


def waiting_at(ident: int | None) -> str:
    """Where thread ``ident`` is now (``sys._current_frames``): ``at`` its innermost frame, the
    innermost frame of the backend's own code where that is further out (not the standard library,
    an installed package or the suite), and the operation the lockstep driver was applying, where
    one is on its stack. "" once the thread is gone."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    if frame is None:
        return ""
    found = f"at {frame_place(frame)}"
    caller, op = frame, None
    while caller is not None and not_the_backends(caller):
        caller = caller.f_back
    if caller is not None and caller is not frame:
        found += f", called from {frame_place(caller)}"
    while frame is not None and op is None:
        op = frame.f_locals.get("op") if frame.f_code is Lockstep.apply.__code__ else None
        frame = frame.f_back
    return found if op is None else f"{found}, applying {op}"
