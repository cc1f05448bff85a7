"""Run the lockstep machine against a backend factory in each configuration it declares."""

from __future__ import annotations

import importlib
import time
import traceback
from dataclasses import dataclass

from hypothesis import settings as Settings
from hypothesis.stateful import run_state_machine_as_test

from kvstate.spec.errors import KVStateError
from kvstate.spec.protocol import Config, Factory, declared_configs

from .configs import PROFILES, machine_configs
from .machine import machine_for


class FactoryError(KVStateError):
    """A backend factory could not be loaded or does not speak the protocol."""


def load_factory(path: str) -> Factory:
    """``package.module:callable``, or ``package.module`` for that module's ``factory``."""
    module_name, _, attribute = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:   # any import failure is the user's to read, by name
        raise FactoryError(f"cannot import backend module {module_name!r}: {error!r}") from error
    attribute = attribute or "factory"
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise FactoryError(f"{module_name!r} has no callable {attribute!r} (a backend factory)")
    return factory


@dataclass
class ConfigResult:
    config: Config
    runs: int
    steps: int
    checks: int
    seconds: float
    failure: str | None = None

    @property
    def passed(self) -> bool:
        return self.failure is None


def run_lockstep(factory: Factory, config: Config, settings: Settings) -> ConfigResult:
    machine = machine_for(factory, config)
    started = time.perf_counter()
    failure = None
    try:
        run_state_machine_as_test(machine, settings=settings)
    except Exception as error:   # a failing backend may raise anything; report it, never hang
        failure = "".join(traceback.format_exception_only(type(error), error)).strip()
    stats = machine.stats
    return ConfigResult(config, stats.runs, stats.steps, stats.checks, time.perf_counter() - started, failure)


def conform(factory: Factory, profile: str = "ci", configs: list[Config] | None = None) -> list[ConfigResult]:
    configs = configs or declared_configs(factory, machine_configs())
    return [run_lockstep(factory, config, PROFILES[profile]) for config in configs]


def format_table(results: list[ConfigResult]) -> str:
    rows = [("configuration", "runs", "steps", "invariant checks", "seconds", "result")]
    for r in results:
        rows.append((r.config.name, str(r.runs), str(r.steps), str(r.checks), f"{r.seconds:.1f}",
                     "pass" if r.passed else "FAIL"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for r in results:
        if not r.passed:
            lines.append(f"\n{r.config.name} failed:\n{r.failure}")
    return "\n".join(lines)
