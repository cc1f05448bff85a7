"""The semantics README.md pins for backend authors, one row each, and the check of each row.

``ROWS`` is the single source of the table in README's "Write a backend" section
(``tests/test_semantics_rows.py`` keeps the two identical). A row with a ``check``
is exercised by the directed check ``pinned semantics``, whose failure quotes the
row; a row without one is a freedom the suite grants, and the suite's own tests
prove that a backend using it is not rejected (``tests/test_semantics_rows.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, takewhile
from typing import Callable

import numpy as np

from kvstate.spec.arithmetic import pages_needed
from kvstate.spec.protocol import Config, Factory
from kvstate.spec.semantics import evicts_for_room

from .. import ops as O
from ..configs import PROFILES
from .common import NotApplicable, both, current, filled, keeping, record, retain_new, start
from ..lockstep import Lockstep


@dataclass(frozen=True)
class Row:
    topic: str
    text: str
    check: Callable[[Factory, Config, str], None] | None = None


def _two_entries(factory: Factory, config: Config) -> Lockstep:
    """c1 retained as key A, then its fork c2, one position longer, as key B (the newer)."""
    run, _ = filled(factory, config, pages=1.5)
    run.apply(O.Retain("c1"))
    run.apply(O.Fork("c1"))
    run.apply(O.Extend("c2", (1,), seed=2))
    run.apply(O.Retain("c2"))
    run.check()
    return run


def _miss(factory: Factory, config: Config, promise: str) -> None:
    # Two entries, so a stamp on a miss would show as a change of order (one entry cannot show it).
    run = _two_entries(factory, config) if config.max_entries >= 2 else filled(factory, config)[0]
    with keeping(promise, run):
        handle = run.apply(O.Match((7, 7)))          # shares not even a first token with any key
        if len(run.live[handle][0]) != 0:
            raise AssertionError(f"the miss returned a context of {len(run.live[handle][0])} positions")
        run.check()                                   # entry order unchanged: nothing was stamped
        run.finish()


def _replace(factory: Factory, config: Config, promise: str) -> None:
    if config.values == "prefix":      # both copies hold the same values: what a failure here breaks is the rest
        promise = ("Retaining a key that is already retained replaces that entry and it becomes the most "
                   "recently used; under `values=\"prefix\"` either copy's values may be kept.")
    run, _ = filled(factory, config)
    with keeping(promise, run):
        run.apply(O.Retain("c1"))
        run.apply(O.Overwrite("c1", 0, (0,), seed=99))       # same tokens, new values
        run.apply(O.Retain("c1"))
        run.check()
        run.apply(O.Match(tuple(run.live["c1"][1].tokens)))  # must read the newer values
        run.check()
        run.finish()


def _exact(factory: Factory, config: Config, promise: str) -> None:
    run, n = filled(factory, config)
    with keeping(promise, run):
        run.apply(O.Retain("c1"))
        handle = run.apply(O.Match(tuple(run.live["c1"][1].tokens)))
        run.check()
        if config.match == "entry" and len(run.live[handle][0]) != n:
            raise AssertionError(f"an exact-key match held {len(run.live[handle][0])} of {n} positions")
        run.finish()


def _clear(factory: Factory, config: Config, promise: str) -> None:
    run, _ = filled(factory, config)
    with keeping(promise, run):
        run.apply(O.Retain("c1"))
        run.apply(O.Clear())
        run.check()
        handle = run.apply(O.Match(tuple(run.live["c1"][1].tokens)))
        if len(run.live[handle][0]) != 0:
            raise AssertionError("a match after clear() still hit")
        run.finish()


def _full_pool(factory: Factory, config: Config, promise: str) -> None:
    """Grow a retained context past the pool: each step either fits, falls back, evicts or is
    refused, as declared; the reference (which counts pages) decides which. Then the case where
    evicting every entry would free some pages but not enough."""
    run, _ = filled(factory, config, pages=1)
    limit = config.pool_limit or 4
    with keeping(promise, run):
        run.apply(O.Retain("c1"))
        for step in range(limit + 2):
            run.apply(O.Extend("c1", tuple([step % 3] * config.page_tokens), seed=10 + step))
            run.check()
        run.finish()
    if config.pool_limit:
        _short_even_after_evicting(factory, config, promise)
        _held_entry_kept_when_full(factory, config, promise)
        _full_while_a_hit_holds_a_cached_page(factory, config, promise)
        _overwrite_copies_in_a_full_pool(factory, config, promise)
        _refused_overwrite_writes_nothing(factory, config, promise)
    if config.on_full == "reclaim":
        _recycled_without_pressure(factory, config, promise)


def _after_an_entry_of_one_page(run, page: int, limit: int, seed: int) -> str:
    """An entry of key ``(1,) * page`` keeping one page no context holds, then a context holding every
    other page of the pool (its handle returned); ``seed`` and ``seed + 1`` write their values."""
    kept = run.apply(O.Allocate())
    run.apply(O.Extend(kept, tuple([1] * page), seed=seed))
    run.apply(O.Retain(kept))
    run.apply(O.Close(kept))
    filler = run.apply(O.Allocate())
    run.apply(O.Extend(filler, tuple([2] * (page * (limit - 1))), seed=seed + 1))
    return filler


def _short_even_after_evicting(factory: Factory, config: Config, promise: str) -> None:
    """An entry keeps one page no context holds; a context holds the rest of the pool and asks for
    two more. Evicting the entry would free one: not enough, so `refuse` and `evict-then-refuse`
    refuse with the entry still there (evicting first, then refusing, changed the cache), and
    `evict` evicts it and falls back."""
    page, limit = config.page_tokens, config.pool_limit
    run = start(factory, config)
    with keeping(promise, run):
        filler = _after_an_entry_of_one_page(run, page, limit, seed=41)     # the pool, to the last page
        run.apply(O.Extend(filler, tuple([2] * (2 * page)), seed=43))
        run.apply(O.Match(tuple([1] * page)))      # the entry, if the pool's rule kept it
        run.finish()


def _held_entry_kept_when_full(factory: Factory, config: Config, promise: str) -> None:
    """Entry A, whose context stays open, then entry B, a page each; a context takes the rest of the
    pool and asks for one page more. Whatever the pool declares, A's page is no entry's to give up:
    an engine may take B's (the newer), never A's, though A is the least recently used. SGLang's tree
    with its lock test left out of choosing leaves (an audit's plant in its own code, s73) evicted the
    older, locked leaf and wrote the new page over A's values; only a rare lockstep run caught it."""
    page, limit = config.page_tokens, config.pool_limit
    if limit < 3:
        return
    run = start(factory, config)
    with keeping(promise, run):
        held = run.apply(O.Allocate())
        run.apply(O.Extend(held, tuple([4] * page), seed=50))
        run.apply(O.Retain(held))
        newer = run.apply(O.Allocate())
        run.apply(O.Extend(newer, tuple([5] * page), seed=51))
        run.apply(O.Retain(newer))
        run.apply(O.Close(newer))
        filler = run.apply(O.Allocate())
        run.apply(O.Extend(filler, tuple([6] * (page * (limit - 2))), seed=52))
        run.apply(O.Extend(filler, tuple([6] * page), seed=53))     # one page past the pool
        run.check()
        run.apply(O.Close(held))
        run.finish()


def _full_while_a_hit_holds_a_cached_page(factory: Factory, config: Config, promise: str) -> None:
    """An entry keeps one page no context holds (cached), a hit then holds it, and a context takes every
    other page of the pool and asks for one more. Nothing is free or reclaimable, so the pool does what
    it declares when full, and the held page is never handed out: an audit's engine (s66) whose hit
    left a cached block in its free queue passed ``ci`` in one configuration. No check between the
    operations, as in ``_recycled_without_pressure``."""
    page, limit = config.page_tokens, config.pool_limit
    run = start(factory, config)
    with keeping(promise, run):
        kept = run.apply(O.Allocate())
        run.apply(O.Extend(kept, tuple([1] * page), seed=47))
        run.apply(O.Retain(kept))
        run.apply(O.Close(kept))
        run.apply(O.Match(tuple([1] * page)))      # held: its page is no longer the pool's to reuse
        filler = run.apply(O.Allocate())
        run.apply(O.Extend(filler, tuple([2] * (page * (limit - 1))), seed=48))
        run.apply(O.Extend(filler, tuple([2] * page), seed=49))
        run.finish()


def _overwrite_copies_in_a_full_pool(factory: Factory, config: Config, promise: str) -> None:
    """A context of two pages and a fork sharing both, the rest of the pool taken: an overwrite of the fork
    that ends inside its second page, then one from the first page's last position into the second, each
    needs a copy of every shared page it touches (README: "how an operation's need is counted"), so each
    does what the pool declares when full; the reference decides which. An audit's engine (s70) counted
    the pages an overwrite touches with an exclusive end, leaving out a shared page it ends inside: only
    ``seeded`` caught it. No check between the operations."""
    page, limit = config.page_tokens, config.pool_limit
    if page < 2 or limit < 2:
        return      # no overwrite ends inside a page, or no room for the two shared pages
    run = start(factory, config)
    with keeping(promise, run):
        shared = run.apply(O.Allocate())
        run.apply(O.Extend(shared, tuple(60 + i % 3 for i in range(2 * page)), seed=55))
        fork = run.apply(O.Fork(shared))
        filler = run.apply(O.Allocate())
        run.apply(O.Extend(filler, tuple([2] * (page * (limit - 2))), seed=56))
        run.apply(O.Overwrite(fork, page, (7,), seed=57))             # ends inside the shared second page
        run.apply(O.Overwrite(fork, page - 1, (8, 9), seed=58))       # touches both shared pages
        run.finish()


def _refused_overwrite_writes_nothing(factory: Factory, config: Config, promise: str) -> None:
    """A fork whose first page is its own and whose second it still shares, the rest of the pool taken:
    an overwrite across the two needs a copy of the second, so a pool that cannot make room refuses it,
    and the position it would have written in the first page reads as before. An audit's engine (s73)
    taking pages one at a time, rolling back on refusal the pages and tokens but not the values it had
    written into a page of its own, passed ``ci``; a sweep and ``nightly`` caught it."""
    page, limit = config.page_tokens, config.pool_limit
    if limit < 4:
        return      # no room for three pages and a filler
    run = start(factory, config)
    with keeping(promise, run):
        shared = run.apply(O.Allocate())
        run.apply(O.Extend(shared, tuple(60 + i % 3 for i in range(2 * page)), seed=59))
        fork = run.apply(O.Fork(shared))
        run.apply(O.Overwrite(fork, 0, (5,), seed=60))               # the fork's first page is now its own
        filler = run.apply(O.Allocate())
        run.apply(O.Extend(filler, tuple([2] * (page * (limit - 3))), seed=61))
        run.apply(O.Overwrite(fork, page - 1, (8, 9), seed=62))       # its own page, then the shared one
        run.check()
        run.finish()


def _recycled_without_pressure(factory: Factory, config: Config, promise: str) -> None:
    """An entry keeps one page; a context takes every other page of the pool and lets them go; another
    takes one page. The pool was never short (one page listed plus one needed), so under `reclaim` the
    entry still hits whole. No check between the operations: the per-step probe of a backend without the
    tree tier matches and closes every entry, which sends its pages to the back of a free queue and hides
    an engine recycling freed pages in release order (`reclaim-fifo`'s) declared as `reclaim`."""
    page, limit = config.page_tokens, config.pool_limit
    run = start(factory, config)
    with keeping(promise, run):
        filler = _after_an_entry_of_one_page(run, page, limit, seed=44)     # the rest of the pool
        run.apply(O.Close(filler))
        late = run.apply(O.Allocate())
        run.apply(O.Extend(late, tuple([3] * page), seed=46))
        run.apply(O.Match(tuple([1] * page)))      # the whole entry: nothing was reclaimable yet
        run.finish()


def _several_bad(factory: Factory, config: Config, promise: str) -> None:
    """Calls with two or three things wrong at once: the reference names every error that applies
    (``spec.errors.refuse_with_all``) and ``both`` accepts any of them, nothing else."""
    run, n = filled(factory, config)
    layout = config.layout
    good = O.values_for(layout, 1, 5)
    nan = good.copy()
    nan[0, 0, 0, 0, 0] = np.nan
    two_nan = np.concatenate([nan, nan])
    ctx, ref = run.live["c1"]
    open_cases = [
        ("extend([-1], NaN values)", lambda c: c.extend([-1], nan)),
        ("extend([1], 2 rows of NaN values)", lambda c: c.extend([1], two_nan)),
        ("extend([1], float64 NaN values)", lambda c: c.extend([1], nan.astype(np.float64))),
        (f"overwrite({n + 5}, [1], NaN values)", lambda c: c.overwrite(n + 5, [1], nan)),
        ("overwrite(0, [-1], NaN values)", lambda c: c.overwrite(0, [-1], nan)),
        (f"overwrite({n + 5}, [-1], 2 rows of NaN values)", lambda c: c.overwrite(n + 5, [-1], two_nan)),
    ]
    closed_cases = [
        ("extend([1], 2 rows of NaN values) after close", lambda c: c.extend([1], two_nan)),
        ("extend([1], NaN values) after close", lambda c: c.extend([1], nan)),
        (f"overwrite({n + 5}, [1], values) after close", lambda c: c.overwrite(n + 5, [1], good)),
        (f"read(0, {n + 1}) after close", lambda c: c.read(0, n + 1)),
        (f"truncate({n + 1}) after close", lambda c: c.truncate(n + 1)),
    ]
    empty, empty_ref = run.live[run.apply(O.Allocate())]
    run.apply(O.Close(f"c{run.created}"))
    closed_cases.append(("retain(a closed, empty context)",
                         lambda c: (run.engine if c is ctx else run.reference).retain(empty if c is ctx else empty_ref)))
    for cases in (open_cases, closed_cases):
        if cases is closed_cases:
            run.apply(O.Close("c1"))
        for call, do in cases:
            _, _, error = both(run, promise, f"c1.{call}", lambda: do(ctx), lambda: do(ref))
            if error is None:       # both accepted: the case is wrong, not the backend
                raise AssertionError(f"suite error: c1.{call} was accepted by the reference")
    run.finish()


def _closed(factory: Factory, config: Config, promise: str) -> None:
    """Every operation on a closed context, a second close included, is refused as closed."""
    run, n = filled(factory, config)
    ctx, ref = run.live["c1"]
    run.apply(O.Close("c1"))
    values = O.values_for(config.layout, 1, 5)
    cases = [("close()", lambda c: c.close()), ("fork()", lambda c: c.fork()), ("tokens", lambda c: c.tokens),
             ("read()", lambda c: c.read()), ("truncate(0)", lambda c: c.truncate(0)),
             ("extend([1], values)", lambda c: c.extend([1], values)),
             ("overwrite(0, [1], values)", lambda c: c.overwrite(0, [1], values))]
    for call, do in cases:
        _, _, error = both(run, promise, f"c1.{call} after close", lambda: do(ctx), lambda: do(ref))
        if error is None:
            raise AssertionError(f"suite error: c1.{call} after close was accepted by the reference")
    _, _, error = both(run, promise, "retain(c1) after close", lambda: run.engine.retain(ctx),
                       lambda: run.reference.retain(ref))
    run.finish()


def _zero_length(factory: Factory, config: Config, promise: str) -> None:
    """Zero-length writes, at the start, inside and at the length, change nothing."""
    run, n = filled(factory, config)
    with keeping(promise, run):
        for start in (0, n // 2, n):
            run.apply(O.Overwrite("c1", start, (), seed=3))
            run.check()
        run.apply(O.Extend("c1", (), seed=4))
        run.check()
        before = run.engine.observe()
        run.apply(O.Overwrite("c1", n, (), seed=5))
        if run.engine.observe().pages_allocated != before.pages_allocated:
            raise AssertionError("a zero-length overwrite at the length allocated pages")
        run.finish()


def _hit_allocates_nothing(factory: Factory, config: Config, promise: str) -> None:
    """A hit shares its entry's pages (cached ones included): it allocates none."""
    run, n = filled(factory, config)
    with keeping(promise, run):
        run.apply(O.Retain("c1"))
        run.apply(O.Close("c1"))
        before = run.engine.observe()
        hit = run.apply(O.Match(tuple(i % 3 for i in range(n)) + (1,)))
        after = run.engine.observe()
        if before.pages is not None and after.pages_allocated != before.pages_allocated:
            raise AssertionError(f"a hit of {len(run.live[hit][1])} positions allocated "
                                 f"{after.pages_allocated - before.pages_allocated} pages")
        run.check()
        run.apply(O.Close(hit))
        run.apply(O.Clear())
        run.finish()


def _rescan(factory: Factory, config: Config, promise: str) -> None:
    """Entry X keeps pages p1, p2; entry Y (a prefix of X, retained from a fork) keeps p1 with X. Short
    of both pages, the pool evicts Y (the older, though it frees nothing alone) and X."""
    if not evicts_for_room(config.on_full) or config.max_entries < 2:
        return
    page, limit = config.page_tokens, config.pool_limit
    run = start(factory, config)
    with keeping(promise, run):
        x = run.apply(O.Allocate())
        run.apply(O.Extend(x, tuple(i % 3 for i in range(2 * page)), seed=31))
        y = run.apply(O.Fork(x))
        run.apply(O.Truncate(y, page))
        run.apply(O.Retain(y))
        run.apply(O.Retain(x))
        run.apply(O.Close(y))
        run.apply(O.Close(x))
        run.check()
        filler = run.apply(O.Allocate())
        run.apply(O.Extend(filler, tuple(2 for _ in range(page * limit)), seed=32))   # the whole pool
        run.check()
        run.apply(O.Match(tuple(i % 3 for i in range(page))))                      # Y is gone too
        run.check()
        run.finish()


def _evicts_the_oldest_that_frees(factory: Factory, config: Config, promise: str) -> None:
    """Entries A, B, C retained in that order, a page or more each, no key sharing a token with another;
    A's context stays open. An extend short of one entry's pages evicts B: A is older, but a context holds
    its pages, and C is newer. Then B misses, A and C hit."""
    if not evicts_for_room(config.on_full) or config.max_entries < 3:
        return
    page, block = config.page_tokens, config.block_tokens or 1
    length = -(-max(page, block) // page) * page      # whole pages holding a whole block: a key that can hit
    pages = length // page
    if config.pool_limit < 3 * pages + 1:
        return
    run = start(factory, config)
    keys = [tuple(60 + 10 * k + i % 3 for i in range(length)) for k in range(3)]
    with keeping(promise, run):
        held = None
        for k, key in enumerate(keys):
            handle = run.apply(O.Allocate())
            run.apply(O.Extend(handle, key, seed=41 + k))
            run.apply(O.Retain(handle))
            if k == 0:
                held = handle                       # A's pages stay held by its context
            else:
                run.apply(O.Close(handle))
        run.check()
        filler = run.apply(O.Allocate())
        need = config.pool_limit - 2 * pages         # the pool holds 3 entries' pages: one entry's short
        run.apply(O.Extend(filler, tuple(90 + i % 3 for i in range(need * page)), seed=44))
        run.check()
        for key in keys:
            run.apply(O.Close(run.apply(O.Match(key))))
        run.check()
        run.apply(O.Close(held))
        run.finish()


MAX_ENTRIES_FILLED = 1024
"""``hits stamp their entry`` fills the tree to its bound: past this many entries, a bound that no
workload reaches (the real engines' adapters declare 2**30), the row is skipped."""


def _hits_stamp_their_entry(factory: Factory, config: Config, promise: str) -> None:
    """Entries past the tree's bounds go in the order hits left them, for a hit shorter than its entry's
    key and for a tie among entries sharing the hit (only the winner is stamped). No check runs
    between a hit and the retain that evicts after it: without the tree tier a check probes every
    entry through ``match``, which stamps each back into the reference's order and would hide a
    wrong stamp (``Lockstep._probe_entries``); the matches after the eviction show it. The tree is
    filled to ``max_entries``, or to fewer where the page budget holds fewer (both evict the least
    recently used entry): an audit's engine with a budget of 6 pages skipped the row at 4 entries.
    It runs under ``reclaim`` too: what goes there is the engine's choice only once the pool may have
    been short, and ``_stamp_then_evict`` keeps the pool out of it (skipped under ``reclaim``, an
    audit's engine whose short hits stamped nothing passed every check and 300 sweep seeds)."""
    if config.max_entries < 2:
        return          # one entry has no order
    unit = config.block_tokens or 1

    def key(*firsts: int) -> tuple[int, ...]:      # whole blocks: each can be a hit of its own
        return tuple(first for first in firsts for _ in range(unit))

    def others(count: int) -> list[tuple[int, ...]]:     # one block each, sharing no token with any other key
        return [key(40 + k) for k in range(count)]

    # A partial hit (under "entry", a hit of the whole key: no shorter one exists) stamps its entry.
    held = _entries_held(config, [key(1, 2)], key(40))
    if held >= 2:
        _stamp_then_evict(factory, config, promise, [key(1, 2)] + others(held)[:held - 1],
                          key(1, 2, 9) if config.match == "entry" else key(1, 9), others(held)[held - 1])
    held = _entries_held(config, [key(1, 2), key(40), key(1, 3)], key(40))
    if config.match != "entry" and held >= 3:      # a tie: the newer of two keys sharing the hit's block wins
        _stamp_then_evict(factory, config, promise, [key(1, 2), key(40), key(1, 3)] + others(held)[1:held - 2],
                          key(1, 9), others(held)[held - 2])
    # The entry under a split node no entry holds (two keys sharing a block), and an entry whose node has a
    # child: each hit stamps that entry, not the node above it nor the child below (an audit's trees did
    # both, and passed this row, which had no two keys sharing a block but the tie's).
    for first, query in (([key(1, 2), key(1, 3)], key(1, 2, 9)), ([key(1, 2), key(1)], key(1, 9))):
        held = _entries_held(config, first, key(40))
        if held >= 2:
            _stamp_then_evict(factory, config, promise, first + others(held)[:held - 2], query, others(held)[held - 2])


LONG_HISTORY = 2**16
"""``long histories`` stamps its newest entry until the clock has moved this far past the oldest's stamp,
less one: a tick kept in 16 bits or fewer has then wrapped, and holds the oldest entry's above the newest's.
About 0.3-0.7 s a configuration (kvstate's engine, the suite's Python backends): 26 s of CPU across the
default tests, so under conform's profiles of fewer than ``LONG_HISTORY_STEPS`` steps (ci, hunt) the row
stamps ``SHORT_HISTORY`` (a tick of 12 bits or fewer), and under ``nightly`` the whole of it."""
SHORT_HISTORY = 2**12
LONG_HISTORY_STEPS = PROFILES["nightly"].stateful_step_count


def _history_length() -> int:
    """The row's stamps: ``LONG_HISTORY`` outside conform (a direct call) and under ``nightly``."""
    settings = getattr(current, "settings", None)
    if settings is None or settings.stateful_step_count >= LONG_HISTORY_STEPS:
        return LONG_HISTORY
    return SHORT_HISTORY


def _order_after_many_stamps(factory: Factory, config: Config, promise: str) -> None:
    """The tree is filled (as ``hits stamp their entry`` fills it), its first entry the oldest and its last
    the newest; the newest is then hit until ``_history_length() - 1`` stamps separate it from the oldest
    (the fill's retains counted), a newcomer is retained and every key matched. A clock that wraps at 2**8
    or 2**16 then holds the oldest entry's tick above the newest's, so the newest is evicted (an outside audit,
    s70: a tick kept modulo 256 passed every check, the runs never making 256 stamps), unless that tick is 0
    modulo the wrap: an entry retained before the fill, and evicted by it, keeps the clock's first stamp
    (0, where a clock stamps before it counts) off the oldest kept entry. The hits go to the engine alone:
    they leave the order the reference holds as it was, and the lockstep's per-step comparisons would make
    the row 25 times slower."""
    if config.max_entries < 2:
        return
    unit = config.block_tokens or 1

    def key(first: int) -> tuple[int, ...]:
        return (first,) * unit

    held = _entries_held(config, [key(1)], key(40))
    if held < 2:
        return
    keys = [key(1)] + [key(40 + k) for k in range(held - 1)]
    newcomer = key(39)
    if _pool_chooses(config, keys + [newcomer]):
        return
    run = start(factory, config)
    with keeping(promise, run):
        # First an entry the fill evicts: the oldest kept entry's stamp is then past the clock's first, which
        # a clock stamping before it counts leaves at 0, a tick no wrapped one falls below (the review, s70).
        retain_new(run, key(38), seed=78)
        for k, tokens in enumerate(keys):
            retain_new(run, tokens, seed=80 + k)
    hits = _history_length() - len(keys)      # with the retains after the oldest's: one stamp short of it
    newest = keys[-1]
    record(run, f"{hits} x (match(tokens={newest}), then close of its hit)    # the engine's alone, unobserved: the "
                f"newest entry stays newest, the reference's order as it was")
    with keeping(promise, run):
        for _ in range(hits):
            hit, _matched = run.engine.match(list(newest))
            hit.close()
        retain_new(run, newcomer, seed=79)
        for tokens in keys + [newcomer]:
            run.apply(O.Close(run.apply(O.Match(tokens))))
        run.check()
        run.finish()


def _entries_held(config: Config, first: list, then: tuple) -> int:
    """How many entries the tree holds before one more evicts, its first keys ``first`` and the rest
    like ``then``: ``max_entries``, or fewer where the page budget holds fewer; 0 where that is more
    than ``MAX_ENTRIES_FILLED``."""
    sizes = [pages_needed(len(tokens), config.page_tokens) for tokens in first]
    bound = min(config.max_entries, config.max_pages or MAX_ENTRIES_FILLED + 1, MAX_ENTRIES_FILLED + 1)
    sizes += [pages_needed(len(then), config.page_tokens)] * max(0, bound - len(sizes))
    held = sum(1 for _ in takewhile(lambda pages: not config.max_pages or pages <= config.max_pages,
                                      accumulate(sizes[:bound])))
    return held if held <= MAX_ENTRIES_FILLED else 0


def _pool_chooses(config: Config, keys: list) -> bool:
    """Whether entries of ``keys`` overflow the pool (``pool_limit``): there the pool, not the tree's bounds,
    chooses what an eviction takes, and a row checking the tree's order is skipped."""
    return bool(config.pool_limit) and sum(pages_needed(len(tokens), config.page_tokens)
                                           for tokens in keys) > config.pool_limit


def _stamp_then_evict(factory: Factory, config: Config, promise: str, keys: list, query: tuple,
                      newcomer: tuple) -> None:
    """``keys`` retained oldest first (as many as the tree holds), ``query`` matched and its hit closed,
    ``newcomer`` retained (one entry too many: the least recently used goes), then every key matched.
    Skipped where the pool, not the tree's bounds, would choose what goes."""
    if _pool_chooses(config, keys + [newcomer]):
        return
    run = start(factory, config)
    with keeping(promise, run):
        for k, tokens in enumerate(keys):
            retain_new(run, tokens, seed=70 + k)
        run.apply(O.Close(run.apply(O.Match(query))))
        retain_new(run, newcomer, seed=69)
        for tokens in keys:
            run.apply(O.Close(run.apply(O.Match(tokens))))
        run.check()
        run.finish()


def _evicts_for_the_copy_of_a_shared_page(factory: Factory, config: Config, promise: str) -> None:
    """The need of an extend counts the copy of its context's last page when that page is partly filled
    and shared (README: "how an operation's need is counted"). Entry E keeps whole pages no context
    holds; context C, shorter than a page, is retained as entry F (C and F share C's one page) and stays
    open; a third context fills the pool to its last page. Extending C by one position adds no page but copies the
    shared one: the pool is short of that page and evicts E (F's page is held by C). An extend whose need
    leaves the copy out evicts nothing, and E still hits (an audit's engine: ci passed it under `evict`)."""
    page, block, limit = config.page_tokens, config.block_tokens or 1, config.pool_limit
    length = -(-max(page, block) // page) * page      # whole pages holding a whole block: a key that can hit
    pages = length // page
    if not evicts_for_room(config.on_full) or page < 2 or config.max_entries < 2:
        return      # no eviction for room, no partly filled page, or no room for two entries
    if limit < pages + 1 or 0 < config.max_pages < pages + 1:
        return      # the pool or the page budget cannot hold E and F at once
    kept = tuple(60 + i % 3 for i in range(length))
    run = start(factory, config)
    with keeping(promise, run):
        retain_new(run, kept, seed=51)                  # E: its pages no context holds
        shared = run.apply(O.Allocate())
        run.apply(O.Extend(shared, tuple(70 + i % 3 for i in range(page - 1)), seed=52))
        run.apply(O.Retain(shared))                     # F shares C's partly filled page
        filler = run.apply(O.Allocate())
        run.apply(O.Extend(filler, tuple(90 + i % 3 for i in range(page * (limit - pages - 1))), seed=53))
        run.apply(O.Extend(shared, (1,), seed=54))      # no new page, one copy: the pool is one short
    extend = run.history[-1]
    with keeping(promise, run, f"{extend} (needing one page, the copy of a partly filled page an entry "
                               f"shares, in a full pool), then match of the oldest entry's key"):
        run.apply(O.Match(kept))                        # E was evicted for the copy: a miss
        run.check()
    with keeping(promise, run):
        run.finish()


def _room_by_eviction(factory: Factory, config: Config, promise: str) -> None:
    _rescan(factory, config, promise)
    _evicts_the_oldest_that_frees(factory, config, promise)
    _newest_left_after_room_is_made(factory, config, promise)
    _evicts_for_the_copy_of_a_shared_page(factory, config, promise)


def _newest_left_after_room_is_made(factory: Factory, config: Config, promise: str) -> None:
    """Entries A, B, C whose keys differ only in their last token, under ``token`` matching, A's and B's
    contexts open: an extend short of one entry's pages evicts C, the newest, and a query sharing all
    but the last token then takes its hit from B, the newest entry left, not from A. Eviction by the
    tree's bounds takes the oldest entry, never newer than another; only a pool passing over held
    entries evicts one that is, and an engine re-electing the newest entry below a node wrongly after
    that (an audit's mutant, s73: ``<`` for ``>`` in ``RadixTree._forget_newest``) gave A's values and
    passed every check."""
    if config.match != "token" or not evicts_for_room(config.on_full) or config.max_entries < 3:
        return
    page = config.page_tokens
    length = max(page, 2)
    pages = -(-length // page)
    if config.pool_limit < 3 * pages + 1:
        return
    shared = tuple(70 + i % 3 for i in range(length - 1))
    run = start(factory, config)
    with keeping(promise, run):
        held = []
        for k in range(3):
            handle = run.apply(O.Allocate())
            run.apply(O.Extend(handle, shared + (80 + k,), seed=46 + k))
            run.apply(O.Retain(handle))
            if k < 2:
                held.append(handle)                 # A's and B's pages stay held: the pool passes them over
            else:
                run.apply(O.Close(handle))
        filler = run.apply(O.Allocate())
        run.apply(O.Extend(filler, tuple(90 + i % 3 for i in range((config.pool_limit - 3 * pages + 1) * page)),
                           seed=49))
        run.check()
        run.apply(O.Close(run.apply(O.Match(shared + (99,)))))
        run.check()
        for handle in held:
            run.apply(O.Close(handle))
        run.finish()


def _prefix_values(factory: Factory, config: Config, promise: str) -> None:
    """One key written by two contexts, retained by both, matched: under ``values="prefix"`` both
    wrote the same values (an engine may keep either); under ``seeded`` the newer wins. A hit of the
    first entry is held across the second retain and a new context's pages: an engine that frees the
    pages it kept (SGLang frees the new copy's) while that hit still reads them is caught there."""
    run = start(factory, config)
    key = tuple(40 + i for i in range(2 * config.page_tokens + 1))
    with keeping(promise, run):
        hit = None
        for seed in (71, 72):
            handle = run.apply(O.Allocate())
            run.apply(O.Extend(handle, key, seed=seed))
            run.apply(O.Retain(handle))
            run.apply(O.Close(handle))
            if hit is None:
                hit = run.apply(O.Match(key))       # the first entry's, held across the second retain
        filler = run.apply(O.Allocate())
        run.apply(O.Extend(filler, tuple(60 + i % 3 for i in range(2 * config.page_tokens)), seed=73))
        run.check()
        for handle in (hit, filler):
            run.apply(O.Close(handle))
        run.apply(O.Match(key + (3,)))
        run.check()
        run.finish()


ROWS: list[Row] = [
    Row("a miss", "`match` of tokens no entry shares returns a new, empty context and 0, and stamps no entry.", _miss),
    Row("retain again", "Retaining a key that is already retained replaces that entry: the newer values win, "
                        "and it becomes the most recently used.", _replace),
    Row("prefix values", "Under `values=\"prefix\"` (an engine that keys K/V by the token prefix: SGLang's "
        "radix cache keeps its old slots when a key it holds is inserted again) every write the suite makes "
        "gives position i holding token t the values fixed by (i, t), so a backend may keep either copy of "
        "one prefix; every other rule holds as written.", _prefix_values),
    Row("exact key", "A key is a prefix of itself: matching a retained key exactly returns the whole entry.", _exact),
    Row("clear()", "`clear()` drops every entry; a later `match` of a dropped key misses.", _clear),
    Row("eviction order", "Only the order of entries (least recently used first) is compared, never tick numbers: "
                          "a clock may start anywhere, reset on `clear()`, or advance on a miss."),
    Row("full pool", "A pool that runs out does what the configuration declares (`on_full`): `fallback` to "
                     "ordinary memory, `evict` least recently used entries that keep a page no context holds, "
                     "`refuse` with `CapacityError`, changing nothing, `evict-then-refuse`: refuse as `refuse` when even "
                     "evicting every entry would not make room, else evict as `evict`, or `reclaim`: refuse as "
                     "`evict-then-refuse`, else reclaim entries' pages in any amount and order the engine "
                     "chooses.", _full_pool),
    Row("several bad inputs", "When several things are wrong, any error that truly applies is right, whatever "
                              "order a backend validates in: the token ids, the K/V array's dtype and shape (rows "
                              "against the token count included: `ShapeError`), the context (closed, busy), "
                              "positions, the K/V values (non-finite, out of precision range), the pool. An error "
                              "that does not apply, or none, is wrong.", _several_bad),
    Row("closed contexts", "Every operation on a closed context raises `ContextClosedError`, a second `close()` "
                           "and `retain` included. `len()` of a closed context is free: any number, or the error. "
                           "A closed context holds nothing, so a position in it (an `overwrite`, `read` or "
                           "`truncate` past 0) may also get `PositionError`, and its `retain` "
                           "`EmptyContextError`, as from a backend that checks positions or length first.",
        _closed),
    Row("zero-length writes", "An `extend` or `overwrite` of zero positions is accepted anywhere in `[0, len]`, "
                              "at the length included, and changes nothing.", _zero_length),
    Row("cached pages", "Pages a prefix cache keeps with no holder (`cached`, refcount 0, as vLLM's free queue) "
                        "are live pages: they count in pages allocated - freed until dropped, and against a "
                        "`refuse` pool; `evict`, `evict-then-refuse` and `reclaim` reclaim them first (they are entries' "
                        "pages); `clear()` drops them. A hit shares the pages of the entry it is taken from, "
                        "cached ones included, and allocates none (checked with the pages tier, which a backend "
                        "whose hits copy does not expose, as one whose forks copy does not).",
        _hit_allocates_nothing),
    Row("eviction for room", "A pool short of pages evicts least recently used entries that keep a page no "
                             "context holds, oldest first, until the need fits: an entry whose pages another "
                             "entry keeps too is evicted as well, though it frees nothing alone. Not under `reclaim`, "
                             "whose engine picks what goes.", _room_by_eviction),
    Row("hits stamp their entry", "A hit stamps the entry it is taken from and no other: a hit shorter than "
                                  "that entry's key too, and of entries tied for a hit only the winner, so "
                                  "entries past the tree's bounds go in the order hits left.", _hits_stamp_their_entry),
    Row("long histories", "The order holds however long the history: a `retain` past the bounds evicts the least "
                          "recently used entry after 4,096 stamps (a tick kept in 12 bits or fewer has wrapped) and, "
                          "under the `nightly` profile, after 65,536 (16 bits).", _order_after_many_stamps),
    Row("block ties", "Under `block` matching, every entry reaching the hit's last whole block competes, however "
                      "many tokens past it each shares with the query: the most recently used gives the hit.",
        lambda factory, config, promise: _ties_row(factory, config, promise)),
    Row("max_bytes", "`restore(source, max_bytes=N)` bounds the backend's own estimate of what a restore "
                     "allocates (kvstate's: `impl/snapshot.restore_cost`); the suite never passes it."),
]


def _ties_row(factory: Factory, config: Config, promise: str) -> None:
    from .prefix import TIES, ties

    if config.match != "block":
        promise = TIES      # the row is block's; elsewhere its scenario holds the general tie rule
    run = start(factory, config)
    try:
        with keeping(promise, run):
            ties(run)
            run.finish()
    except NotApplicable as reason:
        raise NotApplicable(f"the row \"block ties\": {reason}") from None


def pinned_semantics(factory: Factory, config: Config) -> None:
    """Every checked row of README's table of pinned semantics."""
    for row in ROWS:
        if row.check is not None:
            row.check(factory, config, row.text)


def readme_table() -> str:
    """The table as README.md shows it."""
    lines = ["| what | the rule |", "| --- | --- |"]
    lines += [f"| {row.topic} | {row.text} |" for row in ROWS]
    return "\n".join(lines)
