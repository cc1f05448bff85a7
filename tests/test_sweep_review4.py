"""A fourth review of the command line and the run artefacts (``kvstate sweep``, ``kvstate replay``):
a failure a sweep records is replayed as recorded, whatever it failed in. Each test runs a real,
small sweep or replay and fails with its fix reverted."""

from __future__ import annotations

import json
from pathlib import Path

from kvstate.cli import main

BUILD_FAILS_IN_Q8 = '''
from kvstate.impl.numpy import factory as _base


def factory(config):
    if config.precision == "q8":
        raise RuntimeError("q8 not supported by this build")
    return _base(config)
'''


def _backend(tmp_path: Path, name: str, source: str) -> str:
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    return str(path)


def test_a_failure_to_build_the_cache_replays_as_reproduced(tmp_path, capsys):
    """From the review: the sweep recorded "RuntimeError at step 0" for q8-heap, whose cache the factory
    cannot build, but ``kvstate replay`` built that cache itself before the replay ran, and exited 2
    ("the factory raised ...") instead of 1: the replay's own build, a finding, was never reached."""
    backend = _backend(tmp_path, "q8broken", BUILD_FAILS_IN_Q8)
    out = tmp_path / "out"
    assert main(["sweep", "--seeds", "1", "--steps", "5", "--backend", backend, "--configs", "q8-heap",
                 "--out", str(out), "--workers", "1", "--shrink-limit", "0"]) == 1
    [failure] = json.loads((out / "report.json").read_text())["failures"]
    assert (failure["config"], failure["failure"]["step"]) == ("q8-heap", 0)
    capsys.readouterr()
    assert main(["replay", failure["replay_file"], "--backend", backend]) == 1
    assert "reproduces the recorded failure (RuntimeError at step 0)" in capsys.readouterr().out
