"""What ``kvstate conform`` says about a backend's observation tiers, and what an arena of 0 slots is.

From an audit (``tests/foreign/audit2_repro/FINDINGS.md``, item 4): a heap-only engine reporting
``arena_size=0`` (as ``examples/listcache.py`` does) was listed with the tiers "pages, arena, tree",
read off its first configuration alone. The arena tier of a configuration without an arena is books
of 0 slots: invariant 3 then says only that no page holds a slot, so the list says no arena was
exercised; a tier seen in some configurations only says in how many. The verdict is unchanged: 0
slots where the configuration asks for an arena is rejected, as before, and now says what to report.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvstate.cli import main
from kvstate.impl.numpy import factory as numpy_factory
from kvstate.spec import Config, Layout
from kvstate.spec.errors import InvariantViolation
from kvstate.spec.invariants import NO_ARENA
from kvstate.stateful.configs import config_named
from kvstate.stateful.conform import conform, observed_tiers
from kvstate.stateful.lockstep import Lockstep

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _printed_tiers(capsys, argv: list[str]) -> list[str]:
    # --workers 1: in this process (two configurations would otherwise start spawned workers: seconds of
    # imports for a header; the pool has its own tests in tests/test_conform_pool.py)
    rc = main(["conform", *argv, "--check", "fork allocates 0", "--workers", "1"])
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("observation tiers: "))
    assert rc == 0, line
    listed = line.removeprefix("observation tiers: ").split(" (values, tokens")[0]
    return listed.split(", ")


def test_arena_books_of_0_slots_are_not_listed_as_an_arena(capsys):
    listed = _printed_tiers(capsys, [str(EXAMPLES / "listcache.py"), "--config", "f32-heap"])
    assert listed == ["pages", "arena books of 0 slots (no arena exercised)", "tree"]


def test_a_tier_some_configurations_lack_says_in_how_many(capsys):
    """The first configuration alone (a heap one here) decided the list before."""
    listed = _printed_tiers(capsys, ["kvstate.impl.numpy", "--config", "f32-heap", "--config", "q8-arena6"])
    assert listed == ["pages", "arena (1 of 2 configurations)", "tree", "shape"]
    assert _printed_tiers(capsys, ["kvstate.impl.numpy", "--config", "q8-arena6"]) == ["pages", "arena", "tree", "shape"]


def test_a_black_box_that_counts_its_pages_is_said_to(capsys):
    """Two audits (s73) read "observation tiers: none" above a failure of invariant 6's counts, which
    a black box reporting ``pages_allocated`` and ``pages_freed`` is held to."""
    import dataclasses

    from helpers import observed_as
    from kvstate.spec.observation import black_box

    Counting = observed_as(lambda obs: dataclasses.replace(black_box(), pages_allocated=obs.pages_allocated,
                                                           pages_freed=obs.pages_freed))
    Silent = observed_as(lambda obs: black_box())
    configs = [config_named("f32-heap")]
    assert observed_tiers(Counting, configs) == ["page counts (invariant 6)"]
    assert observed_tiers(Silent, configs) == []


def test_a_configuration_whose_cache_cannot_be_built_is_left_out_of_the_list():
    """The checks report that configuration's failure; the header must not crash before them."""
    def factory(config):
        if config.arena_pages:
            raise RuntimeError("no arena here")
        return numpy_factory(config)

    configs = [config_named("f32-heap"), config_named("q8-arena6")]
    assert observed_tiers(factory, configs) == ["pages", "arena books of 0 slots (no arena exercised)", "tree",
                                                "shape"]


def test_the_caches_built_for_the_tiers_are_cleared_once_observed():
    """Real engines' caches are large: the header's observations keep none of them filled."""
    cleared = []

    def factory(config):
        cache = numpy_factory(config)
        clear = cache.clear
        cache.clear = lambda: (cleared.append(config.name), clear())[1]
        return cache

    configs = [config_named("f32-heap"), config_named("q8-arena6")]
    assert observed_tiers(factory, configs) == ["pages", "arena (1 of 2 configurations)", "tree", "shape"]
    assert cleared == ["f32-heap", "q8-arena6"]

def _zero_slot_arena_factory():
    """``examples/listcache.py`` (``arena_size=0`` always) declaring an arena it does not have."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        from listcache import ListCache
    finally:
        sys.path.remove(str(EXAMPLES))

    def factory(config):
        return ListCache(config)
    factory.configs = [Config(Layout(layers=2, kv_heads=2, head_dim=4), page_tokens=4, arena_pages=6, max_entries=2)]
    return factory


def test_0_slots_where_the_configuration_has_an_arena_is_rejected_saying_what_to_report():
    factory = _zero_slot_arena_factory()
    (config,) = factory.configs
    try:
        Lockstep(factory, config).check()
    except InvariantViolation as violation:
        assert violation.invariant == 3 and NO_ARENA in violation.detail, violation
    else:
        raise AssertionError("0 slots in a configuration of 6 passed the lockstep books")
    (result,) = conform(factory, checks=["arena evidence"])
    assert result.outcomes["arena evidence"].status == "FAIL"
    assert "arena_size 0, configuration arena_pages 6" in result.failure and NO_ARENA in result.failure
    assert observed_tiers(factory, factory.configs) == ["pages", "arena books of 0 slots (no arena exercised)", "tree"]


def test_the_same_engine_reporting_no_arena_passes_that_configuration():
    """The control: the rejection above is of the report, not of the engine (``None``: no arena tier)."""
    import dataclasses

    base = _zero_slot_arena_factory()

    def factory(config):
        cache = base(config)
        observe = cache.observe
        cache.observe = lambda: dataclasses.replace(observe(), arena_size=None)
        return cache
    factory.configs = base.configs
    (result,) = conform(factory, checks=["arena evidence", "fork allocates 0", "1 write copies 1"])
    assert result.passed, result.failure
    assert result.outcomes["arena evidence"].status == "n/a"
    assert observed_tiers(factory, factory.configs) == ["pages", "tree"]


def test_arena_evidence_is_na_where_books_of_0_slots_compare_nothing():
    """In a heap configuration a backend that cannot read its pages raw had ``arena evidence: pass`` for
    books of 0 slots, where the check compared no byte (only repeated the lockstep check)."""
    factory = _zero_slot_arena_factory()
    heap = factory.configs[0].with_(arena_pages=0)
    (result,) = conform(factory, configs=[heap], checks=["arena evidence"])
    outcome = result.outcomes["arena evidence"]
    assert outcome.status == "n/a" and "no arena in this configuration" in outcome.detail, outcome


def test_books_of_0_slots_with_pages_read_raw_still_get_the_recycled_page_compared():
    """The control: where pages can be read (``read_page``, or kvstate's ``PageStore``), the heap
    configuration's comparison of a page handed out again after frees still runs and passes."""
    from foreign import dict_pages

    for factory in (dict_pages.factory, numpy_factory):
        (result,) = conform(factory, configs=[config_named("f32-heap")], checks=["arena evidence"])
        assert factory(config_named("f32-heap")).observe().arena_size == 0
        assert result.outcomes["arena evidence"].status == "pass", result.outcomes["arena evidence"]


def test_a_factory_hanging_for_a_later_configuration_is_left_out_of_the_tiers_and_its_checks_time_out(tmp_path,
                                                                                                       capsys):
    """The header's observations were built with no time limit, before any check: a factory hanging
    for any configuration but the first (the one ``check_backend`` builds, under the limit) hung
    ``kvstate conform`` forever. Run in a thread here, so that a regression fails, not hangs."""
    import threading

    path = tmp_path / "hangs_for_f16.py"
    path.write_text("\n".join([
        "import sys, threading", f"sys.path.insert(0, {str(EXAMPLES)!r})",
        "from listcache import factory as working", "",
        "def factory(config):",
        "    if config == working.configs[1]:",
        "        threading.Event().wait()    # never returns",
        "    return working(config)",
        "factory.configs = working.configs[:2]", ""]))
    done = {}
    run = threading.Thread(target=lambda: done.setdefault("rc", main(
        ["conform", str(path), "--check", "fork allocates 0", "--time-limit", "1", "--workers", "1"])), daemon=True)
    run.start()
    run.join(30)
    out = capsys.readouterr().out
    assert done.get("rc") == 1, f"kvstate conform still running after 30 s:\n{out}"
    assert "\n  not observed: f16-heap (no cache built and observed within the 1 s limit; its checks report it)" in out
    rows = {cells[0]: cells[1] for cells in map(str.split, out.splitlines())
            if cells[:1] in (["f32-heap"], ["f16-heap"]) and cells[1] != "/"}
    assert rows == {"f32-heap": "pass", "f16-heap": "TIMEOUT"}, out


def test_the_tiers_header_has_one_time_budget_for_every_configuration():
    """From a review: each configuration's cache had the whole limit, one after another, so a factory
    hanging on every one delayed the first check by the limit times the configurations. Counted by
    the caches asked for: the budget spent on the first, the others are not built at all."""
    import threading

    from kvstate.stateful.configs import configs_named
    from kvstate.stateful.conform import observed_tiers

    asked, release = [], threading.Event()

    def hangs(config):
        asked.append(config.name)
        release.wait(30)        # let go at the end, so no thread outlives the test by much
        raise RuntimeError("released")
    configs = configs_named(["f32-heap", "f16-heap", "q8-heap"])
    unobserved: list[str] = []
    try:
        observed_tiers(hangs, configs, time_limit=0.5, unobserved=unobserved)
    finally:
        release.set()
    assert asked == ["f32-heap"] and unobserved == ["f32-heap", "f16-heap", "q8-heap"]


def test_a_page_count_probe_that_hangs_costs_the_header_its_own_small_budget(monkeypatch):
    """A review (s73): the one position the header writes ran inside the observation's thread, so a
    backend whose extend hung there ate the header's whole limit and its configurations read "not
    observed". The probe has its own budget now; every cache still counts as observed."""
    import threading
    import time

    from helpers import observed_as
    from kvstate.spec.observation import black_box
    from kvstate.stateful import conform as conform_module

    class HangsInTheProbe(observed_as(lambda obs: black_box())):
        def allocate(self):
            if threading.current_thread() is not threading.main_thread():     # the header's threads
                time.sleep(30)
            return self.cache.allocate()

    monkeypatch.setattr(conform_module, "COUNT_PROBE_S", 0.5)
    unobserved: list = []
    started = time.monotonic()
    assert observed_tiers(HangsInTheProbe, [config_named("f32-heap"), config_named("q8-heap")], time_limit=20,
                          unobserved=unobserved) == []
    assert unobserved == [] and time.monotonic() - started < 15       # the header limit is 20 s
