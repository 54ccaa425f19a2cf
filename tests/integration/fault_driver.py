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
from rlhf_core.faults import JOB_PID_ENV_VAR
from rlhf_core.driver.resume import validate_run_start


def main(config_json: str) -> None:
    os.environ[JOB_PID_ENV_VAR] = str(os.getpid())  # a fault in a Ray worker kills this process too
    run = resolve_paths(RunConfig.model_validate_json(config_json))
    validate_run_start(run)
    for stage in run.stages:
        train_stage(run, stage)


if __name__ == "__main__":
    main(sys.argv[1])
