"""What every directed check shares: the run a check is in, "not applicable", and how a
broken promise is reported.

A directed check drives a ``Lockstep`` (engine and reference side by side) and, where it
calls the backend directly, calls both sides the same way (``both``) so that whatever
semantics the configuration declares, the reference decides what is right.

A failure is a ``BrokenPromise``: its first line quotes the promise and names the exact
call that broke it, then says what was seen.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np

from kvstate.spec.arithmetic import pages_needed
from kvstate.spec.errors import KVStateError
from kvstate.spec.invariants import tiers
from kvstate.spec.observation import Observation
from kvstate.spec.protocol import Config, Factory

from .. import ops as O
from ..frames import suite_assertion
from ..lockstep import REFUSED, Lockstep, describe_refusal, same_refusal, to_numpy

Check = Callable[[Factory, Config], None]

current = threading.local()   # current.run: the Lockstep of the check running in this thread
# current.settings: the Hypothesis settings conform runs the check under (its profile), None outside conform


def note(text: str) -> None:
    """Something a check that passed did not check, for the report (``Outcome.note``): a part the
    backend's factory refused, say. Only for the check running in this thread."""
    current.notes = [*getattr(current, "notes", []), text]


class NotApplicable(Exception):
    """The backend does not offer what the check exercises (a cache without snapshots, say)."""


def require_tier(obs: Observation, tier: str, needs: str) -> None:
    """``NotApplicable`` naming the missing observation tier (``spec.invariants.tiers``) when a
    check reads a part of ``obs`` the backend does not expose."""
    if tier not in tiers(obs):
        raise NotApplicable(f"the observation has no {tier!r} tier ({needs} is None): "
                            f"the backend exposes {tiers(obs) or 'the black box only'}")


class BrokenPromise(AssertionError):
    """A directed check failed: ``promise`` (quoted) was broken by ``call``."""

    invariant: int | str | None = None      # set when the break showed as an invariant violation

    def __init__(self, promise: str, call: str, saw: str):
        self.promise, self.call, self.saw = promise, call, saw
        super().__init__(f'"{promise}" -- broken by {call}: {saw}')


def start(factory: Factory, config: Config) -> Lockstep:
    """A new lockstep run, registered as this thread's current run (conform prints its history),
    its books checked after every ``apply`` (``Lockstep.check_books``): a scenario's setup that
    breaks them is reported at the operation that broke them, not later as the promise the scenario
    goes on to test."""
    run = current.run = Lockstep(factory, config)
    run.check_each_apply = True
    return run


def filled(factory: Factory, config: Config, pages: float = 2.5) -> tuple[Lockstep, int]:
    """A lockstep run holding context ``c1`` with ``pages`` pages' worth of positions."""
    run = start(factory, config)
    run.apply(O.Allocate())
    n = int(config.page_tokens * pages)
    run.apply(O.Extend("c1", tuple(i % 3 for i in range(n)), seed=1))
    if len(run.live["c1"][1]) < n:      # refused by both sides, as a pool this small must
        raise NotApplicable(f"the pool of {config.pool_limit} pages cannot hold the check's context of "
                            f"{pages_needed(n, config.page_tokens)} pages")
    run.check()
    return run, n


def retain_new(run: Lockstep, tokens: tuple[int, ...], seed: int) -> None:
    """A new context holding ``tokens``, retained and closed: an entry whose pages no context holds."""
    handle = run.apply(O.Allocate())
    run.apply(O.Extend(handle, tokens, seed=seed))
    run.apply(O.Retain(handle))
    run.apply(O.Close(handle))


@contextmanager
def keeping(promise: str, run: Lockstep, call: str | None = None) -> Iterator[None]:
    """Report any assertion raised inside as a broken ``promise``, naming ``call`` (default: the
    run's last operation). A ``BrokenPromise`` raised inside passes through unchanged."""
    try:
        yield
    except (BrokenPromise, NotApplicable):
        raise
    except AssertionError as error:
        if not suite_assertion(error):
            raise           # the backend's own assert: reported as the backend raising, not as this promise
        where = call or (run.history[-1] if run.history else "the first operation")
        # a failure of the run's own teardown (``Lockstep.finish``) names the promise it broke, not this one
        broken = BrokenPromise(getattr(error, "promise", None) or promise, where, str(error))
        broken.invariant = getattr(error, "invariant", None)    # the invariant number, where one broke
        raise broken from error


def record(run: Lockstep, call: str) -> None:
    """Add a direct call to the run's history, so a failure report lists it."""
    run.steps += 1
    run.history.append(call)


def both(run: Lockstep, promise: str, call: str, engine: Callable[[], Any], reference: Callable[[], Any]
         ) -> tuple[Any, Any, KVStateError | None]:
    """Call the engine and the reference the same way. Both must accept, or both refuse with the
    same error class. Returns (engine result, reference result, the engine's error or None)."""
    record(run, call)
    got, got_error = _attempt(engine)
    want, want_error = _attempt(reference)
    if not same_refusal(got_error, want_error):
        raise BrokenPromise(promise, call, f"engine {_said(got_error, 'accepted')}, "
                                           f"reference {describe_refusal(want_error)}")
    if got_error is not None:
        run.history[-1] += f"{REFUSED}{type(got_error).__name__}"
    return got, want, got_error


def _attempt(call):
    try:
        return call(), None
    except KVStateError as error:
        return None, error


def _said(error: BaseException | None, otherwise: str) -> str:
    return otherwise if error is None else f"raised {type(error).__name__}({error})"


def same_read(promise: str, call: str, got: tuple[Any, Any], want: tuple[Any, Any]) -> None:
    """An engine ``read`` result equals the reference's: values bit for bit (shape and dtype too), tokens."""
    values, tokens = as_array(got[0]), np.asarray(list(as_list(got[1])), dtype=np.int64)
    want_values, want_tokens = want
    if values.shape != want_values.shape or values.dtype != want_values.dtype:
        raise BrokenPromise(promise, call, f"values {values.dtype}{values.shape}, "
                                           f"reference {want_values.dtype}{want_values.shape}")
    differs = values.view(np.uint32) != want_values.view(np.uint32)
    if differs.any():
        index = tuple(int(i) for i in np.argwhere(differs)[0])
        raise BrokenPromise(promise, call, f"value at {index} is {values[index]!r}, reference {want_values[index]!r}")
    if not np.array_equal(tokens, np.asarray(want_tokens, dtype=np.int64)):
        raise BrokenPromise(promise, call, f"tokens {tokens.tolist()}, reference {list(want_tokens)}")


def as_array(values: Any) -> np.ndarray:
    """A private NumPy copy of an engine's array (NumPy or torch): later changes to the original do not reach it."""
    return np.array(to_numpy(values), copy=True)


def as_list(tokens: Any) -> list[int]:
    """Token ids as plain ints, whatever container the engine returned them in."""
    if hasattr(tokens, "tolist"):
        return [int(t) for t in tokens.tolist()]
    return [int(t) for t in tokens]
