"""The configurations and settings profiles the lockstep machine runs under."""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, settings

from kvstate.spec.layout import Layout
from kvstate.spec.protocol import Config, standard_configs

MACHINE_LAYOUT = Layout(layers=2, kv_heads=2, head_dim=4)
MACHINE_MAX_ENTRIES = 2      # small, so eviction happens often
MACHINE_ARENA_PAGES = 6      # small, so the arena runs out and falls back to the heap
PAGE_TOKENS_RANGE = (1, 8)   # drawn per run, so page boundaries are crossed all the time


def machine_configs() -> list[Config]:
    """The six: f32, f16, q8, each without an arena and with one that runs out."""
    return standard_configs(MACHINE_LAYOUT, page_tokens=4, max_entries=MACHINE_MAX_ENTRIES,
                            arena_pages=MACHINE_ARENA_PAGES)


def configs_named(names, available=None) -> list[Config]:
    """The configurations called ``names``, in that order, from ``available`` (default: the six).

    A name is ``Config.name`` (precision and arena), so a backend declaring one under two page
    sizes gets both. ``KeyError`` naming every unknown name and the known ones: a typo is never
    silently skipped.
    """
    available = machine_configs() if available is None else list(available)
    known = list(dict.fromkeys(config.name for config in available))
    unknown = [name for name in names if name not in known]
    if unknown:
        raise KeyError(f"no configuration {', '.join(map(repr, unknown))}; known: {known}")
    return [config for name in names for config in available if config.name == name]


def config_named(name: str) -> Config:
    """One of the six, by name."""
    return configs_named([name])[0]


_common = dict(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)

PROFILES = {
    # Default, in CI: derandomized so a red CI is a reproducible one.
    "ci": settings(max_examples=100, stateful_step_count=50, derandomize=True, **_common),
    # Nightly: long runs, as the design document's 400-step sweeps.
    "nightly": settings(max_examples=200, stateful_step_count=400, **_common),
    # Planted-bug hunts: the ci budget, without shrinking (only "found or not" matters).
    "hunt": settings(max_examples=100, stateful_step_count=50, derandomize=True,
                     phases=[Phase.explicit, Phase.generate], **_common),
}
