"""Replay files: a failing operation sequence as self-contained JSON, and re-running one.

A replay file names the backend factory, the full configuration (page size
included), the sweep seed that found it, the failure it showed, and the
operations. It depends on nothing else: not on Hypothesis, its example
database or its version. ``execute`` re-runs any sequence through ``Lockstep``
with every invariant checked after every step; ``replay`` runs a file's sequence
with checks spaced so its time is linear in the file (``SpacedChecks``), pins a
failure to its first step, and prints each step; ``kvstate replay FILE`` is its
command line. A file is data: its bounds (``replay_bounds.py``) are checked before
anything runs.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from kvstate.spec.errors import ConfigError, InvariantViolation, ReplayFileError, RunTimeout
from kvstate.spec.layout import Layout, check_page_tokens
from kvstate.spec.precision import check_precision
from kvstate.spec.protocol import Config, Factory

from . import generate as _generate  # noqa: F401  (imports optional op kinds, so their files load)
from . import ops as O
from . import replay_bounds as bounds
from .data_files import read_regular, replace_own_file
from .deadline import Deadline
from .lockstep import CHECKED, REFUSED, UNOBSERVED, Lockstep, to_numpy
from .frames import raised_at  # noqa: F401  (conform and the checks import it from here too)
from .printable import one_line

FORMAT = "kvstate-replay/1"
MAX_REPLAY_BYTES = 64 << 20
"""Replay files larger than this are refused by name (a sweep's shrunk failures are kilobytes)."""
MAX_REPLAY_PAGE_BYTES = 1 << 30
"""A replay configuration whose one page holds more float32 bytes than this is refused: the cache
would accept it and fail only at the first write, which would read as the backend's failure."""


_ANSWER = re.compile(r"accepted|[A-Za-z_]\w*")      # an answer: "accepted", or the error's class name
_REFERENCE = ", reference "


def _op_kind(op: str) -> str:
    """The kind of a printed operation (``extend(ctx='c1', ...)``: ``extend``)."""
    return op.split("(", 1)[0].strip()


@dataclass(frozen=True)
class Failure:
    """Where and how a run broke. ``step`` is the 1-based operation during (``phase`` "apply")
    or after (``phase`` "check") which it broke; ``phase`` "finish" is the final close-all check."""

    step: int
    phase: str
    op: str | None
    error: str                      # the exception's class name
    invariant: int | str | None     # set for InvariantViolation
    message: str
    where: str = ""                 # where an exception other than an assertion was raised (``raised_at``)
    found_by: str = ""              # the suite's own call after the step that saw it (the entry probe's match)

    @property
    def headline(self) -> str:
        """A report's first line: the broken invariant, or what the backend raised and where."""
        if self.invariant is not None:
            return f"{self.error}: {self.message}"
        return f"the backend raised {self.error}: {self.message}{self.where}"

    @property
    def signature(self) -> tuple:
        """What a shrunk sequence must still show to count as the same failure: the error and the
        invariant; for a refusal that changed the cache, the operation's kind too; for an engine
        and reference answering an operation differently (invariant "errors"), the operation's kind
        and each side's answer (an error class, or "accepted"). Those two invariants each hold many
        promises: by error and invariant alone, shrinking "extend wrongly refused" could end on
        "an empty retain accepted", another bug, reported in its place."""
        if self.invariant == "refusal" and self.op is not None:
            return (self.error, self.invariant, _op_kind(self.op))
        if self.invariant == "errors" and self.op is not None:
            return (self.error, self.invariant, _op_kind(self.op), *self._answers())
        return (self.error, self.invariant)

    def _answers(self) -> tuple[str, str]:
        """The engine's and the reference's answer, as lockstep writes an "errors" violation
        (``invariant errors: {op}: engine {answer}, reference {answer}``); "?" where not read."""
        lead = f"invariant errors: {self.op}: engine "
        if not self.message.startswith(lead):
            return "?", "?"
        rest = self.message[len(lead):]
        engine = _ANSWER.match(rest)
        cut = rest.rfind(_REFERENCE)      # the last: the engine's own message may hold the words too
        reference = _ANSWER.match(rest, cut + len(_REFERENCE)) if cut >= 0 else None
        return (engine.group() if engine else "?"), (reference.group() if reference else "?")

    def __str__(self) -> str:
        """One line, whatever its fields hold (they come from a backend or a file): newlines and
        control characters escaped (``printable.one_line``); no operation is not printed as "None"."""
        what = self.phase if self.op is None else f"{self.phase} {one_line(self.op)}"
        found = f", found by {one_line(self.found_by)}" if self.found_by else ""
        where = "at finish" if self.phase == "finish" else f"at step {self.step} ({what}{found})"
        return f"{one_line(self.error)} {where}: {one_line(self.message)}{one_line(self.where)}"


@dataclass
class Replay:
    backend: str
    config: Config
    seed: int | None
    ops: list[O.Op]
    failure: Failure | None = None
    minimised: bool = False
    original_steps: int | None = None
    extra: dict = field(default_factory=dict)
    # Read from a file whose operations are not the ones it was written with (``ops_sha256``): a
    # sweep writes valid sequences only, so a hand edit can turn a failing file into a passing one.
    edited: bool = False
    # The steps (numbered from 1) the run that found the failure applied with nothing observed before
    # them, and those of them it checked after (``stretches``): replayed observing each step, a failure
    # that only unsettled lazy books show would vanish. Empty: every step observed and checked.
    unobserved: tuple[int, ...] = ()
    checked_after: tuple[int, ...] = ()

    def runner(self) -> Callable[..., "tuple[Failure | None, Lockstep]"]:
        """How the sequence runs (``execute``'s signature): observed as the run that found it observed it."""
        return AsWatched.from_steps(self.ops, self.unobserved, self.checked_after) if self.unobserved else execute


# -- running a sequence ------------------------------------------------------------------

StepHook = Callable[[int, O.Op, "str | None", Lockstep], None]


Watch = Callable[[int, O.Op, Lockstep], bool]

# What a backend raising during a step is, for the run: a finding. ``SystemExit`` too: a backend
# that calls ``sys.exit`` would otherwise end the whole sweep, with exit status 0 and no report.
# An interrupt (Ctrl-C) is the user's, and still stops everything.
FINDINGS = (Exception, SystemExit)


def execute(factory: Factory, config: Config, ops: Iterable[O.Op],
            on_step: StepHook | None = None, lockstep: Lockstep | None = None,
            watch: Watch | None = None, checked: Callable[[O.Op], bool] | None = None
            ) -> tuple[Failure | None, Lockstep]:
    """Apply ``ops`` in lockstep, checking invariants 1-5 after every step and 6 at the end.

    Returns the first failure (None when every check holds) and the lockstep, left as it was
    when the run stopped. An operation naming a context that is not live, or a snapshot the run
    has not taken, is the sequence's fault, not the backend's: ``ReplayFileError``. ``ops`` may be
    a generator that reads ``lockstep`` (passed in, already built) to choose each next operation.
    ``watch(step, op, lockstep)``, when given, decides which steps are observed before and checked
    after (``spaced_checks``); every step's errors are still compared. ``checked(op)``, when given, has an
    unwatched step checked after all (``AsWatched``).
    """
    lockstep = lockstep or Lockstep(factory, config)
    step = 0
    for step, op in enumerate(ops, start=1):
        fault = lockstep.sequence_fault(op)
        if fault is not None:
            raise ReplayFileError(f"step {step} {op} {fault}")
        phase = "apply"
        try:
            watched = watch is None or watch(step, op, lockstep)
            handle = lockstep.apply(op, watched)
            if on_step is not None:
                on_step(step, op, handle, lockstep)
            phase = "check"
            if watched or (checked is not None and checked(op)):
                lockstep.check()
        except FINDINGS as error:       # a broken backend may raise anything; that is a finding
            # a check after a step both sides refused says so: the broken promise is "refused, nothing changed"
            refused = lockstep.refused if phase == "check" else None
            return failure_of(step, phase, op, error, refused), lockstep
    try:
        lockstep.finish()
    except FINDINGS as error:
        return failure_of(step + 1, "finish", None, error), lockstep
    return None, lockstep


class AsWatched:
    """How a run observed its steps (``Lockstep.unwatched`` and ``checked_after``, by identity), as a way
    to run a sequence of its operations (``execute``'s signature): a step the run applied unobserved is so
    again, and checked after only where the run checked it; every other step is observed and checked. A
    failure that only a run observing less often shows (a backend settling counts lazily, where an
    observation settles them) so replays, and shrinks, instead of vanishing under every-step checks.
    ``like(new, old)``: ``new``, an operation made from ``old`` (renamed, simplified, joined, or standing
    in for it), observed as ``old`` was; the shrinker calls it for each such operation it makes."""

    def __init__(self, unwatched: dict[int, O.Op], checked_after: dict[int, O.Op]):
        # the operations themselves are kept: no id is reused while this lives
        self.unwatched, self.checked_after = dict(unwatched), dict(checked_after)

    def __call__(self, factory: Factory, config: Config, ops: list[O.Op],
                 lockstep: Lockstep | None = None) -> tuple[Failure | None, Lockstep]:
        return execute(factory, config, ops, lockstep=lockstep, watch=lambda step, op, _: id(op) not in self.unwatched,
                       checked=lambda op: id(op) in self.checked_after)

    def observed(self, op: O.Op) -> O.Op | None:
        """A copy of unobserved ``op`` run observed, or None where it is observed already: the shrinker
        tries it, and keeps it where the failure still shows (a mark that nothing needs is noise)."""
        return replace(op) if id(op) in self.unwatched else None

    def like(self, new: O.Op, old: O.Op, checked: bool = True) -> O.Op:
        """``new`` observed as ``old`` was; checked after as ``old`` was only where ``checked``."""
        if id(old) in self.unwatched:
            self.unwatched[id(new)] = new
            if checked and id(old) in self.checked_after:
                self.checked_after[id(new)] = new
        return new

    def leave(self, op: O.Op, checked: bool) -> None:
        """Have ``op`` run unobserved, and checked after where ``checked`` (a run choosing as it goes)."""
        self.unwatched[id(op)] = op
        if checked:
            self.checked_after[id(op)] = op

    @classmethod
    def from_steps(cls, ops: list[O.Op], unobserved: Iterable[int], checked: Iterable[int]) -> "AsWatched":
        """How a file says its sequence ran: ``unobserved`` and ``checked`` are step numbers (from 1) in ``ops``."""
        return cls({id(ops[step - 1]): ops[step - 1] for step in unobserved},
                   {id(ops[step - 1]): ops[step - 1] for step in checked})

    def steps(self, ops: list[O.Op]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The step numbers (from 1) of ``ops`` run unobserved, and of those checked after: for a file."""
        return (tuple(step for step, op in enumerate(ops, 1) if id(op) in self.unwatched),
                tuple(step for step, op in enumerate(ops, 1) if id(op) in self.checked_after))


CHECK_BUDGET = 16
"""``spaced_checks``: checking may cost up to this many positions per operation (and per token written)."""


class SpacedChecks:
    """Which steps a long replay checks, so that checking costs time linear in the file.

    A check reads every live position, so checking after every step of a sequence that grows
    one context costs the square of its length (2,000 one-token extends: a minute). Here a step
    is checked once the operations since the last check (one unit each, plus one per token
    they carry) times ``budget`` reach the live positions a check reads: every step while the
    cache holds fewer than ``budget`` positions, then spaced so the reading stays within
    ``budget`` per unit. Steps in ``always`` (the recorded failure's) are always checked.
    ``checked`` and ``positions`` count what was checked, for whoever wants to know.
    """

    def __init__(self, budget: int = CHECK_BUDGET, always: Iterable[int] = ()):
        self.budget, self.always = budget, set(always)
        self.last = 0            # the last checked step
        self.work = 0            # units since then
        self.checked = self.positions = 0

    def __call__(self, step: int, op: O.Op, lockstep: Lockstep) -> bool:
        self.work += 1 + len(getattr(op, "tokens", ()))
        live = sum(len(ref) for _, ref in lockstep.live.values()) + len(lockstep.live)
        if step in self.always or step + 1 in self.always or self.work * self.budget >= live:
            self.last, self.work = step, 0
            self.checked += 1
            self.positions += live
            return True
        return False


def spaced_checks(factory: Factory, config: Config, ops: list[O.Op], on_step: StepHook | None = None,
                  schedule: SpacedChecks | None = None,
                  on_start: Callable[[int, O.Op], None] | None = None,
                  quiet: AsWatched | None = None) -> tuple[Failure | None, Lockstep]:
    """``execute`` with ``SpacedChecks``; a failure seen at a check is then pinned to its first
    step by running the sequence again, checking every step since the check before it (and up to
    that check, observing exactly as the first run did: observing settles what a backend keeps
    lazily, so observing less would change what the re-run meets). ``on_start(step, op)`` is told of
    each step before it is applied. ``quiet``: the steps the run that found the failure left
    unobserved (``Replay.runner``), left so in both runs, whatever the schedule, and checked after
    where it checked them; none of them is a step to pin the failure to."""
    schedule = schedule or SpacedChecks()
    watched: list[int] = []
    unwatched = {} if quiet is None else quiet.unwatched
    checked = None if quiet is None else (lambda op: id(op) in quiet.checked_after)

    def watch(step, op, lockstep):
        if on_start is not None:
            on_start(step, op)
        if id(op) in unwatched:
            return False
        if schedule(step, op, lockstep):
            watched.append(step)
            return True
        return False

    failure, lockstep = execute(factory, config, ops, on_step, watch=watch, checked=checked)
    if failure is None or failure.phase == "finish":
        return failure, lockstep
    since = max((step for step in watched if step < failure.step), default=0)
    if all(id(op) in unwatched for op in ops[since:failure.step - 1]):
        return failure, lockstep        # no step the schedule left unchecked lies between
    before = set(watched)

    def again_watch(step, op, lockstep):
        if on_start is not None:
            on_start(step, op)
        return (step in before or step > since) and id(op) not in unwatched
    again, again_lockstep = execute(factory, config, ops[:failure.step], watch=again_watch, checked=checked)
    if again is not None and again.phase != "finish":
        return again, again_lockstep
    return failure, lockstep


def failure_of(step: int, phase: str, op: O.Op | None, error: BaseException, refused: str | None = None) -> Failure:
    """How ``error``, met at ``step`` in ``phase`` (running ``op``, which both sides refused with the error
    class ``refused`` where given), broke a run. Where the suite's own probe after the step raised it,
    that is said (``found_by``): a shrunk report kept only the failing call."""
    invariant = error.invariant if isinstance(error, InvariantViolation) else None
    found_by = getattr(error, "found_by", "") or getattr(error, "raised_by_probe", "")
    shown = None if op is None else f"{op}{REFUSED}{refused}" if refused else str(op)
    return Failure(step, phase, shown, type(error).__name__, invariant, str(error), raised_at(error), found_by)


# -- the file format ---------------------------------------------------------------------

def config_to_json(config: Config) -> dict:
    return asdict(config)


def config_from_json(data: dict) -> Config:
    """A replay file's configuration, checked as a cache would check it (``ConfigError`` if not)."""
    data = dict(data)
    config = Config(layout=Layout(**data.pop("layout")), **data)
    check_page_tokens(config.page_tokens)
    check_precision(config.precision)
    if config.page_tokens * config.layout.values_per_position * 4 > MAX_REPLAY_PAGE_BYTES:
        raise ReplayFileError(f"page_tokens {config.page_tokens} at {config.layout} makes pages larger than "
                              f"MAX_REPLAY_PAGE_BYTES ({MAX_REPLAY_PAGE_BYTES})")
    for name, low in (("arena_pages", 0), ("max_entries", 1)):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"{name} must be an int >= {low}, got {value!r}")
    return config


def _check_op(index: int, op: O.Op) -> O.Op:
    """Fields of the right kind: ints where ints go, token tuples of ints, handle strings;
    otherwise the file is at fault, not the backend that would run it."""
    for f in fields(op):
        value = getattr(op, f.name)
        if f.type in ("str", str):
            ok = isinstance(value, str)
        elif f.name == "tokens":
            ok = isinstance(value, tuple) and all(type(t) is int for t in value)
        elif f.type in ("int", int):
            ok = type(value) is int
        else:
            continue
        if not ok:
            raise ReplayFileError(f"operation {index} ({op.kind}): field {f.name} is {value!r}")
    return op


def checked_failure(failure: Failure) -> Failure:
    """The recorded failure's fields of the right kind, named when not: a step of "x" was a bare
    TypeError out of the step comparison, and a step of -1 read as a failure the backend no longer shows."""
    checks = (("step", type(failure.step) is int and failure.step >= 0), ("phase", isinstance(failure.phase, str)),
              ("op", failure.op is None or isinstance(failure.op, str)),
              ("error", isinstance(failure.error, str)), ("message", isinstance(failure.message, str)),
              ("invariant", failure.invariant is None or type(failure.invariant) in (int, str)),
              ("where", isinstance(failure.where, str)), ("found_by", isinstance(failure.found_by, str)))
    for name, ok in checks:
        if not ok:
            raise ReplayFileError(f"malformed replay file: its failure's {name} is {getattr(failure, name)!r}")
    return failure


def to_json(replay: Replay) -> dict:
    return {
        "format": FORMAT,
        "backend": replay.backend,
        "config_name": replay.config.name,
        "config": config_to_json(replay.config),
        "seed": replay.seed,
        "minimised": replay.minimised,
        "original_steps": replay.original_steps,
        "failure": None if replay.failure is None else failure_to_json(replay.failure),
        **replay.extra,
        **({"unobserved": list(replay.unobserved), "checked_after": list(replay.checked_after)}
           if replay.unobserved else {}),
        "ops_sha256": ops_digest([op.to_json() for op in replay.ops], replay.unobserved, replay.checked_after),
        "ops": [op.to_json() for op in replay.ops],
    }


def failure_to_json(failure: Failure) -> dict:
    """A failure's fields for a file; ``found_by`` only where a probe found it, so a file of a failure
    found otherwise reads in versions from before the field (their ``Failure`` refuses it: s68/final F5)."""
    data = asdict(failure)
    if not data["found_by"]:
        del data["found_by"]
    return data


def ops_digest(ops: list, unobserved: Iterable[int] = (), checked: Iterable[int] = ()) -> str:
    """The operations' fingerprint a file carries: a replay of an edited file is told apart from the run
    that wrote it (``Replay.edited``). Not a signature: it guards against accidents, not an adversary.
    The steps run unobserved count as part of the operations (the same ones observed may pass); a file
    with none has the fingerprint of its operations alone, as files from before the field."""
    unobserved, checked = list(unobserved), list(checked)
    data = {"ops": ops, "unobserved": unobserved, "checked_after": checked} if unobserved else ops
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def unobserved_steps(data: dict, count: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A record's ``unobserved`` and ``checked_after`` step numbers (a replay file's, a journal's run; absent:
    none): each a list of increasing numbers of its ``count`` operations, the second within the first; else
    ``ReplayFileError`` naming which."""
    lists = []
    for name in ("unobserved", "checked_after"):
        steps = data.get(name, [])
        if (not isinstance(steps, list) or any(type(step) is not int for step in steps)
                or any(a >= b for a, b in zip(steps, steps[1:]))
                or (steps and not 1 <= steps[0] <= steps[-1] <= count)):
            raise ReplayFileError(f"malformed replay file: its {name!r} must be a list of increasing step numbers "
                                  f"from 1 to {count} (its operations), not {one_line(repr(steps))[:120]}")
        lists.append(tuple(steps))
    unobserved, checked = lists
    if not set(checked) <= set(unobserved):
        raise ReplayFileError(f"malformed replay file: its 'checked_after' names step "
                              f"{min(set(checked) - set(unobserved))}, which its 'unobserved' does not")
    return unobserved, checked


def from_json(data: dict) -> Replay:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ReplayFileError(f"not a {FORMAT} file (format {found!r})")
    seed = data.get("seed")
    if seed is not None and type(seed) is not int:      # a sweep's seeds are ints; the name of a pasted test holds it
        raise ReplayFileError(f"malformed replay file: its 'seed' is {seed!r}, not an int")
    for name, kind, what in (("backend", str, "a string (a module or a .py file)"), ("ops", list, "a list of operations"),
                             ("config", dict, "an object of configuration fields"),
                             ("failure", (dict, type(None)), "an object of failure fields or null")):
        if name in data and not isinstance(data[name], kind):
            raise ReplayFileError(f"malformed replay file: its {name!r} is a {type(data[name]).__name__}, not {what}")
    try:
        bounds.check_op_count(len(data["ops"]))
        ops = [_check_op(i, O.op_from_json(op)) for i, op in enumerate(data["ops"], start=1)]
        failure = checked_failure(Failure(**data["failure"])) if data.get("failure") else None
        config = config_from_json(data["config"])
        bounds.check_memory(config, ops)
        unobserved, checked = unobserved_steps(data, len(ops))
        recorded = data.get("ops_sha256")      # files from before it carry none, and read as written
        edited = recorded is not None and recorded != ops_digest(data["ops"], unobserved, checked)
        return Replay(data["backend"], config, seed, ops, failure,
                      data.get("minimised", False), data.get("original_steps"), edited=edited,
                      unobserved=unobserved, checked_after=checked)
    except ReplayFileError:
        raise
    except KeyError as error:
        raise ReplayFileError(f"malformed replay file: it has no {error.args[0]!r} field") from error
    except (TypeError, ValueError, AttributeError, ConfigError) as error:
        raise ReplayFileError(f"malformed replay file: {error!r}") from error


def save(replay: Replay, path: Path) -> Path:
    """One operation per line, so a diff of two replay files reads like a diff of two scripts."""
    data = to_json(replay)
    ops = data.pop("ops")
    steps = "".join(f',\n  "{name}": {json.dumps(data.pop(name))}' for name in ("unobserved", "checked_after")
                    if name in data)        # a line each, however many steps
    head = json.dumps(data, indent=2)[:-2]
    body = ",\n".join("    " + json.dumps(op) for op in ops)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_own_file(path, f'{head}{steps},\n  "ops": [\n{body}\n  ]\n}}\n')
    return path


def load(path: Path) -> Replay:
    """A replay file, or ``ReplayFileError`` naming what is wrong with it (also past ``MAX_REPLAY_BYTES``,
    not UTF-8, nested too deeply to parse, or past a bound of ``replay_bounds``), before anything runs."""
    try:
        raw = read_regular(path, MAX_REPLAY_BYTES)         # a FIFO given as the file blocked for good
        if len(raw) > MAX_REPLAY_BYTES:
            raise ReplayFileError(f"replay file {str(path)!r} is larger than {MAX_REPLAY_BYTES} bytes (MAX_REPLAY_BYTES)")
        data = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError, RecursionError) as error:   # ValueError: JSON and UTF-8 errors
        raise ReplayFileError(f"cannot read replay file {str(path)!r}: {error}") from None
    return from_json(data)


# -- replay, step by step ----------------------------------------------------------------

def replay(replay: Replay, factory: Factory, out: Callable[[str], None] = print,
           time_limit: float | None = None, every_step: bool = False,
           on_start: Callable[[int, O.Op], None] | None = None) -> Failure | None:
    """Re-run a replay's sequence, printing each step and, on failure, the broken invariant
    with the live contexts' engine and reference contents side by side.

    Invariants are checked on ``SpacedChecks``' schedule (the recorded failure's step always),
    or after every step with ``every_step``; a file that records steps run unobserved (a seeded run's)
    is replayed observing every other step, as the run that recorded its failure observed them
    (``runs._pinned``: spaced, fewer observations would change what a lazy backend has settled). Past ``time_limit`` seconds the run stops with
    ``RunTimeout`` (a backend stuck inside C is not interrupted: ``replay_process`` runs a replay
    in a process of its own, watched from outside). ``on_start(step, op)`` is told of each step
    before it is applied. The steps the file records as run unobserved are so here too, whatever the
    schedule, and marked as a counterexample marks them."""
    quiet = replay.runner() if replay.unobserved else None

    def show(step, op, handle, lockstep):
        made = f"  -> {handle}" if handle else ""
        _, marked, refused = lockstep.history[-1].partition(REFUSED)     # as a counterexample marks it
        unseen = "" if quiet is None or id(op) not in quiet.unwatched else (
            UNOBSERVED + (CHECKED if id(op) in quiet.checked_after else ""))
        out(f"  {step:>4}  {op}{made}" + (f"{REFUSED}{refused}" if marked else "") + unseen)
    out(f"replaying {len(replay.ops)} operations, {replay.config.name}, page_tokens {replay.config.page_tokens}")
    if quiet is not None:
        out(f"{len(replay.unobserved)} of them with nothing observed before them, as the run that found the failure "
            f"ran them (marked \"{UNOBSERVED.strip()}\"; observing may settle what a backend keeps lazily)")
    recorded = getattr(replay.failure, "step", None)
    always = (recorded,) if type(recorded) is int else ()
    schedule = SpacedChecks(math.inf if every_step or quiet is not None else CHECK_BUDGET, always)
    lockstep = None
    with Deadline(time_limit) as deadline:
        try:
            failure, lockstep = spaced_checks(_building(factory), replay.config, replay.ops, show, schedule,
                                               on_start, quiet)
        except RunTimeout:
            failure = None
        except _BuildFailed as failed:      # the factory failed to build the cache: a finding, as in a sweep
            failure = failure_of(0, "build", None, failed.__cause__)
    if deadline.fired or (failure is not None and failure.error == RunTimeout.__name__):
        raise RunTimeout(f"the replay did not finish within {time_limit:g} s (--time-limit)")
    if failure is None:
        if quiet is not None:
            checked = schedule.checked + len(replay.checked_after)
            out(f"every invariant holds (checked after {checked} of {len(replay.ops)} steps: every step but the "
                f"file's unobserved ones, and those of them its run checked after)")
        else:
            out(f"every invariant holds (checked after {schedule.checked} of {len(replay.ops)} steps; "
                f"--every-step checks them all)" if schedule.checked < len(replay.ops) else "every invariant holds")
        return None
    out("")
    out(f"FAILED {failure}")
    if lockstep is None:
        return failure
    out("contexts, engine vs reference:")
    for line in describe(lockstep):
        out(line)
    out("pages, as the engine reports them:")
    for line in describe_pages(lockstep):
        out(line)
    return failure


class _BuildFailed(Exception):
    """The factory raised (or exited) while building a replay's cache: its ``__cause__``, a finding."""


def _building(factory: Factory) -> Factory:
    """``factory``, whose failures to build a cache come out as ``_BuildFailed``: told apart from
    whatever else may raise around a replay's steps (the file's faults, a hook's bugs)."""
    def build(config: Config):
        try:
            return factory(config)
        except FINDINGS as error:
            raise _BuildFailed() from error
    return build


def describe(lockstep: Lockstep) -> list[str]:
    """The live contexts as engine vs reference: length, tokens, and the first differing value."""
    lines = []
    for handle, (engine, ref) in lockstep.live.items():
        try:
            values, tokens = engine.read()
            values, tokens = to_numpy(values), list(np.asarray(tokens))
        except FINDINGS as error:       # the engine may be too broken to read (or exit)
            lines.append(f"  {handle}: engine read raised {error!r}")
            continue
        want_values, want_tokens = ref.read()
        verdict = "same"
        if [int(t) for t in tokens] != [int(t) for t in want_tokens]:
            verdict = f"tokens differ: engine {[int(t) for t in tokens]} vs reference {[int(t) for t in want_tokens]}"
        elif values.shape != want_values.shape:
            verdict = f"shape differs: engine {values.shape} vs reference {want_values.shape}"
        elif not np.array_equal(values.view(np.uint32), want_values.view(np.uint32)):
            index = tuple(int(i) for i in np.argwhere(values.view(np.uint32) != want_values.view(np.uint32))[0])
            verdict = (f"position {index[0]} (index {index}): engine {values[index]!r} "
                       f"vs reference {want_values[index]!r}")
        lines.append(f"  {handle}: {len(want_tokens)} positions, tokens {[int(t) for t in want_tokens]}: {verdict}")
    return lines


def describe_pages(lockstep: Lockstep) -> list[str]:
    """Each page the engine reports: refcount, the holders that point at it (each with its handle, where
    known), arena slot."""
    try:
        obs = lockstep.engine.observe()
    except FINDINGS as error:
        return [f"  observe() raised {error!r}"]
    if obs is None or obs.pages is None or obs.holders is None:     # a black box: no 'pages' tier
        return ["  (the backend does not report its pages: it exposes no 'pages' tier)"]
    held: dict[int, list[str]] = {}
    for holder, pages in obs.holders.items():
        for pid in pages:
            held.setdefault(pid, []).append(lockstep.named(holder))
    lines = []
    for pid in sorted(set(obs.pages) | set(held)):
        page = obs.pages.get(pid)
        state = "NOT LIVE" if page is None else f"refcount {page.refcount}"
        slot = "" if page is None or page.slot is None else f", arena slot {page.slot}"
        lines.append(f"  page {pid}: {state}{slot}, held by {held.get(pid, [])}")
    lines.append(f"  allocated {obs.pages_allocated}, freed {obs.pages_freed}; "
                 + (f"arena out {sorted(obs.arena_out)}, free {sorted(obs.arena_free)}"
                    if obs.arena_out is not None and obs.arena_free is not None else "no arena reported"))
    return lines


# -- a replay as a regression test -------------------------------------------------------

def _found_as(failure: "Failure | None") -> str:
    """A pytest test's first line: the error and, for an invariant violation, which (a backend's own
    exception has none: "RuntimeError (invariant None)" read as if one were missing)."""
    if failure is None:
        return "passing"
    return failure.error + ("" if failure.invariant is None else f" (invariant {failure.invariant})")


def _docstring(text: str) -> str:
    """``text`` as a string literal to open a function. Read from a replay file or a journal, it is data:
    an outside audit (s70) recorded an error name holding three double quotes, then a command, then three
    more, and the pasted test, its docstring closed early, ran the command."""
    if text.isprintable() and '"' not in text and "\\" not in text:
        return f'"""{text}"""'
    return repr(text)


def as_pytest(replay: Replay) -> str:
    """A ready-to-paste pytest test that fails while the bug is present. Everything in it that a replay
    file says is written as a literal (the backend, the operations, the configuration, the failure) or
    reduced to identifier characters (the test's name), so no file's text runs as code."""
    name = re.sub(r"\W", "_", f"test_sweep_{replay.config.name}_seed_{replay.seed}", flags=re.ASCII)
    module, _, attribute = replay.backend.partition(":")
    ops = ",\n".join(f"    {json.dumps(op.to_json())}" for op in replay.ops)
    if all(part.isidentifier() for part in module.split(".")) and (not attribute or attribute.isidentifier()):
        load, bind = f"from {module} import {attribute or 'factory'} as factory", ""
    else:           # a file path (``--backend path/backend.py``), or names no import statement could hold
        load, bind = "from kvstate.stateful.backends import load_factory", f"\nfactory = load_factory({replay.backend!r})\n"
    run, imported, steps = "execute(factory, config, ops)", "config_from_json, execute", ""
    if replay.unobserved:       # run as the sweep's run observed them: observed, a lazy backend's failure may vanish
        run, imported = "AsWatched.from_steps(ops, UNOBSERVED, CHECKED_AFTER)(factory, config, ops)", \
            "AsWatched, config_from_json"
        steps = (f"\n# Steps run with nothing observed before them (checked after: CHECKED_AFTER), as the sweep "
                 f"ran them.\nUNOBSERVED = {list(replay.unobserved)}\nCHECKED_AFTER = {list(replay.checked_after)}\n")
    return f'''{load}
from kvstate.stateful.replay import {imported}
from kvstate.stateful.ops import op_from_json
{bind}
OPS = [
{ops},
]
{steps}

def {name}():
    {_docstring(f"Found by kvstate sweep: {_found_as(replay.failure)}.")}
    config = config_from_json({json.dumps(config_to_json(replay.config))})
    ops = [op_from_json(op) for op in OPS]
    failure, _ = {run}
    assert failure is None, str(failure)
'''
