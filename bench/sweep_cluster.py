"""Sweeps on Dask: the local pool vs a 2-worker LocalCluster, and throughput vs worker count.

    python -m kvstate.bench.sweep_cluster [--runs 36] [--steps 400] [--json PATH]

1. Real runs: the same (configuration, seed) runs, ``--steps`` each, through ``sweep.sweep``
   with the local ``ProcessPoolExecutor`` (2 processes, the pool the sweep makes itself)
   and on a ``LocalCluster`` of 2 single-thread worker processes on 127.0.0.1. Runs per
   second of each (best of ``--repeats``, taken in turn), and the cluster's overhead per run
   two ways: wall time (what a user sees, but on a shared machine it moves with the other
   jobs) and CPU time of every process involved (pool processes and sweep process; workers,
   scheduler and client), which other jobs move far less. The CPU figure leaves out what
   idle workers burn per second (heartbeats, monitors): a cost of keeping a cluster up,
   not of a run.
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

from kvstate.stateful.sweeps import sweep as S
from kvstate.stateful.configs import machine_configs

from .args import positive_int


def simulated_run(seconds: float, index: int) -> int:
    """A run that takes ``seconds`` of wall time and no CPU."""
    time.sleep(seconds)
    return index


def _local_cluster(workers: int):
    from distributed import LocalCluster

    return LocalCluster(n_workers=workers, processes=True, threads_per_worker=1, host="127.0.0.1",
                        dashboard_address="127.0.0.1:0", silence_logs=40)


def _process_cpu() -> float:
    return time.process_time()


def _pids_cpu(pids) -> float:
    import psutil       # comes with distributed

    return sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in pids)


def _measured(seeds: list[int], steps: int, out: Path, pool_pids=(), client=None, **how) -> dict:
    """Wall and CPU seconds of one sweep: this process (the sweep's loop; the cluster's scheduler
    and client) plus the processes that ran the runs (the pool's, or the cluster's workers)."""
    workers_before = client.run(_process_cpu) if client else {}
    cpu_before, pool_before = time.process_time(), _pids_cpu(pool_pids)
    started = time.perf_counter()
    report = S.sweep(seeds, steps, machine_configs(), out_dir=out, progress=None, **how)
    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu_before + _pids_cpu(pool_pids) - pool_before
    if client:
        workers_after = client.run(_process_cpu)
        cpu += sum(workers_after[w] - workers_before[w] for w in workers_after if w in workers_before)
    return {"wall": wall, "cpu": cpu, "run_cpu": sum(r.cpu_seconds for r in report.results),
            "runs": len(report.results)}


def _idle_cpu_per_second(client, seconds: float = 3.0) -> float:
    """CPU the cluster's workers burn with nothing to do (heartbeats, monitors): a cost of a
    running cluster, paid per second, not per run."""
    before = client.run(_process_cpu)
    time.sleep(seconds)
    after = client.run(_process_cpu)
    return sum(after[w] - before[w] for w in after if w in before) / seconds


def real_runs(runs: int, steps: int, repeats: int) -> dict:
    """Local pool of 2 vs LocalCluster of 2, the same runs on both, measured in turn so that
    both see the same weather on a shared machine. The pool is spawned (this process runs the
    cluster's threads, and forking a threaded process is unsafe) and warmed, as the cluster is."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from kvstate.stateful.sweeps.cluster import connect

    seeds = list(range(max(1, runs // len(machine_configs()))))
    local, remote = [], []
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        one = _measured(seeds[:1], steps, out / "one", workers=1, in_process=True)    # CPU of a run, in this process
        with ProcessPoolExecutor(2, mp_context=get_context("spawn")) as pool, _local_cluster(2) as cluster, \
                connect(cluster.scheduler_address, S.DEFAULT_BACKEND, out=None) as session:
            on_cluster = dict(workers=session.workers, executor=session.executor, window=session.window,
                              scheduler=session.address)
            on_pool = dict(workers=2, executor=pool)
            for how in (on_pool, on_cluster):       # warm: imports, first caches
                S.sweep(seeds[:1], 10, machine_configs(), out_dir=out / "warm", progress=None, **how)
            pids = list(pool._processes)
            for i in range(repeats):
                local.append(_measured(seeds, steps, out / f"local{i}", pool_pids=pids, **on_pool))
                remote.append(_measured(seeds, steps, out / f"cluster{i}", client=session.client, **on_cluster))
            idle = _idle_cpu_per_second(session.client)
            noop = scheduling_only(session.executor, session.window, 400)
    total = local[0]["runs"]
    best_local, best_remote = min(m["wall"] for m in local), min(m["wall"] for m in remote)
    cpu_local, cpu_remote = min(m["cpu"] for m in local), min(m["cpu"] - idle * m["wall"] for m in remote)
    return {"runs": total, "steps": steps, "one_run_cpu_seconds": one["run_cpu"] / one["runs"],
            "local": local, "cluster": remote, "idle_worker_cpu_per_s": idle,
            "local_runs_per_s": total / best_local, "cluster_runs_per_s": total / best_remote,
            "wall_overhead_share": best_remote / best_local - 1,
            "cpu_overhead_share": cpu_remote / cpu_local - 1,
            "cpu_overhead_ms_per_run": (cpu_remote - cpu_local) / total * 1000,
            "noop_tasks_per_s": noop, "load_average": os.getloadavg()}


def scheduling_only(executor, window, tasks: int) -> float:
    """Tasks per second for tasks that do nothing: the ceiling one scheduler and client set."""
    started = time.perf_counter()
    for _ in S._map(executor, simulated_run, [(0.0, i) for i in range(tasks)], window):
        pass
    return tasks / (time.perf_counter() - started)


def scaling(run_seconds: float, worker_counts: list[int], runs_per_worker: int) -> list[dict]:
    """Simulated runs per second as worker processes are added (more than there are cores)."""
    from kvstate.stateful.sweeps.cluster import connect

    rows = []
    for workers in worker_counts:
        with _local_cluster(workers) as cluster, connect(cluster.scheduler_address, S.DEFAULT_BACKEND,
                                                         out=None, timeout_s=120) as session:
            cluster.wait_for_workers(workers)
            jobs = [(run_seconds, i) for i in range(workers * runs_per_worker)]
            started = time.perf_counter()
            for _ in S._map(session.executor, simulated_run, jobs, session.window):
                pass
            seconds = time.perf_counter() - started
        rate = len(jobs) / seconds
        rows.append({"workers": workers, "runs": len(jobs), "seconds": seconds, "runs_per_s": rate,
                     "share_of_ideal": rate / (workers / run_seconds)})
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=positive_int, default=36,
                        help="real runs per measurement (default 36), in whole seeds: a multiple of the six "
                             "standard configurations, at least six")
    parser.add_argument("--steps", type=positive_int, default=400, help="operations per run (default 400)")
    parser.add_argument("--repeats", type=positive_int, default=2, help="measurements of each; the best counts")
    parser.add_argument("--workers", default="1,2,4,8,16", help="worker processes for the simulation")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    real = real_runs(args.runs, args.steps, args.repeats)
    print(f"{real['runs']} runs x {real['steps']} steps on {os.cpu_count()} cores, load average "
          f"{real['load_average'][0]:.1f} (one run: {real['one_run_cpu_seconds'] * 1000:.0f} ms of CPU)")
    for name, label in (("local", "local pool, 2 processes"), ("cluster", "LocalCluster, 2 workers x 1 thread")):
        rate = real[f"{name}_runs_per_s"]
        walls = ", ".join(f"{m['wall']:.1f}" for m in real[name])
        cpus = ", ".join(f"{m['cpu']:.1f}" for m in real[name])
        print(f"  {label:36s} {rate:6.2f} runs/s  (wall {walls} s; CPU {cpus} s)")
    print(f"  cluster overhead per run: wall {real['wall_overhead_share'] * 100:+.1f}%; CPU "
          f"{real['cpu_overhead_share'] * 100:+.1f}% ({real['cpu_overhead_ms_per_run']:+.1f} ms per run), not counting "
          f"the {real['idle_worker_cpu_per_s'] * 1000:.0f} ms/s idle workers burn; target <= 10%")
    print(f"  no-op tasks through the same executor and result loop: {real['noop_tasks_per_s']:,.0f} per second")

    counts = [int(n) for n in args.workers.split(",")]
    run_seconds = real["one_run_cpu_seconds"]
    rows = scaling(run_seconds, counts, runs_per_worker=20)
    print(f"\nsimulated runs ({run_seconds * 1000:.0f} ms sleeps, no CPU), LocalCluster on "
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
