"""Writing a context to a snapshot file and restoring one into a cache: the design, and the entry points.

The format is ``spec/snapshot_format.py``. Writing to a path is atomic
(``impl/snapshot_files.py``: a temporary file in the target's folder, flushed and
fsynced, renamed over the target, then the folder fsynced, so a reader or a crash
sees the old complete file or the new complete one); a worker thread copies each page out and hashes it
while the previous piece is written (``snapshot_write._PiecesAhead``). Restoring validates the
whole file (header, sizes against the real file size, checksums, every token and
value) before the cache is touched: a refused restore changes no page, slot,
context or counter.

A local file of the cache's own precision into the NumPy store is streamed
(``snapshot_stream._stream_restore``): header and sizes first, then a reader thread reads 4 MiB
pieces and hashes each while it is cache-hot, and this thread checks it and copies
it into page arrays prepared outside the cache (reused freed pages, or fresh ones on
huge-page boundaries); the pages join the cache only once everything has passed.
Bodies under ``PIPELINED_FROM_BYTES`` (or any, with ``IO_THREADS = 1``) run both pipelines
inline, without their worker thread (``pipelined``). Staging buffers are recycled between
calls (``StagingPool``), so they are not faulted in anew; these settings live in
``impl/snapshot_tuning.py``, read at each use.
Other sources (in-memory and remote streams, other stores, another precision)
read the body whole, check it, then fill pages (``snapshot_restore._adopt_body``).

One job per module: ``snapshot_files`` (atomic write, partials, folder sync), ``snapshot_write``
(the write pipeline), ``snapshot_read`` (header, sizes, cost bound, a body read whole and
checksummed), ``snapshot_stream`` (the streamed restore), ``snapshot_restore`` (the restore entry
and the whole-body path), ``snapshot_tuning`` (piece sizes, worker threads, staging buffers).
This module only names the entry points; patch a name where it is defined, not here.
"""

from .snapshot_read import read_snapshot, restore_cost
from .snapshot_restore import restore_snapshot
from .snapshot_write import write_snapshot

__all__ = ["read_snapshot", "restore_cost", "restore_snapshot", "write_snapshot"]
