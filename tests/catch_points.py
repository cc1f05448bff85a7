"""Where each planted bug is first caught, per check: the measure behind the profiles' budgets.

    python tests/catch_points.py [--examples N] [--seeds N] [--json OUT] [--bug NAME ...] [--check NAME ...]

For every bug of ``stateful/planted.py`` (in the configurations ``test_planted_bugs.py`` runs it
in) and of the bug zoo (``tests/foreign/bugs.py``, in its one configuration), each check of
``conform`` runs alone, without shrinking: a directed check answers caught or not; ``lockstep``
prints the run that first failed (Hypothesis, ``hunt`` at ``--examples``); ``seeded`` the seed
(of ``--seeds``). A bug a random engine catches only late is one a smaller budget would lose.
The last lines count the bugs each engine catches in some configuration. Minutes of CPU
(``--bug`` and ``--check`` narrow it to some bugs and checks).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from hypothesis import settings  # noqa: E402

from kvstate.impl.numpy import factory as numpy_factory  # noqa: E402
from kvstate.stateful.configs import PROFILES, seeded_size  # noqa: E402
from kvstate.stateful.conform import CHECKS, conform  # noqa: E402
from kvstate.stateful.planted import PLANTED  # noqa: E402
from kvstate.stateful.seeded import first_seed, run_seeds  # noqa: E402

import test_bug_zoo as zoo  # noqa: E402
import test_planted_bugs as planted  # noqa: E402
from foreign.bugs import BUGS  # noqa: E402

RANDOM = ("lockstep", "seeded")


def cases():
    """(kind, bug, factory, configurations, checks, planting context manager)."""
    for bug in sorted(set(PLANTED) - planted.EXHAUSTIVE_ONLY):
        checks = ["scale"] if bug in planted.SCALE_BUGS else list(CHECKS)
        yield "planted", bug, numpy_factory, planted._configs(bug), checks, PLANTED[bug]
    for bug in sorted(zoo.ZOO):
        factory = BUGS[bug]
        yield "zoo", bug, factory, [zoo._config(zoo.ZOO[bug].config, factory)], list(CHECKS), contextlib.nullcontext


def first_failing_seed(factory, config, seeds: int, steps: int) -> int | None:
    """The seeded check's own loop, unhurried and unshrunk: which of its seeds first failed (1-based)."""
    base = first_seed(config)
    found = run_seeds(factory, config, seeds, steps, budget_s=float("inf"), shrink_budget_s=0.0, first=base).failure
    return None if found is None else found.seed - base + 1


def catch_points(examples: int, seeds: int, bugs=None, only_checks=None) -> list[dict]:
    hunt = settings(PROFILES["hunt"], max_examples=examples)
    _, steps = seeded_size(PROFILES["ci"])
    rows = []
    for kind, bug, factory, configs, checks, plant in cases():
        if bugs and bug not in bugs:
            continue
        checks = [name for name in checks if not only_checks or name in only_checks]
        caught = {}
        with plant():
            for config in configs:
                found = {}
                for name in checks:
                    if name == "seeded":
                        found[name] = first_failing_seed(factory, config, seeds, steps)
                        continue
                    (result,) = conform(factory, settings=hunt, configs=[config], checks=[name])
                    outcome = result.outcomes[name]
                    found[name] = (outcome.runs or 1) if outcome.status in ("FAIL", "TIMEOUT") else None
                caught[config.name] = {name: at for name, at in found.items() if at}
        rows.append({"kind": kind, "bug": bug, "caught": caught})
        print(kind, bug, {c: at for c, at in caught.items()}, flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=PROFILES["hunt"].max_examples)
    parser.add_argument("--seeds", type=int, default=seeded_size(PROFILES["ci"])[0])
    parser.add_argument("--json")
    parser.add_argument("--bug", action="append", help="only this bug (planted or zoo); repeatable")
    parser.add_argument("--check", action="append", choices=CHECKS, help="only this check; repeatable")
    args = parser.parse_args(argv)
    known = {bug for _, bug, *_ in cases()}
    unknown = sorted(set(args.bug or ()) - known)
    if unknown:
        parser.error(f"no planted bug {', '.join(map(repr, unknown))}; known: {', '.join(sorted(known))}")
    rows = catch_points(args.examples, args.seeds, args.bug, args.check)
    for engine in RANDOM:
        bugs = [r for r in rows if any(engine in found for found in r["caught"].values())]
        pairs = sum(engine in found for r in rows for found in r["caught"].values())
        print(f"{engine}: catches {len(bugs)} of {len(rows)} bugs, in {pairs} bug-configuration pairs")
    missed = [r["bug"] for r in rows if not any(r["caught"].values())]
    print(f"caught by some check: {len(rows) - len(missed)} of {len(rows)}" + (f"; missed: {missed}" if missed else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
