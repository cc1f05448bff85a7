"""A derandomized lockstep run draws the same operations whatever the process imported before.

Hypothesis answers some integer draws with literals harvested from every local module loaded;
``stateful/fixed_constants.py`` empties that pool while the machine runs. The control shows the
harvest really moves an unpinned run, so the pinned comparison could fail.
"""

import hashlib
import importlib.util
import sys

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvstate.impl.numpy import factory as numpy_factory
from kvstate.stateful.configs import PROFILES, config_named
from kvstate.stateful.fixed_constants import patchable
from kvstate.stateful.machine import machine_for, run_machine

pytestmark = pytest.mark.skipif(not patchable(), reason="this Hypothesis harvests no local constants")

# Enough runs for the harvest to move an unpinned run (the control below moves at 4 already).
SMALL = settings(PROFILES["ci"], max_examples=6)


def _operations(run) -> str:
    """A digest of every operation the machine's runs applied, in order."""
    machine = machine_for(numpy_factory, config_named("q8-heap"))
    digest, do = hashlib.sha256(), machine._do

    def recording(self, op):
        digest.update(repr(op).encode())
        return do(self, op)
    machine._do = recording
    run(machine, SMALL)
    return digest.hexdigest()


def _import_constants(tmp_path, name: str) -> None:
    """Load a local module full of integer literals, as a backend or another test module might.
    Hypothesis keeps what it harvested for the process's life, so each name brings literals of its own."""
    path = tmp_path / f"{name}.py"
    first = 3 + sum(name.encode()) % 500
    path.write_text("LITERALS = [" + ", ".join(str(n) for n in range(first, 70_000, 997)) + "]\n")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


@pytest.fixture
def imports(tmp_path):
    names = []
    yield lambda name: (names.append(name), _import_constants(tmp_path, name))
    for name in names:
        sys.modules.pop(name, None)


def test_a_pinned_run_draws_the_same_operations_after_new_imports(imports):
    before = _operations(run_machine)
    imports("kvstate_test_constants_pinned")
    _rescan_modules()
    assert _operations(run_machine) == before


def _rescan_modules() -> None:
    """Make Hypothesis look for new modules at its next draw. It looks only when ``len(sys.modules)``
    changed since it last looked, and an xdist worker's earlier tests remove modules too (this file's
    fixture among them), so a module imported here could leave the length where it was, unharvested:
    two clean-clone CI runs saw the control below move nothing."""
    from hypothesis.internal.conjecture import providers
    if hasattr(providers, "_sys_modules_len"):
        providers._sys_modules_len = None


def _hypothesis_own_harvest(monkeypatch) -> None:
    """Hypothesis's own harvest for this test, even where another thread of the process is still inside
    ``without_local_constants`` (a check ended at its time limit keeps running): two clean-clone CI runs
    drew, in the control below, exactly the operations of a run with no harvested constants."""
    from hypothesis.internal.conjecture import providers

    from kvstate.stateful import fixed_constants
    if providers._get_local_constants is fixed_constants._nothing_harvested:
        monkeypatch.setattr(providers, "_get_local_constants", fixed_constants._harvest)
    providers.CONSTANTS_CACHE.cache.clear()      # constants drawn from whichever pool was there before


def test_control_an_unpinned_run_moves_with_the_imports(imports, monkeypatch):
    _hypothesis_own_harvest(monkeypatch)

    def unpinned(machine, profile):
        run_state_machine_as_test(machine, settings=profile)
    before = _operations(unpinned)
    imports("kvstate_test_constants_unpinned")
    _rescan_modules()
    assert _operations(unpinned) != before
