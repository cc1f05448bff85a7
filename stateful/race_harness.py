"""The harness the race scenarios share: threads started together, self-verifying values, checks.

- ``run_threads`` starts thread bodies together at a barrier, optionally with an
  observer thread that checks invariants 1-3 on ``observe()`` the whole time, and
  re-raises the first failure as ``RaceFailure`` naming the thread.
- ``switch_interval`` makes CPython switch threads as often as it can (restored after).
- ``kv_for`` makes values self-verifying: the K/V of token ``t`` at position ``p``
  is a fixed function of both, so ``verify`` can check any read by its own tokens.
- ``check_after`` / ``check_emptied`` assert the invariants once the threads are done.
"""

from __future__ import annotations

import importlib.util
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
from kvstate.spec.errors import ContextBusyError, InvariantViolation
from kvstate.spec.layout import Layout
from kvstate.spec.protocol import Config, standard_configs

from .lockstep import to_numpy

RACE_LAYOUT = Layout(layers=2, kv_heads=2, head_dim=4)
RACE_PAGE_TOKENS = 3          # odd, so writes straddle page boundaries
RACE_ARENA_PAGES = 8          # small: runs out (heap fallback) and recycles slots constantly
RACE_MAX_ENTRIES = 3          # small: eviction on most retains
SWITCH_INTERVAL = 1e-6        # seconds; CPython's default is 5e-3
THREAD_TIMEOUT = 120.0        # a thread still running after this is reported as a hang
BUSY_RETRIES = 1_000_000      # a ContextBusyError retried this often is a livelock


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


def race_configs(max_entries: int = RACE_MAX_ENTRIES) -> list[Config]:
    """The six configurations (three precisions, heap and a small arena); iterations cycle through them."""
    return standard_configs(RACE_LAYOUT, page_tokens=RACE_PAGE_TOKENS, max_entries=max_entries,
                            arena_pages=RACE_ARENA_PAGES)


def make_cache(store, config: Config) -> Cache:
    """``store`` names a built-in page store, or is a backend factory (``kvstate conform`` passes one)."""
    if callable(store):
        return store(config)
    return Cache.from_config(config, store=store)


def store_label(store) -> str:
    return store if isinstance(store, str) else getattr(store, "__qualname__", repr(store))


def page_counters(cache) -> dict[str, int]:
    """Pages allocated and copied so far, from ``observe()``'s counters (empty where a backend keeps none)."""
    counters = cache.observe().counters
    return {key: counters[key] for key in ("pages_allocated", "pages_copied") if key in counters}


# -- self-verifying values -------------------------------------------------------------

def kv_for(layout: Layout, tokens, start: int) -> np.ndarray:
    """The K/V every test writes for ``tokens`` at positions ``start, start + 1, ...``: a function of (token, position)."""
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
    return precisions.roundtrip(config.precision, kv_for(config.layout, tokens, 0)), tokens


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
                report: RaceReport | None = None) -> None:
    """Start ``bodies`` together at a barrier, join them, and re-raise the first failure, naming its thread.

    With ``observe_cache``, one more thread checks invariants 1-3 on ``observe()`` until the others finish.
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
                failures.append((index, error))
                barrier.abort()
        return run

    def observer() -> None:     # started through ``wrap``, which waits at the barrier
        checks = 0
        while not done.is_set():
            invariants.check_structure(observe_cache.observe())
            checks += 1
        if report is not None:
            report.add("observations", checks)

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
    real = [(i, e) for i, e in failures if not isinstance(e, threading.BrokenBarrierError)] or failures
    if real:
        index, error = real[0]
        name = "observer" if index == len(bodies) else f"thread {index}"
        raise RaceFailure(f"{where}, {name}: {type(error).__name__}: {error}") from error
    hung = [t.name for t in threads + ([watcher] if watcher else []) if t.is_alive()]
    if hung:
        raise RaceFailure(f"{where}: threads {hung} still running after {THREAD_TIMEOUT}s (deadlock?)")


def check_after(cache: Cache, where: str, expected_tree=None, live: dict | None = None,
                reference: dict | None = None) -> None:
    """Invariants 1-3, the tree (5) against ``expected_tree`` (default: what is observed, structure only),
    and values (4) of ``live`` engine contexts against ``reference`` twins."""
    try:
        obs = cache.observe()
        invariants.check_structure(obs)
        if expected_tree is None:
            expected_tree = [(entry.key, entry.tick) for entry in obs.entries]
        invariants.check_tree(obs, expected_tree)
        if live is not None:
            invariants.check_values({n: read_numpy(c) for n, c in live.items()},
                                    {n: r.read() for n, r in reference.items()})
    except InvariantViolation as error:
        raise RaceFailure(f"{where}: {error}") from error


def check_emptied(cache: Cache, where: str) -> None:
    """Invariant 6 once every context is closed and the tree cleared."""
    cache.clear()
    try:
        invariants.check_empty(cache.observe())
    except InvariantViolation as error:
        raise RaceFailure(f"{where}: {error}") from error


def seeded_rng(seed: int, iteration: int, thread: int = 0) -> np.random.Generator:
    return np.random.default_rng([seed, iteration, thread])
