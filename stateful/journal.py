"""A sweep's journal: the plan and every finished run, one JSON line each, as they finish.

``OUT/runs.jsonl`` starts with the plan (backend, steps, seeds, configurations, shard, and
the submitting machine's fingerprint), then gets one ``run`` line per finished
(configuration, seed) and one ``shrunk`` line per shrunk failure, flushed as each arrives.
Whatever stops a sweep (Ctrl-C, a lost scheduler, a killed machine) leaves the runs that
finished on disk, and ``kvstate sweep --resume OUT`` runs only the rest. A last line cut
short by a kill is ignored; so is a second line for a run already recorded.
"""

from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

from kvstate.spec.errors import ResumeError

FILE = "runs.jsonl"
FORMAT = "kvstate-sweep-journal/1"


@dataclass(frozen=True)
class Plan:
    backend: str
    steps: int
    seeds: tuple[int, ...]
    configs: tuple[str, ...]
    shard: str | None
    fingerprint: dict


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
        out_dir.mkdir(parents=True, exist_ok=True)
        journal = cls(open(out_dir / FILE, "w", encoding="utf-8"))
        journal._write({"kind": "plan", "format": FORMAT, **asdict(plan)})
        return journal

    @classmethod
    def reopen(cls, out_dir: Path) -> "Journal":
        """Continue a journal, first cutting off a last line that a kill left half written
        (appended to, it would be a broken line in the middle)."""
        stream = open(out_dir / FILE, "r+b")
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


def read(out_dir: Path) -> Recorded:
    """The plan, runs and shrunk failures ``OUT/runs.jsonl`` holds; ``ResumeError`` if there is none."""
    path = Path(out_dir) / FILE
    try:
        lines = path.read_text().splitlines()
    except OSError as error:
        raise ResumeError(f"no sweep to resume in {str(out_dir)!r}: {error.strerror} ({path})") from None
    entries = []
    for number, line in enumerate(lines, start=1):
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                break               # the line being written when the sweep was stopped
            raise ResumeError(f"{path}: line {number} is not JSON") from None
    if not entries or entries[0].get("kind") != "plan" or entries[0].get("format") != FORMAT:
        raise ResumeError(f"{path} does not start with a {FORMAT} plan")
    head = {key: value for key, value in entries[0].items() if key not in ("kind", "format")}
    try:
        plan = Plan(head["backend"], head["steps"], tuple(head["seeds"]), tuple(head["configs"]),
                    head["shard"], head["fingerprint"])
    except (KeyError, TypeError) as error:
        raise ResumeError(f"{path}: malformed plan ({error!r})") from None
    runs: dict[tuple[str, int], dict] = {}
    shrunk: dict[tuple[str, int], dict] = {}
    for entry in entries[1:]:
        kind = entry.pop("kind", None)
        target = runs if kind == "run" else shrunk if kind == "shrunk" else None
        if target is None:
            raise ResumeError(f"{path}: an entry of unknown kind {kind!r}")
        target.setdefault((entry["config"], entry["seed"]), entry)      # the first one counts
    return Recorded(plan, runs, shrunk)
