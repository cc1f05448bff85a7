"""``bench/retain_designs.py``: RESULTS.md's bounded retain under designs short of slabs, as a command."""

from kvstate.bench import retain_designs


def test_every_design_is_timed_and_the_command_is_printed(capsys):
    retain_designs.main(["--quick", "--rounds", "1"])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0].strip() for line in lines[:-1]] == list(retain_designs.DESIGNS)
    assert all(float(line.split("retain")[1].split("us")[0]) > 0 for line in lines[:-1])
    assert lines[-1] == "reproduce: python -m kvstate.bench.retain_designs --rounds 1 --quick"


def test_letting_buffers_go_keeps_no_spare_where_the_cache_as_it_is_keeps_some():
    from kvstate.bench.bounded_vs_sglang import QUICK_BUDGET
    from kvstate.bench.one_token_pages import serve_requests
    from kvstate.bench.traffic_workload import QUICK, workload

    requests = workload("divergent", **QUICK)
    spares = {}
    for name in ("kept spares", "buffers let go"):
        cache = retain_designs.cache_for(name, requests, QUICK_BUDGET)
        serve_requests(cache, requests)
        spares[name] = len(cache.store._spares)
    assert spares["kept spares"] > 0 and spares["buffers let go"] == 0, spares
