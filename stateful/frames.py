"""Frames of a stack, told apart: the backend's own code, or the standard library, an installed
package or this suite (what a report points past, to the backend's line).

Used by the reports of an exception the backend raised (``raised_at``) and of a check stuck past
its time limit (``stuck.py``); it imports nothing of the suite, so the lockstep driver can use it.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path


def frame_place(frame, line: int | None = None) -> str:
    """``FILE:LINE in FUNCTION`` of ``frame``, at ``line`` (a traceback's) or where it is now."""
    return f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno if line is None else line} in {frame.f_code.co_name}"


# Code that is not the backend's: the standard library, installed packages, and this suite.
_NOT_THE_BACKEND = tuple(os.path.realpath(path) + os.sep for path in {
    *(sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")),
    str(Path(__file__).resolve().parent)})


def not_the_backends(frame) -> bool:
    return os.path.realpath(frame.f_code.co_filename).startswith(_NOT_THE_BACKEND)


# Where the suite's own checks raise their assertions (invariants, the lockstep, directed checks, fuzzers).
_THE_SUITES = tuple(os.path.realpath(Path(__file__).resolve().parent.parent / part) + os.sep
                    for part in ("stateful", "spec", "fuzz"))


def suite_assertion(error: BaseException) -> bool:
    """Whether ``error`` is one of the suite's own checks failing: an ``AssertionError`` raised in the
    suite's code. A backend's own ``assert`` (real engines assert a lot) is the backend raising."""
    if not isinstance(error, AssertionError):
        return False
    tb = error.__traceback__
    if tb is None:
        return True
    while tb.tb_next is not None:
        tb = tb.tb_next
    return os.path.realpath(tb.tb_frame.f_code.co_filename).startswith(_THE_SUITES)


def raised_at(error: BaseException) -> str:
    """`` at FILE:LINE in FUNCTION`` of the innermost frame that raised ``error``, and the backend's
    own line that called it where that frame is library code (``not_the_backends``); "" for
    the suite's own assertion (``suite_assertion``) or an error with no traceback."""
    if suite_assertion(error) or error.__traceback__ is None:
        return ""
    frames, tb = [], error.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    where = f" at {frame_place(*frames[-1])}"
    if not_the_backends(frames[-1][0]):
        caller = next((found for found in reversed(frames) if not not_the_backends(found[0])), None)
        if caller is not None:
            where += f", called from {frame_place(*caller)}"
    return where
