"""The sweep a worker runs before it starts (`python -m flows.orphans`, deployments/local_worker.sh), against a real
Prefect server: after a power cut the runs that ran here and whose process is gone are Crashed at once (for the
restart automation), not 90 s later by the heartbeat automation; a live run, or another host's, is left alone."""

from __future__ import annotations

import subprocess
import sys

from flows import orphans
from tests.integration.conftest import PROJECT_DIR

POOL = "orphans-test"


def test_a_starting_worker_crashes_only_the_runs_orphaned_on_its_host(worker_prefect_server):
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.states import Running

    here = {**orphans.this_process(), orphans.ATTEMPT: "1"}
    labels = {"dead": {**here, orphans.PID: "999999999"}, "alive": here,
              "elsewhere": {**here, orphans.PID: "999999999", orphans.HOST: "another-machine"}}
    with SyncPrefectClient(worker_prefect_server.api_url) as client:
        client.create_work_pool(WorkPoolCreate(name=POOL, type="process"))
        deployment_id = client.create_deployment(flow_id=client.create_flow_from_name("orphans-test"),
                                                 name="orphans-test", work_pool_name=POOL)
        runs = {}
        for name, run_labels in labels.items():
            run = client.create_flow_run_from_deployment(deployment_id, name=name)
            client.set_flow_run_state(run.id, Running(), force=True)  # run_count 1: the labels' attempt
            client.update_flow_run_labels(run.id, run_labels)
            runs[name] = run.id
        swept = subprocess.run([sys.executable, "-m", "flows.orphans", "--pool", POOL], cwd=PROJECT_DIR,
                               env=worker_prefect_server.env, capture_output=True, text=True, timeout=120)
        states = {name: client.read_flow_run(run_id).state for name, run_id in runs.items()}
    assert swept.returncode == 0, swept.stderr
    assert swept.stdout.strip() == "rlhf: flow run dead ran here and its process is gone: marked Crashed, to be " \
                                   "restarted"
    assert states["dead"].type.value == "CRASHED" and "its process 999999999 is gone" in states["dead"].message
    assert states["alive"].type.value == states["elsewhere"].type.value == "RUNNING"
