"""A training job for fault tests: one process that trains the run's stages chunk by chunk through
rlhf_core (as a flow run would, without Prefect) and exports each stage's final model.

    python -m tests.integration.fault_driver RUN_CONFIG_JSON
"""

from __future__ import annotations

import os
import sys

from rlhf_core.driver.stage_driver import train_stage
from rlhf_core.driver.plan import resolve_paths
from rlhf_core.config import RunConfig
from rlhf_core.faults import ENV_VAR, JOB_PID_ENV_VAR, STATE_ENV_VAR
from rlhf_core.driver.resume import validate_run_start


def main(config_json: str) -> None:
    # A fault in a Ray worker kills this process too (RLHF_FAULT_JOB_PID; "0" from the test: the rank alone dies).
    # A job with no faults forwards no pid, so fault-free jobs share one environment, and the ranks one leaves
    # serve the next (rlhf_core/driver/lingering.py).
    if os.environ.get(ENV_VAR) or os.environ.get(STATE_ENV_VAR):
        os.environ.setdefault(JOB_PID_ENV_VAR, str(os.getpid()))
    run = resolve_paths(RunConfig.model_validate_json(config_json))
    validate_run_start(run)
    for stage in run.stages:
        train_stage(run, stage)


if __name__ == "__main__":
    main(sys.argv[1])
