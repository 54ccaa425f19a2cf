"""A whole training stage in this process, without Prefect (library use, tests and the fault driver): every
chunk in turn (`rlhf_core.driver.chunk.ensure_checkpoint`), then the export of its final checkpoint as a Hugging Face
model. The flow `rlhf` (flows/pipeline.py) does the same with Prefect's caching and retries.
"""

from __future__ import annotations

from rlhf_core.driver.chunk import ensure_checkpoint
from rlhf_core.config import RunConfig
from rlhf_core.driver.export import export_stage_output
from rlhf_core.driver.resume import begin_stage, open_store
from rlhf_core.driver.runner import StageRunner
from rlhf_core.stages import STAGES
from rlhf_core.stages.base import StageConfig


def train_stage(run: RunConfig, stage: str) -> str:
    """Every chunk of a training stage, then its export, in this process and without Prefect (for
    library use and tests; the flow `rlhf` does the same with caching and retries). Returns save_path."""
    with StageRunner(run) as runner, runner.holding_lease():
        lineage, plan = begin_stage(run, stage), runner.plan(stage)
        for target in plan.targets:
            ensure_checkpoint(runner, stage, target, lineage, plan=plan)
        runner.release_workers()  # before the export: the ranks' memory back
        return export_stage(run, stage, plan.total_steps)


def export_stage(run: RunConfig, stage: str, final_step: int) -> str:
    """The stage's final checkpoint as a Hugging Face model (an adapter if LoRA) in its save_path, and the models
    its settings export besides (`StageConfig.extra_exports`, e.g. a critic). Returns save_path."""
    cfg, store = run.section(stage, StageConfig), open_store(run, stage)
    for model_dir, url in cfg.extra_exports().items():
        export_stage_output(store, final_step, model_dir, cfg.start_model, url, run.storage_options)
    return export_stage_output(store, final_step, STAGES[stage].export_model_dir, cfg.start_model,
                               cfg.save_path, run.storage_options)
