"""The NumPy GPT-2's prefill beside transformers', optionally beside another checkout's model too.

    OPENBLAS_NUM_THREADS=T OMP_NUM_THREADS=T MKL_NUM_THREADS=T \\
        python -m kvstate.bench.prefill --threads T [--tokens 512 2048] [--rounds 3] [--against DIR]

GPT-2 small with random weights (seed 0), ``n`` random tokens into an empty context; each figure
is the best of ``--rounds``. ``prefill/HF`` is the NumPy prefill over ``GPT2LMHeadModel``'s on the
same tokens, in the same process (HF's time moves 10-20% between runs on a shared machine, so a
change to the model is judged by ``--against``: the other checkout's model runs in its own
process, ``bench/checkouts.py``, its rounds interleaved with ours and HF's). So does this
checkout's model, in a second child (``here s``): ``against/here`` compares two models that ran
alike, each in a process of its own with nothing else loaded. Ours in the bench's process, beside
torch and a model it has just run, is not alike: with this checkout on both sides (``--against``
its own root), one run measured 20.11 s in the process and 20.41 s in the child. BLAS reads its thread
count at import, hence the variables; ``--threads`` sets torch's and the model's own (``GPT2(threads=)``).
``attention s`` and ``HF attention s`` are the parts of those best rounds spent in attention: the
model's ``attend`` and the ``torch.nn.functional.scaled_dot_product_attention`` that transformers'
GPT-2 calls (its default ``sdpa`` attention; "-" where it called none). ``floor s`` is what no NumPy
prefill can skip, run alone in the same rounds (``bench/prefill_floor.py``: the weights' products,
attention's products, NumPy's ``exp``; each part at its fastest round, printed below the table), and
``floor/HF`` that over HF's best: where it is above 1.0, no NumPy prefill on this BLAS and CPU meets
the target. Timings are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


class Prefiller:
    """Times the NumPy model's prefill of each length, one length after another per round."""

    def __init__(self, lengths: list[int], threads: int, tiny: bool):
        from kvstate.impl import Cache      # absolute: a checkout served by path imports its own
        from kvstate.model import GPT2, GPT2Config

        self.config = GPT2Config.tiny() if tiny else GPT2Config.small(n_positions=max(lengths))
        try:
            self.model = GPT2.random(self.config, threads=threads)
        except TypeError:                   # a checkout from before GPT2(threads=)
            self.model = GPT2.random(self.config)
        self.cache = Cache(self.config.layout, page_tokens=64)
        rng = np.random.default_rng(0)
        self.tokens = {n: rng.integers(0, self.config.vocab_size, n) for n in lengths}

    def round(self) -> dict[str, float]:
        return {str(n): self.prefill(n) for n in self.tokens}

    def prefill(self, n: int) -> float:
        with self.cache.allocate() as ctx:
            start = time.perf_counter()
            self.model.prefill(ctx, self.tokens[n])
            return time.perf_counter() - start


class TimeIn:
    """``with TimeIn(module, name) as spent:`` -- ``spent.seconds`` is the time the block spends in
    ``spent.calls`` calls of ``module.name``, a function its callers look up on the module at each call."""

    def __init__(self, module, name: str):
        self.module, self.name = module, name

    def __enter__(self) -> "TimeIn":
        self.seconds, self.calls = 0.0, 0
        self.original = original = getattr(self.module, self.name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1
        setattr(self.module, self.name, timed)
        return self

    def __exit__(self, *exc) -> None:
        setattr(self.module, self.name, self.original)


def serve_rounds(rounds: int, lengths: list[int], threads: int, tiny: bool) -> None:
    """The child's loop: one round per line on stdin, its seconds per length as JSON on stdout."""
    prefiller = Prefiller(lengths, threads, tiny)
    for _ in range(rounds):
        sys.stdin.readline()
        print(json.dumps(prefiller.round()), flush=True)


def run(lengths: list[int], threads: int = 1, rounds: int = 3, against: Path | None = None,
        tiny: bool = False) -> list[dict]:
    # not at the top: the child runs this file by path, on a checkout that may lack them
    import torch

    from .checkouts import finish, next_round, serve_in
    from .prefill_floor import PARTS, PrefillFloor, best_parts
    from .restore import hf_prefill_timer

    from kvstate.model import numpy_gpt2

    torch.set_num_threads(threads)
    prefiller = Prefiller(lengths, threads, tiny)
    hf_prefill = hf_prefill_timer(prefiller.config, threads)
    best = {kind: dict.fromkeys(map(str, lengths), float("inf")) for kind in ("prefill", "here", "against", "hf")}
    attention = {kind: {} for kind in ("prefill", "hf")}     # the best round's seconds in attention
    floors = {str(n): PrefillFloor(prefiller.model, n) for n in lengths}
    floor_runs = {n: [] for n in floors}                      # each round's parts of the floor
    with tempfile.TemporaryDirectory() as scratch:
        arguments = ["--serve", str(rounds), "--threads", str(threads), "--tokens", *map(str, lengths)]
        arguments += ["--tiny"] if tiny else []
        here = Path(__file__).resolve().parents[1]          # this checkout's root
        children = {kind: serve_in(checkout, Path(__file__), arguments, Path(scratch) / kind)
                    for kind, checkout in (("here", here), ("against", against))} if against else {}
        for _ in range(rounds):               # interleaved: ours, this checkout's child, the other's, HF's
            timed, spent = {"prefill": {}, "hf": {}}, {"prefill": {}, "hf": {}}
            for n in prefiller.tokens:
                with TimeIn(numpy_gpt2, "attend") as inside:
                    timed["prefill"][str(n)] = prefiller.prefill(n)
                spent["prefill"][str(n)] = inside.seconds
            for kind, child in children.items():
                timed[kind] = next_round(child)
            for n, work in floors.items():
                floor_runs[n].append(work.run())
            for n, tokens in prefiller.tokens.items():
                with TimeIn(torch.nn.functional, "scaled_dot_product_attention") as inside:
                    start = time.perf_counter()
                    hf_prefill(tokens)
                    timed["hf"][str(n)] = time.perf_counter() - start
                spent["hf"][str(n)] = inside.seconds if inside.calls else None
            for kind, seconds in timed.items():
                for n, s in seconds.items():
                    if s < best[kind][n] and kind in attention:
                        attention[kind][n] = spent[kind][n]
                    best[kind][n] = min(best[kind][n], s)
        finish(children.values())
    floor = {n: best_parts(runs) for n, runs in floor_runs.items()}
    rows = []
    for n in map(str, lengths):
        row = dict(tokens=int(n), threads=threads, prefill_s=round(best["prefill"][n], 4),
                   hf_s=round(best["hf"][n], 4), prefill_over_hf=round(best["prefill"][n] / best["hf"][n], 3),
                   attention_s=round(attention["prefill"][n], 6),
                   hf_attention_s=None if attention["hf"][n] is None else round(attention["hf"][n], 6),
                   floor_s=round(floor[n]["total"], 4), floor_over_hf=round(floor[n]["total"] / best["hf"][n], 3),
                   floor_parts_s={part: round(floor[n][part], 6) for part in PARTS})
        if against is not None:
            row["here_s"] = round(best["here"][n], 4)
            row["against_s"] = round(best["against"][n], 4)
            row["against_over_hf"] = round(best["against"][n] / best["hf"][n], 3)
            row["against_over_here"] = round(best["against"][n] / best["here"][n], 3)
        rows.append(row)
    return rows


def main(argv=None) -> None:
    try:
        from .args import checkout, positive_int     # run as a module (the parent), arguments are checked here
    except ImportError:                              # the child another checkout runs by path: the parent checked them
        positive_int, checkout = int, Path
    parser = argparse.ArgumentParser(prog="python -m kvstate.bench.prefill", description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=positive_int, nargs="+", default=[512, 2048])
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--against", type=checkout, help="another checkout whose model to time beside this one")
    parser.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)     # the smoke test's model
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve_rounds(args.serve, args.tokens, args.threads, args.tiny)
        return
    rows = run(args.tokens, args.threads, args.rounds, args.against, args.tiny)
    against = args.against is not None
    print(f"{'tokens':>6} {'threads':>7} {'prefill s':>9} {'HF s':>7} {'prefill/HF':>10}"
          f" {'attention s':>11} {'HF attention s':>14} {'floor s':>7} {'floor/HF':>8}"
          + (f" {'here s':>7} {'against s':>9} {'against/HF':>10} {'against/here':>12}" * against))
    for row in rows:
        hf_attention = "-" if row["hf_attention_s"] is None else f"{row['hf_attention_s']:.3f}"
        print(f"{row['tokens']:>6} {row['threads']:>7} {row['prefill_s']:>9.3f} {row['hf_s']:>7.3f}"
              f" {row['prefill_over_hf']:>10.3f} {row['attention_s']:>11.3f} {hf_attention:>14}"
              f" {row['floor_s']:>7.3f} {row['floor_over_hf']:>8.3f}"
              + (f" {row['here_s']:>7.3f} {row['against_s']:>9.3f} {row['against_over_hf']:>10.3f}"
                 f" {row['against_over_here']:>12.3f}" if against else ""))
    for row in rows:
        parts = ", ".join(f"{part} {seconds:.3f} s" for part, seconds in row["floor_parts_s"].items())
        print(f"floor at {row['tokens']} tokens: {parts}")
    from .restore import THREAD_VARS

    env = " ".join(f"{var}={args.threads}" for var in THREAD_VARS)
    print(f"reproduce: {env} python -m kvstate.bench.prefill --threads {args.threads} --rounds {args.rounds}"
          f" --tokens {' '.join(map(str, args.tokens))}" + (f" --against {args.against}" if against else ""))


if __name__ == "__main__":
    main()
