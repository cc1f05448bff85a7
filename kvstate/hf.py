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
covered too. Without the hook, call ``cache.feed(ids)`` before each forward; where a
model is bound to the kvstate cache (``for_model``, ``restore``), such a forward's K/V
are refused, since no model is there to check (attach it instead).
K/V that arrive for positions whose ids were not fed raise ``TokenError``.

Buffering: transformers calls ``update`` layer by layer, but ``Context.extend``
takes every layer of a position at once. The new positions' K/V wait in a
per-layer buffer; when the last layer has arrived they are extended in one call
(a batch's rows in one ``impl.batch_write.extend_rows``: one validation and encoding, one
critical section for every row's pages).
Each layer's ``update`` returns the context's past K/V for that layer followed
by the new positions, as one contiguous ``(1, kv_heads, n, head_dim)`` tensor,
exactly the tensor ``DynamicCache`` would return: at f32 the logits are equal
bit for bit. At f16 and q8 the new positions are returned as they will read back
from the context (``kvstate.spec.precision.roundtrip``), so a position looks the
same to attention in the step that computed it as in every later step.

Batches: one context per row. Left padding (attention mask 0 before a row's first
token) never enters a row's context, tokens or snapshots; attention sees zeros there,
which the mask hides, so logits stay ``torch.equal`` to DynamicCache's. The padding is read
from the forward's mask: a 2-D one, a 4-D one ``(batch, 1 or heads, queries, keys)`` (bool, or
additive float: a new position that cannot attend to itself is padding), or a dict of them per
layer type, whose entries must agree (``hf_rows.real_positions``). A mask it cannot read, a 2-D one
not as wide as the held and new positions, or one that shows a row's padding to its tokens, is
refused (``ShapeError``) before anything is stored.
Beam search's ``reorder_cache``, ``batch_repeat_interleave`` (``num_return_sequences``) and
``batch_select_indices`` move, fork and close row contexts: no K/V byte is copied.
Identical rows of one prefill (``num_beams`` copies of a prompt) are stored once.
``cache.row(i)`` takes a row out as its own one-row cache.

Reading: each layer's past is gathered from the pages by one ``torch.cat`` per row
(``impl/layer_read.py`` keeps the page slices between steps); ``layer_views=True``
keeps a contiguous per-layer tensor as DynamicCache does instead (its speed, and its
memory on top of the pages).
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
from typing import Callable

import numpy as np

from .hf_config import (ALIBI, PADDING_COUNTED, check_layout, decoder_config, layout_of, length_dependent_rope,
                        position_numbering, require_transformers)
from .hf_rows import as_ids, check_positions, new_padding, real_positions, reorder_plan

transformers = require_transformers()

import torch  # noqa: E402
from transformers.cache_utils import Cache as _HFCache  # noqa: E402
from transformers.cache_utils import CacheLayerMixin  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

from kvstate.impl import Cache, Context, TokenIds  # noqa: E402
from kvstate.impl.batch_write import extend_rows  # noqa: E402
from kvstate.impl.layer_read import LayerReader, common_prefix, state_token, written_token  # noqa: E402
from kvstate.impl.snapshot_read import peek_precision  # noqa: E402
from kvstate.spec.errors import (ConfigError, ContextBusyError, ContextClosedError, ForeignContextError,  # noqa: E402
                                 PositionError, ShapeError, SnapshotModelError, SnapshotProducerError, TokenError,
                                 UnsupportedModelError)
from kvstate.spec.layout import check_tokens  # noqa: E402
from kvstate.spec.positions import as_position, not_a_position  # noqa: E402
from kvstate.spec.precision import roundtrip  # noqa: E402

from .hf_identity import bind_model, expected_producer, is_bound, snapshot_producer  # noqa: E402

__all__ = ["KVStateCache", "attach", "layout_of"]


def _as_integer(value) -> int | None:
    """A count or index as a Python int (``spec.positions.as_position``'s rule), and also a 0-d torch
    tensor of an integer dtype: what ``scores.argmax()`` gives, for ``row``. A bool, a float, a
    0-d bool or floating tensor: None."""
    count = as_position(value)
    if count is None and isinstance(value, torch.Tensor) and value.ndim == 0 and value.dtype != torch.bool \
            and not value.dtype.is_floating_point and not value.dtype.is_complex:
        return int(value)
    return count


# How long an operation, generate or forward waits for another thread's operation on the same cache
# (a fork, a snapshot) before ``ContextBusyError``; another thread's generate or forward refuses at once.
OPERATION_WAIT_S = 30.0

UNCHECKED = object()    # ``feed``'s position_ids when the forward's are unknown (fed by hand): not checked


def _owned(what: str):
    """A ``KVStateCache`` method that holds the cache while it runs: refused (``ContextBusyError``) while
    another thread holds it, and released however it ends."""
    def wrap(method):
        @functools.wraps(method)
        def owned(self, *args, **kwargs):
            held = self._held_here()
            try:
                self._hold(what)
                return method(self, *args, **kwargs)
            finally:
                self._release_to(held)
        return owned
    return wrap


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
    """A transformers cache over kvstate contexts, one per batch row (see the module docstring)."""

    def __init__(self, layout, kv: Cache, context, rows: list | None = None, pads: list[int] | None = None,
                 layer_views: bool = False):
        check_layout(layout, kv.layout, "the kvstate cache")
        # layer_views: keep each layer's past as one contiguous tensor grown by a cat per step, as
        # DynamicCache does (its speed, and its memory on top of the pages); refilled from the pages
        # when a row's context changes underneath it. Off: gather from the pages on every step.
        self.layer_views = layer_views
        self._views: list = [None] * layout.layers
        self._view_state = None
        self.layout, self.kv = layout, kv
        self._host_pages = kv.store.__class__.__name__ == "NumpyStore"    # pages are NumPy arrays
        self.rows: list = []            # one context per batch row
        self.pads: list[int] = []       # each row's left padding: positions shown to attention as zeros, never stored
        self._readers: list[LayerReader] = []
        self._set_rows(rows if rows is not None else [context], pads)
        self._pending: list = [None] * layout.layers      # raw float32 (batch, kv_heads, n, head_dim) K and V
        self._ids: np.ndarray | None = None                # (batch, n)
        self._new_pads: list[int] = [0] * len(self.rows)
        self._before_grow = None        # (rows, pads, readers) a feed grew from: undone if its forward fails
        self._zeros = None
        self._shared = None             # (the rows' page tuples, how many leading pages they share)
        self._prompt_checked = False    # a chunked prefill under way, its whole prompt checked (``attach``)
        self._by_hand = False           # the ids were fed by ``feed``, not by an attached model's hook
        # The thread that holds this cache (None: none): one cache is one sequence of forwards, and while
        # a thread's generate or forward is under way another thread's is refused by name
        # (``ContextBusyError``); while only an operation is (a fork, a snapshot), another thread waits
        # for it (``_take``). ``_holds``: that thread's generates and operations under way (nested), of
        # them ``_generates`` generates; ``_in_forward``: its forward fed and not yet committed or
        # ended. Changed under the guard only, whose condition is notified as the cache comes free.
        self._forward_thread: int | None = None
        self._holds = 0
        self._generates = 0
        self._in_forward = False
        self._forward_guard = threading.Condition()
        super().__init__(layers=[_Layer(self, i) for i in range(layout.layers)])

    def _set_rows(self, rows: list, pads: list[int] | None = None, readers: list | None = None) -> None:
        self.rows = list(rows)
        self.pads = list(pads) if pads is not None else [0] * len(self.rows)
        self._readers = readers if readers is not None else [self._reader(ctx) for ctx in self.rows]

    def _reader(self, context) -> LayerReader:
        if self._host_pages:
            return LayerReader(context, lambda x: torch.from_numpy(x).transpose(0, 1), tokens_axis=1)
        return LayerReader(context, lambda x: x.transpose(0, 1), tokens_axis=1)

    @property
    def context(self):
        """The one row's context (a batch of several rows: see ``rows`` and ``row(i)``)."""
        self._one_row("context")
        return self.rows[0]

    @context.setter
    @_owned("setting context")
    def context(self, value) -> None:
        self._set_rows([value])

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def _one_row(self, what: str) -> None:
        if len(self.rows) != 1:
            raise ShapeError(f"{what} is per sequence, and this cache holds a batch of {len(self.rows)} rows: "
                             "take one out with cache.row(i)")

    # -- construction -------------------------------------------------------------

    @classmethod
    def for_model(cls, model, kv: Cache | None = None, context=None, layer_views: bool = False,
                  **cache_args) -> "KVStateCache":
        """A cache for ``model``: checks the model (refusing by name what it cannot hold),
        builds a kvstate ``Cache`` with ``cache_args`` unless ``kv`` is given, attaches the
        token-id hook and allocates a context unless one is given. A given ``context`` brings its
        own kvstate cache: ``kv``, if given too, must be that one. ``cache_args`` with ``kv`` or a
        ``context`` are refused (``ConfigError``): they build a new kvstate cache, and one is given. A
        closed ``context`` is refused (``ContextClosedError``)."""
        layout = layout_of(model)
        _no_cache_args_with(cache_args, kv, context)
        if context is not None:
            if context.closed:
                raise ContextClosedError(f"the context given is closed: {context!r}")
            if kv is not None and kv is not context.cache:
                raise ForeignContextError(f"the context belongs to another kvstate cache than kv: {context!r}")
            kv = context.cache
        if kv is None:
            kv = Cache(layout, **_defaults(model, cache_args))
        check_layout(layout, kv.layout, "the kvstate cache")
        if context is not None:
            check_layout(layout, context.layout, "the context")
        attach(model)
        bind_model(model, kv)
        rope = length_dependent_rope(decoder_config(model))
        if rope is not None:     # on the kvstate cache itself: its own retain and match are refused too
            kv.refuse_prefix_reuse(
                f"this model's rotary embedding ({rope!r}) follows the length of the sequence that computes "
                "K/V, so a prefix hit would serve a longer request's rotations to a shorter one (its logits not "
                "transformers'); one conversation, continued, cut back or snapshotted, is exact")
        return cls(layout, kv, context if context is not None else kv.allocate(), layer_views=layer_views)

    @classmethod
    def restore(cls, model, source, kv: Cache | None = None, layer_views: bool = False,
                **cache_args) -> "KVStateCache":
        """A cache holding the snapshot at ``source``, ready to continue generating (``cache_args``
        build its kvstate cache; with ``kv`` given they are refused, as in ``for_model``). A snapshot
        naming another model (other weights, or settings that change K/V) is ``SnapshotModelError`` (a
        ``SnapshotError`` and an ``UnsupportedModelError``), before anything is allocated; one that
        names none (written by ``Context.snapshot``, by a kvstate before the names, or from a model
        whose weights could not be read, such as one offloaded to the ``meta`` device) is restored
        unchecked, and so is any snapshot restored for such a model.

        The cache built here has ``for_model``'s defaults, except its precision: without
        ``precision=`` (or ``kv``) it is the snapshot's own, read from its header before anything
        is allocated, where that header can be read without using the source up: a path, a
        ``file://`` URL or a stream that can seek (``impl.snapshot_read.peek_precision``). From
        another URL or a stream that cannot seek the default stays f32: the positions convert
        exactly, but new ones are then kept at f32, not rounded as the writer's cache rounded them,
        so a generate continued from an f16 or q8 snapshot there matches the writer's own
        continuation only with the same ``precision=`` given."""
        layout = layout_of(model)
        _no_cache_args_with(cache_args, kv, None)
        if kv is None:
            kv = Cache(layout, **_defaults(model, _with_snapshot_precision(source, cache_args)))
        check_layout(layout, kv.layout, "the kvstate cache")
        attach(model)
        bind_model(model, kv)       # before the restore allocates anything
        try:
            context = kv.restore(source, producer=expected_producer(model))
        except SnapshotProducerError as error:
            raise SnapshotModelError(
                f"the snapshot holds K/V another model computed ({error}); {type(model).__name__} has the same "
                "layout but other weights or K/V settings (or the same checkpoint under another transformers "
                "release, whose configuration spells them otherwise): restore it into the model that wrote it"
            ) from None
        return cls.for_model(model, kv, context, layer_views=layer_views)

    # -- token ids ------------------------------------------------------------------

    def feed(self, ids, attention_mask=None, *, position_ids=UNCHECKED, takes_positions: bool = True,
             padding_counted: bool = True) -> "KVStateCache":
        """The token ids of the positions the next forward pass adds (``(n,)`` or ``(batch, n)``),
        and the forward's attention mask, which says which of them are left padding: transformers'
        2-D mask (0: padding), a 4-D mask or a dict of them (a position that cannot attend to itself
        is padding); one it cannot read is refused (``ShapeError``), never read as no padding.

        ``position_ids``, where given (an attached model's hook gives them, unless its K/V do not depend on where
        a row sits: ALiBi), are the forward's, ``None`` for none; ``takes_positions`` and ``padding_counted``
        say how the model numbers positions (``hf_rows.check_positions``). A forward that would compute a
        row's tokens at other positions than the row's own is refused (``ShapeError``).

        ``None`` forgets them (a forward from ``inputs_embeds``: its K/V are then refused).
        A forward that stopped part-way left K/V of some layers buffered: they are dropped.
        A one-row cache fed a batch grows to it: an empty row becomes fresh contexts, a row
        that holds tokens is forked (every row continues the same held prefix); a forward that
        then fails shrinks it back (``end_forward``).
        The forward it starts holds the cache for this thread until its last layer's K/V are in (or
        ``end_forward``): another thread's forward, ``generate`` or operation meanwhile is refused
        (``ContextBusyError``), and so is this feed while another thread holds the cache.
        Fed here, the forward's model is unknown: where a model is bound to the kvstate cache
        (``for_model``, ``restore``), its K/V are refused (``UnsupportedModelError``) unless the model
        running it is attached (``attach``), whose forward checks it.
        """
        self._claim_forward()
        try:
            self._feed(ids, attention_mask, position_ids, takes_positions, padding_counted)
        except BaseException:
            self.end_forward()      # the forward it claimed never starts
            raise
        self._by_hand = True        # until an attached model's hook says it fed them (``_feed_hook``)
        return self

    def _check_model_of(self, model) -> None:
        """An attached model runs a forward fed by hand (its ``forward`` called directly, so no hook fed
        it): checked as its hook would, the forward ended if refused."""
        try:
            check_model_fits(model._kvstate_layout, self)
            bind_model(model, self.kv)
        except BaseException:
            self.end_forward()
            raise
        self._by_hand = False

    def _refuse_unchecked_model(self, layer: int) -> None:
        """K/V of a forward fed by hand come from a model nothing checked: refused (the forward ended, nothing
        written) where a model is bound to the kvstate cache, whose K/V these may not be. A kvstate cache
        no model is bound to (a ``KVStateCache`` built directly on one) is fed this way."""
        if not is_bound(self.kv):
            self._by_hand = False       # the later layers of this forward need not ask again
            return
        self.end_forward()
        raise UnsupportedModelError(
            f"K/V arrived at layer {layer} for ids fed by hand (cache.feed), from a model never attached, and "
            "this kvstate cache holds the K/V of the model bound to it (KVStateCache.for_model or restore): "
            "whose K/V these are cannot be checked. Attach the model that runs the forward (hf.attach(model), "
            "or KVStateCache.for_model(model)): its forward then feeds the ids and is refused by name if it "
            "is not the bound model")

    def _feed(self, ids, attention_mask, position_ids=UNCHECKED, takes_positions: bool = True,
              padding_counted: bool = True) -> "KVStateCache":
        self._pending = [None] * self.layout.layers
        self._undo_grow()
        if ids is None:
            self._ids = None
            return self
        ids = as_ids(ids)
        batch, n = ids.shape
        if batch != len(self.rows) and len(self.rows) != 1:
            raise ShapeError(f"input_ids has batch size {batch}, but this cache holds {len(self.rows)} rows")
        held = [len(self.rows[0])] * batch if len(self.rows) == 1 else [len(ctx) for ctx in self.rows]
        if attention_mask is None and any(self.pads):
            raise ShapeError(f"this cache's rows hold left padding ({self.pads} positions), which only an attention "
                             "mask hides from attention: pass the forward its attention_mask")
        held_pads = self.pads * batch if len(self.rows) == 1 else self.pads
        pads = new_padding(attention_mask, batch, n, held, held_pads, self._length())
        if position_ids is not UNCHECKED:
            check_positions(position_ids, held, held_pads, pads, n, takes_positions, padding_counted)
        if len(self.rows) == 1 and batch > 1:
            self._grow(batch)
        self._ids, self._new_pads = ids, pads
        return self

    def _grow(self, batch: int) -> None:
        first = self.rows[0]
        extra = [first.fork() if len(first) else self.kv.allocate() for _ in range(batch - 1)]
        self._before_grow = (self.rows, self.pads, self._readers)
        self._set_rows([first, *extra], self.pads * batch)

    def _undo_grow(self) -> None:
        """Back to the one row a feed grew from, the rows it added closed (their forward never committed)."""
        if self._before_grow is None:
            return
        rows, pads, readers = self._before_grow
        self._before_grow = None
        for ctx in self.rows[len(rows):]:
            ctx.close()
        self._set_rows(rows, pads, readers)
        self._new_pads = [0] * len(rows)

    def end_forward(self) -> None:
        """After a forward, whether it returned or raised (``attach`` runs it): one that stopped before
        its last layer leaves the cache as it was before it. Its buffered K/V and ids are dropped and
        a batch its feed grew to is undone, so ``fork``, ``truncate``, ``snapshot`` and the length
        transformers reads work again at once. After a forward that committed, nothing to do.
        Run by a thread whose forward was refused (another thread holds the cache), it changes nothing."""
        me = threading.get_ident()
        with self._forward_guard:
            if self._forward_thread not in (None, me):
                return
            self._forward_thread = me       # held while it cleans up, so no other thread's feed is dropped
        try:
            self._pending = [None] * self.layout.layers
            self._ids = None
            self._undo_grow()
        finally:
            self._forward_done()

    def _forward_done(self) -> None:
        """This thread's forward is over (committed or ended): the cache stays held by its generate or
        operation under way, if any, else it is free."""
        with self._forward_guard:
            if self._forward_thread == threading.get_ident():
                self._in_forward = False
                if not self._holds:
                    self._forward_thread = None
                    self._forward_guard.notify_all()

    def _busy(self, what: str) -> ContextBusyError:
        return ContextBusyError(
            f"{what} while this KVStateCache is in use by another thread (its generate or forward is under "
            "way): one cache is one sequence of forwards, so a generate holds it from start to end; give each "
            "thread its own cache (a fork taken while this one is free), or wait for the other to finish")

    def _claim_forward(self) -> None:
        """This thread's forward starts: ``ContextBusyError`` while another thread's generate or forward
        holds the cache (their K/V and ids would mix in one step, or its generate's sequence would take
        this forward's tokens); after another thread's operation (``_take``)."""
        with self._forward_guard:
            self._take(threading.get_ident(), "a forward")
            self._in_forward = True
            self._forward_guard.notify_all()        # a waiter for a short hold: this one is not

    def _take(self, me: int, what: str) -> None:
        """With the guard held, make this thread the holder. Another thread's generate or forward is
        refused at once (it may run for minutes); another's operation (a fork, a snapshot, a truncate:
        short) is waited out, up to ``OPERATION_WAIT_S``: threads forking their own caches from one root,
        as README advises, collided now and then and got ``ContextBusyError`` for a fork."""
        deadline = None
        while self._forward_thread not in (None, me):
            if self._generates or self._in_forward:
                raise self._busy(what)
            now = time.monotonic()
            deadline = now + OPERATION_WAIT_S if deadline is None else deadline
            if now >= deadline:
                raise self._busy(f"{what} (after {OPERATION_WAIT_S:g} s waiting for another thread's operation)")
            self._forward_guard.wait(deadline - now)
        self._forward_thread = me

    def _held_here(self) -> tuple[int, int]:
        """This thread's generates and operations under way on the cache, and of them its generates
        ((0, 0) if it holds none): what ``_release_to`` goes back to."""
        return (self._holds, self._generates) if self._forward_thread == threading.get_ident() else (0, 0)

    def _hold(self, what: str) -> None:
        """This thread's generate (``what`` "generate") or operation starts (``_take``); nested ones on the
        holding thread go on. Undone by ``_release_to``."""
        with self._forward_guard:
            self._take(threading.get_ident(), what)
            self._holds += 1
            if what == "generate":
                self._generates += 1
                self._forward_guard.notify_all()    # a waiter for a short hold: this one is not

    def _release_to(self, held: tuple[int, int]) -> None:
        """Back to ``held`` (what ``_held_here`` said before the ``_hold``), whatever ran or stopped in
        between (an exception, an interrupt before or after the ``_hold`` took it); the cache is free
        when nothing of this thread's is left under way."""
        with self._forward_guard:
            if self._forward_thread != threading.get_ident():
                return
            self._holds, self._generates = held
            if not self._holds and not self._in_forward:
                self._forward_thread = None
                self._forward_guard.notify_all()

    @_owned("check_prefix_of")
    def check_prefix_of(self, input_ids, attention_mask=None) -> None:
        """Refuse (``TokenError``, naming the row) a prompt that the cache does not begin.

        ``generate`` takes the prompt's first ``get_seq_length()`` columns as held and feeds only
        the rest, so in each row those columns must be exactly what the row holds: its padding
        (attention mask 0), then its tokens. A prompt padded otherwise (a conversation
        re-tokenized with new padding; a batch row continued with its padding from a one-row
        cache) would skip tokens the row never held, or feed held ones twice. The padding is read
        from a 2-D, 4-D or dict mask over the whole prompt as a forward's is (``feed``); a mask it
        cannot read is ``ShapeError``."""
        prompts = as_ids(input_ids)
        if len(self.rows) not in (1, len(prompts)):
            raise ShapeError(f"the prompt has {len(prompts)} rows, but this cache holds {len(self.rows)}")
        mask = real_positions(attention_mask, *prompts.shape, past=0)     # a mask it cannot read is refused
        length = self._length()
        if not length:
            return
        for r, prompt in enumerate(prompts):
            i = r if len(self.rows) > 1 else 0
            pad, held = self.pads[i], (self.rows[i].tokens if len(self.rows[i]) else [])
            if len(prompt) <= length:
                raise TokenError(f"row {r}: the cache holds {length} positions, but the prompt has only "
                                 f"{len(prompt)}: nothing is left to compute the next token from (truncate first)")
            real = mask[r, :length] if mask is not None else np.ones(length, bool)
            if real[:pad].any() or not real[pad:].all():
                raise TokenError(f"row {r}: the prompt's first {length} columns, which generate takes as held, "
                                 f"hold {int(real.sum())} tokens, but this row holds {pad} padding then "
                                 f"{len(held)} tokens there: keep the padding the cache was built with (or "
                                 "continue a row from cache.row(i) with its real tokens only). Given no "
                                 "attention_mask, generate marks every token equal to pad_token_id as padding: "
                                 "pass attention_mask where the prompt holds that id")
            for position, (mine, theirs) in enumerate(zip(held, prompt[pad:length].tolist())):
                if mine != theirs:
                    raise TokenError(f"row {r}: the cache holds token {mine} at position {position}, but the prompt "
                                     f"has {theirs} there: the cache is not a prefix of this prompt "
                                     "(match() or a fresh cache)")

    # -- the transformers Cache API --------------------------------------------------

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return self._update(layer_idx, key_states, value_states)

    def _update(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor):
        batch, heads, n, head_dim = key_states.shape
        if not 0 <= layer < self.layout.layers:
            raise UnsupportedModelError(f"K/V arrived for layer {layer}, but the cache's layout {self.layout} "
                                        f"has {self.layout.layers} layers")
        if (heads, head_dim) != (self.layout.kv_heads, self.layout.head_dim):
            raise UnsupportedModelError(
                f"layer {layer} produced K/V with {heads} heads of {head_dim}, but the layout is {self.layout}")
        if self._forward_thread not in (None, threading.get_ident()):
            raise self._busy(f"K/V for layer {layer}")      # a forward no hook fed, beside a thread's that was
        if self._ids is None:
            raise self._unknown_ids(layer, n)
        if self._ids.shape != (batch, n):
            raise TokenError(f"{self._ids.shape[1]} token ids were fed for each of {self._ids.shape[0]} rows, "
                             f"but layer {layer} wrote {n} positions for {batch} rows")
        if self._by_hand:
            self._refuse_unchecked_model(layer)
        if self._pending[layer] is not None:
            raise PositionError(f"layer {layer} was updated twice in one forward pass")
        k, v = key_states.to(torch.float32), value_states.to(torch.float32)
        self._pending[layer] = (k, v)
        keys, values = self._with_past(layer, self._as_read(k), self._as_read(v))
        if layer == self.layout.layers - 1:
            self._commit()
        return keys.to(key_states.dtype), values.to(value_states.dtype)

    def _unknown_ids(self, layer: int, n: int) -> TokenError:
        """K/V whose ids no one fed: a model never attached (no hook ran, no forward claimed), or a forward
        claimed with none (an attached model run from ``inputs_embeds``, which was told it was never attached)."""
        known = f"K/V for {n} new positions arrived at layer {layer}, but their token ids are unknown: "
        if self._in_forward:
            return TokenError(known + "this forward was given no input_ids (inputs_embeds: a kvstate row keeps each "
                              "position's token id); feed them by hand and call the attached model's forward directly: "
                              "cache.feed(input_ids), then model.forward(inputs_embeds=..., cache=cache)")
        return TokenError(known + "the model running this forward was never attached (KVStateCache.for_model(model) or "
                          "attach(model) does; another model than the one that wrote this cache is then refused "
                          "by name), or call cache.feed(input_ids) before each forward")

    def _as_read(self, x: torch.Tensor) -> torch.Tensor:
        """What ``x`` reads back as after the context stores it at its precision."""
        if self.kv.precision == "f32":
            return x
        return torch.from_numpy(roundtrip(self.kv.precision, x.detach().cpu().numpy())).to(x.device)

    def _with_past(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Each row's padding (zeros), its context's K/V of ``layer`` and its new ``k``, ``v``: one
        contiguous ``(batch, heads, n, dim)`` tensor each, written by one ``torch.cat`` per row.

        The values and strides attention sees are ``DynamicCache``'s (a contiguous ``torch.cat``),
        except at padded positions, which the mask hides: zeros there give the same logits
        bit for bit, since a masked score's weight is exactly 0.
        """
        if self.layer_views:
            return self._with_view(layer, k, v)
        return self._gathered(layer, k, v)

    def _with_view(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """The layer's kept contiguous past (refilled from the pages if any row changed since) and
        the new positions, by one ``torch.cat`` each: ``DynamicCache``'s own step. The view kept for
        the next step is data (detached, the same storage): a graph this forward records ends at its
        own new positions, as in the default mode, and a later backward never reaches it."""
        view, state = self._views[layer], self._row_state()
        if view is None or state != self._view_state or view[0].shape[2] != self._length() \
                or view[0].shape[0] != k.shape[0]:
            if state != self._view_state:
                self._views = [None] * self.layout.layers
                self._view_state = state
            view = self._gathered(layer, k[:, :, :0], v[:, :, :0])
        keys, values = torch.cat([view[0], k], dim=-2), torch.cat([view[1], v], dim=-2)
        self._views[layer] = (keys.detach(), values.detach())
        return keys, values

    def _row_state(self) -> tuple:
        """What the views were filled from: each row's context, what it holds (``written_token``, which
        an overwrite in place changes too) and its length."""
        return tuple((id(ctx), written_token(ctx), len(ctx), pad) for ctx, pad in zip(self.rows, self.pads))

    def _gathered(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            return self._gathered_for_autograd(layer, k, v)
        batch, heads, n, dim = k.shape
        shape = (batch, heads, self._length() + n, dim)
        keys = torch.empty(shape, dtype=torch.float32, device=k.device)
        values = torch.empty(shape, dtype=torch.float32, device=k.device)
        shared_pages, shared_end = self._shared_past()
        for row, reader in enumerate(self._readers):
            # Rows after the first gather only what they do not share with it; the shared part is
            # copied from the first row below, one copy for all of them.
            skip, start = (shared_pages, shared_end) if row else (0, 0)
            pad = [self._zero_run(self.pads[row], k)] if self.pads[row] and not start else []
            for out, new, kind in ((keys, k, 0), (values, v, 1)):
                torch.cat(pad + self._past(reader, layer, kind, k.device, skip) + [new[row]], dim=1,
                          out=out[row, :, start:])
        if shared_end:
            for out in (keys, values):
                out[1:, :, :shared_end] = out[:1, :, :shared_end]
        return keys, values

    def _gathered_for_autograd(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """``_gathered``'s tensors for a forward that records a graph (a loss to backpropagate): the same
        values, each row joined by a ``torch.cat`` of its own and the rows stacked, since a ``cat``
        into a given output records no graph. The held past is data, as in ``DynamicCache`` after
        a ``no_grad`` step: gradients reach the new positions' K/V."""
        joined = []
        for kind, new in ((0, k), (1, v)):
            rows = []
            for row, reader in enumerate(self._readers):
                pad = [self._zero_run(self.pads[row], k)] if self.pads[row] else []
                rows.append(torch.cat(pad + self._past(reader, layer, kind, k.device) + [new[row]], dim=1))
            joined.append(torch.stack(rows))
        return joined[0], joined[1]

    def _shared_past(self) -> tuple[int, int]:
        """The leading pages every row holds in common (the very same pages: the prompt under beams or
        ``num_return_sequences``) and where they end in a row, padding included; ``(0, 0)`` for one row
        or for rows padded differently. The pages are compared once per change of any row's page
        tuple (not once per layer: they do not change within a forward); the end follows the rows'
        length, which a truncate inside the last page changes without a new tuple."""
        rows = self.rows
        if len(rows) < 2 or self.pads.count(self.pads[0]) != len(rows):
            return 0, 0
        tuples = [ctx._pages for ctx in rows]
        known = self._shared
        if known is not None and len(known[0]) == len(tuples) and all(a is b for a, b in zip(known[0], tuples)):
            shared = known[1]
        else:
            shared = min(common_prefix(tuples[0], pages) for pages in tuples[1:])
            self._shared = (tuples, shared)
        tokens = min(shared * self.kv.page_tokens, len(rows[0]))     # all rows are as long: same padding
        return (shared, self.pads[0] + tokens) if tokens else (0, 0)

    def _past(self, reader: LayerReader, layer: int, kind: int, device, skip: int = 0) -> list:
        """The row's held K (kind 0) or V (1) of ``layer`` past its first ``skip`` pages, as float32
        ``(heads, n, dim)`` parts."""
        parts = reader.parts(layer, kind, skip)
        if not parts:
            return []
        if parts[0].device != device:                     # a store on another device than the model
            parts = [p.to(device) for p in parts]
        precision = self.kv.precision
        if precision == "f32":
            return parts
        values = torch.cat(parts, dim=1).to(torch.float32)
        if precision == "q8":
            scales = torch.cat(reader.parts(layer, 2 + kind, skip), dim=1).to(device)
            values = values * scales.unsqueeze(-1)
        return [values]

    def _zero_run(self, n: int, like: torch.Tensor) -> torch.Tensor:
        if self._zeros is None or self._zeros.shape[1] < n or self._zeros.device != like.device:
            self._zeros = torch.zeros((like.shape[1], max(n, 16), like.shape[3]), dtype=torch.float32,
                                      device=like.device)
        return self._zeros[:, :n]

    def _commit(self) -> None:
        """Every layer of the new positions has arrived: extend each row's context once
        (a decode step: every row in one ``extend_rows``).

        A row whose state, ids and K/V equal an earlier row's (``num_beams`` copies of one
        prompt) becomes a fork of it instead of writing the same bytes again. A failure
        leaves every row as it was before the step.
        """
        missing = [i for i, pair in enumerate(self._pending) if pair is None]
        if missing:
            self.feed(None)
            raise PositionError(f"the forward pass skipped layers {missing}: their K/V never arrived")
        kv = torch.stack([torch.stack(pair) for pair in self._pending])   # (layers, 2, batch, heads, n, dim)
        kv = kv.permute(2, 4, 0, 1, 3, 5)                                   # (batch, n, layers, 2, heads, dim)
        ids, pads = self._ids, self._new_pads
        self._ids, self._pending = None, [None] * self.layout.layers
        before = [len(ctx) for ctx in self.rows]
        states = [state_token(ctx) for ctx in self.rows]       # held alive here: their ids stay unique
        leaders: dict = {}
        plain, twins = [], []
        for row in range(len(self.rows)):
            pad = pads[row]
            key = (id(states[row]), before[row], pad, ids[row].tobytes())
            leader = leaders.get(key)
            if leader is not None and torch.equal(kv[row, pad:], kv[leader, pad:]):
                twins.append((row, leader))
            else:
                leaders.setdefault(key, row)
                plain.append(row)
        done = self._extend(plain, ids, kv, pads, before)
        try:
            for row, leader in twins:
                twin = self.rows[leader].fork()
                self.rows[row].close()
                self.rows[row] = twin
                self._readers[row] = self._readers[leader].follow(twin)
        except BaseException:
            for row in done:
                self.rows[row].truncate(before[row])
            raise
        self.pads = [p + q for p, q in zip(self.pads, pads)]
        self._new_pads = [0] * len(self.rows)
        self._before_grow = None           # the rows a feed grew to now hold this step
        if self.layer_views:
            self._view_state = self._row_state()     # the views now cover exactly what the rows hold
        self._forward_done()               # the step is in: the cache is consistent for any thread again

    def _extend(self, plain: list[int], ids, kv, pads: list[int], before: list[int]) -> list[int]:
        """Extend the rows ``plain`` by their new positions; the rows extended. A decode step (no
        padding) is one ``extend_rows`` for the batch; otherwise one ``extend`` per row, a row that
        fails undoing the rows extended before it, so the batch stays in step."""
        if len(plain) > 1 and not any(pads[row] for row in plain):
            part = kv if len(plain) == len(self.rows) else kv[plain]
            extend_rows([self.rows[row] for row in plain], ids[plain], self._for_store(part))
            return plain
        done: list[int] = []
        try:
            for row in plain:
                self.rows[row].extend(ids[row, pads[row]:], self._for_store(kv[row, pads[row]:]))
                done.append(row)
        except BaseException:
            for row in done:
                self.rows[row].truncate(before[row])
            raise
        return done

    def _for_store(self, kv: torch.Tensor):
        """K/V in the form the cache's store takes: a NumPy array for NumPy pages, else the tensor."""
        return kv.detach().cpu().numpy() if self._host_pages else kv

    def _length(self) -> int:
        """The length every row presents to attention: its padding plus its context."""
        return self.pads[0] + len(self.rows[0])

    def _layer_length(self, layer: int) -> int:
        pending = self._pending[layer]
        return self._length() + (pending[0].shape[2] if pending is not None else 0)

    # Past the last layer, what transformers' own ``Cache`` answers (a layer not made yet): 0, and a
    # mask of the query alone; an IndexError here was a different answer where a ``Cache`` is expected.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._layer_length(layer_idx) if layer_idx < len(self._pending) else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if layer_idx >= len(self._pending):
            return query_length, 0
        return self._layer_length(layer_idx) + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' rollback: a negative count removes that many positions from the end."""
        count = _as_integer(tokens_to_remove)
        if count is None:
            raise PositionError(not_a_position("crop", tokens_to_remove))
        if count > 0:
            raise PositionError(f"crop takes a negative count of positions to remove, got {tokens_to_remove}")
        self.truncate(self._length() + count)

    @_owned("reset")
    def reset(self) -> None:
        """Empty the cache: row 0's context truncated to no positions, every other row closed, the
        padding dropped (a new prompt, of any batch size, then starts as in a new cache)."""
        self._refuse_mid_forward("reset")
        for ctx in self.rows[1:]:
            ctx.close()
        self.rows[0].truncate(0)
        self._set_rows(self.rows[:1], [0], self._readers[:1])
        self._new_pads = [0]

    # -- batch reorders: forks and closes of row contexts, no K/V copied ------------------

    @_owned("reorder_cache")
    def reorder_cache(self, beam_idx) -> None:
        """Beam search's reorder: row ``i`` becomes row ``beam_idx[i]``. A row picked once moves, a row
        picked again is forked (its pages shared), a row not picked is closed."""
        self._refuse_mid_forward("reorder_cache")
        plan = reorder_plan(beam_idx, len(self.rows))
        if len(plan) != len(self.rows):
            raise ShapeError(f"beam_idx has {len(plan)} rows, but this cache holds {len(self.rows)}")
        self._regroup(plan)

    @_owned("batch_repeat_interleave")
    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row repeated ``repeats`` times, in place (``num_return_sequences``): forks."""
        self._refuse_mid_forward("batch_repeat_interleave")
        count = _as_integer(repeats)
        if count is None or count < 1:
            raise ShapeError(f"repeats must be an integer of at least 1, got {repeats!r}")
        self._regroup(reorder_plan([r for r in range(len(self.rows)) for _ in range(count)], len(self.rows)))

    @_owned("batch_select_indices")
    def batch_select_indices(self, indices) -> None:
        """Keep the rows at ``indices`` (finished rows dropped): the others are closed."""
        self._refuse_mid_forward("batch_select_indices")
        self._regroup(reorder_plan(indices, len(self.rows)))

    def _regroup(self, plan: list[tuple[int, bool]]) -> None:
        rows, pads, readers = [], [], []
        for source, fork in plan:
            ctx = self.rows[source].fork() if fork else self.rows[source]
            rows.append(ctx)
            pads.append(self.pads[source])
            readers.append(self._readers[source].follow(ctx) if fork else self._readers[source])
        kept = {source for source, _ in plan}
        for index, ctx in enumerate(self.rows):
            if index not in kept:
                ctx.close()
        self._set_rows(rows, pads, readers)
        self._new_pads = [0] * len(rows)

    def early_initialization(self, *args, **kwargs) -> None:
        pass        # layers are views of the contexts: nothing to allocate

    # -- the agent operations ----------------------------------------------------------

    @property
    def tokens(self) -> list[int]:
        """The token ids of the positions the (one row's) context holds."""
        return self.context.tokens

    @_owned("row")
    def row(self, index: int) -> "KVStateCache":
        """Row ``index`` as its own one-row cache, on a fork of its context (pages shared): retain it,
        snapshot it, continue it. Its padding stays behind: it holds the row's real tokens only."""
        self._refuse_mid_forward("row")
        at = _as_integer(index)
        if at is None:
            raise ShapeError(f"row takes an integer index, not {index!r} ({type(index).__name__})")
        if not 0 <= at < len(self.rows):
            raise ShapeError(f"row {index!r} is not a row of a batch of {len(self.rows)}")
        return type(self)(self.layout, self.kv, self.rows[at].fork(), layer_views=self.layer_views)

    @_owned("fork")
    def fork(self) -> "KVStateCache":
        """A new cache on forks of every row's context: every page shared, nothing copied."""
        self._refuse_mid_forward("fork")
        forked = type(self)(self.layout, self.kv, None, rows=[ctx.fork() for ctx in self.rows], pads=self.pads,
                          layer_views=self.layer_views)
        return forked

    def __deepcopy__(self, memo) -> "KVStateCache":
        return self.fork()      # a fork is an independent copy that shares pages until written

    @_owned("truncate")
    def truncate(self, n: int) -> None:
        """Keep the first ``n`` positions of every row, padding included (backtrack to a checkpoint)."""
        self._refuse_mid_forward("truncate")
        keep = _as_integer(n)
        if len(self.rows) == 1 and not self.pads[0]:
            self.rows[0].truncate(n if keep is None else keep)     # a non-integer: the engine's named refusal
            return
        if keep is None:
            raise PositionError(not_a_position("truncate", n))
        if not max(self.pads) <= keep <= self._length():
            raise PositionError(f"truncate to {n} is outside the batch's held positions [{max(self.pads)}, "
                                f"{self._length()}] (padding is not cut)")
        for ctx, pad in zip(self.rows, self.pads):
            ctx.truncate(keep - pad)

    @_owned("retain")
    def retain(self) -> None:
        """Keep a fork of this context in the prefix tree under its token ids."""
        self._refuse_mid_forward("retain")
        self.kv.retain(self.context)

    @_owned("match")
    def match(self, tokens) -> int:
        """Replace this cache's context with the longest retained prefix of ``tokens``; the matched length.

        At most ``len(tokens) - 1`` positions are kept: the logits of the next token come
        from the forward of the last prompt token, so that one is always computed.
        ``generate(tokens, cache=cache)`` then prefills only the unmatched suffix.
        """
        self._refuse_mid_forward("match")
        self._one_row("match")
        current = self.rows[0]
        if current.closed:      # checked first: the hit would have no cache to go to
            raise ContextClosedError("this cache is closed: match with a new one, "
                                     "KVStateCache.for_model(model, cache.kv)")
        if isinstance(tokens, torch.Tensor):        # a prompt as generate takes it, (1, n), is one sequence
            if tokens.ndim > 2 or (tokens.ndim == 2 and tokens.shape[0] != 1):
                raise ShapeError(f"match takes one sequence of token ids, not a tensor of shape {tuple(tokens.shape)}")
            if tokens.ndim == 2:
                tokens = tokens.reshape(-1)     # a 0-d tensor is no sequence: ``check_tokens`` refuses it
        if type(tokens) is not TokenIds:        # checked when they were made: matched by their packed key
            tokens = check_tokens(tokens)
        found, matched = self.kv.match(tokens)
        try:
            if matched >= len(tokens) > 0:
                found.truncate(len(tokens) - 1)
                matched = len(tokens) - 1
            current.close()
        except BaseException:       # the hit is nobody's: let it go (an interrupt, a context busy elsewhere)
            found.close()
            raise
        self.context = found
        return matched

    @_owned("snapshot")
    def snapshot(self, target) -> None:
        """Write the context (tokens and K/V) to a path, atomically, or a binary stream; the file names
        the model that computed them (its fingerprint: format version 3), and ``restore`` refuses it
        for another model."""
        self._refuse_mid_forward("snapshot")
        self.context.snapshot(target, producer=snapshot_producer(self.kv))    # names the model, for a restore to check

    @_owned("close")
    def close(self) -> None:
        """Release every row's pages. Nothing else does: a cache dropped unclosed keeps its pages for as
        long as the kvstate cache lives (a finalizer could run inside the cache's own critical sections)."""
        for ctx in self.rows:
            if not ctx.closed:
                ctx.close()

    def __enter__(self) -> "KVStateCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _fed_here(self) -> bool:
        """Whether this thread's forward is under way on the cache, its ids fed (by a hook, or by hand)."""
        return self._in_forward and self._forward_thread == threading.get_ident()

    def _refuse_mid_forward(self, what: str) -> None:
        if self._forward_thread not in (None, threading.get_ident()):
            raise self._busy(what)
        if any(p is not None for p in self._pending):
            raise PositionError(f"{what} during a forward pass: some layers' K/V are not yet in the context")

    def __repr__(self) -> str:
        rows = self.rows[0] if len(self.rows) == 1 else f"{len(self.rows)} rows"
        return f"KVStateCache({self.layout}, {rows!r}, precision={self.kv.precision!r})"


def _no_cache_args_with(cache_args: dict, kv, context) -> None:
    """``ConfigError`` for a ``kv`` that is not a kvstate ``Cache`` or a ``context`` that is not a
    ``Context`` (a bare ``AttributeError`` further in), and for cache arguments beside either given: they
    would build a new kvstate cache, and were silently ignored (a restore asked for q8 into an f32 cache
    got f32)."""
    if kv is not None and not isinstance(kv, Cache):
        raise ConfigError(f"kv must be a kvstate.impl.Cache (or None: one is built), got {type(kv).__name__}")
    if context is not None and not isinstance(context, Context):
        raise ConfigError(f"context must be a kvstate.impl.Context (or None: one is allocated), "
                          f"got {type(context).__name__}")
    if cache_args and (kv is not None or context is not None):
        given = "the context given already belongs to one" if context is not None else "kv is given"
        raise ConfigError(f"cache arguments {sorted(cache_args)} build a new kvstate cache, but {given}")


def _defaults(model, cache_args: dict) -> dict:
    """A torch store on the model's device unless the caller chose otherwise."""
    args = {"store": "torch", **cache_args}
    if args["store"] == "torch" and "device" not in args:
        args["device"] = str(getattr(model, "device", "cpu"))
    return args


def _with_snapshot_precision(source, cache_args: dict) -> dict:
    """``cache_args`` with the precision the snapshot at ``source`` holds, where they name none and
    its header can be peeked (``peek_precision``)."""
    if "precision" in cache_args:
        return cache_args
    precision = peek_precision(source)
    return cache_args if precision is None else {**cache_args, "precision": precision}


def _cache_given(kwargs: dict):
    """The cache a forward or ``generate`` was handed: ``cache=``, or by its older name ``past_key_values=``."""
    return kwargs.get("cache", kwargs.get("past_key_values"))


def _named_arguments(model, args: tuple, kwargs: dict) -> dict:
    """A forward's arguments by name, those passed by position included: after ``input_ids``, GPT-2's
    forward takes the cache second, Llama's and its family's ``attention_mask``, ``position_ids``, then
    the cache. Only ``kwargs`` where no more than the ids came by position (``generate`` passes
    keywords), or where the arguments do not fit the forward (which then refuses them itself)."""
    if len(args) < 2 or model is None:
        return kwargs
    try:
        bound = _forward_signature(type(model)).bind_partial(model, *args, **kwargs)
    except (TypeError, ValueError):
        return kwargs
    return {**kwargs, **bound.arguments}


@functools.lru_cache(maxsize=64)
def _forward_signature(model_class) -> inspect.Signature:
    """A model class's ``forward`` signature, read once: each forward asks three times."""
    return inspect.signature(model_class.forward)


def _feed_hook(module, args, kwargs):
    named = _named_arguments(module, args, kwargs)
    cache = _cache_given(named)
    if isinstance(cache, KVStateCache):
        check_model_fits(module._kvstate_layout, cache)
        bind_model(module, cache.kv)
        ids = named.get("input_ids")
        if ids is None and args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point():
            ids = args[0]
        _refuse_bool_4d_under_eager(named.get("attention_mask"), module)
        _refuse_token_types(named.get("token_type_ids"))
        try:
            numbering = module._kvstate_numbering
            if numbering == ALIBI:      # its K/V the same wherever a row sits: no position to check
                cache.feed(ids, named.get("attention_mask"))
            else:
                cache.feed(ids, named.get("attention_mask"), position_ids=named.get("position_ids"),
                           takes_positions="position_ids" in _forward_signature(type(module)).parameters,
                           padding_counted=numbering == PADDING_COUNTED)
            cache._by_hand = False      # fed by this model's hook, and the model checked above
        except BaseException as error:
            if not isinstance(error, Exception):
                cache.end_forward()     # an interrupt here: no hook after it runs, and the forward it claimed is over
            raise
    return None


def _refuse_bool_4d_under_eager(mask, model) -> None:
    """transformers' eager attention adds the mask to the scores, so a bool 4-D mask masks nothing there
    (True is +1): its K/V would come from every token seeing every other, read here as causal and stored
    as the tokens' own (an outside audit, s69). Refused by name before the forward."""
    masks = mask.values() if isinstance(mask, dict) else [mask]
    if getattr(getattr(model, "config", None), "_attn_implementation", None) == "eager" and any(
            isinstance(entry, torch.Tensor) and entry.ndim == 4 and entry.dtype == torch.bool for entry in masks):
        raise ShapeError("attention_mask is a bool 4-D mask, which this model's eager attention adds to its scores "
                         "(True as +1, False as 0), so it masks nothing: pass an additive float mask (0 attends, "
                         "the dtype's lowest masks; transformers' eager_mask) or the 2-D one")


def _refuse_token_types(token_type_ids) -> None:
    """A forward's K/V are kept by its token ids alone (a hit serves them to any request of those ids), but
    ``token_type_ids`` change them: GPT-2, GPT-J and CodeGen add their embedding (zeros included), and a
    prefix-LM model (HrmText) lets the prompt's type-1 tokens see each other, but only when its cache says it
    holds nothing yet. An outside audit (s69): stored, a later hit was 0.008 off transformers' logits, and an
    HrmText prompt ran causal under kvstate, 0.0025 off. Refused by name before the forward."""
    if token_type_ids is not None:
        raise TokenError("token_type_ids change the K/V a forward computes (a token-type embedding, or a prompt "
                         "whose tokens see each other), but kvstate keeps K/V by the token ids alone and serves "
                         "them to any request of those ids: forward without token_type_ids, or with a DynamicCache")


def _end_hook(module, args, kwargs, output):
    cache = _cache_given(_named_arguments(module, args, kwargs))
    if isinstance(cache, KVStateCache):
        cache.end_forward()
    return None


def attach(model):
    """Register (once) the forward pre-hook that feeds each forward's ``input_ids`` to a
    ``KVStateCache`` passed as ``cache=`` (or ``past_key_values=``) and checks, per forward, that the
    cache holds this model's K/V (``bind_model``); wrap ``generate`` so that it holds such a cache from
    start to end (``_generating``). Checks the model first. A ``torch.compile`` wrapper attaches the
    model it compiled: the wrapper's ``generate`` is that model's and calls it, not the wrapper, and the
    wrapper's call runs that model's hooks too. Returns the model given."""
    _attach(getattr(model, "_orig_mod", model))
    return model


def _attach(model) -> None:
    model._kvstate_layout = layout_of(model)
    model._kvstate_numbering = position_numbering(model)
    if getattr(model, "_kvstate_hook", None) is None:
        model._kvstate_hook = model.register_forward_pre_hook(_feed_hook, with_kwargs=True)
        model._kvstate_end_hook = model.register_forward_hook(_end_hook, with_kwargs=True, always_call=True)
        # A decoder without a head (``model.model``, ``AutoModel``) has no generate to wrap.
        if callable(getattr(model, "prepare_inputs_for_generation", None)):
            model.prepare_inputs_for_generation = _Wrapped(model.prepare_inputs_for_generation, _prefix_checked)
        if callable(getattr(model, "generate", None)):
            model.generate = _Wrapped(model.generate, _generating)
        if callable(getattr(model, "_prefill", None)):
            model._prefill = _Wrapped(model._prefill, _chunks_checked)
        model.forward = _Wrapped(model.forward, _forward_checked)


class _Wrapped:
    """A model's bound method, called through ``through(method, *args, **kwargs)``: an object holding
    the method, which a deep copy of the model rebinds to the copy. A closure over the bound method
    kept calling the original model's from a copy (``copy.deepcopy`` keeps functions as they are):
    a copied model generated with the original's weights."""

    def __init__(self, method, through):
        self.method, self.through = method, through
        functools.update_wrapper(self, method)      # its name, and __wrapped__ for inspect.signature

    def __call__(self, *args, **kwargs):
        return self.through(self.method, *args, **kwargs)

    def __getstate__(self):
        # Not what ``update_wrapper`` copied: ``generate``'s annotations hold ForwardRefs, whose compiled
        # code does not pickle, and an attached model could not be pickled (``torch.save(model)``).
        return {"method": self.method, "through": self.through}

    def __setstate__(self, state):
        self.__init__(state["method"], state["through"])


def _generating(generate, *args, **kwargs):
    """The model's ``generate``, holding a ``KVStateCache`` it is given from start to end: each forward
    was guarded, but another thread's forward (or generate) ran between two of its forwards and put
    its tokens into the middle of this one's sequence. Released however it ends (an interrupt too)."""
    cache = _cache_given(kwargs)
    if not isinstance(cache, KVStateCache):
        return generate(*args, **kwargs)
    held = cache._held_here()
    args, kwargs = _streamer_releasing(generate, args, kwargs, lambda: cache._release_to(held))
    try:
        cache._hold("generate")
        return generate(*args, **kwargs)
    finally:
        cache._release_to(held)


def _streamer_releasing(generate, args: tuple, kwargs: dict, release: Callable[[], None]) -> tuple[tuple, dict]:
    """``generate``'s arguments with the streamer among them, if any, wrapped in a ``_ReleasingStreamer``.
    Found by binding the call to ``generate``'s own signature: in transformers 5.x the streamer is also its
    eighth positional parameter, and one passed there was never wrapped (the cache was held to the end)."""
    if kwargs.get("streamer") is not None:
        return args, {**kwargs, "streamer": _ReleasingStreamer(kwargs["streamer"], release)}
    if not args:
        return args, kwargs
    try:
        call = inspect.signature(generate).bind(*args, **kwargs)
    except (TypeError, ValueError):     # a call generate itself refuses, or no signature to read: left to it
        return args, kwargs
    if call.arguments.get("streamer") is None:
        return args, kwargs
    call.arguments["streamer"] = _ReleasingStreamer(call.arguments["streamer"], release)
    return call.args, call.kwargs


class _ReleasingStreamer(BaseStreamer):
    """A caller's streamer whose ``end()`` first lets the cache go. transformers calls it inside
    ``generate``, after the last forward and before returning, and HF's streaming recipe (generate on
    a thread, the caller iterating a ``TextIteratorStreamer``) uses the cache as soon as ``end()``
    wakes it: it got ``ContextBusyError`` from a generate that had done its work."""

    def __init__(self, streamer, release: Callable[[], None]):
        self._streamer, self._release = streamer, release

    def put(self, value):
        return self._streamer.put(value)

    def end(self):
        self._release()
        return self._streamer.end()

    def __getattr__(self, name):
        return getattr(self._streamer, name)


def _forward_checked(forward, *args, **kwargs):
    """The model's forward, called through ``model(...)`` (its hook fed the ids and checked the model) or
    directly (``model.forward(...)``: no hook ran, so a forward fed by hand is checked here, and one
    not fed is fed and ended here as the hooks would)."""
    model = _model_of(forward)
    cache = _cache_given(_named_arguments(model, args, kwargs))
    if not isinstance(cache, KVStateCache) or model is None:
        return _ended_on_interrupt(forward, *args, **kwargs)
    if cache._fed_here():
        if cache._by_hand:
            cache._check_model_of(model)
        return _ended_on_interrupt(forward, *args, **kwargs)
    _feed_hook(model, args, kwargs)
    try:
        return _ended_on_interrupt(forward, *args, **kwargs)
    finally:
        cache.end_forward()     # as ``_end_hook`` after any forward: after one that committed, nothing to do


_WRAPPERS_FOLLOWED = 8       # how many wrappers deep ``_model_of`` looks for the model


def _model_of(forward):
    """The model whose ``forward`` this is: a bound method's own, or the module a library's wrapper
    installed before ``attach`` passes first to it (accelerate's ``device_map`` hooks make ``forward``
    a ``functools.partial`` of their function and the module), or, through wrappers that name what they
    wrap (``functools.wraps``: ``model.forward = torch.compile(model.forward)``), the model of the
    method they wrap; None for any other wrapper."""
    for _ in range(_WRAPPERS_FOLLOWED):
        model = getattr(forward, "__self__", None)
        if model is not None:
            return model
        if isinstance(forward, functools.partial) and forward.args and isinstance(forward.args[0], torch.nn.Module):
            return forward.args[0]
        # Asked only after __self__: a bound method's __wrapped__ is its decorated function's, with no model.
        forward = getattr(forward, "__wrapped__", None)
        if forward is None:
            return None
    return None


def _ended_on_interrupt(forward, *args, **kwargs):
    """The model's forward, ending a ``KVStateCache``'s forward if an interrupt (Ctrl-C, a run's deadline)
    stops it: torch runs the ``always_call`` end hook after an ``Exception`` only, and the K/V of the
    layers that ran stayed buffered, counted by ``get_seq_length``, so the next ``generate`` took that
    many prompt columns as held and skipped them."""
    try:
        return forward(*args, **kwargs)
    except Exception:
        raise           # the end hook runs
    except BaseException:
        cache = _cache_given(_named_arguments(_model_of(forward), args, kwargs))
        if isinstance(cache, KVStateCache):
            cache.end_forward()
        raise


def check_model_fits(layout, cache: "KVStateCache") -> None:
    """A model whose layout is not the cache's is refused before its forward computes anything
    (a model with fewer layers would never complete a position; one with more would write past it)."""
    if layout != cache.layout:
        raise UnsupportedModelError(
            f"the model has layout {layout}, but this kvstate cache holds {cache.layout} "
            "(layers, kv_heads, head_dim): build the cache with KVStateCache.for_model(model)")


def _prefix_checked(prepare, input_ids, *args, **kwargs):
    """``generate``'s first step, checked: the ids a cache holds must begin the prompt it is asked to
    continue, or ``generate`` would continue another conversation (it slices off as many prompt ids
    as the cache holds without looking at them)."""
    cache = _cache_given(kwargs)
    if isinstance(cache, KVStateCache) and kwargs.get("is_first_iteration") and input_ids is not None \
            and not cache._prompt_checked:
        cache.check_prefix_of(input_ids, kwargs.get("attention_mask"))
    return prepare(input_ids, *args, **kwargs)


def _chunks_checked(prefill, input_ids, generation_config, model_kwargs, *args, **kwargs):
    """``generate``'s prefill (transformers' ``_prefill``), checked once for the whole prompt where it
    goes in chunks (``prefill_chunk_size``): each chunk then reaches ``prepare_inputs_for_generation``
    alone, as its "first iteration", and is not a prompt that the cache begins."""
    cache = _cache_given(model_kwargs)
    first = kwargs.get("is_first_iteration", args[0] if args else True)
    if not (isinstance(cache, KVStateCache) and first and input_ids is not None
            and getattr(generation_config, "prefill_chunk_size", None) is not None):
        return prefill(input_ids, generation_config, model_kwargs, *args, **kwargs)
    cache.check_prefix_of(input_ids, model_kwargs.get("attention_mask"))
    cache._prompt_checked = True
    try:
        return prefill(input_ids, generation_config, model_kwargs, *args, **kwargs)
    finally:
        cache._prompt_checked = False
