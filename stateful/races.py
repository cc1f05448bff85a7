"""Race scenarios: the concurrency an inference scheduler creates, under real threads.

Each scenario builds its own caches, starts its threads together at a barrier
under a tiny ``sys.setswitchinterval`` (so the interpreter switches threads
between almost every pair of bytecodes), runs many short iterations, and then
checks the invariants of ``kvstate.spec.invariants`` and compares values with
the reference model (``kvstate.reference``) replaying each thread's operations
sequentially. An observer thread calls ``observe()`` and checks invariants 1-3
all the while, so a structure that is only briefly wrong is caught too.

Values are self-verifying: the K/V written for token ``t`` at position ``p`` is
a fixed function of ``(t, p)`` (``kv_for``), so any read, of any context, at
any moment, can be checked against what its own token ids say it must hold. A
page freed while held, a slot issued twice or a write leaking into another
branch reads as a mismatch, named with its position.

Every operation sequence comes from ``(seed, iteration, thread)``; the thread
schedule itself cannot be replayed, so a failure names all three and the store,
and rerunning that seed retries the same work under new schedules.

``tests/test_races.py`` runs these at CI size; ``kvstate stress`` runs them for
minutes. ``SCENARIOS`` maps names to the functions; the shared harness is
``stateful/race_harness.py``.
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
from kvstate.spec.errors import ContextBusyError, ContextClosedError
from kvstate.spec.protocol import Config

from .race_harness import (  # noqa: F401 - RACE_LAYOUT re-exported for the tests
    RACE_LAYOUT, RaceFailure, RaceReport, available_stores, check_after, check_emptied,
    extend, kv_for, make_cache, overwrite, page_counters, race_configs, read_numpy, retry_busy, run_threads,
    seeded_rng, store_label, switch_interval, verify,
)


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


def _apply_plan(ctx, config: Config, plan: list[tuple], reference: bool = False) -> None:
    for op in plan:
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


def _copies_expected(plan: list[tuple], parent_len: int, pt: int) -> int:
    """Pages ``writable`` must copy for one branch: each parent page it writes, once (the parent keeps holding it)."""
    parent_pages, length, touched = pages_needed(parent_len, pt), parent_len, set()
    for op in plan:
        start, n = (op[1], len(op[2])) if op[0] == "overwrite" else (length, len(op[1]))
        touched.update(range(*pages_touched(start, start + n, pt)))
        if op[0] == "extend":
            length += n
    return len({index for index in touched if index < parent_pages})


def _rounds(scenario: str, store, seed: int, iterations: int, configs=None):
    """Each iteration with its configuration (cycling through ``configs``, by default
    ``race_configs()``) and a name for failure messages that reruns exactly that schedule."""
    configs = configs or race_configs()
    for iteration in range(iterations):
        config = configs[iteration % len(configs)]
        yield iteration, config, f"{scenario}[{store_label(store)}, {config.name}] seed={seed} iteration={iteration}"


def _plan_length(plan: list[tuple], parent_len: int) -> int:
    return parent_len + sum(len(op[1]) for op in plan if op[0] == "extend")


def fork_storm(store: str = "numpy", seed: int = 0, iterations: int = 10, threads: int = 16,
               configs=None) -> RaceReport:
    """Sixteen threads fork one parent at once (concurrent forks are refused as busy and retried),
    then each writes its own branch; every branch must read only its own writes, the parent nothing
    new, and exactly the shared pages each branch wrote must have been copied."""
    report = RaceReport("fork_storm", store, seed, threads=threads)
    with switch_interval():
        for iteration, config, where in _rounds("fork_storm", store, seed, iterations, configs):
            pt, rng = config.page_tokens, seeded_rng(seed, iteration)
            cache, ref = make_cache(store, config), RefCache(config)
            parent_tokens = [int(t) for t in rng.integers(0, 1000, int(rng.integers(1, 4 * pt + 1)))]
            parent, ref_parent = cache.allocate(), ref.allocate()
            extend(parent, config, parent_tokens)
            ref_parent.extend(parent_tokens, kv_for(config.layout, parent_tokens, 0))
            plans = [_branch_plan(seeded_rng(seed, iteration, t + 1), t, len(parent_tokens), pt) for t in range(threads)]
            branches: list = [None] * threads
            before = page_counters(cache)

            def body(t: int) -> Callable[[], None]:
                def run() -> None:
                    child = retry_busy(parent.fork, report)
                    branches[t] = child
                    _apply_plan(child, config, plans[t])
                    verify(child, config, f"branch {t}")      # already, while the others still write
                return run

            run_threads([body(t) for t in range(threads)], where, observe_cache=cache, report=report)
            live, twins = {"parent": parent}, {"parent": ref_parent}
            for t, plan in enumerate(plans):
                twin = ref_parent.fork()
                _apply_plan(twin, config, plan, reference=True)
                live[f"branch {t}"], twins[f"branch {t}"] = branches[t], twin
            check_after(cache, where, expected_tree=[], live=live, reference=twins)
            after = page_counters(cache)
            copies = sum(_copies_expected(plan, len(parent_tokens), pt) for plan in plans)
            appended = sum(pages_needed(_plan_length(plan, len(parent_tokens)), pt) - pages_needed(len(parent_tokens), pt)
                           for plan in plans)
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


def _check_match(ctx, matched: int, query: list[int], bases: list[list[int]], config: Config, where: str) -> None:
    """A match result: a prefix of the query that some thread could have retained, with consistent values."""
    if not 0 <= matched <= len(query):
        raise RaceFailure(f"{where}: matched {matched} tokens of a {len(query)}-token query")
    if matched and not any(base[:matched] == query[:matched] for base in bases):
        raise RaceFailure(f"{where}: matched key {query[:matched]} was never retained")
    verify(ctx, config, "match result", want_tokens=query[:matched])


def _tree_worker(cache: Cache, config: Config, bases: list[list[int]], rng: np.random.Generator, steps: int,
                 report: RaceReport, where: str, retained: set, hold: int = 2) -> Callable[[], None]:
    """Retain prefixes of the bases, match queries against them, keep a few results open a while."""
    def run() -> None:
        held: list[tuple] = []
        for step in range(steps):
            base = bases[int(rng.integers(len(bases)))]
            if rng.random() < 0.5:
                ctx = cache.allocate()
                key = base[:int(rng.integers(1, len(base) + 1))]
                extend(ctx, config, key)
                cache.retain(ctx)
                retained.add(tuple(key))
                report.add("retains")
                ctx.close()
            else:
                query = base[:int(rng.integers(1, len(base) + 1))] + [int(t) for t in rng.integers(2000, 3000, 2)]
                ctx, matched = cache.match(query)
                _check_match(ctx, matched, query, bases, config, where)
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
               report: RaceReport) -> Callable[[], None]:
    """Allocate, extend, fork, overwrite, truncate and close, mirrored on a private reference cache."""
    def run() -> None:
        ref, fresh = RefCache(config), 100_000 * (thread + 1)
        for step in range(steps):
            ctx, twin = cache.allocate(), ref.allocate()
            tokens = list(range(fresh, fresh + int(rng.integers(1, 3 * config.page_tokens + 1))))
            fresh += 50
            extend(ctx, config, tokens)
            twin.extend(tokens, kv_for(config.layout, tokens, 0))
            fork, fork_twin = ctx.fork(), twin.fork()
            start = int(rng.integers(0, len(tokens)))
            overwrite(fork, config, start, [fresh])
            fork_twin.overwrite(start, [fresh], kv_for(config.layout, [fresh], start))
            keep = int(rng.integers(0, len(tokens) + 1))
            ctx.truncate(keep)
            twin.truncate(keep)
            invariants.check_values({"ctx": read_numpy(ctx), "fork": read_numpy(fork)},
                                    {"ctx": twin.read(), "fork": fork_twin.read()})
            ctx.close()
            fork.close()
            twin.close()
            fork_twin.close()
            report.add("allocations", 2)
    return run


def _finish_tree(cache: Cache, config: Config, retained: set, where: str, entries: int | None) -> None:
    """After the threads: invariants, the entry count, and every entry's content read through ``match``."""
    check_after(cache, where)
    obs = cache.observe()
    keys = [entry.key for entry in obs.entries]
    ticks = [entry.tick for entry in obs.entries]
    if any(tuple(key) not in retained for key in keys):
        raise RaceFailure(f"{where}: tree holds keys {sorted(set(map(tuple, keys)) - retained)} nobody retained")
    if ticks != sorted(set(ticks)):
        raise RaceFailure(f"{where}: entry ticks {ticks} are not strictly increasing in eviction order")
    if entries is not None and len(keys) != entries:
        raise RaceFailure(f"{where}: {len(keys)} entries, expected {entries}")
    if obs.counters["live_contexts"] != 0:
        raise RaceFailure(f"{where}: {obs.counters['live_contexts']} contexts still live after every thread closed its own")
    for key in keys:
        ctx, matched = cache.match(list(key))
        if matched != len(key):
            raise RaceFailure(f"{where}: entry {key} matched only {matched} of its own tokens")
        verify(ctx, config, f"entry {key}", want_tokens=list(key))
        ctx.close()
    check_emptied(cache, where)


def eviction_vs_allocation(store: str = "numpy", seed: int = 0, iterations: int = 6, threads: int = 6,
                           steps: int = 40, configs=None) -> RaceReport:
    """Threads retaining and matching against a tiny ``max_entries`` while others allocate, extend,
    fork and close: no page leaked, no slot issued twice, nothing freed while held."""
    report = RaceReport("eviction_vs_allocation", store, seed, threads=threads)
    with switch_interval():
        for iteration, config, where in _rounds("eviction_vs_allocation", store, seed, iterations, configs):
            cache, retained = make_cache(store, config), set()
            bases = _bases(seed, iteration, 4 * config.page_tokens)
            bodies = []
            for t in range(threads):
                rng = seeded_rng(seed, iteration, t + 1)
                if t % 2 == 0:
                    bodies.append(_tree_worker(cache, config, bases, rng, steps, report, where, retained))
                else:
                    bodies.append(_allocator(cache, config, rng, steps // 2, t, report))
            run_threads(bodies, where, observe_cache=cache, report=report)
            _finish_tree(cache, config, retained, where, entries=min(config.max_entries, len(retained)))
            report.iterations += 1
    return report


def match_close_vs_clear(store: str = "numpy", seed: int = 0, iterations: int = 6, threads: int = 5,
                         steps: int = 40, configs=None) -> RaceReport:
    """``match`` and ``close`` of the returned contexts racing ``clear``: a match forks an entry before
    the clear releases it or finds nothing; results stay readable after the clear; nothing leaks."""
    report = RaceReport("match_close_vs_clear", store, seed, threads=threads + 1)
    with switch_interval():
        wide = [c.with_(max_entries=8) for c in configs] if configs else race_configs(max_entries=8)
        for iteration, config, where in _rounds("match_close_vs_clear", store, seed, iterations, wide):
            cache, retained = make_cache(store, config), set()
            bases = _bases(seed, iteration, 4 * config.page_tokens)
            bodies = [_tree_worker(cache, config, bases, seeded_rng(seed, iteration, t + 1), steps, report, where, retained,
                                   hold=3)
                      for t in range(threads)]

            def clearer() -> None:
                for _ in range(steps // 2):
                    cache.clear()
                    report.add("clears")
                    time.sleep(0)

            run_threads(bodies + [clearer], where, observe_cache=cache, report=report)
            _finish_tree(cache, config, retained, where, entries=None)
            report.iterations += 1
    return report


# -- bad input: close racing use, close twice, close racing fork ------------------------------

def _shared_pair(cache: Cache, config: Config, rng: np.random.Generator) -> tuple[Context, Context, list[int]]:
    """A context and a fork sharing its pages, so a corrupted refcount would free the sibling's pages."""
    tokens = [int(t) for t in rng.integers(0, 1000, int(rng.integers(1, 4 * config.page_tokens + 1)))]
    ctx = cache.allocate()
    extend(ctx, config, tokens)
    return ctx, ctx.fork(), tokens


def close_races(store: str = "numpy", seed: int = 0, iterations: int = 20, threads: int = 4,
                configs=None) -> RaceReport:
    """Close racing use from other threads, several threads closing at once, and close racing fork.

    Every refusal must be ``ContextBusyError`` or ``ContextClosedError``; exactly one close succeeds;
    a fork either happened before the close (and reads the parent's values) or is refused as closed;
    the sibling sharing the pages reads unchanged and the refcounts stay exact.
    """
    report = RaceReport("close_races", store, seed, threads=threads)
    with switch_interval():
        for iteration, config, where in _rounds("close_races", store, seed, iterations, configs):
            cache = make_cache(store, config)
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
                        except ContextClosedError:
                            with lock:
                                outcomes.append("closed")
                            return
                return run

            bodies = [closer, closer] + [user(t) for t in range(max(1, threads - 2))]
            run_threads(bodies, where, observe_cache=cache, report=report)
            if sorted(closes) != ["already_closed", "closed"]:
                raise RaceFailure(f"{where}: two racing closes ended {closes}; exactly one must succeed")
            if not ctx.closed:
                raise RaceFailure(f"{where}: the context is not closed after a successful close")
            live = {"sibling": sibling, **{f"fork {i}": f for i, f in enumerate(forks)}}
            check_after(cache, where)
            verify(sibling, config, "sibling", want_tokens=tokens)
            for name, child in live.items():
                if name != "sibling":
                    verify(child, config, name, want_tokens=tokens)
            for child in live.values():
                child.close()
            check_emptied(cache, where)
            for name in ("ok", "busy", "closed"):
                report.add(f"uses_{name}", outcomes.count(name))
            report.add("forks_before_close", len(forks))
            report.iterations += 1
    return report


# -- snapshot-and-restore racing a decode loop ---------------------------------------------------

def snapshot_vs_decode(store: str = "numpy", seed: int = 0, iterations: int = 4, steps: int = 12,
                       configs=None) -> RaceReport:
    """Snapshot and restore a context while a decode loop on its fork keeps rewriting the shared prefix.

    The snapshotting thread owns the context and changes it between snapshots, so it knows the state
    every snapshot must hold; a restored context must read exactly that state (values consistent with
    its tokens, tokens equal to the recorded ones): never the decoder's writes, never a mix.
    """
    report = RaceReport("snapshot_vs_decode", store, seed, threads=2)
    with switch_interval(), tempfile.TemporaryDirectory(prefix="kvstate-races-") as folder:
        for iteration, config, where in _rounds("snapshot_vs_decode", store, seed, iterations, configs):
            pt, rng = config.page_tokens, seeded_rng(seed, iteration)
            cache = make_cache(store, config)
            tokens = [int(t) for t in rng.integers(0, 1000, 3 * pt + 1)]
            shared = cache.allocate()
            extend(shared, config, tokens)
            decoder = shared.fork()
            ref = RefCache(config)
            decoder_twin = ref.allocate()
            decoder_twin.extend(tokens, kv_for(config.layout, tokens, 0))

            def snapshotter() -> None:
                state = list(tokens)
                srng = seeded_rng(seed, iteration, 1)
                for step in range(steps):
                    position = int(srng.integers(len(state)))
                    new = 2_000_000 + step
                    overwrite(shared, config, position, [new])
                    state[position] = new
                    path = Path(folder) / f"i{iteration}-s{step}.kvs"
                    shared.snapshot(path)
                    restored = cache.restore(path)
                    verify(restored, config, f"restore of snapshot {step}", want_tokens=state)
                    restored.close()
                    report.add("snapshots")

            def decode() -> None:
                drng = seeded_rng(seed, iteration, 2)
                for step in range(steps * 4):
                    n = int(drng.integers(1, len(tokens) + 1))
                    rewrite = [3_000_000 + step * 100 + k for k in range(n)]
                    overwrite(decoder, config, 0, rewrite)
                    decoder_twin.overwrite(0, rewrite, kv_for(config.layout, rewrite, 0))
                    extend(decoder, config, [4_000_000 + step])
                    decoder_twin.extend([4_000_000 + step], kv_for(config.layout, [4_000_000 + step], len(decoder_twin)))
                    if len(decoder) > 6 * pt:
                        decoder.truncate(len(tokens))
                        decoder_twin.truncate(len(tokens))
                    report.add("decode_steps")

            run_threads([snapshotter, decode], where, observe_cache=cache, report=report)
            check_after(cache, where, expected_tree=[], live={"decoder": decoder}, reference={"decoder": decoder_twin})
            for ctx in (shared, decoder):
                ctx.close()
            check_emptied(cache, where)
            report.iterations += 1
    return report


# -- observe() while other threads write -----------------------------------------------------------

def observe_during_writes(store: str = "numpy", seed: int = 0, iterations: int = 4, threads: int = 2,
                          observations: int = 1000, configs=None) -> RaceReport:
    """Writers extend, overwrite and restart contexts (fresh pages, recycled arena slots, partly filled
    pages) while the main thread observes: every observation must satisfy invariants 1-3, in particular
    no page may show bytes past its ``filled`` mark while a write is in flight."""
    report = RaceReport("observe_during_writes", store, seed, threads=threads + 1)
    with switch_interval():
        for iteration, config, where in _rounds("observe_during_writes", store, seed, iterations, configs):
            cache, done = make_cache(store, config), threading.Event()

            def writer(t: int) -> Callable[[], None]:
                def run() -> None:
                    rng, fresh = seeded_rng(seed, iteration, t + 1), 100_000 * (t + 1)
                    while not done.is_set():
                        ctx = cache.allocate()
                        for _ in range(4 * config.page_tokens):
                            extend(ctx, config, [fresh])
                            fresh += 1
                            if rng.random() < 0.3:
                                overwrite(ctx, config, int(rng.integers(len(ctx))), [fresh])
                                fresh += 1
                        verify(ctx, config, f"writer {t}")
                        ctx.close()
                        report.add("contexts_written")
                return run

            def observer() -> None:
                try:
                    for _ in range(observations):
                        invariants.check_structure(cache.observe())
                        report.add("observations")
                finally:
                    done.set()

            run_threads([writer(t) for t in range(threads)] + [observer], where)
            check_emptied(cache, where)
            report.iterations += 1
    return report


# -- the catalogue ----------------------------------------------------------------------------------

SCENARIOS: dict[str, Callable[..., RaceReport]] = {
    "fork_storm": fork_storm,
    "eviction_vs_allocation": eviction_vs_allocation,
    "match_close_vs_clear": match_close_vs_clear,
    "close_races": close_races,
    "snapshot_vs_decode": snapshot_vs_decode,
    "observe_during_writes": observe_during_writes,
}

# Iterations per scenario: CI keeps the suite's share to seconds; stress multiplies them.
CI_ITERATIONS = {
    "fork_storm": 6,
    "eviction_vs_allocation": 6,
    "match_close_vs_clear": 6,
    "close_races": 12,
    "snapshot_vs_decode": 3,
    "observe_during_writes": 4,
}


def stress(minutes: float, seed: int = 0, stores: list[str] | None = None, scenarios: list[str] | None = None,
           scale: int = 10, out=print) -> dict[str, dict[str, int]]:
    """Run every scenario on every store, ``scale`` times the CI iterations, round after round with
    seeds ``seed, seed + 1, ...``, until ``minutes`` have passed. Stops at the first ``RaceFailure``
    (which propagates, naming store, seed and iteration). Returns totals per scenario."""
    stores = stores or available_stores()
    names = scenarios or list(SCENARIOS)
    totals: dict[str, dict[str, int]] = {}
    deadline = time.monotonic() + minutes * 60
    round_seed = seed
    while True:
        for name in names:
            for store in stores:
                report = SCENARIOS[name](store=store, seed=round_seed, iterations=CI_ITERATIONS[name] * scale)
                total = totals.setdefault(f"{name}[{store}]", {"rounds": 0, "iterations": 0})
                total["rounds"] += 1
                total["iterations"] += report.iterations
                for key, value in report.counts.items():
                    total[key] = total.get(key, 0) + value
                out(str(report))
        round_seed += 1
        if time.monotonic() >= deadline:
            return totals
