"""The hostile-input fuzzer (``fuzz/hostile_inputs.py``) at CI size; more with ``-m slow``.

Each call either does what the documentation says or raises a ``kvstate.spec.errors``
class and changes nothing; ``Finding`` is raised otherwise and Hypothesis shrinks it.
"""

from __future__ import annotations

import tempfile

import numpy as np
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


# -- the write oracle can fail ------------------------------------------------------------------------

def _harness(store, precision, folder):
    return H.Harness(store, precision, H.Tally(), folder)


def _kv(n, bad=None):
    values = np.random.default_rng(0).standard_normal(H.LAYOUT.batch_shape(n)).astype(np.float32)
    return ("float32 array", values) if bad is None else (f"with {bad}", H._poison(values, bad))


@pytest.mark.parametrize("precision", ["f32", "q8"])
def test_the_write_oracle_reports_non_finite_values_stored(tmp_path, monkeypatch, precision):
    """With the numpy store's finite screen passing everything, NaN and inf are stored as they are,
    which equals their own round trip: the oracle must flag the acceptance itself (f16 is left out:
    its range check refuses infinity and NaN anyway)."""
    from kvstate.impl import numpy_store
    monkeypatch.setattr(numpy_store, "all_finite", lambda kv: True)
    harness = _harness("numpy", precision, str(tmp_path))
    with pytest.raises(H.Finding, match="extend.*accepted a K/V holding NaN or infinity"):
        harness.extend(harness.contexts[1], ("token list", [1, 2]), _kv(2, np.nan))
    with pytest.raises(H.Finding, match="overwrite.*accepted a K/V holding NaN or infinity"):
        harness.overwrite(harness.contexts[0], ("int", 1), ("token list", [3, 4]), _kv(2, np.inf))


@pytest.mark.parametrize("store", H.stores())
@pytest.mark.parametrize("precision", ["f32", "f16", "q8"])
def test_the_write_oracle_reports_overwritten_values_that_differ(tmp_path, monkeypatch, store, precision):
    """An overwrite that stores the right tokens but other values (here: zeros)."""
    from kvstate.impl.context import Context
    real = Context.overwrite
    monkeypatch.setattr(Context, "overwrite",
                        lambda self, start, tokens, kv: real(self, start, tokens, np.zeros_like(np.asarray(kv))))
    harness = _harness(store, precision, str(tmp_path))
    with pytest.raises(H.Finding, match="overwrite.*stored values differ from the precision's round trip"):
        harness.overwrite(harness.contexts[0], ("int", 2), ("token list", [3, 4, 5]), _kv(3))


@pytest.mark.parametrize("store", H.stores())
@pytest.mark.parametrize("precision", ["f32", "f16", "q8"])
def test_the_write_oracle_passes_the_engine_as_it_is(tmp_path, store, precision):
    """The calls above on the engine as shipped: the non-finite writes refused by name, changing
    nothing; the valid ones read back as their round trip. No finding."""
    harness = _harness(store, precision, str(tmp_path))
    harness.extend(harness.contexts[1], ("token list", [1, 2]), _kv(2, np.nan))
    harness.overwrite(harness.contexts[0], ("int", 1), ("token list", [3, 4]), _kv(2, np.inf))
    harness.overwrite(harness.contexts[0], ("int", 2), ("token list", [3, 4, 5]), _kv(3))
    harness.extend(harness.contexts[1], ("token list", [1, 2]), _kv(2))
    harness.overwrite(harness.contexts[1], ("int", 1), ("token list", [7]), _kv(1))
    assert not harness.tally.findings
    refused = dict(harness.tally.refused)
    assert set(refused) <= {"NonFiniteError", "PrecisionRangeError"} and sum(refused.values()) == 2, refused
    assert len(harness.contexts[1]) == 2


@pytest.mark.parametrize("module", ["hostile_inputs", "hostile_storage", "hostile_sweep"])
@pytest.mark.parametrize("count", ["-5", "0", "abc", "x", "²"])
def test_a_fuzzers_bad_count_is_one_line_and_exit_2(module, count, capsys):
    # README's command lines: -5 and 0 were a Hypothesis traceback, abc a ValueError one, and
    # hostile_sweep ran its default on x; each returns before any example runs
    import importlib
    main = importlib.import_module(f"kvstate.fuzz.{module}").main
    assert main([count]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"kvstate.fuzz.{module}: EXAMPLES must be one positive integer" in err, err
