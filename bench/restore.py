"""Restore vs re-prefill, GPT-2-small shape (12 layers, 12 heads, 768 wide, f32, CPU).

Both end in the same K/V state, ready for the next token. The denominator is
the faster of two prefills measured in the same run: our NumPy forward pass
and HF transformers' ``GPT2LMHeadModel`` (when installed). Restore is timed
warm (file in the page cache) and cold (the file's pages dropped with
``posix_fadvise(DONTNEED)``, where the OS allows) once ``ctx.snapshot`` and
``cache.restore`` exist in this build; until then the prefills are reported
beside the ceiling for any restore: reading the same K/V bytes from a warm file.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np

from kvstate.impl import Cache
from kvstate.model import GPT2, GPT2Config

from .timing import best_of


def drop_from_page_cache(path: Path) -> bool:
    """Ask the OS to forget the file's cached pages; False where it cannot be asked."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    finally:
        os.close(fd)


def hf_prefill_timer(config: GPT2Config, threads: int):
    """A function timing HF's prefill of n tokens, or None without transformers."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    torch.set_num_threads(threads)
    hf_config = transformers.GPT2Config(vocab_size=config.vocab_size, n_positions=config.n_positions,
                                        n_embd=config.n_embd, n_layer=config.n_layer, n_head=config.n_head)
    hf = transformers.GPT2LMHeadModel(hf_config).eval()

    def prefill(tokens: np.ndarray) -> None:
        with torch.no_grad():
            hf(torch.from_numpy(tokens[None]), use_cache=True)
    return prefill


def run(quick: bool = False, full: bool = False, threads: int | None = None) -> dict:
    lengths = [128, 512] if quick else [128, 512, 2048] + ([8192] if full else [])
    threads = threads or os.cpu_count()
    config = GPT2Config.small(n_positions=max(lengths))
    model = GPT2.random(config)
    hf_prefill = hf_prefill_timer(config, threads)
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
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
            row.update(_read_bytes_time(cache, model, tokens, Path(folder) / f"raw{n}.bin"))
            row["read_bytes_speedup"] = row["prefill_s"] / row["read_bytes_s"]
            row.update(_restore_times(cache, model, tokens, Path(folder) / f"ctx{n}.kvs"))
            row["warm_speedup"] = row["prefill_s"] / row["restore_warm_s"]
            if row.get("restore_cold_s"):
                row["cold_speedup"] = row["prefill_s"] / row["restore_cold_s"]
            rows.append(row)
    return {"name": "restore_vs_prefill",
            "params": {"shape": "GPT-2 small f32", "threads": threads,
                       "hf": hf_prefill is not None},
            "rows": rows, "targets": {"warm_speedup_at_512": 100}}


def _read_bytes_time(cache: Cache, model: GPT2, tokens: np.ndarray, path: Path) -> dict:
    """The ceiling for any restore: reading the context's K/V bytes back from a warm file, nothing else."""
    with cache.allocate() as ctx:
        model.prefill(ctx, tokens)
        values, _ = ctx.read()
    values.tofile(path)
    return {"read_bytes_s": best_of(lambda: np.fromfile(path, np.float32), 3), "kv_bytes": values.nbytes}


def _restore_times(cache: Cache, model: GPT2, tokens: np.ndarray, path: Path) -> dict:
    with cache.allocate() as ctx:
        model.prefill(ctx, tokens)
        ctx.snapshot(path)

    def restore():
        cache.restore(path).close()
    times = {"restore_warm_s": best_of(restore, 3), "snapshot_bytes": path.stat().st_size}
    cold = []
    for _ in range(3):
        if not drop_from_page_cache(path):
            break
        start = time.perf_counter()
        restore()
        cold.append(time.perf_counter() - start)
    times["restore_cold_s"] = min(cold) if cold else None
    return times
