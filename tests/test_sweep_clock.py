"""A sweep's report does not depend on the clock: the same under any load, or it says which stage a
time limit cut short.

In CI a Dask worker's shrink of a planted bug ran past the 60 s that bounded it (under load; 2 s idle):
its nanny ended it, and the cluster's report held the run's own 26-step failure where the local
pool's held the 8-step shrunk one, with nothing to tell them apart. Tries bound a shrink now; the
clock is a backstop, and where it ends a stage the failure's ``clock`` names it.
"""

import itertools
import json
import time

from kvstate.impl.numpy import factory as numpy_factory
from kvstate.stateful import ops as O
from kvstate.stateful.configs import config_named, configs_named
from kvstate.stateful.planted import PLANTED
from kvstate.stateful.shrink import Shrinker
from kvstate.stateful.sweeps import sweep as S
from kvstate.stateful.sweeps.runs import run_seed

BUG = "missing_copy_on_write"


def _failures(out) -> list[dict]:
    return json.loads((out / "report.json").read_text())["failures"]


def _racing_clock(step_s: float):
    """``time.monotonic`` on a machine so loaded that ``step_s`` seconds pass between any two readings."""
    real, ticks = time.monotonic, itertools.count()
    return lambda: real() + step_s * next(ticks)


def test_a_shrink_whose_clock_runs_out_reports_the_same_or_says_so(tmp_path, monkeypatch):
    configs = configs_named(["f32-heap"])
    with PLANTED[BUG]():
        calm = S.sweep(range(2), 60, configs, out_dir=tmp_path / "calm", progress=None, in_process=True)
        with monkeypatch.context() as loaded_machine:
            loaded_machine.setattr(time, "monotonic", _racing_clock(10.0))
            S.sweep(range(2), 60, configs, out_dir=tmp_path / "loaded", progress=None, in_process=True)
    assert calm.failures and not any(f.get("clock") for f in _failures(tmp_path / "calm"))
    for quiet, hurried in zip(_failures(tmp_path / "calm"), _failures(tmp_path / "loaded"), strict=True):
        if hurried.get("clock"):
            assert "shrink" in hurried["clock"] and not hurried["minimised"]
            continue
        assert {**hurried, "replay_file": None} == {**quiet, "replay_file": None}, \
            "the clock changed a failure, and its report does not say so"
    assert json.loads((tmp_path / "loaded" / "report.json").read_text())["clock_limited"] == ["f32-heap seed0: shrink"]


def test_a_shrink_that_comes_back_without_a_result_is_marked_lost(tmp_path, monkeypatch):
    """A worker's shrink that stalled for minutes came back as an error (its worker given up on): the
    sweep dropped it, and the report held the run's own failure, unmarked, where another's held the
    shrunk one."""
    def lost(*job):
        raise ConnectionResetError("the worker went away")

    monkeypatch.setattr(S, "shrink_result", lost)
    with PLANTED[BUG]():
        S.sweep(range(1), 60, configs_named(["f32-heap"]), out_dir=tmp_path, progress=None, in_process=True)
    [failure] = _failures(tmp_path)
    assert failure.get("clock") == ["shrink-lost"] and not failure["minimised"]


def test_a_shrink_stopped_by_its_try_limit_is_the_same_at_any_speed(monkeypatch):
    from kvstate.stateful.shrink import TRIES

    config = config_named("f32-heap")
    with PLANTED[BUG]():
        run = run_seed(numpy_factory, config, 0, 60)
        config, ops = config.with_(page_tokens=run.page_tokens), [O.op_from_json(op) for op in run.ops]

        def shrunk():
            shrinker = Shrinker(numpy_factory, config, run.failure, budget_s=1e6, max_tries=12)
            return shrinker.shrink(ops), shrinker.failure, shrinker.tries, shrinker.stopped

        idle = shrunk()
        monkeypatch.setattr(time, "monotonic", _racing_clock(1000.0))       # a budget of 1e6 s: a thousand readings
        assert shrunk() == idle
    assert idle[2:] == (12, TRIES) and len(idle[0]) < len(ops)
