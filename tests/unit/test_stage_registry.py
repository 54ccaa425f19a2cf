"""A stage is one home: a stage declared in one module of another package (registered through the `rlhf.stages`
entry-point group, as a user's package would) shows in the CLI, the run config and its chaining, the Prefect
flow's parameter form, and the generated flag docs, with no file of this project changed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import RLHF

PROJECT_DIR = Path(__file__).resolve().parents[2]

THROWAWAY_MODULE = '''
from pydantic import Field

from rlhf_core.stages.base import Earlier, Stage, StageConfig, input_location, operational


class ThrowawayConfig(StageConfig):
    """A stage that exists only in this test."""

    pretrain: str | None = Field(None, **input_location("Model; default: the SFT output.", role="model"))
    dataset: str = Field(**input_location("Its data.", role="data"))
    throwaway_knob: float = Field(0.5, description="A knob only the throwaway stage has.")
    save_path: str = Field("./out/throwaway", **operational("Where it exports.", role="output"))

    def chained(self, earlier: Earlier) -> "ThrowawayConfig":
        return self if self.pretrain else self.model_copy(update={"pretrain": earlier.output("sft")})


STAGE = Stage("throwaway", ThrowawayConfig, "train", position=27, description="Settings of the throwaway stage.",
              trainer="rlhf_core.rank.trainers.sft:SFTTrainer")
'''

PROBE = '''
import json
from prefect.utilities.callables import parameter_schema

from flows.openrlhf_flags import render_markdown
from flows.pipeline import rlhf
from rlhf_core.config import RunConfig

run = RunConfig.model_validate({"stages": ["sft", "throwaway"], "sft": {"pretrain": "base", "dataset": "d1"},
                                "throwaway": {"dataset": "d2", "throwaway_knob": 2.0}})
try:
    RunConfig.model_validate({"stages": ["throwaway", "sft"], "sft": {"pretrain": "b", "dataset": "d"},
                              "throwaway": {"dataset": "d"}})
    out_of_order = ""
except ValueError as error:
    out_of_order = str(error)
schema = parameter_schema(rlhf).model_dump()
print(json.dumps({
    "chained_pretrain": run.throwaway.pretrain, "knob": run.throwaway.throwaway_knob, "out_of_order": out_of_order,
    "form": sorted(schema["definitions"]["RunConfig"]["properties"]),
    "form_knob": schema["definitions"]["ThrowawayConfig"]["properties"]["throwaway_knob"].get("description"),
    "docs": render_markdown(),
}))
'''


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory) -> dict[str, str]:
    """An environment in which an installed package (a folder on PYTHONPATH with its dist-info) declares the
    throwaway stage."""
    site = tmp_path_factory.mktemp("site")
    (site / "throwaway_stage.py").write_text(textwrap.dedent(THROWAWAY_MODULE))
    info = site / "throwaway_stage-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: throwaway-stage\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[rlhf.stages]\nthrowaway = throwaway_stage:STAGE\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(PROJECT_DIR)]),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


def test_the_cli_offers_the_stage_with_its_own_and_openrlhfs_common_flags(plugin_env):
    listing = subprocess.run([RLHF, "train", "--help"], env=plugin_env, capture_output=True, text=True)
    assert listing.returncode == 0, listing.stderr
    assert "throwaway" in listing.stdout
    help_text = subprocess.run([RLHF, "train", "throwaway", "--help"], env=plugin_env, capture_output=True, text=True)
    assert help_text.returncode == 0, help_text.stderr
    flat = " ".join(help_text.stdout.split())
    assert "--throwaway_knob" in flat and "A knob only the throwaway stage has." in flat
    assert "--train.batch_size" in flat  # OpenRLHF's 0.11 spelling of a flag every trainer has


def test_the_run_config_the_flow_form_and_the_docs_carry_the_stage(plugin_env):
    probe = subprocess.run([sys.executable, "-c", PROBE], env=plugin_env, capture_output=True, text=True,
                           cwd=PROJECT_DIR)
    assert probe.returncode == 0, probe.stderr[-3000:]
    seen = json.loads(probe.stdout.strip().splitlines()[-1])
    assert seen["chained_pretrain"] == "./out/sft" and seen["knob"] == 2.0  # its input: the SFT output
    assert "pipeline order (sft -> dpo -> rm -> prm -> throwaway -> ppo" in seen["out_of_order"]
    assert "throwaway" in seen["form"] and seen["form_knob"] == "A knob only the throwaway stage has."
    assert "## `rlhf train throwaway` (no OpenRLHF command)" in seen["docs"]


def test_without_the_package_the_stage_is_nowhere():
    listing = subprocess.run([RLHF, "train", "--help"], capture_output=True, text=True)
    assert listing.returncode == 0 and "throwaway" not in listing.stdout
