"""A second review of the nightly-sweep surface (``kvstate sweep``, ``kvstate replay``): crashes in the
re-run that pins a failure, redraws that end early, backends that start processes, a watchdog row left
by a dead process, replays slower than --time-limit, fingerprints of odd folders, printed data. Each
test fails with its fix reverted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvstate.cli import main

EXAMPLES = Path(__file__).parents[1] / "examples"

PLANTED = '''
import ctypes, multiprocessing, os, time
from listcache import ListCache, ListContext, factory as _ok

def act(self):
{act}


class C(ListContext):
    def truncate(self, k):
        if self.cache.page_tokens == 5 and k == 3:
            act(self)
        return super().truncate(k)


class K(ListCache):
    context_class = C


def factory(config):
{build}
    return K(config)


factory.configs = _ok.configs[:1]       # f32-heap
factory.any_page_size = _ok.any_page_size
{extra}
'''


def _backend(tmp_path: Path, name: str, act: str, build: str = "    pass", extra: str = "") -> str:
    """A listcache (beside a copy of ``examples/listcache.py``) that runs ``act`` at one truncate:
    seed 5 gets there at step 48."""
    folder = tmp_path / "be"
    folder.mkdir(exist_ok=True)
    shutil.copy(EXAMPLES / "listcache.py", folder / "listcache.py")
    (folder / f"{name}.py").write_text(PLANTED.format(act=act, build=build, extra=extra))
    return str(folder / f"{name}.py")


def _sweep(tmp_path: Path, backend: str, *more: str) -> dict:
    out = tmp_path / "out"
    status = main(["sweep", "--seed-range", "5:6", "--steps", "60", "--backend", backend, "--out", str(out),
                   "--shrink-limit", "0", *more])
    assert status == 1
    return json.loads((out / "report.json").read_text())


def test_a_crash_in_the_rerun_that_pins_a_failure_is_saved_at_its_step_with_its_operations(tmp_path, capsys):
    """From the review: the re-run that pins a failure (``runs._pinned``) reported no steps to the
    watchdog, which its ``begin`` had reset to 0: a crash there was saved at step 0 with no operations,
    and its replay passed (exit 0, "fixed")."""
    backend = _backend(tmp_path, "pinned_segv", "    if _seen:\n        ctypes.string_at(0)\n"
                                                "    _seen.append(1)\n    raise ValueError('planted')",
                       extra="_seen = []")
    [failure] = _sweep(tmp_path, backend)["failures"]
    assert (failure["seed"], failure["failure"]["error"], failure["failure"]["step"]) == (5, "ProcessDied", 48)
    saved = json.loads(Path(failure["replay_file"]).read_text())
    assert len(saved["ops"]) == 48 and saved["failure"]["op"] == "truncate(ctx='c6', n=3)"


def test_a_redraw_that_ends_before_the_known_step_says_so_and_its_replay_is_refused(tmp_path, capsys):
    """From the review: a redraw that died before the step the run crashed at (a crash that is not
    deterministic) saved 2 operations for a failure at step 48 without a word, and its replay exited 0."""
    backend = _backend(
        tmp_path, "nondet_segv", "    ctypes.string_at(0)",
        extra="_count = [0]\n_orig = ListContext.writable\n"
              "def _writable(self, index):\n"
              "    if multiprocessing.current_process().name == 'kvstate-sweep-redraw':\n"
              "        _count[0] += 1\n"
              "        if _count[0] == 10:\n"
              "            ctypes.string_at(0)\n"
              "    return _orig(self, index)\n"
              "C.writable = _writable")       # this backend's class only: listcache is shared by the process's tests
    [failure] = _sweep(tmp_path, backend)["failures"]
    assert failure["failure"]["step"] == 48
    saved = json.loads(Path(failure["replay_file"]).read_text())
    assert len(saved["ops"]) < 48
    assert f"after {len(saved['ops'])} of the 48 operations" in failure["failure"]["message"]
    capsys.readouterr()
    assert main(["replay", failure["replay_file"], "--backend", backend]) == 2
    assert f"records a failure at step 48 but holds only {len(saved['ops'])} operations" in capsys.readouterr().err


def test_a_backend_that_starts_processes_is_drawn_again_and_replayed(tmp_path, capsys):
    """From the review: the redraw and replay children were daemonic, so a backend that starts a process
    when it builds a cache (an engine's allocator or worker process) failed there ("daemonic processes
    are not allowed to have children"): its crash was saved without its operations, its replay was an error."""
    backend = _backend(tmp_path, "mp_helper", "    ctypes.string_at(0)",
                       build="    helper = multiprocessing.Process(target=int)\n    helper.start(); helper.join()")
    [failure] = _sweep(tmp_path, backend)["failures"]
    assert (failure["failure"]["error"], failure["failure"]["step"]) == ("ProcessDied", 48)
    assert "daemonic" not in failure["failure"]["message"]
    assert len(json.loads(Path(failure["replay_file"]).read_text())["ops"]) == 48
    capsys.readouterr()
    assert main(["replay", failure["replay_file"], "--backend", backend]) == 1
    assert "reproduces the recorded failure" in capsys.readouterr().out


def _crash_or_return(name: str, limit: float, crash_after: float) -> str:
    """A pool task that reports step 7 and then returns, or crashes in C (SIGSEGV: not a hang)."""
    import ctypes
    import time

    from kvstate.stateful.sweeps import watchdog

    watchdog.begin(limit)
    watchdog.step(7)
    time.sleep(crash_after)
    if name == "crasher":
        ctypes.string_at(0)
    return name


def test_a_pool_process_that_crashed_is_not_taken_for_stuck_while_the_sweep_is_busy(monkeypatch):
    """From the review: a pool process that died left its watchdog row started; with the sweep's main
    thread busy past the limit plus ``GRACE_S`` (a redraw, a slow write), the watchdog recorded the crash
    as a task stuck (``RunTimeout``, not ``ProcessDied``) and sent SIGKILL to the reaped, maybe reused, pid."""
    import os
    import threading
    import time

    from kvstate.stateful.sweeps import sweep as S
    from kvstate.stateful.sweeps import watchdog

    monkeypatch.setattr(watchdog, "GRACE_S", 0.2)
    killed = []
    real_kill = os.kill

    def kill(pid, sig):
        if threading.current_thread().name == "kvstate-sweep-watchdog":
            killed.append(pid)
        return real_kill(pid, sig)
    monkeypatch.setattr(os, "kill", kill)
    pool = S.LocalPool(1)
    results = {}
    try:
        for job, result in S._map(pool, _crash_or_return, [("quick", 0.3, 0.0), ("crasher", 0.3, 0.2)]):
            results[job[0]] = result
            if job[0] == "quick":
                time.sleep(1.2)         # the main thread busy while the crasher's process dies
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    assert type(results["crasher"]).__name__ == "ProcessDied" and results["crasher"].step == 7
    assert killed == []
    here = watchdog.started_at(os.getpid())
    assert watchdog.alive(os.getpid(), here) and not watchdog.alive(os.getpid(), here + 1)
    assert not watchdog.alive(2 ** 22 + 12345)


def test_a_replay_slower_than_its_time_limit_asks_for_more_time(tmp_path, capsys):
    """From the review: a replay merely slower than --time-limit (the file records an exception, not a
    hang) exited 3, "fails, but NOT as recorded", instead of 2 with a word to raise the limit."""
    raising = _backend(tmp_path, "raising", "    raise ValueError('planted')")
    [failure] = _sweep(tmp_path, raising)["failures"]
    slow = _backend(tmp_path, "slow", "    time.sleep(30)")
    capsys.readouterr()
    assert main(["replay", failure["replay_file"], "--backend", slow, "--time-limit", "1"]) == 2
    err = capsys.readouterr().err
    assert "did not finish within 1 s" in err and "raise --time-limit" in err and "step 48" in err


FORK_HOSTILE = '''
import os
from listcache import factory as _ok

# The process that imported it, or built a cache since, uses the device: as CUDA (initialised at
# import here, since ``kvstate replay`` imports the backend but builds no cache), it cannot be used
# again in a fork of that process.
_used_in = [os.getpid()]


def factory(config):
    if _used_in and _used_in[0] != os.getpid():
        raise RuntimeError("cannot re-initialize CUDA in forked subprocess")
    _used_in[:] = [os.getpid()]
    return _ok(config)


factory.configs = _ok.configs[:1]
factory.any_page_size = _ok.any_page_size
'''


def _replay_of(tmp_path, name: str, source: str, ops: list):
    """A backend file ``name`` (``source``, beside a copy of listcache.py) and a replay file of ``ops``
    against it in its first configuration: (the backend's path, the replay file's)."""
    from kvstate.stateful import replay as R
    from kvstate.stateful.backends import load_factory
    from kvstate.stateful.configs import configs_for

    folder = tmp_path / "be"
    folder.mkdir()
    shutil.copy(EXAMPLES / "listcache.py", folder / "listcache.py")
    backend = folder / name
    backend.write_text(source)
    config = configs_for(load_factory(str(backend)))[0]
    return backend, R.save(R.Replay(str(backend), config, 0, ops), tmp_path / "r.json")


def test_replay_spawn_runs_a_backend_that_cannot_run_in_a_fork(tmp_path, capsys):
    """From the review: the replay's child was a fork of the process that had built a cache to check the
    backend, where a CUDA backend fails. ``--spawn`` starts it fresh, importing the backend there."""
    from kvstate.stateful import ops as O

    backend, path = _replay_of(tmp_path, "cuda_like.py", FORK_HOSTILE, [O.Allocate(), O.Extend("c1", (1, 2, 3))])
    assert main(["replay", str(path), "--backend", str(backend), "--spawn"]) == 0
    assert "every invariant holds" in capsys.readouterr().out
    assert main(["replay", str(path), "--backend", str(backend)]) != 0      # forked: what --spawn is for


def test_a_fingerprint_reads_regular_files_only_marks_unreadable_ones_and_caps_the_count(tmp_path, monkeypatch):
    """From the review: a FIFO named ``*.py`` in a backend's folder hung the fingerprint (a read that never
    ends), a dangling symlink failed it whole, and a folder of thousands of files was read in full."""
    import os
    import threading

    from kvstate.stateful.sweeps import fingerprint as F

    (tmp_path / "a.py").write_text("x = 1\n")
    os.mkfifo(tmp_path / "pipe.py")
    (tmp_path / "gone.py").symlink_to(tmp_path / "nowhere.py")
    files = F._folder_sources(tmp_path) + [("pipe.py", tmp_path / "pipe.py"), ("gone.py", tmp_path / "gone.py")]
    found = []
    thread = threading.Thread(target=lambda: found.append(F._digest(sorted(files))), daemon=True)
    thread.start()
    thread.join(5)
    if thread.is_alive():           # unblock the read, so the thread ends
        os.close(os.open(tmp_path / "pipe.py", os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("the fingerprint blocked on a FIFO")
    [digest] = found
    assert len(digest) == 16
    monkeypatch.setattr(F, "MAX_HASHED_FILES", 2)
    assert "names and sizes only: 3 files" in F._digest(sorted(files))


def test_fields_printed_from_data_cannot_print_lines_of_their_own(tmp_path, capsys, monkeypatch):
    """From the review: a replay file's failure message with newlines printed lines of its own (a fake
    "every invariant holds"); a lone surrogate crashed the replay (UnicodeEncodeError); a sweep error
    (which may quote a journal read on --resume) and the JUnit ``type`` were written raw; a failure with
    no operation printed "(crash None)"."""
    from kvstate.spec.errors import SweepError
    from kvstate.stateful import ops as O
    from kvstate.stateful import replay as R
    from kvstate.stateful.configs import configs_for
    from kvstate.stateful.sweeps import sweep as S
    from kvstate.impl.numpy import factory

    fake = "boom\nFAKE LINE\x1b[2J\ud800"
    failure = R.Failure(2, "crash", None, "ProcessDied\nFAKE TYPE", None, fake)
    shown = str(failure).encode("utf-8", "backslashreplace")       # no lone surrogate in pytest's report
    assert shown == b"ProcessDied\\nFAKE TYPE at step 2 (crash): boom\\nFAKE LINE\\x1b[2J\\ud800"
    config = configs_for(factory)[0]
    path = R.save(R.Replay("kvstate.impl.numpy", config, 0, [O.Allocate(), O.Extend("c1", (1, 2))], failure),
                  tmp_path / "r.json")
    capsys.readouterr()
    assert main(["replay", str(path)]) == 0
    out = capsys.readouterr().out
    assert not any(line.startswith("FAKE") for line in out.splitlines()) and "\\ud800" in out, out

    monkeypatch.setattr(S, "sweep", lambda *a, **k: (_ for _ in ()).throw(SweepError(fake)))
    assert main(["sweep", "--seeds", "1", "--steps", "2", "--backend", "kvstate.impl.numpy",
                 "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "boom\\nFAKE LINE\\x1b[2J" in err and not any(line.startswith("FAKE") for line in err.splitlines())

    result = S.runs.RunResult("f32-heap", 0, 4, 2, 0.0, 0.0, failure, replay_file="r.json")
    report = S.SweepReport("kvstate.impl.numpy", 2, [0], ["f32-heap"], 1, None, 0.0, [result])
    assert S.to_junit(report).getroot().find(".//failure").get("type") == "ProcessDied\\nFAKE TYPE"


def test_the_replay_exit_statuses_are_told_the_same_everywhere(capsys):
    """From the review: README said a replay "exits 1 whatever the backend raises" and also 3 when it
    differs; the ``kvstate`` module docstring and ``replay --help`` did not mention 3 at all."""
    import kvstate.cli

    with pytest.raises(SystemExit):
        main(["replay", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    for told in ("0, every invariant holds", "1, the recorded failure reproduces", "3, it fails, but not as recorded",
                 "2, a bad argument or file"):
        assert told in shown
    assert "3 when\nit fails but not as recorded" in kvstate.cli.__doc__
    readme = " ".join((Path(__file__).parents[1] / "README.md").read_text().split())
    assert "A replay exits 1 while its failure reproduces, whatever the backend raises" not in readme
    assert "3, the replay fails but not as recorded" in readme


def test_how_a_process_ended_is_told_by_one_helper_and_the_watchdog_stops_for_good():
    """From the review (nits): three copies of "exit status or signal in words"; ``Watchdog.stop()`` left
    its thread running."""
    from kvstate.stateful.exits import ended_how
    from kvstate.stateful.replay_process import _died
    from kvstate.stateful.sweeps import sweep as S
    from kvstate.stateful.sweeps import watchdog

    assert (ended_how(-11), ended_how(3), ended_how(None)) == ("signal SIGSEGV", "exit status 3", None)
    assert S._how_ended([None, -11]) == ": signal SIGSEGV"

    class Ended:
        exitcode = -9

        def join(self, timeout=None):
            pass
    assert _died(Ended(), 4, "close(ctx='c1')").message.endswith("without a result: signal SIGKILL")
    guard = watchdog.Watchdog(1, {})
    guard.stop()
    assert not guard._thread.is_alive()


PARENT_ONLY = '''
import sys

if "pytest" not in sys.modules:        # state the parent has and a fresh process does not
    raise ImportError("this backend loads only where pytest is imported")
from listcache import factory  # noqa: E402,F401
'''


def test_a_backend_that_cannot_load_in_the_spawned_process_is_a_bad_argument_not_a_reproduction(tmp_path, capsys):
    """From a second review: with ``--spawn`` a backend that failed to load in the fresh process ended the
    replay with a traceback and exit 1, which reads as "the recorded failure reproduces"."""
    from kvstate.stateful import ops as O

    backend, path = _replay_of(tmp_path, "parent_only.py", PARENT_ONLY, [O.Allocate()])
    assert main(["replay", str(path), "--backend", str(backend), "--spawn"]) == 2
    assert "could not be loaded in the replay's fresh process" in capsys.readouterr().err
