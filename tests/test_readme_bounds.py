"""README states the deadlines, bounds and trust rules the code enforces (issue 24's last item),
with the code's own numbers: a constant changed without the README fails here."""

from __future__ import annotations

from pathlib import Path

from kvstate.impl import remote_deadline
from kvstate.stateful import replay, replay_bounds
from kvstate.stateful.sweeps import journal

README = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")


def section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return " ".join(README[start:end].split())      # one line: a phrase may wrap anywhere


def test_the_storage_section_states_every_deadline_and_its_order():
    text = section("Snapshots in object storage")
    assert f"{remote_deadline.DEFAULT_DEADLINE_S:g} s by default" in text
    order = ["per call (`cache.restore(url, deadline_s=", "then per cache (`Cache(layout, remote_deadline_s=",
             "then per store (`SnapshotStore(url, deadline_s=", "then for everything in a block"]
    assert all(phrase in text for phrase in order)
    assert [text.index(phrase) for phrase in order] == sorted(text.index(phrase) for phrase in order)
    assert "refused before use" in text         # URLs carrying credentials


def test_the_sweep_section_states_the_bounds_and_the_trust_rules():
    text = section("Nightly sweeps and replay")
    assert f"{replay.MAX_REPLAY_BYTES >> 20} MiB of file (`MAX_REPLAY_BYTES`)" in text
    assert f"{replay_bounds.MAX_REPLAY_OPS:,} operations (`MAX_REPLAY_OPS`)" in text
    assert f"{replay_bounds.MAX_REPLAY_MEMORY_BYTES >> 30} GiB of K/V values" in text
    assert f"{journal.MAX_BYTES >> 20} MiB or {journal.MAX_LINES:,} lines" in text
    assert "Nothing imports code that a journal, replay file or report names without one of those two flags" in text
    assert "`--run-timeout`" in text and "`--time-limit` (default 60)" in text
