"""Seven concurrency bugs of fine-grained locking, planted one per factory in ``finelock``'s engine
(audit s67/audit3, ``/work/runs/s67/audit3/REPORT.md``). Run one with

    PYTHONPATH=. python -m kvstate conform tests/foreign/finelock_plants.py:NAME --workers 1 --check races

P1-P5 were caught by ``races`` as the audit found it; P6 ``half_cow`` and P7 ``late_stamp`` passed it
(its findings F1 and F2) and are what ``tests/test_races_finelock.py`` holds it to now.
"""

from __future__ import annotations

try:
    from . import finelock as base
except ImportError:         # loaded as a plain file
    import importlib.util
    import pathlib
    import sys
    _path = pathlib.Path(__file__).with_name("finelock.py")
    _spec = importlib.util.spec_from_file_location("finelock", _path)
    base = importlib.util.module_from_spec(_spec)
    sys.modules["finelock"] = base
    _spec.loader.exec_module(base)

Context, Entry, FineLockCache = base.Context, base.Entry, base.FineLockCache


def _declare(cls, name):
    def factory(config):
        return cls(config)
    factory.__name__ = factory.__qualname__ = name
    factory.configs = base.factory.configs
    factory.any_page_size = True
    factory.thread_safe = True
    return factory


# P1: refcount read-then-write across two acquisitions of the pool lock (fork/match adopt).
class SplitRefcount(FineLockCache):
    def _adopt(self, pages, length):
        for page in pages:
            with self.pool.lock:
                count = page.refcount
            with self.pool.lock:
                page.refcount = count + 1
        ctx = self.context_class(self, pages, length)
        with self.pool.lock:
            ctx.serial = next(self.pool.serials)
            self.pool.contexts[ctx.serial] = ctx
        return ctx


split_refcount = _declare(SplitRefcount, "split_refcount")


# P2: fork copies the source's page list without the source context's lock.
class UnlockedForkContext(Context):
    def fork(self):
        self._open()
        pages, length = self.state
        return self.cache._adopt(pages, length)


class UnlockedFork(FineLockCache):
    context_class = UnlockedForkContext


unlocked_fork = _declare(UnlockedFork, "unlocked_fork")


# P3: match lets the tree lock go before bumping the hit's refcounts (an eviction may free them).
class EarlyMatchRelease(FineLockCache):
    def match(self, tokens):
        from kvstate.spec.layout import check_tokens
        query = tuple(int(t) for t in check_tokens(tokens))
        with self.tree_lock:
            best = self._longest(query)
            if best is None:
                pages, length, matched = (), 0, 0
            else:
                self.clock += 1
                best.tick = self.clock
                pages, length, matched = best.pages, best.length, len(best.key)
        return self._adopt(pages, length), matched


early_match_release = _declare(EarlyMatchRelease, "early_match_release")


# P4: lock-order inversion: observe() takes the pool lock, then the tree lock (retain/match/clear: tree, then pool).
class InvertedObserve(FineLockCache):
    def observe(self):
        with self.pool.lock:
            with self.tree_lock:
                return self._observe_locked()


inverted_observe = _declare(InvertedObserve, "inverted_observe")


# P5: retain inserts the entry into the tree (and evicts) before pinning its pages.
class InsertBeforePin(FineLockCache):
    def retain(self, ctx):
        from kvstate.spec.errors import EmptyContextError
        with ctx.lock:
            ctx._open()
            pages, length = ctx.state
            if length == 0:
                raise EmptyContextError("cannot retain an empty context")
            key = tuple(int(t) for t in ctx._gather(0, length)[1])
            with self.tree_lock:
                self.clock += 1
                entry = Entry(key, pages, length, self.clock)
                old = self.entries.pop(key, None)
                self.entries[key] = entry
                victims = []
                while len(self.entries) > self.max_entries:
                    victim = min((e for e in self.entries.values() if e is not entry), key=lambda e: e.tick)
                    del self.entries[victim.key]
                    victims.append(victim)
            with self.pool.lock:
                self.pool.incref(pages)
                for gone in ([old] if old is not None else []) + victims:
                    self.pool.release(gone.pages)


insert_before_pin = _declare(InsertBeforePin, "insert_before_pin")


# P6: a lock-free read ("shared pages are immutable") meets a copy-on-write that publishes the
# private copy before filling it: a read can see the half-done copy.
class HalfCowContext(Context):
    def read(self, start=0, stop=None):
        self._open()
        length = self.state[1]
        start = base._pos(start, "start")
        stop = length if stop is None else base._pos(stop, "stop")
        if not 0 <= start <= stop <= length:
            from kvstate.spec.errors import PositionError
            raise PositionError(f"read of [{start}, {stop}) outside length {length}")
        return self._gather(start, stop)

    def _write(self, start, tokens, values, grow):
        n = len(tokens)
        if n == 0:
            return
        pt = self.cache.page_tokens
        pool = self.cache.pool
        copies = []
        with pool.lock:
            pages, length = self.state
            pages = list(pages)
            first, last = start // pt, (start + n - 1) // pt
            for index in range(first, min(last + 1, len(pages))):
                page = pages[index]
                if page.refcount > 1:
                    private = pool.new_page()
                    copies.append((private, page))
                    pool.release([page])       # its bytes stay readable through ``copies``
                    pages[index] = private
            while len(pages) <= last:
                pages.append(pool.new_page())
            self.state = (tuple(pages), start + n if grow else length)
        for private, page in copies:        # filled after it was published
            private.tokens[:] = page.tokens
            private.values[:] = page.values
        for i in range(n):
            index, offset = divmod(start + i, pt)
            pages[index].values[offset] = values[i]
            pages[index].tokens[offset] = tokens[i]


class HalfCow(FineLockCache):
    context_class = HalfCowContext


half_cow = _declare(HalfCow, "half_cow")


# P7 (extra): match pins its hit under the tree lock but stamps recency after letting the tree lock go.
class LateStamp(FineLockCache):
    def match(self, tokens):
        from kvstate.spec.layout import check_tokens
        query = tuple(int(t) for t in check_tokens(tokens))
        with self.tree_lock:
            best = self._longest(query)
            if best is None:
                return self._adopt((), 0), 0
            hit = self._adopt(best.pages, best.length), len(best.key)
        self._stamp(best)
        return hit

    def _stamp(self, entry):
        tick = self.clock + 1
        self.clock = tick
        entry.tick = tick


late_stamp = _declare(LateStamp, "late_stamp")
