"""Draft vocabulary: the `draft_vocab_size` most frequent response tokens, mapped with speculators' convention
(d2t[i] is an int64 offset, target id = i + d2t[i]; t2d is a bool mask over the verifier vocabulary).

Frequencies count loss-masked (assistant) tokens of the training split only. Files (numpy, no pickle):
    vocab/d2t.npy [draft_vocab_size] int64, vocab/t2d.npy [verifier_vocab_size] bool,
    vocab/token_freq.npy [verifier_vocab_size] int64
"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Iterable

import numpy as np
import torch
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

from eagle3_ray.core import storage


def count_tokens(samples: Iterable[tuple[list[int], list[int]]]) -> Counter[int]:
    """Token counts over (input_ids, loss_mask) pairs, counting only tokens whose mask is 1."""
    counts: Counter[int] = Counter()
    for input_ids, loss_mask in samples:
        counts.update(t for t, m in zip(input_ids, loss_mask, strict=True) if m)
    return counts


def build_vocab(
    counts: Counter[int], draft_vocab_size: int, verifier_vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [draft_vocab_size] int64, t2d [verifier_vocab_size] bool) from speculators' builder."""
    if draft_vocab_size > verifier_vocab_size:
        raise ValueError(
            f"train.draft_vocab_size={draft_vocab_size} exceeds the verifier vocabulary ({verifier_vocab_size} tokens)"
        )
    return build_vocab_mappings_from_distribution(dict(counts), draft_vocab_size, verifier_vocab_size)


def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def save_vocab(vocab_dir: str, d2t: torch.Tensor, t2d: torch.Tensor, counts: Counter[int]) -> None:
    freq = np.zeros(t2d.shape[0], dtype=np.int64)
    for token, n in counts.items():
        freq[token] = n
    storage.write_bytes_atomic(storage.join(vocab_dir, "token_freq.npy"), _npy_bytes(freq))
    storage.write_bytes_atomic(storage.join(vocab_dir, "t2d.npy"), _npy_bytes(t2d.numpy()))
    # d2t last: its presence marks a complete vocab directory
    storage.write_bytes_atomic(storage.join(vocab_dir, "d2t.npy"), _npy_bytes(d2t.numpy()))


def load_vocab(vocab_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) as saved by `save_vocab`."""
    d2t = np.load(io.BytesIO(storage.read_bytes(storage.join(vocab_dir, "d2t.npy"))), allow_pickle=False)
    t2d = np.load(io.BytesIO(storage.read_bytes(storage.join(vocab_dir, "t2d.npy"))), allow_pickle=False)
    return torch.from_numpy(d2t), torch.from_numpy(t2d)


def vocab_exists(vocab_dir: str) -> bool:
    return storage.exists(storage.join(vocab_dir, "d2t.npy"))
