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


def _stress(args: argparse.Namespace) -> int:
    from kvstate.stateful.races import RaceFailure, stress

    print(f"race scenarios for {args.minutes} min, seed {args.seed}, {args.scale}x the CI iterations")
    try:
        totals = stress(args.minutes, seed=args.seed, stores=args.store, scenarios=args.scenario, scale=args.scale)
    except RaceFailure as failure:
        print(f"FAILED: {failure}")
        return 1
    for name, counts in totals.items():
        print(f"total {name}: " + ", ".join(f"{k}={v}" for k, v in counts.items()))
    print("no race found")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstate", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    conform = commands.add_parser("conform", help="run the conformance suite against a backend factory")
    conform.add_argument("backend", nargs="?", default="kvstate.impl.numpy",
                         help="package.module[:factory] (default: the built-in NumPy backend)")
    conform.add_argument("--profile", default="ci", choices=["ci", "nightly"])
    conform.set_defaults(run=_conform)

    stress = commands.add_parser("stress", help="run the thread-race scenarios for minutes (nightly)")
    stress.add_argument("--minutes", type=float, default=5.0, help="keep starting rounds until this has passed")
    stress.add_argument("--seed", type=int, default=0, help="seed of the first round; round k uses seed + k")
    stress.add_argument("--scale", type=int, default=10, help="iterations per round, as a multiple of CI's")
    stress.add_argument("--store", action="append", help="page store (repeatable; default: every available one)")
    stress.add_argument("--scenario", action="append", help="scenario name (repeatable; default: all)")
    stress.set_defaults(run=_stress)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
