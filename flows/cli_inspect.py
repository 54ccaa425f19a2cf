"""The read-only commands of `rlhf`: `ckpt ls` / `ckpt verify` (with each stage's alerts), `status`, `goodput` and
`plan` (the checkpoint interval from the run's goodput ledger). They read the store and the ledger; none trains."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from rlhf_core.errors import UserError
from rlhf_core.stages import STAGES
from rlhf_core.storage.manifest import CheckpointInfo


def cmd_goodput(run_url: str, as_json: bool) -> None:
    """`rlhf goodput RUN_URL`: the run's ledger in a few lines (rlhf_core.ops.goodput)."""
    from rlhf_core.ops.goodput_summary import format_summary, read_ledger

    summary = read_ledger(run_url.rstrip("/"))
    print(json.dumps(summary.to_dict(), indent=2) if as_json else format_summary(summary, run_url.rstrip("/")))


def cmd_plan(args: argparse.Namespace) -> None:
    """`rlhf plan`: per stage, the measured costs, the goodput expected at today's save_steps and at Young's."""
    costs = GivenCosts(args.checkpoint_seconds, args.step_seconds, args.restart_seconds)
    print("\n".join(plan_lines(args.ckpt_path, args.run_name, args.mtbf_hours, args.stage, costs)))


@dataclasses.dataclass(frozen=True)
class GivenCosts:
    """The costs `rlhf plan` is given in place of the ledger's measurements (None: measured): C, the seconds a
    checkpoint costs; the seconds a step takes; R, the seconds a restart costs."""

    checkpoint_seconds: float | None = None
    step_seconds: float | None = None
    restart_seconds: float | None = None


def plan_lines(ckpt_path: str, run_name: str, mtbf_hours: float, only_stage: str | None = None,
               costs: GivenCosts = GivenCosts()) -> list[str]:
    """Per stage of the run's ledger (or once, for the given costs): C, step time and R, the goodput expected
    at the save_steps the run used, and Young's interval with the goodput expected there."""
    from rlhf_core.ops.goodput import GoodputLedger
    from rlhf_core.ops.goodput_summary import measured_costs

    checkpoint_seconds, step_seconds, restart_seconds = dataclasses.astuple(costs)
    for flag, value, may_be_zero in (("--mtbf_hours", mtbf_hours, False), ("--step_seconds", step_seconds, False),
                                     ("--checkpoint_seconds", checkpoint_seconds, True),
                                     ("--restart_seconds", restart_seconds, True)):
        if value is not None and not (value >= 0 and (may_be_zero or value > 0)):
            raise UserError(f"{flag} {value} must be a positive number of {'hours' if 'hours' in flag else 'seconds'}.")
    run_url = f"{ckpt_path.rstrip('/')}/{run_name}"
    ledger = GoodputLedger(run_url)
    given = checkpoint_seconds is not None and step_seconds is not None
    stages = [stage for stage in _ledger_stages(ledger, required=not given)
              if only_stage in (None, stage.stage) and measured_costs(stage) is not None]
    if not stages and not given:
        raise UserError(f"{ledger.url} has no committed chunk{' of stage ' + only_stage if only_stage else ''} yet: "
                        "train a few chunks first, or give --checkpoint_seconds and --step_seconds.")
    lines = [f"plan for run {run_name} ({run_url}), MTBF {mtbf_hours:g} h:"]
    overrides = (checkpoint_seconds, step_seconds, restart_seconds)
    for stage in stages or [None]:
        measured = measured_costs(stage) if stage is not None else (0.0, 0.0, 0.0)
        name = stage.stage if stage is not None else (only_stage or "given")
        lines += _stage_plan(name, measured, overrides, mtbf_hours * 3600,
                             round(stage.steps / stage.chunks) if stage is not None else None)
        lines += _snapshot_memory(run_url, name) if stage is not None else []
    lines.append("expected goodput = 1 - C/T - (T/2 + R)/MTBF (first order; T = save_steps x step seconds)")
    return lines


def _stage_plan(name: str, measured: tuple[float, float, float], overrides: tuple, mtbf_seconds: float,
                save_steps_now: int | None) -> list[str]:
    from rlhf_core.ops.goodput_summary import expected_goodput, plan_interval

    c, t, r = (given if given is not None else value for given, value in zip(overrides, measured))
    sources = ["given" if given is not None else "measured" for given in overrides]
    lines = [f"{name}: C {c:.3g} s per checkpoint ({sources[0]}), step {t:.3g} s ({sources[1]}), "
             f"restart R {r:.3g} s ({sources[2]})"]
    if save_steps_now:
        lines.append(f"  now:       --save_steps {save_steps_now} ({save_steps_now * t:.3g} s of work per checkpoint): "
                     f"expected goodput {100 * expected_goodput(save_steps_now * t, c, mtbf_seconds, r):.2f}%")
    plan = plan_interval(c, t, mtbf_seconds, r)
    lines.append(f"  suggested: --save_steps {plan.save_steps} (T = sqrt(2*C*MTBF) = {plan.interval_seconds:.3g} s "
                 f"of work): expected goodput {100 * plan.expected_goodput:.2f}%")
    return lines


def _snapshot_memory(run_url: str, stage: str) -> list[str]:
    """The memory the snapshots between commits take (`rlhf_core.rank.interim`): two per rank in its node's tmpfs
    (and their copies on the next node, for a group on several), each the rank's share of the DeepSpeed state of the stage's newest commit (none when it has no commit)."""
    from rlhf_core.errors import human_bytes
    from rlhf_core.storage.interim import NUM_SLOTS
    from rlhf_core.storage.checkpoint import CheckpointStore
    from rlhf_core.storage.manifest import MANIFEST_NAME

    store = CheckpointStore(f"{run_url}/{stage}")
    committed = [info for info in store.list() if info.is_committed]
    if not committed:
        return []
    newest = committed[-1]
    state_bytes = sum(entry["size"] for entry in store.read_json(f"{newest.name}/{MANIFEST_NAME}")["files"]
                      if "/ds/" in entry["path"])
    ranks = store.training_metadata(newest.step).world_size or 1
    return [f"  snapshots between commits (--snapshot_steps): at most {NUM_SLOTS} per rank in its node's tmpfs, "
            f"{human_bytes(NUM_SLOTS * state_bytes / ranks)} per rank on average ({human_bytes(NUM_SLOTS * state_bytes)} "
            f"for all {ranks}: {NUM_SLOTS}x the DeepSpeed state of {newest.name}), and as much again on the next node "
            "when the ranks are on several (each rank's copies, which survive its node); room for them in /dev/shm, "
            "or --snapshot_steps -1"]


def _ledger_stages(ledger, required: bool = True) -> list:
    """The stages of a run's goodput ledger; with none and `required`, a UserError naming the override flags."""
    from rlhf_core.ops.goodput_summary import summarize

    try:
        if ledger.exists():
            return summarize(ledger.read()).stages
    except (OSError, ValueError) as error:
        raise UserError(f"cannot read {ledger.url}: {error}.") from None
    if required:
        raise UserError(f"{ledger.url} does not exist: check --ckpt_path and --run_name, train a few chunks first, "
                        "or give --checkpoint_seconds and --step_seconds.")
    return []


def cmd_ckpt(command: str, path: str, as_json: bool, verify: bool) -> int:
    """`ckpt ls` lists, each checkpoint with its alerts; `ckpt verify` hashes everything and fails when the
    newest step is not valid."""
    from rlhf_core.storage.checkpoint import CheckpointStore

    store = CheckpointStore(path)
    store.require_folder()  # a mistyped path is a mistake (exit 2), not an empty listing
    infos = store.list(verify=verify or command == "verify")
    alerts = stage_alerts(store.url)
    if as_json:
        rows = to_json(infos)
        for row in rows:
            row["alerts"] = [alert_summary(alert) for alert in alerts if alert.step == row["step"]]
        print(json.dumps(rows, indent=2))
    else:
        print(listing_with_alerts(format_listing(infos), infos, alerts))
    if command == "verify" and (not infos or not infos[-1].is_committed):
        newest = f"{infos[-1].name} is {infos[-1].status} ({infos[-1].reason})" if infos else "no checkpoint found"
        print(f"rlhf: newest checkpoint is not valid: {newest}.", file=sys.stderr)
        return 1
    return 0


def stage_alerts(stage_url: str) -> list:
    """The alerts of the stage folder `stage_url` ({run_url}/{stage}), from its run's alerts.jsonl."""
    from rlhf_core.ops.alerts import AlertLog

    run_url, _, stage = stage_url.rstrip("/").rpartition("/")
    if not run_url or not stage:
        return []
    return AlertLog(run_url).for_stage(stage)


def alert_summary(alert) -> dict[str, Any]:
    return {"name": alert.name, "stage": alert.stage, "step": alert.step, "message": alert.message}


def _alert_line(alert, indent: str = "  ") -> str:
    return f"{indent}! {alert.name}: {alert.message}"


def listing_with_alerts(table: str, infos: list, alerts: list) -> str:
    """`format_listing`'s table (a header, then one line per checkpoint) with each checkpoint's alerts on lines
    below it; alerts of steps that have no checkpoint (a chunk that failed uncommitted) come last."""
    if not alerts:
        return table
    lines = table.splitlines()
    if len(lines) != len(infos) + 1:  # not the expected table (e.g. "no checkpoints"): alerts after it
        lines, infos = [table], []
    out, listed = [lines[0]], {info.step for info in infos}
    for info, line in zip(infos, lines[1:]):
        out.append(line)
        out.extend(_alert_line(alert) for alert in alerts if alert.step == info.step)
    unlisted = [alert for alert in alerts if alert.step not in listed]
    if unlisted:
        out.append("alerts at steps without a checkpoint here:")
        out.extend(f"  step {alert.step}: {alert.name}: {alert.message}" for alert in unlisted)
    return "\n".join(out)


def cmd_status(run_url: str) -> None:
    """`rlhf status RUN_URL`: a few lines on a run folder (see `run_status`)."""
    print(run_status(run_url))


def run_status(run_url: str) -> str:
    """The stages found under `run_url`, each one's last committed step, headline metric and output folder, the
    run's alerts and its lease holder. A URL that is no run folder is a UserError."""
    import time

    from rlhf_core.ops.alerts import AlertLog
    from rlhf_core.storage.checkpoint import CheckpointStore
    from rlhf_core.storage.lease import RunLease

    run_url = run_url.rstrip("/")
    try:
        CheckpointStore(run_url).require_folder()  # also: an unreachable store is one sentence
    except UserError as error:
        if "no such folder" not in str(error) and "is a file" not in str(error):
            raise
        raise UserError(f"{run_url} is not a folder; give a run folder {{ckpt_path}}/{{run_name}} "
                        "(e.g. ./ckpt/rlhf).") from None
    stages = [(stage, CheckpointStore(f"{run_url}/{stage}")) for stage in STAGES]
    stages = [(stage, store) for stage, store in stages if _is_folder(store)]
    alerts = AlertLog(run_url).read()
    holder = RunLease(run_url).read()
    if not stages and not alerts and holder is None:
        parent, _, name = run_url.rpartition("/")
        hint = (f" ({name} is a stage folder: give its parent, {parent})" if name in STAGES else "")
        raise UserError(f"{run_url} is not a run folder: it holds no stage folder, alerts.jsonl or LEASE.json; "
                        f"give {{ckpt_path}}/{{run_name}}{hint}.")
    lines = [f"run {run_url.rpartition('/')[2]} ({run_url})"]
    lines += [_stage_status(stage, store) for stage, store in stages] or ["no stage folders yet"]
    if holder is None or holder.released:
        lines.append("lease: free")
    else:
        lines.append(f"lease: held by {holder.describe(time.time())}")
    lines.append(f"alerts: {len(alerts)}" if alerts else "alerts: none")
    lines += [f"  {alert.stage} step {alert.step}: {alert.name}: {alert.message}" for alert in alerts]
    return "\n".join(lines)


def _is_folder(store) -> bool:
    try:
        return store.fs.isdir(store.root)
    except OSError:
        return False


def _stage_status(stage: str, store) -> str:
    """One line: the stage's last committed step of its total, its headline metric and its output folder."""
    from rlhf_core.ops.alerts import headline_metric
    from rlhf_core.storage.metadata import CheckpointMetadata

    infos = store.list()
    committed = [info for info in infos if info.is_committed]
    if not committed:
        return f"{stage:<6} no committed checkpoint ({len(infos)} incomplete or corrupt)"
    last = committed[-1]
    try:
        metadata = store.training_metadata(last.step)
    except UserError:
        metadata = CheckpointMetadata(stage, last.step)
    metrics, total = metadata.metrics, metadata.total_steps
    parts = [f"{stage:<6} step {last.step}" + (f"/{total}" if total else ""),
             f"{len(committed)} committed"]
    headline = headline_metric(stage, metrics)
    if headline:
        parts.append(f"{headline[0]} {metrics[headline[0]]:.4g}")
    save_path = metadata.output_path()
    parts.append(f"output {save_path}" if save_path else f"checkpoint {last.uri}")
    return ", ".join(parts)


def format_listing(infos: list[CheckpointInfo]) -> str:
    """A plain-text table of checkpoints for ``rlhf ckpt ls``."""
    if not infos:
        return "no checkpoints"
    header = ("step", "status", "size", "name", "reason")
    rows = [
        (str(info.step), info.status, f"{info.size_bytes / 1e6:.1f} MB", info.name, info.reason)
        for info in infos
    ]
    table = [header, *rows]
    widths = [max(len(row[column]) for row in table) for column in range(len(header))]
    lines = ("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in table)
    return "\n".join(lines)


def to_json(infos: list[CheckpointInfo]) -> list[dict[str, Any]]:
    """Checkpoint infos as plain dicts, for ``--json`` output."""
    return [dataclasses.asdict(info) for info in infos]
