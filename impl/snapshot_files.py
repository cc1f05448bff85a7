"""The file protocol of a snapshot at a path: atomic replacement, partial files, folder sync.

``write_atomic(path, fill)`` writes a temporary file in the target's folder (``mkstemp``, 0600),
flushes and fsyncs it, renames it over the target (``os.replace``: a symlink there is replaced,
not followed), then fsyncs the folder: a reader, or a crash, sees the old complete file or the
new complete one. The writer holds an exclusive ``flock`` on its partial file while it writes
(``hold_partial``), so ``clean_stale_partials`` removes only the partials of writers that died.
``open_regular(path)`` opens a snapshot for reading only if it is a regular file, never blocking
on a FIFO (here, beside the writer, so ``impl/remote_io.py`` opens a local URL with it too).
What goes into the file is the caller's (``impl/snapshot.py``); this module knows only names
(``spec/snapshot_format.py``'s ``TEMP_PREFIX``/``TEMP_SUFFIX``) and the operating system.
"""

from __future__ import annotations

import io
import os
import stat
import tempfile
import time
from typing import Callable

from kvstate.spec import snapshot_format as fmt
from kvstate.spec.errors import SnapshotError, SnapshotNotFoundError, SnapshotWriteError

try:
    import fcntl
except ImportError:      # not POSIX: no partial-file locks
    fcntl = None

STALE_PARTIAL_SECONDS = 10.0    # an unlocked partial file this old has no live writer (see clean_stale_partials)


def open_regular(source) -> tuple[io.BufferedReader, int]:
    """``source`` opened for reading, and its size, if it is a regular file; a ``SnapshotError`` if not.

    Opened with ``O_NONBLOCK`` and checked with ``fstat`` before any read: opening a FIFO
    with no writer would otherwise block forever, and a device (``/dev/zero``) or a
    directory is no snapshot. Blocking is switched back on for the reads.
    """
    try:
        path = os.fspath(source)
    except TypeError:
        raise SnapshotError(f"a snapshot comes from a path or a binary stream, not {type(source).__name__}") from None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError as error:
        raise SnapshotNotFoundError(f"no snapshot at {path!r}") from error
    except (OSError, ValueError) as error:     # permission, a symlink loop, a NUL in the path
        raise SnapshotError(f"cannot open snapshot {path!r}: {error}") from error
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SnapshotError(f"{path!r} is not a regular file ({_file_kind(info.st_mode)}); "
                                f"pass an open binary stream to restore from anything else")
        os.set_blocking(fd, True)
        return open(fd, "rb"), info.st_size
    except BaseException:
        os.close(fd)
        raise


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"


def write_atomic(path: str, fill: Callable) -> None:
    """Replace ``path`` with what ``fill(file)`` writes: temp file, fsync, rename, fsync of the folder.

    On any failure the temporary file is removed, whatever was at ``path`` is untouched, and
    ``SnapshotWriteError`` says what failed; the one exception is the folder's sync after the
    rename, whose failure says that the new file is in place. The temporary file is created 0600
    (``mkstemp``) and ``os.replace`` replaces a symlink at ``path`` rather than following it. A
    FIFO, a device such as ``/dev/null`` or a socket at ``path`` is refused, before anything is
    written and again just before the rename (one made in between the second check and the
    rename is still replaced: the check cannot be atomic with it); so is a folder at ``path`` (the
    rename refused it, but only after the whole body was written). The writer holds an exclusive ``flock`` on its temporary file while
    writing, so ``clean_stale_partials`` (run first) never removes a live writer's file, only
    those of writers that died.
    """
    _refuse_special(path)
    folder = os.path.dirname(os.path.abspath(path))
    prefix = partial_prefix(folder, path)
    clean_stale_partials(folder, prefix)
    try:
        fd, temp = tempfile.mkstemp(prefix=prefix, suffix=fmt.TEMP_SUFFIX, dir=folder)
    except (OSError, ValueError) as error:       # ValueError: a NUL in the path
        raise SnapshotWriteError(f"cannot create a temporary file in {folder!r} for {path!r}: {error}") from error
    try:
        hold_partial(fd)
        with open(fd, "wb") as file:
            fill(file)
            file.flush()
            os.fsync(file.fileno())
            _refuse_special(path)       # again: one made while the body was written (a window remains)
            os.replace(temp, path)      # still open, so still locked: no cleaner can take it first
    except BaseException as error:
        try:
            os.unlink(temp)
        except OSError:
            pass
        if isinstance(error, OSError):
            raise SnapshotWriteError(
                f"writing snapshot {path!r} failed ({error}); the previous file there is intact") from error
        raise
    try:
        fsync_folder(folder)
    except OSError as error:
        raise SnapshotWriteError(f"snapshot {path!r} was written but its folder could not be synced: {error}") from error


def partial_prefix(folder: str, path: str) -> str:
    """``.NAME.``, the start of ``path``'s partial files: NAME is the target's, cut short where the
    whole temporary name (this prefix, ``mkstemp``'s 8 characters, ``TEMP_SUFFIX``) would pass the
    folder's limit on a name. Uncut, a valid target name of 240 bytes was refused: its temporary
    file's name was too long. Targets whose names agree up to the cut share the prefix, so a write
    to one may clean the other's stale partials: those of dead writers only, never a live one's."""
    name = os.path.basename(path)
    room = _name_max(folder) - len(os.fsencode(fmt.TEMP_PREFIX + "." + "x" * 8 + fmt.TEMP_SUFFIX))
    while name and len(os.fsencode(name)) > room:      # by characters: a multi-byte one is never split
        name = name[:-1]
    return fmt.TEMP_PREFIX + name + "."


def _name_max(folder: str) -> int:
    """The longest name, in bytes, ``folder`` takes (255 where the system does not say)."""
    try:
        limit = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):      # no such folder (the write then says so), or no pathconf
        return 255
    return limit if limit > 0 else 255      # -1: no limit reported


def _refuse_special(path: str) -> None:
    """``SnapshotWriteError`` if ``path`` is something a snapshot must not replace (not a regular file,
    a symlink or nothing)."""
    try:
        mode = os.lstat(path).st_mode
    except (OSError, ValueError):       # nothing there (or a name the write itself will refuse)
        return
    if stat.S_ISDIR(mode):      # before the body is written: the rename refused it only after
        raise SnapshotWriteError(f"{path!r} is a folder: a snapshot goes to a file's path (one inside it), "
                                 "or an open binary stream")
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a character device" if stat.S_ISCHR(mode)
                else "a block device" if stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a special file")
        raise SnapshotWriteError(f"{path!r} is {kind}, not a regular file: a snapshot would replace it; "
                                 "write to a file's path, or pass an open binary stream")


def hold_partial(fd: int) -> int:
    """Mark ``fd``'s partial file as a live writer's: an exclusive ``flock``, released when it is closed
    (also when the process dies). Best effort: where locks are unsupported, nothing is cleaned."""
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass
    return fd


def clean_stale_partials(folder: str, prefix: str) -> list[str]:
    """Remove partial files of one target left by writers that died (a crash mid-write); their names.

    A partial file is removed only if it is older than ``STALE_PARTIAL_SECONDS`` (a writer
    takes its lock an instant after creating it) and its ``flock`` can be taken without
    waiting (a live writer holds it until its file is renamed or removed), and it is still
    the same file when the lock is held. Never raises: cleaning is a courtesy to the next write.
    """
    if fcntl is None:
        return []
    removed = []
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    now = time.time()
    for name in names:
        middle = name[len(prefix):-len(fmt.TEMP_SUFFIX)] if name.endswith(fmt.TEMP_SUFFIX) else ""
        if not name.startswith(prefix) or not middle or "." in middle:    # mkstemp's part has no dot
            continue
        path = os.path.join(folder, name)
        try:
            info = os.lstat(path)
            if not stat.S_ISREG(info.st_mode) or now - info.st_mtime < STALE_PARTIAL_SECONDS:
                continue
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held = os.fstat(fd)
            if (held.st_dev, held.st_ino) == (info.st_dev, info.st_ino) == _identity(path):
                os.unlink(path)
                removed.append(name)
        except OSError:
            pass                        # locked by a live writer, gone, or not ours to remove
        finally:
            os.close(fd)
    return removed


def _identity(path: str) -> tuple[int, int] | None:
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def fsync_folder(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
