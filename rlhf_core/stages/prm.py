"""Process reward model: OpenRLHF v0.9.0's `train_prm` (removed from OpenRLHF by 0.9.10); its trainer is
`rlhf_core.rank.trainers.prm`."""

from __future__ import annotations

from pydantic import Field, model_validator

from rlhf_core.stages.base import Earlier, Ref, Stage, StageConfig, input_location, operational, restated


class PRMConfig(StageConfig):
    """A causal LM that judges each step of a solution: at every placeholder token that ends a step it predicts
    that step's label (one of reward_tokens, e.g. + or -), as Math-Shepherd's data marks them."""

    pretrain: str | None = Field(None, **input_location("Model to start from; default: the SFT output of this run.",
                                                        role="model"))
    dataset: str = Field(**input_location("Step-labelled data (Math-Shepherd's shape: input_key holds the text with a "
                                          "placeholder after each step, label_key the list of step labels), in any "
                                          "form --dataset of SFT takes.", role="data"))
    input_key: str = Field("input", description="Key of the text, each step followed by the placeholder token.")
    label_key: str = Field("label", description="Key of the step labels: a list of reward tokens (hard labels), or "
                                                "of numbers in [0, 1] (soft labels: the first reward token's share).")
    placeholder_token: str = Field(description="The token that ends each step (Math-Shepherd: ки); it must be one "
                                               "token of the tokenizer.")
    reward_tokens: list[str] | None = Field(None, description="The label tokens the loss chooses between (e.g. + -); "
                                                              "none: the whole vocabulary (hard labels only).")
    eval_split: str = restated("eval_split", "test")  # train_dpo's and train_prm's
    learning_rate: float = restated("learning_rate", 1e-6)  # train_prm's (v0.9.0)
    micro_train_batch_size: int = restated("micro_train_batch_size", 1)  # train_prm's (v0.9.0)
    save_path: str = Field("./out/prm", **operational("Where the final process reward model is exported.",
                                                       role="output"))

    earlier_defaults = {"learning_rate": 5e-6, "micro_train_batch_size": 8, "max_samples": None}

    @model_validator(mode="after")
    def _soft_labels_need_two_tokens(self) -> PRMConfig:
        if self.reward_tokens is not None and len(set(self.reward_tokens)) < 2:
            raise ValueError("reward_tokens needs two or more distinct tokens (e.g. + -)")
        if self.input_template is not None:  # a StageConfig field the PRM's data never goes through
            raise ValueError("input_template is not used by prm: the text of input_key is tokenized as written "
                             "(as OpenRLHF's train_prm does); put the template into the data")
        return self

    def chained(self, earlier: Earlier) -> PRMConfig:
        """The model starts from the SFT output of this run."""
        return self if self.pretrain else self.model_copy(update={"pretrain": earlier.output("sft")})


STAGE = Stage("prm", PRMConfig, "train", position=25, description="Settings of the process-reward-model stage.",
              trainer=Ref("rlhf_core.rank.trainers.prm", "PRMTrainer"), openrlhf_module="train_prm",
              count_items=Ref("rlhf_core.data.step_labels", "count_step_labelled"))
