"""``match``, ``retain`` and ``extend`` at one-token pages on agent traffic, here and in another checkout, side by side.

    python -m kvstate.bench.one_token_pages [--against DIR] [--rounds N] [--max-entries N]

The ``shared`` workload of ``agent_traffic`` at 4 turns (200 conversations of 4 turns behind a
1,000-token system prompt) served with ``match``, ``extend``, ``retain``, ``close`` on a
cache of one-token pages, tiny layout (one value per position: only the tree and page
bookkeeping are timed). Each request's time is its best over the rounds.

``--against DIR`` runs the same workload, interleaved round by round, in a process that
imports kvstate from the checkout at DIR (an older commit, say) and prints both, with
the speedups. That is how issue 15's "at least 3x today's" is measured:
``git worktree add /tmp/before 9766fa8`` makes the checkout the issue was filed against. Each row
names the commit it ran (``commit``: ``git rev-parse HEAD`` in its checkout, ``+changes`` where tracked
files differ from it); the issue's met/MISSED is printed only where the other checkout is 9766fa8
unchanged, and any other ratio is labelled with the commit it was measured against, with no verdict.
Only the API every version has is used (``Cache(layout, page_tokens=, max_entries=)``,
``match``, ``extend``, ``retain``, ``close``); entry semantics, the only one there then.

``--max-entries N`` bounds the tree, as a server's fixed pool is bounded: past N entries each
``retain`` evicts the least recently used one, and every page only that entry held is freed inside
the timed ``retain``. At one-token pages that is hundreds of pages an eviction, so the retain
column then prices a page's free. Without it the tree keeps every request (nothing is evicted).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


ISSUE_15_COMMIT = "9766fa8"      # the commit issue 15's "at least 3x today's" was filed against


def commit_of(checkout: Path) -> str:
    """The commit checked out at ``checkout`` (a short hash, ``+changes`` where tracked files differ from it),
    or why none can be named."""
    def git(*arguments: str) -> str:
        return subprocess.run(["git", "-C", str(checkout), *arguments], capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()
    try:
        head = git("rev-parse", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "no git commit"
    return head[:12] + "+changes" * bool(changed)


def issue_15_targets(ratio: dict, against: str, commit: str) -> dict:
    """Issue 15's target (3x, lookups and inserts) where ``commit`` is the one it was filed against,
    unchanged; else each ratio labelled with the commit and checkout it was measured against, no verdict."""
    if commit.startswith(ISSUE_15_COMMIT) and not commit.endswith("+changes"):
        return {f"{op}_speedup >= 3x (issue 15, against {ISSUE_15_COMMIT})":
                f"{ratio[op + '_speedup']:.2f} {'met' if ratio[op + '_speedup'] >= 3 else 'MISSED'}"
                for op in ("match", "retain")}
    return {f"{op}_speedup against {commit} ({against})":
            f"{ratio[op + '_speedup']:.2f} (no verdict: issue 15's 3x is against {ISSUE_15_COMMIT})"
            for op in ("match", "retain")}


def requests(conversations: int = 200, turns: int = 4, system: int = 1000, seed: int = 0) -> list[np.ndarray]:
    """``agent_traffic``'s shared workload (4 turns, as when this bench was written), rebuilt here so an
    older checkout serves the same requests."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 50000, system)
    histories = [np.concatenate([prompt, rng.integers(0, 50000, rng.integers(50, 201))]) for _ in range(conversations)]
    order = np.repeat(np.arange(conversations), turns)
    rng.shuffle(order)
    seen, out = [0] * conversations, []
    for c in order:
        if seen[c]:
            histories[c] = np.concatenate([histories[c], rng.integers(0, 50000, rng.integers(50, 201))])
        seen[c] += 1
        out.append(histories[c])
    return out


def serve_requests(cache, queries: list[np.ndarray], lookup_key=None, before_extend=None, extend_s=None,
                   after_retain=None) -> tuple[np.ndarray, np.ndarray, int]:
    """Each request matched, the rest extended (zeros), retained and closed: seconds per request
    in ``match`` and in ``retain``, and the tokens matched. Only API every version has (this
    file runs in older checkouts too); ``agent_traffic`` serves its requests with it as well.
    ``lookup_key(i)``, where given, makes what request ``i`` is matched by, inside its timing;
    ``before_extend(new_tokens)``, where given, runs untimed right before each extend, with its tokens;
    ``extend_s``, where given, an array that gets each request's seconds in ``extend``;
    ``after_retain()``, where given, runs untimed right after each retain.

    The hit's hold is charged to ``match``, as SGLang's lookup is charged its ``inc_lock_ref``. kvstate
    leaves it a pending count (``impl/refcounts.py``), added to the refcount array when something first
    reads the counts. Where the hit ends inside a page and the request has tokens past it, the extend
    reads them at once (its partly filled shared page: ``writable``), so that flush is timed here, in its
    own window added to the request's ``match`` time, read through ``cache.pool.books.counts`` (left out
    where an older checkout has no such books). Where the hit ends on a page boundary (page 1, ``block``
    semantics) nothing reads the counts before ``close`` withdraws the hold: it is realised only when 64
    are pending (``Refcounts.FLUSH_AT``), inside the timed ``match`` or ``retain``, and otherwise costs
    nothing, so nothing is added there."""
    zeros = np.zeros((max(map(len, queries)), *cache.layout.position_shape), np.float32)
    match_s, retain_s = np.zeros(len(queries)), np.zeros(len(queries))
    matched_tokens = 0
    clock = time.perf_counter
    books = getattr(getattr(cache, "pool", None), "books", None)
    page = getattr(cache, "page_tokens", 1) if hasattr(type(books), "counts") else 0     # the class: no read here
    for i, tokens in enumerate(queries):
        t0 = clock()
        ctx, matched = cache.match(tokens if lookup_key is None else lookup_key(i))
        t1 = clock()
        if page and matched % page and matched < len(tokens):   # the extend below reads the counts first thing
            t_hold = clock()
            books.counts        # noqa: B018 - the read adds the hit's pending count: what is timed
            t1 += clock() - t_hold
        if before_extend is not None:
            before_extend(tokens[matched:])
        t_extend = clock()
        ctx.extend(tokens[matched:], zeros[:len(tokens) - matched])
        t2 = clock()
        if extend_s is not None:
            extend_s[i] = t2 - t_extend
        cache.retain(ctx)
        t3 = clock()
        if after_retain is not None:
            after_retain()
        ctx.close()
        match_s[i], retain_s[i] = t1 - t0, t3 - t2
        matched_tokens += matched
    return match_s, retain_s, matched_tokens


def one_round(queries: list[np.ndarray], max_entries: int | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Seconds per request in ``match``, ``retain`` and ``extend``, from an empty cache of one-token
    pages keeping at most ``max_entries`` entries (every request's when None), and the pages freed a request."""
    from kvstate.impl import Cache
    from kvstate.spec.layout import Layout

    cache = Cache(Layout(1, 1, 1), page_tokens=1, max_entries=max_entries or len(queries) + 1)
    extend_s = np.zeros(len(queries))
    match_s, retain_s, _ = serve_requests(cache, queries, extend_s=extend_s)
    return match_s, retain_s, extend_s, cache.pool.freed / len(queries)


def serve_rounds(rounds: int, conversations: int = 200, max_entries: int | None = None) -> None:
    """The child's loop: one round per line on stdin, its per-request seconds as JSON on stdout."""
    queries = requests(conversations)
    for _ in range(rounds):
        sys.stdin.readline()
        match_s, retain_s, extend_s, freed = one_round(queries, max_entries)
        print(json.dumps([match_s.tolist(), retain_s.tolist(), extend_s.tolist(), freed]), flush=True)


def run(against: Path | None = None, rounds: int = 3, conversations: int = 200, max_entries: int | None = None) -> dict:
    from .checkouts import finish, next_round, serve_in     # not at the top: the child runs this file by path

    contenders = {"here": Path(__file__).resolve().parents[1]}
    if against is not None:
        contenders["against"] = against.resolve()
    best = {name: [None, None, None] for name in contenders}
    freed = {}
    with tempfile.TemporaryDirectory() as scratch:
        arguments = ["--serve", str(rounds), "--conversations", str(conversations)]
        if max_entries:
            arguments += ["--max-entries", str(max_entries)]
        children = {name: serve_in(checkout, Path(__file__), arguments, Path(scratch) / name)
                    for name, checkout in contenders.items()}
        for _ in range(rounds):               # interleaved: one round of each, in turn
            for name, child in children.items():
                *seconds, freed[name] = next_round(child)
                best[name] = [np.array(new) if old is None else np.minimum(old, new)
                              for old, new in zip(best[name], seconds)]
        finish(children.values())
    rows = [{"checkout": str(contenders[name]), "commit": commit_of(contenders[name]),
             "match_us": 1e6 * m.mean(), "retain_us": 1e6 * r.mean(),
             "extend_us": 1e6 * e.mean(), "pages_freed_per_request": freed[name]}
            for name, (m, r, e) in best.items()]
    command = ("python -m kvstate.bench.one_token_pages" + (f" --against {against}" if against else "")
               + (f" --rounds {rounds}" if rounds != 3 else "")
               + (f" --conversations {conversations}" if conversations != 200 else ""))
    result = {"name": "one_token_pages",
              "params": {"page_tokens": 1, "requests": 4 * conversations, "rounds": rounds, "max_entries": max_entries},
              "rows": rows, "command": command + (f" --max-entries {max_entries}" if max_entries else "")}
    if against is not None:
        here, there = rows
        ratio = result["ratio"] = {f"{op}_speedup": there[f"{op}_us"] / here[f"{op}_us"]
                                   for op in ("match", "retain", "extend")}
        if not max_entries:     # issue 15's target (lookups and inserts), on the tree that keeps every request
            result["targets"] = issue_15_targets(ratio, there["checkout"], there["commit"])
    return result


def main(argv: list[str] | None = None) -> int:
    try:
        from .args import checkout, positive_int     # run as a module (the parent), arguments are checked here
    except ImportError:                              # the child another checkout runs by path: the parent checked them
        positive_int, checkout = int, Path
    parser = argparse.ArgumentParser(prog="python -m kvstate.bench.one_token_pages", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", type=checkout, help="another checkout to measure beside this one")
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--conversations", type=positive_int, default=200)
    parser.add_argument("--max-entries", type=positive_int, help="entries the tree keeps; past them each retain evicts")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve_rounds(args.serve, args.conversations, args.max_entries)
        return 0
    from .run import format_result

    started = time.perf_counter()
    result = run(args.against, args.rounds, args.conversations, args.max_entries)
    result["wall_s"] = time.perf_counter() - started       # the header's time (0.0 s before)
    print(format_result(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
