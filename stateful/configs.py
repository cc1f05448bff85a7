"""The configurations and settings profiles the lockstep machine runs under."""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, Verbosity, settings

from kvstate.spec.layout import Layout
from kvstate.spec.errors import ConfigError
from kvstate.spec.protocol import SEMANTICS_TAGS, Config, check_declarations, standard_configs

MACHINE_LAYOUT = Layout(layers=2, kv_heads=2, head_dim=4)
MACHINE_MAX_ENTRIES = 2      # small, so eviction happens often
MACHINE_ARENA_PAGES = 6      # small, so the arena runs out and falls back to the heap
PAGE_TOKENS_RANGE = (1, 8)   # drawn per run, so page boundaries are crossed all the time
DRAWN_PAGE_SIZES = tuple(range(PAGE_TOKENS_RANGE[0], PAGE_TOKENS_RANGE[1] + 1))
# Both random engines draw an extend's tokens 1-9 at a time: a page or two at the sizes above. A
# backend that declares larger pages (vLLM's 16, SGLang's 64) had its contexts end inside their second
# page and never truncated to a page boundary, so bugs at page boundaries and in a full pool went
# unseen (an audit: a truncate that keeps the page past the new length, an extend that forgets the
# copy of a shared last page). From this size up, extends repeat their drawn tokens to about a page
# and truncates land on page boundaries half the time; smaller pages draw exactly as before.
LARGE_PAGES_FROM = 10


def scaled_run(tokens: tuple, page_tokens: int) -> tuple:
    """An extend's drawn tokens at ``page_tokens``: as drawn below ``LARGE_PAGES_FROM``, else repeated
    so that 1-9 drawn tokens span about 1/6 to 1.5 pages."""
    if page_tokens < LARGE_PAGES_FROM:
        return tokens
    return tokens * -(-page_tokens // 6)


def scaled_cut(n: int, page_tokens: int) -> int:
    """A truncate's drawn length at ``page_tokens``: as drawn below ``LARGE_PAGES_FROM``, else moved
    down to a page boundary when it is odd and a page or more (no extra draw: the sequences of
    small pages stay the same)."""
    if page_tokens < LARGE_PAGES_FROM or n % 2 == 0 or n < page_tokens:
        return n
    return n - n % page_tokens


def machine_configs() -> list[Config]:
    """The six: f32, f16, q8, each without an arena and with one that runs out."""
    return standard_configs(MACHINE_LAYOUT, page_tokens=4, max_entries=MACHINE_MAX_ENTRIES,
                            arena_pages=MACHINE_ARENA_PAGES)


def semantics_configs() -> list[Config]:
    """One configuration per declared semantics beyond the seed's (``spec/semantics.py``), sized so
    that each bound or pool limit is reached often in a few dozen steps."""
    base = Config(MACHINE_LAYOUT, page_tokens=4, max_entries=MACHINE_MAX_ENTRIES)
    return [
        base.with_(match="token"),
        base.with_(match="token", precision="f16", max_entries=4, max_pages=5),    # the page budget binds first
        base.with_(match="block", block_tokens=2, precision="q8"),
        base.with_(match="token", arena_pages=MACHINE_ARENA_PAGES, on_full="evict", max_entries=4),
        base.with_(match="block", block_tokens=4, pool_pages=12, on_full="refuse"),
        base.with_(arena_pages=10, on_full="refuse"),                             # a fixed pool, entry match
        # vLLM's and SGLang's pools: cached pages are reclaimed first, then the operation is refused
        base.with_(match="block", block_tokens=2, precision="f16", pool_pages=10, on_full="evict-then-refuse",
                   max_entries=8),
    ]


def all_configs() -> list[Config]:
    return machine_configs() + semantics_configs()


def configs_for(factory) -> list[Config]:
    """What a factory is checked under: its ``configs`` if it lists them; else the six, plus each
    semantics configuration whose ``tags`` are all in the factory's ``semantics`` declaration."""
    check_declarations(factory)
    tags = frozenset(getattr(factory, "semantics", ()))
    unknown = tags - SEMANTICS_TAGS
    if unknown:     # beside ``configs`` too: a misspelled tag there passed unread, and silently
        raise ConfigError(f"the factory declares unknown semantics {sorted(unknown)}; known: {sorted(SEMANTICS_TAGS)}")
    declared = getattr(factory, "configs", None)
    if declared is not None:
        return list(declared)
    return machine_configs() + [config for config in semantics_configs() if config.tags <= tags]


def page_sizes(factory, config: Config) -> tuple[int, ...]:
    """The page sizes the lockstep machine and the seeded runs build ``config``'s caches at.

    A factory that lists its ``configs`` declared each one's ``page_tokens``, and is run at exactly
    that (an engine whose block is its page, as vLLM's, may take no other); one that lists none is
    checked in the standard configurations at page sizes drawn per run from ``PAGE_TOKENS_RANGE``,
    so page boundaries fall everywhere. ``factory.any_page_size`` (True or False) overrides either.
    """
    drawn = getattr(factory, "any_page_size", getattr(factory, "configs", None) is None)
    return DRAWN_PAGE_SIZES if drawn else (config.page_tokens,)


# What a declared configuration fixes beyond its layout and bounds: how pages are stored, and the
# declared semantics. A backend is held to no other value of these; any layout or entry limit it takes.
DECLARED_FIELDS = ("precision", "arena_pages", "match", "block_tokens", "max_pages", "pool_pages", "on_full", "values")


def undeclared_by(factory, config: Config, holder: str = "the file") -> str | None:
    """Why ``factory`` is not to be held to ``config`` (a replay file's, say: ``holder`` names what
    holds it in the answer), or None where it may be.

    A factory that lists its ``configs`` is held to the ``DECLARED_FIELDS`` of one of them, at one of
    the page sizes it is run at (``page_sizes``); one that lists none, to any configuration whose
    declared semantics (``Config.tags``) its ``semantics`` names."""
    declared = getattr(factory, "configs", None)
    if declared is None:
        missing = config.tags - frozenset(getattr(factory, "semantics", ()))
        return f"semantics {sorted(missing)}" if missing else None
    differences = []
    for listed in declared:
        differ = [name for name in DECLARED_FIELDS if getattr(config, name) != getattr(listed, name)]
        if config.page_tokens not in page_sizes(factory, listed):
            differ.append("page_tokens")
        if not differ:
            return None
        differences.append((len(differ), listed, differ))
    if not differences:
        return "it declares no configurations"
    _, nearest, differ = min(differences, key=lambda found: found[0])
    return (f"its nearest, {nearest.name}, has " + ", ".join(f"{name} {getattr(nearest, name)!r}" for name in differ)
            + f" where {holder} has " + ", ".join(f"{getattr(config, name)!r}" for name in differ))


def describe_page_sizes(sizes: tuple[int, ...]) -> str:
    return (f"page_tokens {sizes[0]}" if len(sizes) == 1
            else f"page_tokens drawn per run from {sizes[0]}-{sizes[-1]}")


def configs_named(names, available=None) -> list[Config]:
    """The configurations called ``names``, in that order, from ``available`` (default: all standard ones).

    A name is ``Config.name`` (precision and arena), so a backend declaring one under two page
    sizes gets both. ``KeyError`` naming every unknown name and the known ones: a typo is never
    silently skipped.
    """
    available = all_configs() if available is None else list(available)
    known = list(dict.fromkeys(config.name for config in available))
    unknown = [name for name in names if name not in known]
    if unknown:
        raise KeyError(f"no configuration {', '.join(map(repr, unknown))}; known: {known}")
    return [config for name in names for config in available if config.name == name]


def config_label(config: Config, among) -> str:
    """``config``'s name, or, where ``among`` holds another of that name (one declared at two page sizes:
    a name leaves the page size out), the name and ``-pageN``: the label sweeps, reruns and conform's
    table give it, which ``--configs`` takes back."""
    namesakes = {other for other in among if other.name == config.name} | {config}
    return config.name if len(namesakes) == 1 else f"{config.name}-page{config.page_tokens}"


def config_named(name: str) -> Config:
    """One of the standard configurations, by name."""
    return configs_named([name])[0]


_common = dict(
    deadline=None,
    database=None,
    # conform writes its own report (the minimised sequence, the broken promise); Hypothesis's
    # printout of its steps would be a second, rawer copy on stdout.
    verbosity=Verbosity.quiet,
    # A long first example is what a 400-step nightly run is for (large_base_example), and the
    # suite's runs are slow by design (too_slow): neither is a finding about the backend.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large,
                           HealthCheck.large_base_example],
)

# Hypothesis settings of the lockstep machine per profile. The seeded check (stateful/seeded.py)
# sizes itself from the same settings: max_examples // 3 seeds of max(200, step count) operations.
PROFILES = {
    # Default, before every commit and in CI: derandomized so a red run is a reproducible one.
    "ci": settings(max_examples=50, stateful_step_count=50, derandomize=True, **_common),
    # Nightly: long runs, as the design document's 400-step sweeps; random, so each night differs.
    "nightly": settings(max_examples=200, stateful_step_count=400, **_common),
    # Planted-bug hunts: the ci budget, without shrinking (only "found or not" matters).
    "hunt": settings(max_examples=50, stateful_step_count=50, derandomize=True,
                     phases=[Phase.explicit, Phase.generate], **_common),
}


def seeded_size(profile_settings: settings) -> tuple[int, int]:
    """(seeds, steps) of the seeded check under these settings."""
    return max(1, profile_settings.max_examples // 3), max(200, profile_settings.stateful_step_count)
