"""The benchmarks and the demo run, and their counts (never their timings) say what the engine promises."""

import numpy as np
import pytest

from kvstate.bench import agent_traffic, fork_copy, read_pages
from kvstate.bench.yardstick import TokenRadixTree
from kvstate.spec import Layout
from kvstate.demo import Demo


def _rows(result, workload, engine="kvstate", match=None):
    return {row["page"]: row for row in result["rows"]
            if row["workload"] == workload and row["engine"] == engine and match in (None, row["match"])}


def test_token_semantics_matches_as_many_tokens_as_the_token_radix_tree():
    result = agent_traffic.run(quick=True, peer="yardstick")    # the fallback where SGLang is absent
    assert "in-house yardstick" in result["params"]["peer"]
    for workload in agent_traffic.WORKLOADS:
        (yard,) = _rows(result, workload, "yardstick").values()
        (strong,) = _rows(result, workload, "yardstick-slice").values()
        token = _rows(result, workload, match="token")
        entry = _rows(result, workload, match="entry")
        block = _rows(result, workload, match="block")
        assert sorted(token) == list(agent_traffic.PAGE_SIZES)
        for page in agent_traffic.PAGE_SIZES:
            assert token[page]["matched"] == yard["matched"] == strong["matched"] > 0
            assert token[page]["hit_rate"] == yard["hit_rate"]
            # nobody retains the system prompt alone: a conversation's first turn misses by entry
            assert entry[page]["matched"] < token[page]["matched"]
            assert block[page]["matched"] < token[page]["matched"]
        # at one-token pages nothing is held twice: as many pages as the radix tree holds tokens
        assert token[1]["live_bytes"] == yard["live_bytes"]
        assert entry[1]["live_bytes"] > yard["live_bytes"]
    assert all(value is True for key, value in result["targets"].items() if "hit" in key)


def test_shared_workload_extends_each_conversation_and_diverging_rewrites_after_turn_one():
    size = dict(conversations=3, turns=4, system_tokens=100, turn_tokens=(5, 9))
    shared = agent_traffic.workload("shared", **size)
    diverging = agent_traffic.workload("diverging", **size)
    assert len(shared) == len(diverging) == 12
    assert [len(r) for r in shared] == [len(r) for r in diverging]
    assert all((r[:100] == shared[0][:100]).all() for r in shared + diverging)

    def earlier_prefixes(requests):
        """For each request, the indices of earlier requests that are a proper prefix of it."""
        return [[j for j in range(i) if len(requests[j]) < len(r) and (r[:len(requests[j])] == requests[j]).all()]
                for i, r in enumerate(requests)]

    for requests in (shared, diverging):
        prefixes = earlier_prefixes(requests)
        first_turns = {i for i, found in enumerate(prefixes) if not found}
        assert len(first_turns) == 3                   # every later turn extends its conversation's turn one
        later = {j for found in prefixes for j in found} - first_turns
        # shared: later turns extend later turns too; diverging: only turn one is ever a prefix
        assert bool(later) is (requests is shared)


def test_yardstick_evicts_least_recently_used_leaves():
    tree = TokenRadixTree()
    tree.insert([1, 2, 3], np.arange(3))
    tree.insert([1, 2, 4, 5], np.array([0, 1, 7, 8]))
    tree.match([1, 2, 3])                       # [1, 2, 4, 5]'s leaf is now the least recent
    assert tree.tokens_held == 5
    assert tree.evict(1) == 2 and tree.tokens_held == 3
    slots, _ = tree.match([1, 2, 4, 5])
    assert slots.tolist() == [0, 1]


def test_fork_allocates_and_copies_nothing():
    fork, copy, *deferred = fork_copy.run()["rows"]
    assert all((row["pages_allocated"], row["bytes_copied"]) == (0, 0) for row in [fork, *deferred])
    assert copy["bytes_copied"] == fork_copy.WAYS * 32 * 16 * 12 * 2 * 12 * 64 * 4


def test_demo_shows_exact_backtracking_and_prefix_hits():
    lines = []
    Demo(out=lines.append).run()
    text = "\n".join(lines)
    assert "bit-identical next-token logits: True" in text
    assert "match found 500 of 540 tokens" in text
    assert "next-token logits identical: True" in text      # the snapshot/restore section ran
    assert "restored 600 positions" in text and "tokens not re-prefilled 600" in text      # read before the close


def test_one_token_pages_serves_another_checkout_beside_this_one(tmp_path):
    """``--against`` measures a second checkout in its own process: here the same one, so both
    rows must name it and the ratios are of two real runs (never a copied figure)."""
    from pathlib import Path

    from kvstate.bench import one_token_pages

    checkout = Path(one_token_pages.__file__).resolve().parents[1]
    result = one_token_pages.run(against=checkout, rounds=1, conversations=6)
    here, there = result["rows"]
    assert here["checkout"] == there["checkout"] == str(checkout)
    assert result["params"]["requests"] == 24
    assert all(row["match_us"] > 0 and row["retain_us"] > 0 and row["extend_us"] > 0 for row in result["rows"])
    assert result["ratio"]["match_speedup"] == there["match_us"] / here["match_us"]
    assert result["ratio"]["extend_speedup"] == there["extend_us"] / here["extend_us"]
    commit = there["commit"]        # this checkout's, not 9766fa8: labelled with it, and no issue-15 verdict
    assert here["commit"] == commit and not commit.startswith(one_token_pages.ISSUE_15_COMMIT)
    assert set(result["targets"]) == {f"{op}_speedup against {commit} ({checkout})" for op in ("match", "retain")}
    assert all("no verdict" in value for value in result["targets"].values())
    assert result["command"] == (f"python -m kvstate.bench.one_token_pages --against {checkout} --rounds 1 "
                                 "--conversations 6")
    assert here["pages_freed_per_request"] == there["pages_freed_per_request"] == 0     # the tree keeps every request


def test_one_token_pages_with_a_bounded_tree_frees_evicted_pages_in_the_retains():
    from kvstate.bench import one_token_pages

    result = one_token_pages.run(rounds=1, conversations=6, max_entries=3)
    (row,) = result["rows"]
    assert row["pages_freed_per_request"] > 0        # evictions free pages (the unbounded tree above frees none)
    assert result["command"] == ("python -m kvstate.bench.one_token_pages --rounds 1 --conversations 6 "
                                 "--max-entries 3") and "targets" not in result


def test_reproducing_commands_carry_the_rounds_that_are_not_the_default():
    from kvstate.bench.versus_sglang import rounds_option

    assert rounds_option(None, False) == rounds_option(2, False) == rounds_option(1, True) == ""
    assert rounds_option(3, False) == " --rounds 3" and rounds_option(2, True) == " --rounds 2"


def test_tree_scale_runs_by_path_outside_the_package(capsys):
    """Its docstring's ``python PATH/tree_scale.py`` (a before/after from another checkout's root)
    runs the file with no package around it, so it cannot need a relative import."""
    import runpy

    from kvstate.bench import tree_scale

    by_path = runpy.run_path(tree_scale.__file__, run_name="tree_scale_by_path")
    with pytest.raises(SystemExit) as stopped:
        by_path["main"](["--help"])
    assert stopped.value.code == 0 and "--sizes" in capsys.readouterr().out


def test_token_input_takes_its_options_and_refuses_a_bad_one(capsys):
    from kvstate.bench import token_input

    with pytest.raises(SystemExit) as stopped:
        token_input.main(["--rounds", "0"])
    assert stopped.value.code == 2 and "0 is not at least 1" in capsys.readouterr().err
    assert token_input.main(["--quick", "--rounds", "1", "--page", "16"]) == 0
    assert "reproduce: python -m kvstate.bench.token_input --quick --page 16 --rounds 1" in capsys.readouterr().out


def test_token_input_matches_lists_and_arrays_and_prints_the_conversion_floor():
    from kvstate.bench import token_input

    result = token_input.run(quick=True)
    rows = {row["input"]: row["us_per_match"] for row in result["rows"]}
    assert set(rows) == {"int64 array", "Python list", "np.fromiter of the list alone"}
    array, conversion = rows["int64 array"], rows["np.fromiter of the list alone"]
    assert result["ratio"]["floor_of_list_over_array"] == pytest.approx((array + conversion) / array)
    assert result["command"] == "python -m kvstate.bench.token_input --quick"


def test_extend_bench_times_the_floor_and_another_checkout_beside_extend():
    from pathlib import Path

    from kvstate.bench import extend

    checkout = Path(extend.__file__).resolve().parents[1]
    result = extend.run(lengths=[64, 100], rounds=1, against=checkout)
    assert [row["tokens"] for row in result["rows"]] == [64, 100]
    for row in result["rows"]:
        assert row["extend_ms"] > 0 and row["floor_ms"] > 0 and row["against_ms"] > 0
        assert row["extend_over_floor"] == pytest.approx(row["extend_ms"] / row["floor_ms"])
        assert row["speedup"] == pytest.approx(row["against_ms"] / row["extend_ms"])
    assert result["command"] == f"python -m kvstate.bench.extend --tokens 64 100 --rounds 1 --against {checkout}"


def test_read_pages_times_every_store_precision_and_page_size_here_and_in_a_checkout():
    from pathlib import Path

    checkout = Path(read_pages.__file__).resolve().parents[1]
    rows = read_pages.run(tokens=40, rounds=1, against=checkout)
    cases = {(row["store"], row["precision"], row["page_tokens"]) for row in rows}
    assert cases == {(store, precision, page) for store in read_pages.stores()
                     for precision in ("f32", "f16", "q8") for page in read_pages.PAGE_SIZES}
    assert all(row["read_ms"] > 0 and row["against_ms"] > 0 and row["tokens"] == 40 for row in rows)


def test_prefill_times_the_model_beside_transformers_here_and_in_a_checkout():
    pytest.importorskip("transformers")
    from pathlib import Path

    from kvstate.bench import prefill

    checkout = Path(prefill.__file__).resolve().parents[1]
    rows = prefill.run([5, 9], threads=1, rounds=1, against=checkout, tiny=True)
    assert [row["tokens"] for row in rows] == [5, 9]
    for row in rows:
        assert row["prefill_s"] > 0 and row["hf_s"] > 0 and row["against_s"] > 0 and row["threads"] == 1
        # this checkout in a child of its own too, so the A/B compares models that ran alike
        assert row["here_s"] > 0 and row["against_over_here"] > 0
        # the attention inside each: transformers' GPT-2 runs torch's fused attention by default
        assert 0 < row["attention_s"] < row["prefill_s"] and 0 < row["hf_attention_s"] < row["hf_s"]
        # the floor beside them, part by part (bench/prefill_floor.py)
        assert row["floor_s"] == pytest.approx(sum(row["floor_parts_s"].values()), abs=1e-3)
        assert row["floor_over_hf"] > 0 and all(s > 0 for s in row["floor_parts_s"].values())


@pytest.mark.parametrize("argv", [
    ["kvstate.bench.prefill", "--rounds", "0"], ["kvstate.bench.one_token_pages", "--conversations", "0"],
    ["kvstate.bench.restore", "--repeat", "-1"], ["kvstate.bench.restore", "--tokens", "0"],
    ["kvstate.bench.extend", "--rounds", "0"], ["kvstate.bench.read_pages", "--tokens", "x"],
    ["kvstate.bench.tree_scale", "--rounds", "0"], ["kvstate.bench.versus_sglang", "--rounds", "-2"],
    ["kvstate.bench.page_churn", "--rounds", "0"], ["kvstate.bench.bounded_vs_sglang", "--budget", "0"],
    ["kvstate.bench.one_token_pages", "--max-entries", "0"],
], ids=lambda argv: " ".join(argv[1:]) + " " + argv[0].rsplit(".", 1)[1])
def test_a_count_that_is_not_a_count_is_refused_by_argparse(argv, capsys):
    """Before, --rounds 0 printed inf and nan, or a KeyError far from the argument."""
    import importlib
    module = importlib.import_module(argv[0])
    with pytest.raises(SystemExit) as stopped:
        module.main(argv[1:])
    assert stopped.value.code == 2 and "not" in capsys.readouterr().err


def test_bounded_trees_evict_on_both_sides_and_keep_the_same_hits():
    from kvstate.bench import bounded_vs_sglang
    from kvstate.bench.versus_sglang import sglang_missing

    if sglang_missing():
        pytest.skip(f"SGLang's RadixCache cannot be loaded: {sglang_missing()}")

    result = bounded_vs_sglang.run(quick=True)
    sglang, kvstate, floor = result["rows"]
    assert [row["engine"] for row in result["rows"]] == [bounded_vs_sglang.SGLANG, bounded_vs_sglang.KVSTATE,
                                                         bounded_vs_sglang.FLOOR]
    assert sglang["freed_per_request"] > 0 and kvstate["freed_per_request"] > 0     # both really evicted
    assert kvstate["held_at_end"] > 0 and sglang["held_at_end"] > 0
    # the two trees sized to hold as many requests (kvstate's max_pages counts the prompt in each entry)
    assert abs(kvstate["requests_held_mean"] - sglang["requests_held_mean"]) <= 0.1 * sglang["requests_held_mean"]
    assert result["params"]["kvstate_max_pages"] > result["params"]["budget_tokens"]
    assert floor["held_at_end"] is None and floor["freed_per_request"] == kvstate["freed_per_request"]
    assert all(result["targets"].values()), result["targets"]
    unbounded = bounded_vs_sglang.run(quick=True, budget=10**9)                    # the control: nothing evicted
    assert [row["freed_per_request"] for row in unbounded["rows"]] == [0, 0, 0]
    assert unbounded["rows"][1]["matched"] >= kvstate["matched"]


def test_the_bounded_command_names_a_budget_that_is_not_its_modes_default():
    """``--quick --budget 71000`` (the full run's budget) must print ``--budget 71000``: without it
    the command reruns at the quick budget, 400."""
    from kvstate.bench import bounded_vs_sglang
    from kvstate.bench.versus_sglang import sglang_missing

    if sglang_missing():
        pytest.skip(f"SGLang's RadixCache cannot be loaded: {sglang_missing()}")

    command = bounded_vs_sglang.run(quick=True, budget=bounded_vs_sglang.BUDGET)["command"]
    assert command == f"{bounded_vs_sglang.COMMAND} --quick --budget {bounded_vs_sglang.BUDGET}"


def test_the_floor_row_frees_nothing_and_keeps_every_page_it_was_handed():
    from kvstate.bench.bounded_vs_sglang import skip_frees
    from kvstate.impl import Cache

    layout = Layout(layers=1, kv_heads=1, head_dim=2)
    cache = Cache(layout, page_tokens=1, max_pages=3)
    kept = skip_frees(cache.pool)
    for first in (0, 10):       # the second entry pushes the first out of the 3-page budget
        ctx = cache.allocate()
        ctx.extend(np.arange(first, first + 3), np.zeros(layout.batch_shape(3), np.float32))
        cache.retain(ctx)
        ctx.close()
    assert cache.pool.freed == 3 and [len(pages) for pages in kept] == [3]
    assert cache.pool.live_count == 6 - 3 and len(cache.pool.live) == 6     # counted freed, never let go


def test_the_bounded_verdict_names_what_a_missed_insert_pays_per_page():
    from kvstate.bench.bounded_vs_sglang import SLABS, speed_verdict

    peer = {"insert_us_per_freed": 0.27}
    floor = {"insert_speedup": 1.08}
    missed = speed_verdict(peer, {"lookup_speedup": 1.7, "insert_speedup": 0.2, "insert_us_per_freed": 1.26}, floor)
    assert missed.startswith("0.20 MISSED: ") and "1.26 µs a page freed against SGLang's 0.27" in missed
    assert "skipped (kvstate, frees skipped (floor)) inserts run at 1.08x" in missed and missed.endswith(SLABS)
    lookups_short = {"lookup_speedup": 1.4, "insert_speedup": 1.9, "insert_us_per_freed": 0.1}
    assert speed_verdict(peer, lookups_short, floor) == "1.40 MISSED"
    assert speed_verdict(peer, {"lookup_speedup": 1.6, "insert_speedup": 1.5, "insert_us_per_freed": 0.1}, floor) == "1.50 met"


@pytest.mark.parametrize("argv, message", [
    (["bench", "--out", "/proc/no-such-folder", "fork_copy"], "cannot write results to '/proc/no-such-folder'"),
    (["kvstate.bench.extend", "--against", "/no/such/checkout"], "is no kvstate checkout"),
    (["kvstate.bench.tree_scale", "--sizes", "0"], "0 is not at least 1"),
    (["kvstate.bench.tree_scale", "--sizes", "10,abc"], "'abc' is not a whole number"),
], ids=["out", "against", "sizes-0", "sizes-abc"])
def test_bad_bench_arguments_are_one_line_and_exit_2_before_anything_runs(argv, message):
    """They ran the benchmark, then ended in a traceback (--out), or ended in one (--against, --sizes)."""
    import subprocess
    import sys
    command = [sys.executable, "-m", "kvstate", *argv] if argv[0] == "bench" else [sys.executable, "-m", *argv]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr, run.stderr
    assert not run.stdout.strip()


# From a review (finding 3): with OUT/results.json a folder, the whole run went by, then ended in an
# IsADirectoryError traceback (exit 1) and its results were lost.
def _bench_args(out, *names):
    import argparse

    from kvstate.bench.cli import add_arguments
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([*names, "--quick", "--threads", "1", f"--out={out}"])


def test_bench_refuses_a_folder_where_results_json_goes_before_it_runs(tmp_path):
    import subprocess
    import sys
    (tmp_path / "results.json").mkdir()
    run = subprocess.run([sys.executable, "-m", "kvstate", "bench", "fork_copy", "--quick", "--threads", "1",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.strip().count("\n") == 0, run.stderr
    assert f"cannot write results to '{tmp_path / 'results.json'}': it is a folder" in run.stderr, run.stderr
    assert not run.stdout.strip()           # refused before the benchmark ran


def test_bench_refuses_a_folder_where_a_plot_goes_before_it_runs(tmp_path, monkeypatch, capsys):
    from kvstate.bench import cli, plots

    monkeypatch.setattr(plots.importlib.util, "find_spec", lambda name: object())    # as if matplotlib were here
    monkeypatch.setattr(cli, "pin_threads", lambda args: pytest.fail("the run went on"))
    (tmp_path / "fork_vs_copy.png").mkdir()
    assert cli.run(_bench_args(tmp_path, "fork_copy")) == 2
    assert "fork_vs_copy.png': it is a folder" in capsys.readouterr().err


def test_every_plot_the_bench_draws_is_checked_before_the_run():
    from kvstate.bench import plots
    from kvstate.bench.run import BENCHMARKS

    assert set(plots.PLOT_OF) <= set(BENCHMARKS) and set(plots.PLOT_OF.values()) == set(plots._DRAWERS)


def test_a_results_json_that_cannot_be_written_at_the_end_keeps_the_results(tmp_path, monkeypatch, capsys):
    """A folder made in its place during the run: one line, exit 2, and the results kept beside it."""
    import json

    from kvstate.bench import cli, run

    def run_all(names, **kwargs):
        (tmp_path / "results.json").mkdir()
        return [{"name": "fake", "rows": [{"x": 1}]}]

    monkeypatch.setattr(cli, "pin_threads", lambda args: None)
    monkeypatch.setattr(run, "run_all", run_all)
    assert cli.run(_bench_args(tmp_path, "tree_scale")) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"kvstate bench: cannot write results to '{tmp_path / 'results.json'}'"), line
    (kept,) = tmp_path.glob("results.json.*.tmp")
    assert str(kept) in line and json.loads(kept.read_text())["results"][0]["name"] == "fake"


@pytest.mark.parametrize("out", ["-dashdir", "--out", "a=b", "-"])
def test_the_thread_pinning_reexec_parses_back_to_the_same_run(monkeypatch, out):
    """From a review (finding 7): ``--out=-dashdir`` was passed on as ``--out -dashdir``, which the
    re-executed command refused ("expected one argument"), leaving the folder the first one made."""
    import argparse

    from kvstate.bench import cli

    for var in cli.THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    execs = []
    monkeypatch.setattr(cli.os, "execve", lambda path, argv, env: execs.append(argv))
    args = _bench_args(out, "fork_copy", "restore")
    args.full = True
    cli.pin_threads(args)
    (argv,) = execs
    assert argv[1:3] == ["-m", "kvstate.bench"]
    parser = argparse.ArgumentParser(exit_on_error=False)
    cli.add_arguments(parser)
    assert parser.parse_args(argv[3:]) == args
