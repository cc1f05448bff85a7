"""Every error kvstate raises, in one small hierarchy.

Each error says what was wrong with which value. Callers catch ``KVStateError``
for "kvstate refused this" and a subclass when they care why.

When several things are wrong at once, any error that truly applies is a right
answer: real engines validate in many orders. Each check is judged on its own
input: the token ids (``DTypeError``, ``ShapeError``, ``TokenError``); the K/V
array's dtype and shape, its rows against the token count included (``DTypeError``,
``ShapeError``); the context itself (``ContextClosedError``, ``ContextBusyError``);
positions (``PositionError``); the K/V values (``NonFiniteError``,
``PrecisionRangeError``); the page pool (``CapacityError``, judged only once the
operation's need is known: valid tokens and array, an open context, positions
inside it). The reference raises the first of these in that order and names every
one that applies (``refuse_with_all``); a backend is checked against that set
(``applicable_errors``): a class outside it, or no error, is wrong. A backend's own
subclass of one of these is judged as the class it derives from (``spec_class``).
"""

from __future__ import annotations

from typing import Callable


class KVStateError(Exception):
    """Base of every error kvstate raises on purpose."""


# -- bad input: refused before anything changes ---------------------------------

class InvalidInputError(KVStateError, ValueError):
    """An argument was refused; nothing was written or allocated."""


class ShapeError(InvalidInputError):
    """An array has the wrong shape for the cache's layout, or K/V rows differ from the token count."""


class DTypeError(InvalidInputError):
    """An array or token sequence has the wrong element type."""


class NonFiniteError(InvalidInputError):
    """K/V values contain NaN or infinity."""


class PrecisionRangeError(InvalidInputError):
    """A finite value does not fit the cache's precision: f16 from 65520 on (``precision.F16_OVERFLOW``),
    which rounds to infinity; a value between 65504, f16's largest, and 65520 rounds to 65504 and is stored."""


class TokenError(InvalidInputError):
    """A token id is outside ``[0, 2**31)``."""


class PositionError(InvalidInputError, IndexError):
    """A position or range lies outside the context."""


class ConfigError(InvalidInputError):
    """A cache was configured with impossible settings."""


class UnsupportedModelError(ConfigError):
    """A transformers model ``kvstate.hf`` cannot hold (sliding-window or linear-attention
    layers, an encoder-decoder, or a K/V layout other than the cache's); refused before any work."""


class EmptyContextError(InvalidInputError):
    """The operation needs at least one position (``retain`` of an empty context)."""


class CapacityError(KVStateError):
    """The page pool is full and the configuration declares ``on_full="refuse"``; nothing changed."""


# -- lifecycle and ownership -----------------------------------------------------

class ContextClosedError(KVStateError):
    """The context was closed; it cannot be used again."""


class ContextBusyError(KVStateError):
    """Another thread is using this context right now (a context has one owner)."""


class ForeignContextError(InvalidInputError):
    """The context belongs to another cache."""


# -- snapshots -------------------------------------------------------------------

class SnapshotError(KVStateError):
    """A snapshot could not be written or was refused on restore.

    A refused restore changed nothing: no page, slot, context or counter.
    """


class SnapshotNotFoundError(SnapshotError, FileNotFoundError):
    """There is no snapshot file at the path given to restore."""


class SnapshotCorruptError(SnapshotError):
    """Bad magic, a checksum mismatch, or a field or value the format does not allow."""


class SnapshotTruncatedError(SnapshotError):
    """The file ends before the length its header declares (or before the header ends)."""


class SnapshotTooLargeError(SnapshotError):
    """The header declares more positions (or a larger layout) than the format allows; or a context
    to be written holds more than it allows (refused before the target is touched)."""


class SnapshotVersionError(SnapshotError):
    """The file was written in a format version this build has no loader for."""


class SnapshotLayoutError(SnapshotError):
    """The snapshot's layout differs from the cache's; no conversion exists."""


class SnapshotProducerError(SnapshotError):
    """The snapshot names a producer (format version 3: the model whose forward computed its values)
    other than the one the restore expects."""


class SnapshotModelError(SnapshotProducerError, UnsupportedModelError):
    """``kvstate.hf``: the snapshot holds K/V another model computed. A refusal of the file (a
    ``SnapshotError``, as every refused restore) and of the model (an ``UnsupportedModelError``, as
    every other model refused by its fingerprint)."""


class SnapshotPrecisionError(SnapshotError, PrecisionRangeError):
    """The snapshot's values do not fit this cache's precision (an f32 file restored into an f16
    cache, with values from 65520 on); a refusal of the file, so a ``SnapshotError`` too."""


class SnapshotWriteError(SnapshotError):
    """Writing failed (disk full, I/O error); the previous file at the target is intact."""


class SnapshotReadError(SnapshotError):
    """Reading failed before the snapshot could be checked (storage unreachable or refusing, after retries)."""


class SnapshotDeadlineError(SnapshotReadError, SnapshotWriteError):
    """A remote snapshot operation (restore, write, a store's lookup) ran past its total deadline,
    retries included; ``deadline`` names which one (the call's, the cache's, the store's, the
    enclosing block's, or the default). A read or a write error, as the operation was."""

    def __init__(self, message: str, deadline: str | None = None):
        super().__init__(message)
        self.deadline = deadline


# -- verification ----------------------------------------------------------------

class ReplayFileError(InvalidInputError):
    """A replay file is malformed, or one of its operations names a context that is not live."""


class InvariantViolation(AssertionError):
    """An invariant of ARCHITECTURE.md does not hold.

    ``invariant`` is its number (1-6, or a name for checks beyond the six) and
    the message names the offending page, context, position or node.
    """

    def __init__(self, invariant: int | str, message: str):
        self.invariant = invariant
        self.detail = message
        super().__init__(f"invariant {invariant}: {message}")


class SecondTierWarning(UserWarning):
    """A second tier (``Cache(second_tier=...)``) could not deliver; ``match`` returned the local hit.
    The tier counts these too (``SnapshotStore.failures``)."""


# -- sweeps ----------------------------------------------------------------------

class SweepError(KVStateError):
    """A sweep could not start, or stopped before its end (``kvstate sweep`` exits 2)."""


class BackendMismatchError(SweepError):
    """Workers would run another backend, kvstate, Python, NumPy or torch than the submitting machine.

    ``differences`` maps each such worker to ``{what: (here, there)}``.
    """

    def __init__(self, message: str, differences: dict[str, dict[str, tuple]]):
        self.differences = differences
        super().__init__(message)


class ClusterLostError(SweepError):
    """The scheduler (or the local pool) went away mid-sweep; the finished runs are kept as a partial report."""


class ResumeError(SweepError, InvalidInputError):
    """``--resume`` names a folder without a sweep's journal, or arguments that differ from the journal's."""


class RunTimeout(SweepError):
    """One run went past ``--run-timeout``; it is recorded as that seed's failure."""


# -- several bad inputs ------------------------------------------------------------

def refuse_with_all(*checks: Callable[[], None]) -> None:
    """Run each check of one operation on its own; if any refuses, raise the first refusal with
    ``applicable`` set to the class of every refusal (each is a right answer for a backend)."""
    refusals = []
    for check in checks:
        try:
            check()
        except KVStateError as error:
            refusals.append(error)
    if refusals:
        first = refusals[0]
        first.applicable = tuple(dict.fromkeys(type(error) for error in refusals))
        raise first


def spec_class(error: BaseException) -> type:
    """The class of this module that ``error`` is: its own, or, for a backend's own subclass (``class
    MyPositionError(PositionError)``), the nearest one it derives from. A backend is judged by that
    one, as a caller's ``except PositionError`` would catch it."""
    return next((cls for cls in type(error).__mro__ if cls.__module__ == __name__), type(error))


def applicable_errors(error: BaseException) -> tuple[type, ...]:
    """The error classes a backend may raise where the reference raised ``error``."""
    return getattr(error, "applicable", (type(error),))
