"""LoRA merge: OpenRLHF's `lora_combiner`, run by `rlhf_core.driver.export.merge_lora` on the driver."""

from __future__ import annotations

from pydantic import Field

from rlhf_core.stages.base import Earlier, Stage, StageSettings, input_location, operational


class MergeConfig(StageSettings):
    """LoRA merge: base model + adapter -> one model, checked against base+adapter logits before writing."""

    model_path: str | None = Field(None, **input_location("Base model; default: the policy's pretrain in this run.",
                                                  role="model"))
    lora_path: str | None = Field(None, **input_location("Adapter; default: the last policy stage's output in this run.",
                                                 role="model"))
    output_path: str = Field("./out/merged", **operational("Where the merged model is written (any fsspec URL).",
                                                            role="output"))
    bf16: bool = Field(False, description="Write the merged weights in bfloat16.")

    def chained(self, earlier: Earlier) -> MergeConfig:
        """Base model and adapter default to the last policy stage's start and output."""
        policy = earlier.policy()
        if policy is None:
            if self.model_path is None or self.lora_path is None:
                raise ValueError(f"merge needs model_path and lora_path, or a policy stage ({earlier.policy_stages()}) "
                                 "before it")
            return self
        name, settings = policy
        if self.lora_path is None and not settings.lora_rank:
            raise ValueError(f"merge needs LoRA adapters: set {name}.lora_rank > 0, or give merge.lora_path")
        return self.model_copy(update={"model_path": self.model_path or settings.pretrain,
                                       "lora_path": self.lora_path or earlier.output(name)})


STAGE = Stage("merge", MergeConfig, "merge", position=80, description="Settings of the LoRA merge stage.",
              openrlhf_module="lora_combiner")
