"""What an operator sees of a stage while it runs: Prefect artifacts (progress, chunk table, checkpoints, the
loss/reward curve, goodput), updated in place under keys made from the run and stage names, and a console line
per chunk. docs/design-notes.md ("The stage report") lists the artifacts and what they cost.
"""

from __future__ import annotations

import base64
import logging
import re
import time
from dataclasses import asdict, dataclass
from uuid import UUID

from typing import Callable

import fsspec
from prefect import get_client
from prefect.artifacts import (TableArtifact, create_markdown_artifact, create_progress_artifact,
                               create_table_artifact, update_progress_artifact)
from prefect.client.schemas.actions import ArtifactUpdate

from rlhf_core.driver.chunk import ChunkResult
from rlhf_core.driver.plan import StagePlan
from rlhf_core.config import RunConfig
from rlhf_core.ops.curve import curve_svg

BAR_WIDTH = 10
REFRESH_S = 30.0  # the chunk table, links, curve and goodput views: at most this often, and at the stage's end


@dataclass
class StageSummary:
    """What the flow `rlhf` returns for each stage (as `to_dict`, under the stage's name). A training stage has a
    `status` (`completed`, or `stopped-by-budget` with its `total_steps` and `reason`), its last step and checkpoint,
    its chunk table and how many chunks trained; merge and export stages have their output (`save_path`, and the
    merge's `max_logit_difference`). `seconds`: the stage's wall time in the flow."""

    status: str | None = None
    final_step: int | None = None
    total_steps: int | None = None
    checkpoint: str | None = None
    manifest_digest: str | None = None
    save_path: str | None = None
    chunks: list[dict] | None = None
    chunks_trained: int | None = None
    reason: str | None = None
    max_logit_difference: float | None = None
    seconds: float | None = None

    def to_dict(self) -> dict:
        """The JSON form: a training stage's keys always, the rest only when set."""
        always = _TRAINING_KEYS if self.status is not None else ("save_path",)
        return {name: value for name, value in asdict(self).items() if name in always or value is not None}

    @classmethod
    def from_dict(cls, record: dict) -> StageSummary:
        return cls(**record)


_TRAINING_KEYS = ("status", "final_step", "checkpoint", "manifest_digest", "save_path", "chunks", "chunks_trained")


def artifact_key(*parts: str) -> str:
    """A Prefect artifact key from free text: lowercase letters, digits and dashes only."""
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")


def headline_metric(metrics: dict) -> str:
    return "reward" if "reward" in metrics else "loss"


def progress_line(stage: str, chunks: tuple[int, int], steps: tuple[int, int], metrics: dict, status: str = "") -> str:
    """`sft [#####-----] 4/8 chunks  step 32/64: trained 8 steps  loss 2.97`: one console line per chunk, with
    `chunks` (done, of all) and `steps` (reached, of all); the status says whether the chunk trained, was cached, or
    ran on fewer ranks than asked."""
    (num_done, num_chunks), (step, total_steps) = chunks, steps
    filled = round(BAR_WIDTH * num_done / max(num_chunks, 1))
    name = headline_metric(metrics)
    value = metrics.get(name, float("nan"))
    return (f"{stage} [{'#' * filled}{'-' * (BAR_WIDTH - filled)}] {num_done}/{num_chunks} chunks  "
            f"step {step}/{total_steps}{': ' + status if status else ''}  {name} {value:.4g}")


class StageReport:
    """The artifacts of one stage in one flow run (see module docstring)."""

    def __init__(self, run: RunConfig, stage: str, plan: StagePlan, logger: logging.Logger | logging.LoggerAdapter):
        self.run, self.stage, self.plan, self.logger = run, stage, plan, logger
        self.rows: list[dict] = []
        self._artifact_ids: dict[str, UUID] = {}
        self._refreshed_at: float | None = None  # time.monotonic() of the views' last refresh
        self.curve_url = f"{run.run_url()}/{stage}-curve.svg"
        self.progress_id: UUID = create_progress_artifact(
            progress=0.0, key=self._key("progress"),
            description=f"Chunks of stage {stage} committed, run {run.run_name} ({len(plan.targets)} chunks)")

    def _key(self, what: str) -> str:
        return artifact_key(self.run.run_name, self.stage, what)

    def _publish(self, what: str, data: str, create: Callable[[], UUID]) -> None:
        """`create()` the artifact the first time, then replace its data in place."""
        if what in self._artifact_ids:
            get_client(sync_client=True).update_artifact(self._artifact_ids[what], ArtifactUpdate(data=data))
        else:
            self._artifact_ids[what] = create()

    def add_chunk(self, result: ChunkResult, status: str) -> None:
        """One more committed chunk: progress, table, links, curve and the console line."""
        self.rows.append({"step": result.step, "status": status, "world_size": result.world_size,
                          **{k: round(v, 6) for k, v in result.metrics.items()},
                          **{f"{k}_s": round(v, 3) for k, v in result.seconds.items()}, "checkpoint": result.uri})
        num_done = len(self.rows)
        update_progress_artifact(self.progress_id, progress=round(100.0 * num_done / len(self.plan.targets), 1))
        if self._refreshed_at is None or time.monotonic() - self._refreshed_at >= REFRESH_S:
            self.refresh()
        self.logger.info(progress_line(self.stage, (num_done, len(self.plan.targets)),
                                       (result.step, self.plan.total_steps), result.metrics, status))

    def refresh(self, save_path: str | None = None) -> None:
        """The chunk table, the links (with the exported model's once there is one), the curve and goodput."""
        self._refreshed_at = time.monotonic()
        self._publish("chunks", TableArtifact(table=self.rows).format(_sync=True),
                      lambda: create_table_artifact(key=self._key("chunks"), table=self.rows,
                                                    description=f"Chunks of stage {self.stage} in run {self.run.run_name}"))
        self.publish_links(save_path)
        self.publish_curve()
        self.publish_goodput()

    def publish_links(self, save_path: str | None = None) -> None:
        lines = [f"# {self.run.run_name} / {self.stage}", "", "Committed checkpoints:", ""]
        kept = self._step_dirs()
        lines += [f"- step {row['step']}: [{row['checkpoint']}]({row['checkpoint']})"
                  + ("" if kept is None or f"step_{row['step']}" in kept else " (since removed: max_ckpt_num)")
                  for row in self.rows]
        if save_path:
            lines += ["", f"Exported model: [{save_path}]({save_path})"]
        lines += ["", f"Curve: [{self.curve_url}]({self.curve_url})"]
        markdown = "\n".join(lines)
        self._publish("checkpoints", markdown,
                      lambda: create_markdown_artifact(key=self._key("checkpoints"), markdown=markdown,
                                                       description=f"Checkpoints and outputs of stage {self.stage}"))

    def _step_dirs(self) -> set[str] | None:
        """Names in the stage folder now (retention removes old checkpoints), or None if it cannot be listed."""
        try:
            fs, root = fsspec.core.url_to_fs(self.run.stage_url(self.stage), **self.run.storage_options)
            fs.invalidate_cache(root)
            return {path.rstrip("/").rsplit("/", 1)[-1] for path in fs.ls(root, detail=False)}
        except OSError:
            return None

    def publish_curve(self) -> None:
        """Save the curve in the run folder and show it in the UI; a plotting failure costs a warning, not
        the chunk."""
        try:
            svg = curve_svg(self.stage, self.rows)
            with fsspec.open(self.curve_url, "wb", **self.run.storage_options) as file:
                file.write(svg)
        except Exception as error:  # noqa: BLE001 - the curve is a view; training goes on without it
            self.logger.warning("%s: could not draw or save the curve %s: %s", self.stage, self.curve_url, error)
            return
        data_uri = "data:image/svg+xml;base64," + base64.b64encode(svg).decode()
        markdown = (f"# {self.run.run_name} / {self.stage}\n\n![curve]({data_uri})\n\n"
                    f"Saved as `{self.curve_url}`.")
        self._publish("curve", markdown,
                      lambda: create_markdown_artifact(key=self._key("curve"), markdown=markdown,
                                                       description=f"Metrics of stage {self.stage} per committed chunk"))

    def publish_goodput(self) -> None:
        """The run's goodput ledger as markdown (one read of goodput.json); a run without one shows nothing,
        and a failure to read it costs a warning, not the chunk."""
        from rlhf_core.ops.goodput import GoodputLedger
        from rlhf_core.ops.goodput_summary import format_markdown, summarize

        ledger = GoodputLedger(self.run.run_url(), self.run.storage_options)
        try:
            if not ledger.exists():
                return
            markdown = format_markdown(summarize(ledger.read()), self.run.run_url())
        except (OSError, ValueError) as error:
            self.logger.warning("%s: could not read the goodput ledger %s: %s", self.stage, ledger.url, error)
            return
        key, description = artifact_key(self.run.run_name, "goodput"), f"Goodput of run {self.run.run_name}"
        self._publish("goodput", markdown,
                      lambda: create_markdown_artifact(key=key, markdown=markdown, description=description))

    def finish(self, save_path: str) -> None:
        """The stage's model is exported: every view shows every chunk, the links name the model and the ledger
        counts the export."""
        self.refresh(save_path)
