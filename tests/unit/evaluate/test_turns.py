"""MT-Bench-style prompts in the evaluate stage: second turns built after the model's own first answer, categories
decoded and reported group by group. No engine: the tokenizer comes from a tiny verifier built in code."""

from __future__ import annotations

import json

import pytest

from eagle3_ray.core.config import config_from_dict
from eagle3_ray.core.tiny_verifier import IM_END_ID, build_tiny_verifier
from eagle3_ray.evaluate import engine, report
from eagle3_ray.evaluate.measure import concat_runs
from eagle3_ray.evaluate.prompts import (
    check_second_turn_fits,
    level_groups,
    load_prompts,
    prompt_groups,
    second_turn_prompts,
)

pytestmark = pytest.mark.unit

ROWS = [
    {"id": "w1", "category": "writing", "turns": ["Write a haiku about sorting.", "Now make it rhyme."]},
    {"id": "c1", "category": "coding", "turns": ["Reverse a list in Python.", "Do it in place."]},
    {"id": "w2", "category": "writing", "turns": ["Describe a stack.", "Shorter, please."]},
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        build_tiny_verifier("llama", tmp_path_factory.mktemp("v") / "tiny", num_layers=2)
    )


def cfg_for(tmp_path, rows, **fields):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return config_from_dict({"evaluate": {"prompts": str(path), "num_prompts": len(rows), **fields}})


def test_mtbench_rows_load_with_their_category_and_second_turn_only_when_both_turns_are_asked_for(tmp_path):
    both = load_prompts(cfg_for(tmp_path, ROWS, turns="both"))
    assert [p["category"] for p in both] == ["writing", "coding", "writing"]
    assert both[1]["messages"] == [{"role": "user", "content": "Reverse a list in Python."}]
    assert both[1]["second_turn"] == "Do it in place."
    first = load_prompts(cfg_for(tmp_path, ROWS))
    assert all(p["second_turn"] is None for p in first) and first[0]["id"] == "w1"


def test_both_turns_refuse_a_row_without_a_second_turn_naming_the_field(tmp_path):
    rows = [*ROWS, {"messages": [{"role": "user", "content": "only one turn"}]}]
    with pytest.raises(ValueError, match=r"evaluate.turns=both: .*prompts.jsonl row 3 has no second turn"):
        load_prompts(cfg_for(tmp_path, rows, turns="both"))


def test_second_turn_follows_the_models_own_first_answer_through_the_chat_template(tokenizer):
    prompts = [
        {"id": "w1", "messages": [{"role": "user", "content": "Write a haiku."}], "second_turn": "Now rhyme."},
        {"id": "c1", "messages": [{"role": "user", "content": "Reverse a list."}], "second_turn": "In place."},
    ]
    answers = [tokenizer.encode("def f(x):\n    return x", add_special_tokens=False) + [IM_END_ID], []]
    first_ids = [
        tokenizer.apply_chat_template(p["messages"], add_generation_prompt=True, return_dict=False) for p in prompts
    ]
    second = second_turn_prompts(tokenizer, prompts, answers)
    text = tokenizer.decode(second[0])
    assert text.endswith(
        "<|im_start|>user\nWrite a haiku.<|im_end|>\n<|im_start|>assistant\ndef f(x):\n    return x<|im_end|>\n"
        "<|im_start|>user\nNow rhyme.<|im_end|>\n<|im_start|>assistant\n"
    )  # the answer's own end-of-turn token is not doubled
    assert second[0][: len(first_ids[0])] == first_ids[0]  # turn 2 extends turn 1's prompt
    assert "<|im_start|>assistant\n<|im_end|>\n<|im_start|>user\nIn place.<|im_end|>" in tokenizer.decode(second[1])
    assert second_turn_prompts(tokenizer, prompts, answers) == second  # the same ids for every engine


def test_second_turns_that_cannot_fit_the_context_are_refused_before_any_engine_starts(tmp_path, tokenizer):
    cfg = cfg_for(tmp_path, ROWS, turns="both", max_tokens=200)
    prompts = load_prompts(cfg)
    check_second_turn_fits(tokenizer, prompts, cfg)  # 2048 tokens is room enough
    small = config_from_dict({**cfg.to_dict(), "verifier": {**cfg.to_dict()["verifier"], "max_model_len": 420}})
    with pytest.raises(ValueError, match=r"need more than verifier.max_model_len=420 .*evaluate.max_tokens=200"):
        check_second_turn_fits(tokenizer, prompts, small)


def test_categories_are_decoded_group_by_group_so_no_wave_mixes_two():
    prompts = [{"category": r["category"]} for r in ROWS]
    groups = prompt_groups(prompts, 1)
    assert groups == [
        {"turn": 1, "category": "writing", "indices": [0, 2]},
        {"turn": 1, "category": "coding", "indices": [1]},
    ]
    assert [engine.waves(g["indices"], 1) for g in groups] == [[[0], [2]], [[1]]]
    assert engine.waves(list(range(5)), 2) == [[0, 1], [2, 3], [4]]
    assert prompt_groups([{"id": "a"}, {"id": "b"}], 1) == [{"turn": 1, "category": None, "indices": [0, 1]}]


def test_a_concurrency_no_category_can_fill_decodes_in_prompt_order_at_full_concurrency():
    prompts = [{"category": c} for c in ("a", "a", "b", "b", "b")]
    assert len(prompt_groups(prompts, 2)) == 2
    assert prompt_groups(prompts, 3) == [{"turn": 1, "category": None, "indices": [0, 1, 2, 3, 4]}]


def test_both_turns_are_grouped_turn_after_turn_over_every_prompt_twice():
    prompts = [{"category": c} for c in ("a", "b", "a", "b")]
    groups = level_groups(prompts, 2, (1, 2))
    assert [(g["turn"], g["category"], g["indices"]) for g in groups] == [
        (1, "a", [0, 2]),
        (1, "b", [1, 3]),
        (2, "a", [4, 6]),
        (2, "b", [5, 7]),
    ]
    assert [g["turn"] for g in level_groups(prompts, 4, (2,))] == [2]


def spec(drafts: int, accepted: int, per_pos: list[int]) -> dict:
    return {"num_drafts": drafts, "num_draft_tokens": 3 * drafts, "num_accepted_tokens": accepted,
            "accepted_per_pos": per_pos}  # fmt: skip


def group(turn: int, category: str, wall_s: float, tokens: int, s: dict) -> dict:
    return {"turn": turn, "category": category, "wall_s": wall_s, "output_tokens": tokens, "spec": s}


def test_turn_two_measurements_join_turn_one_and_report_speedup_and_acceptance_per_category_and_turn():
    zero = spec(0, 0, [])
    base1 = {"outputs": [[1] * 10, [1] * 10], "wall_s": 4.0, "spec": zero,
             "groups": [group(1, "writing", 2.0, 10, zero), group(1, "coding", 2.0, 10, zero)],
             "reference": {"outputs": [[1] * 10, [1] * 10], "margins": [[1.0] * 10, [1.0] * 10]},
             "per_request": [None, None]}  # fmt: skip
    base2 = {**base1, "groups": [group(2, "writing", 2.0, 10, zero), group(2, "coding", 2.0, 10, zero)]}
    base = concat_runs(base1, base2)
    assert len(base["outputs"]) == 4 and base["wall_s"] == 8.0 and len(base["reference"]["margins"]) == 4
    assert base["per_request"] == [None] * 4
    groups = [
        group(1, "writing", 1.0, 10, spec(5, 5, [4, 1])),
        group(1, "coding", 2.0, 10, spec(5, 0, [0, 0])),
        group(2, "writing", 1.0, 10, spec(4, 6, [3, 2, 1])),
        group(2, "coding", 4.0, 10, spec(10, 0, [])),
    ]
    run = {"outputs": [[1] * 10] * 4, "wall_s": 8.0, "spec": spec(24, 11, [7, 3, 1]), "groups": groups,
           "per_request": [None] * 4}  # fmt: skip
    items = [{"class": "identical", "first_diff_token": None, "plain_shift_token": None, "margin": None}] * 4
    labels = [{"prompt": p, "turn": t, "category": c} for t in (1, 2) for p, c in (("w1", "writing"), ("c1", "coding"))]
    row = report.spec_row(3, 1, run, base, base, items, labels)
    assert row["speedup"] == pytest.approx(1.0) and row["identity"]["identical"] == 4
    assert row["acceptance_per_position"] == pytest.approx([7 / 24, 3 / 24, 1 / 24])
    writing, coding = row["by_category"]["writing"], row["by_category"]["coding"]
    assert writing["speedup"] == pytest.approx(2.0) and writing["mean_acceptance_length"] == pytest.approx(1 + 11 / 9)
    assert writing["acceptance_per_position"] == pytest.approx([7 / 9, 3 / 9, 1 / 9])
    assert coding["speedup"] == pytest.approx(4 / 6) and coding["acceptance_rate"] == 0.0
    assert set(row["by_turn"]) == {"1", "2"} and row["by_turn"]["1"]["speedup"] == pytest.approx(4 / 3)
