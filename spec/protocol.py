"""The plug point: how the suite builds a cache for a configuration.

A backend is a *factory*: a callable taking a ``Config`` and returning an object
with the ``CacheProtocol`` surface. ``kvstate conform package.module:factory``
runs the whole suite against it. A factory may carry a ``configs`` attribute
(an iterable of ``Config``) to declare which configurations it supports;
otherwise the standard six are used.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Protocol, runtime_checkable

from .layout import DEFAULT_PAGE_TOKENS, Layout
from .observation import Observation


@dataclass(frozen=True)
class Config:
    layout: Layout
    page_tokens: int = DEFAULT_PAGE_TOKENS
    precision: str = "f32"
    arena_pages: int = 0
    max_entries: int = 64

    @property
    def name(self) -> str:
        arena = f"arena{self.arena_pages}" if self.arena_pages else "heap"
        return f"{self.precision}-{arena}"

    def with_(self, **changes: Any) -> "Config":
        return replace(self, **changes)


@runtime_checkable
class ContextProtocol(Protocol):
    def __len__(self) -> int: ...
    @property
    def tokens(self) -> list[int]: ...
    def extend(self, tokens, kv) -> None: ...
    def overwrite(self, start: int, tokens, kv) -> None: ...
    def read(self, start: int = 0, stop: int | None = None) -> tuple[Any, Any]: ...
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


Factory = Callable[[Config], CacheProtocol]


def standard_configs(layout: Layout, page_tokens: int, max_entries: int, arena_pages: int) -> list[Config]:
    """The six configurations every backend is checked under: each precision, heap and arena."""
    return [
        Config(layout, page_tokens, precision, arena, max_entries)
        for precision in ("f32", "f16", "q8")
        for arena in (0, arena_pages)
    ]


def declared_configs(factory: Factory, default: Iterable[Config]) -> list[Config]:
    declared = getattr(factory, "configs", None)
    return list(declared) if declared is not None else list(default)
