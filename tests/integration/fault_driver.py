"""A training job for the fault matrix: one process that trains a stage chunk by chunk through
rlhf_core (as a flow run would, without Prefect) and exports the final model.

    python -m tests.integration.fault_driver RUN_CONFIG_JSON
"""

from __future__ import annotations

import os
import sys

from rlhf_core.chunk import ensure_checkpoint, plan_stage, release_workers, resolve_paths
from rlhf_core.config import RunConfig
from rlhf_core.export import export_hf_model
from rlhf_core.faults import JOB_PID_ENV_VAR
from rlhf_core.resume import begin_stage, open_store, validate_run_start


def main(config_json: str) -> None:
    os.environ[JOB_PID_ENV_VAR] = str(os.getpid())  # a fault in a Ray worker kills this process too
    run = resolve_paths(RunConfig.model_validate_json(config_json))
    validate_run_start(run)
    lineage = begin_stage(run, "sft")
    plan = plan_stage(run, "sft")
    try:
        for target in plan.targets:
            ensure_checkpoint(run, "sft", target, lineage)
    finally:
        release_workers()
    export_hf_model(open_store(run, "sft"), plan.total_steps, run.sft.pretrain, run.sft.save_path)


if __name__ == "__main__":
    main(sys.argv[1])
