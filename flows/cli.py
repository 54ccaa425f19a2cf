"""The `rlhf` command. Flags keep OpenRLHF's names and are generated from the pydantic configs,
so each flag's help is the field's description.

    rlhf toy init DIR                 tiny model + toy data
    rlhf train sft --pretrain ... --dataset ... [--load_checkpoint]
    rlhf run CONFIG.yaml              the pipeline from a YAML run config
    rlhf ckpt ls PATH [--json]        checkpoints of one stage folder, with their alerts
    rlhf status RUN_URL               stages, last committed steps, alerts, lease, outputs of a run
    rlhf goodput RUN_URL [--json]     where a run's wall time went, across restarts (goodput.json)
    rlhf plan --ckpt_path P --mtbf_hours H   --save_steps by Young/Daly from the measured costs
    rlhf demo [--workdir DIR]         the whole pipeline on toy data

Training commands run the Prefect flow `rlhf` (on Prefect's ephemeral server when no
PREFECT_API_URL is set). Their console shows the chunk and stage lines, warnings once and errors;
Ray's, DeepSpeed's and the ranks' full output goes to a log file (rlhf_core.ops.console: in the run
folder's logs/driver.log when it is local) and --verbose shows it on the console too.
Every failure the pipeline names (rlhf_core.errors) prints one sentence; mistakes the user can fix exit
with code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import types
import typing
from typing import Any, Sequence

from pydantic import BaseModel, ValidationError

from flows.openrlhf_flags import IMPLEMENTED, MAPPED, REFUSED, flags_for
from rlhf_core.config import RunConfig
from rlhf_core.config_file import describe_validation_error, load_run_config
from rlhf_core.stages import STAGES
from rlhf_core.stages.merge import MergeConfig
from rlhf_core.errors import RLHFError, UserError
from rlhf_core.driver.stop import StoppedBySignal

STAGE_CONFIGS = {name: stage.config for name, stage in STAGES.items() if stage.kind == "train"}
RUN_FLAGS_EXCLUDED = {"stages", *STAGES}


def _flag_type(annotation: Any) -> tuple[Any, dict[str, Any]]:
    """argparse keyword arguments for a pydantic field annotation."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        inner = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return _flag_type(inner[0])
    if annotation is bool:
        return None, {"action": "store_true", "default": argparse.SUPPRESS}
    if origin is tuple:
        item_types = typing.get_args(annotation)
        return None, {"nargs": len(item_types), "type": item_types[0], "default": argparse.SUPPRESS}
    if origin is list:
        return None, {"nargs": "+", "default": argparse.SUPPRESS}
    if origin is dict:
        return None, {"type": json.loads, "default": argparse.SUPPRESS, "metavar": "JSON"}
    if origin is typing.Literal:
        choices = typing.get_args(annotation)
        return None, {"type": type(choices[0]), "choices": choices, "default": argparse.SUPPRESS}
    return None, {"type": annotation, "default": argparse.SUPPRESS}


def add_model_flags(parser: argparse.ArgumentParser, model: type[BaseModel], exclude: set[str] = frozenset(),
                    aliases: dict[str, list[str]] | None = None) -> None:
    """One flag per field of `model`, its help the field's description; `aliases` adds other spellings."""
    for name, field in model.model_fields.items():
        if name in exclude:
            continue
        _, kwargs = _flag_type(field.annotation)
        required = " (required)" if field.is_required() else ""
        spellings = [f"--{name}"] + [f"--{alias}" for alias in (aliases or {}).get(name, []) if alias != name]
        parser.add_argument(*spellings, dest=name, help=((field.description or "") + required).replace("%", "%%"),
                            **kwargs)


OPENRLHF_DEST = "openrlhf:"
_TAKES = {"switch": {"action": "store_true"}, "value": {}, "pair": {"nargs": 2}, "list": {"nargs": "*"}}


def add_openrlhf_flags(parser: argparse.ArgumentParser, cli: str, models: Sequence[type[BaseModel]],
                       exclude: set[str] = frozenset()) -> None:
    """Our fields' flags, with OpenRLHF's spellings (0.9 and 0.11's dotted ones) from `openrlhf_flags` as aliases,
    and one flag per OpenRLHF flag that is mapped, refused or converted (checked in `apply_openrlhf_flags`)."""
    aliases: dict[str, list[str]] = {}
    own_flags = _own_openrlhf_flags(cli, _field_names(models, exclude))
    for flag in flags_for(cli):
        if flag not in own_flags:
            aliases.setdefault(flag.field, []).extend(flag.spellings(cli))
    claimed = {name for flag in own_flags for name in flag.spellings(cli)}
    for model in models:
        add_model_flags(parser, model, exclude | claimed, aliases)
    group = parser.add_argument_group("OpenRLHF flags mapped or refused here (see docs/openrlhf-flags.md)")
    for index, flag in enumerate(own_flags):
        kwargs = dict(_TAKES[flag.takes])
        if flag.takes != "switch":
            kwargs.update(type=flag.value_type, metavar=("LOW", "HIGH") if flag.takes == "pair" else "VALUE")
        help_text = f"{flag.kind}: {flag.note or flag.field}".replace("%", "%%")
        group.add_argument(*(f"--{name}" for name in flag.spellings(cli)), dest=f"{OPENRLHF_DEST}{index}",
                           default=argparse.SUPPRESS, help=help_text, **kwargs)


def _field_names(models: Sequence[type[BaseModel]], exclude: set[str]) -> set[str]:
    return {name for model in models for name in model.model_fields} - exclude


def _own_openrlhf_flags(cli: str, fields: set[str]) -> list:
    """The OpenRLHF flags of `cli` that get a flag of their own: all but plain spellings of one of our fields."""
    return [flag for flag in flags_for(cli)
            if not (flag.kind == IMPLEMENTED and flag.convert is None and flag.field in fields)]


def apply_openrlhf_flags(cli: str, flags: dict[str, Any], models: Sequence[type[BaseModel]],
                         exclude: set[str] = frozenset()) -> dict[str, Any]:
    """Our field values from parsed flags: refused OpenRLHF flags at a non-default value are a UserError, mapped
    ones print their note once, and OpenRLHF's rank counts become --num_workers."""
    own_flags = _own_openrlhf_flags(cli, _field_names(models, exclude))
    values = {name: value for name, value in flags.items() if not name.startswith(OPENRLHF_DEST)}
    for index, flag in enumerate(own_flags):
        if f"{OPENRLHF_DEST}{index}" not in flags:
            continue
        value = flags[f"{OPENRLHF_DEST}{index}"]
        spelled = " / ".join(f"--{name}" for name in flag.spellings(cli))
        if flag.kind == REFUSED and value != flag.default and not (flag.takes == "pair" and
                                                                   tuple(value) == tuple(flag.default or ())):
            raise UserError(f"{spelled} {value!r} is not supported here: {flag.note}.")
        if flag.kind == MAPPED:
            print(f"rlhf: note: {spelled}: {flag.note}.", file=sys.stderr)
        values.update(flag.updates(value))
    nodes, gpus = values.pop("_num_nodes", None), values.pop("_num_gpus_per_node", None)
    if (nodes or gpus) and "num_workers" not in values:
        values["num_workers"] = (nodes or 1) * (gpus or 1)
    return values


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlhf", description="Resumable RLHF pipeline on Prefect, Ray and DeepSpeed.")
    commands = parser.add_subparsers(dest="command", required=True)

    toy = commands.add_parser("toy", help="Toy model and data.").add_subparsers(dest="toy_command", required=True)
    toy_init = toy.add_parser("init", help="Write a tiny HF model, tokenizer and toy datasets into DIR.")
    toy_init.add_argument("directory", metavar="DIR")
    toy_init.add_argument("--seed", type=int, default=0, help="Seed of the toy model and data.")
    toy_init.set_defaults(handler=_cmd_toy)

    train = commands.add_parser("train", help="Train one stage.").add_subparsers(dest="stage", required=True)
    for stage, config in STAGE_CONFIGS.items():
        stage_parser = train.add_parser(stage, help=config.__doc__)
        add_openrlhf_flags(stage_parser, stage, (RunConfig, config), exclude=RUN_FLAGS_EXCLUDED)
        stage_parser.set_defaults(handler=_cmd_train)

    run = commands.add_parser("run", help="Run the pipeline from a YAML run config.")
    run.add_argument("config", metavar="CONFIG.yaml")
    run.set_defaults(handler=_cmd_run)

    ckpt = commands.add_parser("ckpt", help="Inspect checkpoints.").add_subparsers(dest="ckpt_command", required=True)
    ckpt_ls = ckpt.add_parser("ls", help="List the checkpoints of a stage folder ({ckpt_path}/{run_name}/{stage}).")
    ckpt_ls.add_argument("path", metavar="PATH")
    ckpt_ls.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
    ckpt_ls.add_argument("--verify", action="store_true",
                         help="Check every file's checksum (the one its manifest names), not only its size.")
    status = commands.add_parser("status", help="Stages, last committed steps, alerts, lease and outputs of a run.")
    status.add_argument("run_url", metavar="RUN_URL", help="The run folder, {ckpt_path}/{run_name} (local or s3://).")
    status.set_defaults(handler=lambda args: cmd_status(args.run_url))
    goodput = commands.add_parser("goodput", help="Goodput of a run: useful step time against wall time, and where "
                                  "the rest went (stall, start-up, load, lost to crashes), from its goodput.json.")
    goodput.add_argument("run_url", metavar="RUN_URL", help="The run folder, {ckpt_path}/{run_name} (local or s3://).")
    goodput.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
    goodput.set_defaults(handler=lambda args: cmd_goodput(args.run_url, args.json))
    add_plan_parser(commands)
    ckpt_verify = ckpt.add_parser("verify", help="Check every file's checksum in every checkpoint; exit 1 if "
                                  "the newest is not valid.")
    ckpt_verify.add_argument("path", metavar="PATH")
    ckpt_verify.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
    for ckpt_command in (ckpt_ls, ckpt_verify):
        ckpt_command.set_defaults(handler=lambda args: cmd_ckpt(args.ckpt_command, args.path, args.json,
                                                                getattr(args, "verify", False)))

    combiner = commands.add_parser("lora-combiner", help="Merge a LoRA adapter into its base model.")
    add_openrlhf_flags(combiner, "lora-combiner", (MergeConfig,))
    combiner.set_defaults(handler=_cmd_lora_combiner)

    demo = commands.add_parser("demo", help="Run the pipeline on the toy model and data.")
    demo.add_argument("--workdir", default="./demo", help="Folder for toy assets, checkpoints and outputs.")
    demo.add_argument("--num_workers", type=int, default=1, help="DeepSpeed ranks (Ray actors).")
    demo.add_argument("--verbose", action="store_true", help=RunConfig.model_fields["verbose"].description)
    demo.set_defaults(handler=_cmd_demo)
    return parser


def add_plan_parser(commands) -> None:
    plan = commands.add_parser(
        "plan", help="Suggest --save_steps for a mean time between failures, by Young/Daly: T = sqrt(2*C*MTBF) "
        "seconds of work between checkpoints, C and the step time measured in the run's goodput.json.")
    plan.add_argument("--ckpt_path", required=True, help="Checkpoint root of the run (as given to rlhf train).")
    plan.add_argument("--run_name", default=RunConfig.model_fields["run_name"].default, help="Name of the run.")
    plan.add_argument("--mtbf_hours", type=float, required=True, help="Mean time between failures, in hours.")
    plan.add_argument("--stage", help="Only this stage (default: every stage in the ledger).")
    for name, what in (("checkpoint_seconds", "C, seconds each checkpoint costs the step loop"),
                       ("step_seconds", "seconds per optimizer step"),
                       ("restart_seconds", "R, seconds a restart costs (start-up and load)")):
        plan.add_argument(f"--{name}", type=float, help=f"{what}; overrides the measured value (needed with "
                          "no ledger, except restart_seconds, default 0).")
    plan.set_defaults(handler=cmd_plan)


def cmd_goodput(run_url: str, as_json: bool) -> None:
    """`rlhf goodput RUN_URL`: the run's ledger in a few lines (rlhf_core.ops.goodput)."""
    from rlhf_core.ops.goodput_summary import format_summary, read_ledger

    summary = read_ledger(run_url.rstrip("/"))
    print(json.dumps(summary.to_dict(), indent=2) if as_json else format_summary(summary, run_url.rstrip("/")))


def cmd_plan(args: argparse.Namespace) -> None:
    """`rlhf plan`: per stage, the measured costs, the goodput expected at today's save_steps and at Young's."""
    print("\n".join(plan_lines(args.ckpt_path, args.run_name, args.mtbf_hours, args.stage, args.checkpoint_seconds,
                               args.step_seconds, args.restart_seconds)))


def plan_lines(ckpt_path: str, run_name: str, mtbf_hours: float, only_stage: str | None = None,
               checkpoint_seconds: float | None = None, step_seconds: float | None = None,
               restart_seconds: float | None = None) -> list[str]:
    """Per stage of the run's ledger (or once, for the given costs): C, step time and R, the goodput expected
    at the save_steps the run used, and Young's interval with the goodput expected there."""
    from rlhf_core.ops.goodput import GoodputLedger
    from rlhf_core.ops.goodput_summary import measured_costs

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


def run_config_from_flags(stage: str, flags: dict[str, Any]) -> RunConfig:
    flags = apply_openrlhf_flags(stage, flags, (RunConfig, STAGE_CONFIGS[stage]), RUN_FLAGS_EXCLUDED)
    stage_fields = STAGE_CONFIGS[stage].model_fields
    stage_values = {name: value for name, value in flags.items() if name in stage_fields}
    run_values = {name: value for name, value in flags.items() if name in RunConfig.model_fields}
    try:
        return RunConfig(stages=[stage], **run_values, **{stage: STAGE_CONFIGS[stage](**stage_values)})
    except ValidationError as error:
        raise UserError(describe_validation_error(error, f"rlhf train {stage}", flag_style=True)) from None


def cmd_ckpt(command: str, path: str, as_json: bool, verify: bool) -> int:
    """`ckpt ls` lists, each checkpoint with its alerts; `ckpt verify` hashes everything and fails when the
    newest step is not valid."""
    from rlhf_core.storage.checkpoint import CheckpointStore, format_listing, to_json

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

    infos = store.list()
    committed = [info for info in infos if info.is_committed]
    if not committed:
        return f"{stage:<6} no committed checkpoint ({len(infos)} incomplete or corrupt)"
    last = committed[-1]
    try:
        metadata = store.read_metadata(last.step)
    except UserError:
        metadata = {}
    metrics = metadata.get("metrics") or {}
    total = metadata.get("total_steps")
    parts = [f"{stage:<6} step {last.step}" + (f"/{total}" if total else ""),
             f"{len(committed)} committed"]
    headline = headline_metric(stage, metrics)
    if headline:
        parts.append(f"{headline[0]} {metrics[headline[0]]:.4g}")
    config = metadata.get("config") or {}
    save_path = metadata.get("save_path") or config.get("save_path")
    parts.append(f"output {save_path}" if save_path else f"checkpoint {last.uri}")
    return ", ".join(parts)


def cmd_lora_combiner(flags: dict[str, Any]) -> None:
    from rlhf_core.driver.export import merge_lora

    try:
        cfg = MergeConfig(**flags)
    except ValidationError as error:
        raise UserError(describe_validation_error(error, "rlhf lora-combiner", flag_style=True)) from None
    if cfg.model_path is None or cfg.lora_path is None:
        raise UserError("rlhf lora-combiner: --model_path and --lora_path are required.")
    with tempfile.TemporaryDirectory(prefix="rlhf-adapter-") as local_dir:
        adapter = checkpoint_adapter(cfg.lora_path, local_dir) or cfg.lora_path
        difference = merge_lora(cfg.model_path, adapter, cfg.output_path, cfg.bf16)
    print(f"merged {cfg.lora_path} into {cfg.model_path} -> {cfg.output_path} "
          f"(max logit difference vs base+adapter: {difference:.2e})")


def checkpoint_adapter(lora_path: str, local_dir: str) -> str | None:
    """The seed's `--lora_path {ckpt_path}/latest` (or `.../step_N`): the policy adapter of that checkpoint,
    verified and downloaded into `local_dir`; None when `lora_path` names no checkpoint."""
    from rlhf_core.storage.checkpoint import CheckpointStore
    from rlhf_core.storage.manifest import parse_step_dir_name

    parent, _, name = lora_path.rstrip("/").rpartition("/")
    if not parent or (name != "latest" and parse_step_dir_name(name) is None):
        return None
    store = CheckpointStore(parent)
    committed = [info for info in store.list(verify=True) if info.is_committed]
    chosen = committed[-1:] if name == "latest" else [info for info in committed if info.name == name]
    if not chosen:
        raise UserError(f"--lora_path {lora_path}: {parent} holds no valid checkpoint "
                        f"{'at all' if name == 'latest' else name} (see `rlhf ckpt ls {parent}`).")
    store.download(chosen[0].step, local_dir)
    return os.path.join(local_dir, "actor_model", "hf")


def _run_pipeline(run: RunConfig) -> None:
    from flows.pipeline import run_pipeline

    run_pipeline(run)


def run_quietly(run_url: str, run_name: str, verbose: bool, start: typing.Callable[[], Any],
                stop_grace_s: float = RunConfig.model_fields["stop_grace_s"].default) -> None:
    """`start()` (a training command) with the quiet console of rlhf_core.ops.console: its log file is written once
    the run is real, and not at all when the run is refused with a UserError. SIGTERM and Ctrl-C stop it
    after an emergency checkpoint (rlhf_core.driver.stop) from the first moment on, Prefect's start included."""
    import flows.pipeline  # noqa: F401 - importing prefect sets up its logging; the console's filters go on it
    from rlhf_core.driver import stop
    from rlhf_core.ops.console import configure_console, discard_log_file, log_file_for, open_log_file, reset_console

    configure_console(log_file_for(run_url, run_name), verbose)
    try:
        with stop.obeying_signals(stop_grace_s, owns_process=True):
            start()
    except UserError:
        discard_log_file()
        reset_console()  # the one-sentence error prints as usual; an in-process caller (tests) gets logging back
        raise
    except BaseException:
        open_log_file()
        raise
    open_log_file()


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:  # a real command (not a test calling main): the ledger's start-up counts from its start
        from rlhf_core.ops.goodput import mark_command_started

        mark_command_started()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "rlhf_core")  # fallback and set-aside notices
    # rlhf_core's warnings during preflight come before any flow run: keep them off Prefect's API handler.
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    # The ephemeral server's start took 12-25 s on a loaded 2-core machine, past Prefect's 20 s default, which then
    # starts a second one (see flows.pipeline._start_ephemeral_server_in_background).
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args) or 0
    except StoppedBySignal as stopped:
        print(f"rlhf: {stopped}", file=sys.stderr)
        return stopped.exit_code  # 130 after Ctrl-C, 143 after SIGTERM, as a shell reports them
    except RLHFError as error:  # one sentence, its remedy included; 2 for the user's own mistakes
        print(f"rlhf: error: {error}", file=sys.stderr)
        return error.exit_code


def _own_flags(args: argparse.Namespace, *parser_keys: str) -> dict[str, Any]:
    """The flags a command was given, without the parser's own entries (the command, its handler, ...)."""
    return {key: value for key, value in vars(args).items() if key not in ("command", "handler", *parser_keys)}


def _cmd_toy(args: argparse.Namespace) -> None:
    from rlhf_core.toy import init_toy

    for name, path in init_toy(args.directory, args.seed).items():
        print(f"{name}: {path}")


def _cmd_train(args: argparse.Namespace) -> None:
    run = run_config_from_flags(args.stage, _own_flags(args, "stage"))
    run_quietly(run.run_url(), run.run_name, run.verbose, lambda: _run_pipeline(run), run.stop_grace_s)


def _cmd_run(args: argparse.Namespace) -> None:
    run = load_run_config(args.config)
    run_quietly(run.run_url(), run.run_name, run.verbose, lambda: _run_pipeline(run), run.stop_grace_s)


def _cmd_lora_combiner(args: argparse.Namespace) -> None:
    cmd_lora_combiner(apply_openrlhf_flags("lora-combiner", _own_flags(args), (MergeConfig,)))


def _cmd_demo(args: argparse.Namespace) -> None:
    from flows.demo import demo_config, run_demo

    demo_run = demo_config(args.workdir, args.num_workers)
    run_quietly(demo_run.run_url(), demo_run.run_name, args.verbose, lambda: run_demo(args.workdir, args.num_workers))


if __name__ == "__main__":
    sys.exit(main())
