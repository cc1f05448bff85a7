"""A backend stuck in C code that holds the GIL ends the ``kvstate`` command, named, instead of hanging it.

Such a factory or import stopped every thread of the command (its waits, its timers, its SIGTERM
handler): ``kvstate sweep --time-limit 3`` and ``kvstate conform`` hung for good, printing nothing
(review 4 of session 66). ``ctypes.PyDLL`` calls C without letting the GIL go, as such a backend does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.skipif(os.name != "posix" or not sys.platform.startswith("linux"),
                                reason="the watcher waits on a pipe with select; libc's sleep through PyDLL")

# The command itself (``main()`` reading sys.argv), with a short grace so the test waits ~1 s, not 5.
COMMAND = textwrap.dedent("""
    import sys
    from kvstate.stateful import held_interpreter
    held_interpreter.GRACE_S = 0.5
    from kvstate.cli import main
    sys.exit(main())
""")

STUCK_FACTORY = textwrap.dedent("""
    import ctypes
    from kvstate.impl.numpy import factory as numpy_factory

    def factory(config):
        ctypes.PyDLL(None).sleep(60)     # C code holding the GIL
        return numpy_factory(config)
""")


def run(args: list[str], cwd, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", COMMAND, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    return done, time.monotonic() - started


@pytest.mark.parametrize("command", ["conform", "sweep"])
def test_a_factory_holding_the_gil_ends_the_command_named(tmp_path, command):
    (tmp_path / "stuck.py").write_text(STUCK_FACTORY)
    args = [command, "stuck.py", "--time-limit", "0.5"] if command == "conform" else \
        [command, "--seeds", "1", "--backend", "stuck.py", "--time-limit", "0.5", "--out", str(tmp_path / "out")]
    done, took = run(args, tmp_path)
    assert done.returncode in (-signal.SIGTERM, -signal.SIGKILL), (done.returncode, done.stderr)
    assert "the backend's factory or its first cache did not finish within 0.5 s" in done.stderr
    assert "C code holds the interpreter" in done.stderr
    assert took < 30, "ended well before the factory's 60 s call returned"
    assert not (tmp_path / "out").exists()       # the sweep had written nothing yet


def test_a_conformance_worker_holding_the_gil_fails_its_configuration_by_name(tmp_path):
    """With workers, a check stuck in C stopped its worker process past every limit of its own, and the
    command waited on it for good; the watcher ends the worker, which the pool reports as the
    configuration's failure (``worker``) after running the task again alone."""
    (tmp_path / "stuck_later.py").write_text(textwrap.dedent("""
        import ctypes
        import multiprocessing
        from kvstate.impl.numpy import factory as numpy_factory
        from kvstate.stateful import held_interpreter
        held_interpreter.GRACE_S = 0.3       # imported in each worker: its watcher's grace

        def factory(config):
            if multiprocessing.parent_process() is not None:     # a worker's: the command's own are made
                ctypes.PyDLL(None).sleep(60)
            return numpy_factory(config)
    """))
    done, took = run(["conform", "stuck_later.py", "--configs", "f32-heap,f16-heap", "--check", "lockstep",
                      "--time-limit", "0.5", "--workers", "2"], tmp_path)
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    assert "the lockstep check of f32-heap did not finish within 0.5 s" in done.stderr
    assert done.stdout.count("the worker process running this configuration died") == 2
    assert took < 40


def test_a_backend_that_ends_the_process_at_import_is_said_to_have(tmp_path):
    """``os._exit(0)`` at import ended ``kvstate conform`` with status 0 and nothing printed: a pass to a CI job.
    Now it is a failure, said in one line naming the stage (the watcher, told, adds nothing)."""
    (tmp_path / "gone.py").write_text("import os\nos._exit(0)\n")
    done, _took = run(["conform", "gone.py", "--config", "f32-heap", "--workers", "1"], tmp_path)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip() == ("kvstate: os._exit(0) was called during importing backend 'gone.py', so the command "
                                   "ended before a verdict was reached: exit status 1")


EXIT_IN_A_CHECK = textwrap.dedent("""
    import os
    from kvstate.impl.numpy import factory as numpy_factory

    def factory(config):
        cache = numpy_factory(config)
        cache.match = lambda tokens: os._exit(0)
        return cache
""")


def test_a_backend_that_ends_the_process_in_a_check_fails_the_command(tmp_path):
    """Part way through a check, ``os._exit(0)`` ended conform with status 0 (the watcher said no verdict was
    reached, but a CI job reads the status): now status 1, naming the check it ended."""
    (tmp_path / "gone.py").write_text(EXIT_IN_A_CHECK)
    done, _took = run(["conform", "gone.py", "--config", "f32-heap", "--check", "prefix edges", "--workers", "1"],
                      tmp_path)
    assert done.returncode == 1, done.stderr
    assert "os._exit(0) was called during the prefix edges check of f32-heap" in done.stderr
    assert "before it could report" not in done.stderr         # the watcher, told, says nothing more


def test_an_exit_after_the_verdict_keeps_it_and_a_forked_child_keeps_its_own():
    """Past the verdict an ``os._exit(0)`` (a thread a backend left, an exit hook) ends with the command's status;
    a process forked from the command ends through the same function with the status it asks for."""
    script = textwrap.dedent("""
        import os, sys
        from kvstate.stateful import held_interpreter as h
        h.enable()
        child = os.fork()
        if child == 0:
            os._exit(0)
        assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0
        h.settled(1 if sys.argv[1] == "failed" else 0)
        os._exit(0)
    """)
    for verdict, status in (("failed", 1), ("passed", 0)):
        done = subprocess.run([sys.executable, "-c", script, verdict], capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stderr) == (status, ""), verdict


def test_a_c_call_that_holds_the_gil_for_seconds_and_returns_is_a_timeout_not_an_end(tmp_path):
    """A final review (s67): with a grace of 5 s the watcher ended a correct conform whose first cache spent 6 s
    in one C call (the header's observation, under what was left of one shared budget). A stage now has its
    limit again, and 30 s at least, past its limit: such a call returns and the stage reports its own timeout."""
    (tmp_path / "slow.py").write_text(textwrap.dedent("""
        import ctypes
        from kvstate.impl.numpy import factory as numpy_factory
        made = []

        def factory(config):
            if not made:
                ctypes.PyDLL(None).sleep(3)     # the first cache: 3 s in C holding the GIL, then on
            made.append(config)
            return numpy_factory(config)
    """))
    # grace 0.5 s, as the other tests here: the stage, limit 2 s, is ended only past 2 + max(0.5, 2) s
    done, _took = run(["conform", "slow.py", "--time-limit", "2", "--config", "f32-heap", "--check", "fork isolation",
                       "--workers", "1"], tmp_path)
    assert done.returncode == 0 and "C code holds the interpreter" not in done.stderr, (done.returncode, done.stderr)
    assert "fork isolation" in done.stdout


def test_a_library_caller_is_never_ended_and_the_watcher_goes_with_the_command(tmp_path):
    """Only the command's own process is watched (``enable``); the watcher ends when the command does."""
    script = textwrap.dedent("""
        import ctypes, time
        from kvstate.stateful import held_interpreter as h
        h.GRACE_S = 0.2
        with h.guarding(0.1, "not enabled"):         # a library caller's stage: nobody watches it
            ctypes.PyDLL(None).usleep(600_000)
        assert h._watcher is None
        h.enable()
        with h.guarding(5, "a stage that ends in time"):
            time.sleep(0.3)
        print(h._watcher.pid, flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    watcher = int(done.stdout)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(watcher, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    pytest.fail(f"the watcher {watcher} outlived its command")


@pytest.mark.parametrize("workers", ["1", "2"])
def test_ctrl_c_stops_conform_at_once_in_one_line(tmp_path, workers):
    """A terminal's Ctrl-C (SIGINT to the whole group) printed a KeyboardInterrupt traceback, one more
    from each watcher, and with workers took 15-26 s: the pool waited for the checks already running."""
    # Ctrl-C's Python handler, whatever this test's runner left SIGINT at (ignored, in some)
    launch = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
              "sys.argv = ['kvstate', *sys.argv[1:]]; runpy.run_module('kvstate', run_name='__main__')")
    command = subprocess.Popen([sys.executable, "-c", launch, "conform", "--configs", "f32-heap,q8-heap,f16-heap",
                                "--workers", workers], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    # the backend loaded and checks running, in the workers where there are some (an earlier Ctrl-C
    # must end the same way)
    time.sleep(4 if workers == "2" else 2)
    stopped = time.monotonic()
    os.killpg(command.pid, signal.SIGINT)
    _out, err = command.communicate(timeout=60)
    assert command.returncode == 130, err
    assert time.monotonic() - stopped < 5
    assert err.strip().splitlines()[-1] == "kvstate conform: interrupted" and "Traceback" not in err, err


def test_a_sweep_run_in_process_that_ends_the_process_fails_the_command(tmp_path):
    """``sweep --in-process`` runs the backend in the command's own process, outside any guarded stage:
    its ``os._exit(0)`` ended the sweep with status 0 and no word."""
    (tmp_path / "gone.py").write_text(EXIT_IN_A_CHECK)
    done, _took = run(["sweep", "--seeds", "1", "--backend", "gone.py", "--in-process", "--configs", "f32-heap",
                       "--out", str(tmp_path / "out")], tmp_path)
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip().splitlines()[-1] == ("kvstate: os._exit(0) was called (by the backend, or code it ran), "
                                                    "so the command ended before a verdict was reached: exit status 1")
