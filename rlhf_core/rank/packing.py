"""Sample packing (`--packing_samples`): a micro-batch's sequences laid end to end in one row, no padding, positions
restarting at each sequence so that transformers keeps attention inside each; the loss is the padded batch's within
float rounding. docs/design-notes.md ("Sample packing") says why callers pass `use_cache=False`.
"""

from __future__ import annotations

import torch

from rlhf_core.data.samples import IGNORE_INDEX


def pack_sequences(sequences: list[list[int]]) -> dict[str, torch.Tensor]:
    """input_ids and position_ids [1, total], and `ends` [n]: the index of each sequence's last token."""
    lengths = torch.tensor([len(ids) for ids in sequences])
    input_ids = torch.tensor([token for ids in sequences for token in ids]).unsqueeze(0)
    position_ids = torch.cat([torch.arange(length) for length in lengths.tolist()]).unsqueeze(0)
    return {"input_ids": input_ids, "position_ids": position_ids, "ends": lengths.cumsum(0) - 1}


def pack_sft(samples) -> dict[str, torch.Tensor]:
    """A packed SFT row: input_ids, position_ids and labels (IGNORE_INDEX outside responses and at each
    sample's first token)."""
    packed = pack_sequences([sample.input_ids for sample in samples])
    labels = [token if keep and position > 0 else IGNORE_INDEX
              for sample in samples
              for position, (token, keep) in enumerate(zip(sample.input_ids, sample.loss_mask))]
    return {"input_ids": packed["input_ids"], "position_ids": packed["position_ids"],
            "labels": torch.tensor(labels).unsqueeze(0)}


def packed_scores(model, input_ids: torch.Tensor, position_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A scalar model's (backbone + `score` head) score at `positions` of one packed row."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # through a LoRA wrapper
    backbone = getattr(inner, inner.base_model_prefix)
    device = inner.score.weight.device
    hidden = backbone(input_ids=input_ids.to(device), position_ids=position_ids.to(device),
                      use_cache=False).last_hidden_state
    return inner.score(hidden[0, positions.to(device)]).squeeze(-1)
