"""Directed check: the prefix tree in the shapes random sequences rarely build.

Random runs over a three-token alphabet seldom hold nested keys at once, retain the
same key twice with other values, retain a context again after overwriting an earlier
block of it, or cut a retained context exactly at a page boundary. Every scenario here
runs through ``Lockstep``, which compares each
``match``'s matched count, every read, and the entries in eviction order with the
reference: the check holds a backend to whatever match semantics its configuration
declares, and the scenarios stay within (or deliberately beyond) ``max_entries``.
"""

from __future__ import annotations

from kvstate.spec.arithmetic import pages_needed
from kvstate.spec.protocol import Config, Factory

from .. import ops as O
from .common import NotApplicable, keeping, retain_new, start
from ..lockstep import Lockstep
from ..snapshots import Restore, Snapshot, supports_snapshots

NESTED = ("match answers with the longest retained key that prefixes the query (an exact key included), "
          "and after that entry is evicted, with the longest that remains")
BEYOND = "past max_entries, retain evicts the least recently used entry, and match answers from what remains"
REPLACED = "retaining a key that is already retained replaces its entry: match returns the newer values"
COLLAPSED = ("evicting an entry whose node splits a shared prefix collapses the split; match afterwards "
             "answers from the entries that remain")
TRUNCATED = ("truncating a fork of a retained context, at any point around a page boundary, changes "
             "neither the entry nor any other holder")
HITS = ("hits of one entry are contexts like any other: a write through one, into the entry's partly used "
        "last page included, shows in no other hit and not in the entry")
HIT_SNAPSHOT = "a snapshot of a hit holds what the hit reads, after the hit was overwritten too"
TIES = ("among entries sharing the longest prefix with the query, the most recently used gives the hit, "
        "and only it is stamped")
ELSEWHERE = ("a hit is a prefix of a retained key, taken from its start: tokens at the start of the query equal "
             "to tokens a key holds further on are no hit, nor is a key's later block after another key's first "
             "(as a block hash that leaves out its parent's finds them)")
ONE_APART = ("a query one token apart from a retained key (at a block's last token or the next block's first) "
             "or one token short of it hits what the declared matching gives: the positions before the "
             "difference, in whole blocks where it matches by block")
REWRITTEN = ("a hit extended, overwritten at its start and retained is an entry of what it then holds: a query "
             "of its rewritten first pages hits those, not the pages it was taken with")
UNOBSERVED = ("two hits of one entry, the tree cleared and one hit closed with nothing observed in between: "
              "the other hit still holds the entry's pages and reads what it read")
MANY_HOLDERS = ("a hundred hits of one entry, each cut by a position, and a fork of each, all held at once and then "
                "closed, with nothing observed in between: every holder reads what it read, and the counts come out exact")
BUDGET = ("the tree's bounds: past max_entries entries or max_pages pages (each entry's own pages, as if "
          "nothing were shared), retain evicts the least recently used entries, never the one just retained")
REHASHED = ("retaining a context again after an overwrite of an earlier block keeps the first entry whole: "
            "the first key's hit stays as long as the reference's (a block cached under one chain of hashes is "
            "copied, not moved, when a key of another chain holds it too)")

_LIMIT = 256      # max_entries past which the "beyond" scenario would only take time


def prefix_edges(factory: Factory, config: Config) -> None:
    """A context retained again after an overwrite of an earlier block, ties, nested keys, eviction past
    max_entries, a key retained twice, eviction that collapses a split, and truncation of a retained fork
    at every point around its page boundaries."""
    run = start(factory, config)
    untested = None
    # retained after an overwrite early: before a scenario presses the pool, a shorter hit is no reclaim's
    for scenario in (ties, _blocks_elsewhere, _one_token_apart, _retained_after_overwrite, _page_budget,
                     _shared_page_budget, _hits_write, _hit_snapshot, _hit_rewritten_and_retained, _hits_unobserved,
                     _many_holders_unobserved,
                     _nested_keys,
                     _beyond_max_entries, _retained_twice, _eviction_collapses, _truncation_around_pages):
        try:
            scenario(run)
        except NotApplicable as reason:     # said once the others have run: a failure among them comes first
            untested = str(reason)
        run.apply(O.Clear())
        run.check()
    run.finish()
    if untested is not None:
        raise NotApplicable(f"{untested}; every other scenario passed")


def _context(run: Lockstep, tokens: tuple[int, ...], seed: int) -> str:
    handle = run.apply(O.Allocate())
    run.apply(O.Extend(handle, tokens, seed=seed))
    return handle


def _retain_prefix(run: Lockstep, source: str, n: int) -> None:
    """Retain the first ``n`` positions of ``source`` (a fork cut to ``n``, retained, closed)."""
    fork = run.apply(O.Fork(source))
    run.apply(O.Truncate(fork, n))
    run.apply(O.Retain(fork))
    run.apply(O.Close(fork))


def _match(run: Lockstep, query: tuple[int, ...]) -> None:
    """Match ``query`` (lockstep compares the matched count), compare every read, close the hit."""
    hit = run.apply(O.Match(query))
    run.check()
    run.apply(O.Close(hit))


def _fill(run: Lockstep, count: int, first: int) -> None:
    """Retain ``count`` one-token keys no other key shares (pushes older entries out). Past
    ``_LIMIT`` entries (an engine with no entry bound) there is nothing to push: none."""
    if run.config.max_entries > _LIMIT:
        return
    for i in range(count):
        handle = _context(run, (first + i,), seed=first + i)
        run.apply(O.Retain(handle))
        run.apply(O.Close(handle))


def ties(run: Lockstep) -> None:
    """Two entries share a prefix the query shares too; which one gives the hit is the recency rule
    (under entry matching neither key prefixes the query: both queries miss, which is checked too).
    Under ``block`` one query shares a token more with the older entry than with the newer, within
    the same last whole block: the newer still gives the hit.

    Both entries must be held at once, or no tie is tested: where ``max_pages`` or the pool cannot
    hold two keys of the shared prefix and one block more (an audit's engine breaking ties passed at
    ``max_pages`` 5 and 6), the keys end one token past the shared prefix, inside a block, and that
    prefix is one block where a longer one does not fit either; where nothing fits, ``NotApplicable``."""
    config = run.config
    if config.max_entries < 2:
        return
    page, block = config.page_tokens, config.block_tokens or 1
    past_a_page = tuple(130 + i for i in range(-(-(page + 1) // block) * block))   # whole blocks, past a page
    shapes = dict.fromkeys(((past_a_page, block), (past_a_page, 1), (past_a_page[:block], 1)))
    fitting = [(shared, tail) for shared, tail in shapes if _both_held(config, len(shared) + tail)]
    if not fitting:
        pages = pages_needed(block + 1, page)
        bounds = [f"max_pages {config.max_pages}" if 0 < config.max_pages < 2 * pages else "",
                  f"a pool of {config.pool_limit} pages" if config.on_full != "fallback" and
                  0 < config.pool_limit < 2 * pages else ""]
        raise NotApplicable(f"ties: {' and '.join(filter(None, bounds))} cannot hold two entries of {block + 1} "
                            f"positions ({pages} pages each) at once, so no tie can be built")
    shared, tail = fitting[0]
    if tail < block:
        _ties_inside_a_block(run, shared)
        return
    first, second = shared + (1,) * block, shared + (2,) * block
    closer_to_first = shared + (1,) + (9,) * block
    with keeping(TIES, run):
        retain_new(run, first, seed=121)
        retain_new(run, second, seed=122)               # the newer: it gives the hit
        _both_kept(run, first, second)
        _match(run, shared + (3,) * block)
        _match(run, closer_to_first)
        _match(run, first)                                # now the first is newer
        _match(run, shared + (3,) * block)
        _match(run, shared[:block])


def _both_held(config: Config, length: int) -> bool:
    """Whether two entries of ``length`` positions fit ``max_pages`` (each counting its own pages) and the
    pool (the two entries' pages, or one entry's and a context's), so neither bound evicts the first (a
    pool that falls back evicts nothing)."""
    pages = 2 * pages_needed(length, config.page_tokens)
    pool = config.pool_limit if config.on_full != "fallback" else 0
    return (not config.max_pages or pages <= config.max_pages) and (not pool or pages <= pool)


def _both_kept(run: Lockstep, first: tuple[int, ...], second: tuple[int, ...]) -> None:
    """Both tied entries are held by the reference: else the scenario tests no tie (the suite's error, not
    the backend's: ``_both_held`` sized it wrong)."""
    kept = {key for key, _ in run.reference.eviction_order()}
    if first not in kept or second not in kept:
        raise RuntimeError(f"suite error: the ties scenario's entries {list(first)} and {list(second)} are not "
                           f"both held (the reference holds {sorted(map(list, kept))}): no tie is tested")


def _ties_inside_a_block(run: Lockstep, shared: tuple[int, ...]) -> None:
    """Ties where keys of a whole block more do not fit: keys one token past ``shared`` (whole blocks),
    whose hits are ``shared`` alone under ``block`` matching, so every query ties. The first key's
    context stays open and is retained again to make its entry the newer (a match cannot: it ties)."""
    block = run.config.block_tokens or 1
    first, second = shared + (1,), shared + (2,)
    with keeping(TIES, run):
        held = _context(run, first, seed=121)
        run.apply(O.Retain(held))
        retain_new(run, second, seed=122)               # the newer: it gives the hit
        _both_kept(run, first, second)
        _match(run, shared + (3,) * block)
        _match(run, shared + (1,) + (9,) * block)         # a token more in common with the first
        run.apply(O.Retain(held))                         # the first retained again: now the newer
        _match(run, shared + (3,) * block)
        _match(run, shared[:block])
        run.apply(O.Close(held))


def _retained_after_overwrite(run: Lockstep) -> None:
    """A key of two pages (whole blocks) retained, its first block overwritten, retained again: the later
    pages are the first entry's and the second's at once. Then the same through a fork of the second."""
    size = max(run.config.page_tokens, run.config.block_tokens or 1)
    first = tuple(400 + i for i in range(2 * size))
    second, third = (401,) + first[1:], (402,) + first[1:]
    with keeping(REHASHED, run):
        held = _context(run, first, seed=191)
        run.apply(O.Retain(held))
        run.apply(O.Overwrite(held, 0, second[:1], seed=192))
        run.apply(O.Retain(held))
        _match(run, first)
        _match(run, second)
        fork = run.apply(O.Fork(held))
        run.apply(O.Overwrite(fork, 0, third[:1], seed=193))
        run.apply(O.Retain(fork))
        for key in (first, second, third):
            _match(run, key)
        run.apply(O.Close(fork))
        run.apply(O.Close(held))


def _blocks_elsewhere(run: Lockstep) -> None:
    """A key of two whole blocks, matched by queries that hold its second block first: no hit there,
    and a hit of one block where only the first agrees (a chain of block hashes that leaves out each
    block's parent finds the second block at the query's start). Then a key of one other block, and
    a query of it followed by the first key's second block: one block (a hash of a block and its
    index, not its parent, finds that second block after the other first block: an audit's engine so
    hashed passed every check at vLLM's block size 16). Three blocks in all, so a tight ``max_pages``
    still holds both keys."""
    block = run.config.block_tokens or run.config.page_tokens
    first, second = tuple(150 + i for i in range(block)), tuple(170 + i for i in range(block))
    other = tuple(190 + i for i in range(block))
    with keeping(ELSEWHERE, run):
        retain_new(run, first + second, seed=131)
        _match(run, second)
        _match(run, second + first)
        _match(run, first + first)
        _match(run, first + second)
        retain_new(run, other, seed=132)
        _match(run, other + second)


def _one_token_apart(run: Lockstep) -> None:
    """A key of two whole blocks, matched by queries that differ from it in one token: the first block's
    last, the second block's first, the second block's last; and by the key one token short. Random
    runs almost never draw a query that agrees with a key up to a block's last token: two audits' real
    engines passed every check at block size 16 with a block hash that left out its last token (vLLM),
    and with a match rounded to whole blocks one token too far up (SGLang's page alignment). Each query
    meets the key alone in a new tree: an earlier hit can split a radix tree's node at a block
    boundary, and the rounding showed only inside one node."""
    block = run.config.block_tokens or run.config.page_tokens
    key = tuple(230 + i % 7 for i in range(2 * block))
    apart = 229          # in no key here
    queries = [key[:at] + (apart,) + key[at + 1:] for at in sorted({2 * block - 1, block - 1, block})]
    with keeping(ONE_APART, run):
        for query in [*queries, key[:-1], key]:
            retain_new(run, key, seed=136)
            _match(run, query)
            run.apply(O.Clear())


def _hit_rewritten_and_retained(run: Lockstep) -> None:
    """A hit of two of an entry's three pages, extended, overwritten at its first position and retained;
    then a query of its first two pages as rewritten. An audit's mutant of kvstate's engine (s73: a
    holding that kept listing the pages its hit was taken with after a write copied the first) hit
    the old pages, and passed every check of ``ci`` in four configurations."""
    page = run.config.page_tokens
    key = tuple(300 + i for i in range(3 * page))
    with keeping(REWRITTEN, run):
        retain_new(run, key, seed=137)
        hit = run.apply(O.Match(key[:2 * page]))
        run.apply(O.Extend(hit, (350, 351), seed=138))
        run.apply(O.Overwrite(hit, 0, (299,), seed=139))
        run.apply(O.Retain(hit))
        run.apply(O.Close(hit))
        _match(run, (299,) + key[1:2 * page])


def _hits_unobserved(run: Lockstep) -> None:
    """Two hits of one entry's first page and a half (its whole key under ``entry``), then ``clear()`` and
    the first hit closed, with no observation between the operations (``watched=False``; ``observe()``
    may settle books a backend keeps lazily), then every read compared. An audit's mutant of kvstate's engine (s73), whose pending
    count took a second hit of the same pages as none, freed them under the second hit; every check
    observing before each operation settled the count first and passed it (only ``races`` caught it)."""
    page = run.config.page_tokens
    key = tuple(320 + i for i in range(2 * page))
    query = key if run.config.match == "entry" else key[:page + -(-page // 2)]      # an entry hits whole
    retain_new(run, key, seed=140)
    run.check()
    with keeping(UNOBSERVED, run):
        first = run.apply(O.Match(query), watched=False)
        second = run.apply(O.Match(query), watched=False)
        run.apply(O.Clear(), watched=False)
        run.apply(O.Close(first), watched=False)
        run.check()
        run.apply(O.Close(second))


HOLDERS = 100
"""``_many_holders_unobserved``'s hits (and forks): past any batch a backend settles its counts in (kvstate's
engine adds deferred counts once 64 are pending, ``impl/refcounts.py``)."""


def _many_holders_unobserved(run: Lockstep) -> None:
    """``HOLDERS`` hits of an entry's first page and a half (its whole key under ``entry``), each truncated
    by one position, and a fork of each, all open at once, then all closed, observed only before and after
    each half. A mutant of kvstate's engine that dropped its pending counts once 64 were pending passed the
    whole default suite and ``conform``: the lockstep runs observed (and so settled the counts) before every
    step and held at most 8 contexts, and no scenario held more than a few hits unobserved."""
    page = run.config.page_tokens
    key = tuple(330 + i % 7 for i in range(3 * page))
    query = key if run.config.match == "entry" else key[:page + -(-page // 2)]
    retain_new(run, key, seed=141)
    run.check()
    with keeping(MANY_HOLDERS, run):
        hits = [run.apply(O.Match(query), watched=False) for _ in range(HOLDERS)]
        for hit in hits:      # each its own length: a fork of it then shares no other hit's holding
            run.apply(O.Truncate(hit, len(run.live[hit][1]) - 1), watched=False)
        forks = [run.apply(O.Fork(hit), watched=False) for hit in hits]
        run.check()
        for handle in hits + forks:
            run.apply(O.Close(handle), watched=False)
        run.check()


def _page_budget(run: Lockstep) -> None:
    """Long and short keys against both bounds: which entries stay is what the bound that binds
    first says (the reference counts each entry's own pages)."""
    page, limit = run.config.page_tokens, run.config.max_entries
    if limit > _LIMIT:
        return
    lengths = [3 * page + 1, 1, 2 * page, page + 1, 1, 4 * page][:limit + 2]
    with keeping(BUDGET, run):
        for i, n in enumerate(lengths):
            retain_new(run, tuple(200 + 10 * i + j % 3 for j in range(n)), seed=140 + i)
            run.check()
        for i, n in enumerate(lengths):
            _match(run, tuple(200 + 10 * i + j % 3 for j in range(n)))


def _shared_page_budget(run: Lockstep) -> None:
    """Entries that share their first pages through hits, under ``max_pages``: each counts its own pages
    as if nothing were shared, so fewer stay than a count of shared pages once would keep (an audit's
    engine counting them once passed every check at the ci budget)."""
    page, budget = run.config.page_tokens, run.config.max_pages
    if not budget or run.config.max_entries > _LIMIT:
        return
    shared = tuple(300 + j % 5 for j in range(2 * page))
    suffixes = [(310 + i,) * page for i in range(budget)]
    with keeping(BUDGET, run):
        retain_new(run, shared, seed=180)
        for i, suffix in enumerate(suffixes):
            hit = run.apply(O.Match(shared + suffix))          # the shared pages, held through the hit
            run.apply(O.Truncate(hit, min(len(shared), len(run.live[hit][1]))))
            run.apply(O.Extend(hit, shared[len(run.live[hit][1]):] + suffix, seed=181 + i))
            run.apply(O.Retain(hit))
            run.apply(O.Close(hit))
            run.check()
        for suffix in suffixes:
            _match(run, shared + suffix)


def _hits_write(run: Lockstep) -> None:
    """Three live hits of one entry whose key ends inside a page, each extending and overwriting."""
    page = run.config.page_tokens
    key = tuple(150 + i for i in range(page + max(1, page // 2)))      # ends inside its second page
    with keeping(HITS, run):
        retain_new(run, key, seed=151)
        hits = [run.apply(O.Match(key + (9,))) for _ in range(3)]
        for i, hit in enumerate(hits):
            run.apply(O.Extend(hit, (i, i + 1), seed=152 + i))        # into the shared, partly used page
        run.check()
        for i, hit in enumerate(hits):
            run.apply(O.Overwrite(hit, 0, (i,), seed=160 + i))
        run.check()
        _match(run, key)                                    # the entry still reads its own values
        for hit in hits:
            run.apply(O.Close(hit))


def _hit_snapshot(run: Lockstep) -> None:
    """overwrite -> snapshot -> restore of a hit (new token ids at its front) reads what the hit read."""
    if not supports_snapshots(run.engine):
        return
    key = tuple(170 + i for i in range(run.config.page_tokens + 1))
    with keeping(HIT_SNAPSHOT, run):
        retain_new(run, key, seed=171)
        hit = run.apply(O.Match(key))
        if hit is None or not len(run.live[hit][1]):
            return                                           # a block match too short to hit: nothing to snapshot
        run.apply(O.Overwrite(hit, 0, (7,), seed=172))
        run.apply(Snapshot(hit, "hit"))
        run.apply(Restore("hit"))
        run.check()
        for handle in list(run.live)[-2:]:
            run.apply(O.Close(handle))


def _nested_keys(run: Lockstep) -> None:
    page, limit = run.config.page_tokens, run.config.max_entries
    length = 3 * page + 2
    tokens = tuple(10 + i for i in range(length))
    spread = [length, page + 1, 2 * page, 1, 2 * page + 1, page, length - 1]
    lengths = list(dict.fromkeys(k for k in spread if 1 <= k <= length))[:min(limit, 4)]
    with keeping(NESTED, run):
        source = _context(run, tokens, seed=21)
        for k in sorted(lengths, reverse=True):          # the longest first: it is the oldest
            _retain_prefix(run, source, k)
        run.apply(O.Close(source))
        run.check()
        _match(run, tokens + (999,))                       # the longest must win
        for k in sorted(lengths):
            _match(run, tokens[:k])                        # an exact key
            if k < length:
                _match(run, tokens[:k + 1])                # just past a key
        _match(run, ())
        _match(run, (tokens[0] + 1000,))
        for k in sorted(lengths)[:-1]:
            _match(run, tokens[:k])                        # every shorter key is now newer than the longest
        _fill(run, limit - len(lengths) + 1, first=5000)   # one past the limit: the longest goes
        _match(run, tokens + (999,))
        _match(run, tokens)


def _beyond_max_entries(run: Lockstep) -> None:
    limit = run.config.max_entries
    if limit > _LIMIT:
        return
    tokens = tuple(300 + i for i in range(limit + 1))
    with keeping(BEYOND, run):
        handle = run.apply(O.Allocate())
        for token in tokens:                               # nested keys, shortest (oldest) first
            run.apply(O.Extend(handle, (token,), seed=token))
            run.apply(O.Retain(handle))
        run.check()
        _match(run, tokens + (1,))
        _match(run, tokens[:1])                            # the evicted shortest key
        _match(run, tokens[:2])
        run.apply(O.Truncate(handle, 1))                   # retain the evicted key again: it is back
        run.apply(O.Retain(handle))
        _match(run, tokens[:2])
        run.apply(O.Close(handle))


def _retained_twice(run: Lockstep) -> None:
    page = run.config.page_tokens
    key = tuple(50 + i for i in range(page + 1))           # one position into the second page
    with keeping(REPLACED, run):
        older = _context(run, key, seed=31)
        newer = _context(run, key, seed=32)
        run.apply(O.Retain(older))
        run.apply(O.Retain(newer))
        run.check()
        _match(run, key + (7,))
        _match(run, key)
        run.apply(O.Overwrite(older, 0, key[:1], seed=33))  # values change, the key does not
        run.apply(O.Retain(older))
        _match(run, key)
        run.apply(O.Close(older))
        run.apply(O.Close(newer))
        _match(run, key)


def _eviction_collapses(run: Lockstep) -> None:
    page, limit = run.config.page_tokens, run.config.max_entries
    shared = tuple(70 + i for i in range(page + 1))        # the split lies one position into page 2
    first, second = shared + (1, 2), shared + (3,)
    with keeping(COLLAPSED, run):
        for tokens, seed in ((first, 41), (second, 42)):
            handle = _context(run, tokens, seed=seed)
            run.apply(O.Retain(handle))
            run.apply(O.Close(handle))
        run.check()
        _match(run, second + (9,))                         # second is now newer than first
        _fill(run, limit - 1, first=6000)                  # one past the limit: first goes
        _match(run, second + (9,))
        _match(run, first)
        _match(run, shared)
        run.apply(O.Clear())
        _match(run, second)


def _truncation_around_pages(run: Lockstep) -> None:
    page = run.config.page_tokens
    length = 3 * page + 2
    tokens = tuple(90 + i for i in range(length))
    points = sorted({n for k in range(4) for n in (k * page - 1, k * page, k * page + 1) if 0 <= n <= length}
                    | {length - 1, length})
    with keeping(TRUNCATED, run):
        retained = _context(run, tokens, seed=51)
        run.apply(O.Retain(retained))
        fork = run.apply(O.Fork(retained))
        for n in points:
            cut = run.apply(O.Fork(fork))
            run.apply(O.Truncate(cut, n))
            run.check()
            run.apply(O.Extend(cut, (2, 2, 2), seed=60 + n))   # regrow over pages others share
            run.apply(O.Overwrite(cut, max(n - 1, 0), (4,), seed=80 + n))
            run.check()
            _match(run, tokens + (5,))
            run.apply(O.Close(cut))
        for n in reversed(points):                         # the retained context itself, cut step by step
            run.apply(O.Truncate(retained, n))
            run.check()
            _match(run, tokens)
        run.apply(O.Close(fork))
        run.apply(O.Close(retained))
