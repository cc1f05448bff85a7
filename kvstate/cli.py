"""The ``kvstate`` command: the users' jobs, one subcommand each.

Every bad argument, unreadable file or broken backend ends in one line on stderr
and exit status 2; exit 1 means the suite ran and found a failure. ``kvstate replay``
exits 0 when every invariant holds (fixed), 1 when the recorded failure reproduces, 3 when
it fails but not as recorded, and 2 for a bad argument or file (a failure step past its
operations included) or a replay that did not finish within ``--time-limit`` where the file
records no hang. Loading a
backend (its import and its first cache) runs under a time limit, so a module or
factory that hangs cannot hang the command.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shlex
import sys
import threading

LOAD_TIME_LIMIT = 60.0
CONFORM_TIME_LIMIT = 300.0     # seconds per configuration and check (stateful.conform.DEFAULT_TIME_LIMIT)
SCRATCH_USERS = ("conform", "sweep", "replay", "spec-check")     # commands whose runs write snapshot files there
MAX_RACE_THREADS = 4096    # ``kvstate race --threads``: past what a machine starts, a failure read as the race's
MAX_TIME_LIMIT = threading.TIMEOUT_MAX     # past it a wait overflowed, and read as the backend failing to load


class UsageError(Exception):
    """A bad argument: one line, exit 2."""


def _workers(value: str, tasks: int) -> int:
    """``--workers``: ``auto`` (one per core, no more than there are tasks) or a positive int."""
    if value == "auto":
        return max(1, min(tasks, os.cpu_count() or 1))
    try:
        workers = int(value)
    except ValueError:
        raise UsageError(f"--workers must be 'auto' or a positive int, got {value!r}") from None
    _at_least("--workers", workers, 1)
    return workers


def _at_least(name: str, value, low, high=None) -> None:
    """``value`` (None: not given) a finite number in ``[low, high]``; argparse lets NaN, inf and, for
    ``--opt=--``, an empty list through."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < low or (high is not None and value > high):
        raise UsageError(f"{name} must be a finite number at least {low}"
                         + (f" and at most {high}" if high is not None else "") + f", got {value!r}")


def _load_backend(backend: str, time_limit: float = LOAD_TIME_LIMIT, configs_default=None, check: bool = True):
    """``stateful.backends.load_backend``: the factory and its configurations, or a ``FactoryError``."""
    from kvstate.stateful.backends import load_backend

    return load_backend(backend, time_limit, configs_default, check)


def _conform(args: argparse.Namespace) -> int:
    from kvstate.stateful.conform import (FactoryError, conform, conform_checks_known, format_table, observed_tiers,
                                          use_cache_folder_for_hypothesis)
    from kvstate.stateful.configs import describe_page_sizes, page_sizes
    from kvstate.stateful.replay_bounds import MAX_REPLAY_OPS

    try:
        _at_least("--time-limit", args.time_limit, 0.001, MAX_TIME_LIMIT)
        _at_least("--examples", args.examples, 1)
        _at_least("--steps", args.steps, 1, MAX_REPLAY_OPS)   # a seeded failure's replay command is a sweep's
        _workers(args.workers, 1)           # its form, before the backend is loaded
        if args.check:
            conform_checks_known(args.check)
        factory, configs = _load_backend(args.backend, args.time_limit)
        # An empty name is refused, as sweep refuses it: dropped, --configs , ran every configuration.
        names = (args.config or []) + ([name.strip() for name in args.configs.split(",")]
                                       if args.configs is not None else [])     # "" (an unset $CONFIGS) is refused
        if names:
            from kvstate.stateful.sweeps.sweep import configs_labelled
            try:
                configs = configs_labelled(names, configs)      # each once; a sweep's NAME-pageN labels too
            except KeyError as error:
                raise FactoryError(f"the backend declares {error.args[0]}") from None
        print(f"conformance of {args.backend}, profile {args.profile}, {len(configs)} configurations", flush=True)
        for config in configs:
            print(f"  {config.describe(describe_page_sizes(page_sizes(factory, config)))}")
        unobserved: list[str] = []      # a factory that hangs for one configuration: its checks report it
        tiers = observed_tiers(factory, configs, time_limit=args.time_limit, unobserved=unobserved)
        print(f"observation tiers: {', '.join(tiers) or 'none'} "
              f"(values, tokens, matched counts and errors are checked for every backend)", flush=True)
        if unobserved:
            print(f"  not observed: {', '.join(unobserved)} (no cache built and observed within the "
                  f"{args.time_limit:g} s limit; its checks report it)", flush=True)
        use_cache_folder_for_hypothesis()
        progress = (lambda line: print(line, file=sys.stderr, flush=True)) if args.verbose else None
        workers = _workers(args.workers, len(configs))
        if workers > 1 and len(configs) > 1:
            from kvstate.stateful.conform_pool import conform_in_processes

            results = conform_in_processes(args.backend, configs, workers, profile=args.profile, checks=args.check,
                                           time_limit=args.time_limit, sizes=(args.examples, args.steps),
                                           progress=progress)
        else:
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
    print(format_table(results, rerun=lambda result, check: _conform_rerun(args, result.config.name, check)),
          flush=True)
    return 0 if all(r.passed for r in results) else 1


def _conform_rerun(args: argparse.Namespace, config: str, check: str) -> str:
    """The command running one failed check of one configuration alone, as this run ran it; the whole
    configuration where what failed is no check (``worker``: the process running it died)."""
    from kvstate.stateful.conform import CHECKS

    words = ["kvstate", "conform", args.backend, "--config", config]
    if check not in CHECKS:
        words += [word for name in (args.check or []) for word in ("--check", name)]
    else:
        words += ["--check", check]
    if args.profile != "ci":
        words += ["--profile", args.profile]
    for option, value in (("--examples", args.examples), ("--steps", args.steps)):
        if value:
            words += [option, str(value)]
    if args.time_limit != CONFORM_TIME_LIMIT:
        words += ["--time-limit", f"{args.time_limit:g}"]
    return ("rerun this check alone: " if check in CHECKS else "rerun this configuration alone: ") + shlex.join(words)


def _fuzz(args: argparse.Namespace) -> int:
    if args.atheris:
        from kvstate.fuzz.atheris_harness import main as atheris_main

        return atheris_main(["kvstate-fuzz", *args.flags])
    for name, count in (("--random", args.random), ("--garbage", args.garbage), ("--files", args.files)):
        _at_least(name, count, 0)
    from kvstate.fuzz.snapshot_fuzz import run

    reports = run(args.precision or ("f32", "f16", "q8"), random_count=args.random, garbage_count=args.garbage,
                  seed=args.seed, path_share=args.files)
    for precision, report in reports.items():
        print(f"{precision}: {report.summary()}")
        for finding in report.escaped[:10] + report.changed[:10]:
            print(f"  {finding}")
    return 0 if all(report.ok for report in reports.values()) else 1

def _stress(args: argparse.Namespace) -> int:
    from kvstate.stateful.races.scenarios import SCENARIOS, NothingToRace, RaceFailure, available_stores, stress

    _at_least("--minutes", args.minutes, 0)
    _at_least("--scale", args.scale, 1)
    _at_least("--seed", args.seed, 0)      # NumPy's seeding refused it only once the races ran, unnamed
    for store in args.store or ():
        if store not in available_stores():
            raise UsageError(f"unknown or unavailable store {store!r} (available: {', '.join(available_stores())})")
    for scenario in args.scenario or ():
        if scenario not in SCENARIOS:
            raise UsageError(f"unknown scenario {scenario!r} (known: {', '.join(SCENARIOS)})")
    stores = list(args.store or ())
    if args.backend is not None:      # raced where conform's races check would race it (races/applicable.py)
        stores.append(_load_backend(args.backend)[0])

    print(f"race scenarios for {args.minutes} min, seed {args.seed}, {args.scale}x the CI iterations")
    try:
        totals = stress(args.minutes, seed=args.seed, stores=stores or None, scenarios=args.scenario, scale=args.scale)
    except NothingToRace as why:
        raise UsageError(f"{args.backend!r} is raced in no configuration: {why}") from None
    except RaceFailure as failure:
        print(f"FAILED: {_with_notes(failure)}")
        return 1
    for name, counts in totals.items():
        print(f"total {name}: " + ", ".join(f"{k}={v}" for k, v in counts.items()))
    print("no race found")
    return 0

def _with_notes(error: BaseException) -> str:
    """A race failure's message and its notes: each thread's last operations and the rerun command."""
    return "\n".join([str(error), *getattr(error, "__notes__", ())])


def _race(args: argparse.Namespace) -> int:
    """One iteration of one race scenario, as a race failure's rerun command names it."""
    from kvstate.stateful.races.applicable import why_not_raced
    from kvstate.stateful.races.harness import available_stores
    from kvstate.stateful.races.rerun import candidate_configs, config_for_label
    from kvstate.stateful.races.scenarios import SCENARIOS, run_iteration

    if args.scenario not in SCENARIOS:
        raise UsageError(f"unknown scenario {args.scenario!r} (known: {', '.join(SCENARIOS)})")
    _at_least("--iteration", args.iteration, 0)
    # Checked here: a negative seed failed inside the scenario and read as the race reproduced (exit 1);
    # 0 threads or fewer raced nothing and read as a pass; more than a machine starts read as a failure.
    _at_least("--seed", args.seed, 0)
    _at_least("--threads", args.threads, 1, MAX_RACE_THREADS)
    if args.store is not None and args.store not in available_stores():
        raise UsageError(f"unknown or unavailable store {args.store!r} (available: {', '.join(available_stores())})")
    store = args.store or _load_backend(args.backend)[0]
    why = None if args.store is not None else why_not_raced(store)     # as stress and conform's races: n/a
    if why is not None:
        raise UsageError(f"{args.backend!r} is raced in no configuration: {why}")
    try:
        config = config_for_label(args.config, candidate_configs(args.scenario, store))
    except KeyError as error:
        raise UsageError(error.args[0]) from None
    options = {"yields": args.yields} | ({"threads": args.threads} if args.threads is not None else {})
    try:
        report = run_iteration(args.scenario, store, config, args.seed, args.iteration, **options)
    except Exception as failure:     # noqa: BLE001 - RaceFailure, or what the backend raised in the scenario
        print(f"FAILED: {type(failure).__name__}: {_with_notes(failure)}")
        return 1
    if report.skipped:
        print(f"n/a: {args.scenario} in {config.name}: {'; '.join(report.skipped.values())}")
        return 0
    print(f"passed: {report}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from kvstate.bench.cli import run

    return run(args)


def _demo(args: argparse.Namespace) -> int:
    from kvstate.demo import main as demo

    return demo(hf=args.hf)

def _sweep(args: argparse.Namespace) -> int:
    from kvstate.stateful.sweeps.sweep import terminated_as_interrupt

    # A SIGTERM (a CI job's timeout) is ``Terminated`` from the command's first line to its last: one
    # that came while the backend loaded or the summary printed ended the command by the signal, not 143.
    with terminated_as_interrupt():
        return _sweep_command(args)


def _sweep_command(args: argparse.Namespace) -> int:
    import os
    from contextlib import nullcontext
    from pathlib import Path

    from kvstate.spec.errors import ClusterLostError, SweepError
    from kvstate.stateful.backends import backend_option, canonical_backend
    from kvstate.stateful.sweeps import journal as J
    from kvstate.stateful.sweeps import sweep as S
    from kvstate.stateful.conform import FactoryError
    from kvstate.stateful.printable import one_line, printable
    from kvstate.stateful.replay_bounds import MAX_REPLAY_OPS

    # --scheduler, else KVSTATE_SCHEDULER unless --workers or --in-process asks for a local sweep.
    scheduler = args.scheduler or (None if args.workers or args.in_process else os.environ.get("KVSTATE_SCHEDULER")
                                   or None)
    out_default = args.resume or "sweep-out"
    began, report = False, None
    try:
        _at_least("--seeds", args.seeds, 1, S.MAX_SEEDS)
        _at_least("--steps", args.steps, 1, MAX_REPLAY_OPS)   # past it, a failure's replay file could not be replayed
        _at_least("--shrink-limit", args.shrink_limit, 0)
        _at_least("--shrink-budget", args.shrink_budget, 0)
        _at_least("--shrink-tries", args.shrink_tries, 0)
        _at_least("--time-limit", args.time_limit, 0.001, MAX_TIME_LIMIT)
        _at_least("--run-timeout", args.run_timeout, 0.001, MAX_TIME_LIMIT)
        if args.resume:
            seeds, label, recorded_workers = _resume_arguments(args)
            if not scheduler and args.workers is None and recorded_workers and not args.in_process:  # a local resume
                # as many as the sweep it finishes had, no more than this machine's cores: a journal
                # is data, and may come from a bigger machine or a hostile hand
                args.workers = str(min(recorded_workers, S.resolve_workers("auto")))
        else:
            seeds = S.parse_seed_range(args.seed_range) if args.seed_range else range(args.seeds)
            label = None
            if args.shard:
                k, n = S.parse_shard(args.shard)
                seeds, label = S.shard(seeds, k, n), args.shard
                if not seeds:       # it ran 0 runs and exited 0: a CI job that checked nothing read as green
                    raise UsageError(f"--shard {args.shard} of {len(range(args.seeds)) if not args.seed_range else args.seed_range} "
                                     "seeds holds no seed: use fewer shards or more seeds")
        args.steps = 400 if args.steps is None else args.steps
        args.shrink_limit = J.DEFAULT_SHRINK_LIMIT if args.shrink_limit is None else args.shrink_limit
        args.shrink_budget = J.DEFAULT_SHRINK_BUDGET if args.shrink_budget is None else args.shrink_budget
        args.shrink_tries = J.DEFAULT_SHRINK_TRIES if args.shrink_tries is None else args.shrink_tries
        args.backend = args.backend or S.DEFAULT_BACKEND
        if not scheduler:       # a file backend, absolute: its commands work from any folder (a cluster's
            args.backend = canonical_backend(args.backend)      # workers resolve the name as given)
        if args.out is not None and not args.out.strip():     # '' was the default folder: a script's unset variable
            raise UsageError(f"--out {args.out!r} names no folder")
        args.out = args.out or out_default
        if Path(args.out).exists() and not Path(args.out).is_dir():
            raise UsageError(f"--out {args.out!r} is a file; it must name a folder")
        if scheduler:       # a bad address is one line now, before the backend loads or a Client exists
            from kvstate.stateful.sweeps.cluster import check_address

            check_address(scheduler)
        # Every configuration the backend declares (ours: each semantics too); a broken factory: exit 2 now.
        _, declared = _load_backend(args.backend, args.time_limit)
        configs = S.configs_labelled(args.configs.split(","), declared) if args.configs is not None else declared
        if scheduler and args.workers:
            raise ValueError("--workers sizes the local pool; with --scheduler the cluster's workers run the sweep")
        if args.in_process and (scheduler or S.resolve_workers(args.workers or "1") > 1):
            raise ValueError("--in-process runs the sweep in this process: it takes --workers 1 and no --scheduler")
        if scheduler:
            from kvstate.stateful.sweeps.cluster import connect

            context = connect(scheduler, args.backend)
        else:
            context = nullcontext()
        with context as cluster:
            workers = cluster.workers if cluster else S.resolve_workers(args.workers or "1")
            cores = S.resolve_workers("auto")
            if not cluster and workers > cores:     # 40 on 2 cores ran a third slower than 2 (review s68, 8)
                print(f"kvstate sweep: note: {workers} workers on {cores} cores; runs are CPU-bound, so more "
                      f"workers than cores only slow them", file=sys.stderr)
            where = (f"{workers} worker thread(s) of Dask scheduler {scheduler}" if cluster
                     else f"{workers} worker(s)")
            print(f"sweep: {len(seeds)} seeds x {len(configs)} configurations x {args.steps} steps "
                  f"against {args.backend}, {where}{', shard ' + label if label else ''}"
                  f"{', resuming ' + args.out if args.resume else ''}", file=sys.stderr)
            began = True
            report = S.sweep(seeds, args.steps, configs, args.backend, workers, Path(args.out),
                             args.shrink_limit, args.shrink_budget, shard_label=label,
                             executor=cluster.executor if cluster else None, run_timeout=args.run_timeout,
                             resume=bool(args.resume), scheduler=scheduler, progress=sys.stderr,
                             window=cluster.window if cluster else None, in_process=args.in_process,
                             shrink_tries=args.shrink_tries)
    except ClusterLostError as error:
        print(printable(f"kvstate sweep: {error}"), file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:
        if report is not None:      # the sweep had finished (a cluster's session was closing)
            return _stopped_with_reports(stop, Path(args.out))
        out = args.out or out_default
        how = "terminated" if isinstance(stop, S.Terminated) else "interrupted"
        if not began:
            print(f"\nkvstate sweep: {how} before the sweep began; nothing was run", file=sys.stderr)
            return _stopped_status(stop)
        written = S.report_paths(Path(out))[0]
        where = f"partial report in {written}" if written.is_file() else "no report written"
        print(printable(f"\nkvstate sweep: {how}; {where}; "        # a resumed backend's name is the journal's
                        f"finish with: kvstate sweep --resume {shlex.quote(str(out))}"
                        f"{backend_option(args.backend) if args.backend else ''}{S.scheduler_option(scheduler)}"),
              file=sys.stderr)
        return _stopped_status(stop)
    except (ValueError, KeyError, FactoryError, SweepError, UsageError) as error:
        # One line, escaped: a journal read on --resume (backend, configuration names) may be in it.
        print(one_line(f"kvstate sweep: {error.args[0] if isinstance(error, KeyError) else error}"), file=sys.stderr)
        return 2
    json_path, junit_path = S.report_paths(Path(args.out))      # the sweep wrote them before it let the folder go
    try:
        print(printable(S.format_summary(report)))      # names and messages come from the backend: escaped
        print(printable(f"reports: {json_path}, {junit_path}"))
        if report.failures:
            print()
            print(printable(S.failure_notes(report)))
    except KeyboardInterrupt as stop:
        return _stopped_with_reports(stop, Path(args.out))
    return 1 if report.failures else 0


def _stopped_with_reports(stop: KeyboardInterrupt, out) -> int:
    """Stopped after the sweep wrote its reports (while its summary printed, or a cluster's session
    closed): only what came after is cut short, the reports on disk are whole."""
    from kvstate.stateful.printable import printable
    from kvstate.stateful.sweeps.sweep import report_paths

    how = "terminated" if _terminated(stop) else "interrupted"
    json_path, junit_path = report_paths(out)
    print(printable(f"\nkvstate sweep: {how} after the sweep finished; its reports are complete: "
                    f"{json_path}, {junit_path}"), file=sys.stderr)
    return _stopped_status(stop)


def _stopped_status(stop: KeyboardInterrupt) -> int:
    """143 for a SIGTERM (``Terminated``), as a shell reports a process it ended; 130 for Ctrl-C."""
    return 143 if _terminated(stop) else 130


def _terminated(error: BaseException) -> bool:
    """Whether ``error`` is the ``Terminated`` a sweep's SIGTERM raises."""
    from kvstate.stateful.sweeps.sweep import Terminated

    return isinstance(error, Terminated)


def _resume_arguments(args: argparse.Namespace) -> tuple[list[int], str | None, int | None]:
    """The seeds, shard and local worker count of the sweep in ``--resume OUT``; its backend, steps,
    configurations and folder go into ``args``. Arguments given as well must agree with the journal
    (``--workers`` may differ)."""
    from pathlib import Path

    from kvstate.spec.errors import ResumeError
    from kvstate.stateful.backends import canonical_backend
    from kvstate.stateful.sweeps import journal

    plan = journal.read(Path(args.resume)).plan
    if args.backend is None and not args.trust_backend:
        _refuse_untrusted(plan.backend, f"{Path(args.resume) / journal.FILE}")
    recorded = {"backend": plan.backend, "steps": plan.steps, "configs": ",".join(plan.configs), "out": args.resume}
    clash = {}
    for name, want in recorded.items():
        given = getattr(args, name)
        if given is None:
            same = True
        elif name == "backend":     # the same file, however either is spelled
            same = _factory_named(canonical_backend(given)) == _factory_named(canonical_backend(want))
        elif name == "out":
            same = Path(given).resolve() == Path(want).resolve()
        else:
            same = _names_the_same_configs(given, plan.configs) if name == "configs" else given == want
        if not same:
            clash[name] = given
        setattr(args, name, want)
    if args.shard is not None and args.shard != plan.shard:
        clash["shard"] = args.shard
    for name in ("run_timeout", "shrink_limit", "shrink_budget", "shrink_tries"):       # how it ran: kept unless given
        if getattr(args, name) is None:
            setattr(args, name, getattr(plan, name))
    if clash:
        def held(name: str) -> str:
            value = recorded.get(name, plan.shard)
            return f"no --{name}" if value is None else f"--{name} {value}"
        raise ResumeError(f"{args.resume} holds a sweep with " + "; ".join(
            f"{held(name)}, not {value}" for name, value in clash.items()))
    return list(plan.seeds), plan.shard, plan.workers


def _factory_named(backend: str) -> str:
    """``backend`` with its callable named: ``file.py`` and ``file.py:factory`` load the same factory."""
    return backend if ":" in backend else f"{backend}:factory"


def _names_the_same_configs(given: str, labels) -> bool:
    """Whether ``--configs`` names the journal's configurations, in any order: each name one of its
    labels, or a configuration name that stands for its labels at several page sizes (``NAME-pageN``,
    ``sweep.config_labels``), together all of them and nothing else."""
    covered: set[str] = set()
    for name in given.split(","):
        meant = {label for label in labels if label == name or re.fullmatch(re.escape(name) + r"-page\d+", label)}
        if not meant:
            return False
        covered |= meant
    return covered == set(labels)


def _refuse_untrusted(backend: str, source: str) -> None:
    """A journal, replay or report is data (from CI, a colleague, a download): the backend it names
    is imported only if built in or if the user names it (``--backend``) or trusts it (``--trust-backend``).
    Checked before any import."""
    from kvstate.stateful.backends import BUILTIN_BACKENDS

    if not isinstance(backend, str) or backend.partition(":")[0] not in BUILTIN_BACKENDS:
        raise UsageError(f"{source} names backend {backend!r}; pass --backend {backend!r} "
                         f"(or --trust-backend) to import it: a file you did not write must not run code")


def _replay(args: argparse.Namespace) -> int:
    """Exit 0: it passes; 1: the recorded failure reproduces (a death or a hang of the backend
    included); 3: it fails otherwise than recorded; 2: a bad argument or file (``replay_verdict``)."""
    from kvstate.spec.errors import ReplayFileError, RunTimeout
    from kvstate.stateful import replay as R
    from kvstate.stateful import replay_process
    from kvstate.stateful.configs import undeclared_by
    from kvstate.stateful.conform import FactoryError
    from kvstate.stateful.printable import printable
    from kvstate.stateful.replay_verdict import FIXED, verdict

    def show(line: object) -> None:         # everything from the file or the backend, escaped
        print(printable(line))

    try:
        _at_least("--time-limit", args.time_limit, 0.001, MAX_TIME_LIMIT)
        recorded = R.load(args.file)
        short = recorded.failure
        if short is not None and short.phase != "finish" and short.step > len(recorded.ops):
            # A sweep's redraw that ended early (a crash that is not deterministic) saved fewer
            # operations than the step the run failed at: replayed, it would pass and read as "fixed".
            raise ReplayFileError(f"{args.file} records a failure at step {short.step} but holds only "
                                  f"{len(recorded.ops)} operations: it cannot reproduce that failure "
                                  f"(the sweep could not draw the operations that ran again)")
        backend = args.backend or recorded.backend
        if not args.backend and not args.trust_backend:
            _refuse_untrusted(recorded.backend, args.file)
        # Imported only: the replay builds the file's cache in its own process, where a factory that
        # raises, dies or hangs there is a finding compared with the recorded one (a sweep records it
        # as one), not a backend that cannot be loaded (exit 2).
        factory, _ = _load_backend(backend, args.time_limit, configs_default=[recorded.config], check=False)
        undeclared = undeclared_by(factory, recorded.config)
        if undeclared:
            raise UsageError(f"{args.file} holds configuration {recorded.config.name}, which backend {backend!r} "
                             f"does not declare ({undeclared}): nothing a backend does not declare is held against it")
        show(f"{args.file}: seed {recorded.seed}, backend {backend}"
             + (f" (found with {recorded.backend})" if backend != recorded.backend else ""))
        if recorded.failure is not None:
            show(f"recorded failure: {recorded.failure}")
        failure = replay_process.replay(recorded, factory, show, time_limit=args.time_limit,
                                        every_step=args.every_step,
                                        spawn_backend=backend if args.spawn else None)
        if failure is not None and failure.error == "BackendHasNoSnapshots":     # not a finding of this backend
            raise UsageError(f"{args.file}'s step {failure.step} snapshots or restores, and backend {backend!r} has "
                             f"no snapshot()/restore(): replay it against a backend that has them")
    except (ReplayFileError, FactoryError, UsageError, RunTimeout) as error:
        print(printable(f"kvstate replay: {error}"), file=sys.stderr)
        return 2
    status, lines = verdict(recorded.failure, failure)
    for line in lines:
        show(line)
    if recorded.edited:     # its operations are not the ones that ran: a pass says nothing of the recorded failure
        edit = (f"{args.file}'s operations were changed since it was written (its ops_sha256 does not match "
                f"them), so they are not the run that failed")
        if status == FIXED and recorded.failure is not None:
            print(printable(f"kvstate replay: {edit}: its passing says nothing about the recorded failure; "
                            f"replay the file as written, or remove its \"ops_sha256\" to replay the edit"), file=sys.stderr)
            return 2
        show(f"note: {edit}")
    return status


def _spec_check(args: argparse.Namespace) -> int:
    from kvstate.stateful.spec_check import MAX_WRITES_PER_STATE, SIZE_MAX, run_spec_check, writes_per_state

    for name in ("page_tokens", "contexts", "positions", "alphabet", "write", "values", "entries"):
        _at_least("--" + name.replace("_", "-"), getattr(args, name), 1, SIZE_MAX[name])
    for name in ("arena", "block_tokens", "max_pages", "pool_pages"):
        _at_least("--" + name.replace("_", "-"), getattr(args, name), 0, SIZE_MAX[name])
    # each option within its bound can still offer a state more writes than the search can try
    writes = writes_per_state(args.contexts, args.positions, args.alphabet, args.write, args.values)
    if writes > MAX_WRITES_PER_STATE:
        raise UsageError(f"this scope offers {writes:,} writes in one state (--contexts x --values x --alphabet ** k "
                         f"for k = 1..--write, at each of --positions places); at most {MAX_WRITES_PER_STATE:,} "
                         f"can be searched: lower --alphabet, --write or --values")
    _at_least("--depth", args.depth, 0)
    _at_least("--time-limit", args.time_limit, 0.001, MAX_TIME_LIMIT)
    _at_least("--crosshair-timeout", args.crosshair_timeout, 0.001)

    return run_spec_check(args)


class _Parser(argparse.ArgumentParser):
    """A bad argument is one line and exit 2, as README promises of every command; argparse printed
    its usage block (four lines for conform) before it. ``--help`` still prints the usage."""

    def error(self, message: str):
        from kvstate.stateful.printable import printable

        self.exit(2, printable(f"{self.prog}: error: {message} (see {self.prog} --help)") + "\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvstate", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    conform = commands.add_parser("conform", help="run the conformance suite against a backend factory")
    conform.add_argument("backend", nargs="?", default="kvstate.impl.numpy",
                         help="package.module[:factory] or path/to/file.py[:factory] (default: the built-in NumPy backend)")
    conform.add_argument("--profile", default="ci", choices=["ci", "nightly", "hunt"])
    conform.add_argument("--config", action="append", metavar="NAME",
                         help="only this configuration (e.g. q8-arena6); repeatable")
    conform.add_argument("--configs", metavar="A,B",
                         help="only these configurations, comma-separated, as kvstate sweep takes them (joins --config)")
    conform.add_argument("--check", action="append", metavar="NAME",
                         help="only this check (lockstep, 'fork isolation', ...); repeatable")
    conform.add_argument("--time-limit", type=float, default=CONFORM_TIME_LIMIT, metavar="SECONDS",
                         help="per configuration and check (default 300); past it the check is reported as "
                              "TIMEOUT, with where it was stuck, and the configuration's later checks are skipped")
    conform.add_argument("--examples", type=int, metavar="N", help="lockstep runs per configuration (overrides the profile)")
    conform.add_argument("--steps", type=int, metavar="N", help="operations per lockstep run (overrides the profile)")
    conform.add_argument("-v", "--verbose", action="store_true", help="print each check as it finishes")
    conform.add_argument("--workers", default="auto", metavar="N",
                         help="configurations checked at once, each in its own process (default: one per core; "
                              "1: in this process)")
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
    stress.add_argument("--store", action="append", help="page store (repeatable; default: every available one, "
                                                          "none with --backend)")
    stress.add_argument("--backend", help="a thread-safe backend's factory, package.module[:factory] or a file's "
                                          "path: raced in the configurations and scenarios kvstate conform races it in")
    stress.add_argument("--scenario", action="append", help="scenario name (repeatable; default: all)")
    stress.set_defaults(run=_stress)

    race = commands.add_parser("race", help="run one iteration of one thread-race scenario again (a race failure "
                                            "prints this command)")
    race.add_argument("scenario", help="scenario name (fork_storm, close_races, ...)")
    where = race.add_mutually_exclusive_group()
    where.add_argument("--backend", default="kvstate.impl.numpy",
                       help="package.module[:factory] or path/to/file.py[:factory] (default: the built-in NumPy backend)")
    where.add_argument("--store", help="a built-in page store, in the race configurations of tests/test_races.py")
    race.add_argument("--config", required=True, help="configuration name (NAME-pageN where a backend declares "
                                                      "NAME at several page sizes)")
    race.add_argument("--seed", type=int, default=0)
    race.add_argument("--iteration", type=int, default=0, help="which iteration: its operations come from the seed and it")
    race.add_argument("--threads", type=int, help="threads, as the failing run had them (default: the scenario's)")
    race.add_argument("--yields", action="store_true",
                      help="threads give up the interpreter at random calls into the backend's modules")
    race.set_defaults(run=_race)

    from kvstate.bench.cli import add_arguments as bench_arguments

    bench = commands.add_parser("bench", help="run the benchmarks: table, results.json, PNG plots")
    bench_arguments(bench)
    bench.set_defaults(run=_bench)

    demo = commands.add_parser("demo", help="ten seconds of what agents get: forks, backtracking, restore, prefix hits")
    demo.add_argument("--hf", action="store_true",
                      help="the same under Hugging Face transformers, on a tiny random model (pip install 'kvstate[hf]')")
    demo.set_defaults(run=_demo)

    sweep = commands.add_parser("sweep", help="run many seeds x configurations in lockstep; shrink and save failures")
    which = sweep.add_mutually_exclusive_group(required=True)
    which.add_argument("--seeds", type=int, help="seeds 0..N-1")
    which.add_argument("--seed-range", help="seeds A..B-1, as A:B")
    which.add_argument("--resume", metavar="OUT",
                       help="finish the stopped sweep whose journal is in OUT, running only what it lacks "
                            "(locally with as many workers as it had, at most one per core, unless --workers)")
    sweep.add_argument("--steps", type=int, help="operations per run (default 400)")
    sweep.add_argument("--configs", help="comma-separated configuration names (default: every one the "
                                             "backend is checked in)")
    sweep.add_argument("--backend", help="package.module[:factory] (default kvstate.impl.numpy)")
    sweep.add_argument("--trust-backend", action="store_true",
                       help="with --resume: import the backend the journal names even if it is not built in")
    sweep.add_argument("--workers", help="local processes, or 'auto' for one per core (default 1); a run that "
                                         "crashes its process, or hangs in C past --run-timeout, is a finding of its seed")
    sweep.add_argument("--in-process", action="store_true",
                       help="run every run in this process, for a debugger (a crash or a hang in C then ends or "
                            "holds the whole sweep)")
    sweep.add_argument("--scheduler", metavar="tcp://HOST:PORT",
                       help="run on this Dask scheduler's workers (default: $KVSTATE_SCHEDULER unless --workers "
                            "or --in-process is given); needs the cluster extra: pip install 'kvstate[cluster]'")
    sweep.add_argument("--run-timeout", type=float, metavar="SECONDS",
                       help="a run still going after this long is a timeout failure of its seed "
                            "(a resume: the sweep's, unless given)")
    sweep.add_argument("--shard", help="K/N: run only the K-th of N disjoint shards of the seeds")
    sweep.add_argument("--out", help="folder for report.json, junit.xml, replays/, runs.jsonl (default sweep-out)")
    sweep.add_argument("--shrink-limit", type=int, help="failures to shrink (default 5; a resume: the sweep's)")
    sweep.add_argument("--shrink-budget", type=float,
                       help="seconds per shrink, a backstop against a candidate that hangs: a shrink it cuts short "
                            "is marked so in the report (default 300; a resume: the sweep's)")
    sweep.add_argument("--shrink-tries", type=int,
                       help="tries per shrink, what bounds it on every machine alike (default 1000; a resume: "
                            "the sweep's)")
    sweep.add_argument("--time-limit", type=float, default=LOAD_TIME_LIMIT, metavar="SECONDS",
                       help="for importing the backend and building its first cache (default 60)")
    sweep.set_defaults(run=_sweep)

    replay = commands.add_parser(
        "replay", help="re-run a saved failing sequence step by step",
        description="Re-run a saved failing sequence step by step. Exit status: 0, every invariant holds (fixed); "
                    "1, the recorded failure reproduces (or the file records none and the replay fails); 3, it "
                    "fails, but not as recorded; 2, a bad argument or file (a failure step past its operations "
                    "included; a failing file whose operations were edited since it was written, then passing), "
                    "a backend that cannot be loaded, or a replay that did not finish within "
                    "--time-limit where the file records no hang (raise --time-limit).")
    replay.add_argument("file", help="a replay file written by kvstate sweep")
    replay.add_argument("--backend", help="replay against this factory instead of the recorded one")
    replay.add_argument("--trust-backend", action="store_true",
                        help="import the backend the file names even if it is not built in (a file runs code)")
    replay.add_argument("--time-limit", type=float, default=LOAD_TIME_LIMIT, metavar="SECONDS",
                        help="for importing the backend and building its first cache, and again for the "
                             "replay itself (default 60); a replay that does not finish in it exits 2, unless "
                             "the file records a hang (RunTimeout), which then reproduces")
    replay.add_argument("--every-step", action="store_true",
                        help="check every invariant after every step (default: after every step while the cache "
                             "is small, then spaced so the replay takes time linear in its length)")
    replay.add_argument("--spawn", action="store_true",
                        help="run the replay in a fresh process (spawn) that imports the backend itself, not in a "
                             "fork of this one, which built a cache to check the backend: for a backend that cannot "
                             "run in a forked child (CUDA). Patches made in this process do not reach it")
    replay.set_defaults(run=_replay)

    spec_check = commands.add_parser(
        "spec-check", help="CrossHair over the spec's arithmetic, then an exhaustive search at a small scope, "
                           "once per declared semantics (--semantics)")
    from kvstate.stateful.spec_check import add_arguments as add_spec_check_arguments

    add_spec_check_arguments(spec_check)
    spec_check.set_defaults(run=_spec_check)
    return parser


# Options whose value may start with "-" ("--seed-range -3:2"): argparse would read such a value as
# an option and say only "expected one argument"; joined to its option, the value gets its named error.
DASHED_VALUES = ("--seed-range", "--shard")


def _join_dashed_values(argv: list[str]) -> list[str]:
    joined, rest = [], iter(argv)
    for token in rest:
        value = next(rest, None) if token in DASHED_VALUES else None
        if value is not None and value.startswith("-") and value[1:2].isdigit():
            joined.append(f"{token}={value}")
        else:
            joined += [token] if value is None else [token, value]
    return joined


def main(argv: list[str] | None = None) -> int:
    from kvstate.stateful.printable import printable

    if argv is None:        # the command itself, not a caller of ``main``: its stages are watched from outside
        from kvstate.stateful.held_interpreter import enable, settled
        enable()
        status = main(sys.argv[1:])
        settled(status)     # an ``os._exit(0)`` past here (a thread a backend left) keeps this status
        return status

    args = build_parser().parse_args(_join_dashed_values(argv))
    try:
        if args.command in SCRATCH_USERS:
            from kvstate.stateful.snapshots import scratch_problem
            if (problem := scratch_problem()) is not None:
                raise UsageError(problem)
        return args.run(args)
    except UsageError as error:
        print(printable(f"kvstate {args.command}: {error}"), file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:       # Ctrl-C (or a SIGTERM a command turned into one): one line, as sweep's
        print(f"kvstate {args.command}: {'terminated' if _terminated(stop) else 'interrupted'}", file=sys.stderr)
        return _stopped_status(stop)
    except Exception as error:      # noqa: BLE001 -- anything else escaping a subcommand: one line, exit 2
        message = str(error).splitlines()[0] if str(error) else ""
        print(printable(f"kvstate {args.command}: {type(error).__name__}: {message}"), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
