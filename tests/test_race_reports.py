"""What a race failure shows: where it happened, what each thread last did, and a command that runs
that iteration again; and how ``kvstate conform`` runs the scenarios (two schedules each).

From two audits: a failure named a thread and an exception and nothing else, and two planted lock
bugs were caught in 1 to 3 of 3 configurations depending on the run."""

from __future__ import annotations

import re
import shlex
import threading
import time

import pytest

from kvstate.cli import main
from kvstate.stateful import conform as conform_module
from kvstate.stateful.races import harness
from kvstate.stateful.races import scenarios as races
from kvstate.stateful.races.trace import Trace, TracedCache

AUDIT_BUGS = "tests/foreign/audit_snapshots_bugs.py"


@pytest.fixture
def forks_forget_their_refcounts(monkeypatch):
    from kvstate.impl import refcounts

    monkeypatch.setattr(refcounts.Refcounts, "share_holding", lambda self, holding: None)


@pytest.fixture
def writes_skip_their_copy(monkeypatch):
    """Shared pages written in place: seen only after a branch writes, so each report shows a write
    (a fork that forgets its refcounts can be seen before any branch has written)."""
    from kvstate.impl import context

    monkeypatch.setattr(context.Context, "writable", lambda self, index: self._pages[index])


def _failure(scenario, **options) -> races.RaceFailure:
    with pytest.raises(races.RaceFailure) as caught:
        scenario("numpy", **options)
    return caught.value


def test_a_race_failure_names_its_iteration_each_threads_operations_and_a_rerun(writes_skip_their_copy):
    notes = _failure(races.fork_storm, seed=7, iterations=1, threads=4).__notes__
    assert notes[0] == "race: fork_storm, configuration f32-heap, store numpy, seed 7, iteration 0"
    threads = [note for note in notes if re.match(r"  thread \d: ", note)]
    assert threads, notes
    # Each branch's fork of the parent (the main thread's c1), then its own writes, with their sizes,
    # as far as each got when the first failure was seen.
    assert all(note.partition(": ")[2].startswith("c1.fork()") for note in threads), threads
    assert any(re.search(r"c1\.fork\(\) -> c(\d+); c\1\.(extend|overwrite)\((at \d+, )?\d+ tokens?\)", note)
               for note in threads), threads
    assert any(note.startswith("  main: allocate() -> c1; c1.extend(") for note in notes), notes
    assert notes[-1].endswith("kvstate race fork_storm --store numpy --config f32-heap --seed 7 --iteration 0 "
                              "--threads 4")


def test_a_thread_failure_freezes_the_trace_with_the_operations_then_running():
    """The other threads run on to their end after one fails; the report shows them as they were."""
    trace = Trace(length=3)
    for n in range(5):
        trace.started("extend", "c1", (f"{n} tokens",))[3] = ""
    running = trace.started("read", "c1", ())
    trace.freeze()
    running[3] = ""
    trace.started("close", "c1", ())
    assert trace.lines() == ["main: c1.extend(3 tokens); c1.extend(4 tokens); c1.read() ...running"]


def test_the_trace_shows_the_other_threads_as_they_were_when_one_failed():
    report = races.RaceReport("planted", "numpy", 0)
    cache = races.make_cache("numpy", races.race_configs()[0], report.trace)

    def failing() -> None:
        cache.allocate()
        raise RuntimeError("planted")

    def going_on() -> None:
        ctx = cache.allocate()
        deadline = time.monotonic() + 5
        while report.trace.frozen is None and time.monotonic() < deadline:
            time.sleep(0.001)
        ctx.close()         # after the failure: not in its report

    with pytest.raises(races.RaceFailure, match="thread 0: RuntimeError: planted"):
        races.run_threads([failing, going_on], "planted", report=report)
    lines = report.trace.lines()
    assert [re.sub(r"c\d$", "cN", line) for line in lines] == ["thread 0: allocate() -> cN", "thread 1: allocate() -> cN"], lines


def test_the_traced_cache_keeps_the_backends_results_and_errors():
    config = races.race_configs()[0]
    trace = Trace()
    cache = races.make_cache("numpy", config, trace)
    assert isinstance(cache, TracedCache)
    ctx = cache.allocate()
    races.extend(ctx, config, [1, 2, 3])
    cache.retain(ctx)
    hit, matched = cache.match([1, 2, 3, 4])
    assert matched == 3 and hit.tokens == [1, 2, 3] and len(hit) == 3
    ctx.close()
    with pytest.raises(Exception) as refused:
        ctx.fork()
    assert trace.lines() == [f"main: allocate() -> c1; c1.extend(3 tokens); retain(c1); match(4 tokens) -> c2, 3 matched; "
                             f"c1.close(); c1.fork() -> {type(refused.value).__name__}"]
    hit.close()
    races.check_emptied(cache, "traced")


def _operations(report) -> dict[str, list[tuple]]:
    """Each thread's operations and arguments, without the context names (which follow the schedule)
    and without the refusals of a busy context (retried as often as the schedule makes them)."""
    return {name: [(entry[0], entry[2]) for entry in ring if entry[3] != "ContextBusyError"]
            for name, ring in report.trace.rings.values()}


def test_a_rerun_issues_the_iterations_operations_again(monkeypatch):
    monkeypatch.setattr("kvstate.stateful.races.trace.TRACE_LENGTH", 1000)    # the whole iteration
    config = races.race_configs()[2]
    whole = races.fork_storm("numpy", seed=3, iterations=3, threads=4)
    rerun = races.run_iteration("fork_storm", "numpy", config, seed=3, iteration=2, threads=4)
    assert whole.configs[2] == rerun.configs[0] == config.name
    first = _operations(whole)
    assert len(first) == 5 and sum(len(ops) for ops in first.values()) > 20    # the main thread and 4 branches
    assert _operations(rerun) == first


def test_a_failure_whose_rerun_cannot_be_named_is_still_reported():
    from kvstate.impl.numpy import factory as numpy_factory
    from kvstate.stateful.races.rerun import annotate

    def unlisted(config):       # declares semantics no configuration list knows
        return numpy_factory(config)
    unlisted.semantics = ("no-such-semantics",)
    report = races.RaceReport("close_races", unlisted, 0, at=(0, races.race_configs()[0]))
    error = RuntimeError("the backend's")
    annotate(error, report)
    assert error.__notes__[0].startswith("race: close_races, configuration f32-heap, store ")
    assert error.__notes__[-1].startswith("rerun (the same operations, a new schedule): none (ConfigError: ")


def test_the_printed_rerun_command_runs_that_iteration_again(forks_forget_their_refcounts, capsys):
    command = _failure(races.fork_storm, seed=7, iterations=1, threads=4).__notes__[-1].partition(": ")[2]
    argv = shlex.split(command)
    assert argv[0] == "kvstate"
    assert main(argv[1:]) == 1
    out = capsys.readouterr().out
    assert out.startswith("FAILED: RaceFailure: fork_storm[numpy, f32-heap] seed=7 iteration=0"), out
    assert command in out


def test_the_rerun_command_passes_a_sound_iteration_and_refuses_an_unknown_configuration(capsys):
    assert main(["race", "close_races", "--store", "numpy", "--config", "f16-arena8", "--seed", "2",
                 "--iteration", "5"]) == 0
    assert capsys.readouterr().out.startswith("passed: close_races[numpy] seed=2 iterations=1")
    assert main(["race", "close_races", "--store", "numpy", "--config", "f64-heap"]) == 2
    assert "no configuration 'f64-heap'; known: f32-heap" in capsys.readouterr().err


def test_a_backend_failure_prints_a_rerun_naming_the_backend_file():
    from kvstate.stateful.backends import load_factory

    close_plain = load_factory(f"{AUDIT_BUGS}:close_plain")
    config = close_plain.configs[0]
    with pytest.raises(races.RaceFailure) as caught:
        for seed in range(3):       # caught at the first in 30 of 30 runs
            races.eviction_vs_allocation(close_plain, seed=seed, iterations=2, configs=[config], yields=True)
    rerun = caught.value.__notes__[-1]
    assert re.search(r"kvstate race eviction_vs_allocation --backend \S+/tests/foreign/audit_snapshots_bugs\.py:"
                     r"close_plain --config f32-heap --seed \d --iteration \d --threads 6 --yields$", rerun), rerun


def test_conform_runs_each_scenario_as_the_interpreter_switches_then_with_yields(monkeypatch):
    from kvstate.impl.numpy import factory
    from kvstate.stateful.configs import config_named

    calls = []

    def recorder(name):
        def run(store, seed, iterations, configs, yields=False, **options):
            calls.append((name, seed, iterations, yields))
            return races.RaceReport(name, store, seed)
        return run
    for name in races.SCENARIOS:
        monkeypatch.setitem(races.SCENARIOS, name, recorder(name))
    outcome = conform_module.races_check(factory, config_named("f32-heap"), None)
    assert outcome.status == "pass"
    names = list(dict.fromkeys(call[0] for call in calls))
    assert "fork_storm" in names and "snapshot_vs_decode" in names
    rounds = [(0, 2, False), (1, 1, True), (2, 1, True), (3, 1, True)]     # instant scenarios: every round fits
    assert calls == [(name, *round_) for name in names for round_ in rounds]


def test_a_slow_scenario_runs_two_rounds_and_a_fast_one_more():
    slow = iter([0.0, 0.6])            # two rounds took 0.6 s: past the budget
    assert [seed for seed, _ in conform_module.race_rounds(lambda: next(slow))] == [0, 1]
    fast = iter([0.0, 0.1, 0.2])
    assert [options for _, options in conform_module.race_rounds(lambda: next(fast))] == \
        [{"iterations": 2}] + 3 * [{"iterations": 1, "yields": True}]


@pytest.mark.parametrize("bug", ["close_plain", pytest.param("restore_unlocked", marks=pytest.mark.slow)])
def test_conform_catches_the_audits_unlocked_close_and_restore(bug):
    """Before the rounds with yields: caught in 19 and 16 of 30 configurations (10 runs of 3).
    ``restore_unlocked`` under ``-m slow``: caught only by the last scenario, after all the others' rounds."""
    from kvstate.stateful.backends import load_factory
    from kvstate.stateful.conform import conform

    factory = load_factory(f"{AUDIT_BUGS}:{bug}")
    (result,) = conform(factory, configs=factory.configs[:1], checks=["races"])
    outcome = result.outcomes["races"]
    assert outcome.status == "FAIL" and "rerun (the same operations, a new schedule): kvstate race" in outcome.detail


def test_stress_prints_each_threads_operations_and_the_rerun(forks_forget_their_refcounts, capsys):
    assert main(["stress", "--minutes", "0", "--store", "numpy", "--scenario", "fork_storm", "--scale", "1"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^FAILED: fork_storm\[numpy, ", out, re.M), out
    assert re.search(r"^  thread \d+: c1\.fork\(\)", out, re.M), out
    assert re.search(r"^rerun \(the same operations, a new schedule\): kvstate race fork_storm --store numpy --config \S+ "
                     r"--seed 0 --iteration \d+ --threads 16$", out, re.M), out


def test_stress_races_a_thread_safe_backend_where_conform_would(capsys):
    """``kvstate stress`` took built-in stores only, so a foreign engine could be raced for minutes
    only by looping ``conform --check races`` (audit 3). Each scenario in each configuration its
    ``races`` check runs; a backend that claims no thread safety is refused by name."""
    from kvstate.stateful.backends import load_factory

    factory = load_factory("tests/foreign/audit3_locks.py")
    applies = races._applicability(factory)
    planned = {name: races._planned(name, applies) for name in races.SCENARIOS}
    assert planned.pop("snapshot_vs_decode") is None            # no restore: conform skips it too
    assert {name: [c.name for c in configs] for name, (configs, _options) in planned.items()} == {
        name: [c.name for c in factory.configs] for name in planned}
    assert planned["fork_storm"][1] == {"threads": 8}           # conform's size
    assert main(["stress", "--minutes", "0", "--backend", "tests/foreign/audit3_locks.py", "--scale", "1"]) == 0
    assert re.search(r"^total \w+\[factory\]: rounds=1, iterations=4\b", capsys.readouterr().out, re.M)
    assert main(["stress", "--minutes", "0", "--backend", "tests/foreign/audit_minimal.py"]) == 2
    assert "is raced in no configuration: the factory does not declare thread_safe = True" in capsys.readouterr().err


def test_stress_finds_a_backends_race_and_prints_its_rerun(capsys):
    """Audit 3's ``stamp_outside_lock``, raced until found or half a minute has passed (found in the
    first round in every run by hand)."""
    assert main(["stress", "--minutes", "0.5", "--backend", "tests/foreign/audit3_locks_bugs.py:stamp_outside_lock",
                 "--scenario", "hits_stamp_under_race", "--scale", "1"]) == 1
    out = capsys.readouterr().out
    assert re.search(r"^FAILED: hits_stamp_under_race\[stamp_outside_lock, \S+\] .*every order of those hits", out,
                     re.M), out
    assert re.search(r"^rerun \(the same operations, a new schedule\): kvstate race hits_stamp_under_race --backend "
                     r"\S+audit3_locks_bugs\.py:stamp_outside_lock --config \S+", out, re.M), out


def test_a_deadlock_is_reported_with_where_each_thread_waits(monkeypatch):
    """Two threads taking two locks in opposite orders (an audit's engine closed a context so): the
    report names the line each one waits at. It said "threads [...] still running after 120s
    (deadlock?)" and nothing of where they waited."""
    monkeypatch.setattr(harness, "THREAD_TIMEOUT", 0.5)
    first, second = threading.Lock(), threading.Lock()
    both_hold_one = threading.Barrier(2)

    def taking(one, other):
        def body() -> None:
            with one:
                both_hold_one.wait()
                if other.acquire(timeout=10):      # held by the other thread, waiting for ``one``
                    other.release()
        return body

    with pytest.raises(races.RaceFailure) as caught:
        races.run_threads([taking(first, second), taking(second, first)], "planted")
    message = str(caught.value)
    assert message.startswith("planted: 2 of its threads still running after 0.5 s, a deadlock"), message
    assert re.search(r"thread 0 at test_race_reports\.py:\d+ in body; thread 1 at test_race_reports\.py:\d+ in body$",
                     message), message
