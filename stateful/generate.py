"""Deterministic operation sequences from an integer seed, for sweeps.

Why not Hypothesis here: with ``seed(n)`` and ``max_examples=1`` Hypothesis
tries its simplest example first, so every n gives the *same* run, and a rule
that draws large lists can exhaust its choice budget and end a run early. A
sweep needs the opposite: seed n is one fixed, full-length run, different for
every n, identical on every machine. So a ``random.Random(seed)`` picks each
operation from the live state, the way the Hypothesis machine's rules would:
the same op mix, the same tiny token alphabet, a page size drawn per run.

Every operation is valid by construction (it names a live context, stays
inside its length), so a sequence is exactly ``steps`` operations long. Ops
are chosen from the *reference* side of a ``Lockstep``, so the sequence for a
seed does not depend on the backend under test (as long as it supports the
same operation kinds: snapshot and restore only join where it has them).

New operation kinds (snapshot, restore) join with ``register_generator``.
"""

from __future__ import annotations

import functools
import itertools
import random
from dataclasses import dataclass
from typing import Callable

from kvstate.impl.numpy import factory as numpy_factory
from kvstate.spec.protocol import Config, Factory

from . import ops as O
from .configs import DRAWN_PAGE_SIZES, machine_configs, page_sizes, scaled_cut, scaled_run
from .lockstep import Lockstep

TOKENS = (0, 1, 2)          # a tiny alphabet: prefixes repeat, so match and retain hit
MAX_RUN = 9                 # up to a page or two at page size 1-8, as the machine's TOKEN_RUNS
MAX_FIRST = 12              # the first context's tokens, as the machine's initialize rule
MAX_EXTRA = 4               # tokens a match query adds past a live context's prefix
SEED_LIMIT = 2**16          # K/V value seeds, as the machine's SEEDS
PREFILL_AFTER_MATCH = 0.5   # how often a match is followed by its hit's prefill (``Generator._prefill``)
MAX_LIVE = 8                # caps the live contexts: every step's check reads each of them,
                            # and a few contexts touched often share more pages than many touched once


class RunState:
    """What the generators may look at: the reference side of a lockstep run, as it is while
    one operation is chosen (nothing is applied meanwhile, so the handles are listed once)."""

    def __init__(self, lockstep: Lockstep, hits: "set[str] | frozenset[str]" = frozenset()):
        self.lockstep = lockstep
        self.handles: list[str] = list(lockstep.live)
        self.hits: list[str] = [handle for handle in self.handles if handle in hits]

    def pick(self, rng: random.Random) -> str:
        """A live handle: half the time a hit's, where there is one. Hits are where the tree's pages
        and a context's meet, so writes, snapshots and forks of them are where sharing is tested;
        among all handles they would be a small share of the choices."""
        if self.hits and rng.random() < 0.5:
            return rng.choice(self.hits)
        return rng.choice(self.handles)

    def length(self, handle: str) -> int:
        return len(self.lockstep.live[handle][1])

    def tokens(self, handle: str) -> list[int]:
        return self.lockstep.live[handle][1].tokens

    @property
    def has_entries(self) -> bool:
        return bool(self.lockstep.reference.entries)

    def entry_keys(self) -> list[tuple[int, ...]]:
        return self.lockstep.reference.keys()


# A generator returns an operation valid in ``state``, or None when its kind does not apply now.
OpGenerator = Callable[[random.Random, RunState], "O.Op | None"]


@dataclass(frozen=True)
class Entry:
    make: OpGenerator
    weight: float


GENERATORS: dict[str, Entry] = {}


def register_generator(kind: str, make: OpGenerator, weight: float = 1.0) -> None:
    """Add (or replace) the generator for an operation kind. Order of registration is part of
    the sequence a seed gives, so register new kinds after the core ones, never in between."""
    GENERATORS[kind] = Entry(make, weight)
    _cumulative_weights.cache_clear()


@functools.lru_cache(maxsize=None)
def _cumulative_weights(kinds: tuple[str, ...]) -> list[float]:
    """What ``random.choices(kinds, weights)`` accumulates at every call, made once per set of
    kinds still open: passed as ``cum_weights``, the draw is the same."""
    return list(itertools.accumulate(GENERATORS[kind].weight for kind in kinds))


def _tokens(rng: random.Random, low: int, high: int) -> tuple[int, ...]:
    return tuple(rng.choice(TOKENS) for _ in range(rng.randint(low, high)))


def _room(state: RunState) -> bool:
    return len(state.handles) < MAX_LIVE


def _allocate(rng, state):
    return O.Allocate() if _room(state) else None


def _extend(rng, state):
    if not state.handles:
        return None
    page_tokens = state.lockstep.config.page_tokens
    return O.Extend(rng.choice(state.handles), scaled_run(_tokens(rng, 1, MAX_RUN), page_tokens),
                    rng.randint(0, SEED_LIMIT))


def _overwrite(rng, state):
    if not state.handles:
        return None
    ctx = state.pick(rng)
    length = state.length(ctx)
    start = rng.randint(0, length)
    return O.Overwrite(ctx, start, _tokens(rng, 0, min(MAX_RUN, length - start)), rng.randint(0, SEED_LIMIT))


def _fork(rng, state):
    if not state.handles or not _room(state):
        return None
    return O.Fork(rng.choice(state.handles))


def _truncate(rng, state):
    if not state.handles:
        return None
    ctx = rng.choice(state.handles)
    return O.Truncate(ctx, scaled_cut(rng.randint(0, state.length(ctx)), state.lockstep.config.page_tokens))


def _close(rng, state):
    return O.Close(rng.choice(state.handles)) if state.handles else None


def _retain(rng, state):
    # Empty contexts are refused (EmptyContextError) by both sides; skipping them keeps the step useful.
    candidates = [h for h in state.handles if state.length(h)]
    return O.Retain(rng.choice(candidates)) if candidates else None


def _match(rng, state):
    # Queries built from a live context's tokens hit the tree far more often than random ones.
    # Half of them carry the context's whole token list: a retained context, or a hit, is then
    # matched again in full, so one entry gets several live hits and an extended hit retained
    # again nests keys (a cut at random would hit a whole entry key about once per key length).
    # A third start from an entry's own key instead: most live contexts have moved on from every
    # key (extended, overwritten, truncated), so without these only about one match in sixteen hit,
    # and the paths a hit opens (its writes, its snapshot, a second hit of one entry) ran rarely.
    if not _room(state):
        return None
    prefix: tuple[int, ...] | list[int] = ()
    keys = state.entry_keys()
    if keys and rng.random() < 1 / 3:
        prefix = rng.choice(keys)
    elif state.handles:
        tokens = state.tokens(rng.choice(state.handles))
        whole = rng.random() < 0.5
        prefix = tokens if whole else tokens[:rng.randint(0, len(tokens))]
    return O.Match(tuple(prefix) + _tokens(rng, 0, MAX_EXTRA))


def _clear(rng, state):
    return O.Clear() if state.has_entries else None


for _kind, _make in [("allocate", _allocate), ("extend", _extend), ("overwrite", _overwrite),
                     ("fork", _fork), ("truncate", _truncate), ("close", _close),
                     ("retain", _retain), ("match", _match), ("clear", _clear)]:
    register_generator(_kind, _make)


def _register_snapshots() -> None:
    """snapshot and restore join the mix where their operations exist (stateful/snapshots.py)
    and the engine under test supports them, as the Hypothesis machine's rules do."""
    try:
        from . import snapshots
    except ImportError:
        return

    def taken(state: RunState) -> list[str]:
        # The names the reference side holds: a refused snapshot never gets one.
        return list(getattr(state.lockstep, "_reference_snapshots", {}))

    def snapshot(rng, state):
        if not state.handles or not snapshots.supports_snapshots(state.lockstep.engine):
            return None
        return snapshots.Snapshot(state.pick(rng), f"s{len(taken(state)) + 1}")

    def restore(rng, state):
        names = taken(state)
        return snapshots.Restore(rng.choice(names)) if names and _room(state) else None

    register_generator("snapshot", snapshot)
    register_generator("restore", restore)


_register_snapshots()


class Generator:
    """The operation stream of one seed. ``page_tokens`` is drawn first (from ``sizes``), then each
    ``next_op`` looks at the run's state, so feed it the same ``Lockstep`` the operations are applied to."""

    def __init__(self, seed: int, sizes: tuple[int, ...] = DRAWN_PAGE_SIZES):
        self.seed = seed
        self.rng = random.Random(seed)
        self.page_tokens = self.rng.choice(sizes)    # for 1-8, the very draw randint(1, 8) makes
        self._opening = [O.Allocate()]
        self._matched: tuple[tuple[int, ...], int, bool] | None = None    # (query, contexts made before it, prefill?)
        self._hits: set[str] = set()            # handles a match made with positions in them
        first = _tokens(self.rng, 0, MAX_FIRST)
        if first:       # as the machine's initialize: one context to share pages with from step 1
            self._opening.append(O.Extend("c1", first, self.rng.randint(0, SEED_LIMIT)))

    def next_op(self, lockstep: Lockstep) -> O.Op:
        if self._opening:
            return self._opening.pop(0)
        prefill = self._prefill(lockstep)
        if prefill is not None:
            return prefill
        state = RunState(lockstep, self._hits)
        kinds = tuple(GENERATORS)
        while kinds:
            kind = self.rng.choices(kinds, cum_weights=_cumulative_weights(kinds))[0]
            op = GENERATORS[kind].make(self.rng, state)
            if op is not None:
                if op.kind == "match":
                    self._matched = (op.tokens, lockstep.created, self.rng.random() < PREFILL_AFTER_MATCH)
                return op
            kinds = tuple(k for k in kinds if k != kind)
        raise RuntimeError("no operation applies; allocate always should")   # pragma: no cover

    def _prefill(self, lockstep: Lockstep) -> O.Op | None:
        """Notes the hit the last match made, and returns what a server does next with it half the
        time: extend it by the query's unmatched suffix (or, if the whole query matched, by a
        decode's new tokens). Two hits of one entry then both write past its key."""
        if self._matched is None:
            return None
        (query, created_before, prefill), self._matched = self._matched, None
        handle = f"c{created_before + 1}"
        if lockstep.created != created_before + 1 or handle not in lockstep.live:
            return None                          # the match was refused: nothing to note or prefill
        matched = len(lockstep.live[handle][1])
        if matched:
            self._hits.add(handle)
        if not prefill:
            return None
        rest = tuple(query[matched:]) or _tokens(self.rng, 1, MAX_RUN)
        return O.Extend(handle, rest, self.rng.randint(0, SEED_LIMIT))


def generate(seed: int, steps: int, config: Config | None = None,
             factory: Factory | None = None, sizes: tuple[int, ...] | None = None) -> tuple[int, list[O.Op]]:
    """The page size and exactly ``steps`` operations seed ``seed`` gives (no invariant checks).

    Operations are chosen from the reference side, so any backend that supports the same
    operation kinds gets the same sequence; ``factory`` defaults to the NumPy engine. The page
    size is drawn from ``sizes`` (default: those ``factory`` is run at), as a run of a backend
    that declares other sizes draws it.
    """
    config = config or machine_configs()[0]
    factory = factory or numpy_factory
    generator = Generator(seed, sizes or page_sizes(factory, config))
    lockstep = Lockstep(factory, config.with_(page_tokens=generator.page_tokens))
    sequence = []
    for _ in range(steps):
        op = generator.next_op(lockstep)
        lockstep.apply(op)
        sequence.append(op)
    return generator.page_tokens, sequence
