"""The CPU-checkable parts of the adaptation benchmark (bench/gpu/adapt.py): the HumanEval split into training and
held-out prompts, prompt files that keep their ingest version, and the cost of a cold start read from the
per-epoch replay estimates."""

from __future__ import annotations

import json
import os

import pytest

from bench.gpu.adapt import SCALES, cold_start_cost, parse_variants, write_prompts

pytestmark = pytest.mark.unit


def _rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_the_held_out_code_prompts_share_no_humaneval_row_with_the_training_prompts(tmp_path):
    paths = write_prompts(str(tmp_path), SCALES["gpu"])
    train, held_out = _rows(paths["code_train"]), _rows(paths["eval"])
    assert len(train) == 100 and paths["num_eval"] == len(held_out) == 64 + 40
    code = [r for r in held_out if r["category"] == "code"]
    assert [r["id"] for r in code] == [f"humaneval:HumanEval/{i}" for i in range(64)]
    assert {r["id"] for r in train} == {f"humaneval:HumanEval/{i}" for i in range(64, 164)}
    assert {r["messages"][0]["content"] for r in train}.isdisjoint(r["messages"][0]["content"] for r in code)
    assert [r["category"] for r in held_out[64:]] == ["mtbench"] * 40


def test_writing_the_same_prompts_again_leaves_the_files_untouched(tmp_path):
    # ingest's version hashes an input file's size and modification time: a rewrite would regenerate the data
    paths = write_prompts(str(tmp_path), SCALES["cpu"])
    os.utime(paths["code_train"], (1, 1))
    write_prompts(str(tmp_path), SCALES["cpu"])
    assert os.stat(paths["code_train"]).st_mtime == 1


def test_variants_are_named_by_kind_and_learning_rate():
    assert parse_variants("adapt@1e-3,scratch@3e-4") == [
        ("adapt-lr1e-3", "adapt", 1e-3),
        ("scratch-lr3e-4", "scratch", 3e-4),
    ]
    with pytest.raises(SystemExit):
        parse_variants("finetune@1e-3")


def test_the_cold_starts_cost_is_the_first_epoch_the_warm_start_reaches_its_last_estimate():
    def drafter(curve):
        return {"train": {"val_replay_by_epoch": curve}}

    drafters = {
        "base": {"train": None},
        "adapt-lr1e-3": drafter([1.30, 1.42, 1.50, 1.55]),
        "adapt-lr3e-4": drafter([1.10, 1.20, 1.30, 1.35]),
        "scratch-lr1e-3": drafter([1.05, 1.20, 1.33, 1.41]),
    }
    cost = {c["warm"]: c for c in cold_start_cost(drafters)}
    assert cost["adapt-lr1e-3"]["warm_epochs_to_reach"] == 2
    assert cost["adapt-lr1e-3"]["fraction_of_cold_epochs"] == 0.5
    assert cost["adapt-lr3e-4"]["warm_epochs_to_reach"] is None
