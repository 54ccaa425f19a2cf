"""What a preparation asks of a fast tokenizer, without transformers (`TokenizerSnapshot`): the backend as
transformers left it after loading the folder (its `tokenizers.Tokenizer`, saved as JSON), the special tokens and
their ids, the truncation side. Loading a tokenizer through transformers costs the driver ~4 CPU-s (torch and
transformers imported, then the folder read); a snapshot loads in milliseconds with the `tokenizers` library alone,
and encodes as transformers' `__call__` does (the same backend call, truncation and special-token settings).
A snapshot is taken only where its encodings of a few probe texts equal the tokenizer's (`take_snapshot`); what it
does not hold (`apply_chat_template`, `decode`, ...) is the loaded tokenizer's (`tokenizer_ref.LazyTokenizer`).
docs/design-notes.md ("Prepared data") has the design.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

FORMAT = 1
TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")
TOKEN_ATTRIBUTES = frozenset({*TOKEN_NAMES, *(f"{name}_id" for name in TOKEN_NAMES)})  # held in state["tokens"]
ATTRIBUTES = frozenset({*TOKEN_ATTRIBUTES, "special_tokens_map", "backend_tokenizer", "encode",
                        "truncation_side"})  # what a snapshot answers itself
CALL_ARGUMENTS = frozenset({"add_special_tokens", "truncation", "max_length"})


@dataclass(frozen=True)
class Encoded:
    input_ids: Any  # a list of ids, or one list per text


@dataclass(frozen=True)
class TokenizerSnapshot:
    """A fast tokenizer's backend and special tokens, as its JSON form (`state`) holds them."""

    state: dict

    @functools.cached_property
    def backend_tokenizer(self):
        return self._new_backend()

    def _new_backend(self):
        """The backend as the state holds it, with no truncation or padding and the special-token splitting
        transformers sets on each call."""
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(self.state["backend"])
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = self.state["split_special_tokens"]
        return backend

    @functools.cached_property
    def _truncating(self) -> dict[int, Any]:
        return {}  # max_length -> a copy of the backend truncating there

    def __getattr__(self, name: str) -> Any:
        if name in TOKEN_ATTRIBUTES:
            return self.state["tokens"].get(name)
        if name in ("special_tokens_map", "truncation_side"):
            return self.state[name]
        raise AttributeError(name)

    def __getstate__(self) -> dict:
        return {"state": self.state}  # not the backends built from it

    def accepts(self, kwargs: dict) -> bool:
        """Whether `__call__` with these keyword arguments is the snapshot's (else the loaded tokenizer's)."""
        return set(kwargs) <= CALL_ARGUMENTS and not (kwargs.get("truncation") and kwargs.get("max_length") is None)

    def __call__(self, text: str | list[str], add_special_tokens: bool = True, truncation: bool = False,
                 max_length: int | None = None) -> Encoded:
        """transformers' `tokenizer(text, ...)` for these arguments: `.input_ids` of one text or of each."""
        texts = [text] if isinstance(text, str) else list(text)
        backend = self._backend(max_length if truncation else None)
        ids = [encoding.ids for encoding in backend.encode_batch(texts, add_special_tokens=add_special_tokens)]
        return Encoded(ids[0] if isinstance(text, str) else ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self(text, add_special_tokens=add_special_tokens).input_ids

    def _backend(self, max_length: int | None):
        if max_length is None:
            return self.backend_tokenizer
        if max_length not in self._truncating:  # as transformers sets it: longest first, no stride, its side
            backend = self._new_backend()
            backend.enable_truncation(max_length=max_length, stride=0, strategy="longest_first",
                                      direction=self.state["truncation_side"])
            self._truncating[max_length] = backend
        return self._truncating[max_length]


PROBES = ("a", "Hello world", "  two  spaces\nand a newline\n", "ünïcödé ✓ 数字 123", "a" * 300)


def take_snapshot(tokenizer) -> dict | None:
    """The JSON form of a snapshot of `tokenizer` (as `load_tokenizer` gives it), or None where it has no fast
    backend or the snapshot's encodings of the probe texts (special tokens written in them too, with and without
    added special tokens, truncated) differ from its own."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    tokens = {name: getattr(tokenizer, name, None) for name in TOKEN_NAMES}
    tokens.update({f"{name}_id": getattr(tokenizer, f"{name}_id", None) for name in TOKEN_NAMES})
    state = {"format": FORMAT, "backend": backend.to_str(), "tokens": tokens,
             "special_tokens_map": {key: list(value) if isinstance(value, (list, tuple)) else str(value)
                                    for key, value in tokenizer.special_tokens_map.items()},
             "truncation_side": tokenizer.truncation_side,
             "split_special_tokens": bool(getattr(tokenizer, "split_special_tokens", False))}
    snapshot = TokenizerSnapshot(state)
    probes = [*PROBES, *(f"{token} x {token}" for token in tokens.values() if isinstance(token, str))]
    for kwargs in ({}, {"add_special_tokens": False}, {"add_special_tokens": False, "truncation": True,
                                                         "max_length": 8}, {"truncation": True, "max_length": 5}):
        for probe in (probes, probes[1]):
            if snapshot(probe, **kwargs).input_ids != tokenizer(probe, **kwargs).input_ids:
                return None
    return state


def snapshot_from(state: Any) -> TokenizerSnapshot | None:
    """The snapshot of a record's JSON form, or None where the record holds none of this format."""
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        return None
    return TokenizerSnapshot(state)
