"""What ``kvstate.hf`` takes as arguments, from an audit acting as an agent runtime.

A forward's cache and attention mask are found however they are passed (transformers' forwards take
them by position too: GPT-2's the cache second, Llama's family the mask second and the cache fourth);
an attached model's ``forward`` called directly feeds its ids as its call does; and a batch's
positions, row indices and repeat counts follow the engine's rule (ints of any width, never a bool),
each bad one refused by name with the cache as it was.
"""

import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'kvstate[hf]')")
torch = pytest.importorskip("torch")

from transformers import DynamicCache  # noqa: E402

from kvstate import TokenIds  # noqa: E402
from kvstate.spec.errors import PositionError, ShapeError, TokenError  # noqa: E402

hf = pytest.importorskip("kvstate.hf")

VOCAB = 100


def gpt2():
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(
        transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB)).eval()


def llama():
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256)).eval()


PROMPT = torch.tensor([[5, 6, 7, 8, 9]])
PADDED = torch.tensor([[0, 0, 0, 5, 6, 7], [1, 2, 3, 4, 5, 6]])
MASK = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
POSITIONS = (MASK.cumsum(-1) - 1).clamp(min=0)


def test_a_cache_passed_by_position_is_fed_as_one_passed_by_keyword():
    # GPT-2's forward is (input_ids, cache, ...): the hook read keywords only, and refused this call
    # as if the model had never been attached.
    model = gpt2()
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    with torch.no_grad():
        expected = model(PROMPT, DynamicCache()).logits
        assert torch.equal(model(PROMPT, cache).logits, expected)
    assert cache.tokens == PROMPT[0].tolist()
    cache.close()


def test_an_attention_mask_passed_by_position_keeps_the_padding_out_of_the_rows():
    # Llama's forward is (input_ids, attention_mask, position_ids, cache, ...): a mask passed by position
    # was not seen, so the left padding was stored as three real tokens of row 0.
    model = llama()
    held = {}
    for how in ("keyword", "position"):
        cache = hf.KVStateCache.for_model(model, page_tokens=4)
        with torch.no_grad():
            if how == "keyword":
                logits = model(PADDED, attention_mask=MASK, position_ids=POSITIONS, cache=cache).logits
            else:
                logits = model(PADDED, MASK, POSITIONS, cache=cache).logits
        row = cache.row(0)
        held[how] = logits, list(cache.pads), row.tokens
        row.close()
        cache.close()
    assert held["position"][1:] == held["keyword"][1:] == ([3, 0], [5, 6, 7])
    assert torch.equal(held["position"][0], held["keyword"][0])


def test_an_attached_models_forward_called_directly_feeds_its_ids_as_its_call_does():
    # README: an attached model's forward feeds and checks, ``model.forward(...)`` called directly
    # included. No hook runs there, so nothing was fed, and the call was refused as never attached.
    model = llama()
    called, direct = (hf.KVStateCache.for_model(model, page_tokens=4) for _ in range(2))
    with torch.no_grad():
        expected = model(PROMPT, cache=called).logits
        assert torch.equal(model.forward(PROMPT, cache=direct).logits, expected)
        assert torch.equal(model.forward(input_ids=PROMPT[:, :1] + 1, cache=direct).logits,
                           model(PROMPT[:, :1] + 1, cache=called).logits)
    assert direct.tokens == called.tokens == PROMPT[0].tolist() + [6]
    direct.fork().close()       # the forward is over: nothing is left held
    with torch.no_grad(), pytest.raises(TokenError, match="no input_ids"):
        model.forward(inputs_embeds=model.get_input_embeddings()(PROMPT), cache=direct)
    assert direct.tokens == called.tokens       # and that refusal left it as it was
    for cache in (called, direct):
        cache.close()


def batch_cache(model, rows=2):
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    prompt = torch.randint(1, VOCAB, (rows, 6), generator=torch.Generator().manual_seed(1))
    model.generate(prompt, attention_mask=torch.ones_like(prompt), cache=cache, max_new_tokens=3, pad_token_id=0)
    return cache


@pytest.mark.parametrize("call, value", [("truncate", False), ("truncate", True), ("truncate", 2.0),
                                         ("crop", True), ("crop", -1.0), ("crop", np.array(-1))])
def test_a_batch_refuses_a_position_that_is_no_integer_and_keeps_its_rows(call, value):
    # A batch checked ``isinstance(n, int)``: ``truncate(False)`` emptied every row, ``truncate(True)`` cut
    # each to one position, and ``crop(True)`` became a truncate to the length.
    cache = batch_cache(gpt2())
    with pytest.raises(PositionError, match="integer positions"):
        getattr(cache, call)(value)
    assert [len(row) for row in cache.rows] == [8, 8]
    cache.close()


def test_a_batch_takes_numpy_integers_as_positions_counts_and_rows():
    # ... and refused a NumPy integer, with a message saying 6 lay outside [0, 8].
    model = gpt2()
    cache = batch_cache(model)
    cache.truncate(np.int64(6))
    cache.crop(np.int32(-1))
    assert [len(row) for row in cache.rows] == [5, 5]
    row = cache.row(np.uint8(1))
    assert len(row.context) == 5
    cache.batch_repeat_interleave(np.int64(2))
    assert len(cache.rows) == 4
    for held in (row, cache):
        held.close()


@pytest.mark.parametrize("call, value", [("row", True), ("row", 1.0), ("batch_repeat_interleave", 2.5),
                                         ("batch_repeat_interleave", "2"), ("batch_repeat_interleave", True)])
def test_a_row_index_or_repeat_count_that_is_no_integer_is_refused_by_name(call, value):
    # ``row(True)`` returned row 1 and ``row(1.0)`` raised a bare TypeError; ``int(repeats)`` took 2.5 and '2' as 2.
    cache = batch_cache(gpt2())
    with pytest.raises(ShapeError, match=repr(value).replace(".", r"\.")):
        getattr(cache, call)(value)
    assert len(cache.rows) == 2
    cache.close()


def test_a_0d_integer_tensor_is_a_row_index_count_and_position_and_a_0d_bool_or_float_one_is_not():
    # From a review: ``cache.row(scores.argmax())`` (a 0-d int64 tensor) was refused as "not a row of a
    # batch of 2" once every count went through the engine's position rule, which takes no 0-d array.
    cache = batch_cache(gpt2())
    row = cache.row(torch.tensor(1))
    assert len(row.context) == 8
    cache.truncate(torch.tensor(6, dtype=torch.int32))
    cache.crop(torch.tensor(-1))
    assert [len(ctx) for ctx in cache.rows] == [5, 5]
    cache.batch_repeat_interleave(torch.tensor(2))
    assert len(cache.rows) == 4
    for value in (torch.tensor(True), torch.tensor(1.0), torch.tensor([1])):
        with pytest.raises(ShapeError, match="integer index"):
            cache.row(value)
    for value in (torch.tensor(False), torch.tensor(-1.0), torch.tensor([-1])):
        with pytest.raises(PositionError, match="integer positions"):
            cache.crop(value)
    assert len(row.tokens) == 8 and [len(ctx) for ctx in cache.rows] == [5] * 4
    single = row.row(torch.tensor(0))       # one row: truncate goes straight to the engine's context
    single.truncate(torch.tensor(3))
    assert len(single.context) == 3
    for held in (single, row, cache):
        held.close()


def test_match_refuses_a_0d_tensor_and_takes_token_ids_as_they_are():
    # A 0-d tensor was reshaped into the one-token query [5], and the cache gave up what it held for it.
    model = gpt2()
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    with torch.no_grad():
        model(PROMPT, cache=cache)
    cache.retain()
    with pytest.raises(ShapeError, match="one-dimensional"):
        cache.match(torch.tensor(5))
    assert cache.tokens == PROMPT[0].tolist()
    assert cache.match(TokenIds(PROMPT[0].tolist()) + [1, 2]) == 5
    assert cache.tokens == PROMPT[0].tolist()
    cache.close()
