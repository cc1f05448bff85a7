"""The ``kvstate`` command: the users' jobs, one subcommand each."""

from __future__ import annotations

import argparse
import sys


def _conform(args: argparse.Namespace) -> int:
    from kvstate.stateful.conform import FactoryError, conform, format_table, load_factory

    try:
        factory = load_factory(args.backend)
    except FactoryError as error:
        print(f"kvstate conform: {error}", file=sys.stderr)
        return 2
    print(f"lockstep machine against {args.backend}, profile {args.profile}")
    results = conform(factory, profile=args.profile)
    print(format_table(results))
    return 0 if all(r.passed for r in results) else 1


def _fuzz(args: argparse.Namespace) -> int:
    if args.atheris:
        from kvstate.fuzz.atheris_harness import main as atheris_main

        return atheris_main(["kvstate-fuzz", *args.flags])
    from kvstate.fuzz.snapshot_fuzz import run

    reports = run(args.precision or ("f32", "f16", "q8"), random_count=args.random, garbage_count=args.garbage,
                  seed=args.seed, path_share=args.files)
    for precision, report in reports.items():
        print(f"{precision}: {report.summary()}")
        for finding in report.escaped[:10] + report.changed[:10]:
            print(f"  {finding}")
    return 0 if all(report.ok for report in reports.values()) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstate", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    conform = commands.add_parser("conform", help="run the conformance suite against a backend factory")
    conform.add_argument("backend", nargs="?", default="kvstate.impl.numpy",
                         help="package.module[:factory] (default: the built-in NumPy backend)")
    conform.add_argument("--profile", default="ci", choices=["ci", "nightly"])
    conform.set_defaults(run=_conform)

    fuzz = commands.add_parser("fuzz", help="refuse damaged and hostile snapshot files (deterministic, or atheris)")
    fuzz.add_argument("--precision", action="append", choices=["f32", "f16", "q8"], help="repeatable; default all")
    fuzz.add_argument("--random", type=int, default=2000, help="random multi-byte corruptions per precision")
    fuzz.add_argument("--garbage", type=int, default=2000, help="random garbage files per precision")
    fuzz.add_argument("--files", type=int, default=500, help="also restore this many cases through real files")
    fuzz.add_argument("--seed", type=int, default=0)
    fuzz.add_argument("--atheris", action="store_true", help="coverage-guided; pass libFuzzer flags after --")
    fuzz.add_argument("flags", nargs="*", help="with --atheris: corpus dirs and flags such as -max_total_time=600")
    fuzz.set_defaults(run=_fuzz)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
