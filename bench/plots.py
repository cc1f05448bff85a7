"""PNG plots of the benchmark results (matplotlib: ``pip install kvstate[plot]``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

# The plot each benchmark's result gets (``{name}.png``), by benchmark: the run checks these files
# before it starts, as it does results.json.
PLOT_OF = {"fork_copy": "fork_vs_copy", "best_of_n": "best_of_n", "agent_traffic": "agent_traffic",
           "paged_decode": "paged_vs_contiguous_decode", "restore": "restore_vs_prefill"}


def plot_files(names, out: Path) -> list[Path]:
    """The PNGs a run of the benchmarks ``names`` writes in ``out``; none without matplotlib."""
    if importlib.util.find_spec("matplotlib") is None:
        return []
    return [out / f"{PLOT_OF[name]}.png" for name in names if name in PLOT_OF]


def draw(results: list[dict], out: Path) -> list[Path]:
    """One PNG per benchmark that has something to plot; [] without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    drawn = []
    for result in results:
        drawer = _DRAWERS.get(result["name"])
        if drawer is None:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        drawer(ax, result)
        ax.set_title(result["name"].replace("_", " "))
        fig.tight_layout()
        path = out / f"{result['name']}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        drawn.append(path)
    return drawn


def _bars(ax, labels, values, ylabel, log=False):
    ax.bar(labels, values, color=["tab:blue", "tab:orange", "tab:green", "tab:red"][:len(values)])
    ax.set_ylabel(ylabel)
    if log:
        ax.set_yscale("log")


def _fork_copy(ax, r):
    _bars(ax, [row["method"] for row in r["rows"]], [row["us_per_fork"] for row in r["rows"]],
          "microseconds per fork / copy (log)", log=True)


def _best_of_n(ax, r):
    _bars(ax, [row["method"] for row in r["rows"]], [row["kv_bytes"] / 2**20 for row in r["rows"]], "K/V MiB held")


def _agent(ax, r):
    """Token semantics against the peer (SGLang, or the yardstick where SGLang is absent), per page
    size: lookups and retains (x)."""
    if any("lookup_speedup" in row for row in r["rows"]):        # against SGLang: array input
        token = [row for row in r["rows"] if row["engine"] == "kvstate token" and row["input"] == "int64 array"]
        lookups, retains, peer = "lookup_speedup", "insert_speedup", "SGLang"
    else:
        token = [row for row in r["rows"] if row["engine"] == "kvstate" and row["match"] == "token"]
        lookups, retains, peer = "lookups_x", "retains_x", "yardstick"
    labels = [f"{row['workload']}\n@{row['page']}" for row in token]
    x = range(len(token))
    ax.bar([i - 0.2 for i in x], [row[lookups] for row in token], 0.4, label="lookups x")
    ax.bar([i + 0.2 for i in x], [row[retains] for row in token], 0.4, label="retains x")
    ax.axhline(1.0, color="k", linewidth=0.5)
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel(f"kvstate token speed / {peer}'s")
    ax.legend()


def _by_tokens(keys, ylabel, log=False):
    def draw(ax, r):
        for key in keys:
            points = [(row["tokens"], row[key]) for row in r["rows"] if row.get(key)]
            if points:
                ax.plot(*zip(*points), marker="o", label=key)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens")
        ax.set_ylabel(ylabel)
        if log:
            ax.set_yscale("log")
        ax.legend()
    return draw


_DRAWERS = {
    "fork_vs_copy": _fork_copy,
    "best_of_n": _best_of_n,
    "agent_traffic": _agent,
    "paged_vs_contiguous_decode": _by_tokens(["paged_ms", "contiguous_ms", "contiguous_one_matmul_ms"], "ms per decode step"),
    "restore_vs_prefill": _by_tokens(["ours_prefill_s", "hf_prefill_s", "restore_warm_s", "restore_cold_s",
                                      "read_bytes_s"],
                                     "seconds (log)", log=True),
}
