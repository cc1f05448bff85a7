"""The hostile-input fuzzer (``fuzz/hostile_inputs.py``) at CI size; more with ``-m slow``.

Each call either does what the documentation says or raises a ``kvstate.spec.errors``
class and changes nothing; ``Finding`` is raised otherwise and Hypothesis shrinks it.
"""

from __future__ import annotations

import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstate.fuzz import hostile_inputs as H

CI = settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
SLOW = settings(max_examples=2000, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def _drive(data, store, precision, steps):
    tally = H.Tally()
    with tempfile.TemporaryDirectory() as folder:
        H.drive(data, H.Harness(store, precision, tally, folder), steps=steps)
    assert not tally.findings, tally.findings
    return tally


@CI
@given(st.data(), st.sampled_from(H.stores()), st.sampled_from(["f32", "f16", "q8"]))
def test_hostile_calls_are_done_or_refused_by_name(data, store, precision):
    _drive(data, store, precision, steps=6)


@CI
@given(H.cache_arguments())
def test_hostile_cache_arguments(args):
    tally = H.Tally()
    H.construct(tally, args)
    assert not tally.findings


@pytest.mark.slow
@SLOW
@given(st.data(), st.sampled_from(H.stores()), st.sampled_from(["f32", "f16", "q8"]))
def test_hostile_calls_long(data, store, precision):
    _drive(data, store, precision, steps=12)


@pytest.mark.slow
@SLOW
@given(H.cache_arguments())
def test_hostile_cache_arguments_long(args):
    tally = H.Tally()
    H.construct(tally, args)
    assert not tally.findings


@CI
@given(H.replay_documents())
def test_hostile_replay_files(document):
    tally = H.Tally()
    with tempfile.TemporaryDirectory() as folder:
        H.cli_replay(tally, document, folder)
    assert not tally.findings


@pytest.mark.slow
@SLOW
@given(H.replay_documents())
def test_hostile_replay_files_long(document):
    tally = H.Tally()
    with tempfile.TemporaryDirectory() as folder:
        H.cli_replay(tally, document, folder)
    assert not tally.findings


@pytest.mark.parametrize("store", ["numpy", "torch"])
def test_a_page_store_class_is_refused_where_an_instance_goes(store):
    if store == "torch":
        pytest.importorskip("torch")
        from kvstate.impl.torch_store import TorchStore as cls
    else:
        from kvstate.impl.numpy_store import NumpyStore as cls
    from kvstate import Cache, Layout
    from kvstate.spec.errors import ConfigError
    with pytest.raises(ConfigError, match=f"not the class {cls.__name__}"):
        Cache(Layout(1, 1, 2), page_tokens=2, store=cls)
