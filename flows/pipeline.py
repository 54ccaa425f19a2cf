"""The flow `rlhf`: every requested stage as a subflow run named `{run_name}-{stage}` on the run's `StageRunner`
(training stages: `rlhf-stage`, chunk by chunk as cached, retried tasks, then the export; merge and export:
`rlhf-output`), within the run's budgets, with the events automations read; and `run_pipeline`, the CLI's
preflight, prestart and flow. docs/design-notes.md ("The flow") says how budgets, retries and deployment runs
behave.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from datetime import datetime, timedelta, timezone

import fsspec
from prefect import Flow, flow, get_run_logger, runtime
from prefect.artifacts import create_link_artifact
from prefect.events import emit_event
from prefect.states import Cancelled, State

from flows import restarts
from flows.stage_report import StageReport, StageSummary, artifact_key
from rlhf_core.driver.outage import is_outage
from rlhf_core.driver.stop import StopSignals
from rlhf_core.ops.alerts import NonFiniteTraining
from rlhf_core.driver.chunk import ChunkResult
from rlhf_core.driver.plan import resolve_paths
from rlhf_core.driver.runner import StageRunner
from rlhf_core.config import RunConfig
from rlhf_core.stages import STAGES
from rlhf_core.errors import RLHFError
from rlhf_core.driver.resume import begin_stage, finished_checkpoint, open_store, validate_run_start
from flows.startup import EphemeralServer, checked_while_ray_starts, prestart_first_training_stage
from tasks.chunks import ChunkKey, chunk_task_for, emit_alert, export_final_task, export_model, merge_lora_task

STOPPED_BY_BUDGET = "stopped-by-budget"
COMPLETED = "completed"


class _NoTracebackForNamedFailures(logging.Filter):
    """A named failure (`rlhf_core.errors`) is one sentence the CLI prints; Prefect's log of it keeps the
    message, not a traceback that would bury it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], RLHFError):
            record.exc_info, record.exc_text = None, None
        return True


for _logger_name in ("prefect.flow_runs", "prefect.task_runs"):
    logging.getLogger(_logger_name).addFilter(_NoTracebackForNamedFailures())
# Where the ranks were placed is worth a line each time a group starts (rlhf_core.driver.engine).
logging.getLogger("rlhf_core").setLevel(logging.INFO)
logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- events


def _resource(run: RunConfig, stage: str) -> dict:
    return {"prefect.resource.id": f"rlhf.run.{run.run_name}.{stage}", "prefect.resource.name": f"{run.run_name}/{stage}"}


def _stored_size(run: RunConfig, uri: str) -> int | None:
    """Bytes under a checkpoint folder (one listing), for the commit event."""
    try:
        fs, path = fsspec.core.url_to_fs(uri, **run.storage_options)
        return int(fs.du(path))
    except (OSError, ValueError):
        return None


def _emit_commit_events(run: RunConfig, result: ChunkResult) -> None:
    """`rlhf.checkpoint.committed` and the commit's alerts, for automations (deployments/)."""
    size_bytes = getattr(result, "size_bytes", None) or _stored_size(run, result.uri)
    emit_event(event="rlhf.checkpoint.committed", resource=_resource(run, result.stage),
               payload={"run": run.run_name, "stage": result.stage, "step": result.step, "uri": result.uri,
                        "size_bytes": size_bytes, "manifest_digest": result.manifest_digest,
                        "world_size": result.world_size})
    for alert in result.alerts:
        emit_alert(alert)


def _emit_set_aside_events(run: RunConfig, stage: str, before: set[str]) -> set[str]:
    """`rlhf.checkpoint.set-aside` for each folder that appeared under the store's `.aside/` since `before`;
    returns the folders now there. rlhf_core sets checkpoints aside deep inside a chunk (a corrupt or leftover
    step), so the flow finds them by listing, one call per chunk; during a store outage, at the next chunk."""
    store = open_store(run, stage)
    try:
        entries = store.aside_entries()
    except Exception as error:  # noqa: BLE001 - a store's own error types; only an outage is let pass
        if not is_outage(error):
            raise
        return before
    for entry in entries:
        if entry.name not in before:  # only a new one's REASON file is read: one listing a chunk otherwise
            emit_event(event="rlhf.checkpoint.set-aside", resource=_resource(run, stage),
                       payload={"run": run.run_name, "stage": stage, "step": entry.step, "uri": entry.uri,
                                "size_bytes": _stored_size(run, entry.uri), "reason": store.aside_reason(entry.name)})
    return {entry.name for entry in entries}


# --------------------------------------------------------------------------- budgets


def _budget_reason(chunks_left: int | None, stop_at: datetime | None) -> str | None:
    """Why no further chunk may train in this flow run, or None."""
    if chunks_left is not None and chunks_left <= 0:
        return "the chunk budget (max_chunks_per_run) is spent"
    if stop_at is not None and datetime.now(timezone.utc) >= stop_at:
        return "the time budget (time_budget_minutes) is spent"
    return None


def _last_chunk_allowed(chunks_left: int | None, stop_at: datetime | None, last_chunk_s: float) -> bool:
    """Whether the chunk about to train is the last a run budget allows, so that training the next chunk
    ahead while it commits would be thrown away at the stop: the chunk budget's last, or a chunk that will
    end past the time budget if it takes as long as the previous one (`last_chunk_s`; 0 before any, so the
    first is judged only by a budget already spent). A wrong guess costs the overlap, never work."""
    if chunks_left is not None and chunks_left <= 1:
        return True
    return stop_at is not None and datetime.now(timezone.utc) + timedelta(seconds=last_chunk_s) >= stop_at


def _quiet_console_in_a_deployment_run(run: RunConfig) -> None:
    """The CLI's quiet console for a flow run started from a deployment (in this process of its own, by a
    worker); nothing when the CLI already set it up or the flow runs in a caller's process."""
    from rlhf_core.ops import console
    from rlhf_core.ops.run_log import log_file_for

    if runtime.deployment.id is None or console.configured_log_file() is not None:
        return
    console.configure_console(log_file_for(run.run_url(), run.run_name), run.verbose)
    console.open_log_file()  # the run is real: validate_run_start passed


def _committed_steps(run: RunConfig, stage: str) -> set[int]:
    return {info.step for info in open_store(run, stage).list() if info.is_committed}


# --------------------------------------------------------------------------- flows


@flow(name="rlhf-stage", flow_run_name="{runner.run.run_name}-{stage}", log_prints=True)
def rlhf_stage(runner: StageRunner, stage: str, upstream_digest: str = "", chunks_left: int | None = None,
               stop_at: datetime | None = None, chunks_trained_before: int = 0) -> dict:
    """One training stage of the parent flow's run (its `runner`): its chunks in order, then its export. Stops
    before a chunk that would train once `chunks_left` is 0 or `stop_at` has passed (budgets of the parent flow
    run, which has trained `chunks_trained_before` chunks in earlier stages; the time budget applies after the
    first); returns the stage summary."""
    with runner.signals.obeying():  # Prefect's subflow engine put its SIGTERM handler back
        return _train_stage_chunks(runner, stage, upstream_digest, chunks_left, stop_at, chunks_trained_before)


def _train_stage_chunks(runner: StageRunner, stage: str, upstream_digest: str, chunks_left: int | None,
                        stop_at: datetime | None, chunks_trained_before: int) -> dict | State:
    """The body of `rlhf_stage`; a Cancelled state when a stop signal ended it (rlhf_core.driver.stop)."""
    logger, run = get_run_logger(), runner.run
    aside = {entry.name for entry in open_store(run, stage).aside_entries()}
    lineage = begin_stage(run, stage)
    plan = runner.plan(stage)
    train_chunk = chunk_task_for(run)
    report = StageReport(run, stage, plan, logger)
    result, num_trained, last_chunk_s = None, 0, 0.0
    for target in plan.targets:
        reason = _budget_reason(None if chunks_left is None else chunks_left - num_trained,
                                stop_at if chunks_trained_before + num_trained else None)
        if reason and target not in _committed_steps(run, stage):
            return _stopped(report, result, num_trained, reason).to_dict()
        started = time.monotonic()
        last_allowed = _last_chunk_allowed(None if chunks_left is None else chunks_left - num_trained, stop_at,
                                           last_chunk_s)
        state = train_chunk(runner, ChunkKey.of(run, stage, target, upstream_digest, lineage),
                            train_ahead=not last_allowed, plan=plan, return_state=True)
        aside = _emit_set_aside_events(run, stage, aside)
        if state.is_cancelled():  # stopped by a signal, after its emergency checkpoint
            return Cancelled(message=state.message)
        try:
            result = ChunkResult(**state.result())
        except NonFiniteTraining as error:
            emit_alert(json.loads(error.to_alert(run.run_name).to_json()))
            raise
        trained = state.name != "Cached" and result.num_steps_trained > 0
        num_trained += int(trained)
        last_chunk_s = time.monotonic() - started if trained else last_chunk_s
        if state.name != "Cached":
            _emit_commit_events(run, result)
        report.add_chunk(result, _chunk_status(run, state.name, result))
    if runner.signals.requested():  # the stage's last chunk committed; the next run of the command exports it
        return _cancelled(runner, stage, plan.total_steps)
    save_path = export_model(runner, stage, plan.total_steps, plan)
    report.finish(save_path)
    logger.info("%s: exported the final model (step %d) to %s", stage, plan.total_steps, save_path)
    return StageSummary(COMPLETED, plan.total_steps, checkpoint=result.uri, manifest_digest=result.manifest_digest,
                        save_path=save_path, chunks=report.rows, chunks_trained=num_trained).to_dict()


def _cancelled(runner: StageRunner, stage: str, step: int) -> State:
    """The Cancelled state of a flow that a stop signal ends between chunks or stages."""
    return Cancelled(message=str(runner.signals.stopped(stage, step, runner.run.stage_url(stage))))


def _chunk_status(run: RunConfig, state_name: str, result: ChunkResult) -> str:
    status = "cached" if state_name == "Cached" else f"trained {result.num_steps_trained} steps"
    if result.world_size and result.world_size != run.num_workers:  # --allow_fewer_workers after a node loss
        status += f" on {result.world_size} of {run.num_workers} ranks"
    return status


def _stopped(report: StageReport, result: ChunkResult | None, num_trained: int, reason: str) -> StageSummary:
    """The summary of a stage (`report`'s) stopped by a run budget at a chunk boundary (not exported), `result`
    its last chunk's."""
    step, total_steps = (result.step if result is not None else 0), report.plan.total_steps
    report.refresh()
    report.logger.info("%s: stopped at step %d/%d because %s; the next run of %s continues from there.",
                       report.stage, step, total_steps, reason, report.run.run_name)
    return StageSummary(STOPPED_BY_BUDGET, step, total_steps, result.uri if result else None,
                        result.manifest_digest if result else "", None, report.rows, num_trained, reason)


@flow(name="rlhf-output", flow_run_name="{run.run_name}-{stage}", log_prints=True)
def rlhf_output_stage(run: RunConfig, stage: str) -> dict:
    """The merge (LoRA adapter into its base) or export (standalone HF model) stage, with a link to its output."""
    result = StageSummary.from_dict(merge_lora_task(run) if STAGES[stage].kind == "merge" else export_final_task(run))
    create_link_artifact(key=artifact_key(run.run_name, stage, "output"), link=result.save_path,
                         link_text=result.save_path, description=f"Output of stage {stage} in run {run.run_name}")
    return result.to_dict()


@flow(name="rlhf", log_prints=True)
def rlhf(config: RunConfig) -> dict:
    """Run the requested RLHF stages in order; each stage resumes from its newest valid checkpoint.
    Returns {stage: summary}; a stage stopped by a run budget has status "stopped-by-budget". A deployment's run
    that fails on a fault that passes, or is preempted, ends rescheduled instead (flows/restarts.py)."""
    run = resolve_paths(config)
    restarts.start_attempt(run)  # a deployment's run: outlive its worker, label its process, back off or stop
    runner = StageRunner(run, announce=emit_alert)
    try:
        with runner.signals.obeying(), runner:  # in place of Prefect's SIGTERM handler (Crashed)
            outcome = _run_stages(runner, prepared=False)
    except Exception as error:
        rescheduled = restarts.after_failure(run, error)
        if rescheduled is None:
            raise
        restarts.leave_as(rescheduled)
    if isinstance(outcome, State) and outcome.is_cancelled() and runner.signals.signal_number is not None:
        preempted = restarts.after_stop(outcome, signal.Signals(runner.signals.signal_number).name)
        if preempted is not outcome:
            restarts.leave_as(preempted)
    return outcome


def _rlhf_on(runner: StageRunner) -> Flow:
    """The flow `rlhf` (its name, parameter and body) on a runner its caller created and closes: the CLI's, whose
    worker group started beside Prefect's server and whose preflight already resolved and checked the run."""

    def rlhf_on_runner(config: RunConfig) -> dict:
        with runner.signals.obeying():
            prepared = runner.is_checked(config)
            return _run_stages(runner if prepared else runner.with_run(resolve_paths(config)), prepared)

    return flow(rlhf_on_runner, name=rlhf.name, description=rlhf.description, log_prints=True)


def _run_stages(runner: StageRunner, prepared: bool) -> dict | State:
    """The body of `rlhf` over the runner's run (`prepared`: resolved and validated already, by the CLI's
    preflight); a Cancelled state when a stop signal ended it (rlhf_core.driver.stop)."""
    logger = get_run_logger()
    if (runtime.flow_run.run_count or 1) > 1:  # a Prefect retry of this flow run always resumes
        runner, prepared = runner.with_run(runner.run.model_copy(update={"load_checkpoint": True})), False
    run = runner.run
    if not prepared:
        validate_run_start(run)
    _quiet_console_in_a_deployment_run(run)
    stop_at = (datetime.now(timezone.utc) + timedelta(minutes=run.time_budget_minutes)
               if run.time_budget_minutes else None)
    summary: dict[str, StageSummary] = {}
    upstream_digest, num_trained = "", 0
    runner.ledger.attempt_started()  # before the lease: it still names a crashed predecessor's process
    ended_well = False  # then the ranks may serve the next command (rlhf_core/driver/lingering.py)
    with runner.holding_lease():
        try:
            prestart_first_training_stage(runner)  # a deployment run's; the CLI's run_pipeline started it already
            for stage in run.stages:
                if runner.signals.requested():  # between stages: the last one finished, the next run starts this
                    done = [name for name in summary if STAGES[name].kind == "train"]
                    return _cancelled(runner, done[-1], summary[done[-1]].final_step or 0) if done else \
                        _cancelled(runner, stage, 0)
                started = time.perf_counter()
                kind = STAGES[stage].kind
                if kind in ("merge", "export"):
                    summary[stage] = StageSummary.from_dict(rlhf_output_stage(run, stage))
                else:
                    chunks_left = None if run.max_chunks_per_run is None else run.max_chunks_per_run - num_trained
                    outcome = _training_stage(runner, stage, upstream_digest, chunks_left, stop_at, num_trained)
                    if isinstance(outcome, State):
                        return outcome
                    summary[stage] = outcome
                    num_trained += summary[stage].chunks_trained or 0
                    upstream_digest = summary[stage].manifest_digest or ""
                summary[stage].seconds = round(time.perf_counter() - started, 1)
                if summary[stage].status == STOPPED_BY_BUDGET:
                    break
                logger.info("%s: output in %s (%s s)", stage, summary[stage].save_path, summary[stage].seconds)
            ended_well = True
        finally:
            runner.release_workers(retire=ended_well)
            runner.ledger.attempt_finished()
    return {stage: stage_summary.to_dict() for stage, stage_summary in summary.items()}


def _training_stage(runner: StageRunner, stage: str, upstream_digest: str, chunks_left: int | None,
                    stop_at: datetime | None, num_trained: int) -> StageSummary | State:
    """The summary of the subflow `rlhf_stage` (its Cancelled state when a stop ended it), or, for a stage a resuming
    run finds finished (`finished_checkpoint`: its last step committed and exported), the summary without one."""
    run = runner.run
    done = finished_checkpoint(run, stage, lambda: runner.plan(stage).total_steps)
    if done is None:
        state = rlhf_stage(runner, stage, upstream_digest, chunks_left, stop_at, num_trained, return_state=True)
        return Cancelled(message=state.message) if state.is_cancelled() else StageSummary.from_dict(state.result())
    begin_stage(run, stage)  # its drift guard: a changed setting or input is refused as when the stage is entered
    save_path = getattr(run.stage_config(stage), STAGES[stage].output_field)
    get_run_logger().info("%s: finished by an earlier run (step %d, exported to %s): not entered again", stage,
                          done.step, save_path)
    return StageSummary(COMPLETED, done.step, checkpoint=open_store(run, stage).uri(done.step),
                        manifest_digest=done.manifest_digest, save_path=save_path, chunks=[], chunks_trained=0)


def run_pipeline(run: RunConfig, command_started: float | None = None, signals: StopSignals | None = None) -> dict:
    """The flow `rlhf` run in this process, after everything that can be checked before Prefect starts has been
    (rlhf_core.driver.preflight): a user mistake is then one sentence, not a failed flow run's traceback. Ray starts
    beside a long preparation (flows.startup), Prefect's server beside the first ranks' start.
    `command_started`: when the command began (the goodput ledger counts its start-up from there); `signals`: the
    command's stop signals (by default the run's own, obeyed from the flow's start)."""
    from rlhf_core.ops.console import open_log_file

    checked = checked_while_ray_starts(run, signals)
    open_log_file()  # preflight passed: the run is real
    # announce: a hang replaced in place inside a chunk, its alert as a Prefect event at once
    with StageRunner(checked.run, checked, command_started, signals, emit_alert) as runner:
        server = EphemeralServer()
        server.start()
        try:
            prestart_first_training_stage(runner)  # Ray and the first ranks start beside Prefect
        finally:
            server.join()  # never leave the start half done (an exit would wait on it)
        state = _rlhf_on(runner)(config=checked.run, return_state=True)
    if state.is_cancelled() and runner.signals.outcome is not None:
        raise runner.signals.outcome
    return state.result()
