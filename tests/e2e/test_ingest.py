"""Ingest stage on real files and a real local Ray: every input format, rejects with reasons, dedupe, turns,
strict mode, errors before work, idempotent versioned output."""

from __future__ import annotations

import json
import os

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from eagle3_ray.core import storage
from eagle3_ray.core.config import load_config
from eagle3_ray.core.prompts import tiny_prompts

pytestmark = pytest.mark.e2e


# Ray reads its auth settings when first imported: the stage module (which imports ray) is imported only after the
# session fixtures have set them, through this fixture.
MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


@pytest.fixture()
def ingest(ray_session):
    from eagle3_ray.ingest import stage as ingest

    assert ingest.MESSAGES_TYPE == MESSAGES_TYPE
    return ingest


SYSTEM = {"role": "system", "content": "Be brief."}


U1, A1, U2 = (
    {"role": "user", "content": "Write a function that adds two numbers."},
    {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
    {"role": "user", "content": "Now add type hints."},
)


CONVERSATION = [SYSTEM, U1, A1, U2]


SHAREGPT = [
    {"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
    for m in CONVERSATION
]


def write_jsonl(path, rows) -> str:
    with open(path, "wb") as f:
        for row in rows:
            f.write(row if isinstance(row, bytes) else json.dumps(row).encode())
            f.write(b"\n")
    return str(path)


def make_cfg(tmp_path, tiny_llama, inputs, *overrides):
    return load_config(
        None,
        [
            f"run.storage_path={tmp_path / 'runs'}",
            f"verifier.path={tiny_llama}",
            f"ingest.inputs={json.dumps([str(i) for i in inputs])}",
            *overrides,
        ],
    )


def read_output(summary, name="conversations.parquet") -> list[dict]:
    return storage.read_parquet(storage.join(summary["path"], name)).to_pylist()


# Each format: how to write one conversation and what it normalises to with turns=all.
def _jsonl_messages(d):
    return write_jsonl(d / "chat.jsonl", [{"messages": CONVERSATION}]), CONVERSATION


def _jsonl_sharegpt(d):
    return write_jsonl(d / "sharegpt.jsonl", [{"conversations": SHAREGPT, "id": "x"}]), CONVERSATION


def _jsonl_prompt(d):
    return write_jsonl(d / "prompt.jsonl", [{"prompt": U1["content"], "system": "Be brief."}]), [SYSTEM, U1]


def _jsonl_instruction(d):
    rows = [{"instruction": "Sort this list.", "input": "[3, 1, 2]", "output": "[1, 2, 3]"}]
    return write_jsonl(d / "alpaca.jsonl", rows), [
        {"role": "user", "content": "Sort this list.\n\n[3, 1, 2]"},
        {"role": "assistant", "content": "[1, 2, 3]"},
    ]


def _parquet_messages(d):
    pq.write_table(pa.table({"messages": pa.array([CONVERSATION], MESSAGES_TYPE)}), d / "chat.parquet")
    return str(d / "chat.parquet"), CONVERSATION


def _datasets_folder(d):
    datasets.Dataset.from_list([{"conversations": SHAREGPT}]).save_to_disk(str(d / "hf_folder"))
    return str(d / "hf_folder"), CONVERSATION


def _csv_prompt(d):
    (d / "prompts.csv").write_text(f'prompt,source_name\n"{U1["content"]}",demo\n')
    return str(d / "prompts.csv"), [U1]


def _file_uri(d):
    return "file://" + write_jsonl(d / "uri.jsonl", [{"messages": [U1]}]), [U1]


FORMATS = [
    _jsonl_messages,
    _jsonl_sharegpt,
    _jsonl_prompt,
    _jsonl_instruction,
    _parquet_messages,
    _datasets_folder,
    _csv_prompt,
    _file_uri,
]


@pytest.mark.parametrize("make_input", FORMATS, ids=[f.__name__.strip("_") for f in FORMATS])
def test_every_input_format_ingests_to_the_contract_schema(ingest, tiny_llama, tmp_path, make_input):
    uri, expected = make_input(tmp_path)
    summary = ingest.run(make_cfg(tmp_path, tiny_llama, [uri], "ingest.turns=all"))

    table = storage.read_parquet(storage.join(summary["path"], "conversations.parquet"))
    assert table.schema == pa.schema(
        [
            ("id", pa.string()),
            ("messages", MESSAGES_TYPE),
            ("source", pa.string()),
            ("num_turns", pa.int32()),
            ("num_prompt_tokens", pa.int32()),
        ]
    )
    [row] = table.to_pylist()
    assert row["messages"] == expected
    assert row["source"] == f"{uri}:0"
    assert row["num_turns"] == sum(m["role"] == "user" for m in expected)
    assert len(row["id"]) == 16 and int(row["id"], 16) >= 0
    assert (summary["rows_in"], summary["rows_ok"], summary["rows_rejected"], summary["duplicates"]) == (1, 1, 0, 0)


def test_prompt_token_count_is_the_chat_templated_prompt_with_generation_prompt(ingest, tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    summary = ingest.run(make_cfg(tmp_path, tiny_llama, [_jsonl_messages(tmp_path)[0]], "ingest.turns=all"))
    [row] = read_output(summary)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    ids = tokenizer.apply_chat_template([SYSTEM, U1], add_generation_prompt=True, return_dict=False)
    assert row["num_prompt_tokens"] == len(ids)


BROKEN_ROWS = [  # (line, expected reason or None when kept)
    ({"messages": [U1, A1]}, None),
    ({"messages": [{"role": "user", "content": "   "}]}, "empty_content"),
    ({"messages": [{"role": "user"}]}, "missing_content"),
    ({"messages": [U1, {"role": "tool", "content": "42"}]}, "unknown_role"),
    ({"messages": [{"role": "user", "content": 123}]}, "non_string_content"),
    (b'{"messages": [{"role": "user", "content": "lone \\ud800 surrogate"}]}', "invalid_utf8"),
    (b'{"messages": [{"role": "user", "content": "caf\xff"}]}', "invalid_utf8"),
    ({"messages": [U1, U2]}, "not_alternating"),
    ({"messages": [SYSTEM, A1]}, "no_user_turn"),
    (b'{"messages": [', "invalid_json"),
    ({"messages": [{"role": "user", "content": "x " * 400}]}, "prompt_too_long"),
    (b"[1, 2]", "not_an_object"),
    ({"text": "no known column in this row"}, "no_known_column"),
    ({"messages": "not a list"}, "bad_messages"),
    ({"messages": [U1, A1]}, "duplicate"),
]


def test_broken_rows_land_in_rejects_with_their_reason_and_counts_reconcile(ingest, tiny_llama, tmp_path, capsys):
    jsonl = write_jsonl(tmp_path / "broken.jsonl", [row for row, _ in BROKEN_ROWS])
    parquet = str(tmp_path / "binary.parquet")
    pq.write_table(pa.table({"prompt": pa.array([b"a valid prompt", b"\xff\xfe bad bytes"], pa.binary())}), parquet)

    summary = ingest.run(make_cfg(tmp_path, tiny_llama, [jsonl, parquet], "ingest.max_prompt_tokens=64"))

    expected = {
        f"{jsonl}:{i}": reason for i, (_, reason) in enumerate(BROKEN_ROWS) if reason not in (None, "duplicate")
    }
    expected[f"{parquet}:1"] = "invalid_utf8"
    rejects = read_output(summary, "rejects.parquet")
    assert {r["source"]: r["reason"] for r in rejects} == expected
    assert all(r["detail"] and r["raw"] for r in rejects)
    assert [r["source"] for r in read_output(summary)] == [f"{jsonl}:0", f"{parquet}:0"]
    assert (summary["rows_in"], summary["rows_ok"], summary["rows_rejected"], summary["duplicates"]) == (
        len(BROKEN_ROWS) + 2,
        2,
        len(expected),
        1,
    )
    assert summary["rows_in"] == summary["rows_ok"] + summary["rows_rejected"] + summary["duplicates"]
    assert summary == storage.read_json(storage.join(summary["path"], "summary.json"))
    out = capsys.readouterr().out
    assert "[eagle3 ingest] progress" in out and "rows_per_s=" in out and f"rejects={len(expected)}" in out


def test_duplicates_keep_the_first_row_in_source_order_across_files_and_formats(ingest, tiny_llama, tmp_path):
    first = write_jsonl(tmp_path / "a.jsonl", [{"messages": [U2]}, {"messages": [U1]}, {"messages": [U1]}])
    second = write_jsonl(
        tmp_path / "b.jsonl",
        [
            {"conversations": [{"from": "human", "value": U1["content"]}]},
            {"prompt": U2["content"]},
            {"prompt": "something new"},
        ],
    )
    summary = ingest.run(make_cfg(tmp_path, tiny_llama, [first, second]))
    assert [r["source"] for r in read_output(summary)] == [f"{first}:0", f"{first}:1", f"{second}:2"]
    assert (summary["rows_in"], summary["rows_ok"], summary["duplicates"]) == (6, 3, 3)


def test_turns_first_keeps_system_and_first_user_turn_and_all_keeps_the_conversation(ingest, tiny_llama, tmp_path):
    path = write_jsonl(tmp_path / "multi.jsonl", [{"messages": CONVERSATION}])
    [first] = read_output(ingest.run(make_cfg(tmp_path, tiny_llama, [path], "ingest.turns=first")))
    [whole] = read_output(ingest.run(make_cfg(tmp_path, tiny_llama, [path], "ingest.turns=all")))
    assert first["messages"] == [SYSTEM, U1] and first["num_turns"] == 1
    assert whole["messages"] == CONVERSATION and whole["num_turns"] == 2
    assert first["num_prompt_tokens"] == whole["num_prompt_tokens"]
    assert first["id"] != whole["id"]


def test_strict_mode_fails_naming_the_row_and_reason_and_writes_nothing(ingest, tiny_llama, tmp_path):
    path = write_jsonl(
        tmp_path / "one_bad.jsonl", [{"messages": [U1]}, {"messages": [{"role": "robot", "content": "hi"}]}]
    )
    cfg = make_cfg(tmp_path, tiny_llama, [path], "ingest.strict=true")
    with pytest.raises(ValueError, match=rf"ingest.strict: row {path}:1 rejected: unknown_role"):
        ingest.run(cfg)
    assert not storage.exists(storage.join(cfg.run.run_dir, "ingest", "LATEST.json"))


@pytest.mark.parametrize(
    "name, content, message",
    [
        ("missing.jsonl", None, "does not exist"),
        ("no_known.jsonl", b'{"text": "a"}\n{"body": "b"}\n', "none of the known columns"),
        ("no_known.parquet", "parquet", "none of the known columns"),
        ("notes.txt", b"hello\n", "unsupported extension '.txt'"),
    ],
)
def test_bad_input_paths_fail_before_any_work(ingest, tiny_llama, tmp_path, name, content, message):
    path = tmp_path / name
    if content == "parquet":
        pq.write_table(pa.table({"text": ["a"]}), path)
    elif content is not None:
        path.write_bytes(content)
    good = write_jsonl(tmp_path / "good.jsonl", [{"messages": [U1]}])
    cfg = make_cfg(tmp_path, tiny_llama, [good, path])
    with pytest.raises(ValueError, match=rf"ingest.inputs\[1\]: .*{message}"):
        ingest.run(cfg)
    assert not os.path.exists(cfg.run.run_dir)


def test_rerun_is_a_noop_and_changed_config_or_input_writes_a_new_version(ingest, tiny_llama, tmp_path, capsys):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [U1]}, {"messages": [U2]}])
    cfg = make_cfg(tmp_path, tiny_llama, [path])
    first = ingest.run(cfg)
    done_mtime = os.stat(os.path.join(first["path"], "_SUCCESS")).st_mtime_ns

    again = ingest.run(cfg)
    assert again["skipped"] is True and again["path"] == first["path"]
    assert os.stat(os.path.join(first["path"], "_SUCCESS")).st_mtime_ns == done_mtime
    assert f"[eagle3 ingest] already_done version={first['version']}" in capsys.readouterr().out

    changed = ingest.run(make_cfg(tmp_path, tiny_llama, [path], "ingest.max_prompt_tokens=512"))
    assert changed["version"] != first["version"]
    write_jsonl(path, [{"messages": [U1]}, {"messages": [U2]}, {"prompt": "a third prompt"}])
    grown = ingest.run(cfg)
    assert grown["version"] not in (first["version"], changed["version"]) and grown["rows_ok"] == 3
    assert storage.latest(cfg.run.run_dir, "ingest")["version"] == grown["version"]
    provenance = storage.read_json(storage.join(grown["path"], "provenance.json"))
    assert provenance["config"]["ingest"]["inputs"] == [path] and provenance["input_fingerprint"]


def test_builtin_tiny_prompts_ingest_without_downloads_and_eval_split_is_disjoint(ingest, tiny_llama, tmp_path):
    summary = ingest.run(make_cfg(tmp_path, tiny_llama, ["builtin:tiny_prompts"], "ingest.turns=all"))
    rows = read_output(summary)
    assert summary["rows_ok"] == len(tiny_prompts()) == 200
    assert sum(r["num_turns"] > 1 for r in rows) == 40
    assert rows[7]["source"] == "builtin:tiny_prompts:7"
    train_users = {m["content"] for r in rows for m in r["messages"] if m["role"] == "user"}
    eval_users = {m["content"] for c in tiny_prompts(split="eval") for m in c["messages"] if m["role"] == "user"}
    assert len(eval_users) == 100 and not train_users & eval_users
    assert tiny_prompts(split="eval", num_prompts=5) == tiny_prompts(split="eval")[:5]


def test_jsonl_starting_with_a_utf8_bom_keeps_its_first_row(ingest, tiny_llama, tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(
        b"\xef\xbb\xbf"
        + json.dumps({"prompt": U1["content"]}).encode()
        + b"\n"
        + json.dumps({"prompt": U2["content"]}).encode()
        + b"\n"
    )
    summary = ingest.run(make_cfg(tmp_path, tiny_llama, [path]))
    assert [r["source"] for r in read_output(summary)] == [f"{path}:0", f"{path}:1"]
    assert (summary["rows_ok"], summary["rows_rejected"]) == (2, 0)


def test_folder_holding_a_json_array_file_ingests_like_the_file_named_directly(ingest, tiny_llama, tmp_path):
    folder = tmp_path / "arrays"
    folder.mkdir()
    (folder / "chats.json").write_text(json.dumps([{"messages": [U1, A1]}, {"prompt": U2["content"]}]))
    direct = read_output(ingest.run(make_cfg(tmp_path, tiny_llama, [folder / "chats.json"], "ingest.turns=all")))
    via_folder = read_output(ingest.run(make_cfg(tmp_path, tiny_llama, [folder], "ingest.turns=all")))
    assert [r["messages"] for r in via_folder] == [r["messages"] for r in direct] == [[U1, A1], [U2]]
    assert [r["source"] for r in via_folder] == [f"{folder}/chats.json:0", f"{folder}/chats.json:1"]


@pytest.mark.parametrize("name", ["empty.jsonl", "empty.parquet", "folder/empty.jsonl"])
def test_a_zero_byte_file_fails_with_one_message_naming_it_and_no_chained_traceback(ingest, tiny_llama, tmp_path, name):
    path = tmp_path / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(b"")
    cfg = make_cfg(tmp_path, tiny_llama, [path.parent if "/" in name else path])
    with pytest.raises(ValueError, match=rf"^ingest.inputs\[0\]: {path} is empty \(0 bytes\)$") as err:
        ingest.run(cfg)
    assert err.value.__cause__ is None and err.value.__context__ is None  # nothing printed above the message
    assert not os.path.exists(cfg.run.run_dir)
