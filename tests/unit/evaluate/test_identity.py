"""Greedy identity classes (evaluate/identity.py) on hand-built token lists and top-2 margins."""

from __future__ import annotations

import pytest

from eagle3_ray.evaluate import identity

pytestmark = pytest.mark.unit

PLAIN = [5, 6, 7, 8, 9]
WIDE = [2.0] * 5  # plain decoding's top-2 margin at every position: far from a tie
BF16 = identity.TIE_MARGIN_NATS["bfloat16"]


def classify(spec, plain, others, margins):
    return identity.classify(spec, plain, others, margins, tie_margin_nats=BF16)


def test_equal_outputs_are_identical_even_when_plain_decoding_shifts_elsewhere():
    got = classify(PLAIN, PLAIN, [[5, 6, 1, 1, 1]], WIDE)
    assert got == {"class": "identical", "first_diff_token": None, "plain_shift_token": 2, "margin": None}


def test_a_difference_where_plain_decoding_itself_changes_with_batch_shape_is_batch_numerics():
    got = classify([5, 6, 7, 3, 3], PLAIN, [[5, 6, 7, 4, 4]], WIDE)
    assert got["class"] == "batch_numerics" and got["first_diff_token"] == 3 and got["plain_shift_token"] == 3
    earlier = classify([5, 6, 7, 3, 3], PLAIN, [[5, 1, 1, 1, 1], PLAIN], WIDE)
    assert earlier["class"] == "batch_numerics" and earlier["plain_shift_token"] == 1


def test_plain_shifting_only_after_the_drafter_departs_does_not_excuse_the_drafter():
    got = classify([5, 3, 3, 3, 3], PLAIN, [[5, 6, 7, 1, 1]], WIDE)
    assert got["class"] == "drafter" and (got["first_diff_token"], got["plain_shift_token"]) == (1, 3)


def test_a_near_tie_in_plain_top2_at_the_first_difference_is_a_numerics_tie():
    margins = [2.0, 2.0, 0.01, 2.0, 2.0]
    got = classify([5, 6, 4, 4, 4], PLAIN, [PLAIN], margins)
    assert got == {"class": "numerics_tie", "first_diff_token": 2, "plain_shift_token": None, "margin": 0.01}
    clear = classify([5, 6, 4, 4, 4], PLAIN, [PLAIN], [2.0, 2.0, 0.5, 2.0, 2.0])
    assert clear["class"] == "drafter" and clear["margin"] == 0.5


def test_a_gap_of_one_or_two_bf16_rounding_steps_is_a_tie_and_the_limit_follows_the_dtype():
    assert [classify([4], PLAIN, [], [gap] * 5)["class"] for gap in (0.0, 0.125, 0.25, 0.375)] == [
        "numerics_tie",
        "numerics_tie",
        "numerics_tie",
        "drafter",
    ]
    fp32 = identity.TIE_MARGIN_NATS["float32"]
    assert identity.classify([4], PLAIN, [], [0.125] * 5, tie_margin_nats=fp32)["class"] == "drafter"
    assert set(identity.TIE_MARGIN_NATS) == {"bfloat16", "float16", "float32"}


def test_an_output_that_stops_early_differs_at_its_end_and_a_missing_margin_is_no_tie():
    shorter = classify([5, 6], PLAIN, [], [0.0] * 5)
    assert shorter["first_diff_token"] == 2 and shorter["class"] == "numerics_tie"
    longer = classify(PLAIN, [5, 6], [], [0.0, 0.0])
    assert longer == {"class": "drafter", "first_diff_token": 2, "plain_shift_token": None, "margin": None}


def test_compare_and_counts_name_every_class():
    spec = [PLAIN, [5, 6, 7, 3, 3], [5, 3, 3, 3, 3], [5, 6, 4, 4, 4]]
    plain = [PLAIN] * 4
    other = [PLAIN, [5, 6, 7, 4, 4], PLAIN, PLAIN]
    margins = [WIDE, WIDE, WIDE, [2.0, 2.0, 0.01, 2.0, 2.0]]
    items = identity.compare(spec, plain, [other], margins, tie_margin_nats=BF16)
    assert [i["class"] for i in items] == ["identical", "batch_numerics", "drafter", "numerics_tie"]
    assert identity.counts(items) == {
        "identical": 1,
        "batch_numerics": 1,
        "numerics_tie": 1,
        "numerics_fp32": 0,
        "drafter": 1,
    }
    assert identity.counts([]) == dict.fromkeys(identity.CLASSES, 0)


def test_a_drafter_output_whose_float32_decodes_agree_is_numerics_and_one_that_still_differs_stays_drafter():
    flagged = classify([5, 3, 3, 3, 3], PLAIN, [], WIDE)
    assert flagged["class"] == "drafter"
    agreed = identity.recheck(flagged, [9, 9, 8], [9, 9, 8])
    assert agreed["class"] == "numerics_fp32" and agreed["fp32_first_diff_token"] is None
    assert agreed["fp32_tokens"] == 3
    assert agreed["first_diff_token"] == flagged["first_diff_token"] == 1  # the bf16 finding stays on record
    still = identity.recheck(flagged, [9, 9, 8], [9, 7, 8])
    assert still["class"] == "drafter" and still["fp32_first_diff_token"] == 1


def test_top2_margin_is_the_gap_between_the_two_most_likely_tokens():
    assert identity.top2_margin({11: -0.7, 12: -0.75}) == pytest.approx(0.05)
    assert identity.top2_margin({12: -2.0, 11: -0.1, 13: -3.0}) == pytest.approx(1.9)


def test_noise_floor_lists_plain_decodings_own_flips_with_their_margin():
    low = [PLAIN, PLAIN, [1, 2]]
    high = [PLAIN, [5, 6, 0, 0, 0], [1]]
    floor = identity.noise_floor(low, high, [WIDE, [1.0, 1.0, 0.02, 1.0, 1.0], [0.3, 0.4]])
    assert floor == [
        {"index": 1, "first_diff_token": 2, "margin": 0.02},
        {"index": 2, "first_diff_token": 1, "margin": 0.4},
    ]
