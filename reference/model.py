"""The reference model: deliberately stupid, obviously correct.

Every context owns a full float32 copy of exactly what a read must return, plus
its own token list. Nothing is shared. The prefix "tree" is a flat list scanned
linearly, once per declared match semantics (``spec/semantics.py``). Recency uses
a logical clock, so entry sets and eviction order compare exactly.

The page pool (``on_full``) is modelled by counting, not by sharing: every holder
keeps a list of page *labels* naming the pages an engine would hold. A fork copies
the labels; a write into a page whose label another holder lists takes a fresh label
(the copy ``writable`` would make); new pages take fresh labels. Live pages are the
distinct labels. No value is ever shared.

A label is a tuple of names, one per way an engine may share pages (``SHARINGS``):

- ``FORKS``: as forks, hits and retains share them;
- ``WHOLE_PAGES``: as well as that, as an engine keying K/V by prefix shares them under
  ``values="prefix"``: its retain keeps the page an older entry holds for each whole page of the
  key it already has, and the context and the new entry hold that page instead of their own
  (SGLang's insert, which frees the request's slots the tree already held);
- ``SAME_KEY``: as ``WHOLE_PAGES``, and a retain of a key the tree holds already keeps that
  entry's partly filled last page too;
- ``CACHED_FIRST``: as forks share them, except that a retain's new entry holds, for each whole page
  of its key an older entry already covers, that entry's page, while the context keeps its own: a
  hit then shares the page cached first (vLLM caches a block hash once for its hits:
  ``get_cached_block`` hands out the first block cached under it);
- ``KEEP_ENTRY``: as forks share them, except that a retain of a key the tree holds already keeps
  that entry as it is, every page of it, while the context keeps its own (a cache whose insert of a
  key it has only refreshes it: "if the key is there, touch it").

Under ``values="seeded"`` the names always agree. Where the counts disagree on whether a full pool
has room, either answer is right, and the reference does what the engine under test did
(``check_room``); where they disagree on which entries a pool that evicts lets go, the reference
keeps the entries the engine kept, where it can see them (``make_room``). An engine shares one way
for the whole run: each such answer narrows the ways still open (``viable``) to those it agrees
with, and later answers are judged by those alone.

Under ``on_full="reclaim"`` the engine reclaims entries' pages its own way, so nothing here follows
its evictions: the entries stay (an upper bound on any hit), ``pressed`` says when the pool may first
have been short, and the lockstep truncates a hit context to a shorter hit the engine returned. Once
pressed, a retain that takes an older entry's page (``WHOLE_PAGES``, ``SAME_KEY``) may find it gone,
keep the context's own page instead and give that to every later hit: the two names may then be one
page or two (``maybe_one_page``). Rooms are judged between the two counts: names as they stand (the
most pages the engine may hold) and names that may be one page counted once (the fewest). The keys
retained since the pool last may have been short still hold every page (``least_hit``).

Under ``match="block"`` no hit reaches past an entry's last whole block, so whether the engine keeps
the pages past it (a retained key's partly filled last block, which vLLM never caches) is its own
choice: rooms are judged between counting them and not (``_listed``), as for ``reclaim``. A pool that
evicts evicts both ways, as the ways of sharing do, and an eviction only one of them gives closes the
other for the rest of the run (``tails_left_out``).
"""

from __future__ import annotations

from operator import countOf, itemgetter
from typing import Callable

import numpy as np

from kvstate.spec import precision as precisions
from kvstate.spec.arithmetic import pages_needed, pages_touched
from kvstate.spec.errors import (CapacityError, ContextClosedError, EmptyContextError, PositionError,
                                 PrecisionRangeError, SnapshotPrecisionError, refuse_with_all)
from kvstate.spec.layout import check_tokens, check_values, is_torch_tensor, require_finite
from kvstate.spec.protocol import Config
from kvstate.spec.semantics import (counts_only_contexts, entry_pages, evicts_for_room, hit_length, may_refuse,
                                    reclaims, reclaims_once_warm)

# Which name of a page label is which: one per way of sharing pages (see the module docstring).
FORKS, WHOLE_PAGES, SAME_KEY, CACHED_FIRST, KEEP_ENTRY = SHARINGS = (0, 1, 2, 3, 4)
_COUNTED = {FORKS: "as forks share pages", WHOLE_PAGES: "where retains share whole pages by prefix",
            SAME_KEY: "where a retained key keeps its last page too",
            CACHED_FIRST: "where hits share the page cached first",
            KEEP_ENTRY: "where a key retained again keeps its entry"}      # a refusal's words for each
_CONTEXT_KEEPS_ITS_OWN = (CACHED_FIRST, KEEP_ENTRY)     # ways whose retain leaves the context its own pages


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _count(tokens) -> int | None:
    """How many token ids ``tokens`` holds, judged without judging them (None: cannot tell)."""
    if isinstance(tokens, np.ndarray) or is_torch_tensor(tokens):
        return len(tokens) if tokens.ndim == 1 else None
    return len(tokens) if isinstance(tokens, (list, tuple)) else None


def _numbers(kv) -> np.ndarray | None:
    """``kv`` as a NumPy float array whatever its shape, for the checks of the values themselves
    (None when it holds no floats to judge)."""
    if hasattr(kv, "detach"):
        kv = kv.detach().cpu().numpy()
    return kv if isinstance(kv, np.ndarray) and kv.dtype.kind == "f" else None


class RefContext:
    def __init__(self, cache: "RefCache", values: np.ndarray, tokens: list[int], labels: list[tuple[int, ...]]):
        self.cache = cache
        self.values = values      # (n, layers, 2, kv_heads, head_dim) float32, as reads return it
        self.token_list = tokens
        self.labels = labels      # the pages an engine would hold, by label (see the module docstring)
        self.closed = False

    def __len__(self) -> int:
        return len(self.token_list)

    def _held(self) -> int:
        """The length positions are judged against: none for a closed context, which holds nothing (a
        backend that frees everything at close reports 0, and its ``PositionError`` for a position of
        a closed context is as right as ``ContextClosedError``; both apply, ``refuse_with_all``)."""
        return 0 if self.closed else len(self)

    def _require_open(self) -> None:
        if self.closed:
            raise ContextClosedError("reference context is closed")

    @property
    def tokens(self) -> list[int]:
        self._require_open()
        return list(self.token_list)

    def _checked_write(self, tokens, kv, start: int | None) -> tuple[list[int], np.ndarray]:
        """The tokens and the values as stored, for a write at ``start`` (None: an extend).

        Every check of spec/errors.py runs on its own, and a refusal names every one that
        failed (``refuse_with_all``): when several inputs are wrong, any of those errors is a
        right answer for a backend. The first, in the order spec/errors.py lists, is ours.
        """
        layout, precision = self.cache.config.layout, self.cache.config.precision
        ok: dict[str, object] = {}

        def token_ids():
            ok["tokens"] = [int(t) for t in check_tokens(tokens)]

        def count() -> int | None:      # how many positions, where that can be told at all
            return len(ok["tokens"]) if "tokens" in ok else _count(tokens)

        def dtype_and_shape():
            if count() is not None:
                ok["kv"] = check_values(layout, kv, count())

        def positions():
            if start is not None and (not _is_int(start) or start < 0 or start + (count() or 0) > self._held()):
                raise PositionError(f"overwrite of {count()} positions at {start!r} is outside length {self._held()}")
            ok["positions"] = True

        def values():
            numbers = _numbers(kv)
            if numbers is not None:
                require_finite(numbers)
                if numbers.dtype == np.float32:
                    ok["values"] = precisions.roundtrip(precision, numbers)

        def pool():
            if {"tokens", "kv", "positions"} <= ok.keys() and not self.closed:
                self.cache.check_room(*self._needs(len(self) if start is None else start, count(), start is None))

        refuse_with_all(token_ids, dtype_and_shape, self._require_open, positions, values, pool)
        return ok["tokens"], ok["values"]

    def _needs(self, start: int, n: int, extend: bool) -> tuple[dict[int, int], dict[int, int] | None]:
        """The pages a write of positions [start, start + n) takes (its copies and new pages), per way of
        sharing still open (one, under ``values="seeded"``: every step pays for the ways it counts),
        at most; and, where entries' pages are reclaimed the engine's way (``reclaim``), the least it
        may take: a page only entries share with it may be gone from them, so only copies of pages
        contexts share count (and the most counts a page shared under any name it may have)."""
        def need(least: bool) -> dict[int, int]:
            return {sharing: sum(self._pages_to_write(start, n, extend, sharing, least))
                    for sharing in self.cache.viable}
        fewer = reclaims(self.cache.config.on_full) or self.cache.tails_optional
        return need(False), need(True) if fewer else None

    def _pages_to_write(self, start: int, n: int, extend: bool, sharing: int,
                        least: bool = False) -> tuple[int, int]:
        """(shared pages the write must copy, new pages it appends) for positions [start, start + n),
        pages shared as ``sharing`` shares them: with any holder, under any name a page may have
        (``RefCache.maybe_one_page``); or, where ``least``, by its own name, with other contexts (under
        ``reclaim``) or with holders that must keep it (an entry's optional tail aside: ``_listed``)."""
        if not n:
            return 0, 0
        page_tokens, contexts_only = self.cache.config.page_tokens, least and reclaims(self.cache.config.on_full)
        first, end = pages_touched(start, start + n, page_tokens)
        copies = sum(self.cache.shared(self.labels[i], sharing, contexts_only=contexts_only, merged=not least,
                                       fewest=least)
                     for i in range(first, min(end, len(self.labels))))
        return copies, (pages_needed(start + n, page_tokens) - len(self.labels) if extend else 0)

    def extend(self, tokens, kv) -> None:
        tokens, values = self._checked_write(tokens, kv, None)
        if not tokens:
            return
        start, stop = len(self), len(self) + len(tokens)
        self.cache.make_room(*self._needs(start, len(tokens), True))
        fresh = self._pages_to_write(start, len(tokens), True, FORKS)[1]
        self._relabel(range(*pages_touched(start, stop, self.cache.config.page_tokens)))
        self.labels = self.labels + [self.cache.new_label() for _ in range(fresh)]
        self.values = np.concatenate([self.values, values])
        self.token_list = self.token_list + tokens

    def overwrite(self, start: int, tokens, kv) -> None:
        tokens, values = self._checked_write(tokens, kv, start)
        if not tokens:
            return
        self.cache.make_room(*self._needs(start, len(tokens), False))
        self._relabel(range(*pages_touched(start, start + len(tokens), self.cache.config.page_tokens)))
        self.values = self.values.copy()
        self.values[start:start + len(tokens)] = values
        self.token_list = self.token_list[:start] + tokens + self.token_list[start + len(tokens):]

    def _relabel(self, indexes) -> None:
        """The copy ``writable`` makes: a page another holder lists gets a name of its own, in each way of
        sharing still open where another holder lists it (the closed ways follow the first open one:
        nothing counts them again)."""
        viable = self.cache.viable
        for i in indexes:
            if i < len(self.labels):
                copied = {sharing: self.cache.shared(self.labels[i], sharing) for sharing in viable}
                if any(copied.values()):
                    fresh = self.cache.new_label()
                    label = tuple(fresh[sharing] if copied.get(sharing, copied[viable[0]]) else self.labels[i][sharing]
                                  for sharing in SHARINGS)
                    self.labels = self.labels[:i] + [label] + self.labels[i + 1:]

    def read(self, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        stop = self._held() if stop is None else stop

        def positions():
            if not (_is_int(start) and _is_int(stop) and 0 <= start <= stop <= self._held()):
                raise PositionError(f"read of [{start}, {stop}) outside length {self._held()}")
        refuse_with_all(self._require_open, positions)
        return self.values[start:stop].copy(), np.array(self.token_list[start:stop], dtype=np.int64)

    def contents(self) -> tuple[np.ndarray, np.ndarray]:
        """What ``read()`` of the whole context returns, the values not copied: for the invariant
        check after every step, which only compares them."""
        self._require_open()
        return self.values, np.array(self.token_list, dtype=np.int64)

    def fork(self) -> "RefContext":
        self._require_open()
        return self.cache._adopt(self.values.copy(), list(self.token_list), list(self.labels))

    def truncate(self, n: int) -> None:
        def positions():
            if not (_is_int(n) and 0 <= n <= self._held()):
                raise PositionError(f"truncate to {n} outside length {self._held()}")
        refuse_with_all(self._require_open, positions)
        self.values = self.values[:n].copy()
        self.token_list = self.token_list[:n]
        self.labels = self.labels[:pages_needed(n, self.cache.config.page_tokens)]

    def snapshot(self) -> tuple[str, np.ndarray, list[int]]:
        """What a snapshot holds: the precision and a copy of what a read returns."""
        self._require_open()
        return self.cache.config.precision, self.values.copy(), list(self.token_list)

    def close(self) -> None:
        if self.closed:
            raise ContextClosedError("reference context is already closed")
        self.closed = True
        self.cache.contexts.remove(self)


class RefCache:
    def __init__(self, config: Config):
        self.config = config
        self.contexts: list[RefContext] = []
        self.entries: list[list] = []    # [key tuple, private RefContext, tick]
        self.clock = 0
        self.labels_issued = 0
        # Whether the engine under test refused the operation now being checked for a full pool: set by
        # the lockstep before the reference runs it (None: no engine), read only where either answer is right.
        self.engine_refused: bool | None = None
        # What gives the keys of the entries the engine kept after that operation, where its evictions may
        # go several ways (set by the lockstep: values="prefix", a pool that evicts, the tree tier; None:
        # unknown). Called only where the ways of sharing still open would keep different entries.
        self.engine_keys: Callable[[], set[tuple[int, ...]] | None] | None = None
        # The ways of sharing (``SHARINGS``) the engine's answers so far agree with, narrowed at each
        # answer only some of them give: the run is judged by one engine, sharing one way.
        self.viable: tuple[int, ...] = SHARINGS if config.values == "prefix" else (FORKS,)
        # Under on_full="reclaim": whether the pool may have been short yet (``_note_pressure``). From then on
        # the engine may have reclaimed entries' pages, so its hits may be shorter; this reference evicts
        # nothing for room, and its entries stay an upper bound on what a hit holds.
        self.pressed = False
        # Under on_full="reclaim", per way of sharing: page names that may be one page in the engine, as
        # a union-find (a name -> a name of the same page; ``_one_name``). Empty until pressed.
        self.maybe_one_page: dict[int, dict[int, int]] = {sharing: {} for sharing in SHARINGS}
        # Under on_full="reclaim": the keys retained since the pool last may have been short. Nothing
        # has been reclaimed since, so every page of theirs is still there (``least_hit``); once pressed,
        # only the newest where the engine's retain may have evicted for the bounds (``_engine_may_pass_bounds``).
        self.retained_since_pressure: set[tuple[int, ...]] = set()
        # Under on_full="reclaim", once pressed: the entries a retain evicted for the tree's bounds. The
        # engine may have reclaimed others instead, so it holds fewer and evicts fewer for the bounds: these
        # stay an upper bound on a hit (and their pages may still be live), never part of the floor.
        self.bounded_out: list[list] = []
        # Under on_full="reclaim", per entry's key (``entries`` and ``bounded_out``): the keys retained since the
        # engine may last have used it (a match or retain sharing a token with it), with no pressure between.
        # Each is newer there and still held, so once ``max_entries`` are, an engine evicting least recently
        # used for the bound has let it go: it leaves ``bounded_out``.
        self.retained_after: dict[tuple[int, ...], set[tuple[int, ...]]] = {}
        # Under match="block": the ways of counting an entry's pages past its last whole block, which no hit
        # reaches, still open: kept (False) or left out (True, ``_listed``). An engine keeps them or not for
        # the whole run: an eviction only one way gives closes the other (``make_room``).
        self.tails_left_out: tuple[bool, ...] = (False, True) if config.match == "block" else (False,)

    # -- page labels: the pool, counted ------------------------------------------------

    def new_label(self) -> tuple[int, ...]:
        """A page no holder lists yet, by every name."""
        self.labels_issued += 1
        return (self.labels_issued,) * len(SHARINGS)

    @property
    def tails_optional(self) -> bool:
        """Whether an entry's pages past its last whole block may still be left out (``_listed``)."""
        return True in self.tails_left_out

    def keys(self, bounded_out: bool = False) -> list[tuple[int, ...]]:
        """The entries' keys, in the order they were last retained (``bounded_out``: and, under ``reclaim``,
        the keys evicted for the tree's bounds once pressed, which an engine may still hold)."""
        return [entry[0] for entry in self.entries + (self.bounded_out if bounded_out else [])]

    def _holders(self) -> list[RefContext]:
        return self.contexts + [entry[1] for entry in self.entries + self.bounded_out]

    def _listed(self, holders: list[RefContext], fewest: bool = False) -> list[list[tuple[int, ...]]]:
        """The labels each of ``holders`` lists; ``fewest``: the fewest the engine must keep, so under
        ``match="block"`` an entry's only up to its last whole block (a hit never reaches past it)."""
        if not (fewest and self.tails_optional):
            return [holder.labels for holder in holders]
        block, size, contexts = self.config.block_tokens, self.config.page_tokens, {id(ctx) for ctx in self.contexts}
        return [holder.labels if id(holder) in contexts
                else holder.labels[:pages_needed(len(holder) - len(holder) % block, size)] for holder in holders]

    def holders_of(self, label: tuple[int, ...], sharing: int = FORKS, contexts_only: bool = False,
                   merged: bool = False, fewest: bool = False) -> int:
        """How many holders list ``label``'s page (``merged``: or a name that may be the same page;
        ``fewest``: as the fewest pages the engine must keep, ``_listed``)."""
        named = self._namer(sharing, merged)
        name = named(label)
        holders = self.contexts if contexts_only else self._holders()
        return sum(countOf(map(named, labels), name) for labels in self._listed(holders, fewest))

    def shared(self, label: tuple[int, ...], sharing: int = FORKS, contexts_only: bool = False,
               merged: bool = False, fewest: bool = False) -> bool:
        return self.holders_of(label, sharing, contexts_only, merged, fewest) > 1

    def live_pages(self, sharing: int = FORKS) -> int:
        return _pages(self._holders(), self._namer(sharing))

    def context_pages(self, sharing: int = FORKS, merged: bool = False) -> int:
        """Pages that would stay live if every tree entry were evicted: those contexts list (``merged``:
        names that may be one page counted once, the fewest the engine may hold)."""
        return _pages(self.contexts, self._namer(sharing, merged))

    def _namer(self, sharing: int, merged: bool = False) -> Callable[[tuple[int, ...]], int]:
        """A label's name as ``sharing`` names it; ``merged``: one name for names that may be one page."""
        if merged and self.maybe_one_page[sharing]:
            return lambda label: self._one_name(label[sharing], sharing)
        return itemgetter(sharing)

    def _one_name(self, name: int, sharing: int) -> int:
        parent = self.maybe_one_page[sharing]
        while name in parent:
            name = parent[name]
        return name

    def _may_be_one_page(self, a: int, b: int, sharing: int) -> None:
        a, b = self._one_name(a, sharing), self._one_name(b, sharing)
        if a != b:
            self.maybe_one_page[sharing][max(a, b)] = min(a, b)

    def check_room(self, needed: int | dict[int, int], least: dict[int, int] | None = None) -> None:
        """``CapacityError`` when ``on_full`` refuses an operation needing ``needed`` new pages (a count,
        or one count per way of sharing still open, ``RefContext._needs``); changes nothing. ``least``:
        the fewest it may need (under ``reclaim``; else exactly ``needed``)."""
        limit, on_full, needs = self.config.pool_limit, self.config.on_full, self._per_sharing(needed)
        least = needs if least is None else least
        if not any(needs.values()) or not limit or not may_refuse(on_full):
            return
        counted = self.contexts if counts_only_contexts(on_full) else self._holders()
        full = {sharing: _pages(counted, self._namer(sharing)) + needs[sharing] > limit for sharing in self.viable}
        if not any(full.values()):
            return
        fewest = self._listed(counted, fewest=True)
        room = {sharing: _distinct(fewest, self._namer(sharing, merged=True)) + least[sharing] <= limit
                for sharing in self.viable}
        if any(room.values()) and self.engine_refused is not None:
            # room one way (of sharing, or of counting copies) and none another: the engine's answer stands,
            # and the ways of sharing that allowed no such answer are closed for the rest of the run
            allowed = full if self.engine_refused else room
            self.viable = tuple(sharing for sharing in self.viable if allowed[sharing])
            if not self.engine_refused:
                return
        what = "pages held by contexts (entries' pages are reclaimable)" if counts_only_contexts(on_full) else "live pages"
        def at_least(sharing: int) -> str:      # where names that may be one page, or the least need, count less
            pages, need = _distinct(fewest, self._namer(sharing, merged=True)), least[sharing]
            most = (_pages(counted, self._namer(sharing)), needs[sharing])
            return "" if (pages, need) == most else f" (at least {pages} + {need})"
        said = {sharing: f"{_pages(counted, self._namer(sharing))} {what} + {needs[sharing]} needed{at_least(sharing)}"
                for sharing in self.viable}
        if len(set(said.values())) == 1 and len(said) > 1:      # every way counts alike: said once (an audit, s73)
            counts = f"{next(iter(said.values()))} every way of sharing pages counted"
        else:
            counts = ", ".join(said[sharing] + (f" {_COUNTED[sharing]}" if self.config.values == "prefix" else "")
                               for sharing in self.viable)
        raise CapacityError(f"{counts} > pool of {limit}")

    def make_room(self, needed: int | dict[int, int], least: dict[int, int] | None = None) -> None:
        """``on_full`` for an operation that needs ``needed`` new pages (spec/semantics.py): a count, or
        one count per sharing (``least``: as ``check_room``). Evictions count pages as the first way of
        sharing still open does (forks', while it is), and under ``match="block"`` with entries' pages past
        their last whole block counted (``_listed``), unless the ways open, counting those pages or not,
        would keep different entries and the engine's are known (``engine_keys``): then as the first way
        that kept the very entries the engine kept. Under ``reclaim`` nothing is evicted: it notes whether
        the pool may have been short."""
        limit, needs = self.config.pool_limit, self._per_sharing(needed)
        if not any(needs.values()) or not limit:
            return
        self.check_room(needs, least)
        if reclaims(self.config.on_full):
            self._note_pressure(needs)
        if not evicts_for_room(self.config.on_full):
            return
        least = needs if least is None else least
        # (a way of sharing, whether entries' pages past their last whole block are left out: ``_listed``)
        ways = [(sharing, fewest) for sharing in self.viable for fewest in self.tails_left_out]
        kept = {way: self._kept_after_evicting((least if way[1] else needs)[way[0]], *way) for way in ways}
        keys = {way: frozenset(entry[0] for entry in entries) for way, entries in kept.items()}
        differ = len(set(keys.values())) > 1
        engine = self.engine_keys() if differ and self.engine_keys is not None else None
        agreeing = [way for way in ways if keys[way] == engine]
        if agreeing:        # the engine evicted as these ways do: the ways of sharing and of counting tails close
            self.viable = tuple(sharing for sharing in self.viable if any(way[0] == sharing for way in agreeing))
            self.tails_left_out = tuple(out for out in self.tails_left_out if any(way[1] == out for way in agreeing))
        self.entries = kept[(agreeing or ways)[0]]

    def _note_pressure(self, needs: dict[int, int]) -> bool:
        """``pressed`` from the first operation that may have found the pool short, counted every way of
        sharing still open: the pages all holders list plus its need pass the pool; under
        ``reclaim-fifo``, or the pages handed out since the start plus its need do (an engine recycling
        freed pages in release order, as vLLM's free queue, reaches its cached pages then, though
        uncached free pages wait behind them)."""
        limit, warm = self.config.pool_limit, reclaims_once_warm(self.config.on_full)
        if any(self.live_pages(sharing) + needs[sharing] > limit or warm and self.labels_issued + needs[sharing] > limit
               for sharing in self.viable):
            self.pressed = True
            self.retained_since_pressure.clear()
            for retained in self.retained_after.values():     # the engine may have reclaimed any of them
                retained.clear()
            return True
        return False

    def least_hit(self, query: tuple[int, ...]) -> int:
        """Under ``reclaim``, the shortest hit an engine may return for ``query``: the hit over only the
        entries retained since the pool last may have been short, none of whose pages can have gone
        since. Under ``reclaim-fifo`` (a retain's copies may reach cached pages too): none."""
        if reclaims_once_warm(self.config.on_full):
            return 0
        return self._lookup(query, [entry for entry in self.entries if entry[0] in self.retained_since_pressure])[1]

    def _per_sharing(self, needed: int | dict[int, int]) -> dict[int, int]:
        """A need of pages per way of sharing still open (the same count where only one is given)."""
        return needed if isinstance(needed, dict) else {sharing: needed for sharing in self.viable}

    def _kept_after_evicting(self, needed: int, sharing: int, fewest: bool = False) -> list:
        """The entries left once the least recently used of those keeping a page no context lists are
        evicted, oldest first, until ``needed`` more pages fit or none is left; pages named as
        ``sharing`` names them (``fewest``: an entry keeps only the pages up to its last whole block,
        under ``match="block"``, ``_listed``). Counted so, an operation needing no page evicts nothing,
        however full the pool (``evict`` may have gone past it)."""
        entries, limit, named = list(self.entries), self.config.pool_limit, itemgetter(sharing)
        held = {named(label) for ctx in self.contexts for label in ctx.labels}
        while needed and _distinct(self._listed(self.contexts + [e[1] for e in entries], fewest), named) + needed > limit:
            listed = self._listed([entry[1] for entry in entries], fewest)
            keeps = [entry for entry, labels in zip(entries, listed)
                     if any(named(label) not in held for label in labels)]
            if not keeps:
                break
            entries.remove(min(keeps, key=lambda entry: entry[2]))
        return entries

    # -- contexts ------------------------------------------------------------------------

    def _adopt(self, values: np.ndarray, tokens: list[int], labels: list[tuple[int, ...]]) -> RefContext:
        ctx = RefContext(self, values, tokens, labels)
        self.contexts.append(ctx)
        return ctx

    def allocate(self) -> RefContext:
        return self._adopt(np.zeros(self.config.layout.batch_shape(0), np.float32), [], [])

    def restore(self, saved: tuple[str, np.ndarray, list[int]]) -> RefContext:
        """A new context from ``RefContext.snapshot()``'s result, converted by spec rules if the precision differs."""
        precision, values, tokens = saved
        if precision != self.config.precision:
            try:
                values = precisions.roundtrip(self.config.precision, values)
            except PrecisionRangeError as error:
                raise SnapshotPrecisionError(str(error)) from None     # a refusal of the file
        pages = pages_needed(len(tokens), self.config.page_tokens)
        self.make_room(pages)
        return self._adopt(values.copy(), list(tokens), [self.new_label() for _ in range(pages)])

    # -- the prefix "tree": a flat list ----------------------------------------------------

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def retain(self, ctx: RefContext) -> None:
        def not_empty():      # a closed context holds nothing: its ``EmptyContextError`` applies too
            if ctx._held() == 0:
                raise EmptyContextError("cannot retain an empty context")
        refuse_with_all(ctx._require_open, not_empty)
        key = tuple(ctx.token_list)
        labels = list(ctx.labels)
        if self.config.values == "prefix":
            labels = self._kept_by_older_entries(key, ctx.labels)
            # The context holds what the entry holds, except under ``CACHED_FIRST`` and ``KEEP_ENTRY``: it keeps
            # its own pages.
            ctx.labels = [tuple(own[sharing] if sharing in _CONTEXT_KEEPS_ITS_OWN else kept[sharing]
                                for sharing in SHARINGS)
                          for kept, own in zip(labels, ctx.labels)]
        if reclaims(self.config.on_full):       # nothing below changes the reference of any other pool
            labels, short = self._copied_where_cached_under_other_tokens(key, labels)
            if not short:       # a retain the pool may have been short for may not have made its own copies
                self.retained_since_pressure.add(key)
        self.entries = [entry for entry in self.entries if entry[0] != key]
        if reclaims(self.config.on_full):
            for entry in self.entries + self.bounded_out:   # sharing first tokens may refresh it (a tree's nodes)
                if _common_prefix(entry[0], key):
                    self.retained_after[entry[0]] = set()
                else:
                    self.retained_after.setdefault(entry[0], set()).add(key)
            self.retained_after[key] = set()
        self.bounded_out = [entry for entry in self.bounded_out if entry[0] != key
                            and len(self.retained_after[entry[0]]) < self.config.max_entries]
        private = RefContext(self, ctx.values.copy(), list(ctx.token_list), labels)
        newest = [key, private, self._tick()]
        self.entries.append(newest)
        if reclaims(self.config.on_full) and self.pressed and self._engine_may_pass_bounds():
            # the engine may be at its bounds here, and its recency may differ from ours (a hit it took from
            # another entry than ours refreshed that one): its eviction may take any older entry
            self.retained_since_pressure = {key}
        while len(self.entries) > self.config.max_entries or self._over_page_budget():
            older = [entry for entry in self.entries if entry is not newest]
            if not older:
                break
            evicted = min(older, key=lambda entry: entry[2])
            self.entries.remove(evicted)
            if reclaims(self.config.on_full) and self.pressed:
                self.bounded_out.append(evicted)
        if reclaims(self.config.on_full):       # only the entries an engine may hold are followed
            self.retained_after = {key: self.retained_after[key] for key in self.keys(bounded_out=True)}

    def _kept_by_older_entries(self, key: tuple[int, ...], labels: list) -> list:
        """``labels`` (a retained context's) renamed as a retain sharing the tree's pages leaves them for
        the new entry: under ``WHOLE_PAGES``, ``SAME_KEY`` and ``CACHED_FIRST``, each whole page of ``key``
        whose tokens up to its end an entry's key begins with takes that entry's name (any such entry's:
        they all hold one page there, until a reclaiming pool was pressed); under ``SAME_KEY``, an entry
        of this very key gives its partly filled last page too; under ``KEEP_ENTRY``, an entry of this very
        key gives every page, and no other entry any."""
        size, kept = self.config.page_tokens, [list(label) for label in labels]
        # Once pressed (reclaim only), entries may have lost pages and kept others, so entries of one
        # prefix no longer hold one page there, and the engine's own may be among those it still holds.
        candidates = self.entries + self.bounded_out if self.pressed else self.entries
        same_key = [entry for entry in candidates if entry[0] == key]
        for i, label in enumerate(kept):
            end = min((i + 1) * size, len(key))
            if end == (i + 1) * size:       # a whole page: from any entry whose key begins with key[:end]
                groups = (([entry for entry in candidates if entry[0][:end] == key[:end]],
                           (WHOLE_PAGES, SAME_KEY, CACHED_FIRST)), (same_key, (KEEP_ENTRY,)))
            else:                           # the partly filled last page: from an entry of this very key
                groups = ((same_key, (SAME_KEY, KEEP_ENTRY)),)
            for olders, sharings in groups:
                if olders:
                    self._name_as_older(label, i, olders, sharings)
        return [tuple(label) for label in kept]

    def _name_as_older(self, label: list, i: int, olders: list, sharings: tuple[int, ...]) -> None:
        """Page ``i`` of a retain's new entry, ``label``, named under ``sharings`` as the ``olders`` entries
        that hold that page name it (see ``_kept_by_older_entries``)."""
        if not self.pressed:            # they all hold one page there: the first one's
            for sharing in sharings:
                label[sharing] = olders[0][1].labels[i][sharing]
            return
        # The context's own page may be kept, or any older entry's taken. A fresh name, maybe one
        # page with each: counted as named, the most pages the engine may hold (each older page
        # beside the own one, where others list it); merged, the fewest. The first older entry's
        # name alone missed an own page kept, or another entry's taken (SGLang refusing correctly
        # was called wrong, found by review); the own name alone, an older page taken.
        fresh = self.new_label()
        for sharing in sharings:
            names = {label[sharing]} | {older[1].labels[i][sharing] for older in olders}
            if len(names) > 1:          # else one page already (a hit of those entries): kept as is
                for name in names:
                    self._may_be_one_page(fresh[sharing], name, sharing)
                label[sharing] = fresh[sharing]

    def _copied_where_cached_under_other_tokens(self, key: tuple[int, ...], labels: list) -> tuple[list, bool]:
        """The new entry's labels under ``reclaim``: a page an older entry lists at the same place under
        other tokens up to the page's end (the context overwrote an earlier page since) may be copied
        into a page the cache alone keeps (vLLM hashes a block with its whole prefix, once: the adapter
        caches a copy) or shared: a fresh name, which may be one page with the context's. Such copies are
        pages handed out, for which the pool may have been short (``_note_pressure``: vLLM's
        ``get_new_blocks`` evicts a cached block for one once the never used blocks are gone). Also
        whether it may have been short for them."""
        size = self.config.page_tokens
        copied = {}         # page index -> the ways of sharing that list the page under other tokens
        for i, label in enumerate(labels):
            end = min((i + 1) * size, len(key))
            elsewhere = [sharing for sharing in SHARINGS
                         if any(len(entry[1].labels) > i and entry[1].labels[i][sharing] == label[sharing]
                                and entry[0][:end] != key[:end] for entry in self.entries)]
            if elsewhere:
                copied[i] = elsewhere
        short = bool(copied) and self._note_pressure(
            {sharing: sum(sharing in elsewhere for elsewhere in copied.values()) for sharing in self.viable})
        named = list(labels)
        for i, elsewhere in copied.items():
            fresh, label = self.new_label(), labels[i]
            for sharing in elsewhere:
                self._may_be_one_page(fresh[sharing], label[sharing], sharing)
            named[i] = tuple(fresh[sharing] if sharing in elsewhere else label[sharing] for sharing in SHARINGS)
        return named, short

    def _engine_may_pass_bounds(self) -> bool:
        """Under ``reclaim``, once pressed, with the new entry in: whether the entries an engine may still hold
        (ours and ``bounded_out``) pass the tree's bounds, so that its retain may evict for them."""
        held = self.entries + self.bounded_out
        budget = self.config.max_pages
        return len(held) > self.config.max_entries or bool(budget) and sum(
            entry_pages(len(entry[0]), self.config.page_tokens) for entry in held) > budget

    def _over_page_budget(self) -> bool:
        budget = self.config.max_pages
        return bool(budget) and sum(entry_pages(len(entry[0]), self.config.page_tokens)
                                    for entry in self.entries) > budget

    def match(self, tokens) -> tuple[RefContext, int]:
        query = tuple(int(t) for t in check_tokens(tokens))
        for key in self.retained_after:         # the engine's hit may come from its entry: the newest now
            if _common_prefix(key, query):
                self.retained_after[key] = set()
        best, length = self._lookup(query, self.entries + self.bounded_out)
        if best is None:
            return self.allocate(), 0
        best[2] = self._tick()
        entry = best[1]
        labels = entry.labels[:pages_needed(length, self.config.page_tokens)]
        hit = self._adopt(entry.values[:length].copy(), list(entry.token_list[:length]), list(labels))
        self.hit_may_come_from_another(query, hit)
        return hit, length

    def hit_may_come_from_another(self, query: tuple[int, ...], hit: RefContext) -> None:
        """Under ``reclaim``, once pressed: the engine may have reclaimed the pages of the entry the reference's
        ``hit`` came from and taken a hit as long from another entry holding the same positions (an engine
        keeping a copy per entry), so each page of the hit may be one page with that entry's: refusals
        then allow either count. Called again by the lockstep when it cuts ``hit`` to an engine's shorter one."""
        if not (reclaims(self.config.on_full) and self.pressed):
            return
        size = self.config.page_tokens
        for i, label in enumerate(hit.labels):
            end = min((i + 1) * size, len(hit))
            others = [other[1].labels[i] for other in self.entries + self.bounded_out
                      if len(other[1].labels) > i and other[0][:end] == query[:end] and other[1].labels[i] != label]
            if not others:
                continue
            # a fresh name, maybe one page with each candidate's: counted as named, the most pages; merged, the fewest
            fresh = self.new_label()
            for other in [label] + others:
                for sharing in SHARINGS:
                    self._may_be_one_page(other[sharing], fresh[sharing], sharing)
            hit.labels[i] = fresh

    def _lookup(self, query: tuple[int, ...], entries: list | None = None):
        """The entry a hit is taken from and the positions it holds, or ``(None, 0)``; among ``entries``
        (default: every entry)."""
        entries = self.entries if entries is None else entries
        if self.config.match == "entry":
            prefixes = [entry for entry in entries if query[:len(entry[0])] == entry[0]]
            if not prefixes:
                return None, 0
            best = max(prefixes, key=lambda entry: len(entry[0]))
            return best, len(best[0])
        common = {id(entry): _common_prefix(entry[0], query) for entry in entries}
        length = hit_length(self.config.match, self.config.block_tokens, max(common.values(), default=0))
        if length == 0:
            return None, 0
        # The hit's length decides the tie: under ``block`` every entry reaching the last whole block
        # is a candidate, however many tokens past it it shares with the query.
        best = max((entry for entry in entries if common[id(entry)] >= length), key=lambda entry: entry[2])
        return best, length

    def clear(self) -> None:
        self.entries = []
        self.bounded_out = []
        self.retained_after = {}

    def eviction_order(self) -> list[tuple[tuple[int, ...], int]]:
        """Entries as (key, tick), least recently used first."""
        return sorted(((entry[0], entry[2]) for entry in self.entries), key=lambda pair: pair[1])


def _pages(holders: list[RefContext], named: Callable[[tuple[int, ...]], int]) -> int:
    """How many pages ``holders`` hold between them, each label named by ``named`` (``RefCache._namer``)."""
    return _distinct([holder.labels for holder in holders], named)


def _distinct(listed: list[list[tuple[int, ...]]], named: Callable[[tuple[int, ...]], int]) -> int:
    """How many pages the label lists ``listed`` name between them (``RefCache._listed``)."""
    return len({named(label) for labels in listed for label in labels})


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
