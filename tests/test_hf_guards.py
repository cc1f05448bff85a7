"""kvstate.hf's guards, from an audit acting as an agent runtime.

Which model's K/V a kvstate cache holds: a model whose weights changed (a deep copy loaded with
others, the bound model itself reloaded or edited in place, weights differing only past their first
values) is refused by name, and weights kvstate cannot read (the ``meta`` device) make a model match
no other.
"""

import copy

import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'kvstate[hf]')")
torch = pytest.importorskip("torch")

from transformers import DynamicCache  # noqa: E402

from kvstate import Cache  # noqa: E402

hf = pytest.importorskip("kvstate.hf")
from kvstate.spec.errors import UnsupportedModelError  # noqa: E402

VOCAB = 97


def config(layers=2):
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                     bos_token_id=0, eos_token_id=0)


def llama(seed=0):
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config()).eval()


def ids(n, seed):
    return torch.from_numpy(np.random.default_rng(seed).integers(1, VOCAB, (1, n)))


def run(model, cache, *chunks):
    with torch.no_grad():
        return [model(chunk, cache=cache).logits for chunk in chunks]


GREEDY = dict(do_sample=False, pad_token_id=0)


# -- which model's K/V -----------------------------------------------------------------------------

def test_a_deep_copy_loaded_with_other_weights_is_another_model():
    """The fingerprint was kept on the model object, so a deep copy of an attached model carried it
    over: loaded with other weights, the copy continued the original's cache on them."""
    model = llama()
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    run(model, cache, ids(5, 60))
    twin = copy.deepcopy(model)
    twin.load_state_dict(llama(seed=1).state_dict())
    with pytest.raises(UnsupportedModelError, match="another model"):
        run(twin, cache, ids(1, 61))
    with pytest.raises(UnsupportedModelError, match="another model"):
        hf.KVStateCache.for_model(twin, kv=cache.kv)
    assert len(cache.context) == 5
    same = copy.deepcopy(model)                     # a copy with the same weights is the same model
    run(same, cache, ids(1, 62))
    assert len(cache.context) == 6
    cache.close()


def test_the_bound_model_reloaded_or_edited_in_place_is_refused_until_its_weights_are_back():
    """The model that computed a cache's K/V, given other weights (``load_state_dict``, an in-place
    edit), kept its first fingerprint and continued the old weights' K/V with the new ones: wrong
    logits, no error. Now refused by name before any work; with its old weights back it goes on
    exactly, and a new kvstate cache serves the new weights."""
    model = llama()
    original = {name: value.clone() for name, value in model.state_dict().items()}
    cache, dynamic = hf.KVStateCache.for_model(model, page_tokens=4), DynamicCache(config=model.config)
    out = model.generate(ids(6, 63), cache=cache, max_new_tokens=2, **GREEDY)
    assert torch.equal(out, model.generate(ids(6, 63), cache=dynamic, max_new_tokens=2, **GREEDY))
    held = len(cache.context)
    turn = torch.cat([out, ids(3, 64)], dim=1)
    model.load_state_dict(llama(seed=1).state_dict())
    with pytest.raises(UnsupportedModelError, match="weights changed"):
        model.generate(turn, cache=cache, max_new_tokens=2, **GREEDY)
    with pytest.raises(UnsupportedModelError, match="weights changed"):
        hf.KVStateCache.for_model(model, kv=cache.kv)
    fresh = hf.KVStateCache.for_model(model, page_tokens=4)    # the new weights: a new kvstate cache
    run(model, fresh, ids(4, 65))
    fresh.close()
    model.load_state_dict(original)
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight.mul_(2)      # an in-place edit of one weight
    with pytest.raises(UnsupportedModelError, match="weights changed"):
        run(model, cache, ids(1, 66))
    assert len(cache.context) == held and cache.get_seq_length() == held
    model.load_state_dict(original)
    args = dict(max_new_tokens=3, output_logits=True, return_dict_in_generate=True, **GREEDY)
    mine, theirs = model.generate(turn, cache=cache, **args), model.generate(turn, cache=dynamic, **args)
    assert torch.equal(mine.sequences, theirs.sequences)
    assert all(torch.equal(a, b) for a, b in zip(mine.logits, theirs.logits))
    cache.close()


def test_weights_that_differ_only_past_their_first_values_are_another_model():
    """The fingerprint hashed each parameter's first four values: a model whose weights differ after
    them (a fine-tune that left some rows as they were) passed for the cache's model."""
    model = llama()
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    run(model, cache, ids(5, 67))
    other = copy.deepcopy(llama())
    with torch.no_grad():
        for param in other.parameters():
            flat = param.view(-1)
            flat[flat.numel() // 2:] += 0.25
    with pytest.raises(UnsupportedModelError, match="another model"):
        hf.KVStateCache.for_model(other, kv=cache.kv)
    with pytest.raises(UnsupportedModelError, match="another model"):
        run(hf.attach(other), cache, ids(1, 68))
    assert len(cache.context) == 5
    cache.close()


def test_weights_on_the_meta_device_match_no_other_model():
    """Offloaded weights (the ``meta`` device, as accelerate leaves them) have no values to hash: two
    such models of one config hashed the same, and each passed for the other. Now such a model is
    fingerprinted without reading them and matches itself only. A model whose weights are inference
    tensors (built under ``torch.inference_mode``, with no version counter) is fingerprinted too."""
    with torch.device("meta"):
        first = transformers.AutoModelForCausalLM.from_config(config())
        second = transformers.AutoModelForCausalLM.from_config(config())
    layout = hf.layout_of(first)
    kv = Cache(layout, store="numpy")
    hf.KVStateCache.for_model(first, kv=kv).close()
    hf.bind_model(first, kv)                                # itself, again
    with pytest.raises(UnsupportedModelError, match="another model"):
        hf.KVStateCache.for_model(second, kv=kv)
    real = llama()
    cache = hf.KVStateCache.for_model(real, page_tokens=4)
    run(real, cache, ids(4, 69))
    halves = [copy.deepcopy(llama()) for _ in range(2)]     # the same real weights, one layer offloaded
    for half in halves:
        half.model.layers[1].to("meta")
    with pytest.raises(UnsupportedModelError, match="another model"):
        hf.KVStateCache.for_model(halves[0], kv=cache.kv)
    other = Cache(layout, store="numpy")
    hf.bind_model(halves[0], other)
    with pytest.raises(UnsupportedModelError, match="another model"):
        hf.bind_model(halves[1], other)
    with torch.inference_mode():
        frozen = llama()
    twin = hf.KVStateCache.for_model(frozen, kv=cache.kv)   # the same weights as ``real``
    assert run(frozen, twin, ids(2, 70))[0].shape == (1, 2, VOCAB)
    twin.close()
    cache.close()
