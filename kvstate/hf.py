"""kvstate under Hugging Face transformers: a ``transformers.Cache`` whose K/V live in a kvstate context.

    from kvstate import hf
    cache = hf.KVStateCache.for_model(model)            # attaches the token-id hook, allocates a context
    out = model.generate(ids, cache=cache, max_new_tokens=20)
    branch = cache.fork()                                # shares every page
    cache.snapshot("turn.kvs"); later = hf.KVStateCache.restore(model, "turn.kvs")

How the cache learns token ids (it never guesses): a kvstate position carries
its token id, but ``Cache.update`` only sees K/V. ``attach(model)`` (done by
``for_model``) registers a forward pre-hook that hands the forward's
``input_ids`` to ``feed``; ``generate`` calls the model's forward, so it is
covered too. Without the hook, call ``cache.feed(ids)`` before each forward.
K/V that arrive for positions whose ids were not fed raise ``TokenError``.

Buffering: transformers calls ``update`` layer by layer, but ``Context.extend``
takes every layer of a position at once. The new positions' K/V wait in a
per-layer buffer; when the last layer has arrived they are extended in one call.
Each layer's ``update`` returns the context's past K/V for that layer followed
by the new positions, as one contiguous ``(1, kv_heads, n, head_dim)`` tensor,
exactly the tensor ``DynamicCache`` would return: at f32 the logits are equal
bit for bit. At f16 and q8 the new positions are returned as they will read back
from the context (``kvstate.spec.precision.roundtrip``), so a position looks the
same to attention in the step that computed it as in every later step.

One context holds one sequence: batch size 1. Best-of-N is N forks, each run on
its own; the shared prefix's pages are stored once.
"""

from __future__ import annotations

import numpy as np

from .hf_config import check_layout, layout_of, require_transformers

transformers = require_transformers()

import torch  # noqa: E402
from transformers.cache_utils import Cache as _HFCache  # noqa: E402
from transformers.cache_utils import CacheLayerMixin  # noqa: E402

from kvstate.impl import Cache  # noqa: E402
from kvstate.spec.errors import PositionError, ShapeError, TokenError, UnsupportedModelError  # noqa: E402
from kvstate.spec.layout import check_tokens  # noqa: E402
from kvstate.spec.precision import roundtrip  # noqa: E402

__all__ = ["KVStateCache", "attach", "layout_of"]


class _Layer(CacheLayerMixin):
    """One model layer's view of the shared context; the cache does the work."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, owner: "KVStateCache", index: int):
        super().__init__()
        self.owner, self.index = owner, index
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self.owner._update(self.index, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.owner._layer_length(self.index)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.owner.reset()

    def crop(self, tokens_to_remove: int) -> None:
        self.owner.crop(tokens_to_remove)

    def offload(self):
        pass

    def prefetch(self):
        pass


class KVStateCache(_HFCache):
    """A transformers cache over one kvstate context (see the module docstring)."""

    def __init__(self, layout, kv: Cache, context):
        check_layout(layout, kv.layout, "the kvstate cache")
        self.layout, self.kv, self.context = layout, kv, context
        self._pending: list = [None] * layout.layers      # raw float32 (kv_heads, n, head_dim) K and V
        self._ids: np.ndarray | None = None
        self._host_pages = kv.store.__class__.__name__ == "NumpyStore"    # pages are NumPy arrays
        super().__init__(layers=[_Layer(self, i) for i in range(layout.layers)])

    # -- construction -------------------------------------------------------------

    @classmethod
    def for_model(cls, model, kv: Cache | None = None, context=None, **cache_args) -> "KVStateCache":
        """A cache for ``model``: checks the model (refusing by name what it cannot hold),
        builds a kvstate ``Cache`` with ``cache_args`` unless ``kv`` is given, attaches the
        token-id hook and allocates a context unless one is given."""
        layout = layout_of(model)
        if kv is None:
            kv = Cache(layout, **_defaults(model, cache_args))
        check_layout(layout, kv.layout, "the kvstate cache")
        if context is not None:
            check_layout(layout, context.layout, "the context")
        attach(model)
        return cls(layout, kv, context if context is not None else kv.allocate())

    @classmethod
    def restore(cls, model, source, kv: Cache | None = None, **cache_args) -> "KVStateCache":
        """A cache holding the snapshot at ``source``, ready to continue generating."""
        layout = layout_of(model)
        if kv is None:
            kv = Cache(layout, **_defaults(model, cache_args))
        check_layout(layout, kv.layout, "the kvstate cache")
        return cls.for_model(model, kv, kv.restore(source))

    # -- token ids ------------------------------------------------------------------

    def feed(self, ids) -> "KVStateCache":
        """The token ids of the positions the next forward pass adds (``(n,)`` or ``(1, n)``).

        ``None`` forgets them (a forward from ``inputs_embeds``: its K/V are then refused).
        A forward that stopped part-way left K/V of some layers buffered: they are dropped.
        """
        self._pending = [None] * self.layout.layers
        if ids is None:
            self._ids = None
            return self
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().cpu().numpy()
        ids = np.asarray(ids)
        if ids.ndim == 2:
            if ids.shape[0] != 1:
                raise ShapeError(f"a kvstate cache holds one sequence; input_ids has batch size {ids.shape[0]} "
                                 "(fork the cache once per sequence)")
            ids = ids[0]
        self._ids = check_tokens(ids)
        return self

    def check_prefix_of(self, input_ids, attention_mask=None) -> None:
        """Refuse (``TokenError``, naming the first differing position) a prompt that the ids this
        cache holds do not begin."""
        held = self.context.tokens
        if not held:
            return
        row = input_ids[0] if input_ids.ndim == 2 else input_ids
        prompt = row.detach().cpu().tolist()
        for position, (mine, theirs) in enumerate(zip(held, prompt)):
            if mine != theirs:
                raise TokenError(f"the cache holds token {mine} at position {position}, but the prompt has {theirs} "
                                 "there: the cache is not a prefix of this prompt (match() or a fresh cache)")
        if len(prompt) <= len(held):
            raise TokenError(f"the cache holds {len(held)} positions, but the prompt has only {len(prompt)}: "
                             "nothing is left to compute the next token from (truncate the cache first)")

    # -- the transformers Cache API --------------------------------------------------

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return self._update(layer_idx, key_states, value_states)

    def _update(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor):
        batch, heads, n, head_dim = key_states.shape
        if batch != 1:
            raise ShapeError(f"a kvstate cache holds one sequence; K/V arrived with batch size {batch}")
        if not 0 <= layer < self.layout.layers:
            raise UnsupportedModelError(f"K/V arrived for layer {layer}, but the cache's layout {self.layout} "
                                        f"has {self.layout.layers} layers")
        if (heads, head_dim) != (self.layout.kv_heads, self.layout.head_dim):
            raise UnsupportedModelError(
                f"layer {layer} produced K/V with {heads} heads of {head_dim}, but the layout is {self.layout}")
        if self._ids is None:
            raise TokenError(f"K/V for {n} new positions arrived at layer {layer}, but their token ids are unknown: "
                             "attach(model) or call cache.feed(input_ids) before the forward")
        if len(self._ids) != n:
            raise TokenError(f"{len(self._ids)} token ids were fed, but layer {layer} wrote {n} positions")
        if self._pending[layer] is not None:
            raise PositionError(f"layer {layer} was updated twice in one forward pass")
        k, v = key_states[0].to(torch.float32), value_states[0].to(torch.float32)
        self._pending[layer] = (k, v)
        keys, values = self._with_past(layer, self._as_read(k), self._as_read(v))
        if layer == self.layout.layers - 1:
            self._commit()
        return keys.to(key_states.dtype), values.to(value_states.dtype)

    def _as_read(self, x: torch.Tensor) -> torch.Tensor:
        """What ``x`` reads back as after the context stores it at its precision."""
        if self.kv.precision == "f32":
            return x
        return torch.from_numpy(roundtrip(self.kv.precision, x.detach().cpu().numpy())).to(x.device)

    def _with_past(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """The context's K and V of ``layer`` followed by the new ``k``, ``v``: each one
        contiguous ``(1, heads, n, dim)`` tensor.

        One ``torch.cat`` into a fresh contiguous tensor, as ``DynamicCache`` does: the
        attention matmul sees the same values with the same strides.
        """
        pages = self.context.read_layer_pages(layer)
        if self._host_pages:
            pages = [(torch.from_numpy(pk), torch.from_numpy(pv)) for pk, pv in pages]
        keys = [pk.transpose(0, 1) for pk, _ in pages]
        values = [pv.transpose(0, 1) for _, pv in pages]
        if keys and keys[0].device != k.device:        # a store on another device than the model
            keys, values = [p.to(k.device) for p in keys], [p.to(k.device) for p in values]
        keys.append(k)
        values.append(v)
        return torch.cat(keys, dim=1).unsqueeze(0), torch.cat(values, dim=1).unsqueeze(0)

    def _commit(self) -> None:
        """Every layer of the new positions has arrived: extend the context once."""
        missing = [i for i, pair in enumerate(self._pending) if pair is None]
        if missing:
            self.feed(None)
            raise PositionError(f"the forward pass skipped layers {missing}: their K/V never arrived")
        kv = torch.stack([torch.stack(pair) for pair in self._pending])   # (layers, 2, heads, n, dim)
        kv = kv.permute(3, 0, 1, 2, 4)                                      # (n, layers, 2, heads, dim)
        if self._host_pages:
            kv = kv.detach().cpu().numpy()
        ids, self._ids = self._ids, None
        self._pending = [None] * self.layout.layers
        self.context.extend(ids, kv)

    def _layer_length(self, layer: int) -> int:
        pending = self._pending[layer]
        return len(self.context) + (pending[0].shape[1] if pending is not None else 0)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._layer_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self._layer_length(layer_idx) + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' rollback: a negative count removes that many positions from the end."""
        if tokens_to_remove > 0:
            raise PositionError(f"crop takes a negative count of positions to remove, got {tokens_to_remove}")
        self.truncate(len(self.context) + tokens_to_remove)

    def reset(self) -> None:
        self.truncate(0)

    def reorder_cache(self, beam_idx) -> None:
        raise UnsupportedModelError("beam search reorders a batch; a kvstate cache holds one sequence (fork it)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        if repeats != 1:
            raise ShapeError(f"a kvstate cache holds one sequence; fork it instead of repeating it {repeats} times")

    def batch_select_indices(self, indices) -> None:
        if list(torch.as_tensor(indices).reshape(-1).tolist()) != [0]:
            raise ShapeError("a kvstate cache holds one sequence; it cannot select batch rows")

    def early_initialization(self, *args, **kwargs) -> None:
        pass        # layers are views of the context: nothing to allocate

    # -- the agent operations ----------------------------------------------------------

    @property
    def tokens(self) -> list[int]:
        """The token ids of the positions the context holds."""
        return self.context.tokens

    def fork(self) -> "KVStateCache":
        """A new cache on a fork of the context: every page shared, nothing copied."""
        self._refuse_mid_forward("fork")
        return type(self)(self.layout, self.kv, self.context.fork())

    def __deepcopy__(self, memo) -> "KVStateCache":
        return self.fork()      # a fork is an independent copy that shares pages until written

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` positions (backtrack to a checkpoint)."""
        self._refuse_mid_forward("truncate")
        self.context.truncate(n)

    def retain(self) -> None:
        """Keep a fork of this context in the prefix tree under its token ids."""
        self._refuse_mid_forward("retain")
        self.kv.retain(self.context)

    def match(self, tokens) -> int:
        """Replace this cache's context with the longest retained prefix of ``tokens``; the matched length.

        At most ``len(tokens) - 1`` positions are kept: the logits of the next token come
        from the forward of the last prompt token, so that one is always computed.
        ``generate(tokens, cache=cache)`` then prefills only the unmatched suffix.
        """
        self._refuse_mid_forward("match")
        tokens = check_tokens(tokens.reshape(-1).tolist() if isinstance(tokens, torch.Tensor) else tokens)
        found, matched = self.kv.match(tokens)
        if matched >= len(tokens) > 0:
            found.truncate(len(tokens) - 1)
            matched = len(tokens) - 1
        self.context.close()
        self.context = found
        return matched

    def snapshot(self, target) -> None:
        """Write the context (tokens and K/V) to a path, atomically, or a binary stream."""
        self._refuse_mid_forward("snapshot")
        self.context.snapshot(target)

    def close(self) -> None:
        """Release the context's pages."""
        self.context.close()

    def _refuse_mid_forward(self, what: str) -> None:
        if any(p is not None for p in self._pending):
            raise PositionError(f"{what} during a forward pass: some layers' K/V are not yet in the context")

    def __repr__(self) -> str:
        return f"KVStateCache({self.layout}, {self.context!r}, precision={self.kv.precision!r})"


def _defaults(model, cache_args: dict) -> dict:
    """A torch store on the model's device unless the caller chose otherwise."""
    args = {"store": "torch", **cache_args}
    if args["store"] == "torch" and "device" not in args:
        args["device"] = str(getattr(model, "device", "cpu"))
    return args


def _feed_hook(module, args, kwargs):
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if isinstance(cache, KVStateCache):
        check_model_fits(module._kvstate_layout, cache)
        ids = kwargs.get("input_ids")
        if ids is None and args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
            ids = args[0]
        cache.feed(ids)
    return None


def attach(model):
    """Register (once) the forward pre-hook that feeds each forward's ``input_ids`` to a
    ``KVStateCache`` passed as ``cache=`` (or ``past_key_values=``). Checks the model first."""
    model._kvstate_layout = layout_of(model)
    if getattr(model, "_kvstate_hook", None) is None:
        model._kvstate_hook = model.register_forward_pre_hook(_feed_hook, with_kwargs=True)
        model.prepare_inputs_for_generation = _prefix_checked(model.prepare_inputs_for_generation)
    return model


def check_model_fits(layout, cache: "KVStateCache") -> None:
    """A model whose layout is not the cache's is refused before its forward computes anything
    (a model with fewer layers would never complete a position; one with more would write past it)."""
    if layout != cache.layout:
        raise UnsupportedModelError(
            f"the model has layout {layout}, but this kvstate cache holds {cache.layout} "
            "(layers, kv_heads, head_dim): build the cache with KVStateCache.for_model(model)")


def _prefix_checked(prepare):
    """``generate``'s first step, checked: the ids a cache holds must begin the prompt it is asked to
    continue, or ``generate`` would continue another conversation (it slices off as many prompt ids
    as the cache holds without looking at them)."""
    def checked(input_ids, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, KVStateCache) and kwargs.get("is_first_iteration") and input_ids is not None:
            cache.check_prefix_of(input_ids, kwargs.get("attention_mask"))
        return prepare(input_ids, *args, **kwargs)
    checked.__wrapped__ = prepare
    return checked
