"""Restore from object storage vs from a local file vs re-prefill, GPT-2-small shape (f32, CPU).

One run, per context length (512 and 2,048 tokens): the same context is
snapshotted to a local file and to an S3-API server on 127.0.0.1 (moto's
standalone server, started here as a subprocess and stopped at the end), then
restored from each, and compared with computing it again (our NumPy prefill, and
HF's when transformers is installed: the faster one is the denominator, as in
``bench/restore.py``). Bytes moved per token are the object's bytes over its
positions: what a restore downloads and a snapshot uploads. The client's peak
Python/NumPy allocation during an upload and a restore (tracemalloc) shows
that neither buffers the object an extra time.

    python -m kvstate.bench.remote_restore [--quick]

Needs ``kvstate[remote]`` and ``moto[server]``. The local server has no network
latency or bandwidth limit: remote figures are a floor for a real bucket, where
time per byte is set by the link (bytes per token times tokens over bandwidth).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import tracemalloc
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

from kvstate.impl import Cache
from kvstate.model import GPT2, GPT2Config

from .args import positive_int
from .restore import hf_prefill_timer
from .timing import best_of


# -- a local S3-API server -----------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def local_s3_server(start_timeout_s: float = 60.0) -> Iterator[str]:
    """moto's S3-API server in a subprocess on 127.0.0.1 and a free port; yields its endpoint URL."""
    for _ in range(3):      # the free port can be taken between the probe and the server's bind
        port = _free_port()
        server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + start_timeout_s
        while server.poll() is None and time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        if server.poll() is None and time.monotonic() < deadline:
            try:
                yield f"http://127.0.0.1:{port}"
            finally:
                server.terminate()
                try:
                    server.wait(10)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait()
            return
        if server.poll() is None:
            server.kill()
        server.wait()
    raise RuntimeError("moto's server did not start on 127.0.0.1 (pip install 'moto[server]')")


def s3_options(endpoint: str) -> dict:
    """Storage options for the local server: dummy credentials, nothing else contacted."""
    return dict(endpoint_url=endpoint, key="bench", secret="bench-not-a-secret")


# -- the benchmark ---------------------------------------------------------------------------------

def run(quick: bool = False, threads: int | None = None) -> dict:
    import fsspec

    lengths = [128, 512] if quick else [512, 2048]
    threads = threads or os.cpu_count()
    config = GPT2Config.small(n_positions=max(lengths))
    model = GPT2.random(config)
    hf_prefill = hf_prefill_timer(config, threads)
    rng = np.random.default_rng(0)
    rows = []
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(name, "bench")
    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    with local_s3_server() as endpoint, tempfile.TemporaryDirectory() as folder:
        options = s3_options(endpoint)
        fsspec.config.conf["s3"] = options       # ctx.snapshot(url) / cache.restore(url) take no options
        bucket = f"bench-{uuid.uuid4().hex[:8]}"
        fsspec.filesystem("s3", **options).mkdir(bucket)
        for n in lengths:
            tokens = rng.integers(0, config.vocab_size, n)
            repeat = 1 if n >= 2048 else 2
            cache = Cache(config.layout, page_tokens=64)

            def ours():
                with cache.allocate() as ctx:
                    model.prefill(ctx, tokens)
            row = {"tokens": n, "ours_prefill_s": best_of(ours, repeat)}
            if hf_prefill is not None:
                row["hf_prefill_s"] = best_of(lambda: hf_prefill(tokens), repeat)
            row["prefill_s"] = min(v for k, v in row.items() if k.endswith("prefill_s"))
            row.update(_transfer(cache, model, tokens, Path(folder) / f"ctx{n}.kvs", f"s3://{bucket}/ctx{n}.kvs"))
            row["file_speedup"] = row["prefill_s"] / row["file_restore_s"]
            row["s3_speedup"] = row["prefill_s"] / row["s3_restore_s"]
            row["s3_over_file"] = row["s3_restore_s"] / row["file_restore_s"]
            rows.append(row)
    return {"name": "remote_restore",
            "params": {"shape": "GPT-2 small f32", "threads": threads, "hf": hf_prefill is not None,
                       "server": "moto (subprocess, 127.0.0.1)"},
            "rows": rows}


def _transfer(cache: Cache, model: GPT2, tokens: np.ndarray, path: Path, url: str) -> dict:
    with cache.allocate() as ctx:
        model.prefill(ctx, tokens)
        file_write = best_of(lambda: ctx.snapshot(path), 2)
        s3_write = best_of(lambda: ctx.snapshot(url), 2)
        write_peak = _peak(lambda: ctx.snapshot(url))
    size = path.stat().st_size
    restore_peak = _peak(lambda: cache.restore(url).close())
    return {"snapshot_bytes": size, "bytes_per_token": size / len(tokens),
            "file_snapshot_s": file_write, "s3_snapshot_s": s3_write,
            "file_restore_s": best_of(lambda: cache.restore(path).close(), 3),
            "s3_restore_s": best_of(lambda: cache.restore(url).close(), 3),
            "s3_snapshot_peak_bytes": write_peak, "s3_restore_peak_bytes": restore_peak}


def _peak(fn) -> int:
    """Peak bytes allocated (Python and NumPy, every thread) while ``fn`` runs, above where it started."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def report(result: dict) -> str:
    mb = 1 << 20
    params = result["params"]
    lines = [f"restore from a local S3-API server vs a local file vs re-prefill ({params['shape']}, "
             f"{params['threads']} threads, prefill: {'min(ours, HF)' if params['hf'] else 'ours'})",
             f"{'tokens':>6} {'MB':>7} {'B/token':>8} {'prefill s':>9} {'file s':>8} {'s3 s':>8} "
             f"{'prefill/file':>12} {'prefill/s3':>10} {'s3/file':>7} {'up s':>7} {'up peak MB':>10} "
             f"{'down peak MB':>12}"]
    for row in result["rows"]:
        lines.append(f"{row['tokens']:>6} {row['snapshot_bytes'] / mb:>7.1f} {row['bytes_per_token']:>8.0f} "
                     f"{row['prefill_s']:>9.3f} {row['file_restore_s']:>8.4f} {row['s3_restore_s']:>8.4f} "
                     f"{row['file_speedup']:>11.1f}x {row['s3_speedup']:>9.1f}x {row['s3_over_file']:>6.1f}x "
                     f"{row['s3_snapshot_s']:>7.3f} {row['s3_snapshot_peak_bytes'] / mb:>10.1f} "
                     f"{row['s3_restore_peak_bytes'] / mb:>12.1f}")
    lines.append("up/down peak: client allocations during ctx.snapshot(url) / cache.restore(url); a restore "
                 "holds the body it checks and the pages it fills (about 2x the object), an upload a few "
                 "parts of remote_io.PART_BYTES whatever the object's size.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstate.bench.remote_restore", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="128 and 512 tokens instead of 512 and 2,048")
    parser.add_argument("--threads", type=positive_int, default=None, help="HF/torch threads (default: all cores)")
    args = parser.parse_args(argv)
    print(report(run(quick=args.quick, threads=args.threads)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
