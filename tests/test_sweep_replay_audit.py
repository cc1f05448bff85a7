"""An audit of the nightly-sweep surface (``kvstate sweep``, ``kvstate replay``): crashes and C-level
hangs recorded with the sequence that really ran, guarded from outside the process that runs the
backend, replayed as failures; fingerprints over a backend's sibling modules; replay verdicts; escaped
output. Each test fails with its fix reverted."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

from kvstate.cli import main
from kvstate.stateful.stretches import numbered
from kvstate.stateful.sweeps import fingerprint as F
from kvstate.stateful.sweeps import watchdog

EXAMPLES = Path(__file__).parents[1] / "examples"

PLANTED = '''
import ctypes, os, time
from listcache import ListCache, ListContext, factory as _ok

def _stuck():
    ctypes.PyDLL(None).sleep(3600)      # C code holding the GIL: no thread of this process runs


class C(ListContext):
    def truncate(self, k):
        if self.cache.page_tokens == 5 and k == 3:
            {act}
        return super().truncate(k)


class K(ListCache):
    context_class = C


def factory(config):
    return K(config)


factory.configs = _ok.configs[:1]       # f32-heap
factory.any_page_size = _ok.any_page_size
'''

SHRINK_STUCK = '''
import ctypes, sys
from broken_sharing import SharingCache, SharingContext, _working_factory


class C(SharingContext):
    def truncate(self, n):
        if n == 0 and any(f.f_code.co_filename.endswith("shrink.py") for f in _frames()):
            ctypes.PyDLL(None).sleep(3600)      # only sequences the shrinker invents get here
        return super().truncate(n)


def _frames():
    f = sys._getframe()
    while f:
        yield f
        f = f.f_back


class K(SharingCache):
    context_class = C


def factory(config):
    return K(config)


factory.configs = _working_factory.configs[:1]
factory.any_page_size = _working_factory.any_page_size
'''


def _folder(tmp_path: Path, name: str, source: str) -> str:
    """A backend file beside a copy of ``examples/listcache.py`` (and ``broken_sharing.py``), which it imports."""
    folder = tmp_path / "be"
    folder.mkdir(exist_ok=True)
    for sibling in ("listcache.py", "broken_sharing.py"):
        shutil.copy(EXAMPLES / sibling, folder / sibling)
    (folder / f"{name}.py").write_text(source)
    return str(folder / f"{name}.py")


def _in_thread(call, seconds: float):
    done: dict = {}
    thread = threading.Thread(target=lambda: done.setdefault("value", call()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    return done["value"]


def _drawn_with(backend: str, seed: int, steps: int) -> tuple[int, list]:
    """The operations seed ``seed`` draws with ``backend`` (applied as a run applies them)."""
    from kvstate.stateful.backends import load_factory
    from kvstate.stateful.configs import configs_for, page_sizes
    from kvstate.stateful.generate import Generator
    from kvstate.stateful.lockstep import Lockstep

    factory = load_factory(backend)
    config = configs_for(factory)[0]
    generator = Generator(seed, page_sizes(factory, config))
    lockstep = Lockstep(factory, config.with_(page_tokens=generator.page_tokens))
    ops = []
    for _ in range(steps):
        op = generator.next_op(lockstep)
        ops.append(json.loads(json.dumps(op.to_json())))
        if len(ops) == steps:
            break
        lockstep.apply(op)
    return generator.page_tokens, ops


@pytest.fixture(scope="module")
def exit3(tmp_path_factory):
    """A listcache (no snapshots) that exits with status 3 at one truncate: seed 5 gets there at step 48."""
    tmp_path = tmp_path_factory.mktemp("exit3")
    backend = _folder(tmp_path, "exit3", PLANTED.format(act="os._exit(3)"))
    status = main(["sweep", "--seeds", "8", "--steps", "60", "--backend", backend, "--out", str(tmp_path / "out"),
                   "--shrink-limit", "0"])
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    return backend, status, report


def test_a_crash_is_saved_with_the_sequence_that_ran_and_the_step_it_died_at(exit3):
    """From the audit: the replay file of a crash held a sequence drawn against the NumPy engine (with
    snapshots, which listcache lacks), so its replay failed at step 20 and never reached the crash; and
    the failure was recorded at step 60, the run's length, not where the process died."""
    backend, status, report = exit3
    assert status == 1
    [failure] = report["failures"]
    assert (failure["seed"], failure["failure"]["error"], failure["failure"]["step"]) == (5, "ProcessDied", 48)
    saved = json.loads(Path(failure["replay_file"]).read_text())
    page_tokens, ran = _drawn_with(backend, 5, 48)
    assert saved["config"]["page_tokens"] == page_tokens and saved["ops"] == ran
    assert saved["failure"]["op"] == "truncate(ctx='c6', n=3)"
    # the steps the run left unobserved, as any seeded run leaves them (``stretches``), replayed so
    assert (tuple(saved["unobserved"]), tuple(saved["checked_after"])) == numbered(48)


def test_replaying_a_crash_is_the_failure_reproducing(exit3, capsys):
    """From the audit: a replay whose backend ended its process (exit 3, ``os._exit(0)``) ended the
    command with that status; 0 read as "fixed"."""
    backend, _, report = exit3
    capsys.readouterr()
    assert main(["replay", report["failures"][0]["replay_file"], "--backend", backend]) == 1
    shown = capsys.readouterr().out
    assert "FAILED ProcessDied at step 48 (apply truncate(ctx='c6', n=3))" in shown
    assert "exit status 3" in shown and "reproduces the recorded failure" in shown


@pytest.fixture
def fast_watchdog(monkeypatch):
    monkeypatch.setattr(watchdog, "GRACE_S", 0.2)


def test_a_run_stuck_in_c_holding_the_gil_is_a_timeout_and_a_resume_gets_past_it(tmp_path, fast_watchdog, capsys):
    """From the audit: C code holding the GIL (``ctypes.PyDLL``'s sleep) held the sweep for good
    despite --run-timeout: the timeout and its "end the process" fallback were timer threads of the
    stuck process. The sweep's own process now watches and kills it; a resume gets past it too."""
    backend = _folder(tmp_path, "stuck", PLANTED.format(act="_stuck()"))
    out = tmp_path / "out"
    command = ["sweep", "--seeds", "6", "--steps", "60", "--backend", backend, "--out", str(out),
               "--shrink-limit", "0", "--run-timeout", "0.5"]
    assert _in_thread(lambda: main(command), 40) == 1
    report = json.loads((out / "report.json").read_text())
    [failure] = report["failures"]
    assert (failure["seed"], failure["failure"]["error"], failure["failure"]["step"]) == (5, "RunTimeout", 48)
    assert json.loads(Path(failure["replay_file"]).read_text())["ops"] == _drawn_with(backend, 5, 48)[1]
    journal = out / "runs.jsonl"        # as if stopped before the stuck seed's run was journaled
    journal.write_text("".join(line for line in journal.read_text().splitlines(keepends=True)
                               if '"seed": 5' not in line))
    assert _in_thread(lambda: main(["sweep", "--resume", str(out), "--backend", backend]), 40) == 1
    report = json.loads((out / "report.json").read_text())
    assert report["runs"] == 6 and [f["failure"]["error"] for f in report["failures"]] == ["RunTimeout"]


def test_replaying_a_hang_fails_naming_the_step_and_operation_it_is_stuck_in(tmp_path, fast_watchdog, capsys):
    """From the audit: a replay stuck in C exited 2 (the bad-argument status), naming no operation."""
    backend = _folder(tmp_path, "stuck", PLANTED.format(act="_stuck()"))
    out = tmp_path / "out"
    _in_thread(lambda: main(["sweep", "--seeds", "6", "--steps", "60", "--backend", backend, "--out", str(out),
                             "--shrink-limit", "0", "--run-timeout", "0.5"]), 40)
    capsys.readouterr()
    status = _in_thread(lambda: main(["replay", str(out / "replays" / "f32-heap-seed5.json"), "--backend", backend,
                                      "--time-limit", "1"]), 30)
    shown = capsys.readouterr().out
    assert status == 1, shown
    assert "FAILED RunTimeout at step 48 (apply truncate(ctx='c6', n=3))" in shown
    assert "stuck in step 48, truncate(ctx='c6', n=3)" in shown and "reproduces the recorded failure" in shown


def test_a_shrink_stuck_in_c_ends_with_its_budget_and_is_not_called_minimised(tmp_path, fast_watchdog):
    """From the audit: a shrink candidate stuck in C held the sweep past --shrink-budget, for good."""
    backend = _folder(tmp_path, "shrink_stuck", SHRINK_STUCK)
    out = tmp_path / "out"
    command = ["sweep", "--seeds", "3", "--steps", "40", "--backend", backend, "--out", str(out),
               "--shrink-limit", "1", "--shrink-budget", "1"]
    assert _in_thread(lambda: main(command), 40) == 1
    report = json.loads((out / "report.json").read_text())
    assert report["failures"] and not any(f["minimised"] for f in report["failures"])
    # Killed past its budget (the one failure shrunk): said to be the clock's doing, not left to read as
    # a failure nobody tried to shrink.
    assert [f["clock"] for f in report["failures"]].count(["shrink"]) == len(report["clock_limited"]) == 1


def test_a_resume_refuses_a_backend_whose_sibling_module_changed(tmp_path, monkeypatch):
    """From the audit: the fingerprint of a ``.py`` backend hashed that file only, so a resume (or a
    Dask worker) accepted a run whose sibling module (which it imports) had changed."""
    backend = _folder(tmp_path, "plain", PLANTED.format(act="pass"))
    before = F._take(backend)["backend source"]
    sibling = Path(backend).parent / "listcache.py"
    sibling.write_text(sibling.read_text() + "\n# changed\n")
    assert F._take(backend)["backend source"] != before


def test_replay_says_whether_it_reproduced_the_recorded_failure(tmp_path, capsys):
    """From the audit: a file recording invariant 2 at step 3 replayed as invariant 4 at step 6 with
    exit 1 and not a word: replay never compared with the recorded failure."""
    from kvstate.stateful import ops as O
    from kvstate.stateful.backends import load_factory
    from kvstate.stateful.configs import config_named
    from kvstate.stateful.replay import Replay, execute, save

    backend = str(EXAMPLES / "broken_sharing.py")
    config = config_named("f32-heap").with_(page_tokens=4)
    ops = [O.Allocate(), O.Extend("c1", (1, 2, 3), 1), O.Fork("c1"), O.Overwrite("c1", 0, (9,), 2)]
    failure, _ = execute(load_factory(backend), config, ops)
    assert failure is not None                  # the missing copy shows in the fork
    path = save(Replay(backend, config, 0, ops, failure), tmp_path / "leak.json")
    capsys.readouterr()
    assert main(["replay", str(path), "--backend", backend]) == 1
    assert "reproduces the recorded failure" in capsys.readouterr().out
    data = json.loads(path.read_text())
    # (an earlier step: a failure step past the file's operations is refused, exit 2)
    data["failure"].update(step=data["failure"]["step"] - 1, invariant=99)
    path.write_text(json.dumps(data))
    assert main(["replay", str(path), "--backend", backend]) == 3
    shown = capsys.readouterr().out
    assert "NOT as recorded" in shown and "  recorded: " in shown and "  now: " in shown


def test_replay_escapes_control_characters_from_the_file(tmp_path, capsys):
    """From the audit: a file's ``failure.message`` was printed raw: ESC[2J cleared the screen and a
    fake "ALL GOOD" followed."""
    path = tmp_path / "failure_ansi.json"
    path.write_text(json.dumps({
        "format": "kvstate-replay/1", "backend": "kvstate.impl.numpy", "config_name": "f32-heap",
        "config": {"layout": {"layers": 2, "kv_heads": 2, "head_dim": 4}, "page_tokens": 7, "precision": "f32",
                   "arena_pages": 0, "max_entries": 2},
        "seed": 0, "failure": {"step": 2, "phase": "check", "op": "x\u009b", "error": "InvariantViolation\u202e",
                               "invariant": 4, "message": "\x1b[2J\x1b[31mALL GOOD\x1b[0m", "where": ""},
        "ops": [{"op": "allocate"}, {"op": "extend", "ctx": "c1", "tokens": [1, 0], "seed": 0}]}))
    main(["replay", str(path)])
    captured = capsys.readouterr()
    shown = captured.out + captured.err
    assert "\\x1b[2J" in shown and "\\x9b" in shown and "\\u202e" in shown
    assert not any(c in shown for c in "\x1b\x9b\u202e")


def test_a_shard_that_holds_no_seed_is_refused(tmp_path, capsys):
    """From the audit: ``--seeds 2 --shard 3/3`` ran no run and exited 0."""
    assert main(["sweep", "--seeds", "2", "--shard", "3/3", "--out", str(tmp_path / "out")]) == 2
    assert "holds no seed" in capsys.readouterr().err


def test_a_replay_operation_with_a_field_its_kind_does_not_have_is_refused_by_name(tmp_path, capsys):
    """From the audit: unknown fields in a replay file's operations were dropped without a word, so a
    file from another version (or edited by hand) replayed as something else than it says."""
    path = tmp_path / "extra.json"
    path.write_text(json.dumps({
        "format": "kvstate-replay/1", "backend": "kvstate.impl.numpy", "config_name": "f32-heap",
        "config": {"layout": {"layers": 2, "kv_heads": 2, "head_dim": 4}, "page_tokens": 7, "precision": "f32",
                   "arena_pages": 0, "max_entries": 2},
        "seed": 0, "ops": [{"op": "allocate"}, {"op": "extend", "ctx": "c1", "tokens": [1, 0], "seed": 0,
                                                "position": 3}]}))
    assert main(["replay", str(path)]) == 2
    assert "fields it does not have: position" in capsys.readouterr().err


def test_a_replay_file_names_a_file_backend_by_its_absolute_path_also_as_a_cluster_was_handed_it(tmp_path,
                                                                                                  monkeypatch):
    """From the audit: a cluster's workers are handed a file backend as given (relative), and its replay
    files kept it so: every file differed from the local pool's, which README says are byte for byte
    the same, and the file replayed only from the folder the sweep ran in."""
    from kvstate.stateful.configs import config_named
    from kvstate.stateful.sweeps.runs import RunResult, save_replay

    monkeypatch.chdir(tmp_path)
    (tmp_path / "be").mkdir()
    result = RunResult("f32-heap", 3, 4, 2, 0.1, 0.1, None, [{"op": "allocate"}], minimised=True)
    save_replay("be/mine.py:factory", config_named("f32-heap"), result, tmp_path / "replays")
    saved = json.loads(Path(result.replay_file).read_text())
    assert saved["backend"] == f"{tmp_path / 'be' / 'mine.py'}:factory"


def test_replaying_a_snapshot_on_a_backend_without_snapshots_is_a_usage_error_not_a_finding(tmp_path, capsys):
    """From an audit of replay fidelity (s72): a file found on a backend that snapshots, replayed against one
    that has no snapshot(), read as that backend failing ("NOT as recorded", an AttributeError, exit 3)."""
    from kvstate.stateful import ops as O
    from kvstate.stateful import replay as R
    from kvstate.stateful.configs import config_named
    from kvstate.stateful.snapshots import Restore, Snapshot

    ops = [O.Allocate(), O.Extend("c1", (1, 2, 3), seed=1), Snapshot("c1", "a"), Restore("a")]
    path = R.save(R.Replay("kvstate.impl.numpy", config_named("f32-heap"), 1, ops), tmp_path / "found.json")
    assert main(["replay", str(path)]) == 0           # the backend it was found on: every invariant holds
    capsys.readouterr()
    assert main(["replay", str(path), "--backend", str(EXAMPLES / "listcache.py")]) == 2
    err = capsys.readouterr().err
    assert "step 3 snapshots or restores" in err and "has no snapshot()/restore()" in err, err
