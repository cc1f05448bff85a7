"""Hostile inputs to object storage (issue 24): snapshot URLs, ``SnapshotStore`` prefixes, ``second_tier`` values.

Two targets, in the style of ``hostile_inputs.py`` (its ``Tally`` counts what was tried,
each ``Finding`` is a bug). Both stay local and fast: ``memory://`` and ``file://`` only
(S3 on a local server is tested in tests/test_remote*.py).

- ``check_url``: ``ctx.snapshot(url)`` / ``cache.restore(url)``, and ``SnapshotStore.put``/``get``
  under a prefix, for names built from every character class (glob and URL syntax
  ``*?[]{}#%``, slashes and backslashes, ``..``, unicode, control characters, empty, very
  long), some with ``user:secret@`` whose secret holds ``/``, ``+`` and ``=``. Oracle: a
  ``kvstate`` error and nothing left behind by the refused step (no key or file that was
  not there just before it, no ``.kvs-partial``), or the write lands at one new key (a
  ``SnapshotStore``: exactly the keys ``put`` reports), a second write to the URL replaces
  it, and a restore returns exactly what the last write held. The keys are listed after
  every step that returns, so a write that also leaves a temporary file (``TEMP_PREFIX``
  name ``TEMP_SUFFIX``) or a second key is reported. The secret is never in any message,
  chained cause or context, traceback text, warning or log record.
- ``check_tier``: ``Cache(second_tier=value)`` for values of every kind (strings, numbers,
  None, objects, the ``SnapshotStore`` class, duck tiers, stores holding damaged, truncated
  or foreign objects). Oracle: a named ``kvstate`` error at construction, or ``match``
  returns a context holding a prefix of the query at least as long as the local hit
  and never raises because of the tier; the cache's invariants hold.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import traceback
import uuid
import warnings
from pathlib import Path

import numpy as np
from hypothesis import strategies as st

from kvstate.fuzz.hostile_inputs import LAYOUT, PAGE_TOKENS, Finding, Tally, examples_argument, run_and_report
from kvstate.impl.cache import Cache
from kvstate.spec import invariants
from kvstate.spec import snapshot_format as fmt
from kvstate.spec.errors import KVStateError
from kvstate.spec.layout import Layout


def _finding(tally: Tally, message: str, cause: BaseException | None = None):
    tally.findings.append(message)
    raise Finding(message) from cause


# -- names and URLs ---------------------------------------------------------------------------------

PIECES = ["*", "?", "[", "]", "[a-z]", "{a,b}", "#", "%", "%2F", "%00", "/", "\\", "..", ".", "~", " ", "+", "=",
          "@", ":", ";", "&", "'", '"', "é", "中文", "\U0001f600", "\u202e", "e\u0301", "\t", "\n", "a", "kv",
          ".kvs", ".kvs-partial", "-", "_", "$HOME", "`x`"]

SECRET_CHARS = "/+=AbZ09"


def names() -> st.SearchStrategy:
    """(kind, name): a snapshot's name below the fuzzer's own folder."""
    built = st.lists(st.sampled_from(PIECES), min_size=1, max_size=5).map(lambda parts: ("pieces", "".join(parts)))
    return st.one_of(
        built,
        built.map(lambda kind_name: ("pieces.kvs", kind_name[1] + ".kvs")),
        st.sampled_from(["", "/", "..", "../x.kvs", "./x.kvs", "a//b.kvs", "a/", "x.kvs/", "a/../b.kvs",
                         "*", "?", "[", "x*.kvs", "x?.kvs", "x[1].kvs", ".kvs-partial"]).map(lambda n: ("edge", n)),
        st.integers(200, 4000).map(lambda n: ("very long", "n" * n + ".kvs")),
        st.text(min_size=1, max_size=8).map(lambda n: ("any text", n)),
    )


def secrets() -> st.SearchStrategy:
    """Secrets distinctive enough that finding one in a message is no coincidence."""
    return st.text(SECRET_CHARS, min_size=3, max_size=10).map(lambda s: f"Sk{s}/+={s[::-1]}Qz")


def credentials() -> st.SearchStrategy:
    """(kind, userinfo template): where ``{secret}`` goes."""
    return st.sampled_from([("user:secret@", "AKIAFUZZ:{secret}@"), ("no user", ":{secret}@"),
                            ("token only", "{token}@"), ("two @", "u:{secret}@x@")])


class Scheme:
    """One filesystem under a fresh root: URLs for a name, and every key or file below the root."""

    def __init__(self, kind: str, folder: str):
        self.kind = kind
        self.root = f"kvfuzz-{uuid.uuid4().hex[:12]}"
        self.folder = Path(folder)
        # deep enough that a name of ".." pieces stays inside ``folder``, where ``listing`` looks
        self.base = self.folder.joinpath(*"abcdef") / self.root
        if kind == "file":
            self.base.mkdir(parents=True)

    def url(self, name: str, userinfo: str = "") -> str:
        if self.kind == "memory":
            return f"memory://{userinfo}{self.root}/{name}"
        return f"file://{userinfo}{self.base}/{name}"

    def listing(self) -> set[str]:
        if self.kind == "memory":
            from fsspec.implementations.memory import MemoryFileSystem
            return {key for key in MemoryFileSystem.store if f"/{self.root}" in key or self.root in key}
        found = set()
        for top, dirs, files in os.walk(self.folder):
            found.update(os.path.join(top, name) for name in files)
        return found

    def clean(self) -> None:
        if self.kind == "memory":
            from fsspec.implementations.memory import MemoryFileSystem
            for key in self.listing():
                MemoryFileSystem.store.pop(key, None)
            for key in [k for k in MemoryFileSystem.pseudo_dirs if self.root in k]:
                MemoryFileSystem.pseudo_dirs.remove(key)


def _texts(error: BaseException) -> str:
    """Everything a user could see of ``error``: its traceback with every chained cause and context."""
    return "".join(traceback.format_exception(type(error), error, error.__traceback__))


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        try:
            self.lines.append(record.getMessage())
        except Exception:     # noqa: BLE001 - a record that cannot format carries nothing to leak
            pass


def _observed(action):
    """``action()``'s result or error, with the warnings and log lines it produced."""
    records, root = _Records(), logging.getLogger()
    level = root.level
    root.addHandler(records)
    root.setLevel(logging.DEBUG)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                return action(), None, [str(w.message) for w in caught] + records.lines
            except Exception as error:     # noqa: BLE001 - judged by the caller
                return None, error, [str(w.message) for w in caught] + records.lines
    finally:
        root.removeHandler(records)
        root.setLevel(level)


def _filled(cache: Cache, tokens: list[int], seed: int):
    ctx = cache.allocate()
    ctx.extend(tokens, np.random.default_rng(seed).standard_normal(LAYOUT.batch_shape(len(tokens))).astype(np.float32))
    return ctx


def _same(ctx, other) -> bool:
    a, ta = ctx.read()
    b, tb = other.read()
    return np.asarray(ta).tobytes() == np.asarray(tb).tobytes() and np.asarray(a).tobytes() == np.asarray(b).tobytes()


def check_url(tally: Tally, scheme_kind: str, name, userinfo, secret: str, folder: str, store: bool) -> None:
    """One URL (``store``: one ``SnapshotStore`` prefix) through a write, a rewrite and restores.

    A refused step must leave nothing that was not there just before it; one refused after a
    write has landed is a finding by itself (the URL took a write, so it takes the next and
    reads back). After each step that returns, the keys new since the first step must be what
    the steps so far rightly wrote (``rightful``: one key, or the keys ``put`` reports)."""
    name_kind, name = name
    info_kind, template = userinfo if userinfo is not None else ("", "")
    # a token alone cannot hold "/": "scheme://tok/en@host" is host "tok" and a path holding "@"
    token = secret.replace("/", "")
    info = template.format(secret=secret, token=token)
    secret = token if "{token}" in template else secret
    scheme = Scheme(scheme_kind, folder)
    url = scheme.url(name, info)
    entry = f"{'SnapshotStore' if store else 'snapshot'} {scheme_kind}://"
    tally.tried[(entry, f"{name_kind}{' + ' + info_kind if info else ''}")] += 1
    cache = Cache(LAYOUT, page_tokens=PAGE_TOKENS)
    first, second = _filled(cache, [1, 2, 3, 4, 5], 1), _filled(cache, [1, 2, 3, 4, 5], 2)
    before = scheme.listing()
    try:
        steps, rightful = (_store_steps(cache, url, first, second) if store
                           else _snapshot_steps(cache, url, first, second, name))
        wrote = set()       # the keys the steps so far rightly wrote (``rightful`` holds them to that)
        for label, action, check in steps:
            step_before = scheme.listing()
            result, error, said = _observed(action)
            shown = "\n".join(said) + ("" if error is None else _texts(error))
            if secret in shown:
                _finding(tally, f"{entry}{name_kind}: the secret of {info_kind} shows in what {label} said: "
                                f"{shown[-300:]!r}")
            if error is not None and not isinstance(error, KVStateError):
                _finding(tally, f"{entry}{name_kind} {name[:60]!r}: {label} raised unnamed "
                                f"{type(error).__name__}: {str(error)[:200]}", error)
            if error is not None:
                tally.refused[type(error).__name__] += 1
                left = scheme.listing() - step_before     # an earlier step's rightful key is not "left"
                if left:
                    _finding(tally, f"{entry}{name_kind} {name[:60]!r}: {label} refused "
                                    f"({type(error).__name__}) but left {sorted(left)[:3]}")
                if wrote:       # the URL took a write: a rewrite and every read of it must succeed
                    _finding(tally, f"{entry}{name_kind} {name[:60]!r}: {label} refused "
                                    f"({type(error).__name__}: {str(error)[:120]}) after a write landed at "
                                    f"{sorted(wrote)[:3]}", error)
                return
            new = scheme.listing() - before
            problem = check(result) or rightful(new)
            if problem:
                _finding(tally, f"{entry}{name_kind} {name[:60]!r}: {label} returned but {problem}")
            wrote = new
        tally.refused["stored"] += 1
    finally:
        scheme.clean()


def _base(key: str) -> str:
    return key.rstrip("/").rpartition("/")[2]


def _temporary(key: str) -> bool:
    """Whether ``key`` has a temporary file's name (``snapshot_format.TEMP_PREFIX``/``TEMP_SUFFIX``)."""
    base = _base(key)
    return base.startswith(fmt.TEMP_PREFIX) and base.endswith(fmt.TEMP_SUFFIX)


def _snapshot_steps(cache: Cache, url: str, first, second, name: str):
    """Write, read back, write again, read back: the second read returns the second write; and the
    rule for the keys new since the first step: none before the first write returns, then exactly
    one, the same one after every later step (the second write replaces it), never a temporary
    name (unless the name asked for is one: ".kvs-partial" is a legal snapshot name)."""
    written = {}

    def landed(_):
        written.setdefault("first", True)
        return None

    def rightful(new: set[str]) -> str | None:
        if not written:
            return f"wrote {sorted(new)[:3]} before any snapshot" if new else None
        stray = sorted(key for key in new if _temporary(key) and _base(key) != _base(name))
        if stray:
            return f"left a temporary file {stray[:3]}"
        if len(new) != 1:
            return f"the snapshot is at {len(new)} new keys, not one: {sorted(new)[:3]}"
        if written.setdefault("key", new) != new:
            return f"the snapshot moved from {sorted(written['key'])} to {sorted(new)}"
        return None

    def restored(want):
        def check(got):
            try:
                return None if _same(got, want) else "the restore returned another context"
            finally:
                got.close()
        return check
    return [("snapshot", lambda: first.snapshot(url), landed),
            ("restore", lambda: cache.restore(url), restored(first)),
            ("a second snapshot", lambda: second.snapshot(url), landed),
            ("restore after the second snapshot", lambda: cache.restore(url), restored(second))], rightful


def _store_steps(cache: Cache, url: str, first, second):
    from kvstate.remote import SnapshotStore

    holder = {}

    def build():
        holder["store"] = SnapshotStore(url, stride=4)

    def got(want_n):
        def check(result):
            ctx, n = result
            try:
                if n != want_n:
                    return f"get found {n} positions, not {want_n}"
                return None if _same(ctx, first) or want_n != len(first) else "get returned another context"
            finally:
                ctx.close()
        return check
    def put(written):
        if not written:
            return "put wrote nothing"
        holder["keys"] = sorted(_base(holder["store"].url(cache, first.tokens[:n])) for n in written)
        return None

    def rightful(new: set[str]) -> str | None:
        """No key before put returns; then exactly the keys put reports (by name: the listing spells
        a key as its filesystem does, the store as a URL), none of them a temporary name."""
        stray = sorted(key for key in new if _temporary(key))
        if stray:
            return f"left a temporary file {stray[:3]}"
        want = holder.get("keys", [])
        if sorted(_base(key) for key in new) != want:
            return f"the new keys are {sorted(new)[:3]}, not the {len(want)} put reports {want}"
        return None
    return [("SnapshotStore()", build, lambda _: None),
            ("put", lambda: holder["store"].put(first), put),
            ("get", lambda: holder["store"].get(cache, [1, 2, 3, 4, 5]), got(5))], rightful


STORE_NUMBERS = [4, 1, 3, 0, -1, True, False, 2**70, 4.0, "4", None, float("nan")]
STORE_OPTIONS = [None, {}, {"bogus": 1}, {"auto_mkdir": True}, "memory", 3, [], {"skip_instance_cache": True}]


DEADLINES = [None, 30, 2.5, 0, -1, True, "5", float("nan"), float("inf"), 2**70, 1e300]


def store_arguments() -> st.SearchStrategy:
    """stride, probe_batch, storage_options, the store's ``deadline_s``, the cache's ``remote_deadline_s``."""
    return st.tuples(st.sampled_from(STORE_NUMBERS), st.sampled_from(STORE_NUMBERS), st.sampled_from(STORE_OPTIONS),
                     st.sampled_from(DEADLINES), st.sampled_from(DEADLINES))


def check_store_arguments(tally: Tally, args) -> None:
    """``SnapshotStore(prefix, stride, probe_batch, storage_options, deadline_s)`` and a cache with
    ``remote_deadline_s``: a named error when built (or at first use), or a store whose ``put`` and
    ``get`` round-trip a context into that cache."""
    from kvstate.remote import SnapshotStore

    stride, batch, options, *deadlines = args
    store_deadline, cache_deadline = deadlines or (None, None)
    kind = (f"stride {stride!r}, probe_batch {batch!r}, storage_options {options!r}, deadline_s {store_deadline!r}, "
            f"Cache remote_deadline_s {cache_deadline!r}")
    tally.tried[("SnapshotStore(...)", kind)] += 1
    prefix = f"memory://kvfuzz-{uuid.uuid4().hex[:12]}"
    cache = Cache(LAYOUT, page_tokens=PAGE_TOKENS)
    ctx = _filled(cache, [1, 2, 3, 4, 5], 5)
    scheme = Scheme("memory", "")
    scheme.root = prefix.partition("://")[2]
    try:
        def use():
            store = SnapshotStore(prefix, stride=stride, probe_batch=batch, storage_options=options,
                                  deadline_s=store_deadline)
            store.put(ctx)
            return store.get(Cache(LAYOUT, page_tokens=PAGE_TOKENS, remote_deadline_s=cache_deadline),
                             [1, 2, 3, 4, 5])
        result, error, _ = _observed(use)
        if error is not None:
            if not isinstance(error, KVStateError):
                _finding(tally, f"SnapshotStore({kind}) raised unnamed {type(error).__name__}: {error}", error)
            tally.refused[type(error).__name__] += 1
            return
        got, n = result
        try:
            if n != 5 or not _same(got, ctx):
                _finding(tally, f"SnapshotStore({kind}): get found {n} positions after put")
        finally:
            got.close()
        tally.refused["stored"] += 1
    finally:
        scheme.clean()


# -- second tiers -----------------------------------------------------------------------------------

class PassThrough:
    """A duck tier that hands back what the cache found."""

    def consult(self, cache, tokens, found):
        return found


class Raising:
    """A duck tier whose lookup fails."""

    def __init__(self, error: BaseException):
        self.error = error

    def consult(self, cache, tokens, found):
        raise self.error


class NotCallable:
    consult = 3


def tier_values(folder: str) -> st.SearchStrategy:
    """(kind, factory): ``factory(cache_layout)`` builds the value to pass as ``second_tier``."""
    def store_holding(kind):
        def build():
            from kvstate.remote import SnapshotStore
            store = SnapshotStore(f"memory://kvfuzz-tier-{uuid.uuid4().hex[:12]}", stride=4)
            if kind != "empty":
                _plant(store, kind)
            return store
        return (f"SnapshotStore holding {kind}", build)
    plain = [("None", None), ("str URL", "memory://kvfuzz-x"), ("empty str", ""), ("int", 3), ("float nan", float("nan")),
             ("True", True), ("object()", object()), ("list", []), ("dict", {"consult": 1}),
             ("the SnapshotStore class", "<class>"), ("consult not callable", NotCallable()),
             ("duck pass-through", PassThrough()), ("duck raising KVStateError", Raising(KVStateError("tier down"))),
             ("duck raising OSError", Raising(OSError("tier down"))),
             ("duck raising RuntimeError", Raising(RuntimeError("tier down")))]
    return st.one_of(st.sampled_from(plain).map(lambda pair: (pair[0], lambda: _resolve(pair[1]))),
                     st.sampled_from(["empty", "the prefix", "garbage", "a truncated object", "another layout",
                                      "other tokens"]).map(store_holding))


def _resolve(value):
    if value == "<class>":
        from kvstate.remote import SnapshotStore
        return SnapshotStore
    return value


QUERY = [1, 2, 3, 4, 5, 6, 7, 8, 9]


def _plant(store, kind: str) -> None:
    """Put an object at the key a match of ``QUERY`` asks for first (its 8-token prefix, stride 4)."""
    import fsspec

    writer = Cache(LAYOUT, page_tokens=PAGE_TOKENS)
    url = store.url(writer, QUERY[:8])
    if kind == "the prefix":
        with _filled(writer, QUERY[:8], 3) as ctx:
            store.put(ctx)
        return
    fs, path = fsspec.core.url_to_fs(url)
    if kind == "garbage":
        data = b"kvstate? no" * 20
    else:
        other = Cache(Layout(1, 1, 2) if kind == "another layout" else LAYOUT, page_tokens=PAGE_TOKENS)
        tokens = QUERY[:8] if kind != "other tokens" else [9] * 8
        ctx = other.allocate()
        ctx.extend(tokens, np.ones(other.layout.batch_shape(8), np.float32))
        import io
        buffer = io.BytesIO()
        ctx.snapshot(buffer)
        data = buffer.getvalue()
        if kind == "a truncated object":
            data = data[:len(data) // 2]
    with fs.open(path, "wb") as file:
        file.write(data)


def check_tier(tally: Tally, value, tokens_kind: str) -> None:
    """``Cache(second_tier=value)`` then ``retain`` and ``match``: see the module docstring."""
    kind, build = value
    tally.tried[("Cache(second_tier=)", kind)] += 1
    tier = build()
    try:
        cache = Cache(LAYOUT, page_tokens=PAGE_TOKENS, second_tier=tier)
    except KVStateError as error:
        tally.refused[type(error).__name__] += 1
        if "second_tier" not in str(error):
            _finding(tally, f"Cache(second_tier={kind}) refused without naming second_tier: {error}")
        return
    except Exception as error:     # noqa: BLE001
        _finding(tally, f"Cache(second_tier={kind}) raised unnamed {type(error).__name__}: {error}", error)
    tally.tried[("Cache.match via second_tier", f"{kind} / {tokens_kind}")] += 1
    with _filled(cache, QUERY[:3], 4) as local:
        cache.retain(local)
    query = {"list": QUERY, "iterator": iter(QUERY), "array": np.array(QUERY, np.int64), "short": QUERY[:2]}[tokens_kind]
    want = list(QUERY if tokens_kind != "short" else QUERY[:2])
    result, error, _ = _observed(lambda: cache.match(query))
    if error is not None:
        _finding(tally, f"Cache(second_tier={kind}).match({tokens_kind}) raised {type(error).__name__}: "
                        f"{str(error)[:200]}", error)
    ctx, n = result
    try:
        local_n = 3 if len(want) >= 3 else 0
        got = [int(t) for t in np.asarray(ctx.read()[1])] if n else []
        if not isinstance(n, int) or n < local_n or len(ctx) != n or got != want[:n]:
            _finding(tally, f"Cache(second_tier={kind}).match({tokens_kind}) returned {n!r} positions {got} "
                            f"(local hit {local_n})")
    finally:
        ctx.close()
    tally.refused["matched"] += 1
    cache.clear()
    invariants.check_empty(cache.observe())


def tier_queries() -> st.SearchStrategy:
    return st.sampled_from(["list", "iterator", "array", "short"])


def main(argv: list[str] | None = None) -> int:
    """``python -m kvstate.fuzz.hostile_storage [EXAMPLES]``: a longer run, printing what was tried."""
    from kvstate.stateful.conform import use_cache_folder_for_hypothesis

    use_cache_folder_for_hypothesis()       # Hypothesis's files in the user's cache, never the working folder

    from hypothesis import HealthCheck, given, settings

    examples = examples_argument("hostile_storage", argv, 300)
    if examples is None:
        return 2
    tally = Tally()
    options = settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))

    @options
    @given(st.sampled_from(["memory", "file"]), names(), st.none() | credentials(), secrets(), st.booleans())
    def run_urls(scheme, name, userinfo, secret, store):
        with tempfile.TemporaryDirectory() as folder:
            check_url(tally, scheme, name, userinfo, secret, folder, store)

    @options
    @given(tier_values(""), tier_queries())
    def run_tiers(value, query):
        check_tier(tally, value, query)

    @options
    @given(store_arguments())
    def run_store_arguments(args):
        check_store_arguments(tally, args)

    return run_and_report(tally, (run_urls, run_tiers, run_store_arguments))

if __name__ == "__main__":
    sys.exit(main())
