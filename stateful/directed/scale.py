"""Directed check: the sizes where a backend's internals grow.

Every other check runs at toy sizes (a 2x2x4 layout, a handful of pages), so a bug that lives
behind an internal size threshold passes them all: a refcount table or page index that grows
past its first size, a free list that starts recycling, a different allocator for large pages.
This check drives the same lockstep comparison (engine and reference, every invariant after
every step) through sizes such thresholds sit at:

- thousands of live pages, grown past every power of two up to 2,048, shrunk to a few dozen and
  grown again, with forks, hits, writes into shared pages and truncations all the way;
- a real model's layout (4 layers, 8 KV heads of 128: every other check stores at 2x2x4), written,
  forked, copied, retained and hit, where a bug in how heads or dimensions are laid out shows;
- pages of several MiB (a wide layout), freed and taken again with one position written, where a
  store that recycles large pages must hand them out clean.

It uses the configuration's declared semantics and page size (drawn sizes become one small size,
so pages are many and cheap). A pool that refuses is scaled up with the pages (a refusing pool of
10 pages cannot hold thousands): the configuration with its pool raised is tried first and, where
the factory refuses it (``ConfigError``), the declared one is used. The model's layout and the wide
one run only where the factory accepts them; a pass says which it refused (``common.note``).
"""

from __future__ import annotations

from kvstate.spec.errors import ConfigError
from kvstate.spec.layout import Layout
from kvstate.spec.protocol import Config, Factory
from kvstate.spec.semantics import may_refuse

from .. import ops as O
from ..configs import page_sizes
from .common import keeping, note, start
from ..lockstep import Lockstep

MANY = ("a backend holds at any size what it holds at a small one: thousands of live pages, grown past "
        "every internal size and shrunk again, read and shared exactly as a handful of pages are")
LARGE = ("pages of several MiB behave as small ones: a page freed and taken again reads zero wherever "
         "nothing was written")

MODEL = ("a layout of a real model's size (4 layers, 8 KV heads of 128 dimensions) reads back as the toy one "
         "does: every layer, K and V, head and dimension in its place")

PEAK_PAGES = 2_300          # past 256, 512, 1,024 and 2,048: where tables that double grow
LARGE_PAGE_BYTES = 3 << 20  # stored, past the 2 MiB from which a store may keep freed pages for reuse
WIDE = Layout(layers=4, kv_heads=8, head_dim=64)
MODEL_LAYOUT = Layout(layers=4, kv_heads=8, head_dim=128)    # a model's heads (Llama 3 8B's), fewer layers
VALUE_BYTES = {"f32": 4, "f16": 2, "q8": 1}     # a stored value's bytes (q8's scales not counted)


def scale(factory: Factory, config: Config) -> None:
    """Thousands of pages grown, shrunk and grown again; then pages of several MiB recycled."""
    sizes = page_sizes(factory, config)
    small = config.with_(page_tokens=min(sizes))
    _many_pages(_run(factory, _scaled_pool(small, PEAK_PAGES + 64), fallback=small))
    _full_at_each_doubling(_run(factory, _scaled_pool(small, PEAK_PAGES + 64), fallback=small))
    # Every other check stores at the toy 2x2x4 layout, where a bug in how a backend lays out heads or
    # dimensions (two heads swapped past the third, a row offset past 128 bytes) does not show.
    model = _run(factory, small.with_(layout=MODEL_LAYOUT), fallback=None)
    if model is not None:
        _model_layout(model)
    wide = _wide(config, drawn=len(sizes) > 1)
    run = _run(factory, _scaled_pool(wide, 8), fallback=None)
    if run is not None:
        _large_pages(run)
    for shape, page_tokens, ran, unchecked in ((MODEL_LAYOUT, small.page_tokens, model, "a real model's layout"),
                                               (wide.layout, wide.page_tokens, run, "pages of several MiB")):
        if ran is None:
            note(f"the factory refused layout {shape.layers}x{shape.kv_heads}x{shape.head_dim} at page_tokens "
                 f"{page_tokens} (ConfigError): {unchecked} went unchecked")


def _scaled_pool(config: Config, pages: int) -> Config:
    """``config`` with a pool that refuses raised to ``pages`` (``pool_pages``, else the arena that
    sets its limit); a pool that falls back or evicts takes any size as it is."""
    if not may_refuse(config.on_full) or config.pool_limit >= pages:
        return config
    if config.pool_pages:
        return config.with_(pool_pages=pages)
    return config.with_(arena_pages=pages)


def _wide(config: Config, drawn: bool) -> Config:
    """``config`` at a layout and page size whose pages store ``LARGE_PAGE_BYTES`` at its precision:
    the wide layout at the page size that makes it, where page sizes are free; else the declared
    page size with the head dimension that makes it."""
    stored = WIDE.values_per_position * VALUE_BYTES[config.precision]
    if drawn:
        return config.with_(layout=WIDE, page_tokens=-(-LARGE_PAGE_BYTES // stored))
    per_head_dim = config.page_tokens * WIDE.layers * 2 * WIDE.kv_heads * VALUE_BYTES[config.precision]
    return config.with_(layout=Layout(WIDE.layers, WIDE.kv_heads, -(-LARGE_PAGE_BYTES // per_head_dim)))


def _run(factory: Factory, config: Config, fallback: Config | None) -> Lockstep | None:
    """A lockstep run of ``config``; where the factory refuses it, of ``fallback`` (None: no run)."""
    try:
        factory(config)
    except ConfigError:
        if fallback is None:
            return None
        config = fallback
    run = start(factory, config)
    # Every operation goes through ``_step``: a check reads only the contexts an operation could
    # have changed (the others hold thousands of pages, read again at every step), and ``finish``
    # reads them all.
    run.reads_changed_only = True
    return run


def _tokens(n: int, first: int) -> tuple[int, ...]:
    return tuple((first + i) % 7 for i in range(n))


def _step(run: Lockstep, op: O.Op) -> str | None:
    made = run.apply(op)
    run.check()
    return made


def _many_pages(run: Lockstep) -> None:
    page = run.config.page_tokens
    third = PEAK_PAGES // 3 * page
    with keeping(MANY, run):
        a = _step(run, O.Allocate())
        between = _step(run, O.Allocate())
        for part in range(2):
            _step(run, O.Extend(a, _tokens(third // 2 + part, part), seed=301 + part))
            if not part:        # a page of another context between a's two halves: a's pages are no one run
                _step(run, O.Extend(between, _tokens(page, 9), seed=311))
        # Two forks counted with nothing observed between them: kvstate's engine adds a holding's pending
        # forks to a long scattered run in one step, where a mutant counted one holder for two (s74).
        run.apply(O.Fork(a), watched=False)
        b = run.apply(O.Fork(a), watched=False)
        run.check()
        for position in range(1, len(run.live[a][1]), 97 * page + 1):    # a copy here and there
            _step(run, O.Overwrite(b, position, (6,), seed=303))
        _step(run, O.Retain(a))
        c = _step(run, O.Allocate())
        _step(run, O.Extend(c, _tokens(third, 3), seed=304))
        d = _step(run, O.Fork(c))
        _step(run, O.Extend(d, _tokens(third - page // 2, 4), seed=305))     # the peak
        _step(run, O.Truncate(c, 3 * page + 1))
        _step(run, O.Close(b))
        _step(run, O.Close(d))                                                # down to a few hundred
        hit = _step(run, O.Match(tuple(run.live[a][1].tokens) + (1,)))
        if hit is not None:
            _step(run, O.Extend(hit, _tokens(third, 5), seed=306))
            _step(run, O.Overwrite(hit, page, (5, 5), seed=307))
            _step(run, O.Truncate(hit, page + 1))
            _step(run, O.Close(hit))
        _step(run, O.Clear())
        _step(run, O.Close(a))                                                # a few pages left
        e = _step(run, O.Allocate())
        _step(run, O.Extend(e, _tokens(2 * third, 6), seed=308))              # and up again
        f = _step(run, O.Fork(e))
        _step(run, O.Overwrite(f, 0, (3,), seed=309))
        _step(run, O.Extend(c, _tokens(third, 7), seed=310))
        _step(run, O.Retain(f))
        run.finish()


def _full_at_each_doubling(run: Lockstep) -> None:
    """One context holding exactly 256, 512, 1,024 and 2,048 pages, the only pages live, then one more
    each time: a table that doubles when full grows while its last slot is in use (a mutant of kvstate's
    engine that left that slot's count behind passed every check, s74: pages were never exactly that many)."""
    page = run.config.page_tokens
    with keeping(MANY, run):
        a = _step(run, O.Allocate())
        held = 0
        for pages in (256, 512, 1024, 2048):        # checked once a size: after the growth
            run.apply(O.Extend(a, _tokens((pages - held) * page, pages), seed=340 + pages % 97), watched=False)
            _step(run, O.Extend(a, _tokens(page, 1), seed=341))
            held = pages + 1
        run.finish()


def _model_layout(run: Lockstep) -> None:
    page = run.config.page_tokens
    with keeping(MODEL, run):
        a = _step(run, O.Allocate())
        _step(run, O.Extend(a, _tokens(2 * page + page // 2 + 1, 0), seed=331))
        b = _step(run, O.Fork(a))
        _step(run, O.Overwrite(b, max(page - 1, 0), (4, 5), seed=332))      # across a page boundary: a copy
        _step(run, O.Retain(a))
        hit = _step(run, O.Match(tuple(run.live[a][1].tokens) + (6,)))
        if hit is not None:
            _step(run, O.Extend(hit, (6,), seed=333))
            _step(run, O.Truncate(hit, page + 1))
        run.finish()


def _large_pages(run: Lockstep) -> None:
    page = run.config.page_tokens
    with keeping(LARGE, run):
        a = _step(run, O.Allocate())
        _step(run, O.Extend(a, _tokens(page + 1, 0), seed=321))    # a full page and one position
        b = _step(run, O.Fork(a))
        _step(run, O.Overwrite(b, 1, (4,), seed=322))                # a copy of a large page
        _step(run, O.Close(a))
        _step(run, O.Close(b))                                       # every page freed
        c = _step(run, O.Allocate())
        _step(run, O.Extend(c, (1,), seed=323))                      # taken again, one position written
        d = _step(run, O.Allocate())
        _step(run, O.Extend(d, (2, 3), seed=324))
        _step(run, O.Truncate(d, 1))
        _step(run, O.Extend(c, (2,), seed=325))
        run.finish()
