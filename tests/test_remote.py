"""Snapshots at fsspec URLs and the second-tier store, against a real S3-API server.

The S3 tests start moto's standalone server (``moto[server]``) on 127.0.0.1, on a
free port, and stop it at the end; they talk to nothing else (dummy credentials,
no proxies, no instance metadata). ``memory://`` tests need only fsspec. Each
group skips cleanly when its extra is missing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import threading
import uuid
from pathlib import Path

import numpy as np
import pytest

from kvstate.impl import Cache, remote_io
from kvstate.impl import snapshot_write
from kvstate.model import GPT2, GPT2Config
from kvstate.spec import Layout
from kvstate.spec.errors import (InvalidInputError, SnapshotError, SnapshotNotFoundError, SnapshotReadError,
                                 SnapshotTruncatedError, SnapshotWriteError)
from kvstate.spec.precision import PRECISIONS

fsspec = pytest.importorskip("fsspec")

SECRET = "dummy-secret-" + "x" * 24        # never a real credential; asserted absent from every message
ROOT = Path(__file__).resolve().parents[1]
SMALL = Layout(1, 1, 2)                    # 3 positions at f32: a 108-byte snapshot
BIG = Layout(2, 4, 64)                     # 4 KiB a position at f32: 2,500 positions span two multipart parts


def filled(cache: Cache, n: int, seed: int = 0, first_token: int = 0):
    rng = np.random.default_rng(seed)
    ctx = cache.allocate()
    tokens = np.arange(first_token, first_token + n) % 50_000
    ctx.extend(tokens, rng.standard_normal((n, *cache.layout.position_shape)).astype(np.float32))
    return ctx


def f32_bytes(layout: Layout, n: int) -> int:
    """Bytes of ``n`` positions' values at f32."""
    return 4 * n * layout.values_per_position


def bits(ctx) -> tuple[bytes, list[int]]:
    values, tokens = ctx.read()
    return np.ascontiguousarray(values).view(np.uint8).tobytes(), [int(t) for t in tokens]


# -- the server --------------------------------------------------------------------------

class S3:
    def __init__(self, endpoint: str, bucket: str):
        self.endpoint, self.bucket = endpoint, bucket
        self.options = dict(endpoint_url=endpoint, key="testing", secret=SECRET,
                            config_kwargs={"retries": {"max_attempts": 2}, "connect_timeout": 2, "read_timeout": 20})
        self.fs = fsspec.filesystem("s3", skip_instance_cache=True, **self.options)

    def url(self, name: str) -> str:
        return f"s3://{self.bucket}/{name}"

    def client(self):
        import boto3
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                            aws_secret_access_key=SECRET, region_name="us-east-1")


@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    pytest.importorskip("flask")
    pytest.importorskip("flask_cors")
    from kvstate.bench.remote_restore import local_s3_server

    with pytest.MonkeyPatch.context() as patch:
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "AWS_PROFILE", "AWS_SESSION_TOKEN",
                     "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            patch.delenv(name, raising=False)
        patch.setenv("AWS_ACCESS_KEY_ID", "testing")
        patch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
        patch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        patch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        patch.setenv("AWS_CONFIG_FILE", os.devnull)
        patch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
        patch.setenv("NO_PROXY", "127.0.0.1")
        with local_s3_server() as endpoint:     # moto's server, a subprocess on 127.0.0.1, stopped on exit
            assert endpoint.startswith("http://127.0.0.1:")
            store = S3(endpoint, f"kvstate-{uuid.uuid4().hex[:12]}")
            store.fs.mkdir(store.bucket)
            # ctx.snapshot("s3://...") takes no options: it gets them from fsspec's config, as a user's would
            patch.setitem(fsspec.config.conf, "s3", store.options)
            patch.setattr(remote_io, "BACKOFF_S", 0.01)
            yield store


# -- round trips ----------------------------------------------------------------------------

@pytest.mark.parametrize("precision", PRECISIONS)
def test_s3_round_trip_is_bit_identical_and_the_same_bytes_as_a_file(s3, precision, tmp_path):
    cache = Cache(BIG, page_tokens=16, precision=precision)
    with filled(cache, 37, seed=1) as ctx:
        url = s3.url(f"round/{precision}.kvs")
        ctx.snapshot(url)
        ctx.snapshot(tmp_path / "local.kvs")
        with cache.restore(url) as back:
            assert bits(back) == bits(ctx)
    assert s3.fs.cat(url.removeprefix("s3://")) == (tmp_path / "local.kvs").read_bytes()


def test_s3_round_trip_of_a_multipart_object(s3):
    cache = Cache(BIG, page_tokens=64)
    with filled(cache, 2500, seed=2) as ctx:     # 10 MB: two parts of remote_io.PART_BYTES
        assert 2500 * f32_bytes(BIG, 1) > remote_io.PART_BYTES
        ctx.snapshot(s3.url("round/multipart.kvs"))
        with cache.restore(s3.url("round/multipart.kvs")) as back:
            assert bits(back) == bits(ctx)


def test_streaming_holds_a_few_parts_up_and_no_extra_copy_down(s3, monkeypatch):
    """Client allocations (tracemalloc: Python and NumPy, every thread; the server is another process).

    Up: a few parts (about 6 of 5 MiB measured: s3fs's buffer, the part it cuts
    from it, the HTTP body), however large the object; buffering the object whole
    would hold more than the object. Down: the body the reader checks plus the
    pages it fills (2x the object) plus a few blocks; fetching the whole object
    first and then parsing it would hold 3x.
    """
    import tracemalloc

    monkeypatch.setattr(remote_io, "PART_BYTES", 5 << 20)
    monkeypatch.setattr(remote_io, "READ_BLOCK_BYTES", 1 << 20)
    cache = Cache(BIG, page_tokens=256)
    url = s3.url("memory/big.kvs")

    def peak(fn):
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            result = fn()
            return tracemalloc.get_traced_memory()[1] - base, result
        finally:
            tracemalloc.stop()
    with filled(cache, 12_000, seed=9) as ctx:      # 47 MiB
        up, _ = peak(lambda: ctx.snapshot(url))
        size = s3.fs.size(url.removeprefix("s3://"))
        assert size > 45 << 20
        down, back = peak(lambda: cache.restore(url))
        with back:
            assert bits(back) == bits(ctx)
    assert up < 0.75 * size, f"upload peaked at {up / 2**20:.1f} MiB for a {size / 2**20:.1f} MiB object"
    assert down < 2 * size + 8 * (1 << 20), f"restore peaked at {down / 2**20:.1f} MiB for {size / 2**20:.1f} MiB"


@pytest.mark.parametrize("precision", PRECISIONS)
def test_memory_and_file_urls_round_trip(precision, tmp_path):
    cache = Cache(SMALL, page_tokens=2, precision=precision)
    with filled(cache, 5) as ctx:
        for url in (f"memory://kvstate-test/{uuid.uuid4().hex}/ctx.kvs", (tmp_path / "ctx.kvs").as_uri()):
            ctx.snapshot(url)
            with cache.restore(url) as back:
                assert bits(back) == bits(ctx)
    assert [p.name for p in tmp_path.iterdir()] == ["ctx.kvs"]     # no temporary file left behind


def test_memory_urls_start_no_deadline_thread(monkeypatch):
    """Nothing in this process's memory can block: a memory:// snapshot and restore run without the
    deadline's worker thread (the lockstep machine sends half its snapshots there)."""
    def no_worker(*args, **kwargs):
        raise AssertionError("a deadline worker for a memory:// URL")
    monkeypatch.setattr(remote_io, "Worker", no_worker)
    cache = Cache(SMALL, page_tokens=2)
    url = f"memory://kvstate-test/{uuid.uuid4().hex}/ctx.kvs"
    with filled(cache, 5) as ctx:
        ctx.snapshot(url)
        with cache.restore(url) as back:
            assert bits(back) == bits(ctx)


def test_a_missing_object_is_not_found_by_name(s3):
    cache = Cache(SMALL, page_tokens=2)
    url = s3.url("nowhere/ctx.kvs")
    with pytest.raises(SnapshotNotFoundError, match="s3://.*/nowhere/ctx.kvs"):
        cache.restore(url)


# s3fs cuts a key at "?versionId=" and writes no version: both URLs were the one object "sess.kvs",
# the second snapshot replaced the first, and neither URL could be restored.
def test_s3_urls_naming_a_version_are_refused_before_anything_is_written(s3):
    from kvstate.remote import SnapshotStore

    cache = Cache(SMALL, page_tokens=2)
    folder = f"versioned-{uuid.uuid4().hex[:8]}"
    with filled(cache, 3) as ctx:
        for version in ("turn1", "turn2"):
            with pytest.raises(SnapshotWriteError, match=r"\?versionId="):
                ctx.snapshot(s3.url(f"{folder}/sess.kvs?versionId={version}"))
    with pytest.raises(SnapshotReadError, match=r"\?versionId="):
        cache.restore(s3.url(f"{folder}/sess.kvs?versionId=turn1"))
    with pytest.raises(InvalidInputError, match=r"\?versionId="):
        SnapshotStore(f"s3a://{s3.bucket}/{folder}?versionId=x")
    assert s3.fs.find(f"{s3.bucket}/{folder}") == []
    with filled(cache, 3) as ctx:        # any other query string is part of the key, written whole
        ctx.snapshot(s3.url(f"{folder}/sess.kvs?turn=1"))
    assert s3.fs.find(f"{s3.bucket}/{folder}") == [f"{s3.bucket}/{folder}/sess.kvs?turn=1"]


# -- refusals --------------------------------------------------------------------------------

def _refusal(cache: Cache, url: str) -> SnapshotError:
    before = cache.stats(), cache.observe().holders
    with pytest.raises(SnapshotError) as caught:
        cache.restore(url)
    assert (cache.stats(), cache.observe().holders) == before, "a refused object changed the cache"
    message = str(caught.value)
    assert remote_io.redact(url) in message and SECRET not in message
    return caught.value


def test_every_truncation_of_a_stored_object_is_refused_by_name(s3):
    cache = Cache(SMALL, page_tokens=2)
    with filled(cache, 3) as ctx:
        ctx.snapshot(s3.url("damage/whole.kvs"))
    whole = s3.fs.cat(f"{s3.bucket}/damage/whole.kvs")
    assert len(whole) == 108
    keep = cache.restore(s3.url("damage/whole.kvs"))     # a live context, so "nothing changed" has something to keep
    for length in range(len(whole)):                      # every length, 0 to 107
        s3.fs.pipe(f"{s3.bucket}/damage/cut.kvs", whole[:length])
        error = _refusal(cache, s3.url("damage/cut.kvs"))
        assert isinstance(error, SnapshotTruncatedError), (length, error)
    assert not keep.closed and len(keep) == 3
    keep.close()


def test_every_flipped_byte_of_a_stored_object_is_refused_by_name(s3):
    cache = Cache(SMALL, page_tokens=2)
    with filled(cache, 3) as ctx:
        ctx.snapshot(s3.url("damage/whole2.kvs"))
    whole = s3.fs.cat(f"{s3.bucket}/damage/whole2.kvs")
    for offset in range(len(whole)):                      # every byte, each flipped in all 8 bits
        damaged = bytearray(whole)
        damaged[offset] ^= 0xFF
        s3.fs.pipe(f"{s3.bucket}/damage/flip.kvs", bytes(damaged))
        error = _refusal(cache, s3.url("damage/flip.kvs"))
        assert not isinstance(error, (SnapshotReadError, SnapshotNotFoundError)), (offset, error)


# -- atomic publication ---------------------------------------------------------------------

def _fail_after(patch, bytes_before: int, action):
    """Make the snapshot writer run ``action`` once it has produced ``bytes_before`` body bytes."""
    original, produced, fired = snapshot_write.body_chunks, [0], []

    def chunks(ctx):
        for chunk in original(ctx):
            yield chunk
            produced[0] += chunk.nbytes      # counted across calls: the writer may make two passes
            if produced[0] >= bytes_before and not fired:
                fired.append(True)
                action()
    patch.setattr(snapshot_write, "body_chunks", chunks)


def test_a_failed_upload_publishes_nothing_and_aborts_its_multipart_upload(s3, monkeypatch):
    cache = Cache(BIG, page_tokens=64)
    url = s3.url("atomic/injected.kvs")
    with filled(cache, 32, seed=5) as old:
        old.snapshot(url)
    old_bytes = s3.fs.cat(url.removeprefix("s3://"))
    client = s3.client()
    uploads_at_failure = []

    def fail():
        listed = client.list_multipart_uploads(Bucket=s3.bucket, Prefix="atomic/injected.kvs").get("Uploads", [])
        parts = [client.list_parts(Bucket=s3.bucket, Key=u["Key"], UploadId=u["UploadId"]).get("Parts", [])
                 for u in listed]
        uploads_at_failure.append(sum(len(p) for p in parts))
        raise RuntimeError("injected failure in the upload stream")

    with filled(cache, 2500, seed=6) as new:
        # the writer makes two passes on a stream it cannot seek (checksum, then bytes): fail in the second
        _fail_after(monkeypatch, new_bytes := 2 * 2500 * f32_bytes(BIG, 1) - (1 << 20), fail)
        with pytest.raises(SnapshotWriteError, match="injected failure") as caught:
            new.snapshot(url)
    assert new_bytes > remote_io.PART_BYTES
    assert uploads_at_failure and uploads_at_failure[0] >= 1, "no part was uploaded before the failure"
    assert s3.url("atomic/injected.kvs") in str(caught.value) and SECRET not in str(caught.value)
    assert s3.fs.cat(url.removeprefix("s3://")) == old_bytes
    assert client.list_multipart_uploads(Bucket=s3.bucket, Prefix="atomic/").get("Uploads", []) == []


class DyingProxy:
    """A TCP relay to the server that can die: it closes every connection and stops listening."""

    def __init__(self, upstream_port: int):
        self.upstream = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            with self.lock:
                self.sockets += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(source, sink):
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
        except OSError:
            pass

    def die(self):
        try:
            self.listener.shutdown(socket.SHUT_RDWR)     # wakes the accept(); close() alone would not
        except OSError:
            pass
        self.listener.close()
        with self.lock:
            for sock in self.sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()


def test_a_server_that_dies_mid_upload_leaves_the_old_object_intact(s3, monkeypatch):
    cache = Cache(BIG, page_tokens=64)
    key = "atomic/dying.kvs"
    with filled(cache, 32, seed=7) as old:
        old.snapshot(s3.url(key))
    old_bytes = s3.fs.cat(f"{s3.bucket}/{key}")
    proxy = DyingProxy(int(s3.endpoint.rsplit(":", 1)[1]))
    # botocore's own retries of a refused connection slept rand * 2**k s each (8 of this test's
    # 10 s): one botocore attempt here; our ATTEMPTS and s3fs's retries are what is tested
    via_proxy = dict(s3.options, endpoint_url=f"http://127.0.0.1:{proxy.port}",
                     config_kwargs={**s3.options["config_kwargs"], "retries": {"total_max_attempts": 1}})
    fsspec.filesystem("s3", **via_proxy).retries = 2     # the cached instance remote_io gets: s3fs's own retries, fewer
    monkeypatch.setattr(remote_io, "ATTEMPTS", 2)
    with filled(cache, 2500, seed=8) as new:
        _fail_after(monkeypatch, 2 * 2500 * f32_bytes(BIG, 1) - (1 << 20), proxy.die)
        with pytest.raises(SnapshotWriteError) as caught:
            remote_io.publish(s3.url(key), new.snapshot, storage_options=via_proxy)
    message = str(caught.value)
    assert "after 2 attempts" in message and "EndpointConnectionError" in message and SECRET not in message
    assert s3.fs.cat(f"{s3.bucket}/{key}") == old_bytes       # asked of the server directly: it never died
    before = cache.stats()
    with pytest.raises(SnapshotReadError, match=f"{s3.url(key)} failed after 2 attempts") as caught:
        remote_io.read(s3.url(key), cache.restore, storage_options=via_proxy)
    assert SECRET not in str(caught.value) and cache.stats() == before
    with cache.restore(s3.url(key)) as back:
        assert len(back) == 32


def test_concurrent_writers_of_one_key_leave_one_whole_object(s3):
    cache = Cache(BIG, page_tokens=64)
    url = s3.url("race/same.kvs")
    writers = [filled(cache, 2100, seed=10 + i) for i in range(3)]   # 8.6 MB each: multipart uploads
    expected = {bits(ctx)[0] for ctx in writers}
    start, seen, errors = threading.Barrier(len(writers) + 1), [], []

    def write(ctx):
        start.wait()
        ctx.snapshot(url)

    def read_while_writing():
        start.wait()
        for _ in range(6):
            try:
                with cache.restore(url) as back:
                    seen.append(bits(back)[0])
            except SnapshotNotFoundError:
                pass
            except SnapshotError as error:     # anything else would be a torn or spliced object
                errors.append(error)
    threads = [threading.Thread(target=write, args=(ctx,)) for ctx in writers]
    threads.append(threading.Thread(target=read_while_writing))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert all(value in expected for value in seen)
    with cache.restore(url) as final:
        assert bits(final)[0] in expected
    for ctx in writers:
        ctx.close()


def test_an_object_replaced_mid_read_is_read_again_whole_never_spliced(s3, monkeypatch):
    monkeypatch.setattr(remote_io, "READ_BLOCK_BYTES", 1 << 20)     # several ranged GETs per read
    key = f"{s3.bucket}/replaced/ctx.kvs"
    old, new = bytes(range(256)) * (3 << 12), bytes(reversed(range(256))) * (3 << 12)    # 3 MiB each
    s3.fs.pipe(key, old)
    attempts = []

    def parse(file):
        attempts.append(1)
        head = file.read(1 << 20)
        if len(attempts) == 1:
            s3.fs.pipe(key, new)          # another writer publishes between two ranged GETs
        return head + file.read()
    assert remote_io.read(f"s3://{key}", parse) == new
    assert len(attempts) == 2             # the first read failed on If-Match and started over


# -- retries and names ------------------------------------------------------------------------

def test_transient_failures_are_retried_a_bounded_number_of_times(monkeypatch):
    monkeypatch.setattr(remote_io, "BACKOFF_S", 0.001)
    cache = Cache(SMALL, page_tokens=2)
    url = f"memory://kvstate-test/{uuid.uuid4().hex}/retry.kvs"
    with filled(cache, 3) as ctx:
        calls = []

        def flaky(file):
            calls.append(1)
            if len(calls) < 3:
                raise ConnectionResetError("connection reset by peer")
            ctx.snapshot(file)
        remote_io.publish(url, flaky)
        assert len(calls) == 3
        with cache.restore(url) as back:
            assert bits(back) == bits(ctx)

        calls.clear()
        with pytest.raises(SnapshotReadError, match=f"after {remote_io.ATTEMPTS} attempts"):
            remote_io.read(url, lambda file: calls.append(1) or (_ for _ in ()).throw(TimeoutError("slow")))
        assert len(calls) == remote_io.ATTEMPTS

        calls.clear()
        with pytest.raises(SnapshotWriteError, match="PermissionError"):
            remote_io.publish(url, lambda file: calls.append(1) or (_ for _ in ()).throw(PermissionError("denied")))
        assert len(calls) == 1      # not transient: no retry
        with cache.restore(url) as back:
            assert bits(back) == bits(ctx)


def test_a_failed_memory_publication_leaves_no_object_and_no_temporary_key():
    folder = f"kvstate-test/{uuid.uuid4().hex}"
    with pytest.raises(SnapshotWriteError, match="ZeroDivisionError"):
        remote_io.publish(f"memory://{folder}/ctx.kvs", lambda file: file.write(b"part") and 1 / 0)
    assert fsspec.filesystem("memory").find(f"/{folder}") == []
    remote_io.publish(f"memory://{folder}/ctx.kvs", lambda file: file.write(b"whole"))
    assert fsspec.filesystem("memory").find(f"/{folder}") == [f"/{folder}/ctx.kvs"]


def test_without_fsspec_a_url_is_refused_by_name(monkeypatch):
    monkeypatch.setitem(sys.modules, "fsspec", None)     # import fsspec now raises ImportError
    cache = Cache(SMALL, page_tokens=2)
    with filled(cache, 3) as ctx:
        with pytest.raises(SnapshotWriteError, match=r"kvstate\[remote\]"):
            ctx.snapshot("s3://bucket/ctx.kvs")
    with pytest.raises(SnapshotReadError, match=r"s3://bucket/ctx.kvs.*kvstate\[remote\]"):
        cache.restore("s3://bucket/ctx.kvs")
    assert cache.stats()["live_contexts"] == 0


def test_messages_carry_no_credentials():
    assert remote_io.redact(f"s3://AKIA:{SECRET}@bucket/k.kvs?X-Amz-Signature={SECRET}") == "s3://bucket/k.kvs"
    error = ConnectionError(f"cannot reach https://user:{SECRET}@host/b/k?sig={SECRET}")
    with pytest.raises(SnapshotReadError) as caught:
        remote_io._retried(lambda: (_ for _ in ()).throw(error), f"s3://u:{SECRET}@b/k", "reading", SnapshotReadError)
    assert SECRET not in str(caught.value) and "s3://b/k" in str(caught.value)


# -- the store ------------------------------------------------------------------------------

from kvstate.remote import SnapshotStore, second_tier_match  # noqa: E402


def memory_store(**kwargs) -> SnapshotStore:
    return SnapshotStore(f"memory://kvstate-test/{uuid.uuid4().hex}", **kwargs)


def test_with_the_loggers_readme_names_kept_above_debug_no_log_record_carries_a_secret(s3, caplog):
    """From an audit: README's advice named only ``botocore``, yet s3fs's DEBUG log quotes every call's
    extra arguments, an SSE-C key among them (whoever holds it can read the objects)."""
    import base64
    import logging
    import re
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    advice = re.search(r"keep the ((?:`[\w.]+`(?:, | and )?)+) loggers? above DEBUG", readme)
    assert advice, "README's Trust paragraph names the loggers to keep above DEBUG"
    for name in re.findall(r"`([\w.]+)`", advice.group(1)):
        caplog.set_level(logging.INFO, logger=name)
    caplog.set_level(logging.DEBUG)       # last: each call sets the capturing handler's level too
    key = uuid.uuid4().hex                 # 32 bytes, as AES256 takes them
    sse_c = {"SSECustomerAlgorithm": "AES256", "SSECustomerKey": key}
    store = SnapshotStore(s3.url(f"sse-c/{uuid.uuid4().hex}"),
                          storage_options={**s3.options, "s3_additional_kwargs": sse_c})
    cache = Cache(SMALL, page_tokens=4)
    with filled(cache, 3) as ctx:
        assert store.put(ctx) == [3]
    logging.getLogger(__name__).debug("DEBUG is captured")       # else the check passes for the wrong reason
    assert "DEBUG is captured" in caplog.text
    for secret in (key, base64.b64encode(key.encode()).decode(), SECRET):
        assert secret not in caplog.text


def test_store_keys_are_content_addresses(s3):
    cache = Cache(BIG, page_tokens=16)
    store = SnapshotStore(s3.url("content"), stride=16, storage_options=s3.options)
    with filled(cache, 40, seed=1) as a, filled(cache, 40, seed=2) as b:
        assert store.put(a) == [40, 32]
        assert store.put(b) == []            # same tokens, same keys: already there
        assert store.url(cache, a.tokens) == store.url(Cache(BIG, page_tokens=64), b.tokens)
    other = Cache(BIG, page_tokens=16, precision="f16")
    assert store.url(other, list(range(40))) != store.url(cache, list(range(40)))


def test_store_get_finds_the_exact_and_the_stride_aligned_lengths(s3):
    cache = Cache(BIG, page_tokens=16)
    store = SnapshotStore(s3.url("aligned"), stride=16, storage_options=s3.options)
    with filled(cache, 40, seed=3) as ctx:
        store.put(ctx)
        tokens = ctx.tokens
        want = bits(ctx)
    longer = tokens + [7, 8, 9]
    for query, matched in ((tokens, 40), (longer, 32), (tokens[:35], 32), (tokens[:31], 0), ([1, 2, 3], 0)):
        got, n = store.get(cache, query)
        with got:
            assert n == matched == len(got)
            if n:
                assert bits(got)[1] == tokens[:n]
                assert bits(got)[0] == want[0][:n * f32_bytes(BIG, 1)]
    assert store.lookup(cache, longer) == 32 and store.lookup(cache, longer, longer_than=32) == 0


def test_store_get_is_match_one_tier_down():
    """With ``stride=1`` every length is a candidate: ``get`` must agree with ``Cache.match`` exactly."""
    rng = np.random.default_rng(11)
    store = memory_store(stride=1, probe_batch=4)
    remote, local = Cache(SMALL, page_tokens=2), Cache(SMALL, page_tokens=2, max_entries=1000)
    stored = []
    for _ in range(12):
        base = stored[rng.integers(len(stored))][:rng.integers(1, 6)] if stored and rng.random() < 0.6 else []
        tokens = list(base) + [int(t) for t in rng.integers(0, 4, rng.integers(1, 5))]
        with local.allocate() as ctx:
            seed = int.from_bytes(hashlib.sha256(bytes(tokens)).digest()[:4], "little")   # same tokens, same values
            ctx.extend(tokens, np.random.default_rng(seed).standard_normal(
                (len(tokens), *SMALL.position_shape)).astype(np.float32))
            local.retain(ctx)
            store.put(ctx)
        stored.append(tokens)
    for _ in range(40):
        query = [int(t) for t in rng.integers(0, 4, rng.integers(0, 10))]
        if stored and rng.random() < 0.7:
            query = stored[rng.integers(len(stored))][:rng.integers(0, 9)] + query[:rng.integers(0, 3)]
        (mine, n), (theirs, m) = store.get(remote, query), local.match(query)
        with mine, theirs:
            assert n == m, query
            assert bits(mine) == bits(theirs)


def test_the_cache_consults_its_second_tier_on_a_miss_and_a_short_hit_and_retains_what_it_restores():
    store = memory_store(stride=8)
    source = Cache(SMALL, page_tokens=4)
    with filled(source, 20, seed=4) as ctx:
        assert store.put(ctx) == [20, 16]
        tokens, want = ctx.tokens, bits(ctx)
    size = f32_bytes(SMALL, 1)
    cache = Cache(SMALL, page_tokens=4, second_tier=store)
    with filled(cache, 8, seed=4) as short:       # the first 8 positions, held locally: a short hit
        cache.retain(short)
    got, n = cache.match(tokens + [1, 2])          # candidates 22, 16, 8: the store's 16 beats the local 8
    with got:
        assert n == 16 and bits(got) == (want[0][:16 * size], tokens[:16])
    assert cache.stats()["entries"] == 2

    class Recorder:     # what the cache found by itself, before any second tier
        def __init__(self):
            self.local = []

        def consult(self, cache, tokens, found):
            self.local.append(found[1])
            return found
    cache.second_tier = recorder = Recorder()
    got, n = cache.match(tokens[:16] + [5])
    with got:
        assert n == 16 and bits(got) == (want[0][:16 * size], tokens[:16])
    assert recorder.local == [16]       # retained by the first match: a local hit now
    cache.second_tier = store
    got, n = cache.match(tokens)        # a short local hit (16) below an exact stored length (20)
    with got:
        assert n == 20 and bits(got) == want

    plain = Cache(SMALL, page_tokens=4)
    for query, matched in ((tokens[:12], 0), (tokens[:17], 16)):     # 8 is a candidate but was never stored
        got, n = second_tier_match(plain, store, query)
        with got:
            assert n == matched and bits(got)[1] == tokens[:matched]
    assert plain.stats()["entries"] == 1


PEER = textwrap.dedent("""
    import hashlib, json, sys
    import numpy as np
    from kvstate.impl import Cache
    from kvstate.model import GPT2, GPT2Config
    from kvstate.remote import SnapshotStore
    args = json.loads(sys.argv[1])
    config = GPT2Config.tiny()
    model = GPT2.random(config, seed=5)
    store = SnapshotStore(args["prefix"], stride=16, storage_options=args["options"])
    cache = Cache(config.layout, page_tokens=8, precision=args["precision"], second_tier=store)
    with cache.allocate() as ctx:
        model.prefill(ctx, args["put"])
        written = store.put(ctx)
    ctx, matched = cache.match(args["get"])
    with ctx:
        logits = model.decode(ctx, 3)
        values, _ = ctx.read()
    print(json.dumps({"written": written, "matched": matched,
                      "values": hashlib.sha256(values.tobytes()).hexdigest(),
                      "logits": hashlib.sha256(np.asarray(logits).tobytes()).hexdigest()}))
""")


@pytest.mark.parametrize("precision", ["f32", "q8"])
def test_two_caches_in_two_processes_share_one_store(s3, precision):
    config = GPT2Config.tiny()
    model = GPT2.random(config, seed=5)
    rng = np.random.default_rng(6)
    mine = [int(t) for t in rng.integers(0, config.vocab_size, 40)]
    theirs = [int(t) for t in rng.integers(0, config.vocab_size, 35)]
    prefix = s3.url(f"fleet-{precision}")
    store = SnapshotStore(prefix, stride=16, storage_options=s3.options)
    cache = Cache(config.layout, page_tokens=8, precision=precision, second_tier=store)

    def state(tokens, n):
        """Values and next-token logits of ``tokens`` prefilled here and cut to ``n``, as digests.

        (Cut, not prefilled at ``n``: a longer prefill's matrix products may round differently.)
        """
        with cache.allocate() as ctx:
            model.prefill(ctx, tokens)
            ctx.truncate(n)
            logits, (values, _) = model.decode(ctx, 3), ctx.read()
        return hashlib.sha256(values.tobytes()).hexdigest(), hashlib.sha256(np.asarray(logits).tobytes()).hexdigest()

    with cache.allocate() as ctx:
        model.prefill(ctx, mine)
        assert store.put(ctx) == [40, 32]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    args = {"prefix": prefix, "options": s3.options, "precision": precision, "put": theirs, "get": mine + [1, 2]}
    done = subprocess.run([sys.executable, "-c", PEER, json.dumps(args)], env=env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    peer = json.loads(done.stdout.strip().splitlines()[-1])
    assert peer["written"] == [35, 32] and peer["matched"] == 32
    assert (peer["values"], peer["logits"]) == state(mine, 32)      # restored there, prefilled here: identical

    got, matched = cache.match(theirs + [4])                          # what the other process put
    with got:
        assert matched == 32
        logits, (values, _) = model.decode(got, 3), got.read()
    assert (hashlib.sha256(values.tobytes()).hexdigest(),
            hashlib.sha256(np.asarray(logits).tobytes()).hexdigest()) == state(theirs, 32)


# -- issue 24: exact keys on S3 -------------------------------------------------------------------

def test_s3_publication_lands_at_the_exact_key_for_every_character_class(s3):
    from test_remote_hardening import AWKWARD_NAMES
    cache = Cache(SMALL, page_tokens=2)
    folder = f"awkward-{uuid.uuid4().hex[:8]}"
    for index, name in enumerate(AWKWARD_NAMES):
        with filled(cache, 3, seed=index) as old, filled(cache, 5, seed=index + 50) as new:
            old.snapshot(s3.url(f"{folder}/{name}"))
            new.snapshot(s3.url(f"{folder}/{name}"))
            with cache.restore(s3.url(f"{folder}/{name}")) as back:
                assert bits(back) == bits(new)
    keys = [item["Key"] for item in s3.client().list_objects_v2(Bucket=s3.bucket, Prefix=folder + "/")["Contents"]]
    assert sorted(keys) == sorted(f"{folder}/{name}" for name in AWKWARD_NAMES)


# -- found by an audit: an object gone mid-read, put's lookup, file:// stores, scheme-only prefixes ---

def test_an_object_removed_after_the_read_opened_it_is_a_miss_and_the_shorter_prefix_serves(s3, monkeypatch):
    store = SnapshotStore(f"s3://{s3.bucket}/gone-{uuid.uuid4().hex}", stride=4)
    cache = Cache(SMALL, page_tokens=2)
    for n in (8, 4):
        with filled(cache, n) as ctx:
            store.put(ctx)
    tokens = list(range(8))
    longest = store.url(cache, tokens).removeprefix("s3://")
    opened = remote_io.open_read

    @contextlib.contextmanager
    def open_then_expire(url, options=None, worker=None):
        with opened(url, options, worker) as file:
            if url.endswith(longest) and s3.fs.exists(longest):
                s3.fs.rm(longest)          # a lifecycle rule, between the open and the first read
            yield file
    monkeypatch.setattr(remote_io, "open_read", open_then_expire)
    got, n = store.get(cache, tokens)
    assert n == 4 and list(got.tokens) == tokens[:4]
    got.close()
    with filled(cache, 8) as ctx:
        store.put(ctx)
    with pytest.raises(SnapshotNotFoundError, match="went while it was read"):
        cache.restore(f"s3://{longest}")
    cache.clear()
    assert cache.observe().pages == {}


def test_a_put_that_cannot_look_up_its_key_is_a_write_error():
    store = SnapshotStore("s3://bucket/kv", storage_options={"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}},
                          deadline_s=30)
    cache = Cache(SMALL, page_tokens=2)
    with filled(cache, 4) as ctx, pytest.raises(SnapshotWriteError, match="put: looking up"):
        store.put(ctx)


def test_a_file_store_makes_its_folders_and_publishes_by_rename(tmp_path, monkeypatch):
    store = SnapshotStore(f"file://{tmp_path}/new/kv")
    cache = Cache(SMALL, page_tokens=2)
    renamed = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (renamed.append(b), real_replace(a, b))[1])
    with filled(cache, 5) as ctx:
        assert store.put(ctx) == [5]
        want = bits(ctx)
    assert renamed and all(name.endswith(".kvs") for name in renamed)      # never a copy in place
    got, n = store.get(cache, list(range(5)))
    assert n == 5 and bits(got) == want
    got.close()


def test_a_store_travels_to_worker_processes_by_pickle(tmp_path):
    """A fleet hands its store to a process pool or Dask workers: its lock made that a TypeError."""
    import pickle

    from kvstate.spec.errors import SecondTierWarning
    store = SnapshotStore(f"file://{tmp_path}/kv", stride=4, deadline_s=7)
    cache = Cache(SMALL, page_tokens=2)
    with filled(cache, 5) as ctx:
        store.put(ctx)
        want = bits(ctx)
    copy = pickle.loads(pickle.dumps(store))
    assert (copy.url_prefix, copy.stride, copy.deadline_s) == (store.url_prefix, 4, 7)
    got, n = copy.get(cache, list(range(5)))
    with got:
        assert n == 5 and bits(got) == want
    with pytest.warns(SecondTierWarning):
        copy._failed(SnapshotError("counted in the copy's own books"), stacklevel=2)     # its lock works
    assert (copy.failures, store.failures) == (1, 0)


# fsspec's blocking open of a FIFO at a file:// store's key waited out every get's and match's deadline,
# in a thread stuck for good; 16 of those refused every file:// store in the process (the stuck-call cap).
def test_a_fifo_at_a_file_stores_key_is_refused_at_once_and_leaves_no_call_waiting(tmp_path):
    from kvstate.impl import remote_deadline
    from kvstate.spec.errors import SecondTierWarning
    store = SnapshotStore(f"file://{tmp_path}/kv", stride=4, deadline_s=2)
    cache = Cache(SMALL, page_tokens=2)
    key = store.url(cache, [1, 2, 3]).removeprefix("file://")
    os.makedirs(os.path.dirname(key))
    os.mkfifo(key)
    stuck, started = remote_deadline.stuck_calls(), time.monotonic()
    with pytest.raises(SnapshotError, match=r"not a regular file \(a FIFO\)"):
        store.get(cache, [1, 2, 3])
    tiered = Cache(SMALL, page_tokens=2, second_tier=store)
    with pytest.warns(SecondTierWarning, match="a FIFO"):
        hit, n = tiered.match([1, 2, 3])
    hit.close()
    assert n == 0 and store.failures == 1
    assert time.monotonic() - started < 1.5, "waited for the deadline"
    assert remote_deadline.stuck_calls() == stuck


@pytest.mark.parametrize("prefix", ["memory://", "s3://", "s3:///", "file://"])
def test_a_prefix_that_names_no_bucket_or_folder_is_refused(prefix):
    with pytest.raises(InvalidInputError, match="naming a bucket or folder"):
        SnapshotStore(prefix)


def test_a_bucket_that_does_not_exist_is_a_read_error_and_a_counted_tier_failure_not_a_miss(s3):
    """From an audit as an inference fleet: with a typo in the tier's bucket every lookup was a silent
    miss (no failure counted, no warning), and a restore SnapshotNotFoundError, read as "start fresh"."""
    from kvstate.spec.errors import SecondTierWarning
    missing = f"{s3.bucket}-missing"
    cache = Cache(SMALL, page_tokens=4)
    with pytest.raises(SnapshotReadError, match="bucket does not exist") as caught:
        cache.restore(f"s3://{missing}/x.kvs")
    assert not isinstance(caught.value, SnapshotNotFoundError)
    store = SnapshotStore(f"s3://{missing}/kv", stride=4, storage_options=s3.options)
    tiered = Cache(SMALL, page_tokens=4, second_tier=store)
    with pytest.warns(SecondTierWarning, match="bucket does not exist"):
        got, n = tiered.match(list(range(10)))
    got.close()
    assert n == 0 and store.failures == 1


def test_a_key_that_names_a_folder_is_no_snapshot_not_a_damaged_one(s3):
    """From an audit: restoring ``s3://b/sessions``, where keys begin with ``sessions/``, said the file ended
    inside its header (a damaged snapshot), where a runtime treats "not found" as "start fresh"."""
    cache = Cache(BIG, page_tokens=16)
    with filled(cache, 5, seed=3) as ctx:
        ctx.snapshot(s3.url("sessions/one.kvs"))
    s3.fs.pipe(f"{s3.bucket}/markers/", b"")          # a console's folder marker
    for name in ("sessions", "markers"):
        with pytest.raises(SnapshotNotFoundError, match="folder|no snapshot"):
            cache.restore(s3.url(name))
    assert cache.stats()["live_pages"] == 0


# -- writes that may still land, by every spelling of their object ---------------------------------

def _hold_first_publish(monkeypatch) -> threading.Event:
    """The next publication's one PUT is held by the "server" until the returned event is set, then sent
    for real to moto (it lands late); every later publication goes straight through."""
    released = threading.Event()
    real_filesystem = remote_io._filesystem
    first = [True]

    class HeldPut:
        def __init__(self, fs):
            self.fs = fs

        def __getattr__(self, name):     # protocol, storage_options, split_path ...: the real s3fs's
            return getattr(self.fs, name)

        def open(self, path, mode, **kwargs):
            file = self.fs.open(path, mode, **kwargs)
            close = file.close

            def held_close():
                released.wait(20)
                close()
            file.close = held_close
            return file

    def filesystem(url, options, error):
        fs, path = real_filesystem(url, options, error)
        return (HeldPut(fs) if first and first.pop() else fs), path
    monkeypatch.setattr(remote_io, "_filesystem", filesystem)
    return released


def test_a_write_that_may_still_land_holds_back_every_spelling_of_its_object(s3, monkeypatch):
    """From a review: writes that may still land were held back by their URL string, so the same object
    named another way (``s3a://``, which fsspec serves with the same S3 filesystem, or ``s3:///bucket/key``)
    was written at once, and the late landing then replaced that newer snapshot with the older one.
    ``s3://bucket//key`` is another object (the key ``/key``) and is not held back."""
    from kvstate.spec.errors import SnapshotDeadlineError
    key = f"landing/{uuid.uuid4().hex}.kvs"
    cache = Cache(SMALL, page_tokens=4)
    released = _hold_first_publish(monkeypatch)
    try:
        with filled(cache, 3, seed=1) as old, filled(cache, 5, seed=2) as new:
            with pytest.raises(SnapshotDeadlineError, match="may still complete"):
                old.snapshot(f"s3a://{s3.bucket}/{key}", deadline_s=0.8)   # the PUT is held past it
            for alias in (f"s3://{s3.bucket}/{key}", f"s3:///{s3.bucket}/{key}", f"s3a://{s3.bucket}/{key}"):
                with pytest.raises(SnapshotWriteError, match="may still land"):
                    new.snapshot(alias)
            # from an audit: the same server by an IPv4-mapped or an uncompressed IPv6 loopback address
            port = s3.endpoint.rpartition(":")[2]
            for endpoint in (f"http://[::ffff:127.0.0.1]:{port}", f"http://[0:0:0:0:0:0:0:1]:{port}"):
                monkeypatch.setitem(fsspec.config.conf, "s3", {**s3.options, "endpoint_url": endpoint})
                with pytest.raises(SnapshotWriteError, match="may still land"):
                    new.snapshot(s3.url(key))
            monkeypatch.setitem(fsspec.config.conf, "s3", s3.options)
            s3.fs.invalidate_cache()
            assert not s3.fs.exists(f"{s3.bucket}/{key}")          # nothing was sent
            new.snapshot(f"s3://{s3.bucket}//{key}")              # another object: written at once
            assert s3.fs.exists(f"{s3.bucket}//{key}")
            released.set()                                         # the server answers the old PUT: it lands
            give_up = time.monotonic() + 10
            while True:
                try:
                    new.snapshot(s3.url(key))
                    break
                except SnapshotWriteError:
                    assert time.monotonic() < give_up, "still held back after the old call returned"
                    time.sleep(0.01)
            with cache.restore(f"s3a://{s3.bucket}/{key}") as back:
                assert bits(back) == bits(new)
    finally:
        released.set()


# -- put mends a damaged object, and leaves an intact one --------------------------------------------

def test_put_writes_again_over_a_damaged_object_of_the_right_size_and_never_over_an_intact_one(s3):
    """``put`` judged a key by its object's size: bytes damaged in place (a flipped bit at rest, a bad
    copy) were never mended, and every ``get`` reaching them fell back to a shorter prefix and counted a
    failure. The bucket keeps versions, so every PUT the server took is counted there."""
    client = s3.client()
    bucket = f"kvstate-mend-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    store = SnapshotStore(f"s3://{bucket}/kv", stride=4, storage_options=s3.options)
    cache = Cache(SMALL, page_tokens=4)

    def versions(length: int) -> int:
        key = store.url(cache, tokens[:length]).removeprefix(f"s3://{bucket}/")
        listed = client.list_object_versions(Bucket=bucket, Prefix=key).get("Versions", [])
        return sum(1 for version in listed if version["Key"] == key)

    with filled(cache, 6, seed=5) as ctx:
        tokens = list(ctx.tokens)
        want = bits(ctx)
        assert store.put(ctx) == [6, 4]
        assert store.put(ctx) == [] and (versions(6), versions(4)) == (1, 1)     # intact: not written again
        path = store.url(cache, tokens).removeprefix("s3://")
        good = s3.fs.cat(path)
        for offset in (20, len(good) - 3):                       # a header field, a value in the body
            damaged = bytearray(good)
            damaged[offset] ^= 0x10
            s3.fs.pipe(path, bytes(damaged))                      # same size, other bytes
            assert store.put(ctx) == [6]                          # the aligned copy is intact: left alone
            assert s3.fs.cat(path) == good
        assert (versions(6), versions(4)) == (5, 1)               # first put, 2 damages, 2 mends
        assert store.put(ctx) == [] and versions(6) == 5
    got, n = store.get(cache, tokens)
    with got:
        assert n == 6 and bits(got) == want
    assert store.failures == 0


def test_a_damaged_object_on_s3_is_read_once_while_its_etag_stands(s3, monkeypatch):
    """The second tier remembers a damaged object by its size and ETag (the lookup's HEAD): on a real S3 server
    the next match reads nothing; a rewrite (another ETag) is read again and served."""
    from kvstate.spec.errors import SecondTierWarning
    store = SnapshotStore(s3.url(f"damaged/{uuid.uuid4().hex}"), stride=4, storage_options=s3.options)
    cache = Cache(SMALL, page_tokens=2, second_tier=store)
    with filled(Cache(SMALL, page_tokens=2), 4) as ctx:
        store.put(ctx)
        query = ctx.tokens + [9]
    path = store.url(cache, query[:4]).partition("://")[2]
    good = s3.fs.cat_file(path)
    s3.fs.pipe_file(path, good[:-1] + bytes([good[-1] ^ 1]))
    reads = []
    real = remote_io.read
    monkeypatch.setattr(remote_io, "read", lambda *args, **kwargs: (reads.append(args[0]), real(*args, **kwargs))[1])
    for _ in range(2):
        with pytest.warns(SecondTierWarning, match="SnapshotCorruptError"):
            got, n = cache.match(query)
        got.close()
        assert n == 0 and len(reads) == 1
    s3.fs.pipe_file(path, good)
    got, n = cache.match(query)
    got.close()
    assert n == 4 and len(reads) == 2
