"""A fourth review of the command line and the run artefacts (``kvstate sweep``, ``kvstate replay``):
a failure a sweep records is replayed as recorded, whatever it failed in. Each test runs a real,
small sweep or replay and fails with its fix reverted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from kvstate.cli import main

EXAMPLES = Path(__file__).parents[1] / "examples"

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


STRAY_WRITE = '''
import numpy as np
from listcache import ListCache, ListContext, factory as _base


class StrayContext(ListContext):
    def extend(self, tokens, kv) -> None:
        """The first extend made while another context is live also adds 1.0 to that context's private
        first page: no page id, refcount or length changes, so only a read of that context shows it."""
        super().extend(tokens, kv)
        if getattr(self.cache, "_strayed", False):
            return
        for other in self.cache.contexts:
            if other is not self and other.length and other.pages and other.pages[0].refcount == 1:
                other.pages[0].values[0] += np.float32(1.0)
                self.cache._strayed = True
                return


class StrayCache(ListCache):
    context_class = StrayContext


def factory(config):
    return StrayCache(config)


factory.configs = _base.configs[:1]     # f32-heap
factory.any_page_size = True
'''


def test_a_failure_a_sweep_first_sees_at_finish_replays_as_recorded(tmp_path, capsys):
    """From the review: a run reads only the contexts an operation could have changed, so a write into
    another context's private page showed only at ``finish`` (which reads them all); the sweep recorded
    it "at finish" and did not pin it, while ``kvstate replay`` (every context read) found it at step 28:
    exit 3, "fails, but NOT as recorded", for the very bug the file records. Seed 7 is one such run."""
    shutil.copy(EXAMPLES / "listcache.py", tmp_path / "listcache.py")
    backend = _backend(tmp_path, "stray_write", STRAY_WRITE)
    out = tmp_path / "out"
    assert main(["sweep", "--seed-range", "7:8", "--steps", "30", "--backend", backend, "--out", str(out),
                 "--workers", "1", "--shrink-limit", "0"]) == 1
    [failure] = json.loads((out / "report.json").read_text())["failures"]
    assert failure["failure"]["phase"] != "finish" and failure["failure"]["invariant"] == 4
    saved = json.loads(Path(failure["replay_file"]).read_text())
    assert len(saved["ops"]) == failure["failure"]["step"]        # the operations after it are dropped
    capsys.readouterr()
    assert main(["replay", failure["replay_file"], "--backend", backend]) == 1
    assert f"reproduces the recorded failure (InvariantViolation at step {failure['failure']['step']})" \
        in capsys.readouterr().out
