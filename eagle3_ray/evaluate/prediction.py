"""Training's predicted acceptance next to vLLM's measured one, and the verdict on a gap: a shortfall on the prompts
the replay was computed on is a likely contract problem (aux layer ids, drafter flags, chat template); one on the
evaluation prompts alone is distribution shift.

    check = predicted_vs_measured(training_metrics(drafter_dir), rows, infos, contract_runs, max_tokens)
"""

from __future__ import annotations

from typing import Any

from eagle3_ray.core import storage
from eagle3_ray.evaluate import report
from eagle3_ray.evaluate.acceptance import acceptance, per_position

# Largest |measured - predicted| mean acceptance length not flagged. The replay meets vLLM within a few hundredths on
# a run's own validation prompts (docs/benchmarks.md#smollm2-drafter: validation against estimate); a contract fault
# (wrong aux ids, a dropped norm flag) costs far more.
PREDICTION_TOLERANCE = 0.15


def training_metrics(drafter_dir: str) -> dict[str, Any]:
    """The exported checkpoint's validation metrics: the export's summary.json, next to its speculators/ dir."""
    export_dir = drafter_dir.rstrip("/").rsplit("/", 1)[0]
    return storage.read_json(storage.join(export_dir, "summary.json"))["checkpoint"].get("metrics") or {}


def predicted_vs_measured(
    metrics: dict[str, Any],
    rows: list[dict[str, Any]],
    infos: dict[int, dict[str, Any]],
    contract_runs: dict[int, dict[str, Any]] | None = None,
    max_tokens: int | None = None,
) -> list[dict[str, Any]]:
    """Per draft length: training's replay of vLLM's chain (acceptance.py) next to vLLM's measurement on the
    evaluation prompts and, where `contract_runs` has the draft length (spec counters of the validation split's
    decode), on the prompts the replay was computed on. A shortfall beyond PREDICTION_TOLERANCE on the validation
    prompts, or on the evaluation prompts when there is no validation decode, is flagged as a likely contract problem
    naming what to check (a contract fault lowers acceptance); a shortfall on the evaluation prompts alone is
    reported as distribution shift, acceptance above the replay as a note. When the replay covered another number
    of response tokens than this decode (`max_tokens`: an evaluation run with another evaluate.max_tokens than
    training's), every message says so first: the two count different windows of each response."""
    window = metrics.get("val_replay_max_tokens")
    window_note = None
    if window is not None and max_tokens is not None and int(window) != max_tokens:
        window_note = (
            f"training's replay covered the first {int(window)} response tokens of each validation sample and "
            f"this evaluation decodes {max_tokens}: estimate and measurement count different windows (train with "
            f"evaluate.max_tokens={max_tokens} for an estimate of this one)"
        )
    out = []
    for k, info in infos.items():
        measured, measured_pos = report.measured_acceptance(rows, k)
        predicted = metrics.get(f"val_replay_acceptance_length_k{k}")
        item = {
            "num_speculative_tokens": k,
            "measured_acceptance_length": measured,
            "measured_per_position": measured_pos,
            "predicted_acceptance_length": predicted,
            "predicted_per_position": [metrics.get(f"val_replay_acc_k{k}_{j}") for j in range(k)],
            "gap": None if predicted is None else measured - predicted,
            "validation": None,
            "flagged": False,
            "message": None,
        }
        own = (contract_runs or {}).get(k)
        if own is not None:
            own_len = acceptance(own)["mean_acceptance_length"]
            item["validation"] = {
                "measured_acceptance_length": own_len,
                "measured_per_position": per_position(own),
                "gap": None if predicted is None else own_len - predicted,
            }
        if predicted is None:
            item["message"] = (
                f"k={k}: no prediction: the checkpoint's validation has no "
                f"val_replay_acceptance_length_k{k} (trained with fewer ttt_steps, or before the "
                "replay existed)"
            )
        elif own is not None:
            item.update(_validation_verdict(k, predicted, measured, own_len, info))
        elif item["gap"] < -PREDICTION_TOLERANCE:
            item.update(flagged=True, message=_gap_message(k, predicted, measured, info, "the evaluation prompts"))
        if window_note is not None and predicted is not None:
            item["message"] = "; ".join(m for m in (f"k={k}: {window_note}", item["message"]) if m)
        out.append(item)
    return out


def _validation_verdict(k: int, predicted: float, measured: float, own_len: float, info: dict[str, Any]) -> dict:
    """A contract fault (aux ids, drafter flags, chat template) lowers vLLM's acceptance on the very prompts the
    replay was computed on: only a shortfall there is flagged. Acceptance above the replay there is not a fault
    (the replay is conservative, or the decoded sample differs from the whole split); a shortfall on the evaluation
    prompts alone is distribution shift."""
    notes = []
    if own_len - predicted < -PREDICTION_TOLERANCE:
        return {"flagged": True, "message": _gap_message(k, predicted, own_len, info, "the run's validation prompts")}
    if own_len - predicted > PREDICTION_TOLERANCE:
        notes.append(
            f"k={k}: on the run's validation prompts vLLM accepted more than training's replay predicted "
            f"({own_len:.3f} vs {predicted:.3f}): not a contract fault, which lowers acceptance; the replay is "
            "conservative there, or the decoded prompts are a sample easier than the whole split"
        )
    if measured - predicted < -PREDICTION_TOLERANCE:
        notes.append(
            f"k={k}: distribution shift: on the run's validation prompts vLLM measured {own_len:.3f} against "
            f"training's replay {predicted:.3f}, so drafter and vLLM agree, but on the evaluation prompts it "
            f"measured {measured:.3f} (gap {measured - predicted:+.3f}): they are unlike the training data, and "
            "training's estimate does not carry over to them; train on prompts like them"
        )
    return {"flagged": False, "message": "; ".join(notes) or None}


def _gap_message(k: int, predicted: float, measured: float, info: dict[str, Any], where: str) -> str:
    return (
        f"k={k}: vLLM measured mean acceptance length {measured:.3f} on {where}, training's replay predicted "
        f"{predicted:.3f} (gap {measured - predicted:+.3f}, tolerance {PREDICTION_TOLERANCE}): likely a contract "
        f"problem. Check the aux layer ids vLLM feeds the drafter ({info['aux_layer_ids']}) against the capture, "
        f"the drafter flags as this vLLM reads them ({info['drafter_flags']}; vllm_support.MEASURED), and that the "
        "prompts go through the verifier's chat template as in training"
        + ("; a held-out set unlike the training data also opens a gap" if where == "the evaluation prompts" else "")
    )
