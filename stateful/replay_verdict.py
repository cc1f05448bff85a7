"""Whether a replay showed the failure its file records, and what ``kvstate replay`` exits with.

0: every invariant holds (the failure is fixed). 1: the recorded failure reproduces (the same
kind, invariant and step), or the file records none and the replay fails. 3: the replay fails,
but not as recorded (another invariant, another exception, another step): both are printed. A
process that dies is one kind however it was recorded (``ProcessDied`` locally, ``KilledWorker``
on Dask). 2 (``kvstate replay``'s, not this module's): a bad argument or file, or a replay that did
not finish within ``--time-limit`` where the file records no hang (``replay_process``).
"""

from __future__ import annotations

from .replay import Failure

FIXED, REPRODUCED, DIFFERENT = 0, 1, 3
_DIED = frozenset({"ProcessDied", "KilledWorker"})


def kind(failure: Failure) -> tuple:
    """What a replay must show again to reproduce ``failure``: its signature (``Failure.signature``),
    a dead process under one name however it died."""
    return ("the process died" if failure.error in _DIED else failure.error, *failure.signature[1:])


def verdict(recorded: Failure | None, now: Failure | None) -> tuple[int, list[str]]:
    """The exit status and the lines that say how ``now`` compares with ``recorded``."""
    if now is None:
        return FIXED, ([f"the recorded failure no longer shows (it was: {recorded})"] if recorded else [])
    if recorded is None:
        return REPRODUCED, ["the file records no failure to compare with"]
    if kind(now) == kind(recorded) and now.step == recorded.step:
        return REPRODUCED, [f"reproduces the recorded failure ({now.error} at step {now.step})"]
    return DIFFERENT, ["fails, but NOT as recorded (exit 3):", f"  recorded: {recorded}", f"  now:      {now}"]
