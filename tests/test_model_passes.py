"""The forward pass's row-blocked and in-place passes give the same bits as the formulas they replace."""

import numpy as np
import pytest

from kvstate.model.numpy_gpt2 import NORM_ROWS, layer_norm, residual
from kvstate.spec.precision import PRECISIONS, decode, encode, roundtrip


def whole_array_layer_norm(x, gain, bias, eps):
    """The formula over the whole activation at once, as the model computed it before row blocks."""
    mean = x.mean(-1, keepdims=True)
    centred = x - mean
    var = (centred * centred).mean(-1, keepdims=True)
    return centred / np.sqrt(var + np.float32(eps)) * gain + bias


@pytest.mark.parametrize("rows", [1, NORM_ROWS, 3 * NORM_ROWS + 5])
def test_layer_norm_in_row_blocks_is_the_whole_array_formula_bit_for_bit(rows):
    rng = np.random.default_rng(rows)
    # a large common offset makes the centring's rounding matter, so a change of order would show
    x = (rng.standard_normal((rows, 768)) * 3 + 40).astype(np.float32)
    gain, bias = (rng.standard_normal(768).astype(np.float32) for _ in range(2))
    before = x.copy()
    got = layer_norm(x, gain, bias, 1e-5)
    assert got.dtype == np.float32 and np.array_equal(got, whole_array_layer_norm(x, gain, bias, 1e-5))
    assert np.array_equal(x, before)                     # the input is left alone


def test_residual_is_x_plus_update_plus_bias_bit_for_bit_in_the_updates_memory():
    rng = np.random.default_rng(0)
    x, update = (rng.standard_normal((70, 48)).astype(np.float32) * 1e3 for _ in range(2))
    bias = rng.standard_normal(48).astype(np.float32)
    expected, before = x + update + bias, x.copy()
    got = residual(x, update, bias)
    assert got is update and np.array_equal(got, expected) and np.array_equal(x, before)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_roundtrip_is_decode_of_encode_in_fresh_memory(precision):
    x = (np.random.default_rng(1).standard_normal((5, 3, 8)) * 2).astype(np.float32)
    got = roundtrip(precision, x)
    assert np.array_equal(got, decode(precision, encode(precision, x)))
    assert got.dtype == np.float32 and not np.shares_memory(got, x)
