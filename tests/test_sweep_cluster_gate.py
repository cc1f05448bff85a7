"""The sweep's worker gate on a real loopback cluster: a run whose worker died is run again by the
worker that replaces it.

Dask looks at runs waiting for a worker ("no-worker") when a worker registers or starts running,
not when a worker gains a resource, and the gate grants the sweep's resource only after a worker
has registered: without the gate's pause and resume, a run left waiting when its worker died
waited for ever beside its idle replacement (a sweep whose workers crashed hung 3 times in 4).
"""

import importlib.util
import os

import pytest


@pytest.mark.skipif(importlib.util.find_spec("distributed") is None,
                    reason="needs Dask distributed (pip install 'kvstate[cluster]')")
def test_a_run_whose_worker_died_runs_on_its_replacement(tmp_path):
    import dask
    from distributed import LocalCluster

    from kvstate.stateful.sweeps import sweep as S
    from kvstate.stateful.sweeps.cluster import connect

    def dies_once(marker: str) -> str:
        """Kills its worker the first time, as a crashing seed does; returns the second.
        Nested, so that it travels by value: the workers cannot import this module."""
        if not os.path.exists(marker):
            open(marker, "w").close()
            os._exit(1)
        return "ran again"

    # One worker: while it is dead none holds the resource, so the run waits for its replacement.
    with dask.config.set({"distributed.comm.timeouts.connect": "10s"}), \
            LocalCluster(n_workers=1, processes=True, threads_per_worker=1, host="127.0.0.1",
                         dashboard_address="127.0.0.1:0") as local, \
            connect(local.scheduler_address, S.DEFAULT_BACKEND, out=None) as session:
        first = session.client.run(os.getpid)
        future = session.executor.submit(dies_once, str(tmp_path / "died"))
        try:
            assert future.result(timeout=30) == "ran again"
        except TimeoutError:        # without the gate's resume: the run waits, "no-worker"
            states = {key: task.state for key, task in local.scheduler.tasks.items()}
            pytest.fail(f"the run never ran again; the scheduler's tasks: {states}")
        assert session.client.run(os.getpid) != first          # on the replacement
        assert len(set(session.accepted)) == 2                 # which the gate checked too
