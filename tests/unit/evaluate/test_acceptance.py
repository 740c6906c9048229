"""Acceptance the ways users compare it, from hand-made counter increments: pooled over verify steps (vLLM's) and the
mean of per-request means (SpecForge's), per category and per position, against context length, and the warning
when serving allows longer contexts than training saw."""

from __future__ import annotations

import pyarrow as pa
import pytest

from eagle3_ray.core import storage
from eagle3_ray.core.config import config_from_dict
from eagle3_ray.evaluate import acceptance, report
from eagle3_ray.evaluate.stage import longest_training_sequence, training_context

pytestmark = pytest.mark.unit


def counters(drafts: int, accepted_per_pos: list[int], *, prompt_tokens: int = 0, output_tokens: int = 0) -> dict:
    """A request's (or a group's) counter increments at k=3, as EngineBench.measure reports them."""
    return {
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "num_drafts": drafts,
        "num_draft_tokens": 3 * drafts,
        "num_accepted_tokens": sum(accepted_per_pos),
        "accepted_per_pos": accepted_per_pos,
    }


def test_a_long_well_drafted_request_lifts_pooled_acceptance_above_the_mean_of_per_request_means():
    long = counters(10, [10, 6, 4], prompt_tokens=100, output_tokens=60)  # its own length 3.0
    short = counters(2, [0, 0, 0], prompt_tokens=40, output_tokens=3)  # its own length 1.0
    one_token = counters(0, [0, 0, 0], prompt_tokens=40, output_tokens=1)  # no verify step: no acceptance of its own
    labels = [{"prompt": p, "turn": 1, "category": None} for p in ("long", "short", "one")]
    requests = acceptance.request_records([long, short, one_token], labels)
    assert [r["mean_acceptance_length"] for r in requests] == [3.0, 1.0, None]
    assert requests[0]["context_tokens"] == 160 and requests[0]["prompt"] == "long"
    summary = acceptance.summarize(requests)
    assert summary["mean_acceptance_length"] == pytest.approx(1 + 20 / 12)  # pooled: 2.667
    assert summary["mean_acceptance_length_per_request"] == pytest.approx(2.0)  # (3.0 + 1.0) / 2
    assert summary["num_requests"] == 3 and summary["acceptance_rate"] == pytest.approx(20 / 36)
    assert acceptance.per_request_mean([]) is None
    assert acceptance.request_records([None, None], labels[:2]) == []  # measured together: no request of its own


def test_context_buckets_hold_their_lower_bound_and_not_their_upper():
    names = [acceptance.context_bucket(n) for n in (0, 255, 256, 511, 512, 1023, 1024, 2047, 2048, 100_000)]
    assert names == ["<256", "<256", "256-512", "256-512", "512-1k", "512-1k", "1k-2k", "1k-2k", ">=2k", ">=2k"]
    records = [
        {"context_tokens": n, "mean_acceptance_length": length, **counters(d, [a, 0, 0])}
        for n, length, d, a in ((1500, 1.5, 4, 2), (100, 2.0, 2, 2), (120, 3.0, 1, 2), (3000, None, 0, 0))
    ]
    buckets = acceptance.by_context_length(records)
    assert list(buckets) == ["<256", "1k-2k", ">=2k"]  # bucket order, empty ones left out
    assert buckets["<256"]["num_requests"] == 2
    assert buckets["<256"]["mean_acceptance_length"] == pytest.approx(1 + 4 / 3)
    assert buckets["<256"]["mean_acceptance_length_per_request"] == pytest.approx(2.5)
    assert buckets[">=2k"]["mean_acceptance_length_per_request"] is None
    assert acceptance.by_context_length([]) is None


def spec_run(per_request: list[dict | None]) -> dict:
    """A k=3 run over 4 prompts (2 mtbench writing, 2 humaneval) in two groups, with the requests' own increments."""
    writing, code = counters(6, [5, 3, 1]), counters(8, [2, 0, 0])
    groups = [
        {"turn": 1, "category": "writing", "wall_s": 1.0, "output_tokens": 20, "spec": writing},
        {"turn": 1, "category": "humaneval", "wall_s": 1.0, "output_tokens": 20, "spec": code},
    ]
    total = {k: writing[k] + code[k] for k in acceptance.SPEC_TOTALS}
    total["accepted_per_pos"] = acceptance.add_per_position(writing["accepted_per_pos"], code["accepted_per_pos"])
    return {"outputs": [[1] * 10] * 4, "wall_s": 2.0, "spec": total, "groups": groups, "per_request": per_request}


def test_a_concurrency_1_row_reports_both_means_per_category_with_per_position_and_by_context_length():
    per_request = [
        counters(2, [2, 1, 1], prompt_tokens=50, output_tokens=10),  # 3.0
        counters(4, [3, 2, 0], prompt_tokens=300, output_tokens=10),  # 2.25
        counters(4, [2, 0, 0], prompt_tokens=60, output_tokens=10),  # 1.5
        counters(4, [0, 0, 0], prompt_tokens=60, output_tokens=10),  # 1.0
    ]
    labels = [
        {"prompt": p, "turn": 1, "category": c}
        for p, c in (("w1", "writing"), ("w2", "writing"), ("h1", "humaneval"), ("h2", "humaneval"))
    ]
    zero = {k: 0 for k in acceptance.SPEC_TOTALS} | {"accepted_per_pos": []}
    base = {**spec_run([None] * 4), "spec": zero, "groups": [{**g, "spec": zero} for g in spec_run([])["groups"]]}
    base["reference"] = {"outputs": base["outputs"]}
    items = [{"class": "identical", "first_diff_token": None}] * 4
    row = report.spec_row(3, 1, spec_run(per_request), base, base, items, labels)
    assert row["mean_acceptance_length"] == pytest.approx(1 + 11 / 14)  # pooled over the groups' counters
    assert row["mean_acceptance_length_per_request"] == pytest.approx((3.0 + 2.25 + 1.5 + 1.0) / 4)
    writing, code = row["by_category"]["writing"], row["by_category"]["humaneval"]
    assert writing["mean_acceptance_length_per_request"] == pytest.approx(2.625)
    assert code["mean_acceptance_length_per_request"] == pytest.approx(1.25)
    assert writing["acceptance_per_position"] == pytest.approx([5 / 6, 3 / 6, 1 / 6])
    assert code["acceptance_per_position"] == pytest.approx([2 / 8, 0, 0])
    assert list(row["by_context_length"]) == ["<256", "256-512"]
    assert row["by_context_length"]["256-512"]["mean_acceptance_length"] == pytest.approx(2.25)
    assert [r["prompt"] for r in row["requests"]] == ["w1", "w2", "h1", "h2"]
    batched = report.spec_row(3, 4, spec_run([None] * 4), base, base, items, labels)
    assert batched["mean_acceptance_length_per_request"] is None and batched["by_context_length"] is None
    assert batched["by_category"]["writing"]["mean_acceptance_length_per_request"] is None
    md = report.markdown(results_of([row, batched]))
    assert "Acceptance by context length, at concurrency 1" in md
    assert "| 256-512 | 3 | 1 | 0.417 | 2.250 | 2.250 |" in md and "| <256 | 3 | 3 | " in md
    assert "| humaneval | 3 | 1 | 20.0 | 20.0 | 1.00x | 0.083 | 1.250 | 1.250 | 0.250, 0.000, 0.000 |" in md
    assert "| humaneval | 3 | 4 | 20.0 | 20.0 | 1.00x | 0.083 | 1.250 | n/a | 0.250, 0.000, 0.000 |" in md
    assert "No acceptance by context length" in report.markdown(results_of([batched]))


def results_of(rows: list[dict], training_context: dict | None = None) -> dict:
    """What report.markdown reads, around measured k=3 rows."""
    from eagle3_ray.core.config import EvaluateConfig
    from eagle3_ray.evaluate import gate

    concurrency = sorted({r["concurrency"] for r in rows}) or [1]
    results = {
        "version": "v1",
        "drafter_dir": "d",
        "verifier_path": "v",
        "prompt_ids": ["p"] * 4,
        "held_out": {"num_train_conversations": 12},
        "max_tokens": 10,
        "turns": "first",
        "capture_aux_layer_ids": [1, 3, 4],
        "vllm_aux_layer_ids": {"3": [1, 3, 4]},
        "rows": rows,
        "numerics_tie_margin_nats": 0.05,
        "plain_noise_floor": {"concurrency": [1, 4], "num_outputs": 4, "differing": []},
        "gate": gate.gate(rows, EvaluateConfig(concurrency=concurrency, num_speculative_tokens=[3])),
    }
    return results if training_context is None else {**results, "training_context": training_context}


def test_serving_past_the_longest_training_sample_warns_naming_both_lengths(tmp_path):
    gen_dir = str(tmp_path / "generate" / "v1")
    storage.write_parquet_atomic(
        storage.join(gen_dir, "manifest.parquet"), pa.table({"id": ["a", "b"], "num_tokens": [180, 300]})
    )
    cfg = config_from_dict({"verifier": {"max_model_len": 4096}, "train": {"total_seq_len": 2048}})
    longest = longest_training_sequence(cfg, gen_dir)
    assert longest == {"num_tokens": 300, "source": f"the longest sample in {gen_dir}/manifest.parquet"}
    context = training_context(cfg, gen_dir)
    assert context["warning"].startswith(
        "verifier.max_model_len=4096 exceeds the longest training sequence (300 tokens, the longest sample in "
    )
    cut = config_from_dict({"verifier": {"max_model_len": 4096}, "train": {"total_seq_len": 256}})
    assert longest_training_sequence(cut, gen_dir)["num_tokens"] == 256  # packing cuts the 300-token sample
    online = longest_training_sequence(cfg, str(tmp_path / "ingest" / "v1"))
    assert online["num_tokens"] == 2048 and online["source"].startswith("train.total_seq_len")
    within = config_from_dict({"verifier": {"max_model_len": 300}})
    assert training_context(within, gen_dir)["warning"] is None
    assert acceptance.context_warning(300, longest) is None
    assert "\n- **context warning**: verifier.max_model_len=4096 exceeds" in report.markdown(results_of([], context))
    assert (
        "\n- context: verifier.max_model_len=300 is within the longest training sequence (300 tokens"
        in report.markdown(results_of([], training_context(within, gen_dir)))
    )
