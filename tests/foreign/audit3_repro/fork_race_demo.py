"""The planted ``fork_without_context_lock`` is a real bug, though `conform --check races` passes it.

Thread A extends a parent by one token and truncates it back, over and over (one writer per
context, as README allows). Thread B forks the parent (a fork may race the parent's writer: README
"Concurrency" and close_races both do it) and rewrites the branch's position 0 with its own value, which copies
the page the branch shares with the parent. Every value is a fixed function of (position, token),
and tokens only grow. Without the parent's lock a fork can land after the extend raised the
length but before its bytes landed: the branch's copy then holds the bytes and token of an
extend that was truncated before the fork began (a state the parent never had at that length).

    PYTHONPATH=. python tests/foreign/audit3_repro/fork_race_demo.py [BUG_NAME] [SECONDS]
"""

from __future__ import annotations

import sys
import threading
import time

import numpy as np

sys.path.insert(0, "tests/foreign")
import audit3_locks as engine            # noqa: E402
import audit3_locks_bugs as bugs         # noqa: E402


def kv(layout, tokens, start):
    out = np.zeros(layout.batch_shape(len(tokens)), np.float32)
    for i, t in enumerate(tokens):
        out[i] = 1.0 + (start + i) + t / 1000.0
    return out


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else "fork_without_context_lock"
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 10
    config = engine.factory.configs[0].with_(pool_pages=0, on_full="fallback")
    cache = engine.factory(config) if name == "correct" else bugs.BUGS[name](config)
    layout = config.layout
    parent = cache.allocate()
    parent.extend([7], kv(layout, [7], 0))
    stop = time.monotonic() + seconds
    bad: list[str] = []
    sys.setswitchinterval(1e-6)
    rng = np.random.default_rng(0)

    def yields(frame, event, arg):       # give up the interpreter at random calls into the engine (as `yields` does)
        if event == "call" and "audit3_locks" in frame.f_code.co_filename and rng.random() < 0.3:
            time.sleep(0)

    threading.setprofile(yields)

    current = [0]

    def writer():
        token = 0
        while time.monotonic() < stop and not bad:
            token += 1                   # a new token each time, published before its extend
            current[0] = token
            parent.extend([token], kv(layout, [token], 1))
            parent.truncate(1)

    def forker():
        forks = 0
        while time.monotonic() < stop and not bad:
            floor = current[0]           # the extend of ``floor`` (or a later one) is the only one a fork can see
            child = parent.fork()
            child.overwrite(0, [7], kv(layout, [7], 0))      # copies the shared page now
            values, tokens = child.read()
            if len(tokens) == 2 and int(tokens[1]) < floor:
                bad.append(f"fork #{forks}: position 1 holds token {int(tokens[1])}, left by an extend truncated "
                           f"before the fork began (the parent's extend of {floor} had raised the length, "
                           f"its bytes not landed, when the fork copied the page)")
            want = kv(layout, [int(t) for t in tokens], 0)
            if not np.array_equal(values, want):
                row = int(np.argwhere((values != want).any(axis=(1, 2, 3, 4)))[0][0])
                bad.append(f"fork #{forks}: length {len(tokens)}, position {row} reads "
                           f"{values[row].flat[0]} where its token {int(tokens[row])} says {want[row].flat[0]}")
            child.close()
            forks += 1
        print(f"{forks} forks")

    threads = [threading.Thread(target=writer), threading.Thread(target=forker)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"{name}: " + (bad[0] if bad else "no wrong read"))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
