"""Reward model: OpenRLHF's `train_rm`; its trainer is `rlhf_core.rank.trainers.rm`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from rlhf_core.stages.base import Earlier, PreferenceConfig, Ref, Stage, input_location, operational, restated


class RMConfig(PreferenceConfig):
    """Reward model: a causal-LM backbone with a scalar `score` head, trained on preference pairs
    with the Bradley-Terry loss; accuracy is measured on a held-out split."""

    pretrain: str | None = Field(None, **input_location("Backbone to start from; default: the SFT output of this run.",
                                                role="model"))
    loss: Literal["sigmoid", "logexploss"] = Field("sigmoid", description="Pairwise loss: sigmoid (Bradley-Terry, "
                                                                         "-log sigmoid(r_c - r_r)) or logexploss "
                                                                         "(log(1 + exp(r_r - r_c))).")
    learning_rate: float = restated("learning_rate", 9e-6)  # train_rm's
    micro_train_batch_size: int = restated("micro_train_batch_size", 1)  # train_rm's
    margin_loss: bool = Field(False, description="Subtract each pair's 'margin' field from r_c - r_r in the loss.")
    save_path: str = Field("./out/rm", **operational("Where the final reward model is exported (any fsspec URL).",
                                                      role="output"))

    earlier_defaults = {"learning_rate": 5e-6, "micro_train_batch_size": 8, "max_len": 2048, "max_samples": None,
                        "eval_holdout": 0.1}

    def chained(self, earlier: Earlier) -> RMConfig:
        """The backbone defaults to the SFT output of this run."""
        if self.pretrain is not None:
            return self
        return self.model_copy(update={"pretrain": earlier.output("sft")})


STAGE = Stage("rm", RMConfig, "train", position=20, description="Settings of the reward-model stage.",
              trainer=Ref("rlhf_core.rank.trainers.rm", "RewardModelTrainer"), openrlhf_module="train_rm",
              export_model_dir="reward_model",
              count_items=Ref("rlhf_core.data.pairs", "count_rm_pairs"))
