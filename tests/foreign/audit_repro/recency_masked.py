"""Finding: for a black-box backend, ``Lockstep``'s probe of every entry after each step (matching
each reference entry by its own key, oldest first, on both sides) re-stamps the engine's entries in
the reference's order, so a step that left the engine's recency order wrong is resynchronised
before any later eviction can show it. Two planted recency bugs of the audit's engine:

- ``stamp_all_candidates``: a block-tie hit also stamps the entries that lost the tie;
- ``partial_hit_no_stamp``: a hit shorter than the giving entry's key does not stamp it.

The same 10 operations, run on the engines directly (no probes), show each bug evicting the wrong
entry (a key that must hit misses); run through the suite's ``Lockstep`` they pass.

    PYTHONPATH=. python tests/foreign/audit_repro/recency_masked.py
"""
import numpy as np

from common import CONFIGS, audit_bugs, audit_minimal, both, match_close, retain_new, run


SCENARIOS = {
    # A and B share a block, X (unrelated) retained between them; a one-block hit comes from B (the most
    # recently used) and stamps only B: order A, X, B; the next retain past max_entries (3) evicts A.
    "stamp_all_candidates": [("retain", (1, 2)), ("retain", (5,)), ("retain", (1, 3)), ("match", (1, 9)),
                             ("retain", (7,)), ("match", (5,)), ("match", (1, 2))],
    # B, then X; a one-block hit of B's two-block key stamps B: order X, B; two more retains evict X.
    "partial_hit_no_stamp": [("retain", (1, 3)), ("retain", (5,)), ("match", (1, 9)), ("retain", (7,)),
                             ("retain", (8,)), ("match", (5,)), ("match", (1, 3))],
}


def tokens(blocks, B):
    return tuple(t for b in blocks for t in (b,) * B)


def lockstep_script(steps):
    def script(lock):
        B = lock.config.block_tokens
        for i, (op, blocks) in enumerate(steps):
            if op == "retain":
                retain_new(lock, tokens(blocks, B), seed=i + 1)
            else:
                match_close(lock, tokens(blocks, B))
    return script


def direct(factory, config, steps):
    """The same operations on the engine alone: what a user of the engine sees (matched counts)."""
    cache, B, L = factory(config), config.block_tokens, config.layout
    seen = []
    for op, blocks in steps:
        t = list(tokens(blocks, B))
        if op == "retain":
            c = cache.allocate()
            c.extend(t, np.ones(L.batch_shape(len(t)), np.float32))
            cache.retain(c)
        else:
            c, n = cache.match(t)
            seen.append(n)
        c.close()
    return seen


config = CONFIGS["block4-f32-pool10-evict"]       # max_entries 3
for bug, steps in SCENARIOS.items():
    print(f"{bug}: matched counts, correct engine {direct(audit_minimal.factory, config, steps)}, "
          f"planted {direct(getattr(audit_bugs, bug), config, steps)}")
    both(bug, config.name, lockstep_script(steps))


# Control: the same engines exposing the tree tier (entries in eviction order, nothing else) are
# rejected on the same operations: the gap is the black-box probe's.
from kvstate.spec.observation import EntryView, black_box  # noqa: E402


def with_entries(cls):
    class Tree(cls):
        def observe(self):
            obs = black_box()
            entries = tuple(EntryView(e.key, e.stamp, None) for e in sorted(self.entries, key=lambda e: e.stamp))
            return obs.__class__(**{**obs.__dict__, "entries": entries})

    def factory(config):
        return Tree(config)
    factory.configs = audit_minimal.factory.configs
    return factory


for bug, steps in SCENARIOS.items():
    print(f"tree tier, correct engine: {run(with_entries(audit_minimal.AuditCache), config, lockstep_script(steps))}")
    print(f"tree tier, planted {bug}: {run(with_entries(audit_bugs.BUGS[bug]), config, lockstep_script(steps))[:300]}")
