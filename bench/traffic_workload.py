"""The requests of ``agent_traffic``: agent conversations behind one shared system prompt.

``conversations`` conversations of ``turns`` turns (200 x 10 in full), all starting with
the same system prompt (1,000 tokens), turns of all conversations interleaved at random;
each turn adds 50-200 tokens. Nobody retains the system prompt on its own.

``shared``    each request is the conversation's previous request plus the new turn.
``divergent`` each request is as long as ``shared``'s, but only the system prompt is shared:
              everything after it is new.
``diverging`` (not run by default) after turn one, each request keeps the system prompt and
              turn one and rewrites everything after (an agent that rewrites its working memory).
"""

from __future__ import annotations

import numpy as np

from kvstate.spec.layout import Layout

TINY = Layout(1, 1, 1)       # one value per position: only the tree and page bookkeeping are timed
PAGE_SIZES = (1, 16, 64)
WORKLOADS = ("shared", "divergent")
KINDS = (*WORKLOADS, "diverging")
QUICK = dict(conversations=12, turns=3, system_tokens=100, turn_tokens=(5, 40))
FULL = dict(conversations=200, turns=10, system_tokens=1000, turn_tokens=(50, 200))


def workload(kind: str = "shared", conversations: int = 200, turns: int = 10, system_tokens: int = 1000,
             turn_tokens: tuple[int, int] = (50, 200), seed: int = 0) -> list[np.ndarray]:
    """The requests in arrival order, each a token array; a conversation's turns stay in order."""
    if kind not in KINDS:
        raise ValueError(f"workload must be one of {KINDS}, got {kind!r}")
    rng = np.random.default_rng(seed)

    def fresh(n):
        return rng.integers(0, 50000, n)

    # Sizes and arrival order first, so both kinds get the same ones; then the tokens.
    added = rng.integers(*turn_tokens, size=(conversations, turns), endpoint=True)
    order = np.repeat(np.arange(conversations), turns)
    rng.shuffle(order)
    system = fresh(system_tokens)
    turn_one = [np.concatenate([system, fresh(added[c, 0])]) for c in range(conversations)]
    histories = list(turn_one)
    seen = [0] * conversations
    requests = []
    for c in order:
        turn, seen[c] = seen[c], seen[c] + 1
        if turn:
            if kind == "shared":
                histories[c] = np.concatenate([histories[c], fresh(added[c, turn])])
            else:   # as long as ``shared`` would be, everything after turn one new
                histories[c] = np.concatenate([turn_one[c], fresh(len(histories[c]) - len(turn_one[c]) + added[c, turn])])
        if kind == "divergent":     # as long as ``shared``'s request, everything after the system prompt new
            requests.append(np.concatenate([system, fresh(len(histories[c]) - system_tokens)]))
            continue
        requests.append(histories[c])
    return requests
