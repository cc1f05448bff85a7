"""``kvstate conform --workers N``: configurations checked in worker processes, the same verdicts."""

from __future__ import annotations

import multiprocessing
import textwrap
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import _ExecutorManagerThread
from pathlib import Path

import pytest

from kvstate.cli import main
from kvstate.stateful.configs import machine_configs
from kvstate.stateful.conform_pool import _ended_if_stopped, tasks

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _table_rows(out: str) -> dict[str, list[str]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("configuration "))
    rows = {}
    for line in lines[start + 2:]:
        if not line.strip():
            break
        cells = line.split()
        rows[cells[0]] = cells[1:-3]       # the statuses (steps, checks and seconds dropped)
    return rows


def test_workers_give_the_verdicts_of_one_process(capsys):
    backend = str(EXAMPLES / "listcache.py")
    checks = ["--check", "fork isolation", "--check", "prefix edges", "--examples", "5", "--steps", "5"]
    assert main(["conform", backend, "--workers", "2", *checks]) == 0
    spread = _table_rows(capsys.readouterr().out)
    assert main(["conform", backend, "--workers", "1", *checks]) == 0
    assert spread == _table_rows(capsys.readouterr().out) and len(spread) == 3


def test_a_failure_in_a_worker_is_reported_with_its_counterexample(capsys):
    assert main(["conform", str(EXAMPLES / "broken_sharing.py"), "--workers", "2", "--check", "fork isolation"]) == 1
    out = capsys.readouterr().out
    assert "fork isolation: FAIL" in out and "invariant 4" in out


def test_a_worker_that_dies_fails_its_configuration_by_name(tmp_path, capsys):
    path = tmp_path / "dies.py"
    path.write_text(textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(EXAMPLES)!r})
        from listcache import ListCache, ListContext, factory as working

        class Context(ListContext):
            def fork(self):
                os._exit(3)          # takes the whole process down

        class Cache(ListCache):
            context_class = Context

        def factory(config):
            return Cache(config)
        factory.configs = working.configs[:2]
    """))
    assert main(["conform", str(path), "--workers", "2", "--check", "fork isolation"]) == 1
    assert "worker process running this configuration died" in capsys.readouterr().out


def test_a_dying_worker_fails_only_its_own_configuration_the_others_get_their_verdicts(tmp_path, capsys):
    """One worker's death broke the pool, and every task not finished by then (f32-heap's, running
    beside it; q8-heap's, never started) read "the worker process running this configuration died".
    Now the task still running is run again alone, the one never started in a fresh pool, and only
    f16-heap, whose worker dies again alone, fails."""
    path = tmp_path / "f16_dies.py"
    path.write_text(textwrap.dedent(f"""
        import multiprocessing, os, sys, time
        sys.path.insert(0, {str(EXAMPLES)!r})
        from listcache import ListCache, ListContext, factory as working

        class Context(ListContext):
            def fork(self):
                os._exit(3)          # takes the whole process down

        class Dying(ListCache):
            context_class = Context

        slow = set()
        def factory(config):
            if config == working.configs[1]:
                return Dying(config)
            if config not in slow and multiprocessing.parent_process():   # in a worker: still running, or queued,
                slow.add(config)                                          # when f16-heap's worker dies
                time.sleep(0.5)
            return ListCache(config)
        factory.configs = working.configs
    """))
    assert main(["conform", str(path), "--workers", "2", "--check", "fork isolation"]) == 1
    out = capsys.readouterr().out
    assert _table_rows(out) == {"f32-heap": ["pass", "-"], "f16-heap": ["-", "FAIL"], "q8-heap": ["pass", "-"]}, out
    assert out.count("worker process running this configuration died") == 1 and "f16-heap / worker: FAIL" in out


def test_workers_must_be_a_positive_int_or_auto(capsys):
    for value in ("0", "two"):
        assert main(["conform", "--workers", value]) == 2
        assert "--workers" in capsys.readouterr().err


def test_tasks_hand_out_every_lockstep_then_every_seeded_then_the_rest():
    """Longest first, so the last task to finish is a short one (one task per configuration left the
    slowest configuration running alone at the end)."""
    configs = machine_configs()[:3]
    handed = tasks(configs, ["fork isolation", "seeded", "lockstep", "races"])
    assert [(config.name, checks) for config, checks in handed] == (
        [(config.name, ["lockstep"]) for config in configs] + [(config.name, ["seeded"]) for config in configs]
        + [(config.name, ["fork isolation", "races"]) for config in configs])
    assert tasks(configs, ["fork isolation"]) == [(config, ["fork isolation"]) for config in configs]


def test_an_interrupt_leaves_no_pool_thread_running():
    """A pool's manager thread left running when Ctrl-C went on closed its wake-up pipe while the
    interpreter's exit hook wrote to it: now and then an ``OSError: Bad file descriptor`` traceback
    followed "kvstate conform: interrupted" (CI, 2026-12-07)."""
    with pytest.raises(KeyboardInterrupt):
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool, \
                _ended_if_stopped(pool):
            running = pool.submit(time.sleep, 60)
            pool.submit(time.sleep, 60)
            time.sleep(0.5)
            raise KeyboardInterrupt
    assert running.done()
    assert [t for t in threading.enumerate() if isinstance(t, _ExecutorManagerThread)] == []
    assert multiprocessing.active_children() == []
