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


def _sweep(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvstate.stateful import sweep as S
    from kvstate.stateful.configs import config_named, machine_configs
    from kvstate.stateful.conform import FactoryError

    try:
        seeds = S.parse_seed_range(args.seed_range) if args.seed_range else range(args.seeds)
        label = None
        if args.shard:
            k, n = S.parse_shard(args.shard)
            seeds, label = S.shard(seeds, k, n), args.shard
        configs = [config_named(name) for name in args.configs.split(",")] if args.configs else machine_configs()
        workers = S.resolve_workers(args.workers)
        print(f"sweep: {len(seeds)} seeds x {len(configs)} configurations x {args.steps} steps "
              f"against {args.backend}, {workers} worker(s){', shard ' + label if label else ''}", file=sys.stderr)
        report = S.sweep(seeds, args.steps, configs, args.backend, workers, Path(args.out),
                         args.shrink_limit, args.shrink_budget, shard_label=label)
    except (ValueError, KeyError, FactoryError) as error:
        print(f"kvstate sweep: {error.args[0] if isinstance(error, KeyError) else error}", file=sys.stderr)
        return 2
    json_path, junit_path = S.write_reports(report, Path(args.out))
    print(S.format_summary(report))
    print(f"reports: {json_path}, {junit_path}")
    if report.failures:
        print()
        print(S.failure_notes(report))
    return 1 if report.failures else 0


def _replay(args: argparse.Namespace) -> int:
    from kvstate.spec.errors import ReplayFileError
    from kvstate.stateful import replay as R
    from kvstate.stateful.conform import FactoryError, load_factory

    try:
        recorded = R.load(args.file)
        backend = args.backend or recorded.backend
        factory = load_factory(backend)
        print(f"{args.file}: seed {recorded.seed}, backend {backend}"
              + (f" (found with {recorded.backend})" if backend != recorded.backend else ""))
        if recorded.failure is not None:
            print(f"recorded failure: {recorded.failure}")
        failure = R.replay(recorded, factory)
    except (ReplayFileError, FactoryError) as error:
        print(f"kvstate replay: {error}", file=sys.stderr)
        return 2
    return 1 if failure else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstate", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    conform = commands.add_parser("conform", help="run the conformance suite against a backend factory")
    conform.add_argument("backend", nargs="?", default="kvstate.impl.numpy",
                         help="package.module[:factory] (default: the built-in NumPy backend)")
    conform.add_argument("--profile", default="ci", choices=["ci", "nightly"])
    conform.set_defaults(run=_conform)

    sweep = commands.add_parser("sweep", help="run many seeds x configurations in lockstep; shrink and save failures")
    which = sweep.add_mutually_exclusive_group(required=True)
    which.add_argument("--seeds", type=int, help="seeds 0..N-1")
    which.add_argument("--seed-range", help="seeds A..B-1, as A:B")
    sweep.add_argument("--steps", type=int, default=400, help="operations per run (default 400)")
    sweep.add_argument("--configs", help="comma-separated configuration names (default: all six)")
    sweep.add_argument("--backend", default="kvstate.impl.numpy", help="package.module[:factory]")
    sweep.add_argument("--workers", default="1", help="processes, or 'auto' for one per core (default 1)")
    sweep.add_argument("--shard", help="K/N: run only the K-th of N disjoint shards of the seeds")
    sweep.add_argument("--out", default="sweep-out", help="folder for report.json, junit.xml, replays/")
    sweep.add_argument("--shrink-limit", type=int, default=5, help="failures to shrink (default 5)")
    sweep.add_argument("--shrink-budget", type=float, default=60.0, help="seconds per shrink (default 60)")
    sweep.set_defaults(run=_sweep)

    replay = commands.add_parser("replay", help="re-run a saved failing sequence step by step")
    replay.add_argument("file", help="a replay file written by kvstate sweep")
    replay.add_argument("--backend", help="replay against this factory instead of the recorded one")
    replay.set_defaults(run=_replay)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
