"""Choose the draft length and apply the deploy gate, from the measured rows alone (no engine, no Ray).

    recommended = recommend(rows)         # per concurrency: the fastest measured k and its speedup
    verdict = gate(rows, cfg.evaluate)    # {"passed", "recommended", "recommended_num_speculative_tokens", "misses",
                                          #  "too_slow", "baseline_moved", "thresholds"}

The drafter is judged as it would be deployed: at each concurrency level with the k recommended there, so one slow k
does not fail a drafter that is fast at another. Speed and acceptance thresholds apply to the recommended k of each
concurrency; greedy identity applies to every measured (k, concurrency), since a difference attributed to the drafter
(identity.py) is a correctness problem at any k.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from eagle3_ray.core.config import EvaluateConfig, versioned


def recommend(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency (ascending), the measured k with the highest speedup (a tie goes to the smaller k, which drafts
    less): `{"concurrency", "num_speculative_tokens", "speedup", "mean_acceptance_length"}`."""
    best: dict[int, dict[str, Any]] = {}
    for r in (r for r in rows if r["num_speculative_tokens"]):
        c, k = r["concurrency"], r["num_speculative_tokens"]
        held = best.get(c)
        if held is None or (r["speedup"], -k) > (held["speedup"], -held["num_speculative_tokens"]):
            best[c] = {
                "concurrency": c,
                "num_speculative_tokens": k,
                "speedup": r["speedup"],
                "mean_acceptance_length": r["mean_acceptance_length"],
            }
    return [best[c] for c in sorted(best)]


def one_k(rows: list[dict[str, Any]]) -> int | None:
    """One k for a server that cannot change k with its load: the measured k whose lowest speedup over the
    concurrency levels is highest (a tie goes to the smaller k)."""
    ks = sorted({r["num_speculative_tokens"] for r in rows if r["num_speculative_tokens"]})
    worst = {k: min(r["speedup"] for r in rows if r["num_speculative_tokens"] == k) for k in ks}
    return max(ks, key=lambda k: (worst[k], -k)) if ks else None


def min_speedup(section: EvaluateConfig, concurrency: int) -> float | None:
    """The speedup threshold at `concurrency` (None: not gated on speed there)."""
    threshold = section.min_speedup
    return threshold.get(concurrency) if isinstance(threshold, dict) else threshold


def gate(rows: list[dict[str, Any]], section: EvaluateConfig) -> dict[str, Any]:
    """The verdict on the measured rows under `section`'s thresholds: passed when, at every concurrency, the
    recommended k meets `min_speedup` and `min_acceptance_length`, (with `require_identical_outputs`) no measured
    row has an output difference attributed to the drafter, and plain decoding's two passes agree within
    `max_baseline_drift`. `misses` names each failed threshold; `too_slow` lists the concurrencies that missed
    `min_speedup`, `baseline_moved` those where plain decoding's rate moved past `max_baseline_drift` (the speedups
    there cannot be trusted, either way)."""
    by_key = {(r["num_speculative_tokens"], r["concurrency"]): r for r in rows}
    recommended = recommend(rows)
    misses, slow = [], []
    for rec in recommended:
        k, c = rec["num_speculative_tokens"], rec["concurrency"]
        need = min_speedup(section, c)
        if need is not None and rec["speedup"] < need:
            slow.append(c)
            misses.append(f"k={k} c={c}: speedup {rec['speedup']:.3f} < min_speedup {need} (the fastest k at c={c})")
        need = section.min_acceptance_length
        if need is not None and rec["mean_acceptance_length"] < need:
            misses.append(
                f"k={k} c={c}: mean acceptance length {rec['mean_acceptance_length']:.3f} "
                f"< min_acceptance_length {need}"
            )
    if section.require_identical_outputs:
        misses += [_identity_miss(by_key[key]) for key in sorted(by_key) if _num_drafter(by_key[key])]
    drift, moved = section.max_baseline_drift, []
    for r in (r for r in rows if not r["num_speculative_tokens"] and "baseline_drift" in r):
        if drift is not None and abs(r["baseline_drift"]) > drift:  # rows of a run with evaluate.baseline_again
            moved.append(r["concurrency"])
            misses.append(
                f"c={r['concurrency']}: plain decoding ran at {r['tokens_per_s']:.1f} tokens/s before the drafter "
                f"engines and {r['tokens_per_s_again']:.1f} after ({r['baseline_drift']:+.1%}, max_baseline_drift "
                f"{drift}): the machine's speed changed during the measurement, so its speedups cannot be trusted; "
                "evaluate again with nothing else running on the machine"
            )
    thresholds = {name: value for name, value in dataclasses.asdict(section).items() if name not in versioned(section)}
    return {
        "passed": not misses,
        "recommended": recommended,
        "recommended_num_speculative_tokens": one_k(rows),
        "misses": misses,
        "too_slow": slow,
        "baseline_moved": moved,
        "thresholds": thresholds,
    }


def _num_drafter(row: dict[str, Any]) -> int:
    return row["identity"]["drafter"] if row["num_speculative_tokens"] else 0


def _identity_miss(row: dict[str, Any]) -> str:
    found = [m for m in row["mismatches"] if m["class"] == "drafter"]
    where = ", ".join(f"{m['prompt']} at token {m['first_diff_token']}" for m in found[:5])
    return (
        f"k={row['num_speculative_tokens']} c={row['concurrency']}: {len(found)} greedy output(s) differ from plain "
        f"decoding at the same concurrency with no numeric explanation (plain decoding is stable across batch shapes "
        f"there, its top-2 margin is not a near tie, and rechecked in float32 the outputs still differ, where "
        f"evaluate.fp32_recheck ran): prompts {where}; this points at speculation (drafter vocab mapping, verification)"
    )
