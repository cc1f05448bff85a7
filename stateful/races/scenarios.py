"""Race scenarios: the concurrency an inference scheduler creates, under real threads.

Each scenario builds its own caches, starts its threads together at a barrier
under a tiny ``sys.setswitchinterval`` (so the interpreter switches threads
between almost every pair of bytecodes), runs many short iterations, and then
checks the invariants of ``kvstate.spec.invariants`` and compares values with
the reference model (``kvstate.reference``) replaying each thread's operations
sequentially. An observer thread calls ``observe()`` and checks invariants 1-3
all the while (and that a refusing pool never passes its limit), so a structure
that is only briefly wrong is caught too.

Every scenario runs under every declared semantics (``spec/semantics.py``): the
iterations cycle through ``race_configs()``, and the expectations follow the
configuration rather than the seed's world. A ``match`` hit is checked by its
kind (an ``entry`` hit is a whole retained key, a ``token`` hit a prefix of one, a
``block`` hit that, in whole blocks: ``hit_length``); the tree's size by its
bounds (``max_entries`` and ``max_pages``, and only from above where memory
pressure evicts too); and in a pool that refuses when full, any write may be
refused with ``CapacityError``, which must leave its context as it was, while the
reference replays only the writes that happened. ``pressure_vs_match`` is the
scenario of memory pressure itself: small pools that evict or refuse, with
allocation, forks and writes racing ``retain`` and ``match``. ``hits_stamp_under_race`` holds
recency under concurrent hits (the entry none of them hit must be the next one evicted), and
``fork_vs_owner_writes`` forks racing an owner that extends and truncates the parent (each
branch holds a state the parent had). Two reach windows with no call inside them by pausing a
thread at lines of the engine's code (``harness.pausing``): ``reads_during_copy_on_write`` reads
a context in pauses of an overwrite copying many of its shared pages (each read exactly the
values written), and ``stamps_vs_retains`` pauses a hit while retains run, then judges the
eviction order sequentially (the entry hit last and the fresh keys stay, nothing else).

Values are self-verifying: the K/V written for token ``t`` at position ``p`` is
a fixed function of ``(t, p)`` (``kv_for``), so any read, of any context, at
any moment, can be checked against what its own token ids say it must hold. A
page freed while held, a slot issued twice or a write leaking into another
branch reads as a mismatch, named with its position.

Every scenario takes ``yields``: threads then also give up the interpreter at random
calls into the engine's modules (``harness.yielding_calls``), which catches
short unlocked windows the GIL's own switching almost never lands in, at several
times the cost; ``pressure_vs_match`` uses it by default, ``kvstate stress`` every
other round.

Every operation sequence comes from ``(seed, iteration, thread)``; the thread
schedule itself cannot be replayed, so a failure names the scenario, configuration,
store, seed and iteration, shows the last operations each thread started
(``trace.py``), and prints a ``kvstate race`` command that issues that iteration's
operations again under new schedules (``rerun.py``).

``tests/test_races.py`` runs these at CI size; ``kvstate stress`` runs them for
minutes. ``SCENARIOS`` maps names to the functions; the shared harness is
``stateful/races/harness.py``.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np

from kvstate.impl import Cache, Context
from kvstate.reference import RefCache
from kvstate.spec import invariants
from kvstate.spec.arithmetic import pages_needed, pages_touched
from kvstate.spec.errors import CapacityError, ContextBusyError, ContextClosedError
from kvstate.spec.protocol import Config
from kvstate.spec.semantics import entry_pages, evicts_for_room, hit_length, may_refuse, reclaims

from .harness import (  # noqa: F401 - RACE_LAYOUT and check_pool re-exported for the tests
    NAP_SECONDS, RACE_LAYOUT, SETTLE, THREAD_TIMEOUT, RaceFailure, RaceReport, Watch, attempt,
    available_stores, check_after, check_emptied, check_pool, engine_folders, expected_read, extend, is_closed, kv_for,
    make_cache, overwrite, own_store, page_counters, pausing, pressure_configs, race_configs, read_numpy,
    reference_config, retry_busy, run_threads, seeded_rng, store_label, switch_interval, verify,
)
from .rerun import racing_reported


# -- 1. sixteen threads fork one parent, then each writes its own branch -------------------

def _branch_plan(rng: np.random.Generator, thread: int, parent_len: int, pt: int) -> list[tuple]:
    """A few overwrites inside the shared prefix and extends past it, with this thread's own token ids."""
    plan, length, fresh = [], parent_len, 100_000 * (thread + 1)
    for step in range(int(rng.integers(2, 5))):
        if rng.random() < 0.6:
            start = int(rng.integers(0, parent_len))
            n = int(rng.integers(1, min(2 * pt, parent_len - start) + 1))
            plan.append(("overwrite", start, list(range(fresh, fresh + n))))
        else:
            n = int(rng.integers(1, 2 * pt + 1))
            plan.append(("extend", list(range(fresh, fresh + n))))
            length += n
        fresh += 10
    return plan


def _apply_op(ctx, config: Config, op: tuple, reference: bool = False) -> None:
    if op[0] == "overwrite":
        _, start, tokens = op
        if reference:
            ctx.overwrite(start, tokens, kv_for(config.layout, tokens, start))
        else:
            overwrite(ctx, config, start, tokens)
    else:
        _, tokens = op
        if reference:
            ctx.extend(tokens, kv_for(config.layout, tokens, len(ctx)))
        else:
            extend(ctx, config, tokens)


def _after_op(state: list[int], op: tuple) -> list[int]:
    """The token ids a context holds after ``op``, given those it held before."""
    if op[0] == "overwrite":
        _, start, tokens = op
        return state[:start] + tokens + state[start + len(tokens):]
    return state + op[1]


def _copies_expected(plan: list[tuple], parent_len: int, pt: int) -> int:
    """Pages ``writable`` must copy for one branch: each parent page it writes, once (the parent keeps holding it)."""
    parent_pages, length, touched = pages_needed(parent_len, pt), parent_len, set()
    for op in plan:
        start, n = (op[1], len(op[2])) if op[0] == "overwrite" else (length, len(op[1]))
        touched.update(range(*pages_touched(start, start + n, pt)))
        if op[0] == "extend":
            length += n
    return len({index for index in touched if index < parent_pages})


def _rounds(report: RaceReport, store, seed: int, iterations: int | range, configs=None):
    """Each iteration with its configuration (cycling through ``configs``, by default
    ``race_configs()``, recorded in ``report.configs``) and a name for failure messages.
    ``iterations``: how many, or which (a rerun runs ``range(i, i + 1)``: iteration ``i``'s
    operations come from ``(seed, i)`` alone). Each starts a fresh trace (``report.trace``)."""
    configs = configs or race_configs()
    for iteration in (range(iterations) if isinstance(iterations, int) else iterations):
        config = configs[iteration % len(configs)]
        report.configs.append(config.name)
        report.at = iteration, config
        report.trace.reset()
        yield iteration, config, (f"{report.scenario}[{store_label(store)}, {config.name}] "
                                  f"seed={seed} iteration={iteration}")


def _fitting(config: Config, n: int) -> int:
    """At most ``n`` tokens, and few enough that a context set up before the threads start fills
    at most half of a pool that refuses when full (so the set-up itself is never refused)."""
    if not may_refuse(config.on_full):
        return n
    return max(1, min(n, config.pool_limit // 2 * config.page_tokens))


def _plan_length(plan: list[tuple], parent_len: int) -> int:
    return parent_len + sum(len(op[1]) for op in plan if op[0] == "extend")


def fork_storm(store: str = "numpy", seed: int = 0, iterations: int = 10, threads: int = 16,
               configs=None, yields: bool = False) -> RaceReport:
    """Sixteen threads fork one parent at once (a backend may serialise them or refuse as busy: retried),
    then each writes its own branch; every branch must read only its own writes, the parent nothing
    new, and exactly the shared pages each branch wrote must have been copied. In a pool that
    refuses when full, a refused write changes nothing, and the counts and the reference replay
    follow the writes that happened."""
    report = RaceReport("fork_storm", store, seed, threads=threads, options={"threads": threads})
    with racing_reported(report, yields):
        for iteration, config, where in _rounds(report, store, seed, iterations, configs):
            pt, rng = config.page_tokens, seeded_rng(seed, iteration)
            cache, ref = make_cache(store, config, report.trace), RefCache(reference_config(config))
            parent_tokens = [int(t) for t in rng.integers(0, 1000, _fitting(config, int(rng.integers(1, 4 * pt + 1))))]
            parent, ref_parent = cache.allocate(), ref.allocate()
            extend(parent, config, parent_tokens)
            ref_parent.extend(parent_tokens, kv_for(config.layout, parent_tokens, 0))
            plans = [_branch_plan(seeded_rng(seed, iteration, t + 1), t, len(parent_tokens), pt) for t in range(threads)]
            done: list[list[tuple]] = [[] for _ in range(threads)]     # each branch's writes that happened
            branches: list = [None] * threads
            before = page_counters(cache)

            def body(t: int) -> Callable[[], None]:
                def run() -> None:
                    child = retry_busy(parent.fork, report)
                    branches[t] = child
                    state = list(parent_tokens)
                    for op in plans[t]:
                        if attempt(lambda: _apply_op(child, config, op), child, config, report, f"branch {t}",
                                   want_tokens=state):
                            state = _after_op(state, op)
                            done[t].append(op)
                    verify(child, config, f"branch {t}", want_tokens=state)   # already, while the others still write
                return run

            run_threads([body(t) for t in range(threads)], where, observe_cache=cache, report=report, config=config)
            live, twins = {"parent": parent}, {"parent": ref_parent}
            for t, ops in enumerate(done):
                twin = ref_parent.fork()
                for op in ops:
                    _apply_op(twin, config, op, reference=True)
                live[f"branch {t}"], twins[f"branch {t}"] = branches[t], twin
            check_after(cache, where, expected_tree=[], live=live, reference=twins, config=config)
            after = page_counters(cache)
            copies = sum(_copies_expected(ops, len(parent_tokens), pt) for ops in done)
            appended = sum(pages_needed(_plan_length(ops, len(parent_tokens)), pt) - pages_needed(len(parent_tokens), pt)
                           for ops in done)
            if "pages_copied" in after and after["pages_copied"] - before["pages_copied"] != copies:
                raise RaceFailure(f"{where}: {after['pages_copied'] - before['pages_copied']} pages copied, "
                                  f"the branches wrote {copies} shared pages")
            if "pages_allocated" in after and after["pages_allocated"] - before["pages_allocated"] != copies + appended:
                raise RaceFailure(f"{where}: {after['pages_allocated'] - before['pages_allocated']} pages allocated, "
                                  f"expected {copies} copies + {appended} appended")
            for ctx in live.values():
                ctx.close()
            check_emptied(cache, where)
            report.iterations += 1
            report.add("forks", threads)
            report.add("pages_copied", copies)
    return report


# -- 2. and 3. the prefix tree under eviction, allocation and clear ---------------------------

BASE_COUNT = 4


def _bases(seed: int, iteration: int, length: int) -> list[list[int]]:
    """A few token sequences that share prefixes pairwise, so keys split and share tree nodes."""
    rng = seeded_rng(seed, iteration, 999)
    root = [int(t) for t in rng.integers(0, 500, length)]
    bases = []
    for b in range(BASE_COUNT):
        cut = int(rng.integers(1, length))
        bases.append(root[:cut] + [int(t) for t in rng.integers(500, 1000, length - cut)])
    return bases


class Retained:
    """The keys the threads retained, and every prefix of them. A key is added before its
    ``retain``, so whatever entry a thread can find is already here; sets, because a
    membership test and an add are each atomic while other threads add."""

    def __init__(self) -> None:
        self.keys: set[tuple[int, ...]] = set()
        self.prefixes: set[tuple[int, ...]] = set()

    def add(self, key) -> None:
        key = tuple(int(t) for t in key)
        self.prefixes.update(key[:n] for n in range(1, len(key) + 1))
        self.keys.add(key)


def _check_match(ctx, matched: int, query: list[int], retained: Retained, config: Config, where: str) -> None:
    """A match result as the declared ``match`` kind allows it: an ``entry`` hit is a whole retained
    key, a ``token`` hit a prefix of one, a ``block`` hit that in whole blocks; values consistent."""
    if not 0 <= matched <= len(query):
        raise RaceFailure(f"{where}: matched {matched} tokens of a {len(query)}-token query")
    hit = tuple(query[:matched])
    if matched and config.match == "entry" and hit not in retained.keys:
        raise RaceFailure(f"{where}: matched key {list(hit)} was never retained")
    if matched and config.match != "entry" and hit not in retained.prefixes:
        raise RaceFailure(f"{where}: matched {list(hit)}, a prefix of no retained key")
    if hit_length(config.match, config.block_tokens, matched) != matched:
        raise RaceFailure(f"{where}: a {config.match} match held {matched} positions, "
                          f"not a whole number of {config.block_tokens}-token blocks")
    verify(ctx, config, "match result", want_tokens=list(hit))


def _tree_worker(cache: Cache, config: Config, bases: list[list[int]], rng: np.random.Generator, steps: int,
                 report: RaceReport, where: str, retained: Retained, hold: int = 2) -> Callable[[], None]:
    """Retain prefixes of the bases, match queries against them, keep a few results open a while
    (their pages stay live: an eviction must not free them, and they make some entries free
    nothing when evicted)."""
    def run() -> None:
        held: list[tuple] = []
        for step in range(steps):
            base = bases[int(rng.integers(len(bases)))]
            if rng.random() < 0.5:
                ctx = cache.allocate()
                key = base[:int(rng.integers(1, len(base) + 1))]
                if attempt(lambda: extend(ctx, config, key), ctx, config, report, where, want_tokens=[]):
                    retained.add(key)
                    cache.retain(ctx)
                    report.add("retains")
                ctx.close()
            else:
                query = base[:int(rng.integers(1, len(base) + 1))] + [int(t) for t in rng.integers(2000, 3000, 2)]
                ctx, matched = cache.match(query)
                _check_match(ctx, matched, query, retained, config, where)
                report.add("match_hits" if matched else "match_misses")
                held.append((ctx, query[:matched]))
            while len(held) > hold:
                ctx, tokens = held.pop(0)
                verify(ctx, config, "held match result", want_tokens=tokens)   # nothing freed while held
                ctx.close()
        for ctx, tokens in held:
            verify(ctx, config, "held match result", want_tokens=tokens)
            ctx.close()
    return run


def _allocator(cache: Cache, config: Config, rng: np.random.Generator, steps: int, thread: int,
               report: RaceReport, where: str, retained: Retained | None = None) -> Callable[[], None]:
    """Allocate, extend, fork, overwrite, truncate and close, mirrored on a private reference cache
    (which replays the writes that happened; a refusing pool may refuse any of them). With
    ``retained``, half the contexts are also retained and then extended: the entry shares their
    pages, so the extend copies the shared last page, and evicting the entry frees only what
    the context no longer holds."""
    def run() -> None:
        ref, fresh = RefCache(reference_config(config)), 100_000 * (thread + 1)
        for step in range(steps):
            ctx, twin = cache.allocate(), ref.allocate()
            tokens = list(range(fresh, fresh + int(rng.integers(1, 3 * config.page_tokens + 1))))
            more = list(range(fresh + 25, fresh + 25 + int(rng.integers(1, config.page_tokens + 2))))
            fresh += 50
            if attempt(lambda: extend(ctx, config, tokens), ctx, config, report, where, want_tokens=[]):
                twin.extend(tokens, kv_for(config.layout, tokens, 0))
                if retained is not None and rng.random() < 0.5:
                    retained.add(tokens)
                    cache.retain(ctx)
                    report.add("retains")
                    if attempt(lambda: extend(ctx, config, more), ctx, config, report, where, want_tokens=twin.tokens):
                        twin.extend(more, kv_for(config.layout, more, len(twin)))
                fork, fork_twin = ctx.fork(), twin.fork()
                start = int(rng.integers(0, len(twin)))
                if attempt(lambda: overwrite(fork, config, start, [fresh]), fork, config, report, where,
                           want_tokens=fork_twin.tokens):
                    fork_twin.overwrite(start, [fresh], kv_for(config.layout, [fresh], start))
                keep = int(rng.integers(0, len(twin) + 1))
                ctx.truncate(keep)
                twin.truncate(keep)
                invariants.check_values({"ctx": read_numpy(ctx), "fork": read_numpy(fork)},
                                        {"ctx": twin.read(), "fork": fork_twin.read()})
                fork.close()
                fork_twin.close()
            ctx.close()
            twin.close()
            report.add("allocations", 2)
    return run


def _check_bounds(keys: list[tuple[int, ...]], config: Config, retained: Retained, where: str,
                  only_evicted_by_bounds: bool) -> None:
    """The tree's size after the threads, as ``max_entries`` and ``max_pages`` declare it.

    From above: at most ``max_entries`` entries and ``max_pages`` pages (unless one entry alone
    is over the budget: the one just retained is never evicted). From below, where nothing but
    the bounds evicts (no ``clear``, no memory-pressure eviction): if some retained key is gone,
    the bounds evicted it, and eviction stops as soon as the tree is within them, so the tree
    left after the last eviction plus its victim was over a bound; later retains only added
    entries. So the tree is at ``max_entries``, or one more entry of the largest retained key
    would pass ``max_pages``.
    """
    pt = config.page_tokens
    pages = sum(entry_pages(len(key), pt) for key in keys)
    if len(keys) > config.max_entries:
        raise RaceFailure(f"{where}: {len(keys)} entries, max_entries is {config.max_entries}")
    if config.max_pages and pages > config.max_pages and len(keys) > 1:
        raise RaceFailure(f"{where}: {len(keys)} entries count {pages} pages, max_pages is {config.max_pages}")
    if not only_evicted_by_bounds or len(keys) == len(retained.keys):
        return
    largest = max(entry_pages(len(key), pt) for key in retained.keys)
    if len(keys) < config.max_entries and not (config.max_pages and pages + largest > config.max_pages):
        raise RaceFailure(f"{where}: {len(keys)} entries counting {pages} pages after evicting "
                          f"{len(retained.keys) - len(keys)} of {len(retained.keys)} retained keys; the bounds "
                          f"(max_entries {config.max_entries}, max_pages {config.max_pages or 'none'}) evict "
                          f"only while passed")


def _finish_tree(cache: Cache, config: Config, retained: Retained, where: str, only_evicted_by_bounds: bool) -> None:
    """After the threads: invariants, the tree's size against its bounds, and every entry's content
    read through ``match`` (which holds as much of an entry's own key as its ``match`` kind allows).

    Under ``reclaim`` the pool takes entries' pages in any amount and order the engine chooses once it
    may have been short, which threads racing a small pool leave unknown: the tree has no floor, and
    an entry still listed may hit fewer of its own tokens (aligned as its ``match`` kind requires), as
    lockstep allows once pressed; the upper bounds and every value read still hold."""
    reclaiming = reclaims(config.on_full)
    only_evicted_by_bounds = only_evicted_by_bounds and not reclaiming
    check_after(cache, where, config=config)
    obs = cache.observe()
    live_contexts = (obs.counters or {}).get("live_contexts")      # a counter the protocol does not ask for
    if live_contexts:
        raise RaceFailure(f"{where}: {live_contexts} contexts still live after every thread closed its own")
    if obs.entries is None:
        # No tree tier: which entries stayed is unseen, but whatever a retained key hits still reads
        # what was written at those positions.
        for key in sorted(retained.keys):
            ctx, matched = cache.match(list(key))
            most = hit_length(config.match, config.block_tokens, len(key))
            if matched > most or (config.match == "block" and matched % config.block_tokens):
                raise RaceFailure(f"{where}: retained key {list(key)} matched {matched} tokens, where a "
                                  f"{config.match} match holds at most {most}"
                                  + (f" in whole blocks of {config.block_tokens}" if config.match == "block" else ""))
            if matched:
                verify(ctx, config, f"the hit of {list(key)}", want_tokens=list(key[:matched]))
            ctx.close()
        check_emptied(cache, where)
        return
    keys = [tuple(entry.key) for entry in obs.entries]
    ticks = [entry.tick for entry in obs.entries]
    if any(key not in retained.keys for key in keys):
        raise RaceFailure(f"{where}: tree holds keys {sorted(set(keys) - retained.keys)} nobody retained")
    if ticks != sorted(set(ticks)):
        raise RaceFailure(f"{where}: entry ticks {ticks} are not strictly increasing in eviction order")
    _check_bounds(keys, config, retained, where, only_evicted_by_bounds)
    for key in keys:
        ctx, matched = cache.match(list(key))
        want = hit_length(config.match, config.block_tokens, len(key))
        if matched != want and not (reclaiming and _reclaimed_hit(config, key, matched, want, retained)):
            raise RaceFailure(f"{where}: entry {list(key)} matched {matched} of its own {len(key)} tokens, "
                              f"a {config.match} match holds {want}"
                              + (f" (under on_full={config.on_full!r} fewer, aligned as it requires)" if reclaiming else ""))
        verify(ctx, config, f"entry {list(key)}", want_tokens=list(key[:matched]))
        ctx.close()
    check_emptied(cache, where)


def _reclaimed_hit(config: Config, key: tuple[int, ...], matched: int, want: int, retained: Retained) -> bool:
    """Whether ``matched`` positions of entry ``key`` (whose whole hit holds ``want``) is a hit a reclaiming
    pool may leave: shorter, in whole blocks under ``match="block"``, a whole retained key under ``"entry"``."""
    if not 0 <= matched < want:
        return False
    if config.match == "block":
        return matched % config.block_tokens == 0
    return config.match != "entry" or matched == 0 or key[:matched] in retained.keys


def eviction_vs_allocation(store: str = "numpy", seed: int = 0, iterations: int = 6, threads: int = 6,
                           steps: int = 40, configs=None, yields: bool = False) -> RaceReport:
    """Threads retaining and matching against tiny tree bounds while others allocate, extend,
    fork and close: no page leaked, no slot issued twice, nothing freed while held, and the tree
    within its bounds (and, unless memory pressure evicts too, no smaller than they keep it)."""
    report = RaceReport("eviction_vs_allocation", store, seed, threads=threads, options={"threads": threads})
    with racing_reported(report, yields):
        for iteration, config, where in _rounds(report, store, seed, iterations, configs):
            cache, retained = make_cache(store, config, report.trace), Retained()
            bases = _bases(seed, iteration, 4 * config.page_tokens)
            bodies = []
            for t in range(threads):
                rng = seeded_rng(seed, iteration, t + 1)
                if t % 2 == 0:
                    bodies.append(_tree_worker(cache, config, bases, rng, steps, report, where, retained))
                else:
                    bodies.append(_allocator(cache, config, rng, steps // 2, t, report, where))
            run_threads(bodies, where, observe_cache=cache, report=report, config=config)
            _finish_tree(cache, config, retained, where, only_evicted_by_bounds=not evicts_for_room(config.on_full))
            report.iterations += 1
    return report


def pressure_vs_match(store: str = "numpy", seed: int = 0, iterations: int = 6, threads: int = 6,
                      steps: int = 30, configs=None, yields: bool = True) -> RaceReport:
    """Memory pressure racing allocation and ``match``: in a small pool (``pressure_configs()``)
    that evicts when full, threads extending, forking, retaining and closing contexts force
    pressure evictions while others retain, match and hold what they matched; in one that
    refuses, the same load is refused page by page.

    Throughout (the observer): invariants 1-3, and a refusing pool never past its limit.
    Each thread: a refused write (``CapacityError``, only where the pool refuses) leaves its
    context as it was; every match result and every held one reads its own tokens (an eviction
    never frees a page a live context holds); each allocator's contexts equal its reference
    replay. Afterwards: the invariants, the tree within its bounds, every entry matched and
    read, and nothing leaked once everything is closed and cleared.

    With ``yields`` (the default here), threads also give up the interpreter at random calls into
    the engine (``yielding_calls``): a step of eviction or of the pool's check done without the
    cache lock is then interleaved with other threads within a few iterations, where the GIL alone
    almost never switches threads inside so short a window.
    """
    report = RaceReport("pressure_vs_match", store, seed, threads=threads, options={"threads": threads})
    with racing_reported(report, yields):
        for iteration, config, where in _rounds(report, store, seed, iterations, configs or pressure_configs()):
            cache, retained = make_cache(store, config, report.trace), Retained()
            bases = _bases(seed, iteration, 4 * config.page_tokens)
            bodies = []
            for t in range(threads):
                rng = seeded_rng(seed, iteration, t + 1)
                if t % 2 == 0:
                    bodies.append(_tree_worker(cache, config, bases, rng, steps, report, where, retained, hold=3))
                else:
                    bodies.append(_allocator(cache, config, rng, steps, t, report, where, retained))
            run_threads(bodies, where, observe_cache=cache, report=report, config=config)
            report.add("pressure_evictions", (cache.observe().counters or {}).get("pressure_evictions", 0))
            _finish_tree(cache, config, retained, where, only_evicted_by_bounds=not evicts_for_room(config.on_full))
            report.iterations += 1
    return report


def match_close_vs_clear(store: str = "numpy", seed: int = 0, iterations: int = 6, threads: int = 5,
                         steps: int = 40, configs=None, yields: bool = False) -> RaceReport:
    """``match`` and ``close`` of the returned contexts racing ``clear``: a match forks an entry before
    the clear releases it or finds nothing; results stay readable after the clear; nothing leaks.
    A backend's factory runs in the configuration it declared: with no entry bound (``max_entries``
    2**30) nothing but ``clear`` removes an entry, and the tree is held to that bound alone."""
    report = RaceReport("match_close_vs_clear", store, seed, threads=threads + 1, options={"threads": threads})
    with racing_reported(report, yields):
        # kvstate's own stores with room for 8 entries, so that clear, more than eviction, empties
        # the tree; a backend in the bound it declared (with none, only clear does)
        wide = configs if configs and not own_store(store) else [
            c.with_(max_entries=8) for c in configs or race_configs()]
        for iteration, config, where in _rounds(report, store, seed, iterations, wide):
            cache, retained = make_cache(store, config, report.trace), Retained()
            bases = _bases(seed, iteration, 4 * config.page_tokens)
            bodies = [_tree_worker(cache, config, bases, seeded_rng(seed, iteration, t + 1), steps, report, where, retained,
                                   hold=3)
                      for t in range(threads)]

            def clearer() -> None:
                for _ in range(steps // 2):
                    cache.clear()
                    report.add("clears")
                    time.sleep(0)

            run_threads(bodies + [clearer], where, observe_cache=cache, report=report, config=config)
            _finish_tree(cache, config, retained, where, only_evicted_by_bounds=False)
            report.iterations += 1
    return report


# -- bad input: close racing use, close twice, close racing fork ------------------------------

def _shared_pair(cache: Cache, config: Config, rng: np.random.Generator) -> tuple[Context, Context, list[int]]:
    """A context and a fork sharing its pages, so a corrupted refcount would free the sibling's pages."""
    tokens = [int(t) for t in rng.integers(0, 1000, _fitting(config, int(rng.integers(1, 4 * config.page_tokens + 1))))]
    ctx = cache.allocate()
    extend(ctx, config, tokens)
    return ctx, ctx.fork(), tokens


def close_races(store: str = "numpy", seed: int = 0, iterations: int = 20, threads: int = 4,
                configs=None, yields: bool = False) -> RaceReport:
    """Close racing use from other threads, several threads closing at once, and close racing fork.

    Every refusal must be ``ContextBusyError`` or ``ContextClosedError`` (or, for a write in a pool that
    refuses when full, ``CapacityError``: the write copies the page the sibling shares); exactly one close succeeds;
    a fork either happened before the close (and reads the parent's values) or is refused as closed;
    the sibling sharing the pages reads unchanged and the refcounts stay exact.
    """
    report = RaceReport("close_races", store, seed, threads=threads, options={"threads": threads})
    with racing_reported(report, yields):
        for iteration, config, where in _rounds(report, store, seed, iterations, configs):
            cache = make_cache(store, config, report.trace)
            ctx, sibling, tokens = _shared_pair(cache, config, seeded_rng(seed, iteration))
            closes, forks, outcomes = [], [], []
            lock = threading.Lock()

            def closer() -> None:
                while True:
                    try:
                        ctx.close()
                        outcome = "closed"
                    except ContextBusyError:
                        report.add("busy_refusals")
                        time.sleep(0)
                        continue
                    except ContextClosedError:
                        outcome = "already_closed"
                    with lock:
                        closes.append(outcome)
                    return

            def user(t: int) -> Callable[[], None]:
                def run() -> None:
                    rng = seeded_rng(seed, iteration, t + 1)
                    while True:           # until this thread sees the context closed
                        action = ["read", "fork", "tokens", "retain", "write"][int(rng.integers(5))]
                        try:
                            if action == "read":
                                verify(ctx, config, "racing read")
                            elif action == "fork":
                                child = ctx.fork()
                                with lock:
                                    forks.append(child)
                            elif action == "tokens":
                                ctx.tokens
                            elif action == "retain":
                                cache.retain(ctx)
                            else:
                                # A write (position 0 keeps its token, so every fork still reads
                                # ``tokens``): it goes through ``writable`` and copies the page the
                                # sibling shares. Not an extend: the position of an extend from a
                                # thread that does not own the context is unknowable in advance.
                                overwrite(ctx, config, 0, tokens[:1])
                            with lock:
                                outcomes.append("ok")
                        except ContextBusyError:
                            with lock:
                                outcomes.append("busy")
                        except CapacityError:
                            if action != "write" or not may_refuse(config.on_full):
                                raise
                            with lock:
                                outcomes.append("refused")
                        except ContextClosedError:
                            with lock:
                                outcomes.append("closed")
                            return
                return run

            bodies = [closer, closer] + [user(t) for t in range(max(1, threads - 2))]
            run_threads(bodies, where, observe_cache=cache, report=report, config=config)
            if sorted(closes) != ["already_closed", "closed"]:
                raise RaceFailure(f"{where}: two racing closes ended {closes}; exactly one must succeed")
            if not is_closed(ctx):
                raise RaceFailure(f"{where}: the context is not closed after a successful close")
            live = {"sibling": sibling, **{f"fork {i}": f for i, f in enumerate(forks)}}
            check_after(cache, where, config=config)
            verify(sibling, config, "sibling", want_tokens=tokens)
            for name, child in live.items():
                if name != "sibling":
                    verify(child, config, name, want_tokens=tokens)
            for child in live.values():
                child.close()
            check_emptied(cache, where)
            for name in ("ok", "busy", "closed", "refused"):
                report.add(f"uses_{name}", outcomes.count(name))
            report.add("forks_before_close", len(forks))
            report.iterations += 1
    return report


# -- snapshot-and-restore racing a decode loop ---------------------------------------------------

def snapshot_vs_decode(store: str = "numpy", seed: int = 0, iterations: int = 4, steps: int = 8,
                       configs=None, yields: bool = False) -> RaceReport:
    """Snapshot and restore a context while a decode loop on its fork keeps rewriting the shared prefix.

    The snapshotting thread owns the context and changes it between snapshots, so it knows the state
    every snapshot must hold; a restored context must read exactly that state (values consistent with
    its tokens, tokens equal to the recorded ones): never the decoder's writes, never a mix. In a
    pool that refuses when full, a refused write or restore changes nothing, and the state and the
    decoder's reference replay follow the writes that happened.
    """
    report = RaceReport("snapshot_vs_decode", store, seed, threads=2)
    with racing_reported(report, yields), tempfile.TemporaryDirectory(prefix="kvstate-races-") as folder:
        for iteration, config, where in _rounds(report, store, seed, iterations, configs):
            pt, rng = config.page_tokens, seeded_rng(seed, iteration)
            cache = make_cache(store, config, report.trace)
            tokens = [int(t) for t in rng.integers(0, 1000, _fitting(config, 3 * pt + 1))]
            shared = cache.allocate()
            extend(shared, config, tokens)
            decoder = shared.fork()
            ref = RefCache(reference_config(config))
            decoder_twin = ref.allocate()
            decoder_twin.extend(tokens, kv_for(config.layout, tokens, 0))

            def snapshotter() -> None:
                state = list(tokens)
                srng = seeded_rng(seed, iteration, 1)
                for step in range(steps):
                    position = int(srng.integers(len(state)))
                    new = 2_000_000 + step
                    if attempt(lambda: overwrite(shared, config, position, [new]), shared, config, report,
                               "snapshotter", want_tokens=state):
                        state[position] = new
                    path = Path(folder) / f"i{iteration}-s{step}.kvs"
                    shared.snapshot(path)
                    report.add("snapshots")
                    try:
                        restored = cache.restore(path)
                    except CapacityError:
                        if not may_refuse(config.on_full):
                            raise
                        report.add("refusals")
                        continue
                    verify(restored, config, f"restore of snapshot {step}", want_tokens=state)
                    restored.close()

            def decode() -> None:
                drng = seeded_rng(seed, iteration, 2)
                for step in range(steps * 4):
                    n = int(drng.integers(1, len(tokens) + 1))
                    rewrite = [3_000_000 + step * 100 + k for k in range(n)]
                    if attempt(lambda: overwrite(decoder, config, 0, rewrite), decoder, config, report, "decoder",
                               want_tokens=decoder_twin.tokens):
                        decoder_twin.overwrite(0, rewrite, kv_for(config.layout, rewrite, 0))
                    new = [4_000_000 + step]
                    if attempt(lambda: extend(decoder, config, new), decoder, config, report, "decoder",
                               want_tokens=decoder_twin.tokens):
                        decoder_twin.extend(new, kv_for(config.layout, new, len(decoder_twin)))
                    if len(decoder) > 6 * pt:
                        decoder.truncate(len(tokens))
                        decoder_twin.truncate(len(tokens))
                    report.add("decode_steps")

            run_threads([snapshotter, decode], where, observe_cache=cache, report=report, config=config)
            check_after(cache, where, expected_tree=[], live={"decoder": decoder}, reference={"decoder": decoder_twin},
                        config=config)
            for ctx in (shared, decoder):
                ctx.close()
            check_emptied(cache, where)
            report.iterations += 1
    return report


# -- observe() while other threads write -----------------------------------------------------------

def observe_during_writes(store: str = "numpy", seed: int = 0, iterations: int = 4, threads: int = 2,
                          changes: int = 40, looks: int = 1000, configs=None, yields: bool = False) -> RaceReport:
    """Writers extend, overwrite and restart contexts (fresh pages, recycled arena slots, partly filled
    pages) while the main thread observes: every observation must satisfy invariants 1-3, in particular
    no page may show bytes past its ``filled`` mark while a write is in flight (and a refusing pool
    never passes its limit; a refused write leaves its context as it was).

    The observer stops once it has checked ``changes`` different states (or after ``looks`` looks,
    for a backend whose observation never changes), stepping aside after a look that saw no
    change (``Watch``). It used to make 1000 looks back to back, which held the writers up: about
    19 of them an iteration saw a state it had not checked yet.
    """
    report = RaceReport("observe_during_writes", store, seed, threads=threads + 1, options={"threads": threads})
    with racing_reported(report, yields):
        for iteration, config, where in _rounds(report, store, seed, iterations, configs):
            cache, done = make_cache(store, config, report.trace), threading.Event()

            def writer(t: int) -> Callable[[], None]:
                def run() -> None:
                    rng, fresh = seeded_rng(seed, iteration, t + 1), 100_000 * (t + 1)
                    while not done.is_set():
                        ctx = cache.allocate()
                        for _ in range(4 * config.page_tokens):
                            attempt(lambda: extend(ctx, config, [fresh]), ctx, config, report, f"writer {t}")
                            fresh += 1
                            if len(ctx) and rng.random() < 0.3:
                                attempt(lambda: overwrite(ctx, config, int(rng.integers(len(ctx))), [fresh]), ctx,
                                        config, report, f"writer {t}")
                                fresh += 1
                        verify(ctx, config, f"writer {t}")
                        ctx.close()
                        report.add("contexts_written")
                return run

            def observer() -> None:
                watch = Watch(cache, config)
                try:
                    for _ in range(looks):
                        changed = watch.look()
                        report.add("observations")
                        if watch.changes >= changes:
                            break
                        if not changed:
                            time.sleep(SETTLE)
                finally:
                    done.set()
                    report.add("observed_changes", watch.changes)

            run_threads([writer(t) for t in range(threads)] + [observer], where, report=report)
            check_emptied(cache, where)
            report.iterations += 1
    return report


# -- recency under concurrent hits -------------------------------------------------------------------

def _hits_of(cache, config, keys: list, want: int, at: str) -> list[bool]:
    """Whether each of ``keys`` (retained whole) still hits, each hit checked (``_check_hit``)."""
    kept = []
    for key in keys:
        ctx, matched = cache.match(key)
        _check_hit(ctx, matched, key, config, want, at)
        kept.append(bool(matched))
    return kept


def _check_hit(ctx, matched: int, key: list, config, want: int, at: str) -> None:
    """A match of retained ``key``: ``want`` positions or a miss, and the key's own values; ``ctx`` closed."""
    try:
        if matched not in (0, want):
            raise RaceFailure(f"{at}: retained key {key} matched {matched} positions, a {config.match} match "
                              f"holds {want} or misses")
        if matched:
            verify(ctx, config, f"the hit of {key}", want_tokens=key[:want])
    finally:
        ctx.close()


def _retain_key(cache: Cache, config: Config, key: list[int]) -> None:
    """Retain ``key`` through a context of its own, closed after (its pages then stay the entry's alone)."""
    ctx = cache.allocate()
    extend(ctx, config, key)
    cache.retain(ctx)
    ctx.close()


# The most entries ``hits_stamp_under_race`` fills a round with; a backend declaring a larger
# ``max_entries`` (vLLM's and SGLang's adapters declare 2**30: no entry bound) never evicts in it.
MOST_FILLED = 64


def _hit_plan(config: Config, threads: int, store) -> tuple[Config, int, int, int] | str:
    """The configuration ``hits_stamp_under_race`` runs in, its key length, how many threads hit and
    how many more keys fill the tree; or why the scenario does not apply (an n/a).

    Keys are one whole block (``block``) or one token. The tree holds ``max_entries`` of them, so
    that one more retain must evict exactly one: the hit keys, the fillers and Z. ``max_entries`` is
    the one declared, for a backend's factory (never one it did not declare: a backend with no
    entry bound, or a larger one than the scenario fills, never evicts here, and is n/a); for
    kvstate's own stores, whose race configurations are the suite's, the hits plus Z. Neither
    ``max_pages`` nor the pool may ever need room for those keys plus the one more retain: nothing
    but ``max_entries`` then decides the eviction."""
    length = config.block_tokens if config.match == "block" else 1
    pages = entry_pages(length, config.page_tokens)
    room = MOST_FILLED
    if config.max_pages:
        room = min(room, config.max_pages // pages)        # the keys within the budget
    if config.pool_limit:
        room = min(room, config.pool_limit // pages - 1)   # and the retain that must evict, in the pool
    within = f"{length}-token keys" + (" within max_pages and the pool" if room < MOST_FILLED else "")
    bound = min(threads + 1, room) if own_store(store) else config.max_entries
    if own_store(store) and bound < 3:
        return f"fewer than two hit keys and the newest fit ({room} entries of {within})"
    if bound > room:
        return (f"max_entries {bound}: the scenario fills at most {room} entries ({within}), so its retain "
                f"never evicts for the entry bound")
    if bound < 3:
        return f"max_entries {bound}: fewer than two entries besides the newest, so no concurrent hits to race"
    hits = min(threads, bound - 1)
    if hits < 2:
        return f"threads {threads}: fewer than two hits to race"
    return config.with_(max_entries=bound), length, hits, bound - 1 - hits


def hits_stamp_under_race(store: str = "numpy", seed: int = 0, iterations: int = 4, threads: int = 3,
                          rounds: int = 10, configs=None, yields: bool = False) -> RaceReport:
    """Recency under concurrent hits: each of ``rounds`` rounds retains ``threads`` keys, then any
    fillers, then one more, Z (the newest; the keys, the fillers and Z are ``max_entries``); the
    fillers are then hit one by one (so only the keys and Z are older); ``threads`` threads then hit
    the keys at once, one key each (a ``match`` of the whole key, closed after); then one more retain
    must evict. Whatever order the hits take, each stamps its own entry after Z's retain, so Z is the
    least recently used and the retain must evict Z and nothing else (no false positive: the outcome
    does not depend on the schedule). Judged through the black box after that retain: a ``match`` of
    each key (those stamp, but the eviction is already decided), Z missing, every other key holding
    what its ``match`` kind allows. A ``match`` stamping its entry outside the lock that guards the
    clock (two hits crossing, one stamp lost or given to the other's entry) leaves a hit key older
    than Z, and that one is evicted instead.

    ``max_entries`` is the declared one for a backend's factory (``_hit_plan``): fewer hit threads
    where it is small, fillers where it passes ``threads + 1``. kvstate's own stores run with the
    hits plus Z and no fillers.

    Ten rounds: audit 3's ``stamp_outside_lock`` was caught in every configuration of 10 of 10
    ``races`` runs at 10 as at 40, for a quarter of the cost on a correct engine.

    n/a (counted as ``skipped``, the reason in ``report.skipped``) where pages are reclaimed the
    engine's own way (``reclaim``: which entry goes is its choice), or where fewer than two hit keys
    fit or the declared ``max_entries`` is more than the scenario fills (``_hit_plan``)."""
    report = RaceReport("hits_stamp_under_race", store, seed, threads=threads, options={"threads": threads})
    with racing_reported(report, yields):
        for iteration, config, where in _rounds(report, store, seed, iterations, configs):
            plan = (f"on_full={config.on_full!r}: which entry goes is the engine's choice"
                    if reclaims(config.on_full) else _hit_plan(config, threads, store))
            if isinstance(plan, str):
                report.add("skipped")
                report.skipped[config.name] = plan
                report.iterations += 1
                continue
            bounded, length, hits, filled = plan
            cache = make_cache(store, bounded, report.trace)
            rng = seeded_rng(seed, iteration)
            want = hit_length(bounded.match, bounded.block_tokens, length)
            for round_ in range(rounds):
                first = [int(t) for t in rng.permutation(900)[:hits + filled + 2] + 100]     # distinct first tokens
                keys = [[t] + [int(rng.integers(1000, 2000)) for _ in range(length - 1)] for t in first]
                hit_keys, fillers = keys[:hits], keys[hits:hits + filled]
                newest, last = keys[hits + filled], keys[hits + filled + 1]
                for key in hit_keys + fillers + [newest]:
                    _retain_key(cache, bounded, key)
                at = f"{where} round {round_}"

                def hitter(key: list[int]) -> Callable[[], None]:
                    def run() -> None:
                        ctx, matched = cache.match(key)
                        try:
                            if matched != want:
                                raise RaceFailure(f"{at}: a hit of retained key {key} held {matched} positions, "
                                                  f"a {bounded.match} match holds {want} (max_entries "
                                                  f"{bounded.max_entries}, nothing evicted yet)")
                            verify(ctx, bounded, f"the hit of {key}", want_tokens=key[:want])
                        finally:
                            ctx.close()
                    return run

                for key in fillers:         # one by one: each is then newer than Z
                    hitter(key)()
                run_threads([hitter(key) for key in hit_keys], at, report=report)
                _retain_key(cache, bounded, last)          # must evict exactly Z
                kept = _hits_of(cache, bounded, hit_keys + fillers + [newest, last], want, at)
                evicted = [key for key, k in zip(hit_keys + fillers + [newest, last], kept) if not k]
                if evicted != [newest]:
                    hit_list = " and ".join(str(key) for key in hit_keys)
                    others = f", the {filled} others hit one by one after it" if filled else ""
                    raise RaceFailure(
                        f"{at}: after concurrent hits of {hit_list} (each a match of its whole key, closed "
                        f"after), a retain of {last} evicted {evicted or 'nothing'}; every order of those hits "
                        f"leaves {newest} (retained after them, never hit{others}) least recently used, so with "
                        f"max_entries {bounded.max_entries} it alone must go: a hit's stamp on the clock was "
                        f"lost or given to another entry (is the stamp taken under the lock that picks the hit?)")
                check_emptied(cache, at)
                report.add("hit_rounds")
                report.add("hits", hits)
            report.iterations += 1
    return report


# -- a fork racing the owner's writes to its parent ----------------------------------------------------

def _fork_state_ok(seen: list[int], undo: tuple | None, history: list[tuple[int, ...]], lo: int, hi: int) -> bool:
    """Whether a branch reading ``seen`` after its one write ``undo`` forked one of ``history[lo:hi + 1]``:
    the branch's tokens with that write taken back (an extend's tokens dropped; an overwritten
    position, whose old token is gone, matching anything) equal that state's."""
    if undo is not None and undo[0] == "extend":
        seen, wild = seen[:len(seen) - len(undo[1])], set()
    elif undo is not None:
        wild = set(range(undo[1], undo[1] + len(undo[2])))
    else:
        wild = set()
    for state in history[lo:hi + 1]:
        if len(state) == len(seen) and all(i in wild or state[i] == t for i, t in enumerate(seen)):
            return True
    return False


def fork_vs_owner_writes(store: str = "numpy", seed: int = 0, iterations: int = 4, threads: int = 3,
                         forks: int = 40, configs=None, yields: bool = False) -> RaceReport:
    """A fork racing writes that change its parent: the owner thread extends its parent with new
    tokens (never seen before) and truncates it, again and again, reading it back after each
    write; ``threads - 1`` other threads fork it (a fork of a context another thread writes may be
    refused as busy: retried) and at once write their branch (an overwrite or an extend, which
    copies the page it shares with the parent) or read it. Each branch must hold a state the parent
    actually had at one instant between the owner's operations, from the last one finished when the
    fork began to the one in flight when it returned (tokens, the length with them, and values
    consistent with its tokens), plus its own write; the parent must read exactly the owner's
    writes. A fork that does not exclude the parent's writer shares a page whose bytes have not
    landed, or copies half of them: its branch then holds a token of an extend truncated before it
    began, or values its tokens do not give. In a pool that refuses when full, a refused write
    changes nothing."""
    report = RaceReport("fork_vs_owner_writes", store, seed, threads=threads, options={"threads": threads})
    with racing_reported(report, yields):
        for iteration, config, where in _rounds(report, store, seed, iterations, configs):
            pt, rng = config.page_tokens, seeded_rng(seed, iteration)
            cache = make_cache(store, config, report.trace)
            base = [int(t) for t in rng.integers(0, 1000, _fitting(config, pt + 1))]
            parent = cache.allocate()
            extend(parent, config, base)
            history: list[tuple[int, ...]] = [tuple(base)]     # the parent's states, appended after each write
            finished = [0]
            checks: list[tuple[str, list[int], tuple | None, int, int]] = []
            lock = threading.Lock()
            forkers = max(1, threads - 1)

            def owner() -> None:
                orng, state, fresh = seeded_rng(seed, iteration, 0), list(base), 5_000_000
                while finished[0] < forkers:
                    if len(state) < len(base) + 2 * pt and (len(state) <= 1 or orng.random() < 0.6):
                        new = list(range(fresh, fresh + int(orng.integers(1, pt + 1))))
                        fresh += len(new)
                        if retry_busy(lambda: attempt(lambda: extend(parent, config, new), parent, config, report,
                                                      "owner", want_tokens=state), report):
                            state = state + new
                    else:
                        keep = int(orng.integers(1, len(state)))
                        retry_busy(lambda: parent.truncate(keep), report)
                        state = state[:keep]
                    history.append(tuple(state))
                    if orng.random() < 0.25:        # reads of the parent, a few: the writes are what forks race
                        retry_busy(lambda: verify(parent, config, "the parent, read by its owner",
                                                  want_tokens=state), report)
                    report.add("owner_writes")

            def forker(t: int) -> Callable[[], None]:
                def run() -> None:
                    frng, fresh = seeded_rng(seed, iteration, t + 1), 100_000 * (t + 1)
                    try:
                        for n in range(forks):
                            lo = len(history) - 1
                            child = retry_busy(parent.fork, report)
                            hi = len(history)
                            name = f"branch {t}.{n}"
                            what = f"{name} (forked while the parent's owner extended and truncated it)"
                            undo = None
                            if frng.random() < 0.7:
                                length = len(child)
                                if length and frng.random() < 0.5:
                                    start = int(frng.integers(length))
                                    op = ("overwrite", start, [fresh])
                                else:
                                    op = ("extend", [fresh, fresh + 1][:int(frng.integers(1, 3))])
                                fresh += 2
                                if attempt(lambda: _apply_op(child, config, op), child, config, report, what):
                                    undo = op
                            seen = [int(x) for x in verify(child, config, what)]
                            with lock:
                                checks.append((name, seen, undo, lo, hi))
                            child.close()
                            report.add("forks")
                    finally:
                        with lock:
                            finished[0] += 1
                return run

            run_threads([owner] + [forker(t) for t in range(forkers)], where, observe_cache=cache, report=report,
                        config=config)
            for name, seen, undo, lo, hi in checks:
                if not _fork_state_ok(seen, undo, history, lo, hi):
                    write = "" if undo is None else f" after its own {undo[0]} of {undo[-1]}" + (
                        f" at {undo[1]}" if undo[0] == "overwrite" else "")
                    states = "; ".join(str(list(s)) for s in history[lo:hi + 1])
                    raise RaceFailure(
                        f"{where}: {name}, forked while the parent's owner extended and truncated it, reads "
                        f"tokens {seen}{write}: no state the parent had between the owner's operations "
                        f"around that fork ({states}), so the fork saw the parent mid-write (a length "
                        f"raised before its bytes landed, or a page copied half-written)")
            verify(parent, config, "the parent after the threads", want_tokens=list(history[-1]))
            check_after(cache, where, config=config)
            parent.close()
            check_emptied(cache, where)
            report.add("owner_states", len(history))
            report.iterations += 1
    return report


POLL_SECONDS = 2e-5      # how long a thread waiting for another's turn sleeps between looks
WAKE_SECONDS = 5e-3      # how long a paused thread waits for the other to begin (a busy machine wakes it late)


def _poll_until(condition: Callable[[], bool], seconds: float = THREAD_TIMEOUT) -> bool:
    """Whether ``condition()`` came true within ``seconds``, looked at every ``POLL_SECONDS``. Not an
    ``Event``: a thread blocked there waits for the system to wake it, which on a busy machine takes
    longer than the pause it is handed; and not ``sleep(0)``, which takes the interpreter from a
    traced thread at each of its lines."""
    deadline = time.perf_counter() + seconds
    while not condition():
        if time.perf_counter() >= deadline:
            return False
        time.sleep(POLL_SECONDS)
    return True


# -- reads racing a copy-on-write of many pages ------------------------------------------------------

COPIED_PAGES = 8        # pages each overwrite copies (fewer where a pool that refuses would run out)
PAUSES_PER_WRITE = 8    # lines of each overwrite, drawn from those it runs in the engine, the owner pauses at


def reads_during_copy_on_write(store: str = "numpy", seed: int = 0, iterations: int = 4, cycles: int = 6,
                               configs=None, yields: bool = False) -> RaceReport:
    """A context read while its owner copies many shared pages of it: the owner forks the context
    (every page now shared), overwrites it whole with the tokens and values it already holds (so
    each of its pages is copied on write), checks and closes the fork, ``cycles`` times. It pauses
    at random lines the overwrite runs in the engine (``pausing``), and a reader thread reads the
    context in each pause (a read that waits for a lock the paused owner holds ends the pause
    after ``NAP_SECONDS``, and lands after it). Whatever the schedule, each read returns exactly
    those tokens and values (or is refused as busy: a context used by two threads at once), and
    the fork never sees the write. A copy-on-write that publishes the private copy before filling
    it lets a read see zeros: its window holds NumPy copies alone, no call, which neither the GIL's
    switching nor ``yields`` lands in."""
    report = RaceReport("reads_during_copy_on_write", store, seed, threads=2)
    with racing_reported(report, yields):
        for iteration, config, where in _rounds(report, store, seed, iterations, configs):
            rng = seeded_rng(seed, iteration)
            cache = make_cache(store, config, report.trace)
            tokens = [int(t) for t in rng.integers(0, 1000, _fitting(config, COPIED_PAGES * config.page_tokens))]
            want = expected_read(config, tokens)        # all a read may return, at any moment
            ctx = cache.allocate()
            extend(ctx, config, tokens)
            lines = _lines_run(store, lambda: _copy_on_write(ctx, config, tokens, report))
            asked, begun, answered, done = [0], [0], [0], threading.Event()     # pauses, and reads in them

            def pause() -> None:        # until the read in it ends, or NAP_SECONDS after it began
                if begun[0] != answered[0] or done.is_set():
                    return      # the last pause's read still waits, for a lock the owner holds (or failed)
                asked[0] += 1
                if _poll_until(lambda: begun[0] == asked[0], WAKE_SECONDS):
                    _poll_until(lambda: answered[0] == asked[0], NAP_SECONDS)

            def owner() -> None:
                try:
                    for _ in range(cycles):
                        at = {int(n) for n in rng.choice(lines, min(lines, PAUSES_PER_WRITE), replace=False)}
                        with pausing(engine_folders(store), at.__contains__, pause):
                            _copy_on_write(ctx, config, tokens, report)
                        report.add("copies_on_write")
                finally:
                    done.set()

            def reader() -> None:
                name = "a read racing a copy-on-write of its pages"
                try:
                    while _poll_until(lambda: asked[0] > answered[0] or done.is_set()) and not done.is_set():
                        now = begun[0] = asked[0]
                        try:
                            got = read_numpy(ctx)
                        except ContextBusyError:
                            report.add("busy_reads")
                        else:
                            invariants.check_values({name: got}, {name: want})
                            report.add("reads")
                        answered[0] = now
                finally:
                    done.set()

            run_threads([owner, reader], where, report=report)
            verify(ctx, config, "the context after the threads", want_tokens=tokens)
            check_after(cache, where, expected_tree=[], config=config)
            ctx.close()
            check_emptied(cache, where)
            report.iterations += 1
    return report


def _copy_on_write(ctx, config: Config, tokens: list[int], report: RaceReport) -> None:
    """Fork ``ctx``, overwrite it whole with ``tokens`` (which it holds: every shared page is
    copied, nothing changes), and check and close the fork."""
    twin = retry_busy(ctx.fork, report)
    retry_busy(lambda: attempt(lambda: overwrite(ctx, config, 0, tokens), ctx, config, report, "owner",
                               want_tokens=tokens), report)
    verify(twin, config, "the fork, after its parent was overwritten", want_tokens=tokens)
    twin.close()


def _lines_run(store, operation: Callable[[], object]) -> int:
    """How many lines of the engine's code ``operation`` runs (at least 1)."""
    seen = [0]

    def count(n: int) -> bool:
        seen[0] = n + 1
        return False

    with pausing(engine_folders(store), count):
        operation()
    return max(1, seen[0])


# -- recency with hits racing retains ---------------------------------------------------------------

MOST_PAUSES = 16        # lines of a hit ``stamps_vs_retains`` pauses at, one a round, at most
RETAINS_IN_PAUSE = 3    # retains it runs while the hit is paused: the clock moves on past the hit's tick


def _stamp_plan(config: Config, store) -> tuple[Config, int] | str:
    """The configuration ``stamps_vs_retains`` runs in and its key length, or why it does not apply.

    Keys are one whole block (``block``) or one token; the tree holds ``max_entries`` of them: the
    declared bound for a backend's factory (at most ``MOST_FILLED``), 4 for kvstate's own stores.
    Neither ``max_pages`` nor the pool may ever need room for those keys plus one more retain
    (as in ``_hit_plan``): nothing but ``max_entries`` then decides what a retain evicts."""
    if reclaims(config.on_full):
        return f"on_full={config.on_full!r}: which entry goes is the engine's choice"
    length = config.block_tokens if config.match == "block" else 1
    pages = entry_pages(length, config.page_tokens)
    room = MOST_FILLED
    if config.max_pages:
        room = min(room, config.max_pages // pages)
    if config.pool_limit:
        room = min(room, config.pool_limit // pages - 1)
    bound = min(4, room) if own_store(store) else config.max_entries
    if bound > room:
        return (f"max_entries {bound}: the scenario fills at most {room} entries of {length}-token keys, so its "
                f"retains never evict for the entry bound")
    if bound < 2:
        return f"max_entries {bound}: no entry besides the one hit to judge"
    return config.with_(max_entries=bound), length


def stamps_vs_retains(store: str = "numpy", seed: int = 0, iterations: int = 4, configs=None,
                      yields: bool = False) -> RaceReport:
    """Recency with hits racing retains. Each round retains ``max_entries`` keys; one thread then
    hits one of them (a match of its whole key, closed after), and is paused at one line it runs
    in the engine (``pausing``: another line each round) while another
    thread retains ``RETAINS_IN_PAUSE`` of the keys again (a retain of a retained key replaces its
    entry, as the most recently used: the hit still hits); a pause inside a lock the retains wait
    for ends after ``NAP_SECONDS``, and they run after it. Any interleaving of that is allowed:
    only what follows, sequentially, is judged. One entry B is hit (the first key, in the order
    retained, that still hits: a miss stamps nothing), then ``max_entries - 1`` fresh keys are
    retained. B is then the most recently used of the entries the race left, and each retain
    evicts the least recently used, so B and the fresh keys stay and every other key goes,
    whatever the race did. A match that stamps its entry with an unlocked read-modify-write of
    the clock (``tick = clock + 1`` on one line, ``clock = tick`` on the next: no call between, so
    neither the GIL nor ``yields`` switches threads there), paused between the two while the
    retains move the clock on, writes it back: B's stamp then trails an entry retained in the
    race, which stays while B goes. (``hits_stamp_under_race`` races hits against hits alone,
    which cannot turn the clock back.)

    The rounds: one for each line a hit runs in the engine (counted by a hit before the first
    round), or ``MOST_PAUSES`` of them drawn from the seed where there are more. n/a where pages are
    reclaimed the engine's own way or the declared bound does not fit (``_stamp_plan``)."""
    report = RaceReport("stamps_vs_retains", store, seed, threads=2)
    with racing_reported(report, yields):
        for iteration, config, where in _rounds(report, store, seed, iterations, configs):
            plan = _stamp_plan(config, store)
            if isinstance(plan, str):
                report.add("skipped")
                report.skipped[config.name] = plan
                report.iterations += 1
                continue
            bounded, length = plan
            cache = make_cache(store, bounded, report.trace)
            rng = seeded_rng(seed, iteration)
            m = bounded.max_entries
            # distinct first tokens: no key is a prefix of another, so a query hits its own key or nothing
            first = [int(t) for t in rng.permutation(900)[:m] + 100]
            filled = [[t] + [int(rng.integers(1000, 2000)) for _ in range(length - 1)] for t in first]
            for key in filled:
                _retain_key(cache, bounded, key)
            # the lines a hit runs in the engine: one to pause at a round
            hit: list = []
            lines = _lines_run(store, lambda: hit.append(cache.match(filled[-1])[0]))
            hit[0].close()
            pauses = [int(n) for n in rng.permutation(lines)[:MOST_PAUSES]]
            for round_, line in enumerate(pauses):
                at = f"{where} round {round_}"
                first = [int(t) for t in rng.permutation(900)[:m - 1] + 1000 * (round_ + 1)]
                fresh = [[t] + [int(rng.integers(1000, 2000)) for _ in range(length - 1)] for t in first]
                _race_stamps(cache, bounded, filled, filled[int(rng.integers(len(filled)))], line, report, at, store)
                b = _judge_recency(cache, bounded, filled, fresh, at)
                filled = ([b] if b else []) + fresh         # the tree now, oldest first: the next round's keys
                report.add("stamp_rounds")
            check_emptied(cache, where)
            report.iterations += 1
    return report


def _race_stamps(cache: Cache, config: Config, keys: list[list[int]], target: list[int], line: int,
                 report: RaceReport, at: str, store) -> None:
    """A thread hitting ``target``, paused at the ``line``-th line it runs in the engine while another
    retains ``RETAINS_IN_PAUSE`` of ``keys`` again (the pause ends where the first takes more than
    ``NAP_SECONDS``: it waits for a lock the paused hit holds)."""
    want = hit_length(config.match, config.block_tokens, len(target))
    paused, begun, retained, done = threading.Event(), [0], [0], threading.Event()

    def pause() -> None:
        paused.set()
        # The first retain within NAP_SECONDS of its start, or it waits for a lock the paused hit
        # holds; the others then go on unhindered, so a busy machine is given longer for them.
        for n in range(1, RETAINS_IN_PAUSE + 1):
            if not (_poll_until(lambda: begun[0] >= n, WAKE_SECONDS) and
                    _poll_until(lambda: retained[0] >= n, NAP_SECONDS if n == 1 else WAKE_SECONDS)):
                return

    def hitter() -> None:
        try:
            with pausing(engine_folders(store), line.__eq__, pause):
                ctx, matched = cache.match(target)
        finally:
            done.set()          # the retains run now if the pause never came
        _check_hit(ctx, matched, target, config, want, at)
        report.add("hits" if matched else "misses")

    def retainer() -> None:
        _poll_until(lambda: paused.is_set() or done.is_set())
        for turn in range(RETAINS_IN_PAUSE):
            begun[0] += 1
            key, ctx = keys[turn % len(keys)], cache.allocate()
            if attempt(lambda: extend(ctx, config, key), ctx, config, report, at, want_tokens=[]):
                cache.retain(ctx)
                report.add("retains")
            ctx.close()
            retained[0] += 1

    run_threads([hitter, retainer], at, report=report)


def _judge_recency(cache: Cache, config: Config, older: list[list[int]], fresh: list[list[int]],
                   at: str) -> list[int] | None:
    """Sequentially: hit B, the first of ``older`` that still hits; retain each of ``fresh``
    (``max_entries - 1`` keys); then B and the fresh keys must hit, every other key miss.
    Returns B (None where no key of ``older`` hit)."""
    want = hit_length(config.match, config.block_tokens, len(older[0]))
    b = None
    for key in older:
        ctx, matched = cache.match(key)
        ctx.close()
        if matched:
            b = key
            break
    for key in fresh:
        _retain_key(cache, config, key)
    kept = [key for key, hit in zip(older + fresh, _hits_of(cache, config, older + fresh, want, at)) if hit]
    expected = ([b] if b else []) + fresh
    if sorted(kept) != sorted(expected):
        raise RaceFailure(
            f"{at}: after hits racing retains, then, the threads done, a hit of {b} and retains of {len(fresh)} "
            f"fresh keys {fresh}: {[k for k in kept if k not in expected]} stayed and "
            f"{[k for k in expected if k not in kept]} went. {b}, hit after everything the race did, and the fresh "
            f"keys are the {config.max_entries} most recently used, so with max_entries {config.max_entries} they "
            f"alone must stay: did the clock go backwards (a hit's stamp reading it, a retain moving it on, the "
            f"stamp writing back an older value)?")
    return b


# -- the catalogue ----------------------------------------------------------------------------------

SCENARIOS: dict[str, Callable[..., RaceReport]] = {
    "fork_storm": fork_storm,
    "eviction_vs_allocation": eviction_vs_allocation,
    "pressure_vs_match": pressure_vs_match,
    "match_close_vs_clear": match_close_vs_clear,
    "close_races": close_races,
    "snapshot_vs_decode": snapshot_vs_decode,
    "observe_during_writes": observe_during_writes,
    "hits_stamp_under_race": hits_stamp_under_race,
    "fork_vs_owner_writes": fork_vs_owner_writes,
    "reads_during_copy_on_write": reads_during_copy_on_write,
    "stamps_vs_retains": stamps_vs_retains,
}

def run_iteration(scenario: str, store, config: Config, seed: int, iteration: int, **options) -> RaceReport:
    """Iteration ``iteration`` of ``scenario`` with ``seed`` in ``config``: what a failure's rerun
    command (``kvstate race``) runs."""
    return SCENARIOS[scenario](store=store, seed=seed, iterations=range(iteration, iteration + 1), configs=[config],
                               **options)


# Iterations per scenario: one per configuration, so CI runs each scenario under every declared
# semantics (tests/test_races.py checks that it does) while keeping the suite's share to seconds;
# stress multiplies them.
CI_ITERATIONS = {name: len(race_configs()) for name in SCENARIOS}
CI_ITERATIONS["pressure_vs_match"] = len(pressure_configs())


def stress(minutes: float, seed: int = 0, stores: list | None = None, scenarios: list[str] | None = None,
           scale: int = 10, out=print, clock: Callable[[], float] = time.monotonic) -> dict[str, dict[str, int]]:
    """Run every scenario on every store, ``scale`` times the CI iterations, round after round with
    seeds ``seed, seed + 1, ...``, every other round with ``yields`` for all scenarios, until
    ``minutes`` have passed: the deadline is checked after each CI-sized stretch of a scenario's
    iterations, so a run ends within one such stretch past it (seconds), whatever ``scale``. Each round starts one
    pair further on, so runs shorter than a round still reach every scenario in turn. Stops at the
    first ``RaceFailure`` (which propagates, naming store, seed and iteration). Returns totals per
    scenario and store that ran. A store may be a backend's factory: it is raced in the
    configurations and scenarios ``kvstate conform`` races it in (``applicable.py``), ``scale``
    iterations a configuration."""
    stores = stores or available_stores()
    names = scenarios or list(SCENARIOS)
    applicability = {id(store): _applicability(store) for store in stores}
    runs = [(name, store, planned) for store in stores for name in names
            if (planned := _planned(name, applicability[id(store)])) is not None]
    if not runs:        # only a backend's factory can be raced nowhere: say why
        why = [found for applies in applicability.values() for found in (applies or {}).values() if isinstance(found, str)]
        raise NothingToRace("; ".join(dict.fromkeys(why)) or "none of the scenarios asked applies in its configurations")
    totals: dict[str, dict[str, int]] = {}
    deadline = clock() + minutes * 60
    round_seed = seed
    while True:
        first = (round_seed - seed) % len(runs)
        for name, store, (configs, options) in runs[first:] + runs[:first]:
            options = options | ({"yields": True} if (round_seed - seed) % 2 else {})
            stretch = len(configs) if configs else CI_ITERATIONS[name]
            total = totals.setdefault(f"{name}[{store_label(store)}]", {"rounds": 0, "iterations": 0})
            total["rounds"] += 1
            # ``scale`` CI-sized stretches, iterations numbered on (each one's configuration and seed as
            # in one call of them all), the clock read after each: a large --scale cannot hold the run
            # past its minutes by more than one stretch.
            ran = None
            for start in range(0, stretch * scale, stretch):
                report = SCENARIOS[name](store=store, seed=round_seed, iterations=range(start, start + stretch),
                                         **({"configs": configs} if configs else {}), **options)
                ran = _added(ran, report)
                total["iterations"] += report.iterations
                for key, value in report.counts.items():
                    total[key] = total.get(key, 0) + value
                if clock() >= deadline:
                    out(str(ran))
                    return totals
            out(str(ran))
        round_seed += 1


def _added(ran: RaceReport | None, report: RaceReport) -> RaceReport:
    """``report``'s iterations and counts added to ``ran``'s (one scenario's stretches, for its line)."""
    if ran is None:
        return report
    ran.iterations += report.iterations
    for key, value in report.counts.items():
        ran.counts[key] = ran.counts.get(key, 0) + value
    return ran


class NothingToRace(ValueError):
    """``stress`` was given only backends that no scenario asked races in any configuration."""


def _applicability(store) -> "dict[Config, list | str] | None":
    """For a backend's factory, what ``applicable.backend_scenarios`` says of each of its configurations
    (each asked once: it builds a cache); None for a built-in store."""
    if not callable(store):
        return None
    from ..configs import configs_for
    from .applicable import backend_scenarios

    return {config: backend_scenarios(store, config) for config in configs_for(store)}


def _planned(name: str, applies) -> "tuple[list[Config] | None, dict] | None":
    """``(configurations, options)`` of scenario ``name``: a built-in store's defaults (``applies`` None:
    every race configuration); for a backend's factory (``applies`` from ``_applicability``), the
    configurations it is raced in under ``name`` and conform's options, or None where there are none."""
    if applies is None:
        return None, {}
    configs, options = [], {}
    for config, found in applies.items():
        raced = {} if isinstance(found, str) else dict(found)
        if name in raced:
            configs.append(config)
            options = raced[name]
    return (configs, options) if configs else None
