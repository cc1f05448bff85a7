"""The batch bookkeeping of ``kvstate.hf``: which new positions of a row are padding, and which
rows a reorder keeps, moves or forks. Pure functions over ids and masks: no K/V, no contexts.
"""

from __future__ import annotations

import numpy as np

from kvstate.spec.errors import ShapeError
from kvstate.spec.layout import check_tokens


def as_ids(ids) -> np.ndarray:
    """Token ids as a ``(batch, n)`` int array (a ``(n,)`` input is one row)."""
    if hasattr(ids, "detach"):
        ids = ids.detach().cpu().numpy()
    ids = np.asarray(ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2:
        raise ShapeError(f"input_ids must be (batch, n) or (n,), got shape {ids.shape}")
    for row in ids:
        check_tokens(row)
    return ids


def new_padding(mask, batch: int, n: int, held: list[int]) -> list[int]:
    """How many of each row's ``n`` new positions are left padding (attention mask 0).

    ``mask`` is transformers' 2D attention mask over past and new positions (or None:
    no padding). Padding must come before a row's first real token: a row that already
    holds tokens, or a 0 after a 1, is refused (``ShapeError``) -- kvstate stores a row's
    real positions only, so a hole inside a row has no place.
    """
    if mask is None or getattr(mask, "ndim", 0) != 2:
        return [0] * batch
    if hasattr(mask, "detach"):
        mask = mask.detach().cpu().numpy()
    mask = np.asarray(mask)
    if mask.shape[0] != batch or mask.shape[1] < n:
        raise ShapeError(f"attention_mask of shape {mask.shape} does not cover {batch} rows of {n} new positions")
    new = mask[:, mask.shape[1] - n:] != 0
    pads = []
    for row, real in enumerate(new):
        first = int(real.argmax()) if real.any() else n
        if not real[first:].all():
            raise ShapeError(f"row {row}'s attention mask has a hole after its first token: kvstate holds left "
                             "padding only (tokenizer padding_side='left'). Given no attention_mask, generate "
                             "builds one that marks every token equal to pad_token_id as padding: a prompt "
                             "holding that id gets a hole there; pass attention_mask (torch.ones_like(input_ids) "
                             "where nothing is padded)")
        if first and held[row]:
            raise ShapeError(f"row {row} already holds {held[row]} tokens, but its new positions start with "
                             f"{first} padded ones: padding goes before a row's first token only")
        pads.append(first)
    return pads


def reorder_plan(indices, batch: int) -> list[tuple[int, bool]]:
    """For each new row, ``(source row, fork)``: a source's first use moves its context, every
    later use forks it. Checked in full before anything moves."""
    if hasattr(indices, "detach"):
        indices = indices.detach().cpu()
    picked = np.asarray(indices).reshape(-1)
    if picked.dtype.kind not in "iu" and picked.size:
        raise ShapeError(f"row indices must be integers, got {picked.dtype}")
    picked = [int(i) for i in picked]
    bad = [i for i in picked if not 0 <= i < batch]
    if bad or not picked:
        raise ShapeError(f"row indices {picked} are not rows of a batch of {batch}")
    seen, plan = set(), []
    for source in picked:
        plan.append((source, source in seen))
        seen.add(source)
    return plan
