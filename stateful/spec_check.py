"""``kvstate spec-check``: CrossHair over ``spec/arithmetic.py``, then the exhaustive search.

The default scope is the CI one, searched once per declared semantics of
``exhaustive.SEMANTICS`` (entry, token and block matching, an evicting and a
refusing pool). ``--semantics token,refuse`` picks some; ``--match``,
``--block-tokens``, ``--max-pages``, ``--pool-pages`` and ``--on-full`` set one
field on each picked scope (given alone, on the entry scope), e.g.
``kvstate spec-check --match token --pool-pages 2 --on-full refuse``.
Raise the scope overnight, e.g.
``kvstate spec-check --depth 0 --contexts 3 --positions 4 --time-limit 36000``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from kvstate.spec.errors import ConfigError
from kvstate.spec.semantics import MATCH_KINDS, ON_FULL

from .exhaustive import SEMANTICS, Scope, explore, semantics_scope, write_replay

DEFAULT = Scope()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="kvstate.impl.numpy",
                        help="package.module[:factory] to search (default: the built-in NumPy backend)")
    parser.add_argument("--page-tokens", type=int, default=DEFAULT.page_tokens)
    parser.add_argument("--contexts", type=int, default=DEFAULT.max_contexts, help="most live contexts")
    parser.add_argument("--positions", type=int, default=DEFAULT.max_positions, help="most positions per context")
    parser.add_argument("--alphabet", type=int, default=len(DEFAULT.alphabet), help="tokens are 0 .. N-1")
    parser.add_argument("--write", type=int, default=DEFAULT.max_write, help="most positions per extend/overwrite")
    parser.add_argument("--values", type=int, default=len(DEFAULT.seeds), help="distinct value seeds per write")
    parser.add_argument("--entries", type=int, default=DEFAULT.max_entries, help="max_entries of the tree")
    parser.add_argument("--arena", type=int, default=None,
                        help=f"arena slots (0: none); given, it holds for every semantics searched (default: "
                             f"{DEFAULT.arena_pages}, or the semantics' own: evict 1, refuse 0)")
    parser.add_argument("--precision", default=DEFAULT.precision, choices=["f32", "f16", "q8"])
    parser.add_argument("--semantics", default=None,
                        help=f"comma-separated declared semantics to search, of {', '.join(SEMANTICS)} "
                             f"(default: all of them; only 'entry' when a field below is given)")
    parser.add_argument("--match", choices=MATCH_KINDS, default=None, help="match semantics (spec/semantics.py)")
    parser.add_argument("--block-tokens", type=int, default=None, help="the block size B of --match block")
    parser.add_argument("--max-pages", type=int, default=None, help="the tree's page budget (0: none)")
    parser.add_argument("--pool-pages", type=int, default=None, help="a live-page limit without an arena (0: none)")
    parser.add_argument("--on-full", choices=ON_FULL, default=None, help="what a full pool does")
    parser.add_argument("--depth", type=int, default=DEFAULT.max_depth or 0,
                        help="longest operation sequence (0: search until no new state appears)")
    parser.add_argument("--time-limit", type=float, default=None, help="stop the search after this many seconds")
    parser.add_argument("--crosshair-timeout", type=float, default=2.0,
                        help="CrossHair's per-condition timeout, CPU seconds")
    parser.add_argument("--no-crosshair", action="store_true", help="skip the CrossHair check")
    parser.add_argument("--replay-out", default="spec-check-violation.json",
                        help="where a violation's shortest trace is written")


_FIELDS = ("match", "block_tokens", "max_pages", "pool_pages", "on_full")

# Upper bounds of the size options, checked before anything runs: past them a typo grew memory until a
# bare ``MemoryError`` (the alphabet and value seeds are built as tuples, every word of each write
# length as a list, the arena as arrays). The search finishes (hours) only at 2-4 contexts, positions,
# entries and slots and depth 7 or so (README: the nightly scope); no depth it can finish fills more
# than 64 pages, positions, contexts or entries, so nothing reachable is cut.
SIZE_MAX = {"page_tokens": 64, "contexts": 16, "positions": 64, "alphabet": 1024, "write": 64, "values": 1024,
            "entries": 64, "arena": 64, "block_tokens": 64, "max_pages": 64, "pool_pages": 64}
# Writes the search offers in one state, at about 1 ms a transition (2026-12-07): 20,000 are 20 s to
# expand one state. The default scope offers 28, the nightly one 8; alphabet 64 with writes of 2
# positions (16,768) is the largest common one under it (its depth 2: 4,163 states in 4.7 s).
MAX_WRITES_PER_STATE = 20_000


def writes_per_state(contexts: int, positions: int, alphabet: int, write: int, values: int) -> int:
    """Most writes (extends and overwrites) one state offers: per live context, each of the
    ``alphabet ** k`` words of ``k`` positions (``k`` up to ``write``, and no write is longer than
    ``positions``) with each value seed, at each of the ``positions - k + 1`` places it fits."""
    return contexts * values * sum(alphabet ** k * (positions - k + 1) for k in range(1, min(write, positions) + 1))


def scope_from(args: argparse.Namespace) -> Scope:
    """The entry-semantics scope the size options describe."""
    return Scope(page_tokens=args.page_tokens, max_contexts=args.contexts, max_positions=args.positions,
                 alphabet=tuple(range(args.alphabet)), max_write=args.write,
                 seeds=tuple(-(i + 1) for i in range(args.values)), max_entries=args.entries,
                 arena_pages=DEFAULT.arena_pages if args.arena is None else args.arena, precision=args.precision,
                 max_depth=args.depth or None)


def scopes_from(args: argparse.Namespace) -> list[Scope]:
    """One scope per picked semantics, each with the fields given on the command line.

    ``KeyError`` for an unknown semantics name, ``ConfigError`` for fields that do not go together.
    """
    fields = {name: getattr(args, name) for name in _FIELDS if getattr(args, name, None) is not None}
    if fields.get("match") == "block" and "block_tokens" not in fields:
        fields["block_tokens"] = args.page_tokens      # whole pages, unless a block size is given
    if fields.get("match") in ("entry", "token"):
        fields.setdefault("block_tokens", 0)
    names = args.semantics.split(",") if args.semantics else (["entry"] if fields else list(SEMANTICS))
    # a size option given holds over the semantics' own (evict's one slot, refuse's none): ``--arena 2``
    # was silently replaced by them
    sizes = {} if getattr(args, "arena", None) is None else {"arena_pages": args.arena}
    scopes = [replace(semantics_scope(name.strip(), scope_from(args)), **fields, **sizes) for name in names]
    for scope in scopes:
        scope.config()          # refuse a combination Config refuses, before anything runs
    return scopes


def crosshair_tool() -> str | None:
    """The ``crosshair`` command beside this Python or on the PATH; None where it is not installed."""
    tool = shutil.which("crosshair") or str(Path(sys.executable).with_name("crosshair"))
    return tool if Path(tool).exists() or shutil.which(tool) is not None else None


def crosshair(timeout: float) -> int:
    """Run ``crosshair check`` over the spec's arithmetic; print its findings; 0 when none refute."""
    from kvstate.spec import arithmetic

    tool = crosshair_tool()
    if tool is None:
        print("crosshair: not installed (pip install crosshair-tool)", file=sys.stderr)
        return 2
    started = time.perf_counter()
    run = subprocess.run([tool, "check", "--analysis_kind=PEP316", f"--per_condition_timeout={timeout}",
                          "--report_all", arithmetic.__file__], capture_output=True, text=True)
    lines = run.stdout.splitlines()
    confirmed = sum("Confirmed over all paths" in line for line in lines)
    refuted = [line for line in lines if ": error:" in line]
    print(f"crosshair: {len(lines)} conditions, {confirmed} confirmed over all paths, "
          f"{len(lines) - confirmed - len(refuted)} not refuted within {timeout} s, {len(refuted)} refuted "
          f"({time.perf_counter() - started:.1f} s)")
    for line in refuted:
        print("  " + line)
    if run.returncode not in (0, 1):
        print(run.stderr, file=sys.stderr)
    return run.returncode


def run_spec_check(args: argparse.Namespace) -> int:
    from .backends import FactoryError, load_factory
    from .configs import undeclared_by

    try:
        factory = load_factory(args.backend)
    except FactoryError as error:
        print(f"kvstate spec-check: {error}", file=sys.stderr)
        return 2
    try:
        scopes = scopes_from(args)
    except (KeyError, ConfigError) as error:
        print(f"kvstate spec-check: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    for scope in scopes:        # as replay and conform: nothing a backend does not declare is held against it
        undeclared = undeclared_by(factory, scope.config(), holder="the scope")
        if undeclared:
            print(f"kvstate spec-check: backend {args.backend!r} does not declare scope {scope.config().name} "
                  f"({undeclared}); pick scopes it declares (--semantics, --arena 0)", file=sys.stderr)
            return 2
    unwritable = replay_out_problem(args.replay_out)
    if unwritable:
        print(f"kvstate spec-check: --replay-out {unwritable}", file=sys.stderr)
        return 2
    if not args.no_crosshair and crosshair_tool() is None:     # refused before the search, not reported "skipped"
        print("kvstate spec-check: CrossHair is not installed (pip install crosshair-tool, or "
              "pip install -e '.[test]'); pass --no-crosshair to run the exhaustive search alone", file=sys.stderr)
        return 2
    # CrossHair after the arguments and the backend are checked: a refusal comes at once, not after it
    status = crosshair(args.crosshair_timeout) if not args.no_crosshair else 0
    started, cut = time.perf_counter(), []
    for index, scope in enumerate(scopes):
        config = scope.config()
        print(f"exhaustive: {config.name} ({config.semantics}): {scope}")
        result = explore(factory, scope, time_limit=_share(args.time_limit, started, len(scopes) - index))
        print(f"exhaustive: {config.name}: {result.summary()}")
        print(f"exhaustive: {config.name}: new states per depth {result.per_depth}")
        if result.violation is not None:
            try:
                write_replay(args.replay_out, scope, result.violation, factory, args.backend)
            except OSError as error:    # made unwritable during the search: the violation is still the verdict
                print(f"kvstate spec-check: the shortest trace could not be written to {args.replay_out!r}: "
                      f"{error}", file=sys.stderr)
                return status or 1
            print(f"exhaustive: shortest trace written to {args.replay_out}")
            return status or 1
        if not result.complete:     # which bound, and how deep: the last line named neither (an audit)
            at_depth = scope.max_depth is not None and result.depth >= scope.max_depth
            cut.append(f"{config.name} at depth {result.depth}, {'--depth' if at_depth else 'the time limit'}")
    if cut:
        print(f"exhaustive: no violation, but {len(cut)} of {len(scopes)} searches stopped at a bound before "
              f"the space was covered ({'; '.join(cut)}): a bound, not a proof past it")
    return status


def replay_out_problem(path: str) -> str | None:
    """Why a violation's trace cannot go to ``path``, found before the search (minutes to hours): a
    folder there was found only at the write, after it, and turned the violation (exit 1) into exit 2."""
    target = Path(path)
    if target.is_dir():
        return f"{path!r} is a folder: name the file the trace goes to"
    for folder in target.parents:       # the nearest that exists must be a folder (the write makes the rest)
        if folder.exists():
            return None if folder.is_dir() else f"{path!r} is inside {str(folder)!r}, which is not a folder"
    return None


def _share(time_limit: float | None, started: float, searches_left: int) -> float | None:
    """This search's part of ``--time-limit``: what is left of it, split evenly over the searches
    left (time one did not use goes to those after it). The first search used to get all of it,
    and every later one none."""
    if time_limit is None:
        return None
    return max(0.0, time_limit - (time.perf_counter() - started)) / searches_left
