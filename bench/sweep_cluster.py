"""Sweeps on Dask: the local pool vs a 2-worker LocalCluster, and throughput vs worker count.

    python -m kvstate.bench.sweep_cluster [--runs 36] [--steps 400] [--json PATH]

1. Real runs: the same (configuration, seed) runs, ``--steps`` each, through ``sweep.sweep``
   with the local ``ProcessPoolExecutor`` (2 processes, the pool the sweep makes itself)
   and on a ``LocalCluster`` of 2 single-thread worker processes on 127.0.0.1. Runs per
   second of each (best of ``--repeats``), and the cluster's overhead per run: the share of
   throughput lost, and the milliseconds per run it adds.
2. Scheduling alone: tasks that do nothing, through the same executor and the same result
   loop as the sweep's runs: the most runs per second one scheduler hands out.
3. Scaling, by simulation: a run is replaced by a sleep as long as a measured run, so each
   worker process stands for a machine of its own and more workers than cores can run
   (only the scheduler and the client use CPU). Runs per second for 1..16 workers, and
   the share of the ideal (workers / run seconds) reached.

Timings on a shared machine move with the other jobs on it; run it when it is quiet.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from kvstate.stateful import sweep as S
from kvstate.stateful.configs import machine_configs


def simulated_run(seconds: float, index: int) -> int:
    """A run that takes ``seconds`` of wall time and no CPU."""
    time.sleep(seconds)
    return index


def _local_cluster(workers: int):
    from distributed import LocalCluster

    return LocalCluster(n_workers=workers, processes=True, threads_per_worker=1, host="127.0.0.1",
                        dashboard_address=None, silence_logs=40)


def _sweep_seconds(seeds: list[int], steps: int, out: Path, **how) -> tuple[float, S.SweepReport]:
    started = time.perf_counter()
    report = S.sweep(seeds, steps, machine_configs(), out_dir=out, progress=None, **how)
    return time.perf_counter() - started, report


def real_runs(runs: int, steps: int, repeats: int) -> dict:
    """Runs per second, local pool of 2 vs LocalCluster of 2, the same runs on both."""
    from kvstate.stateful.cluster import connect

    seeds = list(range(max(1, runs // len(machine_configs()))))
    total = len(seeds) * len(machine_configs())
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        local = [_sweep_seconds(seeds, steps, out / f"local{i}", workers=2)[0] for i in range(repeats)]
        with _local_cluster(2) as cluster, connect(cluster.scheduler_address, S.DEFAULT_BACKEND, out=None) as session:
            how = dict(workers=session.workers, executor=session.executor, scheduler=session.address)
            S.sweep(seeds[:1], 10, machine_configs(), out_dir=out / "warm", progress=None, **how)   # imports
            remote = [_sweep_seconds(seeds, steps, out / f"cluster{i}", **how)[0] for i in range(repeats)]
            noop = scheduling_only(session.executor, 400)
        _, report = _sweep_seconds(seeds, steps, out / "cpu", workers=1)      # one process: the CPU per run
    run_seconds = sum(r.seconds for r in report.results) / total
    local_rate, cluster_rate = total / min(local), total / min(remote)
    return {"runs": total, "steps": steps, "local_runs_per_s": local_rate, "cluster_runs_per_s": cluster_rate,
            "local_seconds": local, "cluster_seconds": remote, "one_run_seconds": run_seconds,
            "overhead_share": 1 - cluster_rate / local_rate,
            "overhead_ms_per_run": (min(remote) - min(local)) / total * 2 * 1000,
            "noop_runs_per_s": noop}


def scheduling_only(executor, tasks: int) -> float:
    """Tasks per second for tasks that do nothing: the ceiling one scheduler and client set."""
    started = time.perf_counter()
    for _ in S._map(executor, simulated_run, [(0.0, i) for i in range(tasks)]):
        pass
    return tasks / (time.perf_counter() - started)


def scaling(run_seconds: float, worker_counts: list[int], runs_per_worker: int) -> list[dict]:
    """Simulated runs per second as worker processes are added (more than there are cores)."""
    from kvstate.stateful.cluster import connect

    rows = []
    for workers in worker_counts:
        with _local_cluster(workers) as cluster, connect(cluster.scheduler_address, S.DEFAULT_BACKEND,
                                                         out=None, timeout_s=120) as session:
            cluster.wait_for_workers(workers)
            jobs = [(run_seconds, i) for i in range(workers * runs_per_worker)]
            started = time.perf_counter()
            for _ in S._map(session.executor, simulated_run, jobs):
                pass
            seconds = time.perf_counter() - started
        rate = len(jobs) / seconds
        rows.append({"workers": workers, "runs": len(jobs), "seconds": seconds, "runs_per_s": rate,
                     "share_of_ideal": rate / (workers / run_seconds)})
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=36, help="real runs per measurement (default 36)")
    parser.add_argument("--steps", type=int, default=400, help="operations per run (default 400)")
    parser.add_argument("--repeats", type=int, default=2, help="measurements of each; the best counts")
    parser.add_argument("--workers", default="1,2,4,8,16", help="worker processes for the simulation")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    real = real_runs(args.runs, args.steps, args.repeats)
    print(f"{real['runs']} runs x {real['steps']} steps, {os.cpu_count()} cores "
          f"(one run: {real['one_run_seconds'] * 1000:.0f} ms in one process)")
    print(f"  local pool, 2 processes:          {real['local_runs_per_s']:6.2f} runs/s  "
          f"(walls {', '.join(f'{s:.1f}' for s in real['local_seconds'])} s)")
    print(f"  LocalCluster, 2 workers x 1 thread: {real['cluster_runs_per_s']:6.2f} runs/s  "
          f"(walls {', '.join(f'{s:.1f}' for s in real['cluster_seconds'])} s)")
    print(f"  cluster overhead: {real['overhead_share'] * 100:+.1f}% of throughput, "
          f"{real['overhead_ms_per_run']:+.1f} ms per run per worker (target <= 10%)")
    print(f"  no-op tasks through the same executor: {real['noop_runs_per_s']:,.0f} per second")

    counts = [int(n) for n in args.workers.split(",")]
    rows = scaling(real["one_run_seconds"], counts, runs_per_worker=8)
    print(f"\nsimulated runs ({real['one_run_seconds'] * 1000:.0f} ms sleeps, no CPU), LocalCluster on "
          f"{os.cpu_count()} cores:")
    print("  workers  runs  seconds  runs/s  share of ideal")
    for row in rows:
        print(f"  {row['workers']:7d}  {row['runs']:4d}  {row['seconds']:7.2f}  {row['runs_per_s']:6.1f}  "
              f"{row['share_of_ideal'] * 100:13.0f}%")
    results = {"real": real, "scaling": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
