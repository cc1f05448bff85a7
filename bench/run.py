"""Run the benchmarks, print one table each, write ``results.json`` and PNG plots.

Each benchmark module has ``run(quick) -> dict`` with ``name``, ``params``,
``rows`` (a list of flat dicts: the table) and optionally ``ratio``/``targets``.
Figures are measured side by side in one run; compare ratios, not absolute times.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

BENCHMARKS = ("fork_copy", "agent_traffic", "tree_scale", "paged_decode", "best_of_n", "restore", "hf_agent")


def run_all(names, quick: bool, full: bool, threads: int) -> list[dict]:
    import importlib

    results = []
    for name in names:
        module = importlib.import_module(f"kvstate.bench.{name}")
        start = time.perf_counter()
        kwargs = {"full": full, "threads": threads} if name in ("restore", "hf_agent") else {}
        result = module.run(quick=quick, **kwargs)
        result["wall_s"] = time.perf_counter() - start
        print(format_result(result), flush=True)
        results.append(result)
    return results


def timed(make) -> dict:
    """``make()``'s result with its ``wall_s`` (a benchmark's own command line: the header's time)."""
    start = time.perf_counter()
    result = make()
    result.setdefault("wall_s", time.perf_counter() - start)
    return result


def format_result(result: dict) -> str:
    rows = result["rows"]
    columns = list(dict.fromkeys(key for row in rows for key in row))
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = [f"\n== {result['name']}  ({result.get('wall_s', 0):.1f} s)  {result.get('params', '')}",
             "  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in cells]
    if "command" in result:
        lines.append(f"reproduce: {result['command']}")
    for key in ("ratio", "targets", "same_continuations"):
        if isinstance(result.get(key), dict) and len(result[key]) > 3:     # one per line, to be read
            lines.append(f"{key}:")
            lines += [f"  {name}: {_cell(value)}" for name, value in result[key].items()]
        elif key in result:
            lines.append(f"{key}: {_cell(result[key])}")
    return "\n".join(lines)


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}={_cell(v)}" for k, v in value.items())
    return "-" if value is None else str(value)


def save(results: list[dict], out: Path, threads: int) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    meta = {"python": platform.python_version(), "machine": platform.machine(), "threads": threads,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    # written beside it, then renamed over it: where results.json cannot be replaced (a folder of
    # that name made during the run) the run's results are kept in the temporary file, which the
    # OSError names, not lost to a traceback after minutes of benchmarking
    temp = out / f"results.json.{os.getpid()}.tmp"
    temp.write_text(json.dumps({"meta": meta, "results": results}, indent=2, default=str))
    try:
        os.replace(temp, path)
    except OSError as error:
        raise OSError(error.errno, f"{error.strerror}; the results are in {str(temp)!r}", str(path)) from None
    return path
