"""What a race failure says beyond its message, and the command that runs its iteration again.

A failure in a scenario leaves ``racing_reported`` with notes added (``annotate``): the scenario, the
configuration, store, seed and iteration; the last operations each thread started
(``trace.Trace``); and a ``kvstate race`` command (``rerun_command``) that runs that one
iteration of that scenario again in that configuration, for that backend, with the same seed:
the same operations, under a new schedule (a race is a schedule, which nothing replays).
``scenarios.run_iteration`` is what the command does.
"""

from __future__ import annotations

import shlex
from contextlib import contextmanager

from kvstate.spec.protocol import Config

from ..backends import backend_name, canonical_backend
from ..configs import config_label, configs_for
from .harness import RaceReport, pressure_configs, race_configs, racing, store_label


def candidate_configs(scenario: str, store) -> list[Config]:
    """The configurations a rerun finds a name among: the factory's own (as ``kvstate conform``
    runs it), or for a built-in store the scenario's default ones (``tests/test_races.py``'s)."""
    if callable(store):
        return configs_for(store)
    return pressure_configs() if scenario == "pressure_vs_match" else race_configs()


def config_for_label(label: str, candidates: list[Config]) -> Config:
    for config in candidates:
        if config_label(config, candidates) == label or f"{config.name}-page{config.page_tokens}" == label:
            return config
    known = ", ".join(dict.fromkeys(config_label(c, candidates) for c in candidates))
    raise KeyError(f"no configuration {label!r}; known: {known}")


def rerun_command(report: RaceReport, iteration: int, config: Config) -> str:
    if callable(report.store):
        target = f"--backend {shlex.quote(canonical_backend(backend_name(report.store)))}"
    else:
        target = f"--store {report.store}"
    label = config_label(config, candidate_configs(report.scenario, report.store))
    options = "".join(f" --{name} {value}" for name, value in report.options.items() if name != "yields")
    if report.options.get("yields"):
        options += " --yields"
    return (f"kvstate race {report.scenario} {target} --config {shlex.quote(label)} --seed {report.seed} "
            f"--iteration {iteration}{options}")


@contextmanager
def racing_reported(report: RaceReport, yields: bool):
    """``harness.racing`` for ``report``'s scenario; an error leaving it, the suite's ``RaceFailure``
    or whatever the backend raised, leaves with the notes of ``annotate``."""
    report.options["yields"] = yields
    try:
        with racing(report.store, report.seed, yields):
            yield
    except Exception as error:
        annotate(error, report)
        raise


def annotate(error: BaseException, report: RaceReport) -> None:
    """Add to ``error`` where in the scenario it happened, each thread's last operations, and the rerun."""
    if report.at is None:       # before the first iteration began: nothing ran yet
        return
    iteration, config = report.at
    yields = ", with yields" if report.options.get("yields") else ""
    error.add_note(f"race: {report.scenario}, configuration {config.name}, store {store_label(report.store)}, "
                   f"seed {report.seed}, iteration {iteration}{yields}")
    lines = report.trace.lines()
    if lines:
        error.add_note(f"the last {report.trace.length} operations each thread started, oldest first "
                       f"(threads 0, 1, ... as the failure names them):")
        for line in lines:
            error.add_note(f"  {line}")
    error.add_note(f"rerun (the same operations, a new schedule): {_command_or_why_not(report, iteration, config)}")


def _command_or_why_not(report: RaceReport, iteration: int, config: Config) -> str:
    """The rerun command, or why there is none: a report must never replace the failure it reports."""
    try:
        return rerun_command(report, iteration, config)
    except Exception as problem:    # noqa: BLE001 - e.g. a factory whose configurations cannot be listed
        return f"none ({type(problem).__name__}: {problem})"
