"""A token-granular prefix cache over a fixed page pool that refuses when full.

The shape of SGLang's radix cache with a fixed KV pool, on ``examples/listcache.py``'s
pages: ``match`` returns the longest common prefix of the query with any retained key,
token by token, so a hit may end inside a page -- that last page stays shared with the
entry, and a later write copies it (``writable``). The pool holds ``pool_pages`` pages;
an operation that needs more than are free raises ``CapacityError`` before it changes
anything. It declares exactly that (``factory.configs``: ``match="token"``,
``pool_pages``, ``on_full="refuse"``), so ``kvstate conform`` holds it to those semantics
and does not reject it for behaviour that is not a bug.

Observed through pages, arena books (no arena: size 0) and entries (``tree=None``): the
tree-shape tier is n/a.

    kvstate conform examples/token_pool_backend.py
"""

from __future__ import annotations

from listcache import ListCache, ListContext

from kvstate.spec import Config, Layout
from kvstate.spec import precision as precisions
from kvstate.spec.arithmetic import pages_needed
from kvstate.spec.errors import CapacityError, ConfigError
from kvstate.spec.layout import check_tokens
from kvstate.spec.semantics import hit_length

POOL_PAGES = 10    # small, so the suite's runs fill it often


class PoolContext(ListContext):
    """Counts what a write needs and asks the pool for it before writing anything."""

    def extend(self, tokens, kv) -> None:
        tokens, values = self._encode(tokens, kv)
        if len(tokens):
            size = self.cache.page_tokens
            last = self.length // size          # the page the first new position lands in
            copy = last < len(self.pages) and self.pages[last].refcount > 1
            self.cache.make_room(copy + pages_needed(self.length + len(tokens), size) - len(self.pages))
        self._store(self.length, tokens, values)
        self.length += len(tokens)

    def overwrite(self, start: int, tokens, kv) -> None:
        tokens, values = self._encode(tokens, kv, start)     # checks the position before the values
        if len(tokens):
            size = self.cache.page_tokens
            touched = self.pages[start // size:(start + len(tokens) - 1) // size + 1]
            self.cache.make_room(sum(page.refcount > 1 for page in touched))    # one copy per shared page
        self._store(start, tokens, values)


class TokenPoolCache(ListCache):
    context_class = PoolContext

    def __init__(self, config: Config):
        if config.match not in ("token", "block") or config.on_full not in ("refuse", "fallback") or config.max_pages:
            raise ConfigError(f"TokenPoolCache matches by token or block and refuses when full, not {config.name}")
        super().__init__(config)
        self.config = config

    def make_room(self, needed: int) -> None:
        """Refuse, changing nothing, when ``needed`` more pages would pass the pool."""
        limit = self.config.pool_limit
        if needed and limit and len(self.live) + needed > limit and self.config.on_full == "refuse":
            raise CapacityError(f"{len(self.live)} live pages + {needed} needed > pool of {limit}")

    def match(self, tokens):
        query = tuple(int(t) for t in check_tokens(tokens))
        common = [(_common_prefix(entry[0], query), entry[2], entry) for entry in self.entries]
        longest = max((c for c, _, _ in common), default=0)
        length = hit_length(self.config.match, self.config.block_tokens, longest)
        if length == 0:
            return self.allocate(), 0
        # of the entries sharing all of the hit's positions, the most recently used; only it is stamped
        _, _, best = max((item for item in common if item[0] >= length), key=lambda item: item[1])
        self.clock += 1
        best[2] = self.clock
        pages = best[1].pages[:pages_needed(length, self.page_tokens)]   # the last one may be partly used
        return self.adopt(list(pages), length), length


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def factory(config: Config) -> TokenPoolCache:
    return TokenPoolCache(config)


factory.configs = [Config(Layout(layers=2, kv_heads=2, head_dim=4), page_tokens=4, precision=p, max_entries=2,
                          match="token", pool_pages=POOL_PAGES, on_full="refuse") for p in precisions.PRECISIONS]
factory.any_page_size = True      # written for any page size: checked at sizes drawn 1-8 per run
