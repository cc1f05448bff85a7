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


def _bench(args: argparse.Namespace) -> int:
    from kvstate.bench.cli import run

    return run(args)


def _demo(args: argparse.Namespace) -> int:
    from kvstate.demo import main as demo

    return demo()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstate", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    conform = commands.add_parser("conform", help="run the conformance suite against a backend factory")
    conform.add_argument("backend", nargs="?", default="kvstate.impl.numpy",
                         help="package.module[:factory] (default: the built-in NumPy backend)")
    conform.add_argument("--profile", default="ci", choices=["ci", "nightly"])
    conform.set_defaults(run=_conform)

    from kvstate.bench.cli import add_arguments as bench_arguments

    bench = commands.add_parser("bench", help="run the benchmarks: table, results.json, PNG plots")
    bench_arguments(bench)
    bench.set_defaults(run=_bench)

    demo = commands.add_parser("demo", help="ten seconds of what agents get: forks, backtracking, restore, prefix hits")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
