"""Directed conformance checks: short fixed scenarios with exact expectations.

Each check takes a backend factory and a configuration, builds its own cache,
and raises ``AssertionError`` (``InvariantViolation`` is one) saying what it
saw when the backend is wrong. Values are compared with the reference through
``Lockstep``; page counts come from ``observe()``, so any backend that speaks
the protocol can be held to them.

This module holds the first five and the registry, ``DIRECTED``, that conform
turns into table columns. The edges random sequences rarely build live beside it,
one module per concern (``edges``, ``precision``, ``prefix``, ``snapshot_writes``),
as does the evidence the suite gathers itself rather than taking the backend's word
(``evidence``); what they share is ``common``.
"""

from __future__ import annotations

import io

import numpy as np

from kvstate.spec import errors
from kvstate.spec.layout import check_tokens
from kvstate.spec.observation import Observation
from kvstate.spec.protocol import Config, Factory

from .. import ops as O
# ``current`` and ``NotApplicable`` are re-exported: conform reads ``directed.current.run`` for a
# failure's history and reports ``directed.NotApplicable`` as n/a.
from .common import Check, NotApplicable, current, filled as _filled, record, require_tier, start  # noqa: F401
from .edges import boundaries, no_aliasing
from .evidence import arena_evidence
from .hostile_snapshots import hostile_files
from .precision import precision_edges
from .portable import portable_snapshots
from .prefix import prefix_edges
from .scale import scale
from .semantics import pinned_semantics
from .snapshot_writes import snapshot_writes
from ..lockstep import to_numpy
from ..replay import raised_at


def _context_pages(obs: Observation) -> list[tuple[int, ...]]:
    """Page lists of the live contexts (tree entries left out), in the observation's order."""
    return [pages for name, pages in obs.holders.items() if name.startswith("ctx:")]


def fork_isolation(factory: Factory, config: Config) -> None:
    """Writes through a fork never show in the parent, nor the parent's in the fork, on any page: with
    the cache observed before every write, and again with nothing observed between the fork and the
    writes (observing may settle counts a backend keeps lazily, which its copy-on-write must not need:
    an audit's backend, s74, copied only on counts already settled and passed every check)."""
    for watched in (True, False):
        run, n = _filled(factory, config)
        run.apply(O.Fork("c1"), watched)
        run.apply(O.Overwrite("c2", 0, (2,), seed=7), watched)                 # first page
        run.apply(O.Overwrite("c1", n - 1, (1,), seed=8), watched)             # last, partly filled page
        run.apply(O.Extend("c2", (0, 1), seed=9), watched)                     # into the shared tail
        run.apply(O.Extend("c1", (2,), seed=10), watched)
        run.check()
        run.apply(O.Fork("c2"), watched)
        run.apply(O.Truncate("c2", 1), watched)
        run.apply(O.Extend("c2", (2, 2, 2), seed=11), watched)                 # regrow over a page c3 shares
        run.check()
        run.finish()
    _parent_closed_sharing_some(factory, config)


def _parent_closed_sharing_some(factory: Factory, config: Config) -> None:
    """A parent closed while its fork shares every other one of its pages: its own go, the shared stay
    (a mutant of kvstate's engine freeing the right pages at the wrong slots, where the parent's pages
    did not start at its first slot, passed every check: s74). A one-page context comes first."""
    page = config.page_tokens
    run = start(factory, config)
    first = run.apply(O.Allocate())
    run.apply(O.Extend(first, (2,) * page, seed=12))
    parent = run.apply(O.Allocate())
    run.apply(O.Extend(parent, tuple(i % 3 for i in range(4 * page)), seed=13))
    child = run.apply(O.Fork(parent))
    run.apply(O.Overwrite(child, page, (1,), seed=14))
    run.apply(O.Overwrite(child, 3 * page, (1,), seed=15))
    run.apply(O.Close(parent))
    run.check()
    run.finish()


def fork_allocates_nothing(factory: Factory, config: Config) -> None:
    """``fork`` is a page-list copy: no page is allocated or copied, and the fork lists the same pages."""
    run, _ = _filled(factory, config)
    before = run.engine.observe()
    require_tier(before, "pages", "observe().pages or .holders")
    run.apply(O.Fork("c1"))
    after = run.engine.observe()
    if after.pages_allocated != before.pages_allocated or len(after.pages) != len(before.pages):
        raise AssertionError(
            f"fork allocated {after.pages_allocated - before.pages_allocated} pages "
            f"({len(before.pages)} live before, {len(after.pages)} after); it must allocate 0")
    (parent,), lists = _context_pages(before), _context_pages(after)
    if lists != [parent, parent]:
        raise AssertionError(f"after fork the contexts hold pages {lists}; both must hold the parent's {parent}")
    run.check()
    run.finish()


def one_write_copies_one_page(factory: Factory, config: Config) -> None:
    """After a fork, writing one position copies exactly the one page it lands in, nothing else."""
    run, _ = _filled(factory, config)
    require_tier(run.engine.observe(), "pages", "observe().pages or .holders")
    (parent,) = _context_pages(run.engine.observe())
    run.apply(O.Fork("c1"))
    before = run.engine.observe()
    run.apply(O.Overwrite("c2", config.page_tokens, (0,), seed=3))         # first position of page 1
    refused = run.refused
    if refused:     # a pool exactly the context's size: the copy does not fit, and both sides said so
        raise NotApplicable(f"the pool ({config.pool_limit} pages) cannot hold the one page a write into the fork "
                            f"copies: the backend and the reference both refused it ({refused})")
    after = run.engine.observe()
    allocated = after.pages_allocated - before.pages_allocated
    if allocated != 1:
        raise AssertionError(f"overwriting one position of a shared page allocated {allocated} pages, not 1")
    lists = _context_pages(after)
    others = [pages for pages in lists if pages != parent]
    changed = [i for i, (a, b) in enumerate(zip(parent, others[0])) if a != b] if len(others) == 1 else None
    if len(lists) != 2 or changed != [1]:
        raise AssertionError(f"after one write into page 1 of a fork, the contexts hold {lists}: one must "
                             f"still hold the parent's {parent}, the other differ from it at page 1 only")
    run.apply(O.Overwrite("c2", config.page_tokens + 1 if config.page_tokens > 1 else 0, (1,), seed=4))
    again = run.engine.observe()
    if config.page_tokens > 1 and again.pages_allocated != after.pages_allocated:
        raise AssertionError("a second write into a page the fork already owns copied it again")
    run.check()
    run.finish()


def _first_change(was: tuple, now: tuple) -> str | None:
    """The first token or value a read differs in, in words ("token at position 3: 1 -> 0"), or None."""
    (values, tokens), (now_values, now_tokens) = was, now
    tokens, now_tokens = np.asarray(tokens, np.int64), np.asarray(now_tokens, np.int64)
    if tokens.shape != now_tokens.shape:
        return f"length {len(tokens)} -> {len(now_tokens)}"
    if (tokens != now_tokens).any():
        at = int(np.argmax(tokens != now_tokens))
        return f"token at position {at}: {int(tokens[at])} -> {int(now_tokens[at])}"
    now_values = to_numpy(now_values)
    differs = ~((values == now_values) | (np.isnan(values) & np.isnan(now_values)))
    if differs.any():
        index = tuple(int(i) for i in np.argwhere(differs)[0])
        return f"value at {index} (position, layer, k/v, head, dim): {values[index]!r} -> {now_values[index]!r}"
    return None


TOKEN_IDS = ("token ids are an ordered sequence of ints in [0, 2**31): a bool, a float, a float array, a set "
             "or a dict is refused, and a lookup checks every token id it is given")
# Token ids README refuses, as a report lists them: out of range, of no int type, or with no order to keep
BAD_TOKENS = [("[-1]", [-1]), ("[2**31]", [2**31]), ("[True]", [True]), ("[1.5]", [1.5]),
              ("np.array([1.0])", np.array([1.0])), ("{1}", {1}), ("{1: 0}", {1: 0})]


def _bad_token_cases(cache, ctx, good: np.ndarray) -> list[tuple]:
    """Each of ``BAD_TOKENS`` through extend, overwrite and match ("a lookup checks every token id it is
    given"), expecting the error ``spec.layout.check_tokens`` raises for it."""
    cases = []
    for said, ids in BAD_TOKENS:
        error = _refusal(ids)
        cases += [(f"extend with the token ids {said}", error, f"c1.extend({said}, values)",
                   lambda ids=ids: ctx.extend(ids, good), TOKEN_IDS),
                  (f"overwrite with the token ids {said}", error, f"c1.overwrite(0, {said}, values)",
                   lambda ids=ids: ctx.overwrite(0, ids, good), TOKEN_IDS),
                  (f"match of the token ids {said}", error, f"match({said})", lambda ids=ids: cache.match(ids),
                   TOKEN_IDS)]
    return cases


def _refusal(ids) -> type:
    """The error class the spec's rule refuses ``ids`` with."""
    try:
        check_tokens(ids)
    except errors.KVStateError as error:
        return type(error)
    raise RuntimeError(f"suite error: the spec accepts the token ids {ids!r} the bad input check expects refused")


def _bad_input_cases(run, n: int, config: Config) -> list[tuple]:
    """``bad_input_changes_nothing``'s calls on ``run``'s context c1 of ``n`` positions: (what, the error
    it must raise, the call as a report lists it, the call[, the promise it tests])."""
    ctx = run.live["c1"][0]
    layout = config.layout
    good = O.values_for(layout, 1, 5)
    nan = good.copy()
    nan[0, 0, 0, 0, 0] = np.nan
    # (what, the error it must raise, the call as a report lists it, the call)
    cases = [
        ("extend with NaN", errors.NonFiniteError, "c1.extend([1], one position with a NaN)",
         lambda: ctx.extend([1], nan)),
        ("overwrite with NaN", errors.NonFiniteError, "c1.overwrite(0, [1], one position with a NaN)",
         lambda: ctx.overwrite(0, [1], nan)),
        ("extend with a wrong shape", errors.ShapeError, "c1.extend([1, 2], values for one position)",
         lambda: ctx.extend([1, 2], good)),
        ("extend with float64", errors.DTypeError, "c1.extend([1], float64 values)",
         lambda: ctx.extend([1], good.astype(np.float64))),
        ("overwrite past the end", errors.PositionError, f"c1.overwrite({n}, [1], values)",
         lambda: ctx.overwrite(n, [1], good)),
        ("read past the end", errors.PositionError, f"c1.read(0, {n + 1})", lambda: ctx.read(0, n + 1)),
        ("truncate past the end", errors.PositionError, f"c1.truncate({n + 1})", lambda: ctx.truncate(n + 1)),
    ]
    # The bad value in the last position of a write over every held page, and of a two-position extend: a
    # backend checking position by position as it writes had written the ones before it (an outside audit).
    span = O.values_for(layout, n, 6)
    span_nan, two_nan = span.copy(), O.values_for(layout, 2, 7)
    span_nan[-1, 0, 0, 0, 0] = np.nan
    two_nan[-1, 0, 0, 0, 0] = np.nan
    whole = "before anything is written"
    cases += [
        ("overwrite with NaN in its last position", errors.NonFiniteError,
         f"c1.overwrite(0, [7] * {n}, a NaN in position {n - 1} only)",
         lambda: ctx.overwrite(0, [7] * n, span_nan), whole),
        ("extend with NaN in its last position", errors.NonFiniteError, "c1.extend([7, 7], a NaN in position 1 only)",
         lambda: ctx.extend([7, 7], two_nan), whole),
    ]
    cases += _bad_token_cases(run.engine, ctx, good)
    if config.precision == "f16":
        big, span_big = good.copy(), span.copy()
        big[0, 0, 0, 0, 0] = 1e6
        span_big[-1, 0, 0, 0, 0] = 1e6
        cases += [
            ("extend past f16 range", errors.PrecisionRangeError, "c1.extend([1], a value of 1e6)",
             lambda: ctx.extend([1], big)),
            ("overwrite past f16 range in its last position", errors.PrecisionRangeError,
             f"c1.overwrite(0, [7] * {n}, a value of 1e6 in position {n - 1} only)",
             lambda: ctx.overwrite(0, [7] * n, span_big), whole),
        ]
    return cases


def _refused_alike(run, case: tuple, before: Observation, values: np.ndarray, tokens) -> Observation:
    """One of ``_bad_input_cases``, recorded in ``run``'s history: refused with its error, the cache and
    the context unchanged since ``before`` (``values``, ``tokens``); an ``AssertionError`` if not.

    Returns the cache observed after this check's own read of the context: the next case's ``before``.
    A read may move the pages it reads to other ids (a compacting engine does; the lockstep machine
    allows it), so an observation taken before a read is no baseline for the call after it: compared
    with one, an engine that changed nothing was reported as changing its pages (an audit, s69)."""
    what, error, said, call, *promise = case
    ctx = run.live["c1"][0]
    record(run, said)       # a failure's report then ends with this call
    broken = f' ("{promise[0]}")' if promise else ""
    try:
        with np.errstate(over="ignore"):   # the f16 case overflows on purpose
            call()
    except error:
        pass
    except Exception as other:
        raise AssertionError(f"{what}: raised {type(other).__name__}{raised_at(other)}, "
                             f"expected {error.__name__}{broken}") from other
    else:
        raise AssertionError(f"{what}: accepted, expected {error.__name__}{broken}")
    after = run.engine.observe()
    if (after.pages_allocated, after.holders, after.lengths) != (
            before.pages_allocated, before.holders, before.lengths):
        raise AssertionError(f"{what}: refused, but the cache changed (pages, holders or lengths)")
    changed = _first_change((values, tokens), ctx.read())      # after each call: the report names the culprit
    if changed:
        raise AssertionError(f"{what}: refused, but the context's {changed} changed{broken}")
    return run.engine.observe()


def _fails_alone(factory: Factory, config: Config, index: int, run) -> None:
    """Case ``index`` of ``_bad_input_cases`` again on a new context, with none of the others before it:
    where it fails there too, that failure (allocate, extend, the call) is raised in place of the one
    found after every earlier case (an audit, s73: 10 and 14 operations printed, the refused calls
    before the failing one among them); else ``run`` stays the one reported."""
    try:
        alone, n = _filled(factory, config)
        case = _bad_input_cases(alone, n, config)[index]
        values, tokens = alone.live["c1"][0].read()     # read first: see ``_refused_alike``
        _refused_alike(alone, case, alone.engine.observe(), to_numpy(values).copy(), tokens)
    except AssertionError:
        raise
    except Exception:       # noqa: BLE001 - the new context itself broke: the failure found stands
        pass
    current.run = run


def bad_input_changes_nothing(factory: Factory, config: Config) -> None:
    """NaN, wrong shapes, bad tokens and out-of-range positions raise the named error and change nothing."""
    run, n = _filled(factory, config)
    cases = _bad_input_cases(run, n, config)
    values, tokens = run.live["c1"][0].read()
    values = to_numpy(values).copy()
    before = run.engine.observe()       # after the read: see ``_refused_alike``
    for index, case in enumerate(cases):
        try:
            before = _refused_alike(run, case, before, values, tokens)
        except AssertionError:
            _fails_alone(factory, config, index, run)
            raise
    good = O.values_for(config.layout, 1, 5)
    # ... nor anything a later retain keeps: the entry, and a hit of it, read what the reference reads
    run.apply(O.Retain("c1"))
    run.apply(O.Match(tuple(int(t) for t in np.asarray(tokens)) + (1,)))
    run.check()
    closed = run.live["c1"][0]
    run.apply(O.Close("c1"))
    record(run, "c1.extend([1], values) after its close")
    try:
        closed.extend([1], good)
    except errors.ContextClosedError:
        pass
    except Exception as other:
        raise AssertionError(f"extend after close: raised {type(other).__name__}, expected ContextClosedError")
    else:
        raise AssertionError("extend after close: accepted, expected ContextClosedError")
    run.finish()


def damaged_snapshots_refused(factory: Factory, config: Config) -> None:
    """Every truncation of a snapshot is refused with ``SnapshotTruncatedError``, a change of every byte and
    each file of ``hostile_snapshots`` (checksums right, contents forbidden) with a ``SnapshotError``, and no
    refusal changes the cache; the intact file restores to the same values."""
    run, n = _filled(factory, config)
    cache, ctx = run.engine, run.live["c1"][0]
    if not (hasattr(cache, "restore") and hasattr(ctx, "snapshot")):
        raise NotApplicable("the cache has no snapshot/restore")
    record(run, "retain(c1)")           # a report lists the calls made outside the lockstep run too
    cache.retain(ctx)                      # a tree entry too, so "unchanged" covers the tree
    stream = io.BytesIO()
    record(run, "c1.snapshot(stream), its last page shared with the entry")
    ctx.snapshot(stream)
    data = stream.getvalue()
    # A file cut short is SnapshotTruncatedError, whatever byte it ends at (spec/snapshot_format.py, rule 4;
    # a caller may retry an upload still being written, never a damaged file); other damage any SnapshotError.
    cases = [(f"truncated to {size} of {len(data)} bytes", data[:size], errors.SnapshotTruncatedError)
             for size in range(len(data))]
    cases += [(f"byte {offset} xor 0x01", data[:offset] + bytes([data[offset] ^ 1]) + data[offset + 1:],
               errors.SnapshotError) for offset in range(len(data))]
    # ... and files whose checksums hold but whose contents the format forbids (the checksum alone passes them)
    cases += hostile_files(data, config.precision, config.layout, to_numpy(ctx.read()[0]))

    def state(obs: Observation):
        return obs.pages_allocated, obs.pages_freed, obs.holders, obs.lengths, obs.entries
    before = state(cache.observe())
    for what, damaged, expected in cases:
        try:
            restored = cache.restore(io.BytesIO(damaged))
        except expected:
            pass
        except errors.SnapshotError as other:
            record(run, f"restore(the snapshot {what})")
            rule = ("a file cut short is SnapshotTruncatedError (spec/snapshot_format.py, rule 4)"
                    if expected is errors.SnapshotTruncatedError else f"expected {expected.__name__}")
            raise AssertionError(f"snapshot {what}: raised {type(other).__name__}: {other}; {rule}") from other
        except Exception as other:
            record(run, f"restore(the snapshot {what})")
            raise AssertionError(f"snapshot {what}: raised {type(other).__name__}: {other}; a damaged file is "
                                 "refused with a SnapshotError, judged before anything is allocated "
                                 "(spec/snapshot_format.py)") from other
        else:
            record(run, f"restore(the snapshot {what})")
            restored.close()
            raise AssertionError(f"snapshot {what}: restored {len(restored)} positions, expected {expected.__name__}")
        after = state(cache.observe())
        if after != before:
            record(run, f"restore(the snapshot {what})")
            moved = [name for name, was, now in zip(("pages allocated", "pages freed", "holders", "lengths", "entries"),
                                                    before, after) if was != now]
            raise AssertionError(f"snapshot {what}: refused, but the cache changed ({', '.join(moved)}): a file is "
                                 "judged whole before any page is allocated (spec/snapshot_format.py)")
    want = ctx.read()
    cache.clear()
    run.apply(O.Close("c1"))        # room for the intact file, also in a fixed pool no larger than c1's pages
    record(run, "restore(the intact snapshot)")
    restored = cache.restore(io.BytesIO(data))
    changed = _first_change((to_numpy(want[0]), want[1]), restored.read())
    if changed:
        raise AssertionError(f"the intact snapshot of c1 restored to other positions than c1 held: its {changed} "
                             "(c1 -> the restored context)")
    restored.close()
    run.finish()


DIRECTED: dict[str, Check] = {
    "fork isolation": fork_isolation,
    "fork allocates 0": fork_allocates_nothing,
    "1 write copies 1": one_write_copies_one_page,
    "bad input": bad_input_changes_nothing,
    "damaged snapshots": damaged_snapshots_refused,
    # what random sequences rarely build (edges, precision, prefix, snapshot_writes)
    "no aliasing": no_aliasing,
    "boundaries": boundaries,
    "precision edges": precision_edges,
    "prefix edges": prefix_edges,
    "snapshot writes": snapshot_writes,
    # evidence the suite gathers itself, never the backend's say-so (evidence)
    "arena evidence": arena_evidence,
    # README's table of pinned semantics, row by row (semantics)
    "pinned semantics": pinned_semantics,
    # the sizes where a backend's internals grow (scale)
    "scale": scale,
    # a snapshot read by a cache of another precision or page size (portable)
    "portable snapshots": portable_snapshots,
}
