"""Hostile inputs to ``kvstate sweep`` (issue 24): journal lines for ``--resume``, and the command's options.

Two targets, in the style of ``hostile_inputs.py`` (its ``Tally`` counts what was tried,
each ``Finding`` is a bug):

- ``check_journal``: a valid ``runs.jsonl`` with one line damaged, mistyped or replaced
  (wrong shapes, hostile JSON values, numbers past Python's int-parsing limit, bytes that
  are not UTF-8, runs outside the plan, backends that name a module). ``journal.read``
  either refuses it with ``ResumeError`` naming the file (and the line, for a line's
  fault), or accepts only runs the plan holds, and then ``kvstate sweep --resume`` on it
  finishes (exit 0 or 1) or refuses in one named line; a module the plan names as its
  backend is never imported without ``--trust-backend``.
- ``check_arguments``: ``kvstate sweep`` with hostile option values (steps, seeds, seed
  ranges, shards, configurations, workers, time limits, scheduler strings, folders).
  The command either refuses in one line with exit 2 -- its own words, not the catch-all
  that prints a Python exception's class -- or hands the sweep values it can run: the
  sweep itself is replaced by a recorder, so a huge accepted value costs nothing here.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import sys
import tempfile
from pathlib import Path

from hypothesis import strategies as st

from kvstate.fuzz.hostile_inputs import Finding, Tally, examples_argument, json_values, run_and_report

CONFIG = "f32-heap"
SEEDS = (0, 1)
STEPS = 3
UNIMPORTED = ("colorsys", "wave", "sndhdr", "xdrlib", "mailcap")     # stdlib modules nothing here imports

# A builtin exception's name first on the line: the CLI's catch-all, not a refusal it wrote.
_CATCH_ALL = re.compile(r"^kvstate sweep: (?:[A-Z]\w*Error|Exception|RecursionError|StopIteration)\b")


def _finding(tally: Tally, message: str, cause: BaseException | None = None):
    tally.findings.append(message)
    raise Finding(message) from cause


# -- journals ------------------------------------------------------------------------------------

class Raw(str):
    """JSON text put into a line as it is (numbers ``json.dumps`` cannot write: 5,000 digits, 1e400)."""


def _base_lines() -> list[dict]:
    from kvstate.stateful import ops as O
    from kvstate.stateful.sweeps import journal as J
    from kvstate.stateful.sweeps.fingerprint import fingerprint

    plan = {"kind": "plan", "format": J.FORMAT, "backend": "kvstate.impl.numpy", "steps": STEPS,
            "seeds": list(SEEDS), "configs": [CONFIG], "shard": None, "fingerprint": _fingerprint(fingerprint)}
    failure = {"step": 2, "phase": "op", "op": "Extend", "error": "InvariantViolation", "invariant": 4,
               "message": "planted"}
    ops = [O.Allocate().to_json(), O.Extend("c1", (1, 2), 1).to_json()]

    def run(seed, kind="run", **change):
        return {"kind": kind, "config": CONFIG, "seed": seed, "page_tokens": 4, "steps": STEPS, "seconds": 0.1,
                "cpu_seconds": 0.1, "failure": None, "ops": None, "replay_file": None, "minimised": False, **change}
    return [plan, run(0), run(1, failure=failure, ops=ops), run(1, "shrunk", failure=failure, ops=ops[:1],
                                                                minimised=True)]


_FINGERPRINT: dict = {}


def _fingerprint(fingerprint) -> dict:
    if not _FINGERPRINT:
        _FINGERPRINT.update(fingerprint("kvstate.impl.numpy"))
    return dict(_FINGERPRINT)


def _dump(entry) -> bytes:
    """One journal line; ``Raw`` values are spliced in as written."""
    raws: list[str] = []

    def mark(value):
        if isinstance(value, Raw):
            raws.append(str(value))
            return f"\x00raw{len(raws) - 1}\x00"
        if isinstance(value, dict):
            return {key: mark(item) for key, item in value.items()}
        if isinstance(value, list):
            return [mark(item) for item in value]
        return value
    text = json.dumps(mark(entry))
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\x00raw{i}\x00"), raw)
    return text.encode("utf-8") + b"\n"


HOSTILE_NUMBERS = [Raw("1" * 5000), Raw("-" + "9" * 4301), Raw("1e400"), Raw("-1e400"), Raw("NaN"), Raw("Infinity"),
                   2**63, -(2**63) - 1, -1, 0, 2**31, 1.5, -0.0, True, False]

HOSTILE_LINES = [b"\xff\xfe{}", b"{", b"[]", b'"run"', b"1", b"null", b"{}", b"\x00", b" ", b"[" * 5000 + b"]" * 5000,
                 b'{"kind": "run"}', b'{"kind": "plan"}', b'{"kind": "shrunk", "seed": 0}', b'{"kind": ["run"]}',
                 b'{"kind": "run", "kind": "plan"}', "{\"kind\": \"run\", \"config\": \"\u00e9\"}".encode("latin-1")]

HOSTILE_BACKENDS = ["", ":", "kvstate.impl.numpy:", "kvstate.impl.numpy:factory:x", "kvstate.impl", "../evil",
                    "kvstate.impl.numpy\n", "os:system", *[f"{name}:factory" for name in UNIMPORTED], *UNIMPORTED]


def hostile_values() -> st.SearchStrategy:
    return st.one_of(json_values(), st.sampled_from(HOSTILE_NUMBERS),
                     st.lists(st.sampled_from(HOSTILE_NUMBERS), max_size=3),
                     st.lists(json_values(), max_size=3).map(lambda ops: [{"op": "Extend"}, *ops]))


def journal_documents() -> st.SearchStrategy:
    """(kind, bytes): the base journal with one change."""
    def replace_field(args):
        line, key, value, in_failure = args
        lines = _base_lines()
        target = lines[line % len(lines)]
        if in_failure and isinstance(target.get("failure"), dict):
            target = target["failure"]
        keys = sorted(target)
        target[keys[key % len(keys)]] = value
        return ("a field replaced", lines, None)

    def drop_or_add(args):
        line, key, add = args
        lines = _base_lines()
        target = lines[line % len(lines)]
        keys = sorted(target)
        if add:
            target["extra"] = 1
        else:
            del target[keys[key % len(keys)]]
        return ("a field added" if add else "a field dropped", lines, None)

    def raw_line(args):
        line, raw = args
        return ("a line of hostile bytes", _base_lines(), (line % 5, raw))

    def outside(args):
        config, seed = args
        lines = _base_lines()
        lines.append({**lines[1], "config": config, "seed": seed})
        return ("a run outside the plan", lines, None)

    def backend(name):
        lines = _base_lines()
        lines[0]["backend"] = name
        return ("a plan naming a backend", lines, None)

    def encode(case):
        kind, lines, raw = case
        body = [_dump(entry) for entry in lines]
        if raw is not None:
            index, data = raw
            body.insert(index, data + b"\n")
        return kind, b"".join(body)

    return st.one_of(
        st.tuples(st.integers(0, 3), st.integers(0, 20), hostile_values(), st.booleans()).map(replace_field),
        st.tuples(st.integers(0, 3), st.integers(0, 20), st.booleans()).map(drop_or_add),
        st.tuples(st.integers(0, 4), st.sampled_from(HOSTILE_LINES)).map(raw_line),
        st.tuples(st.sampled_from([CONFIG, "f16-heap", "", "nope"]),
                  st.sampled_from([0, 1, 2, -1, 2**40, 10**30])).map(outside),
        st.sampled_from(HOSTILE_BACKENDS).map(backend),
    ).map(encode)


def check_journal(tally: Tally, document, folder: str, run_cli: bool = True) -> None:
    """``journal.read`` and then ``kvstate sweep --resume`` on ``document``; see the module docstring."""
    from kvstate.spec.errors import ResumeError
    from kvstate.stateful.sweeps import journal as J

    kind, data = document
    tally.tried[("journal.read", kind)] += 1
    out = Path(folder) / "out"
    out.mkdir(exist_ok=True)
    path = out / J.FILE
    path.write_bytes(data)
    try:
        recorded = J.read(out)
    except ResumeError as error:
        tally.refused["ResumeError"] += 1
        if str(path) not in str(error):
            _finding(tally, f"journal.read on {kind} refused without naming the file: {error}")
        recorded = None
    except Exception as error:      # noqa: BLE001 -- an unnamed exception is the finding
        _finding(tally, f"journal.read on {kind} raised unnamed {type(error).__name__}: {str(error)[:200]}", error)
    if recorded is not None:
        plan = recorded.plan
        for config, seed in [*recorded.runs, *recorded.shrunk]:
            if config not in plan.configs or seed not in plan.seeds:
                _finding(tally, f"journal.read on {kind} accepted a run ({config!r}, {seed!r}) outside the plan")
    complete = recorded is not None and all((config, seed) in recorded.runs
                                            for config in recorded.plan.configs for seed in recorded.plan.seeds)
    if run_cli and (recorded is None or complete):      # nothing left to run: the resume costs no sweep
        _resume(tally, kind, out)


def _resume(tally: Tally, kind: str, out: Path) -> None:
    from kvstate.cli import main as cli_main

    tally.tried[("kvstate sweep --resume", kind)] += 1
    absent = [name for name in UNIMPORTED if name not in sys.modules]
    status, lines, err = _cli(tally, ["sweep", "--resume", str(out), "--shrink-limit", "0"], cli_main)
    imported = [name for name in absent if name in sys.modules]
    if imported:
        _finding(tally, f"kvstate sweep --resume on {kind} imported {imported} without --trust-backend")
    if status == 2:
        tally.refused["exit 2"] += 1
        if len(lines) != 1 or _CATCH_ALL.match(lines[0]) or "Traceback" in err:
            _finding(tally, f"kvstate sweep --resume on {kind} refused without a named line: {err[-400:]}")
    elif status not in (0, 1):
        _finding(tally, f"kvstate sweep --resume on {kind} exited {status}: {err[-300:]}")


def _cli(tally: Tally, argv: list[str], cli_main) -> tuple[int, list[str], str]:
    """Exit status, the non-progress lines on stderr, and stderr, of ``kvstate argv`` run here."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = cli_main(argv)
    except SystemExit as error:      # argparse's refusal: usage and one error line, exit 2
        status = error.code if isinstance(error.code, int) else 2
        text = err.getvalue()
        if status != 2 or not text.rstrip().splitlines()[-1:] or ": error: " not in text.rstrip().splitlines()[-1]:
            _finding(tally, f"kvstate {' '.join(argv)} exited through SystemExit({error.code!r}): {text[-300:]}")
        return 2, [text.rstrip().splitlines()[-1]], text
    except Finding:
        raise
    except BaseException as error:      # noqa: BLE001 -- main returns its status; anything else escaped it
        _finding(tally, f"kvstate {' '.join(argv)} raised {type(error).__name__}: {str(error)[:200]}", error)
    text = err.getvalue()
    lines = [line for line in text.splitlines()
             if line.strip() and not line.startswith(("sweep: ", "[", "  "))]     # the banner and progress
    return status, lines, text


# -- the command's options ---------------------------------------------------------------------

NUMBERS = ["0", "1", "2", "-1", "", " ", "1.5", "1e3", "nan", "NaN", "inf", "-inf", "1e309", "1e-400", "0x10",
           "99999999999999999999", "9" * 5000, "1_000", "\u0663", "\x00", "abc", "--", "auto"]
OPTIONS = {
    "--steps": NUMBERS, "--seeds": NUMBERS, "--workers": NUMBERS, "--shrink-limit": NUMBERS,
    "--shrink-budget": NUMBERS, "--time-limit": NUMBERS, "--run-timeout": NUMBERS,
    "--seed-range": ["0:2", "2:0", "1:1", ":", "0:", "-1:2", "0:99999999999999999999", "a:b", "0:2:4", "\u0663:\u0665"],
    "--shard": ["1/2", "0/2", "3/2", "1/0", "0/0", "/", "1/", "-1/2", "1/99999999999999999999", "\u0661/\u0662"],
    "--configs": [CONFIG, "", ",", f"{CONFIG},{CONFIG}", "nope", f"{CONFIG},", "F32-HEAP", " f32-heap"],
    "--backend": ["kvstate.impl.numpy", "kvstate.impl.numpy:nope", "no.such.module", "", ":",
                  "kvstate.impl.numpy:factory:x"],
    "--scheduler": ["nonsense", "", "tcp://", "tcp://[::1", "inproc://x", "tcp://host:notaport"],
    "--out": ["<file>", "<folder>", "", "/dev/null", "<folder>/\x00"],
}


def sweep_arguments() -> st.SearchStrategy:
    """(kinds, argv) for ``kvstate sweep``: a few options, each with a hostile or valid value."""
    option = st.sampled_from(sorted(OPTIONS)).flatmap(
        lambda name: st.sampled_from(OPTIONS[name]).map(lambda value: (name, value)))
    return st.tuples(st.sampled_from(["--seeds", "--seed-range", "--resume", None]),
                     st.lists(option, max_size=4, unique_by=lambda pair: pair[0]),
                     st.booleans())


class _Accepted(BaseException):     # past the CLI's catch-all, which takes Exception
    """The command got as far as running the sweep (or connecting to a scheduler) with these values."""

    def __init__(self, values: dict):
        super().__init__("accepted")
        self.values = values


def check_arguments(tally: Tally, drawn, folder: str) -> None:
    """``kvstate sweep ARGS`` with the sweep and the scheduler connection recorded instead of run."""
    from kvstate.cli import main as cli_main
    from kvstate.stateful.sweeps import cluster
    from kvstate.stateful.sweeps import sweep as S

    which, options, trust = drawn
    argv, kinds = ["sweep"], []
    resume_dir = Path(folder) / "resume"
    if which == "--resume":
        _write_resume(resume_dir)
        argv += ["--resume", str(resume_dir)]
    elif which == "--seeds":
        argv += ["--seeds", "2"]
    elif which == "--seed-range":
        argv += ["--seed-range", "0:2"]
    if not any(name == "--configs" for name, _ in options) and which != "--resume":
        argv += ["--configs", CONFIG]
    if not any(name == "--steps" for name, _ in options) and which != "--resume":
        argv += ["--steps", "2"]
    for name, value in options:
        value = value.replace("<file>", str(Path(folder) / "a-file")).replace("<folder>", str(Path(folder) / "o"))
        argv.append(f"{name}={value}")
        kinds.append(f"{name} {value[:12]!r}")
    if trust:
        argv.append("--trust-backend")
    (Path(folder) / "a-file").write_text("x")
    kind = f"{which or 'no seeds'}: " + ", ".join(kinds or ["valid"])
    tally.tried[("kvstate sweep", ", ".join(name for name, _ in options) or "valid")] += 1

    def record_sweep(seeds, steps, configs, backend, workers, out_dir, shrink_limit, shrink_budget_s, **rest):
        raise _Accepted({"seeds": seeds, "steps": steps, "configs": configs, "workers": workers,
                         "shrink_limit": shrink_limit, "shrink_budget": shrink_budget_s, **rest})

    @contextlib.contextmanager
    def record_connect(address, backend, *args, **kwargs):
        raise _Accepted({"connect": address})
        yield     # pragma: no cover

    saved = S.sweep, cluster.connect
    S.sweep, cluster.connect = record_sweep, record_connect
    environ = os.environ.pop("KVSTATE_SCHEDULER", None)
    try:
        status, lines, err = _cli(tally, argv, cli_main)
    except Finding as finding:
        accepted = finding.__cause__
        if not isinstance(accepted, _Accepted):
            raise
        tally.findings.pop()
        _check_accepted(tally, kind, accepted.values)
        tally.refused["accepted"] += 1
        return
    finally:
        S.sweep, cluster.connect = saved
        if environ is not None:
            os.environ["KVSTATE_SCHEDULER"] = environ
    if status != 2:
        _finding(tally, f"kvstate {' '.join(argv)[:300]} exited {status}: {err[-300:]}")
    tally.refused["exit 2"] += 1
    if len(lines) != 1 or _CATCH_ALL.match(lines[0]) or "Traceback" in err:
        _finding(tally, f"kvstate sweep with {kind} refused without a named line: {err[-400:]}")


def _check_accepted(tally: Tally, kind: str, values: dict) -> None:
    """What the sweep would be handed: every value one it can run."""
    if "connect" in values:
        if not isinstance(values["connect"], str) or not values["connect"]:
            _finding(tally, f"kvstate sweep with {kind} connected to scheduler {values['connect']!r}")
        return
    problems = []
    seeds = values["seeds"]
    if not len(seeds) or not all(isinstance(s, int) and s >= 0 for s in seeds[:3]):
        problems.append(f"seeds {seeds!r}")
    if not isinstance(values["steps"], int) or values["steps"] < 1:
        problems.append(f"steps {values['steps']!r}")
    if not values["configs"]:
        problems.append("no configurations")
    if not isinstance(values["workers"], int) or values["workers"] < 1:
        problems.append(f"workers {values['workers']!r}")
    budget = values["shrink_budget"]
    if not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget < 0:
        problems.append(f"shrink budget {budget!r}")
    timeout = values.get("run_timeout")
    if timeout is not None and (not math.isfinite(timeout) or timeout <= 0):
        problems.append(f"run timeout {timeout!r}")
    if problems:
        _finding(tally, f"kvstate sweep with {kind} ran a sweep with " + ", ".join(problems))


def check_scheduler(tally: Tally, address: str, folder: str, limit_s: float = 120.0) -> None:
    """``kvstate sweep --scheduler ADDRESS`` for real, in its own process (what a user sees, exit
    included): one named line and exit 2 within ``limit_s``. Opt-in: a refused address may take the
    connection timeout, so this is not in ``check_arguments``."""
    import subprocess

    tally.tried[("kvstate sweep --scheduler", address[:20] or "empty")] += 1
    argv = [sys.executable, "-m", "kvstate", "sweep", "--seeds", "1", "--steps", "1", "--configs", CONFIG,
            "--scheduler", address, "--out", str(Path(folder) / "o")]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=limit_s,
                              env={**os.environ, "KVSTATE_SCHEDULER": ""})
    except subprocess.TimeoutExpired:
        _finding(tally, f"kvstate sweep --scheduler {address!r} was still running after {limit_s:g} s")
    lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith(("sweep: ", "["))]
    if address and (done.returncode != 2 or len(lines) != 1 or "Traceback" in done.stderr
                    or _CATCH_ALL.match(lines[0])):
        _finding(tally, f"kvstate sweep --scheduler {address!r} exited {done.returncode} with "
                        f"{len(lines)} lines: {done.stderr[-400:]}")
    tally.refused[f"exit {done.returncode}"] += 1


def _write_resume(out: Path) -> None:
    """A journal whose every planned run is recorded (so resuming it runs nothing)."""
    out.mkdir(parents=True, exist_ok=True)
    lines = _base_lines()
    (out / "runs.jsonl").write_bytes(b"".join(_dump(entry) for entry in lines[:3]))


def main(argv: list[str] | None = None) -> int:
    """``python -m kvstate.fuzz.hostile_sweep [EXAMPLES] [--schedulers]``: a longer run, printing what was
    tried; ``--schedulers`` also connects to each hostile scheduler address for real (minutes)."""
    from kvstate.stateful.conform import use_cache_folder_for_hypothesis

    use_cache_folder_for_hypothesis()       # Hypothesis's files in the user's cache, never the working folder

    from hypothesis import HealthCheck, given, settings

    examples = examples_argument("hostile_sweep", argv, 300, flags=("--schedulers",))
    if examples is None:
        return 2
    tally = Tally()
    options = settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))

    @options
    @given(journal_documents())
    def run_journals(document):
        with tempfile.TemporaryDirectory() as folder:
            check_journal(tally, document, folder)

    @options
    @given(sweep_arguments())
    def run_arguments(drawn):
        with tempfile.TemporaryDirectory() as folder:
            check_arguments(tally, drawn, folder)

    @settings(max_examples=len(OPTIONS["--scheduler"]), deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(OPTIONS["--scheduler"]))
    def run_schedulers(address):
        with tempfile.TemporaryDirectory() as folder:
            check_scheduler(tally, address, folder)

    runs = (run_journals, run_arguments) + ((run_schedulers,) if "--schedulers" in (sys.argv[1:] if argv is None else argv) else ())
    return run_and_report(tally, runs)

if __name__ == "__main__":
    sys.exit(main())
