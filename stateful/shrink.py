"""Shrink a failing operation sequence to a handful of steps that still fail the same way.

Delta debugging over operations, contexts merged into earlier ones, matches
made forks and extends joined, then argument simplification, against the same
``execute`` that replay uses, so what is saved is exactly what replays.
Why not Hypothesis's shrinker: it shrinks choice sequences Hypothesis itself
drew, and a sweep's runs are drawn from ``random.Random(seed)`` (see
generate.py for why). Seeding its engine with an outside sequence takes its
internal, version-specific API; shrinking operations directly needs none and
yields the same kind of result: fewer steps, smaller arguments.

"Same way" means the same exception class and invariant number. Removing an
operation that creates a context removes every later operation on that
context, and the handles left are renumbered ``c1, c2, ...`` in creation
order, as ``Lockstep`` names them, so a shrunk file stays readable. A
``restore`` goes with the ``snapshot`` it names.

What bounds a shrink is a count of tries (``max_tries``), not seconds: the same failure shrinks to the
same sequence on an idle laptop and on a loaded CI machine or Dask worker. Under a 60 s budget it did
not: a shrink that takes 8 s of CPU took 80 s on a loaded machine and stopped wherever the clock ran
out, so two sweeps of one seed saved different replays, and nothing said why. ``budget_s`` remains, as
a backstop against a candidate that hangs the backend; where it (or ``stop``) ends a shrink, the result
says so (``Shrinker.stopped`` is ``CLOCK``), and a sweep's report carries it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Sequence

from kvstate.spec.errors import ReplayFileError, RunTimeout
from kvstate.spec.protocol import Config, Factory

from . import ops as O
from .deadline import Deadline
from .lockstep import Lockstep
from .replay import Failure, execute
from .snapshots import remove_files

DEFAULT_TRIES = 1000
"""Tries one shrink may make: about what the old 60 s budget allowed on an idle machine (a 400-step run's
shrink makes 20 to 240 tries, 30 ms of CPU each)."""
TRIES, CLOCK = "tries", "clock"     # why a shrink stopped before no smaller sequence could be found


def _same(new: O.Op, old: O.Op, checked: bool = True) -> O.Op:
    return new


def renumber(ops: Sequence[O.Op], handles: Sequence[str | None], like=_same) -> list[O.Op]:
    """Keep ``ops`` whose contexts still exist, renaming handles in creation order.

    ``handles[i]`` is the handle ``ops[i]`` created in the sequence they came from (None if none);
    ``like(new, old)``, the runner's (``replay.AsWatched.like``), is told of each renamed operation.
    """
    names: dict[str, str] = {}
    snapshots: set[str] = set()
    kept = []
    for op, made in zip(ops, handles):
        ctx = getattr(op, "ctx", None)
        if ctx is not None:
            if ctx not in names:
                continue            # its context's creator was removed
            if names[ctx] != ctx:
                op = like(replace(op, ctx=names[ctx]), op)
        if op.kind == "snapshot":
            snapshots.add(op.name)
        elif op.kind == "restore" and op.name not in snapshots:
            continue                # its snapshot was removed
        if made is not None:
            names[made] = f"c{len(names) + 1}"
        kept.append(op)
    return kept


def created_handles(ops: Sequence[O.Op]) -> list[str | None]:
    """The handle each creating operation gets, as Lockstep numbers them (creators always succeed
    in generated and renumbered sequences)."""
    handles, count = [], 0
    for op in ops:
        if op.creates:
            count += 1
            handles.append(f"c{count}")
        else:
            handles.append(None)
    return handles


@dataclass(frozen=True)
class Shrunk:
    """The shortest sequence a shrink has found so far, read while it runs (by a caller whose time ran
    out) or after: its operations, the failure it shows, and the readable history of the run that showed
    it, up to the failure (None for the sequence the shrink started from, which it has not run yet)."""

    ops: list[O.Op]
    failure: Failure
    history: list[str] | None


class Shrinker:
    """``shrink(ops)`` makes at most ``max_tries`` tries. ``stopped`` says afterwards why it stopped short of a
    sequence no single change can shrink: None (it did not), ``TRIES`` (``max_tries`` made: the same on every
    machine), ``CLOCK`` (``budget_s`` passed, a try was cut short by it, or ``stop()``: where this shrink ends
    depends on the machine's speed). ``best`` is the shortest failing sequence so far (``Shrunk``; None before
    ``shrink``), replaced whole, so another thread may read it while the shrink runs."""

    def __init__(self, factory: Factory, config: Config, failure: Failure, budget_s: float = 60.0,
                 stop: Callable[[], bool] = lambda: False, max_tries: int = DEFAULT_TRIES,
                 run: Callable[..., tuple[Failure | None, Lockstep]] = execute):
        self.factory = factory
        self.run = run            # ``execute``, or a check's own way of running a sequence (``Failure`` alike)
        # Each operation a pass makes from another is observed as that one was, where the run says how
        # (``replay.AsWatched``: a run that left steps unobserved); else this does nothing.
        self.like = getattr(run, "like", _same)
        self.observed = getattr(run, "observed", lambda op: None)
        self.config = config
        self.signature = failure.signature
        self.failure = failure
        self.deadline = time.monotonic() + budget_s
        self.stop = stop          # asked between tries: True ends shrinking now (its caller gave up waiting)
        self.max_tries = max_tries
        self.tries = 0
        self.stopped: str | None = None
        self.best: Shrunk | None = None

    def fails(self, ops: list[O.Op]) -> bool:
        """Whether ``ops`` still fails the same way; remembers the failure it shows."""
        self.tries += 1
        lockstep = None
        try:        # a candidate can hang a backend (a loop at truncate 0): each try ends with the budget
            with Deadline(max(self.deadline - time.monotonic(), 0.01)) as deadline:
                lockstep = Lockstep(self.factory, self.config)
                failure, _ = self.run(self.factory, self.config, ops, lockstep=lockstep)
        except ReplayFileError:
            return False
        except RunTimeout:
            self.stopped = CLOCK
            return False
        finally:    # its snapshot files removed here, not by a collection in whatever thread (snapshots.remove_files)
            if lockstep is not None:
                remove_files(lockstep)
        if deadline.fired:
            self.stopped = CLOCK        # this try's answer was the clock's, not the backend's
            return False
        if failure is not None and failure.signature == self.signature:
            self.failure = failure      # every caller keeps a sequence that still fails: it is the best so far
            self.best = Shrunk(list(ops), failure, lockstep.history[:lockstep.failed_at])
            return True
        return False

    @property
    def out_of_time(self) -> bool:
        """Whether to stop before the next try (``stopped`` says why)."""
        if self.stopped is None:
            if self.tries >= self.max_tries:
                self.stopped = TRIES
            elif time.monotonic() > self.deadline or self.stop():
                self.stopped = CLOCK
        return self.stopped is not None

    def shrink(self, ops: list[O.Op]) -> list[O.Op]:
        self.best = Shrunk(list(ops), self.failure, None)
        # Operations after the one that broke never ran: drop them before anything else.
        if self.failure.phase != "finish" and not self.stop():
            cut = ops[:self.failure.step]
            if self.fails(cut):
                ops = cut
        while not self.out_of_time:
            before = list(ops)
            ops = self.restores_as_forks(ops)
            ops = self.remove_chunks(ops)
            ops = self.contexts_merged(ops)
            ops = self.matches_as_forks(ops)
            ops = self.extends_joined(ops)
            ops = self.simplify_arguments(ops)
            if ops == before:
                break
        return ops

    def restores_as_forks(self, ops: list[O.Op]) -> list[O.Op]:
        """Replace a snapshot and the restores of it by forks of its context, taken where the snapshot
        was (a fork reads what the snapshot held), keeping each change that still fails: what is
        left to read is a bug in snapshots, not a sequence that merely passes through one."""
        index = 0
        while index < len(ops) and not self.out_of_time:
            op = ops[index]
            if op.kind != "snapshot":
                index += 1
                continue
            handles = created_handles(ops)
            restores = [i for i, other in enumerate(ops) if other.kind == "restore" and other.name == op.name]
            forks = [self.like(O.Fork(op.ctx), ops[i]) for i in restores]
            kept = [i for i in range(len(ops)) if i != index and i not in restores]
            candidate = renumber(ops[:index] + forks + [ops[i] for i in kept if i > index],
                                 handles[:index] + [handles[i] for i in restores]
                                 + [handles[i] for i in kept if i > index], self.like)
            if self.fails(candidate):
                ops = candidate
            else:
                index += 1
        return ops

    def contexts_merged(self, ops: list[O.Op]) -> list[O.Op]:
        """Drop a context made by ``allocate``, ``fork`` or ``match`` and do what was done to it to one
        made before it (its closes dropped), keeping each change that still fails: a fork's parent
        first, then the others, nearest first; where a new context stood in, it is cut to 0 before its
        first operation, as the context it replaces was empty. Delta debugging cannot: dropping a context drops every
        operation on it, so a chain of forks, each retained or extended once, stayed whole, as did
        three contexts where one, cut and refilled, shows the bug (audits, s72 and s73)."""
        index = 0
        while index < len(ops) and not self.out_of_time:
            op = ops[index]
            if op.kind not in ("allocate", "fork", "match"):
                index += 1
                continue
            handles = created_handles(ops)
            earlier = [h for h in reversed(handles[:index]) if h is not None]
            if op.kind == "fork":
                earlier.remove(op.ctx)
                earlier.insert(0, op.ctx)
            for into in earlier:
                if self.out_of_time:
                    return ops
                candidate = _merged(ops, handles, index, into, empty=op.kind == "allocate", like=self.like)
                if self.fails(candidate):
                    ops = candidate
                    break
            else:
                index += 1
        return ops

    def matches_as_forks(self, ops: list[O.Op]) -> list[O.Op]:
        """Replace a ``match`` by a ``fork`` of a context made before it, nearest first, keeping each change
        that still fails: a hit is how a random run comes to share pages, and a retain, a match and
        their keys then stay where a fork shows the same bug (an audit, s73: 6 operations where 4 do)."""
        index = 0
        while index < len(ops) and not self.out_of_time:
            if ops[index].kind != "match":
                index += 1
                continue
            for parent in reversed([h for h in created_handles(ops)[:index] if h is not None]):
                if self.out_of_time:
                    return ops
                candidate = ops[:index] + [self.like(O.Fork(parent), ops[index])] + ops[index + 1:]
                if self.fails(candidate):
                    ops = candidate
                    break
            index += 1
        return ops

    def extends_joined(self, ops: list[O.Op]) -> list[O.Op]:
        """Join an ``extend`` with the next operation on its context where that is an ``extend`` too
        (one write of both runs of tokens, the first's seed), keeping each change that still fails."""
        index = 0
        while index < len(ops) and not self.out_of_time:
            op = ops[index]
            after = next((j for j in range(index + 1, len(ops)) if getattr(ops[j], "ctx", None) == op.ctx), None) \
                if op.kind == "extend" else None
            if after is None or ops[after].kind != "extend":
                index += 1
                continue
            joined = self.like(replace(op, tokens=op.tokens + ops[after].tokens), ops[after])
            candidate = ops[:index] + [joined] + ops[index + 1:after] + ops[after + 1:]
            if self.fails(candidate):
                ops = candidate
            else:
                index += 1
        return ops

    def remove_chunks(self, ops: list[O.Op]) -> list[O.Op]:
        """ddmin: remove chunks of halving size until no single operation can go."""
        chunks = 2
        while len(ops) > 1 and not self.out_of_time:
            size = -(-len(ops) // chunks)
            for start in range(0, len(ops), size):
                if self.out_of_time:
                    return ops
                handles = created_handles(ops)
                candidate = renumber(ops[:start] + ops[start + size:], handles[:start] + handles[start + size:],
                                     self.like)
                if candidate != ops and self.fails(candidate):
                    ops = candidate
                    chunks = max(chunks - 1, 2)
                    break
            else:
                if size == 1:
                    break
                chunks = min(chunks * 2, len(ops))
        return ops

    def simplify_arguments(self, ops: list[O.Op]) -> list[O.Op]:
        """Try smaller arguments for each operation, keeping each change that still fails."""
        index = 0
        while index < len(ops):
            observed = self.observed(ops[index])
            for simpler in ([observed] if observed is not None else []) + list(_simpler(ops[index])):
                if self.out_of_time:
                    return ops
                if simpler is not observed:
                    simpler = self.like(simpler, ops[index])
                candidate = ops[:index] + [simpler] + ops[index + 1:]
                if self.fails(candidate):
                    ops = candidate
                    break           # simplify the simpler op further
            else:
                index += 1
        return ops


def _merged(ops: list[O.Op], handles: list[str | None], index: int, into: str, empty: bool,
            like=_same) -> list[O.Op]:
    """``ops`` without the context ``ops[index]`` makes: every later operation on it done to ``into``
    instead, its closes dropped; where ``empty``, ``into`` cut to 0 right before the first of them (the
    dropped context was empty until then, and ``into`` kept its own positions for what came between).
    ``like`` as ``renumber``'s."""
    gone = handles[index]
    kept: list[O.Op] = []
    kept_handles: list[str | None] = []
    for i, other in enumerate(ops):
        if i == index:
            continue
        if getattr(other, "ctx", None) == gone:
            if other.kind == "close":
                continue
            if empty:
                kept.append(like(O.Truncate(into, 0), other, checked=False))
                kept_handles.append(None)
                empty = False
            other = like(replace(other, ctx=into), other)
        kept.append(other)
        kept_handles.append(handles[i])
    return renumber(kept, kept_handles, like)


def _simpler(op: O.Op) -> Iterator[O.Op]:
    """Simpler variants of one operation, simplest first."""
    if hasattr(op, "tokens"):
        tokens = op.tokens
        for n in range(len(tokens)):             # shortest prefix first
            yield replace(op, tokens=tokens[:n])
        if any(tokens):
            yield replace(op, tokens=tuple(0 for _ in tokens))
    if isinstance(op, O.Match) and not op.tokens:
        yield O.Allocate()                        # a miss is a new empty context, as allocate makes
    if isinstance(op, O.Overwrite) and op.start:
        yield replace(op, start=0)
    if isinstance(op, O.Truncate) and op.n:
        yield replace(op, n=0)
        yield replace(op, n=op.n - 1)
    if hasattr(op, "seed") and op.seed != 0:
        yield replace(op, seed=0)


def shrink(factory: Factory, config: Config, ops: Sequence[O.Op], failure: Failure,
           budget_s: float = 60.0, stop: Callable[[], bool] = lambda: False,
           max_tries: int = DEFAULT_TRIES) -> tuple[list[O.Op], Failure]:
    """The smallest sequence found within ``max_tries`` tries and ``budget_s`` (or until ``stop()``) that
    fails with ``failure``'s signature, and the failure it shows (``Shrinker`` also says why it stopped)."""
    shrinker = Shrinker(factory, config, failure, budget_s, stop, max_tries)
    shrunk = shrinker.shrink(list(ops))
    return shrunk, shrinker.failure
