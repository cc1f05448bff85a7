"""The lockstep ``RuleBasedStateMachine``: engine and reference, every operation, every invariant.

The machine is parameterised by the backend: ``machine_for(factory, config)``
builds a machine class for any factory that speaks the spec's protocol.
Each rule builds an ``Op`` and hands it to ``Lockstep``; invariants are checked
after every step by ``every_invariant_holds``, and the teardown checks invariant 6.
"""

from __future__ import annotations

from functools import lru_cache

from hypothesis import settings as Settings, strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize, invariant, multiple,
                                 precondition, rule, run_state_machine_as_test)

from kvstate.spec.protocol import Config, Factory
from kvstate.spec.semantics import evicts_for_room, reclaims

from . import ops as O
from .configs import PAGE_TOKENS_RANGE, page_sizes, scaled_cut, scaled_run
from .fixed_constants import without_local_constants
from .lockstep import Lockstep
from .snapshots import Restore, Snapshot, supports_snapshots
from .stretches import ends_stretch, unobserved

ALPHABET = 3
TOKENS = st.integers(0, ALPHABET - 1)                        # a tiny alphabet: prefixes repeat
TOKEN_RUNS = st.lists(TOKENS, min_size=1, max_size=9)        # up to a page or two at page size 1-8
SEEDS = st.integers(0, 2**16)


# The strategies a rule builds from the state (a bound that is a context's length), one object
# per bound: Hypothesis works out a new strategy's properties (emptiness, labels) when it is
# first drawn from, which cost more than the draw itself when rebuilt at every step. The same
# arguments give an equal strategy, so the same draws.
@lru_cache(maxsize=4096)
def up_to(n: int) -> st.SearchStrategy[int]:
    return st.integers(0, n)


@lru_cache(maxsize=64)
def token_runs_up_to(n: int) -> st.SearchStrategy[list[int]]:
    return st.lists(TOKENS, min_size=0, max_size=n)


class CheckAbandoned(Exception):
    """Raised into every later step of a machine whose check conform stopped waiting for: each run
    then fails at once, so Hypothesis's shrinking ends in moments instead of minutes."""


class RunStats:
    """Steps and invariant checks across every run of one machine class."""

    def __init__(self):
        self.runs = 0
        self.steps = 0
        self.checks = 0
        self.last: Lockstep | None = None    # the latest run: after a failure, the minimised one
        self.shortest_failure: Lockstep | None = None    # the shortest failing run so far (while shrinking)
        self.abandoned = False    # the check's time ran out: stop (conform no longer waits for it)
        self.snapshots = 0
        self.restores = 0

    def abandon(self) -> None:
        self.abandoned = True


class LockstepMachine(RuleBasedStateMachine):
    factory: Factory
    config: Config
    page_sizes: tuple[int, ...]     # what runs are built at (``configs.page_sizes``)
    stats: RunStats

    contexts = Bundle("contexts")
    snapshots = Bundle("snapshots")

    def __init__(self):
        super().__init__()
        self.lockstep: Lockstep | None = None
        self.snapshots_taken = 0
        self.hits: list[str] = []       # handles a match made with positions in them (``_or_a_hit``)

    @initialize(target=contexts, page_tokens=st.integers(*PAGE_TOKENS_RANGE),
                tokens=st.lists(TOKENS, max_size=12), seed=SEEDS)
    def build_cache(self, page_tokens, tokens, seed):
        """Every run starts from a cache holding one context, so short runs still share pages."""
        sizes = type(self).page_sizes     # all of PAGE_TOKENS_RANGE, or the declared size alone
        page_tokens = sizes[(page_tokens - PAGE_TOKENS_RANGE[0]) % len(sizes)]
        self.lockstep = Lockstep(type(self).factory, type(self).config.with_(page_tokens=page_tokens))
        self.lockstep.reads_changed_only = True     # every operation goes through ``_do``
        type(self).stats.runs += 1
        type(self).stats.last = self.lockstep
        first = self._do(O.Allocate())
        if tokens:
            self._do(O.Extend(first, tuple(tokens), seed))
        return first

    def _do(self, op: O.Op):
        if type(self).stats.abandoned:
            raise CheckAbandoned("the check's time limit passed; conform reported it already")
        handle = self.lockstep.apply(op, not unobserved(self.lockstep.steps))
        if op.creates and handle is None:
            return multiple()     # refused by both sides (a full pool): nothing joins the bundle
        return handle

    def _length(self, handle: str) -> int:
        return len(self.lockstep.live[handle][1])

    # -- rules: one per operation ---------------------------------------------------

    @rule(target=contexts)
    def allocate(self):
        return self._do(O.Allocate())

    @rule(ctx=contexts, tokens=TOKEN_RUNS, seed=SEEDS)
    def extend(self, ctx, tokens, seed):
        self._do(O.Extend(ctx, scaled_run(tuple(tokens), self.lockstep.config.page_tokens), seed))

    def _or_a_hit(self, ctx: str, data) -> str:
        """``ctx``, or half the time a live hit where there is one. Hits are where the tree's pages
        and a context's meet, so their writes and snapshots are where sharing is tested; drawn among
        all contexts they would be a small share of the choices."""
        hits = [handle for handle in self.hits if handle in self.lockstep.live]
        if hits and data.draw(st.booleans(), label="a hit"):
            return data.draw(st.sampled_from(hits), label="hit")
        return ctx

    @rule(ctx=contexts, data=st.data(), seed=SEEDS)
    def overwrite(self, ctx, data, seed):
        ctx = self._or_a_hit(ctx, data)
        length = self._length(ctx)
        start = data.draw(up_to(length), label="start")
        tokens = data.draw(token_runs_up_to(min(9, length - start)), label="tokens")
        self._do(O.Overwrite(ctx, start, tuple(tokens), seed))

    @rule(target=contexts, ctx=contexts)
    def fork(self, ctx):
        return self._do(O.Fork(ctx))

    @rule(ctx=contexts, data=st.data())
    def truncate(self, ctx, data):
        n = data.draw(up_to(self._length(ctx)), label="n")
        self._do(O.Truncate(ctx, scaled_cut(n, self.lockstep.config.page_tokens)))

    @rule(ctx=consumes(contexts))
    def close(self, ctx):
        self._do(O.Close(ctx))

    @rule(ctx=contexts)
    def retain(self, ctx):
        self._do(O.Retain(ctx))

    @rule(target=contexts, ctx=contexts, data=st.data(), extra=st.lists(TOKENS, max_size=4))
    def match(self, ctx, data, extra):
        # Queries built from a live context's tokens hit the tree far more often than random ones,
        # and whole ones hit whole entries: one entry gets several live hits, and an extended hit
        # retained again nests keys (a cut at random reaches a key's end once per key length).
        # Queries from an entry's own key always hit: most live contexts have moved on from every
        # key. Half the hits are then extended at once by the query's unmatched suffix (or a
        # decode's tokens), as a server prefills: two hits of one entry both write past its key.
        # Half the time the context is retained first, as a server caches a turn before the next
        # request: hits need entries, and with retain a rule of its own (which swarm testing turns
        # off in some runs), only one match in sixteen found an entry to hit.
        if data.draw(st.booleans(), label="retain first"):
            self._do(O.Retain(ctx))
        keys = self.lockstep.reference.keys()
        source = data.draw(st.sampled_from(("whole", "cut", "entry") if keys else ("whole", "cut")), label="query")
        if source == "entry":
            prefix = data.draw(st.sampled_from(keys), label="key")
        else:
            tokens = self.lockstep.live[ctx][1].tokens
            prefix = tokens if source == "whole" else tokens[:data.draw(up_to(len(tokens)), label="cut")]
        query = tuple(prefix) + tuple(extra)
        hit = self._do(O.Match(query))
        if not isinstance(hit, str):        # refused by both sides (a full pool)
            return hit
        matched = self._length(hit)
        if matched:
            self.hits.append(hit)
        if data.draw(st.booleans(), label="prefill"):
            rest = query[matched:] or tuple(data.draw(TOKEN_RUNS, label="decoded"))
            self._do(O.Extend(hit, rest, data.draw(SEEDS, label="seed")))
        return hit

    @precondition(lambda self: self.lockstep is not None and self.lockstep.reference.entries)
    @rule()
    def clear(self):
        self._do(O.Clear())

    @precondition(lambda self: self.lockstep is not None and supports_snapshots(self.lockstep.engine))
    @rule(target=snapshots, ctx=contexts, data=st.data())
    def snapshot(self, ctx, data):
        return self._snapshot(self._or_a_hit(ctx, data))

    def _snapshot(self, ctx: str) -> str:
        self.snapshots_taken += 1
        name = f"s{self.snapshots_taken}"
        self._do(Snapshot(ctx, name))
        type(self).stats.snapshots += 1
        return name

    @precondition(lambda self: self.lockstep is not None and supports_snapshots(self.lockstep.engine))
    @rule(target=contexts, name=snapshots)
    def restore(self, name):
        type(self).stats.restores += 1
        return self._do(Restore(name))

    @precondition(lambda self: self.lockstep is not None and supports_snapshots(self.lockstep.engine))
    @rule(target=contexts, ctx=contexts, data=st.data(), seed=SEEDS)
    def checkpoint(self, ctx, data, seed):
        """An agent's checkpoint: a context (half the time a hit) overwritten, snapshotted and the
        snapshot restored at once. A snapshot that writes something stale (a hit's token ids kept
        from its match, which the overwrite did not update) shows only when that very snapshot is
        restored before the context's length changes; drawn apart, the three seldom line up."""
        ctx = self._or_a_hit(ctx, data)
        tokens = self.lockstep.live[ctx][1].tokens
        if tokens:      # a rewrite: every token written differs from the one it replaces
            start = data.draw(up_to(len(tokens) - 1), label="start")
            n = data.draw(st.integers(1, min(9, len(tokens) - start)), label="n")
            shifts = data.draw(st.lists(st.integers(1, ALPHABET - 1), min_size=n, max_size=n), label="shifts")
            rewritten = tuple((int(t) + shift) % ALPHABET for t, shift in zip(tokens[start:start + n], shifts))
            self._do(O.Overwrite(ctx, start, rewritten, seed))
        name = self._snapshot(ctx)
        type(self).stats.restores += 1
        return self._do(Restore(name))

    # -- invariants -------------------------------------------------------------------

    @invariant()
    def every_invariant_holds(self):
        if self.lockstep is not None:
            type(self).stats.steps += 1
            last = self.lockstep.steps - 1
            # a stretch run unobserved is checked after its last operation only
            if not unobserved(last) or ends_stretch(last):
                self.lockstep.check()
                type(self).stats.checks += 1

    def teardown(self):
        # After a failed step the first violation is the report: a teardown that failed too
        # (as it usually does, on a broken cache) must not replace it.
        run = self.lockstep
        if run is not None and run.failed_at is None:
            try:
                run.finish()
            finally:
                type(self).stats.checks += 1
                self._keep_if_shortest(run)
        elif run is not None:
            self._keep_if_shortest(run)

    def _keep_if_shortest(self, run: Lockstep) -> None:
        """Remember the shortest failing run, so a check stopped mid-shrink reports it."""
        best = type(self).stats.shortest_failure
        if run.failed_at is not None and (best is None or run.failed_at < best.failed_at):
            type(self).stats.shortest_failure = run


class EvictingPoolMachine(LockstepMachine):
    """The machine where a full pool evicts entries for room: one rule more."""

    @rule(ctx=consumes(LockstepMachine.contexts))
    def retain_and_close(self, ctx):
        # A server caches a finished request and lets it go: entries whose pages no context lists are
        # what such a pool evicts, and which one it picks shows only where two or more of them wait (a
        # pool evicting the newest passed 50 examples of both evicting configurations without this).
        # A rule of this class alone: the other configurations' runs stay the ones their catches were
        # measured on (a rule added to all shifts every draw after it).
        if self._length(ctx):
            self._do(O.Retain(ctx))
        self._do(O.Close(ctx))


def machine_for(factory: Factory, config: Config) -> type[LockstepMachine]:
    """A machine class bound to one backend factory and one configuration."""
    evicting = evicts_for_room(config.on_full) or reclaims(config.on_full)
    base = EvictingPoolMachine if config.pool_limit and evicting else LockstepMachine
    return type(f"Lockstep_{config.name.replace('-', '_')}", (base,),
                {"factory": staticmethod(factory), "config": config, "page_sizes": page_sizes(factory, config),
                 "stats": RunStats()})


def run_machine(machine: type[LockstepMachine], settings: Settings) -> None:
    """Run ``machine`` under ``settings``; a derandomized run draws the same sequences in every
    process, whatever it imported before (``fixed_constants``)."""
    with without_local_constants():
        run_state_machine_as_test(machine, settings=settings)
