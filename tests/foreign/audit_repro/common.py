"""Replay a hand-written operation sequence through the suite's own ``Lockstep`` (engine beside the
reference, checks after every step), against the audit's engine and one planted bug."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from foreign import audit_bugs, audit_minimal  # noqa: E402
from kvstate.stateful import ops as O  # noqa: E402,F401
from kvstate.stateful.lockstep import Lockstep  # noqa: E402

CONFIGS = {c.name: c for c in audit_minimal.factory.configs}


def run(factory, config, script) -> str:
    """``script(run)`` applies operations, each followed by ``Lockstep.check`` (every invariant, and
    for a black box the probe of every entry); returns 'pass' or the suite's message."""
    lock = Lockstep(factory, config)
    apply = lock.apply

    def apply_and_check(op, *args, **kwargs):      # as the random engines do: every check after every step
        handle = apply(op, *args, **kwargs)
        lock.check()
        return handle
    lock.apply = apply_and_check
    try:
        script(lock)
        lock.check()
        lock.finish()
    except AssertionError as e:         # InvariantViolation
        return f"FAIL: {type(e).__name__}: {e}"
    return "pass"


def both(bug: str, config_name: str, script) -> None:
    config = CONFIGS[config_name]
    print(f"{config_name}: correct engine: {run(audit_minimal.factory, config, script)}")
    print(f"{config_name}: planted {bug}: {run(getattr(audit_bugs, bug), config, script)}")


def ctx(lock, tokens, seed=0):
    h = lock.apply(O.Allocate())
    lock.apply(O.Extend(h, tuple(tokens), seed=seed))
    return h


def retain_new(lock, tokens, seed=0):
    h = ctx(lock, tokens, seed)
    lock.apply(O.Retain(h))
    lock.apply(O.Close(h))


def match_close(lock, tokens):
    h = lock.apply(O.Match(tuple(tokens)))
    lock.check()
    lock.apply(O.Close(h))
