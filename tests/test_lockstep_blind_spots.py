"""Bugs that passed every check (an outside audit, s69), each planted here in ``examples/listcache.py`` with
stable holder names (``ctx:<serial>``, so the lockstep's changed-only reads stay on after closes):

- a write into another context's page, which that context's truncate hid before its next read;
- window reads from a slot table gone stale when another context's close moved the pages;
- an ``observe()`` that finishes queued writes, where ``read()`` does not (every check observed first);
- a one-page context's ``read()`` handing out a read-only view of its page (``no aliasing`` kept only
  reads of a three-page context across writes).

Each is a wrong answer a user gets; each is now caught, and the control passes the same runs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvstate.spec import Observation
from kvstate.spec.errors import InvariantViolation
from kvstate.stateful import ops as O
from kvstate.stateful.backends import load_factory
from kvstate.stateful.conform import conform
from kvstate.stateful.lockstep import Lockstep

LISTCACHE = load_factory(str(Path(__file__).resolve().parent.parent / "examples" / "listcache.py"))
CONFIG = LISTCACHE.configs[0].with_(page_tokens=4)


def _stable(context_methods: dict | None = None, cache_methods: dict | None = None):
    """A factory of listcache whose contexts keep one holder name for life, with methods replaced."""
    base = LISTCACHE(CONFIG)
    context_class = type("Context", (base.context_class,), dict(context_methods or {}))

    def observe(cache) -> Observation:
        seen = type(base).observe(cache)
        names = {f"ctx:{i}": f"ctx:{id(ctx)}" for i, ctx in enumerate(cache.contexts)}
        return Observation(pages=seen.pages, holders={names.get(k, k): v for k, v in seen.holders.items()},
                           lengths={names.get(k, k): v for k, v in seen.lengths.items()},
                           pages_allocated=seen.pages_allocated, pages_freed=seen.pages_freed,
                           arena_size=0, arena_out={}, arena_free=(), tree=None, entries=seen.entries)

    cache_class = type("Cache", (type(base),), {"context_class": context_class, "observe": observe,
                                                **(cache_methods or {})})

    def factory(config):
        return cache_class(config)
    factory.configs, factory.any_page_size = [CONFIG], False
    return factory


def _run(factory, ops, skip: bool = True) -> Lockstep:
    run = Lockstep(factory, CONFIG)
    run.reads_changed_only = skip
    for op in ops:
        run.apply(op)
        run.check()
    return run


def _overwrite_also_writing_the_page_below(self, start, tokens, kv):
    tokens, values = self._encode(tokens, kv, start)
    self._store(start, tokens, values)
    if len(tokens):
        other = self.cache.live.get(self.pages[start // self.cache.page_tokens].page_id - 1)
        if other is not None and other not in self.pages:
            other.values[start % self.cache.page_tokens] = values[0]       # the planted bug


def test_a_write_into_a_skipped_context_is_read_before_an_operation_can_hide_it():
    """c2's overwrite also wrote c1's page; the check after it skipped c1 (no observation showed a change),
    and c1's truncate then cut the position away: the run passed. c1 is now read right before the truncate."""
    factory = _stable({"overwrite": _overwrite_also_writing_the_page_below})
    ops = [O.Allocate(), O.Extend("c1", (0, 1, 2, 0), seed=1), O.Allocate(), O.Extend("c2", (1, 1, 1, 1), seed=2),
           O.Overwrite("c2", 0, (2,), seed=3)]
    run = _run(factory, ops)
    with pytest.raises(InvariantViolation) as failed:
        run.apply(O.Truncate("c1", 0))
    assert failed.value.invariant == 4 and "read right before truncate(ctx='c1', n=0)" in str(failed.value)
    control = _run(_stable(), ops + [O.Truncate("c1", 0)])
    control.finish()


def _window_from_pages_kept_at_the_last_operation(self, start=0, stop=None):
    values, tokens = type(self).__mro__[1].read(self, start, stop)
    stop = self.length if stop is None else stop
    if (start, stop) != (0, self.length):       # a window: the page arrays as they were at its last operation
        values = np.concatenate(self.kept)[start:stop].copy()
    return values, tokens


def _keeping_its_arrays(method_name):
    def method(self, *args):
        try:
            return getattr(type(self).__mro__[1], method_name)(self, *args)
        finally:
            self.kept = [page.values for page in self.pages]
    return method


def _close_moving_every_page(self):
    type(self).__mro__[1].close(self)
    for page in self.cache.live.values():       # compacting: each page's values to a new array, the old scrubbed
        moved = page.values.copy()
        page.values[...] = 0
        page.values = moved


def test_a_window_read_is_checked_in_every_context_once_a_run():
    """c1's close moved c2's pages; c2's window reads still used the arrays kept at its own last operation
    (zeros), its whole reads were right, and only contexts a step named got a window read: the run passed.
    ``finish`` now reads every live context through a window too."""
    factory = _stable({"read": _window_from_pages_kept_at_the_last_operation,
                       "extend": _keeping_its_arrays("extend"), "overwrite": _keeping_its_arrays("overwrite"),
                       "truncate": _keeping_its_arrays("truncate"), "close": _close_moving_every_page})
    ops = [O.Allocate(), O.Extend("c1", (1, 2, 3, 4), seed=1), O.Allocate(), O.Extend("c2", (5, 6, 7, 8), seed=2),
           O.Close("c1")]
    run = _run(factory, ops)
    with pytest.raises(InvariantViolation) as failed:
        run.finish()
    assert failed.value.invariant == 4 and "a read of positions" in str(failed.value)
    _run(_stable(), ops).finish()
    # Reading every context at every step (a replay, the sweep's pinning rerun) finds it too, at the close:
    # with window reads only where a step named a context, a sweep saved failures its replay called fixed.
    with pytest.raises(InvariantViolation, match="a read of positions"):
        _run(factory, ops, skip=False)


def _extend_queued(self, tokens, kv):
    self.cache.drain()
    tokens, values = self._encode(tokens, kv)
    self.cache.__dict__.setdefault("queue", []).append((self, self.length, tokens, values))
    self.length += len(tokens)


def _read_without_draining(self, start=0, stop=None):
    stop = self.length if stop is None else stop
    have = sum(len(page.tokens) for page in self.pages)
    values, tokens = type(self).__mro__[1]._positions(self, 0, min(stop, have))
    pad = stop - len(tokens)       # queued positions, not stored yet, read as zeros: the planted bug
    values = np.concatenate([values, np.zeros((pad, *values.shape[1:]), values.dtype)])
    tokens = np.concatenate([tokens, np.zeros(pad, tokens.dtype)])
    return values[start:stop].copy(), tokens[start:stop].copy()


def _drain(cache):
    queue, cache.queue = getattr(cache, "queue", []), []
    for ctx, start, tokens, values in queue:
        ctx._store(start, tokens, values)


def _observe_after_draining(cache):
    cache.drain()
    return type(cache).__mro__[1].observe(cache)


def test_a_read_is_checked_before_observe_finishes_what_a_write_queued():
    """Writes queued until the next operation or ``observe()``, and a ``read()`` that forgot to finish them:
    a read right after an extend returned zeros, yet every check observed first and so read right."""
    factory = _stable({"extend": _extend_queued, "read": _read_without_draining},
                      {"drain": _drain, "observe": _observe_after_draining})
    run = _run(factory, [O.Allocate()])
    run.apply(O.Extend("c1", (1, 2, 3), seed=1))
    with pytest.raises(InvariantViolation) as failed:
        run.check()
    assert failed.value.invariant == 4 and "c1 position 0" in str(failed.value)


def _one_page_read_as_a_view(self, start=0, stop=None):
    values, tokens = type(self).__mro__[1].read(self, start, stop)
    stop = self.length if stop is None else stop
    if len(self.pages) == 1:
        values = self.pages[0].values[start:stop]
        values.flags.writeable = False        # "the caller cannot write it": but the cache still does
    return values, tokens


def test_a_read_only_view_of_a_one_page_context_fails_no_aliasing():
    (planted,) = conform(_stable({"read": _one_page_read_as_a_view}), profile="hunt", checks=["no aliasing"])
    assert planted.outcomes["no aliasing"].status == "FAIL"
    assert "what it returned changed when the context was overwritten" in planted.outcomes["no aliasing"].detail
    (control,) = conform(_stable(), profile="hunt", checks=["no aliasing"])
    assert control.outcomes["no aliasing"].status == "pass", control.outcomes["no aliasing"].detail


def test_arena_evidence_says_what_it_could_not_compare_for_a_backend_that_renames_its_holders():
    """The final review (s69): once a rename drops the learnt holder names, the heap configuration's comparison
    of a page taken back after frees with a new cache's had no holder to read, and passed saying nothing."""
    from kvstate.impl.numpy import factory as numpy_factory
    from kvstate.stateful.configs import config_named

    def renaming(config):
        cache = numpy_factory(config)
        real = cache.observe

        def observe():          # contexts named by their rank, as a list's positions would name them
            seen = real()
            names = {h: f"ctx:{i}" for i, h in enumerate(sorted(h for h in seen.holders if h.startswith("ctx")))}
            return Observation(**{**seen.__dict__, "holders": {names.get(k, k): v for k, v in seen.holders.items()},
                                  "lengths": {names.get(k, k): v for k, v in seen.lengths.items()}})
        cache.observe = observe
        return cache
    (result,) = conform(renaming, configs=[config_named("f32-heap")], checks=["arena evidence"])
    outcome = result.outcomes["arena evidence"]
    assert outcome.status == "pass" and "renames its contexts' holders" in outcome.note, outcome
    (control,) = conform(numpy_factory, configs=[config_named("f32-heap")], checks=["arena evidence"])
    assert control.outcomes["arena evidence"].note is None


def test_a_backend_counting_its_reads_among_its_counters_is_not_blamed_for_the_suites_reads():
    """A false-rejection audit (s69): a backend whose ``observe().counters`` counts reads failed every run: the
    observation before an operation was the last check's, taken before the check's own reads (and before the
    read of a skipped context right before an operation), so a refusal or a zero-length write "changed the
    counters". The "before" is now observed after the suite's reads."""
    import dataclasses

    def read_counted(self, start=0, stop=None):
        self.cache.reads = getattr(self.cache, "reads", 0) + 1
        return type(self).__mro__[1].read(self, start, stop)

    def observe_with_reads(cache):
        return dataclasses.replace(type(cache).__mro__[1].observe(cache), counters={"reads": getattr(cache, "reads", 0)})

    factory = _stable({"read": read_counted}, {"observe": observe_with_reads})
    ops = [O.Allocate(), O.Extend("c1", (1, 2, 3), seed=1), O.Fork("c1"), O.Allocate(), O.Retain("c3"),
           O.Extend("c1", (), seed=2), O.Overwrite("c2", 0, (), seed=3)]
    _run(factory, ops).finish()        # a refused retain and zero-length writes, each after the suite's reads
    (result,) = conform(factory, profile="hunt", checks=["lockstep", "pinned semantics"])
    assert result.passed, result.failure
