"""Crash safety: a writer killed at any moment, or a write that fails, never leaves a broken target."""

import errno
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kvstate.impl import snapshot_files
from kvstate.impl.cache import Cache
from kvstate.spec import snapshot_format as fmt
from kvstate.spec.errors import SnapshotError, SnapshotWriteError
from kvstate.spec.layout import Layout

LAYOUT = Layout(layers=2, kv_heads=4, head_dim=32)
VERSIONS = {1: 600, 2: 900}     # token id -> positions: two distinguishable snapshots of ~1-2 MB

CHILD = f"""
import sys
import numpy as np
from kvstate.impl.cache import Cache
from kvstate.spec.layout import Layout
layout = Layout({LAYOUT.layers}, {LAYOUT.kv_heads}, {LAYOUT.head_dim})
cache = Cache(layout, page_tokens=16)
contexts = []
for token, n in {VERSIONS!r}.items():
    ctx = cache.allocate()
    ctx.extend([token] * n, np.full(layout.batch_shape(n), float(token), np.float32))
    contexts.append(ctx)
contexts[0].snapshot(sys.argv[1])
print("ready", flush=True)
i = 1
while True:
    contexts[i % 2].snapshot(sys.argv[1])
    i += 1
"""


def check_complete(path, versions=VERSIONS) -> int:
    """Restore ``path``; it must be exactly one of the versions (token id -> positions). Returns its token."""
    ctx = Cache(LAYOUT, page_tokens=7).restore(path)
    values, tokens = ctx.read()
    token = int(tokens[0])
    assert len(ctx) == versions[token]
    assert (tokens == token).all() and (values == float(token)).all()
    return token


def kill_writer_at_random_moments(tmp_path, kills: int, seed: int) -> dict:
    rng = random.Random(seed)
    target = tmp_path / "session.kvs"
    seen = {"tokens": set(), "strays": 0}
    for _ in range(kills):
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(target)], stdout=subprocess.PIPE)
        try:
            assert child.stdout.readline().strip() == b"ready"
            time.sleep(rng.uniform(0, 0.08))
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
        seen["tokens"].add(check_complete(target))
        for name in os.listdir(tmp_path):
            if name == target.name:
                continue
            # A stray is named as a temporary file, never as a snapshot, and never loads as a broken one.
            assert name.startswith(fmt.TEMP_PREFIX + target.name + ".") and name.endswith(fmt.TEMP_SUFFIX), name
            seen["strays"] += 1
            try:
                check_complete(tmp_path / name)
            except SnapshotError:
                pass
            os.unlink(tmp_path / name)
    return seen


def test_writer_killed_by_sigkill_leaves_a_complete_snapshot(tmp_path):
    seen = kill_writer_at_random_moments(tmp_path, kills=4, seed=1)
    assert seen["tokens"] <= set(VERSIONS)


@pytest.mark.slow
def test_writer_killed_by_sigkill_many_times(tmp_path):
    seen = kill_writer_at_random_moments(tmp_path, kills=60, seed=2)
    assert seen["tokens"] == set(VERSIONS)
    assert seen["strays"] > 0     # some kills really landed mid-write


# -- failed writes -----------------------------------------------------------------------

def two_contexts():
    cache = Cache(LAYOUT, page_tokens=16)
    old, new = cache.allocate(), cache.allocate()
    old.extend([1] * 5, np.full(LAYOUT.batch_shape(5), 1.0, np.float32))
    new.extend([2] * 9, np.full(LAYOUT.batch_shape(9), 2.0, np.float32))
    return old, new


def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


class FailingFile:
    """A file whose writes run out of space after ``budget`` bytes, like a full disk."""

    def __init__(self, file, budget: int):
        self.file, self.budget = file, budget

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if size > self.budget:
            self.file.write(memoryview(data).cast("B")[:self.budget])
            self.budget = 0
            enospc()
        self.budget -= size
        return self.file.write(data)

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


@pytest.mark.parametrize("failure", ["fsync", "write", "replace"])
def test_failed_write_leaves_previous_snapshot_intact(tmp_path, monkeypatch, failure):
    old, new = two_contexts()
    target = tmp_path / "ctx.kvs"
    old.snapshot(target)
    before = target.read_bytes()
    if failure == "fsync":
        monkeypatch.setattr(snapshot_files.os, "fsync", enospc)
    elif failure == "replace":
        monkeypatch.setattr(snapshot_files.os, "replace", enospc)
    else:
        real_open = open
        monkeypatch.setattr(snapshot_files, "open", lambda *a, **k: FailingFile(real_open(*a, **k), 1000),
                            raising=False)
    with pytest.raises(SnapshotWriteError, match="previous file there is intact"):
        new.snapshot(target)
    monkeypatch.undo()
    assert target.read_bytes() == before
    assert os.listdir(tmp_path) == [target.name]     # the temporary file was removed
    assert check_complete(target, {1: 5, 2: 9}) == 1


def test_write_into_a_missing_folder_is_refused(tmp_path):
    old, _ = two_contexts()
    with pytest.raises(SnapshotWriteError, match="temporary file"):
        old.snapshot(tmp_path / "missing" / "ctx.kvs")
