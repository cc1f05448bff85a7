"""Exact-logit checks: what a model computes from a context depends only on what the context stores.

Every comparison is ``np.array_equal`` (difference exactly zero), in every
precision, with forks at a page boundary and one position either side of it.
"""

import importlib.util
import threading

import numpy as np
import pytest

from kvstate.impl import Cache
from kvstate.impl import context as context_module
from kvstate.model import GPT2, GPT2Config
from kvstate.spec.errors import ConfigError, PositionError, TokenError
from kvstate.spec.precision import PRECISIONS

PAGE = 4
CONFIG = GPT2Config.tiny()
MODELS = {"numpy": GPT2.random(CONFIG, seed=3), "numpy-block-page": GPT2.random(CONFIG, seed=3)}
MODELS["numpy"].block = 6                   # attention blocks assembled from slices of several pages
MODELS["numpy-block-page"].block = PAGE     # attention blocks that are pages, read in place
if importlib.util.find_spec("torch"):
    import torch

    from kvstate.model.torch_gpt2 import TorchGPT2

    torch.set_num_threads(1)       # tiny shapes: threads only add contention on a shared CI machine
    MODELS["torch"] = TorchGPT2.random(CONFIG, seed=3)
PROMPT = [int(t) for t in np.random.default_rng(0).integers(0, CONFIG.vocab_size, 3 * PAGE + 1)]
CONTINUATION = [11, 42, 7, 93, 5, 60]
BRANCH = [1, 2, 3, 4, 5]
STORES = ["numpy"] + (["torch"] if importlib.util.find_spec("kvstate.impl.torch") else [])


@pytest.fixture(params=[(s, p) for s in STORES for p in PRECISIONS], ids=lambda sp: f"{sp[0]}-{sp[1]}")
def cache(request):
    store, precision = request.param
    return Cache(CONFIG.layout, page_tokens=PAGE, precision=precision, store=store, max_entries=4)


@pytest.fixture(params=list(MODELS), ids=lambda name: f"model-{name}")
def model(request):
    return MODELS[request.param]


def prefilled(model, cache, n):
    ctx = cache.allocate()
    model.prefill(ctx, PROMPT[:n])
    return ctx


def continue_with(model, ctx, tokens):
    return [model.decode(ctx, t) for t in tokens]


def assert_same(a, b):
    assert len(a) == len(b)
    for step, (x, y) in enumerate(zip(a, b)):
        assert np.array_equal(x, y), f"logits differ at step {step}: max |diff| {np.abs(x - y).max()}"


AT_BOUNDARY = [2 * PAGE - 1, 2 * PAGE, 2 * PAGE + 1]


@pytest.mark.parametrize("n", AT_BOUNDARY)
def test_fork_continues_exactly_as_its_parent(model, cache, n):
    parent = prefilled(model, cache, n)
    child = parent.fork()
    assert_same(continue_with(model, child, CONTINUATION), continue_with(model, parent, CONTINUATION))


@pytest.mark.parametrize("n", AT_BOUNDARY)
def test_parent_is_isolated_from_its_branch(model, cache, n):
    parent = prefilled(model, cache, n)
    branch = parent.fork()
    branch_logits = continue_with(model, branch, BRANCH[:3])
    never_forked = prefilled(model, cache, n)
    assert_same(continue_with(model, parent, CONTINUATION), continue_with(model, never_forked, CONTINUATION))
    # the branch, resumed after the parent wrote into the page they shared, still sees its own history
    branch_logits += continue_with(model, branch, BRANCH[3:])
    assert_same(branch_logits, continue_with(model, prefilled(model, cache, n), BRANCH))


@pytest.mark.parametrize("n", AT_BOUNDARY)
def test_matched_context_continues_exactly_as_the_retained_one(model, cache, n):
    retained = prefilled(model, cache, n)
    cache.retain(retained)
    matched, length = cache.match(PROMPT[:n] + CONTINUATION)
    assert length == n
    assert_same(continue_with(model, matched, CONTINUATION), continue_with(model, retained, CONTINUATION))


def test_a_single_changed_value_changes_the_logits(model, cache):
    """The equality above is sensitive: one stored value different is seen at the logits."""
    ctx = prefilled(model, cache, 2 * PAGE)
    other = ctx.fork()
    kv, tokens = other.read(PAGE, PAGE + 1)
    kv[0, 0, 0] += 0.5
    other.overwrite(PAGE, tokens, kv)
    assert not np.array_equal(model.decode(other, 9), model.decode(ctx, 9))


@pytest.mark.parametrize("other_page", [3, 5, 64])
def test_same_values_in_another_page_size_continue_exactly(model, cache, other_page):
    """The forward pass does not depend on the page size: the same stored values give the same logits."""
    if cache.precision == "q8":
        pytest.skip("re-encoding q8 reads is not lossless; snapshot restore covers q8 across page sizes")
    ctx = prefilled(model, cache, 2 * PAGE + 1)
    values, tokens = ctx.read()
    other = Cache(CONFIG.layout, page_tokens=other_page, precision=cache.precision).allocate()
    other.extend(tokens, values)
    assert_same(continue_with(model, other, CONTINUATION), continue_with(model, ctx, CONTINUATION))


@pytest.mark.parametrize("restore_page", [PAGE, 2 * PAGE, 3])
def test_restored_snapshot_continues_exactly(model, cache, tmp_path, restore_page):
    ctx = prefilled(model, cache, 2 * PAGE + 1)
    path = tmp_path / "ctx.kvs"
    ctx.snapshot(path)
    other = Cache(CONFIG.layout, page_tokens=restore_page, precision=cache.precision,
                  store=type(cache.store).__module__.rsplit(".", 1)[-1].removesuffix("_store"))
    restored = other.restore(path)
    assert_same(continue_with(model, restored, CONTINUATION), continue_with(model, ctx, CONTINUATION))


# -- the layer-major read the model uses -------------------------------------------------

@pytest.mark.parametrize("start,stop", [(0, 13), (3, 9), (4, 8), (5, 5), (12, 13)])
def test_read_layer_equals_read(cache, start, stop):
    model = MODELS["numpy"]
    ctx = prefilled(model, cache, 13)
    values, _ = ctx.read(start, stop)
    for layer in range(CONFIG.n_layer):
        k, v = ctx.read_layer(layer, start, stop)
        assert np.array_equal(np.asarray(k), values[:, layer, 0])
        assert np.array_equal(np.asarray(v), values[:, layer, 1])


def test_read_layer_gathers_while_it_owns_the_context(cache, monkeypatch):
    """The parts are views of the pages: copying them after letting go of the context would let
    its next owner rewrite (or free and recycle) those pages mid-copy."""
    ctx = prefilled(MODELS["numpy"], cache, 9)
    gather, owned = cache.store.gather, []

    def watching_gather(parts, shape):
        owned.append(ctx._use == threading.get_ident())      # held, by this thread
        return gather(parts, shape)

    monkeypatch.setattr(cache.store, "gather", watching_gather)
    ctx.read_layer(0, 0, 9)
    assert owned == [True, True]


def test_read_layer_refuses_bad_layers_and_ranges(cache):
    model = MODELS["numpy"]
    ctx = prefilled(model, cache, 5)
    for bad in (-1, CONFIG.n_layer, True):
        with pytest.raises(PositionError):
            ctx.read_layer(bad)
    with pytest.raises(PositionError):
        ctx.read_layer(0, 2, 9)


def test_model_refuses_bad_input_and_writes_nothing(model, cache):
    ctx = prefilled(model, cache, 5)
    with pytest.raises(TokenError):
        model.decode(ctx, CONFIG.vocab_size)
    with pytest.raises(PositionError):
        model.prefill(ctx, [0] * CONFIG.n_positions)
    wrong = Cache(GPT2Config.tiny(n_layer=3).layout).allocate()
    with pytest.raises(ConfigError):
        model.decode(wrong, 1)
    assert len(ctx) == 5 and len(wrong) == 0
