"""Sweep journals and replay files are data (issue 24 items 2, 8, 9): nothing in them imports code
unless the user says so, every line is checked with its file and line named, and bounds are
checked before work. Each test builds its files by hand: nothing here runs a sweep."""

from __future__ import annotations

import json
import os
import sys

import pytest

from kvstate.cli import main
from kvstate.stateful import ops as O
from kvstate.stateful.sweeps import journal as J

EVIL = '''import pathlib
pathlib.Path({marker!r}).write_text("imported")
def factory(config):
    raise SystemExit("never")
'''


def plan_line(backend="kvstate.impl.numpy", seeds=(0, 1), configs=("f32-heap",), fingerprint=None) -> dict:
    return {"kind": "plan", "format": J.FORMAT, "backend": backend, "steps": 10, "seeds": list(seeds),
            "configs": list(configs), "shard": None, "fingerprint": fingerprint or {}}


def this_codes_plan_line(**change) -> dict:
    """A plan that this code resumes: its fingerprint is this machine's."""
    from kvstate.stateful.sweeps.fingerprint import fingerprint
    return plan_line(fingerprint=fingerprint("kvstate.impl.numpy"), **change)


def run_line(seed=0, config="f32-heap", **change) -> dict:
    return {"kind": "run", "config": config, "seed": seed, "page_tokens": 4, "steps": 10, "seconds": 0.1,
            "cpu_seconds": 0.1, "failure": None, "ops": None, "replay_file": None, "minimised": False, **change}


def write_journal(folder, *entries, raw: bytes = b"") -> None:
    folder.mkdir(exist_ok=True)
    text = "".join(json.dumps(entry) + "\n" for entry in entries).encode() + raw
    (folder / J.FILE).write_bytes(text)


@pytest.fixture
def evil_module(tmp_path, monkeypatch):
    """A module that, imported, leaves a marker file; on sys.path as ``kvs_evil_backend``."""
    marker = tmp_path / "imported"
    (tmp_path / "kvs_evil_backend.py").write_text(EVIL.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "kvs_evil_backend", raising=False)
    return marker


# -- item 2: no code from data ------------------------------------------------------------------

def test_resume_does_not_import_the_backend_a_journal_names(tmp_path, evil_module, capsys):
    out = tmp_path / "out"
    write_journal(out, plan_line(backend="kvs_evil_backend:factory"), run_line(0))
    assert main(["sweep", "--resume", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--trust-backend" in err and "kvs_evil_backend" in err and len(err.strip().splitlines()) == 1
    assert not evil_module.exists() and "kvs_evil_backend" not in sys.modules


def test_replay_does_not_import_the_backend_a_replay_file_names(tmp_path, evil_module, capsys):
    from kvstate.stateful import replay as R
    from kvstate.stateful.configs import configs_named
    path = R.save(R.Replay("kvs_evil_backend:factory", configs_named(["f32-heap"])[0], 0, []), tmp_path / "r.json")
    assert R.load(path).backend == "kvs_evil_backend:factory"      # a well-formed file: only trust refuses it
    assert main(["replay", str(path)]) == 2
    assert "--trust-backend" in capsys.readouterr().err
    assert not evil_module.exists() and "kvs_evil_backend" not in sys.modules


# -- item 9: damaged journals are named by file and line ----------------------------------------------

@pytest.mark.parametrize("damage, line", [
    ([run_line("0")], 2),                              # a seed of the wrong type
    ([run_line(0, failure=[1, 2])], 2),                        # a failure of the wrong shape
    ([run_line(0), {"kind": "run", "seed": 1}], 3),            # fields missing
    ([run_line(0), ["not", "an", "object"]], 3),
    ([run_line(0, failure={"step": 1})], 2),                   # a failure without its fields
])
def test_a_damaged_journal_line_is_refused_with_file_and_line(tmp_path, capsys, damage, line):
    out = tmp_path / "out"
    write_journal(out, plan_line(), *damage, run_line(1))
    assert main(["sweep", "--resume", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out / J.FILE}: line {line}" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("change, said", [({"seeds": (0, 0, 1)}, "its seeds list [0] more than once"),
                                          ({"configs": ("f32-heap", "f32-heap")},
                                           "its configs list ['f32-heap'] more than once")])
def test_a_plan_that_lists_a_seed_or_configuration_twice_is_refused(tmp_path, capsys, change, said):
    """From a review: ``--resume`` took a plan with seed 0 listed twice and counted that seed's runs and
    failures twice in the report, the junit file and the exit summary."""
    out = tmp_path / "out"
    write_journal(out, this_codes_plan_line(**change), run_line(0))
    assert main(["sweep", "--resume", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out / J.FILE}: line 1: malformed plan: {said}" in err and len(err.strip().splitlines()) == 1, err


def test_a_line_that_is_not_utf8_is_refused_with_its_line(tmp_path, capsys):
    out = tmp_path / "out"
    write_journal(out, plan_line(), raw=b'{"kind": "run", "config": "\xff\xfe"}\n' + json.dumps(run_line(1)).encode() + b"\n")
    assert main(["sweep", "--resume", str(out)]) == 2
    assert f"{out / J.FILE}: line 2" in capsys.readouterr().err


def test_a_run_outside_the_plan_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    write_journal(out, plan_line(seeds=(0, 1)), run_line(0), run_line(9))
    assert main(["sweep", "--resume", str(out)]) == 2
    err = capsys.readouterr().err
    assert "line 3" in err and "plan does not hold" in err
    write_journal(out, plan_line(seeds=(0, 1)), run_line(0, config="bf16-arena"))
    assert main(["sweep", "--resume", str(out)]) == 2
    assert "line 2" in capsys.readouterr().err


def test_a_journal_past_its_size_limit_is_refused_before_it_is_read(tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    write_journal(out, plan_line(), run_line(0))
    monkeypatch.setattr(J, "MAX_BYTES", 64)
    assert main(["sweep", "--resume", str(out)]) == 2
    assert "MAX_BYTES=64" in capsys.readouterr().err


# -- from an audit: a resume writes only its own folder ------------------------------------------------

def test_a_resume_refuses_a_symlinked_journal_and_writes_nothing_through_it(tmp_path, capsys):
    """``--resume`` cut and appended to the target of a symlinked ``runs.jsonl``, outside OUT (a folder
    from a CI artifact or a tarball can carry such a link); a new sweep refused it already."""
    from kvstate.spec.errors import ResumeError

    elsewhere = tmp_path / "elsewhere"
    write_journal(elsewhere, this_codes_plan_line(), run_line(0), raw=b'{"kind": "run", "cut sh')
    before = (elsewhere / J.FILE).read_bytes()
    out = tmp_path / "out"
    out.mkdir()
    (out / J.FILE).symlink_to(elsewhere / J.FILE)
    assert main(["sweep", "--resume", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith(f"kvstate sweep: {out / J.FILE} is not a regular file"), err
    with pytest.raises(ResumeError, match="not a regular file"):
        J.Journal.reopen(out)
    assert (elsewhere / J.FILE).read_bytes() == before
    assert sorted(path.name for path in out.iterdir()) == [".sweep.lock", J.FILE]      # no report either


def test_a_new_sweep_refuses_a_symlinked_journal_before_it_removes_a_replay_file(tmp_path):
    """From a review: a new sweep read a symlinked ``runs.jsonl`` through the link, found a finished
    sweep there, removed that sweep's replay files from this folder (``OUT/replays``) and only then
    refused the link when it started its own journal."""
    from kvstate.spec.errors import ResumeError
    from kvstate.stateful.sweeps import sweep as S

    elsewhere, out = tmp_path / "elsewhere", tmp_path / "out"
    write_journal(elsewhere, plan_line(), run_line(0), run_line(1))       # a finished sweep, elsewhere
    plan = J.read(elsewhere).plan
    replay = out / "replays" / f"{plan.configs[0]}-seed{plan.seeds[0]}.json"
    replay.parent.mkdir(parents=True)
    replay.write_text("{}")
    (out / J.FILE).symlink_to(elsewhere / J.FILE)
    with pytest.raises(ResumeError, match="not a regular file"):
        S._open_journal(out, plan, {}, resume=False)
    assert replay.read_text() == "{}"
    (out / J.FILE).unlink()
    os.mkfifo(out / J.FILE)         # a FIFO: refused at once, never blocking the sweep
    with pytest.raises(ResumeError, match="not a regular file"):
        J.Journal.start(out, plan)
    assert replay.read_text() == "{}"


@pytest.mark.parametrize("resume", [False, True])
def test_a_sweep_refuses_a_symlinked_lock_file_and_makes_nothing_where_it_leads(tmp_path, capsys, resume):
    """From an audit: ``.sweep.lock`` was opened to append, through a symlink too, so a dangling one made a
    file wherever it led, outside OUT, before anything else was looked at."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    if resume:
        write_journal(out, this_codes_plan_line(), run_line(0))
    out.mkdir(exist_ok=True)
    elsewhere.mkdir()
    (out / ".sweep.lock").symlink_to(elsewhere / "made-here")
    args = ["sweep", "--resume", str(out)] if resume else ["sweep", "--seeds", "1", "--steps", "5", "--out", str(out)]
    assert main(args) == 2
    assert f"{out / '.sweep.lock'} is not a regular file" in capsys.readouterr().err
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize("out", ["", "  "])
def test_an_empty_out_is_refused_not_read_as_the_default_folder(out, tmp_path, capsys, monkeypatch):
    """From an audit (s72): ``--out ''`` (a script's unset variable) swept into ``sweep-out`` and replaced
    whatever an earlier sweep had left there."""
    monkeypatch.chdir(tmp_path)
    assert main(["sweep", "--seeds", "1", "--steps", "5", "--out", out]) == 2
    assert f"--out {out!r} names no folder" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def _finished_with_a_failure(out) -> None:
    """A finished sweep's journal in ``out`` whose seed 1 failed (shrunk): a resume runs nothing and
    saves that failure's replay file, ``replays/f32-heap-seed1.json``."""
    write_journal(out, this_codes_plan_line(), run_line(0),
                  run_line(1, **_failed([O.Allocate(), O.Extend("c1", (1, 2))], 4)))


def test_a_resume_writes_its_replay_file_over_a_symlink_never_through_it(tmp_path):
    """From a review: a resume wrote each failure's replay file with ``Path.write_text``, through a
    symlink at its name, so a folder from elsewhere overwrote a file outside it."""
    out, victim = tmp_path / "out", tmp_path / "victim.txt"
    _finished_with_a_failure(out)
    victim.write_text("precious")
    (out / "replays").mkdir()
    (out / "replays" / "f32-heap-seed1.json").symlink_to(victim)
    assert main(["sweep", "--resume", str(out)]) == 1
    assert victim.read_text() == "precious"
    saved = out / "replays" / "f32-heap-seed1.json"
    assert not saved.is_symlink() and json.loads(saved.read_text())["seed"] == 1


@pytest.mark.parametrize("resume", [False, True])
def test_a_sweep_refuses_a_symlinked_replays_folder_before_it_writes_or_removes_there(tmp_path, capsys, resume):
    """From a review: through a symlinked ``OUT/replays`` a resume wrote its replay files, and a new
    sweep into a finished folder removed the old ones, wherever the link led."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    _finished_with_a_failure(out)
    elsewhere.mkdir()
    (elsewhere / "f32-heap-seed0.json").write_text("theirs")
    (out / "replays").symlink_to(elsewhere)
    args = ["sweep", "--resume", str(out)] if resume else ["sweep", "--seeds", "1", "--steps", "5", "--out", str(out)]
    assert main(args) == 2
    assert f"{out / 'replays'} is not a folder" in capsys.readouterr().err
    assert [path.name for path in elsewhere.iterdir()] == ["f32-heap-seed0.json"]
    assert (elsewhere / "f32-heap-seed0.json").read_text() == "theirs"


def _failed(ops: list, page_tokens: int) -> dict:
    """A run line's fields for a shrunk failure of ``ops`` at ``page_tokens``."""
    failure = {"step": 1, "phase": "apply", "op": None, "error": "X", "invariant": None, "message": "m", "where": ""}
    return {"failure": failure, "ops": [op.to_json() for op in ops], "minimised": True, "page_tokens": page_tokens}


def _largest_replayable_page() -> int:
    from kvstate.stateful.configs import configs_named
    from kvstate.stateful.replay import MAX_REPLAY_PAGE_BYTES
    return MAX_REPLAY_PAGE_BYTES // (configs_named(["f32-heap"])[0].layout.values_per_position * 4)


@pytest.mark.parametrize("change, said", [
    ({"steps": -5}, "steps is -5"),             # report.json's steps_resumed summed it
    ({"steps": 11}, "steps is 11"),
    (lambda: _failed([], 10**9), "MAX_REPLAY_PAGE_BYTES"),
    # One token takes a whole page, on each side: past a replay's memory bound.
    (lambda: _failed([O.Allocate(), O.Extend("c1", (1,), 0)], _largest_replayable_page()), "MAX_REPLAY_MEMORY_BYTES"),
    # A replay file refuses it: a resume stopped at reading back the file it saved.
    (lambda: {**_failed([O.Allocate()], 4), "failure": {**_failed([], 4)["failure"], "step": -1}},
     "its failure's step is -1"),
], ids=["negative-steps", "steps-past-the-plan", "huge-page", "past-the-memory-bound", "negative-failure-step"])
def test_a_run_line_out_of_range_is_refused_with_its_line_before_anything_is_written(tmp_path, capsys, change, said):
    """From an audit: these passed ``journal.read``; a run line a resume cannot save as a replay file stopped
    it after the reports were written, with an error that named neither the journal nor the line, on every retry."""
    out = tmp_path / "out"
    write_journal(out, this_codes_plan_line(), run_line(0, **(change() if callable(change) else change)))
    journal = (out / J.FILE).read_bytes()
    (out / "report.json").write_text("{}")        # a report of the sweep's own: a resume that set off replaces it
    assert main(["sweep", "--resume", str(out)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{out / J.FILE}: line 2:" in last and said in last, last
    assert (out / J.FILE).read_bytes() == journal and (out / "report.json").read_text() == "{}"
    assert not (out / "replays").exists()


# -- issue 22 item 5: a replay against a black box (no page observation) ------------------------------

BROKEN_BOX = '''import sys
sys.path.insert(0, {examples!r})
from blackbox_backend import BoxCache, BoxContext, factory as working

class Context(BoxContext):
    def read(self, start=0, stop=None):
        values, tokens = super().read(start, stop)
        return values + 1, tokens          # wrong values: a failure the lockstep check finds

class Cache(BoxCache):
    def adopt(self, values, tokens):
        ctx = super().adopt(values, tokens)
        ctx.__class__ = Context
        return ctx

def factory(config):
    return Cache(config)
factory.semantics = working.semantics
'''


def test_replaying_a_failure_on_a_black_box_reports_it_and_exits_1(tmp_path, capsys):
    from pathlib import Path

    from kvstate.stateful import ops as O
    from kvstate.stateful import replay as R
    from kvstate.stateful.conform import load_factory
    from kvstate.stateful.configs import configs_for
    examples = Path(__file__).resolve().parent.parent / "examples"
    module = tmp_path / "broken_box.py"
    module.write_text(BROKEN_BOX.format(examples=str(examples)))
    config = configs_for(load_factory(str(module)))[0]
    recorded = R.Replay(f"{module}:factory", config, 0, [O.Allocate(), O.Extend("c1", (1, 2, 3))])
    path = R.save(recorded, tmp_path / "replay.json")
    assert main(["replay", str(path), "--backend", f"{module}:factory"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "pages, as the engine reports them" in out and "does not report" in out, out


# -- schedulers (item 9) ------------------------------------------------------------------------

def _has_distributed() -> bool:
    try:
        import distributed  # noqa: F401
    except ImportError:
        return False
    return True


needs_distributed = pytest.mark.skipif(not _has_distributed(), reason="needs Dask distributed")


@needs_distributed
def test_a_nonsense_scheduler_is_one_line_at_once():
    # In a process of its own: a Client whose constructor failed used to wait 60 s on its way out
    # and print a TimeoutError traceback, after the command had printed its line.
    import subprocess
    from pathlib import Path

    done = subprocess.run([sys.executable, "-m", "kvstate", "sweep", "--scheduler", "nonsense", "--seeds", "1",
                           "--steps", "5", "--out", "never-written"], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=40)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and "--scheduler 'nonsense'" in lines[0], done.stderr


@needs_distributed
@pytest.mark.parametrize("address", ["nonsense", "tcp://host", "foo://host:1", "tcp://:80", "tcp://host:0", "",
                                     "inproc://x", "inproc://192.0.2.1/1/1"])
def test_scheduler_addresses_are_checked_before_a_client_exists(address):
    from kvstate.spec.errors import SweepError
    from kvstate.stateful.sweeps.cluster import check_address

    with pytest.raises(SweepError, match="--scheduler"):
        check_address(address)


@needs_distributed
def test_a_sessions_dask_client_logs_do_not_reach_the_user():
    """A lost scheduler made Dask's client log a 36-line reconnection traceback before the sweep's
    one line; while a session is open the client's records are dropped, and kept again after."""
    import logging

    from distributed import LocalCluster

    from kvstate.stateful.sweeps.cluster import connect

    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    client_log = logging.getLogger("distributed.client")
    client_log.addHandler(handler)
    try:
        with LocalCluster(n_workers=1, processes=False, threads_per_worker=1,
                          dashboard_address="127.0.0.1:0") as local:
            with connect(local.scheduler_address, "kvstate.impl.numpy", out=None):
                client_log.error("Failed to reconnect to scheduler after 30.00 seconds, closing client")
            assert seen == []
            client_log.error("after the session")
        assert [record.getMessage() for record in seen] == ["after the session"]
    finally:
        client_log.removeHandler(handler)


def test_local_workers_past_the_cores_are_noted_and_past_the_cap_refused(tmp_path, capsys):
    """From the sweeps review (s68, 8): ``--workers 1000`` started 1,000 processes; 40 on 2 cores ran a
    third slower than 2, and nothing said so."""
    from kvstate.cli import main
    from kvstate.stateful.sweeps import sweep as S

    assert main(["sweep", "--workers", str(S.MAX_LOCAL_WORKERS + 1), "--seeds", "1", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and f"more than {S.MAX_LOCAL_WORKERS} local processes" in err, err
    cores = S.resolve_workers("auto")
    assert main(["sweep", "--workers", str(cores + 1), "--seeds", "1", "--steps", "5", "--configs", "f32-heap",
                 "--out", str(tmp_path / "b")]) == 0
    assert f"note: {cores + 1} workers on {cores} cores" in capsys.readouterr().err
