"""The recommended draft length per concurrency and the deploy gate (evaluate/gate.py) on hand-built rows."""

from __future__ import annotations

import pytest

from eagle3_ray.core.config import EvaluateConfig
from eagle3_ray.evaluate import gate, identity

pytestmark = pytest.mark.unit


def row(k: int, c: int, speedup: float, *, length: float = 2.0, drafter: int = 0) -> dict:
    mismatches = [{"prompt": f"p{i}", "turn": 1, "class": "drafter", "first_diff_token": 7 + i} for i in range(drafter)]
    return {
        "num_speculative_tokens": k,
        "concurrency": c,
        "speedup": speedup,
        "mean_acceptance_length": length,
        "identity": {**dict.fromkeys(identity.CLASSES, 0), "identical": 8 - drafter, "drafter": drafter},
        "mismatches": mismatches,
    }


BASELINE = [{"num_speculative_tokens": 0, "concurrency": c, "tokens_per_s": 100.0} for c in (1, 8)]
# k=3 is fastest one request at a time, k=1 under load: no single k wins everywhere
ROWS = BASELINE + [
    row(1, 1, 1.20, length=1.6),
    row(2, 1, 1.45, length=2.1),
    row(3, 1, 1.60, length=2.5),
    row(1, 8, 1.05, length=1.6),
    row(2, 8, 0.98, length=2.1),
    row(3, 8, 0.90, length=2.5),
]


def test_the_fastest_k_is_recommended_at_each_concurrency_with_its_speedup():
    assert gate.recommend(ROWS) == [
        {"concurrency": 1, "num_speculative_tokens": 3, "speedup": 1.60, "mean_acceptance_length": 2.5},
        {"concurrency": 8, "num_speculative_tokens": 1, "speedup": 1.05, "mean_acceptance_length": 1.6},
    ]


def test_a_speed_tie_recommends_the_smaller_k():
    rows = [row(3, 1, 1.3), row(2, 1, 1.3)]
    assert gate.recommend(rows)[0]["num_speculative_tokens"] == 2
    assert gate.one_k(rows) == 2


def test_one_k_for_every_load_has_the_best_lowest_speedup():
    assert gate.one_k(ROWS) == 1  # lowest speedups: k=1 1.05, k=2 0.98, k=3 0.90
    assert gate.one_k(BASELINE) is None


def test_gate_passes_when_the_recommended_k_is_fast_enough_at_every_concurrency_though_no_k_is_everywhere():
    verdict = gate.gate(ROWS, EvaluateConfig(concurrency=[1, 8], min_speedup=1.0))
    assert verdict["passed"] and verdict["misses"] == []
    assert [(r["concurrency"], r["num_speculative_tokens"]) for r in verdict["recommended"]] == [(1, 3), (8, 1)]
    assert verdict["recommended_num_speculative_tokens"] == 1
    assert verdict["thresholds"]["min_speedup"] == 1.0 and "num_speculative_tokens" not in verdict["thresholds"]


def test_gate_fails_a_concurrency_whose_fastest_k_is_too_slow_and_names_it():
    verdict = gate.gate(ROWS, EvaluateConfig(concurrency=[1, 8], min_speedup=1.1))
    assert not verdict["passed"]
    assert verdict["misses"] == ["k=1 c=8: speedup 1.050 < min_speedup 1.1 (the fastest k at c=8)"]


def test_per_concurrency_thresholds_leave_unnamed_levels_ungated():
    assert gate.gate(ROWS, EvaluateConfig(concurrency=[1, 8], min_speedup={1: 1.5}))["passed"]
    assert not gate.gate(ROWS, EvaluateConfig(concurrency=[1, 8], min_speedup={1: 1.7}))["passed"]
    assert gate.gate(ROWS, EvaluateConfig(concurrency=[1, 8], min_speedup=None))["passed"]


def test_acceptance_threshold_applies_at_the_recommended_k():
    verdict = gate.gate(ROWS, EvaluateConfig(concurrency=[1, 8], min_acceptance_length=2.0))
    assert verdict["misses"] == ["k=1 c=8: mean acceptance length 1.600 < min_acceptance_length 2.0"]


def test_an_output_difference_attributed_to_the_drafter_fails_at_any_k_unless_identity_is_not_required():
    rows = [*ROWS[:-1], row(3, 8, 0.90, drafter=2)]  # k=3 is not recommended at c=8, still a correctness problem
    verdict = gate.gate(rows, EvaluateConfig(concurrency=[1, 8]))
    [miss] = verdict["misses"]
    assert miss.startswith("k=3 c=8: 2 greedy output(s) differ from plain decoding at the same concurrency")
    assert "prompts p0 at token 7, p1 at token 8" in miss
    assert gate.gate(rows, EvaluateConfig(concurrency=[1, 8], require_identical_outputs=False))["passed"]


def test_numerics_classes_do_not_fail_the_identity_gate():
    rows = [dict(r) for r in ROWS]
    rows[2]["identity"] = {"identical": 5, "batch_numerics": 2, "numerics_tie": 1, "drafter": 0}
    assert gate.gate(rows, EvaluateConfig(concurrency=[1, 8]))["passed"]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_speculative_tokens": [2, 2]}, r"evaluate.num_speculative_tokens: has a value twice"),
        ({"concurrency": [1, 4, 1]}, r"evaluate.concurrency: has a value twice"),
        ({"num_speculative_tokens": [0, 1]}, r"evaluate.num_speculative_tokens: needs values >= 1"),
        ({"turns": "second"}, r"evaluate.turns: must be 'first' or 'both'"),
        ({"min_speedup": {16: 1.0}}, r"evaluate.min_speedup: names concurrency levels \[16\]"),
    ],
)
def test_bad_evaluate_config_names_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        EvaluateConfig(**fields)
