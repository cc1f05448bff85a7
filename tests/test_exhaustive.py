"""The small-scope exhaustive checker: it passes the engine, explores completely, and bites.

Each planted bug must be found with a trace of exactly its known minimal length
(derived by hand in ``MINIMAL``): BFS order is what makes the trace shortest,
so a longer trace means the search or its deduplication is wrong.
"""

from __future__ import annotations

import json

import pytest

from kvstate.impl.numpy import factory as numpy_factory
from kvstate.spec.errors import InvariantViolation
from kvstate.stateful import ops as O
from kvstate.stateful import replay as R
from kvstate.stateful.exhaustive import Scope, _Interner, _States, as_replay, canonical, explore, write_replay
from kvstate.stateful.lockstep import Lockstep
from kvstate.stateful.planted import PLANTED

TINY = Scope(max_contexts=1, max_positions=2, max_write=1, max_entries=1, arena_pages=1, max_depth=None)
ONE_ENTRY = Scope(max_contexts=1, max_positions=2, max_entries=1)

# bug -> (scope, minimal number of operations, why that is the minimum)
MINIMAL = {
    # allocate, extend; closing it (invariant 6, checked at every state) leaks the page
    "refcount_kept_on_close": (Scope(), 2),
    "release_skips_last_page": (Scope(), 2),
    # allocate, extend 1; truncate to 1 keeps floor(1/2) = 0 pages of a 1-position context
    "truncate_off_by_one": (Scope(), 3),
    # allocate, extend, fork, overwrite: the first write to a shared page
    "missing_copy_on_write": (Scope(), 4),
    # allocate, extend 2 (slot 0 full), truncate 0 (slot freed dirty), extend 1 (slot 0 reissued)
    "dirty_recycled_slot": (Scope(), 4),
    # allocate, extend, extend (length 3 needs two writes of <= 2), fork, truncate to 2
    "truncate_shared_boundary": (Scope(), 5),
    # allocate, extend, retain (entry A shares the page), extend (copies: A now holds it alone),
    # retain (evicts A with max_entries 1)
    "arena_slot_kept_on_eviction": (ONE_ENTRY, 5),
    # allocate, extend (0,0), retain, overwrite position 1, retain: entries (0,0) and (0,1)
    # under a split node; overwrite position 0, retain a third key: the wrong entry is evicted
    "split_node_evicted": (Scope(max_contexts=1, max_positions=2, max_depth=None), 7),
}


# Planted bugs in operations the exhaustive scope does not explore (the lockstep machine finds them).
OUTSIDE_SCOPE = {
    "restore_drops_partial_page": "snapshot/restore are not operations of the exhaustive scope",
    "q8_rounds_half_away_from_zero": "the default scope stores f32; a q8 tie needs x / scale exactly on .5",
    "match_shortest_key": "two nested keys and a match past both take 6 operations; the default depth is 5",
}


def test_every_planted_bug_has_a_known_minimum():
    assert set(MINIMAL) | set(OUTSIDE_SCOPE) == set(PLANTED)
    assert not set(MINIMAL) & set(OUTSIDE_SCOPE)


def test_engine_passes_a_complete_tiny_scope():
    result = explore(numpy_factory, TINY)
    assert result.passed, str(result.violation)
    assert result.complete                    # no new state remained: the space is explored
    assert result.states > 100 and result.transitions > result.states
    assert sum(result.per_depth) == result.states


def test_engine_passes_the_default_scope():
    """The default scope (what ``kvstate spec-check`` runs): every sequence of up to 5 operations."""
    result = explore(numpy_factory, Scope())
    assert result.passed, str(result.violation)
    assert result.depth == Scope().max_depth and result.states > 1000
    assert len(result.per_depth) == result.depth + 1


@pytest.mark.parametrize("bug", sorted(MINIMAL))
def test_planted_bug_is_found_with_a_minimal_trace(bug, tmp_path):
    scope, minimum = MINIMAL[bug]
    with PLANTED[bug]():
        result = explore(numpy_factory, scope, time_limit=120)
    assert result.violation is not None, f"{bug} not found: {result.summary()}"
    assert len(result.violation.ops) == minimum, str(result.violation)
    # the trace is a sweep replay file that fails again with the bug and passes without it
    path = tmp_path / "trace.json"
    with PLANTED[bug]():
        write_replay(str(path), scope, result.violation, numpy_factory)
    replay = R.load(path)
    assert [op.kind for op in replay.ops] == [op.kind for op in result.violation.ops]
    assert replay.failure is not None and replay.minimised
    with PLANTED[bug]():
        assert R.execute(numpy_factory, replay.config, replay.ops)[0] is not None
    assert R.execute(numpy_factory, replay.config, replay.ops)[0] is None


def test_canonical_form_ignores_names_only():
    """Two runs that differ only in creation order and page ids reach one canonical state.

    (Without an arena: arena slot numbers are kept as they are, not renamed.)
    """
    intern, config = _Interner(), Scope(arena_pages=0).config()
    first = Lockstep(numpy_factory, config)
    a = first.apply(O.Allocate())
    first.apply(O.Extend(a, (0,), -1))
    b = first.apply(O.Allocate())
    first.apply(O.Extend(b, (1,), -1))
    second = Lockstep(numpy_factory, config)
    b2 = second.apply(O.Allocate())
    second.apply(O.Extend(b2, (1,), -1))
    a2 = second.apply(O.Allocate())
    second.apply(O.Extend(a2, (0,), -1))
    assert canonical(first, intern) == canonical(second, intern)
    second.apply(O.Overwrite(a2, 0, (0,), -2))          # same tokens, another value
    assert canonical(first, intern) != canonical(second, intern)


def test_canonical_form_sees_sharing_and_dirty_slots():
    intern, config = _Interner(), Scope().config()
    shared = Lockstep(numpy_factory, config)
    c = shared.apply(O.Allocate())
    shared.apply(O.Extend(c, (0,), -1))
    shared.apply(O.Fork(c))
    private = Lockstep(numpy_factory, config)
    c = private.apply(O.Allocate())
    private.apply(O.Extend(c, (0,), -1))
    d = private.apply(O.Allocate())
    private.apply(O.Extend(d, (0,), -1))
    assert canonical(shared, intern) != canonical(private, intern)
    empty = Lockstep(numpy_factory, config)
    empty.apply(O.Allocate())
    used = Lockstep(numpy_factory, config)
    c = used.apply(O.Allocate())
    used.apply(O.Extend(c, (0,), -1))
    used.apply(O.Truncate(c, 0))                         # slot 0 is free again, but not clean
    assert canonical(empty, intern) != canonical(used, intern)


def test_clone_is_independent_of_its_parent():
    states = _States(numpy_factory, Scope().config())
    parent = states.start()
    c = parent.apply(O.Allocate())
    parent.apply(O.Extend(c, (0, 1), -1))
    from kvstate.stateful.exhaustive import _copyable_locks
    with _copyable_locks():
        child = states.clone(parent, [])
    assert states.can_pickle
    child.apply(O.Overwrite(c, 0, (1,), -1))
    child.check()
    parent.check()
    assert parent.live[c][1].tokens == [0, 1] and child.live[c][1].tokens == [1, 1]


def test_a_violation_at_the_empty_cache_is_reported():
    """A refusal that differs between engine and reference is a violation, with its trace."""
    def broken_factory(config):
        cache = numpy_factory(config)
        cache.allocate = lambda: (_ for _ in ()).throw(InvariantViolation(1, "planted"))
        return cache
    result = explore(broken_factory, Scope(max_depth=2))
    assert result.violation is not None and [op.kind for op in result.violation.ops] == ["allocate"]


def test_traces_use_the_sweep_replay_format():
    ops = [O.Allocate(), O.Extend("c1", (0, 1), -1), O.Truncate("c1", 1)]
    document = json.loads(json.dumps(R.to_json(as_replay(Scope(), ops, numpy_factory))))
    assert document["format"] == R.FORMAT and document["config"]["page_tokens"] == 2
    assert R.from_json(document).ops == ops and document["failure"] is None


def test_spec_check_command(tmp_path, capsys):
    """``kvstate spec-check`` passes the engine and, with a bug planted, writes the shortest trace."""
    from kvstate.cli import main

    assert main(["spec-check", "--no-crosshair", "--depth", "3"]) == 0
    assert "states" in capsys.readouterr().out
    out = tmp_path / "violation.json"
    with PLANTED["missing_copy_on_write"]():
        assert main(["spec-check", "--no-crosshair", "--depth", "5", "--replay-out", str(out)]) == 1
    document = json.loads(out.read_text())
    assert len(document["ops"]) == MINIMAL["missing_copy_on_write"][1]
    assert document["config"]["max_entries"] == Scope().max_entries
