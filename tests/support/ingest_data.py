"""Ingest-format inputs for the generate tests, written directly (independent of the ingest stage)."""

from __future__ import annotations

import hashlib
import json

import pyarrow as pa

from eagle3_ray.core import stage, storage

TOPICS = [
    "parse a csv file",
    "sort a list of tuples",
    "read a json config",
    "retry a network call",
    "merge two dicts",
    "walk a directory tree",
    "format a date",
    "count words in a file",
    "validate an email address",
    "compute a moving average",
    "flatten a nested list",
    "cache a function result",
]
MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


def conversations(num_single: int = 24, num_multi: int = 4, long_words: int = 0) -> list[list[dict]]:
    convs = []
    for i in range(num_single):
        msgs = [{"role": "user", "content": f"Write a Python function to {TOPICS[i % len(TOPICS)]} (variant {i})."}]
        if i % 5 == 0:
            msgs.insert(0, {"role": "system", "content": "You are a terse coding assistant."})
        convs.append(msgs)
    for i in range(num_multi):
        convs.append(
            [
                {"role": "user", "content": f"How do I {TOPICS[i]}?"},
                {"role": "assistant", "content": "An old answer that gets regenerated."},
                {"role": "user", "content": "Now add error handling and tests."},
                {"role": "assistant", "content": "Another old answer."},
            ]
        )
    if long_words:
        code = " ".join(["def f(x): return x"] * long_words)
        convs.append([{"role": "user", "content": "Explain this code: " + code}])
    return convs


def write_ingest(cfg, tokenizer, convs: list[list[dict]]) -> pa.Table:
    """ingest/{version}/conversations.parquet as docs/stages.md specifies, at the version `cfg` determines."""
    rows = []
    for i, msgs in enumerate(convs):
        first = next((j for j, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs))
        text = tokenizer.apply_chat_template(msgs[:first], tokenize=False, add_generation_prompt=True)
        rows.append(
            {
                "id": hashlib.sha256(json.dumps(msgs).encode()).hexdigest()[:16],
                "messages": msgs,
                "source": f"fixture.jsonl:{i}",
                "num_turns": sum(m["role"] == "user" for m in msgs),
                "num_prompt_tokens": len(tokenizer(text, add_special_tokens=False)["input_ids"]),
            }
        )
    schema = pa.schema(
        [
            ("id", pa.string()),
            ("messages", MESSAGES_TYPE),
            ("source", pa.string()),
            ("num_turns", pa.int32()),
            ("num_prompt_tokens", pa.int32()),
        ]
    )
    table = pa.Table.from_pylist(rows, schema=schema)
    out = stage.output_dir(cfg, "ingest")
    storage.write_parquet_atomic(storage.join(out, "conversations.parquet"), table)
    storage.write_json_atomic(storage.join(out, "summary.json"), {"rows_ok": table.num_rows})
    storage.mark_complete(out, {"rows_ok": table.num_rows})
    return table
