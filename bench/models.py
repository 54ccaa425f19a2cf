"""The benchmark's models, built locally as `rlhf_core.toy` builds the toy one (no hub access).

Two Llamas on the toy tokenizer (19 tokens, so nearly every parameter is in the layers):
- `23.6m`: hidden 384, 8 layers, MLP 2048: the size the issue's step-speed numbers were measured on;
- `100m`: hidden 1024, 6 layers, MLP 4096: big enough that a checkpoint (~2 GB with its optimizer
  state) costs seconds, so the checkpoint ratios measure I/O rather than fixed overhead.
Both sides of every comparison (ours and TRL) load the same saved folder.
"""

from __future__ import annotations

import os

SIZES = {
    "23.6m": {"hidden_size": 384, "intermediate_size": 2048, "num_hidden_layers": 8, "num_attention_heads": 6},
    "100m": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 6, "num_attention_heads": 16},
}


def build_model_dir(directory: str, size: str, seed: int = 0) -> tuple[str, int]:
    """Save a randomly initialised Llama of `size` with the toy tokenizer into `directory` (once: an
    existing folder is reused). Returns (directory, number of parameters)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_core.toy import build_tokenizer

    tokenizer = build_tokenizer()
    shape = SIZES[size]
    config = LlamaConfig(vocab_size=len(tokenizer), num_key_value_heads=shape["num_attention_heads"],
                         max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, **shape)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    if not os.path.exists(os.path.join(directory, "config.json")):
        model.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    return directory, sum(parameter.numel() for parameter in model.parameters())
