"""Planted bugs in ``audit_snapshots.py``: one subclass each, one broken promise each.

    kvstate conform tests/foreign/audit_snapshots_bugs.py:in_place_write

Four passed conform (ci) when the audit wrote them: trailing_bytes_accepted, layout_by_size,
content_not_checked, convert_without_range_check (audit2_repro/FINDINGS.md); ``damaged snapshots``
now restores well-formed hostile files too (``stateful/directed/hostile_snapshots.py``) and catches them.
"""

from __future__ import annotations

import os

import numpy as np

from kvstate.spec import precision as precisions
from kvstate.spec import snapshot_format as fmt
from kvstate.spec.errors import SnapshotLayoutError, SnapshotTruncatedError, SnapshotCorruptError, SnapshotWriteError

from .audit_snapshots import AuditCache, AuditContext, factory as _good


def _make(cls):
    def f(config):
        return cls(config)
    for name in ("configs", "any_page_size", "thread_safe"):
        setattr(f, name, getattr(_good, name))
    f.__name__ = f.__qualname__ = cls.__name__
    return f


# 1. A path write straight into the target: no temporary file, no fsync, no rename.
class InPlaceWrite(AuditCache):
    def write_path(self, data, target):
        try:
            with open(os.fspath(target), "wb") as file:
                file.write(data)
        except OSError as error:
            raise SnapshotWriteError(str(error)) from error


# 2. A restore that allocates its pages from the header before the body is validated (leaks on refusal).
class AllocateBeforeValidate(AuditCache):
    def restore(self, source, max_bytes=None):
        data = self.read_source(source)
        header = fmt.parse_header(data[:fmt.HEADER_V3_SIZE])
        with self.lock:
            ctx = self.adopt([], 0)
            for _ in range(-(-header.positions // self.page_tokens)):
                ctx.pages.append(self.new_page())
        tokens, encoded = self.parse(data)      # may raise: ctx and its pages stay
        with self.lock:
            ctx._store(0, tokens, encoded)
            ctx.length = len(tokens)
            return ctx


# 3. The body checksum is never verified (content checks only).
class ChecksumNotVerified(AuditCache):
    check_body = staticmethod(lambda header, body, body_crc=None: fmt.check_body_content(header, body))


# 4. close() without the cache lock: its refcount decrements race forks and retains.
class CloseWithoutLock(AuditContext):
    def close(self):
        self._open()
        for page in self.pages:
            page.refcount -= 1
            os.sched_yield()
            if page.refcount == 0:
                self.cache.live.pop(page.page_id, None)
                self.cache.freed += 1
        self.pages = []
        self.closed = True
        self.cache.contexts.remove(self)


class CloseWithoutLockCache(AuditCache):
    context_class = CloseWithoutLock


# 5. Body written layer-major (the engine's own per-layer tensors), read back the same way:
#    self-consistent, but not the format (positions must come first).
class LayerMajorBody(AuditCache):
    def snapshot_bytes(self, ctx):
        parts, tokens = ctx._gather(0, ctx.length)
        parts = [np.ascontiguousarray(np.swapaxes(p, 0, 1)) for p in parts]
        dtypes = [d for _, d, _ in fmt.body_sections(self.layout, self.precision, ctx.length)]
        body = b"".join(np.ascontiguousarray(s, dtype=d).tobytes() for s, d in zip([tokens, *parts], dtypes))
        v = fmt.FORMAT_VERSION
        return fmt.pack_header(self.precision, self.layout, ctx.length, fmt.body_checksum(v, body), version=v) + body

    def parse(self, data):
        header = fmt.parse_header(data[:fmt.HEADER_V3_SIZE])
        tokens, encoded = super().parse(data)
        if header.precision != self.precision:
            return tokens, encoded
        n = len(tokens)
        fixed = []
        for part in encoded:
            flat = np.ascontiguousarray(part).reshape(-1)
            shape = (part.shape[1], n, *part.shape[2:])
            fixed.append(np.ascontiguousarray(np.swapaxes(flat.reshape(shape), 0, 1)))
        return tokens, tuple(fixed)


# 6. A restore into f16 that lets an overflow out as a plain PrecisionRangeError, not a SnapshotError,
#    and converts precision with roundtrip instead of encode (no check).
class ConvertWithoutRangeCheck(AuditCache):
    def parse(self, data):
        header = fmt.parse_header(data[:fmt.HEADER_V3_SIZE])
        if header.precision == self.precision:
            return super().parse(data)
        if header.layout != self.layout:
            raise SnapshotLayoutError("layout")
        end = header.size + header.body_bytes
        if len(data) < end:
            raise SnapshotTruncatedError("short")
        if len(data) > end:
            raise SnapshotCorruptError("long")
        arrays = fmt.check_body(header, data[header.size:end])
        stored = (arrays["values"],) + ((arrays["scales"],) if header.precision == "q8" else ())
        values = precisions.decode(header.precision, stored)
        if self.precision == "f16":
            with np.errstate(over="ignore"):
                return arrays["tokens"].astype(np.int64), (values.astype(np.float16),)
        return arrays["tokens"].astype(np.int64), precisions.encode(self.precision, values)


in_place_write = _make(InPlaceWrite)
allocate_before_validate = _make(AllocateBeforeValidate)
checksum_not_verified = _make(ChecksumNotVerified)
close_without_lock = _make(CloseWithoutLockCache)
layer_major_body = _make(LayerMajorBody)
convert_without_range_check = _make(ConvertWithoutRangeCheck)
BUGS = ["in_place_write", "allocate_before_validate", "checksum_not_verified", "close_without_lock",
        "layer_major_body", "convert_without_range_check"]


# 7. The temporary file is synced and renamed, but the folder is never synced after the rename.
class NoFolderFsync(AuditCache):
    def write_path(self, data, target):
        import tempfile
        path = os.fsdecode(os.fspath(target))
        folder = os.path.dirname(os.path.abspath(path))
        fd, temp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=fmt.TEMP_SUFFIX, dir=folder)
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temp, path)
        except OSError as error:
            raise SnapshotWriteError(str(error)) from error


# 8. A restore reads header + body and ignores whatever follows (a longer file is accepted).
class TrailingBytesAccepted(AuditCache):
    def parse(self, data):
        header = fmt.parse_header(data[:fmt.HEADER_V3_SIZE])
        return super().parse(data[:header.size + header.body_bytes])


# 9. The layout is compared by values per position only (1x2x8 passes for 2x2x4).
class LayoutBySize(AuditCache):
    def parse(self, data):
        header = fmt.parse_header(data[:fmt.HEADER_V3_SIZE])
        l = header.layout
        if l.layers * l.kv_heads * l.head_dim == self.layout.layers * self.layout.kv_heads * self.layout.head_dim:
            real = self.layout
            self.layout = l
            try:
                tokens, encoded = super().parse(data)
            finally:
                self.layout = real
            return tokens, tuple(np.ascontiguousarray(p).reshape(len(tokens), *(
                real.position_shape if p.ndim == 5 else real.position_shape[:-1])) for p in encoded)
        return super().parse(data)


# 10. As 4, without the yield: close() outside the lock, as an author would write it.
class ClosePlain(AuditContext):
    def close(self):
        self._open()
        for page in self.pages:
            self.cache.release(page)
        self.pages = []
        self.closed = True
        self.cache.contexts.remove(self)


class ClosePlainCache(AuditCache):
    context_class = ClosePlain


# 11. A restore that allocates first and frees what it took when validation fails.
class AllocateThenFree(AuditCache):
    def restore(self, source, max_bytes=None):
        data = self.read_source(source)
        header = fmt.parse_header(data[:fmt.HEADER_V3_SIZE])
        with self.lock:
            ctx = self.adopt([], 0)
            ctx.pages = [self.new_page() for _ in range(-(-header.positions // self.page_tokens))]
        try:
            tokens, encoded = self.parse(data)
        except Exception:
            ctx.close()
            raise
        with self.lock:
            ctx._store(0, tokens, encoded)
            ctx.length = len(tokens)
            return ctx


no_folder_fsync = _make(NoFolderFsync)
trailing_bytes_accepted = _make(TrailingBytesAccepted)
layout_by_size = _make(LayoutBySize)
close_plain = _make(ClosePlainCache)
allocate_then_free = _make(AllocateThenFree)
BUGS += ["no_folder_fsync", "trailing_bytes_accepted", "layout_by_size", "close_plain", "allocate_then_free"]


# 12. The body checksum is verified, but not the tokens and values behind it (a hostile file with a
#     valid checksum restores NaN or a negative token).
class ContentNotChecked(AuditCache):
    check_body = staticmethod(lambda header, body, body_crc=None: (
        fmt.check_body_crc(header, fmt.body_checksum(header.version, body, header.checksum)),
        fmt.split_body(header, body))[1])


content_not_checked = _make(ContentNotChecked)
BUGS += ["content_not_checked"]


# 13. fork() outside the lock (refcount increments race releases), no yield added.
class ForkPlain(AuditContext):
    def fork(self):
        self._open()
        ctx = self.cache.context_class(self.cache, list(self.pages), self.length)
        for page in ctx.pages:
            page.refcount += 1
        with self.cache.lock:
            self.cache.contexts.append(ctx)
        return ctx


class ForkPlainCache(AuditCache):
    context_class = ForkPlain


# 14. The restore's pages join the cache outside the lock (new_page's id counter and books race).
class RestoreUnlocked(AuditCache):
    def restore(self, source, max_bytes=None):
        data = self.read_source(source)
        tokens, encoded = self.parse(data)
        ctx = self.adopt([], 0)
        ctx._store(0, tokens, encoded)
        ctx.length = len(tokens)
        return ctx


fork_plain = _make(ForkPlainCache)
restore_unlocked = _make(RestoreUnlocked)
BUGS += ["fork_plain", "restore_unlocked"]


# 15. (an audit of the snapshot checks, s72) The body checksum is checked only where there is a body: a
#     file of no positions restores whatever its body_crc says.
class EmptyBodyChecksumSkipped(AuditCache):
    @staticmethod
    def check_body(header, body, body_crc=None):
        if header.positions == 0:
            return fmt.check_body_content(header, body)
        return fmt.check_body(header, body, body_crc)


# 16. (the same audit) A restore into pages of fewer than 4 tokens drops the last, partly filled one.
class SmallPageDropsPartial(AuditCache):
    def parse(self, data):
        tokens, encoded = super().parse(data)
        if self.page_tokens < 4 and len(tokens) % self.page_tokens:
            keep = len(tokens) // self.page_tokens * self.page_tokens
            tokens, encoded = tokens[:keep], tuple(part[:keep] for part in encoded)
        return tokens, encoded


empty_body_checksum_skipped = _make(EmptyBodyChecksumSkipped)
small_page_drops_partial = _make(SmallPageDropsPartial)
