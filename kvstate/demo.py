"""``kvstate demo``: what an agent gets from the engine, on a small seeded model, in about ten seconds.

Four scenes, each printing pages shared, pages copied, tokens not re-prefilled
and the time that saved (measured against re-prefilling in the same run):
best-of-N from one prompt, branch/explore/backtrack, a session snapshotted on
exit and restored on the next start, and a prefix hit on a re-sent conversation.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from kvstate.impl import Cache
from kvstate.model import GPT2, GPT2Config

CONFIG = GPT2Config(vocab_size=512, n_positions=1024, n_embd=128, n_layer=4, n_head=4)
PAGE = 16


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


class Demo:
    def __init__(self, out=print):
        self.out = out
        self.model = GPT2.random(CONFIG, seed=7)
        self.rng = np.random.default_rng(7)
        self.cache = Cache(CONFIG.layout, page_tokens=PAGE, max_entries=16)
        with Cache(CONFIG.layout).allocate() as warm:    # first calls pay one-off costs; keep them out of the timings
            self.model.prefill(warm, self.tokens(64))

    def tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(0, CONFIG.vocab_size, n)

    def report(self, before: dict, shared: int, not_prefilled: int, saved_s: float) -> None:
        after = self.cache.stats()
        self.out(f"   pages shared {shared}, pages copied {after['pages_copied'] - before['pages_copied']}, "
                 f"tokens not re-prefilled {not_prefilled}, time saved ~{saved_s * 1e3:.0f} ms")

    def best_of_n(self, n: int = 4, prompt_len: int = 600, new: int = 12) -> None:
        self.out(f"1. best-of-{n}: {n} continuations of {new} tokens from one {prompt_len}-token prompt")
        prompt = self.tokens(prompt_len)
        parent = self.cache.allocate()
        logits, prefill_s = timed(lambda: self.model.prefill(parent, prompt)[-1])
        before = self.cache.stats()
        branches = [parent.fork() for _ in range(n)]
        for i, ctx in enumerate(branches):
            rng, step = np.random.default_rng(i), logits
            for _ in range(new):
                step = self.model.decode(ctx, int(np.argmax(step + rng.gumbel(size=step.shape))))
        self.out(f"   {n} forks, each a list copy: no K/V bytes copied at fork time")
        self.report(before, shared=n * (prompt_len // PAGE), not_prefilled=n * prompt_len, saved_s=n * prefill_s)
        for ctx in branches:
            ctx.close()
        self.parent, self.prefill_s = parent, prefill_s

    def explore_and_backtrack(self, tries: int = 3, depth: int = 8) -> None:
        self.out(f"2. an agent explores {tries} branches of {depth} tool-call tokens and backtracks from each")
        state = self.parent
        with state.fork() as look:                       # what the agent would see next, before exploring
            probe = self.model.decode(look, 1)
        before = self.cache.stats()
        for _ in range(tries):
            with state.fork() as branch:
                for token in self.tokens(depth):
                    self.model.decode(branch, int(token))
        with state.fork() as again:
            unchanged = np.array_equal(self.model.decode(again, 1), probe)
        self.out(f"   backtracked state gives bit-identical next-token logits: {unchanged}")
        self.report(before, shared=tries * len(state) // PAGE, not_prefilled=tries * len(state),
                    saved_s=tries * self.prefill_s)

    def snapshot_and_restore(self) -> None:
        self.out("3. a session is snapshotted on exit and restored on the next start")
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "session.kvs"
            self.parent.snapshot(path)
            next_start = Cache(CONFIG.layout, page_tokens=PAGE)
            restored, restore_s = timed(lambda: next_start.restore(path))
            positions = len(restored)
            with self.parent.fork() as original:
                same = np.array_equal(self.model.decode(restored, 1), self.model.decode(original, 1))
            restored.close()
            self.out(f"   restored {positions} positions in {restore_s * 1e3:.1f} ms "
                     f"(re-prefill {self.prefill_s * 1e3:.0f} ms); next-token logits identical: {same}")
            self.out(f"   tokens not re-prefilled {positions}, time saved ~{(self.prefill_s - restore_s) * 1e3:.0f} ms")

    def prefix_hit(self, history: int = 500, turn: int = 40) -> None:
        self.out(f"4. a conversation of {history} tokens is re-sent with a new {turn}-token turn")
        conversation = self.tokens(history)
        with self.cache.allocate() as first:
            _, full_s = timed(lambda: self.model.prefill(first, conversation))
            self.cache.retain(first)
        request = np.concatenate([conversation, self.tokens(turn)])
        before = self.cache.stats()
        ctx, matched = self.cache.match(request)
        _, rest_s = timed(lambda: self.model.prefill(ctx, request[matched:]))
        self.out(f"   match found {matched} of {len(request)} tokens; prefilled only {len(request) - matched} "
                 f"({rest_s * 1e3:.0f} ms; the {history} took {full_s * 1e3:.0f} ms)")
        # what the hit skipped is the history's prefill, timed above (the match is the whole history);
        # the turn's own prefill happens either way (taking one from the other made a single noisy
        # sample go negative)
        self.report(before, shared=matched // PAGE, not_prefilled=matched, saved_s=full_s)
        ctx.close()

    def run(self) -> None:
        start = time.perf_counter()
        self.out(f"kvstate demo: GPT-2-architecture model {CONFIG.n_layer}x{CONFIG.n_embd}, "
                 f"seeded random weights, {PAGE}-token pages\n")
        self.best_of_n()
        self.explore_and_backtrack()
        self.snapshot_and_restore()
        self.prefix_hit()
        stats = self.cache.stats()
        self.out(f"\ncache: {stats['pages_allocated']} pages ever allocated, {stats['pages_copied']} copied "
                 f"(copy-on-write of partly filled last pages), {stats['live_pages']} live; "
                 f"demo took {time.perf_counter() - start:.1f} s")


def main(hf: bool = False) -> int:
    if hf:
        from kvstate.hf_demo import main as hf_demo

        return hf_demo()
    Demo().run()
    return 0
