"""The forward pass's row-blocked and in-place passes give the same bits as the formulas they replace."""

import numpy as np
import pytest

from kvstate.impl import Cache
from kvstate.model import GPT2, GPT2Config, numpy_gpt2
from kvstate.model.numpy_gpt2 import NORM_ROWS, layer_norm, residual
from kvstate.model.weights import random_weights
from kvstate.spec.precision import PRECISIONS, decode, encode, roundtrip


def whole_array_layer_norm(x, gain, bias, eps):
    """The formula over the whole activation at once, as the model computed it before row blocks."""
    mean = x.mean(-1, keepdims=True)
    centred = x - mean
    var = (centred * centred).mean(-1, keepdims=True)
    return centred / np.sqrt(var + np.float32(eps)) * gain + bias


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows", [1, NORM_ROWS, 3 * NORM_ROWS + 5])
def test_layer_norm_in_row_blocks_is_the_whole_array_formula_bit_for_bit(rows, threads, monkeypatch):
    """Also split over threads (from 2 rows here): each row's numbers do not depend on where it ran."""
    monkeypatch.setattr(numpy_gpt2, "SPLIT_FROM_ROWS", 2)
    split = []
    pool = numpy_gpt2.thread_pool
    monkeypatch.setattr(numpy_gpt2, "thread_pool", lambda count: split.append(count) or pool(count))
    rng = np.random.default_rng(rows)
    # a large common offset makes the centring's rounding matter, so a change of order would show
    x = (rng.standard_normal((rows, 768)) * 3 + 40).astype(np.float32)
    gain, bias = (rng.standard_normal(768).astype(np.float32) for _ in range(2))
    before = x.copy()
    got = layer_norm(x, gain, bias, 1e-5, threads)
    assert got.dtype == np.float32 and np.array_equal(got, whole_array_layer_norm(x, gain, bias, 1e-5))
    assert np.array_equal(x, before)                     # the input is left alone
    assert split == ([threads] if threads > 1 and rows >= 2 else [])


def test_residual_is_x_plus_update_plus_bias_bit_for_bit_in_the_updates_memory():
    rng = np.random.default_rng(0)
    x, update = (rng.standard_normal((70, 48)).astype(np.float32) * 1e3 for _ in range(2))
    bias = rng.standard_normal(48).astype(np.float32)
    expected, before = x + update + bias, x.copy()
    got = residual(x, update, bias)
    assert got is update and np.array_equal(got, expected) and np.array_equal(x, before)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_roundtrip_is_decode_of_encode_in_fresh_memory(precision):
    whole = (np.random.default_rng(1).standard_normal((5, 3, 16)) * 2).astype(np.float32)
    x = whole[:, :, 4:12]                   # strided, as the model's keys are a view of its Q/K/V product
    got = roundtrip(precision, x)
    assert np.array_equal(got, decode(precision, encode(precision, x)))
    assert got.dtype == np.float32 and not np.shares_memory(got, x)


def test_a_forward_pass_split_over_threads_is_the_same_bits(monkeypatch):
    """Split from the first row, so this small pass takes the threaded paths: the heads of attention
    and the rows of the biased GELU over two and three threads, a decode included."""
    monkeypatch.setattr(numpy_gpt2, "SPLIT_FROM_ROWS", 1)
    config = GPT2Config.tiny()
    tokens = [int(t) for t in np.random.default_rng(4).integers(0, config.vocab_size, 70)]
    runs = []
    for threads in (1, 2, 3):
        model = GPT2.random(config, seed=5, threads=threads)
        ctx = Cache(config.layout, page_tokens=8).allocate()
        runs.append((model.prefill(ctx, tokens), model.decode(ctx, 9)))
    for prefill, decode in runs[1:]:
        assert np.array_equal(prefill, runs[0][0]) and np.array_equal(decode, runs[0][1])


def test_float64_weights_are_computed_in_float32():
    """The passes run in place in float32: a float64 weight is taken as float32, not half-promoted."""
    config = GPT2Config.tiny()
    weights = random_weights(config, 6)
    as_float64 = {name: w.astype(np.float64) for name, w in weights.items()}
    tokens = [3, 1, 4, 1, 5]
    logits = [GPT2(config, w).prefill(Cache(config.layout, page_tokens=4).allocate(), tokens)
              for w in (weights, as_float64)]
    assert logits[1].dtype == np.float32 and np.array_equal(logits[0], logits[1])
