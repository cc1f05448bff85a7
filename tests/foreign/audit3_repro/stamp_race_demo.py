"""The planted ``stamp_outside_lock`` is a real bug, though `conform --check races` passes it.

Entries X, Y, Z are retained in that order (Z newest; max_entries 3). Two threads then hit X and Y
once each, at once. Under any order of those two matches both X and Y are stamped after Z, so Z is
the least recently used and a fourth retain must evict Z. With the stamp taken after the cache lock
(and the entry to stamp handed over through the cache), one thread can stamp the other's entry:
X is never stamped and is evicted instead, an order no serialisation of the matches gives.

    PYTHONPATH=. python tests/foreign/audit3_repro/stamp_race_demo.py [BUG_NAME|correct] [ROUNDS]
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np

sys.path.insert(0, "tests/foreign")
import audit3_locks as engine            # noqa: E402
import audit3_locks_bugs as bugs         # noqa: E402


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else "stamp_outside_lock"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    config = engine.factory.configs[0].with_(pool_pages=0, on_full="fallback", max_entries=3)
    make = engine.factory if name == "correct" else bugs.BUGS[name]
    rng = np.random.default_rng(0)
    sys.setswitchinterval(1e-6)

    def yields(frame, event, arg):       # give up the interpreter at random calls into the engine
        if event == "call" and "audit3_locks" in frame.f_code.co_filename and rng.random() < 0.3:
            time.sleep(0)

    kv = np.ones(config.layout.batch_shape(1), np.float32)
    for r in range(rounds):
        cache = make(config)
        for key in (10, 20, 30, 40):
            if key == 40:
                barrier = threading.Barrier(2)
                hits = []

                def hit(token):
                    barrier.wait()
                    ctx, matched = cache.match([token])
                    hits.append(matched)
                    ctx.close()
                threading.setprofile(yields)
                threads = [threading.Thread(target=hit, args=(t,)) for t in (10, 20)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                threading.setprofile(None)
            ctx = cache.allocate()
            ctx.extend([key], kv)
            cache.retain(ctx)
            ctx.close()
        kept = sorted(cache.match([k])[1] and k for k in (10, 20, 30))
        if kept != [0, 10, 20]:
            print(f"{name}: round {r}: after hits of 10 and 20 (both after 30 was retained), retaining 40 "
                  f"evicted {[k for k in (10, 20, 30) if k not in kept]}, not [30]")
            return 1
    print(f"{name}: {rounds} rounds, 30 evicted every time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
