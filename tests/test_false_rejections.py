"""Correct backends the suite rejected: a false-rejection audit (s68), each case with kvstate's own engine
in a configuration a backend may declare, so the control is the engine the suite trusts most.

- ``1 write copies 1`` in a refusing pool exactly the size of its 2.5-page context: the fork's copy did not
  fit, both sides refused it, and the check still asked for one page allocated;
- ``boundaries`` in a refusing pool smaller than its six wide token ids: both sides refused the extend,
  and the check compared the context's tokens with ids never written;
- ``portable snapshots`` restoring into another precision's declared configuration whose pool cannot hold
  the context (with no reference beside it, a correct ``CapacityError`` read as a failure);
- ``no aliasing`` crashing on ``ctx.tokens`` returned as a tuple or ``TokenIds`` (and blaming the backend).
"""

from __future__ import annotations

import numpy as np

from kvstate import TokenIds
from kvstate.impl.numpy import factory as numpy_factory
from kvstate.spec import Config, Layout
from kvstate.stateful.conform import conform

LAYOUT = Layout(layers=2, kv_heads=2, head_dim=4)


def _declaring(*configs: Config):
    def factory(config):
        return numpy_factory(config)
    factory.configs, factory.any_page_size = list(configs), False
    return factory


def _outcomes(factory, check: str) -> dict[str, object]:
    return {r.config.name: r.outcomes[check] for r in conform(factory, profile="hunt", checks=[check])}


def test_a_pool_the_size_of_the_context_makes_one_write_copies_one_not_applicable():
    factory = _declaring(Config(LAYOUT, page_tokens=8, precision="f32", pool_pages=3, on_full="refuse", max_entries=2),
                         Config(LAYOUT, page_tokens=4, precision="f32", pool_pages=3, on_full="evict-then-refuse",
                                max_entries=2),
                         Config(LAYOUT, page_tokens=4, precision="f32", pool_pages=4, on_full="refuse", max_entries=2))
    outcomes = _outcomes(factory, "1 write copies 1")
    assert [o.status for o in outcomes.values()] == ["n/a", "n/a", "pass"], outcomes
    assert "cannot hold the one page a write into the fork copies" in outcomes["f32-pool3-refuse"].detail


def test_a_pool_too_small_for_the_wide_ids_passes_boundaries_and_says_what_it_skipped():
    factory = _declaring(Config(LAYOUT, page_tokens=1, precision="f32", pool_pages=5, on_full="refuse", max_entries=2))
    (outcome,) = _outcomes(factory, "boundaries").values()
    assert outcome.status == "pass", outcome.detail
    assert "cannot hold the 6 wide token ids" in outcome.note and "(CapacityError)" in outcome.note


def test_portable_snapshots_restore_only_into_a_declared_pool_that_holds_the_context():
    roomy = Config(LAYOUT, page_tokens=4, precision="f32", pool_pages=12, on_full="refuse", max_entries=2)
    small = Config(LAYOUT, page_tokens=4, precision="f16", pool_pages=2, on_full="refuse", max_entries=2)
    outcomes = _outcomes(_declaring(roomy, small), "portable snapshots")
    assert outcomes[roomy.name].status == "n/a", outcomes[roomy.name].detail   # its only other precision cannot hold it
    assert outcomes[small.name].status == "n/a"     # its own context does not fit: the check's start is n/a
    wider = Config(LAYOUT, page_tokens=4, precision="f16", pool_pages=3, on_full="refuse", max_entries=2)
    outcomes = _outcomes(_declaring(roomy, small, wider), "portable snapshots")
    assert outcomes[roomy.name].status == "pass"    # into f16 pool 3, which holds the 2.5 pages


def test_a_tuple_or_token_ids_from_tokens_is_compared_as_ids_not_crashed_on():
    from kvstate.stateful.directed.edges import _frozen

    for tokens in ((1, 2, 3), TokenIds([1, 2, 3]), [1, 2, 3], np.array([1, 2, 3])):
        frozen = _frozen(tokens)
        assert frozen.dtype == np.int64 and frozen.tolist() == [1, 2, 3], type(tokens)


def test_the_durability_record_sees_os_functions_a_module_bound_at_import(tmp_path, monkeypatch):
    """``from os import fsync, replace`` at the top of a backend's module: its correct path write was
    reported as "nothing was renamed over the target (os calls seen: none)" (F4)."""
    import os
    import sys
    import types

    from kvstate.stateful.directed.snapshot_writes import _recorder

    module = types.ModuleType("a_backend_binding_os_names")
    module.sync, module.move = os.fsync, os.replace       # bound before the record starts, under other names
    monkeypatch.setitem(sys.modules, module.__name__, module)
    temporary, target = tmp_path / "t", tmp_path / "snapshot.kvs"
    with _recorder() as events:
        with open(temporary, "wb") as file:
            file.write(b"12345")
            file.flush()
            module.sync(file.fileno())
        module.move(temporary, target)
    assert [(e[0], e[1], e[3]) for e in events] == [("sync", "file", 5), ("rename", "file", 5)], events
    assert module.sync is os.fsync and module.move is os.replace      # put back as they were
