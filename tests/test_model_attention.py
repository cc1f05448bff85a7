"""The NumPy model's chunked attention equals plain causal attention, and its chunks stay small.

Small chunks are the point (each product then runs on the calling thread, below
OpenBLAS's threading threshold); these checks pin both the values and the sizes.
"""

import numpy as np
import pytest

from kvstate.model import numpy_gpt2
from kvstate.model.numpy_gpt2 import QUERY_ROWS, attend, rechunk


def dense_attention(q, k, v, start):
    n, H, D = q.shape
    scores = np.einsum("nhd,thd->hnt", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(D)
    visible = np.arange(len(k))[None, :] <= (start + np.arange(n))[:, None]
    scores = np.where(visible, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("hnt,thd->nhd", weights, v.astype(np.float64)).reshape(n, H * D)


def attention_case(start: int, n: int, block, heads: int):
    """Random (q, k, v, blocks) for ``n`` queries after ``start`` past positions: the past and the new
    keys as two parts, regrouped into ``block``-position blocks (``None``: the parts as they are)."""
    rng = np.random.default_rng(start + n)
    k, v = (rng.standard_normal((start + n, heads, 8), dtype=np.float32) for _ in range(2))
    q = rng.standard_normal((n, heads, 8), dtype=np.float32)
    parts = [(k[:start], v[:start]), (k[start:], v[start:])] if start else [(k, v)]
    return q, k, v, parts if block is None else list(rechunk(parts, block))


@pytest.mark.parametrize("start,n,block", [(0, 200, 64), (37, 150, 64), (5, 1, 64), (0, 70, 6), (10, 90, None)])
def test_chunked_attention_equals_dense_attention(start, n, block):
    q, k, v, blocks = attention_case(start, n, block, heads=3)
    assert np.allclose(attend(q, blocks, start), dense_attention(q, k, v, start), atol=1e-5)


def test_no_chunk_spans_more_than_one_key_block_or_query_rows(monkeypatch):
    seen, chunk = [], numpy_gpt2._attend_chunk

    def recording(rows, blocks, offsets, lo, hi, scale):
        seen.append((rows.shape[1], offsets[len(blocks) - 1], lo, hi))
        return chunk(rows, blocks, offsets, lo, hi, scale)

    monkeypatch.setattr(numpy_gpt2, "_attend_chunk", recording)
    rng = np.random.default_rng(0)
    k = v = rng.standard_normal((300, 2, 4), dtype=np.float32)
    attend(rng.standard_normal((290, 2, 4), dtype=np.float32), list(rechunk([(k, v)], 64)), 10)
    assert sum(rows for rows, *_ in seen) == 290
    assert all(rows <= QUERY_ROWS and last <= lo and hi <= last + 64 for rows, last, lo, hi in seen)


@pytest.mark.parametrize("start,n,block", [(40, 300, 64), (0, 130, 6), (37, 150, None), (200, 1, 64)])
def test_threads_split_the_heads_and_change_no_bit(monkeypatch, start, n, block):
    monkeypatch.setattr(numpy_gpt2, "SPLIT_FROM_ROWS", 1)      # split these small passes (a decode too)
    q, k, v, blocks = attention_case(start, n, block, heads=5)
    alone = attend(q, blocks, start)
    for threads in (2, 3, 8):
        assert np.array_equal(attend(q, blocks, start, threads), alone)
    assert np.allclose(alone, dense_attention(q, k, v, start), atol=1e-5)


def test_a_thread_split_runs_each_head_once_on_the_pool(monkeypatch):
    """The split is real: with 2 threads the chunks run on the pool's threads, each head once."""
    import threading
    seen, chunk = [], numpy_gpt2._attend_chunk

    def recording(rows, blocks, offsets, lo, hi, scale):
        seen.append((threading.current_thread().name, rows.shape[0], lo))
        return chunk(rows, blocks, offsets, lo, hi, scale)

    monkeypatch.setattr(numpy_gpt2, "_attend_chunk", recording)
    monkeypatch.setattr(numpy_gpt2, "SPLIT_FROM_ROWS", 100)
    rng = np.random.default_rng(2)
    k = v = rng.standard_normal((200, 4, 8), dtype=np.float32)
    attend(rng.standard_normal((200, 4, 8), dtype=np.float32), list(rechunk([(k, v)], 64)), 0, threads=2)
    assert {name.startswith("kvstate-attention") for name, _, _ in seen} == {True}
    assert sorted((heads, lo) for _, heads, lo in seen) == sorted((2, lo) for lo in (0, 64, 128, 192) for _ in range(2))


def test_the_prefill_is_the_same_bits_at_any_thread_count(monkeypatch):
    """Attention's heads and GELU's rows split over threads: the logits and the stored K/V do not move."""
    monkeypatch.setattr(numpy_gpt2, "SPLIT_FROM_ROWS", 100)
    split = []
    pool = numpy_gpt2.thread_pool
    monkeypatch.setattr(numpy_gpt2, "thread_pool", lambda threads: split.append(threads) or pool(threads))
    from kvstate.impl import Cache
    from kvstate.model import GPT2Config

    config = GPT2Config(vocab_size=97, n_positions=300, n_embd=32, n_layer=2, n_head=4)
    tokens = np.random.default_rng(3).integers(0, 97, 260)
    results = []
    for threads in (1, 2, 3):
        model = numpy_gpt2.GPT2.random(config, threads=threads)
        with Cache(config.layout, page_tokens=16).allocate() as ctx:
            logits = model.prefill(ctx, tokens)
            results.append((logits, ctx.read()[0]))
    for logits, values in results[1:]:
        assert np.array_equal(logits, results[0][0]) and np.array_equal(values, results[0][1])
    assert set(split) == {2, 3}       # the passes at 2 and 3 threads really split


@pytest.mark.parametrize("threads", [0, -1, 1.5, True, "2"])
def test_a_thread_count_that_is_not_a_positive_int_is_refused_by_name(threads):
    from kvstate.model import GPT2Config
    from kvstate.spec.errors import ConfigError

    with pytest.raises(ConfigError, match="threads must be a positive int"):
        numpy_gpt2.GPT2.random(GPT2Config(vocab_size=11, n_positions=8, n_embd=8, n_layer=1, n_head=2), threads=threads)


def test_a_forked_child_splits_on_threads_of_its_own(monkeypatch):
    """The pools are per process: a child forked after the parent split a pass gets new threads
    (the inherited pool has none and would never run the work)."""
    import multiprocessing

    monkeypatch.setattr(numpy_gpt2, "SPLIT_FROM_ROWS", 1)
    rng = np.random.default_rng(4)
    k = v = rng.standard_normal((130, 4, 8), dtype=np.float32)
    q = rng.standard_normal((130, 4, 8), dtype=np.float32)
    blocks = list(rechunk([(k, v)], 64))
    expected = attend(q, blocks, 0, threads=2)          # the parent's pool now exists

    def child():
        raise SystemExit(0 if np.array_equal(attend(q, blocks, 0, threads=2), expected) else 3)
    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    process.join(60)
    if process.is_alive():
        process.kill()
    assert process.exitcode == 0, process.exitcode
