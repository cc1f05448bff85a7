"""A context's pages seen layer by layer, for a forward pass that reads every layer on every step.

``Context.read_layer_pages`` slices each page anew on every call: at 512 tokens in
16-token pages that is 32 slices per layer per step, and the slicing, not the copy,
dominated a decode step. A ``LayerReader`` slices the pages of its context once per
change of the context's page tuple (which the context replaces on every change and
never edits in place: one new tuple per filled page, per copy-on-write, per truncate)
and keeps the slices; a step then takes the list for a layer and cuts only the last,
partly filled page to the context's length. The caller gathers the list with one
concatenation per layer.

The slices are views of the pages in their stored encoding (f32, f16, or q8 codes and
scales): live, valid until the context's owner next writes it, and never written.
``prepare`` is applied to each slice once, when it is made (the transformers adapter
turns a NumPy page into a torch tensor and moves heads first there).
"""

from __future__ import annotations

from kvstate.spec.errors import ContextClosedError


class LayerReader:
    """Per-layer, per-part page slices of one context, rebuilt only when its pages change."""

    def __init__(self, context, prepare=lambda x: x, tokens_axis: int = 0):
        self.context = context
        self._prepare = prepare
        self._axis = tokens_axis        # where ``prepare`` leaves the positions axis (it may move heads first)
        self._pages: tuple | None = None
        self._slices: list = []     # [layer][component] -> list of per-page slices (page_tokens positions each)

    def parts(self, layer: int, component: int, skip: int = 0) -> list:
        """Slices covering positions ``[skip * page_tokens, len(context))`` of ``layer``'s ``component``
        (``2 * part + kind``: K then V of the store's first array, then of its second, q8's scales):
        the pages after the first ``skip``. Empty for an empty context."""
        ctx = self.context
        if ctx.closed:
            raise ContextClosedError(f"context {ctx.context_id} is closed")
        if ctx._pages is not self._pages:
            self._rebuild(ctx._pages)
        slices = self._slices[layer][component]
        if skip >= len(slices):
            return []
        tail = ctx._length - (len(slices) - 1) * ctx._cache.page_tokens
        last = slices[-1]
        if tail == last.shape[self._axis]:
            return slices[skip:] if skip else slices
        return slices[skip:-1] + [last[:, :tail] if self._axis == 1 else last[:tail]]

    def follow(self, context) -> "LayerReader":
        """A reader of ``context`` (a fork of this reader's context) that starts from this reader's
        slices: a fork holds the very same pages, so none is sliced again until one changes."""
        reader = LayerReader(context, self._prepare, self._axis)
        reader._pages, reader._slices = self._pages, self._slices     # replaced, never changed in place
        return reader

    def _rebuild(self, pages: tuple) -> None:
        """Slice the pages that changed: the pages a new tuple shares with the old one, from the
        start (every page but the last after an ``extend`` or a copy-on-write), keep their slices."""
        keep = common_prefix(self._pages or (), pages)
        layout = self.context._cache.layout
        arrays = [_arrays(page.buffer) for page in pages[keep:]]
        parts = len(_arrays(pages[0].buffer)) if pages else 1
        if not keep or not self._slices:
            self._slices = [[[] for _ in range(2 * parts)] for _ in range(layout.layers)]
        self._slices = [[kept[:keep] + [self._prepare(a[component // 2][layer, component % 2]) for a in arrays]
                         for component, kept in enumerate(self._slices[layer])]
                        for layer in range(layout.layers)]
        self._pages = pages


def common_prefix(pages: tuple, others: tuple) -> int:
    """How many leading pages two page tuples hold in common (the very same page objects)."""
    n = min(len(pages), len(others))
    for index in range(n):
        if pages[index] is not others[index]:
            return index
    return n


def _arrays(buffer) -> tuple:
    """The arrays of a page buffer, whichever store made it."""
    return buffer.tensors if hasattr(buffer, "tensors") else buffer.arrays




def written_token(context):
    """A token that changes (``is not``) whenever ``context`` is written, cut or moved to other pages:
    its ``Holding``, which every change replaces whole. Unlike ``state_token`` it changes on an
    overwrite inside a page only this context holds (which keeps the page tuple)."""
    return context._holding


def state_token(context):
    """A token equal (``is``) for two contexts exactly when they hold the very same pages: two
    forks that neither has written since. What one would store next, the other would too."""
    return context._pages
