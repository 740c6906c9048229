"""Evaluation numbers -> result rows, a Markdown report, a plain-text summary table and two PNG plots.

A row is one (num_speculative_tokens, concurrency) measurement; `num_speculative_tokens` 0 is plain decoding.
    acceptance_rate         = accepted draft tokens / proposed draft tokens
    mean_acceptance_length  = 1 + accepted / drafts, pooled over every verify step of every request (vLLM's way;
                              tokens emitted per verifier step; 1.0 = no gain)
    mean_acceptance_length_per_request = the mean of each request's own 1 + accepted / drafts (SpecForge's way);
                              concurrency 1 only, where each request is measured on its own, else None
    acceptance_per_position = accepted at position i / drafts   (the chance the i-th draft token survives)
    speedup                 = output tokens/s with the drafter / without it, same prompts and concurrency
    identity                = prompts per greedy-identity class against plain decoding at the same concurrency
                              (identity.py: identical, batch_numerics, numerics_tie, numerics_fp32, drafter)
    by_category, by_turn    = the same rates per prompt category / conversation turn, when there are several
    requests, by_context_length = (concurrency 1) each request's own numbers, and acceptance per bucket of prompt +
                              generated tokens (acceptance.CONTEXT_BUCKETS)
Predicted acceptance (`predicted_vs_measured`) is training's replay of vLLM's draft/verify chain over the validation
split (train/acceptance.py), shown next to the measured one on the evaluation prompts and on prompts of that validation
split (`validation`); a gap past prediction.PREDICTION_TOLERANCE on the validation prompts is flagged as a contract
problem, one on the evaluation prompts alone is reported as distribution shift. The gate's `recommended` (gate.py) names
the fastest k at each concurrency.
"""

from __future__ import annotations

import io
from typing import Any

from eagle3_ray.core import storage
from eagle3_ray.evaluate import identity
from eagle3_ray.evaluate.acceptance import (
    SPEC_TOTALS,
    acceptance,
    add_per_position,
    by_context_length,
    per_position,
    per_request_mean,
    request_records,
)


def _tokens_per_s(run: dict[str, Any]) -> float:
    return sum(len(o) for o in run["outputs"]) / max(run["wall_s"], 1e-9)


def baseline_row(concurrency: int, run: dict[str, Any]) -> dict[str, Any]:
    """Plain decoding at one concurrency. `num_rerun_mismatches`: prompts whose timed pass and untimed reference pass
    (the same waves again, with logprobs) differ; nonzero means plain decoding is not even repeatable here."""
    row = {
        "num_speculative_tokens": 0,
        "concurrency": concurrency,
        "wall_s": run["wall_s"],
        "output_tokens": sum(len(o) for o in run["outputs"]),
        "tokens_per_s": _tokens_per_s(run),
    }
    if "reference" in run:
        pairs = zip(run["outputs"], run["reference"]["outputs"], strict=True)
        row["num_rerun_mismatches"] = sum(a != b for a, b in pairs)
    return row


def add_baseline_again(row: dict[str, Any], run: dict[str, Any]) -> None:
    """Plain decoding's second timed pass, after the drafter engines, into its baseline row: `tokens_per_s_again` and
    `baseline_drift` (second rate / first - 1)."""
    row["tokens_per_s_again"] = _tokens_per_s(run)
    row["baseline_drift"] = row["tokens_per_s_again"] / row["tokens_per_s"] - 1.0


def spec_row(
    k: int,
    concurrency: int,
    run: dict[str, Any],
    base: dict[str, Any],
    base_lowest: dict[str, Any],
    identity_items: list[dict[str, Any]],
    labels: list[dict[str, Any]],
) -> dict[str, Any]:
    """`base`: plain decoding at the same concurrency; `base_lowest`: plain decoding at the lowest concurrency, whose
    difference from `base` shows how much batching alone moves greedy outputs. `identity_items`: identity.compare's
    class per output; `labels`: `{"prompt", "turn", "category"}` per output."""
    s = run["spec"]
    requests = request_records(run["per_request"], labels)
    mismatches = [
        {**label, **item} for label, item in zip(labels, identity_items, strict=True) if item["class"] != "identical"
    ]
    lowest, same_c = base_lowest["reference"]["outputs"], base["reference"]["outputs"]
    return {
        **baseline_row(concurrency, run),
        "num_speculative_tokens": k,
        "baseline_tokens_per_s": _tokens_per_s(base),
        "speedup": _tokens_per_s(run) / _tokens_per_s(base),
        "num_drafts": s["num_drafts"],
        "num_draft_tokens": s["num_draft_tokens"],
        "num_accepted_tokens": s["num_accepted_tokens"],
        **acceptance(s),
        "mean_acceptance_length_per_request": per_request_mean(requests),
        "acceptance_per_position": per_position(s),
        "num_outputs": len(run["outputs"]),
        "num_mismatched_outputs": len(mismatches),
        "identity": identity.counts(identity_items),
        "mismatches": mismatches,
        "num_baseline_batch_mismatches": sum(a != b for a, b in zip(lowest, same_c, strict=True)),
        "by_category": breakdown(run, base, "category", requests),
        "by_turn": breakdown(run, base, "turn", requests),
        "requests": requests,
        "by_context_length": by_context_length(requests),
    }


def breakdown(
    run: dict[str, Any], base: dict[str, Any], key: str, requests: list[dict[str, Any]] | None = None
) -> dict[str, dict[str, Any]] | None:
    """Speedup, acceptance and per-position acceptance per value of `key` ("category" or "turn") from the run's
    groups (each group is timed and its spec-decode counters diffed on its own), with the per-request mean from
    `requests` (acceptance.request_records; None where there are none); None when there is only one value."""
    if len({g[key] for g in run["groups"]}) < 2:
        return None
    names = ("wall_s", "output_tokens", "base_wall_s", "base_output_tokens", *SPEC_TOTALS)
    sums: dict[str, dict[str, Any]] = {}
    for g, b in zip(run["groups"], base["groups"], strict=True):
        assert (g["turn"], g["category"]) == (b["turn"], b["category"]), "both engines decode the same groups"
        total = sums.setdefault(str(g[key]), {**dict.fromkeys(names, 0), "accepted_per_pos": []})
        for name in SPEC_TOTALS:
            total[name] += g["spec"][name]
        total["accepted_per_pos"] = add_per_position(total["accepted_per_pos"], g["spec"]["accepted_per_pos"])
        total["wall_s"] += g["wall_s"]
        total["output_tokens"] += g["output_tokens"]
        total["base_wall_s"] += b["wall_s"]
        total["base_output_tokens"] += b["output_tokens"]
    out = {}
    for name, t in sums.items():
        tokens_per_s = t["output_tokens"] / max(t["wall_s"], 1e-9)
        base_tokens_per_s = t["base_output_tokens"] / max(t["base_wall_s"], 1e-9)
        out[name] = {
            "tokens_per_s": tokens_per_s,
            "baseline_tokens_per_s": base_tokens_per_s,
            "speedup": tokens_per_s / max(base_tokens_per_s, 1e-9),
            **acceptance(t),
            "mean_acceptance_length_per_request": per_request_mean([r for r in requests or [] if str(r[key]) == name]),
            "acceptance_per_position": per_position(t),
        }
    return out


def _classes(row: dict[str, Any]) -> str:
    counts = row["identity"]
    return "/".join(str(counts.get(c, 0)) for c in identity.CLASSES)  # .get: results written before a class existed


def recommended_line(gate: dict[str, Any]) -> str:
    """`fastest k: c=1 k=3 (1.42x), c=4 k=2 (1.10x); one k for every load: 3`."""
    per_c = ", ".join(
        f"c={r['concurrency']} k={r['num_speculative_tokens']} ({r['speedup']:.2f}x)" for r in gate["recommended"]
    )
    return f"fastest k: {per_c}; one k for every load: {gate['recommended_num_speculative_tokens']}"


def summary_table(results: dict[str, Any]) -> str:
    """The table a job log ends with: one line per (draft length, concurrency), the recommended k per concurrency,
    the predictions, then `verdict_lines`: the same result in words, the gate's verdict and its misses last."""
    head = (
        f"{'k':>3} {'conc':>5} {'base tok/s':>11} {'spec tok/s':>11} {'speedup':>8} {'accept':>7} "
        f"{'mean len':>9} {'req mean':>9} {'same/batch/tie/fp32/drafter':>28}  per-position acceptance"
    )
    lines = [head, "-" * len(head)]
    for r in (r for r in results["rows"] if r["num_speculative_tokens"]):
        lines.append(
            f"{r['num_speculative_tokens']:>3} {r['concurrency']:>5} {r['baseline_tokens_per_s']:>11.1f} "
            f"{r['tokens_per_s']:>11.1f} {r['speedup']:>7.2f}x {r['acceptance_rate']:>7.3f} "
            f"{r['mean_acceptance_length']:>9.3f} {_fmt(r.get('mean_acceptance_length_per_request')):>9} "
            f"{_classes(r):>28}  " + " ".join(f"{a:.3f}" for a in r["acceptance_per_position"])
        )
    lines.append(
        "mean len: pooled over every verify step (vLLM's way); req mean: the mean of per-request means (SpecForge's "
        "way), at concurrency 1 only"
    )
    g = results["gate"]
    lines.append(recommended_line(g))
    lines += drift_lines(results["rows"])
    lines += prediction_lines(results)
    return "\n".join([*lines, "", *verdict_lines(results)])


def verdict_lines(results: dict[str, Any]) -> list[str]:
    """What the job ends with, in words: acceptance and speed at the recommended k, where the drafter and the report
    are, then the gate's verdict and each missed threshold, and last `evaluate.compare_with` where a recipe sets it."""
    g, rows = results["gate"], results["rows"]
    lines = []
    for k in sorted({rec["num_speculative_tokens"] for rec in g["recommended"]}):
        mean_length, per_pos = measured_acceptance(rows, k)
        per_request = [
            r["mean_acceptance_length_per_request"]
            for r in rows
            if r["num_speculative_tokens"] == k and r.get("mean_acceptance_length_per_request") is not None
        ]  # .get: results measured before per-request acceptance existed
        lines.append(
            f"acceptance at k={k}: {mean_length:.2f} tokens per verifier step (1.00 = no draft token kept, "
            f"{k + 1:.2f} = all {k}); kept per draft position: {', '.join(f'{a:.1%}' for a in per_pos)}"
            + (f"; mean of per-request means at c=1: {per_request[0]:.2f}" if per_request else "")
        )
    by_key = {(r["num_speculative_tokens"], r["concurrency"]): r for r in rows}
    for rec in g["recommended"]:
        r = by_key[rec["num_speculative_tokens"], rec["concurrency"]]
        lines.append(
            f"speedup at {_requests(rec['concurrency'])} (k={rec['num_speculative_tokens']}): {r['speedup']:.2f}x, "
            f"{r['tokens_per_s']:.1f} against {r['baseline_tokens_per_s']:.1f} output tokens/s without the drafter: "
            f"{_faster(r['speedup'])}"
        )
    lines.append(f"drafter: {results['drafter_dir']}")
    if "report_dir" in results:
        lines.append(f"report: {storage.join(results['report_dir'], 'report.md')}")
    if "serve" in results:  # evaluate.stage.write_serving: the vLLM command with the recommended k
        lines.append(f"serving command: {results['serve']}")
    drift_checked = any("baseline_drift" in r for r in rows)
    lines += gate_lines(g, drift_checked=drift_checked)
    compare_with = g["thresholds"].get("compare_with")  # .get: results gated before the field existed
    return [*lines, f"for comparison: {compare_with}"] if compare_with else lines


def _requests(concurrency: int) -> str:
    return "1 request at a time" if concurrency == 1 else f"{concurrency} concurrent requests"


def _faster(speedup: float) -> str:
    if f"{speedup:.2f}" == "1.00":
        return "as fast as without it"
    return f"decoding is {abs(speedup - 1):.0%} {'faster' if speedup > 1 else 'slower'} with it"


def gate_lines(g: dict[str, Any], *, drift_checked: bool = False) -> list[str]:
    """`deploy gate: PASS (what was checked)`, or `deploy gate: FAIL ...` and one `  miss:` line per failed
    threshold; a FAIL under `evaluate.report_only` says that the job succeeds anyway.
    `drift_checked`: plain decoding was measured twice (evaluate.baseline_again), so its steadiness was gated."""
    t = g["thresholds"]
    if not g["passed"]:
        head = "deploy gate: FAIL: do not deploy this drafter"
        if g.get("too_slow") and not t.get("compare_with"):  # .get: results gated before the key existed
            head += (
                "; speedup follows acceptance, which grows with training data: what recipes that train on more reach "
                "is in docs/benchmarks.md"
            )
        if g.get("baseline_moved"):
            head = (
                "deploy gate: FAIL: plain decoding's speed moved during the measurement, so the speedup above cannot "
                "be trusted; remove the report's directory and run --stages evaluate again with nothing else running"
            )
        if t.get("report_only"):
            head += " (evaluate.report_only: the verdict is reported and the job still succeeds)"
        return [head, *(f"  miss: {m}" for m in g["misses"])]
    checked = [_speed_check(t["min_speedup"])]
    if t.get("min_acceptance_length") is not None:
        checked.append(f"acceptance length >= {t['min_acceptance_length']}")
    if t.get("require_identical_outputs"):
        checked.append("no greedy output changed by the drafter")
    if drift_checked and t.get("max_baseline_drift") is not None:
        checked.append(f"plain decoding's speed steady within {t['max_baseline_drift']:.0%}")
    return [f"deploy gate: PASS ({'; '.join(checked)})"]


def _speed_check(min_speedup: float | dict | None) -> str:
    if min_speedup is None:
        return "speed not gated"
    if isinstance(min_speedup, dict):
        return ", ".join(f"speedup >= {v} at c={c}" for c, v in sorted(min_speedup.items()))
    return f"speedup >= {min_speedup} at every concurrency measured"


def drift_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line: plain decoding's rate before and after the drafter engines, per concurrency."""
    again = [r for r in rows if not r["num_speculative_tokens"] and "baseline_drift" in r]
    if not again:
        return []
    return [
        "plain decoding before / after the drafter engines: "
        + ", ".join(
            f"c={r['concurrency']} {r['tokens_per_s']:.1f} / {r['tokens_per_s_again']:.1f} tok/s "
            f"({r['baseline_drift']:+.1%})"
            for r in again
        )
    ]


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _signed(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.3f}"


def measured_acceptance(rows: list[dict[str, Any]], k: int) -> tuple[float, list[float]]:
    """vLLM's mean acceptance length and per-position acceptance for draft length k, over every concurrency."""
    krows = [r for r in rows if r["num_speculative_tokens"] == k]
    drafts = sum(r["num_drafts"] for r in krows) or 1
    per_position = [sum(r["acceptance_per_position"][j] * r["num_drafts"] for r in krows) / drafts for j in range(k)]
    return 1.0 + sum(r["num_accepted_tokens"] for r in krows) / drafts, per_position


def prediction_lines(results: dict[str, Any]) -> list[str]:
    """One line per draft length: mean acceptance length predicted by training's replay vs measured in vLLM."""
    lines = []
    for p in results.get("predicted_vs_measured", []):
        gap = "" if p["gap"] is None else f" (gap {p['gap']:+.3f})"
        own = p.get("validation")
        own_text = "" if own is None else f"; on validation prompts {own['measured_acceptance_length']:.3f}"
        lines.append(
            f"k={p['num_speculative_tokens']}: mean acceptance length predicted "
            f"{_fmt(p['predicted_acceptance_length'])}, measured {p['measured_acceptance_length']:.3f}{gap}{own_text}"
            + (f"\n  FLAGGED: {p['message']}" if p["flagged"] else "")
        )
    return lines


def _prediction_table(results: dict[str, Any]) -> list[str]:
    rows = results.get("predicted_vs_measured", [])
    if not rows:
        return []
    table = [
        "| k | predicted mean acceptance length | measured | gap | measured on validation prompts | gap there "
        "| predicted per position | measured per position |",
        "|" + "---|" * 8,
    ]
    none = {"measured_acceptance_length": None, "gap": None}
    table += [
        f"| {p['num_speculative_tokens']} | {_fmt(p['predicted_acceptance_length'])} | "
        f"{p['measured_acceptance_length']:.3f} | {_signed(p['gap'])} | "
        f"{_fmt((p.get('validation') or none)['measured_acceptance_length'])} | "
        f"{_signed((p.get('validation') or none)['gap'])} | "
        f"{', '.join(_fmt(a) for a in p['predicted_per_position'])} | "
        f"{', '.join(f'{a:.3f}' for a in p['measured_per_position'])} |"
        for p in rows
    ]
    notes = [f"- {p['message']}" for p in rows if p["message"]]
    return [
        "Predicted (training's replay of vLLM's chain over the validation split) vs measured:",
        "",
        *table,
        "",
        *notes,
        "",
    ]


def markdown(results: dict[str, Any]) -> str:
    g = results["gate"]
    rows = [r for r in results["rows"] if r["num_speculative_tokens"]]
    table = [
        "| k | concurrency | tokens/s without | tokens/s with | speedup | acceptance rate "
        "| mean acceptance length, pooled | mean acceptance length, per-request mean "
        "| per-position acceptance "
        "| greedy outputs identical / batch numerics / numerics tie / numerics fp32 / drafter |",
        "|" + "---|" * 10,
    ]
    table += [
        f"| {r['num_speculative_tokens']} | {r['concurrency']} | {r['baseline_tokens_per_s']:.1f} | "
        f"{r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['acceptance_rate']:.3f} | "
        f"{r['mean_acceptance_length']:.3f} | {_fmt(r.get('mean_acceptance_length_per_request'))} | "
        f"{', '.join(f'{a:.3f}' for a in r['acceptance_per_position'])} | {_classes(r).replace('/', ' / ')} |"
        for r in rows  # .get: results measured before per-request acceptance existed
    ]
    recommended = ["| concurrency | fastest k | speedup | mean acceptance length |", "|---|---|---|---|"] + [
        f"| {r['concurrency']} | {r['num_speculative_tokens']} | {r['speedup']:.2f}x | "
        f"{r['mean_acceptance_length']:.3f} |"
        for r in g["recommended"]
    ]
    misses = "".join(f"\n- {m}" for m in g["misses"]) or "\n- none"
    return "\n".join(
        [
            f"# Drafter evaluation {results['version']}",
            "",
            f"- drafter: `{results['drafter_dir']}`",
            f"- verifier: `{results['verifier_path']}`",
            f"- prompts: {len(results['prompt_ids'])} held out "
            f"(none in the {results['held_out']['num_train_conversations']} "
            f"training conversations), chat template applied, greedy, max_tokens={results['max_tokens']}, "
            f"turns={results['turns']}",
            f"- aux layers: captured {results['capture_aux_layer_ids']}, used by vLLM {results['vllm_aux_layer_ids']}",
            *_training_context_lines(results.get("training_context")),
            "",
            f"**Deploy gate: {'PASS' if g['passed'] else 'FAIL'}** at the fastest k of each concurrency "
            f"(thresholds {g['thresholds']}). One k for every load (best lowest speedup): "
            f"{g['recommended_num_speculative_tokens']}.",
            "",
            *recommended,
            "",
            "Misses:" + misses,
            "",
            *table,
            "",
            POOLED_VS_PER_REQUEST,
            "",
            *(f"{line}." for line in drift_lines(results["rows"])),
            "",
            *_identity_section(results, rows),
            *_breakdown_table(rows, "by_category", "category"),
            *_breakdown_table(rows, "by_turn", "turn"),
            *_context_length_table(rows),
            *_prediction_table(results),
            "![acceptance per position](acceptance_per_position.png)",
            "",
            "![throughput vs concurrency](throughput_vs_concurrency.png)",
            "",
        ]
    )


POOLED_VS_PER_REQUEST = (
    "Mean acceptance length two ways: *pooled* = 1 + accepted draft tokens / verify steps over every request "
    "together (how vLLM reports it, from its spec-decode counters; long requests weigh more); *per-request mean* = "
    "the mean over requests of each request's own 1 + accepted / verify steps (how SpecForge reports it; each "
    "request weighs the same), measured at concurrency 1 only, where each request decodes on its own."
)

MAX_LISTED_MISMATCHES = 20


def _training_context_lines(context: dict[str, Any] | None) -> list[str]:
    """The report's line on serving contexts longer than any training sequence (stage.training_context)."""
    if context is None:  # results gated before the check existed
        return []
    if context["warning"]:
        return [f"- **context warning**: {context['warning']}"]
    longest = context["longest_training_sequence"]
    return [
        f"- context: verifier.max_model_len={context['max_model_len']} is within the longest training sequence "
        f"({longest['num_tokens']} tokens, {longest['source']})"
    ]


def _context_length_table(rows: list[dict[str, Any]]) -> list[str]:
    """Acceptance per bucket of prompt + generated tokens, from the requests measured one at a time."""
    measured = [r for r in rows if r.get("by_context_length")]  # .get: results from before the buckets existed
    if not measured:
        return [
            "No acceptance by context length: it comes from requests measured one at a time, which needs "
            "concurrency 1 in evaluate.concurrency.",
            "",
        ]
    table = [
        "| context tokens (prompt + generated) | k | requests | acceptance rate | mean acceptance length, pooled "
        "| mean acceptance length, per-request mean |",
        "|" + "---|" * 6,
    ]
    table += [
        f"| {name} | {r['num_speculative_tokens']} | {b['num_requests']} | {b['acceptance_rate']:.3f} | "
        f"{b['mean_acceptance_length']:.3f} | {_fmt(b['mean_acceptance_length_per_request'])} |"
        for r in measured
        for name, b in r["by_context_length"].items()
    ]
    return [
        "Acceptance by context length, at concurrency 1 (buckets hold their lower bound, not their upper; each "
        "request's own numbers are under `requests` in results.json):",
        "",
        *table,
        "",
    ]


def _identity_section(results: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """The identity classes explained, plain decoding's own batch-shape noise, and the first differing outputs."""
    floor = results["plain_noise_floor"]
    margins = sorted(m["margin"] for m in floor["differing"] if m["margin"] is not None)
    reruns = sum(r.get("num_rerun_mismatches", 0) for r in results["rows"] if not r["num_speculative_tokens"])
    lines = [
        "Greedy identity, against plain decoding at the same concurrency (identity.py): *batch numerics* = plain "
        "decoding itself changes this prompt between concurrency levels at or before the differing token; *numerics "
        f"tie* = plain's top-2 log-probabilities there are within {results['numerics_tie_margin_nats']} nats; "
        "*numerics fp32* = neither, but plain decoding and the drafter agree on it with the verifier in float32 "
        "(the same wave decoded again); *drafter* = none of these (fails `require_identical_outputs`).",
        "",
        *_fp32_recheck_lines(results.get("fp32_recheck")),
        f"Noise floor: plain decoding at concurrency {floor['concurrency'][0]} vs {floor['concurrency'][1]} differs "
        f"on {len(floor['differing'])} of {floor['num_outputs']} outputs"
        + (f" (top-2 margins at the flip: {', '.join(f'{m:.3f}' for m in margins)})" if margins else "")
        + f"; the same waves decoded twice differ on {reruns} output(s).",
        "",
    ]
    listed = [(r, m) for r in rows for m in r["mismatches"]][:MAX_LISTED_MISMATCHES]
    if not listed:
        return lines
    lines += [
        "| k | concurrency | prompt | turn | class | first differing token | plain changes with batch shape at "
        "| plain top-2 margin there |",
        "|" + "---|" * 8,
    ]
    lines += [
        f"| {r['num_speculative_tokens']} | {r['concurrency']} | `{m['prompt']}` | {m['turn']} | {m['class']} | "
        f"{m['first_diff_token']} | {_or_dash(m['plain_shift_token'])} | {_fmt(m['margin'])} |"
        for r, m in listed
    ]
    total = sum(len(r["mismatches"]) for r in rows)
    more = [f"({total - len(listed)} more in results.json)", ""] if total > len(listed) else []
    return [*lines, "", *more]


def _fp32_recheck_lines(rechecked: dict[str, Any] | None) -> list[str]:
    if rechecked is None:
        return []
    if "error" in rechecked:
        return [f"Float32 recheck of {rechecked['outputs']} output(s) could not run: {rechecked['error']}.", ""]
    return [
        f"Float32 recheck: {rechecked['agree_in_fp32']} of {rechecked['outputs']} output(s) without a numeric "
        "explanation in the verifier's dtype agree with plain decoding in float32.",
        "",
    ]


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _breakdown_table(rows: list[dict[str, Any]], field: str, label: str) -> list[str]:
    """Speedup and acceptance per category (or per turn), one line per (value, k, concurrency)."""
    if not any(r[field] for r in rows):
        return []
    table = [
        f"| {label} | k | concurrency | tokens/s without | tokens/s with | speedup | acceptance rate "
        "| mean acceptance length, pooled | mean acceptance length, per-request mean | per-position acceptance |",
        "|" + "---|" * 10,
    ]
    for name in sorted({name for r in rows for name in r[field] or {}}):
        table += [
            f"| {name} | {r['num_speculative_tokens']} | {r['concurrency']} | {m['baseline_tokens_per_s']:.1f} | "
            f"{m['tokens_per_s']:.1f} | {m['speedup']:.2f}x | {m['acceptance_rate']:.3f} | "
            f"{m['mean_acceptance_length']:.3f} | {_fmt(m.get('mean_acceptance_length_per_request'))} | "
            f"{', '.join(f'{a:.3f}' for a in m.get('acceptance_per_position', []))} |"
            for r in rows  # .get: results measured before these columns existed
            if (m := (r[field] or {}).get(name))
        ]
    gaps = sorted({r["concurrency"] for r in rows if not r[field]})
    note = [f"No per-{label} numbers at concurrency {gaps}: a {label} has fewer prompts than that.", ""] if gaps else []
    return [f"Per {label}:", "", *table, "", *note]


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return buf.getvalue()


def plots(results: dict[str, Any]) -> dict[str, bytes]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    ks = sorted({r["num_speculative_tokens"] for r in rows if r["num_speculative_tokens"]})
    acceptance = _png(acceptance_figure(plt, results))
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for k in [0, *ks]:
        krows = sorted((r for r in rows if r["num_speculative_tokens"] == k), key=lambda r: r["concurrency"])
        ax.plot(
            [r["concurrency"] for r in krows],
            [r["tokens_per_s"] for r in krows],
            marker="o",
            label="no speculation" if k == 0 else f"eagle3 k={k}",
        )
    ax.set(xlabel="concurrent requests", ylabel="output tokens/s", title="Throughput vs concurrency")
    ax.legend()
    throughput = _png(fig)
    plt.close("all")
    return {"acceptance_per_position.png": acceptance, "throughput_vs_concurrency.png": throughput}


def acceptance_figure(plt, results: dict[str, Any]):
    """Measured per-position acceptance (solid) and training's prediction (dashed, same colour) on the same axes;
    draft positions are integers."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(5, 3.5))
    rows = results["rows"]
    predicted = {
        p["num_speculative_tokens"]: p["predicted_per_position"] for p in results.get("predicted_vs_measured", [])
    }
    for k in sorted({r["num_speculative_tokens"] for r in rows if r["num_speculative_tokens"]}):
        positions = list(range(1, k + 1))
        (line,) = ax.plot(positions, measured_acceptance(rows, k)[1], marker="o", label=f"k={k} measured (vLLM)")
        if predicted.get(k) and None not in predicted[k]:
            ax.plot(
                positions,
                predicted[k],
                marker="s",
                linestyle="--",
                color=line.get_color(),
                label=f"k={k} predicted (training replay)",
            )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="draft position", ylabel="acceptance", title="Acceptance per draft position", ylim=(0, 1))
    ax.legend(fontsize="small")
    return fig


def write(out_dir: str, results: dict[str, Any]) -> None:
    """results.json, report.md and the plots into the stage's version dir."""
    storage.write_json_atomic(storage.join(out_dir, "results.json"), results)
    storage.write_bytes_atomic(storage.join(out_dir, "report.md"), markdown(results).encode())
    for name, data in plots(results).items():
        storage.write_bytes_atomic(storage.join(out_dir, name), data)
