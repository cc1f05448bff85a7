"""The NumPy model's GELU is GPT-2's tanh approximation, computed through the logistic form."""

import warnings

import numpy as np

from kvstate.model.numpy_gpt2 import GELU_ROWS, gelu, gelu_in_place


def tanh_form(x: np.ndarray) -> np.ndarray:
    """GPT-2's "gelu_new" as written, in float64."""
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def test_gelu_equals_the_tanh_approximation_within_float32_rounding():
    x = np.concatenate([np.linspace(-12, 12, 200_001), np.random.default_rng(0).standard_normal(100_000) * 4]
                       ).astype(np.float32)
    expected = tanh_form(x.astype(np.float64))
    got = gelu(x)
    assert got.dtype == np.float32 and got.shape == x.shape
    assert np.abs(got - expected).max() < 1e-6
    # Relative error too, down the negative tail: there ``1 + tanh(z)`` cancels (the float32 tanh
    # form was off by 13x its value at 1e-8), while the logistic form keeps every value to a few
    # bits (2.3e-6).
    tail = np.abs(expected) > 1e-8
    assert (np.abs(got[tail] - expected[tail]) / np.abs(expected[tail])).max() < 1e-5


def test_gelu_at_the_extremes_is_the_tanh_forms():
    x = np.array([-np.inf, -1e30, -100.0, -0.0, 0.0, 100.0, 1e30, np.inf, np.nan], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)     # 1e30 * 1e30 overflows, in either form
        got = gelu(x)
    assert np.array_equal(got[1:5], [0.0, 0.0, 0.0, 0.0]) and np.signbit(got[1:4]).all() and not np.signbit(got[4])
    assert np.array_equal(got[5:8], x[5:8])              # far above zero: x itself
    assert np.isnan(got[0]) and np.isnan(got[8])         # -inf and nan give nan, as in the tanh form


def test_a_far_negative_value_is_minus_zero_without_a_warning():
    """``exp`` overflows to inf there, which the logistic form is meant to take: not worth a warning."""
    x = np.array([-100.0, -20.0, -4.0], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = gelu(x)
    assert np.array_equal(got[:2], [0.0, 0.0]) and np.signbit(got[:2]).all() and got[2] < 0


def test_gelu_leaves_its_input_alone():
    x = np.random.default_rng(1).standard_normal((4, 6)).astype(np.float32)
    before = x.copy()
    gelu(x)
    assert np.array_equal(x, before)


def test_gelu_in_place_is_gelu_bit_for_bit_over_blocks_of_rows():
    """The forward pass's gelu runs ``GELU_ROWS`` rows at a time into the activation itself: the
    same bits as ``gelu`` over the whole array, a short last block included."""
    x = (np.random.default_rng(2).standard_normal((2 * GELU_ROWS + 3, 7)) * 6).astype(np.float32)
    expected = gelu(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = gelu_in_place(x)
    assert got is x and np.array_equal(x, expected)


def test_gelu_in_place_adds_the_bias_first_bit_for_bit():
    """The forward pass hands the MLP's bias to ``gelu_in_place``, which adds it row block by row block:
    the same bits as adding it to the whole activation and then taking ``gelu``."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((2 * GELU_ROWS + 5, 9)) * 4).astype(np.float32)
    bias = rng.standard_normal(9).astype(np.float32)
    expected = gelu(x + bias)
    got = gelu_in_place(x, bias)
    assert got is x and np.array_equal(x, expected)
