"""pytest plugin: ``pytest --kvstate-backend package.module[:factory]`` runs conformance in your CI.

Registered through the ``pytest11`` entry point, so installing kvstate is enough.
Each (configuration, check) becomes one test item, named
``kvstate[BACKEND][CONFIG][CHECK]``; a failure prints the same counterexample as
``kvstate conform``. Without the option the plugin adds nothing.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser) -> None:
    group = parser.getgroup("kvstate", "kvstate backend conformance")
    group.addoption("--kvstate-backend", action="append", default=[], metavar="FACTORY",
                    help="run the kvstate conformance suite against this backend factory "
                         "(package.module[:callable] or path/to/file.py[:callable]); repeatable")
    group.addoption("--kvstate-profile", default="ci", choices=["ci", "nightly", "hunt"],
                    help="Hypothesis settings profile for the lockstep machine (default: ci)")
    group.addoption("--kvstate-time-limit", type=float, default=300.0, metavar="SECONDS",
                    help="per configuration and check (default: 300)")


class ConformanceFailure(Exception):
    """One conformance check failed; the message is the counterexample."""


class ConformanceItem(pytest.Item):
    def __init__(self, *, backend: str, factory, backend_config, check: str, **kwargs):
        super().__init__(**kwargs)
        self.backend, self.factory, self.backend_config, self.check = backend, factory, backend_config, check

    def runtest(self) -> None:
        from kvstate.stateful.conform import CHECKS, run_with_limit
        from kvstate.stateful.configs import PROFILES

        options = self.session.config
        outcome = run_with_limit(CHECKS[self.check], self.factory, self.backend_config,
                                 PROFILES[options.getoption("kvstate_profile")],
                                 options.getoption("kvstate_time_limit"))
        if outcome.status == "n/a":
            pytest.skip(f"n/a: {outcome.detail}")
        if not outcome.passed:
            raise ConformanceFailure(f"{self.backend_config.name} / {self.check}: {outcome.status}\n{outcome.detail}")

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ConformanceFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, self.name


@pytest.hookimpl(tryfirst=True)   # before -k/-m deselection sees the items
def pytest_collection_modifyitems(session, config, items) -> None:
    backends = config.getoption("kvstate_backend")
    if not backends:
        return
    from kvstate.stateful.conform import CHECKS, FactoryError, check_backend, load_factory
    from kvstate.stateful.configs import configs_for

    for backend in backends:
        try:
            factory = load_factory(backend)
            configs = configs_for(factory)
            check_backend(factory, configs, time_limit=config.getoption("kvstate_time_limit"))
        except FactoryError as error:
            raise pytest.UsageError(f"--kvstate-backend {backend}: {type(error).__name__}: {error}") from None
        made = [ConformanceItem.from_parent(session, name=f"kvstate[{_short(backend)}][{cfg.name}][{check}]",
                                            backend=backend, factory=factory, backend_config=cfg, check=check)
                for cfg in configs for check in CHECKS]
        items.extend(made)
        # The terminal counts "collected N items" from collect reports, not from this list: report ours.
        config.hook.pytest_collectreport(report=pytest.CollectReport(
            nodeid=f"kvstate[{_short(backend)}]", outcome="passed", longrepr=None, result=made))


def _short(backend: str) -> str:
    """A readable test id: ``path/to/engine.py:factory`` -> ``engine.py:factory`` (never ``../../..``)."""
    module, colon, attribute = backend.partition(":")
    if module.endswith(".py"):
        module = module.replace("\\", "/").rsplit("/", 1)[-1]
    return module + colon + attribute
