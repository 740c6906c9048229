"""Ingest-stage output for the generate tests, written with the ingest stage's own schema, ids and prompt lengths
(without running Ray Data)."""

from __future__ import annotations

import pyarrow as pa

from eagle3_ray.core import stage, storage
from eagle3_ray.ingest.formats import conversation_id
from eagle3_ray.ingest.stage import CONVERSATION_COLUMNS, NORMALISED_SCHEMA, prompt_lengths

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
    """ingest/{version}/conversations.parquet at the version `cfg` determines, as the ingest stage writes it."""
    rows = [
        {
            "id": conversation_id(msgs),
            "messages": msgs,
            "source": f"fixture.jsonl:{i}",
            "num_turns": sum(m["role"] == "user" for m in msgs),
            "num_prompt_tokens": n,
        }
        for i, (msgs, n) in enumerate(zip(convs, prompt_lengths(tokenizer, convs), strict=True))
    ]
    schema = pa.schema([NORMALISED_SCHEMA.field(name) for name in CONVERSATION_COLUMNS])
    table = pa.Table.from_pylist(rows, schema=schema)
    out = stage.output_dir(cfg, "ingest")
    storage.write_parquet_atomic(storage.join(out, "conversations.parquet"), table)
    storage.write_json_atomic(storage.join(out, "summary.json"), {"rows_ok": table.num_rows})
    storage.mark_complete(out, {"rows_ok": table.num_rows})
    return table
