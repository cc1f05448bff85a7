"""Engine benchmarks: fork cost and lockstep-machine throughput.

    python -m kvstate.bench.engine [--json PATH]

Prints pages allocated and time per fork of a 32-page context forked 8 ways
(GPT-2-small-shaped pages, so a copy would be expensive), beside the time to
copy the same pages, and lockstep steps per second per configuration.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from hypothesis.stateful import run_state_machine_as_test

from kvstate import Cache, Layout
from kvstate.impl.numpy import factory as numpy_factory
from kvstate.stateful.configs import PROFILES, machine_configs
from kvstate.stateful.machine import machine_for

GPT2_SMALL = Layout(layers=12, kv_heads=12, head_dim=64)


def bench_fork(page_tokens: int = 64, pages: int = 32, ways: int = 8, repeats: int = 2000) -> dict:
    cache = Cache(GPT2_SMALL, page_tokens=page_tokens)
    parent = cache.allocate()
    n = pages * page_tokens
    parent.extend(np.arange(n) % 50000, np.zeros(GPT2_SMALL.batch_shape(n), np.float32))
    before = cache.stats()
    started = time.perf_counter()
    for _ in range(repeats):
        forks = [parent.fork() for _ in range(ways)]
        for f in forks:
            f.close()
    fork_and_close = (time.perf_counter() - started) / (repeats * ways)
    started = time.perf_counter()
    for _ in range(repeats):
        forks = [parent.fork() for _ in range(ways)]
    fork_only = (time.perf_counter() - started) / (repeats * ways)
    after = cache.stats()
    started = time.perf_counter()
    copies = [[tuple(a.copy() for a in page.buffer.arrays) for page in parent._pages] for _ in range(ways)]
    copy_time = (time.perf_counter() - started) / ways
    del copies
    return {
        "pages": pages, "ways": ways, "page_tokens": page_tokens,
        "pages_allocated_by_forks": after["pages_allocated"] - before["pages_allocated"],
        "bytes_copied_by_forks": after["bytes_copied"] - before["bytes_copied"],
        "fork_us": fork_only * 1e6, "fork_and_close_us": fork_and_close * 1e6,
        "copy_pages_us": copy_time * 1e6, "copy_over_fork": copy_time / fork_only,
    }


def bench_machine() -> list[dict]:
    rows = []
    for config in machine_configs():
        machine = machine_for(numpy_factory, config)
        started = time.perf_counter()
        run_state_machine_as_test(machine, settings=PROFILES["ci"])
        seconds = time.perf_counter() - started
        rows.append({"config": config.name, "steps": machine.stats.steps, "seconds": seconds,
                     "steps_per_s": machine.stats.steps / seconds})
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    fork = bench_fork()
    print(f"fork of a {fork['pages']}-page context (GPT-2-small pages of {fork['page_tokens']} tokens), "
          f"{fork['ways']} ways:")
    print(f"  pages allocated {fork['pages_allocated_by_forks']}, bytes copied {fork['bytes_copied_by_forks']}")
    print(f"  {fork['fork_us']:.2f} us per fork; {fork['fork_and_close_us']:.2f} us per fork+close; "
          f"copying the same pages {fork['copy_pages_us']:.0f} us ({fork['copy_over_fork']:.0f}x a fork)")
    machine = bench_machine()
    print("lockstep machine (ci profile):")
    for row in machine:
        print(f"  {row['config']:<12} {row['steps']:>6} steps  {row['seconds']:6.2f} s  {row['steps_per_s']:8.0f} steps/s")
    results = {"fork": fork, "machine": machine}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
