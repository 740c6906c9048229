"""The ingest output for conversations already in memory, written without Ray: the schema, ids, turn counts and
prompt lengths the ingest stage gives them, at the version a config determines, finished as every stage finishes.

    from eagle3_ray.ingest.in_memory import write_output
    write_output(cfg, AutoTokenizer.from_pretrained(cfg.verifier.path), [[{"role": "user", "content": "hi"}]])

For benchmarks and tests that bring their own conversations to the generate stage instead of input files. The
conversations must already be in the normalised form (`formats.normalise`: [system?], user, assistant, ...); they are
written as given, in order, with no rejects and no dedupe.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from eagle3_ray.core import stage, storage
from eagle3_ray.core.config import Config
from eagle3_ray.ingest.formats import conversation_id
from eagle3_ray.ingest.stage import CONVERSATION_COLUMNS, NORMALISED_SCHEMA, prompt_lengths, version

SCHEMA = pa.schema([NORMALISED_SCHEMA.field(name) for name in CONVERSATION_COLUMNS])


def write_output(cfg: Config, tokenizer: Any, conversations: list[list[dict]], *, source: str = "memory") -> pa.Table:
    """ingest/{version}/conversations.parquet for `conversations` at the version `cfg` determines (row i's source is
    `{source}:{i}`), with summary.json, provenance.json, `_SUCCESS` and LATEST.json; returns the table. A version
    already finished is kept as it is."""
    rows = [
        {
            "id": conversation_id(messages),
            "messages": messages,
            "source": f"{source}:{i}",
            "num_turns": sum(m["role"] == "user" for m in messages),
            "num_prompt_tokens": num_tokens,
        }
        for i, (messages, num_tokens) in enumerate(
            zip(conversations, prompt_lengths(tokenizer, conversations), strict=True)
        )
    ]
    table = pa.Table.from_pylist(rows, schema=SCHEMA)

    def write(out: str) -> dict[str, Any]:
        storage.write_parquet_atomic(storage.join(out, "conversations.parquet"), table)
        return {"rows_in": table.num_rows, "rows_ok": table.num_rows, "rows_rejected": 0, "duplicates": 0}

    stage.run(cfg, "ingest", version(cfg), write, inputs={"conversations": f"{len(rows)} in memory ({source})"})
    return table
