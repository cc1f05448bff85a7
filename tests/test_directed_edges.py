"""The directed edge checks pass on our engines and catch a small planted bug each.

Each planted bug is a monkeypatch of our engine that the check exists to catch; the
control is the same check passing on the unpatched engine (NumPy and torch CPU) in
all six machine configurations.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import tempfile
import types

import numpy as np
import pytest

from kvstate.impl import context as context_module
from kvstate.impl import numpy_store as numpy_module
from kvstate.impl import radix as radix_module
from kvstate.impl import snapshot_files
from kvstate.impl import snapshot_read
from kvstate.impl import snapshot_write
from kvstate.impl.arena import SlotArena
from kvstate.impl.numpy import factory as numpy_factory
from kvstate.impl.pages import ref_slots
from kvstate.spec import precision as precisions
from kvstate.spec.errors import InvariantViolation
from kvstate.stateful.directed import checks as checks_module
from kvstate.stateful.directed import precision as directed_precision
from kvstate.stateful.configs import config_named, machine_configs
from kvstate.stateful.directed.checks import DIRECTED
from kvstate.stateful.directed.common import BrokenPromise, NotApplicable
from kvstate.stateful.planted import dirty_recycled_slot

from foreign.bugs import DIRECTED_CATCHES
from helpers import ObservedAs, conform_report, printed_steps

NEW_CHECKS = ["no aliasing", "boundaries", "precision edges", "prefix edges", "snapshot writes", "arena evidence"]


def torch_factory():
    pytest.importorskip("torch")
    from kvstate.impl.torch import cpu_factory

    return cpu_factory


def fails(check: str, factory, config) -> BrokenPromise:
    """Run ``check`` in ``config`` (a Config, or a standard one's name); it must fail with a broken promise,
    which is returned."""
    with pytest.raises(BrokenPromise) as caught:
        DIRECTED[check](factory, config_named(config) if isinstance(config, str) else config)
    message = str(caught.value)
    assert message.startswith('"') and " -- broken by " in message, message
    return caught.value


# -- the controls ----------------------------------------------------------------------------

# The NumPy engine's control is tests/test_planted_bugs.py's: every directed check, these
# included, in all 13 configurations (the six here among them).
@pytest.mark.parametrize("check", NEW_CHECKS)
def test_check_passes_on_the_torch_engine(check, machine_config):
    DIRECTED[check](torch_factory(), machine_config)


def test_new_checks_are_registered_after_the_existing_ones():
    names = list(DIRECTED)
    first_new = names.index(NEW_CHECKS[0])
    assert names[first_new:first_new + len(NEW_CHECKS)] == NEW_CHECKS
    assert names[:first_new] == ["fork isolation", "fork allocates 0", "1 write copies 1", "bad input",
                                 "damaged snapshots"]
    assert all(len(name) <= 18 for name in names)        # table column headers


def test_checks_keep_within_max_entries_and_still_pass_at_one_and_many():
    config = config_named("f32-heap")
    for limit in (1, 3, 64):
        DIRECTED["prefix edges"](numpy_factory, config.with_(max_entries=limit))


@pytest.mark.parametrize("page_tokens", [1, 2, 5])
def test_checks_pass_at_other_page_sizes(page_tokens):
    for name in NEW_CHECKS:
        DIRECTED[name](numpy_factory, config_named("q8-arena6").with_(page_tokens=page_tokens))


# -- the cases are what they claim ------------------------------------------------------------

def test_q8_tie_vectors_divide_to_exact_halves_under_the_spec():
    vectors = np.array(directed_precision.cases(4)["q8 ties"], np.float32)
    codes, scales = precisions.q8_encode(vectors)
    ratios = vectors / scales[:, None]
    assert set(np.log2(scales).tolist()) == {0.0, -7.0, 6.0, -140.0}      # powers of two: exact
    halves = ratios[:, 1:]
    assert np.all(halves - np.floor(halves) == 0.5)                         # every one a tie
    assert np.array_equal(codes[:, 1:], np.rint(halves))                     # and rounded half to even
    assert not np.array_equal(codes[:, 1:], np.sign(halves) * np.floor(np.abs(halves) + 0.5))


def test_f16_ties_and_subnormal_cases_sit_on_the_edges():
    cases = directed_precision.cases(4)
    ties = np.array(cases["f16 ties"], np.float32)
    nearest_even = ties.astype(np.float16).astype(np.float32)
    assert (nearest_even != ties).all()
    subnormals = np.array(cases["f16 subnormals"], np.float32)
    assert ((np.abs(subnormals) < 2.0 ** -14) & (subnormals != 0)).sum() >= 6
    q8_scales = precisions.q8_encode(np.array(cases["subnormal q8 scales"], np.float32))[1]
    assert (q8_scales == 0).any() and ((q8_scales > 0) & (q8_scales < 2.0 ** -126)).any()


# -- planted bugs: no aliasing ------------------------------------------------------------------

def test_no_aliasing_catches_a_read_that_returns_a_view_of_the_page(monkeypatch):
    def read(store, buffer, start, stop):
        return np.moveaxis(buffer.arrays[0][:, :, start:stop], 2, 0)       # f32: a view, not a copy
    monkeypatch.setattr(numpy_module.NumpyStore, "read", read)
    monkeypatch.setattr(numpy_module.NumpyStore, "concat", lambda store, parts: parts[0] if len(parts) == 1
                        else np.concatenate(parts))
    failure = fails("no aliasing", numpy_factory, "f32-heap")
    assert "read(" in failure.call and "invariant 4" in failure.saw


def test_no_aliasing_catches_a_read_that_refills_a_buffer_an_earlier_read_returned(monkeypatch):
    """From an audit: an engine keeping a host mirror of a context, refilled in place at every read and
    sliced for the caller, passed: the kept arrays were compared after writes, with no read between."""
    original = context_module.Context.read
    mirrors: dict = {}

    def read(ctx, start=0, stop=None):
        values, tokens = original(ctx, start, stop)
        whole, _ = original(ctx)
        mirror = mirrors.get(ctx.context_id)
        if mirror is None or len(mirror) < len(whole):
            mirror = mirrors[ctx.context_id] = np.empty((2 * len(whole) + 8, *whole.shape[1:]), whole.dtype)
        mirror[:len(whole)] = whole                                        # refilled in place
        return mirror[start:len(whole) if stop is None else stop], tokens  # the caller gets a view of it
    monkeypatch.setattr(context_module.Context, "read", read)
    failure = fails("no aliasing", numpy_factory, "f32-heap")
    assert "read again" in failure.saw


def test_no_aliasing_catches_tokens_handed_out_from_the_page(monkeypatch):
    original = context_module.Context.read

    def read(ctx, start=0, stop=None):
        values, tokens = original(ctx, start, stop)
        stop = ctx._length if stop is None else stop
        if stop > start and start // ctx.page_tokens == (stop - 1) // ctx.page_tokens:
            page = ctx._pages[start // ctx.page_tokens]
            offset = start % ctx.page_tokens
            tokens = page.tokens[offset:offset + stop - start]             # the page's own token array
        return values, tokens
    monkeypatch.setattr(context_module.Context, "read", read)
    failure = fails("no aliasing", numpy_factory, "q8-arena6")
    assert "token" in failure.saw


def test_no_aliasing_catches_an_observation_that_hands_out_live_books(monkeypatch):
    monkeypatch.setattr(SlotArena, "books", lambda arena: (arena.size, arena.out, tuple(arena.free)))
    failure = fails("no aliasing", numpy_factory, "f16-arena6")
    assert failure.call == "observe()" and "arena_out" in failure.saw


def test_no_aliasing_catches_a_torch_read_that_returns_a_view():
    torch_module = pytest.importorskip("kvstate.impl.torch_store")
    factory = torch_factory()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch_module.TorchStore, "read",
                      lambda store, buffer, start, stop: buffer.tensors[0][:, :, start:stop].movedim(2, 0))
        patch.setattr(torch_module.TorchStore, "concat", lambda store, parts: parts[0] if len(parts) == 1
                      else torch_module.torch.cat(parts))
        failure = fails("no aliasing", factory, "f32-arena6")
    assert "invariant 4" in failure.saw


# -- planted bugs: boundaries --------------------------------------------------------------------

def test_boundaries_catch_a_zero_length_extend_that_allocates_a_page(monkeypatch):
    original = context_module.Context.extend

    def extend(ctx, tokens, kv):
        if len(tokens) == 0:
            with ctx._cache.lock:                       # "make room for what comes next"
                pages = ctx._pages + tuple(ctx._cache.pool.new_pages(1))
                ctx._holding = ctx._holding.replaced(pages, ref_slots(pages), keep_base=True)
        return original(ctx, tokens, kv)
    monkeypatch.setattr(context_module.Context, "extend", extend)
    failure = fails("boundaries", numpy_factory, "f32-heap")
    # caught at the write itself, by the lockstep's "a write of nothing changes nothing"
    assert "tokens=()" in failure.saw and "writes nothing but changed the cache: pages allocated" in failure.saw
    assert failure.call.startswith("extend(")


def test_boundaries_catch_a_zero_length_extend_that_copies_the_shared_last_page(monkeypatch):
    original = context_module.Context.extend

    def extend(ctx, tokens, kv):
        if len(tokens) == 0 and ctx._pages:
            ctx.writable(len(ctx._pages) - 1)
        return original(ctx, tokens, kv)
    monkeypatch.setattr(context_module.Context, "extend", extend)
    failure = fails("boundaries", numpy_factory, "q8-arena6")
    # the copy is a page allocated at the zero-length write (the first difference the check names)
    assert "tokens=()" in failure.saw and "writes nothing but changed the cache: pages allocated" in failure.saw
    assert failure.call.startswith("extend(")


def test_boundaries_catch_a_read_that_takes_stop_0_for_omitted(monkeypatch):
    original = context_module.Context.read
    monkeypatch.setattr(context_module.Context, "read",
                        lambda ctx, start=0, stop=None: original(ctx, start, stop or None))
    failure = fails("boundaries", numpy_factory, "f16-heap")
    assert failure.call.endswith(".read(0, 0)")


def test_boundaries_catch_a_truncate_to_the_length_that_copies(monkeypatch):
    original = context_module.Context.truncate

    def truncate(ctx, n):
        if ctx._pages and n == len(ctx):
            ctx.writable(len(ctx._pages) - 1)           # "make the tail private before cutting"
        return original(ctx, n)
    monkeypatch.setattr(context_module.Context, "truncate", truncate)
    failure = fails("boundaries", numpy_factory, "f32-arena6")
    assert failure.call.startswith("truncate(")


# -- planted bugs: precision edges -----------------------------------------------------------------

def _half_away_from_zero(x):
    codes, scales = precisions.q8_encode(x)
    safe = np.where(scales > 0, scales, np.float32(1))[..., None]
    ratio = np.where(scales[..., None] > 0, np.asarray(x, np.float32) / safe, np.float32(0))
    away = np.sign(ratio) * np.floor(np.abs(ratio) + np.float32(0.5))
    return np.clip(away, -127, 127).astype(np.int8), scales


def _store_precisions(**replaced):
    """spec.precision as the NumPy store sees it, with some functions replaced (the reference keeps the real ones)."""
    shim = types.SimpleNamespace(**{k: v for k, v in vars(precisions).items() if not k.startswith("__")})
    for name, function in replaced.items():
        setattr(shim, name, function)
    return shim


def test_precision_edges_catch_q8_rounding_half_away_from_zero(monkeypatch):
    def encode(precision, x):
        return _half_away_from_zero(x) if precision == "q8" else precisions.encode(precision, x)
    monkeypatch.setattr(numpy_module, "precisions", _store_precisions(encode=encode))
    failure = fails("precision edges", numpy_factory, "q8-heap")
    assert "<q8 ties>" in failure.call
    DIRECTED["precision edges"](numpy_factory, config_named("f32-heap"))     # other precisions: no tie rule


def test_precision_edges_catch_torch_q8_rounding_half_away_from_zero():
    torch_module = pytest.importorskip("kvstate.impl.torch_store")
    torch = torch_module.torch

    def q8_encode(x):
        scales = x.abs().amax(dim=-1) / torch.full_like(x.abs().amax(dim=-1), 127.0)
        positive = (scales > 0).unsqueeze(-1)
        ratio = torch.where(positive, x / torch.where(positive, scales.unsqueeze(-1), torch.ones_like(x[..., :1])),
                            torch.zeros_like(x))
        away = torch.sign(ratio) * torch.floor(ratio.abs() + 0.5)
        return torch.clamp(away, -127, 127).to(torch.int8), scales
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch_module, "_q8_encode", q8_encode)
        failure = fails("precision edges", torch_factory(), "q8-arena6")
    assert "<q8 ties>" in failure.call


def test_precision_edges_catch_f16_subnormals_flushed_to_zero(monkeypatch):
    def encode(precision, x):
        if precision == "f16":
            x = np.where(np.abs(x) < np.float32(2.0 ** -14), np.copysign(np.float32(0), x), x).astype(np.float32)
        return precisions.encode(precision, x)
    monkeypatch.setattr(numpy_module, "precisions", _store_precisions(encode=encode))
    failure = fails("precision edges", numpy_factory, "f16-arena6")
    assert "<f16" in failure.call and "1.1920929e-07" in failure.saw       # 3 * 2**-25 rounds up to 2**-23


def test_precision_edges_catch_a_zero_scale_that_keeps_the_last_codes(monkeypatch):
    """A q8 store whose all-zero vectors keep a scale of 1e-30: reads then differ from +0 for -0 input."""
    def encode(precision, x):
        if precision != "q8":
            return precisions.encode(precision, x)
        codes, scales = precisions.q8_encode(x)
        return codes, np.where(scales == 0, np.float32(1e-30), scales).astype(np.float32)
    monkeypatch.setattr(numpy_module, "precisions", _store_precisions(encode=encode))
    monkeypatch.setattr(numpy_module.NumpyStore, "read", lambda store, buffer, start, stop: np.ascontiguousarray(
        np.moveaxis(buffer.arrays[0][:, :, start:stop].astype(np.float32) * -buffer.arrays[1][:, :, start:stop][..., None], 2, 0)))
    fails("precision edges", numpy_factory, "q8-heap")


# -- planted bugs: prefix edges ------------------------------------------------------------------------

def test_prefix_edges_catch_match_returning_the_shortest_key(monkeypatch):
    monkeypatch.setattr(radix_module, "match_stop",
                        lambda has_entry: next((i for i, entry in enumerate(has_entry) if entry), -1))
    failure = fails("prefix edges", numpy_factory, "f32-heap")
    assert "longest retained key" in failure.promise and "engine matched" in failure.saw


def test_prefix_edges_catch_a_retain_that_keeps_the_older_entry(monkeypatch):
    original = radix_module.RadixTree.insert

    def insert(tree, key, value):
        node, depth = tree._descend(key)
        if depth == len(key) and node.value is not None:
            tree.stamp(node)
            return value                       # "already cached": the new fork is released instead
        return original(tree, key, value)
    monkeypatch.setattr(radix_module.RadixTree, "insert", insert)
    failure = fails("prefix edges", numpy_factory, "q8-arena6")
    assert "replaces its entry" in failure.promise


def test_prefix_edges_catch_an_eviction_that_leaves_the_split(monkeypatch):
    def remove(tree, node):
        del tree.recency[node]
        node.value = None
        while node is not tree.root and node.value is None and not node.children:
            parent = node.parent
            del parent.children[node.edge[:radix_module.TOKEN_BYTES]]
            node = parent                      # no collapse of the split left behind
    monkeypatch.setattr(radix_module.RadixTree, "remove", remove)
    failure = fails("prefix edges", numpy_factory, "f16-heap")
    assert "collapse" in failure.saw


def test_prefix_edges_catch_eviction_of_the_newest_entry(monkeypatch):
    def pop_oldest(tree, spare=None):
        for node in reversed(tree.recency):
            if node.value is not spare:
                value = node.value
                tree.remove(node)
                return value
        raise LookupError("no entry to evict")
    monkeypatch.setattr(radix_module.RadixTree, "pop_oldest", pop_oldest)
    fails("prefix edges", numpy_factory, "f32-arena6")


# -- planted bugs: snapshot writes ------------------------------------------------------------------------

class _OsWithoutSync(types.ModuleType):
    """The os module as impl/snapshot_files.py sees it, with fsync a no-op for one kind of descriptor."""

    def __init__(self, skip_folder: bool):
        super().__init__("os")
        self._skip_folder = skip_folder

    def __getattr__(self, name):
        return getattr(os, name)       # looked up at call time: the check's recorder still sees the rest

    def fsync(self, fd):
        if stat.S_ISDIR(os.fstat(fd).st_mode) == self._skip_folder:
            return None
        return os.fsync(fd)


@pytest.mark.parametrize("skip_folder,said", [(False, "not synced at its full size"),
                                              (True, "folder was not synced after the rename")])
def test_snapshot_writes_catch_a_writer_without_either_sync(monkeypatch, skip_folder, said):
    from kvstate.impl import snapshot_files     # the file protocol: its fsyncs of file and folder
    monkeypatch.setattr(snapshot_files, "os", _OsWithoutSync(skip_folder))
    failure = fails("snapshot writes", numpy_factory, "f32-heap")
    assert said in failure.saw and ".snapshot(" in failure.call


def test_snapshot_writes_catch_a_sync_before_the_bytes_are_written(monkeypatch):
    def write_atomic(path, fill):
        folder = os.path.dirname(os.path.abspath(path))
        fd, temp = tempfile.mkstemp(dir=folder)
        with open(fd, "wb") as file:
            os.fsync(file.fileno())            # too early: the sync covers none of the bytes
            fill(file)
        os.replace(temp, path)
        snapshot_files.fsync_folder(folder)
    monkeypatch.setattr(snapshot_write, "write_atomic", write_atomic)
    failure = fails("snapshot writes", numpy_factory, "q8-heap")
    assert "not synced at its full size" in failure.saw and "fsync file" in failure.saw


def test_snapshot_writes_catch_a_writer_that_writes_the_target_in_place(monkeypatch):
    def write_in_place(path, fill):
        with open(path, "wb") as file:
            fill(file)
            file.flush()
            os.fsync(file.fileno())
    monkeypatch.setattr(snapshot_write, "write_atomic", write_in_place)
    failure = fails("snapshot writes", numpy_factory, "f16-arena6")
    assert "nothing was renamed over the target" in failure.saw


def test_snapshot_writes_catch_a_writer_that_assumes_offset_0(monkeypatch):
    original = snapshot_write._write_to

    def write_to(file, ctx, *producer):
        if snapshot_read.seekable(file):
            file.seek(0)
        original(file, ctx, *producer)
    monkeypatch.setattr(snapshot_write, "_write_to", write_to)
    failure = fails("snapshot writes", numpy_factory, "f32-arena6")
    assert "bytes before the snapshot changed" in failure.saw and "BytesIO" in failure.call


def test_snapshot_writes_is_not_applicable_without_snapshots():
    def factory(config):
        cache = numpy_factory(config)
        return types.SimpleNamespace(**{name: getattr(cache, name)
                                        for name in ("allocate", "retain", "match", "clear", "observe")})
    with pytest.raises(NotApplicable):
        DIRECTED["snapshot writes"](factory, config_named("f32-heap"))


# -- planted bugs: arena evidence ------------------------------------------------------------------------

def test_arena_evidence_catches_a_backend_that_ignores_arena_pages():
    def factory(config):
        return numpy_factory(config.with_(arena_pages=0))
    failure = fails("arena evidence", factory, "q8-arena6")
    assert "arena_size 0, configuration arena_pages 6" in failure.saw
    DIRECTED["arena evidence"](factory, config_named("q8-heap"))      # without an arena it is right


def test_arena_evidence_catches_an_arena_that_never_issues_a_slot(monkeypatch):
    def issue(arena, page_id):
        arena.counters.heap_pages += 1
        return None
    monkeypatch.setattr(SlotArena, "issue", issue)
    failure = fails("arena evidence", numpy_factory, "f32-arena6")
    assert "while the arena has a free slot" in failure.promise and "0 arena slots out of 6" in failure.saw


def _dirty_and_silent(monkeypatch):
    """Slots handed out unzeroed, and the backend's own dirty_tail flag always False."""
    monkeypatch.setattr(numpy_module.NumpyStore, "is_zero_from", lambda store, buffer, offset: True)


@pytest.mark.parametrize("config", ["f32-arena6", "f16-arena6", "q8-arena6"])
def test_arena_evidence_catches_a_dirty_slot_the_backend_does_not_report(monkeypatch, config):
    _dirty_and_silent(monkeypatch)
    with dirty_recycled_slot():
        failure = fails("arena evidence", numpy_factory, config)
    assert "old bytes" in failure.saw


def test_arena_evidence_catches_a_torch_dirty_slot_the_backend_does_not_report(monkeypatch):
    torch_module = pytest.importorskip("kvstate.impl.torch_store")
    original = torch_module.TorchStore._take
    monkeypatch.setattr(torch_module.TorchStore, "allocate", lambda store, page_id: original(store, page_id, zero=False))
    monkeypatch.setattr(torch_module.TorchStore, "is_zero_from", lambda store, buffer, offset: True)
    failure = fails("arena evidence", torch_factory(), "f16-arena6")
    assert "old bytes" in failure.saw


def _without_arena_tier(cache_class):
    """A factory of ``cache_class`` whose observation leaves the arena tier out (pages and holders stay)."""
    def factory(config):
        cache = cache_class(config)
        observe = cache.observe
        cache.observe = lambda: dataclasses.replace(observe(), arena_size=None, arena_out=None, arena_free=None)
        return cache
    return factory


def test_arena_evidence_without_the_arena_tier_still_compares_a_recycled_heap_page():
    """A heap backend that reads its pages raw but reports no arena: the page it hands out again after
    frees is compared with a new cache's (it was "n/a"). Clean, it passes; recycling pages unzeroed
    (and reporting them clean) is caught; an arena configuration still needs the tier."""
    from foreign import dict_pages
    from foreign.bugs import HeapPageReusedDirty

    clean = _without_arena_tier(dict_pages.DictCache)
    DIRECTED["arena evidence"](clean, config_named("f32-heap"))
    with pytest.raises(NotApplicable, match="arena"):
        DIRECTED["arena evidence"](clean, config_named("f32-arena6"))
    failure = fails("arena evidence", _without_arena_tier(HeapPageReusedDirty), "f32-heap")
    assert "handed out again" in failure.promise and "old bytes" in failure.saw


def test_arena_evidence_without_the_arena_tier_or_raw_pages_is_not_applicable():
    def factory(config):
        cache = _without_arena_tier(lambda c: numpy_factory(c))(config)
        return types.SimpleNamespace(**{name: getattr(cache, name)
                                        for name in ("allocate", "retain", "match", "clear", "observe")})
    with pytest.raises(NotApplicable, match="read_page"):
        DIRECTED["arena evidence"](factory, config_named("f32-heap"))


def test_all_new_checks_report_through_conform_with_the_promise_first():
    from kvstate.stateful.conform import conform

    def factory(config):
        return numpy_factory(config.with_(arena_pages=0))
    (result,) = conform(factory, configs=[config_named("f32-arena6")], checks=["arena evidence"])
    outcome = result.outcomes["arena evidence"]
    assert outcome.status == "FAIL"
    assert outcome.detail.splitlines()[0].startswith('BrokenPromise: "observe() reports arena_size equal')


def test_the_six_machine_configs_are_the_ones_checked():
    assert [c.name for c in machine_configs()] == ["f32-heap", "f32-arena6", "f16-heap", "f16-arena6",
                                                   "q8-heap", "q8-arena6"]


# -- what random sequences cannot reach: wide token ids, the token limit, portable snapshots -----------

@pytest.mark.parametrize("name", sorted(DIRECTED_CATCHES))
def test_one_directed_check_catches_what_the_sequences_cannot(name):
    """Sequences draw token ids 0-2 and restore into the cache that wrote the file: each of these
    bugs passes them, and one directed check catches it (its correct base passes the same check)."""
    factory, base, check, config_name, said = DIRECTED_CATCHES[name]
    try:
        DIRECTED[check](factory, config_named(config_name))
    except (BrokenPromise, AssertionError) as caught:
        assert said in str(caught), str(caught)
    else:
        raise AssertionError(f"{check} passed {name}")
    DIRECTED[check](base, config_named(config_name))


def test_portable_snapshots_pass_on_the_torch_engine(machine_config):
    DIRECTED["portable snapshots"](torch_factory(), machine_config)


def test_portable_snapshots_is_not_applicable_at_one_precision_and_page_size():
    def factory(config):
        return numpy_factory(config)
    factory.configs = [config_named("f32-heap")]
    with pytest.raises(NotApplicable):
        DIRECTED["portable snapshots"](factory, config_named("f32-heap"))


def test_a_shrunk_directed_failure_names_the_promise_as_what_was_being_checked():
    """Shrunk by replaying its operations, a directed check's failure is whatever the checks after every
    step meet first, which may break another promise than the check's: the report leads with what broke,
    then says which promise was being checked, rather than claiming the check's own promise broken."""
    from kvstate.stateful.conform import conform
    from kvstate.stateful.planted import PLANTED

    with PLANTED["match_shortest_key"]():
        (result,) = conform(numpy_factory, configs=[config_named("f32-heap")], checks=["prefix edges"])
    head, checking = result.outcomes["prefix edges"].detail.splitlines()[:2]
    # Shrunk, the wrong hit shows at a match step or at the run's end, where every entry is matched by its key.
    assert head.startswith("InvariantViolation: invariant 5: "), head
    assert 'match="entry": a hit holds the whole of the longest retained key' in head, head
    assert checking.startswith('found while checking: "match answers with the longest retained key'), checking


def test_retain_again_under_prefix_values_quotes_no_newer_values_promise(monkeypatch):
    """Under ``values="prefix"`` either copy of a retained key may be kept: a failure of the "retain again"
    row there (here a leaked fork) was reported as found while checking "the newer values win" (an audit)."""
    from kvstate.impl.cache import Cache
    from kvstate.stateful.conform import conform

    retained, retain = set(), Cache.retain

    def leaky_retain(self, ctx):
        if id(ctx) in retained:
            ctx.fork()          # PLANTED: a second retain of one context leaks a fork
        retained.add(id(ctx))
        return retain(self, ctx)
    monkeypatch.setattr(Cache, "retain", leaky_retain)
    prefix = dataclasses.replace(config_named("f32-heap"), values="prefix")
    (result,) = conform(numpy_factory, configs=[prefix], checks=["pinned semantics"])
    detail = result.outcomes["pinned semantics"].detail
    assert not result.passed and 'found while checking: "Retaining a key that is already retained' in detail, detail
    assert "newer values win" not in detail and 'either copy\'s values may be kept' in detail, detail


def test_a_directed_checks_setup_that_breaks_an_invariant_is_reported_at_that_step():
    """A fork that counts no holder breaks invariant 1 while "no aliasing" sets up its scenario; the
    report names the fork and invariant 1, not the read the check goes on to scribble over."""
    from kvstate.stateful.conform import conform
    from foreign.bugs import BUGS

    (result,) = conform(BUGS["fork_without_refcount"], configs=[config_named("f32-heap")], checks=["no aliasing"])
    detail = result.outcomes["no aliasing"].detail
    assert detail.startswith("InvariantViolation: invariant 1: page "), detail
    assert "failing call: c2 = fork(ctx='c1')" in detail and "BrokenPromise" not in detail, detail


def test_prefix_edges_catches_a_page_budget_that_counts_shared_pages_once(monkeypatch):
    """From an audit: ``max_pages`` counts each entry's own pages as if nothing were shared; an engine
    counting the pages its entries share once kept entries the reference evicts, and passed at the
    ci budget (the scenario's keys shared no page). Entries now share pages through hits."""
    from kvstate.impl import tree_bounds

    def exceeded(bounds, tree):
        if len(tree) > bounds.max_entries:
            return True
        pages = {id(page) for node in tree.entries() for page in node.value._pages}     # shared ones once
        return bool(bounds.max_pages) and len(pages) > bounds.max_pages
    monkeypatch.setattr(tree_bounds.TreeBounds, "exceeded", exceeded)
    failure = fails("prefix edges", numpy_factory, "token-f16-heap-pages5")
    assert "as if nothing were shared" in str(failure)


def test_prefix_edges_catches_block_hashes_that_leave_out_their_parent(monkeypatch):
    """From an audit: a block cache whose chain hashed each block alone found a retained key's second block
    at a query's start, and passed every check (300 lockstep examples too); its hit held the key's first
    block. A key of two blocks matched by queries that begin with its second one now shows it."""
    from kvstate.stateful.conform import conform
    from foreign import block_pool

    config = next(c for c in block_pool.CONFIGS if not c.pool_pages and c.precision == "f32")
    (good,) = conform(block_pool.factory, configs=[config], checks=["prefix edges"])
    assert good.passed, good.failure
    monkeypatch.setattr(block_pool, "block_hash", lambda parent, block: hash(block))
    (bad,) = conform(block_pool.factory, configs=[config], checks=["prefix edges"])
    detail = bad.outcomes["prefix edges"].detail
    assert not bad.passed and "invariant 5" in detail and "taken from its start" in detail, detail
    assert "the engine's hit holds tokens (150, 151, 152, 153), not the query's first 4" in detail, detail


def test_a_directed_check_that_a_backend_exception_ends_is_shrunk_too(monkeypatch):
    """From an audit: a backend raising (not an assertion of the suite's) in ``prefix edges`` was reported
    with the check's whole sequence, 142 operations, where its replay shrinks to a handful."""
    from kvstate.impl import cache as cache_module
    from kvstate.stateful.conform import conform

    original_clear, original_match = cache_module.Cache.clear, cache_module.Cache.match
    cleared = set()

    def clear(cache):
        cleared.add(id(cache))
        return original_clear(cache)

    def match(cache, tokens):
        if id(cache) in cleared:
            raise ValueError("max() arg is an empty sequence")      # a walk that trips over what clear left
        return original_match(cache, tokens)
    monkeypatch.setattr(cache_module.Cache, "clear", clear)
    monkeypatch.setattr(cache_module.Cache, "match", match)
    (result,) = conform(numpy_factory, configs=[config_named("f32-heap")], checks=["prefix edges"])
    detail = result.outcomes["prefix edges"].detail
    assert detail.startswith("the backend raised ValueError"), detail
    assert "minimised failing sequence" in detail, detail
    operations = detail.split("minimised failing sequence", 1)[1].splitlines()[1:]
    assert 0 < len(operations) <= 4, operations


def test_boundaries_catch_a_block_hash_that_narrows_ids_at_blocks_of_16(monkeypatch):
    """From an audit: a block hash over ids narrowed to 16 bits passed at blocks of 16 (vLLM's default), where
    the narrowed-id query, 4 ids long, was no whole block. The key and the query are whole blocks now."""
    from foreign import block_pool

    config = block_pool.CONFIGS[0].with_(page_tokens=16, block_tokens=16)
    DIRECTED["boundaries"](block_pool.factory, config)
    monkeypatch.setattr(block_pool, "block_hash",
                        lambda parent, block: hash((parent, tuple(t & 0xFFFF for t in block))))     # 16 bits
    failure = fails("boundaries", block_pool.factory, config)
    assert "match exactly" in failure.promise and "engine matched 16 tokens, reference 0" in failure.saw, failure


def test_boundaries_catch_a_read_that_counts_the_spans_pages_from_its_length(monkeypatch):
    """From an audit: a read gathering as many pages as its length needs, from the page its start is in, lost
    rows where the span starts inside a page and stops inside a later one; every read checked was aligned
    to pages or one position long."""
    from foreign import block_pool
    from kvstate.spec.arithmetic import pages_needed

    def rows(ctx, array, start, stop):
        size = ctx.cache.page_tokens
        first = start // size
        gathered = array[ctx.pages[first:first + pages_needed(stop - start, size)]]    # one page short
        return gathered.reshape(-1, *array.shape[2:])[start - first * size:stop - first * size]
    monkeypatch.setattr(block_pool.BlockContext, "_rows", rows)
    failure = fails("boundaries", block_pool.factory, block_pool.CONFIGS[0])
    assert "inside a later page" in failure.promise and failure.call == "c1.read(2, 6)", failure


def test_boundaries_catch_tokens_kept_from_before_an_overwrite(monkeypatch):
    """From an audit: ``tokens`` kept what it last returned until the length changed, so an overwrite of a
    token did not show in it; the lockstep compares ``read()``, which was right."""
    from foreign import block_pool

    def tokens(ctx):
        kept = getattr(ctx, "kept", None)
        if kept is None or len(kept) != ctx.length:
            kept = ctx.kept = ctx._tokens(0, ctx.length).tolist()
        return list(kept)
    monkeypatch.setattr(block_pool.BlockContext, "tokens", property(tokens))
    failure = fails("boundaries", block_pool.factory, block_pool.CONFIGS[0])
    assert "after every write" in failure.promise and failure.call == "c1.tokens", failure
    assert "tokens [0, 1, 2, 3, 4, 5], reference [9, 1, 2, 3, 4, 5]" in failure.saw, failure


def test_prefix_edges_catch_a_block_moved_to_the_chain_of_a_later_key(monkeypatch):
    """From an audit: a block cache whose block has one hash moved a cached block to the chain of a later key
    that held it too (the context overwrote an earlier block, then was retained again), where it must copy
    it: the first key's hit lost its tail. Caught in 4 of 7 configurations, by chance."""
    from foreign import block_pool

    original = block_pool.BlockPoolCache.retain

    def retain(cache, ctx):
        chain = dict(zip(ctx.pages, ctx.hashes))
        for entry in cache.entries.values():
            moved = next((i for i, (page, h) in enumerate(zip(entry.pages, entry.hashes))
                          if chain.get(page, h) != h), None)
            for gone in entry.hashes[moved:] if moved is not None else ():      # unpublished from the older key
                del cache.index[gone][entry.key]
                if not cache.index[gone]:
                    del cache.index[gone]
            del entry.hashes[len(entry.hashes) if moved is None else moved:]
        return original(cache, ctx)
    monkeypatch.setattr(block_pool.BlockPoolCache, "retain", retain)
    failure = fails("prefix edges", block_pool.factory, block_pool.CONFIGS[0])
    assert "copied, not moved" in failure.promise and "engine matched 4 tokens, reference 8" in failure.saw, failure


def _block_pool_hashing_without_the_last_token(monkeypatch):
    from foreign import block_pool

    monkeypatch.setattr(block_pool, "block_hash", lambda parent, block: hash((parent, block[:-1])))
    return block_pool.factory


def _engine_rounding_a_block_up(monkeypatch):
    from kvstate.impl import matching

    rule = matching.hit_length
    monkeypatch.setattr(matching, "hit_length",
                        lambda match, block, common: rule(match, block, common + 1 if match == "block" else common))
    return numpy_factory


@pytest.mark.parametrize("plant", [_block_pool_hashing_without_the_last_token, _engine_rounding_a_block_up])
def test_prefix_edges_catch_a_query_one_token_apart_at_a_blocks_end(monkeypatch, plant):
    # Two audits (s73) planted these in vLLM's hash and SGLang's page alignment: random runs at block
    # size 16 never drew a query that agrees with a key up to a block's last token, and conform passed.
    factory = plant(monkeypatch)
    config = config_named("f32-heap").with_(page_tokens=16, match="block", block_tokens=16, max_entries=8)
    with pytest.raises(BrokenPromise, match="one token apart") as caught:
        DIRECTED["prefix edges"](factory, config)
    assert caught.value.invariant == 5, caught.value


class _LeakingClearBlackBox(ObservedAs):
    """kvstate's engine seen as a black box that counts its pages, whose ``clear()`` loses count of one
    page for each clear that dropped an entry: only the teardown's invariant 6 sees it."""

    lost = 0

    def clear(self):
        self.lost += bool(self.cache.observe().entries)
        return self.cache.clear()

    def seen(self, obs):
        from kvstate.spec.observation import black_box

        return dataclasses.replace(black_box(), pages_allocated=obs.pages_allocated,
                                   pages_freed=obs.pages_freed - self.lost)


@pytest.mark.parametrize("check", ["prefix edges", "boundaries"])
def test_a_directed_checks_failure_at_teardown_is_shrunk(check):
    # An audit (s73): invariant 6 broken at a directed check's teardown was printed unshrunk (268
    # operations, the teardown's clear being no operation of the run), and ``boundaries``' first run
    # printed no sequence at all.
    from kvstate.stateful.conform import conform

    (result,) = conform(_LeakingClearBlackBox, configs=[config_named("f32-heap")], checks=[check])
    detail = result.outcomes[check].detail
    assert detail.startswith("InvariantViolation: invariant 6") and "minimised failing sequence" in detail, detail
    operations = detail.split("minimised failing sequence", 1)[1].splitlines()[1:]
    assert 0 < len(operations) <= 5, operations


@pytest.mark.parametrize("name", ["checks_values_page_by_page", "match_unchecked", "token_limit_accepted"])
def test_a_bad_input_failure_is_reported_after_its_setup_alone(name):
    # An audit (s73): the report listed every refused call before the failing one (10 and 14 operations);
    # the failing call alone on a new context shows it after two (allocate, extend).
    factory, _, check, config_name, said = DIRECTED_CATCHES[name]
    detail = conform_report(factory, config_named(config_name), check)
    assert said in detail, detail
    operations = printed_steps(detail)
    assert [line.strip().split("(")[0].split(" = ")[-1] for line in operations][:2] == ["allocate", "extend"], detail
    assert len(operations) == 3, detail


@pytest.mark.parametrize("name", ["token-f32-heap", "block2-q8-heap", "token-f32-arena6-evict"])
def test_prefix_edges_catch_a_rewritten_hit_keeping_the_pages_it_was_taken_with(monkeypatch, name):
    # An audit's mutant (s73): a holding kept its base (the pages its hit was taken with) after a write
    # copied its first page, so a hit of the retained rewrite read the old pages; ci passed it.
    from kvstate.impl import holding

    replaced = holding.Holding.replaced
    monkeypatch.setattr(holding.Holding, "replaced",
                        lambda self, pages, slots, keep_base: replaced(self, pages, slots, True))
    with pytest.raises(BrokenPromise, match="overwritten at its start and retained"):
        DIRECTED["prefix edges"](numpy_factory, config_named(name))


@pytest.mark.parametrize("name", ["token-f32-heap", "block2-q8-heap", "token-f32-arena6-evict"])
def test_prefix_edges_catch_a_lazy_count_that_only_observing_settles(monkeypatch, name):
    # An audit's mutant (s73): a second hit of the same pages counted as none in the pending counts.
    # Every check observed before each operation, which settled the counts first; only races caught it.
    from kvstate.impl import refcounts

    def share_once(counts, ids):
        entry = counts.pending.get(id(ids))
        if entry is not None and entry[0] is ids:
            return
        if len(counts.pending) >= counts.FLUSH_AT:
            counts.flush()
        counts.pending[id(ids)] = [ids, 1]
    monkeypatch.setattr(refcounts.Refcounts, "share", share_once)
    with pytest.raises(BrokenPromise, match="nothing observed in between"):
        DIRECTED["prefix edges"](numpy_factory, config_named(name))


def _dropping(batch: str):
    """``Refcounts.share`` (``batch`` "pending": a hit's count on its run) or ``share_holding`` ("forked": a
    fork's on its holding) that, once ``FLUSH_AT`` are waiting, drops them instead of adding them."""
    from kvstate.impl import refcounts

    method = {"pending": "share", "forked": "share_holding"}[batch]
    honest = getattr(refcounts.Refcounts, method)

    def dropping(counts, shared):
        waiting = getattr(counts, batch)
        if len(waiting) >= counts.FLUSH_AT:
            if batch == "forked":
                for holding in waiting.values():
                    holding.forks = 0
            waiting.clear()
        honest(counts, shared)
    return refcounts.Refcounts, method, dropping


@pytest.mark.parametrize("batch, name", [("pending", "token-f32-heap"), ("pending", "block4-f32-pool12-refuse"),
                                         ("forked", "f32-heap"), ("forked", "block2-f16-pool10-evict-then-refuse")])
def test_prefix_edges_catch_counts_dropped_once_a_batch_of_them_is_waiting(monkeypatch, batch, name):
    # A mutant of kvstate's engine (s74): the deferred counts dropped, not added, once 64 were waiting.
    # It passed the whole default suite and conform: every lockstep run observes (and so settles the
    # counts) before each step and holds at most 8 contexts.
    monkeypatch.setattr(*_dropping(batch))
    with pytest.raises(BrokenPromise, match="a hundred hits of one entry"):
        DIRECTED["prefix edges"](numpy_factory, config_named(name))


def test_a_failure_only_an_unobserved_run_shows_is_shrunk_observing_as_that_run_did(monkeypatch):
    # Replayed with every step checked, the observations settled the counts and the failure vanished:
    # the report printed all 377 operations of the check unshrunk. Replayed observing as the check did,
    # it shrinks to the hits that fill the batch and one more, each but the last marked as run unobserved
    # (at 64, the engine's own batch: 68 operations).
    from kvstate.impl.refcounts import Refcounts

    monkeypatch.setattr(*_dropping("pending"))
    monkeypatch.setattr(Refcounts, "FLUSH_AT", 4)      # a batch of 4: the shrink has 5 hits to keep, not 65
    detail = conform_report(numpy_factory, config_named("token-f32-heap"), "prefix edges")
    assert detail.startswith("InvariantViolation: invariant 1") and "minimised failing sequence" in detail, detail
    steps = printed_steps(detail)
    assert len(steps) <= 3 + 5 + 2, steps
    assert sum(line.endswith("# unobserved") for line in steps) >= 4, steps
    # The last hit was checked, not observed before: marked so (an audit, s74: marked as observed, it replayed
    # observed, which settled the counts, and the printed sequence passed).
    assert " = match(tokens=" in steps[-1] and steps[-1].endswith("# unobserved, then checked"), steps
    assert "(unobserved: the step ran with no observe() before it, and no check after unless" in detail, detail


def test_the_shared_page_budget_scenario_catches_shared_pages_counted_once(monkeypatch):
    # An audit's mutant of the checker (s73): this scenario returning at once passed every test, since the
    # engine bug it was written for (a page budget counting a page shared by entries once) is now caught
    # by another scenario too. Run alone, it must catch that bug itself.
    from kvstate.impl import tree_bounds
    from kvstate.stateful.directed import prefix
    from kvstate.stateful.directed.common import start

    def exceeded_sharing_once(bounds, tree):
        held = {id(page) for node in tree.entries() for page in node.value._holding.pages}
        return len(tree) > bounds.max_entries or (bool(bounds.max_pages) and len(held) > bounds.max_pages)
    config = config_named("token-f16-heap-pages5")
    prefix._shared_page_budget(start(numpy_factory, config))
    monkeypatch.setattr(tree_bounds.TreeBounds, "exceeded", exceeded_sharing_once)
    with pytest.raises(BrokenPromise, match="as if nothing were shared"):
        prefix._shared_page_budget(start(numpy_factory, config))


def test_a_backend_keeping_its_counts_lazily_passes_what_runs_unobserved():
    from foreign import lazy_counts
    from kvstate.stateful.conform import conform

    (result,) = conform(lazy_counts.factory, configs=[config_named("f32-heap")],
                        checks=["fork isolation", "prefix edges", "1 write copies 1", "bad input"])
    assert all(outcome.status == "pass" for outcome in result.outcomes.values()), result.outcomes


def test_fork_isolation_catches_a_copy_on_write_that_reads_only_settled_counts():
    # An audit's backend (s74): copy-on-write ignored the counts it had queued, so a write right after a
    # fork landed in the shared page. Every check observed before each write, which settled the fork's
    # count, and it passed everything. Unobserved, the check shrinks it to the fork and the write.
    from foreign import lazy_counts

    detail = conform_report(lazy_counts.settled_cow_factory, config_named("f32-heap"), "fork isolation")
    assert detail.startswith("InvariantViolation: invariant 4: c1 position 0"), detail
    steps = printed_steps(detail)
    assert len(steps) <= 5, steps
    assert [step.split("(")[0].split(" = ")[-1].strip() for step in steps if "# unobserved" in step] == \
        ["fork", "overwrite"], steps


def test_the_lockstep_machine_runs_stretches_unobserved_and_shrinks_them_observed_as_they_ran():
    # A lazy backend freeing a page that a retain and a clear, queued together, leave held: every lockstep
    # step observed first, which applied each change alone, and it passed. The machine now leaves the
    # last steps of every 16 unobserved; its shrink keeps each operation it renames, simplifies or joins
    # observed as the one it came from (else a renamed step counted as observed, and a failure kept
    # another context's operations: 14 where 4 show it).
    from foreign import lazy_counts
    from kvstate.stateful.conform import conform

    detail = conform_report(lazy_counts.decrements_first_factory, config_named("f32-heap"), "lockstep")
    assert detail.startswith("InvariantViolation: invariant 2"), detail
    steps = printed_steps(detail)
    assert len(steps) <= 5, steps
    assert steps[-1].endswith("# unobserved, then checked"), steps
    (fine,) = conform(lazy_counts.factory, configs=[config_named("f32-heap")], checks=["lockstep"])
    assert fine.passed, fine.failure


def test_a_runs_teardown_observes_before_its_closes_as_a_replay_of_it_does():
    # An audit (s74): the teardown probed the entries through the engine, then closed each context taking the
    # last check's observation as what came before: a lazy backend's queued changes met a close no printed
    # step marked unobserved, and the printed sequence, replayed, passed. The run and its replay now agree.
    from foreign import lazy_counts
    from kvstate.stateful import ops as O
    from kvstate.stateful.lockstep import Lockstep
    from kvstate.stateful.replay import execute

    config = config_named("f32-heap").with_(page_tokens=4)
    ops = [O.Allocate(), O.Extend("c1", (0, 1, 2, 0, 1, 2), seed=1), O.Retain("c1"), O.Fork("c1"),
           O.Extend("c2", (1,), seed=2), O.Retain("c2"), O.Match((7, 7))]
    run = Lockstep(lazy_counts.decrements_first_factory, config)
    run.check_each_apply = True         # as a directed check runs: the books after every operation
    for op in ops:
        run.apply(op)
        run.check()
    try:
        run.finish()
        in_the_run = None
    except InvariantViolation as broken:
        in_the_run = broken.invariant
    replayed, _ = execute(lazy_counts.decrements_first_factory, config, ops)
    assert in_the_run == (None if replayed is None else replayed.invariant), (in_the_run, replayed)


def test_scale_catches_two_pending_forks_of_a_long_scattered_run_counted_as_one(monkeypatch):
    # A mutant of the engine (s74): ``add_holders`` past 96 slots added one holder for any number.
    from kvstate.impl import refcounts

    honest = refcounts.add_holders

    def one_holder_past_96(counts, ids, holders):
        honest(counts, ids, 1 if type(ids) is not range and len(ids) > 96 else holders)
    monkeypatch.setattr(refcounts, "add_holders", one_holder_past_96)
    with pytest.raises(BrokenPromise, match="thousands of live pages"):
        DIRECTED["scale"](numpy_factory, config_named("f32-heap"))


def test_scale_catches_books_that_grow_losing_the_last_slot(monkeypatch):
    # A mutant of the engine (s74): the books' arrays doubled without their last item, which only shows
    # where every slot is live when they grow. The scenario written for it catches it alone too.
    from kvstate.impl import pages
    from kvstate.stateful.directed import scale
    from kvstate.stateful.directed.common import start

    def at_least_but_the_last(array, length):
        if length <= len(array):
            return array
        grown = np.zeros(pages._doubled(len(array), length), array.dtype)
        grown[:len(array) - 1] = array[:-1]
        return grown
    monkeypatch.setattr(pages, "_at_least", at_least_but_the_last)
    with pytest.raises(BrokenPromise, match="thousands of live pages"):
        DIRECTED["scale"](numpy_factory, config_named("token-f32-heap"))
    with pytest.raises(BrokenPromise, match="thousands of live pages"):
        scale._full_at_each_doubling(start(numpy_factory, config_named("token-f32-heap").with_(page_tokens=1)))


def test_fork_isolation_catches_a_parents_own_pages_freed_at_the_wrong_slots(monkeypatch):
    # A mutant of the engine (s74): a release freeing some pages of one run of slots took their places in
    # the run as slots, right only for a run starting at slot 0.
    from kvstate.impl import pages
    from kvstate.impl.pages import PageAccountingError

    free = pages.PagePool._free

    def free_at_run_offsets(pool, freed_pages, slots, ids, *rest):
        if type(ids) is range and isinstance(slots, np.ndarray):
            slots = slots - ids.start
        return free(pool, freed_pages, slots, ids, *rest)
    monkeypatch.setattr(pages.PagePool, "_free", free_at_run_offsets)
    with pytest.raises(PageAccountingError, match="freed but not live"):
        DIRECTED["fork isolation"](numpy_factory, config_named("f32-heap"))
    # and the scenario written for it, alone (the passes before it happen to catch it too), which the check runs
    with pytest.raises(PageAccountingError, match="freed but not live"):
        checks_module._parent_closed_sharing_some(numpy_factory, config_named("f32-heap").with_(page_tokens=4))
    ran = []
    monkeypatch.setattr(checks_module, "_parent_closed_sharing_some", lambda factory, config: ran.append(config))
    monkeypatch.setattr(pages.PagePool, "_free", free)
    DIRECTED["fork isolation"](numpy_factory, config_named("f32-heap"))
    assert ran == [config_named("f32-heap")]


def test_boundaries_catch_a_read_layer_returning_another_layers_values(monkeypatch):
    # An audit's mutant of the checker (s73): ``_same_values`` comparing shapes and dtypes only passed the
    # whole suite; nothing ran ``boundaries`` against a wrong ``read_layer``. Here every layer reads layer 0.
    read_layer = context_module.Context._read_layer
    monkeypatch.setattr(context_module.Context, "_read_layer",
                        lambda ctx, layer, start, stop: read_layer(ctx, 0 if isinstance(layer, int) else layer,
                                                                   start, stop))
    with pytest.raises(BrokenPromise, match=r"read_layer\(1"):
        DIRECTED["boundaries"](numpy_factory, config_named("f32-heap"))


def test_a_refused_extend_that_keeps_a_position_is_named_a_refusal_that_changed_the_cache():
    # An audit's mutant of the checker (s73): ignoring a length difference after a refusal passed the whole
    # suite; the failure then read as invariant 4 ("c1 has 20 positions, reference has 19").
    from foreign import block_pool
    from foreign.bugs import _factory_for
    from kvstate.spec.errors import CapacityError, InvariantViolation
    from kvstate.stateful import ops as O
    from kvstate.stateful.lockstep import Lockstep

    class KeepsOne(block_pool.BlockContext):
        def extend(self, tokens, kv):
            try:
                return super().extend(tokens, kv)
            except CapacityError:
                self.length += 1        # planted: the refused extend keeps one position
                raise

    class RefusedExtendGrows(block_pool.BlockPoolCache):
        context_class = KeepsOne
    from kvstate.stateful.configs import configs_named

    [config] = configs_named(["block4-f32-pool10-evict-then-refuse"], block_pool.factory.configs)
    run = Lockstep(_factory_for(RefusedExtendGrows, block_pool.factory), config)
    handle = run.apply(O.Allocate())
    run.apply(O.Extend(handle, (1, 2, 3, 4, 5), seed=1))
    with pytest.raises(InvariantViolation, match="was refused .CapacityError. but changed the cache") as broken:
        run.apply(O.Extend(handle, tuple(range(40)), seed=2))       # 10 pages more: past the pool of 10
    assert broken.value.invariant == "refusal" and "positions" in str(broken.value), broken.value
