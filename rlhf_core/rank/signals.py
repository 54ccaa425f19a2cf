"""The signals between a trainer and the rank hosting it (`RankSignals`); light, so the rank's host imports it
before torch."""

from __future__ import annotations


class RankSignals:
    """What a trainer tells the rank hosting it, and asks it, in the middle of a step (`rlhf_core.rank.worker`
    gives each trainer its own): a piece of long work done (an evaluation batch, a generation batch), which is the
    hang watch's progress and the driver's progress line, and whether every rank has agreed to stop (Ctrl-C or
    SIGTERM in the driver). These defaults are a trainer's outside a rank (tests, tools): nobody listens."""

    def work_done(self, phase: str, done: int, total: int) -> None:
        """`done` of the `total` pieces of `phase` ("eval", "generate") are done on this rank."""

    def stop_agreed(self) -> bool:
        """Whether any rank was asked to stop, agreed by every rank (a collective: every rank must ask together)."""
        return False
