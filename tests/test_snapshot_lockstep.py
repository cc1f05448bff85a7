"""Snapshot and restore in lockstep with the reference, as explicit sequences in all six configurations."""

import pytest

from kvstate.impl.numpy import factory as numpy_factory
from kvstate.spec.errors import InvariantViolation
from kvstate.stateful import ops as O
from kvstate.stateful.lockstep import Lockstep
from kvstate.stateful.snapshots import Restore, Snapshot


def sequence():
    return [
        O.Allocate(),                                   # c1
        O.Extend("c1", (1, 2, 0, 1, 2), seed=1),
        Snapshot("c1", "a"),
        O.Fork("c1"),                                   # c2 shares c1's pages
        O.Overwrite("c2", 1, (2, 2), seed=2),
        Snapshot("c2", "b"),
        O.Truncate("c1", 2),
        Restore("a"),                                   # c3: c1 as it was at snapshot a
        Restore("b"),                                   # c4
        O.Extend("c3", (0,) * 7, seed=3),
        O.Retain("c3"),
        O.Close("c1"),
        Snapshot("c3", "a"),                            # the same name again: replaced atomically
        Restore("a"),                                   # c5
        O.Match((1, 2, 0, 1, 2, 0, 0, 9)),              # c6
        O.Allocate(),                                   # c7: empty
        Snapshot("c7", "empty"),
        Restore("empty"),                               # c8
    ]


def test_snapshot_ops_round_trip_as_json():
    for op in sequence():
        assert O.op_from_json(op.to_json()) == op


@pytest.mark.parametrize("page_tokens", [1, 3, 4])
def test_snapshot_and_restore_in_lockstep(machine_config, page_tokens):
    lockstep = Lockstep(numpy_factory, machine_config.with_(page_tokens=page_tokens))
    lockstep.run(sequence())
    assert set(lockstep.live) == {"c2", "c3", "c4", "c5", "c6", "c7", "c8"}
    assert len(lockstep.live["c3"][0]) == 12 and len(lockstep.live["c4"][0]) == 5
    assert len(lockstep.live["c5"][0]) == 12
    lockstep.finish()


def test_lockstep_catches_a_restore_that_loses_a_position(machine_config, monkeypatch):
    """The checks can fail: a restore that drops the last position is caught."""
    from kvstate.impl import snapshot_restore, snapshot_stream

    # a body read whole, and one streamed into pages
    for module, name in ((snapshot_restore, "_adopt"), (snapshot_stream, "_adopt_prepared")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda cache, tokens, pages, n, real=real: real(cache, tokens, pages, max(n - 1, 0)))
    lockstep = Lockstep(numpy_factory, machine_config)
    with pytest.raises(InvariantViolation):
        lockstep.run([O.Allocate(), O.Extend("c1", (1, 2, 3), seed=1), Snapshot("c1", "a"), Restore("a")])
