"""``kvstate bench agent_traffic`` against SGLang's released RadixCache: it runs and prints every
row with its command, and the hit rates agree where the semantics do (no timing is asserted)."""

import pytest

from kvstate.bench import agent_traffic, versus_sglang
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
            assert (kind, page, "SGLang RadixCache", "Python list") in seen
            assert (kind, page, "SGLang RadixCache", "array('q') + turn") in seen
            for given in ("int64 array", "Python list", versus_sglang.TOKEN_IDS):
                assert (kind, page, "kvstate token", given) in seen
                assert page == 1 or (kind, page, "kvstate block", given) in seen
            assert f"python -m kvstate.bench.versus_sglang --workload {kind} --page {page} --quick" in text
    assert all(row["lookup_speedup"] > 0 and row["insert_speedup"] > 0 for row in result["rows"])
    # every row against SGLang's scheduler with pre-built keys; where handed a list, beside SGLang handed the same
    sglang = {(r["workload"], r["page"], r["input"]): r for r in result["rows"] if r["engine"] == "SGLang RadixCache"}
    for row in result["rows"]:
        peer = sglang[row["workload"], row["page"], "array('q')"]
        assert row["lookup_speedup"] == pytest.approx(peer["lookup_us"] / row["lookup_us"], rel=1e-9)
        assert row["insert_speedup"] == pytest.approx(peer["insert_us"] / row["insert_us"], rel=1e-9)
        handed = {"Python list": "Python list", versus_sglang.TOKEN_IDS: "array('q') + turn"}.get(row["input"])
        if row["engine"].startswith("kvstate") and handed:
            same = sglang[row["workload"], row["page"], handed]
            assert row["request_path_speedup"] == pytest.approx(same["lookup_us"] / row["lookup_us"], rel=1e-9)
        else:
            assert "request_path_speedup" not in row
    handed = {name: value for name, value in result["targets"].items() if "hit = its array('q') row's" in name}
    assert len(handed) == 2 * 3 * 2 and all(value is True for value in handed.values())     # the same tree work
    # token at page 1, block at 16 and 64: each workload, each input
    hits = {name: value for name, value in result["targets"].items() if "hit = SGLang's" in name}
    assert len(hits) == 2 * 3 * 3 and all(value is True for value in hits.values())


def test_agent_traffic_falls_back_to_the_labelled_yardstick():
    result = agent_traffic.run(quick=True, peer="yardstick")
    assert "in-house yardstick" in result["params"]["peer"] and "not SGLang's code" in result["params"]["peer"]
    assert {row["engine"] for row in result["rows"]} >= {"yardstick", "kvstate"}


def test_every_missed_cell_gets_its_floor_and_a_design_beside_it():
    """``verdict`` on made-up rows (no timing): a missed lookup or insert names the floor measured
    for its input, says whether the target sits below it, and names a design; a met cell gets none."""
    from kvstate.bench import versus_sglang

    def row(engine, given, lookup, insert, floor_us=None, floor_x=None):
        return {"workload": "divergent", "page": 1, "engine": engine, "input": given, "matched": 10,
                "lookup_us": 10.0, "insert_us": 10.0, "lookup_speedup": lookup, "insert_speedup": insert,
                "lookup_floor_us": floor_us, "lookup_floor_speedup": floor_x}

    rows = [row("SGLang RadixCache", "array('q')", 1, 1),
            row("kvstate token", "int64 array", 2.0, 0.5, floor_us=1.0, floor_x=10.0),
            row("kvstate token", "Python list", 0.3, 2.0, floor_us=40.0, floor_x=0.25)]
    notes = {name: value for name, value in versus_sglang.verdict(rows, timed=True).items() if "MISSED" in name}
    assert set(notes) == {"divergent @1 kvstate token, int64 array: insert 0.50 MISSED",
                          "divergent @1 kvstate token, Python list: lookup 0.30 MISSED"}
    lookup = notes["divergent @1 kvstate token, Python list: lookup 0.30 MISSED"]
    assert lookup.startswith("floor 0.25x (validating the list") and "BELOW" in lookup and "validated once" in lookup
    assert "0.20x with this run's int64-array lookup past its cast on top" in lookup      # 10 us / (40 + 10 - 1)
    # validation alone above the target: the verdict is the floor's, whatever today's array lookup adds
    # on top (context: 10 / (5 + 2 - 1) = 1.67; the list's pass replaces the array's cast, not added to it)
    rows[2].update(lookup_floor_us=5.0, lookup_floor_speedup=2.0)
    rows[1]["lookup_us"] = 2.0
    lookup = versus_sglang.verdict(rows, timed=True)["divergent @1 kvstate token, Python list: lookup 0.30 MISSED"]
    assert lookup.startswith("floor 2.00x") and "1.67x with this run" in lookup and "above" in lookup
    insert = notes["divergent @1 kvstate token, int64 array: insert 0.50 MISSED"]
    assert insert.startswith("floor 10.00x (one pass over the key") and "above" in insert and "slabs" in insert
    # TokenIds + turn: its floor is checking the ids a request adds, with the array lookup on top
    # less the array's own pass over the query (TokenIds come packed): 10 / (10 + 2 - 1) = 0.91
    rows.append(row("kvstate token", versus_sglang.TOKEN_IDS, 0.8, 2.0, floor_us=10.0, floor_x=1.0))
    ids = versus_sglang.verdict(rows, timed=True)[f"divergent @1 kvstate token, {versus_sglang.TOKEN_IDS}: lookup 0.80 MISSED"]
    assert ids.startswith("floor 1.00x (validating the ids the request adds") and "0.91x with this run" in ids
    assert "BELOW" in ids and "most of every request is new" in ids


def test_rows_handed_a_list_are_judged_against_sglang_with_pre_built_keys():
    """SGLang converts a request's list in its tokenizer process, not in the scheduler that runs its
    tree: a kvstate list or ``TokenIds`` row's target and floor are judged against the scheduler's
    lookup of pre-built keys, never against SGLang's row handed the same list (that is context)."""
    from kvstate.bench import versus_sglang

    def row(engine, given, lookup_us, lookup=1.0, floor_us=None, floor_x=None):
        return {"workload": "divergent", "page": 1, "engine": engine, "input": given, "matched": 10,
                "lookup_us": lookup_us, "insert_us": 10.0, "lookup_speedup": lookup, "insert_speedup": 2.0,
                "lookup_floor_us": floor_us, "lookup_floor_speedup": floor_x}

    rows = [row("SGLang RadixCache", "Python list", 20.0), row("SGLang RadixCache", "array('q')", 10.0),
            row("SGLang RadixCache", "array('q') + turn", 30.0),
            row("kvstate token", "int64 array", 10.0, lookup=2.0, floor_us=1.0, floor_x=10.0),
            row("kvstate token", "Python list", 40.0, lookup=0.25, floor_us=15.0, floor_x=10.0 / 15.0),
            row("kvstate token", versus_sglang.TOKEN_IDS, 25.0, lookup=0.4, floor_us=10.0, floor_x=1.0)]
    out = versus_sglang.verdict(rows, timed=True)
    note = out["divergent @1 kvstate token, Python list: lookup 0.25 MISSED"]
    assert "0.42x with this run's int64-array lookup past its cast" in note     # 10 us / (15 + 10 - 1), not 20 us / ...
    note = out[f"divergent @1 kvstate token, {versus_sglang.TOKEN_IDS}: lookup 0.40 MISSED"]
    assert "0.53x with this run's int64-array lookup past its cast" in note     # 10 / (10 + 10 - 1), not 30 / ...
    assert out["divergent @1 SGLang RadixCache, Python list: hit = its array('q') row's"] is True
    # a TokenIds miss above its floor names the growth's own work, not the array row's design
    rows[3]["lookup_us"], rows[5]["lookup_floor_us"] = 2.0, 3.0          # 10 / (3 + 2 - 1) = 2.5
    rows[5]["lookup_floor_speedup"] = 10.0 / 3.0
    note = versus_sglang.verdict(rows, timed=True)[f"divergent @1 kvstate token, {versus_sglang.TOKEN_IDS}: lookup 0.40 MISSED"]
    assert "2.50x with this run's int64-array lookup past its cast" in note and "above" in note
    assert "TokenIds.__add__" in note and "one C pass packs a list" not in note
    rows[0]["matched"] = 9
    assert versus_sglang.verdict(rows, timed=True)[
        "divergent @1 SGLang RadixCache, Python list: hit = its array('q') row's"] is False


def test_block_rows_are_judged_like_token_rows():
    """``block`` is SGLang's own semantics past page 1: its rows meet the target or miss beside a floor."""
    from kvstate.bench import versus_sglang

    def row(engine, given, lookup, matched=10):
        return {"workload": "shared", "page": 16, "engine": engine, "input": given, "matched": matched,
                "lookup_us": 10.0, "insert_us": 10.0, "lookup_speedup": lookup, "insert_speedup": 3.0,
                "lookup_floor_us": 1.0, "lookup_floor_speedup": 10.0}

    rows = [row("SGLang RadixCache", "array('q')", 1), row("kvstate block", "int64 array", 1.2),
            row("kvstate token", "int64 array", 2.0, matched=12)]
    out = versus_sglang.verdict(rows, timed=True)
    assert out["shared @16 kvstate block, int64 array: min(lookup, insert speedup) >= 1.5"] == "1.20 MISSED"
    assert "floor 10.00x" in out["shared @16 kvstate block, int64 array: lookup 1.20 MISSED"]
    assert out["shared @16 kvstate token, int64 array: min(lookup, insert speedup) >= 1.5"] == "2.00 met"
    assert out["shared @16 kvstate block, int64 array: hit = SGLang's"] is True


def test_token_ids_rows_grow_each_conversation_from_its_last_request_only():
    """What ``TokenIds + turn`` takes as already checked: the request's conversation's previous one
    (shared) or the system prompt alone (divergent, where nothing else repeats); never more."""
    from kvstate.bench.traffic_workload import QUICK, workload

    for kind, extended in (("shared", QUICK["conversations"] * (QUICK["turns"] - 1)), ("divergent", 0)):
        requests = workload(kind, **QUICK)
        bases = versus_sglang.conversation_bases(requests, QUICK["system_tokens"])
        assert sum(b >= 0 for b in bases) == extended
        def extends(i, j):
            return len(requests[j]) < len(requests[i]) and (requests[i][:len(requests[j])] == requests[j]).all()
        for i, b in enumerate(bases):
            held = requests[b] if b >= 0 else requests[i][:QUICK["system_tokens"]]
            assert b < i and len(held) < len(requests[i]) and (requests[i][:len(held)] == held).all()
            assert not any(extends(i, j) for j in range(b + 1, i))      # the latest it extends, none later


@pytest.mark.skipif(installed_version() != SUPPORTED_VERSION,
                    reason=f"sglang {SUPPORTED_VERSION} is not installed (pip install --no-deps sglang=={SUPPORTED_VERSION})")
def test_cold_lookup_times_each_contender_on_the_same_requests():
    """``bench/cold_lookup.py``: five replays of one workload; the untimed work between lookups changes no hit."""
    from kvstate.bench import cold_lookup
    from kvstate.bench.traffic_workload import QUICK, workload

    requests = workload("divergent", **QUICK)
    for page in (1, 4):
        rows = cold_lookup.measure(requests, page, rounds=1)
        assert list(rows) == [cold_lookup.KV_COLD, cold_lookup.KV_WARM, cold_lookup.SGL_BACK, cold_lookup.SGL_WRITE,
                              cold_lookup.SGL_AFTER_OURS]
        ours = {rows[name][1] for name in (cold_lookup.KV_COLD, cold_lookup.KV_WARM)}
        theirs = {rows[name][1] for name in (cold_lookup.SGL_BACK, cold_lookup.SGL_WRITE, cold_lookup.SGL_AFTER_OURS)}
        assert len(ours) == len(theirs) == 1 and min(ours) > 0
        assert page > 1 or ours == theirs       # above page 1 SGLang matches whole pages only
        assert all(us > 0 for us, _ in rows.values())
