"""Files handed to the suite as data (a replay file, a sweep's journal), read without blocking.

Such a file comes from CI, a colleague or a download, and its name from the command line: a FIFO
there blocked ``open`` or ``read`` for good, and ``--time-limit`` does not reach a read. The file
is opened with ``O_NONBLOCK`` and must be a regular file, checked on the open descriptor (no
window for a swap between a check and the open), before a byte is read.
"""

from __future__ import annotations

import errno
import os
import stat


def read_regular(path, limit: int) -> bytes:
    """Up to ``limit + 1`` bytes of the regular file at ``path`` (the caller refuses more than
    ``limit``); ``OSError`` if it cannot be opened, ``ValueError`` if it is no regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{os.fsdecode(path)!r} is not a regular file (a FIFO, device or folder)")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb") as file:
            fd = -1         # the file object closes it now
            return file.read(limit + 1)
    finally:
        if fd >= 0:
            os.close(fd)


def open_own_file(path, flags: int, mode: str):
    """The regular file at ``path`` itself, never through a symlink, opened with ``flags`` as a file
    object of ``mode``: for a file a command writes in its own folder (a sweep's journal and lock),
    which a link would have it write wherever it led. ``ValueError`` if ``path`` is a symlink, FIFO,
    device or folder, checked on the open descriptor (``O_NONBLOCK``: a FIFO fails at once or is
    refused, it never blocks); ``OSError`` as ``os.open`` raises it otherwise."""
    flags |= os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    refused = ValueError(f"{os.fsdecode(path)!r} is not a regular file (a symlink, FIFO, device or folder)")
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):    # a link, a folder, a FIFO with no reader
            raise refused from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise refused
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def replace_own_file(path, text: str) -> None:
    """``text`` as the whole file at ``path``, written aside in the same folder (a name of its own,
    ``O_EXCL``: never through a link) and renamed over ``path``. The rename replaces a symlink at
    ``path`` itself, never the file it leads to: a replay file named in a sweep's folder from
    elsewhere (a CI artifact) had its write land wherever such a link led. An interrupt mid-write
    leaves the old file or none, never half of one."""
    path = os.fspath(path)
    aside = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        os.unlink(aside)            # one a killed writer of this pid left; a link there goes, not its target
    except FileNotFoundError:
        pass
    try:
        with open_own_file(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, "w") as file:
            file.write(text)
        os.replace(aside, path)
    finally:
        try:
            os.unlink(aside)
        except FileNotFoundError:
            pass
