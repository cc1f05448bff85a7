"""kvstate.hf's two guards, from an audit acting as an agent runtime.

Which model's K/V a kvstate cache holds: a model whose weights changed (a deep copy loaded with
others, the bound model itself reloaded or edited in place, weights differing only past their first
values) is refused by name, and weights kvstate cannot read (the ``meta`` device) make a model match
no other. Which thread a ``KVStateCache`` belongs to: a ``generate`` owns it from start to end, and
an operation for its duration, so another thread's use in between is refused by name instead of
interleaving with it. Races are made deterministic with events, never with sleeps.
"""

import copy
import functools
import io
import threading

import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install 'kvstate[hf]')")
torch = pytest.importorskip("torch")

from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList  # noqa: E402

from kvstate import Cache  # noqa: E402

hf = pytest.importorskip("kvstate.hf")
from kvstate import hf_identity  # noqa: E402
from kvstate.spec import errors as spec_errors  # noqa: E402
from kvstate.spec.errors import ContextBusyError, UnsupportedModelError  # noqa: E402

VOCAB = 97
WAIT = 20           # seconds an event may take before the test fails (never slept)


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


def test_the_same_weights_under_another_rotary_base_are_another_model():
    """A model's K/V follow its configuration too: the same weights with another ``rope_theta`` rotate
    every key otherwise, and such a model continued a cache whose keys it did not compute."""
    model = llama()
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    run(model, cache, ids(5, 63))
    settings = config()
    settings.rope_parameters = {**settings.rope_parameters, "rope_theta": 500.0}
    other = transformers.AutoModelForCausalLM.from_config(settings).eval()
    other.load_state_dict(model.state_dict(), strict=False)      # the same weights (its own inv_freq)
    hf.attach(other)
    with pytest.raises(UnsupportedModelError, match="another model"):
        run(other, cache, ids(1, 64))
    reloaded = llama()                                          # the same weights and configuration
    hf.attach(reloaded)
    run(reloaded, cache, ids(1, 65))
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


def quantized(model):
    """``model`` with its ``nn.Linear`` layers quantized dynamically to int8 (``torch.ao``): their weights
    then live in packed parameters, outside ``model.parameters()``."""
    return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)


# torch 2.13 marks torch.ao's quantized tensors deprecated; they are still what quantize_dynamic makes
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:torch.quantize_per_tensor:UserWarning")
def test_dynamically_quantized_weights_are_the_models_weights():
    """From the last session's open list: ``quantize_dynamic`` moves every ``nn.Linear`` weight into packed
    parameters, which ``model.parameters()`` does not list, so two quantized models whose projections
    differ (the embeddings and norms the same) had one fingerprint, and a cache of one was continued
    by the other; and new packed weights set into the bound model (``set_weight_bias``) went unseen."""
    model, other = quantized(llama(seed=0)), llama(seed=1)
    other.load_state_dict({name: value for name, value in llama(seed=0).state_dict().items()
                           if "proj" not in name}, strict=False)       # only the projections differ
    other = quantized(other)
    assert hf_identity.model_fingerprint(model) != hf_identity.model_fingerprint(other)
    assert hf_identity.model_fingerprint(model) == hf_identity.model_fingerprint(quantized(llama(seed=0)))
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    run(model, cache, ids(5, 90))
    with pytest.raises(UnsupportedModelError, match="another model"):
        hf.KVStateCache.for_model(other, kv=cache.kv)
    projection = model.model.layers[0].self_attn.k_proj
    weight, bias = projection._weight_bias()
    projection.set_weight_bias(torch.quantize_per_tensor(weight.dequantize() * 2, 0.1, 0, torch.qint8), bias)
    with pytest.raises(UnsupportedModelError, match="weights changed"):
        run(model, cache, ids(1, 91))
    assert len(cache.context) == 5
    projection.set_weight_bias(weight, bias)        # the old weights back: it goes on
    run(model, cache, ids(1, 92))
    assert len(cache.context) == 6
    cache.close()


def unsampled_rows(weight) -> list[int]:
    """The rows of ``weight`` that hold none of the values the fingerprint samples."""
    step, width = max(1, weight.numel() // hf_identity.SAMPLES), weight[0].numel()
    sampled = {i // width for i in range(0, weight.numel(), step)[:hf_identity.SAMPLES]} | {len(weight) - 1}
    return [row for row in range(len(weight)) if row not in sampled]


def test_weights_edited_between_the_sampled_values_are_another_model():
    """The fingerprint hashed 64 values of each parameter: an in-place edit of the bound model (its
    version counter seen, its weights hashed again) or another model's weights differing between those
    values (one value, or two rows swapped) hashed the same, and continued the cache's K/V silently.
    Every value is hashed now, by row, when the weights may have changed; the old value back, it goes on."""
    model = llama()
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    run(model, cache, ids(4, 73))
    weight = model.model.layers[0].self_attn.k_proj.weight
    row = unsampled_rows(weight.view(-1, 1))[0]         # one value no sample reads
    value = weight.view(-1)[row].item()
    with torch.no_grad():
        weight.view(-1)[row] += 1.0
    with pytest.raises(UnsupportedModelError, match="weights changed"):
        run(model, cache, ids(1, 74))
    with torch.no_grad():
        weight.view(-1)[row] = value
    run(model, cache, ids(1, 74))                       # its old weights back: it goes on
    swapped = llama()
    with torch.no_grad():
        embedding = swapped.model.embed_tokens.weight
        first, second = unsampled_rows(embedding)[:2]
        embedding[[first, second]] = embedding[[second, first]].clone()
    with pytest.raises(UnsupportedModelError, match="another model"):
        hf.KVStateCache.for_model(swapped, kv=cache.kv)
    assert len(cache.context) == 5
    cache.close()


def test_a_snapshot_names_its_model_and_is_refused_for_another(tmp_path):
    """From an audit: a snapshot recorded no model, so one restored into a model of the same layout
    but other weights (or another ``rms_norm_eps``) continued with K/V it never computed, silently
    (logits 0.08-0.54 off). The file now names the model's fingerprint (format version 3)."""
    from kvstate.spec import snapshot_format as fmt

    model = llama()
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    model.generate(ids(6, 70), cache=cache, max_new_tokens=3, **GREEDY)
    path = tmp_path / "turn.kvs"
    cache.snapshot(path)
    assert fmt.parse_header(path.read_bytes()).producer == bytes.fromhex(hf_identity.fingerprint_of(model))
    others = [llama(seed=1), transformers.AutoModelForCausalLM.from_config(
        transformers.LlamaConfig(**{**config().to_dict(), "rms_norm_eps": 1e-2})).eval()]
    others[1].load_state_dict(model.state_dict())        # the same weights, another norm epsilon
    for other in others:
        kv = Cache(hf.layout_of(other), store="torch", page_tokens=4)
        with pytest.raises(spec_errors.SnapshotError, match="another model computed") as refused:
            hf.KVStateCache.restore(other, path, kv=kv)
        assert isinstance(refused.value, UnsupportedModelError)         # refused as a file and as a model
        assert kv.stats()["live_pages"] == 0            # refused before anything was allocated
    reloaded = llama()                                    # the same checkpoint, loaded again
    resumed = hf.KVStateCache.restore(reloaded, path)
    assert resumed.tokens == cache.tokens
    cache.close()
    resumed.close()


def test_a_prompt_holding_the_pad_id_without_a_mask_is_refused_with_the_way_out():
    """From an audit: generate builds the attention mask from pad_token_id when none is given, so a prompt
    holding that id mid-way got a hole, refused with words about left padding the caller never added."""
    model = llama()
    prompt = torch.tensor([[5, 6, 3, 8, 9]])
    settings = dict(do_sample=False, pad_token_id=3)        # a pad id that is not the eos id (0), held mid-prompt
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    with pytest.raises(spec_errors.ShapeError, match="pad_token_id as padding.*pass attention_mask"):
        model.generate(prompt, cache=cache, max_new_tokens=2, **settings)
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), cache=cache, max_new_tokens=2, **settings)
    assert cache.tokens[:5] == prompt[0].tolist() and out.shape[1] == 7
    cache.close()


def test_a_forward_of_a_model_never_attached_says_so():
    """From an audit: a second model, never given to ``for_model``, run on another's cache was told to
    attach a model or feed ids, as if the cache had no model at all."""
    model, stranger = llama(), llama(seed=9)
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    run(model, cache, ids(4, 71))
    with pytest.raises(spec_errors.TokenError, match="the model running this forward was never attached"):
        run(stranger, cache, ids(1, 72))
    assert len(cache.context) == 4
    cache.close()


def test_a_forward_fed_by_hand_on_a_cache_bound_to_a_model_is_checked_or_refused():
    """From the README's list of what was not caught: ``cache.feed(ids)`` then a forward of a model never
    attached gave no model to check, and another model's K/V joined the bound model's silently. Now
    refused by name before any K/V is written; an attached model's ``forward`` called directly (no hook
    runs) is checked as its hook would; a kvstate cache no model is bound to is still fed by hand."""
    model, stranger = llama(), llama(seed=9)
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    run(model, cache, ids(4, 78))
    cache.feed(ids(1, 79))
    with pytest.raises(UnsupportedModelError, match="fed by hand.*never attached"):
        run(stranger, cache, ids(1, 79))
    assert len(cache.context) == 4 and cache.get_seq_length() == 4
    cache.feed(ids(1, 79))
    with torch.no_grad():
        model.forward(ids(1, 79), cache=cache)              # the bound model, attached: checked, goes on
    assert len(cache.context) == 5
    unbound = Cache(hf.layout_of(model), store="torch")
    bare = hf.KVStateCache(hf.layout_of(model), unbound, unbound.allocate())
    bare.feed(ids(3, 81))
    run(stranger, bare, ids(3, 81))                         # no model bound: fed by hand, as before
    assert len(bare.context) == 3
    cache.feed(ids(1, 80))
    with torch.no_grad(), pytest.raises(UnsupportedModelError, match="another model"):
        hf.attach(stranger).forward(ids(1, 80), cache=cache)
    assert len(cache.context) == 5
    run(model, cache, ids(1, 80))                           # nothing left held by the refusals
    bare.close()
    cache.close()


def _hooked_forward(module, *args, **kwargs):
    """What accelerate's ``device_map`` hooks make of ``forward`` at load, before any ``attach``: a
    ``functools.partial`` of a function taking the module first (``add_hook_to_module``)."""
    return type(module).forward(module, *args, **kwargs)


def _as_accelerate_does(model):
    return functools.partial(_hooked_forward, model)


def _as_a_named_wrapper_does(model):
    """``functools.wraps`` over the bound method: ``model.forward = torch.compile(model.forward)``
    (transformers' own recipe), or a profiling wrapper."""
    forward = model.forward

    @functools.wraps(forward)
    def timed(*args, **kwargs):
        return forward(*args, **kwargs)
    return timed


@pytest.mark.parametrize("wrap", [_as_accelerate_does, _as_a_named_wrapper_does])
def test_a_hand_fed_forward_wrapped_before_attach_is_checked_not_refused(wrap):
    """From a review and an audit: ``forward`` wrapped by another library before ``attach`` is no bound
    method, so the model was not found and a hand-fed ``model.forward(...)`` of the bound, attached
    model was refused as if never attached. The module a partial passes first, or the method a
    ``functools.wraps`` wrapper names, gives the model; a stranger so wrapped is still another model."""
    model, stranger = llama(), llama(seed=9)
    model.forward = wrap(model)
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    run(model, cache, ids(4, 78))
    cache.feed(ids(1, 79))
    with torch.no_grad():
        model.forward(ids(1, 79), cache=cache)
    assert len(cache.context) == 5
    stranger.forward = wrap(stranger)
    cache.feed(ids(1, 80))
    with torch.no_grad(), pytest.raises(UnsupportedModelError, match="another model"):
        hf.attach(stranger).forward(ids(1, 80), cache=cache)
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

    def holding_kv() -> Cache:              # a kvstate cache holding some K/V: the binding counts
        kv = Cache(layout, store="numpy")
        kv.allocate().extend([1, 2], np.zeros((2, *layout.position_shape), np.float32))
        return kv
    kv = holding_kv()
    hf.KVStateCache.for_model(first, kv=kv).close()
    hf_identity.bind_model(first, kv)                                # itself, again
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
    other = holding_kv()
    hf_identity.bind_model(halves[0], other)
    with pytest.raises(UnsupportedModelError, match="another model"):
        hf_identity.bind_model(halves[1], other)
    with torch.inference_mode():
        frozen = llama()
    twin = hf.KVStateCache.for_model(frozen, kv=cache.kv)   # the same weights as ``real``
    assert run(frozen, twin, ids(2, 70))[0].shape == (1, 2, VOCAB)
    twin.close()
    cache.close()


# -- which thread ----------------------------------------------------------------------------------

class Pause(LogitsProcessor):
    """Holds the thread named ``name`` after its first forward, between two forwards of its generate."""

    def __init__(self, name):
        self.name, self.inside, self.go_on, self.calls = name, threading.Event(), threading.Event(), 0

    def __call__(self, input_ids, scores):
        if threading.current_thread().name == self.name:
            self.calls += 1
            if self.calls == 1:
                self.inside.set()
                assert self.go_on.wait(WAIT)
        return scores


class Interrupt(LogitsProcessor):
    def __call__(self, input_ids, scores):
        raise KeyboardInterrupt


def in_thread(name, target):
    box = {}

    def body():
        try:
            box["value"] = target()
        except BaseException as error:      # reported to the test, never lost in the thread
            box["error"] = error
    thread = threading.Thread(target=body, name=name)
    thread.start()
    return thread, box


def test_a_generate_owns_its_cache_until_it_ends(tmp_path):
    """Each forward was guarded, but not the gaps between a generate's forwards: another thread's forward
    or generate ran there and put its tokens into the middle of the first's sequence. Now a generate
    owns the cache from start to end: the other thread's forward, generate and operations are refused
    by name, and the first generate equals DynamicCache's. An interrupt, inside a forward or between
    two, leaves the cache to any thread."""
    model = llama()
    cache = hf.KVStateCache.for_model(model, page_tokens=2)
    prompt, pause = ids(5, 71), Pause("first")
    args = dict(max_new_tokens=4, output_logits=True, return_dict_in_generate=True, **GREEDY)
    thread, box = in_thread("first", lambda: model.generate(
        prompt, cache=cache, logits_processor=LogitsProcessorList([pause]), **args))
    assert pause.inside.wait(WAIT)
    held = len(cache.context)
    with pytest.raises(ContextBusyError, match="another thread"):
        run(model, cache, ids(1, 72))
    with pytest.raises(ContextBusyError, match="another thread"):
        model.generate(torch.cat([prompt, ids(1, 73)], dim=1), cache=cache, max_new_tokens=1, **GREEDY)
    for operation in (cache.fork, lambda: cache.truncate(2), lambda: cache.snapshot(tmp_path / "x.kvs"),
                      cache.retain, cache.close):
        with pytest.raises(ContextBusyError, match="another thread"):
            operation()
    plain = llama()                     # never attached: no hook feeds its ids or checks the cache
    with pytest.raises(ContextBusyError, match="another thread"):
        run(plain, cache, ids(1, 74))
    assert len(cache.context) == held
    pause.go_on.set()
    thread.join(WAIT)
    assert not thread.is_alive() and "error" not in box, box.get("error")
    theirs = model.generate(prompt, cache=DynamicCache(config=model.config), **args)
    assert torch.equal(box["value"].sequences, theirs.sequences)
    assert all(torch.equal(a, b) for a, b in zip(box["value"].logits, theirs.logits))

    turn = torch.cat([box["value"].sequences, ids(2, 74)], dim=1)
    with pytest.raises(KeyboardInterrupt):                  # between two forwards
        model.generate(turn, cache=cache, logits_processor=LogitsProcessorList([Interrupt()]), **args)

    def interrupt(module, inputs, output):
        raise KeyboardInterrupt
    handle = model.model.layers[0].register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):                  # inside one (the first turn's prefill is in)
        model.generate(torch.cat([turn, ids(2, 75)], dim=1), cache=cache, **args)
    handle.remove()
    assert cache._forward_thread is None
    thread, box = in_thread("second", lambda: cache.fork())
    thread.join(WAIT)
    assert "error" not in box, box.get("error")
    box["value"].close()
    cache.close()


class Gate(io.RawIOBase):
    """A snapshot target that stops its writer inside ``snapshot`` until told to go on."""

    def __init__(self):
        self.inside, self.go_on, self.data = threading.Event(), threading.Event(), bytearray()

    def writable(self):
        return True

    def write(self, chunk):
        self.inside.set()
        assert self.go_on.wait(WAIT)
        self.data += bytes(chunk)
        return len(chunk)


def test_an_operation_owns_the_cache_while_it_runs():
    """An operation checked that no forward was under way and went on without taking the cache: a
    forward begun by another thread meanwhile ran beside it. Now the operation holds the cache, and
    the forward waits for it to end before any layer runs: the snapshot holds what was there before."""
    model = llama()
    cache = hf.KVStateCache.for_model(model, page_tokens=2)
    run(model, cache, ids(5, 75))
    tokens, gate, layers = cache.tokens, Gate(), []
    thread, box = in_thread("snapshotting", lambda: cache.snapshot(gate))
    assert gate.inside.wait(WAIT)
    handle = model.model.layers[0].register_forward_pre_hook(lambda module, inputs: layers.append(1))
    try:
        forward, done = in_thread("forwarding", lambda: run(model, cache, ids(1, 76)))
        forward.join(0.2)
        assert forward.is_alive() and layers == []          # waiting: no layer ran beside the snapshot
    finally:
        gate.go_on.set()
        thread.join(WAIT)
        forward.join(WAIT)
        handle.remove()
    assert "error" not in box, box.get("error")
    assert "error" not in done, done.get("error")
    assert layers == [1] and len(cache.tokens) == len(tokens) + 1
    restored = hf.KVStateCache.restore(model, io.BytesIO(bytes(gate.data)), kv=cache.kv)
    assert restored.tokens == tokens
    restored.close()
    cache.close()


def counted_hashes(monkeypatch) -> list:
    """A list that grows by one each time a model's weights are hashed."""
    calls, original = [], hf_identity.model_fingerprint
    monkeypatch.setattr(hf_identity, "model_fingerprint", lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    return calls


def test_a_llama_generate_hashes_its_weights_once(monkeypatch):
    """From a review: a Llama forward slices its list of layers, which registers each layer into a new
    ModuleList, and any registration anywhere counted as a change of structure: every forward hashed
    the whole model again (8.3-9.0 ms for Llama-7B's 291 parameters, against 60-90 µs for the key).
    Only registrations on a fingerprinted model's own modules count; an adapter injected still does."""
    calls = counted_hashes(monkeypatch)
    model = llama()
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    model.generate(ids(3, 66), cache=cache, max_new_tokens=8, **GREEDY)
    hashed = len(calls)
    assert hashed <= 1, hashed
    torch.nn.Linear(4, 4)                                   # a module built elsewhere: nothing to hash again
    run(model, cache, ids(1, 67))
    assert len(calls) == hashed
    model.model.layers[0].self_attn.extra = torch.nn.Linear(4, 4)     # an adapter injected into the model
    with pytest.raises(UnsupportedModelError):
        run(model, cache, ids(1, 68))                       # hashed again: another structure, another model
    assert len(calls) == hashed + 1
    cache.close()


def test_a_registration_that_changes_no_parameter_hashes_no_value(monkeypatch):
    """Hashing reads every weight now: a submodule of the model set again (a registration, which may mean
    new parameters) re-reads the parameters' keys, and hashes nothing when they and the configuration
    are as they were."""
    calls = counted_hashes(monkeypatch)
    model = llama()
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    run(model, cache, ids(3, 75))
    hashed = len(calls)
    model.model.norm = model.model.norm                     # registered again, the same weights
    run(model, cache, ids(1, 76))
    assert len(calls) == hashed
    model.model.norm = type(model.model.norm)(model.config.hidden_size, eps=model.config.rms_norm_eps)
    run(model, cache, ids(1, 77))           # a new weight: hashed again, and its values (ones) are the old ones
    assert len(calls) == hashed + 1
    cache.close()


def test_an_inference_tensor_in_the_model_leaves_the_other_weights_watched():
    """From a review: one parameter made under ``inference_mode`` (a base loaded so) dropped the version
    counters of all of them, and an in-place write into another weight went unseen. GPT-2: its forward
    registers no module, so nothing else makes the weights hashed again."""
    torch.manual_seed(0)
    settings = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128,
                                       bos_token_id=0, eos_token_id=0)
    with torch.inference_mode():
        model = transformers.GPT2LMHeadModel(settings).eval()       # every weight an inference tensor
    attn = model.transformer.h[0].attn.c_attn
    attn.weight = torch.nn.Parameter(attn.weight.clone(), requires_grad=False)     # but this one
    hf.attach(model)
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    run(model, cache, ids(4, 69))
    with torch.no_grad():
        attn.weight.mul_(2)                                 # same storage, version + 1
    with pytest.raises(UnsupportedModelError, match="weights changed"):
        run(model, cache, ids(1, 70))
    cache.close()


@pytest.mark.parametrize("passed", ["by name", "by position"])
def test_a_streamed_generate_lets_its_cache_go_when_the_streamer_ends(passed):
    """From a review: HF's streaming recipe runs generate on a thread and wakes the caller at the
    streamer's ``end()``, which transformers calls inside generate; the caller's next use of the cache
    got ContextBusyError from a generate that had done its work. ``end()`` here waits for that use.
    A streamer passed by position (generate's eighth parameter) was not wrapped, and held the cache."""
    from transformers.generation.streamers import BaseStreamer

    model = llama()
    cache = hf.KVStateCache.for_model(model, page_tokens=4)

    class Streamer(BaseStreamer):
        def __init__(self):
            self.ended, self.used, self.tokens = threading.Event(), threading.Event(), []

        def put(self, value):
            self.tokens.append(value)

        def end(self):
            self.ended.set()
            assert self.used.wait(WAIT)         # generate has not returned: the caller uses the cache now

    streamer = Streamer()
    args, kwargs = (ids(4, 71),), dict(cache=cache, max_new_tokens=3, **GREEDY)
    if passed == "by name":
        kwargs["streamer"] = streamer
    else:       # inputs, generation_config, logits_processor, stopping_criteria, prefix_allowed_tokens_fn,
        args += (None,) * 6 + (streamer,)       # synced_gpus, assistant_model, streamer
    worker = threading.Thread(target=model.generate, args=args, kwargs=kwargs)
    worker.start()
    try:
        assert streamer.ended.wait(WAIT)
        cache.retain()                           # refused with ContextBusyError before
        hit = cache.fork()
        hit.close()
    finally:
        streamer.used.set()
        worker.join(WAIT)
    assert not worker.is_alive() and len(streamer.tokens) == 4      # the prompt, then 3 new tokens
    cache.close()


def test_a_model_that_rewrites_its_rotary_frequencies_as_it_runs_keeps_its_cache():
    """From an audit: with buffers in the fingerprint, a dynamic-NTK model (it recomputes ``inv_freq``
    past its original length) was refused in the middle of its own generate, "weights changed". Its
    configuration stands for its rotary frequencies instead; the generate equals DynamicCache's."""
    settings = config()
    settings.max_position_embeddings = 16
    settings.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    torch.manual_seed(0)
    model = hf.attach(transformers.AutoModelForCausalLM.from_config(settings).eval())
    twin = copy.deepcopy(model)
    cache, dynamic = hf.KVStateCache.for_model(model, page_tokens=4), DynamicCache(config=settings)
    prompt = ids(20, 72)                                        # past the original 16 positions
    mine = model.generate(prompt, cache=cache, max_new_tokens=4, **GREEDY)
    assert torch.equal(mine, twin.generate(prompt, cache=dynamic, max_new_tokens=4, **GREEDY))
    run(copy.deepcopy(model), cache, ids(1, 73))               # the same weights and configuration: the same model
    cache.close()


def test_setting_the_context_is_refused_while_another_thread_holds_the_cache():
    """From an audit: ``cache.context = ...`` went through while another thread's generate held the cache,
    and that generate's output and length were silently wrong."""
    model = llama()
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    other = cache.fork()
    inside, leave = threading.Event(), threading.Event()

    class Paused(LogitsProcessor):          # the generate holds the cache between its forwards, here
        def __call__(self, input_ids, scores):
            inside.set()
            leave.wait(WAIT)
            return scores

    worker = threading.Thread(target=model.generate, args=(ids(4, 76),),
                              kwargs=dict(cache=cache, max_new_tokens=1, logits_processor=LogitsProcessorList([Paused()]),
                                          **GREEDY))
    worker.start()
    try:
        assert inside.wait(WAIT)
        with pytest.raises(ContextBusyError, match="setting context"):
            cache.context = other.context
    finally:
        leave.set()
        worker.join(WAIT)
    cache.context = other.context.fork()                         # free again: it goes through
    other.close()
    cache.close()


def test_a_cache_with_no_kv_yet_follows_its_models_new_weights():
    """From an audit: ``for_model`` binds the kvstate cache it builds, and weights loaded before the first
    forward were refused as changed "since it computed the K/V this cache holds", though it held none."""
    model = llama()
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    model.load_state_dict(llama(seed=1).state_dict())
    run(model, cache, ids(3, 75))
    assert len(cache.context) == 3
    cache.close()


def test_an_operation_waits_out_another_threads_operation():
    """From an audit: threads forking their own caches from one root (README's advice) collided now and
    then, and one got ContextBusyError for its fork; while another thread snapshotted the root, every
    fork did. An operation now waits for another thread's operation; a generate still refuses at once."""
    model = llama()
    root = hf.KVStateCache.for_model(model, page_tokens=4)
    run(model, root, ids(5, 77))
    writing, resume = threading.Event(), threading.Event()

    class SlowStream(io.BytesIO):            # a snapshot's destination that stalls mid-write
        def write(self, data):
            writing.set()
            assert resume.wait(WAIT)
            return super().write(data)

    snapshotting = threading.Thread(target=root.snapshot, args=(SlowStream(),))
    snapshotting.start()
    forks, errors = [], []

    def fork():
        try:
            forks.append(root.fork())
        except ContextBusyError as error:
            errors.append(error)
    try:
        assert writing.wait(WAIT)
        forking = threading.Thread(target=fork)
        forking.start()
        forking.join(0.2)
        assert forking.is_alive() and not forks and not errors      # waiting for the snapshot to end
    finally:
        resume.set()
        snapshotting.join(WAIT)
    forking.join(WAIT)
    assert not errors and len(forks) == 1 and len(forks[0].context) == 5
    forks[0].close()
    root.close()


def test_another_model_does_not_take_a_cache_bound_and_still_empty():
    """From a review: an empty kvstate cache went to whichever model asked, so a second model could take
    it while the first's first forward was under way, and that forward's K/V landed under its binding."""
    first, second = llama(), llama(seed=1)
    cache = hf.KVStateCache.for_model(first, page_tokens=4)
    with pytest.raises(UnsupportedModelError, match="another model"):
        hf.KVStateCache.for_model(second, kv=cache.kv)
    cache.close()


def test_a_submodule_swapped_in_through_its_parents_dict_is_another_model():
    """From a review: ``parent._modules[name] = new`` (as quantizers and adapter libraries swap layers)
    fires no registration hook, and the old layer's parameters were unchanged: the key passed."""
    model = llama()
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    run(model, cache, ids(4, 78))
    model.model.layers._modules["1"] = llama(seed=1).model.layers[1]
    with pytest.raises(UnsupportedModelError, match="weights changed"):
        run(model, cache, ids(1, 79))
    cache.close()


def test_the_registration_hook_leaves_modules_it_cannot_hash_alone():
    """From a review: once a fingerprint was taken, the process-wide hook hashed every module registering
    a submodule anywhere, and one declared ``@dataclass(eq=True)`` (no hash) could no longer be built."""
    import dataclasses

    model = llama()
    hf.KVStateCache.for_model(model, page_tokens=4).close()

    @dataclasses.dataclass(eq=True)
    class Head(torch.nn.Module):
        width: int = 4

        def __post_init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(self.width, self.width)
    assert Head().proj.in_features == 4


def test_the_same_weights_under_other_configuration_multipliers_are_another_model():
    """From a review: a list of the configuration fields that change K/V missed Granite's embedding and
    residual multipliers; every field but those known not to change K/V is hashed now."""
    settings = transformers.GraniteConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = hf.attach(transformers.AutoModelForCausalLM.from_config(settings).eval())
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    run(model, cache, ids(4, 80))
    settings.embedding_multiplier = 12.0
    other = hf.attach(transformers.AutoModelForCausalLM.from_config(settings).eval())
    other.load_state_dict(model.state_dict())
    with pytest.raises(UnsupportedModelError, match="another model"):
        run(other, cache, ids(1, 81))
    cache.close()


def test_a_setting_that_leaves_kv_alone_does_not_make_another_model():
    """From a review: with every configuration field hashed but a list of those that leave K/V alone, a
    dropout rate or a router-logits flag set at run time made the same weights, hashed again after a
    ``load_state_dict`` of themselves, "changed"."""
    model = llama()
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    run(model, cache, ids(4, 82))
    model.config.attention_dropout = 0.1
    model.config.output_router_logits = True
    model.load_state_dict(model.state_dict())               # the same weights: hashed again
    run(model, cache, ids(1, 83))
    assert len(cache.context) == 5
    cache.close()



def test_the_fingerprint_names_the_weights_not_the_wrapper_and_marks_a_config_it_cannot_spell_stably():
    """From a review, now that snapshots carry the fingerprint to other processes: ``torch.compile``'s
    wrapper renamed every parameter (``_orig_mod.``), so the same weights compiled looked like another
    model; and a configuration value spelled by its ``repr`` with an address differs in every process,
    so such a fingerprint is this process's alone (a snapshot then names no model)."""
    model = llama()
    plain = hf_identity.model_fingerprint(model)
    assert hf_identity.model_fingerprint(torch.compile(model)) == plain
    assert plain not in hf_identity._PROCESS_LOCAL and hf_identity.expected_producer(model) is not None
    odd = llama()
    odd.config.kv_helper = object()         # not JSON, and its repr holds an address
    assert hf_identity.model_fingerprint(odd) in hf_identity._PROCESS_LOCAL
    assert hf_identity.expected_producer(odd) is None


def test_a_compiled_model_generates_on_the_cache_built_for_it_and_is_hashed_once(monkeypatch):
    """From an audit: ``for_model(torch.compile(model))`` attached the wrapper, but the wrapper's
    ``generate`` is the model's own and calls the model, not the wrapper: no hook fed its ids
    (``TokenError``), nor those of the uncompiled model continuing the cache; and the wrapper and the
    model were hashed apart. The compiled model is attached and bound; its wrapper stands for it."""
    calls = counted_hashes(monkeypatch)
    model = llama()
    compiled = torch.compile(model, backend="eager")        # nothing below traces: generate calls the model
    cache = hf.KVStateCache.for_model(compiled, page_tokens=4)
    prompt = ids(5, 90)
    out = compiled.generate(prompt, cache=cache, max_new_tokens=3, **GREEDY)
    assert torch.equal(out, model.generate(prompt, cache=DynamicCache(), max_new_tokens=3, **GREEDY))
    run(model, cache, out[:, -1:])                          # the model itself continues it
    assert len(cache.context) == 8 and len(calls) == 1
    cache.close()


def test_a_causal_lm_and_its_decoder_continue_each_others_cache():
    """From an audit: hand-fed forwards of a model never attached are refused on a bound cache, and the way
    out the refusal names, ``hf.attach(model.model)``, raised ``AttributeError`` (a decoder has no
    ``prepare_inputs_for_generation``); attached, the decoder was refused as another model (its parameters
    are named otherwise and it has no head), though its layers compute the causal LM's very K/V."""
    model = llama()
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    reference = DynamicCache()
    prompt, more = ids(4, 92), ids(2, 93)
    run(model, cache, prompt)
    run(model, reference, prompt)
    decoder = hf.attach(model.model)
    with torch.no_grad():
        hidden = decoder(more, cache=cache).last_hidden_state
        assert torch.equal(hidden, decoder(more, cache=reference).last_hidden_state)
    assert len(cache.context) == 6
    stranger = hf.attach(llama(seed=9).model)               # another model's decoder is still another model
    with pytest.raises(UnsupportedModelError, match="another model"), torch.no_grad():
        stranger(ids(1, 94), cache=cache)
    assert torch.equal(run(model, cache, ids(1, 95))[0], run(model, reference, ids(1, 95))[0])
    cache.close()


def test_a_forward_from_inputs_embeds_is_told_so_and_the_way_in():
    """From an audit: an attached model run from ``inputs_embeds`` (its hook feeds no ids) was told it
    was never attached. It is told it gave no ids, and the hand-fed way in works: DynamicCache's logits."""
    model = llama()
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    prompt = ids(4, 99)
    embeds = model.get_input_embeddings()(prompt).detach()
    with torch.no_grad(), pytest.raises(spec_errors.TokenError, match="given no input_ids"):
        model(inputs_embeds=embeds, cache=cache)
    assert len(cache.context) == 0
    cache.feed(prompt)
    with torch.no_grad():
        logits = model.forward(inputs_embeds=embeds, cache=cache).logits
    assert torch.equal(logits, run(model, DynamicCache(), prompt)[0]) and len(cache.context) == 4
    cache.close()


def test_an_attached_model_pickles_and_its_copy_runs_its_own_methods():
    """From an audit: an attached model did not pickle (``torch.save(model)``, a process pool's hand-off):
    each wrapped method carried what ``functools.update_wrapper`` copied, ``generate``'s annotations
    among them, whose ForwardRefs hold code objects. The copy's wrapped methods are its own."""
    model = llama()
    cache = hf.KVStateCache.for_model(model, page_tokens=4)
    prompt = ids(4, 100)
    out = model.generate(prompt, cache=cache, max_new_tokens=2, **GREEDY)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copy_ = torch.load(buffer, weights_only=False)
    for name in ("forward", "generate", "prepare_inputs_for_generation"):
        method = getattr(copy_, name).method
        assert method.__self__ is copy_ and method.__func__ is getattr(type(copy_), name)
    more = copy_.generate(out, cache=cache, max_new_tokens=2, **GREEDY)      # the same weights: the same model
    assert torch.equal(more, model.generate(out, cache=DynamicCache(), max_new_tokens=2, **GREEDY))
    cache.close()


@pytest.mark.parametrize("given", [None, "gpt2", 3])
def test_a_model_that_is_not_a_model_is_refused_by_name(given, tmp_path):
    """A checkpoint's name where the model goes (an easy slip) raised an AttributeError deep in transformers."""
    with pytest.raises(spec_errors.ConfigError, match="needs a transformers model or its config"):
        hf.KVStateCache.for_model(given)
    with pytest.raises(spec_errors.ConfigError, match="needs a transformers model or its config"):
        hf.KVStateCache.restore(given, tmp_path / "never.kvs")


def test_a_layer_past_the_last_is_what_transformers_cache_says():
    """A ``Cache`` answers 0 (and a mask of the query alone) for a layer it has not made; an IndexError was another
    answer where transformers expects a ``Cache``."""
    model = llama()
    cache = hf.KVStateCache.for_model(model)
    reference = DynamicCache()
    with torch.no_grad():
        model(ids(5, 1), past_key_values=cache, use_cache=True)
        model(ids(5, 1), past_key_values=reference, use_cache=True)
    for layer in (0, 1, 2, 9):
        assert cache.get_seq_length(layer) == reference.get_seq_length(layer)
        assert cache.get_mask_sizes(3, layer) == reference.get_mask_sizes(3, layer)
    cache.close()


def test_a_model_whose_kv_come_from_images_too_is_refused_by_name():
    """An outside audit (s69): Llava was held, its image positions keyed by the placeholder id alone, and a
    request with another image hit the first image's K/V (its generation continued the first image's)."""
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, image_size=8, patch_size=4, projection_dim=32)
    multimodal = transformers.LlavaConfig(vision_config=vision, text_config=config(), image_token_index=96)
    with pytest.raises(UnsupportedModelError, match="images or audio as well as token ids"):
        hf.layout_of(multimodal)
    assert hf.layout_of(config()).layers == 2          # the text model alone is held


@pytest.mark.parametrize("rope", ["dynamic", "longrope"])
def test_prefix_reuse_of_a_length_dependent_rotary_model_is_refused_and_one_conversation_is_exact(rope):
    """The same audit: a short request hitting a long one's prefix got K/V rotated for the long length (1e-4
    to 1e-3 off transformers' logits). ``retain`` and ``match`` are refused by name; one conversation,
    continued past the rotary's original length, still equals DynamicCache bit for bit."""
    parameters = {"rope_type": rope, "rope_theta": 10000.0, "factor": 2.0}
    if rope == "longrope":
        parameters = {"rope_type": rope, "rope_theta": 10000.0, "short_factor": [1.0] * 4, "long_factor": [4.0] * 4,
                      "original_max_position_embeddings": 16}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, rope_parameters=parameters, bos_token_id=0,
        eos_token_id=0)).eval()
    ids = torch.from_numpy(np.random.default_rng(3).integers(1, VOCAB, (1, 24)))
    cache = hf.KVStateCache.for_model(model, page_tokens=4, match="token")
    theirs = DynamicCache(config=model.config)
    greedy = dict(attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_logits=True)
    # transformers' dynamic rotary keeps the frequencies of its last long sequence: a fresh model's first
    # run differs from every later one, DynamicCache's too, so one run first
    model.generate(ids, cache=DynamicCache(config=model.config), **greedy)
    ours_out, theirs_out = model.generate(ids, cache=cache, **greedy), model.generate(ids, cache=theirs, **greedy)
    assert all(torch.equal(a, b) for a, b in zip(ours_out.logits, theirs_out.logits))
    # the kvstate cache underneath refuses too: reaching it directly once got a hit at another length
    for refused in (cache.retain, lambda: hf.KVStateCache.for_model(model, cache.kv).match(ids),
                    lambda: cache.kv.retain(cache.rows[0]), lambda: cache.kv.match(ids[0].tolist())):
        with pytest.raises(UnsupportedModelError, match=f"rotary embedding \\('{rope}'\\)"):
            refused()
    assert cache.kv.stats()["entries"] == 0
    cache.close()
