"""``Context.read`` of a long context at small pages, per store and precision.

    python -m kvstate.bench.read_pages [--tokens 2048] [--rounds 5] [--against DIR]

A 2x2x16 layout (the lockstep machine's shape, wider heads), page sizes 1 and 16, every
precision, the NumPy store and (where torch is installed) the torch store on the CPU. Each row is
the fastest of ``--rounds`` reads of the whole context, in milliseconds. A read joins its pages'
rows per stored part and decodes them once (``read_spans``, both stores), where a read page by
page paid a slice, a decode and a move per page: at one-token pages, thousands of them a read.

``--against DIR`` reads the same contexts in another checkout (an older commit, say), in its own
process, rounds interleaved (``bench/checkouts.py``), and prints the speedup. Timings are printed,
never asserted.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvstate.spec.layout import Layout

LAYOUT = Layout(layers=2, kv_heads=2, head_dim=16)
PAGE_SIZES = (1, 16)
PRECISIONS = ("f32", "f16", "q8")


def stores() -> list[str]:
    try:
        import torch  # noqa: F401
    except ImportError:
        return ["numpy"]
    return ["numpy", "torch"]


class Reader:
    """One context per (store, precision, page size), each holding the same ``tokens`` positions."""

    def __init__(self, tokens: int):
        from kvstate.impl import Cache     # absolute: a checkout served by path imports its own

        kv = np.random.default_rng(0).standard_normal(LAYOUT.batch_shape(tokens)).astype(np.float32)
        self.contexts = {}
        for store in stores():
            for precision in PRECISIONS:
                for page in PAGE_SIZES:
                    ctx = Cache(LAYOUT, page_tokens=page, precision=precision, store=store).allocate()
                    ctx.extend(list(range(tokens)), kv)
                    self.contexts[f"{store}/{precision}/{page}"] = ctx

    def round(self) -> dict[str, float]:
        seconds = {}
        for case, ctx in self.contexts.items():
            start = time.perf_counter()
            ctx.read()
            seconds[case] = time.perf_counter() - start
        return seconds


def serve_rounds(rounds: int, tokens: int) -> None:
    """The child's loop: one round per line on stdin, its seconds per case as JSON on stdout."""
    reader = Reader(tokens)
    for _ in range(rounds):
        sys.stdin.readline()
        print(json.dumps(reader.round()), flush=True)


def run(tokens: int = 2048, rounds: int = 5, against: Path | None = None) -> list[dict]:
    from .checkouts import finish, next_round, serve_in     # not at the top: the child runs this file by path

    reader = Reader(tokens)
    best = {kind: dict.fromkeys(reader.contexts, float("inf")) for kind in ("read", "against")}
    with tempfile.TemporaryDirectory() as scratch:
        arguments = ["--serve", str(rounds), "--tokens", str(tokens)]
        children = [serve_in(against, Path(__file__), arguments, Path(scratch) / "against")] if against else []
        for _ in range(rounds):               # interleaved: one of each, in turn
            timed = {"read": reader.round()}
            for child in children:
                timed["against"] = next_round(child)
            for kind, seconds in timed.items():
                for case, s in seconds.items():
                    best[kind][case] = min(best[kind][case], s)
        finish(children)
    rows = []
    for case in reader.contexts:
        store, precision, page = case.split("/")
        row = dict(store=store, precision=precision, page_tokens=int(page), tokens=tokens,
                   read_ms=round(best["read"][case] * 1e3, 3))
        if against is not None:
            row["against_ms"] = round(best["against"][case] * 1e3, 3)
            row["speedup"] = round(best["against"][case] / best["read"][case], 2)
        rows.append(row)
    return rows


def main(argv=None) -> None:
    try:
        from .args import checkout, positive_int     # run as a module (the parent), arguments are checked here
    except ImportError:                              # the child another checkout runs by path: the parent checked them
        positive_int, checkout = int, Path
    parser = argparse.ArgumentParser(prog="python -m kvstate.bench.read_pages", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=positive_int, default=2048)
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--against", type=checkout, help="another checkout to time beside this one")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve_rounds(args.serve, args.tokens)
        return
    rows = run(args.tokens, args.rounds, args.against)
    against = args.against is not None
    print(f"{'store':6} {'precision':9} {'page':>4} {'read ms':>8}" + (f" {'against ms':>10} {'speedup':>7}" * against))
    for row in rows:
        print(f"{row['store']:6} {row['precision']:9} {row['page_tokens']:>4} {row['read_ms']:>8.2f}"
              + (f" {row['against_ms']:>10.2f} {row['speedup']:>7.2f}" if against else ""))
    print(f"reproduce: python -m kvstate.bench.read_pages --tokens {args.tokens} --rounds {args.rounds}"
          + (f" --against {args.against}" if against else ""))


if __name__ == "__main__":
    main()
