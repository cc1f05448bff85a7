"""Directed checks for the edges of the context surface that random sequences rarely look at.

- ``no_aliasing``: what a backend returns (``read`` values and tokens, ``tokens``,
  ``read_layer`` where it exists, the observation's parts) and what it is given
  (``extend``/``overwrite`` arguments) is the caller's: scribbling over it changes
  nothing in the cache, and later writes to the cache do not change it.
- ``boundaries``: a zero-length ``extend``/``overwrite`` and a ``truncate`` to the
  current length allocate, copy and change nothing; every method that takes bounds,
  called at each boundary, returns what the reference returns or refuses with the
  same error class, as does a read from inside a page to inside a later one; token
  ids at the edges of every narrower width (up to 2**31 - 1) read back, are retained
  and match exactly (random sequences draw ids 0-2 only); ``tokens`` follows every
  write (the lockstep compares ``read()`` only).

Both compare with the reference through ``Lockstep``, so they hold a backend to
whatever semantics its configuration declares.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from kvstate.spec.observation import Observation
from kvstate.spec.protocol import Config, Factory

from .. import ops as O
from .common import BrokenPromise, as_array, as_list, both, filled, keeping, note, record, same_read, start
from ..lockstep import Lockstep, to_numpy

NOT_ALIASED = ("what a backend returns, and what it is given, belongs to the caller: changing it changes "
               "nothing in the cache, and later writes to the cache do not change it")
ZERO_LENGTH = ("an extend or overwrite of zero positions, or a truncate to the current length, "
               "allocates, copies and changes nothing")
WIDE_IDS = ("a token id is any int in [0, 2**31): ids at each width a store might narrow them to (8, 16 "
            "and 31 bits) read back, are retained and match exactly")
WIDE_TOKENS = (0, 255, 256, 65_535, 65_536, 2**31 - 1)      # each just inside or past a narrower width
BOUNDS = ("a call at a boundary (start = stop, stop = 0, stop = length, stop omitted, truncate to 0 or "
          "to the length, a write at the length) returns what the reference returns, or refuses with "
          "the same error class")

TOKENS = ("a context's tokens are what read() returns, after every write: an overwrite that changes a token, "
          "a truncate and an extend")
SPANS = ("a read from inside a page to inside a later page returns every position of the span, as the "
         "reference does")

_JUNK_FLOAT = -4321.5
_JUNK_INT = 4321


# -- no aliasing --------------------------------------------------------------------------

def no_aliasing(factory: Factory, config: Config) -> None:
    """Scribble over everything the backend returns or was given; the cache must not notice.
    Then write to the cache; nothing returned earlier may change."""
    run, n = filled(factory, config)
    run.apply(O.Fork("c1"))                                   # c2 shares every page of c1
    run.apply(O.Retain("c1"))                                 # and so does the tree's entry
    hit = run.apply(O.Match(tuple(i % 3 for i in range(n)) + (1,)))    # a hit shares them too
    for handle in ("c1", "c2", hit):
        for call, returned in _returned_arrays(run, handle):
            record(run, f"{call}    # then every element it returned overwritten")
            if any([_scribble(part) for part in returned]):
                with keeping(NOT_ALIASED, run, call):
                    run.check()
    _observation_is_a_copy(run)
    _arguments_are_copied(run, "c2", n)
    _returned_arrays_stay(run, config, n)
    if config.page_tokens < n:      # a context within one page, whose read may hand out that page's storage
        _returned_arrays_stay(run, config, config.page_tokens)
    run.finish()


def _returned_arrays(run: Lockstep, handle: str):
    """(call, parts) for every read-like call on ``handle``: whole, one position, one page, the last position.

    Bounds come from the reference twin's length: a match hit is as long as the configuration's
    semantics make it, which the reference decides.
    """
    engine = run.live[handle][0]
    n, page = len(run.live[handle][1]), run.config.page_tokens
    yield f"{handle}.read()", engine.read()
    for first, stop in dict.fromkeys(((0, 1), (page, min(2 * page, n)), (n - 1, n))):
        if 0 <= first < stop <= n:
            yield f"{handle}.read({first}, {stop})", engine.read(first, stop)
    yield f"{handle}.tokens", (engine.tokens,)
    if hasattr(engine, "read_layer") and n:
        for layer in sorted({0, run.config.layout.layers - 1}):
            yield f"{handle}.read_layer({layer}, 0, {n})", engine.read_layer(layer, 0, n)
            yield f"{handle}.read_layer({layer}, {n - 1}, {n})", engine.read_layer(layer, n - 1, n)


def _scribble(part: Any) -> bool:
    """Overwrite every element of ``part`` in place. False where it cannot be written (read-only, empty)."""
    if isinstance(part, np.ndarray):
        if not part.flags.writeable or part.size == 0:
            return False
        part[...] = _JUNK_FLOAT if part.dtype.kind == "f" else _JUNK_INT
        return True
    if hasattr(part, "fill_") and hasattr(part, "is_floating_point"):       # a torch tensor
        part.fill_(_JUNK_FLOAT if part.is_floating_point() else _JUNK_INT)
        return True
    if isinstance(part, list) and part:
        part[:] = [_JUNK_INT] * len(part)
        return True
    return False


def _observation_is_a_copy(run: Lockstep) -> None:
    """Emptying every dict of an observation must not change the next observation."""
    obs = run.engine.observe()
    before = copy.deepcopy(obs)
    record(run, "observe()    # then its pages, holders, lengths, arena_out and counters emptied")
    for part in (obs.pages, obs.holders, obs.lengths, obs.arena_out, obs.counters):
        if isinstance(part, dict):
            part.clear()
    after = run.engine.observe()
    if after != before:
        changed = [name for name in Observation.__dataclass_fields__
                   if getattr(after, name) != getattr(before, name)]
        raise BrokenPromise(NOT_ALIASED, "observe()", f"emptying one observation's dicts changed the next one's {changed}")
    with keeping(NOT_ALIASED, run, "observe()"):
        run.check()


def _arguments_are_copied(run: Lockstep, handle: str, n: int) -> None:
    """The K/V array and token list given to extend and overwrite are the caller's after the call."""
    engine, reference = run.live[handle]
    layout = run.config.layout
    for what in ("extend", "overwrite"):
        tokens = [2, 0, 1]
        kv = O.values_for(layout, len(tokens), seed=41)
        start = n - 2
        if what == "extend":
            call = f"{handle}.extend({tokens}, values_for(layout, 3, seed=41))"
            both(run, NOT_ALIASED, call, lambda: engine.extend(tokens, kv), lambda: reference.extend(list(tokens), kv.copy()))
        else:
            call = f"{handle}.overwrite({start}, {tokens}, values_for(layout, 3, seed=41))"
            both(run, NOT_ALIASED, call, lambda: engine.overwrite(start, tokens, kv),
                 lambda: reference.overwrite(start, list(tokens), kv.copy()))
        run.history[-1] += "    # then the caller overwrites its kv array and token list"
        kv[...] = _JUNK_FLOAT
        tokens[:] = [_JUNK_INT] * len(tokens)
        with keeping(NOT_ALIASED, run, call):
            run.check()


def _returned_arrays_stay(run: Lockstep, config: Config, n: int) -> None:
    """Keep what a private context returned, rewrite every position of it: the kept arrays must not move."""
    handle = run.apply(O.Allocate())
    run.apply(O.Extend(handle, tuple(range(n)), seed=5))
    kept = []
    for call, returned in _returned_arrays(run, handle):
        record(run, f"{call}    # kept")
        kept.append((call, returned, [_frozen(part) for part in returned]))
    run.apply(O.Overwrite(handle, 0, tuple(range(10, 10 + n)), seed=6))
    run.apply(O.Truncate(handle, 1))
    run.apply(O.Extend(handle, tuple(range(20, 20 + n)), seed=7))
    _kept_as_they_were(kept, "overwritten, truncated and extended")
    for call, _ in _returned_arrays(run, handle):       # a read refilling a buffer an earlier one returned
        record(run, call)
    _kept_as_they_were(kept, "overwritten, truncated, extended and read again")
    run.apply(O.Close(handle))


def _kept_as_they_were(kept: list, since: str) -> None:
    """Each kept result's parts byte for byte as when they were returned; else the promise is broken."""
    for call, returned, frozen in kept:
        for part, was in zip(returned, frozen):
            now = _frozen(part)      # compared as bytes in C order: a copy in another memory order is as good
            if now.shape != was.shape or now.dtype != was.dtype or now.tobytes() != was.tobytes():
                raise BrokenPromise(NOT_ALIASED, call, f"what it returned changed when the context was {since} "
                                                       "afterwards")


def _frozen(part: Any) -> np.ndarray:
    """A private copy of what a call returned: an array (NumPy or torch) as one, any other sequence of token
    ids (a list, a tuple, ``TokenIds``) as int64s: a tuple crashed the check, blamed on the backend (s68)."""
    if isinstance(part, np.ndarray) or hasattr(part, "detach"):
        return as_array(part)
    return np.asarray(as_list(part), dtype=np.int64)


# -- boundaries ------------------------------------------------------------------------------

def boundaries(factory: Factory, config: Config) -> None:
    """Zero-length writes change nothing; bounds at each edge agree with the reference; wide token ids
    read back exactly."""
    _wide_token_ids(start(factory, config))         # first, on runs of their own: a failure's sequence is short
    _tokens_follow_writes(start(factory, config))
    run, n = filled(factory, config)
    page = config.page_tokens
    run.apply(O.Fork("c1"))                                   # c2: every page shared
    empty = run.apply(O.Allocate())
    aligned = run.apply(O.Allocate())
    run.apply(O.Extend(aligned, tuple(range(page)), seed=2))  # exactly one full page
    _zero_length_writes(run, {"c2": n, empty: 0, aligned: page})
    for handle, length in (("c1", n), (empty, 0), (aligned, page)):
        _read_bounds(run, handle, length)
        _write_bounds(run, handle, length)
    run.finish()


def _wide_token_ids(run: Lockstep) -> None:
    """A context of ``WIDE_TOKENS`` padded to whole blocks, retained, then matched and read back through
    the lockstep, which compares tokens, the matched count and the hit with the reference after every step.

    The query that differs from the key in one id only, equal to it in 16 bits, is as long as the key:
    a block hash sees whole blocks only, so a shorter query (4 ids at blocks of 16) misses whether or
    not the hash narrows ids."""
    handle = run.apply(O.Allocate())
    block = run.config.block_tokens or 1
    key = WIDE_TOKENS + (1,) * (-len(WIDE_TOKENS) % block)
    narrowed_alike = key[:3] + (65_535 + 2**16,) + key[4:]     # differs from the stored 65,535, alike in 16 bits
    for op in (O.Extend(handle, key, seed=12), O.Retain(handle), O.Match(key + (7,)), O.Match(narrowed_alike)):
        with keeping(WIDE_IDS, run):
            made = run.apply(op)
            run.check()
        refused = run.refused if op.kind == "extend" else None      # both sides refused it
        if refused:         # a declared pool too small for them: both sides refused, nothing to read back
            note(f"the pool ({run.config.pool_limit} pages) cannot hold the {len(key)} wide token ids: the backend "
                 f"and the reference both refused them ({refused}), so they were not read back")
            run.apply(O.Close(handle))
            run.finish()
            return
        if made is not None and op.kind == "match":
            run.apply(O.Close(made))
    with keeping(WIDE_IDS, run, f"{handle}.tokens"):
        got = as_list(run.live[handle][0].tokens)
        if got != list(key):
            raise AssertionError(f"tokens {got}, written {list(key)}")
    run.apply(O.Close(handle))
    run.finish()


def _tokens_follow_writes(run: Lockstep) -> None:
    """A context's ``tokens``, read once before its writes (a backend may keep what it last returned), then
    after each, equal the reference's: the lockstep compares ``read()`` only."""
    page = run.config.page_tokens
    handle = run.apply(O.Allocate())
    run.apply(O.Extend(handle, tuple(range(page + 2)), seed=13))        # into a second page
    ops = [O.Overwrite(handle, 0, (9,), seed=14), O.Overwrite(handle, page, (8, 7), seed=15),
           O.Truncate(handle, page + 1), O.Extend(handle, (6, 5), seed=16), O.Truncate(handle, 1)]
    for op in [None] + ops:
        if op is not None:
            with keeping(TOKENS, run):
                run.apply(op)
                run.check()
        record(run, f"{handle}.tokens")
        with keeping(TOKENS, run):
            got, want = as_list(run.live[handle][0].tokens), run.live[handle][1].tokens
            if got != want:
                raise AssertionError(f"tokens {got}, reference {want}")
    run.apply(O.Close(handle))
    run.finish()


def _footprint(obs: Observation) -> tuple:
    """What a call that allocates, copies and changes nothing leaves as it was.

    Counters are compared where their names say they count memory (pages, bytes, slots,
    copies, allocations): a backend may also count calls, which a zero-length call is.
    """
    memory = ("page", "byte", "slot", "cop", "alloc", "free", "issue", "return", "heap", "fallback")
    counters = {k: v for k, v in obs.counters.items() if any(word in k for word in memory)}
    return obs.pages_allocated, obs.pages_freed, obs.holders, obs.lengths, obs.arena_out, counters


def _zero_length_writes(run: Lockstep, lengths: dict[str, int]) -> None:
    for handle, length in lengths.items():
        middle = min(run.config.page_tokens, length)
        for op in (O.Extend(handle, (), seed=3), O.Overwrite(handle, 0, (), seed=3),
                   O.Overwrite(handle, middle, (), seed=3), O.Overwrite(handle, length, (), seed=3),
                   O.Truncate(handle, length)):
            before = run.engine.observe()
            with keeping(ZERO_LENGTH, run):
                run.apply(op)
            after = run.engine.observe()
            if _footprint(after) != _footprint(before):
                raise BrokenPromise(ZERO_LENGTH, str(op), _difference(before, after))
            with keeping(ZERO_LENGTH, run):
                run.check()


def _difference(before: Observation, after: Observation) -> str:
    said = []
    if after.pages_allocated != before.pages_allocated:
        said.append(f"allocated {after.pages_allocated - before.pages_allocated} pages")
    if after.pages_freed != before.pages_freed:
        said.append(f"freed {after.pages_freed - before.pages_freed} pages")
    if after.holders != before.holders:
        said.append(f"page lists went from {before.holders} to {after.holders}")
    if after.lengths != before.lengths:
        said.append(f"lengths went from {before.lengths} to {after.lengths}")
    if after.arena_out != before.arena_out:
        said.append(f"arena slots out went from {before.arena_out} to {after.arena_out}")
    counters = {k: (before.counters.get(k), v) for k, v in after.counters.items() if before.counters.get(k) != v}
    if counters:
        said.append(f"counters changed (before, after): {counters}")
    return "; ".join(said)


def _read_bounds(run: Lockstep, handle: str, length: int) -> None:
    engine, reference = run.live[handle]
    middle = min(run.config.page_tokens, length)
    calls: list[tuple] = [(), (0,), (length,), (middle,), (0, 0), (length, length), (middle, middle),
                          (0, length), (0, None), (middle, None), (length, None),
                          (0, length + 1), (length + 1,), (length, length + 1), (-1, length)]
    if length:
        calls += [(1, 0), (length, length - 1), (0, 1), (length - 1, length)]
    spans = _spans(run.config.page_tokens, length)
    for args, promise in [(args, BOUNDS) for args in calls] + [(args, SPANS) for args in spans]:
        call = f"{handle}.read({', '.join(map(repr, args))})"
        got, want, error = both(run, promise, call, lambda: engine.read(*args), lambda: reference.read(*args))
        if error is None:
            same_read(promise, call, got, want)
    if not hasattr(engine, "read_layer"):
        return
    layer_calls = [(0, 0), (length, length), (0, length), (0, None), (middle, None), (length,),
                   (0, length + 1), (-1, length)]
    for args, promise in [(args, BOUNDS) for args in layer_calls] + [(args, SPANS) for args in spans]:
        for layer in sorted({0, run.config.layout.layers - 1}):
            call = f"{handle}.read_layer({layer}, {', '.join(map(repr, args))})"
            got, want, error = both(run, promise, call, lambda: engine.read_layer(layer, *args),
                                    lambda: _reference_layer(reference, layer, args))
            if error is None:
                for side, got_part, want_part in zip("KV", got, want):
                    _same_values(promise, f"{call}[{side}]", got_part, want_part)


def _spans(page: int, length: int) -> list[tuple[int, int]]:
    """Reads that start inside a page and stop inside a later one: one page long across one boundary
    (a count of the span's pages, taken from its length, is one short), and from the second position
    to the last but one, across every boundary."""
    half = page // 2
    spans = [(half, page + half)] if half and page + half < length else []
    if page > 1 and length > page + 1:
        spans.append((1, length - 1))
    return list(dict.fromkeys(spans))


def _reference_layer(reference, layer: int, args: tuple) -> tuple[np.ndarray, np.ndarray]:
    """What ``read_layer`` returns, from the reference's ``read`` of the same bounds."""
    values, _ = reference.read(*args)
    return values[:, layer, 0], values[:, layer, 1]


def _same_values(promise: str, call: str, got: Any, want: np.ndarray) -> None:
    values = to_numpy(got)
    if values.shape != want.shape or values.dtype != want.dtype or \
            not np.array_equal(values.view(np.uint32), want.view(np.uint32)):
        raise BrokenPromise(promise, call, f"values {values.dtype}{values.shape} differ from the reference's "
                                           f"{want.dtype}{want.shape}")


def _write_bounds(run: Lockstep, handle: str, length: int) -> None:
    """Writes and truncates at and past each edge, through the lockstep (which compares refusals)."""
    ops = [O.Overwrite(handle, length, (1,), seed=8), O.Overwrite(handle, length + 1, (), seed=8),
           O.Overwrite(handle, -1, (1,), seed=8), O.Truncate(handle, length + 1), O.Truncate(handle, -1)]
    if length:
        ops.append(O.Overwrite(handle, length - 1, (1,), seed=9))     # the last position: accepted
    ops += [O.Truncate(handle, length), O.Fork(handle)]
    for op in ops:
        with keeping(BOUNDS, run):
            made = run.apply(op)
            run.check()
    # the fork (made last) truncated to 0 and regrown: the original keeps its positions
    for op in (O.Truncate(made, 0), O.Overwrite(made, 0, (), seed=10), O.Extend(made, (2, 2), seed=11)):
        with keeping(BOUNDS, run):
            run.apply(op)
            run.check()
    run.apply(O.Close(made))
    with keeping(BOUNDS, run, f"{handle}.tokens"):
        got, want = as_list(run.live[handle][0].tokens), run.live[handle][1].tokens
        if got != want:
            raise AssertionError(f"tokens {got}, reference {want}")
