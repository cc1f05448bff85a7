"""A backend's own failures during a sweep are findings, found the same way at any worker count.

Found by an audit: a backend calling ``sys.exit`` ended the sweep with status 0 and no report; a
backend raising outside a step aborted ``--workers 1`` where a pool recorded a crash; a crash's
replay file was drawn at a page size the backend never ran; a name declared at two page sizes was
swept at one of them and counted twice; a shrinking try that hung held the sweep past its budget;
the pasteable test of a backend given by path did not compile.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import threading
import time

import pytest

from kvstate.cli import main
from kvstate.stateful import ops as O
from kvstate.stateful.configs import config_named
from kvstate.stateful.replay import Replay, as_pytest, execute
from kvstate.stateful.shrink import Shrinker
from kvstate.stateful.sweeps.redraw import crashed

PLANTED = '''
import os, sys, threading, time
from kvstate.impl.context import Context
from kvstate.impl.numpy import factory as _engine
from kvstate.stateful.configs import configs_named


class Copyless(Context):
    __slots__ = ()

    def writable(self, index):          # the missing copy-on-write
        return self._pages[index]

    def overwrite(self, start, tokens, kv):
        while SPIN and len(self) >= 3:  # a walk that never ends, on a sequence only a shrinker makes
            time.sleep(0.01)
        return super().overwrite(start, tokens, kv)


class Exits(Context):
    __slots__ = ()

    def extend(self, tokens, kv):       # a helper of the backend's that ends the process
        sys.exit(0)


class Raises(Context):
    __slots__ = ()

    def extend(self, tokens, kv):       # a CUDA-style message: a colour code, a NUL, a form feed
        raise RuntimeError("\\x1b[31mCUDA error\\x00\\x0c")


class Dies(Context):
    __slots__ = ()

    def extend(self, tokens, kv):       # a crash in C code, as far as the sweep can tell
        os._exit(3)


class StuckInC(Context):
    __slots__ = ()

    def extend(self, tokens, kv):       # blocked in C, where no deadline reaches
        time.sleep(3600)


class Deadlocks(Context):
    __slots__ = ()

    def extend(self, tokens, kv):       # a lock taken twice: blocked in C for good
        lock = threading.Lock()
        lock.acquire()
        lock.acquire()


class ExitsOnRead(Context):
    __slots__ = ()

    def read(self, *args, **kwargs):    # a read that ends the process
        sys.exit(0)


SPIN = {spin}


def _terminate_sweep(journal, runs):
    # SIGTERM to the sweep (a CI job's timeout) once its journal holds ``runs`` runs: from a pool
    # process, to the sweep that made it; then wait to be stopped with it.
    import multiprocessing
    sweep = multiprocessing.parent_process()
    while open(journal).read().count('"kind": "run"') < runs:
        time.sleep(0.01)
    os.kill(sweep.pid if sweep else os.getpid(), 15)
    time.sleep(60)


def factory(config):
    cache = _engine(config)
    if {when}:
        {act}
    return cache


def _planted(cache, context_class=Copyless):
    engine = type(cache)

    def new_context(self, *args, **kwargs):
        ctx = engine._new_context(self, *args, **kwargs)
        ctx.__class__ = context_class
        return ctx
    cache.__class__ = type("Planted", (engine,), {{"_new_context": new_context}})


_f32, _f16 = configs_named(["f32-heap", "f16-heap"])
factory.configs = {configs}
'''


def _backend(tmp_path, when="False", act="pass", spin=False, configs="[_f32]", name="planted_backend") -> str:
    path = tmp_path / f"{name}.py"         # a module is loaded once per path: another backend, another name
    path.write_text(PLANTED.format(when=when, act=act, spin=spin, configs=configs))
    return str(path)


def _sweep(tmp_path, backend, *extra) -> tuple[int, dict]:
    out = tmp_path / "out"
    status = main(["sweep", "--seeds", "3", "--steps", "40", "--backend", backend, "--out", str(out), *extra])
    return status, json.loads((out / "report.json").read_text())


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_backend_that_calls_sys_exit_is_a_finding_with_a_report(tmp_path, workers):
    backend = _backend(tmp_path, when="True", act="_planted(cache, Exits)")
    status, report = _sweep(tmp_path, backend, "--workers", workers, "--shrink-limit", "0")
    assert status == 1 and report["runs"] == 3 and len(report["failures"]) == 3
    assert {f["failure"]["error"] for f in report["failures"]} == {"SystemExit"}


def test_a_backend_raising_outside_a_step_is_a_crash_at_any_worker_count(tmp_path):
    backend = _backend(tmp_path, when="config.precision == 'f16'", act="raise RuntimeError('cannot build')",
                       configs="[_f32, _f16]")
    status, report = _sweep(tmp_path, backend, "--workers", "1", "--shrink-limit", "0")
    assert status == 1 and report["runs"] == 6 and len(report["failures"]) == 3      # f16's three, as crashes
    assert {(f["config"], f["failure"]["error"]) for f in report["failures"]} == {("f16-heap", "RuntimeError")}


def test_a_crash_is_replayed_at_the_page_size_the_backend_runs_at(tmp_path):
    backend = _backend(tmp_path, configs="[_f32.with_(page_tokens=4)]")
    result = crashed(backend, config_named("f32-heap").with_(page_tokens=4), 5, 20, RuntimeError("worker died"))
    assert result.page_tokens == 4 and len(result.ops) == 20


def test_a_name_declared_at_two_page_sizes_is_swept_at_both_and_counted_once(tmp_path):
    backend = _backend(tmp_path, when="config.page_tokens == 4", act="_planted(cache)",
                       configs="[_f32.with_(page_tokens=4), _f32.with_(page_tokens=8)]")
    status, report = _sweep(tmp_path, backend, "--workers", "1", "--shrink-limit", "0")
    assert status == 1                                   # the bug lives at page size 4 only
    assert report["runs"] == report["runs_expected"] == 6
    assert sorted(report["configs"]) == ["f32-heap-page4", "f32-heap-page8"]
    assert {(f["config"], f["page_tokens"]) for f in report["failures"]} == {("f32-heap-page4", 4)}


def test_a_shrinking_try_that_hangs_ends_with_the_budget(tmp_path):
    from kvstate.stateful.backends import load_factory
    factory = load_factory(_backend(tmp_path, when="True", act="_planted(cache)", spin=True))
    config = config_named("f32-heap").with_(page_tokens=4)
    ops = [O.Allocate(), O.Extend("c1", (1, 2, 3), 1), O.Truncate("c1", 2), O.Fork("c1"),
           O.Overwrite("c1", 0, (9,), 2)]
    failure, _ = execute(factory, config, ops)
    assert failure is not None                        # the missing copy shows in the fork
    shrinking = threading.Thread(target=Shrinker(factory, config, failure, budget_s=1.0).shrink, args=(ops,),
                                 daemon=True)      # it tries the sequence without the truncate, which spins
    shrinking.start()
    shrinking.join(10)
    assert not shrinking.is_alive(), "a shrinking try outlived the 1 s budget by 9 s"


def test_the_pasteable_test_of_a_backend_given_by_path_compiles():
    replay = Replay("backends/cow and spin.py", config_named("f32-heap"), 3, [O.Allocate()], None)
    source = as_pytest(replay)
    ast.parse(source)
    assert "load_factory('backends/cow and spin.py')" in source


@pytest.mark.parametrize("act", ["sys.exit(0)", "raise RuntimeError('cannot build')"])
def test_the_replay_of_a_factory_that_fails_to_build_fails_too(tmp_path, act, capsys):
    """A factory that exits (status 0) or raises while building the cache: the sweep records a crash,
    and its replay reports it and exits 1. Its ``SystemExit`` escaped the replay as the exit status 0."""
    backend = _backend(tmp_path, when="config.precision == 'f16'", act=act, configs="[_f32, _f16]")
    status, report = _sweep(tmp_path, backend, "--workers", "1", "--shrink-limit", "0")
    assert status == 1 and {f["config"] for f in report["failures"]} == {"f16-heap"}
    replay_file = report["failures"][0]["replay_file"]
    capsys.readouterr()
    assert main(["replay", replay_file, "--backend", backend]) == 1
    assert "FAILED " in capsys.readouterr().out


def test_the_replay_of_a_backend_that_exits_while_read_fails(tmp_path, capsys):
    """Describing the contexts after a failure reads them: a read that calls sys.exit is shown, not obeyed."""
    backend = _backend(tmp_path, when="True", act="_planted(cache, ExitsOnRead)")
    status, report = _sweep(tmp_path, backend, "--workers", "1", "--shrink-limit", "0")
    assert status == 1
    capsys.readouterr()
    assert main(["replay", report["failures"][0]["replay_file"], "--backend", backend]) == 1
    shown = capsys.readouterr().out
    assert "FAILED SystemExit" in shown and "engine read raised SystemExit" in shown


# -- the folder a sweep writes to (an audit's findings) ---------------------------------------

def test_a_sigterm_stops_a_sweep_as_ctrl_c_does_and_no_earlier_report_survives(tmp_path):
    """A CI job's timeout sends SIGTERM: the sweep writes its partial report (exit 143). Killed
    outright, it left the last sweep's green report.json and junit.xml in its folder."""
    status, report = _sweep(tmp_path, _backend(tmp_path), "--workers", "1")      # a passing sweep first
    assert status == 0 and report["failures"] == []
    backend = _backend(tmp_path, when="config.precision == 'f16'",
                       act=f"_terminate_sweep({str(tmp_path / 'out' / 'runs.jsonl')!r}, 3)", configs="[_f32, _f16]",
                       name="terminated_backend")
    status, report = _sweep(tmp_path, backend, "--workers", "1", "--shrink-limit", "0")
    assert status == 143
    assert report["partial"] and report["runs"] == 3 and report["backend"] == backend
    assert 'tests="3"' in (tmp_path / "out" / "junit.xml").read_text()


class SigtermReachedTheTest(Exception):
    """What a SIGTERM raises where the sweep's own handler was not installed (the default ended pytest)."""


@pytest.fixture
def sigterm_caught():
    def caught(signum, frame):
        raise SigtermReachedTheTest()
    previous = signal.signal(signal.SIGTERM, caught)
    yield
    signal.signal(signal.SIGTERM, previous)


def _terminated_here() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)       # the handler raises first


@pytest.mark.parametrize("when", ["while the backend loads", "while the summary prints"])
def test_a_sigterm_outside_the_runs_exits_143_too(tmp_path, monkeypatch, capsys, sigterm_caught, when):
    """Only the runs were guarded: a SIGTERM while the summary printed (or the backend loaded) met the
    default handler and ended the command by the signal, not with 143."""
    from kvstate.stateful.sweeps import sweep as S
    backend = "kvstate.impl.numpy"
    if when == "while the backend loads":
        backend = _backend(tmp_path, name="terminated_at_import")
        with open(backend, "a") as module:      # imported in a thread the command waits on
            module.write("\nos.kill(os.getpid(), 15)\ntime.sleep(2)\n")
    else:
        summary = S.format_summary

        def terminated_while_printing(report):
            _terminated_here()
            return summary(report)
        monkeypatch.setattr(S, "format_summary", terminated_while_printing)
    out = tmp_path / "out"
    status = main(["sweep", "--seeds", "1", "--steps", "5", "--in-process", "--backend", backend,
                   "--configs", "f32-heap", "--out", str(out)])
    assert status == 143, capsys.readouterr().err
    if when == "while the summary prints":
        report = json.loads((out / "report.json").read_text())
        assert not report["partial"] and report["runs"] == report["runs_expected"] == 1
        assert "its reports are complete" in capsys.readouterr().err
    else:
        assert "before the sweep began; nothing was run" in capsys.readouterr().err


def test_only_the_first_sigterm_raises_while_a_sweep_stops(sigterm_caught):
    """A second SIGTERM raised again inside the handlers that write the partial report and print the last
    line, cutting them short and ending the command by an uncaught interrupt."""
    from kvstate.stateful.sweeps import sweep as S
    with S.terminated_as_interrupt():
        with pytest.raises(S.Terminated):
            _terminated_here()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)        # stopping already: nothing is raised
        except S.Terminated:        # a KeyboardInterrupt: let through, it stopped the whole test session
            pytest.fail("the second SIGTERM raised Terminated again")


HOLDER = """
import sys
from pathlib import Path
from kvstate.stateful.sweeps import sweep as S
with S._only_sweep_in(Path(sys.argv[1])):
    print("held", flush=True)
    sys.stdin.read()
"""


def test_a_sweep_refused_in_a_busy_folder_changes_nothing_there(tmp_path, capsys):
    """Two sweeps on one folder interleaved their journal lines: the second is refused at once."""
    import subprocess
    import sys
    backend = _backend(tmp_path)
    status, _ = _sweep(tmp_path, backend, "--workers", "1")
    out = tmp_path / "out"
    before = {path.name: path.read_bytes() for path in out.iterdir() if path.is_file()}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)      # another sweep, in another process
    try:
        assert holder.stdout.readline().strip() == "held"
        capsys.readouterr()
        assert main(["sweep", "--resume", str(out), "--backend", backend]) == 2
        assert main(["sweep", "--seeds", "2", "--backend", backend, "--out", str(out)]) == 2
        assert capsys.readouterr().err.count("another sweep is running in") == 2
    finally:
        holder.communicate("", timeout=30)
    assert {path.name: path.read_bytes() for path in out.iterdir() if path.is_file()} == before
    assert main(["sweep", "--resume", str(out), "--backend", backend]) == 0      # let go with its process


def test_a_forked_worker_does_not_hold_the_folder_after_its_sweep(tmp_path):
    """A pool's workers are forked while the sweep holds its folder, and outlive a sweep killed with
    SIGKILL: an ``flock`` they inherited kept the folder locked, and every ``--resume`` was refused."""
    import os
    import subprocess
    import sys

    from kvstate.stateful.sweeps import sweep as S
    read_end, write_end = os.pipe()
    with S._only_sweep_in(tmp_path):
        worker = os.fork()
        if worker == 0:                      # the orphan-to-be: it holds every descriptor it inherited
            os.close(write_end)
            os.read(read_end, 1)
            os._exit(0)
    os.close(read_end)
    try:                                     # the sweep is gone, its worker is not: another sweep may start
        other = subprocess.run([sys.executable, "-c", HOLDER, str(tmp_path)], input="", capture_output=True,
                               text=True, timeout=60)
        assert other.returncode == 0 and other.stdout.strip() == "held", other.stderr
    finally:
        os.close(write_end)
        os.waitpid(worker, 0)


def test_a_journal_cannot_name_a_file_outside_its_folder(tmp_path):
    """A journal is data: a configuration label holding a path made a new sweep there delete
    ``replays/{label}-seed{seed}.json`` wherever that led."""
    from kvstate.spec.errors import ResumeError
    from kvstate.stateful.sweeps import journal
    out, victim = tmp_path / "out", tmp_path / "victim"
    victim.mkdir()
    (victim / "keep-seed0.json").write_text("precious")
    plan = {"kind": "plan", "format": journal.FORMAT, "backend": "kvstate.impl.numpy", "steps": 5, "seeds": [0],
            "configs": ["../../victim/keep"], "shard": None, "fingerprint": {}, "workers": 1}
    run = {"kind": "run", "config": "../../victim/keep", "seed": 0, "page_tokens": 4, "steps": 5, "seconds": 0.1,
           "cpu_seconds": 0.1, "failure": None, "ops": None, "replay_file": None, "minimised": False}
    out.mkdir()
    (out / journal.FILE).write_text(json.dumps(plan) + "\n" + json.dumps(run) + "\n")
    with pytest.raises(ResumeError, match="no configuration label"):
        journal.read(out)
    # A journal that cannot be read is left as it is, by a new sweep too: whether its sweep finished is not known.
    assert main(["sweep", "--seeds", "1", "--steps", "5", "--configs", "f32-heap", "--out", str(out)]) == 2
    assert (victim / "keep-seed0.json").read_text() == "precious"
    assert (out / journal.FILE).read_text() == json.dumps(plan) + "\n" + json.dumps(run) + "\n"


def test_a_sweep_of_a_name_at_two_page_sizes_resumes_with_the_command_it_prints(tmp_path):
    """Its journal holds the labels ``f32-heap-page4`` and ``-page8``, which ``--configs`` refused."""
    backend = _backend(tmp_path, configs="[_f32.with_(page_tokens=4), _f32.with_(page_tokens=8)]")
    status, _ = _sweep(tmp_path, backend, "--workers", "1")
    out = tmp_path / "out"
    lines = (out / "runs.jsonl").read_text().splitlines(keepends=True)
    (out / "runs.jsonl").write_text("".join(lines[:-2]))        # stopped two runs short
    assert main(["sweep", "--resume", str(out), "--backend", backend]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["runs"] == report["runs_expected"] == 6 and report["runs_resumed"] == 4
    assert main(["sweep", "--seeds", "1", "--configs", "f32-heap,f32-heap-page8,f32-heap", "--backend", backend,
                 "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "report.json").read_text())
    assert sorted(again["configs"]) == ["f32-heap-page4", "f32-heap-page8"] and again["runs"] == 2


def test_a_resume_given_configs_compares_the_configurations_they_name_not_the_spelling(tmp_path, capsys):
    """The journal holds ``f32-heap-page4,f32-heap-page8``: ``--configs f32-heap`` (the name the sweep
    was started with) and the labels in another order name the same two and resume it; one of them
    alone is a different sweep, refused by name before anything runs."""
    backend = _backend(tmp_path, configs="[_f32.with_(page_tokens=4), _f32.with_(page_tokens=8)]")
    _sweep(tmp_path, backend, "--workers", "1", "--configs", "f32-heap")
    out = tmp_path / "out"
    journal = out / "runs.jsonl"
    lines = journal.read_text().splitlines(keepends=True)
    journal.write_text("".join(lines[:-1]))
    assert main(["sweep", "--resume", str(out), "--backend", backend, "--configs", "f32-heap-page8"]) == 2
    assert "--configs f32-heap-page4,f32-heap-page8, not f32-heap-page8" in capsys.readouterr().err
    assert journal.read_text() == "".join(lines[:-1])
    for configs in ("f32-heap", "f32-heap-page8,f32-heap-page4"):
        journal.write_text("".join(lines[:-1]))
        assert main(["sweep", "--resume", str(out), "--backend", backend, "--configs", configs]) == 0
        assert json.loads((out / "report.json").read_text())["runs_resumed"] == 5


def test_one_page_size_of_a_name_swept_alone_keeps_its_label_and_resumes(tmp_path):
    """Labelled against the chosen configurations alone, ``--configs f32-heap-page8`` was journaled as
    ``f32-heap``, which a resume reads as both page sizes (and refused)."""
    backend = _backend(tmp_path, configs="[_f32.with_(page_tokens=4), _f32.with_(page_tokens=8)]")
    status, report = _sweep(tmp_path, backend, "--workers", "1", "--configs", "f32-heap-page8")
    assert status == 0 and report["configs"] == ["f32-heap-page8"] and report["runs"] == 3
    out = tmp_path / "out"
    lines = (out / "runs.jsonl").read_text().splitlines(keepends=True)
    (out / "runs.jsonl").write_text("".join(lines[:-1]))
    assert main(["sweep", "--resume", str(out), "--backend", backend]) == 0
    assert json.loads((out / "report.json").read_text())["runs_resumed"] == 2


def test_junit_holds_a_backends_message_with_control_characters_and_a_partial_sweep_is_an_error(tmp_path):
    """From an audit as a nightly CI engineer: an ANSI colour code or a NUL in a backend's message made
    junit.xml no XML at all; a partial sweep's junit.xml read green (tests=6 failures=0)."""
    import xml.etree.ElementTree as ET

    from kvstate.stateful.sweeps import sweep as S
    from kvstate.stateful.sweeps.runs import RunResult

    backend = _backend(tmp_path, when="True", act="_planted(cache, Raises)")
    status, report = _sweep(tmp_path, backend, "--workers", "1", "--shrink-limit", "0")
    assert status == 1 and report["failures"]
    junit = ET.parse(tmp_path / "out" / "junit.xml").getroot()       # well-formed
    message = junit.find(".//failure").get("message")
    assert "\\x1b[31mCUDA error\\x00\\x0c" in message
    assert all(path.startswith(str(tmp_path)) for path in (f["replay_file"] for f in report["failures"]))
    passed = RunResult("f32-heap", 0, 4, 10, 0.1, 0.1, None)
    partial = S.SweepReport("b", 10, [0, 1, 2], ["f32-heap"], 1, None, 1.0, [passed], partial=True)
    root = S.to_junit(partial).getroot()
    assert (root.get("errors"), root.get("failures")) == ("1", "0")
    assert "2 of its 3 runs not run" in root.find(".//error").get("message")
    assert S.to_junit(S.SweepReport("b", 10, [0], ["f32-heap"], 1, None, 1.0, [passed])).getroot().get("errors") == "0"


def test_a_sparse_shards_seeds_are_listed_without_spanning_them():
    """``--seed-range 0:10000000 --shard 1/5000000`` holds 2 seeds; the report spanned 10 million to say so."""
    import tracemalloc

    from kvstate.stateful.sweeps.sweep import _compact

    tracemalloc.start()
    assert _compact([0, 20_000_000]) == [0, 20_000_000] and _compact([3, 4, 5]) == "3:6"
    assert tracemalloc.get_traced_memory()[1] < 1 << 20
    tracemalloc.stop()


def test_a_run_that_ends_its_pool_process_is_a_finding_of_its_seed_and_the_sweep_goes_on(tmp_path):
    """From an audit: ``os._exit`` in a run (as a segfault) broke the local pool; the sweep stopped as if
    the machine were lost, naming no seed, and every resume stopped the same way."""
    backend = _backend(tmp_path, when="config.precision == 'f16'", act="_planted(cache, Dies)",
                       configs="[_f32, _f16]")
    status, report = _sweep(tmp_path, backend, "--workers", "2", "--shrink-limit", "0")
    assert status == 1 and not report["partial"] and report["runs"] == report["runs_expected"] == 6
    assert {(f["config"], f["failure"]["error"], f["failure"]["phase"]) for f in report["failures"]} == \
        {("f16-heap", "ProcessDied", "crash")}
    assert len(report["failures"]) == 3


def test_a_run_stuck_in_c_past_its_timeout_is_a_timeout_of_its_seed_in_a_pool(tmp_path, monkeypatch):
    """From an audit: a run blocked inside C ignored --run-timeout (the deadline reaches Python code only)
    and held its pool process, and every resume, for good. In a pool process it now ends the process
    ``watchdog.GRACE_S`` past the timeout (the sweep's watchdog kills it), and the seed is a RunTimeout."""
    from kvstate.stateful.sweeps import watchdog

    monkeypatch.setattr(watchdog, "GRACE_S", 0.2)      # read by the sweep's own watchdog
    backend = _backend(tmp_path, when="config.precision == 'f16'", act="_planted(cache, StuckInC)",
                       configs="[_f32, _f16]")
    from kvstate.stateful.backends import load_factory
    from kvstate.stateful.configs import configs_for
    from kvstate.stateful.sweeps import sweep as S

    done: dict = {}

    def sweep():        # in a thread of its own: without the fix it never returns, and the test fails at once
        done["report"] = S.sweep(range(3), 40, configs_for(load_factory(backend)), backend, workers=2,
                                 out_dir=tmp_path / "out", shrink_limit=0, run_timeout=0.5, progress=None)
    thread = threading.Thread(target=sweep, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the sweep waited on the stuck run"
    report = done["report"]
    assert len(report.results) == report.expected == 6
    assert {(r.config, r.failure.error) for r in report.failures} == {("f16-heap", "RunTimeout")}


# -- one worker, the default: each run isolated as in a pool ------------------------------------

def _outcome(out) -> tuple[dict, list, list]:
    """The report, the journal's run lines and the replay files a sweep left in ``out``."""
    report = json.loads((out / "report.json").read_text())
    journal = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    return report, [entry for entry in journal if entry["kind"] == "run"], sorted((out / "replays").iterdir())


@pytest.mark.parametrize("workers", [[], ["--workers", "1"]], ids=["default", "workers-1"])
def test_a_run_that_ends_its_process_is_a_finding_with_one_worker_too(tmp_path, workers):
    """With one worker (the default) the runs ran in the sweep's own process: a backend that ended it
    (``os._exit``, a segfault) ended the sweep, with no report, a journal cut short and no replay file.
    The sweep runs as a command of its own here: that way, it took this test's process down with it."""
    import os
    import subprocess
    import sys
    import xml.etree.ElementTree as ET
    from pathlib import Path

    backend = _backend(tmp_path, when="config.precision == 'f16'", act="_planted(cache, Dies)",
                       configs="[_f32, _f16]")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[1]),
                                                                      os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "kvstate", "sweep", "--seeds", "3", "--steps", "40", "--backend",
                           backend, "--out", str(tmp_path / "out"), *workers, "--shrink-limit", "0"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    report, journaled, replays = _outcome(tmp_path / "out")
    assert not report["partial"] and report["runs"] == report["runs_expected"] == 6
    assert report["workers"] == 1 and len(journaled) == 6
    assert sorted((f["config"], f["seed"], f["failure"]["error"]) for f in report["failures"]) == \
        [("f16-heap", seed, "ProcessDied") for seed in range(3)]
    assert all(f["failure"]["message"].endswith("exit status 3") for f in report["failures"])
    assert [path.name for path in replays] == [f"f16-heap-seed{seed}.json" for seed in range(3)]
    assert ET.parse(tmp_path / "out" / "junit.xml").getroot().get("failures") == "3"
    assert "FAIL f16-heap seed 2: ProcessDied" in done.stdout


@pytest.mark.parametrize("stuck", ["StuckInC", "Deadlocks"])
def test_a_run_stuck_in_c_past_its_timeout_is_a_timeout_with_one_worker_too(tmp_path, monkeypatch, stuck):
    """With one worker (the default) a run blocked in C (a sleep, a lock taken twice) held the sweep's own
    process past --run-timeout for good: no report, ever. It now ends the run's process, as in a pool."""
    from kvstate.stateful.sweeps import watchdog

    monkeypatch.setattr(watchdog, "GRACE_S", 0.2)      # read by the sweep's own watchdog
    backend = _backend(tmp_path, when="config.precision == 'f16'", act=f"_planted(cache, {stuck})",
                       configs="[_f32, _f16]")
    done: dict = {}

    def sweep():        # in a thread of its own: without the fix it never returns, and the test fails
        done["status"] = main(["sweep", "--seeds", "2", "--steps", "20", "--backend", backend, "--out",
                               str(tmp_path / "out"), "--shrink-limit", "0", "--run-timeout", "0.3"])
    thread = threading.Thread(target=sweep, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the sweep waited on the stuck run"
    report, journaled, replays = _outcome(tmp_path / "out")
    assert done["status"] == 1 and not report["partial"] and report["runs"] == report["runs_expected"] == 4
    assert len(journaled) == 4 and len(replays) == 2
    assert sorted((f["config"], f["seed"], f["failure"]["error"]) for f in report["failures"]) == \
        [("f16-heap", seed, "RunTimeout") for seed in range(2)]


def test_a_full_disk_stops_the_sweep_naming_the_resume_command(tmp_path, monkeypatch, capsys):
    """The journal's disk fills part way through a line: the sweep stops with one line that says how to
    finish it once there is room (``--backend`` included), and that command does."""
    import errno
    import shlex

    from kvstate.stateful.sweeps import journal as J

    backend = _backend(tmp_path, name="full disk backend")      # a path the command must quote
    out = tmp_path / "out dir"
    write = J.Journal._write
    lines = []

    def fills_up(self, entry):
        if len(lines) == 3:         # the plan and two runs fit; half of the third line does
            self._stream.write(json.dumps(entry)[:20])
            raise OSError(errno.ENOSPC, "No space left on device")
        lines.append(entry)
        write(self, entry)
    monkeypatch.setattr(J.Journal, "_write", fills_up)
    capsys.readouterr()
    assert main(["sweep", "--seeds", "4", "--steps", "20", "--configs", "f32-heap", "--backend", backend,
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "no space left on the disk of" in err and "after 2 of 4 runs" in err
    command = f"kvstate sweep --resume {shlex.quote(str(out))} --backend {shlex.quote(backend)}"
    assert err.rstrip().endswith(f"finish with: {command}"), err
    monkeypatch.setattr(J.Journal, "_write", write)                  # space freed
    assert main(shlex.split(command)[1:]) == 0
    report = json.loads((out / "report.json").read_text())
    assert (report["runs"], report["runs_resumed"], report["partial"]) == (4, 2, False)

    def full_from_the_start(cls, out_dir, plan):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(J.Journal, "start", classmethod(full_from_the_start))
    capsys.readouterr()
    assert main(["sweep", "--seeds", "1", "--steps", "5", "--configs", "f32-heap", "--out", str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err          # no journal begun: nothing to resume
    assert "no space left on the disk of" in err and err.rstrip().endswith("run the same command again"), err


def test_a_pool_broken_between_two_submissions_loses_no_run():
    """With one process a run that dies at once could break the pool before the sweep's next submission,
    which raised ``BrokenProcessPool`` and ended the sweep (seen now and then on a loaded machine). Made
    certain here: the second submission waits until the first run has broken the pool."""
    import operator
    import os

    from kvstate.stateful.sweeps import sweep as S

    pool = S.LocalPool(1)
    submitted: list = []
    submit = pool.executor.submit

    def after_the_break(function, *job):
        if submitted:
            submitted[0].exception()        # its process died: the pool is broken now
        submitted.append(submit(function, *job))
        return submitted[-1]
    pool.executor.submit = after_the_break
    jobs = [(os._exit, 3), (abs, -1), (abs, -2)]
    try:
        results = dict(S._map(pool, operator.call, jobs))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    assert set(results) == set(jobs) and (results[jobs[1]], results[jobs[2]]) == (1, 2)
    assert isinstance(results[jobs[0]], S.ProcessDied) and str(results[jobs[0]]).endswith("exit status 3")


def test_in_process_runs_in_the_sweeps_own_process_with_one_worker_only(tmp_path, monkeypatch, capsys):
    """For a debugger: ``--in-process`` makes no pool (the default, one worker, is a pool of one)."""
    from kvstate.stateful.sweeps import sweep as S

    made = []

    class Spied(S.LocalPool):
        def __init__(self, workers):
            made.append(workers)
            super().__init__(workers)
    monkeypatch.setattr(S, "LocalPool", Spied)
    backend = _backend(tmp_path)
    assert _sweep(tmp_path, backend, "--in-process")[0] == 0 and made == []
    assert _sweep(tmp_path, backend)[0] == 0 and made == [1]
    capsys.readouterr()
    assert main(["sweep", "--seeds", "1", "--backend", backend, "--out", str(tmp_path / "two"), "--in-process",
                 "--workers", "2"]) == 2
    assert "--in-process runs the sweep in this process" in capsys.readouterr().err


def test_a_pytest_tests_first_line_names_an_invariant_only_where_one_broke():
    """From the sweeps review (s68, 9): a backend's own exception printed "RuntimeError (invariant None)"."""
    from kvstate.stateful.configs import configs_named
    from kvstate.stateful.replay import Failure

    config = configs_named(["f32-heap"])[0]
    raised = Replay("kvstate.impl.numpy", config, 0, [], Failure(3, "apply", "allocate()", "RuntimeError", None, "boom"))
    broke = Replay("kvstate.impl.numpy", config, 0, [], Failure(3, "check", "allocate()", "InvariantViolation", 4, "x"))
    assert 'Found by kvstate sweep: RuntimeError."""' in as_pytest(raised)
    assert 'Found by kvstate sweep: InvariantViolation (invariant 4)."""' in as_pytest(broke)
    assert 'Found by kvstate sweep: passing."""' in as_pytest(Replay("kvstate.impl.numpy", config, 0, []))


def test_a_pasted_test_runs_nothing_a_replay_file_or_journal_says():
    """An outside audit (s70): a journal's failure error holding three double quotes, a command and three more
    closed the pasted test's docstring early, and the command ran with the test. Whatever a file says (the error, the invariant,
    a backend attribute) is now a literal or an identifier, and a seed that is not an int is refused on load."""
    from kvstate.stateful.replay import Failure, from_json, to_json
    from kvstate.spec.errors import ReplayFileError

    config = config_named("f32-heap")
    command = '__import__("os").system("touch pwned")'
    error = f'IndexError"""; {command}; """'
    invariant = f'x\\"\n{command}\n'
    for backend in ("kvstate.impl.numpy", f"kvstate.impl.numpy:factory; {command}"):
        source = as_pytest(Replay(backend, config, 0, [O.Allocate()], Failure(3, "apply", "allocate()", error,
                                                                              invariant, "boom")))
        tree = ast.parse(source)
        test = next(node for node in tree.body if isinstance(node, ast.FunctionDef))
        assert ast.get_docstring(test, clean=False) == f"Found by kvstate sweep: {error} (invariant {invariant})."
        assert [type(node).__name__ for node in tree.body if not isinstance(node, (ast.Import, ast.ImportFrom))] in (
            ["Assign", "FunctionDef"], ["Assign", "Assign", "FunctionDef"])     # OPS (and factory by path), the test
        assert command not in source.replace(repr(backend), "").replace(repr(test.body[0].value.value), "")
    data = to_json(Replay("kvstate.impl.numpy", config, 0, [O.Allocate()]))
    with pytest.raises(ReplayFileError, match="its 'seed' is '0; x'"):
        from_json({**data, "seed": "0; x"})
