"""The NumPy page store (the backend factory is ``impl/numpy.py``).

A page is a tuple of arrays in layer-major order: ``(values,)`` of shape
``(layers, 2, page_tokens, kv_heads, head_dim)`` for f32/f16, plus
``scales`` of shape ``(layers, 2, page_tokens, kv_heads)`` for q8.
With an arena, those arrays are views into one preallocated block per component.
"""

from __future__ import annotations

import math
import sys
from sys import getrefcount
from contextlib import contextmanager
from typing import Iterator

import numpy as np

from kvstate.spec import precision as precisions
from kvstate.spec.errors import ConfigError, DTypeError
from kvstate.spec.layout import Layout, all_finite, is_torch_tensor, require_finite

from .arena import SlotArena
from .memory import check_store_size
from .store import StoreCounters


HUGE_PAGE = 2 << 20
_MADV_NOHUGEPAGE = 15


def _libc_madvise():
    try:
        import ctypes
        import sys

        if not sys.platform.startswith("linux"):
            return None
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return madvise
    except (ImportError, OSError, AttributeError):
        return None


_madvise = _libc_madvise()


def huge_page_array(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An unzeroed array whose first byte sits on a 2 MiB boundary, so Linux's transparent huge
    pages (which NumPy requests for large arrays) back all of it but the last partial 2 MiB.

    A fresh page of a few MiB is otherwise mostly 4 KiB pages: its first touch costs one fault
    per 4 KiB, about as much as the copy that fills it (measured: 43 ms against 18 ms to fill 32
    pages of 4.7 MB). The partial tail is marked ``MADV_NOHUGEPAGE`` so no huge page reaches
    into the unused slack: memory in use stays the array's own size, give or take 4 KiB.
    Arrays under 2 MiB, and systems without ``madvise``, get an unaligned block. Either way the
    array is a view of a uint8 block only it holds, which is how ``free`` knows it may reuse it.
    """
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes < HUGE_PAGE or _madvise is None:
        return np.empty(nbytes, np.uint8).view(dtype).reshape(shape)     # a view of a block, as below
    raw = np.empty(nbytes + HUGE_PAGE, np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    tail = start + nbytes // HUGE_PAGE * HUGE_PAGE
    if tail < len(raw):
        _madvise(raw.ctypes.data + tail, len(raw) - tail, _MADV_NOHUGEPAGE)   # advice: a failure costs speed only
    return raw[start:start + nbytes].view(dtype).reshape(shape)


# Freed heap pages kept for the next restore (``prepare``), allocation or clone, up to this many
# bytes: a write into them copies at memory speed instead of faulting fresh memory in (and the
# kernel zeroing it).
SPARE_BYTES = 256 << 20
SPARE_OVERHEAD = 512     # bytes a kept buffer costs beyond its arrays (buffer, tuple, array objects: ~400 measured)
# New heap pages from this size on are made on huge-page boundaries (``huge_page_array``); smaller
# ones by ``np.zeros``. Pages of any size are recycled (``free_all``).
HUGE_PAGE_ARRAYS_FROM_BYTES = HUGE_PAGE
# ``encode``'s private copy of a batch from this size on goes into scratch memory the store keeps
# for the next encode (one block, up to ``STAGING_BYTES``; smaller copies come from malloc, which
# recycles them itself). Fresh memory pays a fault per 4 KiB on first touch (``bench.extend``
# against the commit before this: 1.11x at 512 positions, 1.24x at 2,048).
STAGE_FROM_BYTES = HUGE_PAGE
STAGING_BYTES = 256 << 20


def _unshared(arrays: tuple[np.ndarray, ...]) -> bool:
    """Whether nothing but ``arrays`` references their memory, so a new page may take it over: each
    array owns its memory (``np.zeros``: no ``base``) and only the tuple holds it, or is the only
    view of a uint8 block (``huge_page_array``). A page some caller still sees through a view (the
    view holds the array, or the block) is never reused: it is just dropped."""
    for array in arrays:
        owner = array.base
        if owner is None:
            if getrefcount(array) > _ARRAY_REFS:
                return False
        elif (type(owner) is not np.ndarray or owner.base is not None or getrefcount(owner) > _OWNER_REFS
              or getrefcount(array) > _ARRAY_REFS):      # a view shows in the block's count; the array, in its own
            return False
    return True


def _baseline_refs() -> tuple[int, int, int, int, int]:
    """The references ``_spare`` and ``_unshared`` count where nothing else holds what they test
    (interpreter-specific), read as they read them: (a kept buffer's, popped from the spares; its
    arrays tuple's; an owning array's, held by its tuple, as ``_spare`` reads it; as ``_unshared``
    reads one; a block's, held by its one view). ``_reuse_is_safe`` checks them in use."""
    spares = [NumpyBuffer((np.zeros(1, np.float32),), SPARE)]
    buffer = spares.pop()
    kept = getrefcount(buffer)
    arrays = buffer.arrays
    tupled = getrefcount(arrays)
    sole = getrefcount(arrays[0])
    for array in (np.zeros(1, np.float32),):
        owning = getrefcount(array)
    for array in (huge_page_array((HUGE_PAGE // 4 + 1,), np.float32),):
        owner = array.base
        viewed = getrefcount(owner)
    return kept, tupled, sole, owning, viewed


SPARE = -1       # a ``NumpyBuffer.slot`` while the store keeps the buffer for reuse (no page holds it)


class NumpyBuffer:
    """A page's arrays, and its arena slot: None on the heap, ``SPARE`` once freed and kept."""

    __slots__ = ("arrays", "slot")

    def __init__(self, arrays: tuple[np.ndarray, ...], slot: int | None):
        self.arrays = arrays
        self.slot = slot


class _Staged(tuple):
    """``encode``'s result for f32 when its rows are views of the store's scratch block
    (``staging``): ``recycle`` hands the block on to the next encode."""


class NumpyStore:
    def __init__(self, layout: Layout, page_tokens: int, precision: str, arena_pages: int = 0):
        self.layout = layout
        self.page_tokens = page_tokens
        self.precision = precision
        self.arena_pages = arena_pages
        self.counters = StoreCounters()
        self._shapes = [layout.page_shape(page_tokens)]
        self._dtypes = [precisions.VALUE_DTYPES[precision]]
        if precision == "q8":
            self._shapes.append(layout.page_shape(page_tokens)[:-1])
            self._dtypes.append(np.float32)
        self.page_bytes = sum(math.prod(s) * np.dtype(d).itemsize for s, d in zip(self._shapes, self._dtypes))
        check_store_size(self.page_bytes, arena_pages)
        self._arena = SlotArena(arena_pages, self.counters)
        self._prepared: list[tuple[np.ndarray, ...]] = []     # filled by ``prepare``, handed out by ``adopting``
        # Freed heap pages' buffers, handed out again by the next allocation, clone or restore
        # (``free_all``, ``_spare``): memory already faulted in, and no arrays made or dropped a page.
        self._spares: list[NumpyBuffer] = []
        # Scratch for ``encode``'s private copies (``STAGE_FROM_BYTES`` on): flat float32 blocks,
        # each taken by one encode at a time (list.pop and append are atomic; encodes run concurrently).
        self._staging: list[np.ndarray] = []
        try:
            self._blocks = [np.zeros((arena_pages, *s), d) for s, d in zip(self._shapes, self._dtypes)]
        except (MemoryError, ValueError) as error:
            raise ConfigError(f"an arena of {arena_pages} pages of {self.page_bytes} bytes cannot be allocated: "
                              f"{error!r}") from None

    # -- encoding (validation happens here, before anything is written) -----------

    def encode(self, kv) -> tuple[np.ndarray, ...]:
        if is_torch_tensor(kv):
            try:
                kv = kv.detach().cpu().numpy()
            except (RuntimeError, NotImplementedError, TypeError) as error:   # meta, sparse tensors
                raise DTypeError(f"cannot take K/V values from a {kv.layout} tensor on {kv.device}: {error}") from None
        elif not isinstance(kv, np.ndarray):
            raise DTypeError(f"the numpy store takes NumPy arrays or torch tensors, got {type(kv).__name__}")
        # One private copy first, checked and stored: a caller changing its array meanwhile changes nothing.
        staging, kv = self._private_copy(kv)
        try:
            if not all_finite(kv):      # one read of the copy; only a refusal pays for naming the bad value
                require_finite(kv)
            encoded = (kv,) if self.precision == "f32" else precisions.encode(self.precision, kv)
        except BaseException:
            self._keep_staging(staging)      # refused: nothing reads the copy any more
            raise
        # position-major batch -> layer-major rows, the page's own order
        rows = tuple(np.moveaxis(part, 0, 2) for part in encoded)
        if staging is None or self.precision != "f32":
            self._keep_staging(staging)      # f16, q8: the rows are new arrays, the copy is done with
            return rows
        staged = _Staged(rows)
        staged.staging = staging
        return staged

    def recycle(self, encoded) -> None:
        """``encode``'s scratch back for the next encode; the caller reads ``encoded`` no more."""
        if type(encoded) is _Staged:
            self._keep_staging(encoded.staging)

    def _private_copy(self, kv: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """(the scratch block it lies in or None, a float32 copy of ``kv``)."""
        size = kv.size
        if size * 4 < STAGE_FROM_BYTES:
            return None, np.array(kv, dtype=np.float32, copy=True, subok=False)
        try:
            staging = self._staging.pop()
        except IndexError:
            staging = None
        if staging is None or staging.size < size:
            staging = np.empty(size, np.float32)      # a smaller kept block is dropped: this one is kept after
        copy = staging[:size].reshape(kv.shape)
        np.copyto(copy, kv)
        return staging, copy

    def _keep_staging(self, staging: np.ndarray | None) -> None:
        if staging is None or staging.nbytes > STAGING_BYTES:
            return
        kept = self._staging
        kept.append(staging)
        while len(kept) > 1:        # hand-backs at once: each drops the oldest until one is left
            try:
                kept.pop(0)
            except IndexError:      # another thread dropped it, or an encode took it
                break

    # -- memory ----------------------------------------------------------------------

    def _take(self, page_id: int, zero: bool) -> NumpyBuffer:
        slot = self._arena.issue(page_id)
        try:        # the slot back if filling it fails or is interrupted: else it stayed out for good
            if self._prepared:
                prepared = self._prepared.pop()
                if slot is None:
                    return NumpyBuffer(prepared, None)
                arrays = tuple(block[slot] for block in self._blocks)
                for dst, src in zip(arrays, prepared):     # the arena keeps its slots: one more copy, into them
                    np.copyto(dst, src)
                if _RECYCLE and self._spare_room() > 0:
                    self._spares.append(NumpyBuffer(prepared, SPARE))
                return NumpyBuffer(arrays, slot)
            if slot is None:
                return self._heap_buffer(zero)
            arrays = tuple(block[slot] for block in self._blocks)
            if zero:
                # A recycled slot still holds the last page's bytes: zero it on issue.
                for array in arrays:
                    array.fill(0)
            return NumpyBuffer(arrays, slot)
        except BaseException:
            self._arena.give_back(slot)
            raise

    def _heap_buffer(self, zero: bool) -> NumpyBuffer:
        """A page outside the arena: a freed page's buffer, where one is kept (``free_all``), else new
        arrays. Reuse skips what a new page costs: at one-token pages, an ``np.zeros`` and a buffer a
        page and their release (a third of an eviction's frees, ``bench/bounded_vs_sglang.py``); from
        2 MiB, a fault per 4 KiB on first touch, which cost a 512-position ``extend`` three times its
        copy."""
        buffer = self._spare()
        if buffer is None:
            return self._fresh_buffer(zero)
        buffer.slot = None
        if zero:        # a spare holds its last page's bytes
            for array in buffer.arrays:
                array.fill(0)
        return buffer

    def _fresh_buffer(self, zero: bool) -> NumpyBuffer:
        """New arrays for a page outside the arena, zeroed where ``zero``: from 2 MiB on huge-page
        boundaries (``huge_page_array``), so that a page is faulted in by 2 MiB, not 4 KiB."""
        if self.page_bytes < HUGE_PAGE_ARRAYS_FROM_BYTES:     # ``np.zeros``: zeroed already, by calloc
            shapes, dtypes = self._shapes, self._dtypes
            if len(shapes) == 1:        # f32, f16: 0.8 µs, where ``tuple(map(...))`` took 1.6 and a generator 2.5
                return NumpyBuffer((np.zeros(shapes[0], dtypes[0]),), None)
            return NumpyBuffer(tuple(map(np.zeros, shapes, dtypes)), None)
        buffer = NumpyBuffer(tuple(huge_page_array(s, d) for s, d in zip(self._shapes, self._dtypes)), None)
        if zero:        # whatever malloc left there
            for array in buffer.arrays:
                array.fill(0)
        return buffer

    def _spare_room(self) -> int:
        """How many more freed buffers the spares may keep: ``SPARE_BYTES`` of them, each counted at
        ``SPARE_OVERHEAD`` at least (its objects, where a one-token page's arrays are a few bytes)."""
        return SPARE_BYTES // max(self.page_bytes, SPARE_OVERHEAD) - len(self._spares)

    def _spare(self) -> NumpyBuffer | None:
        """A kept buffer (``free_all``) that nothing else holds, or None. One that something still holds
        (a freed page still listed somewhere, its arrays tuple, an array, a view of one) is dropped,
        never reused (``_reuse_is_safe`` checks at import that these counts hold here). Inlined
        checks: at one-token pages a call here costs as much as the ``np.zeros`` it saves."""
        spares = self._spares
        while spares:
            try:
                buffer = spares.pop()      # list.pop is atomic: ``prepare`` may run meanwhile
            except IndexError:
                return None
            arrays = buffer.arrays
            if arrays and getrefcount(buffer) <= _BUFFER_REFS and getrefcount(arrays) <= _TUPLE_REFS and (
                    getrefcount(arrays[0]) <= _SOLE_REFS and arrays[0].base is None and len(arrays) == 1
                    or _unshared(arrays)):
                return buffer
            buffer.arrays = ()
        return None

    def allocate(self, page_id: int) -> NumpyBuffer:
        return self._take(page_id, zero=True)

    def allocate_all(self, first_page_id: int, count: int) -> list[NumpyBuffer]:
        """``allocate`` of ``count`` pages numbered from ``first_page_id``, all or none: failing part
        way (memory ran out), it frees what it made before the error propagates. Where no arena slot
        is free and no restore's arrays wait, the pages go straight to ``_heap_buffer``: at one-token
        pages an ``extend`` makes hundreds, and ``_take``'s call and slot lookup a page were a tenth
        of it (``python -m kvstate.bench.one_token_pages``)."""
        made: list[NumpyBuffer] = []
        try:
            if self._prepared or self._arena.free:     # page by page, as ``allocate`` takes them
                for page_id in range(first_page_id, first_page_id + count):
                    made.append(self.allocate(page_id))
            else:
                heap, fresh, spares = self._heap_buffer, self._fresh_buffer, self._spares
                try:
                    for _ in range(count):      # once the spares run out, new arrays without asking for one
                        made.append(heap(True) if spares else fresh(True))
                finally:
                    self._arena.count_heap(len(made))     # each page made a heap page, as ``issue`` counts it
        except BaseException:
            self.free_all(made)
            raise
        return made

    def prepare(self, count: int, last_filled: int) -> list[tuple[np.ndarray, ...]]:
        """Arrays for ``count`` pages that a restore fills before any page exists (nothing in the
        cache changes): unzeroed, so the restore's copy is each byte's first touch, except the
        last page's offsets from ``last_filled`` on, which nothing will write and must read zero."""
        prepared = []
        while len(prepared) < count:
            spare = self._spare()
            prepared.append(tuple(huge_page_array(s, d) for s, d in zip(self._shapes, self._dtypes))
                            if spare is None else spare.arrays)
        if prepared:
            for array in prepared[-1]:
                array[:, :, last_filled:] = 0
        return prepared

    @contextmanager
    def adopting(self, prepared: list[tuple[np.ndarray, ...]]) -> Iterator[None]:
        """``allocate`` hands out ``prepared``'s arrays, in order, instead of new ones (an arena
        slot still backs the page where one is free: the arrays are copied into it). Used under
        the cache lock, around one ``PagePool.new_pages``; what it did not hand out is dropped."""
        self._prepared = prepared[::-1]
        try:
            yield
        finally:
            self._prepared = []

    def write_rows(self, arrays: tuple[np.ndarray, ...], part: int, offset: int, rows: np.ndarray) -> None:
        """Position-major ``rows`` of one component into a prepared page from ``offset``."""
        arrays[part][:, :, offset:offset + len(rows)] = np.moveaxis(rows, 0, 2)

    def free(self, buffer: NumpyBuffer) -> None:
        self.free_all((buffer,))

    def free_all(self, buffers) -> None:
        """``free`` of each buffer, in one call: an eviction at one-token pages frees hundreds, and a
        call a buffer was a fifth of it. A heap page's buffer is kept whole as a spare for the next
        allocation, clone or restore (``_spare``), up to ``SPARE_BYTES``; its slot marks it kept, so a
        buffer freed twice is kept once. Failing part way (an interrupt, a slot given back twice), it
        frees the rest before re-raising: the pool has let go of every page it handed over.

        With no arena every buffer is a heap page's, and the spares take them in one step, not a
        step a buffer (at one-token pages that loop was a third of a retain that evicts): none is
        marked, since ``_spare`` hands out no buffer that anything else still holds, and so none
        listed twice (the pool refuses a second free before it gets here)."""
        if not self.arena_pages and type(buffers) is list:
            room = max(self._spare_room(), 0) if _RECYCLE else 0
            self._spares += buffers[:room]      # one call: an interrupt lands before it or after it
            for buffer in buffers[room:]:
                buffer.arrays = ()       # past the budget: let go
            return
        kept = []
        pending = iter(buffers)
        try:
            for buffer in pending:
                slot = buffer.slot
                if slot is None:
                    buffer.slot = SPARE
                    kept.append(buffer)
                elif slot != SPARE:
                    self._arena.give_back(slot)      # first: a slot given back twice raises before any change
                    buffer.arrays = ()
        except BaseException:
            self.free_all(list(pending))
            raise
        finally:
            room = max(self._spare_room(), 0) if _RECYCLE else 0
            for buffer in kept[room:]:
                buffer.arrays = ()       # past the budget: let go
            self._spares += kept[:room]

    # Spares and scratch are memory this process may reuse, not state: a clone of the store starts without them.
    def __getstate__(self) -> dict:
        return {**self.__dict__, "_spares": [], "_prepared": [], "_staging": []}

    def copy(self, source: NumpyBuffer, page_id: int) -> NumpyBuffer:
        target = self._take(page_id, zero=False)   # every byte is overwritten below
        try:        # an interrupt lands as ``copyto`` returns: the slot back, or it stayed out for good
            for dst, src in zip(target.arrays, source.arrays):
                np.copyto(dst, src)
            self.counters.pages_copied += 1
            self.counters.bytes_copied += self.page_bytes
        except BaseException:
            self._arena.give_back(target.slot)
            target.arrays = ()
            raise
        return target

    # -- values ----------------------------------------------------------------------

    def write(self, buffer: NumpyBuffer, offset: int, encoded: tuple[np.ndarray, ...], lo: int, hi: int) -> None:
        for dst, src in zip(buffer.arrays, encoded):
            dst[:, :, offset:offset + hi - lo] = src[:, :, lo:hi]

    def write_whole(self, buffers: list[NumpyBuffer], encoded: tuple[np.ndarray, ...], row: int) -> None:
        """``write`` of whole pages: rows ``[row, row + len(buffers) * page_tokens)`` of ``encoded``,
        one page's rows each, in order. The rows are cut into pages by one reshape, not a slice a
        page: at one-token pages a write's two 5-d slices were three quarters of its time."""
        pages, page_tokens = len(buffers), self.page_tokens
        for part, rows in enumerate(encoded):
            rows = rows[:, :, row:row + pages * page_tokens]
            by_page = np.moveaxis(rows.reshape(*rows.shape[:2], pages, page_tokens, *rows.shape[3:]), 2, 0)
            for buffer, page_rows in zip(buffers, by_page):
                buffer.arrays[part][...] = page_rows

    def read(self, buffer: NumpyBuffer, start: int, stop: int) -> np.ndarray:
        parts = tuple(array[:, :, start:stop] for array in buffer.arrays)
        # layer-major rows -> position-major; transpose, not moveaxis: a quarter of the cost at one page
        return np.ascontiguousarray(precisions.decode(self.precision, parts).transpose(_POSITIONS_FIRST))

    def read_spans(self, spans: list[tuple[NumpyBuffer, int, int]]) -> np.ndarray:
        """What ``concat`` of ``read`` over ``spans`` (each ``(buffer, start, stop)``) returns, decoded
        and transposed once for them all: a read of many small pages pays one decode, not one each."""
        if len(spans) == 1:
            return self.read(*spans[0])
        whole = self.page_tokens    # a whole page's arrays go in as they are: a 5-d slice costs a microsecond each
        parts = tuple(np.concatenate([buffer.arrays[i] if hi - lo == whole else buffer.arrays[i][:, :, lo:hi]
                                      for buffer, lo, hi in spans], axis=2)
                      for i in range(len(spans[0][0].arrays)))
        return np.ascontiguousarray(precisions.decode(self.precision, parts).transpose(_POSITIONS_FIRST))

    def stored_spans(self, spans: list[tuple[NumpyBuffer, int, int]]) -> tuple[np.ndarray, ...]:
        """A copy of the stored rows of ``spans`` (each ``(buffer, start, stop)``), joined per stored
        part in ``encode``'s layer-major form: what ``write`` takes back as they are (an overwrite
        keeps them to undo itself). One ``concatenate`` a part, a copy even for one span."""
        return tuple(np.concatenate([buffer.arrays[i][:, :, lo:hi] for buffer, lo, hi in spans], axis=2)
                     for i in range(len(spans[0][0].arrays)))

    def read_encoded(self, buffer: NumpyBuffer, start: int, stop: int) -> tuple[np.ndarray, ...]:
        return tuple(np.moveaxis(array[:, :, start:stop], 2, 0) for array in buffer.arrays)

    def from_encoded(self, parts: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        return tuple(np.moveaxis(part, 0, 2) for part in parts)

    def read_layer(self, buffer: NumpyBuffer, layer: int, start: int, stop: int):
        if self.precision == "f32":
            (values,) = buffer.arrays
            return values[layer, 0, start:stop], values[layer, 1, start:stop]   # views: gather copies
        parts = tuple(array[layer, :, start:stop] for array in buffer.arrays)
        decoded = precisions.decode(self.precision, parts)
        return decoded[0], decoded[1]

    def gather(self, parts: list[np.ndarray], layer_shape: tuple[int, ...]) -> np.ndarray:
        if not parts:
            return np.zeros(layer_shape, np.float32)
        return np.concatenate(parts)

    def read_empty(self) -> np.ndarray:
        return np.zeros(self.layout.batch_shape(0), np.float32)

    def concat(self, parts: list[np.ndarray]) -> np.ndarray:
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def is_zero_from(self, buffer: NumpyBuffer, offset: int) -> bool:
        if offset >= self.page_tokens:
            return True           # a full page has no unwritten tail (``observe`` asks of every page)
        return all(not array[:, :, offset:].any() for array in buffer.arrays)

    def arena_books(self) -> tuple[int, dict[int, int], tuple[int, ...]]:
        return self._arena.books()


_POSITIONS_FIRST = (2, 0, 1, 3, 4)     # (layers, 2, positions, heads, dim) -> (positions, layers, 2, heads, dim)
_BUFFER_REFS, _TUPLE_REFS, _SOLE_REFS, _ARRAY_REFS, _OWNER_REFS = _baseline_refs()
_RECYCLE = True     # ``_reuse_is_safe`` probes with it on


def _reuse_is_safe() -> bool:
    """Whether ``_spare``, run hot as an extend runs it, takes back a free buffer and refuses one that a
    caller still holds (the buffer, its arrays tuple, an array, a view of one). Its counts are read
    once above, cold; an interpreter that counts a reference fewer in specialised code, or a build
    without the GIL (where ``getrefcount`` is not exact), would reuse a held buffer: recycling is then
    off, and freed heap pages are let go as they were before it."""
    if not getattr(sys, "_is_gil_enabled", lambda: True)():
        return False
    store = NumpyStore(Layout(1, 1, 1), 1, "f32")
    for round_ in range(64):      # past the adaptive interpreter's warm-up: ``_spare`` specialised
        store.free(store.allocate(0))
        if len(store._spares) != 1 or store._spare() is None:
            return False          # a free buffer refused: safe, but the probe is broken
        held = store.allocate(0)
        keep = (held, held.arrays, held.arrays[0], held.arrays[0][:, :1])[round_ % 4]
        store.free(held)
        del held
        if store._spare() is not None:
            return False          # a held buffer handed out again
        del keep
    return True


_RECYCLE = _reuse_is_safe()
