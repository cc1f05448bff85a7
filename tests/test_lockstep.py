"""The lockstep machine, engine against reference, in all six configurations."""

from hypothesis.stateful import run_state_machine_as_test

from kvstate.impl.numpy import factory as numpy_factory
from kvstate.stateful.configs import PROFILES
from kvstate.stateful.machine import machine_for


def test_lockstep_machine(machine_config):
    machine = machine_for(numpy_factory, machine_config)
    run_state_machine_as_test(machine, settings=PROFILES["ci"])
    # The run really exercised the engine: many runs, many checked steps.
    assert machine.stats.runs >= 50
    assert machine.stats.steps >= 1000
    assert machine.stats.snapshots >= 20 and machine.stats.restores >= 20
