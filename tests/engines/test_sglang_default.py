"""SGLang's default tree (``UnifiedRadixCache`` over its Rust TreeCore) under ``kvstate conform``:
skipped where SGLang's dependencies are not installed (CI installs the release alone), run in a
process of its own elsewhere (importing SGLang patches transformers in the process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvstate.engines import sglang_default_loader, sglang_loader

if sglang_loader.installed_version() != sglang_loader.SUPPORTED_VERSION or sglang_default_loader.missing_dependencies():
    pytest.skip(f"SGLang's default tree needs {sglang_default_loader.INSTALL}", allow_module_level=True)

# Each case: factory, configurations, checks; the child prints {case: [passed, failure]} as JSON.
_CHILD = """
import json, sys
from hypothesis import settings
from kvstate.engines import sglang_default
from kvstate.engines._loading import STAND_IN_USES
from kvstate.stateful.conform import conform
from tests.engines import planted_sglang_default as planted

SMALL = settings(max_examples=12, stateful_step_count=15, derandomize=True, deadline=None, database=None)
cases = {name: (getattr(planted, name, sglang_default.factory), configs, checks)     # "factory", "reclaiming": the adapter
         for name, configs, checks in json.loads(sys.argv[1])}
out = {}
for name, (factory, configs, checks) in cases.items():
    chosen = [c for c in factory.configs if c.name in configs]
    results = conform(factory, configs=chosen, checks=checks, settings=SMALL)
    out[name] = [all(r.passed for r in results), " | ".join(r.failure or "" for r in results),
                 min(r.outcomes[checks[0]].steps for r in results)]
from tests.engines.adapter_checks import evicts_under_pressure
pressed = next(c for c in sglang_default.factory.configs if c.name == "token-f32-pool24-reclaim-prefixkv")
out["evicted under pressure"] = evicts_under_pressure(sglang_default.factory, pressed, "evicted_tokens")
out["stand-ins used"] = STAND_IN_USES
print(json.dumps(out))
"""
CASES = [["factory", ["token-f32-heap-prefixkv", "block16-f32-heap-prefixkv"],
          ["lockstep", "fork isolation", "pinned semantics", "prefix edges"]],
         ["reclaiming", ["token-f32-pool24-reclaim-prefixkv", "block16-f32-pool12-reclaim-prefixkv"],
          ["lockstep", "seeded", "pinned semantics"]],
         ["leaked_lock", ["token-f32-heap-prefixkv"], ["lockstep"]],
         ["writes_into_tree", ["token-f32-heap-prefixkv"], ["lockstep"]],
         ["leaked_private_pages", ["token-f32-heap-prefixkv"], ["lockstep"]],
         ["no_prev_prefix", ["token-f32-heap-prefixkv"], ["lockstep"]],
         ["frees_duplicates_twice", ["token-f32-heap-prefixkv"], ["lockstep"]],
         ["refuses_early", ["token-f32-pool24-reclaim-prefixkv"], ["lockstep", "seeded"]],
         ["match_without_lock", ["token-f32-pool24-reclaim-prefixkv"], ["pinned semantics"]],
         ["retain_keeps_own_slots", ["token-f32-pool24-reclaim-prefixkv"], ["seeded"]]]


@pytest.fixture(scope="module")
def verdicts():
    run = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(CASES)], capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["factory", "reclaiming"])
def test_sglangs_default_tree_passes_and_touches_no_stand_in(verdicts, case):
    passed, failure, steps = verdicts[case]
    assert passed, failure
    assert steps > 50
    assert verdicts["stand-ins used"] == []


def test_under_pressure_the_default_tree_evicts_its_own_way(verdicts):
    """Two keys cached, then a context of 12 in a pool of 24: SGLang's ``evict`` makes the room
    (``adapter_checks.evicts_under_pressure``: a shorter hit accepted, in lockstep)."""
    assert verdicts["evicted under pressure"] > 0


@pytest.mark.parametrize("planted,why", [("leaked_lock", "invariant 6"), ("writes_into_tree", "invariant 5"),
                                         ("leaked_private_pages", "invariant 6"), ("no_prev_prefix", "invariant 6"),
                                         ("frees_duplicates_twice", "invariant 6"),
                                         ("refuses_early", "had room"),
                                         ("match_without_lock", "reference CapacityError"),
                                         ("retain_keeps_own_slots", "invariant 4")])
def test_planted_adapter_bug_is_rejected_with_the_broken_promise_named(verdicts, planted, why):
    passed, failure, _steps = verdicts[planted]
    assert not passed
    assert why in failure
