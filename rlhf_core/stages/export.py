"""The final Hugging Face export, run by `rlhf_core.driver.export` on the driver."""

from __future__ import annotations

from pydantic import Field

from rlhf_core.stages.base import Earlier, Stage, StageSettings, input_location, operational


class ExportConfig(StageSettings):
    """Final Hugging Face export of the policy: config, tokenizer and safetensors, checked to load and generate."""

    model_path: str | None = Field(None, **input_location("Model to export; default: the merged or last policy of this run.",
                                                  role="model"))
    save_path: str = Field("./out/final", **operational("Where the final model is exported (any fsspec URL).",
                                                         role="output"))

    def chained(self, earlier: Earlier) -> ExportConfig:
        """The model defaults to the merged one, else the last policy stage's output."""
        if self.model_path is not None:
            return self
        source = earlier.output("merge") if earlier.ran("merge") else None
        if source is None:
            policy = earlier.policy()
            if policy is None:
                raise ValueError(f"export needs model_path, or a policy stage ({earlier.policy_stages()}) or merge "
                                 "before it")
            source = earlier.output(policy[0])
        return self.model_copy(update={"model_path": source})


STAGE = Stage("export", ExportConfig, "export", position=90, description="Settings of the final export stage.")
