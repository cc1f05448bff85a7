"""`kvstate sweep` on a Dask cluster started here on 127.0.0.1: the same answer as the local
pool, a killed worker, a worker with other code, run timeouts, a run stuck in C, a lost scheduler,
and resume.

Backends with planted bugs are modules in a temporary folder that worker processes find
through a preload script (tests/test_sweep.py plants bugs by patching this process, which a
cluster's workers cannot see). Their bugs live in the caches their factory makes, so a
worker process that ran one runs the plain NumPy engine unharmed afterwards.
"""

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import suppress
from multiprocessing import get_context
from pathlib import Path

import pytest

from kvstate.cli import main
from kvstate.spec.errors import BackendMismatchError
from kvstate.stateful import replay as R
from kvstate.stateful.sweeps import sweep as S
from kvstate.stateful.configs import configs_named


def _has_distributed() -> bool:
    # Whether it is installed, not an import: collection runs in every worker, and importing
    # Dask there cost each ~0.9 s of CPU whether or not it ran a cluster test.
    return importlib.util.find_spec("distributed") is not None


needs_distributed = pytest.mark.skipif(not _has_distributed(),
                                       reason="needs Dask distributed (pip install 'kvstate[cluster]')")

PLANTED_BACKEND = '''"""The NumPy engine with the missing copy-on-write of stateful/planted.py, in its own caches only."""
from kvstate.impl.context import Context
from kvstate.impl.numpy import factory as _engine


class _CopylessContext(Context):
    __slots__ = ()          # the engine's Context has slots: a __class__ swap needs the same layout

    def writable(self, index):
        return self._pages[index]          # writes into a shared page instead of copying it


def factory(config):
    cache = _engine(config)
    engine = type(cache)

    def new_context(self, *args, **kwargs):
        ctx = engine._new_context(self, *args, **kwargs)
        ctx.__class__ = _CopylessContext
        return ctx

    cache.__class__ = type("Planted", (engine,), {"_new_context": new_context})
    return cache
'''

HANGING_BACKEND = '''"""The NumPy engine, except that at page sizes 3 and 5 allocate spins for 20 s (for ever, to a
sweep with a shorter --run-timeout; a test whose timeout is broken fails instead of hanging). Not
at 4, the configurations' own page size, which the sweep's protocol check builds before any run."""
import time

from kvstate.impl.numpy import factory as _engine


def _allocate_slowly(self):
    started = time.monotonic()
    while time.monotonic() - started < 20:
        pass
    return type(self).__mro__[1].allocate(self)


def factory(config):
    cache = _engine(config)
    if config.page_tokens in (3, 5):
        cache.__class__ = type("Hanging", (type(cache),), {"allocate": _allocate_slowly})
    return cache
'''

# Generator(seed).page_tokens for seeds 0..5 is [7, 3, 1, 4, 4, 5]: seeds 1 and 5 hang.
HANGING_SEEDS = {1, 5}

CRASHING_BACKEND = '''"""The NumPy engine, except that at page size 1 the process dies at once (a segfault, say)."""
import os

from kvstate.impl.numpy import factory as _engine


def factory(config):
    if config.page_tokens == 1:
        os._exit(1)
    return _engine(config)
'''
CRASHING_SEED = 2

STUCK_BACKEND = '''"""The NumPy engine, except that at page size 7 allocate holds the GIL in C for a minute (for ever, to
a sweep with a shorter --run-timeout): no Python code of its process runs then, not even a timer."""
import ctypes

from kvstate.impl.numpy import factory as _engine


def _allocate_stuck(self):
    ctypes.PyDLL(None).sleep(60)
    return type(self).__mro__[1].allocate(self)


def factory(config):
    cache = _engine(config)
    if config.page_tokens == 7:
        cache.__class__ = type("Stuck", (type(cache),), {"allocate": _allocate_stuck})
    return cache
'''
STUCK_SEED = 0          # Generator(0).page_tokens is 7

BOTH_STUCK_BACKEND = '''"""The NumPy engine, except that at page sizes 7 and 3 allocate sleeps in C for a minute,
the GIL released: two runs of one worker process stuck in C at once, each in a thread of its own."""
import ctypes

from kvstate.impl.numpy import factory as _engine


def _allocate_stuck(self):
    ctypes.CDLL(None).sleep(60)
    return type(self).__mro__[1].allocate(self)


def factory(config):
    cache = _engine(config)
    if config.page_tokens in (7, 3):
        cache.__class__ = type("Stuck", (type(cache),), {"allocate": _allocate_stuck})
    return cache
'''
BOTH_STUCK_SEEDS = {0, 1}       # the first two submitted: the two threads of one worker take them together

SLOW_BACKEND = '''"""The NumPy engine, each cache built a quarter of a second late where KVSTATE_TEST_SLOW_CACHES
is set: in an interrupted sweep's processes, not in its resume in the test's own process."""
import os
import time

from kvstate.impl.numpy import factory as _engine


def factory(config):
    if os.environ.get("KVSTATE_TEST_SLOW_CACHES"):
        time.sleep(0.25)
    return _engine(config)
'''


def _on_path(folder: Path) -> Path:
    """A Dask preload script putting ``folder`` first on a worker's sys.path."""
    script = folder / "on_path.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(folder)!r})\n")
    return script


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    """The backend folder (on this process's path and the workers'), and an odd copy of it whose
    planted backend has one more line: other source, same behaviour."""
    folder = tmp_path_factory.mktemp("backends")
    (folder / "sweep_planted.py").write_text(PLANTED_BACKEND)
    (folder / "sweep_hanging.py").write_text(HANGING_BACKEND)
    (folder / "sweep_crashing.py").write_text(CRASHING_BACKEND)
    (folder / "sweep_stuck.py").write_text(STUCK_BACKEND)
    (folder / "sweep_both_stuck.py").write_text(BOTH_STUCK_BACKEND)
    odd = tmp_path_factory.mktemp("odd-backends")
    (odd / "sweep_planted.py").write_text(PLANTED_BACKEND + "# edited on one machine only\n")
    sys.path.insert(0, str(folder))
    yield {"preload": _on_path(folder), "odd preload": _on_path(odd)}
    sys.path.remove(str(folder))


# LocalCluster closes a worker's nanny for good when, lost-worker-timeout (15 s) after that worker
# died, no worker of its name is registered: a worker that dies again, and is still restarting,
# 15 s after an earlier death of the same name is never restarted. The kill and crash tests kill
# workers a few seconds apart, so now and then the cluster was left one worker short and the next
# test waited 60 s for it and failed. The nannies restart every worker here, so the cluster never
# needs to give up on one.
KEEP_NANNIES = {"distributed.deploy.lost-worker-timeout": "1 hour"}


@pytest.fixture(scope="module")
def cluster(backends, tmp_path_factory):
    import dask
    from distributed import Client, LocalCluster

    # dashboard_address None would still serve HTTP on port 8787; "127.0.0.1:0" takes a free one.
    # A result read from a worker that has just died is retried until the connect timeout (30 s by
    # default: one test once took 30 s in a loaded full suite, 1.2-1.8 s alone); on the loopback
    # interface 10 s is ample for any live peer. The workers get this config from their nannies.
    # The workers see another TMPDIR than their nannies (which run in this process), as a nanny given
    # ``env`` or ``distributed.nanny.environ`` makes them: the nanny's watch must find each worker's table
    # all the same (with the table's place derived from each side's own temporary folder, the nanny never
    # found it, and a run stuck in C hung the sweep without a word).
    workers_tmp = str(tmp_path_factory.mktemp("workers-tmpdir"))
    with dask.config.set({"distributed.comm.timeouts.connect": "10s", **KEEP_NANNIES}):
        with LocalCluster(n_workers=2, processes=True, threads_per_worker=1, host="127.0.0.1",
                          dashboard_address="127.0.0.1:0", preload=[str(backends["preload"])],
                          env={"TMPDIR": workers_tmp}) as local:
            with Client(local, set_as_default=False) as client:
                yield local, client


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(module: str, *args: str) -> subprocess.Popen:
    """``dask scheduler`` or ``dask worker``, every port of it on 127.0.0.1 (without
    --dashboard-address their HTTP servers listen on every interface)."""
    return subprocess.Popen([sys.executable, "-m", f"distributed.cli.{module}", *args, "--host", "127.0.0.1",
                             "--no-dashboard", "--dashboard-address", "127.0.0.1:0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _journal_runs(out: Path) -> list[tuple[str, int]]:
    """The runs the journal holds so far: its complete lines only. Read while the sweep writes,
    the last line may be cut anywhere, even just after an inner ``}`` (a reader that parsed it
    died there once, at load 12, and its signal was never sent)."""
    try:
        lines = (out / "runs.jsonl").read_text().split("\n")[:-1]     # what follows the last newline is unfinished
    except FileNotFoundError:
        return []
    entries = [json.loads(line) for line in lines if line]
    return [(e["config"], e["seed"]) for e in entries if e["kind"] == "run"]


def _when_runs(out: Path, count: int, action, timeout_s: float = 60.0) -> threading.Thread:
    """Call ``action`` from another thread once the journal in ``out`` holds ``count`` runs."""
    def watch():
        deadline = time.monotonic() + timeout_s
        try:
            while len(_journal_runs(out)) < count and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            action()        # even if reading failed: a test waiting for the action must not hang
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _failures(out: Path) -> list[dict]:
    """report.json's failures, with replay files named by their file name alone."""
    failures = json.loads((out / "report.json").read_text())["failures"]
    return [{**f, "replay_file": Path(f["replay_file"]).name} for f in failures]


def _replays(out: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted((out / "replays").glob("*.json"))}


# -- the same answer -------------------------------------------------------------------------

@needs_distributed
def test_cluster_report_equals_the_local_pools(cluster, tmp_path, monkeypatch, capsys):
    local, _ = cluster
    configs = configs_named(["f32-heap", "q8-arena6"])
    # A spawned pool: forking this process, which runs the cluster's threads, is not safe.
    with ProcessPoolExecutor(2, mp_context=get_context("spawn")) as pool:
        # A backstop of 30 s, not 300: a worker's shrink (2 s idle) now and then stalls in C until its nanny
        # ends it past the budget (marked, below), and the suite should not wait 5 minutes for it.
        report = S.sweep(range(6), 60, configs, "sweep_planted", 2, tmp_path / "local", executor=pool,
                         progress=None, shrink_budget_s=30)
    S.write_reports(report, tmp_path / "local")
    assert report.failures                                          # the planted bug is found locally

    monkeypatch.setenv("KVSTATE_SCHEDULER", local.scheduler_address)       # the variable, not the flag
    assert main(["sweep", "--seeds", "6", "--steps", "60", "--configs", "f32-heap,q8-arena6", "--shrink-budget", "30",
                 "--backend", "sweep_planted", "--out", str(tmp_path / "cluster")]) == 1
    assert "failures" in capsys.readouterr().err                    # the same progress line
    on_cluster = json.loads((tmp_path / "cluster" / "report.json").read_text())
    assert on_cluster["scheduler"] == local.scheduler_address and not on_cluster["partial"]
    # The same failures and replay files, byte for byte, except where a report says a time limit cut a stage
    # short (a shrink past --shrink-budget on a machine loaded past reason): only there may they differ.
    clocked = {f["replay_file"] for where in ("cluster", "local") for f in _failures(tmp_path / where) if f["clock"]}
    assert [f for f in _failures(tmp_path / "cluster") if f["replay_file"] not in clocked] == \
        [f for f in _failures(tmp_path / "local") if f["replay_file"] not in clocked]
    assert clocked or any(f["minimised"] for f in _failures(tmp_path / "cluster"))
    assert {name: data for name, data in _replays(tmp_path / "cluster").items() if name not in clocked} == \
        {name: data for name, data in _replays(tmp_path / "local").items() if name not in clocked}
    assert [(row["runs"], row["steps"], row["failures"]) for row in on_cluster["summary"]] == \
        [(row["runs"], row["steps"], row["failures"]) for row in S.summary_rows(report)]


# -- faults ----------------------------------------------------------------------------------

@needs_distributed
@pytest.mark.skipif(sys.version_info >= (3, 12), reason="the deadlock is CPython 3.11's and older")
def test_a_sweep_stops_the_sampling_profiler_of_its_workers(cluster):
    """On CPython before 3.12, Dask's profiler (``sys._current_frames()`` every 10 ms) deadlocked a worker
    now and then: a collection set off inside it ran a run's ``TemporaryDirectory`` finalizer, which gave
    up the GIL while the profiler held the thread-list lock, and a shrink try's timer thread, ending,
    took the GIL and waited for that lock (python/cpython#106883). The gate stops it on every worker."""
    import dask
    from kvstate.stateful.sweeps.cluster import connect

    local, client = cluster
    assert dask.config.get("distributed.worker.profile.enabled")       # Dask's default: on

    def profiling(dask_worker) -> bool:
        callback = dask_worker.periodic_callbacks.get("profile")
        return callback is not None and callback.is_running()
    with connect(local.scheduler_address, "sweep_planted", out=None):
        running = client.run(profiling)
    assert len(running) == 2 and not any(running.values()), running


@needs_distributed
def test_a_killed_worker_loses_and_duplicates_no_run(cluster, tmp_path):
    from kvstate.stateful.sweeps.cluster import connect

    local, client = cluster
    out = tmp_path / "out"
    configs = configs_named(["f32-heap", "f16-arena6"])
    before = client.run(os.getpid)
    victim = sorted(before)[0]
    killer = _when_runs(out, 3, lambda: os.kill(before[victim], signal.SIGKILL))
    with connect(local.scheduler_address, S.DEFAULT_BACKEND, out=None) as session:
        report = S.sweep(range(12), 150, configs, S.DEFAULT_BACKEND, session.workers, out,
                         executor=session.executor, window=session.window, scheduler=session.address,
                         progress=None)
        killer.join()
        client.wait_for_workers(2, timeout=30)          # the nanny's replacement joins ...
        deadline = time.monotonic() + 30
        while len(set(session.accepted)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        admitted = set(session.accepted)                # ... and is checked before it gets work
    assert victim not in client.run(os.getpid)         # the worker really died mid-sweep
    expected = [(c.name, seed) for c in configs for seed in range(12)]
    assert [(r.config, r.seed) for r in report.results] == expected       # each once, none lost
    assert sorted(_journal_runs(out)) == sorted(expected)                  # journaled once each too
    assert all(r.passed and r.steps == 150 for r in report.results)
    assert len(admitted) == 3 and victim in admitted


@needs_distributed
def test_a_run_that_kills_its_worker_is_a_crash_failure_of_its_seed(cluster, tmp_path):
    from kvstate.stateful.sweeps.cluster import connect

    local, client = cluster
    allowed, local.scheduler.allowed_failures = local.scheduler.allowed_failures, 0    # give up at once
    try:
        with connect(local.scheduler_address, "sweep_crashing", out=None) as session:
            report = S.sweep(range(6), 40, configs_named(["f16-heap"]), "sweep_crashing", session.workers,
                             tmp_path, executor=session.executor, window=session.window, progress=None)
    finally:
        local.scheduler.allowed_failures = allowed
    client.wait_for_workers(2, timeout=30)
    crashes = {r.seed: r for r in report.failures}
    crash = crashes[CRASHING_SEED]
    assert crash.failure.error == "KilledWorker" and crash.failure.phase == "crash" and not crash.minimised
    # Drawn again with the backend here, as the run drew it: it dies building the cache, before step 1.
    assert R.load(crash.replay_file).ops == [] and crash.failure.step == 0
    assert "it ended with exit status 1 at step 0" in crash.failure.message
    # Dask blames every run its dead worker held: the window keeps that to one more per thread.
    assert len(crashes) <= 2 and all(r.failure.error == "KilledWorker" for r in crashes.values())
    assert len(report.results) == 6 and all(r.passed for r in report.results if r.seed not in crashes)


DASK_LOST_WORKER_TIMEOUT_S = 15       # distributed.deploy.lost-worker-timeout's default


@needs_distributed
@pytest.mark.slow       # it waits out Dask's 15 s timer
def test_a_worker_killed_again_while_restarting_keeps_its_nanny(cluster):
    """The race KEEP_NANNIES closes: without it this cluster is left one worker short, for good."""
    local, client = cluster
    client.wait_for_workers(2, timeout=30)
    first = client.run(os.getpid)
    address = sorted(first)[0]
    name = client.scheduler_info(n_workers=-1)["workers"][address]["name"]

    def pid_of_replacement() -> int | None:
        workers = client.scheduler_info(n_workers=-1)["workers"]
        again = [a for a, w in workers.items() if w["name"] == name and a != address]
        return client.run(os.getpid, workers=again).popitem()[1] if again else None

    killed = time.monotonic()
    os.kill(first[address], signal.SIGKILL)
    deadline = killed + 30
    while not (replacement := pid_of_replacement()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert replacement, f"worker {name!r} was not restarted"
    # Dead again, and restarting, when the cluster looks for it after the first death.
    time.sleep(max(0.0, killed + DASK_LOST_WORKER_TIMEOUT_S - 0.5 - time.monotonic()))
    os.kill(replacement, signal.SIGKILL)
    time.sleep(2.0)         # past the look
    client.wait_for_workers(2, timeout=30)
    assert sorted(local.workers) == [0, 1] and len(client.scheduler_info(n_workers=-1)["workers"]) == 2


@needs_distributed
def test_a_worker_with_other_code_gets_no_runs(cluster, backends, tmp_path):
    from kvstate.stateful.sweeps.cluster import connect

    local, client = cluster
    odd = _start("dask_worker", local.scheduler_address, "--nthreads", "1", "--no-nanny",
                 "--preload", str(backends["odd preload"]))
    try:
        # Joining mid-sweep: checked by the gate, refused, and never given a run.
        with connect(local.scheduler_address, "sweep_planted", out=None) as session:
            client.wait_for_workers(3, timeout=60)
            deadline = time.monotonic() + 30
            while not session.refused and time.monotonic() < deadline:
                time.sleep(0.05)
            report = S.sweep(range(8), 40, configs_named(["f32-heap"]), "sweep_planted", session.workers,
                             tmp_path / "late", executor=session.executor, window=session.window, progress=None)
        (odd_address, differs), = session.refused.items()
        assert set(differs) == {"backend source"}
        assert len(report.results) == 8
        executed = client.run(lambda dask_worker: dask_worker.state.executed_count)
        assert executed[odd_address] == 0 and sum(executed.values()) >= 8

        # There from the start: the sweep is refused, naming it, before any run.
        out = tmp_path / "refused"
        with pytest.raises(BackendMismatchError) as refused:
            with connect(local.scheduler_address, "sweep_planted", out=None) as session:
                S.sweep(range(8), 40, configs_named(["f32-heap"]), "sweep_planted", session.workers, out,
                        executor=session.executor, progress=None)
        assert list(refused.value.differences) == [odd_address]
        assert odd_address in str(refused.value) and "backend source" in str(refused.value)
        assert not out.exists()
    finally:
        odd.kill()
        odd.wait()


@needs_distributed
def test_an_over_long_run_is_a_timeout_failure_of_its_seed(cluster, tmp_path, capsys):
    local, _ = cluster
    for where in (["--scheduler", local.scheduler_address], ["--workers", "1"]):      # worker threads, main thread
        out = tmp_path / where[0].strip("-")
        # A broken --run-timeout lets the hanging seeds spin out their 20 s and pass: no RunTimeout below.
        assert main(["sweep", "--seeds", "6", "--steps", "40", "--configs", "f32-heap", "--backend", "sweep_hanging",
                     # 1.5 s: at 0.5 a 40-step seed ran past it once on a machine loaded by other work
                     "--run-timeout", "1.5", "--out", str(out), *where]) == 1
        failures = json.loads((out / "report.json").read_text())["failures"]
        assert {f["seed"] for f in failures} == HANGING_SEEDS
        assert all(f["failure"]["error"] == "RunTimeout" and f["failure"]["op"] == "allocate()" and
                   not f["minimised"] for f in failures)
    capsys.readouterr()


def _within(timeout_s: float, call):
    """``call()``'s value, or a failure where it has not returned after ``timeout_s``."""
    done = []
    thread = threading.Thread(target=lambda: done.append(call()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        pytest.fail(f"still running after {timeout_s:g} s")
    return done[0]


@needs_distributed
def test_a_run_stuck_in_c_on_a_worker_is_a_timeout_of_its_seed_and_its_worker_restarts(cluster, tmp_path,
                                                                                       monkeypatch):
    """C code holding the GIL on a worker stops every thread of its process, the run's timer included:
    the worker thread stayed taken, and the sweep waited for good. The worker's nanny, outside it, now
    ends it (and starts it again), and the run is a RunTimeout of its seed at the step it was in."""
    import tempfile

    from kvstate.stateful.sweeps import watchdog

    local, client = cluster
    monkeypatch.setattr(watchdog, "GRACE_S", 0.2)       # read by the nannies, which run in this process
    before = client.run(os.getpid)
    # The fixture's workers make their tables in another temporary folder than their nannies'.
    assert tempfile.gettempdir() not in set(client.run(tempfile.gettempdir).values())
    out = tmp_path / "out"
    assert _within(30, lambda: main(["sweep", "--scheduler", local.scheduler_address, "--seeds", "6", "--steps", "40",
                                     "--configs", "f32-heap", "--backend", "sweep_stuck", "--run-timeout", "0.5",
                                     "--out", str(out)])) == 1
    report = json.loads((out / "report.json").read_text())
    [failure] = report["failures"]
    stuck = failure["failure"]
    assert (failure["seed"], stuck["error"], stuck["op"]) == (STUCK_SEED, "RunTimeout", "allocate()")
    assert not failure["minimised"]
    # Its operations drawn again here, up to the step its worker reported: the one it was stuck in.
    ops = R.load(Path(failure["replay_file"])).ops
    assert stuck["step"] == len(ops) >= 1 and str(ops[-1]) == "allocate()"
    assert report["runs"] == 6 and not report["partial"]        # the other seeds ran, and passed
    ended = re.search(r"the nanny of worker (\S+) ended that worker process", stuck["message"]).group(1)
    client.wait_for_workers(2, timeout=30)
    assert ended in before and ended not in client.run(os.getpid)      # killed, and started again


def _stuck_sweep(local, client, backend: str, out: Path) -> tuple[dict, set]:
    """A sweep of 6 seeds of ``backend`` with a run timeout of 0.5 s, on a cluster whose one worker is
    killed by its nanny for stuck runs: the report's failures by seed, each checked as a RunTimeout at the
    step its own run reported, and the workers named as ended in them (that worker, now replaced)."""
    [worker] = client.run(os.getpid)
    assert _within(30, lambda: main(["sweep", "--scheduler", local.scheduler_address, "--seeds", "6", "--steps", "40",
                                     "--configs", "f32-heap", "--backend", backend, "--run-timeout", "0.5",
                                     "--out", str(out)])) == 1
    client.wait_for_workers(1, timeout=30)
    assert worker not in client.run(os.getpid)          # killed, and started again
    report = json.loads((out / "report.json").read_text())
    assert report["runs"] == 6 and not report["partial"]        # the other seeds ran, and passed
    failures = {failure["seed"]: failure for failure in report["failures"]}
    ended = set()
    for failure in failures.values():
        stuck = failure["failure"]
        assert (stuck["error"], stuck["op"], failure["minimised"]) == ("RunTimeout", "allocate()", False)
        # At the step its own run reported (not the other thread's): its operations, drawn again here, end at it.
        ops = R.load(Path(failure["replay_file"])).ops
        assert stuck["step"] == len(ops) >= 1 and str(ops[-1]) == "allocate()"
        ended.add(re.search(r"the nanny of worker (\S+) ended that worker process", stuck["message"]).group(1))
    assert ended <= {worker}
    return failures, ended


@needs_distributed
@pytest.mark.slow       # a cluster of its own: about 7 s
def test_two_runs_stuck_at_once_in_one_worker_of_two_threads_are_each_told_before_the_one_kill(backends, tmp_path,
                                                                                              monkeypatch):
    """A worker of two threads runs two sweep tasks at once, each reporting in a row of its own of the
    worker's table. Both stuck in C at once (the GIL released): the nanny tells the sweep of each, at its
    own step, before the one kill of that worker; the other runs pass."""
    import dask
    from distributed import Client, LocalCluster

    from kvstate.stateful.sweeps import watchdog

    monkeypatch.setattr(watchdog, "GRACE_S", 0.2)       # read by the nanny, which runs in this process
    with dask.config.set({"distributed.comm.timeouts.connect": "10s", **KEEP_NANNIES}), \
            LocalCluster(n_workers=1, processes=True, threads_per_worker=2, host="127.0.0.1",
                         dashboard_address="127.0.0.1:0", preload=[str(backends["preload"])]) as local, \
            Client(local, set_as_default=False) as client:
        failures, ended = _stuck_sweep(local, client, "sweep_both_stuck", tmp_path / "both")
    assert set(failures) == BOTH_STUCK_SEEDS
    # Both told by the nanny of the worker that ran them, before it ended that worker: one left untold
    # would have run again on its replacement, stuck again, and been told from there (another address).
    assert len(ended) == 1


class _StuckRuns:
    """Runs in threads of this process (as a worker of several threads runs them), each under
    ``watchdog.guarded`` in a row of a table of its own, stuck (waiting) past their limit (0 unless
    ``limits`` gives it: seconds, or None for none) and grace (0); and a nanny's watch over them, driven
    by hand, pausing ``settle_s`` before a kill, whose reports and kills are recorded (it would kill this
    process)."""

    def __init__(self, monkeypatch, jobs: dict[int, int], on_report=None, limits=None, settle_s: float = 0.0):
        import asyncio
        from types import SimpleNamespace

        from kvstate.stateful.sweeps import nanny_watch, watchdog

        self.asyncio, self.told, self.killed = asyncio, [], []
        self.table = memoryview(bytearray(len(jobs) * watchdog.WIDTH * 8)).cast("d")
        monkeypatch.setattr(watchdog, "_table", None)
        monkeypatch.setattr(watchdog, "_free", [])
        monkeypatch.setattr(watchdog, "GRACE_S", 0.0)
        monkeypatch.setattr(nanny_watch, "SETTLE_S", settle_s)
        monkeypatch.setattr(nanny_watch, "os", SimpleNamespace(kill=lambda pid, sig: self.killed.append((pid, sig))))
        watchdog.use(self.table, range(len(jobs)))
        self.release = {job: threading.Event() for job in jobs}
        self.threads = {}
        for job, step in jobs.items():
            began = threading.Event()

            def run(job=job, step=step, began=began):
                watchdog.begin((limits or {}).get(job, 0.0))
                watchdog.step(step)
                began.set()
                self.release[job].wait(10)

            self.threads[job] = threading.Thread(target=watchdog.guarded, args=(run, job), daemon=True)
            self.threads[job].start()
            assert began.wait(10)
        time.sleep(0.01)        # past their limit and grace

        async def log_event(topic, msg):
            self.told.append(msg)
            if on_report is not None:
                on_report(self, msg)

        self.watch = nanny_watch.StuckRunWatch()
        self.watch.nanny = SimpleNamespace(pid=os.getpid(), worker_address="tcp://127.0.0.1:1",
                                           scheduler=SimpleNamespace(log_event=log_event))
        self.watch.pid, self.watch.table = os.getpid(), self.table

    def returns(self, job: int) -> None:
        self.release[job].set()
        self.threads[job].join(10)

    def check(self) -> None:
        try:
            self.asyncio.run(self.watch.check())
        finally:
            for job in self.threads:
                self.returns(job)


@needs_distributed
@pytest.mark.parametrize("returns", [False, True], ids=["still-stuck", "returned-meanwhile"])
def test_a_nanny_ends_its_worker_only_while_the_overdue_run_still_runs_there(monkeypatch, returns):
    """The nanny tells the sweep, waits for it to cancel the task, then kills its worker: a run that
    returned meanwhile (C code that took just past its grace) left a worker running other tasks, which
    the kill took down for nothing."""
    runs = _StuckRuns(monkeypatch, {7: 3}, on_report=(lambda runs, msg: runs.returns(msg["job"])) if returns else None)
    runs.check()
    assert runs.told == [{"worker": "tcp://127.0.0.1:1", "job": 7, "step": 3}]
    assert runs.killed == ([] if returns else [(os.getpid(), signal.SIGKILL)])


@needs_distributed
def test_a_nanny_tells_every_run_stuck_in_its_worker_before_the_one_kill(monkeypatch):
    """Only the first overdue run of a worker was told: the kill took the others down untold, and Dask ran
    each again on another worker, where it was stuck again and took that worker down in turn."""
    runs = _StuckRuns(monkeypatch, {7: 3, 8: 5})
    runs.check()
    assert sorted((msg["job"], msg["step"]) for msg in runs.told) == [(7, 3), (8, 5)]
    assert runs.killed == [(os.getpid(), signal.SIGKILL)]


@needs_distributed
def test_a_run_of_another_thread_overdue_during_the_pause_before_the_kill_is_told_too(monkeypatch):
    """A worker of two threads: one run overdue, told; another of the same worker overdue while the nanny
    waits for the sweep to cancel the first. The one kill ends both: the second, untold, was run again by
    Dask on another worker, stuck there too. A run of a third thread not overdue (no limit) is not told:
    it runs again elsewhere, as any run of a worker that died."""
    runs = _StuckRuns(monkeypatch, {7: 3, 8: 5, 9: 2}, limits={8: 0.05, 9: None}, settle_s=0.15)
    runs.check()
    assert [(msg["job"], msg["step"]) for msg in runs.told] == [(7, 3), (8, 5)]
    assert runs.killed == [(os.getpid(), signal.SIGKILL)]


GIL_HOLDER = '''"""A worker process of two threads, each running a sweep task in a row of the table at argv[1]:
task 8 in Python (limit argv[2]), task 7 (limit argv[3], "none" for none) sleeping in C holding the
GIL, which stops task 8."""
import ctypes
import importlib.util
import sys
import threading

spec = importlib.util.spec_from_file_location("watchdog", sys.argv[4])     # the module alone: no package to import
watchdog = importlib.util.module_from_spec(spec)
spec.loader.exec_module(watchdog)
watchdog.use(watchdog.table_file(__import__("pathlib").Path(sys.argv[1]), 2), range(2))
began = threading.Event()


def frozen():
    watchdog.begin(float(sys.argv[2]))
    watchdog.step(5)
    began.set()
    while True:
        pass


def holds_the_gil():
    watchdog.begin(None if sys.argv[3] == "none" else float(sys.argv[3]))
    watchdog.step(3)
    print("ready", flush=True)
    ctypes.PyDLL(None).sleep(30)


threading.Thread(target=watchdog.guarded, args=(frozen, 8), daemon=True).start()
began.wait()
watchdog.guarded(holds_the_gil, 7)
'''


@needs_distributed
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads seen through /proc")
@pytest.mark.parametrize("holder", ["past-its-limit", "no-limit"])
def test_a_run_stopped_only_by_c_code_of_another_thread_holding_the_gil_is_not_told_as_stuck(tmp_path, monkeypatch,
                                                                                             holder):
    """A worker of two threads: C code of one run holds the GIL, which stops the other run, in Python, as
    long. Both were past their limit, and both were told as stuck: the other one a RunTimeout of a seed that
    runs clean. Its thread waits for the GIL (it wakes every 5 ms to ask for it): the nanny tells only the
    run that holds it, and the one kill ends both. Where the holder is no late run (here: one without a
    limit), the waiting run is left alone until twice as late as it may be, then told all the same."""
    import asyncio
    from types import SimpleNamespace

    from kvstate.stateful.sweeps import nanny_watch, watchdog

    monkeypatch.setattr(watchdog, "GRACE_S", 0.0)
    monkeypatch.setattr(nanny_watch, "SETTLE_S", 0.0)
    path = tmp_path / "table"
    script = tmp_path / "gil_holder.py"
    script.write_text(GIL_HOLDER)
    frozen_limit = "0" if holder == "past-its-limit" else "0.4"     # seconds: twice as late is 0.8
    child = subprocess.Popen([sys.executable, str(script), str(path), frozen_limit,
                              "0" if holder == "past-its-limit" else "none", watchdog.__file__],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        time.sleep(0.05)            # in C now, the GIL held
        told = []

        async def log_event(topic, msg):
            told.append((msg["job"], msg["step"]))

        watch = nanny_watch.StuckRunWatch()
        watch.nanny = SimpleNamespace(pid=child.pid, worker_address="tcp://127.0.0.1:1",
                                      scheduler=SimpleNamespace(log_event=log_event))
        watch.pid, watch.table = child.pid, watchdog.table_file(path)
        if holder == "no-limit":
            time.sleep(0.45)        # task 8 late: past its limit, not yet twice (0.3 s to spare on a busy machine)
            asyncio.run(watch.check())
            assert told == [] and child.poll() is None
            time.sleep(0.4)         # twice as late as it may be
        asyncio.run(watch.check())
        assert told == ([(7, 3)] if holder == "past-its-limit" else [(8, 5)])
        assert child.wait(5) == -signal.SIGKILL         # the one kill, which ends both
    finally:
        child.kill()
        child.wait()


@needs_distributed
def test_a_worker_whose_nanny_cannot_read_its_table_is_named_so_not_as_one_without_a_nanny(tmp_path, monkeypatch):
    """A worker with a nanny whose watch table could not be made (a temporary folder it cannot write, a
    file of that name another user's) was named on stderr as having no nanny, and told to start one."""
    import asyncio
    import io
    from types import SimpleNamespace

    from kvstate.stateful.sweeps import nanny_watch, watchdog
    from kvstate.stateful.sweeps.cluster import ClusterSession
    from kvstate.stateful.sweeps.fingerprint import fingerprint
    from kvstate.stateful.sweeps.worker_gate import BackendGate

    monkeypatch.setattr(watchdog, "_table", None)
    monkeypatch.setattr(nanny_watch, "table_path", lambda pid: tmp_path / "no-such-folder" / f"watch-{pid}")
    events = []

    async def set_resources(**resources):
        pass

    worker = SimpleNamespace(address="tcp://127.0.0.1:1", nanny="tcp://127.0.0.1:2", status=None,
                             state=SimpleNamespace(nthreads=2), set_resources=set_resources, periodic_callbacks={},
                             log_event=lambda topic, message: events.append((topic, message)))
    gate = BackendGate(S.DEFAULT_BACKEND, fingerprint(S.DEFAULT_BACKEND))
    asyncio.run(gate.setup(worker))
    assert not watchdog.watched()
    said = io.StringIO()
    session = ClusterSession("tcp://127.0.0.1:3", None, None, gate.name, 2, out=said)
    [event] = events
    session.note(event)
    assert session.accepted == ["tcp://127.0.0.1:1"]
    assert "no nanny" not in said.getvalue()
    assert ("worker tcp://127.0.0.1:1 cannot be watched by its nanny: the table it would read, "
            f"{tmp_path / 'no-such-folder'}") in said.getvalue()


@needs_distributed
@pytest.mark.parametrize("nanny", ["maps-it", "another-tmp", "no-watch"])
def test_a_worker_hands_its_table_to_its_nanny_and_is_named_unwatched_unless_it_took_it(tmp_path, monkeypatch,
                                                                                         nanny):
    """The nanny maps the table at the path its worker hands it (through distributed's own ``run`` handler,
    as ``Client.run(nanny=True)``), not at one it derives from its own temporary folder: a worker given
    another TMPDIR was never watched, and nothing said so. A nanny that cannot map it (another temporary
    folder at that path: the file is not there for it) or runs no watch leaves the worker named unwatched,
    saying why, and its runs report nowhere."""
    import asyncio
    import io
    import tempfile
    from types import SimpleNamespace

    from distributed import protocol
    from distributed.worker import run as distributed_run

    from kvstate.stateful.sweeps import nanny_watch, watchdog
    from kvstate.stateful.sweeps.cluster import ClusterSession
    from kvstate.stateful.sweeps.fingerprint import fingerprint
    from kvstate.stateful.sweeps.worker_gate import BackendGate

    monkeypatch.setattr(watchdog, "_table", None)
    monkeypatch.setattr(watchdog, "_free", [])
    monkeypatch.setattr(nanny_watch, "_handover", None, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))          # the worker's temporary folder
    watch = nanny_watch.StuckRunWatch()
    watch.pid = watch.table = None
    watch.nanny = SimpleNamespace(pid=os.getpid(), plugins={} if nanny == "no-watch" else {nanny_watch.TOPIC: watch})
    path = nanny_watch.table_path(os.getpid())

    class NannyComm:        # the worker's rpc to its nanny, answered by distributed's handler in this process
        async def run(self, **message):
            if nanny == "another-tmp":
                path.rename(tmp_path / "seen-by-the-worker-only")
            answer = await distributed_run(watch.nanny, None, **message)
            return protocol.loads(protocol.dumps(answer))       # as it comes back over a comm

    async def set_resources(**resources):
        pass

    events = []
    worker = SimpleNamespace(address="tcp://127.0.0.1:1", nanny="tcp://127.0.0.1:2", status=None,
                             state=SimpleNamespace(nthreads=2), set_resources=set_resources, periodic_callbacks={},
                             rpc=lambda address: NannyComm(),
                             log_event=lambda topic, message: events.append((topic, message)))
    gate = BackendGate(S.DEFAULT_BACKEND, fingerprint(S.DEFAULT_BACKEND))
    asyncio.run(gate.setup(worker))
    said = io.StringIO()
    session = ClusterSession("tcp://127.0.0.1:3", None, None, gate.name, 2, out=said)
    [event] = events
    session.note(event)
    assert session.accepted == ["tcp://127.0.0.1:1"] and not path.exists()
    if nanny == "maps-it":
        assert watchdog.watched() and said.getvalue() == ""
        assert watch.pid == os.getpid() and len(watch.table) == 2 * watchdog.WIDTH       # a row per thread

        def run():          # a task of the worker: the nanny reads what it reports
            watchdog.begin(0.5)
            watchdog.step(4)
            return [(watch.table[base + watchdog.JOB], watch.table[base + watchdog.STEP])
                    for base in range(0, len(watch.table), watchdog.WIDTH) if watch.table[base + watchdog.STARTED]]

        assert watchdog.guarded(run, 11) == [(11.0, 4.0)]
        return
    assert not watchdog.watched() and watch.table is None
    why = ("its nanny cannot map the table" if nanny == "another-tmp" else
           f"its nanny does not run the watch {nanny_watch.TOPIC}")
    assert f"worker tcp://127.0.0.1:1 cannot be watched by its nanny: {why}" in said.getvalue()
    assert "no nanny" not in said.getvalue()


@needs_distributed
@pytest.mark.slow       # a cluster of its own
def test_a_worker_without_a_nanny_is_named_as_unwatched(tmp_path):
    """Nothing outside a worker without a nanny can end it, or start it again: it still gets runs, and
    the sweep says on stderr that a run stuck there in C holds it and the sweep."""
    import io

    from distributed import LocalCluster

    from kvstate.stateful.sweeps.cluster import connect

    said = io.StringIO()
    with LocalCluster(n_workers=1, processes=False, threads_per_worker=1, dashboard_address="127.0.0.1:0") as local:
        with connect(local.scheduler_address, S.DEFAULT_BACKEND, out=said) as session:
            report = S.sweep(range(2), 20, configs_named(["f32-heap"]), S.DEFAULT_BACKEND, session.workers,
                             tmp_path, executor=session.executor, window=session.window, progress=None)
    [worker] = set(session.accepted)
    assert f"worker {worker} has no nanny: a run stuck there in C past --run-timeout cannot be ended" in said.getvalue()
    assert len(report.results) == 2 and all(r.passed for r in report.results)


@needs_distributed
def test_a_lost_scheduler_ends_with_one_line_and_resume_finishes(tmp_path, monkeypatch, capfd):
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    scheduler = _start("dask_scheduler", "--port", str(port))
    worker = _start("dask_worker", address, "--nthreads", "1")
    out = tmp_path / "out"
    try:
        killer = _when_runs(out, 3, lambda: scheduler.send_signal(signal.SIGKILL))
        code = main(["sweep", "--scheduler", address, "--seeds", "10", "--steps", "150", "--configs", "q8-heap",
                     "--out", str(out)])
        killer.join()
    finally:
        for process in (scheduler, worker):
            process.kill()
            process.wait()
    err = capfd.readouterr().err
    assert code == 2
    lost = [line for line in err.splitlines() if line.startswith("kvstate sweep:")]
    assert len(lost) == 1 and f"--resume {out}" in lost[0] and "Traceback" not in err
    assert lost[0].endswith(f"--resume {out} --scheduler {address}"), lost     # not a local resume (review s68, 9)
    partial = json.loads((out / "report.json").read_text())
    finished = len(_journal_runs(out))
    assert partial["partial"] and 3 <= partial["runs"] == finished < 10

    # Resume with the local pool: only the runs the journal lacks run.
    ran = []
    real = S.run_seed
    monkeypatch.setattr(S, "run_seed", lambda *job: ran.append(job[2]) or real(*job))
    assert main(["sweep", "--resume", str(out)]) == 0
    done = json.loads((out / "report.json").read_text())
    assert len(ran) == 10 - finished and not done["partial"]
    assert (done["runs"], done["runs_resumed"]) == (10, finished)
    assert sorted(_journal_runs(out)) == [("q8-heap", seed) for seed in range(10)]


# -- resume after Ctrl-C ---------------------------------------------------------------------

def test_resume_after_ctrl_c_gives_the_uninterrupted_answer(tmp_path, monkeypatch):
    from kvstate.stateful.planted import PLANTED

    configs = configs_named(["f32-heap"])
    with PLANTED["missing_copy_on_write"]():
        whole = S.sweep(range(8), 60, configs, out_dir=tmp_path / "whole", progress=None, in_process=True)
        S.write_reports(whole, tmp_path / "whole")
        ran = []
        real = S.run_seed

        def interrupted_at_the_fifth(*job):
            if len(ran) == 4:
                raise KeyboardInterrupt
            ran.append(job[2])
            return real(*job)

        monkeypatch.setattr(S, "run_seed", interrupted_at_the_fifth)
        with pytest.raises(KeyboardInterrupt):
            S.sweep(range(8), 60, configs, out_dir=tmp_path / "out", progress=None)
        partial = json.loads((tmp_path / "out" / "report.json").read_text())
        assert partial["partial"] and partial["runs"] == 4
        ran.clear()
        monkeypatch.setattr(S, "run_seed", lambda *job: ran.append(job[2]) or real(*job))
        resumed = S.sweep(range(8), 60, configs, out_dir=tmp_path / "out", progress=None, resume=True)
    S.write_reports(resumed, tmp_path / "out")
    assert sorted(ran) == [4, 5, 6, 7]
    assert _failures(tmp_path / "out") == _failures(tmp_path / "whole")
    assert _replays(tmp_path / "out") == _replays(tmp_path / "whole")


def _ctrl_c_as_a_shell_gives_it() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def test_ctrl_c_stops_the_local_pool_and_resume_finishes(tmp_path):
    out = tmp_path / "out"
    backend = tmp_path / "sweep_slow.py"
    backend.write_text(SLOW_BACKEND)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parents[1]),
                                                                      os.environ.get("PYTHONPATH")])),
           "KVSTATE_TEST_SLOW_CACHES": "1"}
    # Runs slowed by sleeping, not by steps: the pool cannot finish all 40 runs (5 s of sleep on
    # two workers) while a loaded machine keeps this test's watcher from sending the signal, however
    # loaded (at 150 steps a run and no sleep it sometimes did, at load 11); the resume, in this
    # process, runs the rest at full speed (at 500 steps a run it cost 10 s of CPU).
    # The child starts with Ctrl-C as a user's shell gives it (default action, unblocked), whatever
    # this test process inherited: in a full run the sweep once ignored the signal and finished.
    sweep = subprocess.Popen([sys.executable, "-m", "kvstate", "sweep", "--seeds", "40", "--steps", "20",
                              "--configs", "f32-heap", "--backend", str(backend), "--workers", "2",
                              "--out", str(out)],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             preexec_fn=_ctrl_c_as_a_shell_gives_it)
    inherited = (signal.getsignal(signal.SIGINT), signal.pthread_sigmask(signal.SIG_BLOCK, []))
    sent = []
    _when_runs(out, 2, lambda: sent.append(len(_journal_runs(out))) or sweep.send_signal(signal.SIGINT)).join()
    _, err = sweep.communicate(timeout=60)
    assert sweep.returncode == 130, (err, f"signal sent after {sent} runs; this process's SIGINT handler and "
                                          f"blocked signals: {inherited}")
    assert "interrupted" in err and f"--resume {out}" in err and "Traceback" not in err
    finished = len(_journal_runs(out))
    assert 2 <= json.loads((out / "report.json").read_text())["runs"] == finished < 40
    assert main(["sweep", "--resume", str(out), "--workers", "1", "--trust-backend"]) == 0
    done = json.loads((out / "report.json").read_text())
    assert (done["runs"], done["runs_resumed"], done["partial"]) == (40, finished, False)


def test_resume_refuses_a_folder_without_a_journal_or_other_arguments(tmp_path, capsys):
    assert main(["sweep", "--resume", str(tmp_path / "nothing")]) == 2
    assert "no sweep to resume" in capsys.readouterr().err
    out = tmp_path / "out"
    assert main(["sweep", "--seeds", "2", "--steps", "10", "--configs", "f32-heap", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["sweep", "--resume", str(out), "--steps", "20"]) == 2
    assert "--steps 10, not 20" in capsys.readouterr().err


def test_the_journal_survives_a_cut_last_line_and_refuses_other_code(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["sweep", "--seeds", "3", "--steps", "10", "--configs", "f32-heap", "--out", str(out)]) == 0
    journal = out / "runs.jsonl"
    lines = journal.read_text().splitlines()
    journal.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])      # killed while writing the last run
    assert main(["sweep", "--resume", str(out)]) == 0
    assert json.loads((out / "report.json").read_text())["runs_resumed"] == 2
    assert sorted(_journal_runs(out)) == [("f32-heap", seed) for seed in range(3)]

    plan = json.loads(lines[0])
    plan["fingerprint"]["numpy"] = "0.0.1"                              # swept elsewhere, with other code
    journal.write_text(json.dumps(plan) + "\n" + "\n".join(lines[1:3]) + "\n")
    capsys.readouterr()
    assert main(["sweep", "--resume", str(out)]) == 2
    err = capsys.readouterr().err
    assert "other code" in err and "numpy" in err and "0.0.1" in err
    import numpy        # the journal's value first, this machine's as "here" (they were swapped: review s68, 4)
    assert f"numpy '0.0.1' (here {numpy.__version__!r})" in err, err


def test_without_distributed_the_error_names_the_extra(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "distributed", None)        # as if it were not installed
    assert main(["sweep", "--scheduler", "tcp://127.0.0.1:1", "--seeds", "1", "--out", str(tmp_path)]) == 2
    assert "pip install 'kvstate[cluster]'" in capsys.readouterr().err


def _listening(answer: bytes | None):
    """A loopback TCP service that never answers (``answer`` None) or answers every connection with
    ``answer`` (an HTTP server's error, say), as a wrong --scheduler port would; its address."""
    server = socket.create_server(("127.0.0.1", 0))
    held = []

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)
            if answer is not None:
                with suppress(OSError):
                    conn.recv(4096)
                    conn.sendall(answer)
    threading.Thread(target=serve, daemon=True).start()
    return f"tcp://127.0.0.1:{server.getsockname()[1]}", server


def test_a_service_that_is_not_a_scheduler_is_named_not_waited_on(tmp_path, capsys):
    """From the sweeps review (s68, 1 and 2): a port that accepts and never answers (a dashboard's) hung the
    sweep for good, the Client's timeout bounding only the connection; an HTTP server's answer came out as
    "MemoryError: Unable to allocate 3.07 EiB", then the failed Client's 60 s close and a traceback."""
    from kvstate.spec.errors import SweepError
    from kvstate.stateful.sweeps.cluster import answers_as_scheduler

    silent, server = _listening(None)
    started = time.monotonic()
    with pytest.raises(SweepError, match=r"did not answer as a Dask scheduler within 1 s"):
        answers_as_scheduler(silent, 1.0)
    assert time.monotonic() - started < 10
    server.close()
    http, server = _listening(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
    started = time.monotonic()
    assert main(["sweep", "--scheduler", http, "--seeds", "1", "--steps", "5", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"the service at {http} is not a Dask scheduler" in err and "MemoryError: Unable" not in err, err
    assert "Traceback" not in err and time.monotonic() - started < 20, err
    server.close()


def test_a_scheduler_address_with_a_password_is_refused_without_printing_it(tmp_path, capsys, monkeypatch):
    """From the sweeps review (s68, 5): ``tcp://user:SECRET@host:port`` was echoed whole, in the refusal and
    in the parser's error quoted after it, into a CI job's log."""
    for given in ("tcp://alice:PWSECRET789@127.0.0.1:1", "tcp://bob:PWSECRET789@nonsense"):
        assert main(["sweep", "--scheduler", given, "--seeds", "1", "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert "PWSECRET789" not in err and "user and password" in err, err
    monkeypatch.setenv("KVSTATE_SCHEDULER", "tcp://bob:ENVSECRET321@127.0.0.1:18786")
    assert main(["sweep", "--seeds", "1", "--out", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert "ENVSECRET321" not in err and "user and password" in err, err


def test_a_resume_command_names_the_scheduler_as_it_was_given(monkeypatch):
    """The hint after a Dask sweep stopped resumed on the local pool (no --scheduler: the sweeps review,
    s68, 9); a scheduler from $KVSTATE_SCHEDULER is named by the variable, not spelled out in a log."""
    monkeypatch.delenv("KVSTATE_SCHEDULER", raising=False)
    assert S.scheduler_option(None) == ""
    assert S.scheduler_option("tcp://10.0.0.7:8786") == " --scheduler tcp://10.0.0.7:8786"
    monkeypatch.setenv("KVSTATE_SCHEDULER", "tcp://10.0.0.7:8786")
    assert S.scheduler_option("tcp://10.0.0.7:8786") == ' --scheduler "$KVSTATE_SCHEDULER"'
    assert S.scheduler_option("inproc://10.0.0.7/1/2") == ""      # a cluster inside the stopped process


def test_the_scheduler_probe_works_where_an_event_loop_runs_already():
    """The final review (s68, F2): the probe's ``asyncio.run`` refused to start inside a running loop (a
    notebook, async code), and its RuntimeError read as "not a Dask scheduler"; it runs on a loop of its own."""
    import asyncio

    from distributed import LocalCluster

    from kvstate.stateful.sweeps.cluster import answers_as_scheduler

    with LocalCluster(n_workers=0, processes=False, protocol="tcp", dashboard_address=None, scheduler_port=0) as cluster:
        async def notebook_cell():
            answers_as_scheduler(cluster.scheduler_address, 10)
            return "asked"
        assert asyncio.run(notebook_cell()) == "asked"
