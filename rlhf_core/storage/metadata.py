"""A checkpoint's `training_metadata.json` as one type: what the driver records at each commit (`to_json`) and what
resuming, the alerts and `rlhf ckpt` read back (`from_json`). The JSON keys are a public surface (users' own scripts
read them) and never change meaning; `format_version` counts incompatible changes of the form. A checkpoint written
before a key existed reads as that key's default, and a key this version does not know is kept as it was."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

CHECKPOINT_FORMAT_VERSION = 1


@dataclass(frozen=True)
class WorldSizeChange:
    """A change of world size in a line of checkpoints: the checkpoint at `step` was loaded by `to` ranks, not
    the `from` (`from_size`) that saved it."""

    step: int
    from_size: int
    to: int

    def to_json(self) -> dict[str, int]:
        return {"step": self.step, "from": self.from_size, "to": self.to}

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> WorldSizeChange:
        return cls(int(record["step"]), int(record["from"]), int(record["to"]))


@dataclass(frozen=True)
class CheckpointMetadata:
    """What a checkpoint records about its training (docs/design-notes.md, "One chunk of training"). The fields
    an older checkpoint may lack default to what the readers assumed of them (None: not recorded)."""

    stage: str
    step: int
    total_steps: int | None = None
    consumed_samples: int | None = None
    epoch: int | None = None
    seed: int | None = None
    world_size: int | None = None  # ranks that saved it
    world_size_changes: tuple[WorldSizeChange, ...] = ()  # every change in its line of checkpoints
    zero_stage: int | None = None
    config_hash: str | None = None
    config: dict[str, Any] = field(default_factory=dict)  # the stage's semantic settings (the drift check)
    save_path: str | None = None
    dataset_fingerprint: str | None = None
    input_models: dict[str, str] = field(default_factory=dict)  # field -> fingerprint of each input model
    metrics: dict[str, float] = field(default_factory=dict)  # the chunk's summary (`chunk_summary`)
    trackers: dict[str, Any] = field(default_factory=dict)  # the trackers' run ids, to continue them
    versions: dict[str, str] = field(default_factory=dict)  # torch, deepspeed, transformers
    metric_history: tuple[dict[str, Any], ...] = ()  # `ops.alerts.history_entry`s of its line, itself included
    model_sizes: dict[str, Any] | None = None  # `ops.commit_alerts.model_size_report`; None: not recorded
    format_version: int = CHECKPOINT_FORMAT_VERSION
    unknown: dict[str, Any] = field(default_factory=dict)  # keys of another version, written back unchanged

    def saved_world_size(self, default: int) -> int:
        """The world size that saved it, or `default` when it does not say."""
        return default if self.world_size is None else self.world_size

    def output_path(self) -> str | None:
        """Where the stage writes its model (recorded as `save_path`, or in its settings by an older version)."""
        return self.save_path or self.config.get("save_path")

    def saved_models(self) -> list[dict[str, Any]]:
        """The sizes of the models it saved (`ModelSize` records; none when it does not record them)."""
        return list(((self.model_sizes or {}).get("models") or {}).values())

    def weights_on_gpu(self) -> bool:
        """Whether the ranks that saved it held their weights on GPUs (as its model sizes record)."""
        return bool((self.model_sizes or {}).get("on_gpu", False))

    def history_up_to(self, step: int) -> list[dict[str, Any]]:
        """Its metric history's entries up to `step`."""
        return [entry for entry in self.metric_history if entry["step"] <= step]

    def to_json(self) -> dict[str, Any]:
        """The on-disk form (every key written, as the commit always has)."""
        record = {item.name: getattr(self, item.name) for item in dataclasses.fields(self) if item.name != "unknown"}
        record["world_size_changes"] = [change.to_json() for change in self.world_size_changes]
        record["metric_history"] = list(self.metric_history)
        if self.model_sizes is None:
            del record["model_sizes"]
        return {**self.unknown, **record}

    @classmethod
    def from_json(cls, record: Mapping[str, Any]) -> CheckpointMetadata:
        """Read the on-disk form of any version; missing keys take their defaults (see the class docstring)."""
        names = {item.name for item in dataclasses.fields(cls)} - {"unknown"}
        known = {name: record[name] for name in names if name in record and record[name] is not None}
        known["world_size_changes"] = tuple(WorldSizeChange.from_json(change)
                                            for change in record.get("world_size_changes") or ())
        known["metric_history"] = tuple(record.get("metric_history") or ())
        for name in ("config", "input_models", "metrics", "trackers", "versions"):
            known[name] = dict(record.get(name) or {})
        known.setdefault("stage", "")
        known.setdefault("step", 0)
        return cls(**known, unknown={name: value for name, value in record.items() if name not in names})
