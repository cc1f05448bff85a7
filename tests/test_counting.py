"""Counts, not timings: what fork and writes allocate and copy."""

import ast
import pathlib
import traceback

import pytest

from helpers import filled, kv, make_cache

import kvstate.impl

PAGE = 4


def test_forking_a_32_page_context_eight_ways_allocates_and_copies_nothing():
    cache = make_cache(PAGE)
    parent = filled(cache, 32 * PAGE)
    before = cache.stats()
    forks = [parent.fork() for _ in range(8)]
    after = cache.stats()
    assert after["pages_allocated"] - before["pages_allocated"] == 0
    assert after["bytes_copied"] - before["bytes_copied"] == 0
    assert after["pages_copied"] - before["pages_copied"] == 0
    assert all(page.refcount == 9 for page in parent._pages)
    for f in forks:
        f.close()
    parent.close()


@pytest.mark.parametrize("precision", ["f32", "f16", "q8"])
def test_one_write_into_a_branch_copies_exactly_one_page(precision):
    cache = make_cache(PAGE, precision=precision)
    parent = filled(cache, 32 * PAGE)
    branch = parent.fork()
    before = cache.stats()
    branch.overwrite(5 * PAGE + 1, [3], kv(1, 9))
    after = cache.stats()
    assert after["pages_copied"] - before["pages_copied"] == 1
    assert after["bytes_copied"] - before["bytes_copied"] == cache.store.page_bytes
    assert after["pages_allocated"] - before["pages_allocated"] == 1
    # A second write into the now-private page copies nothing more.
    branch.overwrite(5 * PAGE + 2, [4], kv(1, 10))
    assert cache.stats()["pages_copied"] == after["pages_copied"]
    # Extending a shared, partly filled last page copies that page once.
    partial = filled(cache, PAGE + 1)
    sibling = partial.fork()
    mark = cache.stats()["pages_copied"]
    sibling.extend([1], kv(1, 11))
    assert cache.stats()["pages_copied"] == mark + 1


def test_store_copy_is_reached_only_through_writable(monkeypatch):
    """Dynamically: every call of the copy primitive has Context.writable on its stack."""
    cache = make_cache(PAGE, arena_pages=3, max_entries=2)
    callers = []
    original = type(cache.store).copy

    def spy(store, source, page_id):
        callers.append([frame.name for frame in traceback.extract_stack()])
        return original(store, source, page_id)

    monkeypatch.setattr(type(cache.store), "copy", spy)
    a = filled(cache, 3 * PAGE + 1)
    b = a.fork()
    b.extend([1, 2], kv(2))
    b.overwrite(0, [5], kv(1))
    cache.retain(b)
    c, _ = cache.match(b.tokens)
    c.overwrite(1, [6], kv(1))
    b.truncate(2)
    b.extend([1], kv(1))
    assert len(callers) >= 3
    assert all("writable" in stack for stack in callers)


def test_store_copy_is_called_from_one_place_in_the_source():
    """Statically: across impl/, only PagePool.clone calls store.copy, and only writable calls clone."""
    calls = {}
    for path in pathlib.Path(kvstate.impl.__file__).parent.glob("*.py"):
        for func in ast.walk(ast.parse(path.read_text())):
            if not isinstance(func, ast.FunctionDef):
                continue
            for node in ast.walk(func):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                receiver = ast.unparse(node.func.value)
                # page copies: the store's copy primitive, and the pool's clone that wraps it
                # (tensor.clone() of a caller's input in torch.py's encode is not a page copy)
                if (node.func.attr == "clone" and receiver.endswith("pool")) or \
                        (node.func.attr == "copy" and receiver.endswith("store")):
                    calls.setdefault(node.func.attr, set()).add(f"{path.name}:{func.name}")
    assert calls.get("copy") == {"pages.py:clone"}
    assert calls.get("clone") == {"context.py:writable"}


def test_truncate_releases_exactly_the_pages_past_the_new_length():
    cache = make_cache(PAGE)
    ctx = filled(cache, 5 * PAGE)
    ctx.truncate(2 * PAGE + 1)
    assert cache.stats()["pages_freed"] == 2
    ctx.truncate(2 * PAGE)
    assert cache.stats()["pages_freed"] == 3
    assert cache.stats()["live_pages"] == 2
    ctx.close()


def test_arena_falls_back_to_heap_when_full_and_counts_it():
    cache = make_cache(PAGE, arena_pages=2)
    ctx = filled(cache, 3 * PAGE)
    stats = cache.stats()
    assert stats["arena_issued"] == 2 and stats["heap_fallbacks"] == 1 and stats["heap_pages"] == 1
    ctx.close()
    assert cache.stats()["arena_returned"] == 2
    assert len(cache.observe().arena_free) == 2


@pytest.mark.parametrize("index", [-1, 2, 1.0, True, "0"])
def test_a_direct_writable_of_no_page_is_refused_and_changes_nothing(index):
    """``writable`` is public: ``writable(-1)`` kept every old page beside the copy (the page list
    doubled, refcounts broke, close failed)."""
    from kvstate.spec.errors import PositionError
    cache = make_cache(PAGE)
    ctx = filled(cache, 2 * PAGE)
    branch = ctx.fork()
    before = cache.observe()
    with pytest.raises(PositionError, match="page index"):
        ctx.writable(index)
    assert cache.observe() == before and len(ctx._pages) == 2
    assert ctx.writable(1) is not branch._pages[1]          # a page that exists: copied, as ever
    for c in (ctx, branch):
        c.close()
    assert cache.stats()["live_pages"] == 0


def test_a_direct_writable_asks_the_pool_for_room_for_its_copy():
    """Called by itself, no operation around it made room: on a full refusing pool it refuses."""
    from kvstate.spec.errors import CapacityError
    cache = make_cache(PAGE, pool_pages=2, on_full="refuse")
    ctx = filled(cache, 2 * PAGE)
    branch = ctx.fork()
    before = cache.observe()
    with pytest.raises(CapacityError):
        ctx.writable(0)
    assert cache.observe() == before
    branch.close()
    assert ctx.writable(0) is ctx._pages[0]                 # private now: nothing to copy, nothing asked
