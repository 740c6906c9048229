"""Prompt input formats for the ingest stage: finding the files behind an input, reading them into raw rows, and
normalising one raw row into chat messages or a reject reason. Pure Python + pyarrow (no Ray): `ingest.py` runs
these functions inside Ray Data tasks.

Files: JSONL (one object a line), a JSON array (`[{...}, ...]`, read record by record), Parquet, CSV or a
`datasets` folder. A JSON or JSONL file that was cut off (a download that stopped, a full disk) is read up to its
last whole record; the cut-off tail becomes one reject `truncated_record` naming its byte offset.

Row formats (the first known column a row has wins):
    messages       OpenAI: [{"role": "system"|"user"|"assistant", "content": str | [{"type": "text", "text": str}]}]
    conversations  ShareGPT: [{"from": "system"|"human"|"gpt", "value": str}] (role/content keys also accepted)
    prompt         single turn, optional `system` and `response`/`completion` columns
    instruction    Alpaca: `instruction` + optional `input` (joined by a blank line) + optional `output`
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from eagle3_ray.core import storage
from eagle3_ray.core.config import UserError

KNOWN_COLUMNS = ("messages", "conversations", "prompt", "instruction")
ROLE_ALIASES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant"}
BUILTIN_PREFIX = "builtin:"
FILE_KINDS = {".jsonl": "jsonl", ".parquet": "parquet", ".json": "json", ".csv": "csv"}
DATASETS_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
PEEK_BYTES = 1 << 20
UTF8_BOM = b"\xef\xbb\xbf"  # editors on Windows start UTF-8 files with it; json.loads rejects it
MAX_TAIL_CHARS = 2000  # of a rejected tail kept as its raw text
MAX_RECORD_CHARS = 64 << 20  # a JSON array "record" longer than this is taken as malformed, not as still arriving


class Reject(Exception):
    """A row that cannot become a conversation: `reason` is a short code, `detail` says where and why."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass(frozen=True, slots=True)
class InputFile:
    """One readable unit behind an `ingest.inputs` entry. `kind`: jsonl | json_array | parquet | datasets (a table
    `datasets` loads: a save_to_disk folder or CSV) | builtin (ingest/sources.py)."""

    uri: str
    kind: str


# ---- finding and checking inputs (driver side, before any work) -------------------------------------------------


def expand_input(uri: str, where: str) -> list[InputFile]:
    """The files an input names: itself, a `datasets` folder, or the supported files under a plain folder."""
    if uri.startswith(BUILTIN_PREFIX):
        return [InputFile(uri, "builtin")]
    fs, path = storage.resolve(uri)
    try:
        info = fs.get_file_info(path)
    except OSError as e:
        raise UserError(f"{where}: cannot read {uri}: {e}") from e
    if info.type == pafs.FileType.NotFound:
        raise UserError(f"{where}: input {uri} does not exist")
    if info.type == pafs.FileType.Directory:
        names = {i.base_name for i in fs.get_file_info(pafs.FileSelector(path))}
        if names & set(DATASETS_MARKERS):
            return [InputFile(uri, "datasets")]
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
        found = sorted((i.path[len(path) :].lstrip("/"), i) for i in infos if i.type == pafs.FileType.File)
        files = [
            _input_file(storage.join(uri, rel), info, fs, where)
            for rel, info in found
            if os.path.splitext(rel)[1] in FILE_KINDS
        ]
        if not files:
            raise UserError(
                f"{where}: folder {uri} holds no {', '.join(FILE_KINDS)} files and is not a datasets folder"
            )
        return files
    ext = os.path.splitext(path)[1]
    if ext not in FILE_KINDS:
        raise UserError(f"{where}: {uri} has an unsupported extension {ext!r} (supported: {', '.join(FILE_KINDS)})")
    return [_input_file(uri, info, fs, where)]


def _input_file(uri: str, info: pafs.FileInfo, fs: pafs.FileSystem, where: str) -> InputFile:
    """One file of an input, named directly or found in a folder (the same file reads the same either way)."""
    if info.size == 0:
        raise UserError(f"{where}: {uri} is empty (0 bytes)")
    return InputFile(uri, _file_kind(info.path, fs))


def _file_kind(path: str, fs: pafs.FileSystem) -> str:
    kind = FILE_KINDS[os.path.splitext(path)[1]]
    if kind == "json":
        # `.json` holds either one object per line or one JSON array
        with fs.open_input_stream(path) as f:
            head = f.read(4096).removeprefix(UTF8_BOM).lstrip()
        return "json_array" if head.startswith(b"[") else "jsonl"
    return {"csv": "datasets"}.get(kind, kind)


def column_names(item: InputFile) -> list[str]:
    """Column names of an input, from its schema or (JSON, JSONL) the keys of the records in its first MiB."""
    if item.kind == "builtin":
        return ["messages"]
    if item.kind == "parquet":
        fs, path = storage.resolve(item.uri)
        return pq.read_schema(path, filesystem=fs).names
    if item.kind == "datasets":
        return load_datasets_table(item.uri).column_names
    fs, path = storage.resolve(item.uri)
    with fs.open_input_stream(path) as f:
        head = f.read(PEEK_BYTES).removeprefix(UTF8_BOM)
    keys: set[str] = set()
    if item.kind == "json_array":
        records = [r for _, r, error in json_array_records([_decode(head)], max_rows=1000) if error is None]
    else:
        records = []
        for line in head.splitlines()[:1000]:
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    for record in records:
        keys.update(record if isinstance(record, dict) else ())
    return sorted(keys)


def check_known_columns(item: InputFile, where: str) -> None:
    try:
        names = column_names(item)
    except (OSError, pa.ArrowInvalid) as e:
        # `from None`: the message says all there is; a chained pyarrow traceback would only bury it
        raise UserError(f"{where}: cannot read {item.uri}: {e}") from None
    if not names and item.kind in ("jsonl", "json_array"):
        raise UserError(f"{where}: {item.uri} holds no whole JSON record in its first MiB (cut off, or not JSON?)")
    if not set(names) & set(KNOWN_COLUMNS):
        raise UserError(f"{where}: {item.uri} has none of the known columns {list(KNOWN_COLUMNS)} (found {names[:20]})")


def load_datasets_table(uri: str) -> pa.Table:
    """A `datasets` folder or a CSV file as one Arrow table (all splits of a DatasetDict, in split-name order)."""
    import datasets

    local = uri[len("file://") :] if uri.startswith("file://") else uri
    if os.path.isdir(local):
        loaded = datasets.load_from_disk(local)
    else:
        loaded = datasets.load_dataset("csv", data_files=local, split="train")
    parts = [loaded[k] for k in sorted(loaded)] if isinstance(loaded, datasets.DatasetDict) else [loaded]
    return pa.concat_tables([p.flatten_indices().data.table for p in parts])


# ---- raw rows: (row index, row as ASCII JSON or None, error code or None) ---------------------------------------


def jsonl_rows(data: bytes, max_rows: int | None) -> Iterator[tuple[int, str | None, str | None]]:
    """One raw row per non-blank line; the row index is the 0-based line number. A leading UTF-8 BOM is dropped.
    A last line without its newline that does not parse is the cut-off tail of the file: `truncated_record`."""
    offset = len(data) - len(data := data.removeprefix(UTF8_BOM))
    for index, line in enumerate(data.split(b"\n")):
        start, offset = offset, offset + len(line) + 1
        if max_rows is not None and index >= max_rows:
            return
        if not line.strip():
            continue
        try:
            row = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError as e:
            raw = json.dumps(line.decode("utf-8", "backslashreplace"))
            yield index, raw, f"invalid_utf8:{e.reason} at byte {e.start}"
            continue
        except ValueError as e:
            raw = json.dumps(line.decode("utf-8")[:MAX_TAIL_CHARS])
            if offset > len(data):  # the last line, with no newline after it
                yield (
                    index,
                    raw,
                    f"truncated_record:truncated record at byte {start}: the file ends inside line {index}",
                )
            else:
                yield index, raw, f"invalid_json:{e}"
            continue
        yield index, dumps_row(row), None if isinstance(row, dict) else "not_an_object:a row must be a JSON object"


def json_array_rows(data: bytes, max_rows: int | None) -> Iterator[tuple[int, str | None, str | None]]:
    """One raw row per record of a JSON array file; the row index is the record's 0-based position."""
    for index, record, error in json_array_records([_decode(data)], max_rows=max_rows):
        if error is not None:
            yield index, json.dumps(record), error
        else:
            yield (
                index,
                dumps_row(record),
                None if isinstance(record, dict) else "not_an_object:a record must be a JSON object",
            )


def json_array_records(chunks: Iterable[str], *, max_rows: int | None = None) -> Iterator[tuple[int, Any, str | None]]:
    """The records of one JSON array `[r0, r1, ...]` whose text arrives in `chunks`, decoded one at a time with
    `json.JSONDecoder().raw_decode`, so a 125 MB file is never held whole: `(index, record, None)` per whole record.
    A file cut off inside a record ends with `(index, tail text, "truncated_record:truncated record at byte N: ...")`;
    one that breaks inside the array ends the same way with `invalid_json` (no record after a syntax error can be
    found reliably). A file that stops after a whole record without the closing `]` loses nothing and ends quietly.
    Byte offsets count UTF-8 bytes from the start of the text (decoded with errors="surrogateescape", it round-trips).
    """
    decoder, pending = json.JSONDecoder(), iter(chunks)
    buf, pos, consumed_bytes, index, expect = "", 0, 0, 0, "["

    def read_more() -> bool:
        nonlocal buf, pos, consumed_bytes
        chunk = next(pending, None)
        if chunk is None:
            return False
        consumed_bytes += len(buf[:pos].encode("utf-8", "surrogateescape"))
        buf, pos = buf[pos:] + chunk, 0
        return True

    def at_byte() -> int:
        return consumed_bytes + len(buf[:pos].encode("utf-8", "surrogateescape"))

    while max_rows is None or index < max_rows:
        while True:  # skip whitespace (and a BOM), reading on where the text runs out
            while pos < len(buf) and buf[pos] in " \t\r\n\ufeff":
                pos += 1
            if pos < len(buf) or not read_more():
                break
        if pos == len(buf):
            return  # the text stops between records: nothing is lost
        char = buf[pos]
        if char == "]" and expect in ("first", ","):
            return
        if expect in ("[", ","):
            if char != expect:
                tail = buf[pos : pos + MAX_TAIL_CHARS]
                yield index, tail, f"invalid_json:expected {expect!r} at byte {at_byte()}, found {char!r}"
                return
            pos, expect = pos + 1, "first" if expect == "[" else "record"
            continue
        while True:
            try:
                record, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError as e:
                if len(buf) - pos < MAX_RECORD_CHARS and read_more():
                    continue
                closed = buf.rstrip().endswith("]")
                if closed or len(buf) - pos >= MAX_RECORD_CHARS:
                    detail = f"invalid JSON in record {index} at byte {at_byte()}: {e.msg}; no record after it is read"
                    yield index, buf[pos : pos + MAX_TAIL_CHARS], f"invalid_json:{detail}"
                else:
                    detail = f"truncated record at byte {at_byte()}: the file ends inside record {index}"
                    yield index, buf[pos : pos + MAX_TAIL_CHARS], f"truncated_record:{detail}"
                return
            if end < len(buf) or not read_more():  # a record ending exactly at a chunk's end may go on (a number)
                break
        yield index, record, None
        index, pos, expect = index + 1, end, ","


def _decode(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


def table_rows(table: pa.Table, max_rows: int | None) -> Iterator[tuple[int, str | None, str | None]]:
    rows = table.slice(0, max_rows).to_pylist() if max_rows is not None else table.to_pylist()
    for index, row in enumerate(rows):
        bad = [k for k, v in row.items() if isinstance(v, bytes) and not _is_utf8(v)]
        if bad:
            yield index, dumps_row({k: v for k, v in row.items() if k not in bad}), f"invalid_utf8:column {bad[0]!r}"
            continue
        yield index, dumps_row(row), None


def parquet_rows(data: bytes, max_rows: int | None) -> Iterator[tuple[int, str | None, str | None]]:
    yield from table_rows(pq.read_table(io.BytesIO(data)), max_rows)


def _is_utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def dumps_row(row: Any) -> str:
    # ASCII JSON carries lone surrogates (invalid in Arrow strings) as \ud800 escapes until the row is checked.
    return json.dumps(row, ensure_ascii=True, default=lambda v: v.decode("utf-8") if isinstance(v, bytes) else str(v))


# ---- normalising one row -------------------------------------------------------------------------------------------


def normalise(row: dict[str, Any], turns: str) -> list[dict[str, str]]:
    """Chat messages (roles system/user/assistant) of a raw row, cut to `[system?, user]` when turns == "first".
    The whole conversation is validated either way, so whether a row is rejected never depends on `turns`."""
    column = next((c for c in KNOWN_COLUMNS if row.get(c) is not None), None)
    if column is None:
        nulls = [c for c in KNOWN_COLUMNS if c in row]
        if nulls:
            raise Reject("null_column", f"{nulls[0]} is null")
        raise Reject("no_known_column", f"row has none of {list(KNOWN_COLUMNS)} (keys: {sorted(row)[:10]})")
    if column in ("messages", "conversations"):
        messages = _chat_messages(row[column], column)
    elif column == "prompt":
        messages = _single_turn(row, "prompt", row.get("system"), row.get("response", row.get("completion")))
    else:
        messages = _single_turn(row, "instruction", None, row.get("output"))
    _check_order(messages)
    if turns == "first":
        first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
        messages = messages[: first_user + 1]
    return messages


def _chat_messages(items: Any, column: str) -> list[dict[str, str]]:
    if not isinstance(items, list):
        raise Reject("bad_messages", f"{column} must be a list of messages, got {type(items).__name__}")
    if not items:
        raise Reject("empty_messages", f"{column} is an empty list: a conversation needs at least a user turn")
    messages = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise Reject("bad_messages", f"{column}[{i}] must be an object, got {type(item).__name__}")
        role = item.get("role", item.get("from"))
        if role not in ROLE_ALIASES:
            raise Reject("unknown_role", f"{column}[{i}] has role {role!r}")
        content = item.get("content", item.get("value"))
        messages.append({"role": ROLE_ALIASES[role], "content": _text(content, f"{column}[{i}]")})
    return messages


def _single_turn(row: dict[str, Any], column: str, system: Any, response: Any) -> list[dict[str, str]]:
    prompt = _text(row[column], column)
    if column == "instruction" and row.get("input") is not None:
        extra = _text(row["input"], "input", allow_empty=True)
        prompt = f"{prompt}\n\n{extra}" if extra.strip() else prompt
    messages = [{"role": "user", "content": prompt}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": _text(system, "system")})
    if response is not None:
        messages.append({"role": "assistant", "content": _text(response, "response")})
    return messages


def _text(content: Any, where: str, *, allow_empty: bool = False) -> str:
    """Message content as a string: a string, or OpenAI text parts joined; anything else is a reject."""
    if content is None:
        raise Reject("missing_content", f"{where} has no content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        content = "".join(p.get("text") if isinstance(p.get("text"), str) else "\0" for p in content)
        if "\0" in content:
            raise Reject("non_string_content", f"{where} has a text part without a string")
    if not isinstance(content, str):
        raise Reject("non_string_content", f"{where} content is {type(content).__name__}, not a string")
    try:
        content.encode("utf-8")
    except UnicodeEncodeError as e:
        raise Reject("invalid_utf8", f"{where}: {e.reason} at character {e.start}") from None
    if not content.strip() and not allow_empty:
        raise Reject("empty_content", f"{where} content is empty")
    return content


def _check_order(messages: list[dict[str, str]]) -> None:
    """Optional leading system message, then user/assistant alternating, starting with a user turn."""
    roles = [m["role"] for m in messages]
    if "user" not in roles:
        raise Reject("no_user_turn", f"roles {roles} have no user turn")
    body = roles[1:] if roles[0] == "system" else roles
    expected = ["user" if i % 2 == 0 else "assistant" for i in range(len(body))]
    if body != expected:
        raise Reject("not_alternating", f"roles {roles} do not alternate user/assistant after an optional system")


def conversation_id(messages: list[dict[str, str]]) -> str:
    """16 hex chars of sha256 over the normalised messages (same conversation from any format, same id)."""
    canonical = json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]
