"""The harness the race scenarios share: threads started together, self-verifying values, checks.

- ``run_threads`` starts thread bodies together at a barrier, optionally with an
  observer thread that checks invariants 1-3 on ``observe()`` the whole time, and
  re-raises the first failure as ``RaceFailure`` naming the thread.
- ``Watch`` checks each observation that differs from the last one it checked, and says
  when nothing changed, so an observer can step aside (``SETTLE``).
- ``switch_interval`` makes CPython switch threads as often as it can (restored after).
- ``pausing`` pauses a thread at chosen lines of the engine's code, handing another thread a turn
  in a window with no call inside it, which neither the GIL nor ``yielding_calls`` switches in.
- ``kv_for`` makes values self-verifying: the K/V of token ``t`` at position ``p``
  is a fixed function of both, so ``verify`` can check any read by its own tokens.
- ``check_after`` / ``check_emptied`` assert the invariants once the threads are done.
- ``attempt`` runs one write that a refusing pool (``on_full="refuse"``) may refuse, and
  checks that a refusal left the context as it was.
- ``make_cache`` hands a scenario the cache behind a ``trace.TracedCache``: each thread's last
  operations, which a failure's report shows (``rerun.racing_reported``).

Declared semantics (``spec/semantics.py``): ``race_configs`` holds the six standard
configurations and every semantics configuration of ``stateful/configs.py`` at the race
layout; ``pressure_configs`` the small pools that evict or refuse when full. A reference
replay runs under ``reference_config``: the values a thread's writes leave do not depend on
the pool, but which writes a full pool refuses depends on the schedule, which a sequential
replay cannot know, so the replay applies exactly the writes that happened.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import itertools
import os
import random
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kvstate.impl import Cache
from kvstate.spec import invariants
from kvstate.spec import precision as precisions
from kvstate.spec.semantics import may_refuse
from kvstate.spec.errors import CapacityError, ContextBusyError, ContextClosedError, InvariantViolation, PositionError
from kvstate.spec.layout import Layout
from kvstate.spec.observation import Observation
from kvstate.spec.protocol import Config, standard_configs

from ..configs import semantics_configs
from ..frames import raised_at
from ..lockstep import to_numpy
from ..stuck import waiting_at
from .trace import Trace, TracedCache

RACE_LAYOUT = Layout(layers=2, kv_heads=2, head_dim=4)
RACE_PAGE_TOKENS = 3          # odd, so writes straddle page boundaries
RACE_ARENA_PAGES = 8          # small: runs out (heap fallback) and recycles slots constantly
RACE_MAX_ENTRIES = 3          # small: eviction on most retains
SWITCH_INTERVAL = 1e-6        # seconds; CPython's default is 5e-3
YIELD_PROBABILITY = 0.05      # of a call into the engine's code giving up the interpreter (``yielding_calls``)
NAP_SECONDS = 2e-4            # a pause (``pausing``) at most, where the other thread waits for its lock
# A thread still running after this is reported as a hang, with the line each one waits at. The
# slowest iteration measured takes ~1.2 s (pressure_vs_match with yields, this 2-core machine): this
# leaves a correct backend 100 times slower room, and stays under conform's default check limit
# (300 s), so a deadlock's report is the hang's, not the check's clock's.
THREAD_TIMEOUT = 120.0
BUSY_RETRIES = 1_000_000      # a ContextBusyError retried this often is a livelock
SETTLE = 1e-5                 # seconds an observer steps aside after an observation that saw no change


class RaceFailure(AssertionError):
    """A race scenario found a wrong outcome; the message names store, seed, iteration and thread."""


@dataclass
class RaceReport:
    scenario: str
    store: str
    seed: int
    iterations: int = 0
    threads: int = 0
    counts: dict[str, int] = field(default_factory=dict)
    configs: list[str] = field(default_factory=list)     # configuration names, in the order run
    options: dict = field(default_factory=dict)          # the scenario's arguments a rerun passes again
    at: tuple[int, Config] | None = None                 # the iteration running, and its configuration
    skipped: dict[str, str] = field(default_factory=dict)  # configuration name -> why the scenario is n/a there
    trace: Trace = field(default_factory=Trace, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:        # threads count at once; a bare read-modify-write would lose counts
            self.counts[name] = self.counts.get(name, 0) + n

    def __str__(self) -> str:
        counts = ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
        return f"{self.scenario}[{store_label(self.store)}] seed={self.seed} iterations={self.iterations} threads={self.threads}: {counts}"


# -- stores and configurations -------------------------------------------------------

def available_stores() -> list[str]:
    """The page stores this build has: ``numpy`` always, ``torch`` once ``impl/torch.py`` exists."""
    stores = ["numpy"]
    if importlib.util.find_spec("kvstate.impl.torch") is not None and importlib.util.find_spec("torch") is not None:
        stores.append("torch")
    return stores


def race_configs(max_entries: int | None = None) -> list[Config]:
    """The six standard configurations (three precisions, heap and a small arena), then each declared
    semantics configuration of ``stateful/configs.py`` (token and block match, a page budget, pools
    that evict or refuse) at the race layout and page size; iterations cycle through them.
    ``max_entries`` replaces every configuration's entry bound (default: each keeps its own)."""
    configs = standard_configs(RACE_LAYOUT, page_tokens=RACE_PAGE_TOKENS, max_entries=RACE_MAX_ENTRIES,
                               arena_pages=RACE_ARENA_PAGES)
    configs += [config.with_(layout=RACE_LAYOUT, page_tokens=RACE_PAGE_TOKENS) for config in semantics_configs()]
    return configs if max_entries is None else [config.with_(max_entries=max_entries) for config in configs]


def pressure_configs() -> list[Config]:
    """Small pools under memory pressure: the race configurations that evict or refuse when full,
    and three more so that each match kind meets each policy and a page budget meets eviction."""
    declared = [config for config in race_configs() if config.on_full != "fallback"]
    base = Config(RACE_LAYOUT, RACE_PAGE_TOKENS, max_entries=RACE_MAX_ENTRIES)
    return declared + [
        base.with_(precision="f16", arena_pages=RACE_ARENA_PAGES, on_full="evict"),
        base.with_(precision="q8", match="block", block_tokens=2, max_entries=4, max_pages=5,
                   pool_pages=RACE_ARENA_PAGES, on_full="evict"),
        base.with_(precision="q8", match="token", pool_pages=RACE_ARENA_PAGES, on_full="refuse"),
    ]


def reference_config(config: Config) -> Config:
    """The configuration a reference replay of one thread's writes runs under: the same storage and
    semantics without the pool limit (the replay applies only the writes the engine let happen)."""
    return config.with_(on_full="fallback", pool_pages=0)


def make_cache(store, config: Config, trace: Trace | None = None) -> Cache:
    """``store`` names a built-in page store, or is a backend factory (``kvstate conform`` passes one);
    with a ``trace``, the cache's operations (and its contexts') are recorded in it."""
    cache = store(config) if callable(store) else Cache.from_config(config, store=store)
    _learn_engine_code(store, type(cache))
    return cache if trace is None else TracedCache(cache, trace)


def own_store(store) -> bool:
    """Whether ``store`` is one of kvstate's built-in page stores, whose race configurations are the
    suite's own (a scenario may set their entry bound to what it needs), rather than a backend's
    factory, which is raced only in the configurations it declared: a bound it did not declare it
    need not have (vLLM's and SGLang's adapters have none and declare ``max_entries`` 2**30)."""
    return not callable(store)


def store_label(store) -> str:
    """A built-in store's name; a backend's factory by its ``__qualname__``, or where a helper built it
    (``_make.<locals>.factory``, the same for every factory the helper built) as ``--backend`` loaded
    it, a file by its name alone (``plants.py:split_refcount``; the rerun line names its folders)."""
    if isinstance(store, str):
        return store
    label = getattr(store, "__qualname__", None) or repr(store)
    if "<locals>" not in label:
        return label
    from ..backends import backend_name

    name = backend_name(store)
    return name.rpartition(os.sep)[2] or name


def page_counters(cache) -> dict[str, int]:
    """Pages allocated and copied so far, from ``observe()``'s counters (empty where a backend keeps none)."""
    counters = cache.observe().counters or {}
    return {key: counters[key] for key in ("pages_allocated", "pages_copied") if key in counters}


# -- self-verifying values -------------------------------------------------------------

# Values are made once per input and handed out as copies (a verify re-reads what was written):
# 93% of ``kv_for``'s calls and 95% of ``expected_read``'s in conform's races check repeat one.
# Only small arrays are kept, as ``ops.values_for`` keeps them: a run at a backend's real layout
# writes megabytes a call, which are made afresh rather than held for the process's life.
_KEPT_VALUES = 1024         # values a kept array has at most: 4 KiB as float32


def kv_for(layout: Layout, tokens, start: int) -> np.ndarray:
    """The K/V every test writes for ``tokens`` at positions ``start, start + 1, ...``: a function of (token, position)."""
    tokens = tuple(tokens.tolist() if isinstance(tokens, np.ndarray) else tokens)
    if len(tokens) * layout.values_per_position <= _KEPT_VALUES:
        return _kept_kv(layout, tokens, start).copy()
    return _make_kv(layout, tokens, start)


@functools.lru_cache(maxsize=16_384)
def _kept_kv(layout: Layout, tokens: tuple[int, ...], start: int) -> np.ndarray:
    return _read_only(_make_kv(layout, tokens, start))


def _make_kv(layout: Layout, tokens, start: int) -> np.ndarray:
    tokens = np.asarray(tokens, dtype=np.int64)
    positions = np.arange(start, start + len(tokens), dtype=np.int64)
    base = ((tokens * 7919 + positions * 104729) % 1_000_003).astype(np.float64)
    lanes = np.arange(layout.values_per_position, dtype=np.float64).reshape(layout.position_shape)
    scale = (1 + tokens % 5).astype(np.float64)
    phase = base.reshape(-1, 1, 1, 1, 1) * 1e-3 + lanes * 0.37
    return (np.sin(phase) * scale.reshape(-1, 1, 1, 1, 1)).astype(np.float32)


def expected_read(config: Config, tokens) -> tuple[np.ndarray, np.ndarray]:
    """What a whole-context read must return for a context whose token ids are ``tokens``."""
    tokens = np.asarray(tokens, dtype=np.int64)
    if len(tokens) == 0:
        return np.zeros(config.layout.batch_shape(0), np.float32), tokens
    ids = tuple(tokens.tolist())
    if len(ids) * config.layout.values_per_position <= _KEPT_VALUES:
        return _kept_read(config.precision, config.layout, ids).copy(), tokens
    return precisions.roundtrip(config.precision, kv_for(config.layout, ids, 0)), tokens


@functools.lru_cache(maxsize=16_384)
def _kept_read(precision: str, layout: Layout, tokens: tuple[int, ...]) -> np.ndarray:
    return _read_only(precisions.roundtrip(precision, kv_for(layout, tokens, 0)))


def _read_only(values: np.ndarray) -> np.ndarray:
    values.setflags(write=False)       # kept: handed out only as copies
    return values


def read_numpy(ctx) -> tuple[np.ndarray, np.ndarray]:
    values, tokens = ctx.read()
    return to_numpy(values), np.asarray(to_numpy(tokens) if not isinstance(tokens, np.ndarray) else tokens)


def verify(ctx, config: Config, name: str, want_tokens=None) -> np.ndarray:
    """Read ``ctx`` and check its values against its token ids (and the ids against ``want_tokens``)."""
    values, tokens = read_numpy(ctx)
    want = expected_read(config, tokens if want_tokens is None else want_tokens)
    invariants.check_values({name: (values, tokens)}, {name: want})
    return tokens


def extend(ctx, config: Config, tokens) -> None:
    ctx.extend(list(tokens), kv_for(config.layout, tokens, len(ctx)))


def overwrite(ctx, config: Config, start: int, tokens) -> None:
    ctx.overwrite(start, list(tokens), kv_for(config.layout, tokens, start))


def attempt(write: Callable[[], None], ctx, config: Config, report: "RaceReport", name: str,
            want_tokens=None) -> bool:
    """Run one write on ``ctx`` (which the calling thread owns); True if it happened.

    A refusing pool (``on_full`` "refuse" or "evict-then-refuse") may refuse any write with ``CapacityError``, and the
    refusal must leave ``ctx`` as it was: the same length, and values matching ``want_tokens``
    (its tokens before the write, where the caller knows them) or else its own tokens. Under
    any other ``on_full`` a ``CapacityError`` is a failure.
    """
    before = len(ctx)
    try:
        write()
        return True
    except CapacityError as error:
        if not may_refuse(config.on_full):
            raise RaceFailure(f"{name}: CapacityError although on_full={config.on_full!r}: {error}") from error
    report.add("refusals")
    if len(ctx) != before:
        raise RaceFailure(f"{name}: a refused write changed the length from {before} to {len(ctx)}")
    verify(ctx, config, f"{name} after a refused write", want_tokens=want_tokens)
    return False


# -- threads ------------------------------------------------------------------------------

@contextmanager
def switch_interval(seconds: float = SWITCH_INTERVAL):
    """Make the interpreter switch threads as often as it can; restore the old interval after."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def engine_folder(store) -> str:
    """The folder of the engine's own modules: ``kvstate.impl``'s for a built-in store, else that
    of the factory's module; ``""`` (every call counts) where the factory has no source file."""
    try:
        return os.path.dirname(inspect.getsourcefile(store if callable(store) else Cache) or "")
    except TypeError:
        return ""


# Per store, a box ``[places, store]``: the places the engine's code lives (the factory's folder, and the
# package its caches' class comes from, learnt as ``make_cache`` builds them) and the store it is for. A factory in a thin adapter
# file builds an engine installed elsewhere, whose unlocked windows the yields and pauses missed while
# they counted the adapter's folder alone (an outside audit). The list is read at every profiled call,
# so what a scenario's first cache teaches counts at once.
_ENGINE_CODE: dict = {}


def engine_code(store) -> list[tuple[str, ...]]:
    """The box holding where ``store``'s code lives (``str.startswith`` takes the tuple in it)."""
    key = store if isinstance(store, str) else id(store)
    box = _ENGINE_CODE.get(key)
    if box is None or (not isinstance(store, str) and box[1] is not store):
        box = _ENGINE_CODE[key] = [(engine_folder(store),), store]
    return box


def engine_folders(store) -> tuple[str, ...]:
    """Where ``store``'s code lives as far as learnt: its factory's folder and its caches' package."""
    return engine_code(store)[0]


def _learn_engine_code(store, cache_class: type) -> None:
    """Count ``cache_class``'s top-level package (its file, for a module outside any) as ``store``'s code;
    not kvstate's own: a built-in store's is ``kvstate.impl`` already, and an adapter's the folder it sits in."""
    top = cache_class.__module__.partition(".")[0]
    module = sys.modules.get(top)
    where = getattr(module, "__file__", None)
    if top == "kvstate" or not where:
        return
    place = os.path.dirname(where) if hasattr(module, "__path__") else where
    box = engine_code(store)
    if place and not any(place.startswith(known) and known for known in box[0]):
        box[0] = (*box[0], place)


@contextmanager
def yielding_calls(folder, seed: int, probability: float = YIELD_PROBABILITY):
    """Threads started meanwhile give up the interpreter (``time.sleep(0)``) at a random
    ``probability`` of their calls into code under ``folder`` (a path, or ``engine_code``'s box,
    read at every call).

    Why: under the GIL a thread waiting for the interpreter gets it only after a timed wait,
    whose granularity is tens of microseconds however small ``sys.setswitchinterval`` is, so a
    step of the engine that runs for a few microseconds without the lock it needs is almost
    never interleaved. A yield at the engine's own calls (``make_room`` calling ``pop_oldest``,
    ``_release`` calling ``pool.release``, ...) lets another thread in exactly there.
    """
    draw, sleep = random.Random(seed).random, time.sleep
    where = folder if isinstance(folder, list) else [folder]

    def profile(frame, event, arg) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(where[0]) and draw() < probability:
            sleep(0)

    previous = threading.getprofile()
    threading.setprofile(profile)
    try:
        yield
    finally:
        threading.setprofile(previous)


@contextmanager
def pausing(folder: str | tuple[str, ...], pause_at: Callable[[int], bool], pause: Callable[[], None] | None = None):
    """The calling thread, meanwhile, pauses at each line it runs in code under ``folder`` for which
    ``pause_at(n)`` is true (``n`` counts those lines from 0), as a preempted thread would: it
    calls ``pause`` there (by default a sleep of ``NAP_SECONDS``) while the other threads run on.
    Its own ``sys.settrace`` hook, tracing the lines of those frames alone.

    Why: a window with no call and no loop inside it never loses the interpreter under the GIL
    (CPython 3.11 switches threads only at calls and backward jumps), and ``yielding_calls`` yields
    only at calls: a clock read on one line and written back on the next, or a page published on
    one line and filled by NumPy slice copies on the next, is atomic there, though a preempted OS
    thread or a free-threaded build stops between any two lines. The scenarios' ``pause`` hands
    another thread whole operations to run there (waiting for them, or ``NAP_SECONDS`` where the
    first waits for a lock the paused thread holds)."""
    count, pause = itertools.count(), pause or functools.partial(time.sleep, NAP_SECONDS)

    def lines(frame, event, arg):
        if event == "line" and pause_at(next(count)):
            pause()
        return lines

    def calls(frame, event, arg):
        return lines if frame.f_code.co_filename.startswith(folder) else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        yield
    finally:
        sys.settrace(previous)


@contextmanager
def racing(store, seed: int, yields: bool):
    """What every scenario runs under: ``switch_interval``, and with ``yields``, ``yielding_calls``
    into the engine (a Python-level profile hook on every call: it slows the threads several times
    over, so CI uses it where the short unlocked windows matter most; ``kvstate stress`` every other
    round; ``kvstate conform`` in every round after its first). Scenarios enter it through
    ``rerun.racing_reported``, which gives a failure its report."""
    with switch_interval():
        if not yields:
            yield
            return
        with yielding_calls(engine_code(store), seed):
            yield


def retry_busy(operation: Callable, report: RaceReport):
    """Run ``operation``, retrying while another thread holds the context (``ContextBusyError``)."""
    for _ in range(BUSY_RETRIES):
        try:
            return operation()
        except ContextBusyError:
            report.add("busy_refusals")
            time.sleep(0)
    raise RaceFailure(f"{operation} refused as busy {BUSY_RETRIES} times in a row: livelock")


def run_threads(bodies: list[Callable[[], None]], where: str, observe_cache: Cache | None = None,
                report: RaceReport | None = None, config: Config | None = None) -> None:
    """Start ``bodies`` together at a barrier, join them, and re-raise the first failure, naming its thread.

    With ``observe_cache``, one more thread checks invariants 1-3 on ``observe()`` until the others
    finish, and, given the ``config``, that a refusing pool never passes its limit (``check_pool``).
    Given the ``report``, its trace is frozen at the first failure (``Trace.freeze``).
    """
    barrier = threading.Barrier(len(bodies) + (observe_cache is not None))
    failures: list[tuple[int, BaseException]] = []
    done = threading.Event()

    def wrap(index: int, body: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                barrier.wait()
                body()
            except BaseException as error:      # noqa: BLE001 - reported to the joining thread
                if report is not None and not isinstance(error, threading.BrokenBarrierError):
                    report.trace.freeze()       # what every thread was doing when this one failed
                failures.append((index, error))
                barrier.abort()
        return run

    def observer() -> None:     # started through ``wrap``, which waits at the barrier
        watch = Watch(observe_cache, config)
        while not done.is_set():
            if not watch.look():
                time.sleep(SETTLE)      # nothing new: let the writers move on
        if report is not None:
            report.add("observations", watch.changes)

    threads = [threading.Thread(target=wrap(i, body), name=f"{where}/t{i}", daemon=True)
               for i, body in enumerate(bodies)]
    watcher = None
    if observe_cache is not None:
        watcher = threading.Thread(target=wrap(len(bodies), observer), name=f"{where}/observer", daemon=True)
        watcher.start()
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + THREAD_TIMEOUT
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    done.set()
    if watcher is not None:
        watcher.join(max(1.0, deadline - time.monotonic()))
    # A thread's own failure first: it may be why another one never finished.
    def named(index: int) -> str:
        return "observer" if index == len(bodies) else f"thread {index}"

    real = [(i, e) for i, e in failures if not isinstance(e, threading.BrokenBarrierError)] or failures
    if real:
        index, error = real[0]
        name = named(index)
        # Where the backend raised it (the suite's own assertions have no place to name): a race's only trace.
        raise RaceFailure(f"{where}, {name}: {type(error).__name__}: {error}{raised_at(error)}") from error
    hung = [(index, thread) for index, thread in enumerate(threads + ([watcher] if watcher else [])) if thread.is_alive()]
    if hung:
        waits = "; ".join(f"{named(index)} {waiting_at(thread.ident) or 'ended just now'}" for index, thread in hung)
        raise RaceFailure(f"{where}: {len(hung)} of its threads still running after {THREAD_TIMEOUT:g} s, a deadlock "
                          f"or a wait that never ends: {waits}")


class Watch:
    """Observe ``cache`` and check invariants 1-3 (and ``check_pool`` given the ``config``) on what it shows.

    ``look`` checks an observation only if it differs from the last one checked (the checks are
    functions of the observation: an equal one gets the same verdict) and returns whether it
    differed. ``observe()`` takes the cache lock, so an observer looking back to back holds the
    writers up: in ``observe_during_writes`` about 1 look in 50 saw a state not checked before.
    An observer that steps aside for ``SETTLE`` seconds after a look that saw no change lets
    them move on, so its next look more likely sees a new state.
    """

    __slots__ = ("cache", "config", "last", "changes")

    def __init__(self, cache, config: Config | None = None) -> None:
        self.cache, self.config, self.last, self.changes = cache, config, None, 0

    def look(self) -> bool:
        obs = self.cache.observe()
        if _same(obs, self.last):
            return False
        invariants.check_structure(obs)
        check_pool(obs, self.config)
        self.last = obs
        self.changes += 1
        return True


_MUTABLE_FIELDS = ("pages", "holders", "lengths", "arena_out", "counters")


def _same(obs: Observation, last: Observation | None) -> bool:
    """``obs`` equals ``last``, and is a fresh one: a backend that hands out the same dict twice
    (and changes it in place) must not have its changes taken for the state already checked."""
    if last is None or obs is last:
        return False
    if any(getattr(obs, name) is getattr(last, name) and getattr(obs, name) is not None for name in _MUTABLE_FIELDS):
        return False
    try:
        return bool(obs == last)
    except Exception:       # noqa: BLE001 - a value that does not compare plainly (an array): check it
        return False


def check_pool(obs: Observation, config: Config | None) -> None:
    """A refusing pool never holds more live pages than its limit: every allocation past it is
    refused before it happens (``spec/semantics.py``). Cached pages (refcount 0, reusable) are
    not counted; a backend without the pages tier is not checked here."""
    if config is None or not may_refuse(config.on_full) or obs.pages is None:
        return
    live = sum(1 for page in obs.pages.values() if not page.cached)
    if live > config.pool_limit:
        raise InvariantViolation("pool", f"{live} live pages in a pool of {config.pool_limit} pages that refuses when full")


def check_after(cache: Cache, where: str, expected_tree=None, live: dict | None = None,
                reference: dict | None = None, config: Config | None = None) -> None:
    """Invariants 1-3 (and ``check_pool`` given the ``config``), the tree (5) against ``expected_tree``
    (default: what is observed, structure only), and values (4) of ``live`` engine contexts against
    ``reference`` twins."""
    try:
        obs = cache.observe()
        invariants.check_structure(obs)
        check_pool(obs, config)
        if expected_tree is None:       # the tree's own, structure only (none without the tree tier)
            expected_tree = [(entry.key, entry.tick) for entry in obs.entries or ()]
        # under block matching an entry may hold only its whole blocks (spec/semantics.py), as lockstep allows
        block_tokens = config.block_tokens if config is not None and config.match == "block" else 0
        invariants.check_tree(obs, expected_tree, block_tokens)
        if live is not None:
            invariants.check_values({n: read_numpy(c) for n, c in live.items()},
                                    {n: r.read() for n, r in reference.items()})
    except InvariantViolation as error:
        raise RaceFailure(f"{where}: {error}") from error


def is_closed(ctx) -> bool:
    """Whether ``ctx`` is closed: its ``closed`` attribute where it has one (the protocol does not ask
    for it), else whether a read is refused as a closed context's."""
    closed = getattr(ctx, "closed", None)
    if isinstance(closed, bool):
        return closed
    try:
        ctx.read()          # the call conform holds to refusing once closed
    except (ContextClosedError, PositionError):     # README lets a closed context read as 0 positions long
        return True
    return False


def check_emptied(cache: Cache, where: str) -> None:
    """Invariant 6 once every context is closed and the tree cleared."""
    cache.clear()
    try:
        invariants.check_empty(cache.observe())
    except InvariantViolation as error:
        raise RaceFailure(f"{where}: {error}") from error


def seeded_rng(seed: int, iteration: int, thread: int = 0) -> np.random.Generator:
    return np.random.default_rng([seed, iteration, thread])
