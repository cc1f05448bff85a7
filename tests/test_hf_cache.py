"""kvstate.hf: a kvstate context under transformers gives DynamicCache's logits bit for bit.

Tiny random-weight models built from configs (no downloads): GPT-2, and a Llama
config with grouped-query attention (2 K/V heads for 4 query heads) and rotary
positions. Each check runs the same forward calls with the same chunking on both
caches: at f32 the logits are ``torch.equal``; at f16 and q8 they equal a
DynamicCache whose K/V went through the same precision round trip.
"""

import io
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'kvstate[hf]')")
torch = pytest.importorskip("torch")

from transformers import DynamicCache  # noqa: E402
from transformers.cache_utils import Cache as HFCache  # noqa: E402
from transformers.cache_utils import DynamicLayer  # noqa: E402

from kvstate import Cache, Layout  # noqa: E402
from kvstate.impl.batch_write import extend_rows  # noqa: E402

hf = pytest.importorskip("kvstate.hf")   # skips, naming pip install 'kvstate[hf]', without transformers 5.x
from kvstate.spec.errors import (ConfigError, ContextBusyError, ContextClosedError, ForeignContextError, ShapeError,  # noqa: E402
                                 TokenError, UnsupportedModelError)
from kvstate.spec.precision import roundtrip  # noqa: E402

VOCAB = 97
ROOT = Path(__file__).resolve().parents[1]


def build(kind: str):
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=256, n_embd=32, n_layer=3, n_head=4,
                                         bos_token_id=0, eos_token_id=0)
    else:
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=256, bos_token_id=0, eos_token_id=0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():      # random biases too, so the K/V are not trivially structured
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.05)
    return model


MODELS = {}


def llama_model():
    if "llama" not in MODELS:
        MODELS["llama"] = build("llama")
    return MODELS["llama"]


@pytest.fixture
def llama():
    """The Llama model alone, for checks whose subject is the cache, not the model family."""
    return llama_model()


@pytest.fixture(params=["gpt2", "llama"])
def model(request):
    if request.param not in MODELS:
        MODELS[request.param] = build(request.param)
    return MODELS[request.param]


class RoundTripLayer(DynamicLayer):
    """A DynamicLayer whose K/V go through a kvstate precision round trip before they are kept."""

    def __init__(self, precision):
        super().__init__()
        self.precision = precision

    def update(self, key_states, value_states, *args, **kwargs):
        def rt(x):
            return torch.from_numpy(roundtrip(self.precision, x.contiguous().numpy()))
        return super().update(rt(key_states), rt(value_states))


def reference(model, precision="f32"):
    if precision == "f32":
        return DynamicCache(config=model.config)
    return HFCache(layers=[RoundTripLayer(precision) for _ in range(model.config.num_hidden_layers)])


def ids(n, seed):
    return torch.from_numpy(np.random.default_rng(seed).integers(1, VOCAB, (1, n)))


def run(model, cache, chunks):
    """One forward per chunk; the logits of each."""
    with torch.no_grad():
        return [model(chunk, cache=cache).logits for chunk in chunks]


def steps(tokens, split):
    """A prefill of ``tokens[:split]`` then one decode step per remaining token."""
    return [tokens[:, :split]] + [tokens[:, t:t + 1] for t in range(split, tokens.shape[1])]


def assert_equal_runs(ours, theirs):
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert torch.equal(a, b), f"forward {i}: max |diff| {float((a - b).abs().max())}"


# -- exactness ---------------------------------------------------------------------------

@pytest.mark.parametrize("precision", ["f32", "f16", "q8"])
def test_prefill_and_decode_equal_dynamic_cache(model, precision):
    tokens = ids(21, 1)
    cache = hf.KVStateCache.for_model(model, page_tokens=4, precision=precision)
    assert_equal_runs(run(model, cache, steps(tokens, 13)), run(model, reference(model, precision), steps(tokens, 13)))
    assert cache.tokens == tokens[0].tolist()          # every position entered with its id
    assert cache.get_seq_length() == 21


def test_precision_reference_is_not_the_f32_run(model):
    """The f16/q8 comparison can fail: the rounded run's logits differ from the f32 run's."""
    tokens = ids(12, 2)
    q8 = run(model, hf.KVStateCache.for_model(model, precision="q8"), steps(tokens, 8))
    f32 = run(model, reference(model), steps(tokens, 8))
    assert not all(torch.equal(a, b) for a, b in zip(q8, f32))


def test_generate_equals_dynamic_cache(model):
    prompt = ids(10, 3)
    args = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        ours = model.generate(prompt, cache=hf.KVStateCache.for_model(model, page_tokens=4), **args)
        theirs = model.generate(prompt, cache=reference(model), **args)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert_equal_runs(list(ours.logits), list(theirs.logits))


# -- the agent operations -------------------------------------------------------------------

def test_fork_mid_generation_best_of_n(model):
    """Prefill once, fork four branches, sample each; each equals a DynamicCache run and shares the prompt's pages."""
    prompt = ids(18, 4)
    args = dict(max_new_tokens=6, do_sample=True, top_k=0, output_logits=True, return_dict_in_generate=True,
                pad_token_id=0)
    root = hf.KVStateCache.for_model(model, page_tokens=4)
    run(model, root, [prompt[:, :-1]])
    pages_before = root.kv.stats()["live_pages"]
    branches = [root.fork() for _ in range(4)]
    assert root.kv.stats()["live_pages"] == pages_before          # a fork copies no page
    outs = []
    for i, branch in enumerate(branches):
        torch.manual_seed(100 + i)
        with torch.no_grad():
            outs.append(model.generate(prompt, cache=branch, **args))
        expected_cache = reference(model)
        run(model, expected_cache, [prompt[:, :-1]])
        torch.manual_seed(100 + i)
        with torch.no_grad():
            expected = model.generate(prompt, cache=expected_cache, **args)
        assert torch.equal(outs[i].sequences, expected.sequences)
        assert_equal_runs(list(outs[i].logits), list(expected.logits))
    assert len({tuple(o.sequences[0].tolist()) for o in outs}) > 1     # the branches did diverge
    # The 17 prompt positions fill 4 whole pages, shared by root and every branch; each branch
    # privately holds its copy of the partly filled fifth page and its own new pages.
    shared = [p for p in root.kv.observe().pages.values() if p.refcount == 5]
    assert len(shared) == 4
    assert root.tokens == prompt[0, :-1].tolist()                 # the root is untouched by its branches


def test_branch_continuation_equals_an_independent_run(model):
    tokens = ids(24, 5)
    root = hf.KVStateCache.for_model(model, page_tokens=4)
    run(model, root, steps(tokens[:, :16], 11))
    branch = root.fork()
    sibling = root.fork()
    run(model, sibling, [ids(5, 6)])                               # a sibling writes first
    ours = run(model, branch, [tokens[:, 16:20], tokens[:, 20:21], tokens[:, 21:22]])
    alone = hf.KVStateCache.for_model(model, page_tokens=4)
    run(model, alone, steps(tokens[:, :16], 11))
    assert_equal_runs(ours, run(model, alone, [tokens[:, 16:20], tokens[:, 20:21], tokens[:, 21:22]]))
    dynamic = reference(model)
    run(model, dynamic, steps(tokens[:, :16], 11))
    assert_equal_runs(ours, run(model, dynamic, [tokens[:, 16:20], tokens[:, 20:21], tokens[:, 21:22]]))


def test_truncate_back_to_a_checkpoint_and_continue(model):
    prompt, wrong, right = ids(14, 7), ids(6, 8), ids(4, 9)
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    run(model, cache, [prompt] + [wrong[:, t:t + 1] for t in range(6)])
    cache.truncate(14)
    assert cache.get_seq_length() == 14 and cache.tokens == prompt[0].tolist()
    ours = run(model, cache, [right[:, t:t + 1] for t in range(4)])
    dynamic = reference(model)
    run(model, dynamic, [prompt])
    assert_equal_runs(ours, run(model, dynamic, [right[:, t:t + 1] for t in range(4)]))


@pytest.mark.parametrize("precision", ["f32", "q8"])
def test_snapshot_and_restore_then_continue(model, precision, tmp_path):
    prompt, more = ids(15, 10), ids(5, 11)
    cache = hf.KVStateCache.for_model(model, page_tokens=4, precision=precision)
    run(model, cache, [prompt])
    cache.snapshot(tmp_path / "turn.kvs")
    restored = hf.KVStateCache.restore(model, tmp_path / "turn.kvs", page_tokens=8, precision=precision)
    assert restored.tokens == prompt[0].tolist()
    ours = run(model, restored, steps(more, 2))
    dynamic = reference(model, precision)
    run(model, dynamic, [prompt])
    assert_equal_runs(ours, run(model, dynamic, steps(more, 2)))


class Unseekable(io.RawIOBase):
    """A binary stream that cannot seek, as a pipe or a socket's: a restore reads it once."""

    def __init__(self, data: bytes):
        self._data = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        return self._data.readinto(buffer)


@pytest.mark.parametrize("precision", ["f16", "q8"])
def test_a_restore_without_precision_keeps_the_snapshots_own(llama, precision, tmp_path):
    """From a review: a restore given no ``precision=`` built an f32 cache for an f16 or q8 snapshot
    (2 to 2.6 times the page bytes, new positions no longer rounded as the writer's). The header is
    peeked where that is cheap (a path, a ``file://`` URL, a stream that seeks, from its position);
    a stream that cannot seek is not (its header would be gone): f32 there, as before."""
    prompt, more = ids(9, 65), ids(3, 66)
    writer = hf.KVStateCache.for_model(llama, page_tokens=4, precision=precision)
    run(llama, writer, [prompt])
    path = tmp_path / "turn.kvs"
    writer.snapshot(path)
    data = path.read_bytes()
    stream = io.BytesIO(b"elsewhere" + data)
    stream.seek(len(b"elsewhere"))
    for source in (path, f"file://{path}", stream):
        restored = hf.KVStateCache.restore(llama, source, page_tokens=4)
        assert restored.kv.precision == precision and restored.tokens == prompt[0].tolist()
        if source is path:
            assert_equal_runs(run(llama, restored, steps(more, 1)), run(llama, writer, steps(more, 1)))
        restored.close()
    for source, args in ((Unseekable(data), {}), (path, {"precision": "f32"})):     # not peeked; asked for
        restored = hf.KVStateCache.restore(llama, source, page_tokens=4, **args)
        assert restored.kv.precision == "f32" and restored.tokens == prompt[0].tolist()
        restored.close()
    writer.close()


CHILD = textwrap.dedent("""
    import sys, torch, transformers
    from kvstate import hf
    folder, snap, out, threads = sys.argv[1:5]
    torch.set_num_threads(int(threads))      # the parent's: another count may reorder a reduction
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    cache = hf.KVStateCache.restore(model, snap)
    more = torch.load(folder + "/more.pt")
    with torch.no_grad():
        logits = [model(more[:, :2], cache=cache).logits] + \\
                 [model(more[:, t:t + 1], cache=cache).logits for t in range(2, more.shape[1])]
    torch.save({"logits": logits, "tokens": cache.tokens}, out)
""")


@pytest.mark.slow
def test_restore_in_a_new_process(tmp_path):
    """Llama only (GQA and rotary positions): a second interpreter costs seconds of imports (16 s of
    the default suite's 4 minutes, where ``test_snapshot_and_restore_then_continue`` restores the same
    way in this process)."""
    if "llama" not in MODELS:
        MODELS["llama"] = build("llama")
    model = MODELS["llama"]
    prompt, more = ids(13, 12), ids(4, 13)
    model.save_pretrained(tmp_path)
    torch.save(more, tmp_path / "more.pt")
    cache = hf.KVStateCache.for_model(model)
    run(model, cache, steps(prompt, 9))
    cache.snapshot(tmp_path / "turn.kvs")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), str(tmp_path / "turn.kvs"), str(tmp_path / "out.pt"),
                    str(torch.get_num_threads())],
                   check=True, env=env, timeout=120)
    child = torch.load(tmp_path / "out.pt")
    assert child["tokens"] == prompt[0].tolist() + more[0].tolist()
    dynamic = reference(model)
    run(model, dynamic, steps(prompt, 9))
    assert_equal_runs(child["logits"], run(model, dynamic, steps(more, 2)))


def test_match_prefills_only_the_unmatched_suffix(model):
    kv = Cache(hf.layout_of(model), page_tokens=4, store="torch")
    args = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    turn1 = ids(12, 14)
    first = hf.KVStateCache.for_model(model, kv)
    with torch.no_grad():
        out1 = model.generate(turn1, cache=first, **args)
    first.retain()                                             # keys: turn 1 and its reply but the last token
    turn2 = torch.cat([out1.sequences, ids(7, 15)], dim=1)
    second = hf.KVStateCache.for_model(model, kv)
    matched = second.match(turn2)
    assert matched == out1.sequences.shape[1] - 1
    fed = []
    original = second.feed
    second.feed = lambda x, *mask, **positions: (fed.append(0 if x is None else x.shape[-1]),
                                                 original(x, *mask, **positions))[1]
    with torch.no_grad():
        out2 = model.generate(turn2, cache=second, **args)
    assert fed[0] == turn2.shape[1] - matched == 8             # the prefill: the unmatched suffix only
    dynamic = reference(model)
    with torch.no_grad():
        model.generate(turn1, cache=dynamic, **args)
        expected = model.generate(turn2, cache=dynamic, **args)
    assert torch.equal(out2.sequences, expected.sequences)
    assert_equal_runs(list(out2.logits), list(expected.logits))


def test_a_full_match_leaves_the_last_token_to_compute(model):
    kv = Cache(hf.layout_of(model), page_tokens=4, store="torch")
    tokens = ids(9, 16)
    first = hf.KVStateCache.for_model(model, kv)
    run(model, first, [tokens])
    first.retain()
    second = hf.KVStateCache.for_model(model, kv)
    assert second.match(tokens) == 8 and second.get_seq_length() == 8


def test_deepcopy_is_a_fork(model):
    import copy

    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    run(model, cache, [ids(9, 17)])
    copied = copy.deepcopy(cache)
    assert copied.tokens == cache.tokens and copied.context is not cache.context
    assert cache.kv.stats()["pages_copied"] == 0


# -- refusals, by name and before any work ---------------------------------------------------

@pytest.mark.parametrize("config", [
    lambda: transformers.MistralConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                       num_attention_heads=4, num_key_value_heads=2, sliding_window=8),
    lambda: transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64,
                                     num_attention_heads=4, layer_types=["full_attention", "linear_attention"]),
    lambda: transformers.BartConfig(d_model=32, encoder_layers=1, decoder_layers=1),
    lambda: transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, add_cross_attention=True),
], ids=["sliding-window", "linear-attention", "encoder-decoder", "cross-attention"])
def test_unsupported_models_are_refused(config):
    with pytest.raises(UnsupportedModelError):
        hf.layout_of(config())


def test_sliding_window_model_refused_before_any_work():
    config = transformers.MistralConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, vocab_size=VOCAB,
                                        num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    model = transformers.AutoModelForCausalLM.from_config(config)
    kv = Cache(Layout(2, 2, 8), store="torch")
    with pytest.raises(UnsupportedModelError, match="sliding_attention"):
        hf.KVStateCache.for_model(model, kv)
    assert kv.stats()["live_contexts"] == 0 and getattr(model, "_kvstate_hook", None) is None


def test_layout_mismatch_refused(model):
    layout = hf.layout_of(model)
    wrong = Cache(Layout(layout.layers, layout.kv_heads + 1, layout.head_dim), store="torch")
    with pytest.raises(UnsupportedModelError, match="kv_heads"):
        hf.KVStateCache.for_model(model, wrong)
    assert wrong.stats()["live_contexts"] == 0


def test_grouped_query_layout_comes_from_the_config():
    assert hf.layout_of(build("llama")) == Layout(3, 2, 8)      # 4 query heads share 2 K/V heads
    assert hf.layout_of(build("gpt2")) == Layout(3, 4, 8)


def test_kv_for_positions_with_unknown_ids_refused(model):
    cache = hf.KVStateCache.for_model(model)
    embeds = model.get_input_embeddings()(ids(4, 18))
    with torch.no_grad(), pytest.raises(TokenError, match="unknown"):
        model(inputs_embeds=embeds, cache=cache)
    assert len(cache.context) == 0
    unhooked = build(model.config.model_type if model.config.model_type == "gpt2" else "llama")
    layout = hf.layout_of(model)
    unbound = Cache(layout, store="torch")                     # no model bound to it: fed by hand
    bare = hf.KVStateCache(layout, unbound, unbound.allocate())
    with torch.no_grad(), pytest.raises(TokenError, match="unknown"):
        unhooked(ids(3, 19), cache=bare)                       # no hook and no feed
    bare.feed(ids(3, 19))                                      # the manual way: feed, then forward
    with torch.no_grad():
        unhooked(ids(3, 19), cache=bare)
    assert bare.tokens == ids(3, 19)[0].tolist()
    bare.feed(ids(2, 20))
    with torch.no_grad(), pytest.raises(TokenError, match="2 token ids"):
        unhooked(ids(3, 21), cache=bare)                       # ids for a different count of positions


def left_padded(lengths, seed):
    """A batch of prompts of ``lengths``, left-padded with 0, and its attention mask."""
    width = max(lengths)
    batch = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, n in enumerate(lengths):
        batch[row, width - n:] = ids(n, seed + row)[0]
        mask[row, width - n:] = 1
    return batch, mask


def own_positions(mask):
    """Each row's positions counting its tokens only, as ``generate`` passes them: a direct forward on padded
    rows must pass them too (else transformers counts the padding, and kvstate refuses it)."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def generate_both(model, prompt, mask, seed=0, precision="f32", store="torch", layer_views=False, **args):
    """The same ``generate`` on a kvstate cache and on a DynamicCache (through the same precision
    round trip); both outputs and the kvstate cache."""
    args = dict(output_logits=True, return_dict_in_generate=True, pad_token_id=0, **args)
    cache = hf.KVStateCache.for_model(model, page_tokens=4, precision=precision, store=store,
                                      layer_views=layer_views)
    with torch.no_grad():
        torch.manual_seed(seed)
        ours = model.generate(prompt, attention_mask=mask, cache=cache, **args)
        torch.manual_seed(seed)
        theirs = model.generate(prompt, attention_mask=mask, cache=reference(model, precision), **args)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert_equal_runs(list(ours.logits), list(theirs.logits))
    return ours, cache


@pytest.mark.parametrize("mode", [
    dict(do_sample=False),
    dict(do_sample=True, top_k=0, num_return_sequences=3),
    dict(do_sample=False, num_beams=4, num_return_sequences=2),
], ids=["greedy", "sampling-3-returns", "beam-4"])
def test_left_padded_batch_generates_as_dynamic_cache(model, mode):
    prompt, mask = left_padded([7, 4, 9], 40)
    out, cache = generate_both(model, prompt, mask, seed=5, max_new_tokens=5, **mode)
    rows = 3 * mode.get("num_beams", mode.get("num_return_sequences", 1))
    assert cache.batch_size == rows
    for row, ctx in enumerate(cache.rows):        # a row holds its real tokens only: padding never enters it
        source = row // (rows // 3)
        real = prompt[source][mask[source] == 1].tolist()
        assert ctx.tokens[:len(real)] == real and cache.pads[row] == 9 - len(real)
    if "num_beams" not in mode:
        for row, ctx in enumerate(cache.rows):     # what it holds is what was generated, but the last token
            source = row // (rows // 3)
            expected = prompt[source][mask[source] == 1].tolist() + out.sequences[row, 9:-1].tolist()
            assert ctx.tokens == expected
    cache.close()
    assert cache.kv.stats()["live_pages"] == 0


@pytest.mark.parametrize("precision, store", [("f16", "torch"), ("q8", "numpy")])
def test_beams_at_reduced_precision_equal_the_round_trip(llama, precision, store):
    prompt, mask = left_padded([6, 3], 46)
    generate_both(llama, prompt, mask, max_new_tokens=4, do_sample=False, num_beams=3, precision=precision,
                  store=store)


@pytest.mark.parametrize("store", ["torch", "numpy"])
def test_layer_views_equal_dynamic_cache_and_follow_changes_underneath(llama, store):
    """The kept per-layer views give the same logits, and are refilled when a row changes under them
    (a truncate, a reorder), never served stale."""
    prompt, mask = left_padded([6, 9], 47)
    generate_both(llama, prompt, mask, max_new_tokens=4, do_sample=False, num_beams=2, store=store,
                  layer_views=True)
    tokens = ids(14, 48)
    cache = hf.KVStateCache.for_model(llama, page_tokens=4, store=store, layer_views=True)
    dynamic = reference(llama)
    run(llama, cache, steps(tokens[:, :10], 6))
    run(llama, dynamic, steps(tokens[:, :10], 6))
    cache.truncate(7)                                 # under the views: they must be refilled
    dynamic.crop(-3)
    assert_equal_runs(run(llama, cache, steps(tokens[:, 7:], 3)), run(llama, dynamic, steps(tokens[:, 7:], 3)))


def test_num_return_sequences_shares_the_prompt_pages(llama):
    """Eight copies of one prompt are stored once: the duplicates are forks of the first row."""
    prompt, mask = left_padded([12], 41)
    out, cache = generate_both(llama, prompt, mask, seed=3, max_new_tokens=3, do_sample=True, top_k=0,
                               num_return_sequences=8)
    pages = cache.kv.observe().pages.values()
    assert sum(p.refcount == 8 for p in pages) == 3          # positions 0..11: three whole pages, held once
    assert cache.kv.stats()["live_pages"] < 8 * 4


@pytest.mark.parametrize("store", ["torch", "numpy"])
def test_a_decode_step_commits_every_row_in_one_batched_write(llama, store, monkeypatch):
    """Each decode step of a batch is one ``extend_rows`` over its rows (the prefill, padded, one
    ``extend`` per row), and the logits stay DynamicCache's."""
    calls = []

    def counted(contexts, tokens, kv):
        calls.append(len(contexts))
        return extend_rows(contexts, tokens, kv)
    monkeypatch.setattr(hf, "extend_rows", counted)
    prompt, mask = left_padded([7, 4, 9], 42)
    generate_both(llama, prompt, mask, store=store, max_new_tokens=4, do_sample=False, num_beams=2)
    assert calls == [6, 6, 6]       # 3 prompts x 2 beams; 4 new tokens: the prefill and 3 decode steps


def test_reorders_are_forks_and_copy_no_bytes(llama):
    cache = hf.KVStateCache.for_model(llama, page_tokens=4)
    prompt, mask = left_padded([9, 6], 42)
    with torch.no_grad():
        llama(prompt, attention_mask=mask, position_ids=own_positions(mask), cache=cache)
    tokens = [ctx.tokens for ctx in cache.rows]
    before = cache.kv.stats()
    cache.batch_repeat_interleave(3)                      # rows 0 0 0 1 1 1
    cache.reorder_cache(torch.tensor([3, 3, 0, 5, 1, 4]))
    cache.batch_select_indices(torch.tensor([0, 2, 3]))
    after = cache.kv.stats()
    assert after["pages_copied"] == before["pages_copied"] and after["bytes_copied"] == before["bytes_copied"]
    assert after["live_pages"] == before["live_pages"]    # every page shared, none new
    assert [ctx.tokens for ctx in cache.rows] == [tokens[1], tokens[0], tokens[1]]
    assert cache.pads == [3, 0, 3]
    with pytest.raises(ShapeError):
        cache.reorder_cache(torch.tensor([0, 7, 1]))       # refused in full: nothing moved
    assert [ctx.tokens for ctx in cache.rows] == [tokens[1], tokens[0], tokens[1]]


def test_a_row_taken_out_continues_as_its_own_cache(llama, tmp_path):
    prompt, mask = left_padded([5, 8], 43)
    out, cache = generate_both(llama, prompt, mask, max_new_tokens=3, do_sample=False)
    alone = cache.row(0)                                  # padding stays behind
    assert alone.tokens == prompt[0, 3:].tolist() + out.sequences[0, 8:-1].tolist()
    alone.snapshot(tmp_path / "row.kvs")
    more = torch.cat([out.sequences[0:1, 3:], ids(2, 44)], dim=1)
    expected = reference(llama)
    with torch.no_grad():
        theirs = llama.generate(more, cache=expected, max_new_tokens=3, do_sample=False, pad_token_id=0)
        ours = llama.generate(more, cache=alone, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, theirs)
    with pytest.raises(ShapeError, match="row"):
        cache.snapshot(tmp_path / "batch.kvs")            # a batch has no one token sequence


def test_padding_after_a_token_is_refused(llama):
    cache = hf.KVStateCache.for_model(llama)
    prompt, mask = left_padded([4, 4], 45)
    mask[1, 1] = 0                                        # a hole inside row 1
    with torch.no_grad(), pytest.raises(ShapeError, match="hole"):
        llama(prompt, attention_mask=mask, cache=cache)
    assert all(len(ctx) == 0 for ctx in cache.rows)


def test_missing_transformers_names_the_extra(monkeypatch):
    from kvstate import hf_config

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"kvstate\[hf\]"):
        hf_config.require_transformers()


def test_demo_hf_shows_exact_generation_and_the_agent_operations():
    from kvstate import hf_demo

    lines = []
    hf_demo.run(out=lines.append)
    text = "\n".join(lines)
    assert "bit-identical to DynamicCache's: True" in text
    assert "next-token logits identical: True" in text
    assert "identical to the live cache: True" in text
    assert "match found 211 of 242 tokens; prefilled only 31" in text


def test_numpy_store_gives_the_same_logits(model):
    tokens = ids(11, 22)
    cache = hf.KVStateCache.for_model(model, page_tokens=4, store="numpy")
    assert_equal_runs(run(model, cache, steps(tokens, 7)), run(model, reference(model), steps(tokens, 7)))


def test_bench_counts_best_of_n_bytes_and_match_prefill():
    """bench/hf_agent's counts (never its timings): forks hold the prompt once, match prefills the new turn only."""
    from kvstate.bench import hf_agent

    bench_model = hf_agent._model(512)
    a = hf_agent.best_of_n(bench_model, prompt_len=64, steps=4)
    assert a["same_continuations"]                    # forks, copies and independent runs sample the same tokens
    page_bytes = 4 * 2 * hf_agent.PAGE_TOKENS * 2 * 32 * 4
    # 63 prompt positions: 4 pages held once; each branch copies the partly filled 4th page and adds one
    assert a["rows"][0]["kv_bytes"] == (4 + 8 * 2) * page_bytes
    assert a["rows"][1]["kv_bytes"] == a["rows"][2]["kv_bytes"] == 8 * 67 * 4 * 2 * 2 * 32 * 4
    b = hf_agent.conversation(bench_model, turns=3, system_len=32, user_len=8, reply_len=4)
    assert [row["prefill_tokens"] for row in b["rows"]] == [40 + 9 + 9, 40 + 52 + 64]


def test_a_forward_that_skips_a_layer_is_refused(model):
    from kvstate.spec.errors import PositionError

    layout = hf.layout_of(model)
    kv = Cache(layout, store="torch")       # no model bound: K/V written by hand are taken
    cache = hf.KVStateCache(layout, kv, kv.allocate())
    k = torch.zeros(1, layout.kv_heads, 2, layout.head_dim)
    cache.feed([5, 6])
    cache.update(k, k, 0)
    with pytest.raises(PositionError, match=r"skipped layers \[1\]"):
        cache.update(k, k, layout.layers - 1)
    assert len(cache.context) == 0 and cache.get_seq_length() == 0


def test_crop_is_truncate_from_the_end(model):
    cache = hf.KVStateCache.for_model(model)
    run(model, cache, [ids(10, 23)])
    cache.crop(-3)
    assert cache.tokens == ids(10, 23)[0, :7].tolist()


# -- refused before any work: a model that is not the cache's, a prompt the cache does not begin -----

def _llama(layers):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      bos_token_id=0, eos_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("layers", [2, 4])
def test_a_model_with_another_layer_count_is_refused_before_any_work(layers):
    cache = hf.KVStateCache.for_model(_llama(3))
    other = hf.attach(_llama(layers))                     # hooked, as a model used with its own cache is
    with torch.no_grad(), pytest.raises(UnsupportedModelError, match="layout"):
        other.generate(ids(6, 30), cache=cache, max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert len(cache.context) == 0 and cache.get_seq_length() == 0


def test_a_model_with_the_same_layout_but_other_weights_is_refused_before_any_work(tmp_path):
    """Its K/V are not the cache's: a forward, a new cache over the same kvstate cache and a restore
    into it are refused by name, and nothing is added or left allocated. The same weights loaded
    again into another model object are the same model."""
    first, other = _llama(2), _llama(2)
    with torch.no_grad():
        for param in other.parameters():
            param.add_(0.5)
    cache = hf.KVStateCache.for_model(first, page_tokens=4)
    run(first, cache, [ids(5, 33)])
    cache.context.snapshot(tmp_path / "turn.kvs")
    pages = cache.kv.stats()["live_pages"]
    hf.attach(other)
    with torch.no_grad(), pytest.raises(UnsupportedModelError, match="another model"):
        other.generate(ids(7, 33), cache=cache, max_new_tokens=2, do_sample=False, pad_token_id=0)
    with pytest.raises(UnsupportedModelError, match="another model"):
        hf.KVStateCache.for_model(other, kv=cache.kv)
    with pytest.raises(UnsupportedModelError, match="another model"):
        hf.KVStateCache.restore(other, tmp_path / "turn.kvs", kv=cache.kv)
    assert len(cache.context) == 5 and cache.kv.stats()["live_pages"] == pages
    again = _llama(2)                       # the same seed: the same weights, another object
    resumed = hf.KVStateCache.restore(again, tmp_path / "turn.kvs", kv=cache.kv)
    assert resumed.tokens == cache.tokens


@pytest.mark.parametrize("chunk", [None, 4], ids=["whole", "chunked"])
def test_generate_refuses_a_prompt_the_cache_does_not_begin(llama, chunk):
    """Checked before anything is computed; in a chunked prefill, once for the whole prompt."""
    model = llama
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    first = ids(9, 31)
    run(model, cache, [first])
    prompt = first.clone()
    prompt[0, 5] = (prompt[0, 5] % (VOCAB - 1)) + 1      # another token at position 5
    prompt = torch.cat([prompt, ids(3, 32)], dim=1)
    args = dict(max_new_tokens=2, do_sample=False, pad_token_id=0, prefill_chunk_size=chunk)
    with torch.no_grad(), pytest.raises(TokenError, match="position 5"):
        model.generate(prompt, cache=cache, **args)
    assert cache.tokens == first[0].tolist()              # nothing was added
    with torch.no_grad():                                 # the true continuation still runs
        model.generate(torch.cat([first, ids(3, 32)], dim=1), cache=cache, **args)
    assert len(cache.tokens) == 9 + 3 + 1


def test_falcon_multi_query_and_deepseek_latent_attention_refused_at_construction():
    falcon = transformers.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       multi_query=True, new_decoder_architecture=False)
    deepseek = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, n_group=1, topk_group=1)
    for config, name in [(falcon, "multi_query"), (deepseek, "latent attention")]:
        built = transformers.AutoModelForCausalLM.from_config(config)
        kv = Cache(Layout(2, 4, 8), store="torch")
        with pytest.raises(UnsupportedModelError, match=name):
            hf.KVStateCache.for_model(built, kv)
        assert kv.stats()["live_contexts"] == 0 and getattr(built, "_kvstate_hook", None) is None


def test_bench_batch_parts_report_every_field_at_tiny_sizes():
    """bench hf_agent (a)-(d) at tiny sizes: the fields and the counts, never the timings."""
    from kvstate.bench import hf_agent

    tiny = hf_agent._model(256, "tiny")
    a = hf_agent.batched(tiny, 20, 3, num_beams=4, do_sample=False)
    assert a["same_tokens"] and set(a) == {"rows", "same_tokens", "time", "time_without_cache", "cache_time",
                                           "peak_kv"}
    assert all(row["cache_seconds"] > 0 for row in a["rows"])
    dynamic, ours = a["rows"][0], a["rows"][1]
    assert dynamic["peak_kv_bytes"] > ours["peak_kv_bytes"] > 0     # the 4 beams' prompt is held once
    b = hf_agent.batched(tiny, 20, 3, num_return_sequences=8, do_sample=True, top_k=0)
    assert b["same_tokens"] and b["rows"][1]["pages_copied"] <= 8   # at most each row's partly filled page
    c = hf_agent.decode_modes(tiny, 24, 2)
    assert {r["cache"] for r in c["views"]["rows"]} == {"kvstate", "DynamicCache"} and c["gather"]["overhead"] > 0
    assert c["views"]["floor"] > 0 and c["gather"]["page_write_ms"] > 0 and c["gather"]["page_cat_ms"] > 0
    d = hf_agent.resume(tiny, (24,))
    assert d["rows"][0]["tokens"] == 24 and d["rows"][0]["snapshot_bytes"] > 0


@pytest.mark.parametrize("precision", ["f32", "q8"])
def test_rows_sharing_a_prompt_gather_it_once_and_stay_exact(llama, precision, monkeypatch):
    """Beams of one left-padded prompt share its pages: rows after the first copy that common past
    from the first row's gather (the padding with it) instead of gathering it again."""
    prompt, mask = left_padded([9], 47)
    prompt = torch.cat([torch.zeros((1, 3), dtype=torch.long), prompt], dim=1)     # three positions of padding
    mask = torch.cat([torch.zeros((1, 3), dtype=torch.long), mask], dim=1)
    seen = []
    shared_past = hf.KVStateCache._shared_past
    monkeypatch.setattr(hf.KVStateCache, "_shared_past", lambda self: seen.append(shared_past(self)) or seen[-1])
    generate_both(llama, prompt, mask, max_new_tokens=4, do_sample=False, num_beams=4, precision=precision)
    assert (3, 3 + 9) in seen          # every page of the prompt shared, its partly filled last one too
    assert (2, 3 + 8) in seen          # after each beam's write copied that last page: the two full ones


def test_shared_rows_truncated_inside_their_last_page_read_only_what_they_hold(llama):
    """Rows that share one page tuple, truncated inside its last page (the tuple stays the same
    object, the length does not): the next step reads the shorter past, as DynamicCache does."""
    prompt = ids(11, 48)                               # pages of 4: [0-3] [4-7] [8-10]
    step, crop = ids(1, 49).repeat(2, 1), 9
    ours = hf.KVStateCache.for_model(llama, page_tokens=4)
    theirs = reference(llama)
    with torch.no_grad():
        llama(prompt, cache=ours), llama(prompt, cache=theirs)
        ours.batch_repeat_interleave(2), theirs.batch_repeat_interleave(2)
        assert ours._shared_past() == (3, 11)          # every page shared, the last partly filled
        ours.truncate(crop), theirs.crop(crop - 11)
        assert ours._shared_past() == (3, 9)
        assert_equal_runs([llama(step, cache=ours).logits], [llama(step, cache=theirs).logits])


# -- what an audit found: forwards that fail or record a graph, reset, re-padded prompts ------

def test_a_forward_that_records_a_graph_equals_dynamic_cache_and_backpropagates(model):
    """Outside ``torch.no_grad`` (a loss to train on): the same logits and the same gradients."""
    x = ids(9, 60)
    grads = []
    for cache in (hf.KVStateCache.for_model(model, page_tokens=4), reference(model),
                  hf.KVStateCache.for_model(model, page_tokens=4, layer_views=True)):
        model.zero_grad()
        logits = model(x, cache=cache).logits
        logits.square().mean().backward()
        grads.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    for logits, grad in (grads[0], grads[2]):
        assert torch.equal(logits, grads[1][0])
        assert all(torch.equal(a, b) for a, b in zip(grad, grads[1][1]))
    model.zero_grad()


@pytest.mark.parametrize("layer_views", [False, True])
def test_a_second_turn_with_a_graph_backpropagates_into_its_own_positions_only(llama, layer_views):
    """Two forwards on one cache outside ``torch.no_grad``, a backward after each (a train-per-turn
    loop): the second turn's past is data, so its gradients are those of a DynamicCache whose past
    came from a ``no_grad`` step, and its backward never reaches the first turn's freed graph."""
    first, second = ids(9, 63), ids(2, 64)
    theirs = reference(llama)
    with torch.no_grad():
        llama(first, cache=theirs)
    expected = _gradients_of(llama, second, theirs)
    ours = hf.KVStateCache.for_model(llama, page_tokens=4, layer_views=layer_views)
    _gradients_of(llama, first, ours)
    got = _gradients_of(llama, second, ours)           # the first turn's graph is freed by now
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    ours.close()


def _gradients_of(model, x, cache) -> list:
    """The gradients of one forward's loss with respect to every parameter (the graph then freed)."""
    model.zero_grad()
    model(x, cache=cache).logits.square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return grads


def _fail_in_layer(model, layer: int):
    blocks = model.transformer.h if hasattr(model, "transformer") else model.model.layers

    def boom(*_):
        raise RuntimeError("a user's hook failed")
    return blocks[layer].register_forward_pre_hook(boom)


def test_a_forward_that_fails_part_way_leaves_the_cache_as_it_was(model, tmp_path):
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    first = ids(5, 61)
    run(model, cache, [first])
    hook = _fail_in_layer(model, 1)                     # layer 0 has buffered its K/V by then
    try:
        with torch.no_grad(), pytest.raises(RuntimeError, match="user's hook"):
            model(ids(2, 62), cache=cache)
    finally:
        hook.remove()
    assert cache.get_seq_length() == 5 and cache.tokens == first[0].tolist()
    cache.fork().close(), cache.retain(), cache.snapshot(tmp_path / "after.kvs")     # no "during a forward"
    cache.truncate(4)
    expected = reference(model)
    run(model, expected, [first[:, :4]])
    assert_equal_runs(run(model, cache, [ids(3, 63)]), run(model, expected, [ids(3, 63)]))


def test_a_batch_forward_that_fails_does_not_grow_a_one_row_cache(llama):
    cache = hf.KVStateCache.for_model(llama, page_tokens=4)
    run(llama, cache, [ids(5, 64)])
    before = cache.kv.observe()
    bad = torch.cat([ids(2, 65), torch.tensor([[1, VOCAB + 5]])])    # row 1 holds an id past the vocabulary
    with torch.no_grad(), pytest.raises(IndexError):
        llama(bad, cache=cache)
    after = cache.kv.observe()
    assert cache.batch_size == 1 and len(cache.context) == 5
    assert after.holders == before.holders and after.pages == before.pages      # the forks it grew to are closed
    run(llama, cache, [ids(1, 66)])                     # a one-row forward goes on
    assert len(cache.context) == 6


@pytest.mark.parametrize("lengths", [[3, 6], [6, 6, 6]], ids=["padded", "unpadded"])
def test_reset_empties_a_batch_for_any_next_prompt(llama, lengths):
    cache = hf.KVStateCache.for_model(llama, page_tokens=4)
    prompt, mask = left_padded(lengths, 67)
    with torch.no_grad():
        llama(prompt, attention_mask=mask, position_ids=own_positions(mask), cache=cache)
    rows = list(cache.rows)
    cache.reset()
    assert cache.batch_size == 1 and cache.get_seq_length() == 0 and cache.pads == [0]
    assert all(ctx.closed for ctx in rows[1:]) and not rows[0].closed
    again, mask = left_padded([2, 5], 68)               # another batch size, other padding
    with torch.no_grad():
        ours = llama(again, attention_mask=mask, position_ids=own_positions(mask), cache=cache).logits
        theirs = llama(again, attention_mask=mask, position_ids=own_positions(mask), cache=reference(llama)).logits
    assert torch.equal(ours, theirs)


def test_a_prompt_padded_otherwise_than_the_cache_is_refused(llama):
    """generate takes the prompt's first get_seq_length() columns as held: padded otherwise, they
    would skip tokens a row never held (a re-tokenized conversation), or feed held ones twice (a
    row continued from cache.row(i) with its padding)."""
    prompt, mask = left_padded([3, 7], 69)
    out, cache = generate_both(llama, prompt, mask, max_new_tokens=2, do_sample=False)
    held = out.sequences[:, :-1]                        # the last token was never fed: 8 columns
    assert cache.pads == [4, 0] and [len(ctx) for ctx in cache.rows] == [4, 8]
    # The conversation re-tokenized without row 0's padding, one more turn each (both rows 10 long).
    repadded = torch.cat([torch.cat([held[0:1, 4:], ids(6, 70)], dim=1), torch.cat([held[1:2], ids(2, 71)], dim=1)])
    with torch.no_grad(), pytest.raises(TokenError, match="row 0: the prompt's first 8 columns"):
        llama.generate(repadded, attention_mask=torch.ones_like(repadded), cache=cache, max_new_tokens=1,
                       pad_token_id=0)
    assert [len(ctx) for ctx in cache.rows] == [4, 8] and cache.get_seq_length() == 8       # nothing added
    alone = cache.row(0)                                # row 0's 4 real tokens, no padding
    more = ids(2, 72)
    with torch.no_grad(), pytest.raises(TokenError, match="row 0: the prompt's first 4 columns"):
        llama.generate(torch.cat([held[0:1], more], dim=1), cache=alone, max_new_tokens=1, pad_token_id=0,
                       attention_mask=torch.cat([mask[0:1], torch.ones((1, 3), dtype=torch.long)], dim=1))
    real = torch.cat([held[0:1, 4:], more], dim=1)      # its real tokens only: goes on, as a fresh run
    with torch.no_grad():
        ours = llama.generate(real, cache=alone, max_new_tokens=2, do_sample=False, pad_token_id=0)
        theirs = llama.generate(real, cache=reference(llama), max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, theirs)


def test_a_context_given_without_kv_brings_its_own_cache(llama):
    kv = Cache(hf.layout_of(llama), page_tokens=4, store="torch")
    base = hf.KVStateCache.for_model(llama, kv)
    run(llama, base, [ids(6, 74)])
    ours = hf.KVStateCache.for_model(llama, context=base.context.fork())
    assert ours.kv is kv
    ours.retain()                                       # a context of its own cache, not a foreign one
    with torch.no_grad():
        out = llama.generate(torch.cat([ids(6, 74), ids(2, 75)], dim=1), cache=ours, max_new_tokens=2,
                             do_sample=False, pad_token_id=0, num_beams=3)
        expected = llama.generate(torch.cat([ids(6, 74), ids(2, 75)], dim=1), cache=reference(llama),
                                  max_new_tokens=2, do_sample=False, pad_token_id=0, num_beams=3)
    assert torch.equal(out, expected)
    other = Cache(hf.layout_of(llama), page_tokens=4, store="torch")
    with pytest.raises(ForeignContextError, match="another kvstate cache"):
        hf.KVStateCache.for_model(llama, other, context=base.context)
    with pytest.raises(ConfigError, match="page_tokens"):
        hf.KVStateCache.for_model(llama, context=base.context, page_tokens=64)


# -- generation modes a server uses -------------------------------------------------------------

@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resumed"])
def test_chunked_prefill_equals_dynamic_cache(llama, resume):
    """``prefill_chunk_size`` hands each chunk alone to ``prepare_inputs_for_generation`` as a first
    iteration; the whole prompt is checked once instead, and the chunks go in as they are."""
    model, prompt = llama, ids(11, 41)
    args = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, prefill_chunk_size=4)
    ours, theirs = hf.KVStateCache.for_model(model, page_tokens=4), reference(model)
    with torch.no_grad():
        if resume:                      # a held turn, then a prompt that continues it, in chunks
            for cache in (ours, theirs):
                model.generate(prompt[:, :5], cache=cache, **args)
            prompt = torch.cat([prompt[:, :5], torch.tensor([ours.tokens[5:]]), prompt[:, 5:]], dim=1)
        assert torch.equal(model.generate(prompt, cache=ours, **args), model.generate(prompt, cache=theirs, **args))
    assert ours.tokens == prompt[0].tolist() + ours.tokens[prompt.shape[1]:]


@pytest.mark.parametrize("arena_pages", [0, 8])
def test_a_turn_under_inference_mode_continues_outside_it(llama, arena_pages):
    """Pages made under ``torch.inference_mode`` are ordinary tensors: the next turn, under ``no_grad``,
    writes into the last page's free rows (an inference tensor refuses that outside inference mode)."""
    model, prompt = llama, ids(6, 44)
    args = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    outputs = []
    for make in (lambda: hf.KVStateCache.for_model(model, page_tokens=4, arena_pages=arena_pages),
                 lambda: reference(model)):
        with torch.inference_mode():        # the cache made there too: an arena's blocks are made with it
            cache = make()
            first = model.generate(prompt, cache=cache, **args)
        with torch.no_grad():
            outputs.append(model.generate(first, cache=cache, **args))
    assert len(outputs[0][0]) == 6 + 5 + 5 and torch.equal(outputs[0], outputs[1])


def test_a_fork_in_a_with_block_gives_its_pages_back(llama):
    """README's drafts: each fork generates in a ``with`` block, and the pages it made go back at its end."""
    model = llama
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    with torch.no_grad():
        out = model.generate(ids(6, 45), cache=cache, max_new_tokens=3, do_sample=False, pad_token_id=0)
        live = len(cache.kv.observe().pages)
        for seed in range(3):
            torch.manual_seed(seed)
            with cache.fork() as branch:
                model.generate(out, cache=branch, do_sample=True, max_new_tokens=9, pad_token_id=0)
                assert len(cache.kv.observe().pages) > live
            assert branch.rows[0].closed
            assert len(cache.kv.observe().pages) == live
    cache.close()
    assert cache.kv.observe().pages == {}


def test_a_forward_without_a_mask_on_padded_rows_is_refused(llama):
    """Padded positions read as zeros, which only the attention mask hides: a forward without one
    would attend to them (wrong logits), so it is refused, the cache left as it was."""
    model = llama
    prompt, mask = left_padded([3, 6], 47)
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    with torch.no_grad():
        model(prompt, attention_mask=mask, position_ids=own_positions(mask), cache=cache)
        held = [ctx.tokens for ctx in cache.rows]
        with pytest.raises(ShapeError, match="attention_mask"):
            model(ids(2, 48).repeat(2, 1)[:, :1], cache=cache)
        assert [ctx.tokens for ctx in cache.rows] == held and cache.pads == [3, 0]
        step = torch.cat([mask, torch.ones((2, 1), dtype=mask.dtype)], dim=1)
        model(ids(1, 48).repeat(2, 1), attention_mask=step, position_ids=own_positions(step)[:, -1:],
              cache=cache)     # with its mask it runs
    assert [len(ctx) for ctx in cache.rows] == [4, 7]


# -- from an audit acting as an agent runtime ---------------------------------------------------------------

def test_an_interrupt_inside_a_forward_leaves_nothing_buffered_and_generate_stays_exact(llama):
    """torch runs ``always_call`` end hooks after an ``Exception`` only: after Ctrl-C in a layer, layer 0's K/V
    stayed buffered and counted, and the next ``generate`` skipped as many prompt tokens."""
    prompt = ids(7, 40)
    cache, dynamic = hf.KVStateCache.for_model(llama, page_tokens=4), DynamicCache(config=llama.config)
    args = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    out = llama.generate(prompt, cache=cache, **args)
    assert torch.equal(out, llama.generate(prompt, cache=dynamic, **args))

    def interrupt(module, args, output):
        raise KeyboardInterrupt
    handle = llama.model.layers[0].register_forward_hook(interrupt)
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        llama(ids(3, 41), cache=cache)
    handle.remove()
    assert cache.get_seq_length() == len(cache.context) == dynamic.get_seq_length()
    cache.fork().close()                    # no longer "during a forward pass"
    turn = torch.cat([out, ids(6, 42)], dim=1)
    args.update(max_new_tokens=5, output_logits=True, return_dict_in_generate=True)
    mine, theirs = llama.generate(turn, cache=cache, **args), llama.generate(turn, cache=dynamic, **args)
    assert torch.equal(mine.sequences, theirs.sequences)
    assert all(torch.equal(a, b) for a, b in zip(mine.logits, theirs.logits))
    cache.close()


def test_layer_views_follow_an_overwrite_in_place_through_the_context():
    """An overwrite inside a page only the context holds keeps its page tuple: the views were not refilled."""
    model = _llama(2)
    views = hf.KVStateCache.for_model(model, page_tokens=4, layer_views=True)
    run(model, views, [ids(6, 43), ids(1, 44)])
    values = np.full((1, *views.kv.layout.position_shape), 0.5, np.float32)
    views.context.overwrite(5, [7], values)
    gathered = hf.KVStateCache.for_model(model, context=views.context.fork())
    step = ids(1, 45)
    assert torch.equal(run(model, views, [step])[0], run(model, gathered, [step])[0])
    views.close()
    gathered.close()


def test_match_on_a_closed_cache_is_refused_before_it_takes_a_hit():
    model = _llama(2)
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    run(model, cache, [ids(9, 46)])
    cache.retain()
    tokens = cache.tokens + [3]
    kv = cache.kv
    cache.close()
    stale = hf.KVStateCache.for_model(model, kv)
    stale.close()
    with pytest.raises(ContextClosedError):
        stale.match(tokens)
    assert kv.stats()["live_contexts"] == 0
    fresh = hf.KVStateCache.for_model(model, kv)
    with pytest.raises(ShapeError, match="one sequence"):
        fresh.match(torch.tensor([tokens, tokens]))         # two rows, not one sequence of both
    assert fresh.match(torch.tensor([tokens])) == 9
    fresh.close()
    kv.clear()
    assert kv.stats()["live_pages"] == 0


def test_a_deep_copy_of_an_attached_model_generates_with_its_own_weights():
    """``attach`` wraps some of the model's methods; a closure over a bound method kept calling the
    original model's from a copy, whose ``generate`` then ran the original's weights."""
    import copy

    model = hf.attach(_llama(2))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for param in twin.parameters():
            param.mul_(-1)
    plain = _llama(2)
    plain.load_state_dict(twin.state_dict())        # the same weights, never attached
    args = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    prompt = ids(5, 47)
    mine, theirs = twin.generate(prompt, **args), plain.generate(prompt, **args)
    assert all(torch.equal(a, b) for a, b in zip(mine.logits, theirs.logits))
    cache = hf.KVStateCache.for_model(twin, page_tokens=4)
    assert torch.equal(twin.generate(prompt, cache=cache, **args).sequences, theirs.sequences)
    cache.close()


def test_a_second_threads_forward_on_one_cache_is_refused_and_the_first_completes_exactly(llama):
    """One cache is one sequence of forwards: another thread's forward while one is under way mixed their
    K/V and ids in one step (K/V committed under the other thread's tokens). Now it is refused by
    name, its refused forward ends nothing of the first's, and the first completes as DynamicCache's."""
    import threading

    cache, dynamic = hf.KVStateCache.for_model(llama, page_tokens=2), DynamicCache(config=llama.config)
    run(llama, cache, [ids(3, 48)])
    run(llama, dynamic, [ids(3, 48)])
    inside, go_on, outcome = threading.Event(), threading.Event(), {}

    def hold(module, args, output):
        if threading.current_thread().name == "first":
            inside.set()
            go_on.wait(10)

    def first():
        outcome["first"] = run(llama, cache, [ids(2, 49)])[0]
    handle = llama.model.layers[0].register_forward_hook(hold)
    thread = threading.Thread(target=first, name="first")
    thread.start()
    assert inside.wait(10)
    with torch.no_grad(), pytest.raises(ContextBusyError, match="another thread"):
        llama(ids(2, 50), cache=cache)
    with pytest.raises(ContextBusyError):
        cache.fork()
    go_on.set()
    thread.join(10)
    handle.remove()
    assert torch.equal(outcome["first"], run(llama, dynamic, [ids(2, 49)])[0])
    assert cache.get_seq_length() == 5
    cache.close()


def test_cache_arguments_beside_a_given_kvstate_cache_and_a_closed_context_are_refused(tmp_path):
    """They build a new kvstate cache and were silently ignored: a restore asked for q8 into an f32 cache
    got f32 pages of 4 tokens. A closed context was taken as the cache's row."""
    model = _llama(2)
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    run(model, cache, [ids(5, 51)])
    cache.context.snapshot(tmp_path / "turn.kvs")
    before = cache.kv.stats()
    with pytest.raises(ConfigError, match="kv is given"):
        hf.KVStateCache.for_model(model, cache.kv, precision="f16")
    with pytest.raises(ConfigError, match="kv is given"):
        hf.KVStateCache.restore(model, tmp_path / "turn.kvs", kv=cache.kv, precision="q8", page_tokens=16)
    closed = cache.context.fork()
    closed.close()
    with pytest.raises(ContextClosedError):
        hf.KVStateCache.for_model(model, context=closed)
    assert cache.kv.stats()["live_pages"] == before["live_pages"]
    restored = hf.KVStateCache.restore(model, tmp_path / "turn.kvs", precision="q8", page_tokens=16)
    assert restored.kv.precision == "q8" and restored.kv.page_tokens == 16
    restored.close()
    cache.close()


@pytest.mark.parametrize("given", [{"context": 5}, {"kv": "x"}], ids=["context", "kv"])
def test_a_kv_or_context_of_another_type_is_refused_by_name(given):
    # it was a bare AttributeError ('int' object has no attribute 'closed')
    with pytest.raises(ConfigError, match=f"{next(iter(given))} must be a kvstate.impl"):
        hf.KVStateCache.for_model(_llama(2), **given)
    if "kv" in given:
        with pytest.raises(ConfigError, match="kv must be a kvstate.impl.Cache"):
            hf.KVStateCache.restore(_llama(2), "unread.kvs", **given)


def test_an_interrupt_while_a_forward_is_fed_leaves_no_forward_claimed(llama, monkeypatch):
    """From a review: an interrupt in the pre-hook, after the cache took the forward as this thread's,
    met no hook that ends it: every other thread was refused from then on."""
    cache = hf.KVStateCache.for_model(llama, page_tokens=4)
    run(llama, cache, [ids(4, 52)])

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(hf, "new_padding", interrupted)
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        llama(ids(2, 53), cache=cache)
    monkeypatch.undo()
    assert cache._forward_thread is None and cache.get_seq_length() == 4
    cache.close()
