"""Small-scope exhaustive checking: every operation sequence of a bounded scope.

A breadth-first search over the states that ``Lockstep`` (engine and reference
side by side) can reach from an empty cache, where every operation is drawn
from a finite alphabet fixed by a ``Scope``: at most ``max_contexts`` live
contexts, at most ``max_positions`` positions each, tokens from ``alphabet``,
writes of at most ``max_write`` positions with values from ``seeds``, match
queries built from the retained keys (``operations``). Beside the valid
operations, each context is offered an extend and an overwrite of zero
positions and an overwrite and a truncate past its length (``_edges``), so
Lockstep's "a zero-length write changes nothing" and "a refusal changes
nothing" checks run too; a ``clear`` is offered while there are entries, a
``retain`` of an empty context is refused. Every reachable state is checked
against invariants 1-5 and, on a clone, invariant 6 (close everything, clear:
empty).

States are deduplicated by a canonical form (page ids renamed in first-use
order, contexts sorted, ticks replaced by their order, values by a small
interned id), so with ``max_depth=None`` the search stops when no new state
appears: the reachable space is then explored completely. Because BFS expands
shallow states first, the first violation found comes with a shortest
operation sequence that reaches it, which ``write_replay`` saves as a
plain replay file.

The scope fixes the declared semantics too (``match``, ``block_tokens``,
``max_pages``, ``pool_pages``, ``on_full``; ``spec/semantics.py``), so the same
search runs the engine and the reference in lockstep under any of them;
``SEMANTICS`` names the small scopes ``kvstate spec-check`` runs by default.

Deduplication is exact for kvstate's own engine: the form holds what the
observation shows, the counters that are state rather than history (the tree's
running page count ``max_pages`` is checked against, the entry and context
counts; ``_gauges``) and what each holder keeps that no observation shows (its
kept key, its base; ``_holding_form``). The deliberate abstractions, each of a
part that chooses a code path or holds bytes no path reads back, not a result:
a free arena slot is remembered by which of its positions are non-zero, not by
its bytes (``_engine_memory``); a kept key's bytes past the length, which
refcount-table slot each page is on and whether a holder's slots are a
``range`` or an array are left out (``_holding_form``); and a reached state is
resumed from a pickle, which adds pending fork counts to the refcounts and
drops a store's spare heap pages (the lockstep machine and the scale check
cover those paths). What the declared
semantics add to a state is in the form as well: the recency order of the
entries (both sides), the keys the page budget counts, and the reference's
page labels (which holder shares which page: what ``on_full`` counts and
evicts by), renamed like page ids. For a foreign engine the form is built
from its ``Observation`` alone, which cannot tell which context holds which
page (and a backend that exposes fewer tiers shows less), so two states that
differ only in what it does not show are merged.

Reached states are kept as pickles of the whole ``Lockstep`` and thawed once per
operation tried; an engine that cannot be pickled is re-run along its path instead.
"""

from __future__ import annotations

import copyreg
import itertools
import pickle
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Hashable

import numpy as np

from kvstate.spec.layout import Layout
from kvstate.spec.protocol import Config, Factory

from . import ops as O
from .lockstep import Lockstep
from .replay import Replay, execute, save

SCOPE_LAYOUT = Layout(layers=1, kv_heads=1, head_dim=2)


@dataclass(frozen=True)
class Scope:
    """The bounds of one exhaustive search.

    The defaults are the CI scope: every sequence of up to 5 operations at page size 2,
    2 live contexts of up to 3 positions, tokens {0, 1}, one tiny-set value seed.
    """

    page_tokens: int = 2
    max_contexts: int = 2
    max_positions: int = 3
    alphabet: tuple[int, ...] = (0, 1)
    max_write: int = 2
    seeds: tuple[int, ...] = (-1,)    # negative: ops.values_for's tiny value set
    max_entries: int = 2
    arena_pages: int = 3
    precision: str = "f32"
    max_depth: int | None = 5        # longest sequence; None: run until no new state appears
    # The declared semantics (spec/semantics.py); the defaults are the seed's world.
    match: str = "entry"
    block_tokens: int = 0
    max_pages: int = 0
    pool_pages: int = 0
    on_full: str = "fallback"

    def config(self) -> Config:
        """The configuration searched; ``ConfigError`` for semantics that do not go together."""
        return Config(SCOPE_LAYOUT, page_tokens=self.page_tokens, precision=self.precision,
                      arena_pages=self.arena_pages, max_entries=self.max_entries, match=self.match,
                      block_tokens=self.block_tokens, max_pages=self.max_pages, pool_pages=self.pool_pages,
                      on_full=self.on_full)

    @property
    def name(self) -> str:
        return self.config().name

    def as_dict(self) -> dict:
        return asdict(self)


# The declared semantics a default ``kvstate spec-check`` searches, each a change to the CI
# scope that finishes in seconds. Page size 2, at most 3 positions: a token hit may end
# inside a page (shared, partly filled); block hits are whole pages. The pools are small
# enough to fill within 5 operations: one page (allocate, extend, retain, truncate, extend
# evicts), two (two contexts of one page each, then a copy is refused).
SEMANTICS: dict[str, dict[str, Any]] = {
    "entry": {},
    "token": {"match": "token"},
    "block": {"match": "block", "block_tokens": 2},
    # memory-pressure eviction over a one-slot arena, and a page budget that binds before
    # max_entries does (a 1-page and a 2-page entry are over 2 pages)
    "evict": {"match": "token", "on_full": "evict", "arena_pages": 1, "max_pages": 2},
    # a fixed pool without an arena that refuses when full
    "refuse": {"match": "block", "block_tokens": 2, "on_full": "refuse", "arena_pages": 0, "pool_pages": 2},
}


def semantics_scope(name: str, base: Scope = Scope()) -> Scope:
    """``base`` under the declared semantics ``SEMANTICS[name]``; ``KeyError`` naming the known ones."""
    if name not in SEMANTICS:
        raise KeyError(f"no semantics {name!r}; known: {sorted(SEMANTICS)}")
    return replace(base, **SEMANTICS[name])


@dataclass
class Violation:
    ops: list[O.Op]           # a shortest sequence from an empty cache that reaches it
    error: str

    def __str__(self) -> str:
        steps = "\n".join(f"  {i + 1}. {op}" for i, op in enumerate(self.ops))
        return f"{self.error}\nafter {len(self.ops)} operations:\n{steps}"


@dataclass
class Result:
    scope: Scope
    states: int = 0           # distinct canonical states reached (the empty cache included)
    transitions: int = 0      # operations applied to a reached state
    depth: int = 0            # the deepest BFS level expanded
    complete: bool = False    # True: no new state remained (not cut by depth or time)
    seconds: float = 0.0
    violation: Violation | None = None
    per_depth: list[int] = field(default_factory=list)   # new states found at each depth

    @property
    def passed(self) -> bool:
        return self.violation is None

    def summary(self) -> str:
        how = ("stopped at the violation below" if self.violation is not None
               else "complete" if self.complete else "cut at depth/time bound")
        text = (f"{self.states} states, {self.transitions} transitions, depth {self.depth} "
                f"({how}), {self.seconds:.1f} s")
        if self.violation is not None:
            text += f"\nVIOLATION: {self.violation}"
        return text


# -- the operation alphabet ------------------------------------------------------------

def operations(lockstep: Lockstep, scope: Scope) -> list[O.Op]:
    """Every operation the scope allows in the current state, in a fixed order."""
    live = list(lockstep.live)
    room = len(live) < scope.max_contexts
    result: list[O.Op] = [O.Allocate()] if room else []
    for handle in live:
        length = len(lockstep.live[handle][1])
        for k in range(1, min(scope.max_write, scope.max_positions) + 1):     # no longer write fits
            words = list(itertools.product(scope.alphabet, repeat=k))
            if length + k <= scope.max_positions:
                result += [O.Extend(handle, word, seed) for word in words for seed in scope.seeds]
            result += [O.Overwrite(handle, start, word, seed)
                       for start in range(length - k + 1) for word in words for seed in scope.seeds]
        if room:
            result.append(O.Fork(handle))
        result += [O.Truncate(handle, n) for n in range(length + 1)]
        result += [O.Retain(handle), O.Close(handle)]
        result += _edges(handle, length, scope)
    if room:
        result += [O.Match(query) for query in _queries(lockstep, scope)]
    if lockstep.reference.entries:
        result.append(O.Clear())
    return result


# Besides the valid operations, each live context is offered writes of zero positions (accepted,
# changing nothing: README's zero-length writes) and positions past its length (refused with
# ``PositionError``, changing nothing). A correct engine ends each in its parent's form, so they
# add transitions, not states; they put Lockstep's two "changed nothing" checks in the search.
# Cost (2026-12-07): the standard scopes' state counts are unchanged, their transitions grow by
# 22-41% (the tiny scope's complete search 2,951 -> 4,171; the 4-operation scopes about 1,180 ->
# 1,440; the default scope at 5, 8,094 -> 9,922), the CPU time of the six the default suite
# searches (the tiny one, five at 4 operations) by about 1 s, 6.1-6.9 s -> 7.3-7.9 s.
def _edges(handle: str, length: int, scope: Scope) -> list[O.Op]:
    seed, token = (scope.seeds or (0,))[0], (scope.alphabet or (0,))[0]
    return [O.Extend(handle, (), seed), O.Overwrite(handle, length, (), seed),
            O.Overwrite(handle, length, (token,), seed), O.Truncate(handle, length + 1)]


def _queries(lockstep: Lockstep, scope: Scope) -> list[tuple[int, ...]]:
    """Queries that reach every match outcome: misses, hits on each key, stops inside an edge.

    Under ``token`` and ``block`` matching a hit's length is where the query leaves a key, so
    the queries leave each key at every position (``key[:i]`` and ``key[:i] + (t,)``)."""
    queries = {()} | {(t,) for t in scope.alphabet}
    for key, _tick in lockstep.reference.eviction_order():
        queries |= {key, key[:-1]} | {key + (t,) for t in scope.alphabet}
        if scope.match != "entry":
            queries |= {key[:i] + tail for i in range(len(key)) for tail in [()] + [(t,) for t in scope.alphabet]}
    return sorted(queries, key=lambda q: (len(q), q))


# -- canonical form ----------------------------------------------------------------------

class _Interner:
    """Small ids for byte strings, in first-seen order, shared by every state of a search."""

    def __init__(self):
        self.ids: dict[bytes, int] = {}

    def __call__(self, data: bytes) -> int:
        return self.ids.setdefault(data, len(self.ids))

    def rows(self, values: np.ndarray) -> tuple[int, ...]:
        return tuple(self(np.ascontiguousarray(row).tobytes()) for row in values)


def canonical(lockstep: Lockstep, intern: _Interner) -> Hashable:
    """A form equal for two states exactly when they differ only by naming.

    Names that do not matter: context handles, page ids and the reference's page labels
    (each renamed in first-use order), clock ticks (only their order matters), values
    (interned bytes). A tier the engine does not observe (None) contributes nothing.
    """
    obs = lockstep.engine.observe()
    holders, lengths = obs.holders or {}, obs.lengths or {}
    contexts = []
    for engine_ctx, ref_ctx in lockstep.live.values():
        values, tokens = ref_ctx.read()
        contexts.append((tuple(int(t) for t in tokens), intern.rows(values), engine_ctx, ref_ctx))
    holder_of = {id(ctx): name for name, ctx in _engine_holders(lockstep.engine)}
    named = []
    for tokens, values, engine_ctx, ref_ctx in contexts:
        name = holder_of.get(id(engine_ctx))
        pages = holders.get(name, ()) if name else ()
        named.append(((tokens, values, lengths.get(name), _local_pattern(pages), _local_pattern(ref_ctx.labels),
                       _holding_form(engine_ctx, intern)),
                      pages, ref_ctx.labels))
    named.sort(key=lambda item: item[0])
    renamed: dict[int, int] = {}
    relabelled: dict[int, dict[int, int]] = {}   # a reference label is a tuple of names, each renamed on its own

    def rename(pages):
        return tuple(renamed.setdefault(pid, len(renamed)) for pid in pages)

    def relabel(labels):
        return tuple(tuple(relabelled.setdefault(at, {}).setdefault(name, len(relabelled[at]))
                           for at, name in enumerate(label))
                     for label in labels)

    context_form = tuple((key, rename(pages), relabel(labels)) for key, pages, labels in named)
    entry_values = _engine_entries(lockstep.engine)
    entry_form = tuple((e.key, lengths.get(e.holder), rename(holders.get(e.holder, ())),
                        _holding_form(entry_values.get(e.holder), intern))
                       for e in obs.entries or ())
    # the reference's entries in recency order: what eviction and a token hit's tie-break read
    reference_entries = tuple(
        (entry[0], intern.rows(entry[1].values), relabel(entry[1].labels))
        for entry in sorted(lockstep.reference.entries, key=lambda entry: entry[2]))
    pages = obs.pages or {}
    for pid in sorted(pages):                          # pages no holder points at (a leak)
        rename((pid,))
    page_form = tuple(
        sorted((renamed[pid], p.refcount, p.slot, p.dirty_tail, p.cached) for pid, p in pages.items()))
    arena_form = (obs.arena_free, tuple(sorted((s, renamed.get(pid, -1)) for s, pid in obs.arena_out.items())))
    return (context_form, entry_form, reference_entries, lockstep.reference.viable, page_form, arena_form,
            obs.pages_allocated - obs.pages_freed, obs.tree, _gauges(obs.counters),
            _engine_memory(lockstep.engine, renamed, intern))


# Counters that total what happened so far: each only grows (pages allocated, freed, issued, returned,
# placed on the heap, copied; bytes copied; entries evicted for room). No operation reads one back,
# so two states that differ only in them behave alike, and keeping them would make every path its
# own state (a search with no depth bound would never complete). What they total that is state is
# in the form already: allocated - freed, and the arena's issued - returned as its books.
HISTORY_COUNTERS = frozenset({"pages_allocated", "pages_freed", "arena_issued", "arena_returned", "heap_pages",
                              "heap_fallbacks", "pages_copied", "bytes_copied", "pressure_evictions"})


def _gauges(counters: dict) -> tuple:
    """Every counter but the history totals: the ones a later operation reads or that can go down.

    For kvstate's engine: ``tree_pages`` (the running page count ``max_pages`` is checked against,
    ``RadixTree.weight``, kept on every insert, removal and clear, never recounted), ``entries`` and
    ``live_contexts``. A correct engine's gauges follow from the rest of the form, so they add no
    state; a drifting one (a ``clear`` that leaves the page count) is a state of its own. A foreign
    engine's counters are kept unless named in ``HISTORY_COUNTERS``: a total it keeps splits
    states, which can stop a search at its bound, but never merges two that differ."""
    return tuple(sorted((str(name), value if isinstance(value, Hashable) else repr(value))
                        for name, value in (counters or {}).items() if name not in HISTORY_COUNTERS))


def _local_pattern(pages: tuple[int, ...]) -> tuple[int, ...]:
    seen: dict[int, int] = {}
    return tuple(seen.setdefault(pid, len(seen)) for pid in pages)


def _engine_holders(engine) -> list[tuple[str, Any]]:
    """Holder names of live engine contexts (``ctx:N``), for kvstate's own engine."""
    contexts = getattr(engine, "_contexts", None)
    if contexts is None:
        return []
    return [(f"ctx:{cid}", ctx) for cid, ctx in contexts.items()]


def _engine_entries(engine) -> dict[str, Any]:
    """The tree entries' values by holder name (``entry:N``), for kvstate's own engine; else empty."""
    tree = getattr(engine, "tree", None)
    try:
        return {f"entry:{node.value.context_id}": node.value for node in tree.entries()}
    except Exception:       # noqa: BLE001 - a foreign engine's tree (or none): nothing to read
        return {}


def _holding_form(ctx, intern: _Interner) -> Hashable:
    """What a kvstate context or entry keeps beside its pages that no observation shows.

    Its kept key (``Holding.key``, which ``retain`` stores in place of the pages' token ids): None
    when none is kept, else whether its first ``length`` positions are the pages' tokens (and when
    they are not, which tokens they are). Its base (the prefix of its page list that a fork or hit
    at exactly that length takes whole): how many pages, and where they are not the first pages of
    the list (a bug), which pages. Whether its refcount slots, and its base's, name its pages' own
    slots. An engine without ``_holding`` contributes nothing.

    Two parts are left out on purpose, as the code paths they choose give one result. The key's
    bytes past the length (a hit or a truncate keeps the longer key): ``_kept_key`` cuts them, and
    every growth rewrites the key through ``Context._write``, so no path reads them. Whether the
    slots are a ``range`` or an array: it picks a refcount step's code path, and which one follows
    from the order pages were freed and taken. Keeping them multiplied the tiny scope's complete
    state count by 2.3 (the bytes past the length) and 3 (range or array); a bug in only one of
    those paths is left to the lockstep machine and the scale check.
    """
    holding = getattr(ctx, "_holding", None)
    if holding is None:
        return ()
    try:
        pages, length, key, base = tuple(holding.pages), int(holding.length), holding.key, tuple(holding.base)
        refs = [int(page.ref) for page in pages]
        if key is None:
            key_form = None
        else:
            kept = bytes(key[:4 * length])
            tokens = ctx._tokens() if pages else np.zeros(0, np.int64)
            key_form = "=" if kept == np.asarray(tokens).astype("<i4").tobytes() else ("stale", intern(kept))
        prefix = len(base) <= len(pages) and all(a is b for a, b in zip(base, pages))
        base_form = len(base) if prefix else ("apart", _local_pattern(tuple(map(id, pages + base)))[len(pages):])
        slots_form = ([int(i) for i in holding.slots] == refs,
                      [int(i) for i in holding.base_slots] == refs[:len(base)])
        return key_form, base_form, slots_form
    except Exception as error:    # noqa: BLE001 - a holding that cannot be read is a state of its own
        return ("unreadable", type(error).__name__)


def _engine_memory(engine, renamed: dict[int, int], intern: _Interner) -> Hashable:
    """Bytes the observation does not show but a buggy engine could read back.

    For kvstate's own engine: every live page's full content (stale positions past
    a context's length included), and for each free arena slot which of its
    positions hold a non-zero byte. A slot handed out without zeroing is a bug only
    where it held something the next write does not cover; which stale bytes it
    holds matters less, and keeping only those bits keeps the state space small.
    Foreign engines contribute nothing.
    """
    pool, store = getattr(engine, "pool", None), getattr(engine, "store", None)
    if pool is None or store is None:
        return ()
    pages = tuple(sorted(
        (renamed.get(pid, -1), tuple(int(t) for t in page.tokens), page.filled,
         intern(b"".join(np.ascontiguousarray(a).tobytes() for a in page.buffer.arrays)))
        for pid, page in pool.live.items()))
    blocks = getattr(store, "_blocks", ())
    _size, out, free = store.arena_books()
    dirty = tuple(
        tuple(any(block[slot][:, :, offset].any() for block in blocks) for offset in range(store.page_tokens))
        for slot in free)
    return pages, dirty


# -- cloning -------------------------------------------------------------------------------

_LOCK_TYPES = (type(threading.Lock()), type(threading.RLock()))


@contextmanager
def _copyable_locks():
    """Let a clone (pickled and unpickled) get fresh locks; a clone is used by this thread only."""
    saved = {t: copyreg.dispatch_table.get(t) for t in _LOCK_TYPES}
    copyreg.pickle(_LOCK_TYPES[0], lambda lock: (threading.Lock, ()))
    copyreg.pickle(_LOCK_TYPES[1], lambda lock: (threading.RLock, ()))
    try:
        yield
    finally:
        for t, reducer in saved.items():
            if reducer is None:
                copyreg.dispatch_table.pop(t, None)
            else:
                copyreg.dispatch_table[t] = reducer


class _States:
    """Keeps reached states compactly and makes fresh ``Lockstep``s from them.

    A state is kept as its pickle, so expanding it costs one ``loads`` per operation;
    an engine that cannot be pickled is kept as its path and re-run from the start.
    """

    def __init__(self, factory: Factory, config: Config):
        self.factory, self.config = factory, config
        self.can_pickle = True

    def start(self) -> Lockstep:
        return Lockstep(self.factory, self.config)

    def freeze(self, lockstep: Lockstep) -> bytes | None:
        if self.can_pickle:
            try:
                return pickle.dumps(lockstep, pickle.HIGHEST_PROTOCOL)
            except Exception:          # an engine that cannot be pickled: re-run paths instead
                self.can_pickle = False
        return None

    def thaw(self, frozen: bytes | None, path: list[O.Op]) -> Lockstep:
        if frozen is not None:
            return pickle.loads(frozen)
        fresh = self.start()
        for op in path:
            fresh.apply(op)
        return fresh

    def clone(self, lockstep: Lockstep, path: list[O.Op]) -> Lockstep:
        return self.thaw(self.freeze(lockstep), path)


# -- the search ------------------------------------------------------------------------------

def explore(factory: Factory, scope: Scope = Scope(), time_limit: float | None = None) -> Result:
    """Breadth-first search of the scope's reachable states, checking every invariant at each.

    Stops at the first violation (its ``ops`` are a shortest trace), at ``scope.max_depth``,
    at ``time_limit`` seconds, or when no new state appears (``complete``).
    """
    started = time.perf_counter()
    result = Result(scope)
    intern = _Interner()
    states = _States(factory, scope.config())
    with _copyable_locks():
        root = states.start()
        try:
            root.check()
            frozen = states.freeze(root)
            states.thaw(frozen, []).finish()                  # invariant 6, on a copy
        except Exception as error:     # noqa: BLE001 - any failure of the engine is a finding
            result.violation = Violation([], _describe(error))
            return _done(result, started)
        seen = {canonical(root, intern)}
        frontier: deque[tuple[bytes | None, list[O.Op]]] = deque([(frozen, [])])
        result.states, result.per_depth = 1, [1]
        depth = 0
        while frontier:
            if scope.max_depth is not None and depth >= scope.max_depth:
                return _done(result, started)
            next_frontier: deque = deque()
            new_states = 0
            # The last level's states are checked but never expanded: they need no frozen copy.
            expanded_later = scope.max_depth is None or depth + 1 < scope.max_depth
            for frozen, path in frontier:
                unused = states.thaw(frozen, path)      # lists the operations, then runs the first
                for op in operations(unused, scope):
                    if time_limit is not None and time.perf_counter() - started > time_limit:
                        return _done(result, started)
                    result.transitions += 1
                    child_path = path + [op]
                    child = unused if unused is not None else states.thaw(frozen, path)
                    unused = None
                    try:
                        child.apply(op)
                        form = canonical(child, intern)
                        if form in seen:     # an isomorphic state was checked already
                            continue
                        child.check()
                        frozen_child = states.freeze(child) if expanded_later else None
                        child.finish()                        # invariant 6; the frozen copy lives on
                    except Exception as error:     # noqa: BLE001 - any failure is a finding
                        result.violation = Violation(child_path, _describe(error))
                        result.depth = depth + 1
                        return _done(result, started)
                    seen.add(form)
                    new_states += 1
                    if expanded_later:
                        next_frontier.append((frozen_child, child_path))
            depth += 1
            result.depth = depth
            result.states = len(seen)
            result.per_depth.append(new_states)
            if new_states and not expanded_later:      # cut at max_depth, new states left unexpanded
                return _done(result, started)
            frontier = next_frontier
    result.complete = True
    return _done(result, started)


def _done(result: Result, started: float) -> Result:
    result.seconds = time.perf_counter() - started
    return result


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


# -- traces -----------------------------------------------------------------------------------

def as_replay(scope: Scope, ops: list[O.Op], factory: Factory, backend: str = "kvstate.impl.numpy") -> Replay:
    """A shortest trace as a sweep replay file (``kvstate replay`` runs it), with the failure it shows."""
    config = scope.config()
    failure, _ = execute(factory, config, ops)
    return Replay(backend, config, seed=None, ops=list(ops), failure=failure, minimised=True,
                  extra={"found_by": "exhaustive search (BFS: no shorter sequence reaches it)"})


def write_replay(path: str, scope: Scope, violation: Violation, factory: Factory,
                 backend: str = "kvstate.impl.numpy") -> None:
    save(as_replay(scope, violation.ops, factory, backend), path)
