"""The spec's integer arithmetic: CrossHair finds no counterexample, and it would find one.

Also runs properties over the same pure functions with Hypothesis, once with its
own backend and once with the ``crosshair`` backend (hypothesis-crosshair), and
checks that the vectorised q8 clip agrees with the scalar rule CrossHair proves.
"""

from __future__ import annotations

import functools
import importlib.util
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstate.spec import arithmetic as A
from kvstate.spec import precision

ARITHMETIC = Path(A.__file__)
CROSSHAIR = shutil.which("crosshair") or (
    str(Path(sys.executable).with_name("crosshair")) if Path(sys.executable).with_name("crosshair").exists() else None)
needs_crosshair = pytest.mark.skipif(CROSSHAIR is None, reason="crosshair-tool is not installed (pip install -e .[test])")
HAS_PLUGIN = importlib.util.find_spec("hypothesis_crosshair_provider") is not None

# Conditions CrossHair must confirm over *all* paths (functions on integers only). The
# tuple functions (common_prefix_length, match_stop) have unboundedly many paths: for
# them CrossHair can only fail to refute within its budget, which the check also requires.
MUST_CONFIRM = ("page_of", "offset_in_page", "pages_needed", "pages_touched", "span_in_page",
                "truncate_keep", "split_edge", "walk_step", "q8_code")


def crosshair_check(target: Path, timeout: float = 0.75) -> subprocess.CompletedProcess:
    # Seconds of CPU a condition: every integer function confirms within 0.5, and the six
    # conditions of the two tuple functions spend the whole budget, so it sets the test's length
    # (the check took 11 s at 1.5 s a condition, 7 s at 0.75).
    return subprocess.run(
        [CROSSHAIR, "check", "--analysis_kind=PEP316", f"--per_condition_timeout={timeout}", "--report_all",
         str(target)],
        capture_output=True, text=True, timeout=300)


def _function_at(lines: list[str], lineno: int) -> str:
    """The function whose docstring holds line ``lineno`` (1-based) of the source."""
    for line in reversed(lines[:lineno]):
        if line.startswith("def "):
            return line[4:line.index("(")]
    return "?"


@needs_crosshair
def test_crosshair_finds_no_counterexample_and_confirms_the_integer_functions():
    run = crosshair_check(ARITHMETIC)
    assert run.returncode == 0 and ": error:" not in run.stdout, run.stdout + run.stderr
    source = ARITHMETIC.read_text().splitlines()
    confirmed, unrefuted = set(), set()
    for line in run.stdout.splitlines():
        _path, lineno, _kind, message = line.rsplit(":", 3)
        name = _function_at(source, int(lineno))
        (confirmed if "Confirmed over all paths" in message else unrefuted).add(name)
    assert set(MUST_CONFIRM) <= confirmed - unrefuted, run.stdout
    # every contracted function was analysed
    contracted = {_function_at(source, i + 1) for i, line in enumerate(source) if line.strip().startswith("post:")}
    assert contracted <= confirmed | unrefuted


@needs_crosshair
def test_crosshair_refutes_a_wrong_contract(tmp_path):
    """The check can fail: a pages_needed that rounds down is caught with a counterexample."""
    wrong = tmp_path / "wrong_arithmetic.py"
    wrong.write_text(textwrap.dedent('''
        def pages_needed(positions: int, page_tokens: int) -> int:
            """
            pre: positions >= 0
            pre: page_tokens >= 1
            post: __return__ * page_tokens >= positions
            """
            return positions // page_tokens
    '''))
    run = crosshair_check(wrong)
    assert run.returncode == 1 and "error:" in run.stdout, run.stdout + run.stderr


# -- properties, run with Hypothesis's own backend and with CrossHair's --------------

positions = st.integers(0, 10**6)
sizes = st.integers(1, 512)


def prop_span_tiles_the_write(start, length, page_tokens):
    """The spans of every touched page tile ``[start, stop)`` in order, without gaps."""
    stop = start + length
    first, end = A.pages_touched(start, stop, page_tokens)
    covered = start
    for page in range(first, end):
        lo, hi = A.span_in_page(page, start, stop, page_tokens)
        assert page * page_tokens + lo == covered
        covered = page * page_tokens + hi
    assert covered == stop


def prop_truncate_keeps_what_positions_need(length, keep, page_tokens):
    keep = min(keep, length)
    kept, released = A.truncate_keep(length, keep, page_tokens)
    assert kept == A.pages_needed(keep, page_tokens)
    assert kept + released == A.pages_needed(length, page_tokens)
    if keep:
        assert A.page_of(keep - 1, page_tokens) == kept - 1     # the last kept position's page is kept


def prop_common_prefix_and_split(a, b):
    n = A.common_prefix_length(a, b)
    assert list(a[:n]) == list(b[:n])
    assert n == min(len(a), len(b)) or a[n] != b[n]
    if 1 <= n < len(a) and n <= len(b):
        upper, lower, leaf = A.split_edge(len(a), len(b), n)
        assert a[:upper] == b[:upper] and len(a[upper:]) == lower and len(b[upper:]) == leaf


def prop_match_stop_is_the_deepest_entry(flags):
    flags = tuple(flags)
    stop = A.match_stop(flags)
    deepest = max((i for i, f in enumerate(flags) if f), default=-1)
    assert stop == deepest


PROPERTIES = [
    (prop_span_tiles_the_write, (st.integers(0, 10**4), st.integers(1, 64), st.integers(1, 16))),
    (prop_truncate_keeps_what_positions_need, (positions, positions, sizes)),
    (prop_common_prefix_and_split, (st.lists(st.integers(0, 2), max_size=6).map(tuple),
                                    st.lists(st.integers(0, 2), max_size=6).map(tuple))),
    (prop_match_stop_is_the_deepest_entry, (st.lists(st.booleans(), max_size=8),)),
]
IDS = [prop.__name__[5:] for prop, _ in PROPERTIES]
def _fresh(prop):
    """A new function object per test, so each can carry its own settings."""
    @functools.wraps(prop)
    def run(*args, **kwargs):
        return prop(*args, **kwargs)
    return run


_quiet = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("prop, strategies", PROPERTIES, ids=IDS)
def test_property_hypothesis(prop, strategies):
    given(*strategies)(settings(max_examples=200, derandomize=True, **_quiet)(_fresh(prop)))()


@pytest.mark.skipif(not HAS_PLUGIN, reason="hypothesis-crosshair is not installed (pip install -e .[test])")
@pytest.mark.parametrize("prop, strategies", PROPERTIES, ids=IDS)
def test_property_crosshair_backend(prop, strategies):
    given(*strategies)(settings(backend="crosshair", max_examples=10, **_quiet)(_fresh(prop)))()


@pytest.mark.skipif(not HAS_PLUGIN, reason="hypothesis-crosshair is not installed (pip install -e .[test])")
def test_crosshair_backend_bites():
    """The backend finds a boundary case random draws almost never hit."""
    def wrong(start, page_tokens):
        assert A.offset_in_page(start, page_tokens) != page_tokens - 1 or page_tokens < 1000

    run = given(st.integers(0, 10**9), st.integers(1, 10**6))(settings(backend="crosshair", max_examples=100,
                                                                       **_quiet)(wrong))
    with pytest.raises(AssertionError):
        run()


# -- the vectorised q8 clip is the scalar rule, element by element ---------------------

finite = st.floats(-1e6, 1e6, allow_nan=False, width=32)


@settings(max_examples=300, derandomize=True, **_quiet)
@given(st.lists(finite, min_size=1, max_size=16))
def test_q8_encode_applies_q8_code_to_each_element(xs):
    x = np.array(xs, np.float32)
    codes, scales = precision.q8_encode(x)
    scale = np.float32(np.abs(x).max() / np.float32(precision.Q8_MAX))
    assert scales == scale
    for value, code in zip(x, codes):
        ratio = float(value / scale) if scale > 0 else 0.0
        assert int(code) == A.q8_code(round(ratio))      # round() is half-to-even, like np.rint


def test_q8_code_clips_ratios_beyond_the_range():
    """The vectorised clip agrees with the scalar rule exactly at and past +-127."""
    ratios = np.array([-300.0, -127.5, -127.0, -126.5, 0.5, 1.5, 126.5, 127.0, 127.5, 300.0], np.float32)
    vector = np.clip(np.rint(ratios), -precision.Q8_MAX, precision.Q8_MAX).astype(int)
    assert vector.tolist() == [A.q8_code(round(float(r))) for r in ratios]


def test_q8_codes_round_exact_ties_half_to_even():
    # An audit's mutant (s73): rounding half up (floor(ratio + 0.5)) passed the property above, which
    # never drew an exact tie, and every numpy check (the reference shares this function); only the
    # torch engine's own q8 code disagreed. With 127 the largest value, the scale is 1: codes are the values.
    codes, scales = precision.q8_encode(np.array([[127, 2.5, -1.5, 0.5, -0.5, 3.5]], np.float32))
    assert scales.tolist() == [1.0]
    assert codes.tolist() == [[127, 2, -2, 0, 0, 4]]
    assert precision.q8_decode(codes, scales).tolist() == [[127, 2, -2, 0, 0, 4]]
