"""README's ```python blocks run as written, so they cannot rot: each in a fresh namespace, in a temporary
folder. A fragment that continues an earlier screen gets the few lines it assumes (`PRELUDE`); a block
that needs storage or a checkpoint this machine may not have is skipped by name (`SKIP`), or run with
its URL pointed at fsspec's in-memory filesystem. A new block fails `test_every_block_is_known` until it
is listed here, with what README says it gives."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")

BLOCKS = [(README.count("\n", 0, m.start()) + 2, m.group(1))
          for m in re.finditer(r"^```python\n(.*?)^```", README, re.S | re.M)]

CONTEXT = """
import numpy as np
from kvstate import Cache, Layout
layout = Layout(layers=2, kv_heads=4, head_dim=16)
cache = Cache(layout, page_tokens=64)
ctx = cache.allocate()
ctx.extend(tokens=[1, 2, 3], kv=np.zeros(layout.batch_shape(3), np.float32))
"""

# a line each block contains -> (lines run before it, lines run after it: what README says it gives)
PRELUDE = {
    "cache.retain(ctx)              # the prefix tree keeps its own fork": (
        "", "assert matched == 3 and list(tokens) == [1, 2, 3]"),
    'ctx.snapshot("session.kvs")': (CONTEXT, "assert list(restored.tokens) == [1, 2, 3]"),
    'ctx.snapshot("s3://bucket/sessions/42.kvs")': (
        CONTEXT + "from kvstate.remote import SnapshotStore\n", "assert list(ctx.tokens) == [1, 2, 3]"),
    "model = GPT2.random(config, seed=0)": ("", "assert len(ctx) == 3 and len(branch) == 4"),
}
SKIP = {
    'from_pretrained("path/to/local/checkpoint")':
        "needs a checkpoint; with a tiny from_config model it runs, but transformers and ~200 generated tokens take ~10 s",
}
MEMORY = ("s3://", "memory://")     # fsspec's in-memory filesystem stands in for a bucket


def test_every_block_is_known():
    known = set(PRELUDE) | set(SKIP)
    assert len(BLOCKS) >= 5
    for line, code in BLOCKS:
        assert sum(key in code for key in known) == 1, f"README line {line}: a python block no entry here names"


@pytest.mark.parametrize("line,code", BLOCKS, ids=[f"README:{line}" for line, _ in BLOCKS])
def test_block_runs(line, code, tmp_path, monkeypatch):
    for key, reason in SKIP.items():
        if key in code:
            pytest.skip(reason)
    if MEMORY[0] in code:
        pytest.importorskip("fsspec", reason="the remote extra (fsspec) is not installed")
    before, after = next((v for k, v in PRELUDE.items() if k in code), ("", ""))
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme"}
    exec(compile(before, "prelude", "exec"), namespace)
    try:
        exec(compile("\n" * (line - 1) + code.replace(*MEMORY), "README.md", "exec"), namespace)
        exec(compile(after, f"after README line {line}", "exec"), namespace)
    finally:
        if MEMORY[0] in code:      # the in-memory filesystem is the process's: leave no bucket to other tests
            import fsspec
            memory = fsspec.filesystem("memory")
            if memory.exists("/bucket"):
                memory.rm("/bucket", recursive=True)
