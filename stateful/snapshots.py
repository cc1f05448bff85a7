"""``snapshot`` and ``restore`` as lockstep operations.

The engine writes real files into a temporary folder owned by the run; the
reference keeps a copy of what it read (``RefContext.snapshot``). Restoring
yields a new context handle on both sides, which every later check compares
position by position like any other context.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import ops as O
from .lockstep import Lockstep


@O.register
@dataclass(frozen=True)
class Snapshot(O.Op):
    ctx: str
    name: str
    kind = "snapshot"


@O.register
@dataclass(frozen=True)
class Restore(O.Op):
    name: str
    kind = "restore"
    creates = True


# RAM-backed where there is one: thousands of snapshots per run, each fsynced twice,
# would otherwise spend the run waiting on the disk.
_SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _folder(lockstep: Lockstep) -> Path:
    # The TemporaryDirectory removes itself when the run's Lockstep is collected.
    if not hasattr(lockstep, "_snapshot_folder"):
        lockstep._snapshot_folder = tempfile.TemporaryDirectory(prefix="kvstate-lockstep-", dir=_SCRATCH)
        lockstep._reference_snapshots = {}
    return Path(lockstep._snapshot_folder.name)


def _snapshot(lockstep: Lockstep, op: Snapshot, side: int, cache, ctx):
    folder = _folder(lockstep)
    if side == 0:
        return ctx.snapshot(folder / f"{op.name}.kvs")
    lockstep._reference_snapshots[op.name] = ctx.snapshot()
    return None


def _restore(lockstep: Lockstep, op: Restore, side: int, cache, ctx):
    folder = _folder(lockstep)
    if side == 0:
        return cache.restore(folder / f"{op.name}.kvs")
    return cache.restore(lockstep._reference_snapshots[op.name])


def supports_snapshots(engine) -> bool:
    """Foreign engines without snapshots still run the rest of the machine."""
    return hasattr(engine, "restore")


Lockstep.extra_ops.update(snapshot=_snapshot, restore=_restore)
