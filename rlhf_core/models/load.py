"""Model loading, in the ranks and in the driver's LoRA merge and toy evaluation: Hugging Face models from wherever
`rlhf_core.storage.locate` finds them, optionally with LoRA (an adapter folder loads merged onto its base), reward
models and critics in OpenRLHF's layout (a backbone and a one-label `score` head). Flash attention that cannot run
falls back to sdpa, where OpenRLHF fails. docs/design-notes.md ("Model loading") has the details.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

from rlhf_core.errors import UserError
from rlhf_core.storage.locate import check_model_dir, is_lora_dir, local_model_dir, lora_base_dir

logger = logging.getLogger(__name__)

ATTENTION_FALLBACK = "sdpa"


@dataclass(frozen=True)
class LoadOptions:
    """How a model is built once its weights are read: fresh LoRA adapters (`lora_rank` 0: none), activation
    checkpointing, the attention kernel. The default: the model as it is, transformers' attention."""

    lora_rank: int = 0
    lora_alpha: int = 16
    target_modules: list[str] | None = None
    lora_dropout: float = 0.0
    gradient_checkpointing: bool = False
    attn_implementation: str | None = None

    @classmethod
    def trained(cls, cfg) -> LoadOptions:
        """The options of the model a stage trains: its config's LoRA, checkpointing and attention fields
        (rlhf_core.stages.base)."""
        return cls(cfg.lora_rank, cfg.lora_alpha, cfg.target_modules, cfg.lora_dropout, cfg.gradient_checkpointing,
                   cfg.attn_implementation)

    @classmethod
    def frozen(cls, cfg) -> LoadOptions:
        """The options of a model a stage only reads (reference, reward model): its config's attention kernel."""
        return cls(attn_implementation=cfg.attn_implementation)


def resolve_attn_implementation(name: str | None) -> str | None:
    """`name` if this machine can run it; flash_attention_* without its package or CUDA -> sdpa (one
    warning per process); an unknown name is a UserError naming --attn_implementation."""
    if name is None:
        return None
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    known = ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]
    if name not in known and not name.startswith("paged|") and "/" not in name:  # "/": a kernel on the hub
        raise UserError(f"--attn_implementation {name!r} is not one of {', '.join(known)}.")
    if name.startswith("flash_attention_") and not _flash_attention_available(name):
        _warn_attention_fallback(name)
        return ATTENTION_FALLBACK
    return name


def _flash_attention_available(name: str) -> bool:
    import transformers.utils as hf_utils

    check = getattr(hf_utils, f"is_flash_attn_{name.rsplit('_', 1)[-1]}_available", None)
    return bool(torch.cuda.is_available() and check is not None and check())


@functools.lru_cache(maxsize=None)
def _warn_attention_fallback(name: str) -> None:
    reason = "no CUDA device" if not torch.cuda.is_available() else "the flash-attn package is not installed"
    logger.warning("--attn_implementation %s: %s here; using %s attention instead.", name, reason, ATTENTION_FALLBACK)


def _from_pretrained(auto_class, url: str, storage_options: dict | None, flag: str, **kwargs):
    """`auto_class` at `url`, merging a LoRA adapter into its base when `url` holds one."""
    directory = local_model_dir(url, storage_options, flag=flag)
    check_model_dir(directory, url, flag)
    try:
        if not is_lora_dir(directory):
            return auto_class.from_pretrained(directory, dtype=torch.float32, **kwargs)
        from peft import PeftModel

        base_dir = lora_base_dir(directory, storage_options, flag=flag)
        check_model_dir(base_dir, base_dir, flag)
        base = auto_class.from_pretrained(base_dir, dtype=torch.float32, **kwargs)
        return PeftModel.from_pretrained(base, directory).merge_and_unload()
    except (OSError, ValueError) as error:
        raise UserError(f"{flag}: {url} is not a loadable Hugging Face model ({error}).") from None


def with_lora(model, options: LoadOptions, task_type: str, *, source: str = "the model"):
    """Fresh LoRA adapters on `options.target_modules` (None: all-linear, whatever the family names its
    layers); `model` as it is with `options.lora_rank` 0."""
    if options.lora_rank <= 0:
        return model
    from peft import LoraConfig, get_peft_model

    from rlhf_core.models.lora_targets import refuse_unknown_targets

    refuse_unknown_targets(model, options.target_modules, source)

    lora = LoraConfig(r=options.lora_rank, lora_alpha=options.lora_alpha, lora_dropout=options.lora_dropout,
                      task_type=task_type, target_modules=options.target_modules or "all-linear")
    return get_peft_model(model, lora)


def _attention_kwargs(attn_implementation: str | None) -> dict:
    resolved = resolve_attn_implementation(attn_implementation)
    return {"attn_implementation": resolved} if resolved else {}


def enable_activation_checkpointing(model, use_reentrant: bool) -> None:
    """Recompute activations in backward (transformers 5 renamed gradient_checkpointing_enable)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})


def import_model_classes(url: str | None) -> None:
    """Import transformers and the model family of the local model folder `url` (its configuration and
    modeling modules: about 1.5 s on a CPU), so that a later load does not wait for them; nothing for
    other URLs, which are fetched at load time."""
    if not url or not os.path.isfile(os.path.join(url, "config.json")):
        return
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(url))]  # noqa: B018 - the lookup imports it


def load_causal_lm(url: str, options: LoadOptions = LoadOptions(), *, storage_options: dict | None = None,
                   flag: str = "--pretrain"):
    """The model at `url` in float32 (DeepSpeed casts for bf16), with fresh LoRA adapters if `options` ask."""
    from transformers import AutoModelForCausalLM

    model = _from_pretrained(AutoModelForCausalLM, url, storage_options, flag,
                             **_attention_kwargs(options.attn_implementation))
    if options.gradient_checkpointing:
        enable_activation_checkpointing(model, use_reentrant=False)
    return with_lora(model, options, "CAUSAL_LM", source=url)


def load_scalar_model(url: str, pad_token_id: int, options: LoadOptions = LoadOptions(), *,
                      storage_options: dict | None = None, flag: str = "--pretrain"):
    """A reward model or critic: backbone + `score` head (new if `url` is a causal LM)."""
    from transformers import AutoModelForSequenceClassification

    model = _from_pretrained(AutoModelForSequenceClassification, url, storage_options, flag, num_labels=1,
                             **_attention_kwargs(options.attn_implementation))
    model.config.pad_token_id = pad_token_id  # transformers' pooling needs it; rewards use sequence_scores
    if options.gradient_checkpointing:
        enable_activation_checkpointing(model, use_reentrant=False)
    return with_lora(model, options, "SEQ_CLS", source=url)


def token_values(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The `score` head at every position: a critic's per-token values, [batch, length]. Positions count
    attended tokens only (as OpenRLHF's), so a left-padded row scores as it would unpadded: families with
    learned absolute positions (GPT-2) depend on it."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # through a LoRA wrapper
    backbone = getattr(inner, inner.base_model_prefix)
    device = inner.score.weight.device
    attention_mask = attention_mask.to(device)
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    hidden = backbone(input_ids=input_ids.to(device), attention_mask=attention_mask,
                      position_ids=position_ids).last_hidden_state
    return inner.score(hidden).squeeze(-1)


def last_token_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's last attended position, left or right padding alike: the EOS a sequence ends with."""
    return attention_mask.size(1) - 1 - attention_mask.long().fliplr().argmax(dim=1)


def sequence_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """A reward model's score of each row, read at its last attended token as OpenRLHF reads it, [batch].
    transformers' own pooling reads the last token that is not the pad token instead, which for a family
    without a pad token (GPT-2, Mistral: pad = EOS, as OpenRLHF sets it) is the token before the EOS."""
    values = token_values(model, input_ids, attention_mask)
    return values.gather(1, last_token_positions(attention_mask).to(values.device).unsqueeze(1)).squeeze(1)
