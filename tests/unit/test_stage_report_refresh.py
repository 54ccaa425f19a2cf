"""The stage report's views (chunk table, links, curve, goodput) refresh at most every REFRESH_S seconds while
chunks come fast, and always at the stage's end; the progress artifact and console line follow every chunk."""

from __future__ import annotations

import json
import logging
import uuid

from flows import stage_report
from rlhf_core.config import RunConfig
from rlhf_core.driver.chunk import ChunkResult
from rlhf_core.driver.plan import StagePlan
from rlhf_core.stages.sft import SFTConfig


class FakeClock:
    now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_views_refresh_at_most_every_refresh_s_and_at_the_end(tmp_path, monkeypatch, caplog):
    sent: list[tuple[str, str]] = []  # (view, data) as the server would receive it
    sent_progress: list[float] = []

    def created(view):
        def create(**kwargs):
            sent.append((view, json.dumps(kwargs.get("table")) if view == "chunks" else kwargs["markdown"]))
            return uuid.uuid4()
        return create

    class Client:
        def update_artifact(self, artifact_id, update):
            view = next(name for name, known in report._artifact_ids.items() if known == artifact_id)
            sent.append((view, update.data if isinstance(update.data, str) else json.dumps(update.data)))

    clock = FakeClock()
    monkeypatch.setattr(stage_report, "time", clock)
    monkeypatch.setattr(stage_report, "create_progress_artifact", lambda **kwargs: uuid.uuid4())
    monkeypatch.setattr(stage_report, "update_progress_artifact", lambda _, progress: sent_progress.append(progress))
    monkeypatch.setattr(stage_report, "create_table_artifact", created("chunks"))
    monkeypatch.setattr(stage_report, "create_markdown_artifact",
                        lambda **kwargs: created(kwargs["key"].rsplit("-", 1)[-1])(**kwargs))
    monkeypatch.setattr(stage_report, "get_client", lambda sync_client: Client())

    run = RunConfig(ckpt_path=str(tmp_path / "ckpt"), run_name="fast",
                    sft=SFTConfig(pretrain="m", dataset="d.jsonl"))
    plan = StagePlan(stage="sft", num_samples=80, total_steps=10, targets=list(range(1, 11)))
    report = stage_report.StageReport(run, "sft", plan, logging.getLogger("test-stage-report"))

    def chunk(step: int) -> None:
        report.add_chunk(ChunkResult(stage="sft", step=step, uri=f"{run.stage_url('sft')}/step_{step}",
                                     manifest_digest="d", num_steps_trained=1, metrics={"loss": 1.0 / step}),
                         "trained 1 steps")

    with caplog.at_level(logging.INFO, logger="test-stage-report"):
        for step in range(1, 6):  # five chunks in 4 s: the views once, at the first
            chunk(step)
            clock.now += 1.0
        curves = [data for view, data in sent if view == "curve"]
        assert len(curves) == 1 and [view for view, _ in sent].count("chunks") == 1
        clock.now += stage_report.REFRESH_S
        chunk(6)  # REFRESH_S later: all six rows go out
        tables = [json.loads(data) for view, data in sent if view == "chunks"]
        assert len(tables) == 2 and [row["step"] for row in tables[-1]] == [1, 2, 3, 4, 5, 6]
        for step in range(7, 11):
            chunk(step)
        report.finish(str(tmp_path / "out"))
    assert sent_progress == [10.0 * step for step in range(1, 11)], "progress follows every chunk"
    assert sum("chunks  step" in record.getMessage() for record in caplog.records) == 10, "one line per chunk"
    last = {view: data for view, data in sent}
    assert [row["step"] for row in json.loads(last["chunks"])] == list(range(1, 11))
    assert "step 10:" in last["checkpoints"] and f"Exported model: [{tmp_path / 'out'}]" in last["checkpoints"]
    assert [view for view, _ in sent].count("curve") == 3 and (tmp_path / "ckpt" / "fast" / "sft-curve.svg").exists()
