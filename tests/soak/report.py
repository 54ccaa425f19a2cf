"""The soak's report: a row per fault and the totals, printed as a table, attached to the soak's flow run as a
Prefect artifact, and written to `soak_report.json` (keys `faults`, `kinds`, `human_actions`, `commits_lost`,
`bit_exact`, `wall_ratio`, `rows`, and the legs' times)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tests.soak.observe import Evidence


@dataclass
class FaultRow:
    """One injected fault and what it cost (seconds from the injection; None where it never happened)."""

    leg: str
    kind: str
    target: str
    at_s: float  # after the faulted run's submission
    detect_s: float | None = None
    next_step_s: float | None = None
    steps_recomputed: int | None = None
    # next_step_s - detect_s, apart: from the detection to a new rank's set-up (the flow run or ranks started
    # again), that set-up to its checkpoint loaded (model built, state read), and the steps trained again x the
    # median step time before the fault (the work the fault threw away, on top)
    restart_s: float | None = None
    load_s: float | None = None
    recompute_s: float | None = None
    snapshot_k: int | None = None  # K of the snapshot between commits the new ranks started from, as the run chose it
    committed_before: int | None = None  # the stage's newest commit when the fault hit
    resumed_from: int | None = None  # the step the run trained again from, minus one
    commit_lost: bool = False
    injected_at: float = field(default=0.0, repr=False)  # time.time()
    stage: str = ""

    def measure(self, evidence: Evidence, until: float = float("inf")) -> None:
        """Time the fault from `evidence`, looking for its detection before `until` (the next fault)."""
        detected = evidence.detected_at(self.kind, self.injected_at, until)
        self.snapshot_k = evidence.snapshot_interval(self.injected_at, until)
        self.detect_s = None if detected is None else round(max(0.0, detected - self.injected_at), 1)
        before = evidence.last_step_before(self.injected_at)
        keeps_ranks = self.kind == "store_outage" or (self.kind == "worker_kill" and not evidence.crashed_between(
            self.injected_at, until))  # a run that died with its worker trains again only with new ranks
        after = evidence.next_step(max(self.injected_at, detected or self.injected_at), new_ranks_only=not keeps_ranks)
        if after is None:
            return
        self.next_step_s = round(after.time - self.injected_at, 1)
        if before is not None and before.stage == after.stage:
            self.steps_recomputed = max(0, before.step - after.step)
            step_s = evidence.step_seconds(self.injected_at)
            self.recompute_s = None if step_s is None else round(self.steps_recomputed * step_s, 2)
        setup, loaded = evidence.rank_start(after.pid, detected or self.injected_at) if not keeps_ranks else (None, None)
        if setup is not None:
            self.restart_s = round(setup - (detected or self.injected_at), 1)
            self.load_s = None if loaded is None else round(loaded - setup, 1)
        if after.stage == self.stage:
            self.resumed_from = after.step - 1
            self.commit_lost = self.committed_before is not None and self.resumed_from < self.committed_before


@dataclass
class LegTimes:
    name: str
    reference_s: float
    soak_s: float
    soak_state: str
    bit_exact: bool
    differing_tensors: list[str]


def build(rows: list[FaultRow], legs: list[LegTimes], api_changes: list[str], num_runs: int) -> dict:
    reference = sum(leg.reference_s for leg in legs)
    return {
        "faults": len(rows),
        "kinds": sorted({row.kind for row in rows}),
        # each leg's two runs are submitted once; any other call that changed a run is a person's work
        "human_actions": len(api_changes) - num_runs,
        "commits_lost": sum(row.commit_lost for row in rows),
        "bit_exact": bool(legs) and all(leg.bit_exact for leg in legs),
        "wall_ratio": round(sum(leg.soak_s for leg in legs) / reference, 3) if reference else None,
        "completed": bool(legs) and all(leg.soak_state == "Completed" for leg in legs),
        "legs": [asdict(leg) for leg in legs],
        "api_changes": api_changes,
        "rows": [{key: value for key, value in asdict(row).items() if key != "injected_at"} for row in rows],
    }


def _cell(value) -> str:
    return "-" if value is None else str(value)


def as_markdown(report: dict) -> str:
    columns = ("leg", "kind", "at_s", "detect_s", "next_step_s", "restart_s", "load_s", "steps_recomputed",
               "snapshot_k", "recompute_s", "commit_lost", "target")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row[column]) for column in columns) + " |" for row in report["rows"]]
    legs = "; ".join(f"{leg['name']}: {leg['soak_s']:.0f} s against {leg['reference_s']:.0f} s uninterrupted "
                     f"({leg['soak_state']}, bit-exact {leg['bit_exact']})" for leg in report["legs"])
    totals = (f"**{report['faults']} faults of {len(report['kinds'])} kinds**, human actions "
              f"{report['human_actions']}, commits lost {report['commits_lost']}, bit-exact {report['bit_exact']}, "
              f"wall ratio {report['wall_ratio']} ({legs})")
    return "\n".join([totals, "", *lines])


def publish(report: dict, folder: Path, api_url: str, flow_run_id: str) -> Path:
    """soak_report.json in `folder`, and the table as a markdown artifact on the soak's flow run."""
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.client.schemas.actions import ArtifactCreate

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "soak_report.json"
    path.write_text(json.dumps(report, indent=2))
    with SyncPrefectClient(api_url) as client:
        client.create_artifact(ArtifactCreate(key="rlhf-soak-report", type="markdown", data=as_markdown(report),
                                              flow_run_id=flow_run_id or None,
                                              description="The chaos soak (tests/soak): a row per fault"))
    return path
