"""The alerts a commit is checked for (`commit_alerts`): reward stagnation (`rlhf_core.ops.alerts`' rule) and the
checkpoint's size, against what it should weigh (from its models' sizes, ZeRO stage, world size and optimizer) and
against the previous checkpoints. See `rlhf_core.ops.alerts` for the alerts' common shape, docs/design-notes.md
("Alerts") for the seed's reasons."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

from rlhf_core.errors import human_bytes
from rlhf_core.ops.alerts import ALERT_CHECKPOINT_SIZE, Alert, PlateauRule, metric_history, reward_stagnant_alert
from rlhf_core.storage.metadata import CheckpointMetadata


MASTER_WEIGHT_BYTES = 4  # fp32 master copy per trainable parameter
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8}  # two fp32 moments per trainable parameter
# Measured on DeepSpeed 0.19 checkpoints of the toy model; negligible beside a real model's weights.
DEEPSPEED_SCRIPTS_BYTES = 41_070  # zero_to_fp32.py + zero_to_torch.py, copied into each model folder
TORCH_FILE_OVERHEAD_BYTES = 8_000  # pickled bookkeeping of one .pt file (ds_config, shapes, scheduler)
HF_SMALL_FILES_BYTES = 3_000  # config.json, generation_config.json, safetensors header
CHECKPOINT_SMALL_FILES_BYTES = 3_500  # training_metadata.json + MANIFEST.json


@dataclass(frozen=True)
class ModelSize:
    """What a checkpoint's size depends on for one saved model: its parameters (all and trainable; with
    LoRA the trainable ones are the adapter), the bytes of one parameter in the training dtype, LoRA."""

    num_params: int
    num_trainable_params: int
    param_bytes: int
    lora: bool = False

    @classmethod
    def from_module(cls, module, lora: bool | None = None) -> ModelSize:
        """Count a torch module's parameters (ZeRO-3's partitioned ones by their full size, `ds_numel`)."""
        num_params = num_trainable = 0
        param_bytes = 0
        for param in module.parameters():
            numel = int(getattr(param, "ds_numel", param.numel()))
            num_params += numel
            if param.requires_grad:
                num_trainable += numel
                param_bytes = param_bytes or param.element_size()
        param_bytes = param_bytes or next(iter(module.parameters())).element_size()
        return cls(num_params, num_trainable, param_bytes, hasattr(module, "peft_config") if lora is None else lora)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> ModelSize:
        return cls(int(record["num_params"]), int(record["num_trainable_params"]), int(record["param_bytes"]),
                   bool(record.get("lora", False)))


@dataclass(frozen=True)
class SaveLayout:
    """How a checkpoint's models are saved: with `zero_stage` over `world_size` ranks and `optimizer`; whether
    DeepSpeed's state is written (`has_ds_state`; not with --disable_ds_ckpt) and a Hugging Face copy beside it;
    whether the weights were on GPUs (ZeRO-2 then writes its frozen weights twice)."""

    zero_stage: int
    world_size: int = 1
    optimizer: str = "adamw"
    has_ds_state: bool = True
    has_hf_copy: bool = True
    on_gpu: bool = False


@dataclass(frozen=True)
class AlertSettings:
    """How a run judges its commits (its --alert_* flags), and whether its checkpoints hold DeepSpeed's state
    (not with --disable_ds_ckpt)."""

    run_name: str
    window: int = 3
    min_delta: float = 0.0
    tolerance: float = 0.5
    jump: float = 0.2
    has_ds_state: bool = True


def _model_bytes(model: ModelSize, layout: SaveLayout) -> int:
    """Predicted bytes of one model's folder in a checkpoint (what DeepSpeed writes: docs/design-notes.md, "Alerts")."""
    zero_stage, world_size = layout.zero_stage, layout.world_size
    total = 0
    if layout.has_hf_copy:
        hf_params = model.num_trainable_params if model.lora else model.num_params
        total += hf_params * model.param_bytes + HF_SMALL_FILES_BYTES
    if not layout.has_ds_state:
        return total
    trainable, frozen = model.num_trainable_params, model.num_params - model.num_trainable_params
    master = MASTER_WEIGHT_BYTES if zero_stage > 0 or model.param_bytes != MASTER_WEIGHT_BYTES else 0
    total += trainable * (master + OPTIMIZER_STATE_BYTES[layout.optimizer])
    if zero_stage == 3:
        total += frozen * model.param_bytes  # frozen partitions; trainable weights live in the optimizer shards
    else:
        total += model.num_params * model.param_bytes
        if zero_stage == 2 and layout.on_gpu:
            total += frozen * model.param_bytes  # frozen_param_fragments: CPU copies beside the GPU state dict
    num_torch_files = (world_size if zero_stage == 3 else 1) + (world_size if zero_stage > 0 else 0)
    return total + num_torch_files * TORCH_FILE_OVERHEAD_BYTES + DEEPSPEED_SCRIPTS_BYTES


def expected_checkpoint_bytes(model: ModelSize, layout: SaveLayout, extra_models: Sequence[ModelSize] = (),
                              extra_bytes: int = 0) -> int:
    """Predicted total bytes of a committed step folder that saves `model` (`num_params` parameters,
    `num_trainable_params` trained; with `lora`, the adapter's; `param_bytes` per weight in the training dtype: 4
    fp32, 2 bf16/fp16) as `layout` says; plus the `extra_models` saved beside it (PPO's critic) the same way, and
    `extra_bytes` known besides (a tokenizer)."""
    if layout.optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"no checkpoint size model for optimizer {layout.optimizer!r}; "
                         f"known: {sorted(OPTIMIZER_STATE_BYTES)}")
    if layout.zero_stage not in (0, 1, 2, 3) or layout.world_size < 1:
        raise ValueError(f"zero_stage must be 0-3 and world_size >= 1 (got {layout.zero_stage}, {layout.world_size})")
    return CHECKPOINT_SMALL_FILES_BYTES + extra_bytes + sum(
        _model_bytes(saved, layout) for saved in (model, *extra_models))


def _relative_gap(actual: float, reference: float) -> float:
    return abs(actual - reference) / reference


def _size_findings(actual_bytes: int, expected_bytes: int | None, previous_sizes: Sequence[int], tolerance: float,
                   jump: float) -> tuple[list[str], frozenset[tuple[str, str]], dict[str, Any]]:
    """What is off about a checkpoint of `actual_bytes`: (sentences for the message, the findings as
    {("predicted" | "previous", "more" | "less")}, details). Empty when nothing is."""
    reasons, findings = [], set()
    details: dict[str, Any] = {"actual_bytes": int(actual_bytes), "tolerance": tolerance, "jump": jump}
    if expected_bytes:
        gap = _relative_gap(actual_bytes, expected_bytes)
        details |= {"expected_bytes": int(expected_bytes), "ratio_to_expected": actual_bytes / expected_bytes}
        if gap > tolerance:
            side = "more" if actual_bytes > expected_bytes else "less"
            findings.add(("predicted", side))
            reasons.append(f"{gap:.0%} {side} than the {human_bytes(expected_bytes)} its models' parameters, "
                           f"dtype, ZeRO stage and optimizer predict")
    if previous_sizes:
        median = statistics.median(previous_sizes)
        details |= {"previous_median_bytes": median, "num_previous": len(previous_sizes)}
        if median > 0 and _relative_gap(actual_bytes, median) > jump:
            side = "more" if actual_bytes > median else "less"
            findings.add(("previous", side))
            reasons.append(f"{_relative_gap(actual_bytes, median):.0%} {side} than the median "
                           f"{human_bytes(median)} of the {len(previous_sizes)} previous committed checkpoints")
    return reasons, frozenset(findings), details


def repeats_previous_anomaly(actual_bytes: int, expected_bytes: int | None, previous_sizes: Sequence[int],
                             tolerance: float = 0.5, jump: float = 0.2) -> bool:
    """Whether a checkpoint of `actual_bytes` shows the same anomaly as the newest of `previous_sizes` (oldest
    first): the same findings, on the same sides (a size off from the one before by more than `jump` is a
    finding of its own, against the median). That predecessor is judged as its own commit was, against the
    prediction and the sizes before it (those still listed: retention may have removed some), so a
    persisting anomaly is reported once, at the checkpoint where it started."""
    if not previous_sizes:
        return False
    _, findings, _ = _size_findings(actual_bytes, expected_bytes, previous_sizes, tolerance, jump)
    _, before, _ = _size_findings(previous_sizes[-1], expected_bytes, previous_sizes[:-1], tolerance, jump)
    return bool(findings) and findings == before


def checkpoint_size_alert(actual_bytes: int, expected_bytes: int | None, previous_sizes: Sequence[int],
                          settings: AlertSettings, stage: str, step: int) -> Alert | None:
    """An alert when a committed checkpoint's `actual_bytes` differ from `expected_bytes` by more than
    `settings.tolerance` (relative to the prediction; skipped when there is none), or from the median of the
    `previous_sizes` (the stage's earlier committed checkpoints, oldest first) by more than `settings.jump`; None
    otherwise, and None when the previous checkpoint showed the same anomaly (`repeats_previous_anomaly`)."""
    tolerance, jump = settings.tolerance, settings.jump
    reasons, _, details = _size_findings(actual_bytes, expected_bytes, previous_sizes, tolerance, jump)
    if not reasons or repeats_previous_anomaly(actual_bytes, expected_bytes, previous_sizes, tolerance, jump):
        return None
    message = (f"{stage} checkpoint step_{step} holds {human_bytes(actual_bytes)}, {' and '.join(reasons)}; "
               f"check that every rank saved all its files (`rlhf ckpt ls --verify`) before resuming from it.")
    return Alert(ALERT_CHECKPOINT_SIZE, settings.run_name, stage, step, message, details)


def model_size_report(modules: Mapping[str, Any]) -> dict[str, Any]:
    """What a rank knows about the models a checkpoint saves, for its metadata (`model_sizes`):
    {"on_gpu": bool, "models": {folder name: ModelSize as a dict}}; `modules` maps the checkpoint folder
    (`actor_model`, `critic_model`, `reward_model`) to its torch module (a DeepSpeed engine's `.module`)."""
    on_gpu = any(param.is_cuda for module in modules.values() for param in module.parameters())
    return {"on_gpu": on_gpu, "models": {name: ModelSize.from_module(module).to_dict()
                                         for name, module in modules.items()}}


def expected_bytes_from_metadata(metadata: CheckpointMetadata, has_ds_state: bool = True) -> int | None:
    """The predicted size of a checkpoint from its metadata (`model_sizes`, `zero_stage`, `world_size`); None when
    it does not record its models (written before the alerts existed)."""
    models = [ModelSize.from_dict(record) for record in metadata.saved_models()]
    if not models:
        return None
    layout = SaveLayout(metadata.zero_stage or 0, metadata.saved_world_size(1), has_ds_state=has_ds_state,
                        on_gpu=metadata.weights_on_gpu())
    return expected_checkpoint_bytes(models[0], layout, models[1:])


def commit_alerts(settings: AlertSettings, metadata: CheckpointMetadata, actual_bytes: int,
                  previous_sizes: Sequence[int]) -> list[Alert]:
    """The reward-stagnant and checkpoint-size alerts of a just-committed checkpoint, from its metadata
    (`metric_history`: `history_entry` records of its line of checkpoints, itself included; `model_sizes`),
    its size in bytes and the sizes of the stage's earlier committed checkpoints."""
    alerts = []
    run_name, stage, step = settings.run_name, metadata.stage, metadata.step
    history = metric_history(stage, list(metadata.metric_history))
    if history is not None:
        metric, higher_is_better, points = history
        rule = PlateauRule(settings.window, settings.min_delta)
        alerts.append(reward_stagnant_alert(run_name, stage, points, metric, higher_is_better, rule))
    alerts.append(checkpoint_size_alert(actual_bytes, expected_bytes_from_metadata(metadata, settings.has_ds_state),
                                        previous_sizes, settings, stage, step))
    return [alert for alert in alerts if alert is not None]
