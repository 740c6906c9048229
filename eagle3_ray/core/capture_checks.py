"""Capture checks: per-layer sanity numbers of captured hidden states (zero rows, NaN/inf, row norms), the check
that stops a stage on a broken capture, and their totals over a run.

    stats = capture_stats(hidden_states)                         # hidden_states: [T, L, H]
    problem = capture_problem(stats, T, layer_ids, max_zero_row_share=0.05, max_nonfinite_values=0)
    totals = aggregate_stats(per_sample_stats, num_tokens, layer_ids)
"""

from __future__ import annotations

import math

import torch

# capture_norms' rows at a time on the CPU, in values: under ATen's grain size (32768), so each chunk's reduction runs
# on the calling thread without an OpenMP team. vLLM's connector runs it in threads of vLLM's CPU worker, whose own
# OpenMP threads hold the cores for the forward pass: teams started from the connector's threads (larger chunks) would
# contend with them and slow the stage's decode on a few cores.
NORM_CHUNK_VALUES = (1 << 15) - 1


def capture_norms(hidden_states: torch.Tensor, per_row: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """What capture_stats needs of a captured sample, hidden_states [T, L, H], in one pass: the fp32 L2 norm of
    every token row [T, L] and the NaN/inf values per layer [L] (int64; [T, L] per token row with `per_row`). The row
    norm is 0 exactly for a zero row and non-finite exactly for a row holding NaN/inf (hidden states are far below
    fp32's overflow of a squared bf16), so on the CPU the values are counted only in the rare rows that are, and the
    norms go through the sample a few token rows at a time (NORM_CHUNK_VALUES: the same values as one call, each
    chunk's fp32 copy staying in cache, no OpenMP team). On a GPU (vLLM's connector, before its copy to the host)
    both are whole-tensor kernels, with no sync."""
    if hidden_states.is_cuda:
        norms = torch.linalg.vector_norm(hidden_states, dim=-1, dtype=torch.float32)
        nonfinite = (~torch.isfinite(hidden_states)).sum(dim=2)  # shape: [T, L]
        return norms, nonfinite if per_row else nonfinite.sum(dim=0)
    norms = torch.empty(hidden_states.shape[:2], dtype=torch.float32)  # shape: [T, L]
    rows = max(1, NORM_CHUNK_VALUES // max(1, math.prod(hidden_states.shape[1:])))
    for start in range(0, hidden_states.shape[0], rows):
        torch.linalg.vector_norm(
            hidden_states[start : start + rows], dim=-1, dtype=torch.float32, out=norms[start : start + rows]
        )
    nonfinite = torch.zeros(norms.shape, dtype=torch.int64)
    bad = ~torch.isfinite(norms).all(dim=1)  # shape: [T]
    if bool(bad.any()):
        nonfinite[bad] = (~torch.isfinite(hidden_states[bad])).sum(dim=2)
    return norms, nonfinite if per_row else nonfinite.sum(dim=0)


def stats_from_norms(norms: torch.Tensor, nonfinite: torch.Tensor) -> dict[str, list]:
    """Per-layer sanity numbers of one captured sample from its capture_norms: `zero_rows` [L] tokens whose whole row
    is 0, `nonfinite` [L] NaN/inf values, and over each layer's token rows `norm_sum`, `norm_min`, `norm_max` [L] of
    the L2 norm (non-finite rows left out)."""
    rows_finite = torch.isfinite(norms)  # shape: [T, L]
    return {
        "zero_rows": (norms == 0).sum(dim=0).tolist(),
        "nonfinite": nonfinite.tolist(),
        "norm_sum": torch.where(rows_finite, norms, 0.0).double().sum(dim=0).tolist(),
        "norm_min": torch.where(rows_finite, norms, torch.inf).amin(dim=0).tolist(),
        "norm_max": torch.where(rows_finite, norms, -torch.inf).amax(dim=0).tolist(),
    }


def capture_stats(hidden_states: torch.Tensor) -> dict[str, list]:
    """stats_from_norms of a sample's hidden states [T, L, H]."""
    return stats_from_norms(*capture_norms(hidden_states))


def bad_row_counts(hs: torch.Tensor) -> dict[str, list[int]]:
    """`zero_rows` and `nonfinite` per layer of stored hidden states [T, L, H], the two numbers
    capture_problem reads from capture_stats, from two reductions over the stored dtype (cheaper than
    capture_stats's fp32 norms). fp8 bits: |q| == 0 is 0x00, NaN is 0x7f (e4m3fn has no inf; the power-of-two
    exponents neither zero nor overflow a value), so a row's maximum of the low 7 bits says both."""
    if hs.dtype == torch.float8_e4m3fn:
        bits = hs.view(torch.uint8)
        row_max = torch.empty(hs.shape[:2], dtype=torch.uint8)  # shape: [T, L]
        chunk = torch.empty((min(256, hs.shape[0]), *hs.shape[1:]), dtype=torch.uint8)  # small, reused: no faults
        for start in range(0, hs.shape[0], chunk.shape[0]):
            part = chunk[: min(chunk.shape[0], hs.shape[0] - start)]
            torch.bitwise_and(bits[start : start + part.shape[0]], 0x7F, out=part)
            torch.amax(part, dim=-1, out=row_max[start : start + part.shape[0]])
        zero, bad = row_max == 0, row_max == 0x7F
    else:  # amax/amin propagate NaN; +inf shows in the max, -inf in the min
        hi, lo = hs.amax(dim=-1), hs.amin(dim=-1)  # shape: [T, L]
        zero, bad = (hi == 0) & (lo == 0), ~(torch.isfinite(hi) & torch.isfinite(lo))
    nonfinite = [0] * hs.shape[1]
    if bool(bad.any()):
        nonfinite = (~torch.isfinite(hs[bad.any(dim=1)].float())).sum(dim=(0, 2)).tolist()
    return {"zero_rows": zero.sum(dim=0).tolist(), "nonfinite": nonfinite}


def capture_problem(
    stats: dict[str, list],
    num_tokens: int,
    layer_ids: list[int],
    *,
    max_zero_row_share: float,
    max_nonfinite_values: int,
) -> str | None:
    """What is wrong with a sample's capture (from `capture_stats`), naming the layer id, or None. vLLM has handed
    out all-zero and NaN hidden states for some architectures (wrong cache-group slot mapping); such a capture
    trains a drafter that never matches the verifier, so it must stop the stage, not reach the shards."""
    for j, layer in enumerate(layer_ids):
        if stats["nonfinite"][j] > max_nonfinite_values:
            return f"layer {layer}: {stats['nonfinite'][j]} non-finite values (allowed {max_nonfinite_values})"
        share = stats["zero_rows"][j] / max(num_tokens, 1)
        if share > max_zero_row_share:
            return (
                f"layer {layer}: {stats['zero_rows'][j]} of {num_tokens} token rows are all zero "
                f"({share:.2f} > generate.max_zero_row_share {max_zero_row_share})"
            )
    return None


def aggregate_stats(per_sample: list[dict[str, list]], num_tokens: list[int], layer_ids: list[int]) -> dict:
    """Per-layer totals over samples (`capture_stats` dicts and their token counts): zero-row share, non-finite
    values, norm mean/min/max, keyed by layer id."""
    total = max(sum(num_tokens), 1)
    out = {}
    for j, layer in enumerate(layer_ids):
        out[str(layer)] = {
            "zero_row_share": sum(s["zero_rows"][j] for s in per_sample) / total,
            "nonfinite": int(sum(s["nonfinite"][j] for s in per_sample)),
            "norm_mean": sum(s["norm_sum"][j] for s in per_sample) / total,
            "norm_min": min((s["norm_min"][j] for s in per_sample), default=None),
            "norm_max": max((s["norm_max"][j] for s in per_sample), default=None),
        }
    return out
