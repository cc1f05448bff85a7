"""Where the lockstep's snapshots go: for our engine, in turn a file, a URL, a file, a stream."""

import io
from pathlib import Path

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
