"""``on_full="reclaim"``: an engine that reclaims cached pages its own way (``tests/foreign/reclaiming.py``
drops trie nodes, newest leaf first, not least recently used) is accepted, and each planted bug is caught.

Each scenario is a handful of operations on a pool of 12 one-position pages, run in lockstep with the
reference, every invariant after every step: milliseconds. Keys: A = four 0s, B = four 1s.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvstate.spec import EntryView, InvariantViolation
from kvstate.spec.errors import CapacityError, ConfigError
from kvstate.spec.observation import black_box
from kvstate.stateful import ops as O
from kvstate.stateful.conform import conform
from kvstate.stateful.lockstep import Lockstep

from foreign import reclaiming
from foreign.reclaiming import CONFIG, Cache

A, B = (0, 0, 0, 0), (1, 1, 1, 1)


def run(factory, ops) -> Lockstep:
    """``ops`` in lockstep, every invariant after every step, then teardown (invariant 6, the pool filled)."""
    lockstep = Lockstep(factory, CONFIG)
    lockstep.run(ops)
    lockstep.finish()
    return lockstep


def cached(key, seed: int, handle: str) -> list[O.Op]:
    """A context holding ``key``, retained and closed: its pages only the cache keeps."""
    return [O.Allocate(), O.Extend(handle, key, seed=seed), O.Retain(handle), O.Close(handle)]


# A and B cached (8 pages), then a context of 6: the pool of 12 is short of 2, which only the cache's
# pages can give. The correct engine drops B's last two nodes (the newest leaves): B hits 2 of 4.
UNDER_PRESSURE = cached(A, 1, "c1") + cached(B, 2, "c2") + [
    O.Allocate(), O.Extend("c3", (2,) * 6, seed=3), O.Match(B), O.Match(A)]


def test_a_reclaiming_engine_passes_and_really_reclaims():
    lockstep = run(reclaiming.factory, UNDER_PRESSURE)
    assert lockstep.engine.reclaimed >= 2
    assert lockstep.reference.pressed


def test_a_shorter_hit_leaves_the_reference_holding_its_first_positions():
    lockstep = Lockstep(reclaiming.factory, CONFIG)
    lockstep.run(UNDER_PRESSURE[:-1])
    engine, reference = lockstep.live["c4"]
    assert len(engine) == len(reference) == 2          # the reference's hit of 4, cut to the engine's 2


def test_a_write_that_needs_no_copy_once_the_cache_let_its_page_go_is_accepted():
    # c1 holds A (retained) but its own copy of position 0, so A's first node only the trie holds; B
    # cached; c3's 8 positions fill the pool, which drops B's nodes and then A's first with A's subtree.
    # c1's positions 1-3 are then its alone in the engine, though A's entry still lists them in the
    # reference: the overwrite copies nothing, and may not be refused for the copy the reference counts.
    ops = [O.Allocate(), O.Extend("c1", A, seed=1), O.Retain("c1"), O.Overwrite("c1", 0, (0,), seed=1)]
    ops += cached(B, 2, "c2") + [O.Allocate(), O.Extend("c3", (2,) * 8, seed=3), O.Overwrite("c1", 1, (0,), seed=4)]
    lockstep = run(reclaiming.factory, ops)
    assert "refused" not in lockstep.history[len(ops) - 1]


def test_reclaim_needs_prefix_values():
    with pytest.raises(ConfigError, match="values='prefix'"):
        CONFIG.with_(values="seeded")


# -- planted bugs ----------------------------------------------------------------------------


class ReclaimsHeldPages(Cache):
    """Reclaims trie nodes whether or not a context holds their slot, and frees the slot outright."""

    def reclaimable(self):
        return sorted(self.nodes(), key=lambda node: (bool(node.children), -node.born))

    def release(self, slots) -> None:
        for slot in slots:
            self.refs[slot] = max(0, self.refs[slot] - 1)
            if self.refs[slot] == 0 and slot not in self.free:
                self.free.append(slot)

    def drop(self, node) -> None:
        super().drop(node)
        for slot in [node.slot]:
            if slot not in self.free:
                self.refs[slot] = 0
                self.free.append(slot)


class ForgetsWithoutPressure(Cache):
    """Keeps one cached key: a retain lets every other branch whose pages only the trie holds go."""

    def retain(self, ctx) -> None:
        super().retain(ctx)
        for node in list(self.root.children.values()):
            if node.token != ctx.token_list[0] and self.refs[node.slot] == 1:
                self.drop(node)


class ForgetsOnceReclaimed(ForgetsWithoutPressure):
    """Once it has reclaimed for room, a retain lets every other branch the trie alone holds go."""

    def retain(self, ctx) -> None:
        (super().retain if self.reclaimed else Cache.retain.__get__(self))(ctx)


class ForgetsOnceWarm(Cache):
    """Once it has handed out as many slots as the pool holds, every allocation drops every trie node
    only the trie holds: its pool is never short by its own count (nor by the reference's)."""

    handed = 0

    def take(self, n: int):
        taken = super().take(n)
        self.handed += n
        if self.handed > self.config.pool_limit:
            while self.reclaimable():
                self.reclaim_one()
        return taken


class ClearKeepsTheTrie(Cache):
    """``clear()`` forgets to drop the trie: a later hit is longer than any retained key allows."""

    def clear(self) -> None:
        pass


class WritesIntoCachedPages(Cache):
    """An overwrite copies a slot only where another context shares it, not where the trie does."""

    def shared_positions(self, ctx, span):
        cached = {node.slot for node in self.nodes()}
        return [i for i in span if self.refs[ctx.slots[i]] - (ctx.slots[i] in cached) > 1]


class RefusesCountingCachedPages(Cache):
    """Counts the trie's pages against the pool when refusing, as ``refuse`` would: refuses with room."""

    def take(self, n: int):
        live = len({slot for slot in range(len(self.refs)) if self.refs[slot]})
        if live + n > self.config.pool_limit:
            raise CapacityError(f"{live} live + {n} needed > {self.config.pool_limit}")
        return super().take(n)


def factory_of(cls):
    def factory(config):
        return cls(config)
    factory.configs = reclaiming.factory.configs
    factory.any_page_size = False
    return factory


def caught(cls, ops) -> str:
    with pytest.raises(InvariantViolation) as violation:
        run(factory_of(cls), ops)
    return str(violation.value)


def test_reclaiming_a_page_a_context_holds_is_caught():
    # A retained with its context c2 still open (A's pages held), B cached; the bug drops A's nodes
    # (the newest) and hands their slots to c3, overwriting what c2 reads.
    ops = cached(B, 1, "c1") + [O.Allocate(), O.Extend("c2", A, seed=2), O.Retain("c2"),
                                O.Allocate(), O.Extend("c3", (2,) * 6, seed=3)]
    run(reclaiming.factory, ops)                 # the correct engine reclaims B's pages instead
    assert "c2" in caught(ReclaimsHeldPages, ops)


def test_forgetting_an_entry_without_pressure_is_caught():
    ops = cached(A, 1, "c1") + cached(B, 2, "c2") + [O.Match(A)]     # 8 of 12 pages: no pressure
    run(reclaiming.factory, ops)
    assert "forgot an entry's pages without pressure" in caught(ForgetsWithoutPressure, ops)


def test_forgetting_an_entry_retained_since_the_last_pressure_is_caught():
    # After UNDER_PRESSURE's reclaim, C = (3, 3) and D = (4, 4) are cached with the pool never short
    # again (at most 12 pages listed): C's pages cannot have gone, though the pool was once short.
    ops = UNDER_PRESSURE + [O.Close("c3"), O.Close("c4"), O.Close("c5")] + cached((3, 3), 4, "c6") + \
        cached((4, 4), 5, "c7") + [O.Match((3, 3))]
    run(reclaiming.factory, ops)
    assert "retained since the pool last may have been short" in caught(ForgetsOnceReclaimed, ops)


def test_forgetting_once_as_many_pages_as_the_pool_were_handed_out_is_caught():
    # 16 pages handed out, never more than 8 live: only an engine recycling in release order
    # (on_full="reclaim-fifo", vLLM) may then reach a cached page; this pool declares "reclaim".
    ops = cached(A, 1, "c1") + [O.Allocate()] + [O.Extend("c2", B, seed=2), O.Truncate("c2", 0)] * 2 + [
        O.Extend("c2", B, seed=2), O.Match(A)]
    run(reclaiming.factory, ops)
    assert "forgot an entry's pages without pressure" in caught(ForgetsOnceWarm, ops)
    fifo = Lockstep(factory_of(ForgetsOnceWarm), CONFIG.with_(on_full="reclaim-fifo"))
    fifo.run(ops)
    assert fifo.reference.pressed and len(fifo.live["c3"][0]) == 0


def test_a_hit_longer_than_any_retained_key_is_caught():
    ops = UNDER_PRESSURE + [O.Clear(), O.Match(A)]
    run(reclaiming.factory, ops)
    assert "engine matched 4 tokens, reference 0" in caught(ClearKeepsTheTrie, ops)


def test_a_shorter_hit_with_wrong_values_is_caught():
    # A hit of B (c3) overwritten at position 1: the bug writes into the cached page, so B's entry reads
    # (1, 2)'s values there; the pool then reclaims B's last two nodes, and the shorter hit c5 keeps
    # position 1. Checked once, at the end: the hit itself is read against the reference's, cut to 2.
    ops = cached(A, 1, "c1") + cached(B, 2, "c2") + [
        O.Match(B), O.Overwrite("c3", 1, (2,), seed=9), O.Close("c3"),
        O.Allocate(), O.Extend("c4", (2,) * 6, seed=3), O.Match(B)]
    for cls in (Cache, WritesIntoCachedPages):
        lockstep = Lockstep(factory_of(cls), CONFIG)
        lockstep.run(ops, check_every_step=False)
        assert len(lockstep.live["c5"][0]) == len(lockstep.live["c5"][1]) == 2
        if cls is Cache:
            lockstep.check()
    with pytest.raises(InvariantViolation, match="c5 position 1"):
        lockstep.check()


def test_refusing_while_contexts_pages_and_the_need_fit_is_caught():
    ops = cached(A, 1, "c1") + [O.Allocate(), O.Extend("c2", (2,) * 10, seed=3)]    # 0 held + 10 <= 12
    run(reclaiming.factory, ops)
    assert "engine CapacityError" in caught(RefusesCountingCachedPages, ops)


# -- the tree tier ---------------------------------------------------------------------------


class ListsItsEntries(Cache):
    """The correct engine with the tree tier: the keys it can still hit whole, in the order retained."""

    def __init__(self, config):
        super().__init__(config)
        self.retained: list[tuple[int, ...]] = []

    def retain(self, ctx) -> None:
        super().retain(ctx)
        self.retained = [key for key in self.retained if key != tuple(ctx.token_list)]
        self.retained.append(tuple(ctx.token_list))

    def clear(self) -> None:
        super().clear()
        self.retained = []

    def observe(self):
        whole = [key for key in self.retained if len(self.walk(list(key))) == len(key)]
        return replace(black_box(), entries=[EntryView(key, tick, None) for tick, key in enumerate(whole)])


class ForgetsAndListsIt(ForgetsWithoutPressure, ListsItsEntries):
    """Forgets without pressure, and its tree tier shows it."""


def test_entries_are_compared_only_until_the_pool_may_have_been_short():
    lockstep = Lockstep(factory_of(ListsItsEntries), CONFIG)
    lockstep.run(UNDER_PRESSURE)                   # B's entry partly reclaimed: the engine lists A alone
    assert [entry.key for entry in lockstep.engine.observe().entries] == [A] and len(lockstep.reference.keys()) == 2
    lockstep.finish()
    ops = cached(A, 1, "c1") + cached(B, 2, "c2")
    with pytest.raises(InvariantViolation, match="entry keys"):        # before any pressure: compared
        run(factory_of(ForgetsAndListsIt), ops)


def test_the_directed_checks_pass_the_reclaiming_engine():
    result = conform(reclaiming.factory, configs=[CONFIG], checks=["pinned semantics", "prefix edges", "races"])[0]
    assert result.passed, result.failure
    races = result.outcomes["races"]        # raced under reclaim too (tests/test_races_reclaim.py): not thread-safe
    assert races.status == "n/a" and races.detail == "the factory does not declare thread_safe = True"


@pytest.mark.slow
def test_conform_passes_the_reclaiming_engine():
    result = conform(reclaiming.factory, configs=[CONFIG])[0]
    assert result.passed, result.failure


# -- sweep findings: correct behaviour the reference once refused ----------------------------


def test_a_retain_through_a_prefix_the_engine_reclaimed_keeps_its_own_page():
    # kvstate sweep, seed 5 (24 steps): after pressure c7 ([0, 1, 2]) is retained through the tree's
    # [0, 1, 2, 2, 0, 2], whose tail the engine reclaimed: it keeps its own page at position 2, which
    # c5 and c6 share, where the reference counted the entry's. c8's 4 pages then fit the engine's 8.
    ops = [O.Allocate(), O.Allocate(), O.Extend("c2", (0,) * 4, seed=0), O.Extend("c1", (0, 1), seed=0),
           O.Fork("c2"), O.Close("c2"), O.Fork("c3"), O.Close("c3"), O.Retain("c1"),
           O.Extend("c1", (2, 2, 0, 2), seed=0), O.Match((0,)), O.Extend("c5", (1, 2), seed=0), O.Retain("c5"),
           O.Fork("c5"), O.Match((0, 1, 2)), O.Extend("c5", (0,), seed=0), O.Clear(), O.Retain("c1"),
           O.Truncate("c1", 0), O.Extend("c6", (0,) * 4, seed=0), O.Retain("c7"), O.Close("c4"), O.Allocate(),
           O.Extend("c8", (0,) * 4, seed=0)]
    lockstep = Lockstep(reclaiming.factory, CONFIG)
    lockstep.run(ops)
    assert "refused" not in lockstep.history[-1] and lockstep.reference.maybe_one_page[1]
    with pytest.raises(CapacityError, match=r"13 pages held by contexts .* \+ 1 needed \(at least 12 \+ 1\)"):
        lockstep.reference.check_room(1)          # a refusal names both counts
    lockstep.finish()


def test_a_retains_copies_past_the_pool_are_pressure():
    # A retain whose page an older entry lists under other tokens may copy it (vLLM caches a copy), a page
    # handed out: under reclaim-fifo the 13th page handed out may reach a cached one. vLLM's retain of c2
    # below evicted (5,)'s block, and the next hit of (5,) was a miss the reference, not yet pressed,
    # rejected as forgetting without pressure (tests/engines/test_vllm.py shows it at block size 16).
    from kvstate.reference import RefCache

    ref = RefCache(CONFIG.with_(on_full="reclaim-fifo"))
    layout = ref.config.layout

    def extend(ctx, tokens):
        ctx.extend(list(tokens), O.prefix_values(layout, len(ctx), tokens))

    c1 = ref.allocate()
    extend(c1, (5,))
    ref.retain(c1)
    c1.close()
    c2 = ref.allocate()
    extend(c2, (1, 1))
    ref.retain(c2)
    c2.overwrite(0, [7], O.prefix_values(layout, 0, (7,)))      # its own copy of position 0
    extend(ref.allocate(), (3,) * 8)                            # the 12th page handed out: no pressure yet
    assert not ref.pressed
    ref.retain(c2)               # position 1 is (1, 1)'s page under other tokens: a copy, the 13th page
    assert ref.pressed


def test_a_retain_the_pool_was_short_for_gets_no_floor_of_its_own():
    """Under ``reclaim`` a hit is at least what the entries retained since the pool last may have been
    short give. The entry whose own retain found it short was among them, though its copies are the very
    pages a short pool may not have made: a correct vLLM-like engine caching only the copies that fit was
    rejected (an outside audit). Its key gets no floor; an entry retained after it does."""
    from kvstate.reference import RefCache

    ref = RefCache(CONFIG)
    layout = ref.config.layout

    def extend(ctx, tokens):
        ctx.extend(list(tokens), O.prefix_values(layout, len(ctx), tokens))

    key = (0, 2, 1, 0, 2)
    c2 = ref.allocate()
    extend(c2, key)
    ref.retain(c2)
    c3, matched = ref.match(key)
    assert matched == 5
    extend(ref.allocate(), (0,) * 4)
    c3.overwrite(0, [1], O.prefix_values(layout, 0, (1,)))      # its own copy of position 0: 10 pages listed
    assert not ref.pressed
    ref.retain(c3)       # positions 1-4 are key's pages under other tokens: 4 copies, 14 pages past 12
    assert ref.pressed
    assert ref.least_hit((1, 2, 1, 0, 2)) == 0
    c5 = ref.allocate()
    extend(c5, (4, 4))
    ref.retain(c5)       # no copy, no pressure: nothing of it can have gone since
    assert ref.least_hit((4, 4, 9)) == 2
