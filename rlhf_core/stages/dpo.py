"""Direct preference optimisation: OpenRLHF's `train_dpo`; its trainer is `rlhf_core.rank.trainers.dpo`."""

from __future__ import annotations

from pydantic import Field

from rlhf_core.stages.base import Earlier, PreferenceConfig, Ref, Stage, input_location, operational, restated


class DPOConfig(PreferenceConfig):
    """DPO (Rafailov et al. 2023) on preference pairs against a frozen reference model; IPO (Azar et al. 2023) and
    conservative DPO (label smoothing) as OpenRLHF has them, and an NLL term on the chosen responses."""

    pretrain: str | None = Field(None, **input_location("Policy to start from; default: the SFT output of this run.",
                                                        role="model"))
    ref_pretrain: str | None = Field(None, **input_location("Frozen reference model; default: the policy's start "
                                                            "(--pretrain).", role="model"))
    ref_offload: bool = Field(False, **operational("Keep the reference model on the CPU (it only scores, never trains)."))
    learning_rate: float = restated("learning_rate", 1e-5)  # train_dpo's
    beta: float = Field(0.1, gt=0, description="DPO's beta: how far the policy may move from the reference (the "
                                               "reward is beta x the log-ratio to it).")
    ipo: bool = Field(False, description="IPO's squared loss (logits - 1/(2 beta))^2 instead of DPO's sigmoid.")
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="Conservative DPO: the assumed fraction of flipped "
                                                                  "labels (0: plain DPO; ignored with ipo, as in OpenRLHF).")
    nll_loss_coef: float = Field(0.0, ge=0, description="Weight of the chosen responses' NLL (mean per token) added "
                                                        "to the loss (Llama 3.1's regulariser).")
    eval_split: str = restated("eval_split", "test")  # train_dpo's and train_prm's
    save_path: str = Field("./out/dpo", **operational("Where the final policy is exported (an adapter if LoRA).",
                                                       role="output"))

    earlier_defaults = {"learning_rate": 5e-6, "max_len": 2048, "max_samples": None, "eval_holdout": 0.1}

    def chained(self, earlier: Earlier) -> DPOConfig:
        """The policy starts from the SFT output; the reference is the policy's start, as OpenRLHF."""
        pretrain = self.pretrain or earlier.output("sft")
        return self.model_copy(update={"pretrain": pretrain, "ref_pretrain": self.ref_pretrain or pretrain})


STAGE = Stage("dpo", DPOConfig, "train", position=15, description="Settings of the DPO stage.",
              trainer=Ref("rlhf_core.rank.trainers.dpo", "DPOTrainer"), openrlhf_module="train_dpo",
              headline_metrics=("eval_loss", "mean_loss", "loss"), is_policy=True,
              count_items=Ref("rlhf_core.data.pairs", "count_dpo_pairs"))
