"""Per-operation cost of ``match``, ``retain`` and eviction as the tree grows, a page budget set.

    python -m kvstate.bench.tree_scale [--quick] [--rounds N] [--sizes 1000,10000,100000]

Trees of 10^3, 10^4 and 10^5 entries, each entry a 64-token shared prefix plus 32 random
tokens of its own (page size 16: 6 pages an entry by the budget's count, 2 of them its own), under
``max_pages`` set to hold the tree plus the inserts timed below and no more. Per size:

- ``lookup``: ``match`` of a retained key (a whole-key hit), the hit closed untimed;
- ``insert``: ``retain`` of a new key while the budget has room (nothing evicted);
- ``evict``: ``retain`` of a new key with the budget full, so each evicts one entry.

Rounds are interleaved (every size once per round, each phase in turn), a round being a batch
of ``TIMED`` operations, and each size keeps its best batch's mean per operation: the minimum
drops what other processes cost (and the rare full garbage collection a batch may land on).
Each column is also printed relative to the smallest tree: a cost that stays flat as the tree
grows is 1.0 (issue 26's target: at most 1.2). ``lookup_floor_x_smallest`` is the lookup's floor on
the same scale: the smallest tree's lookup plus what the loads no hit can skip (``Tree.touches``:
the child slot, node, edge, entry and holding of the key hit, and the holding's length and fork count,
the only fields a whole-key hit reads: ``Cache._fork``) grew by at that size, cold in the caches. A run
whose lookup comes in under that floor says so: the floor is then no floor for that run. ``--sizes``
are taken smallest first, and the smallest is the baseline (named in the targets). Each tree is
labelled with its size at the start: the insert and evict phases add ``rounds x TIMED + COUNTED``
entries to every tree (the default 10^3 tree ends at about 2,050, the 10^5 one ~1% over its label).
The ``_calls`` columns count the function calls (Python and C) per operation, outside the timing: they do not depend on the machine's load,
and stay the same at every size unless some step walks the tree.

Standalone on purpose (only ``kvstate.impl`` and ``kvstate.spec``): ``PYTHONPATH=. python PATH/tree_scale.py``
run from another checkout's root times that checkout's engine, for a before/after (a script's own
folder, not the working one, heads ``sys.path``: without ``PYTHONPATH=.`` it times the installed kvstate).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import numpy as np

from kvstate.impl import Cache
from kvstate.impl.radix import pack
from kvstate.spec.layout import Layout

try:
    from .args import positive_int, positive_ints
except ImportError:     # run by path (``PYTHONPATH=. python PATH/tree_scale.py``): no package, so plain ints
    positive_int = int

    def positive_ints(text: str) -> tuple[int, ...]:
        return tuple(map(int, text.split(",")))

TINY = Layout(1, 1, 1)
PAGE = 16
PREFIX, OWN = 64, 32
SIZES, QUICK_SIZES = (1_000, 10_000, 100_000), (100, 1_000)
TIMED = 100                    # operations per phase and round
COUNTED = 50                   # operations per phase whose function calls are counted
FLAT = 1.2                     # issue 26's target, largest tree's cost over the smallest's
COMMAND = "python -m kvstate.bench.tree_scale"


class Tree:
    """One cache filled with ``size`` entries, and the keys for its timed operations."""

    def __init__(self, size: int, rounds: int, timed: int, rng: np.random.Generator):
        self.prefix = rng.integers(0, 50_000, PREFIX)
        self.rng = rng
        pages = -(-(PREFIX + OWN) // PAGE)
        self.cache = Cache(TINY, page_tokens=PAGE, match="token", max_entries=1 << 40,
                           max_pages=pages * (size + rounds * timed + COUNTED))
        self.counting = False
        self.zeros = np.zeros((PREFIX + OWN, *TINY.position_shape), np.float32)
        base = self.cache.allocate()
        base.extend(self.prefix, self.zeros[:PREFIX])
        self.base = base
        self.keys = []
        for _ in range(size):
            self.retain(self.new_key())

    def new_key(self) -> np.ndarray:
        # Token ids from the whole valid range, so no two keys share a first token past the prefix:
        # every size then times the same operation (a new leaf under the prefix node), where a
        # 50,000-token vocabulary would split more edges the more entries there are.
        return np.concatenate([self.prefix, self.rng.integers(0, 2**31 - 1, OWN)])

    def measured(self, op):
        """``op()``'s result and its cost: seconds, or while ``counting`` the function calls it made
        (Python and C: a step that walks the tree makes more of them the more entries there are)."""
        if not self.counting:
            start = time.perf_counter()
            result = op()
            return time.perf_counter() - start, result
        calls = 0

        def hook(frame, event, arg):
            nonlocal calls
            calls += event in ("call", "c_call")
        sys.setprofile(hook)
        try:
            result = op()
        finally:
            sys.setprofile(None)
        return calls, result

    def retain(self, key: np.ndarray) -> float:
        """Retain ``key`` (the shared prefix forked, its own tokens extended); the cost of ``retain``."""
        ctx = self.base.fork()
        ctx.extend(key[PREFIX:], self.zeros[:OWN])
        cost, _ = self.measured(lambda: self.cache.retain(ctx))
        ctx.close()
        self.keys.append(key)
        return cost

    def lookups(self, n: int) -> float:
        """Mean cost per ``match`` of a recently retained key (still in the tree)."""
        recent = self.keys[-len(self.keys) // 2:]
        total = 0.0
        for i in self.rng.integers(0, len(recent), n):
            cost, (ctx, matched) = self.measured(lambda: self.cache.match(recent[i]))
            total += cost
            assert matched == PREFIX + OWN
            ctx.close()
        return total / n

    def touches(self, n: int) -> float:
        """Mean cost of what a hit of a recent key cannot skip at any tree size, the floor under ``lookups``:
        the prefix node's child slot for its first own token, that child and its edge's bytes (compared
        with the key's), its entry, the entry's holding, and the holding's length and fork count: all a
        whole-key hit reads of them (``Cache._fork`` shares the very holding, ``share_holding``; it never
        reads the page list or slots). In a tree of 10^5 entries they are cold in the caches, as they are
        for a lookup."""
        recent = self.keys[-len(self.keys) // 2:]
        under_prefix = next(iter(self.cache.tree.root.children.values())).children
        own = [pack(key[PREFIX:]) for key in recent]
        total = 0.0
        clock = time.perf_counter
        for i in self.rng.integers(0, len(recent), n):
            rest = own[i]
            start = clock()
            node = under_prefix[rest[:4]]
            held = node.value._holding
            node.edge == rest, held.length, held.forks     # noqa: B018 - the loads are what is timed
            total += clock() - start
        return total / n

    def inserts(self, n: int) -> float:
        return sum(self.retain(self.new_key()) for _ in range(n)) / n


def run(quick: bool = False, rounds: int | None = None, sizes: tuple[int, ...] | None = None) -> dict:
    sizes, timed = tuple(sorted(sizes or (QUICK_SIZES if quick else SIZES))), TIMED     # the smallest first: the baseline
    rounds = rounds or (1 if quick else 10)
    rng = np.random.default_rng(0)
    trees = {size: Tree(size, rounds, timed, rng) for size in sizes}
    best = {size: {"lookup": np.inf, "insert": np.inf, "evict": np.inf, "touch": np.inf} for size in sizes}
    calls: dict[int, dict[str, float]] = {size: {} for size in sizes}
    gc.collect()
    # the budget holds the tree plus every insert round: the insert rounds fill it to the brim,
    # then each evict-round retain evicts one entry
    for phase in ("lookup", "insert", "evict"):
        for _ in range(rounds):
            for size, tree in trees.items():
                if phase == "lookup":
                    seconds = tree.lookups(timed)
                    best[size]["touch"] = min(best[size]["touch"], tree.touches(timed))
                else:
                    entries = len(tree.cache.tree)
                    seconds = tree.inserts(timed)
                    # insert: the budget had room, nothing evicted; evict: one evicted per retain
                    assert len(tree.cache.tree) - entries == (timed if phase == "insert" else 0)
                best[size][phase] = min(best[size][phase], seconds)
        for size, tree in trees.items():      # then the same operations once more, counted
            tree.counting = True
            calls[size][phase] = tree.lookups(COUNTED) if phase == "lookup" else tree.inserts(COUNTED)
            tree.counting = False
    smallest = best[sizes[0]]       # sorted above: the smallest tree
    rows = []
    for size in sizes:
        row = {"entries": size}
        for phase in ("lookup", "insert", "evict"):
            row[f"{phase}_us"] = 1e6 * best[size][phase]
        for phase in ("lookup", "insert", "evict"):
            row[f"{phase}_x_smallest"] = best[size][phase] / smallest[phase]
        for phase in ("lookup", "insert", "evict"):
            row[f"{phase}_calls"] = calls[size][phase]
        # The floor: the smallest tree's lookup plus what the loads a hit cannot skip grew by since.
        grown = best[size]["touch"] - smallest["touch"]
        row["lookup_floor_x_smallest"] = (smallest["lookup"] + grown) / smallest["lookup"]
        rows.append(row)
    largest = rows[-1]
    targets = {f"{phase} at {largest['entries']:,} entries <= {FLAT:g}x the smallest tree's ({sizes[0]:,} entries)":
               f"{largest[f'{phase}_x_smallest']:.2f} {'met' if largest[f'{phase}_x_smallest'] <= FLAT else 'MISSED'}"
               for phase in ("lookup", "insert", "evict")}
    lookup = next(name for name in targets if name.startswith("lookup"))
    if targets[lookup].endswith("MISSED"):
        floor = largest["lookup_floor_x_smallest"]
        targets[lookup] += (f": floor {floor:.2f}x (the same {largest['lookup_calls']:g} calls at every size; the "
                            f"child slot, node, edge, entry, holding and its length and fork count a whole-key hit "
                            f"loads, cold in a large tree, grew by "
                            f"{1e6 * (best[largest['entries']]['touch'] - smallest['touch']):.2f} µs); "
                            + ("the target is below it: a node layout whose hit loads one cache line (nodes as rows "
                               "of arrays, not Python objects) would pass" if floor > FLAT else
                               "the target is above it: these are the loads no hit skips, not every one a lookup "
                               "makes (the walk's, the stamp's, the fork's own)"))
    invalid = [row["entries"] for row in rows if row["lookup_x_smallest"] < row["lookup_floor_x_smallest"]]
    if invalid:     # the lookup under its own floor: the floor is no lower bound in this run
        targets["lookup floor a lower bound of the lookup"] = (
            f"NO at {', '.join(f'{size:,}' for size in invalid)} entries: the lookup came in under its floor "
            f"(noise, or the floor loads something the hit does not): read the floor as void for this run")
    return {
        "name": "tree_scale",
        "params": {"page_tokens": PAGE, "key_tokens": PREFIX + OWN, "shared_prefix": PREFIX, "timed_ops": timed,
                   "rounds": rounds, "max_pages": "entries + timed inserts, 6 pages each",
                   "baseline_entries": sizes[0]},
        "rows": rows,
        "targets": targets,
        "command": COMMAND + " --quick" * quick + (f" --rounds {rounds}" if rounds != (1 if quick else 10) else "")
        + (f" --sizes {','.join(map(str, sizes))}" if sizes != (QUICK_SIZES if quick else SIZES) else ""),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="trees of 100 and 1,000 entries")
    parser.add_argument("--rounds", type=positive_int)
    parser.add_argument("--sizes", type=positive_ints,
                        help="entries of each tree, comma-separated (default: 1000,10000,100000)")
    args = parser.parse_args(argv)
    result = run(args.quick, args.rounds, args.sizes)
    for row in result["rows"]:
        print("  ".join(f"{key}={value:.3g}" if isinstance(value, float) else f"{key}={value}"
                        for key, value in row.items()))
    for name, verdict in result["targets"].items():
        print(f"{name}: {verdict}")
    print(f"reproduce: {result['command']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
