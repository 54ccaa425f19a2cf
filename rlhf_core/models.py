"""Model loading: Hugging Face models from any fsspec URL, optionally wrapped in LoRA adapters.

A folder holding a LoRA adapter (adapter_config.json) is accepted wherever a model is: its base is
loaded and the adapter merged in memory, so a LoRA stage's output feeds the next stage directly.
Reward models and critics are `AutoModelForSequenceClassification` with one label: a backbone and a
linear `score` head, OpenRLHF's layout; `token_values` reads the head at every position for a critic.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import fsspec
import torch

from rlhf_core.errors import UserError


def local_model_dir(url: str) -> str:
    """A local folder holding the model at `url`; remote models are fetched once into a cache."""
    protocol, path = fsspec.core.split_protocol(url)
    if protocol in (None, "file"):
        if not Path(path).is_dir():
            raise UserError(f"--pretrain: {url} is not a model folder.")
        return str(Path(path).resolve())
    cache = Path(tempfile.gettempdir()) / "rlhf-model-cache" / hashlib.sha256(url.encode()).hexdigest()[:16]
    if not (cache / "config.json").exists() and not (cache / "adapter_config.json").exists():
        filesystem, remote_path = fsspec.core.url_to_fs(url)
        if not filesystem.exists(remote_path):
            raise UserError(f"--pretrain: {url} does not exist.")
        filesystem.get(remote_path.rstrip("/") + "/", str(cache), recursive=True)
    return str(cache)


SOURCE_NAME = "rlhf_source.json"  # written by export: the checkpoint a stage's output came from
INPUT_MODEL_FIELDS = ("pretrain", "reward_pretrain", "critic_pretrain")


def model_fingerprint(url: str, storage_options: dict | None = None) -> str:
    """Identity of the model folder at `url`, cheap enough to take at every commit: the manifest digest
    of the checkpoint it was exported from (our own stage outputs), else its file names and sizes."""
    filesystem, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    try:
        source = json.loads(filesystem.cat_file(f"{path.rstrip('/')}/{SOURCE_NAME}"))
        return f"checkpoint:{source['manifest_digest']}"
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        pass
    try:
        listing = sorted((entry["name"].rsplit("/", 1)[-1], entry.get("size"))
                         for entry in filesystem.ls(path, detail=True) if entry.get("type") == "file")
    except FileNotFoundError:
        return ""
    return "files:" + hashlib.sha256(repr(listing).encode()).hexdigest()


def input_model_fingerprints(cfg) -> dict[str, str]:
    """`model_fingerprint` of each model a stage starts from (pretrain, reward, critic)."""
    return {name: model_fingerprint(getattr(cfg, name)) for name in INPUT_MODEL_FIELDS if getattr(cfg, name, None)}


def is_lora_dir(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, "adapter_config.json"))


def load_tokenizer(url: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(local_model_dir(url))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _from_pretrained(auto_class, url: str, **kwargs):
    """`auto_class` at `url`, merging a LoRA adapter into its base when `url` holds one."""
    directory = local_model_dir(url)
    try:
        if not is_lora_dir(directory):
            return auto_class.from_pretrained(directory, dtype=torch.float32, **kwargs)
        from peft import PeftConfig, PeftModel

        base = auto_class.from_pretrained(PeftConfig.from_pretrained(directory).base_model_name_or_path,
                                          dtype=torch.float32, **kwargs)
        return PeftModel.from_pretrained(base, directory).merge_and_unload()
    except (OSError, ValueError) as error:
        raise UserError(f"{url} is not a loadable Hugging Face model ({error}).") from None


def with_lora(model, lora_rank: int, lora_alpha: int, target_modules: list[str] | None, task_type: str):
    if lora_rank <= 0:
        return model
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=0.0, task_type=task_type,
                      target_modules=target_modules or "all-linear")
    return get_peft_model(model, lora)


def load_causal_lm(url: str, lora_rank: int = 0, lora_alpha: int = 16, target_modules: list[str] | None = None,
                   gradient_checkpointing: bool = False):
    """The model at `url` in float32 (DeepSpeed casts for bf16), with fresh LoRA adapters if asked."""
    from transformers import AutoModelForCausalLM

    model = _from_pretrained(AutoModelForCausalLM, url)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return with_lora(model, lora_rank, lora_alpha, target_modules, "CAUSAL_LM")


def load_scalar_model(url: str, pad_token_id: int, lora_rank: int = 0, lora_alpha: int = 16,
                      target_modules: list[str] | None = None, gradient_checkpointing: bool = False):
    """A reward model or critic: backbone + `score` head (new if `url` is a causal LM)."""
    from transformers import AutoModelForSequenceClassification

    model = _from_pretrained(AutoModelForSequenceClassification, url, num_labels=1)
    model.config.pad_token_id = pad_token_id  # the score is read at the last non-pad token
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return with_lora(model, lora_rank, lora_alpha, target_modules, "SEQ_CLS")


def token_values(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The `score` head at every position: a critic's per-token values, [batch, length]."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # through a LoRA wrapper
    backbone = getattr(inner, inner.base_model_prefix)
    device = inner.score.weight.device
    hidden = backbone(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).last_hidden_state
    return inner.score(hidden).squeeze(-1)
