"""fork, extend and writable cost: the torch page store against the NumPy store, side by side in one run.

    python -m kvstate.bench.store_bench [--device cpu|cuda] [--repeat N]

Prints the median time per operation for each store and the ratio torch / numpy.
The stores are timed interleaved (one numpy op, one torch op, ...) so machine load
hits both alike. Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvstate import Cache, Layout

from .args import positive_int

LAYOUT = Layout(layers=8, kv_heads=8, head_dim=64)    # 16 KiB per position at f32
PAGE_TOKENS = 64
CONTEXT = 1024 + 17                                    # 17 pages, the last partly filled


def _sync(device: str):
    if device == "cuda":
        import torch

        return torch.cuda.synchronize
    return lambda: None


class Subject:
    """One store's cache holding a long context, and the three operations to time."""

    def __init__(self, store: str, device: str, precision: str):
        self.cache = Cache(LAYOUT, page_tokens=PAGE_TOKENS, precision=precision, store=store, device=device)
        self.sync = _sync(device)
        rng = np.random.default_rng(0)
        values = rng.standard_normal(LAYOUT.batch_shape(CONTEXT)).astype(np.float32)
        self.one = rng.standard_normal(LAYOUT.batch_shape(1)).astype(np.float32)
        if store == "torch":
            import torch

            values, self.one = torch.from_numpy(values).to(device), torch.from_numpy(self.one).to(device)
        self.ctx = self.cache.allocate()
        self.ctx.extend([i % 1000 for i in range(CONTEXT)], values)
        self.tail = self.cache.allocate()                 # a private context that grows by one per extend

    def fork(self) -> float:
        started = time.perf_counter()
        child = self.ctx.fork()
        self.sync()
        elapsed = time.perf_counter() - started
        child.close()
        return elapsed

    def writable(self) -> float:
        """One-position overwrite in a fork: ``writable`` copies exactly one shared page."""
        child = self.ctx.fork()
        self.sync()
        started = time.perf_counter()
        child.overwrite(100, [7], self.one)
        self.sync()
        elapsed = time.perf_counter() - started
        child.close()
        return elapsed

    def extend(self) -> float:
        """A decode step: append one position to a private context."""
        started = time.perf_counter()
        self.tail.extend([7], self.one)
        self.sync()
        elapsed = time.perf_counter() - started
        if len(self.tail) >= 4 * PAGE_TOKENS:
            self.tail.truncate(0)
        return elapsed


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeat", type=positive_int, default=300)
    parser.add_argument("--precision", default="f32", choices=["f32", "f16", "q8"])
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda asked for, but torch sees no CUDA device")
    torch.set_num_threads(1)   # like numpy's single-threaded copies: compare per-op overhead, not cores
    subjects = {"numpy": Subject("numpy", "cpu", args.precision), "torch": Subject("torch", args.device, args.precision)}
    times = {(store, op): [] for store in subjects for op in ("fork", "extend", "writable")}
    for _ in range(args.repeat):
        for op in ("fork", "extend", "writable"):
            for store, subject in subjects.items():
                times[store, op].append(getattr(subject, op)())
    print(f"layout {LAYOUT}, {args.precision}, page {PAGE_TOKENS} tokens, context {CONTEXT} positions, "
          f"{args.repeat} repeats; torch on {args.device}, {torch.get_num_threads()} thread")
    print(f"{'operation':<10} {'numpy µs':>10} {'torch µs':>10} {'torch/numpy':>12}")
    for op in ("fork", "extend", "writable"):
        n = statistics.median(times["numpy", op]) * 1e6
        t = statistics.median(times["torch", op]) * 1e6
        print(f"{op:<10} {n:>10.1f} {t:>10.1f} {t / n:>12.2f}")
    counters = {store: s.cache.stats()["pages_copied"] for store, s in subjects.items()}
    print(f"pages copied: {counters} (one per writable call on each side)")


if __name__ == "__main__":
    main()
