"""The batch bookkeeping of ``kvstate.hf``: which new positions of a row are padding, and which
rows a reorder keeps, moves or forks. Pure functions over ids and masks: no K/V, no contexts.

Padding is read from any mask a forward may be given (2-D, 4-D, a dict of 4-D masks per layer
type); a mask that cannot be read is refused by name, never taken as "no padding": padding stored
as tokens is attended to once the row goes on alone (0.03 to 0.12 off DynamicCache's logits).
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


# What a refusal of a mask it cannot read tells the caller to pass instead.
_PASS_2D = ("pass the 2-D attention mask instead, (batch, past + new positions) with 1 for a token and 0 for "
            "left padding, from which transformers builds its 4-D masks itself")


def new_padding(mask, batch: int, n: int, held: list[int], pads: list[int] | None = None,
                past: int | None = None) -> list[int]:
    """How many of each row's ``n`` new positions are left padding.

    ``mask`` is the forward's attention mask: None (no padding), transformers' 2-D mask over
    past and new positions (0: padding), a 4-D mask ``(batch or 1, 1 or heads, n, keys)``, or a
    dict of 4-D masks per layer type (see ``real_positions``: a mask kvstate cannot read is
    refused, never read as no padding). ``held``: the positions each row's context holds;
    ``pads``: its held left padding; ``past``: the length every row presents to attention
    (padding included), where the new positions' keys start. Padding must come before a row's
    first real token: a row that already holds tokens, or padding after a token, is refused
    (``ShapeError``) -- kvstate stores a row's real positions only, so a hole inside a row has
    no place.
    """
    real = real_positions(mask, batch, n, past, pads)
    if real is None:
        return [0] * batch
    out = []
    for row, row_real in enumerate(real):
        first = int(row_real.argmax()) if row_real.any() else n
        if not row_real[first:].all():
            raise ShapeError(f"row {row}'s attention mask has a hole after its first token: kvstate holds left "
                             "padding only (tokenizer padding_side='left'). Given no attention_mask, generate "
                             "builds one that marks every token equal to pad_token_id as padding: a prompt "
                             "holding that id gets a hole there; pass attention_mask (torch.ones_like(input_ids) "
                             "where nothing is padded)")
        if first and held[row]:
            raise ShapeError(f"row {row} already holds {held[row]} tokens, but its new positions start with "
                             f"{first} padded ones: padding goes before a row's first token only")
        out.append(first)
    return out


def check_positions(position_ids, held: list[int], held_pads: list[int], pads: list[int], n: int,
                    takes_them: bool = True, padding_counted: bool = True) -> None:
    """Refuse (``ShapeError``) a forward whose rows' tokens would be computed at other positions than the
    ones kvstate keeps them at: a row's new token ``j`` (after its ``pads[row]`` new left padding) is its
    position ``held[row] + j``, whatever padding the batch presents to attention.

    ``position_ids`` are the forward's, ``None`` where it was given none; ``takes_them``: whether the model's
    forward takes them (RoFormer's does not, and ignores any given); ``padding_counted``: whether, given none,
    the model counts the padding into each row's positions (transformers' ``cache_position``; OPT numbers them
    from the mask instead: ``hf_config.position_numbering``). Given none where the padding is counted, a row
    holding or given left padding would have its tokens computed past their own positions and kept as if
    they were not (an outside audit, s70: a hit on such a row, or the row continued alone, 2e-4 to 5e-2 off
    transformers' logits). Given ones must equal those positions at each row's tokens (any value at
    padding); a shape that does not fit ``(batch or 1, n)`` is left to the model, which refuses it itself."""
    batch = len(held)
    if not takes_them:
        position_ids = None         # passed, they land in the forward's **kwargs and number nothing
    if position_ids is None:
        if not padding_counted or not (any(pads) or any(held_pads)):
            return
        if not takes_them:
            raise ShapeError("this forward's rows hold or are given left padding, and this model numbers each row's "
                             "positions from the cache's length, padding included, taking no position_ids: kvstate "
                             "keeps a row's tokens as its positions 0, 1, ..., so a padded row's would be computed "
                             "elsewhere. Forward rows without padding, or use a DynamicCache")
        raise ShapeError("this forward's rows hold or are given left padding, and it was given no position_ids: "
                         "this model then counts the padding into each row's positions, which kvstate keeps "
                         "without it (a row's tokens are its positions 0, 1, ...). Pass position_ids = "
                         "(attention_mask.cumsum(-1) - 1).clamp(min=0), as generate does")
    given = position_ids.detach().cpu().numpy() if hasattr(position_ids, "detach") else np.asarray(position_ids)
    try:
        given = np.broadcast_to(given, (batch, n))
    except ValueError:
        return
    # Every row at once (a check each decode step): new position i of a row is its token number i - pad.
    column, first_token = np.arange(n)[None, :], np.asarray(pads)[:, None]
    own = np.asarray(held)[:, None] + column - first_token
    wrong = np.argwhere((column >= first_token) & (given != own))
    if not len(wrong):
        return
    row, at = (int(x) for x in wrong[0])
    if given[row, at] < held[row]:
        raise ShapeError(f"position_ids number row {row}'s new tokens from {int(given[row, pads[row]])}, but the "
                         f"row holds {held[row]} positions: this forward feeds again tokens the row holds "
                         "(transformers' assisted and prompt-lookup generate do so on a cache that already "
                         "holds part of the prompt, appending them again), whose K/V kvstate would keep at "
                         "positions other than their own. Run those on a cache holding nothing, or on a "
                         "DynamicCache")
    raise ShapeError(f"position_ids put row {row}'s token at new position {at} at position {int(given[row, at])}, "
                     f"but kvstate keeps it as that row's position {int(own[row, at])} (its tokens are its "
                     "positions 0, 1, ..., padding never counted): a prefix hit would serve its K/V to requests "
                     "computing it there. Pass each row's own positions, (attention_mask.cumsum(-1) - 1).clamp(min=0); "
                     "generate numbers a row whose prompt is all padding otherwise, so give every row a token; or "
                     "use a DynamicCache")


def real_positions(mask, batch: int, n: int, past: int | None = None, pads: list[int] | None = None,
                   what: str = "attention_mask") -> np.ndarray | None:
    """Which of each row's ``n`` new positions are tokens (True) rather than padding, as a
    ``(batch, n)`` bool array; None for no mask (every position a token).

    - a 2-D mask ``(batch, past + n)`` (its last ``n`` columns): 0 is padding. Where ``past`` is
      given, a mask of any other width is refused: transformers reads its columns as other keys.
    - a 4-D mask ``(batch or 1, 1 or heads, n, keys)``, bool (True: attends) or floating
      (additive: 0 attends, -inf or at most half the dtype's lowest value is masked), as
      transformers builds it or a caller passes it to ``model(...)``: new position ``i`` is
      padding where it cannot attend to itself, key ``past + i`` (``past``: where the new
      positions' keys start; None: the mask's last ``n`` keys are the new positions). Every head
      must agree; the diagonal must be plainly masked or plainly attended (another additive
      value, NaN, is unreadable); and a row's padding (held ``pads`` and new) must be masked for
      each of its new tokens, or those would attend to positions kvstate does not keep.
    - a dict of such masks (per layer type, as transformers 5 builds for some models): each
      entry is read, and they must agree.

    Anything else (another rank or shape, an integer 4-D mask, a ``BlockMask`` or any other type,
    dict entries that disagree) is refused (``ShapeError``), never read as no padding: padding
    stored as tokens would be attended to when the row goes on alone.
    """
    if mask is None:
        return None
    if isinstance(mask, dict):
        return _agreed(mask, batch, n, past, pads, what)
    if not (isinstance(mask, np.ndarray) or (hasattr(mask, "detach") and hasattr(mask, "ndim"))):
        raise ShapeError(f"{what} of type {type(mask).__name__} cannot be read for left padding (kvstate keeps a "
                         f"row's tokens only, so it must know which positions are padding): {_PASS_2D}")
    if mask.ndim == 2:
        return _real_2d(_as_array(mask), batch, n, past, pads, what)
    if mask.ndim == 4:
        return _real_4d(mask, batch, n, past, pads, what)
    raise ShapeError(f"{what} of shape {tuple(mask.shape)} cannot be read for left padding: kvstate reads a 2-D mask "
                     f"(batch, keys) or a 4-D one (batch, 1 or heads, queries, keys); {_PASS_2D}")


def _as_array(mask) -> np.ndarray:
    if hasattr(mask, "detach"):
        mask = mask.detach().cpu()
        mask = (mask.double() if mask.is_floating_point() else mask).numpy()      # bfloat16 has no NumPy dtype
    return np.asarray(mask)


def _agreed(masks: dict, batch: int, n: int, past, pads, what: str) -> np.ndarray | None:
    """A dict of masks (per layer type): each read, and they must say the same."""
    if not masks:
        raise ShapeError(f"{what} is an empty dict: no mask to read left padding from; {_PASS_2D}")
    read = {}
    for key, entry in masks.items():
        if isinstance(entry, dict):
            raise ShapeError(f"{what}[{key!r}] is a dict: kvstate reads one dict of masks per layer type; {_PASS_2D}")
        real = real_positions(entry, batch, n, past, pads, f"{what}[{key!r}]")
        read[key] = np.ones((batch, n), bool) if real is None else real
    keys = list(read)
    for key in keys[1:]:
        if not np.array_equal(read[key], read[keys[0]]):
            raise ShapeError(f"{what}'s masks disagree on which positions are padding: {what}[{keys[0]!r}] and "
                             f"{what}[{key!r}] mark different ones, so kvstate cannot tell which to keep; {_PASS_2D}")
    return read[keys[0]]


def _real_2d(mask: np.ndarray, batch: int, n: int, past, pads, what: str) -> np.ndarray:
    if mask.shape[0] != batch or mask.shape[1] < n:
        raise ShapeError(f"{what} of shape {mask.shape} does not cover {batch} rows of {n} new positions")
    if past is not None:
        _check_width(mask, n, past, what)
    real = mask[:, mask.shape[1] - n:] != 0
    if pads is not None and past is not None:
        for row, pad in enumerate(pads):
            if pad and real[row].any() and (mask[row, :pad] != 0).any():
                raise ShapeError(f"row {row} holds {pad} positions of left padding, which kvstate shows to attention "
                                 f"as zeros, but {what} marks some of them 1 (attended): mark a row's padding 0 in "
                                 "every forward's mask")
            hole = np.flatnonzero(mask[row, pad:past] == 0)
            if len(hole) and real[row].any():
                raise ShapeError(f"{what} marks key {pad + int(hole[0])} of row {row} 0, one of the tokens it holds: "
                                 f"{_NOT_CAUSAL}")
    return real


def _check_width(mask: np.ndarray, n: int, past: int, what: str) -> None:
    """A 2-D mask's columns are the keys, held then new: transformers pads a narrower one with zeros on
    the right and reads a wider one from its first column, so any other width would put the mask's
    columns on other positions there than here (a row's padding shown to its tokens, unseen)."""
    if mask.shape[1] != past + n:
        new = "new one" if n == 1 else "new ones"
        raise ShapeError(f"{what} of shape {mask.shape} has {mask.shape[1]} columns, but this forward's keys are "
                         f"{past} held positions and {n} {new}: pass the 2-D mask over all {past + n} (1 for a "
                         "token, 0 for left padding)")


def _entries_4d(mask, what: str):
    """A reader of a 4-D mask's entries: given an index, two bool arrays, the entries plainly masked
    and plainly attended (a floating mask's value that is neither, another additive bias or NaN, is
    in neither). Only the entries asked for are copied out: a long prompt's mask is large."""
    unread = (f"{what}, a 4-D mask of dtype {mask.dtype}, cannot be read: kvstate reads a bool one (True: "
              f"attends) or a floating, additive one (0 attends, -inf or the dtype's lowest value masks); {_PASS_2D}")
    if hasattr(mask, "detach"):
        import torch
        mask = mask.detach()
        if mask.dtype != torch.bool and not mask.is_floating_point():
            raise ShapeError(unread)
        lowest = torch.finfo(mask.dtype).min / 2 if mask.is_floating_point() else None

        def part(index):        # compared where the mask is, in its own dtype: a long prompt's mask is large
            return mask[tuple(torch.as_tensor(i) if isinstance(i, np.ndarray) else i for i in index)]

        def as_numpy(flags):
            return flags.cpu().numpy()
    else:
        mask = np.asarray(mask)
        if mask.dtype != bool and mask.dtype.kind != "f":
            raise ShapeError(unread)
        lowest = float(np.finfo(mask.dtype).min) / 2 if mask.dtype.kind == "f" else None

        def part(index):
            return mask[index]

        def as_numpy(flags):
            return flags

    def entries(index, weightless: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(masked, attended) at ``index``; ``weightless``: "masked" is any value that leaves a key no weight
        at all (``NO_WEIGHT`` or below: the softmax's exp is exactly 0 in every float dtype), as a causal mask
        built with -1e9, -1e4 or float16's lowest in a float32 mask masks, rather than plainly masked."""
        values = part(index)
        if lowest is None:
            return as_numpy(~values), as_numpy(values)
        return as_numpy(values <= (NO_WEIGHT if weightless else lowest)), as_numpy(values == 0)
    return entries


NO_WEIGHT = -1e4        # exp(-1e4 + any score a model computes) is 0: float32 and float64 underflow far above it


def _real_4d(mask, batch: int, n: int, past, pads, what: str) -> np.ndarray:
    shape = tuple(mask.shape)
    rows, heads, queries, keys = shape
    start = keys - n if past is None else past      # the key of the first new position
    if rows not in (1, batch) or heads < 1 or queries != n or start < 0 or keys < start + n:
        where = "its last queries and keys" if past is None else f"keys {start} to {start + n - 1}"
        raise ShapeError(f"{what} of shape {shape} does not cover {batch} rows of {n} new positions as (batch or 1, "
                         f"1 or heads, {n} queries, keys) with the new positions at {where}; {_PASS_2D}")
    entries = _entries_4d(mask, what)
    new = np.arange(n)
    diagonal_masked, diagonal_attends = entries((slice(None), slice(None), new, start + new))   # (rows, heads, n)
    unread = ~(diagonal_masked | diagonal_attends)
    if unread.any():
        row, _, i = (int(x) for x in np.argwhere(unread)[0])
        raise ShapeError(f"{what} neither plainly masks nor plainly attends new position {i} of row {row} to itself "
                         f"(key {start + i}): an additive value other than 0, -inf or the dtype's lowest cannot say "
                         f"whether that position is padding; {_PASS_2D}")
    if (diagonal_masked != diagonal_masked[:, :1]).any():
        raise ShapeError(f"{what}'s heads disagree on which new positions are padding (masked on their own "
                         f"diagonal); {_PASS_2D}")
    real = np.broadcast_to(~diagonal_masked[:, 0], (batch, n))
    for row in range(batch):
        tokens = np.flatnonzero(real[row])
        hidden = start + np.flatnonzero(~real[row])
        if pads is not None:
            hidden = np.concatenate([np.arange(min(pads[row], start)), hidden])
        if not len(tokens) or not len(hidden):
            continue
        source = row if rows > 1 else 0
        masked, _ = entries((slice(source, source + 1), slice(None), tokens[:, None], hidden[None, :]))
        if not masked.all():                                        # (1, heads, tokens, hidden)
            _, _, t, h = (int(x) for x in np.argwhere(~masked)[0])
            raise ShapeError(f"{what} lets the token at row {row}'s new position {int(tokens[t])} attend to key "
                             f"{int(hidden[h])}, a padding position (masked on its own diagonal, or held as padding): "
                             f"kvstate keeps no padding, so a padding position must be masked for every token; "
                             f"{_PASS_2D}")
    for row in range(batch):
        _causal_over_tokens(entries, row if rows > 1 else 0, row, np.flatnonzero(real[row]), start, keys,
                            min(pads[row], start) if pads is not None else 0, what)
    return np.array(real)


_NOT_CAUSAL = ("kvstate keeps K/V by the token ids before them (a prefix hit, a retained entry, a snapshot serves them "
               "as those tokens' K/V), so each token must attend to every earlier token of its row and to nothing "
               "after it: a mask for packed documents, a tree of drafts or a bidirectional prompt would store K/V "
               "no ordinary request of those tokens computes. Forward such inputs with a DynamicCache")


def _causal_over_tokens(entries, source: int, row: int, tokens: np.ndarray, start: int, keys: int, pad: int,
                        what: str, chunk: int = 256) -> None:
    """Each new token of ``row`` (``tokens``: its new positions) attends to every real key up to its own
    (held ones from ``pad``, new ones that are tokens) and to no key after it, read a chunk of queries
    at a time (a long prompt's mask is large)."""
    if not len(tokens):
        return
    real_key = np.zeros(keys, bool)
    real_key[pad:start] = True
    real_key[start + tokens] = True
    for at in range(0, len(tokens), chunk):
        queries = tokens[at:at + chunk]
        # (1, heads, queries, keys). Where the chunk's positions are consecutive (a row's tokens after its
        # left padding: the usual case) a slice reads them as a view; a gather of a 4,096-token prompt's
        # mask by index arrays took most of this check's time.
        if queries[-1] - queries[0] == len(queries) - 1:
            asked = slice(int(queries[0]), int(queries[-1]) + 1), slice(None)
        else:
            asked = queries[:, None], np.arange(keys)[None, :]
        masked, attends = entries((slice(source, source + 1), slice(None), *asked), weightless=True)
        own = start + queries[:, None]
        later = np.arange(keys)[None, :] > own
        must_attend = real_key[None, :] & ~later
        wrong = (later[None, None] & ~masked) | (must_attend[None, None] & ~attends)
        if wrong.any():
            _, _, q, k = (int(x) for x in np.argwhere(wrong)[0])
            how = "attend to" if k > own[q, 0] else "not attend to"
            raise ShapeError(f"{what} has row {row}'s token at new position {int(queries[q])} {how} key {k}: "
                             f"{_NOT_CAUSAL}")


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
