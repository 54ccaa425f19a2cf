"""Model loading: Hugging Face models from local folders, any fsspec URL or hub ids, optionally with LoRA.

A folder holding a LoRA adapter (adapter_config.json) is accepted wherever a model is: its base is
loaded and the adapter merged in memory, so a LoRA stage's output feeds the next stage directly.
Reward models and critics are `AutoModelForSequenceClassification` with one label: a backbone and a
linear `score` head, OpenRLHF's layout; `token_values` reads the head at every position for a critic, and
`sequence_scores` at each sequence's last token for a reward. LoRA targets are checked against the model's
own layers (rlhf_core.rank.lora_targets).

Hub ids (`OpenRLHF/Llama-3-8b-sft-mixture`) resolve through huggingface_hub (rlhf_core.storage.hub); remote
folders (s3://...) are copied once into a local cache with the run's storage_options. Before anything
is loaded, the folder is checked so that a user's mistake names its file and flag: no tokenizer files,
no or corrupt config.json, a model_type transformers does not know, truncated or corrupt safetensors.
`attn_implementation` flash_attention_* without flash-attn or CUDA falls back to sdpa with one warning
(OpenRLHF would fail to load); unknown names are refused.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import fsspec
import torch

from rlhf_core.errors import UserError
from rlhf_core.storage.hub import hub_model_dir, hub_snapshot, is_hub_id, reaching_store, store_unreachable
from rlhf_core.urls import local_path

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth")


def local_model_dir(url: str, storage_options: dict | None = None, *, flag: str = "--pretrain") -> str:
    """A local folder holding the model at `url` (a folder, a hub id, or a remote URL fetched once into a
    cache); errors name `flag`, the option the user gave `url` with."""
    path = local_path(url)
    if path is not None:
        if Path(path).is_dir():
            return str(Path(path).resolve())
        if Path(path).exists():
            raise UserError(f"{flag}: {url} is a file, not a model folder.")
        if is_hub_id(url):  # (a file:// URL never is one)
            return hub_model_dir(url, flag)
        raise UserError(f"{flag}: {url} is not a model folder (no such folder).")
    with reaching_store(flag, url, storage_options):
        return _fetch_remote(url, storage_options, flag)


def _fetch_remote(url: str, storage_options: dict | None, flag: str) -> str:
    """Copy the remote folder once into a local cache; the copy lands under a temporary name and is
    renamed, so an interrupted download is never taken for a model."""
    key = url + json.dumps(storage_options or {}, sort_keys=True, default=str)
    cache = Path(tempfile.gettempdir()) / "rlhf-model-cache" / hashlib.sha256(key.encode()).hexdigest()[:16]
    if cache.is_dir():
        return str(cache)
    filesystem, remote_path = fsspec.core.url_to_fs(url, **(storage_options or {}))
    if not filesystem.exists(remote_path):
        raise UserError(f"{flag}: {url} does not exist.")
    cache.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=cache.name + ".partial-", dir=cache.parent))
    try:
        filesystem.get(remote_path.rstrip("/") + "/", str(partial), recursive=True)
        os.replace(partial, cache)
    except OSError:
        if not cache.is_dir():  # another process finished first; any other failure is re-raised
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return str(cache)


SOURCE_NAME = "rlhf_source.json"  # written by export: the checkpoint a stage's output came from


def model_fingerprint(url: str, storage_options: dict | None = None, *, flag: str = "--pretrain") -> str:
    """Identity of the model at `url`, cheap enough to take at every commit: the manifest digest of the
    checkpoint it was exported from (our own stage outputs), a hub id's revision, else its file names
    and sizes; "" when there is nothing there."""
    path = local_path(url)
    if path is not None and not os.path.exists(path) and is_hub_id(url):
        snapshot = hub_snapshot(url, download=False)
        return f"hub:{url}@{os.path.basename(snapshot)}" if snapshot else ""
    try:
        filesystem, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
        try:
            source = json.loads(filesystem.cat_file(f"{path.rstrip('/')}/{SOURCE_NAME}"))
            return f"checkpoint:{source['manifest_digest']}"
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            pass
        listing = sorted((entry["name"].rsplit("/", 1)[-1], entry.get("size"))
                         for entry in filesystem.ls(path, detail=True) if entry.get("type") == "file")
    except (FileNotFoundError, NotADirectoryError):  # nothing (or a file) there: the folder check names it
        return ""
    except Exception as error:  # noqa: BLE001 - a store's own error types; re-raised unless understood
        unreachable = store_unreachable(error, flag, url, storage_options)
        if unreachable is not None:
            raise unreachable from None
        raise
    return "files:" + hashlib.sha256(repr(listing).encode()).hexdigest()


def input_model_fingerprints(cfg, storage_options: dict | None = None) -> dict[str, str]:
    """`model_fingerprint` of each model a stage starts from: its fields with the role "model"."""
    from rlhf_core.stages.base import fields_with_role

    return {name: model_fingerprint(getattr(cfg, name), storage_options, flag=f"--{name}")
            for name in fields_with_role(type(cfg), "model") if getattr(cfg, name, None)}


def is_lora_dir(directory: str) -> bool:
    return os.path.exists(os.path.join(directory, "adapter_config.json"))


def _read_json(path: str, flag: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            value = json.load(handle)
    except json.JSONDecodeError as error:
        raise UserError(f"{flag}: {path} is not valid JSON (line {error.lineno}: {error.msg}).") from None
    except UnicodeDecodeError as error:
        raise UserError(f"{flag}: {path} is not UTF-8 text (byte offset {error.start}).") from None
    if not isinstance(value, dict):
        raise UserError(f"{flag}: {path} must hold a JSON object, not {type(value).__name__}.")
    return value


def lora_base_dir(directory: str, storage_options: dict | None = None, *, flag: str = "--pretrain") -> str:
    """The local folder of the base model an adapter folder names (base_model_name_or_path)."""
    config_path = os.path.join(directory, "adapter_config.json")
    base = _read_json(config_path, flag).get("base_model_name_or_path")
    if not base:
        raise UserError(f"{flag}: {config_path} names no base_model_name_or_path.")
    return local_model_dir(base, storage_options, flag=f"{flag} (base_model_name_or_path in {config_path})")


def check_model_dir(directory: str, url: str, flag: str) -> None:
    """Refuse a folder transformers would fail on, naming the file: config.json missing, not JSON, or of
    an unknown model_type; no weights; truncated or corrupt safetensors (a header check, no loading)."""
    from transformers import __version__ as transformers_version
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    config_path = os.path.join(directory, "config.json")
    if is_lora_dir(directory):  # its own file first: a broken adapter_config.json explains what follows
        _read_json(os.path.join(directory, "adapter_config.json"), flag)
    elif not os.path.exists(config_path):
        raise UserError(f"{flag}: {url} has no config.json (nor adapter_config.json); it is not a Hugging Face "
                        "model folder.")
    elif (model_type := _read_json(config_path, flag).get("model_type")) not in CONFIG_MAPPING_NAMES:
        raise UserError(f"{flag}: {config_path} has model_type {model_type!r}, an architecture transformers "
                        f"{transformers_version} does not know; fix the file or install a transformers that "
                        "knows it (models with custom code are not supported).")
    weights = sorted(path for pattern in WEIGHT_PATTERNS for path in glob.glob(os.path.join(directory, pattern)))
    if not weights:
        raise UserError(f"{flag}: {url} has no weights (model.safetensors or pytorch_model.bin).")
    for index_path in glob.glob(os.path.join(directory, "*.index.json")):
        for shard in sorted(set(_read_json(index_path, flag).get("weight_map", {}).values())):
            if not os.path.exists(os.path.join(directory, shard)):
                raise UserError(f"{flag}: {index_path} lists the weight file {shard}, which is missing.")
    for path in weights:
        if path.endswith(".safetensors"):
            _check_safetensors(path, flag)


def _check_safetensors(path: str, flag: str) -> None:
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt"):
            pass
    except Exception as error:  # noqa: BLE001 - SafetensorError and OSError alike mean a bad file
        raise UserError(f"{flag}: {path} is truncated or corrupt ({error}); copy the weights again.") from None


def load_tokenizer(url: str, storage_options: dict | None = None, *, flag: str = "--pretrain"):
    """The tokenizer of the model at `url` (an adapter folder without one uses its base's)."""
    from transformers import AutoTokenizer

    directory = local_model_dir(url, storage_options, flag=flag)
    if not _has_tokenizer(directory) and is_lora_dir(directory):
        directory = lora_base_dir(directory, storage_options, flag=flag)
    if not _has_tokenizer(directory):
        raise UserError(f"{flag}: {url} has no tokenizer ({', '.join(TOKENIZER_FILES[:3])} ...); copy the "
                        "tokenizer files of the model there.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except Exception as error:  # noqa: BLE001 - transformers raises many types for a bad tokenizer
        raise UserError(f"{flag}: cannot load the tokenizer in {url} ({type(error).__name__}: {error}).") from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _has_tokenizer(directory: str) -> bool:
    return any(os.path.exists(os.path.join(directory, name)) for name in TOKENIZER_FILES)


ATTENTION_FALLBACK = "sdpa"


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


def with_lora(model, lora_rank: int, lora_alpha: int, target_modules: list[str] | None, task_type: str,
              lora_dropout: float = 0.0, *, source: str = "the model"):
    """Fresh LoRA adapters on `target_modules` (None: all-linear, whatever the family names its layers)."""
    if lora_rank <= 0:
        return model
    from peft import LoraConfig, get_peft_model

    from rlhf_core.rank.lora_targets import refuse_unknown_targets

    refuse_unknown_targets(model, target_modules, source)

    lora = LoraConfig(r=lora_rank, lora_alpha=lora_alpha, lora_dropout=lora_dropout, task_type=task_type,
                      target_modules=target_modules or "all-linear")
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


def load_causal_lm(url: str, lora_rank: int = 0, lora_alpha: int = 16, target_modules: list[str] | None = None,
                   gradient_checkpointing: bool = False, *, lora_dropout: float = 0.0,
                   attn_implementation: str | None = None, storage_options: dict | None = None,
                   flag: str = "--pretrain"):
    """The model at `url` in float32 (DeepSpeed casts for bf16), with fresh LoRA adapters if asked."""
    from transformers import AutoModelForCausalLM

    model = _from_pretrained(AutoModelForCausalLM, url, storage_options, flag, **_attention_kwargs(attn_implementation))
    if gradient_checkpointing:
        enable_activation_checkpointing(model, use_reentrant=False)
    return with_lora(model, lora_rank, lora_alpha, target_modules, "CAUSAL_LM", lora_dropout, source=url)


def load_scalar_model(url: str, pad_token_id: int, lora_rank: int = 0, lora_alpha: int = 16,
                      target_modules: list[str] | None = None, gradient_checkpointing: bool = False, *,
                      lora_dropout: float = 0.0, attn_implementation: str | None = None,
                      storage_options: dict | None = None, flag: str = "--pretrain"):
    """A reward model or critic: backbone + `score` head (new if `url` is a causal LM)."""
    from transformers import AutoModelForSequenceClassification

    model = _from_pretrained(AutoModelForSequenceClassification, url, storage_options, flag, num_labels=1,
                             **_attention_kwargs(attn_implementation))
    model.config.pad_token_id = pad_token_id  # transformers' pooling needs it; rewards use sequence_scores
    if gradient_checkpointing:
        enable_activation_checkpointing(model, use_reentrant=False)
    return with_lora(model, lora_rank, lora_alpha, target_modules, "SEQ_CLS", lora_dropout, source=url)


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
