"""Directed check: a snapshot restores into a cache of another precision or page size.

ARCHITECTURE.md: a snapshot is position-major, so a cache of any page size restores it, and it
holds its cache's own precision losslessly; restored into another precision it converts by the
precision rules, so the new cache holds what a write of the snapshot's values would hold there
(``spec.precision.roundtrip``). Random sequences and the other snapshot checks restore into the
cache that wrote the file; this one writes a context of the configuration under test and
restores it into a new engine of each other precision the backend is run at and, where it may be
run at any page size, of another page size. Each restored context must read back the written
tokens, and values equal bit for bit to the snapshot's (same precision) or to their round trip.

n/a for a backend without ``snapshot``/``restore``.
"""

from __future__ import annotations

import io

from kvstate.spec.arithmetic import pages_needed
from kvstate.spec.precision import PRECISIONS, roundtrip
from kvstate.spec.protocol import Config, Factory
from kvstate.spec.semantics import may_refuse

from .common import NotApplicable, as_array, as_list, filled, keeping, record, same_read

PORTABLE = ("a snapshot restores into a cache of another page size as it was, and into a cache of another "
            "precision as a write of its values there would hold them")


def portable_snapshots(factory: Factory, config: Config) -> None:
    """The context written under ``config``, restored into engines of the other precisions and page size."""
    run, _ = filled(factory, config)
    source = run.live["c1"][0]
    if not (hasattr(run.engine, "restore") and hasattr(source, "snapshot")):
        raise NotApplicable("the cache has no snapshot/restore")
    stream = io.BytesIO()
    source.snapshot(stream)
    record(run, "c1.snapshot(stream)")
    values, tokens = source.read()
    values, tokens = as_array(values), as_list(tokens)
    targets = _targets(factory, config, len(tokens))
    if not targets:
        raise NotApplicable("the backend is run at one precision and one page size, or at no other that "
                            "holds the context's pages")
    for target in targets:
        call = (f"restore(stream) into a new {target.precision} cache of {target.page_tokens}-token pages "
                f"({target.name})")
        record(run, call)
        engine = factory(target)
        with keeping(PORTABLE, run, call):
            restored = engine.restore(io.BytesIO(stream.getvalue()))
            want = values if target.precision == config.precision else roundtrip(target.precision, values)
            same_read(PORTABLE, call, restored.read(), (want, tokens))
            restored.close()
    run.finish()


def _targets(factory: Factory, config: Config, positions: int) -> list[Config]:
    """One configuration per other precision the backend is run at, and two of other page sizes where
    the backend may be run at any page size: one of 1-8 (5 from 4), and one page smaller, so the last
    page restored is partly filled on a smaller page too (an outside audit's engine dropped it there).
    Of a precision's declared configurations, one whose pool holds the restored context: the restore
    runs with no reference beside it, so a pool too small for it (a correct ``CapacityError``) read
    as a failure (s68)."""
    declared = getattr(factory, "configs", None)
    if declared is None:
        others = [config.with_(precision=p) for p in PRECISIONS if p != config.precision]
    else:
        by_precision = {c.precision: c for c in declared if c.layout == config.layout
                        and _holds(c, positions)}
        others = [c for p, c in by_precision.items() if p != config.precision]
    if declared is None or getattr(factory, "any_page_size", False):
        others.append(config.with_(page_tokens=config.page_tokens % 8 + 1))
        if config.page_tokens > 2 and config.page_tokens - 1 != config.page_tokens % 8 + 1:
            others.append(config.with_(page_tokens=config.page_tokens - 1))
    return others


def _holds(config: Config, positions: int) -> bool:
    """Whether a new cache of ``config`` has room for a restore of ``positions`` (every page of it)."""
    limit = config.pool_limit
    return not (limit and may_refuse(config.on_full)) or pages_needed(positions, config.page_tokens) <= limit
