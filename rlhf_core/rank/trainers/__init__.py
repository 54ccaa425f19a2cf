"""Stage trainers. Each runs inside one DeepSpeed rank and advances its stage one step at a time.

Which trainer a stage uses is declared in `rlhf_core.stages.STAGES`, as a lazy reference (`Ref`): the stage tables
load in every command, torch only where a rank trains.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlhf_core.rank.trainers.base import DeepSpeedTrainer
    from rlhf_core.stages.base import StageConfig


def trainer_class(stage: str) -> type[DeepSpeedTrainer[StageConfig]]:
    """The trainer class `rlhf_core.stages.STAGES` declares for a training stage."""
    from rlhf_core.stages import STAGES

    if stage not in STAGES or not STAGES[stage].trainer:
        raise ValueError(f"no trainer for stage {stage!r}")
    return STAGES[stage].trainer_class()
