"""Nightly sweeps: many seeds x configurations through the lockstep checks, in parallel.

Each (seed, configuration) run is ``steps`` operations from ``generate.Generator(seed)``,
applied by ``Lockstep`` with every invariant checked after every step. A failing
run is shrunk (shrink.py) and saved as a replay file (replay.py), and printed as
a ready-to-paste pytest test.

Parallelism is a ``ProcessPoolExecutor`` rather than pytest-xdist: a sweep is a
command, not a test session; it needs its own progress line, its own report
and a shrink phase that runs after the runs, and each task is one small
picklable (backend path, config, seed). Under xdist all of that would go
through pytest's collection, fixtures and plugins.
"""

from __future__ import annotations

import json
import os
import sys
import time
import xml.etree.ElementTree as ET
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence, TextIO

from kvstate.spec.protocol import Config

from . import ops as O
from .conform import load_factory
from .generate import Generator
from .lockstep import Lockstep
from .replay import Failure, Replay, as_pytest, execute, load, save
from .shrink import shrink

DEFAULT_BACKEND = "kvstate.impl.numpy"


# -- which runs ------------------------------------------------------------------------

def parse_seed_range(text: str) -> range:
    """``A:B`` is seeds A..B-1."""
    start, sep, stop = text.partition(":")
    if not sep or not start.strip().isdigit() or not stop.strip().isdigit() or int(stop) <= int(start):
        raise ValueError(f"--seed-range wants A:B with 0 <= A < B, got {text!r}")
    return range(int(start), int(stop))


def parse_shard(text: str) -> tuple[int, int]:
    """``K/N``: the K-th (1-based) of N shards."""
    k, sep, n = text.partition("/")
    if not sep or not k.isdigit() or not n.isdigit() or not 1 <= int(k) <= int(n):
        raise ValueError(f"--shard wants K/N with 1 <= K <= N, got {text!r}")
    return int(k), int(n)


def shard(seeds: Sequence[int], k: int, n: int) -> list[int]:
    """Every N-th seed from the K-th: N shards cover the seeds once, with no overlap, in sizes
    that differ by at most one."""
    return list(seeds)[k - 1::n]


# -- one run ---------------------------------------------------------------------------

@dataclass
class RunResult:
    config: str
    seed: int
    page_tokens: int
    steps: int
    seconds: float
    cpu_seconds: float
    failure: Failure | None = None
    ops: list | None = None            # the operations that ran (JSON), kept only for failures
    replay_file: str | None = None
    minimised: bool = False

    @property
    def passed(self) -> bool:
        return self.failure is None


_factories: dict[str, Callable] = {}


def _factory(backend: str):
    if backend not in _factories:
        _factories[backend] = load_factory(backend)
    return _factories[backend]


def run_seed(backend: str, config: Config, seed: int, steps: int) -> RunResult:
    """Seed ``seed``'s ``steps`` operations against ``backend`` in ``config``, every invariant
    after every step, and invariant 6 at the end."""
    factory = _factory(backend)
    generator = Generator(seed)
    config = config.with_(page_tokens=generator.page_tokens)
    lockstep = Lockstep(factory, config)
    ran: list[O.Op] = []

    def generated():
        # Each operation is chosen from the state the previous ones left.
        for _ in range(steps):
            op = generator.next_op(lockstep)
            ran.append(op)
            yield op

    started, cpu_started = time.perf_counter(), time.process_time()
    failure, _ = execute(factory, config, generated(), lockstep=lockstep)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    return RunResult(config.name, seed, generator.page_tokens, len(ran), seconds, cpu_seconds, failure,
                     [op.to_json() for op in ran] if failure else None)


def shrink_result(backend: str, config: Config, result: RunResult, out_dir: Path, budget_s: float) -> RunResult:
    """Shrink a failing run and save it as a replay file in ``out_dir``."""
    factory = _factory(backend)
    config = config.with_(page_tokens=result.page_tokens)
    ops = [O.op_from_json(op) for op in result.ops]
    shrunk, failure = shrink(factory, config, ops, result.failure, budget_s)
    replay = Replay(backend, config, result.seed, shrunk, failure, minimised=True, original_steps=result.steps)
    path = save(replay, out_dir / f"{config.name}-seed{result.seed}.json")
    result.failure, result.replay_file, result.minimised = failure, str(path), True
    result.ops = [op.to_json() for op in shrunk]
    return result


def save_unshrunk(backend: str, config: Config, result: RunResult, out_dir: Path) -> RunResult:
    config = config.with_(page_tokens=result.page_tokens)
    ops = [O.op_from_json(op) for op in result.ops]
    replay = Replay(backend, config, result.seed, ops, result.failure, minimised=False, original_steps=result.steps)
    result.replay_file = str(save(replay, out_dir / f"{config.name}-seed{result.seed}.json"))
    return result


# -- progress --------------------------------------------------------------------------

class Progress:
    """One line on stderr: runs done, steps/s, ETA, failures. Redrawn in place on a terminal,
    printed every ``every_s`` seconds elsewhere (CI logs)."""

    def __init__(self, total: int, stream: TextIO = sys.stderr, every_s: float = 10.0):
        self.total, self.stream, self.every_s = total, stream, every_s
        self.done = self.steps = self.failures = 0
        self.started = self.last = time.monotonic()
        self.tty = stream.isatty()

    def update(self, result: RunResult) -> None:
        self.done += 1
        self.steps += result.steps
        self.failures += not result.passed
        now = time.monotonic()
        if self.tty or now - self.last >= self.every_s or self.done == self.total:
            self.last = now
            self.stream.write(("\r" if self.tty else "") + self.line(now) + ("" if self.tty else "\n"))
            self.stream.flush()

    def line(self, now: float) -> str:
        elapsed = max(now - self.started, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate else 0.0
        filled = int(30 * self.done / max(self.total, 1))
        return (f"[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} runs  "
                f"{self.steps / elapsed:,.0f} steps/s  elapsed {_clock(elapsed)}  ETA {_clock(eta)}  "
                f"failures {self.failures}")

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


# -- the sweep -------------------------------------------------------------------------

@dataclass
class SweepReport:
    backend: str
    steps: int
    seeds: list[int]
    configs: list[str]
    workers: int
    shard: str | None
    wall_seconds: float
    results: list[RunResult]

    @property
    def failures(self) -> list[RunResult]:
        return [r for r in self.results if not r.passed]


def resolve_workers(workers: str | int) -> int:
    if workers == "auto":
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = int(workers)
    if workers < 1:
        raise ValueError(f"--workers wants a positive number or 'auto', got {workers}")
    return workers


def sweep(seeds: Iterable[int], steps: int, configs: Sequence[Config], backend: str = DEFAULT_BACKEND,
          workers: int = 1, out_dir: Path = Path("sweep-out"), shrink_limit: int = 5,
          shrink_budget_s: float = 60.0, progress: TextIO | None = sys.stderr,
          shard_label: str | None = None) -> SweepReport:
    """Run every (seed, configuration), then shrink and save up to ``shrink_limit`` failures
    (the first of each configuration and failure kind; the rest are saved unshrunk).

    ``workers`` 1 runs in this process (planted bugs and debuggers see it); more use a pool.
    """
    seeds = list(seeds)
    out_dir = Path(out_dir)
    _factory(backend)           # a bad backend path fails here, before any pool starts
    by_name = {c.name: c for c in configs}
    tasks = [(c, seed) for c in configs for seed in seeds]
    meter = Progress(len(tasks), progress) if progress is not None else None
    started = time.perf_counter()
    results: list[RunResult] = []
    pool = ProcessPoolExecutor(workers) if workers > 1 else None
    try:
        for result in _map(pool, run_seed, [(backend, c, seed, steps) for c, seed in tasks]):
            results.append(result)
            if meter:
                meter.update(result)
        if meter:
            meter.close()
        failed = sorted((r for r in results if not r.passed), key=lambda r: (r.config, r.seed))
        chosen, seen = [], set()
        for r in failed:
            kind = (r.config, r.failure.signature)
            if kind not in seen and len(chosen) < shrink_limit:
                seen.add(kind)
                chosen.append(r)
        replays = out_dir / "replays"
        jobs = [(backend, by_name[r.config], r, replays, shrink_budget_s) for r in chosen]
        shrunk = {(r.config, r.seed): r for r in _map(pool, shrink_result, jobs)}
        for r in failed:
            if (r.config, r.seed) not in shrunk:
                save_unshrunk(backend, by_name[r.config], r, replays)
        results = [shrunk.get((r.config, r.seed), r) for r in results]
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    results.sort(key=lambda r: ([c.name for c in configs].index(r.config), r.seed))
    return SweepReport(backend, steps, seeds, [c.name for c in configs], workers, shard_label,
                       time.perf_counter() - started, results)


def _map(pool, function, argument_tuples):
    """Results in completion order: in a pool, or one by one here."""
    if pool is None:
        for arguments in argument_tuples:
            yield function(*arguments)
        return
    futures: list[Future] = [pool.submit(function, *arguments) for arguments in argument_tuples]
    for future in as_completed(futures):
        yield future.result()


# -- reports ---------------------------------------------------------------------------

def summary_rows(report: SweepReport) -> list[dict]:
    """Per configuration: runs, steps, failures, summed run seconds, steps per second of one
    worker, and steps per CPU second (the figure that holds on a machine shared with others)."""
    rows = []
    for name in report.configs:
        mine = [r for r in report.results if r.config == name]
        seconds = sum(r.seconds for r in mine)
        cpu = sum(r.cpu_seconds for r in mine)
        steps = sum(r.steps for r in mine)
        rows.append({"config": name, "runs": len(mine), "steps": steps,
                     "failures": sum(not r.passed for r in mine), "run_seconds": round(seconds, 3),
                     "steps_per_second": round(steps / seconds, 1) if seconds else None,
                     "cpu_seconds": round(cpu, 3), "steps_per_cpu_second": round(steps / cpu, 1) if cpu else None})
    return rows


def format_summary(report: SweepReport) -> str:
    header = ("configuration", "runs", "steps", "failures", "run seconds", "steps/s per worker", "steps/CPU-s")
    rows = [header] + [(r["config"], str(r["runs"]), str(r["steps"]), str(r["failures"]),
                        f"{r['run_seconds']:.1f}", f"{r['steps_per_second'] or 0:,.0f}",
                        f"{r['steps_per_cpu_second'] or 0:,.0f}")
                       for r in summary_rows(report)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    total_steps = sum(r.steps for r in report.results)
    lines.append(f"\n{len(report.results)} runs, {total_steps} steps, {len(report.failures)} failures, "
                 f"wall {report.wall_seconds:.1f}s ({total_steps / max(report.wall_seconds, 1e-9):,.0f} steps/s "
                 f"on {report.workers} worker{'s' if report.workers > 1 else ''})")
    return "\n".join(lines)


def to_json(report: SweepReport) -> dict:
    return {
        "backend": report.backend, "steps": report.steps, "seeds": _compact(report.seeds),
        "configs": report.configs, "workers": report.workers, "shard": report.shard,
        "wall_seconds": round(report.wall_seconds, 3), "summary": summary_rows(report),
        "failures": [{"config": r.config, "seed": r.seed, "page_tokens": r.page_tokens, "steps": r.steps,
                      "failure": asdict(r.failure), "replay_file": r.replay_file, "minimised": r.minimised,
                      "replay_steps": len(r.ops or [])} for r in report.failures],
    }


def _compact(seeds: list[int]) -> str | list[int]:
    """A contiguous run of seeds as ``A:B``; anything else (a shard) as the list."""
    if seeds and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}:{seeds[-1] + 1}"
    return seeds


def to_junit(report: SweepReport) -> ET.ElementTree:
    """One testsuite per configuration, one testcase per seed: what CI systems list and count."""
    root = ET.Element("testsuites", name="kvstate sweep", tests=str(len(report.results)),
                      failures=str(len(report.failures)), time=f"{report.wall_seconds:.3f}")
    for name in report.configs:
        mine = [r for r in report.results if r.config == name]
        suite = ET.SubElement(root, "testsuite", name=f"sweep.{name}", tests=str(len(mine)),
                              failures=str(sum(not r.passed for r in mine)),
                              time=f"{sum(r.seconds for r in mine):.3f}")
        for r in mine:
            case = ET.SubElement(suite, "testcase", classname=f"kvstate.sweep.{name}",
                                 name=f"seed {r.seed}", time=f"{r.seconds:.3f}")
            if not r.passed:
                failure = ET.SubElement(case, "failure", message=str(r.failure), type=r.failure.error)
                failure.text = f"replay: kvstate replay {r.replay_file}\n"
    return ET.ElementTree(root)


def write_reports(report: SweepReport, out_dir: Path) -> tuple[Path, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, junit_path = out_dir / "report.json", out_dir / "junit.xml"
    json_path.write_text(json.dumps(to_json(report), indent=2) + "\n")
    to_junit(report).write(junit_path, encoding="unicode", xml_declaration=True)
    return json_path, junit_path


def failure_notes(report: SweepReport) -> str:
    """Each failure: where it is saved, how to replay it, and (for shrunk ones) a pytest test."""
    notes = []
    for r in report.failures:
        notes.append(f"FAIL {r.config} seed {r.seed}: {r.failure}\n  replay: kvstate replay {r.replay_file}")
        if r.minimised:
            notes.append(f"  minimised to {len(r.ops)} of {r.steps} steps; as a pytest test:\n")
            notes.append(as_pytest(load(Path(r.replay_file))))
    return "\n".join(notes)
