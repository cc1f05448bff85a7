"""The benchmarks and the demo run, and their counts (never their timings) say what the engine promises."""

from kvstate.bench import agent_traffic, fork_copy
from kvstate.demo import Demo


def test_agent_traffic_reuses_every_shared_prefix():
    row = agent_traffic.run(quick=True)["rows"][0]
    assert row["hit_rate"] == 1.0                 # the system prompt is retained up front
    assert row["token_reuse"] > 0.9
    assert row["tokens_not_reprefilled"] > 0


def test_workload_requests_extend_their_conversation():
    requests = agent_traffic.workload(conversations=3, turns=4)
    assert len(requests) == 12
    assert all(len(r) >= 1050 for r in requests)
    assert all((r[:1000] == requests[0][:1000]).all() for r in requests)


def test_fork_allocates_and_copies_nothing():
    fork, copy = fork_copy.run()["rows"]
    assert (fork["pages_allocated"], fork["bytes_copied"]) == (0, 0)
    assert copy["bytes_copied"] == fork_copy.WAYS * 32 * 16 * 12 * 2 * 12 * 64 * 4


def test_demo_shows_exact_backtracking_and_prefix_hits():
    lines = []
    Demo(out=lines.append).run()
    text = "\n".join(lines)
    assert "bit-identical next-token logits: True" in text
    assert "match found 500 of 540 tokens" in text
    assert "next-token logits identical: True" in text      # the snapshot/restore section ran
