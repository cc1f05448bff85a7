"""``extend`` of a long batch, beside the bare copy of the same bytes into pages.

    python -m kvstate.bench.extend [--tokens 512 2048] [--rounds 7] [--against DIR]

GPT-2-small layout (12 layers, 12 heads, 64 wide: 72 KiB a position), f32, 64-token pages
(4.5 MiB each), NumPy store, no arena. Each round and length: a context is allocated, extended
by n positions (token ids and K/V, validated and copied at the door as always) and closed, in a
cache that has served such rounds before, so the pages freed by the last round are there to be
reused. Beside it, the floor: the same K/V copied into layer-major page arrays allocated once
(``np.copyto`` from the position-major batch), the one copy any paged store makes, nothing
checked. Best round kept; timings are printed, never asserted.

``--against DIR`` times the same ``extend`` in another checkout (an older commit, say), in its
own process, rounds interleaved, and prints the speedup. Only API every version has is used.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

LENGTHS = (512, 2048)
PAGE_TOKENS = 64


def _layout():
    from kvstate.spec.layout import Layout

    return Layout(layers=12, kv_heads=12, head_dim=64)


def _batch(n: int) -> np.ndarray:
    return np.random.default_rng(n).standard_normal(_layout().batch_shape(n), dtype=np.float32)


class Extender:
    """One cache per length, each round's ``extend`` of n positions into a fresh context."""

    def __init__(self, lengths):
        from kvstate.impl import Cache

        self.cases = {n: (Cache(_layout(), page_tokens=PAGE_TOKENS), np.arange(n), _batch(n)) for n in lengths}

    def round(self) -> dict[int, float]:
        seconds = {}
        for n, (cache, tokens, kv) in self.cases.items():
            ctx = cache.allocate()
            start = time.perf_counter()
            ctx.extend(tokens, kv)
            seconds[n] = time.perf_counter() - start
            ctx.close()
        return seconds


def floor_round(extender: Extender, pages: dict) -> dict[int, float]:
    """The bare copy of each of ``extender``'s batches into ``pages[n]`` (layer-major arrays,
    allocated and touched once)."""
    seconds = {}
    for n, (_, _, kv) in extender.cases.items():
        start = time.perf_counter()
        for index, page in enumerate(pages[n]):
            rows = kv[index * PAGE_TOKENS:(index + 1) * PAGE_TOKENS]
            np.copyto(page[:, :, :len(rows)], np.moveaxis(rows, 0, 2))
        seconds[n] = time.perf_counter() - start
    return seconds


def serve_rounds(rounds: int, lengths) -> None:
    """The child's loop: one round per line on stdin, its seconds per length as JSON on stdout."""
    extender = Extender(lengths)
    for _ in range(rounds):
        sys.stdin.readline()
        print(json.dumps(extender.round()), flush=True)


def run(lengths=LENGTHS, rounds: int = 7, against: Path | None = None) -> dict:
    layout = _layout()
    extender = Extender(lengths)
    pages = {n: [np.ones(layout.page_shape(PAGE_TOKENS), np.float32) for _ in range(-(-n // PAGE_TOKENS))]
             for n in lengths}
    best = {kind: dict.fromkeys(lengths, float("inf")) for kind in ("extend", "floor", "against")}
    from .checkouts import finish, next_round, serve_in     # not at the top: the child runs this file by path

    with tempfile.TemporaryDirectory() as scratch:
        arguments = ["--serve", str(rounds), "--tokens", *map(str, lengths)]
        children = [serve_in(against, Path(__file__), arguments, Path(scratch) / "against")] if against else []
        for _ in range(rounds):               # interleaved: one of each, in turn
            timed = {"extend": extender.round(), "floor": floor_round(extender, pages)}
            for child in children:
                timed["against"] = {int(n): s for n, s in next_round(child).items()}
            for kind, seconds in timed.items():
                for n, s in seconds.items():
                    best[kind][n] = min(best[kind][n], s)
        finish(children)
    rows = []
    for n in lengths:
        row = {"tokens": n, "MB": round(n * layout.values_per_position * 4 / 1e6, 1),
               "extend_ms": 1e3 * best["extend"][n], "floor_ms": 1e3 * best["floor"][n],
               "extend_over_floor": best["extend"][n] / best["floor"][n]}
        if against is not None:
            row["against_ms"] = 1e3 * best["against"][n]
            row["speedup"] = best["against"][n] / best["extend"][n]
        rows.append(row)
    command = "python -m kvstate.bench.extend --tokens " + " ".join(map(str, lengths)) + f" --rounds {rounds}"
    return {"name": "extend", "params": {"layout": "GPT-2 small f32", "page_tokens": PAGE_TOKENS, "rounds": rounds,
                                         "against": str(against) if against else None},
            "rows": rows, "command": command + (f" --against {against}" if against else "")}


def main(argv: list[str] | None = None) -> int:
    try:
        from .args import checkout, positive_int     # run as a module (the parent), arguments are checked here
    except ImportError:                              # the child another checkout runs by path: the parent checked them
        positive_int, checkout = int, Path
    parser = argparse.ArgumentParser(prog="python -m kvstate.bench.extend", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=positive_int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--rounds", type=positive_int, default=7)
    parser.add_argument("--against", type=checkout, help="another checkout to time beside this one")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve_rounds(args.serve, args.tokens)
        return 0
    from .run import format_result, timed

    print(format_result(timed(lambda: run(args.tokens, args.rounds, args.against))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
