"""Directed check: evidence about the arena that the suite gathers itself.

Invariant 3 says a recycled arena slot reads zero where nothing was written, but the
lockstep machine learns that only from the backend's own ``dirty_tail`` flag, and a
backend that ignores ``arena_pages`` altogether passes every arena configuration.
Self-reported evidence cannot convict, so this check looks for itself:

- ``observe()`` reports ``arena_size`` equal to the configuration's ``arena_pages``, and
  while the arena has a free slot a new page takes one;
- one fixed program (a seeded sequence of the sweep's generator, then a handcrafted one
  that frees full pages and reuses their slots for a single position) runs on the
  configuration and on the same configuration with ``arena_pages=0``; both must read
  byte-identical values at every step and write byte-identical snapshots, and, for a
  backend built on kvstate's ``PageStore`` (``cache.store``/``cache.pool``, whose pages
  can be read whole), store byte-identical pages, positions never written included;
- without an arena there is no twin, so a page the handcrafted program takes back after frees
  is compared with the page the same ``extend`` makes in a new cache: a heap page recycled
  unzeroed shows there (through ``read_page`` or ``cache.store``, where the backend has either).
  A backend without the arena tier gets this part alone, in a configuration without an arena,
  where it reads its pages raw and names their holders (the pages tier). There, one with arena
  books of 0 slots that cannot read its pages raw gets n/a too: nothing would compare a byte.

Both runs are lockstep runs, so each is also compared with the reference. Should the
two runs disagree on whether a step is refused (a configuration that refuses rather
than fall back when its arena is full), the byte comparison stops there.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from kvstate.spec.errors import InvariantViolation, ReplayFileError
from kvstate.spec.invariants import NO_ARENA, tiers
from kvstate.spec.protocol import Config, Factory

from .. import ops as O
from .common import BrokenPromise, NotApplicable, as_array, as_list, keeping, note, require_tier, start
from ..generate import Generator
from ..lockstep import Lockstep
from ..replay import FINDINGS, Failure, failure_of
from ..snapshots import remove_files

SIZE = "observe() reports arena_size equal to the configuration's arena_pages"
ISSUED = "while the arena has a free slot, a new page takes one"
RECYCLED_LIKE_FRESH = ("without an arena, a page handed out again after frees stores what a new cache's page "
                       "stores: zeros wherever nothing was written")
SAME_BYTES = ("one program run with an arena and without one reads, snapshots and stores byte-identical "
              "values: a recycled slot holds zeros wherever nothing was written")

COMPARED_WHERE = ("a page handed out again after frees is compared only where the backend names pages' holders "
                  "(the 'pages' tier) and reads them raw (cache.read_page)")

PROGRAM_SEED = 11        # the sweep generator's seed for the first part of the program
PROGRAM_STEPS = 120


def arena_evidence(factory: Factory, config: Config) -> None:
    """arena_size is the configuration's, slots are issued, and an arena changes no byte anywhere."""
    try:
        _arena_evidence(factory, config)
    except BrokenPromise as broken:
        broken.replay = replay_evidence     # what only a comparison shows is shrunk by comparing again
        raise


def _arena_evidence(factory: Factory, config: Config) -> None:
    arena = start(factory, config)
    if "arena" not in tiers(arena.engine.observe()) and not config.arena_pages:
        return _heap_pages_like_fresh(arena, factory, config)
    require_tier(arena.engine.observe(), "arena", "observe().arena_size")
    _sized(arena.engine.observe(), config.arena_pages, "observe() of a new cache")
    if not config.arena_pages and not _reads_pages_raw(arena):
        # Books of 0 slots: the program below would compare no byte, only repeat the lockstep check.
        raise NotApplicable(f"no arena in this configuration (arena_pages 0); {COMPARED_WHERE}")
    heap = Lockstep(factory, _heap_twin(config)) if config.arena_pages else None
    twins = _Twins(arena, heap, factory)
    generator = Generator(PROGRAM_SEED)
    for _ in range(PROGRAM_STEPS):
        twins.step(generator.next_op(arena))
    twins.snapshots()
    for handle in list(arena.live):
        twins.step(O.Close(handle))
    twins.step(O.Clear())                    # an empty cache again: every slot free
    _slot_reuse(twins, config)
    twins.snapshots()
    arena.finish()
    if heap is not None:
        heap.finish()


def _heap_twin(config: Config) -> Config:
    """The arena configuration without its arena. The twin keeps the pool's limit (as pool_pages) so its
    declared semantics stay the same."""
    return config.with_(arena_pages=0, pool_pages=config.pool_limit)


def replay_evidence(factory: Factory, config: Config, ops: list[O.Op], lockstep: Lockstep | None = None
                    ) -> tuple[Failure | None, Lockstep]:
    """``replay.execute`` for this check, which the shrinker runs its candidates with: a dirty page
    that the backend reports clean breaks no invariant of one run, so each candidate is compared as the
    check compared. With an arena, ``ops`` run in ``config`` and in its heap twin side by side, compared
    after every step, then their snapshots; without one, each ``extend`` into an empty context is
    compared with the same ``extend`` in a new cache. Returns the first failure and the run; "the same
    way" (``Failure.signature``) is the same promise or invariant broken."""
    run = lockstep or Lockstep(factory, config)
    run.check_each_apply = True
    heap = Lockstep(factory, _heap_twin(config)) if config.arena_pages else None
    twins = _Twins(run, heap, factory, sized=config.arena_pages > 0 or "arena" in tiers(run.engine.observe()))
    step, phase, op = 0, "apply", None
    try:
        for step, op in enumerate(ops, start=1):
            fault = run.sequence_fault(op)
            if fault is not None:
                raise ReplayFileError(f"step {step} {op} {fault}")
            into_empty = op.kind == "extend" and not run.live[op.ctx][1]
            twins.step(op)
            if into_empty:
                twins.like_fresh(op.ctx, op)
        step, phase, op = step + 1, "finish", None
        twins.snapshots()
        run.finish()
        if heap is not None:
            heap.finish()
    except BrokenPromise as broken:         # "the same way": the same invariant, else the same promise, broken
        if isinstance(broken.__cause__, InvariantViolation):    # a run's invariant, named as ``execute`` names it
            return failure_of(step, phase, op, broken.__cause__), run
        return Failure(step, phase, None if op is None else str(op), type(broken).__name__,
                       broken.invariant or broken.promise, str(broken)), run
    except FINDINGS as error:
        return failure_of(step, phase, op, error), run
    finally:
        if heap is not None:
            remove_files(heap)
    return None, run


def _heap_pages_like_fresh(run: Lockstep, factory: Factory, config: Config) -> None:
    """Without the arena tier: only the page taken back after frees, against a new cache's, and only
    where the backend reads pages raw and names their holders (else ``NotApplicable``, as before)."""
    if not _reads_pages_raw(run):
        raise NotApplicable(f"the observation has no 'arena' tier (observe().arena_size is None); {COMPARED_WHERE}")
    twins = _Twins(run, None, factory, sized=False)
    _slot_reuse(twins, config)
    run.finish()


def _reads_pages_raw(run: Lockstep) -> bool:
    return "pages" in tiers(run.engine.observe()) and _stored_pages(run.engine) is not None


class _Twins:
    """The arena run and its heap twin (None for a heap configuration), stepped together; ``sized``:
    the backend reports its arena (the arena tier), checked at every step."""

    def __init__(self, arena: Lockstep, heap: Lockstep | None, factory: Factory, sized: bool = True):
        self.arena, self.heap, self.factory, self.sized = arena, heap, factory, sized
        self.comparing = heap is not None

    def step(self, op: O.Op) -> str | None:
        with keeping(SAME_BYTES, self.arena):
            made = self.arena.apply(op)
            self.arena.check()
        if self.sized:
            _sized(self.arena.engine.observe(), self.arena.config.arena_pages, str(op))
        if self.heap is None or not self.comparing:
            return made
        with keeping(SAME_BYTES, self.heap):
            self.heap.apply(op)
            self.heap.check()
        if _refusal(self.arena.history[-1]) != _refusal(self.heap.history[-1]):
            self.comparing = False           # the runs diverge (a declared refusal): nothing more to compare
            return made
        self.same_reads(str(op))
        self.same_pages(str(op))
        return made

    def same_reads(self, call: str) -> None:
        for handle, (engine, _) in self.arena.live.items():
            twin = self.heap.live[handle][0]
            values, tokens = engine.read()
            heap_values, heap_tokens = twin.read()
            if not _same_bytes(as_array(values), as_array(heap_values)) or as_list(tokens) != as_list(heap_tokens):
                raise BrokenPromise(SAME_BYTES, call, f"{handle} reads other values with an arena than without")

    def same_pages(self, call: str) -> None:
        mine, theirs = _stored_pages(self.arena.engine), _stored_pages(self.heap.engine)
        if mine is None or theirs is None:
            return
        for (holder, pages), (heap_holder, heap_pages) in zip(mine, theirs):
            for index, (page, heap_page) in enumerate(zip(pages, heap_pages)):
                if page != heap_page:
                    offset = next(i for i, (a, b) in enumerate(zip(page, heap_page)) if a != b)
                    raise BrokenPromise(SAME_BYTES, call,
                                        f"page {index} of {holder} is stored with other bytes than page {index} of "
                                        f"{heap_holder} without an arena (first at stored byte {offset}): "
                                        "an arena slot was handed out holding old bytes")

    def like_fresh(self, handle: str, extend: O.Extend) -> None:
        """Without a twin (a heap configuration): ``handle``'s stored pages, made by ``extend`` on a new
        context after pages were freed, against those the same ``extend`` makes in a new cache, whose
        pages were never anything else's."""
        if self.heap is not None:
            return          # the twin compares every page at every step
        fresh = Lockstep(self.factory, self.arena.config)
        fresh.check_each_apply = True       # its books checked, and the new context's holder name learnt
        made = fresh.apply(O.Allocate())
        fresh.apply(O.Extend(made, extend.tokens, extend.seed))
        fresh.check()
        names = self.arena.holder_of(handle), fresh.holder_of(made)
        mine, theirs = (None, None) if None in names else (_stored_pages(self.arena.engine, names[0]),
                                                           _stored_pages(fresh.engine, names[1]))
        fresh.finish()
        if None in names and self.arena.engine.observe().holders is not None:
            note(f"the pages {extend} made in {handle} after pages were freed were not compared with a new "
                 "cache's: the backend renames its contexts' holders (ctx:N by position, say), so which holder "
                 f"is {handle} is not known")
        if not mine or not theirs:
            return          # holders not observed, or pages not readable raw
        for index, (page, new_page) in enumerate(zip(mine[0][1], theirs[0][1])):
            if page != new_page:
                offset = next(i for i, (a, b) in enumerate(zip(page, new_page)) if a != b)
                raise BrokenPromise(RECYCLED_LIKE_FRESH, str(extend),
                                    f"page {index} of {handle} is stored with other bytes than the same extend "
                                    f"stores in a new cache (first at stored byte {offset}): a freed page was "
                                    "handed out again holding old bytes")

    def snapshots(self) -> None:
        if not self.comparing or not hasattr(self.arena.engine, "restore"):
            return
        for handle, (engine, _) in self.arena.live.items():
            mine, theirs = io.BytesIO(), io.BytesIO()
            engine.snapshot(mine)
            self.heap.live[handle][0].snapshot(theirs)
            if mine.getvalue() != theirs.getvalue():
                raise BrokenPromise(SAME_BYTES, f"{handle}.snapshot(BytesIO())",
                                    "the snapshot's bytes differ with an arena and without")


def _slot_reuse(twins: _Twins, config: Config) -> None:
    """Fill pages, free them, reuse their slots for one position each, copy one; check slots are issued."""
    page = config.page_tokens
    full = twins.step(O.Allocate())
    twins.step(O.Extend(full, tuple(range(2 * page)), seed=71))
    obs = twins.arena.engine.observe()
    if twins.sized and not _refusal(twins.arena.history[-1]):
        wanted = min(len(obs.pages), config.arena_pages)
        if len(obs.arena_out) != wanted:
            raise BrokenPromise(ISSUED, twins.arena.history[-1],
                                f"{len(obs.pages)} pages live in a cache that held none, {len(obs.arena_out)} "
                                f"arena slots out of {config.arena_pages}; expected {wanted}")
    twins.step(O.Close(full))                                    # both pages' slots go back, written
    single = twins.step(O.Allocate())
    twins.step(O.Extend(single, (5,), seed=72))                  # a recycled slot, one position written
    fork = twins.step(O.Fork(single))
    twins.step(O.Extend(fork, (6,), seed=73))                    # copy-on-write of that page
    grown = twins.step(O.Allocate())
    twins.step(O.Extend(grown, tuple(range(3 * page)), seed=74))
    twins.step(O.Truncate(grown, 1))                             # frees two whole written pages again
    again = twins.step(O.Allocate())
    reuse = O.Extend(again, (7,), seed=75)                       # a page freed just now, one position written
    twins.step(reuse)
    twins.like_fresh(again, reuse)
    twins.step(O.Close(single))


def _sized(obs, arena_pages: int, call: str) -> None:
    if obs.arena_size != arena_pages:
        raise BrokenPromise(SIZE, call, f"arena_size {obs.arena_size}, configuration arena_pages {arena_pages}"
                                        + (f"; {NO_ARENA}" if obs.arena_size == 0 else ""))


def _refusal(line: str) -> str:
    """The "# refused: ErrorName" a lockstep run appends to a refused step, or ""."""
    marker = "# refused: "
    return line[line.index(marker):] if marker in line else ""


def _same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _stored_pages(cache: Any, only: str | None = None) -> list[tuple[str, list[bytes]]] | None:
    """Each holder's pages as stored, whole (every position, written or not), in the observation's
    holder order (``only``: that holder's alone, where it is one); None unless the backend reads
    pages raw: through the protocol's optional ``cache.read_page(page_id)`` (the stored parts of
    every row), or, built on kvstate's ``PageStore``, through ``cache.store.read_encoded`` of the
    pages in ``cache.pool.live``."""
    def held(holders: dict | None) -> dict:
        holders = holders or {}
        return holders if only is None else {only: holders[only]} if only in holders else {}

    if callable(getattr(cache, "read_page", None)):
        return [(holder, [b"".join(np.ascontiguousarray(part).tobytes() for part in cache.read_page(page_id))
                          for page_id in pages])
                for holder, pages in held(cache.observe().holders).items()]
    store, pool = getattr(cache, "store", None), getattr(cache, "pool", None)
    live = getattr(pool, "live", None)      # read once: an engine may build it on each read
    if not (callable(getattr(store, "read_encoded", None)) and isinstance(live, dict)):
        return None
    obs = cache.observe()
    pages = []
    for holder, ids in held(obs.holders).items():
        stored = []
        for page_id in ids:
            parts = store.read_encoded(live[page_id].buffer, 0, store.page_tokens)
            stored.append(b"".join(np.ascontiguousarray(part).tobytes() for part in parts))
        pages.append((holder, stored))
    return pages
