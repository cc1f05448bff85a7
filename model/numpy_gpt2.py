"""The GPT-2 forward pass in NumPy, reading and writing its K/V through a context.

Each call appends every new position's K/V (all layers) with one ``ctx.extend``,
after the pass, logits included: a pass that fails leaves the context as it was. Attention reads the past positions back from the context with
``ctx.read_layer_pages``, so it sees exactly what the cache stores at its precision.
The new positions' K/V are not in the context yet while later layers run; they
are passed through ``spec.precision.roundtrip``, which is by definition what a
read of them will return. So a context's logits depend only on what it stores,
never on how it got there (a fork, a match, a restore, another page size):
that is what the exact-logit tests assert.

Attention runs over fixed blocks of ``ATTENTION_BLOCK`` positions aligned to
position 0, whatever the page size: with 64-token pages a block is a page, read
in place (no gather copy); with other sizes blocks are assembled from slices.
Same blocks, same arithmetic, so the logits do not depend on the page size.

A context is anything with ``len``, ``layout``, ``precision``,
``read_layer_pages(layer)`` and ``extend(tokens, kv)``: a kvstate ``Context``
or the ``ContiguousKV`` baseline.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache, partial

import numpy as np

from kvstate.spec.errors import ConfigError, PositionError, TokenError
from kvstate.spec.layout import check_tokens
from kvstate.spec.precision import roundtrip

from .config import GPT2Config
from .weights import block_weights, check_weights, random_weights

QUERY_ROWS = 64          # queries per attention chunk (see ``attend``)
ATTENTION_BLOCK = 64     # keys per block; None in ``GPT2.block`` attends over the parts as the context gives them
# Rows from which a pass splits its attention heads and its GELU over ``GPT2.threads``. Below it
# the handoff costs more than it saves (OpenBLAS's own threads still spin on the other cores after
# each product): GPT-2 small at 2 threads, side by side, 512 tokens took 5-10% longer split, 2,048
# tokens 8-13% less.
SPLIT_FROM_ROWS = 1024


class GPT2:
    def __init__(self, config: GPT2Config, weights: dict[str, np.ndarray], threads: int = 1):
        """``threads``: how many threads a pass of ``SPLIT_FROM_ROWS`` tokens or more splits its
        attention heads and its GELU rows over (as BLAS threads split the products); every number
        is the same bits at any count."""
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ConfigError(f"threads must be a positive int, got {threads!r}")
        check_weights(config, weights)
        # float32 throughout: the passes below run in place, so a float64 weight would not promote
        weights = {name: np.asarray(w, dtype=np.float32) for name, w in weights.items()}
        self.threads = threads
        self.config = config
        self.layout = config.layout
        self.wte = weights["wte.weight"]
        self.wpe = weights["wpe.weight"]
        self.ln_f = (weights["ln_f.weight"], weights["ln_f.bias"])
        self.blocks = block_weights(weights, config.n_layer)
        self.head = np.ascontiguousarray(self.wte.T)     # tied output head, laid out for x @ head
        self.block = ATTENTION_BLOCK

    @classmethod
    def random(cls, config: GPT2Config, seed: int = 0, threads: int = 1) -> "GPT2":
        return cls(config, random_weights(config, seed), threads)

    # -- the two calls ---------------------------------------------------------------

    def prefill(self, ctx, tokens) -> np.ndarray:
        """Append ``tokens`` to ``ctx``; logits ``(n, vocab)`` for every new position."""
        return self._forward(ctx, tokens)

    def decode(self, ctx, token: int) -> np.ndarray:
        """Append one token to ``ctx``; next-token logits ``(vocab,)``."""
        return self._forward(ctx, [token])[0]

    # -- the pass ----------------------------------------------------------------------

    def _forward(self, ctx, tokens) -> np.ndarray:
        cfg = self.config
        tokens = check_call(cfg, ctx, tokens)
        start, n = len(ctx), len(tokens)
        H, D = cfg.n_head, cfg.head_dim
        x = self.wte[tokens] + self.wpe[start:start + n]
        kv = np.empty(self.layout.batch_shape(n), np.float32)
        for layer, (g1, b1, w_qkv, b_qkv, w_o, b_o, g2, b2, w_fc, b_fc, w_out, b_out) in enumerate(self.blocks):
            qkv = layer_norm(x, g1, b1, cfg.layer_norm_epsilon, self.threads) @ w_qkv
            qkv += b_qkv
            q, k, v = (part.reshape(n, H, D) for part in np.split(qkv, 3, axis=1))
            kv[:, layer, 0], kv[:, layer, 1] = k, v
            attended = attend(q, self._key_value_blocks(ctx, layer, start, k, v), start, self.threads)
            x = residual(x, attended @ w_o, b_o)
            hidden = layer_norm(x, g2, b2, cfg.layer_norm_epsilon, self.threads) @ w_fc
            in_row_slices(partial(gelu_in_place, bias=b_fc), hidden, self.threads)      # in place
            x = residual(x, hidden @ w_out, b_out)
        logits = layer_norm(x, *self.ln_f, cfg.layer_norm_epsilon, self.threads) @ self.head
        ctx.extend(tokens, kv)          # last: a pass that fails leaves the context as it was
        return logits

    def _key_value_blocks(self, ctx, layer: int, start: int, k: np.ndarray, v: np.ndarray):
        """Past K/V read from the context, then the new ones as the context will store them, in blocks."""
        parts = [(np.asarray(pk), np.asarray(pv)) for pk, pv in ctx.read_layer_pages(layer)] if start else []
        parts.append((roundtrip(ctx.precision, k), roundtrip(ctx.precision, v)))
        return parts if self.block is None else list(rechunk(parts, self.block))


def rechunk(parts, size: int):
    """``(k, v)`` parts regrouped into blocks of ``size`` positions (the last may be shorter).

    A part that already is a whole aligned block passes through as it is (a view).
    """
    pending, held = [], 0
    for k, v in parts:
        at = 0
        while at < len(k):
            take = min(size - held, len(k) - at)
            pending.append((k[at:at + take], v[at:at + take]))
            held, at = held + take, at + take
            if held == size:
                yield _join(pending)
                pending, held = [], 0
    if pending:
        yield _join(pending)


def _join(pieces):
    if len(pieces) == 1:
        return pieces[0]
    return np.concatenate([k for k, _ in pieces]), np.concatenate([v for _, v in pieces])


def check_call(config: GPT2Config, ctx, tokens) -> np.ndarray:
    """Validated tokens for a forward pass on ``ctx``, or a named error before anything is computed."""
    tokens = check_tokens(tokens)
    if ctx.layout != config.layout:
        raise ConfigError(f"the context's layout {ctx.layout} is not the model's {config.layout}")
    start, n = len(ctx), len(tokens)
    if n == 0:
        raise TokenError("prefill needs at least one token")
    if start + n > config.n_positions:
        raise PositionError(f"positions up to {start + n} exceed the model's {config.n_positions}")
    if tokens.max() >= config.vocab_size:
        raise TokenError(f"token id {int(tokens.max())} is outside the vocabulary of {config.vocab_size}")
    return tokens


def residual(x: np.ndarray, update: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """``x + update + bias``, the same bits, summed into ``update`` (a product's fresh output, which no
    one else holds): no activation-sized temporary is allocated."""
    np.add(x, update, out=update)
    update += bias
    return update


# Rows per block of ``layer_norm``. A (2048, 768) activation on this VM: 11.3 ms over the whole array,
# 7.4 ms in blocks of 32 rows, 5.9 of 64, 5.2 of 128 (fewer calls, passes still in cache).
NORM_ROWS = 128


def layer_norm(x: np.ndarray, gain: np.ndarray, bias: np.ndarray, eps: float, threads: int = 1) -> np.ndarray:
    """``(x - mean) / sqrt(var + eps) * gain + bias`` along the rows of a C-ordered ``(n, d)`` ``x``,
    ``NORM_ROWS`` rows at a time: each row's numbers are the same bits as over the whole array (a
    row's mean is its own pairwise sum), and the passes run over rows in cache, not over the whole
    activation each. Its rows split over ``threads`` as ``by_row_slices`` splits them."""
    out, eps = np.empty_like(x), np.float32(eps)
    by_row_slices(lambda rows: _layer_norm_into(out[rows], x[rows], gain, bias, eps), len(x), threads)
    return out


def _layer_norm_into(out: np.ndarray, x: np.ndarray, gain: np.ndarray, bias: np.ndarray, eps: np.float32) -> None:
    squares = np.empty((min(NORM_ROWS, len(x)), *x.shape[1:]), x.dtype)
    for lo in range(0, len(x), NORM_ROWS):
        rows, normed = x[lo:lo + NORM_ROWS], out[lo:lo + NORM_ROWS]
        np.subtract(rows, rows.mean(-1, keepdims=True), out=normed)
        square = np.multiply(normed, normed, out=squares[:len(rows)])
        normed /= np.sqrt(square.mean(-1, keepdims=True) + eps)
        normed *= gain
        normed += bias


# gelu's -2z = x * (_GELU_LINEAR + _GELU_CUBE * x * x)
_GELU_LINEAR = np.float32(-2 * np.sqrt(2 / np.pi))
_GELU_CUBE = np.float32(-2 * np.sqrt(2 / np.pi) * 0.044715)


def gelu(x: np.ndarray) -> np.ndarray:
    """GPT-2's tanh approximation ("gelu_new"), ``0.5 * x * (1 + tanh(z))`` with
    ``z = c * (x + 0.044715 * x**3)``, computed as ``x / (1 + exp(-2 * z))``, the same function
    (``(1 + tanh(z)) / 2`` is the logistic of ``2z``): NumPy's float32 ``exp`` takes about half
    the time of its ``tanh``, and the form takes seven passes over one temporary, not nine
    (``python -m kvstate.bench.prefill --against DIR`` times a prefill beside another checkout's).
    It is also the more accurate form down the negative tail, where ``1 + tanh(z)`` cancels
    (``tests/test_model_gelu.py``). Far below zero ``exp`` overflows to inf and the value is -0.0,
    as in the tanh form.
    """
    minus_two_z = np.empty_like(x)
    return _gelu(x, minus_two_z, out=minus_two_z)


GELU_ROWS = 16      # rows per block of ``gelu_in_place``: 16 x 3072 float32 (192 KiB) stay in L2


def gelu_in_place(x: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """``x[...] = gelu(x + bias)`` (``bias``: one per column; ``gelu(x)`` without one), the same bits,
    ``GELU_ROWS`` rows at a time through one small temporary: the bias and the seven passes then run
    over rows in cache, where over a whole (2048, 3072) activation each pass went out to memory (a
    GPT-2-small layer's gelu 50 -> 39 ms on this VM), and no activation-sized temporary is allocated
    (fresh memory costs its page faults)."""
    minus_two_z = np.empty((min(GELU_ROWS, len(x)), *x.shape[1:]), x.dtype)
    for lo in range(0, len(x), GELU_ROWS):
        rows = x[lo:lo + GELU_ROWS]
        if bias is not None:
            rows += bias
        _gelu(rows, minus_two_z[:len(rows)], out=rows)
    return x


def _gelu(x: np.ndarray, minus_two_z: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``gelu(x)`` into ``out`` (``x`` itself or the scratch ``minus_two_z``, both ``x``'s shape)."""
    np.multiply(x, x, out=minus_two_z)
    minus_two_z *= _GELU_CUBE
    minus_two_z += _GELU_LINEAR
    minus_two_z *= x
    with np.errstate(over="ignore"):
        np.exp(minus_two_z, out=minus_two_z)
    minus_two_z += 1
    return np.divide(x, minus_two_z, out=out)


def attend(q: np.ndarray, blocks: list[tuple[np.ndarray, np.ndarray]], start: int, threads: int = 1) -> np.ndarray:
    """Causal attention of queries at positions ``start..start+n-1`` over key/value ``blocks`` ``(t, H, D)``.

    The blocks cover positions ``0..start+n-1`` in order. Returns ``(n, H * D)``.
    Queries go in chunks of at most ``QUERY_ROWS`` rows that never straddle a key
    block, so a chunk sees whole blocks before its own and masks only inside that
    one. Why so small: each product is then below OpenBLAS's threading threshold
    (``M*N*K <= 4 * 65536`` at 64-wide heads), so it runs on the calling thread;
    with 256-row chunks every one of the thousands of small products of a prefill
    woke the BLAS threads, which on a busy machine cost more than the products
    (a 512-token GPT-2-small prefill: 0.2 s of attention a layer at 2 threads).
    A decode (one query) takes the same path as before: one chunk over every block.

    With ``threads`` > 1, a pass of ``SPLIT_FROM_ROWS`` queries or more splits the heads between that many
    threads, each running the same chunks over its heads (NumPy lets go of the GIL in the
    products and the softmax): a head's numbers are the same bits at any thread count.
    """
    n, H, D = q.shape
    scale = np.float32(1 / np.sqrt(D))
    qh = q.transpose(1, 0, 2)                          # (H, n, D)
    offsets = [0]
    for k, _ in blocks:
        offsets.append(offsets[-1] + len(k))
    out = np.empty((n, H, D), np.float32)              # laid out as the (n, H * D) result: no copy at the end
    groups = min(threads, H) if n >= SPLIT_FROM_ROWS else 1
    if groups == 1:
        _attend_heads(qh, blocks, offsets, start, scale, out)
    else:
        done = thread_pool(groups).map(lambda h: _attend_heads(qh[h], [(k[:, h], v[:, h]) for k, v in blocks],
                                                         offsets, start, scale, out[:, h]), even_slices(H, groups))
        list(done)                                     # re-raises what a thread raised
    return out.reshape(n, H * D)


@lru_cache(maxsize=None)
def thread_pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(threads, thread_name_prefix="kvstate-attention")


# A forked child inherits the pools but not their threads: it makes its own.
os.register_at_fork(after_in_child=thread_pool.cache_clear)


def in_row_slices(in_place, x: np.ndarray, threads: int) -> np.ndarray:
    """``in_place(x)`` (an element-by-element change of ``x`` itself), its rows split as
    ``by_row_slices`` splits them; returns ``x``."""
    by_row_slices(lambda rows: in_place(x[rows]), len(x), threads)
    return x


def by_row_slices(work, n: int, threads: int) -> None:
    """``work(rows)`` for ``rows`` = ``slice(0, n)``, or for ``threads`` consecutive slices of it on as
    many threads when there are enough rows: NumPy's element-by-element loops run on one thread (the
    products' BLAS splits itself), and each row's numbers are the same bits wherever it ran."""
    if threads < 2 or n < SPLIT_FROM_ROWS:
        work(slice(0, n))
    else:
        list(thread_pool(threads).map(work, even_slices(n, threads)))


def even_slices(n: int, parts: int) -> list[slice]:
    """``range(n)`` in ``parts`` consecutive slices whose lengths differ by at most one."""
    cuts = [n * i // parts for i in range(parts + 1)]
    return [slice(a, b) for a, b in zip(cuts, cuts[1:])]


def _attend_heads(qh, blocks, offsets, start: int, scale, out) -> None:
    """``attend`` for the heads of ``qh`` ``(h, n, D)``, chunk by chunk, into ``out`` ``(n, h, D)``."""
    n = qh.shape[1]
    for b in range(len(blocks)):
        for lo in range(max(start, offsets[b]), min(start + n, offsets[b + 1]), QUERY_ROWS):
            hi = min(start + n, offsets[b + 1], lo + QUERY_ROWS)      # absolute positions of the chunk's rows
            chunk = _attend_chunk(qh[:, lo - start:hi - start], blocks[:b + 1], offsets, lo, hi, scale)
            out[lo - start:hi - start] = chunk.transpose(1, 0, 2)


@lru_cache(maxsize=256)
def _hidden(rows: int, width: int, first: int) -> np.ndarray:
    """Row i of a chunk may not see keys of its own block from column ``first + i`` on (read-only: shared)."""
    hidden = np.triu(np.ones((rows, width), bool), first)
    hidden.flags.writeable = False
    return hidden


def _attend_chunk(rows, blocks, offsets, lo: int, hi: int, scale) -> np.ndarray:
    """Rows at positions ``lo..hi-1``, all inside the last of ``blocks``; keys past ``hi - 1`` are never read.

    Three passes over the scores besides their products: the row maxima, the exponent (in
    place) and the row sums. The scale goes into the rows before the products and the
    normalisation into the ``(h, rows, D)`` output after them, both far smaller than the
    ``(h, rows, keys)`` scores; each block's products are written straight into the scores."""
    h, m, _ = rows.shape
    widths = [len(k) for k, _ in blocks[:-1]] + [hi - offsets[len(blocks) - 1]]
    last = offsets[len(blocks) - 1]
    scores = np.empty((h, m, last + widths[-1]), np.float32)
    rows = rows * scale
    for b, ((k, _), w) in enumerate(zip(blocks, widths)):
        np.matmul(rows, k[:w].transpose(1, 2, 0), out=scores[:, :, offsets[b]:offsets[b] + w])
    if m > 1:       # blocks before the last are visible to every row; in the last, row i sees keys up to lo + i
        scores[:, :, last:][:, _hidden(m, widths[-1], lo - last + 1)] = -np.inf
    scores -= scores.max(-1, keepdims=True)
    weights = np.exp(scores, out=scores)
    values = [v[:w].transpose(1, 0, 2) for (_, v), w in zip(blocks, widths)]
    total = weights[:, :, :widths[0]] @ values[0]
    part = np.empty_like(total)                       # each later block's product, summed in left to right
    for b in range(1, len(blocks)):
        total += np.matmul(weights[:, :, offsets[b]:offsets[b] + widths[b]], values[b], out=part)
    total /= weights.sum(-1, keepdims=True)
    return total
