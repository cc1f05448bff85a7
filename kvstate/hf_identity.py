"""Which model's K/V a kvstate cache holds: a fingerprint of the model's weights and configuration,
kept cheaply current, and the binding of a kvstate cache to the first model that writes into it.

A model of the same layout computes other K/V, and a prefix hit or a continuation would read them as
its own; so would the same model given other weights since. ``bind_model`` refuses both by name before
a forward computes anything. Per forward it reads each parameter's data pointer and version counter
(``_Weights``), and which packed object holds each quantized weight (``torch.ao``), never their values;
the values are hashed again (``model_fingerprint``: every one, by row) only when one of those changed, a
submodule was swapped, or a parameter or submodule registered on a fingerprinted model's module changed
its parameters.
"""

from __future__ import annotations

import hashlib
import json
import operator
import secrets
import threading
import weakref

import torch

from kvstate.impl import Cache
from kvstate.spec.errors import UnsupportedModelError

__all__ = ["bind_model", "is_bound", "fingerprint_of", "model_fingerprint", "snapshot_producer", "expected_producer",
           "CONFIG_FIELDS_NOT_KV"]

# Which model's K/V each kvstate cache holds, by ``model_fingerprint``, and the model object that bound
# it (weakly): another model of the same layout computes other K/V, and a hit or a continuation would
# read them as its own; the same model given other weights since is refused as well.
_MODEL_OF: "weakref.WeakKeyDictionary[Cache, tuple]" = weakref.WeakKeyDictionary()

# Each model object's fingerprint and what it was taken from (``_Weights``). Kept here, not on the model:
# a ``copy.deepcopy`` of the model copied an attribute, and a copy loaded with other weights passed for
# the original.
_WEIGHTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# A token per model object whose weights cannot be read (``meta``): it then matches itself only.
_UNREADABLE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# The fingerprints that hold such a token: they mean nothing to another process, so no snapshot names them.
_PROCESS_LOCAL: set[str] = set()
_WEIGHTS_LOCK = threading.Lock()
# Bumped whenever a module of a fingerprinted model registers a parameter or a submodule (``setattr``,
# ``load_state_dict(assign=True)``, adapters injected into a model): every model's parameter list is
# then walked again. Writes into ``module._parameters`` itself are caught by the per-forward key.
_STRUCTURE = [0]
# The modules of every model fingerprinted so far (weakly). Registrations on other modules bump
# nothing: a Llama forward slices its list of layers (``self.layers[:n]``), which registers every
# layer into a new ModuleList, and counted, that hashed the whole model again on every forward.
# By id, each with a weak reference that takes it out when the module goes: the hook runs on every
# registration in the process and must not hash a module (one declared ``@dataclass(eq=True)`` cannot be).
_MEMBERS: dict[int, "weakref.ref"] = {}
SAMPLES = 64        # values hashed per parameter, spread over it (its first ones too)
_version_of = operator.attrgetter("_version")


def _structure_changed(module, *args) -> None:
    member = _MEMBERS.get(id(module))
    if member is not None and member() is module:
        _STRUCTURE[0] += 1


def _add_members(modules) -> None:
    for module in modules:
        key = id(module)
        try:
            _MEMBERS[key] = weakref.ref(module, lambda _gone, key=key: _MEMBERS.pop(key, None))
        except TypeError:       # no weak references to it: its registrations go uncounted
            pass


_watching: list = []       # the two registration hooks, once registered (``_watch_structure``)


def _watch_structure() -> None:
    """Register the process-wide hooks behind ``_STRUCTURE`` once, when a model's fingerprint is first
    taken, not at import: a process that imports kvstate.hf and never uses it keeps torch's hooks as
    they were."""
    if _watching:
        return
    with _WEIGHTS_LOCK:
        if not _watching:
            _watching.extend((torch.nn.modules.module.register_module_parameter_registration_hook(_structure_changed),
                              torch.nn.modules.module.register_module_module_registration_hook(_structure_changed)))


class _Weights:
    """A model's fingerprint and the cheap key of the weights it was taken from: each parameter's data
    pointer and version counter (bumped by every in-place write through the tensor: ``load_state_dict``,
    optimizer steps, ``param.add_``), read through the module dicts that hold them, so a parameter
    replaced in place is seen too. Taken again when the key or the modules' structure changes; the values
    are hashed again only where the parameters, their key or the configuration differ from ``before``'s
    (the model's last ``_Weights``): that hash reads every weight, and a registration that changed no
    parameter (a submodule set again) is no reason to."""

    __slots__ = ("structure", "holders", "names", "versions", "key", "parents", "child_names", "children",
                 "packed", "config", "fingerprint")

    def __init__(self, model, before: "_Weights | None" = None):
        self.structure = _STRUCTURE[0]
        modules = list(model.modules())
        _add_members(modules)
        # Each submodule where its parent keeps it: one swapped in through ``parent._modules[name]`` (as
        # quantizers and adapter libraries do) fires no registration hook, and its weights are new.
        links = [(module._modules, name, child) for module in modules
                 for name, child in module._modules.items() if child is not None]
        self.parents, self.child_names = [parent for parent, _, _ in links], [name for _, name, _ in links]
        self.children = [child for _, _, child in links]
        slots = [(module._parameters, name) for module in modules
                 for name, param in module._parameters.items() if param is not None]
        self.holders, self.names = [holder for holder, _ in slots], [name for _, name in slots]
        params = [holder[name] for holder, name in slots]
        # An inference tensor (made under ``torch.inference_mode``) has no version counter; it cannot be
        # written outside inference mode either. Decided per parameter: one such tensor in a model (a
        # base loaded under inference mode) left the others' writes unseen when it was decided for all.
        self.versions = not any(param.is_inference() for param in params)
        # Quantized weights (``torch.ao``) are packed in an opaque object no version counter watches; new
        # weights are a new object (``set_weight_bias`` packs them anew), so its identity is the key.
        self.packed = [(module, module._packed_params) for module in modules if _holds_packed(module)]
        self.key = self.read_key()
        self.config = _kv_config(getattr(getattr(model, "_orig_mod", model), "config", None))[0]
        self.fingerprint = before.fingerprint if self.same_weights(before) else model_fingerprint(model, _UNREADABLE)

    def same_weights(self, before: "_Weights | None") -> bool:
        """The same parameters, in the same module dicts, with the same key, and the same configuration."""
        return (before is not None and self.key == before.key and self.names == before.names
                and all(map(operator.is_, self.holders, before.holders)) and self.config == before.config
                and len(self.packed) == len(before.packed)
                and all(a is c and b is d for (a, b), (c, d) in zip(self.packed, before.packed)))

    def read_key(self):
        params = list(map(dict.__getitem__, self.holders, self.names))
        pointers = list(map(torch.Tensor.data_ptr, params))
        if self.versions:       # no inference tensor: every version counter, in one map
            return pointers, list(map(_version_of, params))
        return pointers, [None if param.is_inference() else param._version for param in params]

    def current(self) -> bool:
        if self.structure != _STRUCTURE[0]:
            return False
        if not all(map(operator.is_, map(dict.get, self.parents, self.child_names), self.children)):
            return False
        if not all(getattr(holder, "_packed_params", None) is packed for holder, packed in self.packed):
            return False
        try:
            return self.read_key() == self.key
        except (KeyError, AttributeError, RuntimeError):       # a parameter removed or set to None
            return False


def fingerprint_of(model) -> str:
    """``model_fingerprint(model)``, taken again only when the weights may have changed (see ``_Weights``):
    per forward this reads each parameter's data pointer and version counter, never its values. A
    ``torch.compile`` wrapper's is its model's, hashed once for both."""
    model = _compiled(model)
    known = _WEIGHTS.get(model)
    if known is not None and known.current():
        return known.fingerprint
    _watch_structure()      # before the weights are read: a change from then on bumps ``_STRUCTURE``
    with _WEIGHTS_LOCK:
        known = _Weights(model, known)
        _WEIGHTS[model] = known
    return known.fingerprint


# The configuration fields that leave the K/V a model computes from its weights as they are: where it
# was loaded from, how it is run and generated with, its token ids and labels. Every other field is
# hashed with the weights (``_kv_config``): an allow-list missed fields that do change K/V from the same
# weights (Granite's embedding and residual multipliers), where a field hashed needlessly only refuses
# a model that might have gone on.
CONFIG_FIELDS_NOT_KV = frozenset((
    "_name_or_path", "name_or_path", "architectures", "transformers_version", "_commit_hash", "torch_dtype",
    "dtype", "use_cache", "output_attentions", "output_hidden_states", "return_dict", "use_return_dict",
    "torchscript", "_attn_implementation", "attn_implementation", "_attn_implementation_autoset",
    "_attn_implementation_internal", "_experts_implementation", "bos_token_id", "eos_token_id", "pad_token_id",
    "sep_token_id", "decoder_start_token_id", "id2label", "label2id", "problem_type", "finetuning_task",
    "task_specific_params", "tokenizer_class", "prefix", "max_length", "min_length", "do_sample", "num_beams",
    "temperature", "top_k", "top_p", "repetition_penalty", "pruned_heads", "chunk_size_feed_forward",
    "tie_word_embeddings", "use_bfloat16", "is_encoder_decoder", "output_router_logits", "output_scores",
    "return_dict_in_generate", "initializer_range", "init_std"))


def _leaves_kv(field: str) -> bool:
    """Whether a configuration field leaves K/V as they are: those named, and dropout rates (none at
    inference) and training losses' coefficients, by their names."""
    return (field in CONFIG_FIELDS_NOT_KV or field.endswith(("dropout", "pdrop", "dropout_prob"))
            or field.endswith("_loss_coef"))


def _kv_config(config) -> tuple[bytes, bool]:
    """``config``'s fields that may change K/V (all but ``CONFIG_FIELDS_NOT_KV``, sub-configurations'
    too), as they differ from the class's defaults, in a stable spelling; and whether that spelling
    may differ in another process (a value JSON cannot spell whose ``repr`` holds an address, or a set
    of strings, whose order follows the process's hash seed)."""
    if config is None or not hasattr(config, "to_diff_dict"):
        return b"", False
    local = []

    def kept(value):
        if isinstance(value, dict):
            return {key: kept(item) for key, item in value.items() if not (isinstance(key, str) and _leaves_kv(key))}
        return value

    def spelled(value):
        if isinstance(value, (set, frozenset)):
            return sorted(map(repr, value))
        text = repr(value)
        if " at 0x" in text:
            local.append(text)
        return text
    spelling = json.dumps(kept(config.to_diff_dict()), sort_keys=True, default=spelled).encode()
    return spelling, bool(local)


def model_fingerprint(model, unreadable=None) -> str:
    """What tells a model's weights from another's of the same shape: a hash of each parameter's (and
    each quantized weight's, unpacked: ``_weights_of``) name, shape, dtype, ``SAMPLES`` values spread over it (its first and last included) and a hash of
    each of its rows' values (``_row_hashes``), and of the configuration fields that may change K/V
    (``_kv_config``). It reads every weight once (``fingerprint_of`` takes it again only when the
    weights may have changed). Two
    loads of the same checkpoint agree. Weights whose values cannot be read here
    (the ``meta`` device of an offloaded model) are hashed with a token of this model object
    (kept in ``unreadable``, a dict by model; a new one each call without it): the model then
    matches no other, not even another load of the same checkpoint."""
    digest = hashlib.blake2b(digest_size=16)
    samples: dict = {}          # device -> [(parameter index, its sample)]
    model = getattr(model, "_orig_mod", model)      # torch.compile's wrapper names every parameter "_orig_mod."
    config, local = _kv_config(getattr(model, "config", None))    # local: the fingerprint means nothing elsewhere
    digest.update(config)
    with torch.no_grad():
        # Not the buffers: a model may rewrite them as it runs (dynamic-NTK and longrope scaling recompute
        # the rotary frequencies past the original length), and a fingerprint that hashed them refused
        # the very model that computed a cache. The configuration stands for them (its rope fields).
        for index, (name, param) in enumerate(_weights_of(model)):
            digest.update(f"{name}{tuple(param.shape)}{param.dtype}".encode())
            read = None if param.is_meta else _read(param)
            if read is None:
                token = (unreadable if unreadable is not None else {}).setdefault(model, secrets.token_bytes(16))
                digest.update(b"unreadable" + token)
                local = True
            else:
                samples.setdefault(read[0].device, []).append((index, *read))
        # One copy to the host per device, then hashed in parameter order: the same weights spread over
        # devices another way (another device map, on another machine) hash the same.
        on_host = []
        for parts in samples.values():
            values = _to_host([sample for _, sample, _ in parts])
            rows = _to_host([hashes for _, _, hashes in parts])
            on_host += zip((index for index, _, _ in parts), values, rows)
        for _, values, rows in sorted(on_host, key=lambda read: read[0]):
            digest.update(values.numpy().tobytes())
            digest.update(rows.numpy().tobytes())
    fingerprint = digest.hexdigest()
    if local:
        _PROCESS_LOCAL.add(fingerprint)
    return fingerprint


def _weights_of(model) -> list:
    """``(name, tensor)`` for every weight of ``model``: its parameters, then its quantized weights
    (``_packed_holders``), each unpacked into plain tensors: a quantized tensor's integers and its
    quantization parameters (``_unpacked``)."""
    return list(model.named_parameters()) + [(f"{name}.{part}", tensor) for name, holder in _packed_holders(model)
                                             for part, tensor in _unpacked(holder)]


def _packed_holders(model) -> list:
    """``(name, module)`` for each module of ``model`` holding ``torch.ao`` quantized weights packed (a
    quantized ``Linear``'s ``LinearPackedParams``: ``quantize_dynamic`` moves every ``nn.Linear`` weight
    there, out of ``model.parameters()``), which its ``_weight_bias`` unpacks."""
    return [(name, module) for name, module in model.named_modules() if _holds_packed(module)]


def _holds_packed(module) -> bool:
    """Whether ``module`` holds packed quantized weights itself (not the quantized ``Linear`` above it,
    whose ``_packed_params`` is that holder)."""
    return (callable(getattr(module, "_weight_bias", None)) and hasattr(module, "_packed_params")
            and not isinstance(module._packed_params, torch.nn.Module))


def _unpacked(holder) -> list:
    """``(part, tensor)`` of a packed holder's weight and bias: a quantized weight as its integers, its
    scales and zero points (per tensor, or per channel and the axis); a float16 one as it is."""
    weight, bias = holder._weight_bias()
    parts = [("weight", weight.int_repr() if weight.is_quantized else weight)]
    if weight.is_quantized and weight.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        parts.append(("qparams", torch.tensor([weight.q_scale(), weight.q_zero_point()], dtype=torch.float64)))
    elif weight.is_quantized:
        parts += [("scales", weight.q_per_channel_scales()), ("zero_points", weight.q_per_channel_zero_points()),
                  ("axis", torch.tensor([weight.q_per_channel_axis()]))]
    return parts + ([("bias", bias)] if bias is not None else [])


def snapshot_producer(kv: Cache) -> bytes | None:
    """What a snapshot of ``kv``'s K/V names as its producer (format version 3): the fingerprint of the
    model that computed them (bound to ``kv``), or None where none is bound or its weights could not
    be read (that fingerprint holds a token of this process's model object)."""
    bound = _MODEL_OF.get(kv)
    if bound is None or bound[0] in _PROCESS_LOCAL:
        return None
    return bytes.fromhex(bound[0])


def expected_producer(model) -> bytes | None:
    """The producer a snapshot restored for ``model`` must name, where it names one; None where the
    model's weights cannot be read."""
    mine = fingerprint_of(model)
    return None if mine in _PROCESS_LOCAL else bytes.fromhex(mine)


def _to_host(parts: list) -> list:
    """``parts`` (tensors of one device and dtype) on the host, in one copy."""
    return list(torch.cat(parts).cpu().split([len(part) for part in parts]))


def _read(param):
    """What the fingerprint hashes of ``param``'s values: ``_sample`` and ``_row_hashes``; None if
    either cannot be read (a packed or quantized tensor kvstate cannot read)."""
    try:
        return _sample(param), _row_hashes(param)
    except (RuntimeError, TypeError, NotImplementedError):
        return None


def _sample(param):
    """``SAMPLES`` values spread over ``param`` and its last one, as float32."""
    flat = param.detach().reshape(-1)
    step = max(1, flat.numel() // SAMPLES)
    return torch.cat([flat[::step][:SAMPLES], flat[-1:]]).to(torch.float32)


# An integer type of each element size: a value's bits, whatever its dtype (float8 included), read as one.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _row_hashes(param):
    """A hash of every value of each row of ``param`` (along its first dimension), as int64: the xor of
    their bits. Samples alone passed weights edited between them (a fine-tune that changed some rows, an
    in-place edit of a few values); a changed value always changes its row's hash, and rows are hashed in
    order, so rows swapped show too. One pass over the weights, taken only when they may have changed."""
    if not param.numel():
        return torch.zeros(0, dtype=torch.int64, device=param.device)
    rows = param.detach().reshape(param.shape[0] if param.ndim > 1 else 1, -1)
    if rows.element_size() not in _BITS:
        raise TypeError(f"no integer type of {rows.element_size()} bytes to read {rows.dtype} values as")
    bits = rows.view(_BITS[rows.element_size()])
    try:
        return torch.hash_tensor(bits, dim=1).view(torch.int64)
    except (RuntimeError, NotImplementedError):     # no such kernel on this device: the same hash on the host
        return torch.hash_tensor(bits.cpu(), dim=1).view(torch.int64).to(bits.device)


def _compiled(model):
    """The model a ``torch.compile`` wrapper compiled (``_orig_mod``), or ``model``: one model, one binding."""
    return getattr(model, "_orig_mod", model)


def _decoder_of_the_bound(model, bound, held: str) -> bool:
    """Whether ``model`` computes the K/V of ``bound`` (the model bound to a kvstate cache, whose weights are
    still those of ``held``): one is the other's decoder (``base_model``), whose layers compute a causal LM's
    K/V. Their fingerprints differ (a head's weights, parameter names), yet a runtime reading hidden states
    through ``model.model`` continues the causal LM's cache with the very same K/V."""
    if bound is None or bound is model:
        return False
    related = getattr(bound, "base_model", None) is model or getattr(model, "base_model", None) is bound
    return related and fingerprint_of(bound) == held


def is_bound(kv: Cache) -> bool:
    """Whether a model is bound to ``kv`` (``bind_model``): its K/V are that model's."""
    return kv in _MODEL_OF


def bind_model(model, kv: Cache) -> None:
    """``kv`` holds ``model``'s K/V from now on: the first model to use a kvstate cache keeps it, and
    another one (its fingerprint differs), or the same model given other weights since, is refused by
    name before its forward computes anything. A ``torch.compile`` wrapper stands for the model it
    compiled, and a causal LM and its decoder (``base_model``: Llama's ``model.model``) for each other."""
    model = _compiled(model)
    mine = fingerprint_of(model)
    held, bound = _MODEL_OF.setdefault(kv, (mine, weakref.ref(model)))
    if held == mine or _decoder_of_the_bound(model, bound(), held):
        return
    if bound() is model:
        if kv.stats()["live_pages"] == 0:
            # Given other weights before any K/V was written (``for_model`` binds when it builds the cache):
            # nothing of its old weights' to misread. This model only: another one taking an empty cache
            # raced the first's forward, whose K/V then landed under its binding.
            _MODEL_OF[kv] = (mine, weakref.ref(model))
            return
        raise UnsupportedModelError(
            f"this model's weights changed since it computed the K/V this kvstate cache holds ({type(model).__name__}: "
            "load_state_dict, an optimizer step, an in-place edit, a dtype conversion, an injected adapter): its "
            "contexts and prefix hits hold the old weights' K/V; build a cache for the new ones with "
            "KVStateCache.for_model(model), or, where the change can be undone exactly, undo it")
    raise UnsupportedModelError(
        f"this kvstate cache holds K/V another model computed ({type(model).__name__} has the same layout "
        "but other weights): its contexts and prefix hits are not this model's; build a cache for this "
        "model with KVStateCache.for_model(model)")
