"""What a replay file may ask for, checked before any of it runs.

A replay file is data (from CI, a colleague, a download), and a few hundred bytes of
it can name a layout and writes that need gigabytes: run as asked, the ``MemoryError``
would read as the backend's failure. So a file is refused, naming the limit, when it
holds more operations than ``MAX_REPLAY_OPS`` or when the memory it would need at its
peak passes ``MAX_REPLAY_MEMORY_BYTES``. The peak is an upper bound found by walking
the operations once, without values: every holder (context, tree entry, snapshot) is
counted as a full copy in the reference and as whole pages in the engine (nothing
shared), plus the arena and the values of the write in flight; it is exact about handles
as long as the file's creating operations succeed, as a recorded run's did.
"""

from __future__ import annotations

import heapq
from typing import Iterable

from kvstate.spec.errors import ReplayFileError
from kvstate.spec.protocol import Config

from . import ops as O

MAX_REPLAY_OPS = 100_000
"""Operations one replay file may hold (a sweep's runs are hundreds of steps)."""
MAX_REPLAY_MEMORY_BYTES = 1 << 30
"""Value bytes a replay may need at its peak, engine and reference together (see ``peak_bytes``)."""
_IN_FLIGHT_COPIES = 4      # one write's values: a float64 draw, its float32 copy, one copy per side


def check_op_count(count: int) -> None:
    if count > MAX_REPLAY_OPS:
        raise ReplayFileError(f"the replay file holds {count} operations, more than MAX_REPLAY_OPS ({MAX_REPLAY_OPS})")


def check_memory(config: Config, ops: Iterable[O.Op]) -> None:
    need = peak_bytes(config, ops)
    if need > MAX_REPLAY_MEMORY_BYTES:
        raise ReplayFileError(f"the replay would need up to {need} bytes of K/V values at its peak, more than "
                              f"MAX_REPLAY_MEMORY_BYTES ({MAX_REPLAY_MEMORY_BYTES})")


def peak_bytes(config: Config, ops: Iterable[O.Op]) -> int:
    """An upper bound on the value bytes engine and reference hold at once while running ``ops``."""
    position = config.layout.values_per_position * 4
    page = config.page_tokens

    def held(length: int) -> int:          # one holder: a full reference copy and whole engine pages
        return length + -(-length // page) * page

    contexts: dict[str, int] = {}          # handle -> length
    snapshots: dict[str, int] = {}         # name -> length
    entries: list[int] = []                # the max_entries longest keys retained since the last clear
    total = entries_total = longest = created = 0
    peak = 0
    for op in ops:
        length = contexts.get(getattr(op, "ctx", None), 0)
        made = None
        in_flight = _IN_FLIGHT_COPIES * len(op.tokens) if op.kind in ("extend", "overwrite") else 0
        if op.kind == "extend":
            grown = length + len(op.tokens)
            total += held(grown) - held(length)
            contexts[op.ctx] = length = grown
        elif op.kind == "truncate" and op.ctx in contexts and isinstance(op.n, int) and 0 <= op.n < length:
            total += held(op.n) - held(length)
            contexts[op.ctx] = op.n
        elif op.kind == "close" and op.ctx in contexts:
            total -= held(contexts.pop(op.ctx))
        elif op.kind == "retain":
            heapq.heappush(entries, held(length))
            entries_total += held(length)
            if len(entries) > config.max_entries:
                entries_total -= heapq.heappop(entries)
        elif op.kind == "clear":
            entries, entries_total = [], 0
        elif op.kind == "snapshot":
            total += held(length) - held(snapshots.get(op.name, 0))
            snapshots[op.name] = length
        if op.kind == "allocate":
            made = 0
        elif op.kind == "fork":
            made = length
        elif op.kind == "match":
            made = min(len(op.tokens), longest)
        elif op.kind == "restore" and op.name in snapshots:    # else refused: no handle
            made = snapshots[op.name]
        elif op.creates and op.kind != "restore":    # an operation kind this walk does not know: as long as any
            made = longest
        if made is not None:
            created += 1
            contexts[f"c{created}"] = made
            total += held(made)
        longest = max(longest, length, made or 0)
        peak = max(peak, total + entries_total + in_flight)
    arena = config.arena_pages * page
    return (arena + peak) * position
