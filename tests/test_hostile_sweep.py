"""The hostile sweep fuzzer (``fuzz/hostile_sweep.py``) at CI size, more with ``-m slow``; what it found,
as regression tests; and planted faults it must report, so each target is shown able to fail."""

from __future__ import annotations

import os
import re

import pytest
from hypothesis import HealthCheck, given, settings

from kvstate.cli import main
from kvstate.fuzz import hostile_sweep as HS
from kvstate.fuzz.hostile_inputs import Finding, Tally
from kvstate.stateful.sweeps import journal as J

CI = settings(max_examples=25, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
SLOW = settings(max_examples=600, deadline=None, database=None, suppress_health_check=list(HealthCheck))


@CI
@given(HS.journal_documents())
def test_hostile_journals_are_refused_by_name_or_resumed(tmp_path_factory, document):
    tally = Tally()
    HS.check_journal(tally, document, str(tmp_path_factory.mktemp("j")))
    assert not tally.findings


@CI
@given(HS.sweep_arguments())
def test_hostile_sweep_options_are_refused_in_one_named_line(tmp_path_factory, drawn):
    tally = Tally()
    HS.check_arguments(tally, drawn, str(tmp_path_factory.mktemp("a")))
    assert not tally.findings


@pytest.mark.slow
@SLOW
@given(HS.journal_documents())
def test_hostile_journals_long(tmp_path_factory, document):
    tally = Tally()
    HS.check_journal(tally, document, str(tmp_path_factory.mktemp("j")))
    assert not tally.findings


@pytest.mark.slow
@SLOW
@given(HS.sweep_arguments())
def test_hostile_sweep_options_long(tmp_path_factory, drawn):
    tally = Tally()
    HS.check_arguments(tally, drawn, str(tmp_path_factory.mktemp("a")))
    assert not tally.findings


@pytest.mark.slow
@pytest.mark.parametrize("address", HS.OPTIONS["--scheduler"])
def test_hostile_scheduler_addresses_for_real(tmp_path, address):
    """Each address through a real connection attempt, in its own process (slow: connection timeouts)."""
    tally = Tally()
    HS.check_scheduler(tally, address, str(tmp_path))
    assert not tally.findings


# -- what the fuzzer found ----------------------------------------------------------------------

def _journal(folder, *entries, raw: bytes = b""):
    folder.mkdir(exist_ok=True)
    (folder / J.FILE).write_bytes(b"".join(HS._dump(entry) for entry in entries) + raw)
    return folder


def _one_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not line.startswith("sweep: ")]
    assert len(err) == 1, err
    return err[0]


def test_a_journal_number_past_the_int_parsing_limit_is_refused_with_its_line(tmp_path, capsys):
    plan, run0, run1, _ = HS._base_lines()
    run1["seed"] = HS.Raw("1" * 5000)
    out = _journal(tmp_path / "out", plan, run0, run1, run0)
    with pytest.raises(J.ResumeError, match="line 3"):
        J.read(out)
    assert main(["sweep", "--resume", str(out)]) == 2
    assert "line 3" in _one_line(capsys)


@pytest.mark.parametrize("change", [{"ops": None}, {"ops": [{"op": "Nope"}]}, {"ops": [{"op": "extend"}]},
                                    {"ops": [7]}, {"page_tokens": 0}, {"ops": [{"op": "truncate", "ctx": 1, "n": 0}]},
                                    {"ops": [{"op": "allocate"}, {"op": "snapshot", "ctx": "c1", "name": "/tmp/mine"}]},
                                    {"ops": [{"op": "restore", "name": "../mine"}]}],
                         ids=["no ops", "unknown op", "op lacking fields", "op not an object", "page_tokens 0",
                              "op field mistyped", "snapshot name a path", "restore name a path"])
def test_a_recorded_failure_the_resume_cannot_replay_is_refused_with_its_line(tmp_path, capsys, change):
    plan, run0, run1, _ = HS._base_lines()
    out = _journal(tmp_path / "out", plan, run0, {**run1, **change})
    with pytest.raises(J.ResumeError, match="line 3"):
        J.read(out)
    assert main(["sweep", "--resume", str(out), "--shrink-limit", "0"]) == 2
    assert "line 3" in _one_line(capsys)


def test_a_backend_name_holding_a_newline_is_refused_in_one_line(tmp_path, capsys):
    plan, run0, run1, _ = HS._base_lines()
    out = _journal(tmp_path / "out", {**plan, "backend": "kvstate.impl.numpy\n"}, run0, run1)
    assert main(["sweep", "--resume", str(out)]) == 2
    assert "--trust-backend" in _one_line(capsys)


@pytest.mark.parametrize("argv", [["--seed-range", "0:99999999999999999999"], ["--seeds", "99999999999999999999"]])
def test_more_seeds_than_a_sweep_can_list_are_refused_by_name(tmp_path, capsys, argv):
    assert main(["sweep", *argv, "--steps", "1", "--out", str(tmp_path / "o")]) == 2
    line = _one_line(capsys)
    assert "seed" in line and "Error" not in line


@pytest.mark.parametrize("argv, named", [(["--seed-range", "-3:2"], "--seed-range wants A:B with 0 <= A < B"),
                                         (["--seeds", "4", "--shard", "-1/2"], "--shard wants K/N")])
def test_a_negative_range_or_shard_gets_its_named_error_not_argparses(tmp_path, capsys, argv, named):
    """argparse reads "-3:2" as an option ("expected one argument"); joined to its option, it is checked."""
    assert main(["sweep", *argv, "--steps", "1", "--out", str(tmp_path / "o")]) == 2
    assert named in _one_line(capsys)


@pytest.mark.parametrize("option, value", [
    *[(option, "--") for option in ("--shrink-limit", "--shrink-budget", "--time-limit", "--run-timeout", "--seeds")],
    *[(option, value) for option in ("--shrink-budget", "--time-limit", "--run-timeout") for value in ("nan", "inf")],
    ("--run-timeout", "-1")])
def test_option_values_that_are_not_finite_numbers_are_refused_by_name(tmp_path, capsys, option, value):
    """argparse passes ``--opt=--`` as an empty list, and float options take nan and inf."""
    seeds = [] if option == "--seeds" else ["--seeds", "1"]
    assert main(["sweep", *seeds, "--steps", "1", f"{option}={value}", "--out", str(tmp_path / "o")]) == 2
    line = _one_line(capsys)
    assert option in line and "Error" not in line


# -- each target can fail -------------------------------------------------------------------------

def test_the_journal_target_reports_an_unnamed_error(tmp_path, monkeypatch):
    def bare(out_dir):
        raise TypeError("planted")
    monkeypatch.setattr(J, "read", bare)
    tally = Tally()
    with pytest.raises(Finding, match="unnamed TypeError"):
        HS.check_journal(tally, ("valid", b"".join(HS._dump(e) for e in HS._base_lines())), str(tmp_path))
    assert tally.findings


def test_the_journal_target_reports_a_run_outside_the_plan(tmp_path, monkeypatch):
    real = J.read

    def lenient(out_dir):
        recorded = real(out_dir)
        recorded.runs[("f32-heap", 99)] = {}
        return recorded
    monkeypatch.setattr(J, "read", lenient)
    with pytest.raises(Finding, match="outside the plan"):
        HS.check_journal(Tally(), ("valid", b"".join(HS._dump(e) for e in HS._base_lines())), str(tmp_path))


def test_the_journal_target_reports_an_import_of_the_named_backend(tmp_path, monkeypatch):
    import importlib
    import sys

    from kvstate import cli
    monkeypatch.setattr(cli, "_refuse_untrusted", lambda backend, source: importlib.import_module(
        backend.partition(":")[0]))
    name = next(n for n in HS.UNIMPORTED if n not in sys.modules)
    lines = HS._base_lines()
    lines[0]["backend"] = f"{name}:factory"
    try:
        with pytest.raises(Finding, match="imported"):
            HS.check_journal(Tally(), ("evil", b"".join(HS._dump(e) for e in lines)), str(tmp_path))
    finally:
        sys.modules.pop(name, None)


def test_the_arguments_target_reports_a_catch_all_line(tmp_path, monkeypatch):
    from kvstate import cli
    monkeypatch.setattr(cli, "_at_least", lambda name, value, low, high=None: [] < 0)
    with pytest.raises(Finding, match="without a named line"):
        HS.check_arguments(Tally(), ("--seeds", [], False), str(tmp_path))


def test_the_arguments_target_reports_an_unrunnable_accepted_value(tmp_path, monkeypatch):
    from kvstate import cli
    monkeypatch.setattr(cli, "_at_least", lambda name, value, low, high=None: None)
    with pytest.raises(Finding, match="steps -1"):
        HS.check_arguments(Tally(), ("--seeds", [("--steps", "-1")], False), str(tmp_path))


@pytest.mark.slow
def test_a_fuzzer_run_by_hand_leaves_nothing_in_the_working_folder(tmp_path):
    """Hypothesis's own files go to the user's cache folder, as ``kvstate conform``'s do (README).
    Slow: a new interpreter's imports are most of its 5-10 s."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "kvstate.fuzz.hostile_sweep", "1"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(path.name for path in tmp_path.iterdir()) == ["cache"]


def test_a_fifo_as_a_replay_file_or_a_journal_is_refused_not_waited_on(tmp_path, capsys):
    """From an audit: each blocked in open() or read() for good; --time-limit does not reach a read."""
    import os

    fifo = tmp_path / "replay.json"
    os.mkfifo(fifo)
    assert main(["replay", str(fifo)]) == 2
    assert "not a regular file" in capsys.readouterr().err
    out = tmp_path / "sweep"
    out.mkdir()
    os.mkfifo(out / "runs.jsonl")
    assert main(["sweep", "--resume", str(out)]) == 2
    assert "not a regular file" in capsys.readouterr().err
    assert main(["sweep", "--seeds", "1", "--steps", "5", "--configs", "f32-heap", "--out", str(out)]) == 2
    assert "not a regular file" in capsys.readouterr().err


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads process states from /proc (Linux)")
@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_a_pool_process_ends_itself_once_the_sweep_that_made_it_is_gone(method):
    """From an audit: after ``kill -9`` of a 2-worker sweep its pool processes lived on, holding the
    sweep's output open, and a CI step piping it waited for good. A stand-in sweep starts a real
    pool, reads its process's pid, and dies at once without stopping it. Under ``forkserver``
    (Python 3.14's default on Linux) a process's parent is the fork server, not the sweep."""
    import subprocess
    import sys
    import textwrap
    import time

    script = textwrap.dedent(f"""
        import multiprocessing, os
        from kvstate.stateful.sweeps import sweep as S
        multiprocessing.set_start_method({method!r})
        pool = S.LocalPool(1)
        print(pool.executor.submit(os.getpid).result(), flush=True)
        os._exit(0)
    """)
    child = int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                               stdin=subprocess.DEVNULL).stdout.split()[0])

    def alive() -> bool:
        try:
            with open(f"/proc/{child}/stat") as stat:
                return stat.read().rsplit(")", 1)[1].split()[0] != "Z"     # a zombie has ended
        except FileNotFoundError:
            return False
    deadline = time.monotonic() + 10
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive()


@pytest.mark.parametrize("seconds", ["NaN", "Infinity", "-1"])
def test_a_journal_run_with_seconds_no_report_can_hold_is_refused_by_name(tmp_path, capsys, seconds):
    """From an audit: ``"seconds": NaN`` in a journal made report.json hold NaN, which strict JSON refuses."""
    out = tmp_path / "out"
    assert main(["sweep", "--seeds", "2", "--steps", "5", "--configs", "f32-heap", "--out", str(out)]) == 0
    journal = out / J.FILE
    plan, first, *_ = journal.read_text().splitlines(keepends=True)
    journal.write_text(plan + re.sub(r'"seconds": [^,]+', f'"seconds": {seconds}', first, count=1))
    assert main(["sweep", "--resume", str(out)]) == 2
    assert "seconds are not finite numbers" in capsys.readouterr().err
