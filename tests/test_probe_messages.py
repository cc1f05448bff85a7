"""What the suite says when a black-box engine fails its entry probe or a race (two audits, 2026-12-06).

The probe (``Lockstep._probe_entries``) matches every entry after every step. Its message blamed
copy-on-write alone for a tie resolved to another entry. (The audit also found the pool's eviction
suggested for a difference a retain showed; it stays: an engine that copies an entry's pages, as
``tests/foreign/copy_per_entry.py`` does, takes pages in a retain and may evict for them.)
"""

from __future__ import annotations

import pytest

from kvstate.spec import InvariantViolation
from kvstate.stateful import ops as O
from kvstate.stateful.lockstep import Lockstep

from foreign import audit3_locks_bugs, audit_bugs, audit_minimal

CONFIG = next(c for c in audit_minimal.factory.configs if c.name == "block4-f32-pool10-evict")


def _checked_each_step(factory, steps) -> str:
    """``steps(apply)`` run in lockstep with every check after every operation; the violation's text."""
    return str(_violation_of(factory, steps))


def _violation_of(factory, steps) -> InvariantViolation:
    """The violation ``steps(apply)`` meets, every check run after every operation."""
    run = Lockstep(factory, CONFIG)

    def apply(op):
        handle = run.apply(op)
        run.check()
        return handle
    with pytest.raises(InvariantViolation) as failed:
        steps(apply)
    return failed.value


def _tie(apply):        # conform's shrunk counterexample for tie_first_retained
    c1 = apply(O.Allocate())
    apply(O.Extend(c1, (1, 0, 2, 1, 0), seed=0))
    apply(O.Retain(c1))
    c2 = apply(O.Match((1, 0, 2, 1)))
    apply(O.Overwrite(c2, 0, (1,), seed=12737))
    apply(O.Retain(c2))


def test_a_tie_resolved_to_another_entry_names_both_entries():
    """The hit's values are whole, another entry's: the message names whose, and whose they should be
    (it named copy-on-write first, then a tie as one possibility)."""
    said = _checked_each_step(audit_bugs.tie_first_retained, _tie)
    assert ("the hit holds the values of entry [1, 0, 2, 1, 0], where [1, 0, 2, 1] gives it, the most recently used"
            in said and "or a tie resolved to another entry" in said and "copy-on-write" not in said), said


def test_a_hit_that_leaves_its_entry_unstamped_is_named_as_recency():
    """From the third audit (``hit_not_stamped``): conform's counterexample, where the probe's own match of
    the older entry should have made it the one a hit of the shorter key is taken from."""
    config = next(c for c in audit3_locks_bugs.hit_not_stamped.configs if c.name == "token-f32-pool10-refuse")
    run = Lockstep(audit3_locks_bugs.hit_not_stamped, config)
    c1 = run.apply(O.Allocate())
    c2 = run.apply(O.Fork(c1))
    run.apply(O.Extend(c2, (0,), seed=0))
    run.apply(O.Extend(c1, (0, 0), seed=12591))
    run.apply(O.Retain(c1))
    run.apply(O.Retain(c2))
    with pytest.raises(InvariantViolation, match=r"the hit holds the values of entry \[0\], where \[0, 0\] gives it, "
                                                 r"the most recently used .*left its entry's recency as it was \(not stamped\)"):
        run.check()


def test_books_a_probe_left_wrong_are_the_probes_not_the_next_steps():
    """From the third audit: a hit that copied its partly filled last page but kept its count on the
    original leaked a refcount in the probe's own ``match``; the failure showed at the next step's
    check, as "failing call: c2 = allocate()", in a sequence holding no match at all."""
    config = next(c for c in audit3_locks_bugs.eager_partial_copy.configs if c.name == "token-f32-pool12-evict")
    run = Lockstep(audit3_locks_bugs.eager_partial_copy, config)
    c1 = run.apply(O.Allocate())
    run.apply(O.Extend(c1, (0,), seed=0))
    run.check()
    run.apply(O.Retain(c1))
    with pytest.raises(InvariantViolation, match=r"invariant 1: .*; seen right after the suite probed the entries "
                                                 r"after this step \(match\(\[0\]\), each hit closed at once\)"):
        run.check()


def test_a_race_failure_from_the_backends_own_exception_says_where_it_was_raised():
    """From the second audit: "thread 3: ValueError: need at least one array to concatenate" named no
    file or line, and a race failure has no operations to show instead."""
    from kvstate.stateful.races.harness import RaceFailure, run_threads

    def backend_call() -> None:
        raise ValueError("need at least one array to concatenate")
    with pytest.raises(RaceFailure, match=r"thread 1: ValueError: need at least one array to concatenate at "
                                          r".*test_probe_messages\.py:\d+ in backend_call"):
        run_threads([lambda: None, backend_call], "a scenario")


def test_a_failure_the_probe_found_names_the_probe_beside_the_failing_call():
    """From the second audit (F3): a wrong hit the probe's ``match`` found was headed "failing call:
    retain(ctx='c1')", in a sequence holding no match: the step before the probe is still the failing
    call (the engine went wrong there or earlier), and the line now says which call of the suite's saw it."""
    from kvstate.stateful.conform import describe

    violation = _violation_of(audit_bugs.tie_first_retained, _tie)
    history = ["c1 = allocate()", "extend(ctx='c1', tokens=(1, 0, 2, 1, 0), seed=0)", "retain(ctx='c1')",
               "c2 = match(tokens=(1, 0, 2, 1))", "overwrite(ctx='c2', start=0, tokens=(1,), seed=12737)",
               "retain(ctx='c2')"]
    lines = describe(violation, history, config=CONFIG).splitlines()
    failing = next(line for line in lines if line.startswith("failing call:"))
    assert failing in (f"failing call: retain(ctx='c2'), found by the suite's match of entry {key} after it"
                       for key in ("[1, 0, 2, 1, 0]", "[1, 0, 2, 1]")), failing


def test_a_replays_failure_keeps_what_found_it():
    """The same failure as a replay file records it (``replay.Failure``): the probe that saw it is
    kept, printed in its line, and read back; a file written before the field reads as no probe."""
    from kvstate.stateful import replay as R

    ops = [O.Allocate(), O.Extend("c1", (1, 0, 2, 1, 0), seed=0), O.Retain("c1"), O.Match((1, 0, 2, 1)),
           O.Overwrite("c2", 0, (1,), seed=12737), O.Retain("c2")]      # ``_tie`` as a replay holds it
    failure, _ = R.execute(audit_bugs.tie_first_retained, CONFIG, ops)
    assert failure.found_by.startswith("the suite's match of entry [1, 0, 2, 1"), failure
    assert f"(check retain(ctx='c2'), found by {failure.found_by})" in str(failure), str(failure)
    assert R.checked_failure(R.Failure(**R.asdict(failure))) == failure
    older = {k: v for k, v in R.asdict(failure).items() if k != "found_by"}
    assert R.Failure(**older).found_by == "" and "found by" not in str(R.Failure(**older))


def test_a_directed_failure_found_by_an_invariant_leads_with_it_and_names_its_configuration():
    """From the data-plane audit (s68, F4 and F5): an unshrunk directed failure led with the check's
    promise whatever broke (a copy-on-write skipped read as "q8 rounds half to even"), and named no
    configuration, so not the page size the run drew."""
    from kvstate.stateful.conform import _unshrunk_directed
    from kvstate.stateful.directed.common import BrokenPromise

    run = Lockstep(audit_minimal.factory, CONFIG)
    run.apply(O.Allocate())
    run.apply(O.Extend("c1", (1, 2), seed=3))
    cause = InvariantViolation(4, "c1 position 0 (index (0, 0, 0, 0, 0)): 1.0 != reference 2.0")
    broken = BrokenPromise("a promise about rounding", run.history[-1], str(cause))      # as ``keeping`` makes it
    broken.invariant, broken.__cause__ = 4, cause
    lines = _unshrunk_directed(broken, broken.promise, run.history, run.config).splitlines()
    assert lines[:3] == ["InvariantViolation: invariant 4: c1 position 0 (index (0, 0, 0, 0, 0)): 1.0 != reference 2.0",
                         'found while checking: "a promise about rounding"',
                         f"configuration: {CONFIG.describe()}"], lines
    assert lines[3] == "failing call: extend(ctx='c1', tokens=(1, 2), seed=3)", lines
    own = BrokenPromise("a promise about refusals", "c1.read(0, 9)", "engine accepted, reference PositionError")
    lines = _unshrunk_directed(own, own.promise, run.history, run.config).splitlines()
    assert lines[0].startswith('BrokenPromise: "a promise about refusals" -- broken by c1.read(0, 9)'), lines
    assert lines[1] == f"configuration: {CONFIG.describe()}", lines


def test_a_scale_pass_says_which_layouts_the_factory_refused(monkeypatch):
    """From the data-plane audit (s68, F3): a factory refusing ``scale``'s wide run (ConfigError) had it
    skipped with the check reported as a plain pass; now the table says what went unchecked."""
    from foreign import dict_pages
    from kvstate.spec.errors import ConfigError
    from kvstate.stateful.configs import configs_for
    from kvstate.stateful.conform import conform, format_table

    def refusing_big_pages(config):
        if config.page_tokens * config.layout.values_per_position * 4 > 1 << 20:
            raise ConfigError("pages past 1 MiB are not supported")
        return dict_pages.factory(config)
    from kvstate.stateful.directed import scale

    monkeypatch.setattr(scale, "_many_pages", lambda run: run.finish())     # seconds, and not what is tested here
    config = next(c for c in configs_for(dict_pages.factory) if c.name == "f32-heap")
    results = conform(refusing_big_pages, profile="hunt", configs=[config], checks=["scale"])
    outcome = results[0].outcomes["scale"]
    assert outcome.status == "pass" and outcome.note.startswith("the factory refused layout 4x8x")
    assert outcome.note.endswith(" (ConfigError): pages of several MiB went unchecked"), outcome.note
    assert "a real model's layout" not in outcome.note       # 4x8x128 it accepted, and passed
    table = format_table(results)
    assert f"passed, with parts not run:\n  f32-heap / scale: {outcome.note}" in table, table
    plain = conform(dict_pages.factory, profile="hunt", configs=[config], checks=["scale"])
    assert plain[0].outcomes["scale"].note is None and "parts not run" not in format_table(plain)


def test_a_failure_no_probe_found_is_written_as_before_the_field():
    """The final review (s68, F5): every failure was written with ``found_by``, empty or not, and kvstate
    from before the field refuses a file with it (``Failure(**fields)``): now only a probe's failure has it."""
    from kvstate.stateful import replay as R
    from kvstate.stateful.sweeps.runs import RunResult, result_to_json

    plain = R.Failure(3, "apply", "allocate()", "RuntimeError", None, "boom")
    probed = R.Failure(6, "check", "retain(ctx='c2')", "InvariantViolation", 5, "x", found_by="the suite's match")
    assert "found_by" not in R.failure_to_json(plain) and R.failure_to_json(probed)["found_by"] == "the suite's match"
    assert R.Failure(**R.failure_to_json(plain)) == plain and R.Failure(**R.failure_to_json(probed)) == probed
    replay = R.Replay("kvstate.impl.numpy", CONFIG, 0, [O.Allocate()], plain)
    assert "found_by" not in R.to_json(replay)["failure"]
    fields = {name: None for name in RunResult.__dataclass_fields__}
    result = RunResult(**{**fields, "failure": plain})
    assert "found_by" not in result_to_json(result)["failure"]


def test_a_room_or_hit_difference_of_a_sharing_black_box_under_an_evicting_pool_says_it_may_be_false():
    # An audit (s73): a correct black box sharing the tree's pages under evict-then-refuse was rejected
    # (README documents why: without the tree tier the reference cannot follow its evictions), but the
    # refusal's and the hit's messages left out the note the entries' probe gives.
    from helpers import observed_as
    from kvstate.impl.numpy import factory
    from kvstate.spec.errors import CapacityError
    from kvstate.spec.observation import black_box
    from kvstate.stateful.configs import config_named
    from kvstate.stateful.lockstep import Lockstep

    BlackBox = observed_as(lambda obs: black_box())
    config = config_named("block2-f16-pool10-evict-then-refuse").with_(values="prefix")
    note = "without it this can be a false rejection"
    assert note in Lockstep(BlackBox, config)._refusal_hint(CapacityError("full"), None)
    assert note in Lockstep(BlackBox, config)._refusal_hint(None, CapacityError("full"))
    assert note not in Lockstep(factory, config)._refusal_hint(CapacityError("full"), None)    # the tree tier
