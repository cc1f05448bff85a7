"""Declared semantics: the prefix-cache and page-pool behaviours a backend may choose.

Real engines differ in three ways that are not bugs, so a backend declares each
per configuration (``Config``), and the reference and the engine implement all of them:

``match`` -- what a hit returns.
  ``entry``  the entry whose key is the longest key that prefixes the query (the seed's rule);
             the hit holds the whole key.
  ``token``  the longest common prefix of the query with any retained key, token by token
             (SGLang's radix cache); the hit holds exactly those positions.
  ``block``  the token match rounded down to a multiple of ``block_tokens`` (engines that cache
             full blocks by hash: vLLM, nano-vllm); a hit shorter than one block is a miss.
  For ``token`` and ``block``, several entries may share the matched prefix: the hit is taken
  from the most recently used of those sharing all of the hit's positions with the query, and
  only that entry is stamped on the clock. Under ``block`` that is every entry reaching the hit's
  last whole block, however many tokens past it each shares (the block is the unit a block cache
  knows; vLLM keys its cached blocks by the hash of whole blocks). Since no hit reaches past an
  entry's last whole block, under ``block`` the pages past it are the engine's to keep or not
  (vLLM caches full blocks only): a refusing pool's room is judged between the two counts, and a
  pool that evicts may evict as either count does (uncounted, an entry holding only such pages
  keeps no page, and a write into a page only such pages share needs none), the same count for
  the whole run; the reference keeps the entries the engine kept, as seen through its tree tier.

``max_entries`` and ``max_pages`` -- the tree's bounds. After a ``retain`` the least recently
  used entries (never the one just retained) are evicted until both hold, or until only the new
  entry is left: one that alone passes ``max_pages`` is kept, alone. ``max_pages`` counts
  each entry's own pages, ``pages_needed(len(key))``, as if nothing were shared: physical pages
  held are never more than that, and the count does not depend on how an engine shares.

``on_full`` -- what an operation that needs new pages does when live pages plus the pages it
  needs would pass the pool (``pool_pages``, else ``arena_pages``; 0 means no limit):
  ``fallback`` the pages come from ordinary memory (the seed's arena behaviour);
  ``evict``    least recently used tree entries that keep a page no context lists are evicted,
               oldest first, until the pages fit or no such entry is left; the rest falls back
               to ordinary memory (an entry whose pages another entry keeps too frees nothing by
               itself, but evicting both does);
  ``refuse``   ``CapacityError``, and nothing changes (entries' pages count as live: nothing is
               evicted to make room).
  ``evict-then-refuse``  entries' pages are reclaimable (vLLM keeps cached blocks at refcount 0 in a
               free queue, SGLang evicts unlocked leaves): ``CapacityError``, nothing changed, when
               the pages contexts hold plus the pages needed pass the pool; otherwise as ``evict``,
               which then always makes room (with every such entry gone, only pages contexts
               hold are left). What is reclaimed is whole entries, least recently used first, as
               under ``evict``; an engine reclaiming its own way declares ``reclaim``.
  ``reclaim``  refuses as ``evict-then-refuse`` (a copy of a page only entries share with the writer
               may or may not be needed: the entry's page may be gone, so either answer is right
               between the two counts; so is either where, once pressed, a retain may have shared an
               entry's page or kept its own: ``reference/model.py``'s ``maybe_one_page``), but
               entries' pages no context holds are reclaimed in
               any amount and order the engine chooses: whole entries, leaf nodes (SGLang's
               ``RadixCache.evict``), single blocks (vLLM's free queue, in release order). A ``match``
               may then return a shorter hit than the reference's, down to a miss, aligned as
               ``match`` requires, never a longer one: the reference keeps every retained entry (the
               bounds aside) as an upper bound, and its hit context takes the engine's first positions.
               Only once the pool may have been short (``pressed``: the pages every holder lists plus
               an operation's need pass the pool) may a hit be shorter; before, hits are exact, and
               after, a hit is at least what the entries retained since the pool last may have been
               short give (none of their pages can have gone since; not the entry whose own retain may
               have found it short: its copies are pages that pool may not have made). Needs
               ``values="prefix"``: a shorter hit's values are then fixed by its tokens, whichever
               entry gave it. Checks of which entries are kept and in what order (eviction order,
               eviction for room) do not apply once pressed.
  ``reclaim-fifo``  as ``reclaim``, for an engine that hands out free pages in the order they were
               freed, cached ones among them (vLLM's free queue): it reaches a cached page once the
               never used ones are gone, though uncached free pages wait behind it, so ``pressed``
               also comes once the pages handed out since the start plus a need pass the pool, and,
               once it has, any entry may have lost pages (a retain's copies may reach them too).
``values`` -- what K/V values the suite writes.
  ``seeded``  each write draws its values from its own seed (``stateful.ops.values_for``): two
              contexts may hold different values under the same tokens (the seed's world).
  ``prefix``  the engine keys K/V by the token prefix and assumes equal prefixes hold equal K/V
              (SGLang's radix cache: inserting a key it already holds keeps its old slots and
              frees the new ones), so every write the suite makes gives position ``i`` holding
              token ``t`` the values fixed by ``(i, t)`` (``stateful.ops.prefix_values``): equal
              tokens always mean equal values, an overwrite included, and such an engine is never
              asked to hold two values for one prefix. The rules of the cache are unchanged. Such
              an engine may hold fewer or more pages than forks and retains share, so where a full
              pool refuses, the reference allows either answer wherever the ways of counting
              disagree, follows an evicting pool through its tree tier, and holds the rest of the
              run to the ways the engine's answers agreed with (``reference.model``).
  An operation's need is counted before it starts: ``extend`` needs its new pages plus a copy of
  a partly filled last page that another holder shares; ``overwrite`` a copy of each shared
  page it touches; ``restore`` every page of the snapshot; nothing else allocates.
"""

from __future__ import annotations

from .arithmetic import pages_needed

MATCH_KINDS = ("entry", "token", "block")
ON_FULL = ("fallback", "evict", "refuse", "evict-then-refuse", "reclaim", "reclaim-fifo")
VALUES = ("seeded", "prefix")


def hit_length(match: str, block_tokens: int, common: int) -> int:
    """Positions a ``token`` or ``block`` hit holds, given the longest common prefix ``common``."""
    if match == "block":
        return common - common % block_tokens
    return common


def hit_rule(match: str, block_tokens: int, matched: int, query_length: int,
             key_lengths: "list[int] | None" = None) -> str:
    """The rule a hit of ``matched`` positions for a query of ``query_length`` tokens is held to, for a
    report of a hit that differs from the reference's. Where ``matched`` is no hit at all under the
    rule (longer than the query, not whole blocks, no retained key of that length prefixing the
    query: ``key_lengths``), it says so: that is the promise broken, whatever check was running."""
    if match == "block":
        rule = (f'match="block" (blocks of {block_tokens}): a hit is the longest common prefix with a retained '
                f"key, rounded down to whole blocks")
        wrong = f"{matched} is not a whole number of blocks" if matched % block_tokens else ""
    elif match == "entry":
        rule = 'match="entry": a hit holds the whole of the longest retained key that prefixes the query'
        wrong = (f"the reference retains no key of {matched} tokens that prefixes it"
                 if key_lengths is not None and matched and matched not in key_lengths else "")
    else:
        rule, wrong = 'match="token": a hit is the longest common prefix with any retained key, token by token', ""
    if matched > query_length:      # first: whatever the semantics, a hit is a prefix of the query
        wrong = f"{matched} positions for a query of {query_length} tokens: a hit is a prefix of the query"
    return f"{rule}; {wrong}" if wrong else rule


def entry_pages(key_length: int, page_tokens: int) -> int:
    """What one entry counts against ``max_pages``."""
    return pages_needed(key_length, page_tokens)


def may_refuse(on_full: str) -> bool:
    """Whether a full pool may answer an operation with ``CapacityError``."""
    return on_full in ("refuse", "evict-then-refuse", "reclaim", "reclaim-fifo")


def counts_only_contexts(on_full: str) -> bool:
    """Whether a refusal counts only the pages contexts hold (entries' pages are reclaimable)."""
    return on_full in ("evict-then-refuse", "reclaim", "reclaim-fifo")


def reclaims(on_full: str) -> bool:
    """Whether the engine reclaims entries' pages its own way, so a hit may come back shorter."""
    return on_full in ("reclaim", "reclaim-fifo")


def reclaims_once_warm(on_full: str) -> bool:
    """Whether a cached page may go once as many pages as the pool holds were handed out, room or not
    (free pages recycled in release order, as vLLM's free queue: ``reclaim-fifo``)."""
    return on_full == "reclaim-fifo"


def evicts_for_room(on_full: str) -> bool:
    """Whether a full pool evicts tree entries to make room."""
    return on_full in ("evict", "evict-then-refuse")


def pool_limit(pool_pages: int, arena_pages: int) -> int:
    """The live-page limit ``on_full`` acts on (0: none)."""
    return pool_pages or arena_pages
