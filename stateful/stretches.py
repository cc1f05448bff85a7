"""Which steps of a generated run go unobserved: the last few of every stretch, checked after the last.

Observing a backend (``observe()``, a read) may settle what it keeps lazily: queued refcount changes, a
batch of frees. A run that observes before every step never meets the unsettled state, so a bug in it
passes (an audit's backend, s74, freeing a page that a retain and a clear queued together left held).
The Hypothesis machine and the seeded runs (``kvstate sweep``, conform's ``seeded``) both leave the last
``QUIET_STEPS`` of every ``QUIET_EVERY`` operations unobserved and check after the last of them.

Set by the step count, not drawn: a draw for it changed every sequence the machine makes, and a planted
bug the old sequences found went unfound. A replay file records the steps so run (by number), since a
shrink keeps some and drops others: ``replay.AsWatched``.
"""

from __future__ import annotations

QUIET_EVERY, QUIET_STEPS = 16, 4


def unobserved(step: int) -> bool:
    """Whether operation ``step`` (counted from 0) runs with nothing observed before it."""
    return step % QUIET_EVERY >= QUIET_EVERY - QUIET_STEPS


def ends_stretch(step: int) -> bool:
    """Whether operation ``step`` (from 0) is the last of an unobserved stretch: checked after."""
    return step % QUIET_EVERY == QUIET_EVERY - 1


def numbered(count: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The steps of a run of ``count`` operations left unobserved, and those checked after, numbered from 1
    as a replay file numbers them."""
    return (tuple(step + 1 for step in range(count) if unobserved(step)),
            tuple(step + 1 for step in range(count) if ends_stretch(step)))
