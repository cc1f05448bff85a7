"""A restore interrupted as its context is made, or at any line after, leaves no page behind.

Both restore paths made the new context, holding every page, one statement before the ``try``
that closes it on error: an interrupt there (Ctrl-C, a run's deadline, which CPython delivers at a
line of Python code) left a context no caller holds, and its pages, live for good (a review). So
did one landing later, as a path's file closed, and a remote read retried after its context was
made (an audit, s73): every context a restore makes is now closed unless it is the one returned.
"""

from __future__ import annotations

import io
import sys

import numpy as np
import pytest

from kvstate.impl import Cache
from kvstate.impl import snapshot_restore, snapshot_stream
from kvstate.spec import Layout

LAYOUT = Layout(2, 2, 4)


def _interrupt_after_the_context_is_made(code):
    """A trace that raises KeyboardInterrupt at the first line ``code`` runs once ``_new_pages_context`` returned."""
    made = []

    def trace(frame, event, arg):
        if frame.f_code is Cache._new_pages_context.__code__:
            return lambda frame, event, arg: made.append(True) if event == "return" else None
        if frame.f_code is not code:
            return None

        def line(frame, event, arg):
            if event == "line" and made:
                sys.settrace(None)
                raise KeyboardInterrupt
            return line
        return line
    return trace


@pytest.mark.parametrize("adopt, source", [(snapshot_restore._adopt, "stream"), (snapshot_stream._adopt_prepared, "path")])
def test_a_restore_interrupted_as_its_context_is_made_leaves_no_page(tmp_path, adopt, source):
    written = Cache(LAYOUT, page_tokens=4)
    with written.allocate() as ctx:
        ctx.extend(np.arange(11), np.ones((11, *LAYOUT.position_shape), np.float32))
        ctx.snapshot(tmp_path / "s.kvs")
    cache = Cache(LAYOUT, page_tokens=4)
    where = tmp_path / "s.kvs" if source == "path" else io.BytesIO((tmp_path / "s.kvs").read_bytes())
    sys.settrace(_interrupt_after_the_context_is_made(adopt.__code__))
    try:
        with pytest.raises(KeyboardInterrupt):
            cache.restore(where)
    finally:
        sys.settrace(None)
    seen = cache.observe()
    assert seen.holders == {} and not seen.pages and seen.pages_allocated == seen.pages_freed == 3
    with cache.restore(tmp_path / "s.kvs") as back:        # and the cache restores as before
        assert back.tokens == list(range(11))


def _snapshot_of_eleven(tmp_path):
    """A snapshot of 11 positions (3 pages of 4) at ``tmp_path / "s.kvs"``; its path."""
    written = Cache(LAYOUT, page_tokens=4)
    with written.allocate() as ctx:
        ctx.extend(np.arange(11), np.ones((11, *LAYOUT.position_shape), np.float32))
        ctx.snapshot(tmp_path / "s.kvs")
    return tmp_path / "s.kvs"


def _line_trace(number: int, picker, seen: list):
    """A trace that counts, in ``seen``, the line events the picker counts and raises KeyboardInterrupt at
    line ``number`` of them (never, for -1). ``picker`` is ``(traced, counting)``: ``traced(frame)`` is
    True for a frame whose lines may count, None for one not traced, or a local trace function of its
    own; ``counting()`` says, at each line, whether lines count yet."""
    traced, counting = picker

    def trace(frame, event, arg):
        picked = traced(frame)
        if picked is not True:
            return picked

        def line(frame, event, arg):
            if event == "line" and counting():
                seen.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
                if len(seen) - 1 == number:
                    sys.settrace(None)
                    raise KeyboardInterrupt
            return line
        return line
    return trace


def _every_line_interrupted(path, source: str, picker) -> None:
    """A restore of ``path`` (from the path, or a stream of its bytes) interrupted at each line in turn
    that ``picker()`` counts (a new picker each restore): each time KeyboardInterrupt, and no context,
    holder or page left."""
    def restore(cache: Cache, trace):
        sys.settrace(trace)
        try:
            return cache.restore(path if source == "path" else io.BytesIO(path.read_bytes()))
        finally:
            sys.settrace(None)
    lines: list = []
    restore(Cache(LAYOUT, page_tokens=4), _line_trace(-1, picker(), lines)).close()
    assert len(lines) >= 3, lines
    for number, at in enumerate(lines):
        cache = Cache(LAYOUT, page_tokens=4)
        with pytest.raises(KeyboardInterrupt):
            restore(cache, _line_trace(number, picker(), []))
        seen = cache.observe()
        assert seen.holders == {} and not seen.pages and cache.stats()["live_contexts"] == 0, \
            f"interrupted at {at}: {seen.holders}"


def _kvstate_lines_after_the_context_is_made():
    """Lines of ``kvstate.impl`` once ``Cache._new_pages_context`` has returned."""
    import kvstate.impl

    impl, made = kvstate.impl.__path__[0], []

    def traced(frame):
        if frame.f_code is Cache._new_pages_context.__code__:
            return lambda frame, event, arg: made.append(True) if event == "return" else None
        return True if frame.f_code.co_filename.startswith(impl) else None
    return traced, lambda: bool(made)


def _lines_making_the_context():
    """Lines of ``Cache._new_pages_context`` and ``Cache._new_context``."""
    making = (Cache._new_context.__code__, Cache._new_pages_context.__code__)
    return (lambda frame: True if frame.f_code in making else None), lambda: True


@pytest.mark.parametrize("source", ["stream", "path"])
def test_a_restore_interrupted_at_any_line_after_its_context_is_made_leaves_no_page(tmp_path, source):
    # An audit (s73) interrupted a path's restore as ``with file:`` closed the file, after the context
    # had joined the cache: the caller got KeyboardInterrupt and no handle, and the pages stayed out.
    _every_line_interrupted(_snapshot_of_eleven(tmp_path), source, _kvstate_lines_after_the_context_is_made)


@pytest.mark.parametrize("source", ["stream", "path"])
def test_a_restore_interrupted_while_its_context_is_made_leaves_no_context(tmp_path, source):
    # A review (s73): an interrupt at ``_new_context``'s return, the context already listed, released its
    # pages and left it listed, holding freed pages, in no caller's hands.
    _every_line_interrupted(_snapshot_of_eleven(tmp_path), source, _lines_making_the_context)


def test_a_remote_restore_whose_first_read_fails_in_closing_leaves_only_the_second_context(monkeypatch):
    # A read retried after its parse had made a context (the failure came as the stream closed) made
    # a second one: the first, which no caller held, kept its pages for good (an audit, s73).
    from contextlib import contextmanager

    from kvstate.impl import remote_io

    written = Cache(LAYOUT, page_tokens=4)
    with written.allocate() as ctx:
        ctx.extend(np.arange(11), np.ones((11, *LAYOUT.position_shape), np.float32))
        ctx.snapshot("memory://kvstate-s73/closing.kvs")
    opened, failed = remote_io.open_read, []

    @contextmanager
    def failing_once_at_close(*args, **kwargs):
        with opened(*args, **kwargs) as file:
            yield file
        if not failed:
            failed.append(True)
            raise ConnectionResetError("the connection closed as the stream did")
    monkeypatch.setattr(remote_io, "open_read", failing_once_at_close)
    cache = Cache(LAYOUT, page_tokens=4)
    with cache.restore("memory://kvstate-s73/closing.kvs") as back:
        assert failed and back.tokens == list(range(11))
        assert list(cache.observe().holders) == [f"ctx:{back.context_id}"]
    seen = cache.observe()
    assert seen.holders == {} and not seen.pages
