"""Snapshots at fsspec URLs (``s3://``, ``memory://``, ``gs://`` ...): streaming reads, atomic publication, retries.

This module moves bytes; it neither writes nor checks the format. The one writer
and the one reader of ``impl/snapshot.py`` run on the streams opened here, so a
URL gets exactly the checks a file gets (header before sizing, real size against
the declared one, checksum while reading, every value) and a refused object
changes nothing in the cache.

Publication is atomic: a reader of the URL sees the old object or the whole new
one, never a part.

- S3 (s3fs): the bytes go straight to the final key as one PUT (small objects) or
  one multipart upload, which S3 shows only once ``CompleteMultipartUpload``
  succeeds. On any failure the upload is aborted and the file is *not* closed,
  since closing an s3fs file completes the upload with whatever parts it holds.
  An abort that cannot reach the server leaves an incomplete upload, invisible
  to readers; a bucket lifecycle rule (AbortIncompleteMultipartUpload) removes it.
- Any other filesystem: a temporary key beside the target (``TEMP_PREFIX`` name
  ``TEMP_SUFFIX``), then a move onto the target. That is atomic where the move is
  (memory://, object stores whose move is copy-then-delete: the copy appears
  whole); on a filesystem whose move is not atomic, neither is publication.
- URLs of fsspec's local filesystem (``file://``, ``local://``: ``is_local_url``) are local
  paths (``local_path``): ``impl/snapshot.py`` writes them with its own fsync-and-rename.

Memory is bounded both ways: writes buffer at most one part (``PART_BYTES``)
before it is uploaded, reads fetch ``READ_BLOCK_BYTES`` at a time into the
reader's body buffer, so a 2 GB object is never held twice.

Every operation (``read``, ``publish``, ``exists``) has a total deadline over all its
attempts (``impl/remote_deadline.py``: ``DEFAULT_DEADLINE_S``, or the call's, store's or
block's own); past it, ``SnapshotDeadlineError`` naming that deadline.

Transient failures (connection refused or reset, timeouts, 5xx, an object
replaced while it was being read) are retried up to ``ATTEMPTS`` times with
exponential backoff and jitter, within the deadline; each retry starts over (a fresh upload, a fresh
read), which is safe where the failure came before the publishing request was sent. One whose answer
was lost after it was sent may still be applied, late, over a newer write: not guarded (README). Every
failure is a ``SnapshotError`` subclass whose message names the URL with any
credentials (``user:secret@``, query strings) removed.
"""

from __future__ import annotations

import errno
import io
import ipaddress
import os
import random
import re
import threading
import time
import uuid
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar
from urllib.parse import urlsplit, urlunsplit

from kvstate.spec import snapshot_format as fmt
from kvstate.spec.errors import (KVStateError, SnapshotDeadlineError, SnapshotError, SnapshotNotFoundError,
                                 SnapshotReadError, SnapshotWriteError)

from .remote_deadline import Bounded, Deadline, Worker, resolve
from .snapshot_files import open_regular, write_atomic

T = TypeVar("T")

ATTEMPTS = 4                    # tries per read or publish, the first included
BACKOFF_S = 0.25                # first wait; doubled each retry, +-50% jitter
BACKOFF_CAP_S = 8.0
PART_BYTES = 8 << 20            # multipart part size (S3's minimum is 5 MiB): the writer's buffer
READ_BLOCK_BYTES = 8 << 20      # bytes fetched per ranged GET while streaming a restore

_TRANSIENT_ERRNOS = {errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
                     errno.ECONNABORTED, errno.EPIPE, errno.EIO, getattr(errno, "EREMOTEIO", errno.EIO)}
# HTTP answers worth another try: timeout, too many requests, and the server's or a gateway's failures
# 412: an ``If-Match`` read of an object replaced since its HEAD (``_pinned_http_version``): read it again
_TRANSIENT_STATUSES = {408, 412, 429, 500, 502, 503, 504}


# -- URLs --------------------------------------------------------------------------------

def is_remote(target) -> bool:
    """Whether ``target`` is a URL for this module: a str with a scheme, other than the local filesystem's."""
    return isinstance(target, str) and "://" in target and not is_local_url(target)


def is_local_url(target) -> bool:
    """Whether ``target`` is a URL fsspec serves from its local filesystem, by whichever of its names
    (``file://``, ``local://``): decided by the filesystem, not the spelling, since fsspec's copy
    onto a local file truncates it and writes in place, where a local path gets a temp file and a
    rename, and its open blocks on a FIFO, where ``open_regular`` refuses one."""
    if not isinstance(target, str) or "://" not in target:
        return False
    scheme = target.partition("://")[0]
    if scheme == "file":
        return True             # fsspec or not
    try:
        import fsspec
        from fsspec.implementations.local import LocalFileSystem
        return bool(scheme) and issubclass(fsspec.get_filesystem_class(scheme), LocalFileSystem)
    except (ImportError, ValueError):     # no fsspec, or no filesystem of that name: not local
        return False


# ``s3:/bucket/k``, ``s3:bucket/k``: a URL whose ``//`` was lost is a local path to the filesystem, which
# wrote a folder named ``s3:`` and quoted the whole string in every message, ``user:secret@`` included.
_LOST_SLASHES = re.compile(r"\s*([A-Za-z][A-Za-z0-9+.-]+):(?!//)")     # two letters at least: not ``C:``
_SCHEMES_WITHOUT_FSSPEC = frozenset(("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "http", "https",
                                     "memory", "file", "local", "ftp", "sftp", "ssh", "hdfs", "webhdfs", "hf"))


def scheme_missing_slashes(target) -> str | None:
    """The scheme of a str that reads as a URL of a filesystem fsspec knows with its ``//`` lost
    (``s3:/bucket/k``); None for anything else (a ``pathlib.Path`` is always a path)."""
    if not isinstance(target, str) or "://" in target:
        return None
    found = _LOST_SLASHES.match(target)
    if found is None:
        return None
    scheme = found.group(1).lower()
    try:
        from fsspec.registry import known_implementations, registry
        known = scheme in known_implementations or scheme in registry
    except ImportError:
        known = scheme in _SCHEMES_WITHOUT_FSSPEC
    return scheme if known else None


def refuse_lost_slashes(target, error_class: type[KVStateError]) -> None:
    """Refuse a str that reads as a URL with its ``//`` lost (``scheme_missing_slashes``), showing
    only its scheme: the rest may carry ``user:secret@``."""
    scheme = scheme_missing_slashes(target)
    if scheme is not None:
        raise error_class(f"a path beginning {scheme!r} + ':' without '//' reads as a {scheme}:// URL with its "
                          f"'//' lost (the rest is not shown: it may carry credentials); write {scheme}://... for "
                          f"the object, or pass a local file's path as pathlib.Path(...) or ./{scheme}:...")


def local_path(target, error_class: type[SnapshotError] = SnapshotError):
    """The path of a local filesystem's URL (``is_local_url``), taken literally as fsspec takes it
    (``?``, ``#`` and ``%`` are part of the name, not a query, a fragment or an escape; a leading
    ``~`` is the home folder); any other target unchanged. ``error_class``: what a URL carrying
    credentials, or a str reading as a URL with its ``//`` lost, raises (a write's
    ``SnapshotWriteError``, a read's ``SnapshotReadError``)."""
    refuse_lost_slashes(target, error_class)
    if is_local_url(target):
        # fsspec reads file://user:secret@/p as the relative path "user:secret@/p": the secret would
        # become a folder name and show in every message about it
        refuse_credentials(target, error_class)
        path = target.partition("://")[2]
        # fsspec expands ``~`` (``make_path_posix``): taken literally here, file://~/kv was written to
        # a folder named "~" under the working directory while a store's probes (through fsspec)
        # looked in the home folder, and found nothing it had put
        return os.path.expanduser(path) if path.startswith("~") else path
    return target


# ``scheme://user:secret@``: userinfo before the first ``/``, or a ``user:secret`` whose secret holds
# ``/`` (AWS secrets often do), which a URL parser reads as host ``user``, port ``secret...``. Only
# where the authority is a host that may carry a port (``_PORT_SCHEMES``) is ``host:<digits>/...@`` a
# port and a path holding ``@``. Elsewhere (s3://, gs://, memory://) the first part is a bucket or a
# folder and has no port, so a ``:`` there before an ``@`` is always a secret: one of every 400 or so
# AWS secret keys begins with digits and then ``/``, and was used, named in messages and logged.
#
# Looked for after the first ``://`` of each part of an fsspec chain (``simplecache::s3://user:secret@...``,
# ``zip://a.txt::s3://user:secret@...``), wherever it stands: a value pasted with a leading space, or under
# an odd scheme (``1s3://``, ``s_3://``), put it past the string's start, and the secret was quoted. Never
# in a path: ``memory://kv/conv://turn@2.kvs`` is a key.
_SCHEME_END = re.compile(r"([A-Za-z0-9+._-]*)://")
_USERINFO = re.compile(r"[^/@]*@|[^/@:]*:[^@]*@")
_USERINFO_BESIDE_PORT = re.compile(r"[^/@]*@|[^/@:]*:(?!\d+(?:/|$))[^@]*@")
_PORT_SCHEMES = {"http", "https", "ftp", "sftp", "ssh", "smb", "hdfs", "webhdfs", "swebhdfs", "dask"}


def _userinfo(url) -> list[tuple[int, int]]:
    """Where ``url`` holds ``user:secret@`` right after a part's first ``://``: each (start, end), ``@`` included."""
    if not isinstance(url, str):
        return []
    found, at = [], 0
    for part in url.split("::"):
        scheme = _SCHEME_END.search(part)
        if scheme is not None:
            port = scheme.group(1).lower() in _PORT_SCHEMES
            userinfo = (_USERINFO_BESIDE_PORT if port else _USERINFO).match(part, scheme.end())
            if userinfo is not None:
                found.append((at + userinfo.start(), at + userinfo.end()))
        at += len(part) + 2
    return found


def has_credentials(url: str) -> bool:
    """Whether ``url`` carries ``user:secret@`` (in any spelling a parser might split differently)."""
    return bool(_userinfo(url))


def redact(url: str) -> str:
    """``url`` safe for messages and logs: no ``user:password@`` (also a secret holding ``/``), and over
    HTTP no query string or fragment (presigned keys). Elsewhere ``?`` and ``#`` can be part of an
    object's key (``s3://b/conv#turn-2``), and cutting there named another key: only a query of
    ``name=value`` parameters (a signature's shape) is cut."""
    for start, end in reversed(_userinfo(url)):
        url = url[:start] + url[end:]
    if isinstance(url, str) and "://" in url and not url.lower().startswith(("http://", "https://")):
        key, _, query = url.partition("?")
        return key if "=" in query else url
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def refuse_credentials(url: str, error_class: type[KVStateError]) -> None:
    """Credentials in a URL end up in messages, logs, tracebacks and third-party errors (botocore
    quotes the bucket name it was given, secret and all), so such a URL is refused before any use;
    the message shows only the scheme."""
    if has_credentials(url):
        scheme = url.partition("://")[0].strip()
        raise error_class(f"a {scheme}:// URL carrying credentials (user:secret@) is refused: pass them in "
                          f"storage_options or the environment (AWS_ACCESS_KEY_ID ...), never in the URL")


def refuse_chained(url: str, error_class: type[KVStateError]) -> None:
    """fsspec reads ``::`` anywhere in a URL as a chain of filesystems and keeps only what comes before
    the first one as the path: ``memory://kv/a::one.kvs`` and ``memory://kv/a::two.kvs`` are both the
    object ``/kv/a`` (the second snapshot replaced the first, and restoring the first gave the
    second), and an IPv6 host (``http://[::1]:9/x``) is cut inside its brackets. So such a URL is
    refused before any use."""
    if "::" in url:
        raise error_class(f"{redact(url)!r} holds '::', which fsspec reads as a chain of filesystems: every "
                          f"key sharing what comes before it would be one object; name it without '::' "
                          f"(an IPv6 endpoint goes in storage_options' endpoint_url)")


_VERSIONED_SCHEMES = ("s3://", "s3a://")      # s3fs's: it reads ``?versionId=`` in a key as a version


def refuse_versioned(url: str, error_class: type[KVStateError]) -> None:
    """s3fs cuts an S3 key at ``?versionId=`` and sends no version with a write: ``s3://b/s.kvs?versionId=1``
    and ``...?versionId=2`` were both the object ``s.kvs`` (the second snapshot replaced the first, and
    neither URL could be restored). So such a URL is refused before any use. Any other query string
    s3fs keeps in the key, as part of the object's name. The version is not quoted (``redact``)."""
    if url.lower().startswith(_VERSIONED_SCHEMES) and "?versionId=" in url:
        raise error_class(f"{redact(url)}: a URL holding '?versionId=' is refused (what follows it is not quoted): "
                          f"s3fs cuts the key there and writes no version, so every URL differing only after it "
                          f"would be one object; put a version in the key's name instead "
                          f"(such as 's3://bucket/kv/name.v2.kvs')")


# botocore's own rule for a region name (``botocore.utils.validate_region_name``: a host label, not all
# digits), checked before botocore sees one; and the shapes of AWS credentials, which pass that rule and
# would then be named in every endpoint URL botocore builds and logs (an access key id; a secret key's
# 40 characters, which holds no ``/`` or ``+`` one time in eight or so).
_REGION_NAME = re.compile(r"^(?![0-9]+$)(?!-)[a-zA-Z0-9-]{,63}(?<!-)$")
_CREDENTIAL_SHAPE = re.compile(r"^(?:(?:AKIA|ASIA)[A-Z0-9]{16}|[A-Za-z0-9/+=]{40})$")


def refuse_unsafe_options(storage_options: dict | None, error_class: type[KVStateError],
                          url: str | None = None) -> None:
    """``storage_options`` whose ``endpoint_url`` carries ``user:secret@``, or whose ``region_name`` is no
    region name or ``signature_version`` no signer botocore has (a secret pasted into the wrong field),
    refused before any use, top level or in ``client_kwargs`` or ``config_kwargs``: botocore quotes them
    in its messages and its debug log, where no redaction of ours reaches. With ``url``, the options
    fsspec's configuration adds for its filesystem are held to the same rules (``configured_options``):
    they are the only options ``ctx.snapshot(url)`` and ``cache.restore(url)`` have. The message quotes
    no value."""
    if storage_options is not None and not isinstance(storage_options, dict):
        raise error_class(f"storage_options must be a dict of fsspec options, got {type(storage_options).__name__}")
    sources = [("storage_options", storage_options or {})]
    if url is not None:
        sources += configured_options(url, storage_options)
        if url.strip().lower().startswith(_VERSIONED_SCHEMES):      # botocore reads these itself
            for name in _ENDPOINT_VARIABLES:
                _refuse_unsafe_endpoint(os.environ.get(name), f"the environment's {name}", error_class)
    for source, options in sources:
        places = [(source, options)]
        for nested in ("client_kwargs", "config_kwargs"):     # botocore's client, and its Config
            if isinstance(options.get(nested), dict):
                places.append((f"{source}[{nested!r}]", options[nested]))
        for where, found in places:
            _refuse_unsafe_endpoint(found.get("endpoint_url"), f"{where}['endpoint_url']", error_class)
            region = found.get("region_name")
            if region is not None and not (isinstance(region, str) and _REGION_NAME.match(region)
                                           and not _CREDENTIAL_SHAPE.match(region)):
                raise error_class(f"{where}['region_name'] is no region name (such as us-east-1); not quoted "
                                  f"here, in case it is a secret in the wrong field")
            signing = found.get("signature_version")       # a str; botocore.UNSIGNED is an object
            if isinstance(signing, str) and not _known_signature_version(signing):
                raise error_class(f"{where}['signature_version'] is no signature version botocore knows (such as "
                                  f"s3v4); not quoted here, in case it is a secret in the wrong field")


_ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
_ENDPOINT = re.compile(r"https?://[^\s@/?#]+(?:/[^\s@?#]*)?", re.IGNORECASE)     # whole (``fullmatch``)


def _refuse_unsafe_endpoint(endpoint, where: str, error_class: type[KVStateError]) -> None:
    """An endpoint that is not an http(s) URL of a server, refused without quoting it: botocore's
    "Invalid endpoint: ..." quotes whatever it was given (a secret pasted into the wrong field), and
    an ``@`` anywhere in one is userinfo (read as a port and a path, a secret beginning with digits
    then ``/`` passed ``has_credentials``)."""
    if endpoint is None or endpoint == "" or (isinstance(endpoint, str) and _ENDPOINT.fullmatch(endpoint)):
        return      # unset (botocore takes an empty one as unset too), or a server's URL
    if isinstance(endpoint, str) and "@" in endpoint:
        raise error_class(f"{where} carries credentials (user:secret@): pass them as storage_options key and "
                          f"secret, or in the environment, never in the URL")
    raise error_class(f"{where} is no http(s) URL of a server (such as http://127.0.0.1:9000); not quoted here, "
                      f"in case it is a secret in the wrong field")


def _known_signature_version(name: str) -> bool:
    """Whether botocore signs by ``name``: its error for any other quotes it, in every message of ours
    about the call. Without botocore nothing reads the option, so any name passes."""
    try:
        from botocore.auth import AUTH_TYPE_MAPS
    except ImportError:
        return True
    return name in AUTH_TYPE_MAPS


def configured_options(url: str, storage_options: dict | None) -> list[tuple[str, dict]]:
    """The options fsspec's configuration (``fsspec.config.conf``, which ``FSSPEC_<PROTOCOL>_*``
    variables fill) gives ``url``'s filesystem beside ``storage_options``, as (where, options) pairs:
    fsspec merges every protocol of the filesystem's entry in turn, key by key, under the explicit
    options, so only the keys that survive that merge are listed; none where no filesystem serves
    ``url`` (``_filesystem`` refuses it by name)."""
    try:
        import fsspec
        cls = fsspec.get_filesystem_class(fsspec.core.split_protocol(url)[0] or "file")
    except (ImportError, ValueError):
        return []
    protocols = cls.protocol if isinstance(cls.protocol, (tuple, list)) else (cls.protocol,)
    taken, found = set(storage_options or {}), []
    for protocol in reversed(protocols):        # the last one fsspec merges wins a key
        options = fsspec.config.conf.get(protocol)
        if isinstance(options, dict):
            found.append((f"fsspec.config.conf[{protocol!r}]",
                          {name: value for name, value in options.items() if name not in taken}))
            taken.update(options)
    return found


def server_of(url: str) -> str:
    """Whom a URL's calls wait on, for the cap on calls abandoned there (``remote_deadline``): its scheme
    and host or bucket, without credentials."""
    parts = redact(url).partition("://")
    return f"{parts[0]}://{parts[2].split('/', 1)[0]}"


def _describe(error: BaseException) -> str:
    text = re.sub(r"//[^\s@'\"]*@", "//", str(error))          # credentials embedded in a URL (secrets may hold /)
    text = re.sub(r"[^\s'\"/]*:[^\s'\"]*@", "", text)          # a quoted user:secret@bucket (botocore)
    text = re.sub(r"\?[^\s'\"]*", "", text)                     # query strings (signatures)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


# -- filesystems -------------------------------------------------------------------------

def _filesystem(url: str, storage_options: dict | None, error_class: type[SnapshotError]):
    refuse_credentials(url, error_class)
    refuse_chained(url, error_class)
    refuse_versioned(url, error_class)
    refuse_unsafe_options(storage_options, error_class, url)
    try:
        import fsspec
    except ImportError:
        raise error_class(f"{redact(url)}: snapshots at URLs need fsspec (pip install 'kvstate[remote]')") from None
    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except (ImportError, ValueError) as error:
        raise error_class(f"{redact(url)}: no filesystem for this URL ({_describe(error)}); "
                          f"for s3:// pip install 'kvstate[remote]'") from None


def _object_path(url: str, path: str, error_class: type[SnapshotError]) -> str:
    """``path`` if it names an object (a key after the bucket or folder); else ``error_class`` by name.

    ``memory://``, ``s3://bucket`` or ``.../folder/`` name no object: a write there
    would store nothing where a restore could find it.
    """
    name = path.rpartition("/")[2]
    if not name or url.endswith("/") or "/" not in path.strip("/") and _names_bucket(url):
        raise error_class(f"{redact(url)} names no object: a snapshot URL needs a key, such as "
                          f"'s3://bucket/kv/name.kvs' or 'memory://kv/name.kvs'")
    return path


def _names_bucket(url: str) -> bool:
    """Whether the URL's first path part is a bucket (object stores), so a key must follow it."""
    return urlsplit(url).scheme in ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss")


def _is_memory(fs) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "memory" in protocols and isinstance(getattr(fs, "store", None), dict)


def _is_local(fs) -> bool:
    try:
        from fsspec.implementations.local import LocalFileSystem
    except ImportError:
        return False
    return isinstance(fs, LocalFileSystem)


def _is_http(fs) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "http" in protocols or "https" in protocols


def _is_s3(fs) -> bool:
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "s3" in protocols


def _abandon(file) -> None:
    """Drop a half-written file without publishing it; best effort (the server may be gone)."""
    try:
        discard = getattr(file, "discard", None)
        if discard is not None:
            discard()     # s3fs: AbortMultipartUpload
    except Exception:     # noqa: BLE001 - the write already failed; that error is the one to report
        pass
    finally:
        # An fsspec buffered file publishes on close() and on garbage collection unless marked closed.
        try:
            file.closed = True
        except AttributeError:
            pass


# -- streams -----------------------------------------------------------------------------

@contextmanager
def open_read(url: str, storage_options: dict | None = None, worker: Worker | None = None) -> Iterator:
    """A seekable binary stream of the object at ``url``, fetched in ``READ_BLOCK_BYTES`` ranges.

    On S3, and over http(s) where the server gives a strong ETag, every range is fetched
    with ``If-Match`` on the ETag seen at open, so an object replaced mid-read fails (and
    is retried by ``read``) instead of splicing two versions; a server giving none leaves
    that to the checksum, which refuses the splice as damaged. No object there: ``SnapshotNotFoundError`` (no bucket:
    ``SnapshotReadError``). With ``worker``, every blocking call (the open, each read) is bounded
    by its deadline.
    """
    call = worker.call if worker is not None else (lambda function, *args, **kwargs: function(*args, **kwargs))
    fs, path = call(_filesystem, url, storage_options, SnapshotReadError)
    path = _object_path(url, path, SnapshotNotFoundError)
    try:
        if _is_memory(fs):
            # memory:// hands every opener the one stored file object (one position for all):
            # each reader gets its own view of the bytes instead, without copying them.
            file = io.BytesIO(fs.store[path].getbuffer()) if path in fs.store else fs.open(path, "rb")
            worker = None       # in this process's memory: nothing to wait for
        elif _is_local(fs):
            # a FIFO, device or socket at a key (a file:// store's) is refused at once by name, where
            # fsspec's open blocked in a thread stuck for good, counted against every file:// store
            file, _ = call(open_regular, path)
        else:
            call(fs.invalidate_cache, path)     # size and ETag from the server, not from an earlier listing
            file = call(fs.open, path, "rb", block_size=READ_BLOCK_BYTES, cache_type="readahead",
                        **(_pinned_http_version(fs, path, call) if _is_http(fs) else {}))
    except FileNotFoundError as error:
        _raise_if_not_absent(error, url)
        raise SnapshotNotFoundError(f"no snapshot at {redact(url)}") from None
    # s3fs opens a prefix as an empty file. Its details were fetched at the open; ``vars``, since on
    # another filesystem ``details`` may be a property asking the server again, unbounded.
    known = vars(file)
    if (known.get("_details") or known.get("details") or {}).get("type") == "directory":
        if worker is None:
            file.close()
        else:
            worker.later(file.close)
        raise SnapshotNotFoundError(f"no snapshot at {redact(url)}: it names a folder (other keys begin with it)")
    try:
        yield file if worker is None else Bounded(file, worker)
    finally:
        if worker is None:
            file.close()
        else:
            worker.later(file.close)     # a read-only handle: nothing to wait for


def _pinned_http_version(fs, path: str, call) -> dict:
    """``fs.open`` options that fetch every range of the object at ``path`` over http(s) with ``If-Match``
    on the strong ETag its HEAD gives, as s3fs does on S3: an object replaced mid-read then answers 412,
    retried (``is_transient``), where its ranges spliced two versions into one the checksum refused,
    not retried. The size is that HEAD's too, so the open sends none of its own. None where the server
    gives no size or no strong ETag (a weak one never matches ``If-Match``).

    The filesystem's own headers (``storage_options``, ``fsspec.config.conf``: an ``Authorization``)
    are kept beside it: fsspec merges open options over the filesystem's one key deep, so a
    ``headers`` of ``If-Match`` alone sent every range without them (a 401 where the HEAD passed)."""
    info = call(fs.info, path)
    etag, size = info.get("ETag"), info.get("size")
    if not size or not isinstance(etag, str) or etag.startswith("W/"):
        return {}
    own = (getattr(fs, "kwargs", None) or {}).get("headers") or {}
    return {"size": size, "headers": {**own, "If-Match": etag}}


@contextmanager
def open_publish(url: str, storage_options: dict | None = None, worker: Worker | None = None) -> Iterator:
    """A binary stream whose bytes appear at ``url`` all at once when the block exits normally.

    If the block raises, nothing is published and the previous object at ``url``
    (if any) is untouched. See the module docstring for how, per filesystem. With
    ``worker``, every blocking call is bounded by its deadline; past it, clean-up
    (abort, removing the temporary key) runs if and when the stuck call returns.
    """
    call = worker.call if worker is not None else (lambda function, *args, **kwargs: function(*args, **kwargs))

    def clean_up(function, *args, wait: bool = True):
        """Abort or remove now, within the deadline; a worker stuck (or out of time) does it later, and so
        does one interrupted (``wait`` False: Ctrl-C waited out the deadline behind a held upload)."""
        if worker is None:
            function(*args)
        elif not wait or worker.stuck or worker.deadline.left() <= 0:
            worker.later(function, *args)
        else:
            try:
                worker.call(function, *args)
            except SnapshotDeadlineError:
                pass            # still queued on the worker: it runs if the stuck call returns

    fs, path = call(_filesystem, url, storage_options, SnapshotWriteError)
    path = _object_path(url, path, SnapshotWriteError)
    target = object_identity(fs, path)
    _refuse_if_landing(target, url)        # before anything is sent
    if _is_memory(fs):
        call = lambda function, *args, **kwargs: function(*args, **kwargs)    # noqa: E731 - in memory
        worker = None
    if _is_s3(fs):
        file = call(fs.open, path, "wb", block_size=PART_BYTES)
        try:
            yield file if worker is None else Bounded(file, worker)
        except BaseException as error:
            clean_up(_abandon, file, wait=isinstance(error, Exception))
            raise
        try:
            call(file.close)    # CompleteMultipartUpload (or the one PUT): the object appears whole
        except SnapshotDeadlineError as error:
            clean_up(_abandon, file)
            _may_land(target, worker)
            raise _unknown_outcome(error) from None
        except BaseException as error:
            # an upload that did not complete is aborted, not left for the lifecycle rule
            clean_up(_abandon, file, wait=isinstance(error, Exception))
            if not isinstance(error, Exception):
                _may_land(target, worker)      # interrupted with its publishing call sent
            raise
        return
    folder, _, name = path.rpartition("/")
    temp = f"{folder}/" if folder else ""
    temp += f"{fmt.TEMP_PREFIX}{name}.{uuid.uuid4().hex}{fmt.TEMP_SUFFIX}"
    file = call(fs.open, temp, "wb")
    try:
        yield file if worker is None else Bounded(file, worker)
    except BaseException as error:
        clean_up(_abandon, file, wait=isinstance(error, Exception))
        clean_up(_remove_quietly, fs, temp, wait=isinstance(error, Exception))
        raise
    copying = False
    try:
        call(file.close)
        copying = True
        # cp_file and rm_file take one exact key; mv, cp and rm expand glob characters
        # (``*``, ``?``, ``[``) in it, so a name holding them published nothing or left the temp.
        call(fs.cp_file, temp, path)
        copying = False
    except SnapshotDeadlineError as error:
        clean_up(_remove_quietly, fs, temp)
        if not copying:
            raise               # the temporary key's upload: nothing at ``path`` changed
        _may_land(target, worker)
        raise _unknown_outcome(error) from None
    except BaseException as error:
        if copying and not isinstance(error, Exception):
            _may_land(target, worker)          # interrupted with the copy sent
        clean_up(_remove_quietly, fs, temp, wait=isinstance(error, Exception))
        raise
    clean_up(_remove_quietly, fs, temp)


# Objects whose publishing call was given up on (its deadline ran out, or an interrupt came) after it
# was sent: the server may still complete it, and a later write to the object would then be replaced by
# the older snapshot. Writes there are refused until that call returns (``_may_land``). Each is held by
# its ``object_identity``, not its URL: a write through another spelling of the same object
# (``s3a://``, ``s3:///bucket/key``) is refused as well.
_landing: set[tuple] = set()
_landing_lock = threading.Lock()


def object_identity(fs, path: str) -> tuple:
    """Which object ``path`` (as ``url_to_fs`` gave it) names on ``fs``: the same tuple for every URL
    fsspec resolves to that object, another for every other object.

    - the scheme's family, not the scheme: ``s3://`` and ``s3a://`` are one filesystem
      (``fs.protocol`` lists every scheme it answers to);
    - the server: the ``endpoint_url`` of its options (top level or ``client_kwargs``), since a bucket
      of one name on two servers is two objects, in every spelling of it (``endpoint_identity``);
      credentials are not part of it;
    - the key as the filesystem sends it: on object stores their own ``split_path`` (bucket, key),
      which reads ``s3:///bucket/key`` as ``s3://bucket/key``; elsewhere the filesystem's own
      ``_strip_protocol``. A spelling that reaches another key stays apart: ``s3://bucket//key``
      is the key ``/key``, another object on S3, and ``memory://a//b`` another entry than ``memory://a/b``.
    """
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    options = getattr(fs, "storage_options", None)
    options = options if isinstance(options, dict) else {}
    client = options.get("client_kwargs")
    endpoint = options.get("endpoint_url") or (client.get("endpoint_url") if isinstance(client, dict) else None)
    key = path
    try:
        split = getattr(fs, "split_path", None)
        if callable(split):
            bucket, name = split(path)[:2]
            key = f"{bucket}/{name}"
        elif callable(getattr(fs, "_strip_protocol", None)):
            key = fs._strip_protocol(path)
    except Exception:     # noqa: BLE001 - a filesystem that cannot say: the path as url_to_fs gave it
        key = path
    return (tuple(sorted(map(str, protocols))), endpoint_identity(endpoint) if endpoint else None, key)


_DEFAULT_PORTS = {"http": 80, "https": 443}
_LOOPBACK = "loopback"      # every name of this machine's loopback interface, as one server


def endpoint_identity(endpoint) -> str:
    """Which server ``endpoint`` (an ``endpoint_url``) names, the same string for its every spelling:
    the host in any case, with or without a trailing dot, a trailing slash or not, an IP address in any
    form (``[0:0:0:0:0:0:0:1]`` is ``[::1]``, ``[::ffff:10.0.0.5]`` is ``10.0.0.5``), every address of
    the loopback interface and ``localhost`` as one (and the unspecified ``0.0.0.0`` and ``[::]``,
    which a client connects to as this machine), and the scheme's default port written or not, for
    either scheme (a service on ``http://host`` and ``https://host`` is one service; one port serves
    one scheme, so a port written is the server). Reading two spellings of one server as two would let
    a write through the second pass a call to the first that may still land, so where in doubt it is
    one server: a spurious refusal says why and is retried, a missed one replaces a newer snapshot."""
    text = str(endpoint).strip()
    try:
        parts = urlsplit(text)
        scheme, host, port = parts.scheme.lower(), parts.hostname, parts.port
    except ValueError:        # no URL a client could reach either (a bad port): the text as given
        return text.rstrip("/")
    if not scheme or host is None:
        return text.rstrip("/")
    host = _host_identity(host)
    server = host if port is None or port == _DEFAULT_PORTS.get(scheme) else f"{host}:{port}"
    return server + parts.path.rstrip("/")


def _host_identity(host: str) -> str:
    """``host`` (lower case, as ``urlsplit`` gives it) as one string per machine it reaches: an IP
    address in its one canonical form (an IPv4-mapped IPv6 address as the IPv4 one, which a dual-stack
    socket connects it to; IPv6 in brackets, as a port may follow), a name without its trailing dot,
    and ``_LOOPBACK`` for this machine (every loopback address, ``localhost``, and ``0.0.0.0`` or
    ``[::]``, which a client connects to here). Only literal addresses are parsed: ``127.1`` or
    ``2130706433``, which ``ipaddress`` refuses, reach no server through aiohttp either."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        host = host[:-1] if host.endswith(".") else host
        return _LOOPBACK if host == "localhost" else host
    if address.version == 6 and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_loopback or address.is_unspecified:
        return _LOOPBACK
    return f"[{address.compressed}]" if address.version == 6 else address.compressed     # [a::1]:9 is no a::1:9


def landing_key(url: str, storage_options: dict | None = None) -> tuple:
    """``object_identity`` of the object ``url`` names (no request is sent)."""
    fs, path = _filesystem(url, storage_options, SnapshotWriteError)
    return object_identity(fs, _object_path(url, path, SnapshotWriteError))


def _forget_parents_landings() -> None:
    """In a forked child: the parent's publishing calls are not this process's writes (the child has
    none of the threads that would clear them, so its writes there were refused for good)."""
    global _landing_lock
    _landing_lock = threading.Lock()
    _landing.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parents_landings)


def _may_land(target: tuple, worker: Worker | None) -> None:
    """The abandoned publishing call to ``target`` (an ``object_identity``) may still land: refuse
    writes there until ``worker`` is done."""
    if worker is None:
        return
    with _landing_lock:
        _landing.add(target)
    worker.later(_landed, target)


def _landed(target: tuple) -> None:
    with _landing_lock:
        _landing.discard(target)


def _refuse_if_landing(target: tuple, url: str) -> None:
    """``SnapshotWriteError`` for a write to ``url`` (``target``, its ``object_identity``) while an
    abandoned write to the same object, by this spelling or another, may still land."""
    with _landing_lock:
        pending = target in _landing
    if pending:
        raise SnapshotWriteError(f"an earlier write to {redact(url)} (by this URL or another naming the same "
                                 "object, such as s3a://) was given up on after its publishing call was sent, "
                                 "and the server has not answered it: it may still land and would replace this "
                                 "one, so nothing was sent (write again once it has answered)")


def _unknown_outcome(error: SnapshotDeadlineError) -> SnapshotDeadlineError:
    """The deadline ran out during the publishing call itself: the server may yet complete it."""
    return SnapshotDeadlineError(str(error).replace("nothing was changed here", "the publishing call was sent "
                                                    "and may still complete: the object there is the old one "
                                                    "or the whole new one"), deadline=error.deadline)


def _failure_behind(error: BaseException) -> BaseException | None:
    """The failure a ``FileNotFoundError`` stands for, if it is no absence: fsspec's HTTP filesystem
    reports a refused connection, and any error status of its HEAD-then-GET probe (a 403, a 500),
    as "not found", with the real error as its cause; s3fs reports a bucket that does not exist (a
    typo in a fleet's configuration) so. Only a 404 for the object, or no cause at all, is absence."""
    seen = []
    link = error.__cause__ or error.__context__
    while link is not None and link not in seen:
        if not isinstance(link, FileNotFoundError) and (is_transient(link) or _http_status(link) not in (None, 404)
                                                        or _no_bucket(link)):
            return link
        seen.append(link)
        link = link.__cause__ or link.__context__
    return None


def _raise_if_not_absent(error: FileNotFoundError, url: str) -> None:
    """An outage or a refusal disguised as absence becomes ``SnapshotReadError``, with the real cause
    (so an outage is retried and a 403 is not)."""
    failure = _failure_behind(error)
    if failure is None:
        return
    status = _http_status(failure)
    said = (f"the server answered {status}" if status is not None else
            "its bucket does not exist" if _no_bucket(failure) else "cannot reach it")
    said += f": {_describe(failure)}"        # redacted: a server may quote the signed URL back
    raise SnapshotReadError(f"{redact(url)}: {said}") from failure


def _no_bucket(error: BaseException) -> bool:
    """Whether ``error`` is S3's NoSuchBucket (botocore's error shape, without importing botocore)."""
    response = getattr(error, "response", None)
    return isinstance(response, dict) and (response.get("Error") or {}).get("Code") == "NoSuchBucket"


def _http_status(error: BaseException) -> int | None:
    """The HTTP status of an aiohttp response error (fsspec's HTTP filesystem), else None."""
    status = getattr(error, "status", None)
    from_aiohttp = any(cls.__module__.split(".")[0] == "aiohttp" for cls in type(error).__mro__)
    return status if from_aiohttp and isinstance(status, int) else None


def _remove_quietly(fs, path: str) -> None:
    try:
        if fs.exists(path):
            fs.rm_file(path)     # one exact key: rm would glob
    except Exception:     # noqa: BLE001 - best effort; a stray temporary key is never read as a snapshot
        pass


# -- whole operations, retried -------------------------------------------------------------

def read(url: str, parse: Callable[[object], T], storage_options: dict | None = None,
         deadline: Deadline | float | None = None) -> T:
    """``parse(stream)`` on the object at ``url``, started over on transient failures, all within
    ``deadline`` (seconds or a ``Deadline``; default: ``remote_deadline.resolve``'s).

    ``parse`` must change nothing until it has read and checked everything
    (``impl/snapshot.restore_snapshot`` on a stream does exactly that); it runs in this thread.
    """
    deadline = resolve(deadline)

    def attempt() -> T:
        worker = _worker_for(url, deadline, f"restoring from {redact(url)}")
        try:
            with open_read(url, storage_options, worker) as file:
                return parse(file)
        finally:
            if worker is not None:
                worker.close()
    return _retried(attempt, url, "restoring from", SnapshotReadError, deadline)


def publish(url: str, fill: Callable[[object], None], storage_options: dict | None = None,
            deadline: Deadline | float | None = None) -> None:
    """Replace the object at ``url`` with what ``fill(stream)`` writes, atomically; retried on transient
    failures, all within ``deadline`` (as for ``read``)."""
    if is_local_url(url):
        # a local folder (a ``file://`` or ``local://`` store): the local writer's temp file, fsyncs and
        # rename, so a reader sees the old file or the whole new one; fsspec's local copy writes in place
        path = local_path(url, SnapshotWriteError)
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        except OSError as error:
            raise SnapshotWriteError(f"cannot make the folder of {path!r}: {error}") from None
        write_atomic(path, fill)
        return
    deadline = resolve(deadline)

    def attempt() -> None:     # open_publish refuses an object whose abandoned write may still land
        worker = _worker_for(url, deadline, f"writing a snapshot to {redact(url)}")
        try:
            with open_publish(url, storage_options, worker) as file:
                fill(file)
        finally:
            if worker is not None:
                worker.close()
    _retried(attempt, url, "writing a snapshot to", SnapshotWriteError, deadline)


def _worker_for(url: str, deadline: Deadline, doing: str) -> Worker | None:
    """The thread an operation's blocking calls run on, or None for ``memory://``: its bytes are in
    this process, nothing there can block, and a thread per operation cost the lockstep machine
    (half its snapshots go to ``memory://``) a thread start and two hand-offs each."""
    return None if url.startswith("memory://") else Worker(deadline, doing, server_of(url))


def exists(url: str, storage_options: dict | None = None, deadline: Deadline | float | None = None) -> bool:
    """Whether an object is stored at ``url`` (one HEAD on S3), retried on transient failures, within
    ``deadline`` (as for ``read``)."""
    return stored_size(url, storage_options, deadline) is not None


def stored_size(url: str, storage_options: dict | None = None,
                deadline: Deadline | float | None = None) -> int | None:
    """The size of the object stored at ``url``, or None where there is none (a "folder", a prefix other
    keys begin with, is none): one HEAD on S3, retried on transient failures, within ``deadline``."""
    stored = stored_version(url, storage_options, deadline)
    return None if stored is None else stored[0]


# What names one version of an object in ``fs.info``, first found first: S3's ETag (its content's), then the
# times a local or in-memory filesystem keeps (a rewrite changes them).
_VERSION_KEYS = ("ETag", "etag", "mtime", "LastModified", "created")


def stored_version(url: str, storage_options: dict | None = None,
                   deadline: Deadline | float | None = None) -> tuple[int, str | None] | None:
    """``(size, version)`` of the object stored at ``url``, or None where there is none, as ``stored_size``
    asks (one HEAD on S3); ``version`` names the object as it is now (``_VERSION_KEYS``), None where the
    filesystem names none: then no two lookups can be told to have found the same object."""
    deadline = resolve(deadline)

    def look() -> tuple[int, str | None] | None:
        fs, path = _filesystem(url, storage_options, SnapshotReadError)
        fs.invalidate_cache(path)
        try:
            info = fs.info(path)       # not fs.exists: over HTTP it answers False for a refused connection
        except FileNotFoundError as error:
            _raise_if_not_absent(error, url)
            return None
        if info.get("type") == "directory":
            return None
        version = next((str(info[key]) for key in _VERSION_KEYS if info.get(key) is not None), None)
        return int(info.get("size") or 0), version

    def attempt() -> tuple[int, str | None] | None:
        worker = Worker(deadline, f"looking up {redact(url)}", server_of(url))
        try:
            return worker.call(look)
        finally:
            worker.close()
    return _retried(attempt, url, "looking up", SnapshotReadError, deadline)


def _retried(action: Callable[[], T], url: str, verb: str, error_class: type[SnapshotError],
             deadline: Deadline | None = None) -> T:
    deadline = resolve(deadline)
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return action()
        except SnapshotDeadlineError as error:
            failure = error
        except KVStateError as error:
            cause = error.__cause__
            if error_class is SnapshotReadError and isinstance(error, SnapshotReadError) \
                    and isinstance(cause, FileNotFoundError) and _failure_behind(cause) is None:
                # gone after the read opened it (a lifecycle rule, a replacement): absent, as before the open
                failure = _caused(SnapshotNotFoundError(f"no snapshot at {redact(url)}: it went while it was read"),
                                  error)
            elif attempt < ATTEMPTS and isinstance(error, (SnapshotReadError, SnapshotWriteError)) \
                    and cause is not None and is_transient(cause):
                _sleep_before(attempt, deadline)
                continue
            else:
                named = _naming(error, url)
                failure = named if named is error else _caused(named, error)
        except Exception as error:     # noqa: BLE001 - translated into a named error below
            behind = _failure_behind(error) if isinstance(error, FileNotFoundError) else None
            if isinstance(error, FileNotFoundError) and behind is None and error_class is SnapshotReadError:
                failure = _caused(SnapshotNotFoundError(f"no snapshot at {redact(url)}"), error)
            else:
                error = behind or error     # a failure reported as absence: retried if transient, then named
                if attempt < ATTEMPTS and is_transient(error):
                    _sleep_before(attempt, deadline)
                    continue
                tries = f" after {attempt} attempts" if attempt > 1 else ""
                failure = _caused(error_class(f"{verb} {redact(url)} failed{tries}: {_describe(error)}"
                                              + ("; the previous object there is intact"
                                                 if error_class is SnapshotWriteError else "; nothing was changed")),
                                  error)
        raise _without_secrets(failure)     # out of the handler: no context but the chain it names
    raise AssertionError("unreachable")


def _caused(error: BaseException, cause: BaseException) -> BaseException:
    error.__cause__ = cause
    return error


def _without_secrets(error: BaseException) -> BaseException:
    """``error`` with its chain cut at the first error not ours, which a stand-in replaces: the same
    kind for ``is_transient`` (``ConnectionError`` or ``OSError``) carrying only its ``_describe``.
    fsspec's and aiohttp's errors quote whole URLs, a presigned one's signature included; ours name
    them ``redact``-ed. Nor does any link keep an implicit context (the error being handled when it was
    raised): the chain holds what our messages say, and nothing else."""
    link = error
    while link is not None:
        link.__context__, link.__suppress_context__ = None, True
        cause = link.__cause__
        if cause is not None and not isinstance(cause, KVStateError):
            stand_in = (ConnectionError if is_transient(cause) else OSError)(_describe(cause))
            stand_in.__traceback__ = cause.__traceback__     # its frames, for a bug's report (no locals print)
            link.__cause__ = stand_in
            break
        link = cause
    return error


def _naming(error: KVStateError, url: str) -> KVStateError:
    """The same error class, its message prefixed with the (redacted) URL unless it names it already."""
    where = redact(url)
    if where in str(error):
        return error
    try:
        return type(error)(f"{where}: {error}")
    except TypeError:     # an error class with another constructor: keep it as it is
        return error


def is_transient(error: BaseException) -> bool:
    """Worth another try: the network or the server failed, not the request or the object."""
    if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError,
                          FileExistsError)):
        return False
    if isinstance(error, (ConnectionError, TimeoutError)):
        return True
    if isinstance(error, OSError) and error.errno in _TRANSIENT_ERRNOS:
        return True     # s3fs: EBUSY for an object replaced mid-read, EREMOTEIO for InternalError
    for cls in type(error).__mro__:     # botocore / aiohttp transport errors, without importing either
        if cls.__module__.split(".")[0] in ("botocore", "aiohttp", "urllib3") and \
                cls.__name__ in ("ConnectionError", "HTTPClientError", "ClientConnectionError",
                                 "ClientPayloadError", "ServerDisconnectedError", "ProtocolError"):
            return True
    status = _http_status(error)
    if status is not None:          # the status decides: the text quotes the URL, whose key may hold "503"
        return status in _TRANSIENT_STATUSES
    text = str(error)
    return any(mark in text for mark in ("SlowDown", "ServiceUnavailable", "RequestTimeout", "InternalError",
                                         "503", "500 Internal"))


def _sleep_before(attempt: int, deadline: Deadline | None = None) -> None:
    """The pause before another attempt, never past ``deadline`` (the next attempt then fails at once)."""
    delay = min(BACKOFF_CAP_S, BACKOFF_S * 2 ** (attempt - 1)) * random.uniform(0.5, 1.5)
    time.sleep(delay if deadline is None else min(delay, deadline.left()))
