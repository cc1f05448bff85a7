"""The sweep's worker gate: a worker granted the sweep's resource is offered the runs waiting for it.

Found by an audit: Dask reschedules runs waiting for a worker ("no-worker") when a worker joins or
starts running, not when one gains a resource; the gate grants it after the join, so runs whose
worker died before its replacement was granted the resource waited for ever (3 of 4 sweeps whose
workers crashed hung). ``/work/runs/s46/audit_sweep/repro_dask_hang.py`` was the reproducer.
"""

from __future__ import annotations

import time

import pytest

distributed = pytest.importorskip("distributed")

from kvstate.stateful.sweeps.worker_gate import _offer_waiting_runs  # noqa: E402


@pytest.mark.parametrize("offer", [True, False], ids=["offered", "control-not-offered"])
def test_a_run_waiting_for_the_resource_starts_once_a_worker_is_granted_it(offer):
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) \
            as cluster, distributed.Client(cluster) as client:
        future = client.submit(lambda: 42, resources={"kvstate-gate-test": 1}, pure=False)
        time.sleep(0.3)
        assert not future.done()                   # no worker holds the resource: the run waits

        async def grant(dask_worker):
            await dask_worker.set_resources(**{"kvstate-gate-test": 1})
            if offer:
                _offer_waiting_runs(dask_worker)
        client.run(grant)
        if offer:
            assert future.result(timeout=10) == 42
        else:                                      # what the gate did before: the run never starts
            with pytest.raises(distributed.TimeoutError):
                future.result(timeout=1)
