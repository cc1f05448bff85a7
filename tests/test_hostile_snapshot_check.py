"""``damaged snapshots`` refuses files that are well formed on the outside (an audit's findings, 2026-12-06).

Its truncations and flipped bits are all caught by a checksum, so an engine that checked only the
checksum passed it while restoring a file with bytes past its body, a header naming another layout
of the same size, a value that is not finite, or an f32 value past f16's range into an f16 cache.
"""

from __future__ import annotations

import pytest

from kvstate.stateful.directed.checks import damaged_snapshots_refused

from foreign import audit_snapshots, audit_snapshots_bugs

CONFIGS = {config.precision: config for config in audit_snapshots.factory.configs}


@pytest.mark.parametrize("bug, precision, said", [
    ("trailing_bytes_accepted", "q8", "one byte appended past its body"),
    ("layout_by_size", "f32", "naming layout"),
    ("content_not_checked", "f16", "a value that is not finite"),
    ("convert_without_range_check", "f16", "past f16's range"),
    ("empty_body_checksum_skipped", "q8", "of no positions, its body checksum wrong"),
])
def test_a_restore_that_trusts_a_well_formed_file_is_caught(bug, precision, said):
    config = CONFIGS[precision]
    damaged_snapshots_refused(audit_snapshots.factory, config)      # the correct engine refuses them all
    with pytest.raises(AssertionError, match=said):
        damaged_snapshots_refused(getattr(audit_snapshots_bugs, bug), config)


def test_a_refusal_that_changed_the_cache_says_what_changed():
    """From the audit: "refused, but the cache changed" named neither what changed nor the promise."""
    with pytest.raises(AssertionError, match=r"changed \(pages allocated, pages freed\): a file is judged whole"):
        damaged_snapshots_refused(audit_snapshots_bugs.allocate_then_free, CONFIGS["f32"])


def test_a_path_write_that_breaks_durability_is_reported_after_the_few_operations_that_built_it():
    """From the audit: an in-place writer's counterexample listed 24 operations, 22 of them stream
    writes and restores that had passed; the path write now comes first."""
    from kvstate.stateful.directed.common import current
    from kvstate.stateful.directed.snapshot_writes import snapshot_writes

    snapshot_writes(audit_snapshots.factory, CONFIGS["f32"])         # the correct engine: every write passes
    with pytest.raises(AssertionError, match="renamed over the target"):
        snapshot_writes(audit_snapshots_bugs.in_place_write, CONFIGS["f32"])
    assert len(current.run.history) <= 6, current.run.history


def test_a_restore_into_smaller_pages_that_drops_the_partial_last_one_is_caught():
    """From an audit of the snapshot checks: ``portable snapshots`` tried 4-token pages' snapshots only in
    5-token pages, so an engine dropping a partly filled last page in smaller pages passed it."""
    from kvstate.stateful.directed.common import BrokenPromise
    from kvstate.stateful.directed.portable import portable_snapshots

    portable_snapshots(audit_snapshots.factory, CONFIGS["f32"])      # the correct engine
    with pytest.raises(BrokenPromise, match="of 3-token pages"):
        portable_snapshots(audit_snapshots_bugs.small_page_drops_partial, CONFIGS["f32"])
