"""A second tier below the cache: contexts stored in object storage under their tokens.

    from kvstate.remote import SnapshotStore
    store = SnapshotStore("s3://bucket/kv/gpt2")          # one prefix per model (weights), see below
    cache = Cache(layout, second_tier=store)              # match() now consults the store on a short hit

``put(ctx)`` stores a context; ``get(cache, tokens)`` returns the longest stored
prefix of ``tokens`` as a restored context and its length, the contract of
``Cache.match`` one tier down. Every object is a plain snapshot (``ctx.snapshot``
format) written and read through ``impl/remote_io.py``: atomic publication,
streamed and checksummed reads, retries, named errors.

Keys are content addresses: the SHA-256 of the prefix's token ids, under a folder
for the layout and precision::

    <url_prefix>/<layers>x<kv_heads>x<head_dim>-<precision>/<length>-<sha256 of int32 LE tokens>.kvs

so two machines storing the same prefix write the same key with equivalent bytes,
and a race between them is harmless (each write is atomic; either one wins). The
key does not name the model: the values are only valid for the weights that
produced them, so give each model its own ``url_prefix``, and name the model
(``SnapshotStore(url, producer=fingerprint)``, 16 bytes as ``Context.snapshot`` takes):
``put`` then writes it into each object and ``get`` refuses an object naming
another, as a damaged one (a shorter prefix may serve; counted and warned), so a
prefix shared by mistake is loud instead of serving another model's values (``put``
leaves such an object where it is: another model's, not damage, and the other model's
own ``get`` still serves it; so does a store naming none, which does not replace a
named object with its own).
An object naming none (written without one) is restored, as ``Cache.restore`` does.

The index is the key scheme itself; nothing is listed. A lookup cannot ask the
server "which prefixes of these tokens exist", so it asks about candidate
lengths, longest first: the query's own length, then every multiple of
``stride`` below it. ``put`` therefore stores a context at its own length (an
exact resume finds it) and, when that is not a multiple of ``stride``, also at
its longest multiple of ``stride`` (any longer conversation through the same
tokens finds that one). The trade-off, in ``stride``:

- a miss costs ``len(tokens) // stride + 1`` existence checks (HEADs), sent
  ``probe_batch`` at a time in parallel, so about ``len // stride / probe_batch``
  round trips; a smaller stride means more of them;
- a shared-prefix hit recovers all but fewer than ``stride`` tokens of the shared
  part (the caller prefills the rest); a larger stride leaves more to prefill;
- a ``put`` writes up to twice the context's bytes (exact + aligned copy), once
  per distinct prefix: a key already holding an intact object is not written again,
  but that object is read whole to check it (a damaged one is written again), so a
  ``put`` of stored prefixes downloads what it would have uploaded.

Every operation of the store (``put``, ``lookup``, ``get``, and so the second tier's part of
``match``) runs under one total deadline, retries and probes included: the call's
``deadline_s=``, else the cache's (``Cache(remote_deadline_s=...)``, for the cache the
operation reads into or writes from), else the store's own (``SnapshotStore(deadline_s=...)``), else an enclosing
``with kvstate.remote.deadline(seconds):`` block's, else 30 s (``DEFAULT_DEADLINE_S`` of
``impl/remote_deadline.py``, which a program may change).
Past it: ``SnapshotDeadlineError`` naming the deadline; inside ``match``, a counted
failure and the local hit. The same block bounds ``cache.restore(url)`` and
``ctx.snapshot(url)``.

Eviction is not the store's: objects stay until the bucket's lifecycle rules
(expire by age, abort incomplete multipart uploads) remove them. A lookup that
finds an object gone between the check and the read treats that length as a miss.
"""

from __future__ import annotations

import hashlib
import queue
import threading
import time
import warnings

import numpy as np

from kvstate.impl import Cache, Context
from kvstate.impl import remote_io
from kvstate.impl.remote_deadline import CACHE, CALL, STORE, Deadline, check_seconds, first_set, resolve
from kvstate.impl.remote_deadline import within as deadline
from kvstate.impl.snapshot import restore_snapshot
from kvstate.impl.snapshot_read import checked_sections, read_snapshot, remaining
from kvstate.spec.errors import (InvalidInputError, SecondTierWarning, SnapshotCorruptError, SnapshotDeadlineError,
                                 SnapshotError, SnapshotNotFoundError, SnapshotProducerError, SnapshotReadError,
                                 SnapshotTruncatedError, SnapshotVersionError, SnapshotWriteError)
from kvstate.spec import snapshot_format as fmt
from kvstate.spec.semantics import hit_length
from kvstate.spec.layout import check_tokens

DEFAULT_STRIDE = 256
DEFAULT_PROBE_BATCH = 8
# A tier that cannot be read this many times in a row (``SnapshotReadError``: unreachable, past its
# deadline, access refused; not a damaged object or a pool too full) is skipped by ``match`` for
# ``outage_pause_s``: each consult of a tier that is down paid its retries to the deadline (22-26 s
# against a refused connection with botocore's default retries). Then one consult tries it while
# the others still skip it: it lifts the pause, or a failure starts another.
OUTAGES_BEFORE_PAUSE = 3
DEFAULT_OUTAGE_PAUSE_S = 30.0
# Damaged objects a store remembers, by URL and version, so a match does not download one again (the oldest
# forgotten past it); only refusals of the object's own bytes, not of what a reader asks of them.
DAMAGED_KEPT = 1024
_DAMAGED = (SnapshotCorruptError, SnapshotTruncatedError, SnapshotVersionError)

__all__ = ["SnapshotStore", "second_tier_match", "deadline"]


class SnapshotStore:
    """Contexts stored under ``url_prefix`` (any fsspec URL), found again by their tokens."""

    def __init__(self, url_prefix: str, stride: int = DEFAULT_STRIDE, probe_batch: int = DEFAULT_PROBE_BATCH,
                 storage_options: dict | None = None, deadline_s: float | None = None,
                 producer: bytes | None = None, outage_pause_s: float = DEFAULT_OUTAGE_PAUSE_S):
        remote_io.refuse_lost_slashes(url_prefix, InvalidInputError)      # before it is quoted below
        if not isinstance(url_prefix, str) or "://" not in url_prefix or not url_prefix.partition("://")[2].strip("/"):
            raise InvalidInputError(f"url_prefix must be a URL naming a bucket or folder, such as 's3://bucket/kv', "
                                    f"got {url_prefix!r}")
        remote_io.refuse_credentials(url_prefix, InvalidInputError)
        remote_io.refuse_chained(url_prefix, InvalidInputError)     # file:// too: its probes go through fsspec
        remote_io.refuse_versioned(url_prefix, InvalidInputError)  # its every key would be one object
        remote_io.refuse_unsafe_options(storage_options, InvalidInputError, url_prefix)
        for name, value in (("stride", stride), ("probe_batch", probe_batch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidInputError(f"{name} must be an int >= 1, got {value!r}")
        if deadline_s is not None:
            check_seconds(deadline_s, "deadline_s")
        if isinstance(outage_pause_s, bool) or not isinstance(outage_pause_s, (int, float)) or not 0 <= outage_pause_s < float("inf"):
            raise InvalidInputError(f"outage_pause_s must be a finite number of seconds >= 0 (0: never pause), "
                                    f"got {outage_pause_s!r}")
        if producer is not None:
            fmt.check_producer(producer)
        self.url_prefix = url_prefix.rstrip("/")
        self.producer = producer            # what computed the values: put names it, get refuses another
        self.deadline_s = deadline_s        # each operation's total; None: the enclosing block's or the default
        self.stride = stride
        self.probe_batch = probe_batch
        self.storage_options = storage_options
        self.failures = 0                   # consults that fell back to the local hit (see consult)
        self.last_failure: str | None = None
        self.outage_pause_s = outage_pause_s
        self.skipped = 0                    # consults that did not ask the tier: paused after outages
        self._outages = 0                   # consults in a row that could not read the tier
        self._paused_until = 0.0            # on ``_clock``
        self._clock = time.monotonic
        self._failure_lock = threading.Lock()
        # url -> ((size, version), what was wrong) of an object ``get`` read and found damaged: while a lookup
        # finds it so, it is not read again (a damaged object was downloaded whole at every match; audit E, s69)
        self._damaged: dict[str, tuple] = {}

    def __repr__(self) -> str:
        return f"SnapshotStore({remote_io.redact(self.url_prefix)!r}, stride={self.stride})"

    # A store is its prefix and settings: it travels to worker processes (a process pool, Dask) as they
    # do; the lock guarding the failure count is this process's and is made afresh there.
    def __getstate__(self) -> dict:
        return {name: value for name, value in vars(self).items() if name != "_failure_lock"}

    def __setstate__(self, state: dict) -> None:
        vars(self).update(state)
        self._failure_lock = threading.Lock()
        self._outages, self._paused_until = 0, 0.0      # another process's clock: its own view of the tier
        self.__dict__.setdefault("outage_pause_s", DEFAULT_OUTAGE_PAUSE_S)     # pickled before the pause existed
        self.__dict__.setdefault("skipped", 0)
        self.__dict__.setdefault("_damaged", {})
        self._clock = time.monotonic

    # -- keys ------------------------------------------------------------------------

    def url(self, cache: Cache, tokens) -> str:
        """Where the context holding exactly ``tokens`` is stored for caches like ``cache``."""
        _check_cache(cache, "url")
        tokens = check_tokens(tokens)
        return self._url(cache, len(tokens), hashlib.sha256(_token_bytes(tokens)).hexdigest())

    def _url(self, cache: Cache, length: int, digest: str) -> str:
        layout = cache.layout
        folder = f"{layout.layers}x{layout.kv_heads}x{layout.head_dim}-{cache.precision}"
        return f"{self.url_prefix}/{folder}/{length}-{digest}.kvs"

    def _candidates(self, cache: Cache, tokens: np.ndarray, longer_than: int) -> list[tuple[int, str]]:
        """(length, url) of every length a lookup asks about, longest first; the tokens are hashed once."""
        lengths = sorted({*range(self.stride, len(tokens) + 1, self.stride), len(tokens)} - {0})
        lengths = [n for n in lengths if n > longer_than]
        digest, data, done, found = hashlib.sha256(), _token_bytes(tokens), 0, []
        for n in lengths:
            digest.update(data[4 * done:4 * n])
            done = n
            found.append((n, self._url(cache, n, digest.copy().hexdigest())))
        return found[::-1]

    def _deadline(self, deadline_s: float | None, cache=None) -> Deadline:
        """One operation's deadline: the call's, else the cache's (``Cache(remote_deadline_s=)``),
        else the store's, else the block's or the default."""
        return first_set((deadline_s, CALL), (getattr(cache, "remote_deadline_s", None), CACHE),
                         (self.deadline_s, STORE)) or resolve(None)

    # -- the store -------------------------------------------------------------------

    def put(self, ctx: Context, deadline_s: float | None = None) -> list[int]:
        """Store ``ctx`` at its length and at its longest multiple of ``stride``; the lengths written.

        A key already holding an intact object is skipped (same tokens, same key: two machines storing
        one prefix write it once): one of the snapshot's size is read and checked as ``get`` would
        check it (header, size, checksum, every token and value; no page of a cache is allocated),
        within the same deadline. One of another size (cut short, another layout's) or whose bytes
        were damaged is written again; one naming another producer (another model's, sharing the
        prefix by mistake) is left where it is. ``ctx`` is read, never changed. Failures:
        ``SnapshotWriteError`` naming the URL (an outage during the check too), and whatever
        was stored before is intact; past the deadline, ``SnapshotDeadlineError``; a context the
        format cannot hold (``snapshot_format.check_fits``), ``SnapshotTooLargeError``, nothing sent.
        """
        if not isinstance(ctx, Context):
            raise InvalidInputError(f"put needs a kvstate Context, got {type(ctx).__name__}")
        cache, tokens = ctx._cache, np.asarray(ctx.tokens, dtype=np.int64)
        fmt.check_fits(cache.layout, len(tokens))      # before any request: no lookup for what cannot be written
        deadline = self._deadline(deadline_s, cache)
        aligned = len(tokens) // self.stride * self.stride
        written = []
        for n in sorted({len(tokens), aligned} - {0}, reverse=True):
            url = self.url(cache, tokens[:n])
            try:
                stored = remote_io.stored_size(url, self.storage_options, deadline)
            except SnapshotDeadlineError:
                raise
            except SnapshotReadError as error:       # the lookup before the write: a put's failure is a write's
                raise SnapshotWriteError(f"put: {error}") from error
            if stored in self._sizes_kept(cache, n) and self._keeps(url, cache, tokens[:n], deadline):
                continue        # there already, intact (or another model's)
            with ctx.fork() as part:
                part.truncate(n)
                remote_io.publish(url, lambda file: part.snapshot(file, producer=self.producer),
                                  self.storage_options, deadline)
            written.append(n)
        return written

    def _keeps(self, url: str, cache: Cache, tokens: np.ndarray, deadline: Deadline) -> bool:
        """Whether ``put`` leaves the object of the right size at ``url`` as it is: it is what ``get``
        serves whole for ``tokens`` (read and checked as a restore checks it, by the reader's own
        ``read_snapshot`` and ``checked_sections``; into no cache), or it names
        another producer. False: damaged, or gone since the lookup, so ``put`` writes it."""
        def check(file) -> None:
            header, body, crc = read_snapshot(file, cache.layout, remaining(file), None, self.producer)
            arrays = checked_sections(header, body, crc)     # as a restore checks it, into no cache
            if header.precision != cache.precision or header.positions != len(tokens) \
                    or not np.array_equal(arrays["tokens"], tokens):
                raise SnapshotCorruptError(f"{remote_io.redact(url)} holds {header.positions} positions at "
                                           f"{header.precision} that are not the {len(tokens)} of its key")
        try:
            remote_io.read(url, check, self.storage_options, deadline)
        except SnapshotDeadlineError:
            raise
        except SnapshotNotFoundError:
            return False         # removed since the lookup (a lifecycle rule): written
        except SnapshotReadError as error:       # the check before the write: a put's failure is a write's
            raise SnapshotWriteError(f"put: checking the object already there: {error}") from error
        except SnapshotProducerError:
            return True          # another model's object: not damage, not ours to replace (get refuses it)
        except SnapshotError:
            return False         # damaged: written again
        return True

    def _sizes_kept(self, cache: Cache, n: int) -> set[int]:
        """The sizes of an object at an ``n``-position key that ``put`` reads (``_keeps``) rather than
        replaces: the size it writes, and, for a store naming no producer, that of an object naming
        one: some model's, whose store checks what it serves. Counted cut short, it was replaced by
        an unnamed object, which that model's own ``get`` then served as its own (an unnamed object
        is restored): another model's values, silently."""
        body = fmt.body_size(cache.layout, cache.precision, n)
        sizes = {self._header_size() + body}
        if self.producer is None:
            sizes.add(fmt.header_size(fmt.PRODUCER_VERSION) + body)
        return sizes

    def _header_size(self) -> int:
        """Bytes of the header ``put`` writes: version 3's where it names a producer."""
        return fmt.header_size(fmt.FORMAT_VERSION if self.producer is None else fmt.PRODUCER_VERSION)

    def lookup(self, cache: Cache, tokens, longer_than: int = 0, deadline_s: float | None = None) -> int:
        """The longest stored prefix length of ``tokens`` above ``longer_than``, or 0: existence checks only."""
        _check_cache(cache, "lookup")
        found = self._probe(cache, check_tokens(tokens), longer_than, self._deadline(deadline_s, cache))
        return found[0][0] if found else 0

    def get(self, cache: Cache, tokens, longer_than: int = 0,
            deadline_s: float | None = None) -> tuple[Context, int]:
        """A new context of ``cache`` holding the longest stored prefix of ``tokens``, and its length.

        Only prefixes longer than ``longer_than`` count; none: an empty context and 0
        (as ``Cache.match`` on a miss). A refused object raises its ``SnapshotError``
        subclass, naming the URL, and changes nothing in ``cache``; so does the deadline running
        out (``SnapshotDeadlineError``), one deadline for the probes and reads together.
        """
        ctx, n, damaged = self._get(cache, tokens, longer_than, deadline_s)
        if damaged is not None:
            self._failed(damaged, stacklevel=3, let_go=ctx)     # counted and warned, the shorter hit served
        return ctx, n

    def _get(self, cache: Cache, tokens, longer_than: int,
             deadline_s: float | None) -> tuple[Context, int, SnapshotError | None]:
        """``get``'s context and length, and the damaged object a shorter one was served in place of,
        if any: the caller warns of it, so the warning names the caller's line."""
        _check_cache(cache, "get")
        tokens = check_tokens(tokens)
        deadline = self._deadline(deadline_s, cache)
        damaged: SnapshotError | None = None
        for n, url, stored in self._probe(cache, tokens, longer_than, deadline):
            known = self._damaged.get(url) if stored[1] is not None else None
            if known is not None and known[0] == stored:
                damaged = damaged or SnapshotCorruptError(f"{known[1]} (read before and unchanged since, the same size "
                                                          "and version: not read again)")
                continue
            try:     # an object not holding its key is refused before the cache is touched (it evicted entries)
                ctx = remote_io.read(url, lambda file: restore_snapshot(cache, file, producer=self.producer,
                                                                        key=tokens[:n]),
                                     self.storage_options, deadline)
            except SnapshotNotFoundError:
                continue     # removed (lifecycle rule) since the check: a miss at this length
            except (SnapshotReadError, SnapshotWriteError):
                raise        # an outage: a shorter key is no likelier to answer
            except SnapshotError as error:
                if isinstance(error, _DAMAGED) and stored[1] is not None:
                    self._remember_damaged(url, stored, str(error))
                damaged = damaged or error     # one bad object: a shorter prefix may still serve
                continue
            return ctx, n, damaged
        if damaged is not None:
            raise damaged
        return cache.allocate(), 0, None

    def _remember_damaged(self, url: str, stored: tuple, what: str) -> None:
        """``url``'s object, as ``stored`` names it, is damaged (``what``: the refusal's message); the oldest
        memory goes past ``DAMAGED_KEPT``."""
        damaged = self._damaged
        damaged.pop(url, None)
        damaged[url] = (stored, what)
        if len(damaged) > DAMAGED_KEPT:
            damaged.pop(next(iter(damaged)), None)

    def _probe(self, cache: Cache, tokens: np.ndarray, longer_than: int,
               deadline: Deadline) -> list[tuple[int, str, tuple]]:
        """Stored (length, url, (size, version)) candidates, longest first, from the first batch that holds any."""
        if isinstance(longer_than, bool) or not isinstance(longer_than, int) or longer_than < 0:
            raise InvalidInputError(f"longer_than must be an int >= 0, got {longer_than!r}")
        candidates = self._candidates(cache, tokens, longer_than)
        for start in range(0, len(candidates), self.probe_batch):
            batch = candidates[start:start + self.probe_batch]
            present = self._stored([url for _, url in batch], deadline)
            hits = [(n, url, here) for (n, url), here in zip(batch, present) if here is not None]
            if hits:
                # shorter ones: fallbacks if one vanishes (not looked up yet: no version to compare)
                return hits + [(n, url, (None, None)) for n, url in candidates[start + self.probe_batch:]]
        return []

    def _stored(self, urls: list[str], deadline: Deadline) -> list[tuple | None]:
        """``(size, version)`` of the object each of ``urls`` holds (``remote_io.stored_version``), None where
        none, asked at once on daemon threads. Not a thread pool:
        leaving one waits for its threads, so Ctrl-C during a lookup at a hung server took effect only
        when the deadline ran out (and so did the interpreter's exit); the first failure is raised."""
        if len(urls) == 1:
            return [remote_io.stored_version(urls[0], self.storage_options, deadline)]     # no thread to start
        answers: queue.SimpleQueue = queue.SimpleQueue()

        def probe(index: int, url: str) -> None:
            try:
                answers.put((index, remote_io.stored_version(url, self.storage_options, deadline), None))
            except BaseException as error:     # handed to the waiting caller, whatever it is
                answers.put((index, None, error))

        for index, url in enumerate(urls):
            threading.Thread(target=probe, args=(index, url), name="kvstate-probe", daemon=True).start()
        present: list[tuple | None] = [None] * len(urls)
        for _ in urls:
            index, here, error = answers.get()
            if error is not None:
                raise error
            present[index] = here
        return present

    # -- the Cache hook (Cache(second_tier=store)) --------------------------------------------

    def consult(self, cache: Cache, tokens, found: tuple[Context, int]) -> tuple[Context, int]:
        """``found`` (what the cache matched) or, if the store holds a longer prefix, that one, retained.

        The store is an optimisation: when it cannot deliver (unreachable, a damaged object, a
        pool too full for the restore, a deadline) this returns ``found`` unchanged, adds one to
        ``failures``, keeps the message in ``last_failure`` and warns (``SecondTierWarning``,
        shown once per place by Python's default filter; make it an error with
        ``warnings.simplefilter("error", SecondTierWarning)``). A hit from the store obeys the
        cache's declared ``match`` semantics (a ``block`` cache gets whole blocks only).
        """
        ctx, matched = found
        try:
            tokens = check_tokens(tokens)
        except Exception:
            ctx.close()
            raise
        if matched >= len(tokens) or self._paused():
            return found
        config = getattr(cache, "config", None)
        deeper = None
        try:
            deeper, n, damaged = self._get(cache, tokens, matched, None)
            if n and config is not None and config.match != "entry":
                n = hit_length(config.match, config.block_tokens, n)     # what a local hit would hold
                if n > matched:
                    deeper.truncate(n)
            if n > matched:
                cache.retain(deeper)     # the next match of these tokens is a local hit
        except Exception as error:     # noqa: BLE001 - the tier never costs the caller its local hit
            if deeper is not None:
                try:
                    deeper.close()
                except Exception:     # noqa: BLE001 - already closed or never registered
                    pass
            self._failed(error, stacklevel=4, let_go=ctx)
            return found
        except BaseException:          # an interrupt: neither the local hit nor the tier's has a holder now
            ctx.close()
            if deeper is not None and not deeper.closed:
                deeper.close()
            raise
        if n > matched:
            ctx.close()
            found = deeper, n
        else:
            deeper.close()
        with self._failure_lock:
            self._outages, self._paused_until = 0, 0.0      # read: a pause (a trial's, or a slower call's) lifts
        if damaged is not None:        # a shorter prefix, or the local hit, served in its place
            self._failed(damaged, stacklevel=4, let_go=found[0])
        return found

    def _paused(self) -> bool:
        """Whether ``consult`` skips the tier now (counted in ``skipped``): the last ``OUTAGES_BEFORE_PAUSE``
        consults could not read it and ``outage_pause_s`` has not passed since the last, or another
        consult is trying it after the pause."""
        with self._failure_lock:
            now = self._clock()
            if now < self._paused_until:
                self.skipped += 1
                return True
            if self._outages >= OUTAGES_BEFORE_PAUSE and self.outage_pause_s:
                self._paused_until = now + self.outage_pause_s     # this consult is the trial: the rest skip
            return False

    def _failed(self, error: Exception, stacklevel: int, let_go: Context | None = None) -> None:
        """Counted and warned, the warning naming the line ``stacklevel`` frames up (the caller of
        ``match`` or ``get``). A warning made an error (``simplefilter("error", SecondTierWarning)``)
        ends the call: ``let_go``, the context it would have returned, has no holder then."""
        pause = ""
        with self._failure_lock:
            self.failures += 1
            self.last_failure = f"{type(error).__name__}: {error}"
            if isinstance(error, SnapshotReadError):        # not read: unreachable, past its deadline, refused
                self._outages += 1
                if self._outages >= OUTAGES_BEFORE_PAUSE and self.outage_pause_s:
                    self._paused_until = self._clock() + self.outage_pause_s
                    pause = (f"; not read {self._outages} times in a row, so match skips it for "
                             f"{self.outage_pause_s:g} s")
            else:                                           # read: what failed was not getting there
                self._outages, self._paused_until = 0, 0.0
        try:
            warnings.warn(SecondTierWarning(f"second tier {remote_io.redact(self.url_prefix)} could not deliver, "
                                            f"the local hit was used ({self.last_failure}){pause}"),
                          stacklevel=stacklevel)
        except BaseException:
            if let_go is not None and not let_go.closed:
                let_go.close()
            raise


def second_tier_match(cache: Cache, store: SnapshotStore, tokens) -> tuple[Context, int]:
    """``cache.match(tokens)``, then ``store`` for a longer prefix; what the store gives is retained in ``cache``.

    The returned context is the caller's, as from ``match``. On a cache built with
    ``second_tier=store`` this is just ``cache.match(tokens)``.
    """
    _check_cache(cache, "second_tier_match")
    if not isinstance(store, SnapshotStore):
        raise InvalidInputError(f"second_tier_match wants a SnapshotStore, got {type(store).__name__}")
    if getattr(cache, "second_tier", None) is store:
        return cache.match(tokens)
    return store.consult(cache, tokens, cache.match(tokens))


def _check_cache(cache, call: str) -> None:
    """A named error for what is not a kvstate ``Cache`` (a context, a path), before any request is sent."""
    if not isinstance(cache, Cache):
        raise InvalidInputError(f"{call} wants the kvstate Cache to look in or restore into, "
                                f"got {type(cache).__name__}")


def _token_bytes(tokens: np.ndarray) -> bytes:
    """Token ids as the snapshot format stores them (int32 little-endian), the input to a key's hash."""
    return np.asarray(tokens).astype("<i4").tobytes()
