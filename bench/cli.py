"""Command line of the benchmarks, shared by ``python -m kvstate.bench`` and ``kvstate bench``.

Every contender in a run (our NumPy model, HF's torch model) uses the same
thread count. OpenBLAS reads its thread count when NumPy is first imported,
which importing kvstate already did, so the run re-executes itself once with
the thread variables set when they differ from ``--threads``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .args import positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .run import BENCHMARKS  # no NumPy import

    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"benchmarks to run (default: all of {', '.join(BENCHMARKS)})")
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run of under a minute)")
    parser.add_argument("--full", action="store_true", help="add the 8,192-token restore/prefill size")
    parser.add_argument("--threads", type=positive_int, default=os.cpu_count(), help="BLAS/torch threads (default: all cores)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="folder for results.json and PNGs")


THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def pin_threads(args: argparse.Namespace) -> None:
    """Re-execute ``python -m kvstate.bench`` with BLAS threads set to ``--threads``, unless they already are."""
    wanted = str(args.threads)
    if all(os.environ.get(var) == wanted for var in THREAD_VARS):
        return
    env = dict(os.environ, **{var: wanted for var in THREAD_VARS})
    # each value joined to its option, the names after "--": "--out -dashdir" was read as two options
    argv = [sys.executable, "-m", "kvstate.bench", f"--threads={wanted}", f"--out={args.out}"]
    argv += ["--quick"] * args.quick + ["--full"] * args.full + ["--", *args.names]
    sys.stdout.flush()
    os.execve(sys.executable, argv, env)


def run(args: argparse.Namespace) -> int:
    from .run import BENCHMARKS as known

    unknown = [name for name in args.names if name not in known]
    if unknown:
        print(f"kvstate bench: unknown benchmark {', '.join(unknown)}; choose from {', '.join(known)}", file=sys.stderr)
        return 2
    try:        # before the benchmarks run, not after them
        args.out.mkdir(parents=True, exist_ok=True)
        probe = args.out / f".write-check-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as error:
        print(f"kvstate bench: cannot write results to {str(args.out)!r}: {error.strerror or error}", file=sys.stderr)
        return 2
    from .plots import plot_files

    # the files the run writes at its end, checked now: a folder in results.json's place was found only
    # after the whole run, which was then lost to a traceback
    for target in [args.out / "results.json", *plot_files(args.names or known, args.out)]:
        if target.is_dir():
            print(f"kvstate bench: cannot write results to {str(target)!r}: it is a folder", file=sys.stderr)
            return 2
    pin_threads(args)
    from .plots import draw
    from .run import BENCHMARKS, run_all, save

    results = run_all(args.names or BENCHMARKS, quick=args.quick, full=args.full, threads=args.threads)
    try:        # something changed under the run (the check above was minutes ago): one line, exit 2
        path = save(results, args.out, args.threads)
        pngs = draw(results, args.out)
    except OSError as error:
        print(f"kvstate bench: cannot write results to {str(error.filename or args.out)!r}: "
              f"{error.strerror or error}", file=sys.stderr)
        return 2
    print(f"\nwrote {path}" + (f" and {len(pngs)} plots" if pngs else " (no plots: pip install kvstate[plot])"))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstate.bench", description=__doc__)
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except KeyboardInterrupt:       # the re-executed process runs here, outside kvstate's own command
        print("kvstate bench: interrupted", file=sys.stderr)
        return 130
