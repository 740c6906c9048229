"""Evaluation numbers -> result rows, a Markdown report, a plain-text summary table and two PNG plots.

A row is one (num_speculative_tokens, concurrency) measurement; `num_speculative_tokens` 0 is plain decoding.
    acceptance_rate         = accepted draft tokens / proposed draft tokens
    mean_acceptance_length  = 1 + accepted / drafts   (tokens emitted per verifier step; 1.0 = no gain)
    acceptance_per_position = accepted at position i / drafts   (the chance the i-th draft token survives)
    speedup                 = output tokens/s with the drafter / without it, same prompts and concurrency
Predicted acceptance (`predicted_vs_measured`) is training's replay of vLLM's draft/verify chain over the validation
split (train/acceptance.py), shown next to the measured one; a gap past evaluate.PREDICTION_TOLERANCE is flagged.
"""

from __future__ import annotations

import io
from typing import Any

from eagle3_ray.core import storage


def _tokens_per_s(run: dict[str, Any]) -> float:
    return sum(len(o) for o in run["outputs"]) / max(run["wall_s"], 1e-9)


def baseline_row(concurrency: int, run: dict[str, Any]) -> dict[str, Any]:
    return {
        "num_speculative_tokens": 0,
        "concurrency": concurrency,
        "wall_s": run["wall_s"],
        "output_tokens": sum(len(o) for o in run["outputs"]),
        "tokens_per_s": _tokens_per_s(run),
    }


def _mismatches(base: list[list[int]], spec: list[list[int]]) -> list[dict[str, int]]:
    """Prompts whose greedy outputs differ, with the first differing token position."""
    found = []
    for i, (a, b) in enumerate(zip(base, spec, strict=True)):
        if a != b:
            first = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            found.append({"prompt": i, "first_diff_token": first, "base_len": len(a), "spec_len": len(b)})
    return found


def spec_row(
    k: int, concurrency: int, run: dict[str, Any], base: dict[str, Any], base_lowest: dict[str, Any]
) -> dict[str, Any]:
    """`base`: plain decoding at the same concurrency; `base_lowest`: plain decoding at the lowest concurrency, whose
    difference from `base` shows how much batching alone moves greedy outputs."""
    s = run["spec"]
    drafts = max(s["num_drafts"], 1)
    mismatches = _mismatches(base["outputs"], run["outputs"])
    return {
        **baseline_row(concurrency, run),
        "num_speculative_tokens": k,
        "baseline_tokens_per_s": _tokens_per_s(base),
        "speedup": _tokens_per_s(run) / _tokens_per_s(base),
        "num_drafts": s["num_drafts"],
        "num_draft_tokens": s["num_draft_tokens"],
        "num_accepted_tokens": s["num_accepted_tokens"],
        "acceptance_rate": s["num_accepted_tokens"] / max(s["num_draft_tokens"], 1),
        "mean_acceptance_length": 1.0 + s["num_accepted_tokens"] / drafts,
        "acceptance_per_position": [a / drafts for a in s["accepted_per_pos"]],
        "num_outputs": len(run["outputs"]),
        "num_mismatched_outputs": len(mismatches),
        "mismatches": mismatches,
        "num_baseline_batch_mismatches": len(_mismatches(base_lowest["outputs"], base["outputs"])),
    }


def summary_table(results: dict[str, Any]) -> str:
    """The table a job log ends with: one line per (draft length, concurrency), then the gate's verdict."""
    head = (
        f"{'k':>3} {'conc':>5} {'base tok/s':>11} {'spec tok/s':>11} {'speedup':>8} {'accept':>7} "
        f"{'mean len':>9} {'identical':>10}  per-position acceptance"
    )
    lines = [head, "-" * len(head)]
    for r in (r for r in results["rows"] if r["num_speculative_tokens"]):
        same = f"{r['num_outputs'] - r['num_mismatched_outputs']}/{r['num_outputs']}"
        lines.append(
            f"{r['num_speculative_tokens']:>3} {r['concurrency']:>5} {r['baseline_tokens_per_s']:>11.1f} "
            f"{r['tokens_per_s']:>11.1f} {r['speedup']:>7.2f}x {r['acceptance_rate']:>7.3f} "
            f"{r['mean_acceptance_length']:>9.3f} {same:>10}  "
            + " ".join(f"{a:.3f}" for a in r["acceptance_per_position"])
        )
    lines += prediction_lines(results)
    g = results["gate"]
    verdict = "PASS" if g["passed"] else "FAIL"
    lines.append(
        f"deploy gate: {verdict} "
        f"(recommended num_speculative_tokens={g['recommended_num_speculative_tokens']})"
        + "".join(f"\n  miss: {m}" for m in g["misses"])
    )
    return "\n".join(lines)


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
        lines.append(
            f"k={p['num_speculative_tokens']}: mean acceptance length predicted "
            f"{_fmt(p['predicted_acceptance_length'])}, measured {p['measured_acceptance_length']:.3f}{gap}"
            + (f"\n  FLAGGED: {p['message']}" if p["flagged"] else "")
        )
    return lines


def _prediction_table(results: dict[str, Any]) -> list[str]:
    rows = results.get("predicted_vs_measured", [])
    if not rows:
        return []
    table = [
        "| k | predicted mean acceptance length | measured | gap | predicted per position | measured per position |",
        "|" + "---|" * 6,
    ]
    table += [
        f"| {p['num_speculative_tokens']} | {_fmt(p['predicted_acceptance_length'])} | "
        f"{p['measured_acceptance_length']:.3f} | {_signed(p['gap'])} | "
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
        "| mean acceptance length "
        "| per-position acceptance | identical greedy outputs |",
        "|" + "---|" * 9,
    ]
    table += [
        f"| {r['num_speculative_tokens']} | {r['concurrency']} | {r['baseline_tokens_per_s']:.1f} | "
        f"{r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['acceptance_rate']:.3f} | "
        f"{r['mean_acceptance_length']:.3f} | {', '.join(f'{a:.3f}' for a in r['acceptance_per_position'])} | "
        f"{r['num_outputs'] - r['num_mismatched_outputs']}/{r['num_outputs']} |"
        for r in rows
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
            f"training conversations), chat template applied, greedy, max_tokens={results['max_tokens']}",
            f"- aux layers: captured {results['capture_aux_layer_ids']}, used by vLLM {results['vllm_aux_layer_ids']}",
            "",
            f"**Deploy gate: {'PASS' if g['passed'] else 'FAIL'}** (thresholds {g['thresholds']}; recommended "
            f"num_speculative_tokens={g['recommended_num_speculative_tokens']})",
            "",
            "Misses:" + misses,
            "",
            *table,
            "",
            *_prediction_table(results),
            "![acceptance per position](acceptance_per_position.png)",
            "",
            "![throughput vs concurrency](throughput_vs_concurrency.png)",
            "",
        ]
    )


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
