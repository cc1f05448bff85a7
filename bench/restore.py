"""Restore vs re-prefill, and restore vs reading the same bytes, GPT-2-small shape (12 layers, 12 heads, 768 wide, f32, CPU).

    kvstate bench restore [--quick] [--full] [--threads N]
    python -m kvstate.bench.restore [--no-prefill] [--full] [--tokens 512 2048] [--threads 1,2] [--repeat 5]

``--threads`` sets BLAS and torch threads and the snapshot pipelines' own threads
(``impl/snapshot_tuning.py`` ``IO_THREADS``: 1 runs the restore and the write inline; 2 or more leaves
it to the default, ``pipelined``, which adds their worker thread for bodies of 32 MiB or more,
or with ``--worker always`` adds it at every size), so the 1-thread rows show what the pipeline
buys, and ``--tokens 16 128 256 --threads 1,2 --worker always`` what it costs a small body. A list (``1,2``) runs each
count in a child process with the BLAS thread variables set (OpenBLAS reads them at import),
and every row names the command that reproduces it.

Prefill rows: both ends hold the same K/V state, ready for the next token. The
denominator is the faster of two prefills measured in the same run: our NumPy
forward pass and HF transformers' ``GPT2LMHeadModel`` (when installed).

I/O rows, every contender timed in turn, round after round (best of N each, so a
burst of load elsewhere hits them alike), warm (file in the page cache) and cold
(the file's pages dropped with ``posix_fadvise(DONTNEED)`` before each read):

- ``restore``: ``cache.restore(path)``, then the context closed;
- ``raw_read``: ``readinto`` of the snapshot file's bytes into one buffer allocated and faulted in
  once, then reused, nothing else: the ceiling, and the fair baseline (a restore reuses its
  staging buffers and the pages of closed contexts the same way);
- ``raw_read_fresh``: the same into a fresh buffer each time, which pays a first-touch fault per
  page (at 8,192 tokens, 604 MB: it was slower than the restore). Shown, not a target;
- ``copies``: the two copies this design's restore makes and nothing else, inline: the file read in
  4 MiB pieces into one reused staging buffer and each piece's rows moved into layer-major page
  arrays allocated once (no checksum, no checks, no cache). ``copies/raw`` is the floor under
  ``/raw`` for any restore of position-major files into layer-major NumPy pages on one thread;
- ``torch``: ``torch.load`` of the same tokens and K/V as tensors (when torch is installed);
- ``write``: ``ctx.snapshot(path)`` (temp file, fsync, rename, folder fsync) against
  ``raw_write_fsync`` (the same bytes written to a new file, then fsynced: the target's baseline) and ``raw_write_atomic`` (the same bytes with the whole atomic protocol done
  by hand: temp file, write, fsync, rename over the target, folder fsync), so the protocol's own
  cost and our pipeline's are told apart. Every write goes to a path that holds no file: writing
  over an old file frees its blocks first (the rename's unlink, or ``O_TRUNC``), which costs the
  same either way and is not the write's cost.

Ratios are of times measured in the same run; targets: restore <= 1.3x raw (warm, >= 512 tokens),
<= 1.3x torch.load, write <= 1.2x raw write+fsync, re-prefill / restore >= 150x at 512 tokens
with 1 thread.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvstate.impl import Cache
from kvstate.impl import snapshot_tuning
from kvstate.model import GPT2, GPT2Config
from kvstate.spec.arithmetic import pages_touched, span_in_page
from kvstate.spec.snapshot_format import HEADER_SIZE

from .args import positive_int
from .prefill_floor import PrefillFloor, best_run
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


TARGETS = {"warm_speedup_at_512": 150, "restore_over_raw_warm": 1.3, "restore_over_torch_warm": 1.3,
           "write_over_raw_fsync": 1.2, "prefill_over_hf": 1.0}
THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def run(quick: bool = False, full: bool = False, threads: int | None = None, prefill: bool = True,
        repeat: int | None = None, lengths: list[int] | None = None, worker: str = "auto") -> dict:
    threads = threads or os.cpu_count()
    before = snapshot_tuning.IO_THREADS
    # inline; the default's choice by size; or the worker at every size
    snapshot_tuning.IO_THREADS = 1 if threads == 1 else (2 if worker == "always" else None)
    try:
        result = _run(quick, full, threads, prefill, repeat, lengths)
        if worker != "auto":
            for row in result["rows"]:
                row["command"] += f" --worker {worker}"
        return result
    finally:
        snapshot_tuning.IO_THREADS = before


def _run(quick: bool, full: bool, threads: int, prefill: bool, repeat: int | None, lengths: list[int] | None) -> dict:
    lengths = lengths or ([128, 512] if quick else [128, 512, 2048] + ([8192] if full else []))
    try:
        import torch
        torch.set_num_threads(threads)
    except ImportError:
        pass
    config = GPT2Config.small(n_positions=max(lengths))
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        if prefill:
            model = GPT2.random(config, threads=threads)     # attention's heads split as BLAS splits the rest
            hf_prefill = hf_prefill_timer(config, threads)
        rng = np.random.default_rng(0)
        for n in lengths:
            tokens = rng.integers(0, config.vocab_size, n)
            cache = Cache(config.layout, page_tokens=64)
            row = {"tokens": n, "threads": threads}
            if prefill:
                prefill_repeat = 1 if quick or n >= 2048 else 2     # --quick: a smoke run, one of each

                def ours():
                    with cache.allocate() as ctx:
                        model.prefill(ctx, tokens)
                row["ours_prefill_s"] = best_of(ours, prefill_repeat)
                if hf_prefill is not None:
                    row["hf_prefill_s"] = best_of(lambda: hf_prefill(tokens), prefill_repeat)
                    row["prefill_over_hf"] = row["ours_prefill_s"] / row["hf_prefill_s"]
                    floor = best_run(PrefillFloor(model, n), prefill_repeat)["total"]
                    row["floor_over_hf"] = floor / row["hf_prefill_s"]
                row["prefill_s"] = min(v for k, v in row.items() if k.endswith("prefill_s"))
            values = np.random.default_rng(n).standard_normal(config.layout.batch_shape(n), dtype=np.float32)
            row.update(io_times(cache, tokens, values, Path(folder), repeat or (3 if quick else 5)))
            if prefill:
                row["warm_speedup"] = row["prefill_s"] / row["restore_warm_s"]
                if row.get("restore_cold_s"):
                    row["cold_speedup"] = row["prefill_s"] / row["restore_cold_s"]
            row["command"] = command_for(n, threads, prefill, repeat, quick)
            rows.append(row)
    return {"name": "restore_vs_prefill",
            "params": {"shape": "GPT-2 small f32", "threads": threads, "prefill": prefill,
                       "hf": prefill and hf_prefill is not None},
            "rows": rows,
            "targets": TARGETS}


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
    reused = np.ones(size, np.uint8)        # faulted in once: the raw read's ceiling

    def restore():
        cache.restore(path).close()

    def raw_read():
        with open(path, "rb", buffering=0) as file:
            file.readinto(reused)

    def raw_read_fresh():
        buffer = np.empty(size, np.uint8)
        with open(path, "rb", buffering=0) as file:
            file.readinto(buffer)

    def write():
        ctx.snapshot(written)

    def raw_write():
        with open(raw_out, "wb", buffering=0) as file:
            file.write(payload)
            os.fsync(file.fileno())

    def raw_write_atomic():
        temp = raw_out.with_suffix(".tmp")
        with open(temp, "xb", buffering=0) as file:
            file.write(payload)
            os.fsync(file.fileno())
            os.replace(temp, raw_out)
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    contenders = {"restore": restore, "raw_read": raw_read, "raw_read_fresh": raw_read_fresh,
                  "copies": CopiesFloor(path, cache.layout, n, cache.page_tokens)}
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
        for key, action in (("write_s", write), ("raw_write_fsync_s", raw_write),
                            ("raw_write_atomic_s", raw_write_atomic)):
            written.unlink(missing_ok=True)     # every write makes a new file: replacing or truncating an
            raw_out.unlink(missing_ok=True)     # old one frees its blocks (~7 ms per 37 MB here), untimed
            _time_into(best, key, action)
    ctx.close()
    row = {"snapshot_bytes": size, **best}
    for mode in ("warm", "cold"):
        if f"restore_{mode}_s" in best:
            row[f"restore_over_raw_{mode}"] = best[f"restore_{mode}_s"] / best[f"raw_read_{mode}_s"]
            if f"torch_load_{mode}_s" in best:
                row[f"restore_over_torch_{mode}"] = best[f"restore_{mode}_s"] / best[f"torch_load_{mode}_s"]
    row["restore_over_raw_fresh_warm"] = best["restore_warm_s"] / best["raw_read_fresh_warm_s"]
    row["copies_over_raw_warm"] = best["copies_warm_s"] / best["raw_read_warm_s"]
    row["write_over_raw_fsync"] = best["write_s"] / best["raw_write_fsync_s"]
    row["write_over_raw_atomic"] = best["write_s"] / best["raw_write_atomic_s"]
    for leftover in (path, raw_out, written, torch_path):
        if leftover is not None:
            leftover.unlink(missing_ok=True)
    return row


class CopiesFloor:
    """The ``copies`` contender for the f32 snapshot at ``path``: a call reads its tokens and its
    values a 4 MiB piece at a time into one reused buffer and copies each piece's rows into
    ``pages`` (allocated and faulted in once) as ``store.write_rows`` copies them; nothing else."""

    def __init__(self, path: Path, layout, n: int, page_tokens: int):
        self.path, self.n, self.page_tokens = path, n, page_tokens
        self.position_shape, self.row_bytes = layout.position_shape, layout.values_per_position * 4
        self.step = max(1, (4 << 20) // self.row_bytes)
        self.staging = np.ones(self.step * self.row_bytes, np.uint8)
        self.head = np.ones(HEADER_SIZE + 4 * n, np.uint8)
        self.pages = [np.ones(layout.page_shape(page_tokens), np.float32) for _ in range(-(-n // page_tokens))]

    def __call__(self) -> None:
        n, page_tokens = self.n, self.page_tokens
        with open(self.path, "rb", buffering=0) as file:
            file.readinto(self.head)
            for first in range(0, n, self.step):
                count = min(self.step, n - first)
                file.readinto(memoryview(self.staging)[:count * self.row_bytes])
                rows = self.staging[:count * self.row_bytes].view(np.float32).reshape(count, *self.position_shape)
                for index in range(*pages_touched(first, first + count, page_tokens)):
                    lo, hi = span_in_page(index, first, first + count, page_tokens)
                    row = index * page_tokens + lo - first
                    self.pages[index][:, :, lo:hi] = np.moveaxis(rows[row:row + hi - lo], 0, 2)


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


def thread_counts(text: str) -> list[int]:
    counts = [int(part) for part in text.split(",") if part.strip()]
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"--threads takes counts like 1 or 1,2, not {text!r}")
    return counts


def command_for(tokens: int, threads: int, prefill: bool, repeat: int | None, quick: bool = False) -> str:
    """The shell command that measures one row again (``--quick`` too: it sets the rounds of a row)."""
    env = " ".join(f"{var}={threads}" for var in THREAD_VARS)
    flags = ["--tokens", str(tokens), "--threads", str(threads)] + ["--quick"] * quick
    flags += ["--no-prefill"] * (not prefill) + (["--repeat", str(repeat)] if repeat else [])
    return f"{env} python -m kvstate.bench.restore {' '.join(flags)}"


def run_pinned(args: argparse.Namespace, threads: int) -> dict:
    """``run`` with ``threads`` everywhere: here if BLAS already runs with that many threads,
    else in a child process started with the thread variables set."""
    if all(os.environ.get(var) == str(threads) for var in THREAD_VARS):
        return run(quick=args.quick, full=args.full, threads=threads, prefill=not args.no_prefill,
                   repeat=args.repeat, lengths=args.tokens, worker=args.worker)
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        argv = [sys.executable, "-m", "kvstate.bench.restore", "--threads", str(threads), "--json", str(out)]
        argv += ["--quick"] * args.quick + ["--full"] * args.full + ["--no-prefill"] * args.no_prefill
        argv += ["--worker", args.worker]
        argv += (["--repeat", str(args.repeat)] if args.repeat else []) + (
            ["--tokens", *map(str, args.tokens)] if args.tokens else [])
        subprocess.run(argv, env=dict(os.environ, **{var: str(threads) for var in THREAD_VARS}),
                       check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstate.bench.restore", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="128 and 512 tokens only")
    parser.add_argument("--full", action="store_true", help="add 8,192 tokens")
    parser.add_argument("--tokens", type=positive_int, nargs="+", default=None, help="these context lengths instead")
    parser.add_argument("--no-prefill", action="store_true", help="the I/O rows only (no model, much faster)")
    parser.add_argument("--repeat", type=positive_int, default=None, help="rounds; each figure is the best of them")
    parser.add_argument("--threads", type=thread_counts, default=[1, 2],
                        help="thread counts, one set of rows each (default 1,2)")
    parser.add_argument("--worker", choices=("auto", "always"), default="auto",
                        help="with 2+ threads: the pipelines' worker by body size (default) or at every size")
    parser.add_argument("--json", type=Path, default=None, help=argparse.SUPPRESS)   # a child's result
    args = parser.parse_args(argv)
    from .run import format_result

    results = [run_pinned(args, threads) for threads in args.threads]
    result = dict(results[0], rows=[row for result in results for row in result["rows"]])
    result["params"] = dict(result["params"], threads=args.threads)
    if args.json is not None:
        args.json.write_text(json.dumps(result))
        return 0
    print(format_table(result))
    return 0


COLUMNS = (("tokens", "tokens", "{}"), ("threads", "thr", "{}"), ("snapshot_bytes", "MB", "{:.1f}", 1e-6),
           ("restore_warm_s", "restore ms", "{:.2f}", 1e3), ("raw_read_warm_s", "raw ms", "{:.2f}", 1e3),
           ("raw_read_fresh_warm_s", "fresh ms", "{:.2f}", 1e3), ("torch_load_warm_s", "torch ms", "{:.2f}", 1e3),
           ("restore_over_raw_warm", "/raw", "{:.2f}"), ("restore_over_raw_fresh_warm", "/fresh", "{:.2f}"),
           ("restore_over_torch_warm", "/torch", "{:.2f}"), ("restore_over_raw_cold", "cold /raw", "{:.2f}"),
           ("copies_warm_s", "copies ms", "{:.2f}", 1e3), ("copies_over_raw_warm", "copies/raw", "{:.2f}"),
           ("write_s", "write ms", "{:.2f}", 1e3), ("raw_write_fsync_s", "raw+fsync", "{:.2f}", 1e3),
           ("raw_write_atomic_s", "raw atomic", "{:.2f}", 1e3), ("write_over_raw_fsync", "w/raw", "{:.2f}"),
           ("write_over_raw_atomic", "w/atomic", "{:.2f}"), ("warm_speedup", "prefill/restore", "{:.0f}x"),
           ("ours_prefill_s", "prefill s", "{:.2f}"), ("hf_prefill_s", "HF s", "{:.2f}"),
           ("prefill_over_hf", "prefill/HF", "{:.2f}"), ("floor_over_hf", "floor/HF", "{:.2f}"))


def format_table(result: dict) -> str:
    """The rows' times and ratios (targets: /raw and /torch <= 1.3 from 512 tokens, w/raw <= 1.2,
    prefill/restore >= 150x at 512 with 1 thread, prefill/HF <= 1.0), then the command that
    measures each row again."""
    rows = result["rows"]
    columns = [c for c in COLUMNS if any(c[0] in row for row in rows)]
    cells = [[c[2].format(row[c[0]] * (c[3] if len(c) > 3 else 1)) if c[0] in row else "-" for c in columns]
             for row in rows]
    widths = [max(len(c[1]), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = [f"== restore vs raw I/O ({result['params']})",
             "  ".join(c[1].rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in cells]
    lines.append("warm; /raw: restore over readinto into a reused buffer (the ceiling); /fresh: into a fresh one; "
                 "copies/raw: the read and the rearranging copy alone, inline, over the same (the design's floor); "
                 "w/raw: snapshot write over write+fsync of a new file; w/atomic: over that plus rename and folder fsync; "
                 "prefill s: the NumPy GPT-2's prefill (kvstate.model), HF s: transformers' GPT2LMHeadModel on the "
                 "same tokens and weights shape, prefill/HF: the first over the second (at most 1.0: ours no slower); "
                 "floor/HF: what no NumPy prefill can skip, run alone (the weights' products, attention's products "
                 "and NumPy's exp over every score and GELU input: bench/prefill_floor.py), over HF's whole prefill: "
                 "where it is above 1.0 so is every NumPy prefill on this BLAS and CPU, and what passes is a fused "
                 "attention with a vectorised exp (compiled code, as torch's), not another design of the pass")
    lines.append("targets: " + ", ".join(f"{k} {v}" for k, v in result["targets"].items()))
    lines += [f"  {row['tokens']:>5} tokens, {row['threads']} thread(s): {row['command']}" for row in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
