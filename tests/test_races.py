"""Races a scheduler creates, under threads, at CI size (``kvstate stress`` runs them for minutes).

The scenarios live in ``kvstate.stateful.races``; each checks the invariants and the
reference itself and raises ``RaceFailure`` naming store, seed and iteration.
Stores: ``available_stores()`` -- ``numpy``, plus ``torch`` once ``impl/torch.py`` exists.
"""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest

from kvstate.spec import invariants
from kvstate.spec.errors import ContextBusyError, ContextClosedError
from kvstate.stateful import races

STORES = races.available_stores()
SEED = int(os.environ.get("KVSTATE_RACE_SEED", "20261129"))


def _run(name: str, store: str):
    report = races.SCENARIOS[name](store=store, seed=SEED, iterations=races.CI_ITERATIONS[name])
    assert report.iterations == races.CI_ITERATIONS[name]
    return report


@pytest.fixture(autouse=True)
def _switch_interval_restored():
    before = sys.getswitchinterval()
    yield
    assert sys.getswitchinterval() == before, "a scenario left the switch interval changed"


@pytest.mark.parametrize("store", STORES)
def test_sixteen_threads_fork_one_parent_then_write_their_own_branch(store):
    report = _run("fork_storm", store)
    assert report.threads == 16
    assert report.counts["forks"] == 16 * report.iterations
    assert report.counts["pages_copied"] > 0
    assert report.counts["observations"] > 0


@pytest.mark.parametrize("store", STORES)
def test_eviction_races_allocation(store):
    report = _run("eviction_vs_allocation", store)
    assert report.counts["retains"] > 0 and report.counts["allocations"] > 0
    assert report.counts["match_hits"] > 0


@pytest.mark.parametrize("store", STORES)
def test_match_and_close_race_clear(store):
    report = _run("match_close_vs_clear", store)
    assert report.counts["clears"] > 0 and report.counts["match_hits"] > 0


@pytest.mark.parametrize("store", STORES)
def test_close_racing_use_close_and_fork_gives_named_errors(store):
    report = _run("close_races", store)
    # Every user thread ends by seeing the context closed: one "closed" outcome per user per iteration.
    assert report.counts["uses_closed"] == report.iterations * (report.threads - 2)


@pytest.mark.parametrize("store", STORES)
def test_snapshot_and_restore_race_a_decode_rewriting_the_shared_prefix(store):
    report = _run("snapshot_vs_decode", store)
    assert report.counts["snapshots"] > 0 and report.counts["decode_steps"] > 0


@pytest.mark.parametrize("store", STORES)
def test_observe_while_other_threads_write_sees_consistent_structure(store):
    report = _run("observe_during_writes", store)
    assert report.counts["observations"] == 1000 * report.iterations
    assert report.counts["contexts_written"] > 0


# -- deterministic: one thread holds a context, another is refused by name -----------------

def _holding(ctx):
    """A thread that holds ``ctx`` (as an operation in progress would) until released."""
    held, release = threading.Event(), threading.Event()

    def hold():
        with ctx._owned():
            held.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    assert held.wait(10)
    return release, thread


def _operations(cache, config, ctx, folder):
    ops = {
        "read": lambda: ctx.read(),
        "tokens": lambda: ctx.tokens,
        "extend": lambda: races.extend(ctx, config, [5]),
        "overwrite": lambda: races.overwrite(ctx, config, 0, [6]),
        "fork": lambda: ctx.fork(),
        "truncate": lambda: ctx.truncate(1),
        "retain": lambda: cache.retain(ctx),
        "close": lambda: ctx.close(),
        "snapshot": lambda: ctx.snapshot(folder / "s.kvs"),
    }
    return ops


@pytest.mark.parametrize("store", STORES)
def test_every_operation_on_a_context_held_by_another_thread_is_refused_and_changes_nothing(store, tmp_path):
    config = races.race_configs()[1]
    cache = races.make_cache(store, config)
    ctx = cache.allocate()
    races.extend(ctx, config, [1, 2, 3, 4])
    sibling = ctx.fork()
    before = cache.observe()
    release, thread = _holding(ctx)
    try:
        for name, op in _operations(cache, config, ctx, tmp_path).items():
            with pytest.raises(ContextBusyError, match=f"context {ctx.context_id}"):
                op()
            assert cache.observe() == before, f"refused {name} changed the cache"
    finally:
        release.set()
        thread.join()
    races.verify(ctx, config, "ctx", want_tokens=[1, 2, 3, 4])
    for c in (ctx, sibling):
        c.close()
    races.check_emptied(cache, "held")


@pytest.mark.parametrize("store", STORES)
def test_use_after_close_from_another_thread_is_refused_and_refcounts_hold(store, tmp_path):
    config = races.race_configs()[0]
    cache = races.make_cache(store, config)
    ctx = cache.allocate()
    races.extend(ctx, config, list(range(10)))
    sibling = ctx.fork()                          # shares every page: a double release would free them
    closer = threading.Thread(target=ctx.close)
    closer.start()
    closer.join()
    assert ctx.closed
    after_close = cache.observe()
    invariants.check_structure(after_close)
    errors = []

    def use_everything():
        for name, op in _operations(cache, config, ctx, tmp_path).items():
            try:
                op()
                errors.append(f"{name} succeeded on a closed context")
            except ContextClosedError:
                pass
            except Exception as error:            # noqa: BLE001 - collected and asserted below
                errors.append(f"{name} raised {error!r}")

    user = threading.Thread(target=use_everything)
    user.start()
    user.join()
    assert errors == []
    assert cache.observe() == after_close
    races.verify(sibling, config, "sibling", want_tokens=list(range(10)))
    assert all(page.refcount == 1 for page in cache.observe().pages.values())
    sibling.close()
    races.check_emptied(cache, "use-after-close")


@pytest.mark.parametrize("store", STORES)
def test_closing_twice_at_once_succeeds_once(store):
    config = races.race_configs()[2]
    cache = races.make_cache(store, config)
    ctx = cache.allocate()
    races.extend(ctx, config, [3, 1, 4, 1, 5])
    sibling = ctx.fork()
    outcomes, barrier = [], threading.Barrier(8)

    def close():
        barrier.wait()
        while True:
            try:
                ctx.close()
                outcomes.append("closed")
            except ContextBusyError:
                continue
            except ContextClosedError:
                outcomes.append("already closed")
            return

    with races.switch_interval():
        threads = [threading.Thread(target=close) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(outcomes) == ["already closed"] * 7 + ["closed"]
    invariants.check_structure(cache.observe())
    races.verify(sibling, config, "sibling", want_tokens=[3, 1, 4, 1, 5])
    sibling.close()
    races.check_emptied(cache, "double close")


def test_reports_name_the_seed_and_iteration_of_a_failure(monkeypatch):
    """A planted race bug (fork forgets its refcount increments) is caught and reported rerunnably."""
    from kvstate.impl import pages

    monkeypatch.setattr(pages.PagePool, "share", lambda self, pages: None)
    with pytest.raises(races.RaceFailure, match=r"fork_storm\[numpy, f32-heap\] seed=7 iteration=0"):
        races.fork_storm("numpy", seed=7, iterations=1, threads=4)


def test_kv_for_depends_on_token_and_position():
    layout = races.RACE_LAYOUT
    a = races.kv_for(layout, [1, 2], 0)
    assert not np.array_equal(a[0], races.kv_for(layout, [1], 1)[0])     # same token, other position
    assert not np.array_equal(a[1], races.kv_for(layout, [3], 1)[0])     # same position, other token
    assert np.array_equal(a[1], races.kv_for(layout, [2], 1)[0])
