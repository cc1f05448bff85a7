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


@pytest.mark.parametrize("flag", [["--examples", "-1"], ["--steps", "0"], ["--time-limit", "-3"]])
def test_conform_bad_numbers(capsys, flag):
    one_line_exit_2(capsys, ["conform", *flag])


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


# -- stress and spec-check ---------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["stress", "--store", "nonesuch", "--minutes", "0"],
                                  ["stress", "--scenario", "nonesuch", "--minutes", "0"],
                                  ["stress", "--scale", "0", "--minutes", "0"],
                                  ["spec-check", "--no-crosshair", "--page-tokens", "0"],
                                  ["spec-check", "--no-crosshair", "--contexts", "-1"]])
def test_stress_and_spec_check_bad_arguments(capsys, argv):
    one_line_exit_2(capsys, argv)


def test_a_replay_page_too_large_to_allocate_is_the_files_fault(tmp_path, capsys):
    def huge_pages(data):
        data["config"].update(page_tokens=2**40, arena_pages=0)
    assert "MAX_REPLAY_PAGE_BYTES" in one_line_exit_2(capsys, ["replay", replay_file(tmp_path, edit=huge_pages)])
