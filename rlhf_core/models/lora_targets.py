"""LoRA targets checked against the model's own architecture (the default is peft's `all-linear`), so no family is
assumed to be Llama: a `--target_modules` name that matches no module is refused with the layers the model has,
where peft adapts the names that match without a word. docs/design-notes.md ("LoRA targets") has the rules.
"""

from __future__ import annotations

import torch

from rlhf_core.errors import UserError

FLAG = "--target_modules"


def matches_module(target: str, module_name: str) -> bool:
    """peft's rule for one entry of a target list (`check_target_module_exists`)."""
    return module_name == target or module_name.endswith("." + target)


def linear_layer_names(model) -> list[str]:
    """The distinct last names of the layers `all-linear` adapts: nn.Linear and Conv1D, output heads excluded."""
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = [name.rsplit(".", 1)[-1] for name, module in model.named_modules()
             if isinstance(module, (torch.nn.Linear, Conv1D)) and module is not head]
    return [name for name in dict.fromkeys(names) if name not in ("score", "classifier")]


def refuse_unknown_targets(model, target_modules: list[str] | None, source: str) -> None:
    """A UserError naming every entry of `target_modules` that matches no module of `model` (loaded from `source`)."""
    if not target_modules:
        return
    module_names = [name for name, _ in model.named_modules()]
    missing = [target for target in target_modules if not any(matches_module(target, name) for name in module_names)]
    if missing:
        model_type = getattr(getattr(model, "config", None), "model_type", "?")
        raise UserError(f"{FLAG}: {', '.join(missing)} name no module of {source} ({model_type}); its linear layers "
                        f"are {', '.join(linear_layer_names(model))} (or leave {FLAG} out for all-linear, the "
                        "default).")
