"""Hugging Face export: the final checkpoint's weights, merged if LoRA, plus the tokenizer, as safetensors.

Reads only the checkpoint's `hf/` copy (safetensors and JSON), never DeepSpeed's pickles.
"""

from __future__ import annotations

import os
import tempfile

import fsspec

from rlhf_core.checkpoint import CheckpointStore
from rlhf_core.models import is_lora_dir, load_tokenizer


def export_hf_model(store: CheckpointStore, step: int, pretrain: str, save_path: str,
                    storage_options: dict | None = None, model_dir_name: str = "actor_model") -> str:
    """Write a standalone HF model (config, safetensors weights, tokenizer) to `save_path`."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="rlhf-export-") as local_dir:
        store.download(step, local_dir)
        hf_dir = os.path.join(local_dir, model_dir_name, "hf")
        if is_lora_dir(hf_dir):
            from peft import PeftModel

            from rlhf_core.models import local_model_dir

            base = AutoModelForCausalLM.from_pretrained(local_model_dir(pretrain))
            model = PeftModel.from_pretrained(base, hf_dir).merge_and_unload()
        else:
            model = AutoModelForCausalLM.from_pretrained(hf_dir)
        out_dir = os.path.join(local_dir, "export")
        model.save_pretrained(out_dir, safe_serialization=True)
        load_tokenizer(pretrain).save_pretrained(out_dir)
        filesystem, target = fsspec.core.url_to_fs(save_path, **(storage_options or {}))
        filesystem.makedirs(target, exist_ok=True)
        for name in sorted(os.listdir(out_dir)):
            filesystem.put_file(os.path.join(out_dir, name), f"{target.rstrip('/')}/{name}")
    return save_path
