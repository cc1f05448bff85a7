"""The bug zoo: ``conform`` against foreign backends, correct and with one planted bug each.

- Each correct foreign backend (``tests/foreign``) passes the default profile in every
  configuration it declares, with nothing rejected (one or two configurations per backend in the
  default suite, the others under ``-m slow``).
- Each planted bug (``tests/foreign/bugs.py``) is shown directly by a small witness scenario
  (so the bug is real, and its base backend does not have it), then caught by the default
  profile in the one configuration where it shows, with the report naming the broken promise.
- Bugs today's conform does not catch are ``xfail(strict=True, raises=NotCaught)``, and bugs it
  catches under another name ``xfail(strict=True, raises=ReportMisnames)``, each with what it
  reports now: once conform catches (or names) one, its test fails until the mark is removed,
  and a bug that is caught but named otherwise than expected fails with the report to read.

The default suite runs the default profile's sequences without the shrink phase (``hunt``: same
sequences, same catches, a few seconds in all); ``-m slow`` runs the ``ci`` profile exactly,
shrinking included (minutes). ``pytest -n 0 -s [-m slow] tests/test_bug_zoo.py`` prints a table:
per bug, which checks caught it, the counterexample's length and the seconds to catch it.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from kvstate.spec import errors, invariants, precision as precisions
from kvstate.spec.layout import Layout
from kvstate.spec.protocol import Config
from kvstate.stateful.configs import PROFILES, configs_named, machine_configs
from kvstate.stateful.conform import CHECKS, SLOW_CHECKS, conform, quick_first
from kvstate.stateful.ops import values_for

from foreign import block_pool, dict_pages, no_arena, no_tree
from foreign.bugs import BUGS
from helpers import assert_the_catch_is_the_bugs, by_default_or_slow, default_suite_budget

FOREIGN = {"dict_pages": dict_pages.factory, "no_tree": no_tree.factory, "no_arena": no_arena.factory,
           "block_pool": block_pool.factory, "block_pool_pages": block_pool.pages_factory}
SNAPSHOT_CHECKS = ("damaged snapshots",)


def _values(config: Config, n: int, seed: int = 0) -> np.ndarray:
    return values_for(config.layout, n, seed)


def _filled(cache, config: Config, tokens, seed: int = 0):
    ctx = cache.allocate()
    ctx.extend(list(tokens), _values(config, len(tokens), seed))
    return ctx


# -- witnesses: each shows its bug directly, and must show nothing on the correct base ----------
# Each returns a sentence describing the symptom, or None when the backend behaves.

def q8_tie(factory, config):
    x = np.zeros(config.layout.batch_shape(1), np.float32)
    x[0, 0, 0, 0] = [127.0, 2.5, -2.5, 0.5]     # scale 1: three ratios land exactly on .5
    ctx = factory(config).allocate()
    ctx.extend([1], x)
    got, want = ctx.read()[0], precisions.roundtrip("q8", x)
    return None if np.array_equal(got, want) else f"q8 ties read {got[0, 0, 0, 0]}, spec {want[0, 0, 0, 0]}"


def nested_keys(factory, config):
    cache = factory(config)
    cache.retain(_filled(cache, config, [1]))
    cache.retain(_filled(cache, config, [1, 2]))
    _, matched = cache.match([1, 2, 3])
    return None if matched == 2 else f"match([1, 2, 3]) over keys (1,) and (1, 2) matched {matched}, not 2"


def recycled_slot_bytes(factory, config):
    cache = factory(config)
    first = _filled(cache, config, range(config.page_tokens))     # fills slot 0 completely
    first.close()
    again = _filled(cache, config, [1])                           # slot 0 again, one row written
    page = again.pages[0]
    dirty = any(part[1:].any() for part in page.parts)
    return f"recycled slot {page.slot} holds old bytes past row 1" if dirty else None


def recycled_heap_page_bytes(factory, config):
    cache = factory(config)
    _filled(cache, config, range(config.page_tokens)).close()     # a whole page written, then freed
    page = _filled(cache, config, [1]).pages[0]                   # a new page, one row written
    dirty = any(part[1:].any() for part in page.parts)
    return "a new page holds old bytes past row 1" if dirty else None


def arena_size_reported(factory, config):
    size = factory(config).observe().arena_size
    return None if size == config.arena_pages else f"arena_size {size}, configuration {config.arena_pages}"


def matched_count(factory, config):
    cache = factory(config)
    cache.retain(_filled(cache, config, [1, 2, 3]))
    _, matched = cache.match([1, 2, 3, 4, 5])
    return None if matched == 3 else f"match over key (1, 2, 3) reports {matched} tokens matched"


def read_aliasing(factory, config):
    ctx = _filled(factory(config), config, [1, 2])
    values, tokens = ctx.read(0, 1)
    values[...] = 7.0
    tokens[...] = 7
    again, again_tokens = ctx.read(0, 1)
    return "writing into what read() returned changed the context" if (again == 7).all() else None


def prefix_read(factory, config):
    ctx = _filled(factory(config), config, range(2 * config.page_tokens + 1))
    values, tokens = ctx.read(0, config.page_tokens)
    whole, whole_tokens = ctx.read()
    same = np.array_equal(values, whole[:config.page_tokens]) and np.array_equal(tokens, whole_tokens[:config.page_tokens])
    return None if same else f"read(0, {config.page_tokens}) differs from the whole read's first page"


def transposed_write(factory, config):
    made_layer_major = np.ascontiguousarray(np.moveaxis(_values(config, 3, seed=5), 0, 2))
    kv = np.moveaxis(made_layer_major, 2, 0)        # (positions, layers, 2, heads, dim), not C-contiguous
    ctx = factory(config).allocate()
    ctx.extend([1, 2, 3], kv)
    return None if np.array_equal(ctx.read()[0], kv) else "a transposed K/V argument reads back scrambled"


def model_heads(factory, config):
    model = config.with_(layout=Layout(layers=4, kv_heads=8, head_dim=128))
    ctx = factory(model).allocate()
    kv = values_for(model.layout, 2, 7)
    ctx.extend([1, 2], kv)
    return None if np.array_equal(ctx.read()[0], kv) else "at 8 KV heads, the heads read back in another order"


def fork_write(factory, config):
    parent = _filled(factory(config), config, [1, 2])
    before = parent.read()[0].copy()
    parent.fork().overwrite(0, [3], _values(config, 1, 9))
    return None if np.array_equal(parent.read()[0], before) else "a write through the fork shows in its parent"


def close_releases(factory, config):
    cache = factory(config)
    _filled(cache, config, [1]).close()
    pages = cache.observe().pages
    return f"{len(pages)} pages live after closing the only context" if pages else None


def truncate_inside_page(factory, config):
    ctx = _filled(factory(config), config, [1, 2])
    ctx.truncate(1)
    return None if len(ctx.read()[1]) == 1 else f"truncate to 1 reads {len(ctx.read()[1])} positions"


def truncate_releases(factory, config):
    cache = factory(config)
    ctx = _filled(cache, config, list(range(2 * config.page_tokens)))
    ctx.truncate(0)
    held = [pages for holder, pages in cache.observe().holders.items()]
    return f"an empty context still lists pages {held}" if any(held) else None


def eviction_order(factory, config):
    cache = factory(config)
    for token in (1, 2, 3):                          # max_entries 2: the third evicts (1,)
        cache.retain(_filled(cache, config, [token]))
    keys = [e.key for e in cache.observe().entries]
    return None if keys == [(2,), (3,)] else f"entries {keys} after retaining (1,), (2,), (3,)"


def retain_twice(factory, config):
    cache = factory(config)
    ctx = _filled(cache, config, [1])
    cache.retain(ctx)
    cache.retain(ctx)
    ticks = [e.tick for e in cache.observe().entries]
    return None if ticks == [2] else f"retaining (1,) twice leaves ticks {ticks}, not [2]"


def f16_overflow(factory, config):
    x = _values(config, 1)
    x[0, 0, 0, 0, 0] = 1e6
    ctx = factory(config).allocate()
    try:
        with np.errstate(over="ignore"):
            ctx.extend([1], x)
    except errors.PrecisionRangeError:
        return None
    return "extend with 1e6 at f16 was accepted"


def zero_length_write(factory, config):
    cache = factory(config)
    ctx = _filled(cache, config, range(config.page_tokens))
    before = cache.observe().pages_allocated
    ctx.extend([], _values(config, 0))
    allocated = cache.observe().pages_allocated - before
    return f"a zero-length extend allocated {allocated} pages" if allocated else None


def snapshot_round_trip(factory, config):
    cache = factory(config)
    ctx = _filled(cache, config, range(config.page_tokens + 1))
    stream = io.BytesIO()
    ctx.snapshot(stream)
    stream.seek(0)
    restored = cache.restore(stream)
    same = np.array_equal(restored.read()[0], ctx.read()[0])
    return None if same else "a restored snapshot reads other values than its source"


def evicted_slots(factory, config):
    cache = factory(config)
    for token in (1, 2, 3):
        ctx = _filled(cache, config, [token])
        cache.retain(ctx)
        ctx.close()
    try:
        invariants.check_arena(cache.observe())
    except errors.InvariantViolation as violation:
        return str(violation)
    return None


def fork_refcounts(factory, config):
    cache = factory(config)
    _filled(cache, config, [1]).fork()
    counts = [page.refcount for page in cache.observe().pages.values()]
    return None if counts == [2] else f"after one fork the page's refcount is {counts}, not [2]"


def two_hits_extend(factory, config):
    cache = factory(config)
    key = list(range(1, config.page_tokens + 2))      # one position into the second page
    cache.retain(_filled(cache, config, key))
    first, _ = cache.match(key + [9])
    second, _ = cache.match(key + [9])
    first.extend([7], _values(config, 1, 1))
    second.extend([8], _values(config, 1, 2))
    last = int(first.read()[1][-1])
    return None if last == 7 else f"the first hit's appended token reads {last} after the second hit appended 8"


def overwritten_hit_snapshot(factory, config):
    cache = factory(config)
    key = [1, 2, 3]
    cache.retain(_filled(cache, config, key))
    hit, _ = cache.match(key)
    hit.overwrite(1, [9], _values(config, 1, 5))
    stream = io.BytesIO()
    hit.snapshot(stream)
    stream.seek(0)
    restored = cache.restore(stream).read()[1].tolist()
    return None if restored == hit.tokens else f"the snapshot of hit {hit.tokens} restores tokens {restored}"


def refused_extend_then_match(factory, config):
    size = config.page_tokens
    cache = factory(config)
    ctx = _filled(cache, config, range(1, size))            # one short of a full block
    bad = _values(config, 1)
    bad[0, 0, 0, 0, 0] = np.nan
    with pytest.raises(errors.NonFiniteError):
        ctx.extend([size], bad)                             # refused: block 0 would be 1..size
    ctx.extend([size + 1], _values(config, 1, 1))           # block 0 is 1..size-1, size+1
    cache.retain(ctx)
    _, matched = cache.match(list(range(1, size + 1)))
    return None if matched == 0 else f"match of the refused block's tokens matched {matched} of key {ctx.tokens}"


def hit_keeps_entry_recent(factory, config):
    size, cache = config.page_tokens, factory(config)
    blocks = [[k] * size for k in range(1, config.max_entries + 2)]
    for block in blocks[:-1]:
        cache.retain(_filled(cache, config, block))
    cache.match(blocks[0])                                  # the oldest is now the most recently used
    cache.retain(_filled(cache, config, blocks[-1]))        # one past max_entries: blocks[1] goes
    _, matched = cache.match(blocks[0])
    return None if matched == size else f"the entry just hit was evicted (matched {matched}, not {size})"


def refused_extend_holds_nothing(factory, config):
    size, cache = config.page_tokens, factory(config)
    ctx = _filled(cache, config, range(size * (config.pool_limit - 1)))    # one page of the pool left
    before = cache.observe().holders
    with pytest.raises(errors.CapacityError):
        ctx.extend(list(range(2 * size)), _values(config, 2 * size))      # needs two
    after = cache.observe().holders
    return None if after == before else f"a refused extend changed the context's pages {before} -> {after}"


def fork_write_past_growth(factory, config):
    size = config.page_tokens
    parent = _filled(factory(config), config, range(size * (block_pool.INITIAL_PAGES + 1)))
    before = parent.read(0, 1)[0]
    parent.fork().overwrite(0, [7], _values(config, 1, 3))
    same = np.array_equal(parent.read(0, 1)[0], before)
    return None if same else f"past {block_pool.INITIAL_PAGES} pages, a write through a fork shows in its parent"


# -- the table --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Planted:
    base: str                      # the foreign backend it is planted in
    config: str                    # the configuration where it shows
    expect: str | tuple[str, ...]  # the report must contain this (or one of these): the broken promise by name
    witness: Callable
    missed: str | None = None      # today's conform passes it: what it misses (xfail, strict)
    misnamed: str | None = None    # today's conform catches it but names something else (xfail, strict)
    # Speed only: the slow check that catches it, asked before the other slow ones (a first-failure
    # run stops at the first check that fails; every check still runs where it does not, so what is
    # caught and the report it gives are the same, only the checks that pass it first are skipped).
    caught_by: str | None = None


class NotCaught(AssertionError):
    """conform passed a backend with a planted bug."""


class ReportMisnames(AssertionError):
    """conform caught the bug, but its report does not name the broken promise."""


POOL = "block4-f32-pool10-evict-then-refuse"

ZOO = {
    "q8_half_away_from_zero": Planted(
        "dict_pages", "q8-heap", "invariant 4", q8_tie),
    "match_shortest_key": Planted(     # the lockstep says "matched"; the entry probe, what the hit holds
        "no_tree", "f32-heap", ("matched", "the engine's hit holds"), nested_keys),
    "dirty_slot_reported_clean": Planted(
        "dict_pages", "f32-arena6", "arena evidence", recycled_slot_bytes),
    "heap_page_reused_dirty": Planted(
        "dict_pages", "f32-heap", "a page handed out again after frees", recycled_heap_page_bytes),
    "ignores_arena_pages": Planted(
        "dict_pages", "f32-arena6", "the arena has 0 slots, the configuration 6", arena_size_reported),
    "match_count_in_pages": Planted(
        "no_arena", "f32-heap", "matched", matched_count),
    "read_aliases_storage": Planted(
        "dict_pages", "f32-heap", "alias", read_aliasing),
    "missing_copy_on_write": Planted("no_tree", "f32-heap", "invariant 4", fork_write),
    # Directed checks verify after every step: a close or truncate that breaks the books is named
    # at that step (invariants 1 and 2), before a later read or teardown meets the damage.
    "refcount_kept_on_close": Planted(
        "no_arena", "f32-heap", ("invariant 1: page", "invariant 6: not empty"), close_releases),
    "truncate_off_by_one": Planted("no_tree", "f32-heap", ("positions without a page", "invariant 4"),
                                   truncate_inside_page),
    "truncate_releases_nothing": Planted("no_arena", "f32-heap", "pages past its length are still held",
                                         truncate_releases),
    "evicts_most_recent": Planted(
        "no_arena", "f32-heap", "invariant 5", eviction_order),
    "retain_keeps_old_entry": Planted("dict_pages", "f32-heap", "replaces its entry", retain_twice),
    # a data-plane audit (s68): ranged reads, and K/V arguments that are not C-contiguous
    "read_stop_on_page_boundary": Planted("dict_pages", "f32-heap", "a read of positions", prefix_read),
    "ingests_memory_order": Planted("dict_pages", "f32-heap", "invariant 4", transposed_write),
    "heads_swapped_past_the_third": Planted("dict_pages", "f32-heap", "a real model's size", model_heads,
                                            caught_by="scale"),
    "f16_overflow_accepted": Planted("no_arena", "f16-heap", "PrecisionRangeError", f16_overflow),
    "zero_length_write_allocates": Planted(
        "dict_pages", "f32-heap", "zero positions", zero_length_write),
    "snapshot_drops_partial_page": Planted("dict_pages", "f32-heap", "restored to other positions than c1 held",
                                           snapshot_round_trip),
    "arena_slot_kept_on_eviction": Planted(
        "dict_pages", "f32-arena6", "invariant 3", evicted_slots),
    "fork_without_refcount": Planted("no_arena", "f32-heap", "invariant 1", fork_refcounts),
    # issue 22 items 2, 3 and 7, in the standard configurations and in a vLLM-style block pool
    "hits_append_in_place": Planted("dict_pages", "f32-heap", "invariant 4", two_hits_extend),
    "snapshot_stale_tokens": Planted("dict_pages", "f32-heap", "invariant 4", overwritten_hit_snapshot),
    # Only the seeded engine's long runs reach it: scale and lockstep pass it (3 of its 6 s, first).
    "hash_before_write": Planted("block_pool", POOL, "invariant 5", refused_extend_then_match, caught_by="seeded"),
    "hit_stamps_nothing": Planted("block_pool", "block4-f32-heap", "the most recently used gives the hit",
                                  hit_keeps_entry_recent),
    # Either face of the bug comes first: a refused extend that changed the cache, or an extend
    # accepted page by page where its whole need passes the pool (the reference refuses it).
    "refused_extend_keeps_pages": Planted(
        "block_pool_pages", POOL, ("invariant refusal", "reference CapacityError"), refused_extend_holds_nothing),
    "refcounts_lost_on_growth": Planted("block_pool", "block4-f32-heap", "invariant 4", fork_write_past_growth),
}

MEASURED: list[tuple] = []


def _config(name: str, factory) -> Config:
    return configs_named([name], getattr(factory, "configs", None) or machine_configs())[0]


@pytest.mark.parametrize("name", sorted(ZOO))
def test_witness_shows_the_bug_and_not_on_its_base(name):
    """The planted bug is real (its witness shows it) and only in the subclass (the base is clean)."""
    planted = ZOO[name]
    base = FOREIGN[planted.base]
    config = _config(planted.config, BUGS[name])
    assert planted.witness(base, config) is None
    assert planted.witness(BUGS[name], config) is not None


def _zoo_params():
    for name in sorted(ZOO):
        planted, marks = ZOO[name], []
        if planted.missed:
            marks = [pytest.mark.xfail(strict=True, raises=NotCaught, reason=f"not caught by conform yet: {planted.missed}")]
        elif planted.misnamed:
            marks = [pytest.mark.xfail(strict=True, raises=ReportMisnames,
                                       reason=f"not named by conform yet: {planted.misnamed}")]
        yield pytest.param(name, marks=marks, id=name)


def _catch(name: str, profile: str) -> None:
    """Run ``profile`` on the bug's one configuration; ``NotCaught`` / ``ReportMisnames`` if it falls short."""
    planted, factory = ZOO[name], BUGS[name]
    started, cpu = time.perf_counter(), time.process_time()
    checks = quick_first(list(CHECKS))          # conform's own first-failure order ...
    if planted.caught_by in SLOW_CHECKS:        # ... with the catching slow check first of the slow ones
        checks = [n for n in checks if n not in SLOW_CHECKS] + [planted.caught_by] + \
                 [n for n in checks if n in SLOW_CHECKS and n != planted.caught_by]
    results = conform(factory, profile=profile, configs=[_config(planted.config, factory)], checks=checks,
                      first_failure=True)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    MEASURED.append((name, profile, *_measure(results), seconds, cpu))
    failed = [r for r in results if not r.passed]
    if not failed:
        raise NotCaught(f"{name} passed every check in {planted.config}")
    report = "\n".join(r.failure for r in failed)
    expected = (planted.expect,) if isinstance(planted.expect, str) else planted.expect
    if not any(name in report for name in expected):
        raise ReportMisnames(f"{name} was caught, but the report does not say {planted.expect!r}:\n{report}")
    assert_the_catch_is_the_bugs(results, FOREIGN[planted.base], profile)     # the correct base


@pytest.mark.parametrize("name", _zoo_params())
def test_default_sequences_catch_the_bug_and_name_it(name):
    """The default profile's sequences, without its shrink phase (the ``hunt`` profile: the ci budget,
    derandomized, so the same sequences and the same first failure); shrinking is the slow test below."""
    _catch(name, "hunt")


@pytest.mark.slow
@pytest.mark.parametrize("name", _zoo_params())
def test_default_profile_catches_the_bug_shrinks_and_names_it(name):
    """``conform`` exactly as a user runs it (profile ``ci``, shrinking included), in one configuration."""
    _catch(name, "ci")


def _measure(results) -> tuple[str, str, str]:
    """(checks that failed, the first failure's counterexample length, seconds until it was found)."""
    outcomes = results[0].outcomes
    names = list(outcomes)
    failed = [name for name, o in outcomes.items() if not o.passed]
    if not failed:
        return "-", "-", "-"
    first = outcomes[failed[0]]
    length = re.search(r"\((\d+) operations", first.detail or "")
    # checks run one after another, so the first failure came after every check before it
    until = sum(outcomes[name].seconds for name in names[:names.index(failed[0]) + 1])
    return ", ".join(failed), length.group(1) if length else "-", f"{until:.1f}"


@pytest.fixture(scope="module", autouse=True)
def print_measurements():
    yield
    if not MEASURED:
        return
    rows = [("bug", "profile", "caught by", "ops", "s to catch", "s total", "cpu s")]
    rows += [(n, p, by, ops, until, f"{s:.1f}", f"{c:.1f}") for n, p, by, ops, until, s, c in sorted(MEASURED)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print("\n\nbug zoo, one configuration each (ops: the first failure's sequence, shrunk under ci only):")
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())


# -- the correct backends ---------------------------------------------------------------------

# Each configuration is a whole conform run: every backend runs one of its configurations in the
# default suite (bounded where the backend takes an arena or a pool; f32, f16 and q8 among them),
# at the ci profile with 25 examples (so 8 seeds), as our engine's lockstep runs in the default
# suite: 20 CPU s for the five, not 33. The rest, and the whole ci budget, are -m slow. Each catch
# above carries its own control: the check that caught it, on the correct base, in the bug's
# configuration, at the whole ci budget.
DEFAULT_SUITE = {"dict_pages": ("q8-arena6",), "no_tree": ("f16-arena6",), "no_arena": ("f32-heap",),
                 "block_pool": ("block4-q8-heap",), "block_pool_pages": (POOL,)}
DEFAULT_BUDGET = default_suite_budget("ci")


def _declared(backend: str) -> list[Config]:
    return getattr(FOREIGN[backend], "configs", None) or machine_configs()


def _backend_configs():
    for name in FOREIGN:
        for config in _declared(name):
            yield by_default_or_slow(name, config, DEFAULT_SUITE)


def test_the_default_suite_runs_each_backend_once():
    chosen = [param.id for param in _backend_configs() if not param.marks]
    assert sorted(chosen) == sorted(f"{name}-{config}" for name, (config,) in DEFAULT_SUITE.items())
    assert set(DEFAULT_SUITE) == set(FOREIGN)


def _passes_every_check(backend, config, settings):
    (result,) = conform(FOREIGN[backend], settings=settings, configs=[config])
    statuses = {name: o.status for name, o in result.outcomes.items()}
    assert set(statuses) == set(CHECKS)
    assert all(o.passed for o in result.outcomes.values()), result.failure
    assert result.outcomes["lockstep"].steps >= 500
    if backend == "dict_pages":      # the one with snapshots: the snapshot checks really ran
        assert all(statuses[name] == "pass" for name in SNAPSHOT_CHECKS), statuses


@pytest.mark.parametrize("backend,config", _backend_configs())
def test_correct_foreign_backend_passes_with_nothing_rejected(backend, config):
    _passes_every_check(backend, config, DEFAULT_BUDGET)


@pytest.mark.slow
@pytest.mark.parametrize("backend", sorted(DEFAULT_SUITE))
def test_correct_foreign_backend_passes_the_whole_ci_budget(backend):
    (config,) = [c for c in _declared(backend) if c.name == DEFAULT_SUITE[backend][0]]
    _passes_every_check(backend, config, PROFILES["ci"])


def test_no_arena_declares_arena_free_standard_configs_and_refuses_an_arena():
    declared = no_arena.factory.configs
    standard = [c for c in machine_configs() if c.arena_pages == 0]
    assert declared == standard
    with pytest.raises(errors.ConfigError):
        no_arena.factory([c for c in machine_configs() if c.arena_pages][0])


def test_no_tree_reports_no_tree_and_dict_pages_reports_one():
    config = machine_configs()[0]
    for factory, has_tree in ((no_tree.factory, False), (dict_pages.factory, True)):
        cache = factory(config)
        cache.retain(_filled(cache, config, [1, 2]))
        assert (cache.observe().tree is not None) == has_tree


@pytest.mark.parametrize("path", sorted((Path(__file__).parent / "foreign").glob("*.py")), ids=lambda p: p.name)
def test_foreign_backends_import_only_the_spec_and_numpy(path):
    """Written from README and spec alone: no kvstate.impl, no kvstate.reference, no stateful."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            imported.add(node.module)
    kvstate = {name for name in imported if name.split(".")[0] == "kvstate"}
    assert all(name == "kvstate.spec" or name.startswith("kvstate.spec.") for name in kvstate), kvstate
    outside = {name.split(".")[0] for name in imported - kvstate}     # the standard library and NumPy only,
    examples = {example.stem for example in (Path(__file__).parent.parent / "examples").glob("*.py")}
    assert outside <= set(sys.stdlib_module_names) | {"numpy"} | examples, outside    # or an example built so


@pytest.mark.parametrize("name, config, promise", [
    ("dirty_slot_reported_clean", "f32-arena6", "one program run with an arena and without one"),
    ("heap_page_reused_dirty", "f32-heap", "a page handed out again after frees"),
])
def test_a_dirty_page_only_a_comparison_shows_is_shrunk_by_comparing_again(name, config, promise):
    # A recycled page reported clean breaks no invariant of one run, so a replay of the check's
    # sequence alone showed nothing and the report printed it unshrunk: 35 and 140 operations
    # (audit s72). The check's own replay (the arena twin, or each extend into an empty context
    # against a new cache's) shrinks it: free a written page, extend a new context into it.
    factory = BUGS[name]
    [result] = conform(factory, configs=[_config(config, factory)], checks=["arena evidence"])
    report = result.failure
    assert promise in report and "minimised failing sequence" in report, report
    length = int(re.search(r"\((\d+) operations", report).group(1))
    assert length <= 6, report


def test_an_invariant_the_arena_twins_break_is_named_as_the_invariant_once_shrunk():
    # A review (s73): shrunk by the twins' replay, a broken invariant 3 (the arena's books) read as the
    # byte-identity promise it was found under, with no "found while checking" line.
    factory = BUGS["arena_slot_kept_on_eviction"]
    [result] = conform(factory, configs=[_config("q8-arena6", factory)], checks=["arena evidence"])
    report = result.failure
    assert report.startswith("arena evidence: InvariantViolation: invariant 3"), report
    assert 'found while checking: "one program run with an arena and without one' in report, report
