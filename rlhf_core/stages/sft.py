"""Supervised fine-tuning: OpenRLHF's `train_sft`; its trainer is `rlhf_core.rank.trainers.sft`."""

from __future__ import annotations

from pydantic import Field

from rlhf_core.stages.base import PRETRAIN_HELP, Ref, Stage, StageConfig, input_location, operational, restated


class SFTConfig(StageConfig):
    """Supervised fine-tuning on (prompt, response) pairs; the loss covers response tokens only."""

    pretrain: str = Field(**input_location(PRETRAIN_HELP, role="model"))  # the first stage: nothing to default it from
    dataset: str = Field(**input_location("Training data (prompt, response): JSONL, JSON, CSV or Parquet at a local path or "
                                  "fsspec URL, a `datasets` folder, a hub dataset name, or OpenRLHF's name@data_dir; "
                                  "several, comma-separated, are mixed by dataset_probs.", role="data"))
    input_key: str = Field("input", description="Key of the prompt in each sample: a string, or with "
                                                "apply_chat_template a list of {role, content} messages (without "
                                                "output_key: the whole conversation, its last message the response).")
    output_key: str | None = Field(None, description="Key of the response in each sample (a string or messages); "
                                                     "none: input_key holds whole conversations (apply_chat_template).")
    apply_chat_template: bool = Field(False, description="Render prompt and response with the tokenizer's chat "
                                                         "template, as OpenRLHF does.")
    multiturn: bool = Field(False, description="Put loss on every assistant turn of the conversation in input_key "
                                               "(with apply_chat_template), not only on the last.")
    tokenizer_chat_template: str | None = Field(None, description="A Jinja chat template that replaces the "
                                                                  "tokenizer's own (with apply_chat_template).")
    pretrain_mode: bool = Field(False, description="Continued pre-training: the loss covers every token of each "
                                                   "sample's input_key text (no template, output_key unused).")
    max_epochs: int = restated("max_epochs", 2)  # train_sft's
    # train_sft's: applied when no chat template is (OpenRLHF's); unused with apply_chat_template or pretrain_mode
    input_template: str | None = restated("input_template", "User: {}\nAssistant: ")
    save_path: str = Field("./out/sft", **operational("Where the final Hugging Face model is exported (any fsspec "
                                                       "URL).", role="output"))

    earlier_defaults = {"max_epochs": 1, "max_samples": None, "input_template": None}


STAGE = Stage("sft", SFTConfig, "train", position=10, description="Settings of the SFT stage.",
              trainer=Ref("rlhf_core.rank.trainers.sft", "SFTTrainer"), openrlhf_module="train_sft", is_policy=True,
              count_items=Ref("rlhf_core.data.sft", "count_sft_samples"))
