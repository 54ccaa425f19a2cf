"""Everything about a run that can be checked before any training starts (resume rules, output locations, input
models, data, tokenizers, reward functions, LoRA targets, compute settings, tracker packages, the run lease), each
failure one UserError sentence. docs/design-notes.md ("Preflight checks") has the order and why.
"""

from __future__ import annotations

import os

from rlhf_core.config import RunConfig
from rlhf_core.driver.plan import Checked
from rlhf_core.stages import STAGES, TRAINING_STAGES
from rlhf_core.stages.base import StageConfig, fields_with_role
from rlhf_core.storage.writable import probe_writable

def preflight(run: RunConfig) -> Checked:
    """Resolve the run's paths (`resolve_paths`) and refuse, before Prefect starts a flow run, a run that would fail
    on its inputs or outputs; returns the resolved run with the plans counted on the way, which the flow, given
    them through its `StageRunner`, neither resolves nor checks again (a deployment run's flow does both). Two
    halves: `check` reads no data and writes nothing; `count` reads the data and prepares it in the store."""
    return count(*check(run))


def check(run: RunConfig) -> tuple[RunConfig, list[str]]:
    """Every check but the data's: the run resolved, and the stages whose data `count` must read (those training
    from a model no earlier stage produces)."""
    from rlhf_core.driver.plan import resolve_paths
    from rlhf_core.storage.lease import RunLease
    from rlhf_core.driver.resume import validate_run_start
    from rlhf_core.ops.trackers import require_tracker_packages

    run = resolve_paths(run)
    validate_run_start(run)
    outputs = [(run.run_url(), "--ckpt_path")] + [
        (getattr(run.stage_config(stage), STAGES[stage].output_field), f"--{STAGES[stage].output_field}")
        for stage in run.stages]
    for url, flag in outputs:
        probe_writable(url, flag, run.storage_options)
    produced: dict[str, str | None] = {}  # an output of an earlier stage -> the model whose architecture it has
    to_count = []
    for stage in run.stages:
        cfg = run.stage_config(stage)
        for field in fields_with_role(STAGES[stage].config, "model"):
            url = getattr(cfg, field, None)
            if url and url not in produced:
                check_model(url, f"--{field}", run.storage_options)
        architecture = None
        if stage in TRAINING_STAGES:
            check_compute_settings(run, stage)
            training = run.section(stage, StageConfig)
            architecture = produced.get(training.start_model) or training.start_model
            if training.lora_rank:
                check_lora_targets(architecture, training.target_modules, run.storage_options)
            if training.start_model not in produced:
                to_count.append(stage)
        produced[getattr(cfg, STAGES[stage].output_field)] = architecture
    require_tracker_packages(run)
    RunLease(run.run_url(), run.storage_options).check_available()
    return run, to_count


def count(run: RunConfig, stages: list[str]) -> Checked:
    """The checks left once `check` passed: counting reads the data, eval data and reward function of `stages`, and
    prepares the data in the store (rlhf_core.data.prepared), the first thing a refused run would have written."""
    from rlhf_core.driver.plan import plan_stage

    return Checked(run, {stage: plan_stage(run, stage) for stage in stages})


def check_model(url: str, flag: str, storage_options: dict | None) -> None:
    """A model (or adapter) folder transformers can load, and for an adapter its base too."""
    from rlhf_core.storage.locate import check_model_dir, is_lora_dir, local_model_dir, lora_base_dir

    directory = local_model_dir(url, storage_options, flag=flag)
    check_model_dir(directory, url, flag)
    if is_lora_dir(directory):
        base = lora_base_dir(directory, storage_options, flag=flag)
        check_model_dir(base, base, f"{flag} (its base model)")


def check_compute_settings(run: RunConfig, stage: str) -> None:
    """Settings the ranks would refuse only after Ray and DeepSpeed started: fp16 without a GPU (on a local
    Ray, whose ranks run here) and an attention kernel transformers does not know. torch and transformers are
    imported only for the settings that need them (fp16, a named kernel): the driver of a plain run never loads
    them."""
    from rlhf_core.models.precision import resolve_precision

    cfg = run.section(stage, StageConfig)
    if cfg.param_dtype == "fp16" and not (run.ray_address or os.environ.get("RAY_ADDRESS")):
        import torch

        resolve_precision(cfg.param_dtype, on_gpu=torch.cuda.is_available(), cpu_bf16=True)
    if cfg.attn_implementation is not None:
        from rlhf_core.models.load import resolve_attn_implementation

        resolve_attn_implementation(cfg.attn_implementation)


def check_lora_targets(url: str, target_modules: list[str] | None, storage_options: dict | None = None,
                       flag: str = "--pretrain") -> None:
    """Before any rank starts: `refuse_unknown_targets` on the architecture of the model at `url` (`flag`'s
    value; an adapter folder's base), built on the meta device from its config.json."""
    if not target_modules:
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlhf_core.models.lora_targets import refuse_unknown_targets
    from rlhf_core.storage.locate import is_lora_dir, local_model_dir, lora_base_dir

    directory = local_model_dir(url, storage_options, flag=flag)
    if is_lora_dir(directory):
        directory = lora_base_dir(directory, storage_options, flag=flag)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
    refuse_unknown_targets(model, target_modules, url)
