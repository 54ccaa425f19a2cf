"""Many texts tokenized as one call: a fast tokenizer's own `encode_batch` costs a fraction of one transformers call
per text (most of a short text's cost is transformers' Python wrapping). Each stage's batch job renders its texts
per record, with today's checks and errors, then tokenizes them here; the tokens equal `samples.token_ids` (and
`sequence_ids`) of each text. docs/design-notes.md ("Prepared data") has the design.
"""

from __future__ import annotations


class BatchEncoder:
    """`samples.token_ids` of many texts as one call: a fast tokenizer's own `encode_batch` (what transformers
    calls, less its per-text Python wrapping and the character offsets) on a copy truncating at `max_len` as
    transformers sets it (longest first, stride 0, no padding), the tokenizer's own left as it is; a slow tokenizer
    through transformers. `max_len` None truncates nothing (PPO's prompts are cut from the left afterwards)."""

    def __init__(self, tokenizer, max_len: int | None):
        self.tokenizer, self.max_len, self.backend = tokenizer, max_len, None
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:
            from tokenizers import Tokenizer

            self.backend = Tokenizer.from_str(backend.to_str())
            self.backend.no_padding()
            if max_len is None:
                self.backend.no_truncation()
            else:
                self.backend.enable_truncation(max_length=max_len, stride=0, strategy="longest_first")

    def __call__(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        if self.backend is None:
            limits = {} if self.max_len is None else {"truncation": True, "max_length": self.max_len}
            return self.tokenizer(texts, add_special_tokens=False, **limits).input_ids
        # encode_batch_fast (tokenizers >= 0.20): the same ids, without the character offsets nothing here reads
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        return [encoding.ids for encoding in encode(texts, add_special_tokens=False)]

    def sequences(self, texts: list[str]) -> list[list[int]]:
        """`samples.sequence_ids` of each text: newlines stripped, " " + EOS unless present, truncated, the last
        token EOS."""
        eos, eos_id = self.tokenizer.eos_token, self.tokenizer.eos_token_id  # each a transformers __getattr__
        ids = self([sequence_text(eos, text) for text in texts])
        for sequence in ids:
            sequence[-1] = eos_id
        return ids


def sequence_text(eos: str, text: str) -> str:
    """`samples.sequence_ids`' text: newlines stripped, " " + EOS unless present."""
    text = text.rstrip("\n")
    return text if text.endswith(eos) else text + " " + eos

