"""Conformance: run the suite against a backend factory in each configuration it declares.

``conform(factory)`` runs every check in ``CHECKS`` (the lockstep machine first,
then the directed scenarios of ``directed.py``) for every declared configuration
and returns one ``ConfigResult`` per configuration; ``format_table`` prints them
as configuration x check, followed by each failure with its minimised sequence.

Every check runs in a worker thread under a time limit: a backend that hangs is
reported as ``TIMEOUT`` and the run moves on to the next configuration (the stuck
daemon thread is abandoned; the configuration's later checks are reported as
``skipped``, each of which would likely wait out its limit too), so conformance
never hangs. Other suites (snapshot fuzzing, races)
plug in with ``register_check``.
"""

from __future__ import annotations

import os
import shlex
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from hypothesis import Phase, settings as Settings
from hypothesis.errors import FailedHealthCheck

from kvstate.spec.invariants import TIERS, InvariantViolation, tiers
from kvstate.spec.protocol import Config, Factory, check_declarations

from .backends import FactoryError, backend_name, check_backend, load_factory  # noqa: F401  (conform's API, as before)
from .configs import PROFILES, config_label, configs_for, seeded_size
from .deadline import Overran, in_daemon_thread
from .directed import checks as directed
from .directed.checks import DIRECTED
from .directed.common import BrokenPromise
from .machine import machine_for, run_machine
from .frames import suite_assertion
from .lockstep import CHECKED, UNOBSERVED
from .replay import AsWatched, Failure, execute, raised_at
from .seeded import first_seed, run_seeds
from .shrink import CLOCK, TRIES, Shrinker, created_handles
from .stuck import stuck_at

DEFAULT_TIME_LIMIT = 300.0   # seconds per configuration and check


def observed_tiers(factory: Factory, configs: list[Config], time_limit: float | None = DEFAULT_TIME_LIMIT,
                   unobserved: list[str] | None = None) -> list[str]:
    """The observation tiers the factory's new caches expose (``spec.invariants.tiers``) over
    ``configs``, claiming no coverage that did not happen: a tier some configurations lack names in
    how many of them it was seen, and an arena counts only where it has slots (books of 0 slots,
    an arena-less configuration's, check only that no page holds one).

    Each cache is built and observed in a daemon thread within ``time_limit`` (None: no limit), one
    budget for them all, so a factory that hangs for one configuration cannot hang the header printed
    before the checks: that configuration is left out, and its name added to ``unobserved`` where
    given (its checks then report the hang). A configuration whose cache cannot be built is left
    out as well (its checks report that too). Each cache is cleared once observed."""
    seen, observed = [], []
    # One budget for the header, not one each: a factory hanging on every configuration delayed the
    # checks by the limit times the configurations, before any of them started.
    ends = None if time_limit is None else time.monotonic() + time_limit
    for config in configs:
        left = None if ends is None else ends - time.monotonic()
        if left is not None and left <= 0:
            if unobserved is not None:
                unobserved.append(config.name)
            continue

        def observe(config: Config = config):
            cache = factory(config)
            try:
                return cache.observe()
            finally:        # real engines' caches are large: hold nothing (an abandoned thread clears its own)
                _cleared(cache)
        try:
            seen.append(observe() if left is None
                        # watched for the whole limit, not what is left of the header's one budget:
                        # the header only informs, and a slow first cache must not end the command
                        else in_daemon_thread(observe, left, f"kvstate-observe-{config.name}",
                                              f"observing a first cache of {config.name}", watched_for=time_limit))
            observed.append(config)
        except Overran:
            if unobserved is not None:
                unobserved.append(config.name)
        except (Exception, SystemExit):     # the checks report it, with its configuration
            pass
    counting = _page_counts(factory, [c for c, obs in zip(observed, seen) if "pages" not in tiers(obs)], time_limit)
    labels = []
    for tier in TIERS:
        having = [obs for obs in seen if tier in tiers(obs)]
        if tier == "arena":
            slotted = [obs for obs in having if obs.arena_size]
            if having and not slotted:
                labels.append("arena books of 0 slots (no arena exercised)")
            having = slotted
        if having:
            labels.append(tier if len(having) == len(seen) else f"{tier} ({len(having)} of {len(seen)} configurations)")
    if counting:            # a black box whose allocator counts: invariant 6's allocated = freed is checked
        labels.append("page counts (invariant 6)" if counting == len(seen) else
                      f"page counts (invariant 6; {counting} of {len(seen)} configurations)")
    return labels


COUNT_PROBE_S = 10.0
"""What ``_page_counts`` may take in all: past it, the configurations not yet probed count as not counting
(a backend whose one-position extend hangs has its checks report the hang, not the header)."""


def _page_counts(factory: Factory, configs: list[Config], time_limit: float | None) -> int:
    """In how many of ``configs`` (a black box's: no pages tier) a new cache counts the pages it allocates
    (``pages_allocated``), which a new cache's 0 cannot tell: one position written and observed in each,
    within ``COUNT_PROBE_S`` for them all. Two audits (s73) read "observation tiers: none" above a
    failure of invariant 6's counts."""
    ends = time.monotonic() + min(COUNT_PROBE_S, time_limit or COUNT_PROBE_S)
    counted = 0
    for config in configs:
        left = ends - time.monotonic()
        if left <= 0:
            break
        try:
            counted += in_daemon_thread(lambda config=config: _counts_pages(factory(config), config), left,
                                        f"kvstate-count-{config.name}", f"counting the pages of {config.name}")
        except Overran:
            break
        except (Exception, SystemExit):     # the checks report what the backend raised
            pass
    return counted


def _counts_pages(cache, config: Config) -> bool:
    """One position written into a new ``cache`` and observed: whether ``pages_allocated`` counted it."""
    try:
        ctx = cache.allocate()
        try:
            ctx.extend([0], np.zeros(config.layout.batch_shape(1), np.float32))
            return cache.observe().pages_allocated > 0
        finally:
            ctx.close()
    finally:
        _cleared(cache)


def _cleared(cache) -> None:
    """``cache.clear()``, whatever it raises: a header's caches hold nothing once looked at."""
    try:
        cache.clear()
    except Exception:
        pass


def use_cache_folder_for_hypothesis() -> Path:
    """Point Hypothesis's own files at the user's cache folder, never the working directory
    (the profiles keep no example database; Hypothesis may still write other files)."""
    from hypothesis.configuration import set_hypothesis_home_dir

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    folder = base / "kvstate" / "hypothesis"
    set_hypothesis_home_dir(folder)
    return folder


# -- checks ----------------------------------------------------------------------------

@dataclass
class Outcome:
    status: str                  # pass, FAIL, TIMEOUT, n/a (the backend lacks what the check needs), or
                                 # skipped (an earlier check of its configuration hung)
    seconds: float
    detail: str | None = None    # what failed, and the minimised sequence where there is one
    runs: int = 0
    steps: int = 0
    checks: int = 0
    cpu_seconds: float = 0.0     # the process's CPU time while the check ran (its threads' included)
    note: str | None = None      # a pass that left something unchecked says what (``directed.common.note``)

    @property
    def passed(self) -> bool:
        return self.status in ("pass", "n/a", "skipped")

    @classmethod
    def skipped_after(cls, hung: str) -> "Outcome":
        """A check not run because ``hung``, an earlier check of its configuration, timed out."""
        return cls("skipped", 0.0, f"not run: {hung!r} hung in this configuration")


Check = Callable[[Factory, Config, Settings], Outcome]


SHRINK_BUDGET_S = 20.0     # delta debugging of one counterexample, after Hypothesis's own shrinking

# A check that is still shrinking when its time limit comes reports what it has so far:
# thread ident -> a function returning that report (None while nothing failed); and it is told to
# stop, so the abandoned thread does not shrink on for minutes in the background.
_partial: dict[int, Callable[[], "str | None"]] = {}
_abandon: dict[int, Callable[[], None]] = {}


def lockstep_check(factory: Factory, config: Config, settings: Settings) -> Outcome:
    """The lockstep machine: random operation sequences, every invariant after every step."""
    machine = machine_for(factory, config)
    started = time.perf_counter()
    detail = None
    _partial[threading.get_ident()] = lambda: _so_far(machine.stats.shortest_failure, config)
    _abandon[threading.get_ident()] = machine.stats.abandon
    # Hypothesis finds; delta debugging over operations shrinks (``_reshrink``, bounded by
    # SHRINK_BUDGET_S). Hypothesis's own shrinking of a stateful run can take its full five
    # minutes on a correct-speed backend, which reads as a hang; a profile whose phases include
    # ``shrink`` gets ours instead.
    shrinking = Phase.shrink in settings.phases
    finding = Settings(settings, report_multiple_bugs=False,
                       phases=[phase for phase in settings.phases if phase is not Phase.shrink])
    try:
        run_machine(machine, finding)
    except BaseException as error:   # a failing backend may raise anything; report it, never hang
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        detail = _lockstep_failure(factory, error, machine.stats.shortest_failure or machine.stats.last,
                                   shrunk=shrinking, stop=lambda: machine.stats.abandoned)
    finally:
        _partial.pop(threading.get_ident(), None)
        _abandon.pop(threading.get_ident(), None)
    stats = machine.stats
    return Outcome("pass" if detail is None else "FAIL", time.perf_counter() - started, detail,
                   stats.runs, stats.steps, stats.checks)


def _lockstep_failure(factory: Factory, error: BaseException, last, shrunk: bool,
                      stop: Callable[[], bool] = lambda: False) -> str:
    """The report of a failed machine run: the shortest failing run Hypothesis found, shrunk by delta
    debugging over operations (which drops allocate/close pairs nothing else uses) where ``shrunk``."""
    if last is None or isinstance(error, FailedHealthCheck):
        return describe(error, None)
    history = last.history[:last.failed_at] if last.failed_at is not None else last.history
    if shrunk:
        replayed, lines, stopped = _reshrink(factory, last.config, last.ops[:len(history)], stop, run=_as_run(last))
        if replayed is not None:
            return _report(replayed.headline, last.config, lines, _minimised(stopped), replayed.found_by)
    return describe(error, history, minimised=False, config=last.config)


def _as_run(run) -> Callable:
    """How a run's sequence replays: observing as it did, where it left steps unobserved; else ``execute``."""
    return AsWatched(run.unwatched, run.checked_after) if run.unwatched else execute


def _reshrink(factory: Factory, config: Config, ops: list, stop: Callable[[], bool] = lambda: False,
              shrinking: Callable[[Shrinker], None] | None = None,
              run: Callable = execute) -> tuple["Failure | None", list[str], str | None]:
    """Delta debugging of a counterexample: the failure, the shrunk run's history, and why shrinking stopped
    short of a minimal sequence (``Shrinker.stopped``: None, ``TRIES`` or ``CLOCK``); ``(None, [], None)`` when
    it does not replay outside Hypothesis. ``stop()`` True ends the shrink between tries;
    ``shrinking(shrinker)`` is told of the shrink before it starts (``shrinker.best`` is the shortest so far).
    ``run``: how a sequence is run, ``execute`` unless the check that found the failure has its own."""
    if stop():
        return None, [], None
    failure, _ = run(factory, config, ops)
    if failure is None:
        return None, [], None
    shrinker = Shrinker(factory, config, failure, SHRINK_BUDGET_S, stop, run=run)
    if shrinking is not None:
        shrinking(shrinker)
    shrinker.shrink(list(ops))
    best = shrinker.best
    if best.history is None and not stop():     # no try failed: run the sequence once more for its history
        _, lockstep = run(factory, config, best.ops)
        return best.failure, lockstep.history[:lockstep.failed_at], shrinker.stopped
    return best.failure, best.history or [], shrinker.stopped


def _so_far(last, config: Config) -> str | None:
    """The shortest failing run found so far, for a check stopped while it was being shrunk."""
    if last is None or last.failed_at is None:
        return None
    return describe(AssertionError(f"{last.failure} (found, then still being shrunk)"),
                    last.history[:last.failed_at], minimised=False, config=last.config)


_STOPPED = {TRIES: "shrinking stopped at its try limit, so it may not be minimal; ",
            CLOCK: "shrinking stopped at its time budget, so it may not be minimal; "}


def _minimised(stopped: str | None) -> str:
    """What a shrunk sequence is called in a report: minimised, unless shrinking stopped short (``_STOPPED``)."""
    return f"minimised failing sequence ({_STOPPED[stopped][:-2]})" if stopped else "minimised failing sequence"


def _still_shrinking(shrinker: Shrinker | None, found: tuple[Failure, Config, list[str]] | None,
                     what: str = "failing sequence found so far, not minimal",
                     checking: str | None = None) -> str | None:
    """For a check stopped while it was shrinking a failure: the shortest failing sequence ``shrinker`` had
    found (``Shrinker.best``), or, before its first try showed one, ``found``: the failure as it was found,
    its configuration and its sequence. None while nothing failed. ``checking``: the promise a directed
    check was testing (``_shrunk_directed``)."""
    best = None if shrinker is None else shrinker.best
    if best is not None and best.history is not None:
        failure, config, lines = best.failure, shrinker.config, best.history
    elif found is not None:
        failure, config, lines = found
    else:
        return None
    head = f"{failure.headline} (found, then still being shrunk)"
    head += f'\nfound while checking: "{checking}"' if checking else ""
    return _report(head, config, lines, what, failure.found_by)


def _as_drawn(ops: list, failure: Failure, quiet: AsWatched) -> list[str]:
    """A sequence not yet run in lockstep, as its history would read (handles named in creation order, as
    ``Lockstep`` names them, and the steps ``quiet`` says ran unobserved marked so), up to the failing operation."""
    if failure.phase != "finish":
        ops = ops[:failure.step]
    return [(f"{made} = {op}" if made else str(op))
            + (UNOBSERVED + (CHECKED if id(op) in quiet.checked_after else "") if id(op) in quiet.unwatched else "")
            for op, made in zip(ops, created_handles(ops))]


def seeded_check(factory: Factory, config: Config, settings: Settings) -> Outcome:
    """Seeded sequences of ``stateful/generate.py`` (the sweep's), shrunk by delta debugging."""
    seeds, steps = seeded_size(settings)
    started = time.perf_counter()

    def replay(seed: int) -> str:
        return (f"replay: kvstate sweep --seed-range {seed}:{seed + 1} --steps {steps} "
                f"--configs {shlex.quote(config.name)} --backend {shlex.quote(backend_name(factory))}")

    # Past the time limit, ``run_with_limit`` reports the failure being shrunk, and stops the shrink.
    shrinking: list = []        # (seed, operations, shrinker, the failure found) once a seed failed
    stopped = threading.Event()

    def so_far() -> str | None:
        if not shrinking:
            return None
        seed, ops, shrinker, failure = shrinking[0]
        found = (failure, shrinker.config, _as_drawn(ops, failure, shrinker.run))
        return _still_shrinking(shrinker, found, f"failing sequence found so far, not minimal (seed {seed} of "
                                                 f"{steps} steps; {replay(seed)})")

    _partial[threading.get_ident()] = so_far
    _abandon[threading.get_ident()] = stopped.set
    detail = None
    try:        # the hooks stay until the report is built: its last replay may run into the time limit too
        runs = run_seeds(factory, config, seeds, steps, budget_s=float("inf"), shrink_budget_s=SHRINK_BUDGET_S,
                         first=first_seed(config), stop=stopped.is_set,
                         shrinking=lambda seed, ops, shrink: shrinking.append((seed, ops, shrink, shrink.failure)))
        if runs.failure is not None and not stopped.is_set():   # stopped: no one waits for the report
            found = runs.failure
            if found.history is None:       # no shrink try showed it: run it once more for its history
                _, lockstep = found.run(factory, found.config, found.ops)
                found.history = lockstep.history[:lockstep.failed_at]
            what = (f"minimised failing sequence (seed {found.seed} of {steps} steps; "
                    f"{_STOPPED.get(found.shrink_stopped, '')}{replay(found.seed)})")
            detail = _report(found.failure.headline, found.config, found.history, what, found.failure.found_by)
    finally:
        _partial.pop(threading.get_ident(), None)
        _abandon.pop(threading.get_ident(), None)
    return Outcome("pass" if detail is None else "FAIL", time.perf_counter() - started, detail,
                   runs.runs, runs.steps, runs.steps + runs.runs)


def _directed(check) -> Check:
    def run(factory: Factory, config: Config, settings: Settings) -> Outcome:
        started = time.perf_counter()
        directed.current.run = None
        directed.current.notes = []
        directed.current.settings = settings        # a check sized by the profile reads it (``long histories``)
        # Past the time limit, ``run_with_limit`` reports the failure being shrunk, and stops the shrink.
        found: list = []            # (the failure's report as found, the promise checked), once the check failed
        shrinking: list = []        # the shrinker, once its failure replayed
        stopped = threading.Event()

        def so_far() -> str | None:
            if not found:
                return None
            report, promise = found[0]
            return _still_shrinking(shrinking[0] if shrinking else None, None, checking=promise) or report

        _partial[threading.get_ident()] = so_far
        _abandon[threading.get_ident()] = stopped.set
        try:
            check(factory, config)
        except directed.NotApplicable as reason:
            return Outcome("n/a", time.perf_counter() - started, str(reason))
        except Exception as error:
            run = directed.current.run
            history = None if run is None else run.history[:run.failed_at]
            promise = getattr(error, "promise", None)
            # the run's own configuration: the page size it drew, or the wide layout ``scale`` ran at
            ran_in = config if run is None else run.config
            found.append((_unshrunk_directed(error, promise, history, ran_in), promise))
            # a profile without Hypothesis's shrink phase (hunt) wants "found or not", not the shortest run
            shrinks = run is not None and Phase.shrink in (settings.phases or ())
            shrunk = (_shrunk_directed(factory, run, error, stopped.is_set, shrinking.append)
                      if shrinks else None)
            if shrunk is not None:
                return Outcome("FAIL", time.perf_counter() - started, shrunk)
            return Outcome("FAIL", time.perf_counter() - started, found[0][0])
        finally:
            _partial.pop(threading.get_ident(), None)
            _abandon.pop(threading.get_ident(), None)
            directed.current.settings = None
        return Outcome("pass", time.perf_counter() - started, note="; ".join(directed.current.notes) or None)
    run.__doc__ = check.__doc__
    return run


def _unshrunk_directed(error: BaseException, promise: str | None, history: list[str] | None, config: Config) -> str:
    """A directed check's failure as found. Where an invariant the run checks after every step broke
    (``keeping`` made it the check's ``BrokenPromise``), that leads and the promise follows as what was
    being checked, as in a shrunk report: the check's promise is often not the one broken (a copy-on-write
    skipped one step earlier showed as "q8 rounds half to even" in ``precision edges``: audit s68/audit4)."""
    cause = error.__cause__
    if isinstance(error, BrokenPromise) and isinstance(cause, InvariantViolation) and promise:
        first, _, rest = describe(cause, history, minimised=False, config=config).partition("\n")
        return f'{first}\nfound while checking: "{promise}"' + (f"\n{rest}" if rest else "")
    head = f'"{promise}" -- broken: ' if promise and promise not in str(error) else ""
    return head + describe(error, history, minimised=False, config=config)


def _shrunk_directed(factory: Factory, run, error: BaseException, stop: Callable[[], bool] = lambda: False,
                     shrinking: Callable[[Shrinker], None] | None = None) -> str | None:
    """A directed check's failure (the suite's assertion, or what the backend raised: a check's whole
    sequence ran to 142 operations where its replay shrank to 5) as a minimised sequence, where its
    operations replay it: the same
    ``execute`` as replay files (every invariant after every step) finds the failure again, and delta
    debugging shrinks it. What broke is the first line, the promise the check tests the next. None when the
    failure came from a call outside the run's operations (it is then reported as it happened).
    ``stop`` and ``shrinking`` as ``_reshrink``'s."""
    # The teardown's clear (``Lockstep.finish``) is no operation: a failure there (invariant 6) replays too.
    steps = [line for line in run.history if "# teardown" not in line]
    if not isinstance(error, Exception) or not run.ops or len(run.ops) != len(steps):
        return None
    # A check that compares runs (``arena evidence``'s twins) replays a sequence its own way (``error.replay``);
    # one that left steps unobserved, observing as it did.
    replayed, lines, stopped = _reshrink(factory, run.config, list(run.ops), stop, shrinking,
                                         getattr(error, "replay", None) or _as_run(run))
    if replayed is None:
        return None
    # Replayed, the failure is whatever the checks after every step meet first, which may break another
    # promise than the one this check tests: what broke leads, and that promise follows as what was
    # being checked (quoted first, it read as the rule the backend broke).
    promise = getattr(error, "promise", None)
    quoted = promise is not None and f'"{promise}"' in replayed.headline
    head = replayed.headline + (f'\nfound while checking: "{promise}"' if promise and not quoted else "")
    return _report(head, run.config, lines, _minimised(stopped), replayed.found_by)


# Each race scenario runs in rounds: two iterations as the interpreter switches threads (seed 0),
# then one iteration a round with threads also giving up the interpreter at random calls into the
# backend (``harness.yielding_calls``), a new seed each round. Those catch windows a few bytecodes
# wide that the first almost never lands in: two of an audit's planted lock bugs were caught in 19
# and 16 of 30 configurations by the first alone. The first two rounds always run; more, up to
# ``RACE_ROUNDS``, while the scenario has taken under ``RACE_ROUND_BUDGET`` seconds, so a cheap
# scenario gets more schedules and a slow one (the profile hook slows a call-heavy engine's threads
# several times over) costs one iteration more.
RACE_ROUNDS = 4
RACE_ROUND_BUDGET = 0.5


def race_rounds(clock: Callable[[], float] = time.perf_counter):
    """The ``(seed, options)`` of each round of one scenario; ``clock`` read before each past the second."""
    started = clock()
    for seed in range(RACE_ROUNDS):
        if seed >= 2 and clock() - started >= RACE_ROUND_BUDGET:
            return
        yield seed, ({"iterations": 1, "yields": True} if seed else {"iterations": 2})


def races_check(factory: Factory, config: Config, settings: Settings) -> Outcome:
    """The thread-race scenarios of ``stateful/races/``, at a small size, for a backend whose
    factory declares ``thread_safe = True`` (n/a otherwise: a single-threaded backend is legitimate;
    which scenarios apply where: ``races/applicable.py``). Each runs in the declared configuration
    alone; one that does not apply there (``RaceReport.skipped``: an entry bound it cannot use) is
    named in the detail, and the check is n/a if none applies."""
    from .races import scenarios as races
    from .races.applicable import backend_scenarios

    started = time.perf_counter()
    scenarios = backend_scenarios(factory, config)
    if isinstance(scenarios, str):
        return Outcome("n/a", 0.0, scenarios)
    not_applicable = []         # a scenario that does not apply in this configuration, and why
    try:
        for name, options in scenarios:
            for seed, schedule in race_rounds():
                report = races.SCENARIOS[name](store=factory, seed=seed, configs=[config], **options, **schedule)
                if config.name in report.skipped:       # decided by the configuration: so in every round
                    not_applicable.append(f"{name}: {report.skipped[config.name]}")
                    break
    except Exception as error:   # RaceFailure, or whatever the backend raised under threads
        return Outcome("FAIL", time.perf_counter() - started, describe(error, None, minimised=False))
    detail = "; ".join(f"n/a {why}" for why in not_applicable) or None
    return Outcome("n/a" if len(not_applicable) == len(scenarios) else "pass", time.perf_counter() - started, detail)


CHECKS: dict[str, Check] = {"lockstep": lockstep_check, "seeded": seeded_check}
CHECKS.update({name: _directed(check) for name, check in DIRECTED.items()})
CHECKS["races"] = races_check


# The checks whose runs take seconds, in the order a first-failure run asks them: whether a bug is
# there does not depend on the order, and the directed checks take milliseconds, so they go first.
SLOW_CHECKS = ("scale", "lockstep", "seeded", "races")


def quick_first(names: list[str]) -> list[str]:
    """``names`` with the slow checks moved to the end (for a run that stops at its first failure)."""
    return [n for n in names if n not in SLOW_CHECKS] + [n for n in SLOW_CHECKS if n in names]


def register_check(name: str, check: Check) -> None:
    """Add a check to every conformance run (it returns an ``Outcome``)."""
    CHECKS[name] = check


def describe(error: BaseException, history: list[str] | None, minimised: bool = True,
             config: Config | None = None) -> str:
    """The failure by name, then the configuration and the call, then the operations that lead to it."""
    if isinstance(error, FailedHealthCheck):
        head = (f"suite error, not a finding about the backend: Hypothesis could not generate test cases "
                f"({type(error).__name__}: {str(error).splitlines()[0]})")
    elif suite_assertion(error):
        head = f"{type(error).__name__}: {error}"
    else:
        head = f"the backend raised {type(error).__name__}: {error}{raised_at(error)}"
    probe = getattr(error, "suite_probe", None)     # the suite's own call after the step raised it
    if probe:
        head += f"\n  {probe}"
    if history:
        what = "minimised failing sequence" if minimised else "failing sequence (not shrunk)"
        return _report(head, config, history, what, getattr(error, "found_by", ""))
    notes = getattr(error, "__notes__", None)
    if notes:
        head += "\n" + "\n".join(f"  {note}" for note in notes)
    return head if config is None else f"{head}\nconfiguration: {config.describe()}"


def _report(head: str, config: Config | None, history: list[str], what: str, found_by: str = "") -> str:
    """Broken promise, configuration and failing call first (and the suite's own call that found it,
    where a probe after the call did); the whole sequence after."""
    lines = [head]
    if config is not None:
        lines.append(f"configuration: {config.describe()}")
    calls = [line for line in history if "# teardown" not in line]
    if calls:
        failing = calls[-1] if len(calls) == len(history) else history[-1]
        lines.append(f"failing call: {failing}" + (f", found by {found_by}" if found_by else ""))
    lines.append(f"{what} ({len(history)} operations; the failure shows right after the last):")
    lines.extend(f"  {line}" for line in history)
    if any(UNOBSERVED in line for line in history):
        lines.append(f"  ({UNOBSERVED.strip()[2:]}: the step ran with no observe() before it, and no check after "
                     f"unless \"{CHECKED[2:]}\"; observing may settle what a backend keeps lazily, so the failure "
                     f"may not show without that)")
    return "\n".join(lines)


def run_with_limit(check: Check, factory: Factory, config: Config, settings: Settings,
                   time_limit: float, name: str | None = None) -> Outcome:
    """``check`` in a daemon thread; past ``time_limit`` it is abandoned and reported as TIMEOUT, or as a
    FAIL where it was shrinking a failure it found (``_partial``; ``_abandon`` stops the shrink)."""
    def checked() -> Outcome:
        try:
            return check(factory, config, settings)
        except BaseException as error:   # a check that itself crashes (sys.exit too) is a failure, by name
            return Outcome("FAIL", 0.0, describe(error, None))

    started, cpu_started = time.perf_counter(), time.process_time()
    try:
        outcome = in_daemon_thread(checked, time_limit, f"kvstate-conform-{config.name}",
                                   f"the {name or 'conformance'} check of {config.name}")
        outcome.cpu_seconds = time.process_time() - cpu_started
        return outcome
    except Overran as overran:
        stuck = stuck_at(overran.ident)         # read before the run is told to stop and unwinds
        partial = _partial.get(overran.ident, lambda: None)()
        _abandon.get(overran.ident, lambda: None)()
        if partial is not None:
            return Outcome("FAIL", time.perf_counter() - started,
                           f"a failure was found, but shrinking it ran out of the {time_limit:g} s limit: "
                           f"the sequence below is not minimal\n{partial}")
        return Outcome("TIMEOUT", time.perf_counter() - started,
                       f"no result after {time_limit:g} s: the backend hangs or is far too slow for --time-limit "
                       f"(seconds a configuration's check may take){stuck}")


# -- the suite --------------------------------------------------------------------------

@dataclass
class ConfigResult:
    config: Config
    outcomes: dict[str, Outcome] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(o.passed for o in self.outcomes.values())

    @property
    def failure(self) -> str | None:
        failed = [f"{name}: {o.detail}" for name, o in self.outcomes.items() if not o.passed]
        return "\n".join(failed) if failed else None

    @property
    def runs(self) -> int:
        return sum(o.runs for o in self.outcomes.values())

    @property
    def steps(self) -> int:
        return sum(o.steps for o in self.outcomes.values())

    @property
    def checks(self) -> int:
        """Invariant-set checks made (after every step, and at each run's end)."""
        return sum(o.checks for o in self.outcomes.values())


class UnknownCheckError(FactoryError):
    """A check named that does not exist (a ``FactoryError`` for callers catching those: the plugin, the CLI)."""


def conform_checks_known(names: list[str]) -> None:
    """``UnknownCheckError`` naming every check in ``names`` that does not exist, and the known ones."""
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise UnknownCheckError(f"no conformance checks {unknown}; known: {list(CHECKS)}")


def conform(factory: Factory, profile: str = "ci", configs: list[Config] | None = None,
            checks: list[str] | None = None, time_limit: float = DEFAULT_TIME_LIMIT,
            progress: Callable[[str], None] | None = None, settings: Settings | None = None,
            first_failure: bool = False) -> list[ConfigResult]:
    """Every check (or those named in ``checks``) in every configuration the factory declares.

    ``settings`` (Hypothesis settings for the lockstep machine) overrides ``profile``.
    ``first_failure``: stop at the first check that fails (the results end with its configuration),
    for "is a bug there at all?"; without ``checks``, the quick directed checks run first.
    """
    check_declarations(factory)     # with configs given too: races read thread_safe as it is
    configs = configs or configs_for(factory)
    settings = settings or PROFILES[profile]
    names = checks or (quick_first(list(CHECKS)) if first_failure else list(CHECKS))
    conform_checks_known(names)
    results = []
    for config in configs:
        result = ConfigResult(config)
        hung = None
        for name in names:
            if hung:        # each later check would most likely wait out its whole limit as well
                result.outcomes[name] = Outcome.skipped_after(hung)
            else:
                result.outcomes[name] = run_with_limit(CHECKS[name], factory, config, settings, time_limit, name)
                hung = name if result.outcomes[name].status == "TIMEOUT" else None
            if progress:
                progress(progress_line(config, name, result.outcomes[name]))
            if first_failure and not result.outcomes[name].passed:
                return results + [result]
        results.append(result)
    return results


def progress_line(config: Config, name: str, outcome: Outcome) -> str:
    """One check as it finishes (``kvstate conform -v``): its status, wall and CPU seconds."""
    return (f"{config.name:<12} {name:<18} {outcome.status:<7} {outcome.seconds:6.1f} s "
            f"{outcome.cpu_seconds:6.1f} cpu s")


def format_table(results: list[ConfigResult], rerun: Callable[[ConfigResult, str], str] | None = None) -> str:
    """Configuration x check, pass/FAIL/TIMEOUT/n/a/skipped; then every failure with its sequence, and
    ``rerun(result, check)``'s line after it where given (the command running that check alone).

    The columns are every check any configuration has, in the order first met: results may hold
    different checks (``conform(first_failure=True)`` stops within a configuration; a configuration
    whose worker process died has a ``worker`` column and none of that task's checks). A check a
    configuration lacks reads ``-``."""
    if not results:
        return "no configurations"
    names: list[str] = []
    for r in results:       # a check new here goes after its check before, else before its check after, else last
        order = list(r.outcomes)
        for i, name in enumerate(order):
            if name not in names:
                before = [n for n in order[:i] if n in names]
                after = [n for n in order[i + 1:] if n in names]
                names.insert(names.index(before[-1]) + 1 if before else names.index(after[0]) if after
                             else len(names), name)
    # one name declared at two page sizes: each row labelled with its own (an audit, s68: two "f32-heap" rows)
    label = {id(r): config_label(r.config, [other.config for other in results]) for r in results}
    rows = [("configuration", *names, "steps", "invariant checks", "seconds")]
    for r in results:
        rows.append((label[id(r)], *(r.outcomes[n].status if n in r.outcomes else "-" for n in names),
                     str(r.steps), str(r.checks),
                     f"{sum(o.seconds for o in r.outcomes.values()):.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for r in results:
        for name, outcome in r.outcomes.items():
            if not outcome.passed:
                lines.append(f"\n{label[id(r)]} / {name}: {outcome.status}\n{outcome.detail}")
                if rerun is not None:
                    lines.append(rerun(r, name))
                skipped = [n for n, o in r.outcomes.items() if o.status == "skipped"]
                if outcome.status == "TIMEOUT" and skipped:
                    lines.append(f"(not run after it, each of which would likely have waited out its limit too: "
                                 f"{', '.join(skipped)})")
    noted = [f"  {label[id(r)]} / {name}: {outcome.note}" for r in results for name, outcome in r.outcomes.items()
             if outcome.passed and outcome.note]
    if noted:
        lines.append("\npassed, with parts not run:\n" + "\n".join(noted))
    return "\n".join(lines)
