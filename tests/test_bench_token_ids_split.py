"""``bench/token_ids_split.py``: the growth of ``TokenIds + turn`` timed apart from its ``match``, and the
growth again with the list's packing replaced by stand-ins doing less (RESULTS.md's split)."""

from kvstate.bench import token_ids_split
from kvstate.impl import query


def test_the_split_times_every_packer_and_puts_the_real_one_back(capsys):
    real = query._from_marshal
    token_ids_split.main(["--quick", "--rounds", "1", "--page", "4"])
    assert query._from_marshal is real
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0].strip() for line in lines[:4]] == list(token_ids_split.PACKERS)
    assert all(float(line.split("growth")[1].split("us")[0]) > 0 for line in lines[:4])
    assert lines[-1] == "reproduce: python -m kvstate.bench.token_ids_split --page 4 --rounds 1 --quick"


def test_the_stand_ins_pack_as_many_ids_as_they_are_given():
    items = [5, 6, 7]
    assert query._from_marshal(items) == token_ids_split._marshal_and_gather(items)
    assert len(token_ids_split._no_pass(items)) == len(token_ids_split._marshal_only(items)) == 12
