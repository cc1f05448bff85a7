"""Lockstep-machine throughput: checked steps per second in each configuration.

    python -m kvstate.bench.machine [--json PATH]

Runs the ``ci`` profile (what ``kvstate conform`` runs) for the NumPy backend and
reports steps per second; every step includes the full invariant check. Fork cost
is measured by ``kvstate bench fork_copy`` beside ``copy.deepcopy``.
"""

from __future__ import annotations

import argparse
import json
import time

from kvstate.impl.numpy import factory as numpy_factory
from kvstate.stateful.configs import PROFILES, machine_configs
from kvstate.stateful.machine import machine_for, run_machine


def bench_machine(profile: str = "ci") -> list[dict]:
    rows = []
    for config in machine_configs():
        machine = machine_for(numpy_factory, config)
        started = time.perf_counter()
        run_machine(machine, PROFILES[profile])
        seconds = time.perf_counter() - started
        rows.append({"config": config.name, "steps": machine.stats.steps, "seconds": seconds,
                     "steps_per_s": machine.stats.steps / seconds})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    rows = bench_machine()
    print("lockstep machine, ci profile (every step checks the whole invariant set):")
    for row in rows:
        print(f"  {row['config']:<12} {row['steps']:>6} steps  {row['seconds']:6.2f} s  {row['steps_per_s']:8.0f} steps/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
