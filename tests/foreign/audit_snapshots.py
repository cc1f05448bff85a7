"""An audit's engine written from README alone: pages tier, snapshots in kvstate's format, a lock.

Pages hold the cache's encoded form (``spec.precision.encode``: f32/f16 values, q8 codes and
scales), so a snapshot body is that form, position-major (``spec.snapshot_format``). One RLock
guards every operation (README "Concurrency": one cache from many threads), so the factory
declares ``thread_safe``. ``read_page`` returns every row as stored. No arena: heap configs.

Each step is a small method so ``audit_snapshots_bugs.py`` can break one promise per subclass.
"""

from __future__ import annotations

import os
import stat
import tempfile
import threading

import numpy as np

from kvstate.spec import Config, EntryView, Layout, Observation, PageView
from kvstate.spec import precision as precisions
from kvstate.spec import snapshot_format as fmt
from kvstate.spec.errors import (ContextClosedError, EmptyContextError, PositionError, PrecisionRangeError,
                                 SnapshotCorruptError, SnapshotError, SnapshotLayoutError, SnapshotNotFoundError,
                                 SnapshotPrecisionError, SnapshotTooLargeError, SnapshotTruncatedError,
                                 SnapshotWriteError)
from kvstate.spec.layout import check_tokens, check_values, require_finite


class Page:
    def __init__(self, page_id: int, cache: "AuditCache"):
        self.page_id = page_id
        self.refcount = 1
        n, layout = cache.page_tokens, cache.layout
        shape = (n, *layout.position_shape)
        self.parts = [np.zeros(shape, precisions.VALUE_DTYPES[cache.precision])]
        if cache.precision == "q8":
            self.parts.append(np.zeros(shape[:-1], np.float32))
        self.tokens = np.zeros(n, np.int64)


class AuditContext:
    def __init__(self, cache: "AuditCache", pages: list, length: int):
        self.cache = cache
        self.pages = pages
        self.length = length
        self.closed = False

    def __len__(self) -> int:
        return self.length

    def _open(self) -> None:
        if self.closed:
            raise ContextClosedError("this context is closed")

    # -- gathering ---------------------------------------------------------------------
    def _gather(self, start: int, stop: int):
        """(encoded parts, tokens) of positions [start, stop), fresh arrays."""
        cache = self.cache
        if self.pages:
            parts = [np.concatenate([p.parts[i] for p in self.pages])[start:stop].copy()
                     for i in range(len(self.pages[0].parts))]
            tokens = np.concatenate([p.tokens for p in self.pages])[start:stop].copy()
        else:
            shape = (0, *cache.layout.position_shape)
            parts = [np.zeros(shape, precisions.VALUE_DTYPES[cache.precision])]
            if cache.precision == "q8":
                parts.append(np.zeros(shape[:-1], np.float32))
            tokens = np.zeros(0, np.int64)
        return parts, tokens

    @property
    def tokens(self) -> list[int]:
        with self.cache.lock:
            self._open()
            return [int(t) for t in self._gather(0, self.length)[1]]

    def read(self, start: int = 0, stop: int | None = None):
        with self.cache.lock:
            self._open()
            stop = self.length if stop is None else stop
            if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop <= self.length):
                raise PositionError(f"read of [{start}, {stop}) outside length {self.length}")
            parts, tokens = self._gather(start, stop)
            return precisions.decode(self.cache.precision, tuple(parts)), tokens

    # -- writing -----------------------------------------------------------------------
    def _encode(self, tokens, kv, start: int | None = None):
        tokens = check_tokens(tokens)
        kv = check_values(self.cache.layout, kv, len(tokens))
        self._open()
        if start is not None and not (isinstance(start, int) and 0 <= start and start + len(tokens) <= self.length):
            raise PositionError(f"overwrite of [{start}, {start + len(tokens)}) outside length {self.length}")
        require_finite(np.asarray(kv))
        return tokens, precisions.encode(self.cache.precision, np.asarray(kv, np.float32))

    def writable(self, index: int) -> Page:
        page = self.pages[index]
        if page.refcount > 1:
            private = self.cache.new_page()
            for dst, src in zip(private.parts, page.parts):
                dst[:] = src
            private.tokens[:] = page.tokens
            self.cache.release(page)
            self.pages[index] = private
        return self.pages[index]

    def _store(self, start: int, tokens: np.ndarray, encoded) -> None:
        size = self.cache.page_tokens
        for i, position in enumerate(range(start, start + len(tokens))):
            index, offset = divmod(position, size)
            while index >= len(self.pages):
                self.pages.append(self.cache.new_page())
            page = self.writable(index)
            for dst, src in zip(page.parts, encoded):
                dst[offset] = src[i]
            page.tokens[offset] = tokens[i]

    def extend(self, tokens, kv) -> None:
        with self.cache.lock:
            tokens, encoded = self._encode(tokens, kv)
            self._store(self.length, tokens, encoded)
            self.length += len(tokens)

    def overwrite(self, start: int, tokens, kv) -> None:
        with self.cache.lock:
            tokens, encoded = self._encode(tokens, kv, start)
            self._store(start, tokens, encoded)

    def fork(self) -> "AuditContext":
        with self.cache.lock:
            self._open()
            return self.cache.adopt(list(self.pages), self.length)

    def truncate(self, n: int) -> None:
        with self.cache.lock:
            self._open()
            if not (isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= self.length):
                raise PositionError(f"truncate to {n} outside length {self.length}")
            keep = -(-n // self.cache.page_tokens)
            for page in self.pages[keep:]:
                self.cache.release(page)
            del self.pages[keep:]
            self.length = n

    def close(self) -> None:
        with self.cache.lock:
            self._open()
            for page in self.pages:
                self.cache.release(page)
            self.pages = []
            self.closed = True
            self.cache.contexts.remove(self)

    def snapshot(self, target) -> None:
        with self.cache.lock:
            self._open()
            data = self.cache.snapshot_bytes(self)
        self.cache.write_snapshot(data, target)


class AuditCache:
    context_class = AuditContext

    def __init__(self, config: Config):
        self.layout = config.layout
        self.page_tokens = config.page_tokens
        self.precision = config.precision
        self.max_entries = config.max_entries
        self.lock = threading.RLock()
        self.live: dict[int, Page] = {}
        self.allocated = 0
        self.freed = 0
        self.contexts: list[AuditContext] = []
        self.entries: list[list] = []    # [key, AuditContext, tick]
        self.clock = 0

    # -- pages -------------------------------------------------------------------------
    def new_page(self) -> Page:
        self.allocated += 1
        page = Page(self.allocated, self)
        self.live[page.page_id] = page
        return page

    def release(self, page: Page) -> None:
        page.refcount -= 1
        if page.refcount == 0:
            del self.live[page.page_id]
            self.freed += 1

    def adopt(self, pages: list, length: int, register: bool = True) -> AuditContext:
        for page in pages:
            page.refcount += 1
        ctx = self.context_class(self, pages, length)
        if register:
            self.contexts.append(ctx)
        return ctx

    # -- protocol ----------------------------------------------------------------------
    def allocate(self) -> AuditContext:
        with self.lock:
            return self.adopt([], 0)

    def retain(self, ctx: AuditContext) -> None:
        with self.lock:
            ctx._open()
            if len(ctx) == 0:
                raise EmptyContextError("cannot retain an empty context")
            key = tuple(ctx._gather(0, ctx.length)[1].tolist())
            for entry in [e for e in self.entries if e[0] == key]:
                self._drop(entry)
            self.clock += 1
            self.entries.append([key, self.adopt(list(ctx.pages), ctx.length, register=False), self.clock])
            while len(self.entries) > self.max_entries:
                self._drop(min(self.entries[:-1], key=lambda e: e[2]))

    def _drop(self, entry) -> None:
        self.entries.remove(entry)
        for page in entry[1].pages:
            self.release(page)

    def match(self, tokens):
        query = tuple(int(t) for t in check_tokens(tokens))
        with self.lock:
            hits = [e for e in self.entries if query[:len(e[0])] == e[0]]
            if not hits:
                return self.adopt([], 0), 0
            best = max(hits, key=lambda e: (len(e[0]), e[2]))
            self.clock += 1
            best[2] = self.clock
            return self.adopt(list(best[1].pages), best[1].length), len(best[0])

    def clear(self) -> None:
        with self.lock:
            for entry in list(self.entries):
                self._drop(entry)

    def read_page(self, page_id: int):
        with self.lock:
            return tuple(part.copy() for part in self.live[page_id].parts)

    def observe(self) -> Observation:
        with self.lock:
            holders, lengths = {}, {}
            for i, ctx in enumerate(self.contexts):
                holders[f"ctx:{i}"] = tuple(p.page_id for p in ctx.pages)
                lengths[f"ctx:{i}"] = ctx.length
            entries = []
            for i, (key, ctx, tick) in enumerate(sorted(self.entries, key=lambda e: e[2])):
                holders[f"entry:{i}"] = tuple(p.page_id for p in ctx.pages)
                lengths[f"entry:{i}"] = ctx.length
                entries.append(EntryView(key, tick, f"entry:{i}"))
            pages = {pid: PageView(pid, page.refcount, None) for pid, page in self.live.items()}
            return Observation(pages=pages, holders=holders, lengths=lengths,
                               pages_allocated=self.allocated, pages_freed=self.freed,
                               arena_size=0, arena_out={}, arena_free=(), tree=None, entries=tuple(entries))

    # -- snapshots ---------------------------------------------------------------------
    check_body = staticmethod(fmt.check_body)   # checksum, then every token and value

    def snapshot_bytes(self, ctx: AuditContext) -> bytes:
        fmt.check_fits(self.layout, ctx.length)
        parts, tokens = ctx._gather(0, ctx.length)
        sections = [tokens, *parts]
        dtypes = [dtype for _, dtype, _ in fmt.body_sections(self.layout, self.precision, ctx.length)]
        body = b"".join(np.ascontiguousarray(s, dtype=d).tobytes() for s, d in zip(sections, dtypes))
        version = fmt.FORMAT_VERSION
        return fmt.pack_header(self.precision, self.layout, ctx.length, fmt.body_checksum(version, body),
                               version=version) + body

    def write_snapshot(self, data: bytes, target) -> None:
        if hasattr(target, "write"):
            self.write_stream(data, target)
        else:
            self.write_path(data, target)

    def write_stream(self, data: bytes, stream) -> None:
        view = memoryview(data)
        try:
            while view:
                n = stream.write(view)
                if n is None:
                    raise SnapshotWriteError("a non-blocking stream would block")
                view = view[n:]
            stream.flush()
        except SnapshotError:
            raise
        except (OSError, ValueError, TypeError) as error:
            raise SnapshotWriteError(f"cannot write the snapshot to the stream: {error}") from error

    def write_path(self, data: bytes, target) -> None:
        try:
            path = os.fsdecode(os.fspath(target))
        except TypeError as error:
            raise SnapshotWriteError(f"not a path or a binary stream: {target!r:.80}") from error
        folder = os.path.dirname(os.path.abspath(path))
        name = os.path.basename(path)
        try:
            try:
                mode = os.lstat(path).st_mode
                if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
                    raise SnapshotWriteError(f"{path!r} is not a regular file: refused, not replaced")
            except FileNotFoundError:
                pass
            fd, temp = tempfile.mkstemp(prefix=f"{fmt.TEMP_PREFIX}{name}.", suffix=fmt.TEMP_SUFFIX, dir=folder)
        except SnapshotError:
            raise
        except (OSError, ValueError) as error:
            raise SnapshotWriteError(f"cannot write {path!r}: {error}") from error
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(data)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temp, path)
            dir_fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as error:
            try:
                os.unlink(temp)
            except OSError:
                pass
            raise SnapshotWriteError(f"cannot write {path!r}: {error}") from error

    def read_source(self, source) -> bytes:
        if source is None or isinstance(source, (int, bool)):
            raise SnapshotError(f"not a path or a binary stream: {source!r}")
        if hasattr(source, "read"):
            try:
                data = source.read()
            except (OSError, ValueError) as error:
                raise SnapshotError(f"cannot read the stream: {error}") from error
            if not isinstance(data, (bytes, bytearray)):
                raise SnapshotError("the stream is not binary")
            return bytes(data)
        try:
            path = os.fspath(source)
        except TypeError as error:
            raise SnapshotError(f"not a path or a binary stream: {source!r:.80}") from error
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError as error:
            raise SnapshotNotFoundError(f"no snapshot at {path!r}") from error
        except (OSError, ValueError) as error:
            raise SnapshotError(f"cannot open {path!r}: {error}") from error
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise SnapshotError(f"{path!r} is not a regular file")
            with os.fdopen(fd, "rb", closefd=False) as file:
                return file.read()
        except SnapshotError:
            raise
        except OSError as error:
            raise SnapshotError(f"cannot read {path!r}: {error}") from error
        finally:
            os.close(fd)

    def parse(self, data: bytes):
        """Validate the whole file; (tokens, encoded parts at this cache's precision). Allocates no page."""
        header = fmt.parse_header(data[:fmt.HEADER_V3_SIZE])
        if header.layout != self.layout:
            raise SnapshotLayoutError(f"snapshot layout {header.layout} is not this cache's {self.layout}")
        end = header.size + header.body_bytes
        if len(data) < end:
            raise SnapshotTruncatedError(f"file ends at byte {len(data)}, the snapshot at {end}")
        if len(data) > end:
            raise SnapshotCorruptError(f"{len(data) - end} bytes after the snapshot's end at offset {end}")
        arrays = self.check_body(header, data[header.size:end])
        tokens = arrays["tokens"].astype(np.int64)
        stored = (arrays["values"],) + ((arrays["scales"],) if header.precision == "q8" else ())
        if header.precision == self.precision:
            encoded = tuple(np.array(part) for part in stored)
        else:
            values = precisions.decode(header.precision, stored)
            try:
                encoded = precisions.encode(self.precision, values)
            except PrecisionRangeError as error:
                raise SnapshotPrecisionError(f"the snapshot's values overflow {self.precision}: {error}") from error
        return tokens, encoded

    def restore(self, source, max_bytes: int | None = None) -> AuditContext:
        data = self.read_source(source)
        tokens, encoded = self.parse(data)
        if max_bytes is not None and len(data) > max_bytes:
            raise SnapshotTooLargeError(f"restore takes about {len(data)} bytes, above max_bytes {max_bytes}")
        with self.lock:
            ctx = self.adopt([], 0)
            ctx._store(0, tokens, encoded)
            ctx.length = len(tokens)
            return ctx


def factory(config: Config) -> AuditCache:
    return AuditCache(config)


factory.configs = [Config(Layout(layers=2, kv_heads=2, head_dim=4), page_tokens=4, precision=p,
                          arena_pages=0, max_entries=2) for p in precisions.PRECISIONS]
factory.any_page_size = True
factory.thread_safe = True
