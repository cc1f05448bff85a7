"""Restore vs re-prefill, and restore vs reading the same bytes, GPT-2-small shape (12 layers, 12 heads, 768 wide, f32, CPU).

    kvstate bench restore [--quick] [--full]      (or: python -m kvstate.bench.restore [--no-prefill] [--full])

Prefill rows: both ends hold the same K/V state, ready for the next token. The
denominator is the faster of two prefills measured in the same run: our NumPy
forward pass and HF transformers' ``GPT2LMHeadModel`` (when installed).

I/O rows, every contender timed in turn, round after round (best of N each, so a
burst of load elsewhere hits them alike), warm (file in the page cache) and cold
(the file's pages dropped with ``posix_fadvise(DONTNEED)`` before each read):

- ``restore``: ``cache.restore(path)``, then the context closed;
- ``raw``: ``readinto`` of the snapshot file's bytes into a fresh buffer, nothing else: the ceiling;
- ``torch``: ``torch.load`` of the same tokens and K/V as tensors (when torch is installed);
- ``write``: ``ctx.snapshot(path)`` (temp file, fsync, rename, folder fsync) against writing the
  same byte count to a file and fsyncing it.

Ratios are of times measured in the same run; targets: restore <= 1.3x raw (warm, >= 512 tokens),
<= 1.3x torch.load, write <= 1.2x raw write+fsync.
"""

from __future__ import annotations

import argparse
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


def run(quick: bool = False, full: bool = False, threads: int | None = None, prefill: bool = True,
        repeat: int | None = None) -> dict:
    lengths = [128, 512] if quick else [128, 512, 2048] + ([8192] if full else [])
    threads = threads or os.cpu_count()
    config = GPT2Config.small(n_positions=max(lengths))
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        if prefill:
            model = GPT2.random(config)
            hf_prefill = hf_prefill_timer(config, threads)
        rng = np.random.default_rng(0)
        for n in lengths:
            tokens = rng.integers(0, config.vocab_size, n)
            cache = Cache(config.layout, page_tokens=64)
            row = {"tokens": n}
            if prefill:
                prefill_repeat = 1 if n >= 2048 else 2

                def ours():
                    with cache.allocate() as ctx:
                        model.prefill(ctx, tokens)
                row["ours_prefill_s"] = best_of(ours, prefill_repeat)
                if hf_prefill is not None:
                    row["hf_prefill_s"] = best_of(lambda: hf_prefill(tokens), prefill_repeat)
                row["prefill_s"] = min(v for k, v in row.items() if k.endswith("prefill_s"))
            values = np.random.default_rng(n).standard_normal(config.layout.batch_shape(n), dtype=np.float32)
            row.update(io_times(cache, tokens, values, Path(folder), repeat or (3 if quick else 5)))
            if prefill:
                row["warm_speedup"] = row["prefill_s"] / row["restore_warm_s"]
                if row.get("restore_cold_s"):
                    row["cold_speedup"] = row["prefill_s"] / row["restore_cold_s"]
            rows.append(row)
    return {"name": "restore_vs_prefill",
            "params": {"shape": "GPT-2 small f32", "threads": threads, "prefill": prefill,
                       "hf": prefill and hf_prefill is not None},
            "rows": rows,
            "targets": {"warm_speedup_at_512": 100, "restore_over_raw_warm": 1.3, "restore_over_torch_warm": 1.3,
                        "write_over_raw_fsync": 1.2}}


def io_times(cache: Cache, tokens: np.ndarray, values: np.ndarray, folder: Path, repeat: int) -> dict:
    """Restore, raw read and torch.load of one context's bytes, warm and cold, and the snapshot
    write against a raw write+fsync: every contender once per round, best of ``repeat`` rounds."""
    n = len(tokens)
    path, raw_out, written = folder / f"ctx{n}.kvs", folder / f"raw{n}.bin", folder / f"out{n}.kvs"
    ctx = cache.allocate()
    ctx.extend(tokens, values)
    ctx.snapshot(path)
    size = path.stat().st_size
    payload = np.frombuffer(path.read_bytes(), np.uint8).copy()

    def restore():
        cache.restore(path).close()

    def raw_read():
        buffer = np.empty(size, np.uint8)
        with open(path, "rb", buffering=0) as file:
            file.readinto(buffer)

    def write():
        ctx.snapshot(written)

    def raw_write():
        with open(raw_out, "wb", buffering=0) as file:
            file.write(payload)
            os.fsync(file.fileno())

    contenders = {"restore": restore, "raw_read": raw_read}
    torch_path = _torch_file(folder / f"ctx{n}.pt", tokens, values)
    if torch_path is not None:
        import torch

        contenders["torch_load"] = lambda: torch.load(torch_path)
    best: dict[str, float] = {}
    can_drop = drop_from_page_cache(path) and (torch_path is None or drop_from_page_cache(torch_path))
    for _ in range(repeat):
        for name, action in contenders.items():
            _time_into(best, f"{name}_warm_s", action)
            if can_drop:
                drop_from_page_cache(torch_path if name == "torch_load" else path)
                _time_into(best, f"{name}_cold_s", action)
                action()        # warm again for the next warm timing
        _time_into(best, "write_s", write)
        _time_into(best, "raw_write_fsync_s", raw_write)
    ctx.close()
    row = {"snapshot_bytes": size, **best}
    for mode in ("warm", "cold"):
        if f"restore_{mode}_s" in best:
            row[f"restore_over_raw_{mode}"] = best[f"restore_{mode}_s"] / best[f"raw_read_{mode}_s"]
            if f"torch_load_{mode}_s" in best:
                row[f"restore_over_torch_{mode}"] = best[f"restore_{mode}_s"] / best[f"torch_load_{mode}_s"]
    row["write_over_raw_fsync"] = best["write_s"] / best["raw_write_fsync_s"]
    for leftover in (path, raw_out, written, torch_path):
        if leftover is not None:
            leftover.unlink(missing_ok=True)
    return row


def _time_into(best: dict, key: str, action) -> None:
    start = time.perf_counter()
    action()
    best[key] = min(best.get(key, float("inf")), time.perf_counter() - start)


def _torch_file(path: Path, tokens: np.ndarray, values: np.ndarray) -> Path | None:
    """The same tokens and K/V as torch tensors in a ``torch.save`` file, or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    torch.save({"tokens": torch.from_numpy(tokens.astype(np.int32)), "values": torch.from_numpy(values)}, path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstate.bench.restore", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="128 and 512 tokens only")
    parser.add_argument("--full", action="store_true", help="add 8,192 tokens")
    parser.add_argument("--no-prefill", action="store_true", help="the I/O rows only (no model, much faster)")
    parser.add_argument("--repeat", type=int, default=None, help="rounds; each figure is the best of them")
    args = parser.parse_args(argv)
    from .run import format_result

    print(format_result(run(quick=args.quick, full=args.full, prefill=not args.no_prefill, repeat=args.repeat)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
