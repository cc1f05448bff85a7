"""pytest plugin: ``pytest --kvstate-backend package.module[:factory]`` runs conformance in your CI.

Registered through the ``pytest11`` entry point, so installing kvstate is enough.
Each (configuration, check) becomes one test item, named
``kvstate[BACKEND][CONFIG][CHECK]``; a failure prints the same counterexample as
``kvstate conform``. Without the option the plugin adds nothing.
"""

from __future__ import annotations

import math
import shlex
import threading

import pytest

MIN_TIME_LIMIT = 0.001      # as ``kvstate conform --time-limit``: 0 or less failed a correct backend as hanging
TIME_LIMIT = 300.0          # seconds per configuration and check, as ``kvstate conform``'s default


def pytest_addoption(parser) -> None:
    group = parser.getgroup("kvstate", "kvstate backend conformance")
    group.addoption("--kvstate-backend", action="append", default=[], metavar="FACTORY",
                    help="run the kvstate conformance suite against this backend factory "
                         "(package.module[:callable] or path/to/file.py[:callable]); repeatable. Give a "
                         "path as --kvstate-backend=PATH, one word: as two, pytest reads the path as a test "
                         "argument and takes its rootdir and ini file from the backend's folder")
    group.addoption("--kvstate-profile", default="ci", choices=["ci", "nightly", "hunt"],
                    help="Hypothesis settings profile for the lockstep machine (default: ci)")
    group.addoption("--kvstate-time-limit", type=float, default=TIME_LIMIT, metavar="SECONDS",
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
        # As ``kvstate conform``: after a check of this configuration timed out (its thread still runs,
        # abandoned), the later ones are skipped, not each waited out, starving the others' checks too.
        hung = options.stash.setdefault(_HUNG, {})
        key = (self.backend, self.backend_config.name)
        if key in hung:
            self._skip(f"not run: {hung[key]!r} hung in this configuration")
        outcome = run_with_limit(CHECKS[self.check], self.factory, self.backend_config,
                                 PROFILES[options.getoption("kvstate_profile")],
                                 options.getoption("kvstate_time_limit"), self.check)
        if outcome.status == "TIMEOUT":
            hung[key] = self.check
        if outcome.status == "n/a":
            self._skip(f"n/a: {outcome.detail}")
        if not outcome.passed:
            raise ConformanceFailure(f"{self.backend_config.name} / {self.check}: {outcome.status}\n{outcome.detail}\n"
                                     f"rerun this item: {self._rerun()}")

    def _skip(self, reason: str) -> None:
        """Skip this item, named in the reason: ``-rs`` locates a plugin's skip at the plugin's line, so it
        printed "pytest_plugin.py:58: n/a: ..." for every item, whichever (a plugin review, s67)."""
        pytest.skip(f"{self.name}: {reason}")

    def _rerun(self) -> str:
        """The command that runs this item alone: pytest takes no ``::kvstate[...]`` id back (the items
        belong to no file), but ``-k`` matches the name, its words joined by ``and`` (an expression
        ends a word at a space: ``[fork isolation]``)."""
        words = " and ".join(self.name.split())
        limit = self.config.getoption("kvstate_time_limit")
        return (f"pytest --kvstate-backend={shlex.quote(self.backend)} -k {shlex.quote(words)}"
                + ("" if self.config.getoption("kvstate_profile") == "ci"
                   else f" --kvstate-profile={self.config.getoption('kvstate_profile')}")
                # a TIMEOUT rerun without it waited the default 300 s (an audit: 301 s for a 5 s failure)
                + ("" if limit == TIME_LIMIT else f" --kvstate-time-limit={limit:g}"))

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ConformanceFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, self.name


_HUNG = pytest.StashKey[dict]()          # (backend, configuration) -> its check that timed out


def pytest_configure(config) -> None:
    """A bad option refused once, in the process the user started (under xdist, refused during collection it
    came out of each worker as an INTERNALERROR that lost its reason). The backends are loaded at collection,
    as before: a project's own modules may be importable only once pytest has put its rootdir on sys.path."""
    if not config.getoption("kvstate_backend") or hasattr(config, "workerinput"):    # none, or an xdist worker
        return
    limit = config.getoption("kvstate_time_limit")
    if not (math.isfinite(limit) and MIN_TIME_LIMIT <= limit <= threading.TIMEOUT_MAX):
        raise pytest.UsageError(f"--kvstate-time-limit must be a finite number of seconds from {MIN_TIME_LIMIT:g} "
                                f"to {threading.TIMEOUT_MAX:g}, got {limit!r}")


class BackendNotLoaded(pytest.Item):
    """Under xdist, a backend a worker cannot load is this one failing item, its reason in the report: the
    usage error raised at collection elsewhere killed the worker, an INTERNALERROR that lost the reason."""

    def __init__(self, *, reason: str, **kwargs):
        super().__init__(**kwargs)
        self.reason = reason

    def runtest(self) -> None:
        raise ConformanceFailure(self.reason)

    def repr_failure(self, excinfo, style=None):
        return self.reason

    def reportinfo(self):
        return self.path, None, self.name


def _loaded(config, backend: str):
    """``backend``'s factory and configurations, loaded and checked as ``kvstate conform`` does (an import
    or factory that hangs, calls sys.exit or raises is a usage error naming it)."""
    from kvstate.stateful.backends import FactoryError, load_backend

    try:
        return load_backend(backend, config.getoption("kvstate_time_limit"))
    except FactoryError as error:
        raise pytest.UsageError(f"--kvstate-backend {backend}: {type(error).__name__}: {error}") from None


@pytest.hookimpl(tryfirst=True)   # before -k/-m deselection sees the items
def pytest_collection_modifyitems(session, config, items) -> None:
    backends = config.getoption("kvstate_backend")
    if not backends:
        return
    from kvstate.stateful.conform import CHECKS

    shorts = [_short(backend) for backend in backends]
    for backend, short in zip(backends, shorts):
        # two files of one name (other1/engine.py, other2/engine.py) had the same ids, and --lf reran both
        label = short if shorts.count(short) == 1 else backend
        try:
            factory, configs = _loaded(config, backend)
        except pytest.UsageError as error:
            if not hasattr(config, "workerinput"):
                raise
            items.append(BackendNotLoaded.from_parent(session, name=f"kvstate[{label}]", reason=str(error)))
            continue
        made = [ConformanceItem.from_parent(session, name=f"kvstate[{label}][{cfg.name}][{check}]",
                                            backend=backend, factory=factory, backend_config=cfg, check=check)
                for cfg in configs for check in CHECKS]
        items.extend(made)
        # The terminal counts "collected N items" from collect reports, not from this list: report ours.
        config.hook.pytest_collectreport(report=pytest.CollectReport(
            nodeid=f"kvstate[{label}]", outcome="passed", longrepr=None, result=made))


def _short(backend: str) -> str:
    """A readable test id: ``path/to/engine.py:factory`` -> ``engine.py:factory`` (never ``../../..``)."""
    module, colon, attribute = backend.partition(":")
    if module.endswith(".py"):
        module = module.replace("\\", "/").rsplit("/", 1)[-1]
    return module + colon + attribute
