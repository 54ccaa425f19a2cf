"""Hugging Face output, from the checkpoints' `hf/` copies: a stage's final model (`export_stage_output`), the LoRA
merge (`merge_lora`, checked against base + adapter) and the final export (`export_final`, loaded back and asked
to generate). docs/design-notes.md ("Hugging Face export") has the details. torch, transformers and peft are
imported by the functions that load a model (the merge, the final export), never by this module: the driver
imports it for `export_stage_output`, which copies files.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import uuid
from typing import TYPE_CHECKING, Callable

import fsspec
from fsspec.implementations.local import LocalFileSystem

from rlhf_core.storage.checkpoint import CheckpointStore
from rlhf_core.storage.manifest import HF_WEIGHTS_DIR, MANIFEST_NAME, manifest_digest
from rlhf_core.errors import UserError
from rlhf_core.storage.writable import probe_writable
from rlhf_core.storage.locate import SOURCE_NAME, check_model_dir, is_lora_dir, load_tokenizer, local_model_dir

if TYPE_CHECKING:
    import torch

MERGE_TOLERANCE = 1e-4


MODEL_FILE = re.compile(r"(model|adapter_model|pytorch_model).*\.(safetensors|bin)(\.index\.json)?|adapter_config\.json|"
                        r"config\.json|generation_config\.json|tokenizer.*|special_tokens_map\.json|chat_template\.jinja|"
                        + re.escape(SOURCE_NAME))


def upload_dir(local_dir: str, url: str, storage_options: dict | None = None) -> str:
    """Copy the files of `local_dir` to `url`, removing model files of an older export there first
    (a full model left beside a new adapter would be loaded instead of it); other files stay. On a local
    disk each file lands under a temporary name and is renamed over the old one: a process reading the old
    export (safetensors are memory-mapped) keeps its bytes, where a rewrite in place would kill it with
    SIGBUS, and an interrupted export never leaves a truncated file under the real name."""
    filesystem, target = fsspec.core.url_to_fs(url, **(storage_options or {}))
    filesystem.makedirs(target, exist_ok=True)
    new_names = set(os.listdir(local_dir))
    try:
        existing = filesystem.ls(target, detail=False)
    except FileNotFoundError:  # object stores have no empty folders: a first export finds nothing
        existing = []
    for path in existing:
        name = path.rstrip("/").rsplit("/", 1)[-1]
        # SOURCE_NAME goes first and comes back last: present, it says the export beside it is whole (a resuming
        # run skips a stage whose export names its last checkpoint: resume.finished_checkpoint)
        if MODEL_FILE.fullmatch(name) and (name not in new_names or name == SOURCE_NAME) and filesystem.isfile(path):
            filesystem.rm_file(path)
    for name in sorted(new_names, key=lambda name: (name == SOURCE_NAME, name)):
        destination = f"{target.rstrip('/')}/{name}"
        if not isinstance(filesystem, LocalFileSystem):
            filesystem.put_file(os.path.join(local_dir, name), destination)
            continue
        partial = f"{destination}.partial-{uuid.uuid4().hex[:8]}"
        filesystem.put_file(os.path.join(local_dir, name), partial)
        os.replace(partial, destination)
    return url


def export_stage_output(store: CheckpointStore, step: int, model_dir_name: str, pretrain: str, save_path: str,
                        storage_options: dict | None = None) -> str:
    """Copy the `hf/` folder of `model_dir_name` at `step`, plus the tokenizer, to `save_path`, with a
    SOURCE_NAME file naming the checkpoint (a later stage's drift guard compares it on resume). Only that folder
    is fetched: DeepSpeed's state beside it is several times its size (weights, fp32 master and moments)."""
    with tempfile.TemporaryDirectory(prefix="rlhf-export-") as local_dir:
        store.download(step, local_dir, hf_files_of(model_dir_name))
        hf_dir = os.path.join(local_dir, model_dir_name, HF_WEIGHTS_DIR)
        _save_tokenizer(store, pretrain, hf_dir, storage_options)
        with open(os.path.join(local_dir, MANIFEST_NAME), "rb") as manifest:
            source = {"checkpoint": store.uri(step), "manifest_digest": manifest_digest(manifest.read())}
        with open(os.path.join(hf_dir, SOURCE_NAME), "w") as handle:
            json.dump(source, handle, indent=1)
        return upload_dir(hf_dir, save_path, storage_options)


def _save_tokenizer(store: CheckpointStore, pretrain: str, hf_dir: str, storage_options: dict | None) -> None:
    """`pretrain`'s tokenizer saved into `hf_dir`: the files kept in the run's store when its data was counted
    (`tokenizer_ref.save_tokenizer_files`), copied, else the tokenizer loaded (transformers: ~1 CPU-s) and saved."""
    from rlhf_core.data.prepared import PreparedStore
    from rlhf_core.data.tokenizer_ref import saved_tokenizer_files

    ckpt_path = store.url.rsplit("/", 2)[0]  # a stage's store is {ckpt_path}/{run_name}/{stage}: RunConfig.stage_url
    saved = saved_tokenizer_files(pretrain, storage_options, PreparedStore(ckpt_path, storage_options))
    if saved is None:
        load_tokenizer(pretrain, storage_options).save_pretrained(hf_dir)
        return
    for name in os.listdir(saved):
        shutil.copyfile(os.path.join(saved, name), os.path.join(hf_dir, name))


def hf_files_of(model_dir_name: str) -> Callable[[list[str]], list[str]]:
    """A `CheckpointStore.fetch` selection: the files of `model_dir_name`'s Hugging Face copy."""
    prefix = f"{model_dir_name}/{HF_WEIGHTS_DIR}/"
    return lambda paths: [path for path in paths if path.startswith(prefix)]


def _probe_inputs(tokenizer, num_inputs: int = 4) -> torch.Tensor:
    """A few fixed token sequences covering the vocabulary, to compare two models' logits."""
    import torch

    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, len(tokenizer), (num_inputs, 16), generator=generator)


def merge_lora(model_path: str, lora_path: str, output_path: str, bf16: bool = False,
               storage_options: dict | None = None) -> float:
    """Merge the adapter at `lora_path` into `model_path`; returns the max logit difference checked."""
    import torch

    with torch.no_grad():
        return _merge_lora(model_path, lora_path, output_path, bf16, storage_options)


def _merge_lora(model_path: str, lora_path: str, output_path: str, bf16: bool,
                storage_options: dict | None) -> float:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    probe_writable(output_path, "--output_path", storage_options)  # before the merge, not after it
    adapter_dir = local_model_dir(lora_path, storage_options, flag="--lora_path")
    if not is_lora_dir(adapter_dir):
        raise UserError(f"--lora_path: {lora_path} holds no LoRA adapter (adapter_config.json).")
    check_model_dir(adapter_dir, lora_path, "--lora_path")
    base_dir = local_model_dir(model_path, storage_options, flag="--model_path")
    check_model_dir(base_dir, model_path, "--model_path")
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, adapter_dir).eval()
    tokenizer = (load_tokenizer(lora_path, storage_options, flag="--lora_path")
                 if os.path.exists(os.path.join(adapter_dir, "tokenizer_config.json"))
                 else load_tokenizer(model_path, storage_options, flag="--model_path"))
    probe = _probe_inputs(tokenizer)
    expected = adapted(input_ids=probe).logits
    merged = adapted.merge_and_unload().eval()
    difference = (merged(input_ids=probe).logits - expected).abs().max().item()
    if difference > MERGE_TOLERANCE:
        raise RuntimeError(f"merged logits differ from base+adapter by {difference:.2e} (> {MERGE_TOLERANCE}); "
                           "nothing was written")
    if bf16:
        merged = merged.to(torch.bfloat16)
    with tempfile.TemporaryDirectory(prefix="rlhf-merge-") as local_dir:
        merged.save_pretrained(local_dir, safe_serialization=True)
        tokenizer.save_pretrained(local_dir)
        upload_dir(local_dir, output_path, storage_options)
    return difference


def export_final(model_path: str, save_path: str, storage_options: dict | None = None) -> str:
    """Write `model_path` (merged if an adapter) as a standalone model, after it loads and generates."""
    import torch

    with torch.no_grad():
        return _export_final(model_path, save_path, storage_options)


def _export_final(model_path: str, save_path: str, storage_options: dict | None) -> str:
    import torch
    from transformers import AutoModelForCausalLM

    from rlhf_core.models.load import load_causal_lm

    model = load_causal_lm(model_path, storage_options=storage_options, flag="--model_path").eval()
    tokenizer = load_tokenizer(model_path, storage_options, flag="--model_path")
    with tempfile.TemporaryDirectory(prefix="rlhf-final-") as local_dir:
        model.save_pretrained(local_dir, safe_serialization=True)
        tokenizer.save_pretrained(local_dir)
        reloaded = AutoModelForCausalLM.from_pretrained(local_dir).eval()
        prompt = torch.tensor([[tokenizer.bos_token_id or 0]])
        output = reloaded.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        if output.shape[1] <= prompt.shape[1]:
            raise RuntimeError(f"the exported model at {model_path} did not generate")
        return upload_dir(local_dir, save_path, storage_options)
