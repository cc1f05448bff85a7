"""``Context.read`` of a long context at small pages, per store and precision.

    python -m kvstate.bench.read_pages [--tokens 2048] [--repeat 5]

A 2x2x16 layout (the lockstep machine's shape, wider heads), page sizes 1 and 16, every
precision, the NumPy store and (where torch is installed) the torch store on the CPU. Each row is
the fastest of ``--repeat`` reads of the whole context, in milliseconds. A read joins its pages'
rows per stored part and decodes them once (``read_spans``, both stores), where a read page by
page paid a slice, a decode and a move per page: at one-token pages, thousands of them a read.
Timings are printed, never asserted.
"""

from __future__ import annotations

import argparse

import numpy as np

from kvstate.spec.layout import Layout

from .timing import best_of

LAYOUT = Layout(layers=2, kv_heads=2, head_dim=16)
PAGE_SIZES = (1, 16)


def stores() -> list[str]:
    try:
        import torch  # noqa: F401
    except ImportError:
        return ["numpy"]
    return ["numpy", "torch"]


def run(tokens: int = 2048, repeat: int = 5) -> list[dict]:
    from kvstate.impl import Cache

    kv = np.random.default_rng(0).standard_normal(LAYOUT.batch_shape(tokens)).astype(np.float32)
    rows = []
    for store in stores():
        for precision in ("f32", "f16", "q8"):
            for page in PAGE_SIZES:
                cache = Cache(LAYOUT, page_tokens=page, precision=precision, store=store)
                ctx = cache.allocate()
                ctx.extend(list(range(tokens)), kv)
                seconds = best_of(ctx.read, repeat)
                rows.append(dict(store=store, precision=precision, page_tokens=page, tokens=tokens,
                                 read_ms=round(seconds * 1e3, 3)))
                ctx.close()
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvstate.bench.read_pages", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"{'store':6} {'precision':9} {'page':>4} {'read ms':>8}")
    for row in run(args.tokens, args.repeat):
        print(f"{row['store']:6} {row['precision']:9} {row['page_tokens']:>4} {row['read_ms']:>8.2f}")
    print(f"reproduce: python -m kvstate.bench.read_pages --tokens {args.tokens} --repeat {args.repeat}")


if __name__ == "__main__":
    main()
