"""Which race scenarios a backend is raced in, configuration by configuration: one rule for
``kvstate conform``'s ``races`` check and for ``kvstate stress --backend``."""

from __future__ import annotations

from kvstate.spec.protocol import Config

# Every scenario a thread-safe backend gets, with its options at conform's size (the stores' own
# runs, ``tests/test_races.py``, use each scenario's defaults).
RACED = (("fork_storm", {"threads": 8}), ("eviction_vs_allocation", {}), ("match_close_vs_clear", {}),
         ("close_races", {}), ("observe_during_writes", {}), ("hits_stamp_under_race", {}),
         ("fork_vs_owner_writes", {}), ("reads_during_copy_on_write", {}), ("stamps_vs_retains", {}))


def backend_scenarios(factory, config: Config) -> "list[tuple[str, dict]] | str":
    """``(scenario, options)`` for each scenario ``factory``'s backend is raced in under ``config``,
    or why none is (an n/a, not a failure: a single-threaded backend is legitimate).

    Under ``reclaim`` and ``reclaim-fifo`` too: there the scenarios hold the tree only to what the
    engine's own way of reclaiming promises (``scenarios._finish_tree``: entries may be gone, an
    entry's hit may be shorter), and ``hits_stamp_under_race`` and ``stamps_vs_retains``, whose
    verdicts are which whole entries go next, say themselves that they are n/a. A pool that lets its lock go between its check and the
    allocation lives exactly there."""
    why = why_not_raced(factory)
    if why is not None:
        return why
    scenarios = list(RACED)
    if config.on_full != "fallback":
        scenarios.append(("pressure_vs_match", {}))     # pressure eviction or refusal racing match
    if hasattr(factory(config), "restore"):
        scenarios.append(("snapshot_vs_decode", {}))
    return scenarios


def why_not_raced(factory) -> str | None:
    """Why ``factory``'s backend is raced in no configuration at all (``kvstate race`` refuses it so), or None."""
    if not getattr(factory, "thread_safe", False):
        return "the factory does not declare thread_safe = True"
    return None
