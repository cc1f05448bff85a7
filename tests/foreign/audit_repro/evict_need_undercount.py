"""Finding: under ``on_full="evict"`` an extend whose need leaves out the copy of a shared, partly
filled last page (``need_omits_tail_copy``) evicts one entry too few at the pool's edge. conform's
ci passes it in both evicting configurations (it is caught only in the refusing one), and a
200-seed x 400-step sweep of each evicting configuration caught it once in 400 runs
(``sweep_bugs.sh``). Nine operations build the edge; the suite's own ``Lockstep`` rejects them at
once, so a directed row (the ``full pool`` row of ``pinned semantics`` under ``evict``) could.

    PYTHONPATH=. python tests/foreign/audit_repro/evict_need_undercount.py
"""
from common import O, both, ctx


def script(lock):
    P, pool = lock.config.page_tokens, lock.config.pool_pages
    e = ctx(lock, (5,) * P, seed=1)
    lock.apply(O.Retain(e))
    lock.apply(O.Close(e))                               # entry E: one page no context lists (LRU)
    c2 = ctx(lock, (1,) * (P - 1), seed=2)
    lock.apply(O.Retain(c2))                             # entry F shares c2's partly filled page
    ctx(lock, (3,) * (P * (pool - 2)), seed=3)           # live pages = pool
    lock.apply(O.Extend(c2, (1,), seed=4))               # need 1 (copy of the shared page): evicts E
    h = lock.apply(O.Match((5,) * P))                    # E is gone: a miss
    lock.check()
    lock.apply(O.Close(h))


for name in ("block4-f32-pool10-evict", "block3-f16-pool8-evict-pages5"):
    both("need_omits_tail_copy", name, script)
