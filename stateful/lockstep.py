"""Run one engine and the reference side by side, one operation at a time.

``Lockstep.apply(op)`` performs ``op`` on both and insists they agree: on the
result, and on the error when the operation is refused. ``check()`` asserts the
invariants; ``finish()`` closes everything and asserts the cache is empty.
The Hypothesis machine, sweeps, replay and the exhaustive checker all drive
this one class, so they cannot drift apart.
"""

from __future__ import annotations

import re
from contextlib import suppress
from typing import Any, Callable, ClassVar

import numpy as np

from kvstate.reference import RefCache
from kvstate.spec import invariants
from kvstate.spec.errors import CapacityError, InvariantViolation, KVStateError, applicable_errors, spec_class
from kvstate.spec.protocol import Config, Factory
from kvstate.spec.semantics import (counts_only_contexts, evicts_for_room, hit_rule, may_refuse, reclaims,
                                    reclaims_once_warm)

from . import ops as O
from .frames import raised_at

FILL_PAGES_EACH = 16            # pages of each context the teardown of a refusing pool fills it with
FILL_BYTES = 64 << 20           # ... and the most float32 values it writes to, else it skips the fill
WHOLE_POOL_FITS = ("At the end of a sequence, every context closed and the tree cleared, contexts filling the "
                   "whole pool fit it: nothing the engine still counts (a page kept by a refused operation, a "
                   "truncate, a close or a clear, or a pool limit off by one) takes room.")
REFUSED = "    # refused: "      # what a history line ends with when both sides refused it, then the error class
UNOBSERVED = "    # unobserved"   # a history line's step applied with no observation before it and no check after
CHECKED = ", then checked"       # added to ``UNOBSERVED`` where a check followed the step


def _length(ctx: Any) -> int:
    """A reference context's length, 0 where there is none (an operation on a closed context)."""
    try:
        return len(ctx) if ctx is not None else 0
    except Exception:
        return 0


def to_numpy(values: Any) -> np.ndarray:
    """Engine reads may be torch tensors; compare them as NumPy."""
    if isinstance(values, np.ndarray):
        return values
    return values.detach().cpu().numpy()


def _shown(key) -> str:
    """An entry's key as a failure names it: its first 8 tokens."""
    key = list(key)
    return f"{key[:8]}"[:-1] + (", ...]" if len(key) > 8 else "]")


class Lockstep:
    # Operation kinds beyond the core ones (snapshot, restore) add a handler here:
    # handler(lockstep, op, side, cache, ctx) -> result
    extra_ops: ClassVar[dict[str, Callable]] = {}
    # ... and, where an operation names something a run makes (a snapshot), a check here:
    # check(lockstep, op) -> why the sequence, not the backend, is at fault (see ``sequence_fault``), or None
    sequence_faults: ClassVar[dict[str, Callable]] = {}

    def __init__(self, factory: Factory, config: Config):
        self.config = config
        self.engine = factory(config)
        self.reference = RefCache(config)
        self.live: dict[str, tuple[Any, Any]] = {}    # handle -> (engine context, reference context)
        self.created = 0
        self.steps = 0
        # The error class both sides refused the last operation with (the pool full, say), or None: a
        # directed check whose own step a declared pool refuses has nothing to say about it there.
        self.refused: str | None = None
        self.checks = 0
        self.history: list[str] = []    # the operations of this run, readable: a counterexample
        self.ops: list[O.Op] = []       # the same operations as data, for the shrinker
        self.failed_at: int | None = None    # len(history) when a check first failed
        self.failed_op: str | None = None    # the operation after which it failed
        self.failure: str | None = None      # what failed, in words
        self.holder_names: dict[str, str] = {}   # the backend's holder name -> our handle
        self._created_last: str | None = None
        self._context_holders: set[str] = set()
        self._observed: tuple[int, Any] | None = None    # (steps, observation) of the last check
        # ``reads_changed_only``: a check reads only the contexts an operation since the last check
        # could have changed (``_unchanged_since``); set by runs whose every operation goes through
        # ``apply`` (the machine, seeded runs), never by checks that call a backend directly.
        self.reads_changed_only = False
        # ``check_each_apply``: every ``apply`` is followed by ``check_books``, so broken books are
        # reported at the operation that broke them; set for the directed checks, whose full checks
        # come only where their scenario needs one (the machine and replays check every step in full).
        self.check_each_apply = False
        # Operations applied unwatched (``apply(op, False)``: no observation before them), by ``id`` (the
        # ops themselves are kept, so no id is reused), and of those the ones a check followed. A replay
        # of the run observes as it did (``replay.AsWatched``): observing settles what a backend keeps
        # lazily, so a replay observing more may not fail where the run did.
        self.unwatched: dict[int, O.Op] = {}
        self.checked_after: dict[int, O.Op] = {}
        self._touched: set[str] = set()          # handles the operations since the last check named
        self._verified: set[str] = set()         # handles whose values the last check vouched for
        self._unread: set[str] = set()           # handles a check skipped (``_unchanged_since``) and none read since
        self._holder_of: dict[str, str] = {}     # live handle -> the backend's holder name (``holder_names``)
        self._names_kept = True                  # False once the backend renamed a context (``_renamed``)
        self._books_seen: tuple[dict, dict] | None = None    # holders and lengths at the last ``_learn_holder_names``

    # -- operations ----------------------------------------------------------------

    def sequence_fault(self, op: O.Op) -> str | None:
        """Why ``op`` cannot run here through the sequence's own fault (it names a context that is not
        live, or a snapshot never taken), or None. A sequence read from data (a replay file, a
        journal, a shrinker's candidate) can be malformed; that is not a finding against a backend."""
        ctx = getattr(op, "ctx", None)
        if ctx is not None and ctx not in self.live:
            return f"names {ctx!r}, which is not live (live: {sorted(self.live)})"
        check = self.sequence_faults.get(op.kind)
        return None if check is None else check(self, op)

    def apply(self, op: O.Op, watched: bool = True) -> str | None:
        """Perform ``op`` on both sides. Returns the new handle for operations that create one.

        Both sides must agree on whether the operation is refused, and with which error class.
        A refusal must change nothing: ``watched`` compares whole observations before and after
        (a cost that grows with the cache); unwatched, only the live contexts' lengths. An unwatched
        step is observed neither before nor after (``check_each_apply``'s books are not checked): what
        a backend keeps lazily stays unsettled until the caller checks.
        """
        if not watched:
            self.unwatched[id(op)] = op
        handle = self._apply(op, watched)
        if self.check_each_apply and watched:
            self.check_books()
        return handle

    def _apply(self, op: O.Op, watched: bool) -> str | None:
        if getattr(op, "ctx", None) in self._unread:
            self._reported(lambda: self._read_before_use(op))
        before = self._observation_now() if watched else None
        self.refused = None
        self.steps += 1
        self.history.append(str(op) + ("" if watched else UNOBSERVED))
        self.ops.append(op)
        self._created_last = None
        # One draw of the op's values, a copy for each side: a backend that wrote into its argument
        # must not change what the reference is given. The engine's copy comes in one of several
        # memory layouts (``ops.laid_out``), as a caller's K/V come: transposed views, strided slices.
        values = self._values_of(op)
        if hasattr(op, "ctx"):
            self._touched.add(op.ctx)
        judged = self._both_sides(op, before,
                                  lambda: self._perform(op, 0, self.engine,
                                                        None if values is None else O.laid_out(values, op.seed)),
                                  lambda: self._perform(op, 1, self.reference, values))
        if judged is None:
            return None
        engine_result, ref_result = judged
        if before is not None and op.kind in ("extend", "overwrite") and not op.tokens:
            self._zero_length_write_changed_nothing(op, before)
        if op.kind == "match" and engine_result[1] != ref_result[1] \
                and not self._took_shorter_hit(engine_result[1], ref_result, tuple(op.tokens)):
            budget = (f"; with max_pages {self.config.max_pages}, the entries that stay are the budget's, each "
                      "counting its own pages as if nothing were shared" if self.config.max_pages else "")
            raise self._violation(5, f"{op}: engine matched {engine_result[1]} tokens, reference {ref_result[1]} "
                                     f"({self._hit_rule(engine_result[1], tuple(op.tokens))})"
                                     f"{_not_the_querys(engine_result[0], tuple(op.tokens))}{budget}"
                                     f"{self._reclaimed_note(engine_result[1], ref_result[1], tuple(op.tokens))}"
                                     f"{self._prefix_eviction_note()}")
        if op.kind == "close":
            del self.live[op.ctx]
            self._holder_of.pop(op.ctx, None)
            self._unread.discard(op.ctx)
        if op.creates:
            self.created += 1
            handle = f"c{self.created}"
            self.history[-1] = f"{handle} = {self.history[-1]}"
            self.live[handle] = (_context_of(engine_result), _context_of(ref_result))
            self._created_last = handle
            return handle
        return None

    def restore_beside(self, call: str, restore: Callable[[], Any], handle: str) -> str | None:
        """A restore a directed check runs on the engine itself (``restore()``, from a stream or path it
        holds) beside the reference's restore of ``handle``'s context, judged as ``apply`` judges the
        machine's restores: the reference is told how the engine answered on room (under
        values="prefix" its ways of sharing may disagree), and both restore (the new context's handle)
        or both refuse alike, the refusal changing nothing (None). Not an operation of ``ops``: its
        source is the check's own stream, which a replay could not read again."""
        before = self._observation_now()
        self.steps += 1
        self.history.append(call)
        saved = self.live[handle][1].snapshot()
        judged = self._both_sides(_DirectedRestore(call), before, restore, lambda: self.reference.restore(saved))
        if judged is None:
            return None
        engine_result, ref_result = judged
        self.created += 1
        new = f"c{self.created}"
        self.history[-1] = f"{new} = {call}"
        self.live[new] = (engine_result, ref_result)
        return new

    def _both_sides(self, op, before, engine: Callable[[], Any], reference: Callable[[], Any]) -> tuple | None:
        """``engine()``, then ``reference()``, for ``op``: both results, or None where both refused alike
        (the refusal held to changing nothing since ``before``); a violation where they differ."""
        engine_result, engine_error = _attempt(engine)
        # Where the declared semantics let a full pool go several ways, the reference follows the engine:
        # whether it refused for a full pool (None where it refused for another reason, no answer on room).
        self.reference.engine_refused = (isinstance(engine_error, CapacityError)
                                         if engine_error is None or isinstance(engine_error, CapacityError) else None)
        self.reference.engine_keys = self._kept_by_the_engine(op)
        try:
            ref_result, ref_error = _attempt(reference)
        finally:
            self.reference.engine_refused = self.reference.engine_keys = None
        if not same_refusal(engine_error, ref_error):
            engine_said = "accepted" if engine_error is None else f"{engine_error!r}{raised_at(engine_error)}"
            raise self._violation("errors", f"{op}: engine {engine_said}, reference {describe_refusal(ref_error)}"
                                            f"{self._refusal_hint(engine_error, ref_error)}")
        self.refused = None if engine_error is None else type(engine_error).__name__
        if engine_error is not None:
            self.history[-1] += f"{REFUSED}{self.refused}"
            self._unchanged_by_refusal(op, before, engine_error)
            return None
        return engine_result, ref_result

    def _refusal_hint(self, engine_error, ref_error) -> str:
        """What a difference on room may come from, whichever side refused: "" for other differences."""
        if isinstance(engine_error, CapacityError) and ref_error is None:
            return self._room_hint() + self._prefix_eviction_note()
        if engine_error is None and isinstance(ref_error, CapacityError):
            return ("; the engine had room the reference did not. An engine accepting here counts fewer pages "
                    "live than it holds: a page freed while a holder still lists it (a fork or hit that took no "
                    "reference on its pages, a close or truncate that let a shared page go), or an operation's "
                    "need counted lower than spec/semantics.py does (a copy of a shared page it writes forgotten)"
                    + self._prefix_eviction_note())
        return ""

    def _room_hint(self) -> str:
        """Why an engine may refuse for room where the reference had it: the books of both, as far as seen."""
        try:
            pages = self.engine.observe().pages
        except Exception:       # noqa: BLE001 - a hint: the refusal above is the finding, not observe's trouble
            pages = None
        engine = "" if pages is None else f", the engine {len(pages)} before it (it changed nothing)"
        sharing = self.reference.viable[0]        # counted the way the run still follows
        if counts_only_contexts(self.config.on_full):
            live = f"{self.reference.context_pages(sharing)} pages held by contexts (entries' are reclaimable)"
        else:
            live = f"{self.reference.live_pages(sharing)} pages live"
        return (f"; the reference had room: {live} of the pool's "
                f"{self.config.pool_limit} after it{engine}. An engine refusing here holds pages past their use "
                f"(an earlier refused operation, a close or truncate that kept some), counts the operation's "
                f"need higher than spec/semantics.py does (its new pages, and a copy of each shared page it writes), "
                f"or holds fewer pages than the pool it declares")

    def _shorter_hit_allowed(self, matched: int, ref_matched: int, query: tuple) -> bool:
        """Whether an engine's hit of ``matched`` positions, where the reference's holds ``ref_matched``, is
        one ``on_full="reclaim"`` allows: shorter, aligned as the declared ``match`` requires, only once
        the pool may have been short (``RefCache.pressed``: no engine forgets without pressure), and no
        shorter than the entries retained since it last may have been short give (``RefCache.least_hit``)."""
        if not (reclaims(self.config.on_full) and self.reference.pressed and 0 <= matched < ref_matched):
            return False
        if matched < self.reference.least_hit(query):
            return False
        if self.config.match == "block":
            return matched % self.config.block_tokens == 0
        if self.config.match == "entry":
            return matched == 0 or any(len(key) == matched and query[:matched] == key for key in self.reference.keys(bounded_out=True))
        return True

    def _took_shorter_hit(self, matched: int, ref_result: tuple, query: tuple) -> bool:
        """Where the shorter hit is allowed, the reference's hit context cut to the engine's ``matched``
        positions (the first of its own hit: values fixed by their tokens under values="prefix")."""
        if not self._shorter_hit_allowed(matched, ref_result[1], query):
            return False
        ref_result[0].truncate(matched)
        self.reference.hit_may_come_from_another(query, ref_result[0])
        return True

    def _reclaimed_note(self, matched: int, ref_matched: int, query: tuple) -> str:
        """Under on_full="reclaim", why this hit's length is still wrong: longer than any retained key
        allows, or shorter before the pool could have been short."""
        if not reclaims(self.config.on_full):
            return ""
        on_full = self.config.on_full
        if matched > ref_matched:
            return (f"; under on_full={on_full!r} a hit may be shorter than the reference's, never longer: no "
                    "retained key gives it")
        if not self.reference.pressed:
            pressure = "pages listed, or handed out since the start," if reclaims_once_warm(on_full) else "pages listed"
            return (f"; under on_full={on_full!r} a hit may be shorter only once the pool may have been short "
                    f"({pressure} plus a need passing it): none was yet, so the engine forgot an entry's pages "
                    "without pressure")
        least = self.reference.least_hit(query)
        if matched < least:
            return (f"; under on_full={on_full!r} an entry retained since the pool last may have been short keeps "
                    f"every page: the hit holds at least {least} positions")
        return ""

    def _tree_comparable(self) -> bool:
        """Whether the engine's entries are held to the reference's: not once a reclaiming pool may have been
        short (the engine keeps what its own policy keeps; the reference keeps everything)."""
        return not (reclaims(self.config.on_full) and self.reference.pressed)

    def _evictions_may_differ(self) -> bool:
        """Whether ways of counting pages may evict differently here: a pool that evicts, under values="prefix"
        (ways of sharing) or match="block" (an entry's pages past its last whole block kept or not)."""
        return ((self.config.values == "prefix" or self.config.match == "block")
                and evicts_for_room(self.config.on_full) and bool(self.config.pool_limit))

    def _kept_by_the_engine(self, op: O.Op) -> Callable[[], set | None] | None:
        """What reads the keys of the engine's entries after ``op`` (its tree tier; None without it), where
        the reference may need them to follow its evictions: an operation that allocates, under
        values="prefix" with a pool that evicts (ways of sharing pages that evict differently); else None.
        The reference calls it only where the ways still open would keep different entries."""
        if op.kind not in ("extend", "overwrite", "restore") or not self._evictions_may_differ():
            return None

        def keys() -> set | None:
            entries = self.engine.observe().entries
            return None if entries is None else {tuple(entry.key) for entry in entries}
        return keys

    def _values_of(self, op: O.Op):
        """The K/V an extend or overwrite writes: its seed's (``ops.values_for``), or under
        ``values="prefix"`` those fixed by each position and token (``ops.prefix_values``)."""
        if not hasattr(op, "seed"):
            return None
        if self.config.values == "prefix" and op.kind in ("extend", "overwrite"):
            if op.kind == "overwrite":
                start = op.start if isinstance(op.start, int) else 0
            else:
                ref = self.live.get(op.ctx, (None, None))[1]
                start = _length(ref)
            return O.prefix_values(self.config.layout, max(start, 0), op.tokens)
        return O.values_for(self.config.layout, len(op.tokens), op.seed)

    def _perform(self, op: O.Op, side: int, cache: Any, values=None):
        """Run ``op`` on one side: ``side`` 0 is the engine, 1 the reference; ``values`` are the K/V
        of an extend or overwrite (``ops.values_for`` of its seed)."""
        ctx = self.live[op.ctx][side] if hasattr(op, "ctx") else None
        kind = op.kind
        if kind == "allocate":
            return cache.allocate()
        if kind == "extend":
            return ctx.extend(list(op.tokens), values)
        if kind == "overwrite":
            return ctx.overwrite(op.start, list(op.tokens), values)
        if kind == "fork":
            return ctx.fork()
        if kind == "truncate":
            return ctx.truncate(op.n)
        if kind == "close":
            return ctx.close()
        if kind == "retain":
            return cache.retain(ctx)
        if kind == "match":
            return cache.match(list(op.tokens))
        if kind == "clear":
            return cache.clear()
        extra = self.extra_ops.get(kind)
        if extra is None:
            raise InvariantViolation("ops", f"no lockstep handler for operation {kind!r}")
        return extra(self, op, side, cache, ctx)

    # -- refusals change nothing ---------------------------------------------------------

    def _observation_now(self):
        """The engine's observation of the state before the next operation: the last check's,
        when nothing happened since, else a fresh one."""
        if self._observed is not None and self._observed[0] == self.steps:
            return self._observed[1]
        return self.engine.observe()

    def _unchanged_by_refusal(self, op: O.Op, before, error: BaseException) -> None:
        """A refused operation changes nothing observable: every tier of the observation, the
        counters (but those counting refusals), and the length of every live context. Without
        ``before`` (an unwatched step) only the lengths."""
        changed = self._change_since(before)
        if changed:
            raise self._violation("refusal", f"{op} was refused ({type(error).__name__}) but changed the "
                                             f"cache: {self._our_names(changed)}")

    def _zero_length_write_changed_nothing(self, op: O.Op, before) -> None:
        """README's zero-length writes row: a write of zero positions is accepted and changes
        nothing, so it may not allocate, copy or move a page any more than a refusal may."""
        changed = self._change_since(before)
        if changed:
            raise self._violation("zero-length write", f"{op} writes nothing but changed the cache: "
                                                       f"{self._our_names(changed)}")

    def _change_since(self, before) -> str | None:
        """The first observable difference from ``before`` (or, without it, in a live context's
        length), in words; None if there is none."""
        changed = None if before is None else observable_change(before, self.engine.observe())
        lengths = {handle: (len(engine), len(ref)) for handle, (engine, ref) in self.live.items()}
        return changed or next((f"{handle} has {mine} positions, {theirs} before"
                                for handle, (mine, theirs) in lengths.items() if mine != theirs), None)

    # -- invariants ------------------------------------------------------------------

    def _failed(self, error: BaseException) -> None:
        if self.failed_at is None:
            self.failed_at = len(self.history)
            self.failed_op = self.history[-1] if self.history else None
            self.failure = f"{type(error).__name__}: {error}"

    def _violation(self, invariant: int | str, message: str) -> InvariantViolation:
        """The violation to raise, recorded as this run's failure first."""
        violation = InvariantViolation(invariant, message)
        self._failed(violation)
        return violation

    def check(self) -> None:
        """Invariants 1-5 against the current state."""
        if self.ops and id(self.ops[-1]) in self.unwatched and id(self.ops[-1]) not in self.checked_after:
            self.checked_after[id(self.ops[-1])] = self.ops[-1]
            self.history[-1] = self.history[-1].replace(UNOBSERVED, UNOBSERVED + CHECKED, 1)
        self._reported(self._check)

    def check_books(self) -> None:
        """The books alone, from one observation and no reads: refcounts against holders, nothing
        held that is freed, the arena's size, and each holder's page count for its length."""
        self._reported(lambda: self._check_books(self.engine.observe()))

    def _reported(self, check: Callable[[], None]) -> None:
        """``check()``; what it raises is recorded as the run's failure, a violation in our handles' names."""
        try:
            check()
        except InvariantViolation as violation:
            renamed = self._violation(violation.invariant, self._our_names(violation.detail))
            with suppress(AttributeError):      # where the suite's probe saw it (``_probe_entries``)
                renamed.found_by = violation.found_by
            raise renamed from None
        except BaseException as error:
            self._failed(error)
            raise

    def _learn_holder_names(self, obs) -> None:
        """Which of the backend's holder names is which handle: the context holder that first
        appears right after an operation created a handle is that handle's.

        That holds while a context keeps its name. A backend may number its contexts by position
        (``ctx:N`` re-enumerated after a close, as ``examples/listcache.py`` does): from the first
        rename seen (``_renamed``) no name is trusted, and every check reads every context. Kept, the
        stale names sent a check reading only what a step could change to the wrong pages: an
        overwrite without copy-on-write into a page a fork shared went unread for the whole run."""
        if obs.holders is None or not self._names_kept:
            return
        if self._renamed(obs):
            self._names_kept = False
            self.holder_names.clear()
            self._holder_of.clear()
            return
        self._books_seen = (obs.holders, obs.lengths or {})
        now = obs.holders.keys() - {entry.holder for entry in obs.entries or ()}
        new = now - self._context_holders
        if self._created_last is not None and len(new) == 1:
            holder = new.pop()
            self.holder_names[holder] = self._created_last
            self._holder_of[self._created_last] = holder
        self._context_holders = now
        self._created_last = None

    def _renamed(self, obs) -> bool:
        """Whether a live context the run knows by name is under that name no more: the name is gone,
        or, with no operation on the context since the name was last seen, it lists other pages or
        another length (what a context no operation named keeps)."""
        if self._books_seen is None:
            return False
        (was_held, was_long), holders, lengths = self._books_seen, obs.holders, obs.lengths or {}
        for handle, name in self._holder_of.items():
            if name not in holders:
                return True
            if handle not in self._touched and (holders[name] != was_held.get(name)
                                                or lengths.get(name) != was_long.get(name)):
                return True
        return False

    def holder_of(self, handle: str) -> str | None:
        """The backend's holder name of live ``handle`` (learnt at the check after it was made), or None."""
        return self._holder_of.get(handle)

    def named(self, holder: str) -> str:
        """The backend's ``holder`` with the handle it is, as the operations name it (``ctx:3 (c2)``):
        the backend's own number alone says nothing about which context of the run it is."""
        handle = self.holder_names.get(holder)
        return holder if handle is None else f"{holder} ({handle})"

    def _our_names(self, message: str) -> str:
        for holder in self.holder_names:
            message = re.sub(rf"(?<![\w:]){re.escape(holder)}(?![\w:])", self.named(holder), message)
        return message

    def _check_books(self, obs) -> None:
        self._learn_holder_names(obs)
        invariants.check_arena_size(obs, self.config.arena_pages)
        invariants.check_structure(obs)
        invariants.check_page_counts(obs, self.config.page_tokens)

    def _check(self) -> None:
        # The contexts the operations named are read before ``observe()``, and their values copied as
        # read: an engine whose ``observe()`` finishes its pending writes (queued, say) and whose
        # ``read()`` does not passed every check, each of which observed first.
        named = {}
        for handle in [handle for handle in self.live if handle in self._touched]:
            values, tokens = self.live[handle][0].read()
            named[handle] = (values, np.array(to_numpy(values)), np.array(tokens))
        obs = self.engine.observe()
        self._check_books(obs)
        engine_reads, reference_reads = {}, {}
        last = self._observed[1] if self._observed is not None else None
        skip = self._unchanged_since(last, obs) if self.reads_changed_only else set()
        touched, self._touched = self._touched, set()
        returned = {}       # handle -> the values array ``read()`` returned, for ``_read_is_a_copy``
        for handle, (engine, ref) in self.live.items():
            if handle in named:
                returned[handle], values, tokens = named[handle]
                engine_reads[handle] = (values, tokens)
            elif handle in skip:
                continue
            else:
                values, tokens = engine.read()
                returned[handle] = to_numpy(values)
                engine_reads[handle] = (returned[handle], np.asarray(tokens))
            reference_reads[handle] = ref.contents()
        invariants.check_values(engine_reads, reference_reads)
        self._unread = (self._unread | skip) - engine_reads.keys()
        for handle in [handle for handle in engine_reads if handle in touched]:     # the run's order, not a set's
            self._read_is_a_copy(handle, to_numpy(returned[handle]), reference_reads[handle])
        # Every context read is also read through a window: a check reading all of them (a replay, the sweep's
        # pinning rerun) then finds whatever one reading only what changed finds (before an operation, at
        # finish), at that step or earlier; a window read only where a step named the context let a sweep
        # record failures that its own replay could not reach (the s69 sweep audit).
        for handle in engine_reads:
            self._ranged_read(handle, reference_reads[handle])
        expected = self.reference.eviction_order()
        try:
            if self._tree_comparable():
                invariants.check_tree(obs, expected, self.config.block_tokens if self.config.match == "block" else 0)
        except InvariantViolation as differs:
            if "eviction order" not in differs.detail or not evicts_for_room(self.config.on_full):
                raise
            hint = _kept_differently({tuple(entry.key) for entry in obs.entries}, {tuple(key) for key, _ in expected})
            raise InvariantViolation(5, f"{differs.detail}{hint}") from None
        if obs.entries is None:
            self._probe_entries(expected)
            obs = self.engine.observe()      # the probes' hits came and went: observe what is left
            try:        # checked now, so books a probe left wrong are the probe's, not the next step's
                self._check_books(obs)
            except InvariantViolation as wrong:
                keys = [key for key, _tick in expected]
                shown = ", ".join(f"match({_shown(key)})" for key in keys[:3])
                raise InvariantViolation(wrong.invariant, f"{wrong.detail}; seen right after the suite probed the "
                                                          f"entries after this step ({shown}"
                                                          f"{', ...' if len(keys) > 3 else ''}, each hit closed "
                                                          f"at once): such a match or the close of its hit left "
                                                          f"it so") from None
        self.checks += 1
        # Observed again after the check's own reads (the next operation's "before": a backend may count
        # reads among its counters, and a refusal that changes nothing was blamed for the suite's reads)
        self._observed = (self.steps, self.engine.observe() if engine_reads else obs)
        self._verified = set(self.live)

    def _read_before_use(self, op: O.Op) -> None:
        """A context the checks skipped since it was last read is read before an operation names it, whole
        and through a window: a write no observation showed (into a page only its holder lists, by an
        operation that named another) is caught in the run before the operation can close, truncate or
        overwrite it away (the full read at ``finish`` sees only what is still there)."""
        handle = op.ctx
        engine, ref = self.live[handle]
        values, tokens = engine.read()
        expected = ref.contents()
        try:
            invariants.check_values({handle: (to_numpy(values), np.asarray(tokens))}, {handle: expected})
            self._ranged_read(handle, expected)
        except InvariantViolation as differs:
            raise InvariantViolation(4, f"{differs.detail}; read right before {op}, the checks having skipped "
                                        f"{handle} since its last read (no operation since named it or its "
                                        f"pages)") from None
        self._unread.discard(handle)
        self._observed = (self.steps, self.engine.observe())    # after the reads: see the end of ``_check``

    def _read_is_a_copy(self, handle: str, values: np.ndarray, expected) -> None:
        """What ``read`` returned is the caller's: scribbling over it must leave the context as it was.
        Done for the contexts the last operations named (a read each), so a read that returns a view
        of storage is caught at the step it is made, not only by the directed ``no aliasing`` check."""
        if not values.size or not values.flags.writeable:
            return
        values.fill(np.nan if values.dtype.kind == "f" else -1)
        again, tokens = self.live[handle][0].read()
        try:
            invariants.check_values({handle: (to_numpy(again), np.asarray(tokens))}, {handle: expected})
        except InvariantViolation as differs:
            raise InvariantViolation(4, f"writing into the array read() returned for {handle} changed the "
                                        f"context: the read aliases storage instead of copying it: "
                                        f"{differs.detail}") from None

    def _ranged_read(self, handle: str, expected) -> None:
        """``read(start, stop)`` of a context a check reads holds what the whole read holds there.
        The window moves with the step: its stop on an inner page boundary where the context has one
        (``read(0, page)``, a prefix read, is where ``stop // page`` for ``(stop - 1) // page`` goes
        wrong), its start anywhere before it; a context within one page, a window inside it."""
        want_values, want_tokens = expected
        n, page, step = len(want_tokens), self.config.page_tokens, self.steps
        if n < 2:
            return      # its one window is the whole read, already compared
        inner = (n - 1) // page         # page boundaries strictly inside the context
        stop = page * (1 + step % inner) if inner else n - step % 2
        start = (step // 2) % stop
        values, tokens = self.live[handle][0].read(start, stop)
        call = f"{handle}.read({start}, {stop})"
        try:
            invariants.check_values({call: (to_numpy(values), np.asarray(tokens))},
                                    {call: (want_values[start:stop], want_tokens[start:stop])})
        except InvariantViolation as differs:
            raise InvariantViolation(4, f"{differs.detail}, positions counted from the window's start, "
                                        f"{start}: a read of positions [{start}, {stop}) differs from the same "
                                        f"positions of {handle}.read(), which the reference agrees with") from None

    def _unchanged_since(self, last, obs) -> set[str]:
        """The live handles whose values no operation since the last check can have changed, by the
        pages tier: the check vouched for them then, and their holder lists the same pages at the same
        length, none of which an operation since then could have written. A page could have been
        written if it is, or was, held by a context an operation named, or by a holder that came,
        went or changed, or if its ``PageView`` changed. Empty (read everything) without the pages
        tier, where a named handle's holder is not known, or without the tree tier (entries are then
        probed through ``match`` between observations): a black box is read in full."""
        if last is None or obs.pages is None or obs.holders is None or obs.lengths is None or obs.entries is None \
                or last.pages is None or last.holders is None or last.lengths is None:
            return set()
        holder_of, live, touched = self._holder_of, self.live, self._touched
        holders, lengths, was_held, was_long = obs.holders, obs.lengths, last.holders, last.lengths
        for handle in touched:
            if handle in live and handle not in holder_of:
                return set()
        # The candidates first: vouched for, not named, the same pages at the same length. Only
        # their pages can make a difference, so only those pages' views are compared below.
        candidates: dict[str, tuple] = {}
        for handle in self._verified:
            if handle in touched or handle not in live:
                continue
            holder = holder_of.get(handle)
            pages = holders.get(holder)
            if pages is None or was_held.get(holder) != pages:
                continue
            length = lengths.get(holder)
            if length == was_long.get(holder) and length == len(live[handle][1]):
                candidates[handle] = pages
        if not candidates:
            return set()
        suspect: set = set()
        for holder, pages in holders.items():
            was = was_held.get(holder)
            if was != pages or lengths.get(holder) != was_long.get(holder):
                suspect.update(pages)
                suspect.update(was or ())
        for holder in was_held.keys() - holders.keys():
            suspect.update(was_held[holder])
        for handle in touched:
            holder = holder_of.get(handle)
            suspect.update(holders.get(holder, ()))
            suspect.update(was_held.get(holder, ()))
        viewed, was_viewed = obs.pages, last.pages
        for pid in set().union(*candidates.values()) - suspect:
            if pid in viewed:
                view, before = viewed[pid], was_viewed.get(pid)
                if before is not view and before != view:      # an engine may hand back the same view
                    suspect.add(pid)
        return {handle for handle, pages in candidates.items() if suspect.isdisjoint(pages)}

    def _hit_rule(self, matched: int, query: tuple) -> str:
        """The declared rule a hit of ``matched`` positions for ``query`` breaks or is held to (``hit_rule``)."""
        keys = [len(key) for key, _tick in self.reference.eviction_order() if tuple(query[:len(key)]) == tuple(key)]
        return hit_rule(self.config.match, self.config.block_tokens, matched, len(query), keys)

    def _prefix_eviction_note(self) -> str:
        """Where a black-box report of the entries a backend keeps can be a known false rejection, the note
        that says so: an evicting pool under ``values="prefix"`` or ``match="block"``, whose evictions the
        reference follows only through the tree tier (``_kept_by_the_engine``; README, Full pools under
        values="prefix")."""
        if not self._evictions_may_differ() or self._engine_shows_entries():
            return ""
        who = " or".join(([" a backend whose retain shares the tree's pages (values='prefix')"]
                          if self.config.values == "prefix" else []) +
                         ([" a backend keeping no entry's pages past its last whole block (match='block')"]
                          if self.config.match == "block" else []))
        return (f". Here{who} may evict less than the reference counts, or other entries; the "
                "reference follows its evictions only through the tree tier (observe().entries): "
                "without it this can be a false rejection (README: Full pools under values='prefix')")

    def _engine_shows_entries(self) -> bool:
        """Whether the engine has the tree tier (``observe().entries``), through which the reference follows
        its evictions; False where observing fails (the failure being reported is the finding)."""
        try:
            return self.engine.observe().entries is not None
        except Exception:       # noqa: BLE001 - a note's condition, not a check
            return False

    def _probe_entries(self, order: list | None = None) -> None:
        """Without the tree tier, entries are seen through ``match``: the key of each entry the
        reference holds is matched on both sides, oldest first, and the hits compared (matched count
        and every value), then closed. Each match stamps what it hits, so a correct engine's order is
        unchanged; an engine whose order had gone wrong (a step stamped another entry, or none) has
        the reference's afterwards, and no later eviction shows that step's mistake. Probing at
        teardown only was tried (2026-12-06): on the audit's two planted stamp bugs, sweeps found them
        less often (9 and 70 of 400 runs against 15 and 141), since the probes' own partial and tied
        hits are where such bugs show. A directed row builds the case the probes hide instead."""
        for key, _tick in self.reference.eviction_order() if order is None else order:    # ``order``: the check's own
            try:
                engine_hit, engine_matched = self.engine.match(list(key))
            except Exception as error:      # the suite's call, not the step's: said so beside "failing call"
                # A hit takes no page (it shares its entry's), so no full pool refuses one: where one does,
                # the engine copies on a hit, which a refusing pool cannot afford (README: "cached pages").
                room = (": a hit shares its entry's pages and allocates none, so no full pool refuses it"
                        if isinstance(error, CapacityError) else "")
                with suppress(AttributeError):      # an exception type without a __dict__ goes unannotated
                    error.suite_probe = (f"raised by the suite's own match of entry {list(key)}, probing the "
                                         f"entries after the failing call{room}")
                    # what a replayed (shrunk) report names beside its failing call (``replay.failure_of``)
                    error.raised_by_probe = f"the suite's match of entry {_shown(key)} after it, which raised it{room}"
                raise
            ref_hit, ref_matched = self.reference.match(list(key))
            where = f"probing entry {list(key)} through match (an entry, its recency or its content differ)"
            try:
                if engine_matched != ref_matched and not self._took_shorter_hit(engine_matched, (ref_hit, ref_matched), key):
                    # Whatever the step: an engine that copies an entry's pages (a retain, a hit) takes pages there too.
                    evicted = evicts_for_room(self.config.on_full) and engine_matched < ref_matched
                    pool = _POOL_EVICTION if evicted else ""
                    raise InvariantViolation(5, f"{where}: the engine's hit holds {engine_matched} positions, "
                                                f"the reference's {ref_matched} ({self._hit_rule(engine_matched, key)})"
                                                f"{pool}{self._prefix_eviction_note()}"
                                                f"{self._reclaimed_note(engine_matched, ref_matched, key)}")
                values, tokens = engine_hit.read()
                try:
                    invariants.check_values({"the hit": (to_numpy(values), np.asarray(tokens))},
                                            {"the hit": ref_hit.read()})
                except InvariantViolation as differs:
                    taken = self._entry_reading(to_numpy(values), np.asarray(tokens))
                    given = self._entry_reading(*ref_hit.read())
                    if taken is not None and given is not None and taken != given:     # whole values, another entry's
                        raise InvariantViolation(5, f"{where}: the hit holds the values of entry {_shown(taken)}, "
                                                    f"where {_shown(given)} gives it, the most recently used of the "
                                                    f"entries sharing all of its positions (under block: reaching "
                                                    f"its last whole block): a hit or retain that left its entry's "
                                                    f"recency as it was (not stamped), or a tie resolved to another "
                                                    f"entry (or, rarer, a write that reached a page they share)") from None
                    tie = ("; or the hit came from another entry than the reference's: of the entries sharing all "
                           "of its positions (under block: reaching its last whole block), the most recently used "
                           "gives it" if self.config.match != "entry" else "")
                    raise InvariantViolation(5, f"{where}: {differs.detail}; an entry holds what its context held "
                                                f"when retained: a write through a holder sharing its pages (no "
                                                f"copy-on-write), or a page reused while the entry kept it, "
                                                f"changes it{tie}") from None
            except InvariantViolation as error:     # the step before is the failing call; this probe saw it
                error.found_by = f"the suite's match of entry {_shown(key)} after it"
                raise
            finally:
                engine_hit.close()
                ref_hit.close()

    def _entry_reading(self, values: np.ndarray, tokens: np.ndarray) -> tuple | None:
        """The key of the entry the reference holds whose first positions read exactly ``values`` and
        ``tokens`` (where a hit holding them was taken from), the most recently used of several; or None."""
        for other, twin, _tick in sorted(self.reference.entries, key=lambda entry: entry[2], reverse=True):
            if len(other) < len(tokens):
                continue
            want_values, want_tokens = twin.contents()
            try:
                invariants.check_values({"hit": (values, tokens)},
                                        {"hit": (want_values[:len(tokens)], want_tokens[:len(tokens)])})
            except InvariantViolation:
                continue
            return other
        return None

    def finish(self) -> None:
        """6. Close every context, clear the tree: cache and arena must be empty.

        Every live context is read first, whole, through a window and scribbled over, as if the last
        step had named it: a bug that writes into a page no observation shows changed (a context's
        private page, held by nothing the operation named) is then still caught in the run, and shrunk
        from there (a context an operation named was read right before it: ``_read_before_use``), and so
        is a window read gone wrong in a context whose storage another's operation moved."""
        if self.live:
            skipping, self.reads_changed_only = self.reads_changed_only, False
            self._touched.update(self.live)
            try:
                self.check()
            finally:
                self.reads_changed_only = skipping
        if self.engine.observe().entries is not None:
            # With the tree tier each check compares the entries' keys and order, not what they hold
            # (without it every check probes them through match): an entry whose pages a write
            # changed in place is caught here, once a run, and shrunk from there.
            self._reported(self._probe_entries)
            # The probes' hits came and went: the closes below compare with what is left, observed now (the
            # last check's observation, kept for the next step, would leave them run with none before them:
            # a lazy backend's queued changes then met a close no printed step showed unobserved; s74 audit).
            self._observed = (self.steps, self.engine.observe())
        for handle in list(self.live):
            self.apply(O.Close(handle))
        self.engine.clear()
        self.reference.clear()
        self.history.append("clear()    # teardown, then invariant 6")
        self._reported(lambda: invariants.check_empty(self.engine.observe()))
        self.checks += 1
        if self.config.pool_limit and may_refuse(self.config.on_full):
            self._the_whole_pool_fits()

    def _the_whole_pool_fits(self) -> None:
        """After teardown, contexts filling the whole pool: an empty pool holds them. A page the engine
        still counts (kept by a refused operation, a truncate, a close or a clear) is refused here,
        where an engine that exposes no pages, nor counts of them, shows it nowhere else (invariant 6
        reads those). At most ``FILL_PAGES_EACH`` pages a context (an engine may cap a context's length
        below its pool), and not at all past ``FILL_BYTES`` of values (a real engine's pool of thousands
        of pages)."""
        config = self.config
        if config.pool_limit * config.page_tokens * config.layout.values_per_position * 4 > FILL_BYTES:
            return
        handles = []
        try:
            for first in range(0, config.pool_limit, FILL_PAGES_EACH):
                handles.append(self.apply(O.Allocate()))
                if not first:
                    self.history[-1] += "    # teardown: contexts filling the whole pool, which must fit an empty one"
                positions = min(FILL_PAGES_EACH, config.pool_limit - first) * config.page_tokens
                self.apply(O.Extend(handles[-1], tuple(i % 3 for i in range(positions)), seed=0))
            for handle in handles:
                self.apply(O.Close(handle))
            self._reported(lambda: invariants.check_empty(self.engine.observe()))
        except AssertionError as error:     # whatever the sequence before was checking, this is what broke
            error.promise = WHOLE_POOL_FITS       # (a directed row reports it under this, not its own promise)
            raise
        self.checks += 1

    def run(self, sequence, check_every_step: bool = True) -> None:
        for op in sequence:
            self.apply(op)
            if check_every_step:
                self.check()


def observable_change(before, after) -> str | None:
    """The first difference between two observations, in words, or None. Counters whose names
    say they count refusals may move; every other part must be equal."""
    def counters(obs):
        return {name: value for name, value in (obs.counters or {}).items() if "refus" not in name}
    parts = [("pages allocated", lambda o: o.pages_allocated), ("pages freed", lambda o: o.pages_freed),
             ("live pages", lambda o: o.pages), ("holders", lambda o: o.holders),
             ("lengths", lambda o: o.lengths), ("arena slots out", lambda o: o.arena_out),
             ("free arena slots", lambda o: o.arena_free), ("entries", lambda o: o.entries),
             ("tree", lambda o: o.tree), ("counters", counters)]
    for name, part in parts:
        was, now = part(before), part(after)
        if was != now:
            return f"{name} {_difference(was, now)}"
    return None


def _difference(was, now) -> str:
    if isinstance(was, dict) and isinstance(now, dict):
        keys = sorted(set(was) | set(now), key=str)
        key = next(k for k in keys if was.get(k) != now.get(k))
        return f"[{key}]: {was.get(key)!r} -> {now.get(key)!r}"
    return f"{was!r} -> {now!r}"


def same_refusal(engine_error: BaseException | None, ref_error: BaseException | None) -> bool:
    """Both accepted, or the engine raised one of the errors that apply (``spec.errors.applicable_errors``),
    or a subclass of its own deriving from one (``spec.errors.spec_class``)."""
    if engine_error is None or ref_error is None:
        return engine_error is None and ref_error is None
    return spec_class(engine_error) in applicable_errors(ref_error)


def describe_refusal(ref_error: BaseException | None) -> str:
    """The reference's answer, naming every error class that would be right."""
    if ref_error is None:
        return "accepted"
    others = [cls.__name__ for cls in applicable_errors(ref_error)[1:]]
    return f"{ref_error!r}" + (f" (or any of {', '.join(others)})" if others else "")


class _DirectedRestore:
    """What ``restore_beside`` hands the refusal checks and their messages in place of an operation."""
    kind = "restore"

    def __init__(self, call: str):
        self.call = call

    def __str__(self) -> str:
        return self.call


def _attempt(call: Callable[[], Any]) -> tuple[Any, KVStateError | None]:
    """``call()``'s result, or the ``KVStateError`` it raised (a refusal, judged by the caller)."""
    try:
        return call(), None
    except KVStateError as error:
        return None, error


# Where a pool evicts for room, what a difference in the entries kept may come from besides the tree's bounds.
_POOL_EVICTION = ("; or its pool evicted for room: another entry than the least recently used one that keeps a "
                  "page no context holds, or before the pool was full (pages held past their use, a close, "
                  "truncate or release that kept some, fill it early)")


def _kept_differently(engine: set, reference: set) -> str:
    """Where a pool evicts for room, what an eviction-order difference says: entries missing (evicted
    another way), entries kept that the reference evicted, or the same entries in another order."""
    if engine == reference:
        return ("; the same entries in another order: a hit or retain stamped another entry than the reference's "
                "(the most recently used of those sharing the hit), or none")
    if engine - reference and not reference - engine:
        return (f"; the engine keeps entries the reference evicted ({sorted(engine - reference)[:4]}): its pool did "
                f"not evict for room where the reference did (it counted fewer pages live or needed than "
                f"spec/semantics.py does), or it evicted another entry earlier")
    return _POOL_EVICTION


def _not_the_querys(hit, query: tuple) -> str:
    """Where the engine's hit holds other tokens than the query's first ones, a note that says so."""
    try:
        held = tuple(int(token) for token in hit.tokens)
    except Exception:      # noqa: BLE001 - a report's detail: the mismatch above is the finding
        return ""
    if held == query[:len(held)]:
        return ""
    shown = ", ".join(map(str, held[:8])) + (", ..." if len(held) > 8 else "")
    return f"; the engine's hit holds tokens ({shown}), not the query's first {len(held)}"


def _context_of(result):
    """``match`` returns (context, matched); everything else that creates returns the context."""
    return result[0] if isinstance(result, tuple) else result
