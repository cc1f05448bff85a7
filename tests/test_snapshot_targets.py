"""Where the lockstep's snapshots go: for our engine, in turn a file, a URL, a file, a stream."""

import gc
import io
from pathlib import Path

import pytest

from kvstate.impl.numpy import factory as numpy_factory
from kvstate.stateful import ops as O
from kvstate.stateful import snapshots as S
from kvstate.stateful.configs import config_named
from kvstate.stateful.lockstep import Lockstep


def test_snapshots_rotate_over_file_stream_and_url_and_each_restores_again_and_again():
    run = Lockstep(numpy_factory, config_named("f16-heap").with_(page_tokens=3))
    run.apply(O.Allocate())
    run.apply(O.Extend("c1", (0, 1, 2, 0, 1), seed=5))
    for name in ("s1", "s2", "s3", "s4"):
        run.apply(S.Snapshot("c1", name))
        run.apply(O.Overwrite("c1", 1, (2,), seed=int(name[1:])))    # later snapshots differ
    for name in ("s1", "s2", "s3", "s4", "s2", "s4"):                # a stream restores twice
        run.apply(S.Restore(name))
        run.check()
    kinds = [type(run._snapshot_targets[name]) for name in ("s1", "s2", "s3", "s4")]
    assert issubclass(kinds[0], Path) and issubclass(kinds[2], Path) and kinds[3] is io.BytesIO
    assert (kinds[1] is str) == S._URLS and issubclass(kinds[1], Path) != S._URLS
    run.finish()


def test_a_foreign_engine_gets_files_only():
    from foreign import dict_pages

    run = Lockstep(dict_pages.factory, config_named("f32-heap").with_(page_tokens=2))
    run.apply(O.Allocate())
    run.apply(O.Extend("c1", (0, 1, 2), seed=5))
    for name in ("s1", "s2", "s3", "s4"):
        run.apply(S.Snapshot("c1", name))
    assert all(isinstance(target, Path) for target in run._snapshot_targets.values())


def _run_with_a_url_snapshot():
    run = Lockstep(numpy_factory, config_named("f16-heap").with_(page_tokens=3))
    run.apply(O.Allocate())
    run.apply(O.Extend("c1", (0, 1, 2, 0, 1), seed=5))
    for name in ("s1", "s2"):                       # the second target is a URL
        run.apply(S.Snapshot("c1", name))
    run.finish()
    return run


def test_a_collected_runs_urls_go_at_the_next_runs_first_url_not_in_the_collector():
    """A finalizer that removes keys from fsspec's memory store can run in the middle of another
    walk over that store (a collection set off while ``find`` copies its items): the walk then
    raised "dictionary changed size during iteration". So collecting a run only notes its
    prefix, and the next run to make a URL removes it; a new run never reuses a collected
    run's prefix (an id can come back)."""
    fsspec = pytest.importorskip("fsspec")
    memory = fsspec.filesystem("memory")
    first = _run_with_a_url_snapshot()
    url = first._snapshot_targets["s2"]
    path = url.removeprefix("memory:/")
    first_prefix = first._url_prefix
    del first
    gc.collect()
    assert memory.exists(path)                      # the finalizer did not touch the store
    second = _run_with_a_url_snapshot()
    assert not memory.exists(path)                  # the second run's first URL removed it
    assert second._url_prefix != first_prefix
    assert memory.exists(second._snapshot_targets["s2"].removeprefix("memory:/"))
    second.apply(S.Restore("s2"))
    second.check()
