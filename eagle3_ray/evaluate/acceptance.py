"""Acceptance from vLLM's spec-decode counter increments, the ways users compare drafters.

    acceptance(spec)      # {"acceptance_rate", "mean_acceptance_length"}: pooled over every verify step
    per_position(spec)    # the chance the i-th draft token is kept
    requests = request_records(run["per_request"], labels)   # one record per request measured alone (c=1)
    per_request_mean(requests)                                # SpecForge's mean of per-request means
    by_context_length(requests)                               # the same numbers per bucket of prompt + output tokens

Two ways of averaging the same counters give different numbers, and published tables use both:
    pooled (vLLM's)            = 1 + sum(accepted) / sum(verify steps), over every request together; long
                                 requests weigh by their verify steps
    per-request mean (SpecForge's) = mean over requests of 1 + accepted_r / verify steps_r; each request weighs the
                                 same. Requests with no verify step (one output token) have no acceptance and are
                                 left out.
Per-request numbers need the counters read around one request: the evaluate stage does that at concurrency 1,
where each wave is one request (engine.EngineBench.measure), and nowhere else.
"""

from __future__ import annotations

from typing import Any

SPEC_TOTALS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")  # vLLM's spec-decode counters, as totals
# Buckets of context length (prompt + generated tokens) for acceptance against context: (lowest, highest + 1, name).
CONTEXT_BUCKETS = (
    (0, 256, "<256"),
    (256, 512, "256-512"),
    (512, 1024, "512-1k"),
    (1024, 2048, "1k-2k"),
    (2048, None, ">=2k"),
)


def acceptance(spec: dict[str, Any]) -> dict[str, float]:
    """Acceptance rate (accepted / proposed draft tokens) and mean acceptance length (1 + accepted / verify steps),
    pooled over every verify step the counter increments `spec` hold."""
    return {
        "acceptance_rate": spec["num_accepted_tokens"] / max(spec["num_draft_tokens"], 1),
        "mean_acceptance_length": 1.0 + spec["num_accepted_tokens"] / max(spec["num_drafts"], 1),
    }


def per_position(spec: dict[str, Any]) -> list[float]:
    """The chance that the draft token at each position is accepted: accepted there / verify steps."""
    return [a / max(spec["num_drafts"], 1) for a in spec["accepted_per_pos"]]


def add_per_position(a: list[float], b: list[float]) -> list[float]:
    """Element-wise sum of two per-position counts of any lengths (the shorter padded with zeros)."""
    width = max(len(a), len(b))
    return [x + y for x, y in zip(a + [0] * (width - len(a)), b + [0] * (width - len(b)), strict=True)]


def request_records(per_request: list[dict[str, Any] | None], labels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per request measured on its own (`per_request`: EngineBench.measure's, None where it was not):
    its label (prompt, turn, category), prompt and output tokens, `context_tokens` (their sum), its counters and its
    own mean acceptance length (None without a verify step)."""
    records = []
    for label, r in zip(labels, per_request, strict=True):
        if r is None:
            continue
        own = 1.0 + r["num_accepted_tokens"] / r["num_drafts"] if r["num_drafts"] else None
        records.append(
            {
                **label,
                "prompt_tokens": r["prompt_tokens"],
                "output_tokens": r["output_tokens"],
                "context_tokens": r["prompt_tokens"] + r["output_tokens"],
                **{name: r[name] for name in SPEC_TOTALS},
                "mean_acceptance_length": own,
            }
        )
    return records


def per_request_mean(requests: list[dict[str, Any]]) -> float | None:
    """The mean of the requests' own mean acceptance lengths (requests without a verify step left out); None when
    no request was measured on its own."""
    own = [r["mean_acceptance_length"] for r in requests if r["mean_acceptance_length"] is not None]
    return sum(own) / len(own) if own else None


def summarize(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """Pooled and per-request acceptance of a set of request records."""
    totals = {name: sum(r[name] for r in requests) for name in SPEC_TOTALS}
    return {
        "num_requests": len(requests),
        **acceptance(totals),
        "mean_acceptance_length_per_request": per_request_mean(requests),
    }


def context_bucket(num_tokens: int) -> str:
    """The CONTEXT_BUCKETS name holding `num_tokens`."""
    for low, high, name in CONTEXT_BUCKETS:
        if num_tokens >= low and (high is None or num_tokens < high):
            return name
    raise AssertionError(f"context buckets start at 0, got {num_tokens}")


def by_context_length(requests: list[dict[str, Any]]) -> dict[str, dict[str, Any]] | None:
    """`summarize` per context-length bucket (prompt + generated tokens), buckets in CONTEXT_BUCKETS order, empty
    ones left out; None without per-request records."""
    if not requests:
        return None
    groups: dict[str, list[dict[str, Any]]] = {name: [] for _, _, name in CONTEXT_BUCKETS}
    for r in requests:
        groups[context_bucket(r["context_tokens"])].append(r)
    return {name: summarize(rs) for name, rs in groups.items() if rs}


def context_warning(max_model_len: int, longest: dict[str, Any]) -> str | None:
    """The warning when serving accepts longer contexts than the drafter ever trained on (`longest`:
    `{"num_tokens", "source"}`, stage.longest_training_sequence), else None: the drafter's acceptance past that
    length is untested by training."""
    if max_model_len <= longest["num_tokens"]:
        return None
    return (
        f"verifier.max_model_len={max_model_len} exceeds the longest training sequence ({longest['num_tokens']} "
        f"tokens, {longest['source']}): contexts past it were never trained on, so acceptance there may drop; the "
        "report's acceptance by context length shows what was measured"
    )
