"""The pipeline's stages, one module each, found rather than listed: every module of this package with a
`STAGE`, plus any stage another installed package declares under the `rlhf.stages` entry-point group
(`[project.entry-points."rlhf.stages"] mystage = "mypkg.stage:STAGE"`). They run in order of `Stage.position`.

`STAGES` is the one table the rest of the code reads (see `rlhf_core.stages.base`).
"""

from __future__ import annotations

import importlib
import pkgutil
from importlib.metadata import entry_points

from rlhf_core.stages.base import Stage

ENTRY_POINT_GROUP = "rlhf.stages"


def _found_stages() -> list[Stage]:
    modules = [importlib.import_module(f"{__name__}.{info.name}") for info in pkgutil.iter_modules(__path__)]
    built_in = [module.STAGE for module in modules if isinstance(getattr(module, "STAGE", None), Stage)]
    return built_in + [point.load() for point in entry_points(group=ENTRY_POINT_GROUP)]


STAGES: dict[str, Stage] = {stage.name: stage for stage in sorted(_found_stages(), key=lambda stage: stage.position)}
KNOWN_STAGES = tuple(STAGES)
TRAINING_STAGES = tuple(name for name, stage in STAGES.items() if stage.kind == "train")
# Stages whose math depends on the number of ranks (PPO: each rank samples its share with its own seed).
WORLD_SIZE_DEPENDENT_STAGES = tuple(name for name, stage in STAGES.items() if stage.world_size_dependent)
