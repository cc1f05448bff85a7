"""Refcounts: the pool's one int64 array of them, and the shares a fork or hit defers.

A page's refcount is the number of holders (contexts, tree entries) listing it; it lives in
slot ``Page.ref`` of one array, so a fork or match of k pages adds to k counts in one
vectorised step. That step is itself deferred: a fork records "one more holder of these pages"
as one count on what it shares (a holding or a run of slots), added to the array only when
something reads a count (``Refcounts.counts``), so a fork closed before anything looks costs
no step at all. ``pages.PagePool`` owns one ``Refcounts`` and grows its array.
"""

from __future__ import annotations

import numpy as np


class Refcounts:
    """The pool's refcount array, in a box the pages share: it is replaced when it grows, and a
    page reaching it through the box rather than through the pool makes no reference cycle
    (the pool's live set holds the pages), so a dropped cache is freed at once.

    Shares are deferred: a fork records "one more holder of these pages" as one count instead
    of one increment per page, and a holder of the same pages letting go takes such a count
    back, so a fork closed again touches no page's count. Two places keep such counts:

    - a fork at full length (``Context.fork``), whose child holds the very same ``Holding`` as
      its parent, counts on that holding (``Holding.forks``; ``share_holding``);
    - a fork at a shorter length (a match hit) counts on its run of slots (``pending``:
      ``id(ids) -> [ids, holders]``; ``share``, ``withdraw``): hits at one shared prefix get
      different holdings but the same run.

    Whoever reads or writes ``counts`` gets them exact: the pending counts are added first
    (``flush``), one vectorised step per run or holding. So a page's refcount is exact whenever
    anything looks at it (``Page.refcount``, ``observe``, ``writable``, a release that may free
    a page).
    """

    __slots__ = ("_counts", "pending", "forked")

    FLUSH_AT = 64       # runs (or holdings) pending before a share adds them anyway: bounds a late flush

    def __init__(self, size: int):
        self._counts = np.zeros(size, np.int64)    # refcount of the page holding slot i; 0 for free slots
        self.pending: dict[int, list] = {}
        self.forked: dict = {}      # id(holding) -> holding (impl/holding.py), for each with forks counted on it

    @property
    def counts(self) -> np.ndarray:
        if self.pending or self.forked:
            self.flush()
        return self._counts

    @counts.setter
    def counts(self, value: np.ndarray) -> None:
        if self.pending or self.forked:
            self.flush()
        self._counts = value

    def flush(self) -> None:
        # Drained in place, each count dropped right after it is added, with no call between (the
        # add is ``add_holders``' last step): an interrupt (Ctrl-C, a run's deadline) part way leaves
        # the rest pending for the next flush. Emptying the dicts first lost them: refcounts one
        # short, pages freed while still held.
        counts, pending, forked = self._counts, self.pending, self.forked
        if pending:         # (the list of items only where there are some: most flushes find one dict empty)
            for key, (ids, holders) in list(pending.items()):
                add_holders(counts, ids, holders)
                del pending[key]
        if forked:
            for key, holding in list(forked.items()):
                add_holders(counts, holding.slots, holding.forks)
                holding.forks = 0
                del forked[key]

    def share(self, ids) -> None:
        """One more holder of every slot of ``ids`` (one holder's list: distinct slots), as one pending count."""
        pending = self.pending
        entry = pending.get(id(ids))
        if entry is not None and entry[0] is ids:
            entry[1] += 1
            return
        if len(pending) >= self.FLUSH_AT:
            self.flush()
        self.pending[id(ids)] = [ids, 1]

    def share_holding(self, holding) -> None:
        """One more holder of ``holding``'s pages, counted on it (``Context.fork`` adds to a count
        already there itself: this is the first count since the last flush)."""
        if holding.forks:
            holding.forks += 1
            return
        if len(self.forked) >= self.FLUSH_AT:
            self.flush()
        key = id(holding)       # the call before the books change: from here, no call (see ``Cache._fork``)
        self.forked[key] = holding
        holding.forks = 1

    def withdraw_holding(self, holding, holder=None, after=None) -> bool:
        """Take back one holder of ``holding`` counted on it, if there is one; True if taken.
        Safe for any holder of it, as ``withdraw`` is for any holder of a run. ``holder``, where
        given, gets ``after`` as its holding in the same step (``PagePool.release_slots``)."""
        forks, key = holding.forks, id(holding)
        if not forks:
            return False
        # From here no call: the count and the holder change together or not at all.
        holding.forks = forks - 1
        if forks == 1:
            del self.forked[key]
        if holder is not None:
            holder._holding = after
        return True

    def withdraw(self, ids, holder=None, after=None) -> bool:
        """Take back one pending holder of the run ``ids``, if there is one; True if taken.
        ``holder``, where given, gets ``after`` as its holding in the same step.

        Safe without looking at any page: every holder of ``ids`` holds the same pages, so
        which of them lets go does not matter; and while a count is pending for ``ids`` the
        holder it was forked from holds them too, so no page can reach 0 here."""
        key = id(ids)
        entry = self.pending.get(key)
        if entry is None or entry[0] is not ids:
            return False
        # From here no call: the count and the holder change together or not at all.
        if entry[1] == 1:
            del self.pending[key]
        else:
            entry[1] -= 1
        if holder is not None:
            holder._holding = after
        return True

    def __getstate__(self):
        return {"_counts": self.counts}     # flushed: id() keys mean nothing in a copy, and holdings copy no count

    def __setstate__(self, state) -> None:
        self._counts, self.pending, self.forked = state["_counts"], {}, {}


def add_holders(counts: np.ndarray, ids, holders: int) -> None:
    """``holders`` more on each refcount slot of ``ids`` (distinct slots: a range or an int array)."""
    if type(ids) is range:
        counts[ids.start:ids.stop] += holders
    elif len(ids) > 96:      # ufunc.at: faster than fancy indexing on long arrays, slower on short
        np.add.at(counts, ids, holders)
    else:
        counts[ids] += holders
