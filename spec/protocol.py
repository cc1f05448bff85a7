"""The plug point: how the suite builds a cache for a configuration.

A backend is a *factory*: a callable taking a ``Config`` and returning an object
with the ``CacheProtocol`` surface. ``kvstate conform package.module:factory``
runs the whole suite against it.

What a factory may declare, as attributes:

- ``configs``: the configurations it supports (a list of ``Config``), each run at exactly its
  ``page_tokens``; without it, the standard six (``standard_configs``) at page sizes drawn 1-8
  per run, plus each standard semantics configuration whose tags ``semantics`` lists.
- ``semantics``: the declared semantics it implements, a list, tuple or set of names (``SEMANTICS_TAGS``;
  ``spec/semantics.py``).
- ``any_page_size``: True to be run at page sizes drawn 1-8 per run even where ``configs`` fix
  one, False to be run at the standard configurations' own page size.
- ``thread_safe``: True (a bool) to get the race scenarios.

A declaration of another form is refused (``check_declarations``), as are identical ``configs``.

Optional surfaces, each checked where present and reported ``n/a`` where absent:

- ``ctx.snapshot(target)`` and ``cache.restore(source, max_bytes=None)`` (``SnapshotContext``,
  ``SnapshotCache``): a target or source is a path or a binary stream; the bytes are the format of
  ``spec/snapshot_format.py``; a restore returns a new context, and every refusal of a file is a
  ``SnapshotError`` subclass that changes nothing. ``max_bytes`` bounds the backend's own estimate
  of what a restore allocates; the suite never passes it.
- ``cache.read_page(page_id)``: the stored parts of every row of a live page, written or not (the
  one way the suite can see a recycled page handed out dirty from outside).

Left free, and proven not held against a backend by the suite's own tests: the order in which
several bad inputs are judged (any error that applies is right), ``len()`` of a closed context,
tick numbers and when a clock advances (only the order of entries is compared).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Protocol, runtime_checkable

from .errors import ConfigError
from .layout import DEFAULT_PAGE_TOKENS, Layout
from .observation import Observation
from .positions import as_position
from .semantics import MATCH_KINDS, ON_FULL, VALUES, pool_limit, reclaims


@dataclass(frozen=True)
class Config:
    """One configuration a backend is checked under: storage, bounds and declared semantics.

    The semantics fields (``match``, ``block_tokens``, ``max_pages``, ``pool_pages``,
    ``on_full``) are defined in ``spec/semantics.py``; their defaults are the seed's world.
    """

    layout: Layout
    page_tokens: int = DEFAULT_PAGE_TOKENS
    precision: str = "f32"
    arena_pages: int = 0
    max_entries: int = 64
    match: str = "entry"
    block_tokens: int = 0      # the block size B of match="block"
    max_pages: int = 0         # the tree's page budget (0: none)
    pool_pages: int = 0        # a live-page limit for backends without an arena (0: the arena's size)
    on_full: str = "fallback"
    values: str = "seeded"     # "prefix": values fixed by position and token (an engine keying K/V by prefix)

    def __post_init__(self) -> None:
        for name, low in (("page_tokens", 1), ("arena_pages", 0), ("max_entries", 1), ("block_tokens", 0),
                          ("max_pages", 0), ("pool_pages", 0)):
            value = as_position(getattr(self, name))       # ints of any width, kept as Python ints; no bool
            if value is None or value < low:
                raise ConfigError(f"Config.{name} must be an int >= {low}, got {getattr(self, name)!r}")
            object.__setattr__(self, name, value)
        if self.match not in MATCH_KINDS:
            raise ConfigError(f"Config.match must be one of {MATCH_KINDS}, got {self.match!r}")
        if (self.match == "block") != (self.block_tokens > 0):
            raise ConfigError(f"Config.block_tokens is the block size of match='block' (and only of it), "
                              f"got match={self.match!r}, block_tokens={self.block_tokens}")
        if self.on_full not in ON_FULL:
            raise ConfigError(f"Config.on_full must be one of {ON_FULL}, got {self.on_full!r}")
        if self.values not in VALUES:
            raise ConfigError(f"Config.values must be one of {VALUES}, got {self.values!r}")
        if reclaims(self.on_full) and self.values != "prefix":
            # a shorter hit may come from another entry than the reference's: its values must not depend on which
            raise ConfigError(f"on_full={self.on_full!r} needs values='prefix' (a shorter hit's values are fixed by its tokens)")
        if self.on_full != "fallback" and not self.pool_limit:
            raise ConfigError(f"on_full={self.on_full!r} needs a pool: set arena_pages or pool_pages")

    @property
    def pool_limit(self) -> int:
        return pool_limit(self.pool_pages, self.arena_pages)

    @property
    def name(self) -> str:
        """``[token-|blockB-]precision-(arenaN|poolN|heap)[-evict|-refuse][-pagesN]``: the six
        standard names (``f32-heap``, ``q8-arena6``, ...) are unchanged."""
        parts = [] if self.match == "entry" else [self.match if self.match == "token" else f"block{self.block_tokens}"]
        parts.append(self.precision)
        storage = (f"arena{self.arena_pages}" if self.arena_pages else "") + \
                  (f"{'-' if self.arena_pages else ''}pool{self.pool_pages}" if self.pool_pages else "")
        parts.append(storage or "heap")
        if self.on_full != "fallback":
            parts.append(self.on_full)
        if self.max_pages:
            parts.append(f"pages{self.max_pages}")
        if self.values != "seeded":
            parts.append(f"{self.values}kv")
        return "-".join(parts)

    @property
    def tags(self) -> frozenset[str]:
        """The declared semantics this configuration needs beyond the seed's world: a factory
        whose ``semantics`` attribute holds them all is checked under it (``SEMANTICS_TAGS``)."""
        tags = {self.match} - {"entry"} | {self.on_full} - {"fallback"}
        tags |= {name for name in ("max_pages", "pool_pages") if getattr(self, name)}
        tags |= {"prefix-values"} if self.values == "prefix" else set()
        return frozenset(tags)

    @property
    def semantics(self) -> str:
        """The declared semantics in words, for reports."""
        match = {"entry": "entry match", "token": "token match",
                 "block": f"block match (B={self.block_tokens})"}[self.match]
        bounds = f"max_entries {self.max_entries}" + (f", max_pages {self.max_pages}" if self.max_pages else "")
        pool = f"pool {self.pool_limit} pages, {self.on_full} when full" if self.pool_limit else "no pool limit"
        values = "; values fixed by token prefix" if self.values == "prefix" else ""
        return f"{match}; {bounds}; {pool}{values}"

    def describe(self, page_tokens: str | None = None) -> str:
        """Everything a counterexample depends on, in one line (``page_tokens``: how the page size
        is told, when runs draw it rather than take this configuration's)."""
        layout = self.layout
        return (f"{self.name}: layout {layout.layers}x{layout.kv_heads}x{layout.head_dim} "
                f"(layers x kv_heads x head_dim), {page_tokens or f'page_tokens {self.page_tokens}'}, {self.precision}, "
                f"arena {self.arena_pages}, {self.semantics}")

    def with_(self, **changes: Any) -> "Config":
        return replace(self, **changes)


@runtime_checkable
class ContextProtocol(Protocol):
    def __len__(self) -> int: ...
    @property
    def tokens(self) -> list[int]: ...
    def extend(self, tokens, kv) -> None: ...
    def overwrite(self, start: int, tokens, kv) -> None: ...
    def read(self, start: int = 0, stop: int | None = None) -> tuple[Any, Any]:
        """(values, token ids) of positions [start, stop): float32 ``(n, layers, 2, kv_heads, head_dim)``
        and int64 ``(n,)``, NumPy or torch, each the caller's own (no view of storage, nor of a
        buffer a later read refills)."""
    def fork(self) -> "ContextProtocol": ...
    def truncate(self, n: int) -> None: ...
    def close(self) -> None: ...


@runtime_checkable
class CacheProtocol(Protocol):
    def allocate(self) -> ContextProtocol: ...
    def retain(self, ctx: ContextProtocol) -> None: ...
    def match(self, tokens) -> tuple[ContextProtocol, int]: ...
    def clear(self) -> None: ...
    def observe(self) -> Observation: ...


@runtime_checkable
class SnapshotContext(Protocol):
    def snapshot(self, target) -> None: ...


@runtime_checkable
class SnapshotCache(Protocol):
    def restore(self, source, max_bytes: int | None = None) -> ContextProtocol: ...


Factory = Callable[[Config], CacheProtocol]

# What a factory may list in its ``semantics`` attribute (``spec/semantics.py``).
SEMANTICS_TAGS = frozenset({"token", "block", "max_pages", "pool_pages", "evict", "refuse", "evict-then-refuse",
                            "prefix-values"})


def standard_configs(layout: Layout, page_tokens: int, max_entries: int, arena_pages: int) -> list[Config]:
    """The six configurations every backend is checked under: each precision, heap and arena."""
    return [
        Config(layout, page_tokens, precision, arena, max_entries)
        for precision in ("f32", "f16", "q8")
        for arena in (0, arena_pages)
    ]


def check_declarations(factory: Factory) -> None:
    """``ConfigError`` naming a declaration above of the wrong form, each of which was read silently as
    something else: ``semantics = "token"`` as the names t, o, k, e, n; ``thread_safe = "yes"`` as True.
    Identical ``configs`` are refused, not merged: both ran, as two identical rows, and a copy is more
    likely a configuration meant to differ in some field than a wish to run it twice."""
    semantics = getattr(factory, "semantics", ())
    if isinstance(semantics, (str, bytes)) or not isinstance(semantics, Iterable) or \
            not all(isinstance(n, str) for n in semantics):
        raise ConfigError(f"the factory's semantics must be a list, tuple or set of names (any of "
                          f"{sorted(SEMANTICS_TAGS)}), got {semantics!r}")
    for name in ("thread_safe", "any_page_size"):
        value = getattr(factory, name, False)
        # True or False, or a bool or integer of another type equal to one (NumPy's, 1); "yes" is refused
        if not (isinstance(value, bool) or type(value).__name__ == "bool" or hasattr(value, "__index__")) \
                or value not in (0, 1):
            raise ConfigError(f"the factory's {name} must be True or False, got {value!r}")
    configs = getattr(factory, "configs", None)
    if configs is None:
        return
    if not isinstance(configs, (list, tuple)):
        raise ConfigError(f"the factory's configs must be a list of Config, got {configs!r}")
    listed = [config for config in configs if isinstance(config, Config)]   # any other: check_backend's refusal
    for i, config in enumerate(listed):
        if config in listed[:i]:
            raise ConfigError(f"the factory's configs list {config.name} twice, identical: {config.describe()}")


def declared_configs(factory: Factory, default: Iterable[Config]) -> list[Config]:
    check_declarations(factory)
    declared = getattr(factory, "configs", None)
    return list(declared) if declared is not None else list(default)
