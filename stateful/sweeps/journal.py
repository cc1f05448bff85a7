"""A sweep's journal: the plan and every finished run, one JSON line each, as they finish.

``OUT/runs.jsonl`` starts with the plan (backend, steps, seeds, configurations, shard, the
submitting machine's fingerprint, and how runs are run: workers, run timeout, shrinking), then gets one ``run`` line per finished
(configuration, seed) and one ``shrunk`` line per shrunk failure, flushed as each arrives.
Whatever stops a sweep (Ctrl-C, a lost scheduler, a killed machine) leaves the runs that
finished on disk, and ``kvstate sweep --resume OUT`` runs only the rest. A last line cut
short by a kill is ignored; so is a second line for a run already recorded.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, TextIO

from kvstate.spec.errors import InvalidInputError, ResumeError

from ..data_files import open_own_file, read_regular
from ..shrink import DEFAULT_TRIES as DEFAULT_SHRINK_TRIES

if TYPE_CHECKING:
    from kvstate.spec.protocol import Config

FILE = "runs.jsonl"
FORMAT = "kvstate-sweep-journal/1"
# Failures shrunk, and seconds a shrink: only a backstop against a candidate that hangs, since tries
# bound a shrink (``shrink.DEFAULT_TRIES``); 60 s, when the clock bounded it, cut nightly shrinks short
# on loaded machines.
DEFAULT_SHRINK_LIMIT, DEFAULT_SHRINK_BUDGET = 5, 300.0
_OLD_SHRINK_BUDGET = 60.0           # what a journal that records none ran with


@dataclass(frozen=True)
class Plan:
    backend: str
    steps: int
    seeds: tuple[int, ...]
    configs: tuple[str, ...]
    shard: str | None
    fingerprint: dict
    workers: int | None = None      # the local pool's size (None on a cluster): what a resume runs with
    # How runs are run and failures shrunk: a resume keeps them unless told otherwise (a resume
    # without the run timeout hung for good on the seed that hangs).
    run_timeout: float | None = None
    shrink_limit: int = DEFAULT_SHRINK_LIMIT
    shrink_budget: float = DEFAULT_SHRINK_BUDGET
    shrink_tries: int = DEFAULT_SHRINK_TRIES


@dataclass
class Recorded:
    """What a journal holds: runs and shrunk failures as the dicts they were written as."""
    plan: Plan
    runs: dict[tuple[str, int], dict]
    shrunk: dict[tuple[str, int], dict]


class Journal:
    """Appends to ``OUT/runs.jsonl``; ``start`` begins a new one, ``reopen`` continues one."""

    def __init__(self, stream: TextIO):
        self._stream = stream

    @classmethod
    def start(cls, out_dir: Path, plan: Plan) -> "Journal":
        """A new journal in ``out_dir``, replacing the one there; one that is a symlink or no regular
        file is refused (``refuse_foreign``), on the descriptor the journal is then written through."""
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / FILE
        try:
            stream = open_own_file(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "wb")
        except ValueError:
            raise _not_regular(path, START_WAY_OUT) from None
        journal = cls(io.TextIOWrapper(stream, encoding="utf-8"))
        journal._write({"kind": "plan", "format": FORMAT, **asdict(plan)})
        return journal

    @classmethod
    def reopen(cls, out_dir: Path) -> "Journal":
        """Continue a journal, first cutting off a last line that a kill left half written
        (appended to, it would be a broken line in the middle). A journal that is a symlink or no
        regular file is refused as ``start`` refuses it, before anything is cut or written: through a
        link, a folder from elsewhere would have the resume write outside it."""
        path = out_dir / FILE
        try:
            stream = open_own_file(path, os.O_RDWR, "r+b")
        except ValueError:
            raise _not_regular(path, "put a copy of the journal in its place to resume it") from None
        content = stream.read()
        stream.truncate(content.rfind(b"\n") + 1)
        stream.seek(0, 2)
        return cls(io.TextIOWrapper(stream, encoding="utf-8"))

    def record_run(self, run: dict) -> None:
        self._write({"kind": "run", **run})

    def record_shrunk(self, run: dict) -> None:
        self._write({"kind": "shrunk", **run})

    def _write(self, entry: dict) -> None:
        self._stream.write(json.dumps(entry) + "\n")
        self._stream.flush()

    def close(self) -> None:
        self._stream.close()


START_WAY_OUT = "remove it, or pick another --out"


def refuse_foreign(out_dir: Path) -> None:
    """Refuse a journal in ``out_dir`` that is a symlink or no regular file (``ResumeError``), before a
    new sweep reads it or clears anything beside it: read through a link, a finished sweep elsewhere
    had this folder's replay files deleted as if they were its own, and only then was it refused."""
    path = out_dir / FILE
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise _not_regular(path, START_WAY_OUT)


def _not_regular(path: Path, way_out: str) -> ResumeError:
    return ResumeError(f"{path} is not a regular file (a symlink, FIFO or folder): a sweep writes its journal "
                       f"only as a file of its own in its folder; {way_out}")


MAX_BYTES = 256 << 20          # a journal past this is refused before it is read (a million runs is ~200 MB)
MAX_LINES = 2_000_000

_NUMBER = (int, float)
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]*")      # what ``Config.name`` and ``sweep.config_labels`` make
_RUN_FIELDS = {"config": str, "seed": int, "page_tokens": int, "steps": int, "seconds": _NUMBER,
               "cpu_seconds": _NUMBER, "failure": (dict, type(None)), "ops": (list, type(None)),
               "replay_file": (str, type(None)), "minimised": bool, "clock": list, "unobserved": list,
               "checked_after": list}
_FAILURE_FIELDS = {"step": int, "phase": str, "op": (str, type(None)), "error": str,
                   "invariant": (int, str, type(None)), "message": str, "where": str, "found_by": str}
_PLAN_FIELDS = {"backend": str, "steps": int, "seeds": list, "configs": list, "shard": (str, type(None)),
                "fingerprint": dict, "workers": (int, type(None)), "run_timeout": (int, float, type(None)),
                "shrink_limit": int, "shrink_budget": _NUMBER, "shrink_tries": (int, type(None))}


def _repeated(values: list) -> list:
    """The values that ``values`` lists more than once, in their first order."""
    seen, repeated = set(), []
    for value in values:
        if value in seen and value not in repeated:
            repeated.append(value)
        seen.add(value)
    return repeated


def read(out_dir: Path, configs: Mapping[str, Config] | None = None) -> Recorded:
    """The plan, runs and shrunk failures ``OUT/runs.jsonl`` holds; ``ResumeError`` if there is none.

    The journal is data from wherever the folder came from: every line is checked for its
    shape, types and ranges, and every run must be one the plan asked for, before anything uses it.
    With ``configs`` (the plan's configurations by label) each run is also held to the bounds of the
    replay file a resume saves for it (``_check_replayable``). Every refusal names the file and the
    line. Nothing in it is imported or run here.
    """
    path = Path(out_dir) / FILE
    try:
        content = read_regular(path, MAX_BYTES)     # a FIFO there blocked the resume for good
    except OSError as error:
        raise ResumeError(f"no sweep to resume in {str(out_dir)!r}: {error.strerror} ({path})") from None
    except ValueError as error:
        raise ResumeError(f"no sweep to resume in {str(out_dir)!r}: {error}") from None
    if len(content) > MAX_BYTES:
        raise ResumeError(f"{path} holds more than the journal limit MAX_BYTES={MAX_BYTES} bytes")
    lines = content.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    if len(lines) > MAX_LINES:
        raise ResumeError(f"{path} holds {len(lines)} lines, above the journal limit MAX_LINES={MAX_LINES}")
    entries = []
    for number, line in enumerate(lines, start=1):
        try:
            entries.append((number, json.loads(line.decode("utf-8"))))
        except (UnicodeDecodeError, ValueError, RecursionError):     # ValueError: also an int past 4,300 digits
            if number == len(lines):
                break               # the line being written when the sweep was stopped
            raise ResumeError(f"{path}: line {number} is not JSON in UTF-8") from None
    if not entries or not isinstance(entries[0][1], dict) or entries[0][1].get("kind") != "plan" \
            or entries[0][1].get("format") != FORMAT:
        raise ResumeError(f"{path} does not start with a {FORMAT} plan")
    head = {key: value for key, value in entries[0][1].items() if key not in ("kind", "format")}
    head.setdefault("workers", None)        # journals from before these were recorded have none
    head.setdefault("run_timeout", None)
    head.setdefault("shrink_limit", DEFAULT_SHRINK_LIMIT)
    head.setdefault("shrink_budget", _OLD_SHRINK_BUDGET)
    head.setdefault("shrink_tries", None)       # none: shrinks of that sweep were bounded by the clock alone
    _check_fields(head, _PLAN_FIELDS, path, 1, "plan")
    if not all(_is_int(seed) for seed in head["seeds"]) or not all(isinstance(c, str) for c in head["configs"]) \
            or head["steps"] < 1:
        raise ResumeError(f"{path}: line 1: malformed plan (seeds must be ints, configs names, steps >= 1)")
    for label in head["configs"]:       # labels name files (replays/{label}-seed{seed}.json): no path in them
        if not _LABEL.fullmatch(label):
            raise ResumeError(f"{path}: line 1: malformed plan: {label[:60]!r} is no configuration label "
                              "(letters, digits and '-' only)")
    for name in ("seeds", "configs"):       # each run is counted once per entry of the plan: a repeat counted it twice
        repeated = _repeated(head[name])
        if repeated:
            raise ResumeError(f"{path}: line 1: malformed plan: its {name} list {repeated} more than once")
    if head["workers"] is not None and head["workers"] < 1:
        raise ResumeError(f"{path}: line 1: malformed plan (workers must be at least 1, got {head['workers']})")
    timeout = head["run_timeout"]
    if (timeout is not None and not (math.isfinite(timeout) and timeout > 0)) or head["shrink_limit"] < 0 \
            or not (math.isfinite(head["shrink_budget"]) and head["shrink_budget"] >= 0) \
            or (head["shrink_tries"] is not None and head["shrink_tries"] < 0):
        raise ResumeError(f"{path}: line 1: malformed plan (run_timeout must be a positive number or null, "
                          "shrink_limit, shrink_budget and shrink_tries at least 0)")
    plan = Plan(head["backend"], head["steps"], tuple(head["seeds"]), tuple(head["configs"]),
                head["shard"], head["fingerprint"], head["workers"], timeout, head["shrink_limit"],
                head["shrink_budget"], DEFAULT_SHRINK_TRIES if head["shrink_tries"] is None else head["shrink_tries"])
    planned_seeds, planned_configs = set(plan.seeds), set(plan.configs)
    runs: dict[tuple[str, int], dict] = {}
    shrunk: dict[tuple[str, int], dict] = {}
    page_sizes_checked: set[tuple[str, int]] = set()
    for number, entry in entries[1:]:
        kind = entry.pop("kind", None) if isinstance(entry, dict) else None
        target = runs if kind == "run" else shrunk if kind == "shrunk" else None
        if target is None:
            raise ResumeError(f"{path}: line {number}: an entry of unknown kind {kind!r}")
        if isinstance(entry, dict):
            entry.setdefault("clock", [])       # journals from before cut stages were recorded
            entry.setdefault("unobserved", [])  # ... and before seeded runs left steps unobserved
            entry.setdefault("checked_after", [])
        _check_fields(entry, _RUN_FIELDS, path, number, kind)
        if not all(isinstance(stage, str) for stage in entry["clock"]):
            raise ResumeError(f"{path}: line {number}: the {kind}'s clock holds something other than stage names")
        if entry["failure"] is not None:
            if isinstance(entry["failure"], dict):      # journals from before failures said where, or what found them
                entry["failure"].setdefault("where", "")
                entry["failure"].setdefault("found_by", "")
            _check_fields(entry["failure"], _FAILURE_FIELDS, path, number, f"{kind}'s failure")
            _check_failure(entry["failure"], path, number, kind)
            _check_ops(entry["ops"], path, number, kind)     # a resume saves it as a replay file
            _check_unobserved(entry, path, number, kind)
        if entry["page_tokens"] < 1:
            raise ResumeError(f"{path}: line {number}: the {kind}'s page_tokens is {entry['page_tokens']}, not >= 1")
        if not 0 <= entry["steps"] <= plan.steps:      # a run draws the plan's steps, and stops at one of them
            raise ResumeError(f"{path}: line {number}: the {kind}'s steps is {entry['steps']}, not between 0 and "
                              f"the plan's {plan.steps}")
        if not all(math.isfinite(entry[name]) and entry[name] >= 0 for name in ("seconds", "cpu_seconds")):
            raise ResumeError(f"{path}: line {number}: the {kind}'s seconds are not finite numbers >= 0 "
                              "(a report holding NaN is no JSON)")
        if entry["config"] not in planned_configs or entry["seed"] not in planned_seeds:
            raise ResumeError(f"{path}: line {number}: a {kind} of configuration {entry['config']!r}, "
                              f"seed {entry['seed']}, which the plan does not hold")
        if configs is not None and entry["config"] in configs:     # one not there: the plan comparison refuses it
            _check_replayable(entry, configs[entry["config"]], page_sizes_checked, path, number, kind)
        target.setdefault((entry["config"], entry["seed"]), entry)      # the first one counts
    return Recorded(plan, runs, shrunk)


def begun(out_dir: Path) -> bool:
    """Whether ``OUT/runs.jsonl`` holds a whole first line: a sweep stopped before its plan was on the
    disk (no room for it) leaves none, and no run of it finished. Only for a journal ``read`` refused."""
    try:
        return b"\n" in read_regular(Path(out_dir) / FILE, MAX_BYTES)
    except (OSError, ValueError):
        return True         # there, but not to be read: what it holds is not known


def _check_replayable(entry: dict, config: Config, page_sizes_checked: set, path: Path, number: int,
                      kind: str) -> None:
    """The run's configuration at its page size, and a failed run's operations, within what a replay
    file is held to (``replay.config_from_json``, ``replay_bounds``); else ``ResumeError`` naming the
    line. A resume saves a failure's replay file and reads a shrunk one back for its pytest test: past
    those bounds it stopped there, after the reports were written, on every retry."""
    from ..ops import op_from_json
    from ..replay import config_from_json, config_to_json
    from ..replay_bounds import check_memory, check_op_count

    try:
        sized = config.with_(page_tokens=entry["page_tokens"])
        if (entry["config"], entry["page_tokens"]) not in page_sizes_checked:     # a million runs share a few
            config_from_json(config_to_json(sized))
            page_sizes_checked.add((entry["config"], entry["page_tokens"]))
        if entry["failure"] is not None:
            check_op_count(len(entry["ops"]))
            check_memory(sized, [op_from_json(op) for op in entry["ops"]])
    except InvalidInputError as error:      # ConfigError, ReplayFileError
        raise ResumeError(f"{path}: line {number}: the {kind} is past a replay file's bounds: "
                          f"{str(error)[:200]}") from None


def _check_failure(failure: dict, path: Path, number: int, kind: str) -> None:
    """A failure a replay file could hold (its step, phase and fields); else ``ResumeError`` naming the line."""
    from ..replay import Failure
    from ..replay import checked_failure     # the rule replay files are held to

    try:
        checked_failure(Failure(**failure))
    except (TypeError, ValueError) as error:     # ReplayFileError is a ValueError
        raise ResumeError(f"{path}: line {number}: the {kind}'s failure is malformed: {str(error)[:80]}") from None


def _check_ops(ops, path: Path, number: int, kind: str) -> None:
    """A failed run's operations, each one a replay file could hold; else ``ResumeError`` naming the line."""
    from ..ops import op_from_json
    from ..replay import _check_op as check_op     # the rule replay files are held to

    if not isinstance(ops, list):
        raise ResumeError(f"{path}: line {number}: the {kind} records a failure but its ops are "
                          f"{type(ops).__name__}, not a list")
    for index, op in enumerate(ops, start=1):
        try:
            if not isinstance(op, dict):
                raise TypeError(f"a {type(op).__name__}, not an object")
            check_op(index, op_from_json(op))
        except (KeyError, TypeError, ValueError) as error:     # ReplayFileError is a ValueError
            raise ResumeError(f"{path}: line {number}: the {kind}'s operation {index} is malformed: "
                              f"{str(error)[:80]}") from None


def _check_unobserved(entry: dict, path: Path, number: int, kind: str) -> None:
    """A failed run's unobserved steps, as a replay file must hold them; else ``ResumeError`` naming the line."""
    from ..replay import unobserved_steps     # the rule replay files are held to

    try:
        unobserved_steps(entry, len(entry["ops"]))
    except ValueError as error:         # ReplayFileError is a ValueError
        raise ResumeError(f"{path}: line {number}: the {kind}'s steps run unobserved are malformed: "
                          f"{str(error).removeprefix('malformed replay file: ')[:120]}") from None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_fields(entry, fields: dict, path: Path, number: int, what: str) -> None:
    """``entry`` is a dict with exactly ``fields``, each of its type; else ``ResumeError`` naming the line."""
    if not isinstance(entry, dict):
        raise ResumeError(f"{path}: line {number}: the {what} is a {type(entry).__name__}, not an object")
    missing, extra = set(fields) - set(entry), set(entry) - set(fields)
    if missing or extra:
        raise ResumeError(f"{path}: line {number}: the {what} " + "; ".join(
            part for part in (f"lacks {sorted(missing)}" if missing else "",
                              f"has unknown fields {sorted(extra)}" if extra else "") if part))
    for name, kind in fields.items():
        value = entry[name]
        wrong = not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool and kind != (bool,))
        if wrong:
            raise ResumeError(f"{path}: line {number}: the {what}'s {name!r} is {type(value).__name__} "
                              f"{str(value)[:40]!r}")
