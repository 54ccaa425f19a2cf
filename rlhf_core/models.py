"""Model loading: Hugging Face causal LMs from any fsspec URL, optionally wrapped in LoRA adapters."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import fsspec

from rlhf_core.errors import UserError


def local_model_dir(url: str) -> str:
    """A local folder holding the model at `url`; remote models are fetched once into a cache."""
    protocol, path = fsspec.core.split_protocol(url)
    if protocol in (None, "file"):
        if not Path(path).is_dir():
            raise UserError(f"--pretrain: {url} is not a model folder.")
        return str(Path(path).resolve())
    cache = Path(tempfile.gettempdir()) / "rlhf-model-cache" / hashlib.sha256(url.encode()).hexdigest()[:16]
    if not (cache / "config.json").exists():
        filesystem, remote_path = fsspec.core.url_to_fs(url)
        if not filesystem.exists(remote_path):
            raise UserError(f"--pretrain: {url} does not exist.")
        filesystem.get(remote_path.rstrip("/") + "/", str(cache), recursive=True)
    return str(cache)


def load_tokenizer(url: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(local_model_dir(url))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(url: str, lora_rank: int = 0, lora_alpha: int = 16, target_modules: list[str] | None = None,
                   gradient_checkpointing: bool = False):
    """The model at `url` in float32 (DeepSpeed casts for bf16), with fresh LoRA adapters if asked."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(local_model_dir(url), dtype=torch.float32)
    except (OSError, ValueError) as error:
        raise UserError(f"--pretrain: {url} is not a loadable Hugging Face model ({error}).") from None
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=lora_rank, lora_alpha=lora_alpha, lora_dropout=0.0, task_type="CAUSAL_LM",
            target_modules=target_modules or "all-linear",
        )
        model = get_peft_model(model, lora)
    return model


def is_lora_dir(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, "adapter_config.json"))
