"""The snapshot pipelines' tuning: piece sizes, when the worker threads run, and the staging
buffers both pipelines recycle. One module, read at each use (``tuning.IO_THREADS``, ...), so a
benchmark or a test that sets a name here changes what the writer and the readers do."""

from __future__ import annotations

import os
import threading

import numpy as np

CHUNK = 1 << 20         # reads from streams of unknown size grow by at most this much at a time
READ_CHUNK = 4 << 20    # reads of known size: checksummed piece by piece while cache-hot
THREADED_CRC_BYTES = 8 << 20   # from this body size the checksum runs beside the reads
PAGE_OVERHEAD_BYTES = 1024      # Python objects per page (Page, token array, views): counted by ``max_bytes``
IO_THREADS: int | None = None   # 1: the restore and write pipelines run inline; 2: with their worker; None: ``pipelined``
PIPELINED_FROM_BYTES = 32 << 20  # automatic (IO_THREADS None): smaller bodies run inline


def pipelined(body_bytes: int) -> bool:
    """Whether a write or a streamed restore of a ``body_bytes`` body runs its worker thread.

    ``IO_THREADS`` decides when set. Otherwise the worker runs where there are two cores and the
    body is ``PIPELINED_FROM_BYTES`` or more: below that, starting the thread and handing pieces
    over cost more than the overlap bought. Measured on 2 cores, GPT-2-small f32, inline against
    threaded: a restore of 16 positions 0.23 against 0.51 ms alone (0.66 against 1.08 in
    ``bench.restore --worker always``), within noise of each other from 128 to 384 positions
    (9-28 MB), the worker ahead from 512 (38 MB); writes alike (16 positions 1.3 against
    1.7 ms, 512: 21 against 19 ms).
    """
    if IO_THREADS is not None:
        return IO_THREADS > 1
    return body_bytes >= PIPELINED_FROM_BYTES and (os.cpu_count() or 1) > 1     # the size first: cpu_count reads /sys


# -- staging buffers -------------------------------------------------------------------

class StagingPool:
    """Staging buffers kept between snapshot writes and restores. A fresh buffer's first touch
    faults in every page of it, each time: about 0.6 ms for the 12 MiB a restore stages, as
    much as reading 10 MB (measured), and for a small file more than the write itself. Holds
    at most ``KEEP`` buffers of at most ``LARGEST`` bytes; safe from any thread."""

    KEEP = 4
    LARGEST = 16 << 20

    def __init__(self):
        self._spare: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of at least ``nbytes`` (contents arbitrary): the smallest spare that fits, else a new one."""
        with self._lock:
            for index, buffer in enumerate(self._spare):     # kept smallest first
                if buffer.size >= nbytes:
                    return self._spare.pop(index)
        return np.empty(nbytes, np.uint8)

    def give_back(self, buffers: list[np.ndarray]) -> None:
        with self._lock:
            for buffer in buffers:
                if buffer.size <= self.LARGEST and not any(buffer is spare for spare in self._spare):
                    self._spare.append(buffer)
            self._spare.sort(key=lambda b: b.size)
            del self._spare[:max(0, len(self._spare) - self.KEEP)]     # the largest are kept


staging = StagingPool()

# Bytes each stored number costs a restore into another precision, beside the body and the pages
# (``snapshot_read.restore_cost``): its float32 decoding and the target encoding's own arrays and
# temporaries, by target precision. The NumPy store's, measured with tracemalloc from every other
# precision: 4.0-4.1, 6.0-6.1 and 15.0 bytes (``tests/test_snapshot.py``). A store may say its own
# (``conversion_bytes``): the torch store copies the decoded values again and keeps more of its
# q8 encoding's temporaries alive at once.
CONVERSION_BYTES = {"f32": 5, "f16": 7, "q8": 16}
# The torch store's on the CPU, from peak resident memory (4x8x128, 2,048 positions, every pair of
# precisions, 2026-12-06): up to about 13, 16 and 23 bytes a number.
TORCH_CONVERSION_BYTES = {"f32": 14, "f16": 16, "q8": 24}
