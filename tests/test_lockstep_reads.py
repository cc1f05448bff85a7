"""``Lockstep.reads_changed_only``: a check reads only the contexts an operation could have changed,
and a value bug in a context the operation did not name is still caught at its step."""

import pytest

from kvstate.impl import context as engine_context
from kvstate.impl.numpy import factory as numpy_factory
from kvstate.spec.errors import InvariantViolation
from kvstate.stateful import ops as O
from kvstate.stateful.configs import config_named
from kvstate.stateful.lockstep import Lockstep
from kvstate.stateful.planted import PLANTED


def _run(skip: bool) -> Lockstep:
    run = Lockstep(numpy_factory, config_named("f32-heap").with_(page_tokens=4))
    run.reads_changed_only = skip
    return run


def _counting_reads(monkeypatch) -> list[int]:
    count = [0]
    read = engine_context.Context.read

    def counted(self, *args, **kwargs):
        count[0] += 1
        return read(self, *args, **kwargs)

    monkeypatch.setattr(engine_context.Context, "read", counted)
    return count


def _three_contexts(run: Lockstep, check_each: bool) -> None:
    """c1, c2, c3, each extended by three tokens; checked after every step if ``check_each``."""
    for handle in ("c1", "c2", "c3"):
        for op in (O.Allocate(), O.Extend(handle, (0, 1, 2), seed=3)):
            run.apply(op)
            if check_each:
                run.check()


@pytest.mark.parametrize("skip", [False, True])
def test_a_write_into_a_shared_page_fails_the_check_of_that_step(skip):
    """c2 = fork(c1) shares c1's pages; with copy-on-write missing, overwriting c1 changes c2 too.
    c2 was not named by the overwrite, yet the check right after it reads c2 (it shares a page
    the overwrite named) and fails there, with or without skipping."""
    run = _run(skip)
    with PLANTED["missing_copy_on_write"]():
        run.apply(O.Allocate())
        run.check()
        run.apply(O.Extend("c1", (0, 1, 2, 0, 1, 2), seed=1))
        run.check()
        run.apply(O.Fork("c1"))
        run.check()
        run.apply(O.Overwrite("c1", 1, (2,), seed=2))
        with pytest.raises(InvariantViolation) as failed:
            run.check()
    assert failed.value.invariant == 4 and "c2 position" in str(failed.value)
    assert run.failed_at == len(run.history)


def test_only_contexts_an_operation_could_change_are_read(monkeypatch):
    """Three private contexts; extending one reads that one alone. (Handles are known by their
    holders when each creation is checked on its own, as the machine and seeded runs do.) A context
    an operation named is read three times: again after its first read is scribbled over (``no aliasing``),
    and through a window (``read(start, stop)``); and, where the checks skipped it since its last read,
    twice more right before the operation (whole and through a window)."""
    run = _run(True)
    _three_contexts(run, check_each=True)      # as the machine does: a check after every step
    count = _counting_reads(monkeypatch)
    run.apply(O.Extend("c3", (1, 1), seed=4))  # c3, extended last, was read by the last check
    run.check()
    assert count[0] == 3
    run.apply(O.Extend("c2", (1, 1), seed=4))  # c2 was skipped by the last two checks
    run.check()
    assert count[0] == 3 + 2 + 3
    run.apply(O.Fork("c2"))            # c4 is new, c2 was named: both read, c2 three times, c4 whole and in a window
    run.check()
    assert count[0] == 8 + 3 + 2


def test_without_the_flag_every_context_is_read(monkeypatch):
    run = _run(False)
    _three_contexts(run, check_each=False)
    run.check()
    count = _counting_reads(monkeypatch)
    run.apply(O.Extend("c2", (1, 1), seed=4))
    run.check()
    assert count[0] == 7                # all three whole and through a window, and c2's aliasing re-read


def test_a_write_no_observation_shows_is_caught_before_the_run_ends(monkeypatch):
    """A bug that writes into another context's private page (held by nothing the operation named,
    its page view unchanged) escapes the changed-only reads of its step; the full read that
    ``finish`` does first catches it, so the run still fails."""
    run = _run(True)
    for handle in ("c1", "c2"):
        run.apply(O.Allocate())
        run.check()
        run.apply(O.Extend(handle, (0, 1, 2), seed=5))
        run.check()
    victim = run.live["c1"][0]
    extend = engine_context.Context.extend

    def extend_and_scribble(self, tokens, kv):
        extend(self, tokens, kv)
        if self is not victim:
            (array,) = victim._pages[0].buffer.arrays
            array[:, :, 0] += 1        # c1's first position changes (layers, K/V, position, ...); only c2 was named

    monkeypatch.setattr(engine_context.Context, "extend", extend_and_scribble)
    run.apply(O.Extend("c2", (2, 2), seed=6))
    run.check()                        # c1 not named, its pages unchanged as observed: not read
    monkeypatch.undo()
    with pytest.raises(InvariantViolation) as failed:
        run.finish()
    assert failed.value.invariant == 4 and "c1 position" in str(failed.value)


@pytest.mark.parametrize("on_full, hinted", [("evict", True), ("fallback", False)])
def test_a_black_box_entry_missing_from_an_evicting_pool_names_the_pool_as_a_cause(on_full, hinted):
    """Without the tree tier an entry is probed through match: a hit shorter than the reference's, in
    a pool that evicts for room, may be an eviction forced by pages the engine held past their use
    (an audit's truncate that kept its pages was reported as an entry, recency or content fault)."""
    config = config_named("f32-arena6").with_(on_full=on_full)
    run = Lockstep(numpy_factory, config)
    handle = run.apply(O.Allocate())
    run.apply(O.Extend(handle, (1, 2, 3), seed=1))
    run.apply(O.Retain(handle))
    run.engine.match = lambda tokens: (run.engine.allocate(), 0)      # as if the entry were evicted
    with pytest.raises(InvariantViolation, match="invariant 5") as caught:
        run._probe_entries()
    assert ("its pool evicted for room" in str(caught.value)) == hinted
    assert "values='prefix'" not in str(caught.value)


def test_an_evicting_pool_under_prefix_values_names_the_known_false_rejection():
    """Under values="prefix" with a pool that evicts, a backend whose retain shares the tree's pages
    evicts less than the reference counts: an entries report there says it may be that."""
    import dataclasses

    from helpers import observed_as

    # entries are probed through match only where the tree tier is missing
    WithoutTheTreeTier = observed_as(lambda obs: dataclasses.replace(obs, entries=None, tree=None))
    config = config_named("f32-arena6").with_(on_full="evict", values="prefix")
    run = Lockstep(WithoutTheTreeTier, config)
    handle = run.apply(O.Allocate())
    run.apply(O.Extend(handle, (1, 2, 3), seed=1))
    run.apply(O.Retain(handle))
    run.engine.match = lambda tokens: (run.engine.allocate(), 0)
    with pytest.raises(InvariantViolation, match="can be a false rejection"):
        run._probe_entries()


def test_the_tree_tiers_entries_report_under_prefix_values_claims_no_false_rejection():
    """With the tree tier the reference follows the backend's evictions, so a difference is a finding."""
    config = config_named("f32-arena6").with_(on_full="evict", values="prefix")
    run = Lockstep(numpy_factory, config)
    handle = run.apply(O.Allocate())
    run.apply(O.Extend(handle, (1, 2, 3), seed=1))
    run.apply(O.Retain(handle))
    run.reference.entries.clear()       # as if the reference had evicted the entry the engine kept
    with pytest.raises(InvariantViolation, match="entry keys in eviction order") as caught:
        run.check()
    assert "false rejection" not in str(caught.value)


def test_an_early_refusal_and_a_budget_mismatch_name_their_likely_causes(monkeypatch):
    """From an audit: a refused operation that kept a page showed only later, as "engine CapacityError,
    reference accepted", and a page budget counting shared pages once as a bare matched count."""
    from kvstate.impl import context as engine_context
    from kvstate.spec.errors import CapacityError

    run = Lockstep(numpy_factory, config_named("f32-arena10-refuse"))
    handle = run.apply(O.Allocate())

    def refused(self, tokens, kv):
        raise CapacityError("full")
    monkeypatch.setattr(engine_context.Context, "extend", refused)
    with pytest.raises(InvariantViolation, match="the reference had room: .* holds pages past their use"):
        run.apply(O.Extend(handle, (1, 2), seed=1))
    monkeypatch.undo()

    run = Lockstep(numpy_factory, config_named("token-f16-heap-pages5"))
    handle = run.apply(O.Allocate())
    run.apply(O.Extend(handle, (1, 2, 3), seed=1))
    run.apply(O.Retain(handle))
    run.engine.match = lambda tokens: (run.engine.allocate(), 0)
    with pytest.raises(InvariantViolation, match="as if nothing were shared"):
        run.apply(O.Match((1, 2, 3)))


def test_the_aliasing_reads_visit_contexts_in_the_order_they_were_made(monkeypatch):
    """The contexts named since the last check were re-read for aliasing in a set's order, which
    string hashing changes from process to process: where two alias, a local sweep and a cluster
    sweep of one seed could name different contexts in one failure (a Dask helper's review). They
    go in the order the run made them, as every other read of the check does."""
    run = _run(False)
    handles = [f"c{k}" for k in range(1, 9)]
    for handle in handles:
        run.apply(O.Allocate())
        run.apply(O.Extend(handle, (0, 1, 2), seed=3))
    visited = []
    monkeypatch.setattr(Lockstep, "_read_is_a_copy", lambda self, handle, *_: visited.append(handle))
    run.check()
    assert visited == handles


def _renumbering_without_copy_on_write_for_overwrite():
    """``examples/listcache.py`` (it numbers its contexts by position, ``ctx:N`` re-enumerated after a
    close) whose ``overwrite`` writes into its pages in place, copy-on-write skipped."""
    from pathlib import Path

    from kvstate.stateful.backends import load_factory

    listcache = load_factory(str(Path(__file__).parent.parent / "examples" / "listcache.py"))

    def factory(config):
        cache = listcache(config)

        class InPlace(cache.context_class):
            def overwrite(self, start, tokens, kv):
                tokens, values = self._encode(tokens, kv, start)
                for i, position in enumerate(range(start, start + len(tokens))):
                    page = self.pages[position // self.cache.page_tokens]
                    page.values[position % self.cache.page_tokens] = values[i]
                    page.tokens[position % self.cache.page_tokens] = tokens[i]

        cache.context_class = InPlace
        return cache
    return factory, listcache.configs[0].with_(page_tokens=4)


def test_a_backend_that_renumbers_its_contexts_is_read_where_a_write_could_land():
    """The false-rejection audit (s68) saw replays label pages with the wrong contexts for a backend that
    renumbers ``ctx:N`` after a close. The names also chose what a check re-reads: after close(c1) the
    stale names sent the check after c2's in-place overwrite to c4's pages, c3's shared page went unread,
    and with c3 closed before the run's end the bug passed the whole run. A rename now stops every name."""
    factory, config = _renumbering_without_copy_on_write_for_overwrite()
    run = Lockstep(factory, config)
    run.reads_changed_only = True
    for op in (O.Allocate(), O.Extend("c1", (1, 2, 3, 4), seed=1), O.Allocate(), O.Extend("c2", (5, 6, 7, 8), seed=2),
               O.Fork("c2"), O.Allocate(), O.Extend("c4", (9, 9, 9, 9), seed=3), O.Close("c1")):
        run.apply(op)
        run.check()
    assert run.holder_of("c2") is None and "ctx:0 (" not in run.named("ctx:0")     # no stale label either
    run.apply(O.Overwrite("c2", 0, (7,), seed=4))
    with pytest.raises(InvariantViolation) as failed:
        run.check()
    assert failed.value.invariant == 4 and "c3 position 0" in str(failed.value)


def test_a_backend_that_keeps_its_names_keeps_skipping():
    """kvstate's own engine names a context for good: closing one leaves every other name trusted."""
    run = _run(True)
    _three_contexts(run, check_each=True)
    run.apply(O.Close("c1"))
    run.check()
    assert run.holder_of("c2") is not None and run.holder_of("c3") is not None


def test_a_context_skipped_since_its_last_read_is_read_before_it_closes():
    """A write no observation shows (here: c2's values changed behind the backend's books, as a write into
    the wrong page would) was left to ``finish``'s full read; closed before the run's end, c2 was never read
    again and the run passed. Now a skipped context is read once more as it closes."""
    run = _run(True)
    _three_contexts(run, check_each=True)
    engine_c2 = run.live["c2"][0]
    engine_c2._pages[0].buffer.arrays[0][:, :, 0] += 1      # position 0, behind the books: no observation changes
    run.apply(O.Extend("c1", (4,), seed=4))
    run.check()                                             # c2 not named and its pages unchanged: skipped
    with pytest.raises(InvariantViolation) as failed:
        run.apply(O.Close("c2"))
    assert failed.value.invariant == 4 and "read right before close(ctx='c2')" in str(failed.value)
    assert run.failure is not None and "c2" in run.live      # recorded, and nothing closed
