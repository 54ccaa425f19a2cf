"""flows/orphans.py: a flow-run process that outlives the worker reading its console, and which Running runs a
worker starting after a power cut takes for orphans. The sweep against a real server is
tests/integration/test_orphans.py; the power cut itself is `make soak`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from flows import orphans

PROJECT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Prefect's console handler on stdout, as in a flow-run process that a process worker started with a pipe.
FLOW_RUN_PROCESS = textwrap.dedent("""
    import logging, os, sys, time
    from prefect.logging.handlers import PrefectConsoleHandler
    logger = logging.getLogger("a-flow-run")
    logger.addHandler(PrefectConsoleHandler(stream=sys.stdout))
    logger.setLevel(logging.INFO)
    if sys.argv[1] == "outlive":
        from flows.orphans import outlive_the_worker
        outlive_the_worker()
    while not os.path.exists(sys.argv[2]):  # until the worker is gone
        time.sleep(0.05)
    for index in range(100):
        logger.info("chunk %d committed", index)
    print("still here", file=sys.stderr)
    open(sys.argv[3], "w").write("trained on")
""")


@pytest.mark.parametrize("outlive", [False, True], ids=["as-prefect-leaves-it", "outliving-the-worker"])
def test_a_flow_run_outlives_the_worker_reading_its_console(tmp_path, outlive):
    """Without `outlive_the_worker`, the first console line after the pipe's reader died ends the process
    (rich: SystemExit(1)); with it the run goes on."""
    worker_gone, alive = tmp_path / "worker-gone", tmp_path / "alive"
    process = subprocess.Popen([sys.executable, "-c", FLOW_RUN_PROCESS, "outlive" if outlive else "plain",
                                str(worker_gone), str(alive)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               cwd=PROJECT_DIR)
    process.stdout.close()  # the worker is SIGKILLed: its ends of the pipes close
    process.stderr.close()
    worker_gone.touch()
    assert process.wait(timeout=120) == (0 if outlive else 1)
    assert alive.exists() == outlive


def test_an_orphan_is_a_running_run_of_this_host_whose_process_is_gone():
    here = orphans.this_process()
    mine = {**here, orphans.ATTEMPT: "3"}
    assert orphans.orphaned(mine, 3, here) is None  # this very process: alive
    assert orphans.orphaned({**mine, orphans.PID: "999999999"}, 3, here) == "its process 999999999 is gone"
    reused = {**mine, orphans.PID: "1"}  # pid 1 exists, but did not start when the labels say
    assert orphans.orphaned(reused, 3, here) == "its process 1 is gone"
    rebooted = {**mine, orphans.BOOT: "another-boot"}
    assert "this machine restarted" in orphans.orphaned(rebooted, 3, here)
    assert orphans.orphaned({**rebooted, orphans.HOST: "another-host"}, 3, here) is None  # not ours to judge
    assert orphans.orphaned(rebooted, 4, here) is None  # a newer attempt started, not yet labelled
    assert orphans.orphaned({}, 1, here) is None  # a run that never labelled itself (another flow)
