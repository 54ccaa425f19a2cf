"""The flow `rlhf`: every requested stage, chunk by chunk, then its export.

Each chunk is the cached task `train_chunk`; a completed chunk is skipped (state `Cached`) on any
later run of the same run name. Progress and metrics artifacts are emitted here, in the flow body,
because a cached task body does not run.
"""

from __future__ import annotations

import json
import logging
import re
import time

from prefect import flow, runtime
from prefect.artifacts import create_table_artifact
from prefect.events import emit_event

from rlhf_core.alerts import NonFiniteTraining

from rlhf_core.chunk import ChunkResult, plan_stage, release_workers, resolve_paths
from rlhf_core.config import STAGES, RunConfig
from rlhf_core.errors import UserError
from rlhf_core.lease import RunLease
from rlhf_core.resume import Lineage, begin_stage, validate_run_start
from tasks.chunks import chunk_task_for, export_final_task, export_model, merge_lora_task


class _NoTracebackForUserErrors(logging.Filter):
    """A UserError is one sentence the CLI prints (exit 2); Prefect's log of it keeps the message, not a
    traceback that would bury it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], UserError):
            record.exc_info, record.exc_text = None, None
        return True


for _logger_name in ("prefect.flow_runs", "prefect.task_runs"):
    logging.getLogger(_logger_name).addFilter(_NoTracebackForUserErrors())
# Where the ranks were placed is worth a line each time a group starts (rlhf_core.engine).
logging.getLogger("rlhf_core").setLevel(logging.INFO)


def _artifact_key(*parts: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")


def _emit_alert(alert: dict) -> None:
    emit_event(event=alert["name"], resource={"prefect.resource.id": f"rlhf.run.{alert['run_name']}.{alert['stage']}"},
               payload=alert)


def _emit_commit_events(run: RunConfig, result: ChunkResult) -> None:
    """`rlhf.checkpoint.committed` and the commit's alerts, for automations (deployments/automations.yaml)."""
    emit_event(event="rlhf.checkpoint.committed",
               resource={"prefect.resource.id": f"rlhf.run.{run.run_name}.{result.stage}"},
               payload={"run": run.run_name, "stage": result.stage, "step": result.step, "uri": result.uri,
                        "manifest_digest": result.manifest_digest, "world_size": result.world_size})
    for alert in result.alerts:
        _emit_alert(alert)


def run_stage(run: RunConfig, stage: str, upstream_digest: str, lineage: Lineage) -> dict:
    """All chunks of one stage, then its export; returns the stage summary."""
    plan = plan_stage(run, stage)
    train_chunk = chunk_task_for(run)
    rows = []
    result = None
    for target in plan.targets:
        state = train_chunk(run, stage, target, upstream_digest, lineage, return_state=True)
        try:
            result = ChunkResult(**state.result())
        except NonFiniteTraining as error:
            _emit_alert(json.loads(error.to_alert(run.run_name).to_json()))
            raise
        if state.name != "Cached":
            _emit_commit_events(run, result)
        status = "cached" if state.name == "Cached" else f"trained {result.num_steps_trained} steps"
        if result.world_size and result.world_size != run.num_workers:  # --allow_fewer_workers after a node loss
            status += f" on {result.world_size} of {run.num_workers} ranks"
        headline = "reward" if "reward" in result.metrics else "loss"
        print(f"{stage} chunk -> step {target}/{plan.total_steps}: {status}, "
              f"{headline} {result.metrics.get(headline, float('nan')):.4f}")
        rows.append({"step": result.step, "status": status, "world_size": result.world_size, **{k: round(v, 6) for k, v in result.metrics.items()},
                     **{f"{k}_s": round(v, 3) for k, v in result.seconds.items()}, "checkpoint": result.uri})
    save_path = export_model(run, stage, plan.total_steps)
    print(f"{stage}: exported the final model (step {plan.total_steps}) to {save_path}")
    create_table_artifact(key=_artifact_key(run.run_name, stage, "chunks"), table=rows,
                          description=f"Chunks of stage {stage} in run {run.run_name}")
    return {"final_step": plan.total_steps, "checkpoint": result.uri, "manifest_digest": result.manifest_digest,
            "save_path": save_path, "chunks": rows}


@flow(name="rlhf", log_prints=True)
def rlhf(config: RunConfig) -> dict:
    """Run the requested RLHF stages in order; each stage resumes from its newest valid checkpoint."""
    run = resolve_paths(config)
    if (runtime.flow_run.run_count or 1) > 1:  # a Prefect retry of this flow run always resumes
        run = run.model_copy(update={"load_checkpoint": True})
    validate_run_start(run)
    summary, upstream_digest = {}, ""
    with RunLease(run.run_url(), run.storage_options):
        try:
            for stage in run.stages:
                started = time.perf_counter()
                kind = STAGES[stage].kind
                if kind == "merge":
                    summary[stage] = merge_lora_task(run)
                elif kind == "export":
                    summary[stage] = export_final_task(run)
                else:
                    summary[stage] = run_stage(run, stage, upstream_digest, begin_stage(run, stage))
                    upstream_digest = summary[stage]["manifest_digest"]
                summary[stage]["seconds"] = round(time.perf_counter() - started, 1)
                print(f"{stage}: output in {summary[stage]['save_path']} ({summary[stage]['seconds']} s)")
        finally:
            release_workers()
    return summary


def run_pipeline(run: RunConfig) -> dict:
    """The flow `rlhf` run in this process, after everything that can be checked before Prefect starts has been
    (rlhf_core.preflight): a user mistake is then one sentence, not a failed flow run's traceback."""
    from rlhf_core.preflight import preflight

    preflight(resolve_paths(run))
    return rlhf(config=run)
