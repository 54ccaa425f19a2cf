"""Randomness is derived, not carried: every draw seeds from (seed, stage, step, rank, purpose).

A run killed anywhere and resumed therefore replays the same draws without saving RNG state, and
the data order depends on (seed, epoch) alone, so it is the same at any world size.
"""

from __future__ import annotations

import functools
import hashlib

import torch


def derive_seed(*parts: object) -> int:
    """A 63-bit seed that depends on every part, in order."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def generator(*parts: object) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(*parts))


def epoch_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    """The shuffled sample order of one epoch."""
    return _epoch_permutation(num_samples, seed, epoch).tolist()


@functools.lru_cache(maxsize=2)
def _epoch_permutation(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """An epoch's order as one tensor, drawn once per epoch (not per step: a dataset of millions of rows)."""
    return torch.randperm(num_samples, generator=generator(seed, "data-order", epoch))


def step_sample_indices(step: int, batch_size: int, num_samples: int, seed: int) -> list[int]:
    """Dataset indices of the global batch of optimizer step `step` (0-based); the tail of an epoch
    that does not fill a batch is dropped."""
    steps_per_epoch = num_samples // batch_size
    epoch, step_in_epoch = divmod(step, steps_per_epoch)
    start = step_in_epoch * batch_size
    return _epoch_permutation(num_samples, seed, epoch)[start : start + batch_size].tolist()
