"""The ``kvstate`` command: the users' jobs, one subcommand each."""

from __future__ import annotations

import argparse
import sys


def _conform(args: argparse.Namespace) -> int:
    from kvstate.stateful.conform import FactoryError, check_backend, conform, format_table, load_factory
    from kvstate.stateful.configs import machine_configs
    from kvstate.spec.protocol import declared_configs

    try:
        factory = load_factory(args.backend)
        configs = declared_configs(factory, machine_configs())
        check_backend(factory, configs, time_limit=args.time_limit)
        if args.config:
            configs = [c for c in configs if c.name in args.config] or []
            if not configs:
                raise FactoryError(f"no declared configuration named {args.config}")
        print(f"conformance of {args.backend}, profile {args.profile}, {len(configs)} configurations", flush=True)
        progress = (lambda line: print(line, file=sys.stderr, flush=True)) if args.verbose else None
        settings = None
        if args.examples or args.steps:
            from hypothesis import settings as Settings
            from kvstate.stateful.configs import PROFILES

            base = PROFILES[args.profile]
            settings = Settings(base, max_examples=args.examples or base.max_examples,
                                stateful_step_count=args.steps or base.stateful_step_count)
        results = conform(factory, profile=args.profile, configs=configs, checks=args.check,
                          time_limit=args.time_limit, progress=progress, settings=settings)
    except FactoryError as error:
        print(f"kvstate conform: {type(error).__name__}: {error}", file=sys.stderr)
        return 2
    print(format_table(results), flush=True)
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
                         help="package.module[:factory] or path/to/file.py[:factory] (default: the built-in NumPy backend)")
    conform.add_argument("--profile", default="ci", choices=["ci", "nightly", "hunt"])
    conform.add_argument("--config", action="append", metavar="NAME",
                         help="only this configuration (e.g. q8-arena6); repeatable")
    conform.add_argument("--check", action="append", metavar="NAME",
                         help="only this check (lockstep, 'fork isolation', ...); repeatable")
    conform.add_argument("--time-limit", type=float, default=300.0, metavar="SECONDS",
                         help="per configuration and check; past it the check is reported as TIMEOUT")
    conform.add_argument("--examples", type=int, metavar="N", help="lockstep runs per configuration (overrides the profile)")
    conform.add_argument("--steps", type=int, metavar="N", help="operations per lockstep run (overrides the profile)")
    conform.add_argument("-v", "--verbose", action="store_true", help="print each check as it finishes")
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

    stress = commands.add_parser("stress", help="run the thread-race scenarios for minutes (nightly)")
    stress.add_argument("--minutes", type=float, default=5.0, help="keep starting rounds until this has passed")
    stress.add_argument("--seed", type=int, default=0, help="seed of the first round; round k uses seed + k")
    stress.add_argument("--scale", type=int, default=10, help="iterations per round, as a multiple of CI's")
    stress.add_argument("--store", action="append", help="page store (repeatable; default: every available one)")
    stress.add_argument("--scenario", action="append", help="scenario name (repeatable; default: all)")
    stress.set_defaults(run=_stress)

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
