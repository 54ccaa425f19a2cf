"""The chunk task: one `ensure_checkpoint` call, cached by stable identity and retried on failure.

The cache key is a `ChunkKey` (run name, stage, target step, semantic config hash, upstream digest, lineage) and
the checkpoint format version: no flow-run id and no task source, so a new flow run of the same run name, a UI
retry, a subflow restart and a code edit all skip completed chunks. Results are small JSON dicts
persisted in the run's own store (`{ckpt_path}/{run_name}/_prefect/`), never pickles.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import DEFAULT, CachePolicy
from prefect.events import emit_event
from prefect.filesystems import RemoteFileSystem
from prefect.states import Cancelled
from prefect.transactions import get_transaction

from rlhf_core.driver.chunk import ensure_checkpoint
from rlhf_core.driver.plan import StagePlan
from rlhf_core.driver.runner import StageRunner
from rlhf_core.driver.stage_driver import export_stage
from rlhf_core.config import RunConfig, semantic_hash
from rlhf_core.errors import RankHung, StallRepeats, is_retryable
from rlhf_core.driver.export import export_final, merge_lora
from rlhf_core.driver.resume import Lineage
from rlhf_core.driver.stop import StoppedBySignal
from rlhf_core.storage.metadata import CHECKPOINT_FORMAT_VERSION
from rlhf_core.storage.locate import local_path


@dataclass(frozen=True)
class ChunkKey:
    """A chunk's stable identity, its cache key's fields (see the module docstring): the run's name, the stage,
    the target step, the stage's semantic config hash, the upstream stage's final manifest digest, and the
    stage's lineage (`Lineage.cache_token`). `ChunkKey.of` makes one for a run."""

    run_name: str
    stage: str
    target_step: int
    config_hash: str
    upstream_digest: str = ""
    lineage: Lineage = Lineage()

    @classmethod
    def of(cls, run: RunConfig, stage: str, target_step: int, upstream_digest: str = "",
           lineage: Lineage = Lineage()) -> ChunkKey:
        return cls(run.run_name, stage, target_step, semantic_hash(run, stage), upstream_digest, lineage)

    def cache_key(self) -> str:
        identity = {
            "lineage": self.lineage.cache_token(),
            "run_name": self.run_name,
            "stage": self.stage,
            "target_step": self.target_step,
            "config_hash": self.config_hash,
            "upstream_digest": self.upstream_digest,
            "format_version": CHECKPOINT_FORMAT_VERSION,
        }
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
        return f"{self.run_name}-{self.stage}-step{self.target_step}-{digest}"


@dataclass
class ChunkCachePolicy(CachePolicy):
    """Cache key of a chunk from its stable identity (`ChunkKey`)."""

    def compute_key(self, task_ctx: Any, inputs: dict[str, Any], flow_parameters: dict[str, Any],
                    **kwargs: Any) -> str | None:
        return inputs["key"].cache_key()


def emit_alert(alert: dict) -> None:
    """An alert (`rlhf_core.ops.alerts.Alert`, as JSON) as the Prefect event automations react to."""
    resource = {"prefect.resource.id": f"rlhf.run.{alert['run_name']}.{alert['stage']}"}
    emit_event(event=alert["name"], resource=resource, payload=alert)


def run_result_storage(run: RunConfig) -> Path | str:
    """Prefect result storage inside the run's own checkpoint folder.

    A local folder is passed as a Path. Prefect accepts a remote filesystem only as a saved block, so
    one is saved per run; RunConfig refuses secrets in storage_options, so none reach the block.
    """
    url = f"{run.run_url()}/_prefect"
    path = local_path(url)
    if path is not None:
        return Path(path)
    block_name = "rlhf-results-" + hashlib.sha256(url.encode()).hexdigest()[:16]
    RemoteFileSystem(basepath=url, settings=run.storage_options).save(block_name, overwrite=True)
    return f"remote-file-system/{block_name}"


def _retry_if_retryable(task, task_run, state) -> bool:
    """Spend a retry only where one can help: the failure says so itself (`errors.is_retryable`: a lost rank
    yes; a user mistake, a NaN, a full disk or a lost lease no)."""
    try:
        state.result()
    except BaseException as error:  # noqa: BLE001 - classified, not handled
        return is_retryable(error)
    return True


@task(
    name="train_chunk",
    retries=2,
    retry_delay_seconds=[5, 30],
    retry_condition_fn=_retry_if_retryable,
    cache_policy=ChunkCachePolicy(),
    persist_result=True,
    result_serializer="json",
    task_run_name="{key.stage}-to-step-{key.target_step}",
)
def train_chunk(runner: StageRunner, key: ChunkKey, train_ahead: bool = True, plan: StagePlan | None = None) -> dict:
    """Train `key.stage` of the runner's run up to `key.target_step` and commit the checkpoint; returns a
    ChunkResult dict. The cache key is `key`'s, not the runner's processes (its warm worker group, trackers,
    ledger and lease). Not part of the key either: `train_ahead` (train the next chunk while this one commits)
    and `plan` (the stage's, planned once by the flow; a function of the run, which the key holds). Stopped by a
    signal (after its emergency checkpoint, `rlhf_core.driver.stop`), the task run is Cancelled: never retried,
    never cached."""
    try:
        return ensure_checkpoint(runner, key.stage, key.target_step, key.lineage, train_ahead, plan).to_dict()
    except (RankHung, StallRepeats) as hung:  # StallRepeats: the last hang's alert (is_retryable: no retry)
        if hung.alert:
            emit_alert(hung.alert)
        raise
    except StoppedBySignal as stopped:
        # Prefect keeps the cache key of a failed task unwritten, but writes one (with no result) for a returned
        # Cancelled state, which the next run would take as this chunk done: keep it unwritten here too.
        transaction = get_transaction()
        if transaction is not None:
            transaction.write_on_commit = False
        return Cancelled(message=str(stopped))


# Prefect's default policy, less the runner (it holds processes, not inputs).
@task(name="export_model", retries=1, retry_condition_fn=_retry_if_retryable, cache_policy=DEFAULT - "runner")
def export_model(runner: StageRunner, stage: str, final_step: int, plan: StagePlan | None = None) -> str:
    """Export the stage's final checkpoint as a Hugging Face model (an adapter if LoRA) to its save_path."""
    ensure_checkpoint(runner, stage, final_step, plan=plan)  # cheap when present; retrains one that vanished
    return export_stage(runner.run, stage, final_step)


@task(name="merge_lora", retries=1, retry_condition_fn=_retry_if_retryable)
def merge_lora_task(run: RunConfig) -> dict:
    """Merge the policy's LoRA adapter into its base (logits checked before writing)."""
    cfg = run.merge
    difference = merge_lora(cfg.model_path, cfg.lora_path, cfg.output_path, cfg.bf16, run.storage_options)
    return {"save_path": cfg.output_path, "max_logit_difference": difference}


@task(name="export_final", retries=1, retry_condition_fn=_retry_if_retryable)
def export_final_task(run: RunConfig) -> dict:
    """Write the final policy as a standalone HF model that loads and generates."""
    return {"save_path": export_final(run.export.model_path, run.export.save_path, run.storage_options)}


def chunk_task_for(run: RunConfig):
    """The chunk task bound to this run's result storage."""
    return train_chunk.with_options(result_storage=run_result_storage(run))
