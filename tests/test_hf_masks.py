"""kvstate.hf reads left padding from every attention mask a forward may be given, or refuses it.

kvstate keeps a row's real positions only, so it must know which new positions are padding. It read
that from a 2-D mask alone: a 4-D mask ``(batch, 1 or heads, queries, keys)``, as a caller may pass to
``model(...)`` (bool, or additive float), or a dict of them per layer type (as transformers 5 builds for
some models), was read as "no padding", and the padding went into the row as tokens. The batch's logits
stayed equal (the mask hid it), but the row continued alone, or retained and matched, attended to it:
0.03 (GPT-2) to 0.12 (Llama) off DynamicCache's logits, with no error. A mask that cannot be read (dict
entries that disagree, another rank or shape, an unknown type) is now refused by name, nothing changed.
"""

import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'kvstate[hf]')")
torch = pytest.importorskip("torch")

from transformers import DynamicCache  # noqa: E402
from transformers.masking_utils import eager_mask, sdpa_mask  # noqa: E402

hf = pytest.importorskip("kvstate.hf")
from kvstate.spec.errors import ShapeError, TokenError  # noqa: E402

VOCAB = 97
PAD = 3             # row 1's left padding in every prompt here
MODELS = {}


def model_of(kind: str):
    if kind not in MODELS:
        torch.manual_seed(0)
        if kind == "gpt2":
            config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                             bos_token_id=0, eos_token_id=0)
        else:
            family = transformers.Qwen2Config if kind == "qwen2" else transformers.LlamaConfig
            config = family(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                            bos_token_id=0, eos_token_id=0)
        MODELS[kind] = transformers.AutoModelForCausalLM.from_config(config).eval()
    return MODELS[kind]


def padded(seed: int = 1, width: int = 7):
    """Two rows, the second left-padded by PAD: ids, 2-D mask, and position ids as generate makes them."""
    prompt = torch.from_numpy(np.random.default_rng(seed).integers(1, VOCAB, (2, width)))
    prompt[1, :PAD] = 0
    mask = torch.ones((2, width), dtype=torch.long)
    mask[1, :PAD] = 0
    return prompt, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def four_d(mask, queries: int, kind: str):
    """The 4-D mask of a forward of ``queries`` new positions over ``mask``'s keys: transformers' own
    (``sdpa_mask``: bool; ``eager_mask``: float, the dtype's lowest), or by hand (causal and padding,
    -inf where masked; bool with a copy per head)."""
    batch, keys = mask.shape
    if kind == "bool":
        return sdpa_mask(batch_size=batch, q_length=queries, kv_length=keys, q_offset=keys - queries,
                         attention_mask=mask.bool(), allow_is_causal_skip=False)
    if kind == "float":
        return eager_mask(batch_size=batch, q_length=queries, kv_length=keys, q_offset=keys - queries,
                          attention_mask=mask.bool(), dtype=torch.float32)
    causal = torch.arange(keys)[None, :] <= torch.arange(keys - queries, keys)[:, None]
    attends = causal[None, None] & mask.bool()[:, None, None, :]
    if kind == "heads":
        return attends.expand(batch, 4, queries, keys).contiguous()
    return torch.zeros(attends.shape).masked_fill(~attends, float("-inf"))


def forward(model, cache, ids, mask, positions):
    with torch.no_grad():
        return model(ids, attention_mask=mask, position_ids=positions, cache=cache).logits


def unpadded_row(model, cache: DynamicCache, row: int) -> DynamicCache:
    """Row ``row`` of a DynamicCache on its own, its padding cut: what a row taken out should hold."""
    cache.batch_select_indices(torch.tensor([row]))
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, PAD:].contiguous(), layer.values[:, :, PAD:].contiguous()
    return cache


def state(cache):
    """What a refused forward must leave as it was."""
    return ([ctx.tokens for ctx in cache.rows], list(cache.pads), cache.get_seq_length(),
            cache.kv.stats()["live_pages"])


def check_as_dynamic_cache(model, make_mask):
    """A left-padded batch through a kvstate cache and a DynamicCache, each forward given
    ``make_mask(2-D mask, queries)``: the batch's logits equal, row 1 holds its tokens only, and
    row 1 continued alone (and matched from the prefix tree) equals DynamicCache's row 1."""
    prompt, mask, positions = padded()
    ours = hf.KVStateCache.for_model(model, page_tokens=4)
    theirs = DynamicCache(config=model.config)
    assert torch.equal(forward(model, ours, prompt, make_mask(mask, 7), positions),
                       forward(model, theirs, prompt, make_mask(mask, 7), positions))
    assert ours.pads == [0, PAD] and ours.rows[1].tokens == prompt[1, PAD:].tolist()
    step = torch.tensor([[5], [6]])
    longer = torch.cat([mask, torch.ones((2, 1), dtype=torch.long)], dim=1)
    alone_theirs = DynamicCache(config=model.config)
    forward(model, alone_theirs, prompt, make_mask(mask, 7), positions)
    alone_ours = ours.row(1)
    assert torch.equal(forward(model, ours, step, make_mask(longer, 1), positions[:, -1:] + 1),
                       forward(model, theirs, step, make_mask(longer, 1), positions[:, -1:] + 1))
    unpadded_row(model, alone_theirs, 1)
    for t in range(2):          # row 1 on its own: no mask, nothing of the padding
        token, at = torch.tensor([[7 + t]]), positions[1:, -1:] + 1 + t
        assert torch.equal(forward(model, alone_ours, token, None, at), forward(model, alone_theirs, token, None, at))
    alone_ours.retain()
    fresh = hf.KVStateCache.for_model(model, ours.kv)
    assert fresh.match(prompt[1, PAD:].tolist() + [7, 8, 9]) == 6      # its 4 tokens, then 7 and 8
    for cache in (ours, alone_ours, fresh):
        cache.close()


@pytest.mark.parametrize("kind", ["bool", "float", "inf", "heads"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_4d_mask_with_left_padding_equals_dynamic_cache(family, kind):
    """transformers' 4-D masks (bool, float at the dtype's lowest) and hand-made ones (-inf, one per
    head): the padding is read from each, and never enters row 1."""
    check_as_dynamic_cache(model_of(family), lambda mask, queries: four_d(mask, queries, kind))


def test_a_dict_of_masks_per_layer_type_is_read():
    """Qwen2's forward takes a dict of masks per layer type, used as they are: each entry is read."""
    check_as_dynamic_cache(model_of("qwen2"), lambda mask, queries: {"full_attention": four_d(mask, queries, "bool")})


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_a_prefill_in_chunks_reads_each_chunks_4d_mask(kind):
    """Row 1's first chunk is padding only and its second starts with more: each chunk's mask is read
    at the keys where its positions start (past the held padding), and the tokens' logits are
    DynamicCache's. (At a padding position itself, an additive mask at the dtype's lowest, not -inf,
    averages the padding's values, which kvstate shows as zeros: that position's logits, which mean
    nothing, differ, with a 2-D mask under eager attention as well.)"""
    model = model_of("llama")
    prompt, mask, positions = padded()
    logits = []
    for cache in (hf.KVStateCache.for_model(model, page_tokens=4), DynamicCache(config=model.config)):
        logits.append([forward(model, cache, prompt[:, :2], four_d(mask[:, :2], 2, kind), positions[:, :2]),
                       forward(model, cache, prompt[:, 2:], four_d(mask, 5, kind), positions[:, 2:])])
        if isinstance(cache, hf.KVStateCache):
            assert cache.pads == [0, PAD] and cache.rows[1].tokens == prompt[1, PAD:].tolist()
            cache.close()
    (first, second), (first_theirs, second_theirs) = logits
    assert torch.equal(first[0], first_theirs[0])
    assert torch.equal(second[0], second_theirs[0]) and torch.equal(second[1, 1:], second_theirs[1, 1:])
    if kind == "bool":
        assert torch.equal(second, second_theirs)


def unreadable(mask, queries: int) -> dict:
    """Masks of a forward of ``queries`` new positions over ``mask``'s keys that kvstate cannot read
    padding from, each with words its refusal must hold."""
    full = four_d(mask, queries, "bool")
    last = mask.shape[1] - 1                      # the key of the last new position, a token in both rows
    other = full.clone()
    other[0, :, :, last] = False                  # row 0's last position padding in one entry only
    heads = full.expand(2, 4, queries, last + 1).clone()
    heads[1, 2, -1, last] = False                 # one head says row 1's last position is padding
    biased = four_d(mask, queries, "float")
    biased[1, 0, -1, last] = -5.0                 # neither plainly masked nor plainly attended
    seen = full.clone()
    seen[1, 0, -1, 0] = True                      # row 1's last token attends to its padding
    return {
        "a dict whose entries disagree": ({"full_attention": full, "sliding_attention": other}, "disagree"),
        "an empty dict": ({}, "empty dict"),
        "a 3-D mask": (full[:, 0], "shape"),
        "a 4-D integer mask": (full.long(), "dtype"),
        "a 4-D mask over fewer queries": (full[:, :, -1:], "does not cover"),
        "a 4-D mask for another batch size": (torch.cat([full, full[:1]]), "does not cover"),
        "heads that disagree": (heads, "heads disagree"),
        "an additive bias on the diagonal": (biased, "neither plainly masks"),
        "padding shown to a token": (seen, "padding position"),
        "a mask of an unknown type": (mask.tolist(), "type list"),
    }


CASES = list(unreadable(padded()[1], 7))


@pytest.mark.parametrize("case", CASES)
def test_an_unreadable_mask_is_refused_and_changes_nothing(case):
    """Refused by name in the forward's pre-hook, before any K/V: a batch cache that holds rows keeps
    them as they were, and a one-row cache does not grow to the batch; both go on exactly after. On
    Qwen2, whose forward takes a dict of masks per layer type as well as a tensor."""
    model = model_of("qwen2")
    prompt, mask, positions = padded()
    held = hf.KVStateCache.for_model(model, page_tokens=4)
    forward(model, held, prompt[:, :4], mask[:, :4], positions[:, :4])
    empty = hf.KVStateCache.for_model(model, held.kv)
    for cache, ids, at in ((held, prompt[:, 4:], positions[:, 4:]), (empty, prompt, positions)):
        bad, words = unreadable(mask, ids.shape[1])[case]
        before = state(cache)
        with pytest.raises(ShapeError, match="attention_mask") as refused:
            forward(model, cache, ids, bad, at)
        assert words in str(refused.value) and "2-D attention mask" in str(refused.value)
        assert state(cache) == before and cache.batch_size == len(before[0])
    theirs = DynamicCache(config=model.config)
    forward(model, theirs, prompt[:, :4], mask[:, :4], positions[:, :4])
    assert torch.equal(forward(model, held, prompt[:, 4:], mask, positions[:, 4:]),
                       forward(model, theirs, prompt[:, 4:], mask, positions[:, 4:]))
    assert held.pads == [0, PAD]
    for cache in (held, empty):
        cache.close()


def test_a_2d_mask_that_shows_held_padding_is_refused():
    """A row's held padding is shown to attention as zeros; a later 2-D mask marking it 1 made a
    kvstate row attend to zeros where DynamicCache attends to the pad token's K/V (0.09 off, no error)."""
    model = model_of("llama")
    prompt, mask, positions = padded()
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    forward(model, cache, prompt, mask, positions)
    before = state(cache)
    with pytest.raises(ShapeError, match="holds 3 positions of left padding"):
        forward(model, cache, torch.tensor([[5], [6]]), torch.ones((2, 8), dtype=torch.long), positions[:, -1:] + 1)
    assert state(cache) == before
    cache.close()


@pytest.mark.parametrize("width", [1, 7, 9])
def test_a_2d_mask_not_as_wide_as_the_held_and_new_positions_is_refused(width):
    """transformers pads a narrower 2-D mask with zeros on the right and reads a wider one from its
    first column; kvstate read the last columns as the new positions. A decode step given a mask for
    its new column only (width 1) let GPT-2's row 1 attend to its padding in DynamicCache and to zeros
    here (0.02 off, no error). Refused by name, nothing changed; the step with the full mask is exact."""
    model = model_of("gpt2")
    prompt, mask, positions = padded()
    ours, theirs = hf.KVStateCache.for_model(model, page_tokens=4), DynamicCache(config=model.config)
    forward(model, ours, prompt, mask, positions)
    forward(model, theirs, prompt, mask, positions)
    step, at, before = torch.tensor([[5], [6]]), positions[:, -1:] + 1, state(ours)
    with pytest.raises(ShapeError, match="7 held positions and 1 new one"):
        forward(model, ours, step, torch.ones((2, width), dtype=torch.long), at)
    assert state(ours) == before
    full = torch.cat([mask, torch.ones((2, 1), dtype=torch.long)], dim=1)
    assert torch.equal(forward(model, ours, step, full, at), forward(model, theirs, step, full, at))
    ours.close()


def test_check_prefix_of_reads_a_4d_mask():
    """generate's prompt check reads the padding of a 4-D mask as of a 2-D one: a prompt whose mask
    marks as padding what the cache holds as tokens is refused, one padded as the cache is passes, and
    an unreadable mask is refused by name (it was read as no padding at all)."""
    model = model_of("llama")
    prompt, mask, positions = padded()
    longer = torch.cat([prompt, torch.tensor([[5], [6]])], dim=1)
    longer_mask = torch.cat([mask, torch.ones((2, 1), dtype=torch.long)], dim=1)
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    forward(model, cache, prompt, mask, positions)
    cache.check_prefix_of(longer, four_d(longer_mask, 8, "bool"))       # padded as the cache is
    cache.check_prefix_of(longer, four_d(longer_mask, 8, "float"))
    unpadded = hf.KVStateCache.for_model(model, cache.kv)
    forward(model, unpadded, prompt, torch.ones_like(mask), None)    # row 1's leading zeros held as tokens
    with pytest.raises(TokenError, match="row 1"):
        unpadded.check_prefix_of(longer, four_d(longer_mask, 8, "bool"))
    with pytest.raises(ShapeError, match="attention_mask"):
        unpadded.check_prefix_of(longer, four_d(longer_mask, 8, "bool")[:, 0])
    for each in (cache, unpadded):
        each.close()


def _not_causal(kind: str, past: int, n: int):
    """A 4-D additive mask over ``past + n`` keys for ``n`` new positions of one row, causal but for one
    change: packed documents (the second half sees none of the first), a tree (a token not seeing its
    sibling before it), or a bidirectional prompt (every token sees every other)."""
    keys, low = past + n, torch.finfo(torch.float32).min
    mask = torch.full((1, 1, n, keys), low)
    for i in range(n):
        mask[0, 0, i, :past + i + 1] = 0
    if kind == "packed":
        mask[0, 0, n // 2:, :past + n // 2] = low
    elif kind == "tree":
        mask[0, 0, n - 1, past + n - 2] = low
    else:
        mask[0, 0] = 0
    return mask


@pytest.mark.parametrize("kind", ["packed", "tree", "bidirectional"])
@pytest.mark.parametrize("past", [0, 5])
def test_a_mask_not_causal_over_a_rows_tokens_is_refused_and_changes_nothing(kind, past):
    """An outside audit (s69): a 4-D mask for packed documents, a tree of drafts or a bidirectional prompt was
    accepted and its K/V stored as the tokens' own; retained, every later request hitting that prefix got
    other logits than transformers' (0.49 off, generated ids differing from the second token on), no error."""
    model = model_of("llama")
    ids = torch.from_numpy(np.random.default_rng(past).integers(1, VOCAB, (1, past + 6)))
    cache = hf.KVStateCache.for_model(model, page_tokens=4, match="token")
    if past:
        model(ids[:, :past], cache=cache)
    before = state(cache)
    with pytest.raises(ShapeError, match="each token must attend to every earlier token of its row"):
        model(ids[:, past:], attention_mask=_not_causal(kind, past, 6), cache=cache)
    assert state(cache) == before
    causal = torch.full((1, 1, 6, past + 6), torch.finfo(torch.float32).min).triu(past + 1)
    theirs = DynamicCache(config=model.config)
    if past:
        model(ids[:, :past], cache=theirs)
    assert torch.equal(model(ids[:, past:], attention_mask=causal, cache=cache).logits,
                       model(ids[:, past:], attention_mask=causal, cache=theirs).logits)
    cache.close()


def test_a_2d_mask_with_a_hole_over_a_held_token_is_refused():
    """The same audit: a 2-D mask marking one of a row's held tokens 0 was stored (``generate`` refuses it;
    a direct forward did not), and a later hit of that prefix was 0.006 off transformers' logits."""
    model = model_of("llama")
    ids = torch.from_numpy(np.random.default_rng(2).integers(1, VOCAB, (1, 9)))
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    model(ids[:, :6], cache=cache)
    before = state(cache)
    holed = torch.ones((1, 9), dtype=torch.long)
    holed[0, 2] = 0
    with pytest.raises(ShapeError, match="marks key 2 of row 0 0, one of the tokens it holds"):
        model(ids[:, 6:], attention_mask=holed, cache=cache)
    assert state(cache) == before
    cache.close()


@pytest.mark.parametrize("low", [-1e9, -1e4, -65504.0])
def test_a_causal_mask_built_with_a_large_negative_value_is_accepted_and_exact(low):
    """The s69 mask audit: a float32 causal mask masking with -1e9, -1e4 or float16's lowest leaves those keys no
    weight (transformers' logits equal an unmasked causal run's), yet the causality check, reading only -inf or
    the dtype's lowest as masked, refused it."""
    model = model_of("llama")
    ids = torch.from_numpy(np.random.default_rng(4).integers(1, VOCAB, (1, 6)))
    mask = torch.full((1, 1, 6, 6), low).triu(1)
    ours, theirs = hf.KVStateCache.for_model(model, page_tokens=4), DynamicCache(config=model.config)
    assert torch.equal(model(ids, attention_mask=mask, cache=ours).logits,
                       model(ids, attention_mask=mask, cache=theirs).logits)
    assert ours.get_seq_length() == 6
    ours.close()


def test_a_bool_4d_mask_under_eager_attention_is_refused():
    """The same audit: eager attention adds a bool mask to its scores (True as +1), so it masks nothing, and the K/V
    of every token seeing every other were stored as the tokens' own; kvstate read the mask as causal."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=0)
    eager = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    ids = torch.from_numpy(np.random.default_rng(5).integers(1, VOCAB, (1, 6)))
    causal = torch.ones((1, 1, 6, 6), dtype=torch.bool).tril()
    cache = hf.KVStateCache.for_model(eager, page_tokens=4)
    with pytest.raises(ShapeError, match="eager attention adds to its scores"):
        eager(ids, attention_mask=causal, cache=cache)
    assert cache.get_seq_length() == 0
    sdpa = model_of("llama")                        # sdpa reads a bool mask as kvstate does: accepted
    other = hf.KVStateCache.for_model(sdpa, page_tokens=4)
    sdpa(ids, attention_mask=causal, cache=other)
    assert other.get_seq_length() == 6
    cache.close()
    other.close()


@pytest.mark.parametrize("as_tensor", [True, False])
def test_the_causal_check_reads_a_row_whose_tokens_are_not_consecutive(as_tensor):
    """The causal check reads a row's consecutive tokens as a slice of the mask and gathers them otherwise
    (a hole: new position 2 padding here, which ``real_positions`` reports and ``new_padding`` then refuses
    by name): a mask letting a token see a later one is refused on that path too."""
    from kvstate.hf_rows import real_positions

    low, n = torch.finfo(torch.float32).min, 6
    causal = torch.full((1, 1, n, n), low).triu(1)
    causal[:, :, :, 2] = low        # position 2 is padding: masked for every query, itself included
    assert real_positions(causal if as_tensor else causal.numpy(), 1, n, past=0).tolist() == [
        [True, True, False, True, True, True]]
    peeking = causal.clone()
    peeking[0, 0, 3, 4] = 0         # token 3 attends to token 4, after it
    with pytest.raises(ShapeError, match="row 0's token at new position 3 attend to key 4"):
        real_positions(peeking if as_tensor else peeking.numpy(), 1, n, past=0)


def _hrm_text():
    if not hasattr(transformers, "HrmTextConfig"):
        pytest.skip("this transformers has no HrmText")
    torch.manual_seed(0)
    config = transformers.HrmTextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                        num_layers_per_stack=2, num_attention_heads=4, head_dim=8, H_cycles=1,
                                        L_cycles=1, pad_token_id=0)
    return transformers.HrmTextForCausalLM(config).eval()


@pytest.mark.parametrize("kind", ["gpt2", "hrm_text"])
def test_token_type_ids_are_refused_before_the_forward(kind):
    """Outside audits (s69): GPT-2's ``token_type_ids`` add their embedding to the K/V (zeros included), which were
    stored as the tokens' own (a later hit 0.008 off transformers' logits); HrmText, a prefix-LM model, lets a
    prompt's type-1 tokens see each other only while its cache holds nothing, which a kvstate cache never said, so
    the prompt ran causal (0.0025 off). Both are refused by name, in a forward and in ``generate``, changing
    nothing; without them each model's logits are transformers' own."""
    model = _hrm_text() if kind == "hrm_text" else model_of("gpt2")
    prompt = torch.from_numpy(np.random.default_rng(3).integers(1, VOCAB, (1, 7)))
    types = torch.zeros_like(prompt) if kind == "gpt2" else torch.ones_like(prompt)
    cache = hf.KVStateCache.for_model(model, page_tokens=4, match="token")
    model(prompt[:, :3], cache=cache)
    before = state(cache)
    with pytest.raises(TokenError, match="token_type_ids change the K/V"):
        model(prompt[:, 3:], token_type_ids=types[:, 3:], cache=cache)
    assert state(cache) == before
    fresh = hf.KVStateCache.for_model(model, page_tokens=4)
    with pytest.raises(TokenError, match="token_type_ids change the K/V"):
        model.generate(prompt, token_type_ids=types, cache=fresh, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert fresh.get_seq_length() == 0 and fresh.kv.stats()["live_pages"] == 0
    with torch.no_grad():
        ours = model(prompt[:, 3:], cache=cache).logits
        theirs = DynamicCache(config=model.config)
        model(prompt[:, :3], cache=theirs)
        assert torch.equal(ours, model(prompt[:, 3:], cache=theirs).logits)
    for each in (cache, fresh):
        each.close()


def _own_positions(mask):
    return (mask.cumsum(-1) - 1).clamp(min=0)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_padded_forward_runs_at_each_rows_own_positions_or_is_refused(kind):
    """An outside audit (s70): a direct forward of a left-padded batch given no position_ids was stored, though
    transformers had numbered its positions padding included (``cache_position``): a hit on the padded row, or
    the row continued alone, was 9e-4 (Llama) to 1.4e-2 (GPT-2) off its logits. Such a forward is refused by
    name, changing nothing; given each row's own positions, as ``generate`` gives them, the batch equals
    DynamicCache's and a later hit on the padded row is within rounding of the row alone. Positions other than a row's own are refused
    too (audit D, s69: ``arange + 100`` stored, a hit 0.002-0.005 off)."""
    model = model_of(kind)
    rng = np.random.default_rng(11)
    prompt = torch.from_numpy(rng.integers(1, VOCAB, (2, 8)))
    prompt[1, :2] = 0
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0
    cache = hf.KVStateCache.for_model(model, page_tokens=4, match="token")
    before = state(cache)
    with pytest.raises(ShapeError, match="given no position_ids"):
        model(prompt, attention_mask=mask, cache=cache)
    assert state(cache) == before
    with pytest.raises(ShapeError, match="position_ids put row 0's token at new position 0 at position 100"):
        model(prompt[:1], position_ids=torch.arange(8)[None] + 100, cache=cache)
    assert state(cache) == before
    with torch.no_grad():
        ours = model(prompt, attention_mask=mask, position_ids=_own_positions(mask), cache=cache).logits
        theirs = model(prompt, attention_mask=mask, position_ids=_own_positions(mask),
                       cache=DynamicCache(config=model.config)).logits
        assert torch.equal(ours, theirs)
        cache.row(1).retain()                       # the padded row's 6 tokens
        request = torch.cat([prompt[1:, 2:], torch.from_numpy(rng.integers(1, VOCAB, (1, 3)))], dim=1)
        hit = hf.KVStateCache.for_model(model, cache.kv)
        assert hit.match(request) == 6
        served = model(request[:, 6:], cache=hit).logits
        alone = DynamicCache(config=model.config)
        model(request[:, :6], cache=alone)
        # Not bit-equal, and no DynamicCache run is: the row's K/V were computed beside two masked padding
        # keys, a softmax over more terms (transformers' own padded row against the row alone: ~6e-8).
        assert (served - model(request[:, 6:], cache=alone).logits).abs().max() < 1e-6
    for each in (cache, hit):
        each.close()


def _tiny(kind: str):
    torch.manual_seed(0)
    if kind == "bloom":
        return transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2,
                                                                      n_head=4)).eval()
    if kind == "mpt":
        return transformers.MptForCausalLM(transformers.MptConfig(vocab_size=VOCAB, d_model=32, n_layers=2,
                                                                  n_heads=4, max_seq_len=64)).eval()
    if kind == "opt":
        return transformers.OPTForCausalLM(transformers.OPTConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
            word_embed_proj_dim=32, max_position_embeddings=64, pad_token_id=0)).eval()
    return transformers.RoFormerForCausalLM(transformers.RoFormerConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, is_decoder=True)).eval()


@pytest.mark.parametrize("kind", ["bloom", "mpt", "opt"])
def test_a_model_placing_a_padded_row_at_its_own_positions_runs_without_position_ids(kind):
    """ALiBi models (BLOOM, MPT: K/V that do not depend on where a row sits) and OPT (its positions from the mask's
    cumulative sum) compute a padded row at its own positions given no position_ids: not refused (the reviews of
    s70: OPT and MPT were), and exact. OPT's given position_ids are checked: ones past a row's own are refused."""
    model = _tiny(kind)
    prompt = torch.from_numpy(np.random.default_rng(12).integers(1, VOCAB, (2, 7)))
    mask = torch.ones_like(prompt)
    mask[0, :3] = 0
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    with torch.no_grad():
        assert torch.equal(model(prompt, attention_mask=mask, cache=cache).logits,
                           model(prompt, attention_mask=mask, cache=DynamicCache(config=model.config)).logits)
    assert cache.pads == [3, 0]
    if kind == "opt":
        with torch.no_grad(), pytest.raises(ShapeError, match="at position 12, but kvstate keeps it as that row's "
                                                               "position 4"):
            model(prompt[:, :1], attention_mask=torch.cat([mask, torch.ones((2, 1), dtype=mask.dtype)], 1),
                  position_ids=torch.tensor([[12], [12]]), cache=cache)
    cache.close()


def test_a_padded_forward_of_a_model_taking_no_position_ids_that_counts_the_padding_is_refused():
    """RoFormer numbers positions from the cache's length, padding included, and takes no position_ids, so a
    padded row cannot be computed at its own positions (the review of s70: accepted, a hit 1.6e-5 off)."""
    model = _tiny("roformer")
    prompt = torch.from_numpy(np.random.default_rng(13).integers(1, VOCAB, (2, 7)))
    mask = torch.ones_like(prompt)
    mask[0, :3] = 0
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    before = state(cache)
    with torch.no_grad(), pytest.raises(ShapeError, match="taking no position_ids"):
        model(prompt, attention_mask=mask, cache=cache)
    with torch.no_grad(), pytest.raises(ShapeError, match="taking no position_ids"):    # ignored: its **kwargs
        model(prompt, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), cache=cache)
    assert state(cache) == before
    with torch.no_grad():       # unpadded, it runs
        assert torch.equal(model(prompt, cache=cache).logits, model(prompt, cache=DynamicCache(config=model.config)).logits)
    cache.close()


def test_a_generate_that_feeds_held_tokens_again_is_refused_and_changes_nothing():
    """transformers' prompt-lookup (and assisted) generate, on a cache already holding part of the prompt, feeds
    the whole prompt again from position 0 and appends it (a DynamicCache ends up holding it twice): kvstate
    would keep those K/V at positions other than their own, so a later hit served them wrongly. Refused by name
    (the review of s70's matrix); on a cache holding nothing it runs and equals DynamicCache."""
    model = model_of("llama")
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    lookup = dict(max_new_tokens=6, min_new_tokens=6, pad_token_id=0, do_sample=False, prompt_lookup_num_tokens=3)
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    with torch.no_grad():
        ours = model.generate(prompt, cache=cache, **lookup)
        assert torch.equal(ours, model.generate(prompt, cache=DynamicCache(config=model.config), **lookup))
        before = state(cache)
        with pytest.raises(ShapeError, match="this forward feeds again tokens the row holds"):
            model.generate(torch.cat([ours, torch.tensor([[9, 10]])], 1), cache=cache, **lookup)
    assert state(cache) == before
    cache.close()
