"""``kvstate bench agent_traffic`` against SGLang's released RadixCache: it runs and prints every
row with its command, and the hit rates agree where the semantics do (no timing is asserted)."""

import pytest

from kvstate.bench import agent_traffic
from kvstate.bench.run import format_result
from kvstate.engines.sglang_loader import SUPPORTED_VERSION, installed_version


@pytest.mark.skipif(installed_version() != SUPPORTED_VERSION,
                    reason=f"sglang {SUPPORTED_VERSION} is not installed (pip install --no-deps sglang=={SUPPORTED_VERSION})")
def test_agent_traffic_runs_against_sglang_and_prints_each_row_with_its_command():
    result = agent_traffic.run(quick=True)
    assert result["params"]["peer"].startswith("SGLang 0.5.23 RadixCache")
    text = format_result(result)
    seen = {(row["workload"], row["page"], row["engine"], row["input"]) for row in result["rows"]}
    for kind in agent_traffic.WORKLOADS:
        for page in agent_traffic.PAGE_SIZES:
            assert (kind, page, "SGLang RadixCache", "array('q')") in seen
            for given in ("int64 array", "Python list"):
                assert (kind, page, "kvstate token", given) in seen
                assert page == 1 or (kind, page, "kvstate block", given) in seen
            assert f"python -m kvstate.bench.versus_sglang --workload {kind} --page {page} --quick" in text
    assert all(row["lookup_speedup"] > 0 and row["insert_speedup"] > 0 for row in result["rows"])
    # token at page 1, block at 16 and 64: each workload, each input
    hits = {name: value for name, value in result["targets"].items() if "hit = SGLang's" in name}
    assert len(hits) == 2 * 3 * 2 and all(value is True for value in hits.values())


def test_agent_traffic_falls_back_to_the_labelled_yardstick():
    result = agent_traffic.run(quick=True, peer="yardstick")
    assert "in-house yardstick" in result["params"]["peer"] and "not SGLang's code" in result["params"]["peer"]
    assert {row["engine"] for row in result["rows"]} >= {"yardstick", "kvstate"}
