"""Findings on messages: planted bugs caught with a message that points elsewhere. Each sequence is
the one conform printed (shrunk), replayed through the suite's ``Lockstep``.

1. ``tie_first_retained`` (a block tie resolved to the first entry cached under the hash, not the
   most recently used): lockstep and seeded, in every configuration, blame copy-on-write ("a write
   through a holder sharing its pages (no copy-on-write), or a page reused ...") and never name the
   block-ties rule; only prefix edges / pinned semantics quote it, and only where max_pages lets both
   tied entries live (see ties_vacuous.sh).
2. ``stamp_all_candidates`` (a hit also stamps the entries that lost the tie): the failing call is a
   retain (it needs no pages; the eviction is max_entries'), yet the message adds "or its pool
   evicted for room ... or before the pool was full".
3. ``need_omits_tail_copy`` under evict: the engine kept an entry the reference evicted for room;
   the message names only the match rule ("engine matched 4 tokens, reference 0 (match="block" ...)"),
   and under max_pages adds the budget's rule, neither of which is what broke.

    PYTHONPATH=. python tests/foreign/audit_repro/messages.py
"""
from common import O, CONFIGS, audit_bugs, run


def tie(lock):
    c1 = lock.apply(O.Allocate())
    lock.apply(O.Extend(c1, (1, 0, 2, 1, 0), seed=0))
    lock.apply(O.Retain(c1))
    c2 = lock.apply(O.Match((1, 0, 2, 1)))
    lock.apply(O.Overwrite(c2, 0, (1,), seed=12737))
    lock.apply(O.Retain(c2))


def stamp(lock):            # conform's 12-operation lockstep counterexample
    c1 = lock.apply(O.Allocate())
    lock.apply(O.Extend(c1, (0,), seed=0))
    c2 = lock.apply(O.Allocate())
    lock.apply(O.Extend(c2, (2, 1, 1, 1), seed=0))
    c3 = lock.apply(O.Allocate())
    lock.apply(O.Extend(c3, (0, 0, 0, 0), seed=0))
    lock.apply(O.Retain(c3))
    lock.apply(O.Retain(c2))
    c4 = lock.apply(O.Match((0, 0, 0, 0)))
    lock.apply(O.Extend(c4, (0,), seed=0))
    lock.apply(O.Retain(c4))
    lock.apply(O.Retain(c1))


config = CONFIGS["block4-f32-pool10-evict"]
print("1. tie_first_retained:", run(audit_bugs.tie_first_retained, config, tie))
print("2. stamp_all_candidates:", run(audit_bugs.stamp_all_candidates, config, stamp))
print("3. see evict_need_undercount.py")
