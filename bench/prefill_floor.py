"""What no NumPy GPT-2 prefill can skip, run alone: the floor under ``prefill/HF``.

The work of an ``n``-token prefill into an empty context, at GPT-2's shapes, split over threads as
``GPT2(threads=)`` splits it, in three parts:

- ``weights``: the products of the weights (Q/K/V, the attention's output, both MLP layers, the
  output head: for every new position, as ``prefill`` returns every position's logits, as
  transformers' forward does; about a third of these products at 2,048 tokens);
- ``attention``: attention's products, each chunk of queries against every block of keys it sees,
  queries by keys and then weights by values block by block, summed left to right, and between
  them NumPy's float32 ``exp`` of every score (the masked ones in a chunk's own block included, as
  the model runs it). Queries by keys is a contraction over a head's 64 numbers however it is
  grouped, and OpenBLAS runs such products at about half the rate of the weights'. The groupings
  tried instead were no faster and changed the bits (``bench/RESULTS.md``);
- ``gelu_exp``: the same ``exp`` once per GELU input. It is NumPy's cheapest transcendental (its
  ``tanh`` takes about twice as long), and on this VM's CPU (AVX2, no AVX-512) it takes about
  3.9 ns an element, some twenty times a multiply.

Left out, because a better pass could make them cheaper: the layer norms, the softmax's other
passes, bias adds and residuals, and the copy of the K/V into pages.
"""

from __future__ import annotations

import time

import numpy as np

from kvstate.model import numpy_gpt2      # its sizes read at each call, as the model reads them
from kvstate.model.numpy_gpt2 import GPT2, even_slices, in_row_slices, thread_pool

PARTS = ("weights", "attention", "gelu_exp")


class PrefillFloor:
    """The floor's inputs for one model and length, made once; ``run()`` is the part that is timed."""

    def __init__(self, model: GPT2, n: int):
        config = model.config
        heads, width = config.n_head, config.head_dim
        rng = np.random.default_rng(0)
        self.model = model
        self.x = rng.standard_normal((n, config.n_embd), dtype=np.float32)
        # scaled as the model scales them: scores of about unit size, as a softmax sees
        self.queries = rng.standard_normal((heads, n, width), dtype=np.float32) / np.float32(np.sqrt(width))
        self.keys, self.values = (rng.standard_normal((n, heads, width), dtype=np.float32) for _ in range(2))
        self.gelu_inputs = rng.standard_normal((n, 4 * config.n_embd), dtype=np.float32)     # GPT-2's MLP width

    def run(self) -> dict[str, float]:
        """Seconds spent in each of ``PARTS``."""
        model, x = self.model, self.x
        spent = dict.fromkeys(PARTS, 0.0)
        for _g1, _b1, w_qkv, _bq, w_o, _bo, _g2, _b2, w_fc, _bf, w_out, _bout in model.blocks:
            start = time.perf_counter()
            x @ w_qkv
            x @ w_o
            (x @ w_fc) @ w_out
            weights_done = time.perf_counter()
            attention_arithmetic(self.queries, self.keys, self.values, model.threads)
            attention_done = time.perf_counter()
            in_row_slices(exp_by_rows, self.gelu_inputs, model.threads)
            spent["weights"] += weights_done - start
            spent["attention"] += attention_done - weights_done
            spent["gelu_exp"] += time.perf_counter() - attention_done
        start = time.perf_counter()
        x @ model.head
        spent["weights"] += time.perf_counter() - start
        return spent


def best_run(floor: PrefillFloor, repeat: int) -> dict[str, float]:
    """Each part's fastest of ``repeat`` runs, and their ``total``."""
    return best_parts([floor.run() for _ in range(repeat)])


def best_parts(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each part at its fastest over ``runs``, and their sum as ``total``: a burst of load elsewhere
    during one part of a run does not raise the floor (on this VM a 2-thread run's products moved
    by a tenth between runs)."""
    best = {part: min(run[part] for run in runs) for part in PARTS}
    return {**best, "total": sum(best.values())}


def exp_by_rows(x: np.ndarray) -> None:
    """``exp`` of every element of ``x``, ``GELU_ROWS`` rows at a time as the model's GELU runs, into scratch."""
    scratch = np.empty((min(numpy_gpt2.GELU_ROWS, len(x)), *x.shape[1:]), x.dtype)
    for lo in range(0, len(x), numpy_gpt2.GELU_ROWS):
        rows = x[lo:lo + numpy_gpt2.GELU_ROWS]
        np.exp(rows, out=scratch[:len(rows)])


def attention_arithmetic(queries: np.ndarray, keys: np.ndarray, values: np.ndarray, threads: int) -> None:
    """The products and the ``exp`` of causal attention from position 0: ``queries`` ``(H, n, D)``,
    ``keys`` and ``values`` ``(n, H, D)``, heads split over threads as ``numpy_gpt2.attend`` splits them."""
    heads, n, _ = queries.shape
    groups = min(threads, heads) if n >= numpy_gpt2.SPLIT_FROM_ROWS else 1
    if groups == 1:
        _heads_arithmetic(queries, keys, values)
        return
    list(thread_pool(groups).map(lambda h: _heads_arithmetic(queries[h], keys[:, h], values[:, h]),
                                 even_slices(heads, groups)))


def _heads_arithmetic(queries: np.ndarray, keys: np.ndarray, values: np.ndarray) -> None:
    """Chunk by chunk: its queries by each block of keys it sees, ``exp`` of those scores, then the
    weights by each block of values, summed left to right (``numpy_gpt2._attend_chunk`` less its
    scale, mask, row maxima, row sums and division)."""
    heads, n, _ = queries.shape
    for lo in range(0, n, numpy_gpt2.QUERY_ROWS):
        hi = min(n, lo + numpy_gpt2.QUERY_ROWS)
        size = numpy_gpt2.ATTENTION_BLOCK
        blocks = [slice(b, min(b + size, hi)) for b in range(0, hi, size)]
        scores = np.empty((heads, hi - lo, hi), np.float32)
        for block in blocks:
            np.matmul(queries[:, lo:hi], keys[block].transpose(1, 2, 0), out=scores[:, :, block])
        np.exp(scores, out=scores)
        total = scores[:, :, blocks[0]] @ values[blocks[0]].transpose(1, 0, 2)
        part = np.empty_like(total)
        for block in blocks[1:]:
            total += np.matmul(scores[:, :, block], values[block].transpose(1, 0, 2), out=part)
