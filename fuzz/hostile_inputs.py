"""A hostile-input fuzzer over the public entry points (issue 13, "close the classes").

Hypothesis draws a call -- an entry point (``Cache(...)``, every ``Context`` method,
``retain``, ``match``, ``restore``, ``snapshot``) and arguments from a pool of hostile
kinds: arbitrary Python objects, NumPy scalars of every width, arrays of every dtype
and byte order, masked, subclassed, strided, zero-size and 0-d arrays, torch tensors
with grad, non-contiguous, bool/complex or on the meta device -- mixed with valid
arguments so that calls reach deep. The oracle for each call:

- it returns and did what the documentation says (lengths, tokens and values read
  back: a write's values are the precision's round trip of its input, for ``extend`` and
  ``overwrite`` alike), and every invariant of pages and the arena holds; a write whose
  K/V, taken as float32, holds a NaN or an infinity never returns (README: such values
  are refused with ``NonFiniteError``, where no other error applies first); or
- it raises a ``kvstate.spec.errors`` class, and ``observe()``, ``stats()`` and every
  live context's values and tokens are exactly what they were before.

Anything else (an unnamed exception, a refusal that changed state, a success that
stored something else) is a finding. ``Tally`` counts what was tried, by entry point
and input kind, so a run can say what it covered.
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
import warnings
from collections import Counter
from dataclasses import dataclass, field
from functools import cache

import numpy as np
from hypothesis import strategies as st

from kvstate.impl.cache import Cache
from kvstate.spec import invariants
from kvstate.spec import precision as precisions
from kvstate.spec.errors import KVStateError
from kvstate.spec.layout import Layout

LAYOUT = Layout(layers=2, kv_heads=1, head_dim=4)
PAGE_TOKENS = 4

try:
    import torch
except ImportError:          # the fuzzer runs without torch; its tensor kinds are then skipped
    torch = None


def stores() -> list[str]:
    return ["numpy", "torch"] if torch is not None else ["numpy"]


# -- hostile values, each tagged with its kind -----------------------------------------------------

NUMPY_SCALARS = (np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
                 np.float16, np.float32, np.float64, np.longdouble, np.complex64, np.complex128)
ARRAY_DTYPES = ("|b1", "|i1", "|u1", "<i2", ">i2", "<u2", "<i4", ">i4", "<u4", "<i8", ">i8", "<u8", ">u8",
                "<f2", ">f2", "<f4", ">f4", "<f8", ">f8", "<c8", "<c16", "O", "U3", "S3", "V4")


class Weird:
    """An object with every attribute an array has, none of them right."""

    dtype = np.dtype(np.float32)
    shape = LAYOUT.batch_shape(1)

    def __len__(self):
        return 1

    def __iter__(self):
        return iter([1])

    def __index__(self):
        return 1


class SubArray(np.ndarray):
    pass


@cache
def python_objects() -> st.SearchStrategy:
    leaves = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=2**31 - 2, max_value=2**70),
                       st.integers(min_value=-(2**70), max_value=-1), st.floats(allow_nan=True),
                       st.text(max_size=4), st.binary(max_size=4), st.just(Weird()), st.just(object()),
                       st.just(float("nan")), st.just(Ellipsis), st.just(slice(0, 1)))
    return st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=4), st.tuples(inner, inner),
                                                        st.dictionaries(st.text(max_size=2), inner, max_size=2)),
                        max_leaves=6).map(lambda value: ("python", value))


@cache
def numpy_scalars() -> st.SearchStrategy:
    def make(kind, raw):
        try:
            return ("numpy scalar " + kind.__name__, kind(raw))
        except (OverflowError, ValueError, TypeError):
            return ("numpy scalar " + kind.__name__, kind(0))
    return st.builds(make, st.sampled_from(NUMPY_SCALARS), st.integers(min_value=-300, max_value=300))


@cache
def positions() -> st.SearchStrategy:
    """Things passed where a position goes: mostly ints near the context's length, in odd wrappers."""
    small = st.integers(min_value=-3, max_value=40)
    return st.one_of(
        small.map(lambda n: ("int", n)),
        st.tuples(st.sampled_from([np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
                                   np.uint64]), st.integers(min_value=0, max_value=40)).map(
            lambda pair: ("numpy int " + pair[0].__name__, pair[0](pair[1]))),
        small.map(lambda n: ("0-d array", np.array(n))),
        small.map(lambda n: ("float", float(n))),
        st.sampled_from([True, False]).map(lambda b: ("bool", b)),
        st.sampled_from([np.True_, np.False_]).map(lambda b: ("numpy bool", b)),
        st.integers(min_value=2**62, max_value=2**80).map(lambda n: ("huge int", n)),
        numpy_scalars(),
        python_objects(),
    )


@cache
def token_arguments(n: int) -> st.SearchStrategy:
    valid = st.lists(st.integers(min_value=0, max_value=9), min_size=n, max_size=n)
    return st.one_of(
        valid.map(lambda t: ("token list", t)),
        valid.map(lambda t: ("token array int64", np.array(t, np.int64))),
        st.tuples(valid, st.sampled_from(ARRAY_DTYPES)).map(_token_array),
        valid.map(lambda t: ("masked token array", np.ma.masked_array(np.array(t, np.int64),
                                                                       mask=[i == 0 for i in range(len(t))]))),
        valid.map(lambda t: ("strided token array", np.array(t * 2, np.int64)[::-2][:len(t)])),
        valid.map(lambda t: ("token tuple of numpy ints", tuple(np.uint8(x) for x in t))),
        st.lists(st.integers(min_value=-(2**65), max_value=2**65), min_size=n, max_size=n).map(
            lambda t: ("token ints of any size", t)),
        valid.map(lambda t: ("token 2-d array", np.array([t], np.int64))),
        python_objects(),
        *([valid.map(lambda t: ("token tensor", torch.tensor(t)))] if torch is not None else []),
    )


def _token_array(pair):
    tokens, dtype = pair
    try:
        return (f"token array {dtype}", np.array(tokens).astype(dtype))
    except (ValueError, TypeError):
        return (f"token array {dtype}", np.array(tokens, np.int64))


@cache
def kv_arguments(n: int) -> st.SearchStrategy:
    shape = LAYOUT.batch_shape(n)

    def base(seed: int) -> np.ndarray:
        return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)

    seeds = st.integers(min_value=0, max_value=5)
    kinds = [
        seeds.map(lambda s: ("float32 array", base(s))),
        st.tuples(seeds, st.sampled_from(ARRAY_DTYPES)).map(lambda p: (f"array {p[1]}", _cast(base(p[0]), p[1]))),
        seeds.map(lambda s: ("big-endian float32", base(s).astype(">f4"))),
        seeds.map(lambda s: ("masked array hiding NaN", _masked_nan(base(s)))),
        seeds.map(lambda s: ("ndarray subclass", base(s).view(SubArray))),
        seeds.map(lambda s: ("negative strides", base(s)[::-1])),
        seeds.map(lambda s: ("non-contiguous", np.repeat(base(s), 2, axis=-1)[..., ::2])),
        seeds.map(lambda s: ("fortran order", np.asfortranarray(base(s)))),
        seeds.map(lambda s: ("read-only", _read_only(base(s)))),
        seeds.map(lambda s: ("with NaN", _poison(base(s), np.nan))),
        seeds.map(lambda s: ("with inf", _poison(base(s), np.inf))),
        seeds.map(lambda s: ("float32 max", np.full(shape, np.finfo(np.float32).max, np.float32))),
        seeds.map(lambda s: ("f16 overflow", np.full(shape, 1e6, np.float32))),
        seeds.map(lambda s: ("subnormal", np.full(shape, 1e-45, np.float32))),
        # built at each draw, as every kind here is: a strategy is kept for the whole run (``cache``)
        st.builds(lambda: ("zero-size", np.zeros((0, *shape[1:]), np.float32))),
        st.builds(lambda: ("0-d array", np.array(1.0, np.float32))),
        st.builds(lambda: ("wrong shape", np.zeros((n, 1), np.float32))),
        st.builds(lambda: ("duck array", Weird())),
        python_objects(),
        numpy_scalars(),
    ]
    if torch is not None:
        kinds += [
            seeds.map(lambda s: ("tensor", torch.from_numpy(base(s)))),
            seeds.map(lambda s: ("tensor with grad", torch.from_numpy(base(s)).requires_grad_(True) * 1)),
            seeds.map(lambda s: ("non-contiguous tensor", torch.from_numpy(np.repeat(base(s), 2, -1))[..., ::2])),
            seeds.map(lambda s: ("bool tensor", torch.from_numpy(base(s)) > 0)),
            seeds.map(lambda s: ("complex tensor", torch.from_numpy(base(s)).to(torch.complex64))),
            seeds.map(lambda s: ("float64 tensor", torch.from_numpy(base(s)).double())),
            st.builds(lambda: ("meta tensor", torch.empty(shape, device="meta"))),
            seeds.map(lambda s: ("tensor with NaN", torch.from_numpy(_poison(base(s), np.nan)))),
        ]
    return st.one_of(*kinds)


def _cast(values: np.ndarray, dtype: str):
    try:
        return values.astype(dtype)
    except (ValueError, TypeError):
        return values.astype(np.float64)


def _masked_nan(values: np.ndarray):
    values = _poison(values, np.nan)
    return np.ma.masked_invalid(values)


def _read_only(values: np.ndarray) -> np.ndarray:
    values.flags.writeable = False
    return values


def _poison(values: np.ndarray, bad) -> np.ndarray:
    values = values.copy()
    if values.size:
        values.flat[values.size // 2] = bad
    return values


# -- the oracle ---------------------------------------------------------------------------------------

@dataclass
class Tally:
    """What was tried and what came of it."""

    tried: Counter = field(default_factory=Counter)       # (entry point, input kind) -> calls
    refused: Counter = field(default_factory=Counter)     # error class name -> calls
    findings: list = field(default_factory=list)

    def summary(self) -> str:
        entries = sorted({entry for entry, _ in self.tried})
        kinds = sorted({kind for _, kind in self.tried})
        return (f"{sum(self.tried.values())} calls over {len(entries)} entry points x {len(kinds)} input kinds, "
                f"{sum(self.refused.values())} refused by name, {len(self.findings)} findings")


class Finding(AssertionError):
    pass


def _state(cache: Cache, contexts) -> tuple:
    obs = cache.observe()
    values = []
    for ctx in contexts:
        if ctx.closed:
            values.append(None)
            continue
        data, tokens = ctx.read()
        values.append((np.asarray(data).tobytes(), np.asarray(tokens).tobytes()))
    return (obs.pages, obs.holders, obs.lengths, obs.arena_out, obs.arena_free, obs.entries,
            cache.stats(), tuple(values))


def _as_numpy(values):
    return values.detach().cpu().numpy() if torch is not None and isinstance(values, torch.Tensor) else values


def _non_finite(kv) -> bool:
    """Whether ``kv``, taken as float32 as the stores take it, holds a NaN or an infinity (a masked
    array by its data: the stores ignore the mask). False for what cannot be taken as float32 at all
    (a meta tensor, an object array of strings): not a value, so no value of it is non-finite."""
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")         # complex to float, float64 overflowing float32
            values = np.asarray(np.ma.getdata(_as_numpy(kv)), np.float32)
    except Exception:       # noqa: BLE001 -- whatever refuses the conversion: see above
        return False
    return not bool(np.isfinite(values).all())


def _plain_tokens(tokens) -> list[int]:
    if torch is not None and isinstance(tokens, torch.Tensor):
        return [int(t) for t in tokens.tolist()]
    if isinstance(tokens, np.ndarray):
        return [int(t) for t in np.asarray(tokens).reshape(-1)]
    return [int(t) for t in list(tokens)]       # what the engine iterates (a dict: its keys)


class Harness:
    """One cache and a few contexts; ``call`` applies one hostile call and checks it."""

    def __init__(self, store: str, precision: str, tally: Tally, folder: str):
        self.cache = Cache(LAYOUT, page_tokens=PAGE_TOKENS, precision=precision, store=store,
                           arena_pages=3, max_entries=3)
        self.precision = precision
        self.tally = tally
        self.folder = folder
        self.contexts = []
        for n in (6, 0):
            ctx = self.cache.allocate()
            if n:
                ctx.extend(list(range(n)), np.ones(LAYOUT.batch_shape(n), np.float32))
            self.contexts.append(ctx)
        self.cache.retain(self.contexts[0])

    def call(self, entry: str, kinds: tuple[str, ...], action, check_success=None):
        self.tally.tried[(entry, "+".join(kinds))] += 1
        before = _state(self.cache, self.contexts)
        try:
            result = action()
        except KVStateError as error:
            self.tally.refused[type(error).__name__] += 1
            after = _state(self.cache, self.contexts)
            if after != before:
                self._finding(f"{entry}({', '.join(kinds)}) raised {type(error).__name__} but changed state")
            if not str(error):
                self._finding(f"{entry}({', '.join(kinds)}) raised {type(error).__name__} with no message")
            return None
        except Exception as error:      # noqa: BLE001 -- an unnamed exception is the finding
            self._finding(f"{entry}({', '.join(kinds)}) raised unnamed {type(error).__name__}: {error}")
            return None
        if check_success is not None:
            problem = check_success(result)
            if problem:
                self._finding(f"{entry}({', '.join(kinds)}) returned but {problem}")
        invariants.check_structure(self.cache.observe())
        return result

    def _finding(self, message: str):
        self.tally.findings.append(message)
        raise Finding(message)

    # -- entry points ------------------------------------------------------------------------------

    def _written(self, ctx, first: int, tokens, kv, length: int) -> str | None:
        """What is wrong with a write of ``tokens``/``kv`` at ``first`` that returned: it took a
        non-finite value, the context's length is not ``length``, or positions ``first`` on do not
        read back the tokens and the precision's round trip of the values (a stored NaN equals its
        own round trip: hence the first test)."""
        if _non_finite(kv):
            return "accepted a K/V holding NaN or infinity (NonFiniteError expected)"
        want = _plain_tokens(tokens)
        if len(ctx) != length:
            return f"the length is {len(ctx)}, not {length}"
        values, got = ctx.read(first, first + len(want))
        got = _plain_tokens(got)
        if got != want:
            return f"stored tokens {got}, not {want}"
        if not want:
            return None
        stored = np.asarray(_as_numpy(values))
        expected = precisions.roundtrip(self.precision, np.asarray(_as_numpy(kv), np.float32))
        if stored.tobytes() != expected.tobytes():
            return "stored values differ from the precision's round trip"
        return None

    def extend(self, ctx, tokens, kv):
        n0 = len(ctx)
        self.call("Context.extend", (tokens[0], kv[0]), lambda: ctx.extend(tokens[1], kv[1]),
                  lambda _: self._written(ctx, n0, tokens[1], kv[1], n0 + len(_plain_tokens(tokens[1]))))

    def overwrite(self, ctx, start, tokens, kv):
        n0 = len(ctx)
        self.call("Context.overwrite", (start[0], tokens[0], kv[0]),
                  lambda: ctx.overwrite(start[1], tokens[1], kv[1]),
                  lambda _: self._written(ctx, int(start[1]), tokens[1], kv[1], n0))

    def read(self, ctx, start, stop):
        def check(result):
            values, tokens = result
            n = (len(ctx) if stop[1] is None else int(stop[1])) - int(start[1])     # None: to the end
            return None if len(tokens) == n and tuple(values.shape) == LAYOUT.batch_shape(n) else "wrong shape"
        self.call("Context.read", (start[0], stop[0]), lambda: ctx.read(start[1], stop[1]), check)

    def read_layer(self, ctx, layer, start, stop, pages: bool):
        name = "Context.read_layer_pages" if pages else "Context.read_layer"
        method = ctx.read_layer_pages if pages else ctx.read_layer
        self.call(name, (layer[0], start[0], stop[0]), lambda: method(layer[1], start[1], stop[1]))

    def truncate(self, ctx, n):
        def check(_):
            return None if len(ctx) == int(n[1]) and len(ctx.read()[1]) == len(ctx) else f"length {len(ctx)}"
        self.call("Context.truncate", (n[0],), lambda: ctx.truncate(n[1]), check)

    def fork_and_close(self, ctx):
        def action():
            child = ctx.fork()
            child.close()
        self.call("Context.fork/close", ("context",), action)

    def retain(self, thing):
        self.call("Cache.retain", (thing[0],), lambda: self.cache.retain(thing[1]))

    def match(self, tokens):
        def action():
            ctx, matched = self.cache.match(tokens[1])
            ctx.close()
            return matched
        self.call("Cache.match", (tokens[0],), action,
                  lambda matched: None if isinstance(matched, int) and matched >= 0 else f"matched {matched!r}")

    def snapshot_restore(self, ctx, target):
        def action():
            ctx.snapshot(target[1])
            return None
        self.call("Context.snapshot", (target[0],), action)

    def restore(self, source):
        def action():
            restored = self.cache.restore(source[1])
            restored.close()
        self.call("Cache.restore", (source[0],), action)


def snapshot_targets(folder: str) -> st.SearchStrategy:
    return st.one_of(
        python_objects().filter(lambda kv: not isinstance(kv[1], (str, bytes))),
        st.just(("binary stream", io.BytesIO())),
        st.just(("text stream", io.StringIO())),
        st.just(("path in tmp", os.path.join(folder, "fuzz.kvs"))),
        st.just(("bytes path in tmp", os.fsencode(os.path.join(folder, "fuzz-b.kvs")))),
        st.just(("directory", folder)),
    )


def restore_sources(folder: str) -> st.SearchStrategy:
    return st.one_of(
        python_objects().filter(lambda kv: not isinstance(kv[1], (str, bytes))),
        st.binary(max_size=200).map(lambda data: ("binary stream of bytes", io.BytesIO(data))),
        st.just(("text stream", io.StringIO("x" * 60))),
        st.just(("directory", folder)),
        st.just(("missing file", os.path.join(folder, "missing.kvs"))),
        st.just(("/dev/null", "/dev/null")),
    )


@cache
def cache_arguments() -> st.SearchStrategy:
    return st.tuples(positions(), st.one_of(st.sampled_from(["f32", "f16", "q8"]).map(lambda p: ("precision", p)),
                                            python_objects()),
                     positions(), positions())


def construct(tally: Tally, args) -> None:
    """``Cache(layout, page_tokens, precision, arena_pages=..., max_entries=...)`` with hostile arguments:
    it builds a working cache or raises a kvstate error."""
    (pk, page_tokens), (prk, precision), (ak, arena), (mk, entries) = args
    tally.tried[("Cache", "+".join((pk, prk, ak, mk)))] += 1
    try:
        cache = Cache(LAYOUT, page_tokens=page_tokens, precision=precision, arena_pages=arena, max_entries=entries)
    except KVStateError as error:
        tally.refused[type(error).__name__] += 1
        return
    except Exception as error:     # noqa: BLE001
        message = f"Cache(page_tokens={page_tokens!r}, precision={precision!r}, arena_pages={arena!r}, " \
                  f"max_entries={entries!r}) raised unnamed {type(error).__name__}: {error}"
        tally.findings.append(message)
        raise Finding(message) from error
    if page_tokens > 4096 or arena > 64:     # a legal but huge cache: built, not exercised further
        return
    ctx = cache.allocate()
    ctx.extend([1], np.ones(LAYOUT.batch_shape(1), np.float32))
    ctx.close()
    invariants.check_empty(cache.observe())


ENTRIES = st.sampled_from(["extend", "overwrite", "read", "read_layer", "read_layer_pages", "truncate", "fork",
                           "retain", "match", "snapshot", "restore"])
LENGTHS = st.integers(min_value=0, max_value=5)


def drive(data, harness: Harness, steps: int) -> None:
    """``steps`` hostile calls drawn by Hypothesis ``data`` against ``harness``."""
    folder = harness.folder
    for _ in range(steps):
        live = [c for c in harness.contexts if not c.closed] or [harness.cache.allocate()]
        ctx = data.draw(st.sampled_from(live))
        entry = data.draw(ENTRIES)
        n = data.draw(LENGTHS)
        if entry == "extend":
            harness.extend(ctx, data.draw(token_arguments(n)), data.draw(kv_arguments(n)))
        elif entry == "overwrite":
            harness.overwrite(ctx, data.draw(positions()), data.draw(token_arguments(n)), data.draw(kv_arguments(n)))
        elif entry == "read":
            harness.read(ctx, data.draw(positions()), data.draw(positions()))
        elif entry in ("read_layer", "read_layer_pages"):
            harness.read_layer(ctx, data.draw(positions()), data.draw(positions()), data.draw(positions()),
                               pages=entry == "read_layer_pages")
        elif entry == "truncate":
            harness.truncate(ctx, data.draw(positions()))
        elif entry == "fork":
            harness.fork_and_close(ctx)
        elif entry == "retain":
            harness.retain(data.draw(st.one_of(st.just(("context", ctx)), python_objects())))
        elif entry == "match":
            harness.match(data.draw(token_arguments(n)))
        elif entry == "snapshot":
            harness.snapshot_restore(ctx, data.draw(snapshot_targets(folder)))
        else:
            harness.restore(data.draw(restore_sources(folder)))


# -- the command line: replay files are the CLI's one untrusted input ------------------------------------

def json_values() -> st.SearchStrategy:
    leaves = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
                       st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=6))
    return st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                        max_leaves=8)


def _valid_replay() -> dict:
    from kvstate.spec.protocol import Config
    from kvstate.stateful import ops as O
    from kvstate.stateful import replay as R
    replay = R.Replay("kvstate.impl.numpy", Config(LAYOUT, PAGE_TOKENS, "f32", 2, 3), 0,
                      [O.Allocate(), O.Extend("c1", (1, 2, 3), 1), O.Fork("c1"), O.Overwrite("c2", 1, (7,), 2),
                       O.Retain("c2"), O.Match((1, 7)), O.Truncate("c1", 1), O.Close("c2")],
                      unobserved=(3, 4, 5), checked_after=(5,))
    return R.to_json(replay)


def replay_documents() -> st.SearchStrategy:
    """Whole JSON documents, and valid replay files with one field (top level, config, or an operation's)
    replaced by an arbitrary JSON value."""
    def mutate(args):
        where, key, value = args
        doc = _valid_replay()
        if where == "top":
            target = doc
        elif where == "config":
            target = doc["config"]
        elif where == "layout":
            target = doc["config"]["layout"]
        else:
            target = doc["ops"][where % len(doc["ops"])]
        keys = sorted(target)
        target[keys[key % len(keys)]] = value
        return ("replay file with a field replaced", doc)
    return st.one_of(json_values().map(lambda doc: ("any JSON document", doc)),
                     st.tuples(st.one_of(st.sampled_from(["top", "config", "layout"]), st.integers(0, 7)),
                               st.integers(0, 20), json_values()).map(mutate))


def cli_replay(tally: Tally, document, folder: str) -> int:
    """``kvstate replay FILE`` on ``document``: exit 0 (it replays), or 2 with one line on stderr.
    Exit 1 would blame the built-in backend for a bad file; an escaping exception is unnamed."""
    import contextlib
    import json

    from kvstate.cli import main as cli_main

    kind, doc = document
    tally.tried[("kvstate replay", kind)] += 1
    path = os.path.join(folder, "replay.json")
    with open(path, "w") as file:
        json.dump(doc, file)
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = cli_main(["replay", path, "--time-limit", "30"])
    except BaseException as error:      # noqa: BLE001 -- SystemExit included: main returns its status
        message = f"kvstate replay on {kind} raised {type(error).__name__}: {error}"
        tally.findings.append(message)
        raise Finding(message) from error
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    if status == 2:
        tally.refused["exit 2"] += 1
        if len(lines) != 1:
            message = f"kvstate replay on {kind} exited 2 with {len(lines)} lines: {err.getvalue()[:300]}"
            tally.findings.append(message)
            raise Finding(message)
    elif status != 0:
        message = f"kvstate replay on {kind} exited {status}: {out.getvalue()[-300:]}"
        tally.findings.append(message)
        raise Finding(message)
    return status


def examples_argument(module: str, argv: list[str] | None, default: int, flags: tuple[str, ...] = ()) -> int | None:
    """EXAMPLES from ``python -m kvstate.fuzz.MODULE [EXAMPLES] [FLAGS]``, or None after one line on
    stderr (the caller exits 2): -5 or 0 was a Hypothesis traceback, abc a ValueError one, and
    hostile_sweep dropped what was not digits and ran its default."""
    words = [arg for arg in (sys.argv[1:] if argv is None else argv) if arg not in flags]
    usage = f"python -m kvstate.fuzz.{module} [EXAMPLES]" + "".join(f" [{flag}]" for flag in flags)
    if not words:
        return default
    if len(words) == 1 and words[0].strip().isdecimal() and int(words[0]) >= 1:
        return int(words[0])
    print(f"python -m kvstate.fuzz.{module}: EXAMPLES must be one positive integer, got "
          f"{' '.join(words)!r} (usage: {usage})", file=sys.stderr)
    return None


def run_and_report(tally: Tally, runs) -> int:
    """Run each Hypothesis-decorated target, then print the findings, the outcomes and what was
    tried; 1 if anything was found. Shared by this module's ``main`` and its sibling fuzzers'."""
    for run in runs:
        try:
            run()
        except BaseException:      # noqa: BLE001 -- Hypothesis may group several findings
            if not tally.findings:
                raise
    for finding in dict.fromkeys(tally.findings):
        print(f"FINDING: {finding}")
    print(tally.summary())
    if tally.refused:
        print("outcomes:", ", ".join(f"{name} {count}" for name, count in tally.refused.most_common()))
    for (entry, kind), count in sorted(tally.tried.items()):
        print(f"  {entry:28} {kind:60} {count}")
    return 1 if tally.findings else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m kvstate.fuzz.hostile_inputs [EXAMPLES]``: a longer run, printing what was tried."""
    from kvstate.stateful.conform import use_cache_folder_for_hypothesis

    use_cache_folder_for_hypothesis()       # Hypothesis's files in the user's cache, never the working folder

    from hypothesis import HealthCheck, given, settings

    examples = examples_argument("hostile_inputs", argv, 500)
    if examples is None:
        return 2
    tally = Tally()

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data(), st.sampled_from(stores()), st.sampled_from(["f32", "f16", "q8"]))
    def run(data, store, precision):
        with tempfile.TemporaryDirectory() as folder:
            drive(data, Harness(store, precision, tally, folder), steps=8)

    @settings(max_examples=max(examples // 4, 1), deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(replay_documents())
    def run_cli(document):
        with tempfile.TemporaryDirectory() as folder:
            cli_replay(tally, document, folder)

    @settings(max_examples=max(examples // 4, 1), deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(cache_arguments())
    def run_cache(args):
        construct(tally, args)

    return run_and_report(tally, (run, run_cache, run_cli))

if __name__ == "__main__":
    sys.exit(main())
