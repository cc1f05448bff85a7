"""Issue 13, defect 11: every bad CLI argument or file is one line on stderr and exit 2; nothing hangs;
a replay file does not import code it names."""

from __future__ import annotations

import json
import time

import pytest

from helpers import LAYOUT

from kvstate.cli import main
from kvstate.spec.protocol import Config
from kvstate.stateful import ops as O
from kvstate.stateful import replay as R


def one_line_exit_2(capsys, argv, within: float | None = None) -> str:
    started = time.monotonic()
    status = main(argv)
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 2, (status, err)
    assert len(lines) == 1 and "Traceback" not in err, err
    if within is not None:
        assert elapsed < within, f"took {elapsed:.1f} s"
    return lines[0]


def replay_file(tmp_path, backend="kvstate.impl.numpy", edit=None, name="r.json"):
    replay = R.Replay(backend, Config(LAYOUT, 4, "f32", 0, 4), 0,
                      [O.Allocate(), O.Extend("c1", (1, 2), 3), O.Truncate("c1", 1)])
    data = R.to_json(replay)
    if edit:
        edit(data)
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def backend_module(tmp_path, name: str, body: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(body)
    return str(path)


GOOD_FACTORY = "from kvstate.impl.numpy import factory\n"


# -- replay ----------------------------------------------------------------------------------

def test_a_good_replay_runs(tmp_path, capsys):
    assert main(["replay", replay_file(tmp_path)]) == 0


@pytest.mark.parametrize("edit", [
    lambda d: d["config"].update(page_tokens=0),
    lambda d: d["config"].update(precision="f64"),
    lambda d: d["config"].update(max_entries=0),
    lambda d: d["config"].update(arena_pages=-1),
    lambda d: d["ops"][1].update(seed="x"),
    lambda d: d["ops"][1].update(seed=1.5),
    lambda d: d["ops"][2].update(n="1"),
    lambda d: d["ops"][1].update(tokens=[1, "2"]),
    lambda d: d["ops"][1].update(ctx=5),
], ids=["page_tokens 0", "f64", "max_entries 0", "arena -1", "seed str", "seed float", "n str", "token str",
        "ctx int"])
def test_bad_replay_fields_are_file_errors(tmp_path, capsys, edit):
    one_line_exit_2(capsys, ["replay", replay_file(tmp_path, edit=edit)])


def _snapshot_ops(name: str, restore: str | None = None):
    def edit(data):
        data["ops"].append({"op": "snapshot", "ctx": "c1", "name": name})
        if restore is not None:
            data["ops"].append({"op": "restore", "name": restore})
    return edit


@pytest.mark.parametrize("how", ["absolute", "up", "separator", "empty", "nul", "long"])
def test_a_snapshot_name_that_is_not_a_plain_name_is_a_file_error_and_writes_nothing(tmp_path, capsys, how):
    # The engine's snapshot goes to the run's folder under its name: a replay file (data) must not
    # make it write, or read, a file elsewhere, such as a user's own snapshot.
    victim = tmp_path / "mine" / "session.kvs"
    victim.parent.mkdir()
    victim.write_bytes(b"the user's snapshot")
    name = {"absolute": str(victim)[:-len(".kvs")], "up": "../../mine/session", "separator": "mine/session",
            "empty": "", "nul": "s\x001", "long": "s" * 65}[how]
    assert "snapshot name" in one_line_exit_2(capsys, ["replay", replay_file(tmp_path, edit=_snapshot_ops(name))])
    assert victim.read_bytes() == b"the user's snapshot"
    with pytest.raises(ValueError, match="snapshot name"):   # the ops refuse it, wherever they come from
        O.op_from_json({"op": "restore", "name": name})


def test_a_restore_of_a_name_never_snapshotted_is_a_file_error_not_a_finding(tmp_path, capsys):
    line = one_line_exit_2(capsys, ["replay", replay_file(tmp_path, edit=_snapshot_ops("s1", restore="s2"))])
    assert "'s2', which this run has not snapshotted" in line
    assert main(["replay", replay_file(tmp_path, edit=_snapshot_ops("s1", restore="s1"), name="ok.json")]) == 0


@pytest.mark.parametrize("content", [b"\xff\xfe\x00garbage", b"[" * 100_000, b"{}", b""],
                         ids=["not utf-8", "deeply nested", "empty object", "empty"])
def test_unreadable_replay_files(tmp_path, capsys, content):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    one_line_exit_2(capsys, ["replay", str(path)])


def test_an_oversized_replay_file_is_refused_by_name(tmp_path, capsys, monkeypatch):
    path = replay_file(tmp_path)
    monkeypatch.setattr(R, "MAX_REPLAY_BYTES", 100)
    assert "MAX_REPLAY_BYTES" in one_line_exit_2(capsys, ["replay", path])


def test_replay_does_not_import_the_backend_a_file_names(tmp_path, capsys):
    marker = tmp_path / "ran"
    module = backend_module(tmp_path, "evil_backend",
                            f"open({str(marker)!r}, 'w').close()\n" + GOOD_FACTORY)
    path = replay_file(tmp_path, backend=module)
    assert "--backend" in one_line_exit_2(capsys, ["replay", path])
    assert not marker.exists()
    assert main(["replay", path, "--trust-backend"]) == 0       # said so explicitly
    assert marker.exists()


def test_replay_with_a_named_backend_runs(tmp_path, capsys):
    path = replay_file(tmp_path, backend="somewhere.else:factory")
    assert main(["replay", path, "--backend", "kvstate.impl.numpy"]) == 0


# -- conform -----------------------------------------------------------------------------------

def test_conform_with_non_list_configs(tmp_path, capsys):
    module = backend_module(tmp_path, "configs_int", GOOD_FACTORY + "factory = lambda c, f=factory: f(c)\n"
                                                                   "factory.configs = 5\n")
    one_line_exit_2(capsys, ["conform", module])


@pytest.mark.parametrize("flag", [["--examples", "-1"], ["--steps", "0"], ["--time-limit", "-3"],
                                  ["--time-limit", "1e308"], ["--steps", "100001"]])
def test_conform_bad_numbers(capsys, flag):
    line = one_line_exit_2(capsys, ["conform", *flag])
    assert line.startswith(f"kvstate conform: {flag[0]} must be"), line      # 1e308 read as the backend failing to load


def test_sweep_steps_stop_where_a_replay_file_can_still_be_replayed(capsys):
    """From the sweeps review (s68, 3): ``--steps 150000`` saved a failure at step 149,412 whose printed
    ``replay:`` command refused the file (more than MAX_REPLAY_OPS operations)."""
    from kvstate.stateful.replay_bounds import MAX_REPLAY_OPS

    line = one_line_exit_2(capsys, ["sweep", "--steps", str(MAX_REPLAY_OPS + 1), "--seeds", "1"])
    assert line == (f"kvstate sweep: --steps must be a finite number at least 1 and at most {MAX_REPLAY_OPS}, "
                    f"got {MAX_REPLAY_OPS + 1}"), line


@pytest.mark.parametrize("argv", [["conform", "--examples", "1.5"], ["conform", "--profile", "x\nTraceback"],
                                  ["replay"], ["nonesuch"], ["sweep", "--seeds", "x"]])
def test_an_argument_argparse_refuses_is_one_line_too(capsys, argv):
    """argparse printed its usage block (four lines for conform) before the error."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.splitlines()) == 1 and err.startswith("kvstate"), err


def test_conform_on_a_module_that_hangs_at_import(tmp_path, capsys):
    module = backend_module(tmp_path, "hangs_at_import", "import threading\nthreading.Event().wait()\n")
    one_line_exit_2(capsys, ["conform", module, "--time-limit", "1"], within=20)


def test_conform_on_a_module_that_exits_at_import(tmp_path, capsys):
    module = backend_module(tmp_path, "exits_at_import", "import sys\nsys.exit(0)\n")
    assert "sys.exit" in one_line_exit_2(capsys, ["conform", module])


# -- sweep ---------------------------------------------------------------------------------------

def test_sweep_with_a_raising_factory(tmp_path, capsys):
    module = backend_module(tmp_path, "raising_factory", "def factory(config):\n    raise RuntimeError('no')\n")
    one_line_exit_2(capsys, ["sweep", "--seeds", "1", "--steps", "5", "--backend", module,
                             "--out", str(tmp_path / "out")])


def test_sweep_with_a_hanging_factory(tmp_path, capsys):
    module = backend_module(tmp_path, "hanging_factory",
                            "import threading\ndef factory(config):\n    threading.Event().wait()\n")
    one_line_exit_2(capsys, ["sweep", "--seeds", "1", "--steps", "5", "--backend", module, "--time-limit", "1",
                             "--out", str(tmp_path / "out")], within=20)


def test_sweep_out_naming_a_file(tmp_path, capsys):
    out = tmp_path / "a-file"
    out.write_text("")
    one_line_exit_2(capsys, ["sweep", "--seeds", "1", "--steps", "5", "--out", str(out)])


# -- stress, spec-check and fuzz --------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["stress", "--store", "nonesuch", "--minutes", "0"],
                                  ["stress", "--scenario", "nonesuch", "--minutes", "0"],
                                  ["stress", "--scale", "0", "--minutes", "0"],
                                  ["spec-check", "--no-crosshair", "--page-tokens", "0"],
                                  ["spec-check", "--no-crosshair", "--contexts", "-1"],
                                  ["spec-check", "--crosshair-timeout", "-1", "--depth", "1"],
                                  ["fuzz", "--random", "-1"], ["fuzz", "--garbage", "-5"], ["fuzz", "--files", "-1"]])
def test_stress_spec_check_and_fuzz_bad_arguments(capsys, argv):
    one_line_exit_2(capsys, argv)


# A negative seed failed inside the race and read as "the race reproduced" (FAILED, exit 1); --threads 0
# or less raced nothing and read as a pass (exit 0); an empty --configs ran every configuration.
@pytest.mark.parametrize("argv, named", [
    (["race", "fork_storm", "--config", "f32-heap", "--seed", "-1"], "--seed"),
    (["race", "fork_storm", "--config", "f32-heap", "--threads", "0"], "--threads"),
    (["race", "fork_storm", "--config", "f32-heap", "--threads", "-3"], "--threads"),
    (["race", "fork_storm", "--config", "f32-heap", "--threads", "100000"], "--threads"),
    (["stress", "--minutes", "0", "--seed", "-1", "--store", "numpy", "--scenario", "fork_storm"], "--seed"),
    (["conform", "--configs", "", "--check", "bad input"], "no configuration ''"),
    (["sweep", "--seeds", "1", "--configs", "", "--steps", "5"], "no configuration ''")])
def test_race_stress_and_configs_arguments_that_run_nothing_meant_are_refused(capsys, tmp_path, argv, named):
    out = ["--out", str(tmp_path / "out")] if argv[0] == "sweep" else []
    assert named in one_line_exit_2(capsys, argv + out, within=20)
    assert not (tmp_path / "out").exists()


def test_spec_check_holds_a_backend_to_no_scope_it_does_not_declare(capsys):
    """``examples/listcache.py`` passes conform in its heap configurations; the default scope's 3-slot
    arena is none of them, so it is refused (exit 2) as a replay is, not reported as invariant 3 broken."""
    from pathlib import Path

    listcache = str(Path(__file__).resolve().parent.parent / "examples" / "listcache.py")
    line = one_line_exit_2(capsys, ["spec-check", "--no-crosshair", "--depth", "1", "--backend", listcache])
    assert "does not declare scope f32-arena3" in line and "arena_pages 0 where the scope has 3" in line, line
    assert main(["spec-check", "--no-crosshair", "--depth", "1", "--arena", "0", "--semantics", "entry",
                 "--backend", listcache]) == 0


def test_spec_check_refuses_an_undeclared_scope_before_crosshair_runs(capsys, monkeypatch):
    """From a review: the refusal came only after CrossHair's conditions had all been tried (minutes)."""
    from pathlib import Path

    from kvstate.stateful import spec_check

    ran = []
    monkeypatch.setattr(spec_check, "crosshair", lambda timeout: ran.append(timeout) or 0)
    listcache = str(Path(__file__).resolve().parent.parent / "examples" / "listcache.py")
    one_line_exit_2(capsys, ["spec-check", "--depth", "1", "--backend", listcache])
    assert ran == []


@pytest.mark.parametrize("where", ["folder", "file/below"])
def test_spec_check_refuses_a_replay_out_it_cannot_write_before_the_search(capsys, monkeypatch, tmp_path, where):
    """From a review: a folder was found only at the write, after the whole search, and the violation
    it found (exit 1) became an IsADirectoryError, exit 2."""
    from kvstate.stateful import spec_check

    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(spec_check, "explore", lambda *args, **kwargs: pytest.fail("the search ran"))
    line = one_line_exit_2(capsys, ["spec-check", "--no-crosshair", "--depth", "1",
                                    "--replay-out", str(tmp_path / where)])
    assert "--replay-out" in line and ("is a folder" if where == "folder" else "which is not a folder") in line


def test_spec_check_keeps_its_violation_verdict_when_the_trace_cannot_be_written(capsys, monkeypatch, tmp_path):
    """A --replay-out made unwritable during the search: the violation is still exit 1, the write's
    failure one line beside it (it was exit 2, the verdict lost)."""
    from types import SimpleNamespace

    from kvstate.stateful import spec_check

    found = SimpleNamespace(violation=object(), complete=True, per_depth=[1], summary=lambda: "a violation")
    monkeypatch.setattr(spec_check, "explore", lambda *args, **kwargs: found)

    def unwritable(path, *args):
        raise IsADirectoryError(21, "Is a directory", path)
    monkeypatch.setattr(spec_check, "write_replay", unwritable)
    assert main(["spec-check", "--no-crosshair", "--depth", "1", "--semantics", "entry",
                 "--replay-out", str(tmp_path / "trace.json")]) == 1
    assert "the shortest trace could not be written" in capsys.readouterr().err


@pytest.mark.parametrize("limit", ["0", "-1", "nan", "1e308"])     # 1e308: an OverflowError, blamed on loading
def test_a_replay_time_limit_that_is_no_time_is_the_arguments_fault(tmp_path, capsys, limit):
    line = one_line_exit_2(capsys, ["replay", replay_file(tmp_path), "--time-limit", limit])
    assert line.startswith("kvstate replay: --time-limit must be"), line     # not the backend's, nor a hang


def test_a_replay_page_too_large_to_allocate_is_the_files_fault(tmp_path, capsys):
    def huge_pages(data):
        data["config"].update(page_tokens=2**40, arena_pages=0)
    assert "MAX_REPLAY_PAGE_BYTES" in one_line_exit_2(capsys, ["replay", replay_file(tmp_path, edit=huge_pages)])


# -- replay bounds and time (issue 24, item 8) ----------------------------------------------------

from kvstate.spec.errors import RunTimeout  # noqa: E402
from kvstate.spec.layout import Layout  # noqa: E402
from kvstate.stateful import planted  # noqa: E402
from kvstate.stateful import replay_bounds  # noqa: E402


def extends_file(tmp_path, n: int, layout=LAYOUT, page_tokens=4, tokens=1) -> str:
    ops = [O.Allocate()] + [O.Extend("c1", tuple(range(tokens)), i) for i in range(n)]
    return str(R.save(R.Replay("kvstate.impl.numpy", Config(layout, page_tokens, "f32", 0, 4), 0, ops),
                      tmp_path / "long.json"))


def test_a_replay_with_too_many_operations_is_refused_by_name(tmp_path, capsys, monkeypatch):
    path = extends_file(tmp_path, 20)
    monkeypatch.setattr(replay_bounds, "MAX_REPLAY_OPS", 10)
    assert "MAX_REPLAY_OPS" in one_line_exit_2(capsys, ["replay", path])


def test_a_replay_needing_too_much_memory_is_refused_by_name(tmp_path, capsys, monkeypatch):
    path = extends_file(tmp_path, 20)          # 20 positions of 128 bytes, twice: about 5 KB
    monkeypatch.setattr(replay_bounds, "MAX_REPLAY_MEMORY_BYTES", 4096)
    assert "MAX_REPLAY_MEMORY_BYTES" in one_line_exit_2(capsys, ["replay", path])


def test_a_small_file_asking_for_gigabytes_is_refused_before_any_work(tmp_path, capsys):
    # 64 MiB a position, one-position pages (under MAX_REPLAY_PAGE_BYTES), 16 positions a write:
    # about 1 KB of file asking for 1 GiB per operation.
    path = extends_file(tmp_path, 3, layout=Layout(1024, 64, 128), page_tokens=1, tokens=16)
    assert "MAX_REPLAY_MEMORY_BYTES" in one_line_exit_2(capsys, ["replay", path])


def test_forks_and_closes_count_only_what_is_live():
    ops = [O.Allocate(), O.Extend("c1", (1,) * 10, 0)]
    for i in range(100):
        ops += [O.Fork("c1"), O.Close(f"c{i + 2}")]
    once = R.bounds.peak_bytes(Config(LAYOUT, 4, "f32", 0, 4), ops[:4])
    assert R.bounds.peak_bytes(Config(LAYOUT, 4, "f32", 0, 4), ops) == once


class _CountedReads:
    """Positions read back from engine contexts while planted (every check reads every live one)."""

    def __init__(self, monkeypatch):
        from kvstate.impl import context
        self.positions = 0
        original = context.Context.read

        def read(ctx, *args, **kwargs):
            values, tokens = original(ctx, *args, **kwargs)
            self.positions += len(tokens)
            return values, tokens
        monkeypatch.setattr(context.Context, "read", read)


def test_replay_checking_costs_time_linear_in_the_file(tmp_path, monkeypatch):
    from kvstate.impl.numpy import factory
    n = 300
    recorded = R.load(extends_file(tmp_path, n))
    reads = _CountedReads(monkeypatch)
    assert R.replay(recorded, factory, out=lambda line: None) is None
    # Every-step checking reads n * n / 2 = 45,000 positions; spaced checks a bounded number per token.
    assert reads.positions <= 4 * R.CHECK_BUDGET * n, reads.positions


def test_spaced_checks_still_name_the_first_failing_step(tmp_path):
    from kvstate.impl.numpy import factory
    ops = [O.Allocate()] + [O.Extend("c1", (i,), i) for i in range(150)]
    ops += [O.Fork("c1"), O.Overwrite("c2", 148, (7,), 5)]      # writes into a page c1 shares
    broken_at = len(ops)
    ops += [O.Extend("c1", (i,), i) for i in range(40)]
    with planted.missing_copy_on_write():
        every, _ = R.execute(factory, Config(LAYOUT, 4, "f32", 0, 4), ops)
        spaced, _ = R.spaced_checks(factory, Config(LAYOUT, 4, "f32", 0, 4), ops)
    assert every is not None and every.step == broken_at
    assert spaced is not None and (spaced.step, spaced.signature) == (every.step, every.signature)


def test_replay_honours_its_time_limit(tmp_path):
    """In this process: the run it stops is a backend spinning in the test's own thread. What the
    fired deadline leaves behind is nothing (tests/test_run_deadline.py); it once left a flag up that
    hung the thread-race tests after it, and this test ran in a subprocess to keep them apart."""
    from kvstate.impl.context import Context
    from kvstate.impl.numpy import factory

    class Spinning(Context):
        __slots__ = ()          # the engine's Context has slots: a __class__ swap needs the same layout

        def extend(self, *args):
            _spin()

    def stuck_factory(config):
        cache = factory(config)
        allocate = cache.allocate

        def stuck():
            ctx = allocate()
            ctx.__class__ = Spinning
            return ctx
        cache.allocate = stuck
        return cache
    recorded = R.load(extends_file(tmp_path, 3))
    with pytest.raises(RunTimeout, match="--time-limit"):
        R.replay(recorded, stuck_factory, out=lambda line: None, time_limit=0.5)


def _spin():
    while True:
        pass


def test_replay_says_how_many_steps_it_checked_and_every_step_checks_them_all(tmp_path, capsys):
    path = extends_file(tmp_path, 80)
    assert main(["replay", path]) == 0
    assert "every invariant holds (checked after" in capsys.readouterr().out
    assert main(["replay", path, "--every-step"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "every invariant holds"


def test_spec_checks_arena_option_holds_for_every_semantics_searched():
    """From a review: ``--arena N`` was replaced by the evict search's one slot and the refuse search's
    none, silently (README's overnight example, ``--arena 2``, ran them at 1 and 0)."""
    import argparse

    from kvstate.stateful import spec_check

    parser = argparse.ArgumentParser()
    spec_check.add_arguments(parser)
    given = spec_check.scopes_from(parser.parse_args(["--arena", "2"]))
    assert [scope.arena_pages for scope in given] == [2] * len(spec_check.SEMANTICS)     # every semantics, each at 2
    default = {scope.config().semantics: scope.arena_pages for scope in spec_check.scopes_from(parser.parse_args([]))}
    assert sorted(default.values()) == sorted(spec_check.semantics_scope(name).arena_pages
                                             for name in spec_check.SEMANTICS)       # not given: each its own


def test_spec_check_without_crosshair_is_refused_before_the_search_unless_told_to_skip_it(capsys, monkeypatch):
    """From a review: without CrossHair, ``kvstate spec-check`` printed "skipped" and exited 0, as if
    its first half had passed."""
    from kvstate.stateful import spec_check

    explore, searched = spec_check.explore, []
    monkeypatch.setattr(spec_check, "crosshair_tool", lambda: None)
    monkeypatch.setattr(spec_check, "explore", lambda *a, **k: searched.append(a) or explore(*a, **k))
    line = one_line_exit_2(capsys, ["spec-check", "--depth", "1", "--semantics", "entry"])
    assert "CrossHair is not installed" in line and "--no-crosshair" in line and not searched, line
    assert main(["spec-check", "--no-crosshair", "--depth", "1", "--semantics", "entry"]) == 0 and searched


# From a review (finding 1): the size options had lower bounds only; a large one (a typo) grew memory
# until a bare "MemoryError: ", and a time limit did not bound it (one state's operations were listed
# for seconds before the clock was read).
@pytest.mark.parametrize("argv, named", [
    (["--values", "100000000000"], "--values"), (["--alphabet", "100000000000"], "--alphabet"),
    (["--write", "100000", "--positions", "100000"], "--positions"), (["--write", "65"], "--write"),
    (["--page-tokens", "65"], "--page-tokens"), (["--contexts", "17"], "--contexts"),
    (["--entries", "65"], "--entries"), (["--arena", "65"], "--arena"),
    (["--match", "block", "--block-tokens", "65"], "--block-tokens"), (["--max-pages", "65"], "--max-pages"),
    (["--pool-pages", "65"], "--pool-pages"),
    (["--alphabet", "1024", "--write", "2"], "writes in one state"),    # each in bounds, together too many
    (["--alphabet", "1000000", "--time-limit", "3", "--depth", "2"], "--alphabet"),
])
def test_spec_check_refuses_a_scope_too_large_to_search_before_anything_runs(capsys, monkeypatch, argv, named):
    from kvstate.stateful import spec_check

    ran = []
    monkeypatch.setattr(spec_check, "explore", lambda *a, **k: ran.append(a))
    line = one_line_exit_2(capsys, ["spec-check", "--no-crosshair", *argv], within=5)
    assert named in line and "at most" in line and ran == [], line


@pytest.mark.parametrize("argv", [
    [],                                                                                   # the default scope
    ["--depth", "0", "--contexts", "2", "--positions", "2", "--write", "1", "--entries", "1", "--arena", "2"],
    ["--depth", "0", "--contexts", "3", "--positions", "4", "--time-limit", "36000"],
    ["--depth", "7", "--time-limit", "36000"],
    ["--alphabet", "64", "--write", "2"], ["--write", "64"],        # no write is longer than the positions
    ["--match", "token", "--pool-pages", "2", "--on-full", "refuse"],
])
def test_spec_checks_documented_scopes_are_within_its_bounds(capsys, monkeypatch, argv):
    from kvstate.stateful import spec_check

    monkeypatch.setattr(spec_check, "run_spec_check", lambda args: 0)
    assert main(["spec-check", "--no-crosshair", *argv]) == 0, capsys.readouterr().err


def test_a_write_longer_than_the_positions_is_not_listed(monkeypatch):
    """``--write 64`` is within bounds; every word of each length up to it was listed (2 ** 64 of them)
    although no write longer than ``--positions`` fits."""
    import itertools

    from kvstate.stateful.exhaustive import Scope, operations
    from kvstate.stateful.lockstep import Lockstep
    from kvstate.impl.numpy import factory

    scope, product = Scope(max_write=64), itertools.product

    def words(alphabet, repeat):
        assert repeat <= scope.max_positions, f"words of {repeat} positions listed"
        return product(alphabet, repeat=repeat)

    monkeypatch.setattr(itertools, "product", words)
    lockstep = Lockstep(factory, scope.config())
    lockstep.apply(O.Allocate())
    assert max(len(op.tokens) for op in operations(lockstep, scope) if isinstance(op, O.Extend)) == 3


def test_a_scratch_folder_that_cannot_be_written_is_the_settings_fault_not_the_backends(capsys, monkeypatch):
    """A bad KVSTATE_SCRATCH failed the built-in backend ("the backend raised FileNotFoundError") at its
    first snapshot, and sweeps saved replay files blaming it."""
    monkeypatch.setenv("KVSTATE_SCRATCH", "/nonexistent/kvstate-scratch")
    for argv in (["conform", "--config", "f32-heap", "--check", "lockstep"], ["sweep", "--seeds", "1", "--steps", "5"]):
        assert "KVSTATE_SCRATCH='/nonexistent/kvstate-scratch'" in one_line_exit_2(capsys, argv, within=20)


def test_race_refuses_a_backend_that_does_not_declare_thread_safety(capsys):
    """As stress and conform's races check do (n/a); raced anyway, it was blamed about half the time."""
    line = one_line_exit_2(capsys, ["race", "fork_storm", "--backend", "examples/listcache.py", "--config", "f32-heap"])
    assert "does not declare thread_safe = True" in line


@pytest.mark.parametrize("stem, check", [("numpy", "lockstep"), ("random", "races")])
def test_a_backend_file_named_like_a_module_does_not_replace_it(tmp_path, stem, check):
    """numpy.py (as kvstate names its own backends) replaced numpy for the whole run: the correct backend
    FAILed every check (numpy.random missing); random.py broke NumPy's own import of it."""
    import subprocess
    import sys

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / f"{stem}.py").write_text("from kvstate.impl.numpy import factory\n")
    done = subprocess.run([sys.executable, "-m", "kvstate", "conform", f"mine/{stem}.py", "--config", "f32-heap",
                           "--check", check, "--examples", "3", "--workers", "1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_an_edited_failing_replay_that_passes_is_not_read_as_fixed(tmp_path, capsys):
    """From the sweeps review (s68, 7): one field of a sweep's failing file edited (a start past the end,
    a token of -1) made the operation a refusal, and replay printed "every invariant holds", exit 0: a CI
    job replaying its stored failures read the damage as a fix. Files carry their operations' digest."""
    from kvstate.impl.numpy import factory
    from kvstate.stateful.planted import PLANTED
    from kvstate.stateful.replay import ops_digest

    ops = [O.Allocate(), O.Extend("c1", (1, 2), 3), O.Fork("c1"), O.Overwrite("c2", 0, (5,), 4)]
    with PLANTED["missing_copy_on_write"]():
        failure, _ = R.execute(factory, Config(LAYOUT, 4, "f32", 0, 4), ops)
    assert failure is not None
    data = R.to_json(R.Replay("kvstate.impl.numpy", Config(LAYOUT, 4, "f32", 0, 4), 0, ops, failure))
    assert data["ops_sha256"] == ops_digest(data["ops"])
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    assert main(["replay", str(path)]) == 0         # as written, on the fixed engine: fixed, truly
    capsys.readouterr()
    data["ops"][3]["start"] = 5                     # the overwrite now refused: PositionError
    path.write_text(json.dumps(data))
    assert main(["replay", str(path)]) == 2
    out, err = capsys.readouterr()
    assert "operations were changed since it was written" in err and "says nothing about the recorded failure" in err
    del data["ops_sha256"]                          # the edit made on purpose: replayed as it is
    path.write_text(json.dumps(data))
    assert main(["replay", str(path)]) == 0
