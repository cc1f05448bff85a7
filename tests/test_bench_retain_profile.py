"""``bench/retain_profile.py``: RESULTS.md's shares of a bounded retain, function by function, as a command."""

from kvstate.bench import retain_profile


def test_the_shares_name_the_frees_and_the_floor_names_none(capsys):
    with_frees = {where.rsplit("(", 1)[-1] for _, _, _, where in retain_profile.shares(retain_profile.profile(True), 40)}
    assert "free_all)" in with_frees and "release_slots)" in with_frees
    floor = retain_profile.shares(retain_profile.profile(True, frees=False), 40)
    assert not any(where.endswith("(free_all)") for *_, where in floor)      # no page freed: the store never asked
    assert all(0 <= own <= cumulative <= 1.0 + 1e-9 for own, cumulative, _, _ in floor)
    assert abs(sum(own for own, *_ in retain_profile.shares(retain_profile.profile(True), 10_000)) - 1) < 1e-9
    retain_profile.main(["--quick", "--top", "3", "--skip-frees"])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 5 and lines[-1] == "reproduce: python -m kvstate.bench.retain_profile --skip-frees --top 3 --quick"
