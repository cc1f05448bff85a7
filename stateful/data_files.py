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
