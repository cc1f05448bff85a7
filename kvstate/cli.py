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


def _spec_check(args: argparse.Namespace) -> int:
    from kvstate.stateful.spec_check import run_spec_check

    return run_spec_check(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstate", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    conform = commands.add_parser("conform", help="run the conformance suite against a backend factory")
    conform.add_argument("backend", nargs="?", default="kvstate.impl.numpy",
                         help="package.module[:factory] (default: the built-in NumPy backend)")
    conform.add_argument("--profile", default="ci", choices=["ci", "nightly"])
    conform.set_defaults(run=_conform)

    spec_check = commands.add_parser(
        "spec-check", help="CrossHair over the spec's arithmetic, then an exhaustive search at a small scope")
    from kvstate.stateful.spec_check import add_arguments as add_spec_check_arguments

    add_spec_check_arguments(spec_check)
    spec_check.set_defaults(run=_spec_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
