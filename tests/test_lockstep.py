"""The lockstep machine, engine against reference, in all six configurations, with every page
recycled.

The machine's layouts are small, so its pages would normally be left to malloc (``np.zeros``;
pages of 2 MiB or more go through the NumPy store's spares). Here every page goes through the
spares, dirty from its last holder, at every precision, with and without an arena: one run checks
both the engine's semantics and page recycling (a fresh page is still made whenever no spare is
kept, as at every run's start). The malloc path runs under the lockstep machine in the seven
semantics configurations of tests/test_planted_bugs.py (and under -m slow the seeded engine in
all thirteen).
"""

from kvstate.impl import numpy_store
from kvstate.impl.numpy import factory as numpy_factory
from kvstate.stateful.configs import PROFILES
from kvstate.stateful.machine import machine_for, run_machine


def test_lockstep_machine(machine_config, monkeypatch):
    monkeypatch.setattr(numpy_store, "RECYCLE_FROM_BYTES", 0)
    reused = []
    take = numpy_store.NumpyStore._heap_arrays

    def counting(store, zero):
        spares = len(store._spares)
        arrays = take(store, zero)
        reused.append(len(store._spares) < spares)
        return arrays
    monkeypatch.setattr(numpy_store.NumpyStore, "_heap_arrays", counting)
    machine = machine_for(numpy_factory, machine_config)
    run_machine(machine, PROFILES["ci"])
    # The run really exercised the engine: many runs, many checked steps, snapshots restored (the
    # ci profile's 50 examples: 56-68 runs, 1,820-2,258 steps, 196-543 snapshots and 152-257
    # restores per configuration; the same in every process, ``stateful/fixed_constants.py``).
    assert machine.stats.runs >= PROFILES["ci"].max_examples
    assert machine.stats.steps >= 1000
    assert machine.stats.snapshots >= 100 and machine.stats.restores >= 100
    # Pages really came back dirty from the spares (the heap configurations reuse 83-110 pages;
    # with an arena the heap holds only what the arena does not, 20-59).
    assert sum(reused) >= (30 if machine_config.arena_pages == 0 else 5)
