"""The last operations each thread of a race started, for the report of a failure.

A race's schedule cannot be replayed, so what a failure can show is what each thread was doing
when it happened. ``TracedCache`` and ``TracedContext`` stand in for the backend's cache and its
contexts in a scenario: every protocol call (``observe`` excepted: the observer calls it back
to back, and it changes nothing) appends one entry to its thread's ring (a ``deque`` of
``TRACE_LENGTH``) before it runs and marks it finished after, so an operation still running when
the failure was seen reads as such. Contexts are named ``c1, c2, ...`` in the order the scenario
got them.

Why this is cheap enough not to hide a race: a call costs a dictionary lookup, a list and a deque
append more than it did, where the backend's own call takes tens of microseconds; arguments are
kept as small tuples and only formatted once something failed. Every scenario at CI size on the
NumPy store took 7.9 CPU seconds traced, 7.7 before (three runs each, side by side).
"""

from __future__ import annotations

import itertools
import threading
from collections import deque

TRACE_LENGTH = 8            # operations kept per thread
RUNNING = None              # an entry's outcome while its operation has not returned


class Trace:
    """One ring of recent operations per thread; ``reset`` between iterations (thread ids are reused)."""

    def __init__(self, length: int | None = None) -> None:
        self.length = length or TRACE_LENGTH
        self.reset()

    def reset(self) -> None:
        self.rings: dict[int, tuple[str, deque]] = {}
        self.names = itertools.count(1)         # ``next`` is atomic under the GIL: ids never repeat
        self.frozen: list[tuple[str, list]] | None = None

    def freeze(self) -> None:
        """Keep the rings as they are now (a thread just failed): the other threads run on to their
        end, and what they did after the failure would push out what they were doing at it."""
        if self.frozen is None:
            self.frozen = [(name, [list(entry) for entry in list(ring)]) for name, ring in list(self.rings.values())]

    def new_id(self) -> str:
        return f"c{next(self.names)}"

    def started(self, operation: str, ctx: str | None, args: tuple) -> list:
        entry = [operation, ctx, args, RUNNING]
        ring = self.rings.get(threading.get_ident())
        if ring is None:        # each thread adds only its own key: no two threads write one slot
            ring = self.rings[threading.get_ident()] = (threading.current_thread().name, deque(maxlen=self.length))
        ring[1].append(entry)
        return entry

    def lines(self) -> list[str]:
        """One line per thread that called the cache, oldest operation first (as frozen, if it was)."""
        rings = self.frozen if self.frozen is not None else list(self.rings.values())   # copied in one step
        return [f"{thread_label(name)}: " + "; ".join(format_entry(entry) for entry in list(ring))
                for name, ring in sorted(rings, key=lambda item: _thread_order(item[0]))]


def thread_label(name: str) -> str:
    """``run_threads`` names its threads ``WHERE/tN`` and ``WHERE/observer``; any other is the scenario's own."""
    tail = name.rpartition("/")[2]
    if tail.startswith("t") and tail[1:].isdigit():
        return f"thread {tail[1:]}"
    return "observer" if tail == "observer" else "main"


def _thread_order(name: str) -> tuple[int, int]:
    label = thread_label(name)
    if label.startswith("thread "):
        return 1, int(label.split()[1])
    return (0, 0) if label == "main" else (2, 0)


def format_entry(entry: list) -> str:
    operation, ctx, args, outcome = entry
    call = f"{ctx + '.' if ctx else ''}{operation}({', '.join(str(arg) for arg in args)})"
    if outcome is RUNNING:
        return f"{call} ...running"
    return call if outcome == "" else f"{call} -> {outcome}"


def _count(tokens) -> str:
    return f"{len(tokens)} token{'' if len(tokens) == 1 else 's'}"


def _traced(trace: Trace, operation: str, ctx: str | None, args: tuple, call, *call_args):
    """``call(*call_args)`` and its entry; a raised error's name is the entry's outcome."""
    entry = trace.started(operation, ctx, args)
    try:
        result = call(*call_args)
    except BaseException as error:
        entry[3] = type(error).__name__
        raise
    entry[3] = ""
    return result, entry


class TracedContext:
    """A backend context whose protocol calls are traced; anything else passes through."""

    __slots__ = ("backend_ctx", "trace", "trace_id")

    def __init__(self, ctx, trace: Trace) -> None:
        self.backend_ctx, self.trace, self.trace_id = ctx, trace, trace.new_id()

    def __getattr__(self, name):
        return getattr(self.backend_ctx, name)

    def __len__(self) -> int:
        return len(self.backend_ctx)

    def extend(self, tokens, kv) -> None:
        _traced(self.trace, "extend", self.trace_id, (_count(tokens),), self.backend_ctx.extend, tokens, kv)

    def overwrite(self, start: int, tokens, kv) -> None:
        _traced(self.trace, "overwrite", self.trace_id, (f"at {start}", _count(tokens)), self.backend_ctx.overwrite,
                start, tokens, kv)

    def read(self, *span):
        return _traced(self.trace, "read", self.trace_id, span, self.backend_ctx.read, *span)[0]

    def truncate(self, n: int) -> None:
        _traced(self.trace, "truncate", self.trace_id, (n,), self.backend_ctx.truncate, n)

    def close(self) -> None:
        _traced(self.trace, "close", self.trace_id, (), self.backend_ctx.close)

    def snapshot(self, target) -> None:
        _traced(self.trace, "snapshot", self.trace_id, (), self.backend_ctx.snapshot, target)

    def fork(self) -> "TracedContext":
        return _new_context(self.trace, *_traced(self.trace, "fork", self.trace_id, (), self.backend_ctx.fork))


def _new_context(trace: Trace, ctx, entry: list, matched: int | None = None) -> TracedContext:
    """``ctx`` traced, its name the outcome of the operation that made it."""
    traced = TracedContext(ctx, trace)
    entry[3] = traced.trace_id if matched is None else f"{traced.trace_id}, {matched} matched"
    return traced


class TracedCache:
    """A backend cache whose protocol calls are traced, handing out ``TracedContext``s."""

    def __init__(self, cache, trace: Trace) -> None:
        self.backend_cache, self.trace = cache, trace
        self.observe = cache.observe        # the observer's hot loop: not traced, not slowed

    def __getattr__(self, name):
        return getattr(self.backend_cache, name)

    def allocate(self) -> TracedContext:
        return _new_context(self.trace, *_traced(self.trace, "allocate", None, (), self.backend_cache.allocate))

    def match(self, tokens):
        (ctx, matched), entry = _traced(self.trace, "match", None, (_count(tokens),), self.backend_cache.match, tokens)
        return _new_context(self.trace, ctx, entry, matched), matched

    def retain(self, ctx: TracedContext) -> None:
        _traced(self.trace, "retain", None, (ctx.trace_id,), self.backend_cache.retain, ctx.backend_ctx)

    def clear(self) -> None:
        _traced(self.trace, "clear", None, (), self.backend_cache.clear)

    def restore(self, source, *max_bytes) -> TracedContext:
        return _new_context(self.trace, *_traced(self.trace, "restore", None, max_bytes, self.backend_cache.restore,
                                                 source, *max_bytes))
