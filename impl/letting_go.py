"""Letting go of tree entries so that an interrupt cannot lose one.

An entry out of the tree is released here or by nobody: no holder lists it any more. CPython
delivers an interrupt (Ctrl-C, a run's deadline) at a call's entry or as a call returns, so a
release can be interrupted before it did anything, and an eviction after its victim left the tree
but before it was returned (``RadixTree.pop_oldest`` then leaves it in ``evicted``). Both ways of
evicting (the tree's bounds in ``Cache._keep``, a full pool in ``PoolPolicy``) go through
``evict_oldest``, and a retain's replaced entry through ``release_if_held`` too, so each handles
those windows the same way.
"""

from __future__ import annotations

from typing import Callable

from .holding import RELEASED
from .radix import RadixTree


def release_if_held(release: Callable[[object], None], entry) -> None:
    """``release(entry)`` unless it let go already: the second try, where the first raised. A release
    lets its holder go in the step its counts go down (``PagePool.release_slots``), so one interrupted
    before that leaves the entry holding its pages. Called from the ``except`` of a ``try`` around the
    first ``release`` itself: a helper making both tries would be interrupted at its own entry."""
    if entry._holding is not RELEASED:
        release(entry)


def evict_oldest(tree: RadixTree, release: Callable[[object], None], **which):
    """The least recently used entry (``RadixTree.pop_oldest``'s ``spare``/``where``) out of the tree
    and released; returns it, or None when none qualifies."""
    try:
        victim = tree.pop_oldest(**which)
    except BaseException:       # interrupted after the victim left the tree: released now or never
        victim, tree.evicted = tree.evicted, None
        if victim is not None:
            release(victim)
        raise
    if victim is not None:
        try:
            release(victim)
        except BaseException:
            release_if_held(release, victim)
            raise
    return victim
