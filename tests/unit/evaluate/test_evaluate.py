"""Evaluate stage without an engine: the held-out check, training's prediction next to vLLM's measurement, the
acceptance plot, and the report and summary table built from hand-made rows."""

from __future__ import annotations

import pytest

from eagle3_ray.core import storage
from eagle3_ray.evaluate import report
from eagle3_ray.evaluate.prediction import predicted_vs_measured
from eagle3_ray.evaluate.prompts import validation_prompts

pytestmark = pytest.mark.unit


def test_online_runs_check_held_out_prompts_against_the_ingested_conversations(tmp_path):
    import pyarrow as pa

    from eagle3_ray.evaluate.prompts import check_held_out

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
    close = predicted_vs_measured({"val_replay_acceptance_length_k3": 1.72}, rows, info)[0]
    assert close["gap"] == pytest.approx(-0.02) and not close["flagged"]
    far = predicted_vs_measured({"val_replay_acceptance_length_k3": 2.2}, rows, info)[0]
    assert far["flagged"] and "likely a contract problem" in far["message"]
    assert "aux layer ids vLLM feeds the drafter ([1, 3, 4])" in far["message"]
    assert "{'norm_output': False}" in far["message"] and "chat template" in far["message"]
    missing = predicted_vs_measured({"val_acc_0": 0.5}, rows, info)[0]
    assert missing["predicted_acceptance_length"] is None and "no prediction" in missing["message"]


def test_a_gap_on_the_evaluation_prompts_alone_is_distribution_shift_and_one_on_validation_prompts_a_contract_problem():
    rows = [spec_row_for(3, 100, [40, 20, 10])]  # evaluation prompts: 1.70
    info = {3: {"aux_layer_ids": [1, 3, 4], "drafter_flags": {"norm_output": False}}}
    metrics = {"val_replay_acceptance_length_k3": 2.5}
    agrees = {
        3: {"num_drafts": 100, "num_draft_tokens": 300, "num_accepted_tokens": 148, "accepted_per_pos": [66, 48, 34]}
    }  # 2.48
    [shift] = predicted_vs_measured(metrics, rows, info, agrees)
    assert not shift["flagged"] and "distribution shift" in shift["message"]
    assert shift["validation"]["measured_acceptance_length"] == pytest.approx(2.48)
    assert shift["validation"]["gap"] == pytest.approx(-0.02)
    assert shift["validation"]["measured_per_position"] == pytest.approx([0.66, 0.48, 0.34])
    parts = {
        3: {"num_drafts": 100, "num_draft_tokens": 300, "num_accepted_tokens": 70, "accepted_per_pos": [40, 20, 10]}
    }  # 1.70
    [contract] = predicted_vs_measured(metrics, rows, info, parts)
    assert contract["flagged"] and "on the run's validation prompts" in contract["message"]
    assert "likely a contract problem" in contract["message"] and "held-out set unlike" not in contract["message"]
    above = {
        3: {"num_drafts": 100, "num_draft_tokens": 300, "num_accepted_tokens": 170, "accepted_per_pos": [70, 55, 45]}
    }  # 2.70
    [easier] = predicted_vs_measured(metrics, rows, info, above)
    assert not easier["flagged"] and "accepted more than training's replay predicted" in easier["message"]
    table = "\n".join(report.prediction_lines({"predicted_vs_measured": [shift]}))
    assert "on validation prompts 2.480" in table and "FLAGGED" not in table


def test_an_estimate_over_fewer_response_tokens_than_the_decode_says_so_before_any_verdict():
    """An evaluation run with another evaluate.max_tokens than training's: the replay counted the first 64 tokens of
    each response, vLLM decoded 256, so the gap is partly the window's."""
    rows = [spec_row_for(3, 100, [40, 20, 10])]  # 1.70
    info = {3: {"aux_layer_ids": [1, 3, 4], "drafter_flags": {"norm_output": False}}}
    close = {"val_replay_acceptance_length_k3": 1.72, "val_replay_max_tokens": 64.0}
    [same] = predicted_vs_measured(close, rows, info, max_tokens=64)
    assert same["message"] is None and not same["flagged"]
    [other] = predicted_vs_measured(close, rows, info, max_tokens=256)
    assert not other["flagged"]
    assert other["message"].startswith("k=3: training's replay covered the first 64 response tokens")
    assert "this evaluation decodes 256" in other["message"] and "evaluate.max_tokens=256" in other["message"]
    far_off = {**close, "val_replay_acceptance_length_k3": 2.2}
    [far] = predicted_vs_measured(far_off, rows, info, max_tokens=256)
    assert far["flagged"] and far["message"].startswith("k=3: training's replay covered the first 64")
    assert "likely a contract problem" in far["message"]
    [older] = predicted_vs_measured({"val_replay_acceptance_length_k3": 1.72}, rows, info, max_tokens=256)
    assert older["message"] is None  # a checkpoint from before the window was recorded: nothing to compare


def test_gate_fails_when_plain_decoding_moved_between_its_two_passes_and_the_report_shows_both_rates():
    from eagle3_ray.core.config import EvaluateConfig
    from eagle3_ray.evaluate import gate

    base = {"num_speculative_tokens": 0, "concurrency": 1, "wall_s": 1.0, "output_tokens": 475, "tokens_per_s": 475.0}
    steady, moved = dict(base), dict(base)
    report.add_baseline_again(steady, {"outputs": [[0] * 490], "wall_s": 1.0})
    report.add_baseline_again(moved, {"outputs": [[0] * 655], "wall_s": 1.0})
    assert moved["baseline_drift"] == pytest.approx(655 / 475 - 1)
    assert gate.gate([steady], EvaluateConfig(concurrency=[1]))["passed"]
    verdict = gate.gate([moved], EvaluateConfig(concurrency=[1]))
    assert not verdict["passed"] and "475.0 tokens/s before the drafter engines and 655.0 after" in verdict["misses"][0]
    assert gate.gate([moved], EvaluateConfig(concurrency=[1], max_baseline_drift=None))["passed"]
    assert report.drift_lines([moved]) == [
        "plain decoding before / after the drafter engines: c=1 475.0 / 655.0 tok/s (+37.9%)"
    ]


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


def results_for_report() -> dict:
    from eagle3_ray.core.config import EvaluateConfig
    from eagle3_ray.evaluate import gate

    def row(k, c, speedup, classes, mismatches=()):
        return {
            "num_speculative_tokens": k,
            "concurrency": c,
            "baseline_tokens_per_s": 100.0,
            "tokens_per_s": 100.0 * speedup,
            "speedup": speedup,
            "acceptance_rate": 0.4,
            "mean_acceptance_length": 1.0 + 0.4 * k,
            "mean_acceptance_length_per_request": 1.0 + 0.35 * k if c == 1 else None,
            "acceptance_per_position": [0.5, 0.3, 0.1][:k],
            "num_drafts": 10,
            "num_accepted_tokens": 4 * k,
            "identity": dict(zip(("identical", "batch_numerics", "numerics_tie", "drafter"), classes, strict=True)),
            "mismatches": list(mismatches),
            "by_category": None,
            "by_turn": None,
        }

    tie = {"prompt": "p3", "turn": 1, "class": "numerics_tie", "first_diff_token": 17, "plain_shift_token": None,
           "margin": 0.012}  # fmt: skip
    rows = [row(1, 1, 1.2, (8, 0, 0, 0)), row(3, 1, 1.6, (7, 0, 1, 0), [tie]), row(1, 4, 1.1, (6, 2, 0, 0))]
    rows.append(row(3, 4, 0.9, (6, 2, 0, 0)))
    results = {
        "version": "v1",
        "drafter_dir": "d",
        "verifier_path": "v",
        "prompt_ids": ["p"] * 8,
        "held_out": {"num_train_conversations": 12},
        "max_tokens": 48,
        "turns": "first",
        "capture_aux_layer_ids": [1, 3, 4],
        "vllm_aux_layer_ids": {"1": [1, 3, 4]},
        "rows": rows,
        "numerics_tie_margin_nats": 0.05,
        "plain_noise_floor": {
            "concurrency": [1, 4],
            "num_outputs": 8,
            "differing": [{"margin": 0.03}, {"margin": 0.2}],
        },
    }
    results["gate"] = gate.gate(rows, EvaluateConfig(concurrency=[1, 4], num_speculative_tokens=[1, 3]))
    return results


def test_report_and_summary_name_the_fastest_k_per_concurrency_and_the_identity_classes():
    results = results_for_report()
    md = report.markdown(results)
    assert "| concurrency | fastest k | speedup | mean acceptance length |" in md
    assert "| 1 | 3 | 1.60x | 2.200 |" in md and "| 4 | 1 | 1.10x | 1.400 |" in md
    assert "| 3 | 1 | 100.0 | 160.0 | 1.60x | 0.400 | 2.200 | 2.050 | 0.500, 0.300, 0.100 | 7 / 0 / 1 / 0 / 0 |" in md
    assert "| 3 | 4 | 100.0 | 90.0 | 0.90x | 0.400 | 2.200 | n/a | 0.500, 0.300, 0.100 | 6 / 2 / 0 / 0 / 0 |" in md
    assert "| mean acceptance length, pooled | mean acceptance length, per-request mean |" in md
    assert "*pooled* = 1 + accepted draft tokens / verify steps over every request" in md
    assert "| 3 | 1 | `p3` | 1 | numerics_tie | 17 | - | 0.012 |" in md
    assert (
        "plain decoding at concurrency 1 vs 4 differs on 2 of 8 outputs (top-2 margins at the flip: 0.030, 0.200)" in md
    )
    table = report.summary_table(results)
    assert "fastest k: c=1 k=3 (1.60x), c=4 k=1 (1.10x); one k for every load: 1" in table
    assert "    2.200     2.050" in table and "    2.200       n/a" in table  # pooled, then per-request mean
    assert "7/0/1/0/0" in table and table.splitlines()[-1].startswith("deploy gate: PASS (speedup >= 1.0 at every")


def test_the_validation_prompts_are_the_first_of_the_splits_ids_up_to_the_first_user_turn(tmp_path):
    """The serving check decodes the first `evaluate.contract_prompts` ids of training's validation split, each up to
    its first user turn; the split holds one response per prompt (the greedy one, data.split_role)."""
    import pyarrow as pa

    from eagle3_ray.core import stage
    from eagle3_ray.core.config import config_from_dict

    cfg = config_from_dict({"run": {"storage_path": str(tmp_path)}, "evaluate": {"contract_prompts": 2}})
    train = stage.output_dir(cfg, "train")
    storage.write_json_atomic(storage.join(train, "split.json"), {"val_ids": ["a", "b", "c"]})
    storage.write_json_atomic(storage.join(train, storage.SUCCESS_MARKER), {})
    user = [{"role": "user", "content": "q"}]
    table = pa.table({"id": ["a", "b", "c"], "messages": [user + [{"role": "assistant", "content": "r"}]] * 3})
    assert [p["id"] for p in validation_prompts(cfg, "unused", table)] == ["a", "b"]
    assert validation_prompts(cfg, "unused", table)[0]["messages"] == user
