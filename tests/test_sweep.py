"""Sweeps, shrinking and replay files: distinct full-length runs, shards, and the planted-bug round trip."""

import json
import os
import re
import shlex
import threading
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import _ExecutorManagerThread
from pathlib import Path

import numpy as np
import pytest

from kvstate.cli import main
from kvstate.impl.numpy import factory as numpy_factory
from kvstate.spec.errors import ReplayFileError
from kvstate.spec.layout import Layout
from kvstate.stateful import ops as O
from kvstate.stateful import replay as R
from kvstate.stateful.sweeps import sweep as S
from kvstate.stateful.configs import config_named
from kvstate.stateful.generate import generate
from kvstate.stateful.planted import PLANTED
from kvstate.stateful.shrink import created_handles, renumber, shrink

BUG = "missing_copy_on_write"


# -- the sequences --------------------------------------------------------------------

def test_500_seeds_give_500_distinct_sequences():
    # 10 steps, not 40: a seed's longer sequence starts with its shorter one, so 500 distinct
    # 10-step prefixes make 500 distinct sequences at every length (the stronger claim, at a
    # quarter of the generation); full length at 400 steps is the next test's
    sequences = [tuple(generate(seed, 10)[1]) for seed in range(500)]
    assert all(len(s) == 10 for s in sequences)
    assert len(set(sequences)) == 500


def test_full_length_runs_are_400_steps_and_distinct():
    runs = [generate(seed, 400) for seed in (0, 1, 2)]
    assert [len(ops) for _, ops in runs] == [400, 400, 400]
    assert len({tuple(ops) for _, ops in runs}) == 3
    kinds = {op.kind for _, ops in runs for op in ops}
    assert kinds == {"allocate", "extend", "overwrite", "fork", "truncate", "close", "retain", "match", "clear",
                     "snapshot", "restore"}


def test_same_seed_same_sequence_and_it_survives_json():
    page_tokens, ops = generate(7, 200)
    assert generate(7, 200) == (page_tokens, ops)
    assert [O.op_from_json(json.loads(json.dumps(op.to_json()))) for op in ops] == ops


def test_a_sweep_run_executes_exactly_the_generated_sequence():
    config = config_named("q8-arena6")
    with PLANTED["refcount_kept_on_close"]():        # fails at finish at the latest, so ops are kept
        result = S.run_seed("kvstate.impl.numpy", config, 3, 60)
    _, ops = generate(3, 60)
    assert result.ops == [op.to_json() for op in ops[:len(result.ops)]]


@pytest.mark.parametrize("n", [1, 2, 3, 7])
def test_shards_partition_the_seeds(n):
    seeds = list(range(1000, 1500))
    shards = [S.shard(seeds, k, n) for k in range(1, n + 1)]
    assert sorted(s for part in shards for s in part) == seeds
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_bad_seed_range_and_shard_are_refused():
    assert S.parse_seed_range("1000:1500") == range(1000, 1500)
    assert S.parse_shard("2/4") == (2, 4)
    for text in ["5", "5:5", "a:b", "9:3"]:
        with pytest.raises(ValueError):
            S.parse_seed_range(text)
    for text in ["0/4", "5/4", "1", "x/y"]:
        with pytest.raises(ValueError):
            S.parse_shard(text)


# -- shrinking ------------------------------------------------------------------------

def test_removing_a_creator_removes_its_context_and_renumbers_the_rest():
    ops = [O.Allocate(), O.Extend("c1", (1,), 0), O.Allocate(), O.Fork("c2"), O.Close("c1"), O.Truncate("c3", 0)]
    handles = created_handles(ops)
    assert handles == ["c1", None, "c2", "c3", None, None]
    kept = renumber(ops[2:], handles[2:])     # drop c1's allocate: its extend and close go too
    assert kept == [O.Allocate(), O.Fork("c1"), O.Truncate("c2", 0)]


def test_a_chain_of_forks_shrinks_to_the_one_fork_the_bug_needs():
    # A write through the third context of a fork chain shows the missing copy. Delta debugging alone
    # cannot drop the middle fork (dropping a fork drops the write done through it) and stopped at 5
    # operations; doing a fork's operations to its parent instead (``forks_as_parents``) gives 4.
    config = config_named("f32-heap")
    ops = [O.Allocate(), O.Extend("c1", (1,), 1), O.Fork("c1"), O.Fork("c2"), O.Overwrite("c3", 0, (2,), 2)]
    with PLANTED[BUG]():
        found, _ = R.execute(numpy_factory, config, ops)
        assert found is not None and found.invariant == 4, found
        shrunk, failure = shrink(numpy_factory, config, ops, found, 20.0)
    assert failure.signature == found.signature, failure.headline
    assert [op.kind for op in shrunk] == ["allocate", "extend", "fork", "overwrite"], shrunk
    assert shrunk[3].ctx == "c2", shrunk


def test_a_hit_written_and_cut_shrinks_to_one_context_written_once():
    # An audit (s73): the lockstep printed 6 operations (a retain, its hit extended, then cut) for a
    # truncate that keeps one page too few; one context, one extend and the cut show it.
    from foreign.bugs import BUGS

    config = config_named("f32-heap").with_(page_tokens=7)
    ops = [O.Allocate(), O.Extend("c1", (1, 1, 2), 0), O.Retain("c1"), O.Match((1, 1, 2)),
           O.Extend("c2", (0,) * 5, 0), O.Truncate("c2", 8)]
    factory = BUGS["truncate_off_by_one"]
    found, _ = R.execute(factory, config, ops)
    assert found is not None and found.invariant == 2, found
    shrunk, failure = shrink(factory, config, ops, found, 20.0)
    assert failure.signature == found.signature, failure.headline
    assert [op.kind for op in shrunk] == ["allocate", "extend", "truncate"], shrunk


def test_a_hit_taken_only_to_share_pages_shrinks_to_a_fork():
    # An audit (s73): a sweep saved "retain, match, truncate, extend" for a missing copy-on-write; a fork
    # shares the pages as the hit did, and the retain then goes too.
    from foreign.bugs import BUGS

    config = config_named("f32-heap").with_(page_tokens=4)
    ops = [O.Allocate(), O.Extend("c1", (1, 0), 0), O.Retain("c1"), O.Match((1, 0)), O.Truncate("c2", 1),
           O.Extend("c2", (0,), 0)]
    factory = BUGS["missing_copy_on_write"]
    found, _ = R.execute(factory, config, ops)
    shrunk, failure = shrink(factory, config, ops, found, 20.0)
    assert failure.signature == found.signature, failure.headline
    assert [op.kind for op in shrunk] == ["allocate", "extend", "fork", "truncate", "extend"], shrunk


def test_a_failure_seen_after_a_refused_step_says_it_was_refused(monkeypatch):
    # An audit (s73): a sweep's line read "invariant 4 ... != reference" after an overwrite both sides
    # refused, without saying so, though "refused, nothing changed" is the promise it broke.
    from kvstate.impl import context as context_module

    whole = context_module.Context.overwrite

    def position_by_position(ctx, start, tokens, kv):
        for i, token in enumerate(list(tokens)):
            whole(ctx, start + i, [token], np.asarray(kv)[i:i + 1])
    monkeypatch.setattr(context_module.Context, "overwrite", position_by_position)
    config = config_named("f32-heap").with_(page_tokens=4, pool_pages=12, on_full="refuse")
    ops = [O.Allocate(), O.Extend("c1", tuple(range(8)), 1), O.Fork("c1"), O.Overwrite("c2", 0, (5,), 2),
           O.Allocate(), O.Extend("c3", (2,) * 36, 3), O.Overwrite("c2", 3, (8, 9), 4)]
    found, _ = R.execute(numpy_factory, config, ops)
    assert found.phase == "check" and found.invariant == 4, found
    assert "refused: CapacityError" in str(found) and found.signature == ("InvariantViolation", 4), found


# -- the round trip: plant, sweep, shrink, save, replay, fix ---------------------------

@pytest.fixture(scope="module")
def planted_sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep")
    with PLANTED[BUG]():
        report = S.sweep(range(5), 60, [config_named("f32-heap")], workers=1, out_dir=out, progress=None,
                         in_process=True)      # the patch must reach the runs however processes start
    S.write_reports(report, out)
    return report, out


def isolation_replay_file(report) -> str:
    """The shrunk failure the missing copy shows as: a read that differs (invariant 4)."""
    return next(r.replay_file for r in report.failures
                if r.minimised and R.load(r.replay_file).failure.invariant == 4)


def test_planted_bug_is_found_shrunk_and_saved(planted_sweep):
    report, out = planted_sweep
    assert report.failures
    shrunk = [R.load(r.replay_file) for r in report.failures if r.minimised]
    kinds = [(s.failure.error, s.failure.invariant) for s in shrunk]
    assert shrunk and len(kinds) == len(set(kinds))          # one per configuration and failure kind
    replay = next(s for s in shrunk if s.failure.invariant == 4)
    assert 3 <= len(replay.ops) <= 6                          # allocate, extend, fork, overwrite (+ a little)
    assert {op.kind for op in replay.ops} >= {"fork", "overwrite"}
    assert replay.backend == "kvstate.impl.numpy" and replay.config.name == "f32-heap"
    report_json = json.loads((out / "report.json").read_text())
    assert report_json["summary"][0]["failures"] == len(report.failures)
    junit = ET.parse(out / "junit.xml").getroot()
    assert int(junit.get("tests")) == 5 and int(junit.get("failures")) == len(report.failures)


def test_replay_reproduces_the_failure_and_passes_once_the_bug_is_gone(planted_sweep, capsys):
    report, _ = planted_sweep
    path = isolation_replay_file(report)
    with PLANTED[BUG]():
        assert main(["replay", path]) == 1
    shown = capsys.readouterr().out
    assert "FAILED InvariantViolation" in shown and "invariant 4" in shown and "reference" in shown
    assert main(["replay", path, "--backend", "kvstate.impl.numpy:factory"]) == 0
    assert "every invariant holds" in capsys.readouterr().out


def test_unshrunk_failures_are_saved_and_replay_too(planted_sweep):
    report, _ = planted_sweep
    for r in report.failures:
        replay = R.load(r.replay_file)
        with PLANTED[BUG]():
            failure, _ = R.execute(numpy_factory, replay.config, replay.ops)
        assert failure is not None and failure.signature == r.failure.signature


def test_the_printed_pytest_test_fails_with_the_bug_and_passes_without(planted_sweep):
    report, _ = planted_sweep
    replay = R.load(isolation_replay_file(report))
    source = R.as_pytest(replay)
    namespace = {}
    exec(compile(source, "<regression>", "exec"), namespace)
    test = next(value for name, value in namespace.items() if name.startswith("test_"))
    with PLANTED[BUG]():
        with pytest.raises(AssertionError, match="invariant 4"):
            test()
    test()


def test_a_bad_replay_file_is_refused(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"format": "something-else"}')
    with pytest.raises(ReplayFileError):
        R.load(path)
    assert main(["replay", str(path)]) == 2
    good = R.to_json(R.Replay("kvstate.impl.numpy", config_named("f32-heap"), 0, [O.Allocate()]))
    for broken in ([], {**good, "ops": [["allocate"]]}, {**good, "ops": [{"op": "no-such-op"}]},
                   {**good, "config": {**good["config"], "layout": {"layers": 0, "kv_heads": 1, "head_dim": 1}}}):
        path.write_text(json.dumps(broken))
        with pytest.raises(ReplayFileError):
            R.load(path)
    for broken, named in (({**good, "ops": [{"op": "rm -rf"}]}, "an operation of unknown kind 'rm -rf'"),
                          ({**good, "ops": [{"op": "extend", "ctx": "c1"}]},
                           "operation 'extend' without its 'tokens' field"),
                          ({k: v for k, v in good.items() if k != "ops"}, "it has no 'ops' field"),
                          ({**good, "config": None}, "its 'config' is a NoneType, not an object of configuration"),
                          ({**good, "failure": "x"}, "its 'failure' is a str, not an object of failure fields")):
        path.write_text(json.dumps(broken))
        with pytest.raises(ReplayFileError, match=re.escape(named)):
            R.load(path)
    ops = [O.Allocate(), O.Extend("c9", (1,), 0)]
    with pytest.raises(ReplayFileError, match="c9"):
        R.execute(numpy_factory, config_named("f32-heap"), ops)


def test_a_replay_file_whose_failure_has_a_field_of_the_wrong_kind_is_refused_by_name(tmp_path, capsys):
    """A step of "x" was a bare TypeError naming no field; a step of -1 was replayed and read as a
    failure the backend no longer shows (exit 0)."""
    path = tmp_path / "bad.json"
    recorded = R.Failure(1, "check", "allocate()", "InvariantViolation", 4, "m")
    good = R.to_json(R.Replay("kvstate.impl.numpy", config_named("f32-heap"), 0, [O.Allocate()], recorded))
    R.from_json(good)
    for name, value in (("step", "x"), ("step", -1), ("phase", None), ("error", 3), ("message", None),
                        ("invariant", 1.5), ("op", 7), ("where", None)):
        path.write_text(json.dumps({**good, "failure": {**good["failure"], name: value}}))
        assert main(["replay", str(path)]) == 2
        assert capsys.readouterr().err.strip() == \
            f"kvstate replay: malformed replay file: its failure's {name} is {value!r}"


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_a_sweep_of_a_file_backend_prints_replays_that_work_pasted_from_anywhere(tmp_path, monkeypatch, capsys):
    """The backend as a relative path: the journal and every printed replay hold it made absolute,
    with ``--backend`` (a replay imports only built-in backends unasked)."""
    monkeypatch.chdir(EXAMPLES)
    argv = ["sweep", "--seeds", "3", "--steps", "60", "--configs", "f32-heap", "--backend", "broken_sharing.py",
            "--out", str(tmp_path / "out"), "--shrink-limit", "0"]
    assert main(argv) == 1
    replays = re.findall(r"replay: (kvstate replay .*)", capsys.readouterr().out)
    assert replays and all(line.endswith(f" --backend {EXAMPLES / 'broken_sharing.py'}") for line in replays)
    monkeypatch.chdir(tmp_path)
    assert main(shlex.split(replays[0])[1:]) == 1
    spelled_otherwise = os.path.relpath(EXAMPLES / "broken_sharing.py")      # from here: the same file
    assert main(["sweep", "--resume", str(tmp_path / "out"), "--backend", spelled_otherwise]) == 1


def _listcache_sweep(tmp_path, monkeypatch) -> tuple[Path, Path, str, list[str]]:
    """A finished 2-run sweep of ``examples/listcache.py``, run from the examples folder: its folder, its
    journal, the journal's plan line and run lines."""
    monkeypatch.chdir(EXAMPLES)
    out = tmp_path / "out"
    assert main(["sweep", "--seeds", "2", "--steps", "20", "--configs", "f32-heap", "--backend", "listcache.py",
                 "--out", str(out)]) == 0
    journal = out / "runs.jsonl"
    plan, *runs = journal.read_text().splitlines(keepends=True)
    return out, journal, plan, runs


def test_a_journal_that_names_its_file_backend_relatively_still_resumes(tmp_path, monkeypatch):
    """Journals from before file backends were kept absolute: resumed from their folder, by either spelling."""
    out, journal, plan, runs = _listcache_sweep(tmp_path, monkeypatch)
    plan = json.loads(plan)
    plan["backend"] = "listcache.py"
    journal.write_text(json.dumps(plan) + "\n" + "".join(runs[:-1]))
    for spelled in ("listcache.py", str(EXAMPLES / "listcache.py")):
        assert main(["sweep", "--resume", str(out), "--backend", spelled]) == 0


def test_a_replay_of_a_configuration_the_backend_does_not_declare_is_refused(tmp_path, capsys):
    listcache = str(EXAMPLES / "listcache.py")       # declares f32-heap, f16-heap and q8-heap only
    for name, differs in (("f32-arena6", "its nearest, f32-heap, has arena_pages 0 where the file has 6"),
                          ("token-f32-heap", "its nearest, f32-heap, has match 'entry' where the file has 'token'")):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(R.to_json(R.Replay(listcache, config_named(name), 0, [O.Allocate()]))))
        assert main(["replay", str(path), "--backend", listcache]) == 2
        err = capsys.readouterr().err
        assert f"holds configuration {name}, which backend" in err and differs in err
    path.write_text(json.dumps(R.to_json(R.Replay(listcache, config_named("f32-heap"), 0, [O.Allocate()]))))
    assert main(["replay", str(path), "--backend", listcache]) == 0
    # Layout and entry limit are the backend's to take as given (an exhaustive search's scope is its own).
    other = config_named("f32-heap").with_(layout=Layout(1, 1, 2), max_entries=1)
    path.write_text(json.dumps(R.to_json(R.Replay(listcache, other, 0, [O.Allocate()]))))
    assert main(["replay", str(path), "--backend", listcache]) == 0
    # The built-in engine lists no configurations: any layout or arena, its declared semantics.
    arena = config_named("f32-arena6").with_(arena_pages=3, layout=config_named("f32-arena6").layout)
    path.write_text(json.dumps(R.to_json(R.Replay("kvstate.impl.numpy", arena, 0, [O.Allocate()]))))
    assert main(["replay", str(path)]) == 0


def test_a_new_sweep_does_not_overwrite_an_unfinished_one_and_replaces_a_finished_one(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["sweep", "--seeds", "2", "--steps", "20", "--configs", "f32-heap", "--out", str(out)]
    assert main(argv) == 0
    (out / "replays").mkdir(exist_ok=True)
    (out / "replays" / "f32-heap-seed1.json").write_text("{}")      # as the earlier sweep's failure
    (out / "replays" / "my-regression.json").write_text("{}")       # a file no sweep writes
    assert main(argv) == 0                                            # a finished sweep: replaced
    assert sorted(path.name for path in (out / "replays").iterdir()) == ["my-regression.json"]
    journal = out / "runs.jsonl"
    lines = journal.read_text().splitlines(keepends=True)
    journal.write_text("".join(lines[:-1]))                          # as if stopped before its last run
    capsys.readouterr()
    assert main(argv) == 2
    assert f"holds a sweep that stopped after 1 of its 2 runs: finish it with kvstate sweep --resume {out}" \
        in capsys.readouterr().err
    assert journal.read_text() == "".join(lines[:-1])                 # nothing of it lost
    assert main(["sweep", "--resume", str(out)]) == 0


def test_a_new_sweep_does_not_overwrite_one_whose_journal_cannot_be_read(tmp_path, capsys):
    """From an audit: a journal that ``journal.read`` refused (a damaged middle line) counted as no sweep, so
    re-running the sweep command, as a CI retry does, replaced a partial sweep and its finished runs without
    a word, where ``--resume`` named the line. Only a journal whose first line is not even whole (a sweep
    stopped before its plan was written) holds nothing to lose."""
    out = tmp_path / "out"
    out.mkdir()
    journal = out / "runs.jsonl"
    argv = ["sweep", "--seeds", "2", "--steps", "20", "--configs", "f32-heap", "--out", str(out)]
    plan = {"kind": "plan", "format": "kvstate-sweep-journal/1", "backend": "kvstate.impl.numpy", "steps": 20,
            "seeds": [0, 1], "configs": ["f32-heap"], "shard": None, "fingerprint": {}}
    damaged = json.dumps(plan) + '\n{"kind": "run", "seed": 0X}\n{"kind": "run"}\n'
    journal.write_text(damaged)
    capsys.readouterr()
    assert main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{out} holds a sweep whose journal cannot be read ({journal}: line 2 is not JSON" in last, last
    assert f"kvstate sweep --resume {out}" in last and "move" in last and "--out" in last
    assert journal.read_text() == damaged and sorted(path.name for path in out.iterdir()) == [".sweep.lock", journal.name]
    journal.write_text(json.dumps(plan)[:30])                 # stopped before its plan was on the disk
    assert main(argv) == 0


def test_a_replay_marks_the_steps_both_sides_refused_as_a_counterexample_does(tmp_path, capsys):
    path = tmp_path / "refused.json"
    ops = [O.Allocate(), O.Retain("c1"), O.Extend("c1", (1,), 0)]
    path.write_text(json.dumps(R.to_json(R.Replay("kvstate.impl.numpy", config_named("f32-heap"), 0, ops))))
    assert main(["replay", str(path), "--every-step"]) == 0
    steps = [line.strip() for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert steps == ["1  allocate()  -> c1", "2  retain(ctx='c1')    # refused: EmptyContextError",
                     "3  extend(ctx='c1', tokens=(1,), seed=0)"]


def test_a_replays_pages_name_each_holder_with_the_handle_the_file_names():
    """The page listing named holders by the engine's own numbers alone (``held by ['ctx:3']``): with
    an entry taking a number in between, nothing told which of the file's handles that was (c2)."""
    ops = [O.Allocate(), O.Extend("c1", (1, 2, 3, 4, 5), 1), O.Retain("c1"), O.Fork("c1"), O.Close("c1")]
    shown: list[str] = []
    with PLANTED["refcount_kept_on_close"]():
        failure = R.replay(R.Replay("kvstate.impl.numpy", config_named("f32-heap").with_(page_tokens=4), 0, ops),
                           numpy_factory, out=shown.append)
    assert failure is not None
    pages = [line for line in shown if line.startswith("  page ")]
    assert pages and all("(c2)" in line for line in pages)
    assert not any(re.search(r"'ctx:\d+'", line) for line in pages)       # no holder without its handle


def test_workers_that_are_not_a_number_are_refused_by_name(tmp_path, capsys):
    assert main(["sweep", "--seeds", "1", "--workers", "abc", "--out", str(tmp_path)]) == 2
    assert "--workers wants a positive number or 'auto', got 'abc'" in capsys.readouterr().err


# -- the CI share: a sweep of every configuration -----------------------------------------

def test_a_sweep_covers_every_configuration_the_backend_declares(tmp_path, capsys):
    """Ours declares every semantics: the six and one configuration per declared semantics."""
    from kvstate.impl.numpy import factory
    from kvstate.stateful.configs import configs_for

    # Two short seeds: what is tested here is the sweep covering the configurations. Finding bugs
    # in them is the seeded check's (tests/test_planted_bugs.py runs its 16 seeds at 200 steps in
    # all 13 under -m slow; a sweep's seed at fewer steps is the prefix of the same seed's run).
    assert main(["sweep", "--seeds", "2", "--steps", "25", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert [row["config"] for row in report["summary"]] == [c.name for c in configs_for(factory)]
    assert len(report["summary"]) == 13
    for row in report["summary"]:
        assert (row["runs"], row["steps"], row["failures"]) == (2, 50, 0)    # every run full length
    out = capsys.readouterr().out
    assert "f32-heap" in out and "token-f32-arena6-evict" in out


def test_a_sharded_sweep_in_a_process_pool(tmp_path):
    configs = [config_named("f16-arena6")]
    report = S.sweep(S.shard(range(6), 2, 2), 30, configs, workers=2, out_dir=tmp_path, progress=None)
    assert sorted(r.seed for r in report.results) == [1, 3, 5]
    assert all(r.passed and r.steps == 30 for r in report.results)


def test_a_resumed_sweeps_summary_rates_only_the_steps_this_session_ran(tmp_path):
    """The summary divided every run's steps, the journal's too, by this session's wall time: a resume that
    ran one run of three reported three times the rate it ran at."""
    configs = [config_named("f32-heap")]
    S.sweep(range(3), 20, configs, out_dir=tmp_path, progress=None, in_process=True)
    journal = tmp_path / "runs.jsonl"
    lines = journal.read_text().splitlines(keepends=True)
    journal.write_text("".join(lines[:-1]))                          # as if stopped before its last run
    report = S.sweep(range(3), 20, configs, out_dir=tmp_path, progress=None, in_process=True, resume=True)
    assert report.resumed == 2
    assert f"({20 / report.wall_seconds:,.0f} steps/s over this session's 20 steps on 1 worker)" \
        in S.format_summary(report)


def test_a_resume_runs_with_as_many_workers_as_the_sweep_it_finishes(tmp_path, capsys):
    """The journal records the local pool's size; ``--resume`` alone uses it (no more than this
    machine's cores), ``--workers`` overrides it."""
    from kvstate.stateful.sweeps.sweep import resolve_workers

    out = tmp_path / "out"
    assert main(["sweep", "--seeds", "2", "--steps", "20", "--configs", "f32-heap", "--out", str(out),
                 "--workers", "2"]) == 0
    journal = out / "runs.jsonl"
    lines = journal.read_text().splitlines(keepends=True)
    assert json.loads(lines[0])["workers"] == 2
    journal.write_text("".join(lines[:-1]))                          # as if stopped before its last run
    capsys.readouterr()
    assert main(["sweep", "--resume", str(out)]) == 0
    assert f"{min(2, resolve_workers('auto'))} worker(s), resuming" in capsys.readouterr().err
    plan = json.loads(lines[0])
    journal.write_text(json.dumps({**plan, "workers": 10**6}) + "\n" + "".join(lines[1:-1]))
    assert main(["sweep", "--resume", str(out)]) == 0                # a journal cannot ask for a million
    assert f"{resolve_workers('auto')} worker(s), resuming" in capsys.readouterr().err
    journal.write_text("".join(lines[:-1]))
    assert main(["sweep", "--resume", str(out), "--workers", "1"]) == 0
    assert "1 worker(s), resuming" in capsys.readouterr().err
    del plan["workers"]                                               # a journal from before it was recorded
    journal.write_text(json.dumps(plan) + "\n" + "".join(lines[1:-1]))
    assert main(["sweep", "--resume", str(out)]) == 0
    assert "1 worker(s), resuming" in capsys.readouterr().err


def test_a_resume_runs_with_the_run_timeout_and_shrinking_the_sweep_was_started_with(tmp_path, monkeypatch):
    """The journal records them; a resume without them used none and the defaults: a sweep started with
    --run-timeout and resumed with the command it printed hung for good on the seed that hangs."""
    out = tmp_path / "out"
    assert main(["sweep", "--seeds", "2", "--steps", "20", "--configs", "f32-heap", "--out", str(out),
                 "--run-timeout", "30", "--shrink-limit", "0", "--shrink-budget", "7"]) == 0
    journal = out / "runs.jsonl"
    plan, *runs = journal.read_text().splitlines(keepends=True)
    assert {key: json.loads(plan)[key] for key in ("run_timeout", "shrink_limit", "shrink_budget")} == \
        {"run_timeout": 30.0, "shrink_limit": 0, "shrink_budget": 7.0}
    journal.write_text(plan + runs[0])
    seen = []
    real = S.sweep

    def sweep(*args, **kwargs):
        seen.append((kwargs["run_timeout"], args[6], args[7]))      # shrink_limit, shrink_budget_s
        return real(*args, **kwargs)
    monkeypatch.setattr(S, "sweep", sweep)
    assert main(["sweep", "--resume", str(out)]) == 0
    journal.write_text(plan + runs[0])
    assert main(["sweep", "--resume", str(out), "--run-timeout", "5", "--shrink-limit", "3"]) == 0
    assert seen == [(30.0, 0, 7.0), (5.0, 3, 7.0)]


def test_every_saved_failure_replays_at_the_step_and_with_the_error_it_records(tmp_path):
    """From an audit: a sweep's run reads only the contexts an operation could have changed, so a backend
    that damages another (broken_sharing) was recorded a step late, and 6 of 15 unshrunk replay files
    failed earlier than they said. A failing run is pinned again, reading every context."""
    out = tmp_path / "out"
    backend = str(EXAMPLES / "broken_sharing.py")
    assert main(["sweep", "--seeds", "12", "--steps", "60", "--configs", "f32-heap", "--backend", backend,
                 "--out", str(out), "--shrink-limit", "0"]) == 1
    from kvstate.stateful.backends import load_factory

    factory = load_factory(backend)
    files = sorted((out / "replays").glob("*.json"))
    assert len(files) >= 4
    for path in files:
        recorded = R.load(path)
        replayed, _ = R.execute(factory, recorded.config, recorded.ops)
        assert (replayed.step, replayed.error) == (recorded.failure.step, recorded.failure.error), path.name


def test_a_resume_takes_a_file_backend_named_with_or_without_its_factory(tmp_path, monkeypatch):
    out, journal, plan, runs = _listcache_sweep(tmp_path, monkeypatch)
    for spelled in ("listcache.py:factory", str(EXAMPLES / "listcache.py")):
        journal.write_text(plan + runs[0])
        assert main(["sweep", "--resume", str(out), "--backend", spelled]) == 0


@pytest.mark.parametrize("field, value, said", [("ops", {"op": "allocate"}, "'ops' is a dict, not a list"),
                                                ("backend", ["os", "system"], "'backend' is a list, not a string")])
def test_a_replay_file_whose_fields_have_the_wrong_shape_is_refused_by_name(tmp_path, capsys, field, value, said):
    path = tmp_path / "r.json"
    data = R.to_json(R.Replay("kvstate.impl.numpy", config_named("f32-heap"), 0, [O.Allocate()]))
    path.write_text(json.dumps({**data, field: value}))
    assert main(["replay", str(path)]) == 2
    assert said in capsys.readouterr().err


def _failure_at(step: int, error: str = "InvariantViolation") -> R.Failure:
    return R.Failure(step, "check", f"op {step}", error, 4, "differs")


@pytest.mark.parametrize("again, pinned_at", [(_failure_at(3), 3), (_failure_at(5), 5), (_failure_at(7), 5),
                                               (None, 5), (_failure_at(2, "RunTimeout"), 5)])
def test_a_failing_run_pinned_again_keeps_the_earlier_step_only(monkeypatch, again, pinned_at):
    """``_pinned`` re-runs a failing seed reading every context: an earlier failure replaces the run's and
    cuts its operations there; a later one, none, or a timeout of the re-run keeps the run's own (and a
    timeout says the clock decided it)."""
    from kvstate.stateful.sweeps import runs

    ran = [O.Allocate() for _ in range(6)]
    monkeypatch.setattr(runs, "execute", lambda factory, config, ops, **_: (again, None))
    failure, kept, cut = runs._pinned(numpy_factory, config_named("f32-heap"), _failure_at(5), ran, 10.0)
    assert failure.step == pinned_at and len(kept) == (pinned_at if pinned_at < 5 else 6)
    assert cut == (again is not None and again.error == "RunTimeout")


def test_a_pinning_run_past_its_timeout_keeps_the_runs_failure(monkeypatch):
    """The re-run reads more than the run did, so it may take longer: past the run timeout it is given up
    and the run's own failure stands, within about that timeout."""
    import time

    from kvstate.stateful.sweeps import runs

    def slow(factory, config, ops, **_):
        for _ in range(500):            # Python-level sleeps: the deadline's exception lands between them
            time.sleep(0.01)
        return _failure_at(1), None
    monkeypatch.setattr(runs, "execute", slow)
    started = time.monotonic()
    failure, kept, cut = runs._pinned(numpy_factory, config_named("f32-heap"), _failure_at(5), [O.Allocate()] * 6, 0.3)
    assert failure.step == 5 and len(kept) == 6 and cut
    assert time.monotonic() - started < 3


def test_the_window_caps_the_jobs_submitted_and_not_yet_read():
    """A cluster's worker that dies takes the blame for every task it holds: a sweep keeps no more tasks
    submitted and unread than its window, and every job still comes back once."""
    from concurrent.futures import ThreadPoolExecutor

    submitted, read, most = [0], [0], [0]

    class Counting(ThreadPoolExecutor):
        def submit(self, function, *args, **kwargs):
            submitted[0] += 1
            most[0] = max(most[0], submitted[0] - read[0])
            return super().submit(function, *args, **kwargs)

    with Counting(4) as pool:
        jobs = [(i,) for i in range(20)]
        results = {}
        for job, result in S._map(pool, lambda x: 2 * x, jobs, window=lambda: 3):
            read[0] += 1
            results[job] = result
    assert results == {(i,): 2 * i for i in range(20)}
    assert most[0] == 3


def test_a_stopped_pool_leaves_no_thread_to_race_the_exit():
    """``_stop`` left the pool's manager thread closing its wake-up pipe while the interpreter's exit
    hook wrote to it: now and then an ``OSError: Bad file descriptor`` traceback after an interrupted
    command's line (seen from ``kvstate conform``, which stopped its pools the same way)."""
    executor = ProcessPoolExecutor(1)
    running = executor.submit(time.sleep, 60)
    executor.submit(time.sleep, 60)
    time.sleep(0.5)
    S._stop(executor)
    assert running.done()
    assert [t for t in threading.enumerate() if isinstance(t, _ExecutorManagerThread)] == []
