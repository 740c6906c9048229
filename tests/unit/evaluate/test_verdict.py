"""The lines an evaluation ends with (report.verdict_lines): acceptance, speedup and the gate's verdict in words, on
hand-built rows gated by gate.gate."""

from __future__ import annotations

import pytest

from eagle3_ray.core.config import EvaluateConfig
from eagle3_ray.evaluate import gate, report

pytestmark = pytest.mark.unit


def results_at_c1(speedup: float, *, drift: float | None = None, **thresholds) -> dict:
    """One plain row and one k=3 row at concurrency 1: 100 drafts, 28 / 5 / 1 accepted per position."""
    plain = {"num_speculative_tokens": 0, "concurrency": 1, "tokens_per_s": 25.0}
    if drift is not None:
        plain.update(tokens_per_s_again=25.0 * (1 + drift), baseline_drift=drift)
    spec = {
        "num_speculative_tokens": 3,
        "concurrency": 1,
        "baseline_tokens_per_s": 25.0,
        "tokens_per_s": 25.0 * speedup,
        "speedup": speedup,
        "mean_acceptance_length": 1.34,
        "acceptance_per_position": [0.28, 0.05, 0.01],
        "num_drafts": 100,
        "num_accepted_tokens": 34,
        "identity": {"identical": 16, "drafter": 0},
    }
    rows = [plain, spec]
    section = EvaluateConfig(concurrency=[1], num_speculative_tokens=[3], **thresholds)
    return {
        "rows": rows,
        "drafter_dir": "/runs/r/export/e1/speculators",
        "report_dir": "/runs/r/evaluate/v1",
        "gate": gate.gate(rows, section),
    }


def test_a_passing_drafter_ends_with_its_acceptance_speedup_paths_and_what_the_gate_checked():
    lines = report.verdict_lines(results_at_c1(1.2, drift=0.02))
    assert lines[0] == (
        "acceptance at k=3: 1.34 tokens per verifier step (1.00 = no draft token kept, 4.00 = all 3); "
        "kept per draft position: 28.0%, 5.0%, 1.0%"
    )
    assert lines[1] == (
        "speedup at 1 request at a time (k=3): 1.20x, 30.0 against 25.0 output tokens/s without the drafter: "
        "decoding is 20% faster with it"
    )
    assert lines[2:4] == ["drafter: /runs/r/export/e1/speculators", "report: /runs/r/evaluate/v1/report.md"]
    assert lines[4:] == [
        "deploy gate: PASS (speedup >= 1.0 at every concurrency measured; no greedy output changed by the drafter; "
        "plain decoding's speed steady within 15%)"
    ]


def test_a_failing_drafter_under_report_only_says_the_job_succeeds_and_ends_with_each_miss():
    lines = report.verdict_lines(results_at_c1(0.92, report_only=True))
    assert "decoding is 8% slower with it" in lines[1]
    assert lines[-2:] == [
        "deploy gate: FAIL: do not deploy this drafter; speedup follows acceptance, which grows with training data: "
        "what recipes that train on more reach is in docs/benchmarks.md (evaluate.report_only: the verdict is "
        "reported and the job still succeeds)",
        "  miss: k=3 c=1: speedup 0.920 < min_speedup 1.0 (the fastest k at c=1)",
    ]
    enforced = report.verdict_lines(results_at_c1(0.92, min_acceptance_length=1.5, min_speedup=None))
    assert enforced[-2] == "deploy gate: FAIL: do not deploy this drafter"


def test_the_pass_line_names_only_the_checks_that_ran():
    per_c = report.verdict_lines(results_at_c1(1.05, min_speedup={1: 1.02}, require_identical_outputs=False))
    assert per_c[-1] == "deploy gate: PASS (speedup >= 1.02 at c=1)"
    assert report.verdict_lines(results_at_c1(1.0))[1].endswith("without the drafter: as fast as without it")


def test_a_fail_because_plain_decoding_moved_says_the_speedup_cannot_be_trusted_and_how_to_measure_again():
    results = results_at_c1(1.39, drift=0.537, report_only=True)
    assert results["gate"]["baseline_moved"] == [1]
    lines = report.verdict_lines(results)
    assert lines[-2].startswith("deploy gate: FAIL: plain decoding's speed moved during the measurement, so the ")
    assert "run --stages evaluate again with nothing else running" in lines[-2] and "do not deploy" not in lines[-2]
    assert lines[-1].startswith("  miss: c=1: plain decoding ran at 25.0 tokens/s before the drafter engines and 38.4")


def test_a_recipe_that_names_its_longer_recipe_ends_with_what_that_one_reaches():
    longer = "smollm2_cpu.yaml reaches 1.34 tokens per verifier step and 1.20x at c=1"
    lines = report.verdict_lines(results_at_c1(0.93, report_only=True, compare_with=longer))
    assert (
        lines[-3] == "deploy gate: FAIL: do not deploy this drafter (evaluate.report_only: the verdict is reported "
        "and the job still succeeds)"
    )
    assert lines[-2].startswith("  miss: k=3 c=1: speedup 0.930")
    assert lines[-1] == f"for comparison: {longer}"
    assert report.verdict_lines(results_at_c1(1.2, compare_with=longer))[-1].endswith(longer)
