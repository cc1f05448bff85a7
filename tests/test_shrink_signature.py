"""A shrunk counterexample shows the broken promise that was found, not another one.

The shrinker keeps a smaller sequence when it fails "the same way" (``Failure.signature``). By
error class and invariant alone, every disagreement on a refusal was one failure (invariant
"errors"), so shrinking "extend wrongly refused" of a backend with a second bug ("an empty retain
accepted") deleted the extend and reported the retain: the bug found was never shown (a review).
"""

from __future__ import annotations

from kvstate.impl.cache import Cache
from kvstate.impl.context import Context
from kvstate.impl.numpy import factory
from kvstate.spec.errors import PositionError
from kvstate.stateful import ops as O
from kvstate.stateful.configs import config_named
from kvstate.stateful.replay import Failure, execute
from kvstate.stateful.replay_verdict import REPRODUCED, verdict
from kvstate.stateful.shrink import shrink


def _two_bugs(monkeypatch) -> None:
    """An extend refused past 5 positions, and a retain of an empty context accepted."""
    extend, retain = Context.extend, Cache.retain

    def refusing_extend(self, tokens, kv):
        if len(self) + len(tokens) > 5:
            raise PositionError("refused: extend past 5 positions, reference accepted")     # words to mislead a parse
        return extend(self, tokens, kv)

    def accepting_retain(self, ctx):
        return None if len(ctx) == 0 else retain(self, ctx)
    monkeypatch.setattr(Context, "extend", refusing_extend)
    monkeypatch.setattr(Cache, "retain", accepting_retain)


def test_shrinking_an_extend_wrongly_refused_keeps_showing_it(monkeypatch):
    _two_bugs(monkeypatch)
    config = config_named("f32-heap")
    ops = [O.Allocate(), O.Extend("c1", (1, 2, 3), 1), O.Retain("c1"), O.Extend("c1", (1, 2, 3), 2)]
    found, _ = execute(factory, config, ops)
    assert found.invariant == "errors" and found.signature[2:] == ("extend", "PositionError", "accepted")
    shrunk, failure = shrink(factory, config, ops, found, 20.0)
    assert failure.signature == found.signature, failure.headline
    assert [type(op).__name__ for op in shrunk].count("Extend") >= 1 and not any(
        isinstance(op, O.Retain) for op in shrunk), shrunk


def _errors(op: str, engine: str, reference: str) -> Failure:
    return Failure(3, "apply", op, "InvariantViolation", "errors",
                   f"invariant errors: {op}: engine {engine}, reference {reference}")


def test_the_signature_of_a_refusal_disagreement_names_the_operation_and_both_answers():
    extend = "extend(ctx='c1', tokens=(1, 2), seed=0)"
    refused = _errors(extend, "PositionError('no, reference accepted') at x.py:3 in extend", "accepted")
    assert refused.signature == ("InvariantViolation", "errors", "extend", "PositionError", "accepted")
    accepted = _errors("retain(ctx='c1')", "accepted", "EmptyContextError('empty') (or any of KVStateError)")
    assert accepted.signature == ("InvariantViolation", "errors", "retain", "accepted", "EmptyContextError")
    changed = Failure(2, "apply", extend, "InvariantViolation", "refusal", f"invariant refusal: {extend} was refused")
    assert changed.signature == ("InvariantViolation", "refusal", "extend")
    numbered = Failure(2, "check", extend, "InvariantViolation", 4, "invariant 4: values differ")
    assert numbered.signature == ("InvariantViolation", 4)
    # a replay reproduces a recorded failure only with the same answers
    assert verdict(refused, refused)[0] == REPRODUCED
    assert verdict(refused, _errors(extend, "accepted", "PositionError('x')"))[0] != REPRODUCED
