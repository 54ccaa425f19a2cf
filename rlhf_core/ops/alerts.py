"""The seed's alerts, computed from what a chunk commits: reward stagnation, checkpoint size, non-finite values.
Each is an `Alert`, appended to the run's `alerts.jsonl` (`AlertLog`) and announced as one warning line; this
module only computes and records (no prefect, no ray). docs/design-notes.md ("Alerts") has each alert's rule and
reason, and what DeepSpeed writes, which the size prediction follows.
"""

from __future__ import annotations

import json
import logging
import math
import posixpath
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

from rlhf_core.ops.console import WARNING_PREFIX
from rlhf_core.stages import STAGES
from rlhf_core.errors import RLHFError

logger = logging.getLogger(__name__)

ALERT_REWARD_STAGNANT = "rlhf.alert.reward-stagnant"
ALERT_CHECKPOINT_SIZE = "rlhf.alert.checkpoint-size"
ALERT_NON_FINITE = "rlhf.alert.non-finite"
ALERT_HANG = "rlhf.alert.hang"
ALERT_RESTARTS_EXHAUSTED = "rlhf.alert.restarts-exhausted"  # a deployment's run past --max_restarts (flows/restarts.py)
ALERT_NAMES = (ALERT_REWARD_STAGNANT, ALERT_CHECKPOINT_SIZE, ALERT_NON_FINITE, ALERT_HANG, ALERT_RESTARTS_EXHAUSTED)
ALERTS_FILE_NAME = "alerts.jsonl"


NUM_PARAMETERS_NAMED = 5  # non_finite_parameters stops after this many names


def _json_safe(value: Any) -> Any:
    """`value` with every non-finite float spelled as a string, so the record is strict JSON (NaN is not)."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # 'nan', 'inf', '-inf'
    if isinstance(value, Mapping):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    return value


@dataclass
class Alert:
    """One alert: `name` is its Prefect event name; `message` is one sentence for an operator."""

    name: str
    run_name: str
    stage: str
    step: int
    message: str
    details: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)  # epoch seconds

    def __post_init__(self):
        self.details = _json_safe(dict(self.details))

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, allow_nan=False)

    @classmethod
    def from_json(cls, line: str) -> Alert:
        """Parse one `alerts.jsonl` line; raises ValueError when it is not an alert."""
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError("not valid JSON") from error
        if not isinstance(record, dict):
            raise ValueError("not a JSON object")
        try:
            alert = cls(name=str(record["name"]), run_name=str(record["run_name"]), stage=str(record["stage"]),
                        step=int(record["step"]), message=str(record["message"]),
                        details=dict(record.get("details") or {}), time=float(record["time"]))
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"missing or malformed field: {error}") from error
        return alert


# --- reward-stagnant -------------------------------------------------------------------------------------


def headline_metric(stage: str, metrics: Mapping[str, Any]) -> tuple[str, bool] | None:
    """(name, higher_is_better) of the metric that says whether `stage` is improving, or None if
    `metrics` holds none of them: the first present of the stage's declared `headline_metrics` (PPO:
    eval_reward, mean_reward, reward, higher is better; the others: eval_loss, mean_loss, loss)."""
    declared = STAGES[stage]
    for name in declared.headline_metrics:
        if _is_number(metrics.get(name)):
            return name, declared.higher_is_better
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def history_entry(step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
    """What a checkpoint's metadata keeps for the stagnation check: its step and its headline candidates
    (a small record, so the whole line of checkpoints fits in the newest one's metadata, whatever
    retention removed)."""
    names = {name for stage in STAGES.values() for name in stage.headline_metrics}
    return {"step": int(step), **{name: _json_safe(float(metrics[name])) for name in sorted(names)
                                  if _is_number(metrics.get(name))}}


def metric_history(stage: str,
                   entries: Sequence[Mapping[str, Any]]) -> tuple[str, bool, list[tuple[int, float]]] | None:
    """(metric, higher_is_better, [(step, value)] oldest first) from `history_entry` records (or any
    {"step", metric...} mappings). The metric is the newest entry's headline; entries without it, or with
    a non-finite value (the non-finite alert's business), are left out. None when there is nothing to judge."""
    if not entries:
        return None
    ordered = sorted(entries, key=lambda entry: int(entry["step"]))
    chosen = headline_metric(stage, ordered[-1])
    if chosen is None:
        return None
    name, higher_is_better = chosen
    values = [(int(entry["step"]), float(entry[name])) for entry in ordered
              if _is_number(entry.get(name)) and math.isfinite(entry[name])]
    return name, higher_is_better, values


def checkpoints_without_improvement(values: Sequence[float], higher_is_better: bool,
                                    min_delta: float = 0.0) -> tuple[int, int]:
    """(how many of the newest values in a row failed to improve, index of the best value so far). A value
    improves when it beats the best so far by more than `min_delta`; the first value is the baseline."""
    best_index, streak = 0, 0
    for index in range(1, len(values)):
        gain = values[index] - values[best_index] if higher_is_better else values[best_index] - values[index]
        if gain > min_delta:
            best_index, streak = index, 0
        else:
            streak += 1
    return streak, best_index


@dataclass(frozen=True)
class PlateauRule:
    """When a metric has stagnated: `window` checkpoints in a row that failed to improve on the best value before
    them by more than `min_delta` (--alert_reward_window, --alert_reward_min_delta)."""

    window: int = 3
    min_delta: float = 0.0


def reward_stagnant_alert(run_name: str, stage: str, history: Sequence[tuple[int, float]], metric: str,
                          higher_is_better: bool, rule: PlateauRule = PlateauRule()) -> Alert | None:
    """An alert when the newest checkpoint in `history` ((step, value) pairs, any order; non-finite values
    ignored) is the `rule.window`-th in a row that failed to improve on the best value before it by more than
    `rule.min_delta`: the start of a plateau. None otherwise: before it, and at the flat checkpoints after it
    (the same plateau; the next alert needs an improvement first), and always with fewer than `window + 1`
    values. Stateless: the history alone says where each plateau started, so a retry or a resume from
    another process judges the same way."""
    window, min_delta = rule.window, rule.min_delta
    if window < 1 or min_delta < 0:
        raise ValueError(f"window must be >= 1 and min_delta >= 0 (got {window}, {min_delta})")
    points = sorted((int(step), float(value)) for step, value in history if math.isfinite(value))
    if len(points) < window + 1:
        return None
    streak, best_index = checkpoints_without_improvement([value for _, value in points], higher_is_better, min_delta)
    if streak != window:  # below: not stagnant yet; above: this plateau was reported at its start
        return None
    best_step, best_value = points[best_index]
    recent = points[-streak:]
    direction = "higher" if higher_is_better else "lower"
    hint = STAGES[stage].stall_hint
    message = (f"{stage} {metric} has not improved for {streak} committed checkpoints (steps {recent[0][0]} to "
               f"{recent[-1][0]}): best {best_value:.4g} at step {best_step}, newest {recent[-1][1]:.4g} "
               f"({direction} is better); check {hint} before spending more steps.")
    details = {"metric": metric, "higher_is_better": higher_is_better, "window": window, "min_delta": min_delta,
               "checkpoints_without_improvement": streak, "best_step": best_step, "best_value": best_value,
               "recent": [[step, value] for step, value in recent]}
    return Alert(ALERT_REWARD_STAGNANT, run_name, stage, points[-1][0], message, details)


# --- checkpoint-size -------------------------------------------------------------------------------------


# --- non-finite ------------------------------------------------------------------------------------------


def non_finite_metrics(metrics: Mapping[str, Any]) -> list[str]:
    """The names of the numeric metrics that are NaN or +-Inf."""
    return [name for name, value in metrics.items() if _is_number(value) and not math.isfinite(value)]


def non_finite_parameters(module_or_named_tensors, limit: int = NUM_PARAMETERS_NAMED) -> list[str]:
    """The names of the first `limit` parameters holding NaN or Inf, from a torch module or (name, tensor)
    pairs (a mapping too). Under ZeRO-3 each rank checks its own partition (`ds_tensor`), so the caller
    combines the ranks' answers.

    Each tensor is summed in fp32 first: a NaN or an Inf anywhere makes the sum non-finite, and one read of the
    tensor costs a tenth of `isfinite().all()`, which writes a mask as large as the tensor (3.6 against 38 ms
    for a 23.6M model's weights on 2 cores). The ranks wait for this check at every chunk boundary. Only a
    non-finite sum, which finite values that overflow can also give, is confirmed with `isfinite`."""
    import torch

    if isinstance(module_or_named_tensors, torch.nn.Module):
        named: Iterable = module_or_named_tensors.named_parameters()
    elif isinstance(module_or_named_tensors, Mapping):
        named = module_or_named_tensors.items()
    else:
        named = module_or_named_tensors
    found = []
    with torch.no_grad():
        for name, tensor in named:
            data = getattr(tensor, "ds_tensor", tensor)
            if data.is_floating_point() and data.numel() and not _all_finite(data):
                found.append(name)
                if len(found) >= limit:
                    break
    return found


def _all_finite(tensor) -> bool:
    import torch

    return bool(torch.isfinite(tensor.sum(dtype=torch.float32))) or bool(torch.isfinite(tensor).all())


class NonFiniteTraining(RLHFError, RuntimeError):
    """NaN or Inf in a chunk's metrics or weights: its checkpoint is not committed, and retrying the same
    steps from the same checkpoint would give the same values, so the chunk fails without a retry."""

    def __init__(self, stage: str, step: int, metrics: Sequence[str] = (), parameters: Sequence[str] = ()):
        self.stage, self.step = stage, int(step)
        self.metrics, self.parameters = list(metrics), list(parameters)
        found = [f"metrics {', '.join(self.metrics)}" if self.metrics else "",
                 f"parameters {', '.join(self.parameters)}" if self.parameters else ""]
        super().__init__(
            f"{stage} step {self.step}: NaN or Inf in the {' and '.join(part for part in found if part)}, so this "
            f"checkpoint was not committed; lower the learning rate (or clip harder with a smaller --max_norm), "
            f"then resume from the last committed checkpoint with --load_checkpoint.")

    def __reduce__(self):  # Ray pickles a rank's exception to the driver; __init__ takes four arguments
        return (type(self), (self.stage, self.step, self.metrics, self.parameters))

    def to_alert(self, run_name: str) -> Alert:
        return Alert(ALERT_NON_FINITE, run_name, self.stage, self.step, str(self),
                     {"metrics": self.metrics, "parameters": self.parameters})


# --- the run's alerts.jsonl ------------------------------------------------------------------------------


class AlertLog:
    """`{run_url}/alerts.jsonl`, one `Alert` per line. A local file is appended to (one write per call, after
    a newline if a crash left a partial last line); an object store cannot append, so the file is read and
    written whole. Only the run's lease holder writes, so there is no second writer to race."""

    def __init__(self, run_url: str, storage_options: Mapping[str, Any] | None = None):
        self.fs, root = url_to_fs(run_url, **dict(storage_options or {}))
        self.path = posixpath.join(root.rstrip("/"), ALERTS_FILE_NAME) if root.rstrip("/") else ALERTS_FILE_NAME
        self.url = f"{run_url.rstrip('/')}/{ALERTS_FILE_NAME}"

    def append(self, *alerts: Alert, announced: bool = True) -> None:
        """Record the alerts, then announce each one (`announce`) unless another line says it (`announced`
        False: a failure whose own sentence reaches the console)."""
        if not alerts:
            return
        lines = "".join(alert.to_json() + "\n" for alert in alerts).encode()
        if isinstance(self.fs, LocalFileSystem):
            self._append_local(lines)
        else:
            existing = self._read_bytes()
            if existing and not existing.endswith(b"\n"):
                existing += b"\n"
            self.fs.pipe_file(self.path, existing + lines)
        for alert in alerts if announced else ():
            announce(alert)

    def _append_local(self, lines: bytes) -> None:
        self.fs.makedirs(posixpath.dirname(self.path), exist_ok=True)
        with open(self.path, "ab+") as handle:
            if handle.tell() > 0:
                handle.seek(-1, 2)
                if handle.read(1) != b"\n":
                    lines = b"\n" + lines
            handle.write(lines)

    def _read_bytes(self) -> bytes:
        try:
            return self.fs.cat_file(self.path)
        except FileNotFoundError:
            return b""

    def read(self) -> list[Alert]:
        """Every alert, oldest first; a line that does not parse (a partial write) is skipped."""
        alerts = []
        for line in self._read_bytes().decode("utf-8", errors="replace").splitlines():
            if line.strip():
                try:
                    alerts.append(Alert.from_json(line))
                except ValueError:
                    continue
        return alerts

    def for_stage(self, stage: str) -> list[Alert]:
        return [alert for alert in self.read() if alert.stage == stage]


def announce(alert: Alert) -> None:
    """One `rlhf: warning:` line for the people watching: the console and the flow run's log (docs/design-notes.md,
    "Alerts")."""
    logger.warning("%s%s (%s)", WARNING_PREFIX, alert.message, alert.name)


# --- after a commit ---------------------------------------------------------------------------------------
