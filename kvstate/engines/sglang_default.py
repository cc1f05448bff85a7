"""SGLang 0.5.23's default prefix tree, ``UnifiedRadixCache`` over its Rust TreeCore, driven through
the kvstate protocol.

    pip install --no-deps sglang==0.5.23 <kvstate.engines.sglang_default_loader.DEPENDENCIES>
    python -m kvstate conform kvstate.engines.sglang_default

SGLang's scheduler builds this tree by default (``kvstate.engines.sglang_default_loader`` says where
that is decided); ``kvstate.engines.sglang`` drives the legacy ``RadixCache`` the release still ships.
The adapter is that one's, with the tree swapped and two differences the unified tree requires:

- a lock is a receipt: ``lock(node)`` gives a ``TreeLock`` (the node and what ``inc_lock_ref``
  returned), ``unlock`` takes it back, so each context holds its own;
- ``retain`` inserts with ``prev_prefix_len`` = the positions the request already holds from the
  tree, as the scheduler's ``checkpoint_into_tree`` passes ``cache_protected_len``: the tree itself
  frees, into SGLang's allocator, the request's slots for positions past those that it already held
  (the legacy adapter frees those duplicates after the insert).

Declared semantics, configurations and observation as ``kvstate.engines.sglang``'s, the two
reclaiming ones included (``SGLangDefaultReclaimingCache``: ``sglang_reclaim``'s pool on this tree).
Left out: snapshots, thread safety.
"""

from __future__ import annotations

import torch

from kvstate.spec import Config
from kvstate.spec.semantics import reclaims

from .sglang import SGLangCache, _configs
from .sglang_reclaim import HeldPages, ReclaimingCache
from .sglang_default_loader import build_default_tree, load_default_tree
from .sglang_loader import SUPPORTED_VERSION


class SGLangDefaultCache(SGLangCache):
    def _engine(self):
        sg = load_default_tree()
        return sg, (sg.TokenToKVPoolAllocator, sg.PagedTokenToKVPoolAllocator)     # ``rc``: its parameter classes

    def _make_tree(self, allocator):
        return build_default_tree(self.rc, self.page, allocator)

    def hold(self, node):
        return self.tree.lock(node)

    def hold_again(self, held):
        return self.tree.lock(held.node)

    def let_go(self, held) -> None:
        self.tree.unlock(held)

    def _insert(self, ctx, aligned: int) -> None:
        key = self._key(ctx._tokens[:aligned])
        value = torch.tensor(ctx.slots[:aligned], dtype=torch.int64)
        # the tree frees our slots for [protected, what it already held) itself: ours there are duplicates
        self.tree.insert(self.rc.InsertParams(key=key, value=value, prev_prefix_len=ctx.protected))


class SGLangDefaultReclaimingCache(ReclaimingCache, SGLangDefaultCache):
    """``sglang_reclaim``'s pool under pressure on the default tree: ``HeldPages`` is the tree's allocator
    here too (the unified tree frees an evicted node's slots, and a request's duplicates, through its
    ``free_segment``), and the pages only unlocked nodes hold are read from the tree's own walk of its
    unlocked nodes (``walk_for_kv_canary``), the Rust TreeCore exposing no nodes to walk from Python."""

    def _make_tree(self, allocator):
        self.held = HeldPages(allocator, self.page)
        return build_default_tree(self.rc, self.page, self.held)

    def _reclaimable_pages(self) -> int:
        walk = self.tree.tree_core.walk_for_kv_canary(unlocked_only=True, swa_resident_only=False)
        unlocked = self.held.pages(walk.slot_indices.tolist())      # a page lies in one node: nodes split at pages
        return sum(1 for page in unlocked if self.held.holders[page] == 1)


def factory(config: Config) -> SGLangDefaultCache:
    return SGLangDefaultReclaimingCache(config) if reclaims(config.on_full) else SGLangDefaultCache(config)


factory.configs = _configs()
factory.any_page_size = False
factory.engine_version = SUPPORTED_VERSION
