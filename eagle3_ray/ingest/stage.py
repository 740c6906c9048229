"""Ingest stage: prompt files -> one clean, deduplicated conversation table plus a rejects table, on Ray Data.

    python ray_jobs/ingest.py ray_jobs/configs/tiny_cpu.yaml ingest.inputs='[data/chats.jsonl]'

Flow: check every input on the driver (exists, readable, has a known column) -> read files as raw rows in Ray Data
tasks -> normalise and tokenize in an actor pool (one tokenizer per actor) -> the driver streams the results,
printing progress and failing at once in strict mode -> dedupe by id in source order -> write
`ingest/{version}/` (layout in docs/design.md, ingest). A finished version is never redone.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import ray

from eagle3_ray.core import stage, storage
from eagle3_ray.core.config import Config, UserError, versioned
from eagle3_ray.core.prompts import tiny_prompts
from eagle3_ray.core.raycluster import ensure_ray
from eagle3_ray.core.telemetry import RateMeter, log, metrics
from eagle3_ray.core.verifiers import verifier_dir, verifier_dir_on_this_node
from eagle3_ray.ingest import formats, sources

MESSAGES_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
# Raw rows: where a row came from (file_order, row: the sort key of "source order") and the row as ASCII JSON.
RAW_SCHEMA = pa.schema(
    [
        ("file_order", pa.int64()),
        ("row", pa.int64()),
        ("source", pa.string()),
        ("raw", pa.string()),
        ("error", pa.string()),
    ]
)
# Normalised rows: kept rows have reason null; rejects have reason, detail and raw.
NORMALISED_SCHEMA = pa.schema(
    [
        ("file_order", pa.int64()),
        ("row", pa.int64()),
        ("source", pa.string()),
        ("id", pa.string()),
        ("messages", MESSAGES_TYPE),
        ("num_turns", pa.int32()),
        ("num_prompt_tokens", pa.int32()),
        ("reason", pa.string()),
        ("detail", pa.string()),
        ("raw", pa.string()),
    ]
)
CONVERSATION_COLUMNS = ["id", "messages", "source", "num_turns", "num_prompt_tokens"]
REJECT_COLUMNS = ["source", "reason", "detail", "raw"]
MAX_RAW_CHARS = 2000
PROGRESS_EVERY_S = 2.0
ROWS_PER_TASK = 2048


def version(cfg: Config) -> str:
    """Hash of the ingest section, the verifier (its tokenizer counts prompt tokens) and the inputs' fingerprints."""
    return storage.version_hash(
        "ingest", versioned(cfg.ingest), cfg.verifier.path, cfg.verifier.trust_remote_code, inputs_fingerprint(cfg)
    )


def inputs_fingerprint(cfg: Config) -> str:
    """Path, size and modification time of every input file (builtin inputs: their content)."""
    files = [f for i, uri in enumerate(cfg.ingest.inputs) for f in _expand(uri, f"ingest.inputs[{i}]")]
    return storage.version_hash(*[_fingerprint(f) for f in files])


def run(cfg: Config) -> dict[str, Any]:
    """Ingest `cfg.ingest.inputs`; return the summary (also written to summary.json)."""
    inputs = _check_inputs(cfg.ingest.inputs)
    verifier_path = verifier_dir(cfg)
    _check_tokenizer(verifier_path, cfg.verifier.trust_remote_code)
    return stage.run(
        cfg,
        "ingest",
        version(cfg),
        lambda out: _ingest(cfg, inputs, verifier_path, out),
        inputs={"files": ",".join(cfg.ingest.inputs), "verifier": verifier_path},
        input_fingerprint=inputs_fingerprint(cfg),
    )


def _ingest(cfg: Config, inputs: list[list[formats.InputFile]], verifier_path: str, out_dir: str) -> dict[str, Any]:
    ensure_ray(cfg.run)
    log("ingest", "read", inputs=len(cfg.ingest.inputs), files=sum(map(len, inputs)), verifier=verifier_path)
    meter = RateMeter()
    ok, rejects = _collect(_pipeline(inputs, cfg, verifier_path), cfg, meter)
    conversations, num_duplicates = _dedupe(ok)
    builtins = {uri: sources.describe(uri) for uri in cfg.ingest.inputs if uri.startswith(sources.PREFIX)}
    summary = _summary(
        conversations, rejects, num_duplicates, meter, **({"builtin_inputs": builtins} if builtins else {})
    )
    _count_rows(cfg.run.name, {"duplicate": num_duplicates})
    _write(out_dir, conversations, rejects)
    return summary


def _expand(uri: str, where: str) -> list[formats.InputFile]:
    if uri.startswith(formats.BUILTIN_PREFIX):
        sources.check_name(uri, where)
    return formats.expand_input(uri, where)


def _check_inputs(inputs: list[str]) -> list[list[formats.InputFile]]:
    """The files behind each input, each checked for existence and a known column before any work starts."""
    expanded = []
    for i, uri in enumerate(inputs):
        where = f"ingest.inputs[{i}]"
        files = _expand(uri, where)
        for item in files:
            formats.check_known_columns(item, where)
        expanded.append(files)
    return expanded


def _check_tokenizer(verifier_path: str, trust_remote_code: bool) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(verifier_path, trust_remote_code=trust_remote_code)
    if not tokenizer.chat_template:
        raise UserError(f"verifier.path: the tokenizer of {verifier_path} has no chat template")


def _fingerprint(item: formats.InputFile) -> str:
    if item.uri == "builtin:tiny_prompts":
        return storage.version_hash(tiny_prompts())
    if item.kind == "builtin":  # a pinned package's file: its name, version and size
        return storage.version_hash(sources.describe(item.uri))
    return storage.fingerprint_inputs([item.uri])


# ---- the Ray Data pipeline ----------------------------------------------------------------------------------------


def _pipeline(inputs: list[list[formats.InputFile]], cfg: Config, verifier_path: str) -> ray.data.Dataset:
    reads, file_order = [], 0
    for files in inputs:
        reads.extend(_read(files, file_order, cfg.ingest.max_rows))
        file_order += len(files)
    raw = reads[0].union(*reads[1:]) if len(reads) > 1 else reads[0]
    # A file is parsed in one task; blocks of ROWS_PER_TASK rows let several tasks tokenize one large file.
    return raw.repartition(target_num_rows_per_block=ROWS_PER_TASK).map_batches(
        _normalise_batch,
        batch_format="pyarrow",
        batch_size=256,
        num_cpus=1,
        compute=ray.data.TaskPoolStrategy(size=cfg.ingest.num_workers),
        fn_kwargs={
            "verifier_path": verifier_path,
            "verifier_source": cfg.verifier.path,
            "dtype": cfg.verifier.dtype,
            "trust_remote_code": cfg.verifier.trust_remote_code,
            "turns": cfg.ingest.turns,
            "max_prompt_tokens": cfg.ingest.max_prompt_tokens,
        },
    )


def _read(files: list[formats.InputFile], first_order: int, max_rows: int | None) -> list[ray.data.Dataset]:
    """Raw rows (RAW_SCHEMA) of one input's files: files are parsed inside Ray tasks (one file per task), tables
    are split into blocks. `file_order` numbers files across all inputs: with the row index it is the source order."""
    reads = []
    for order, item in enumerate(files, start=first_order):
        if item.kind == "builtin":
            reads.append(ray.data.from_arrow(_raw_table(_builtin_rows(item.uri, max_rows), item.uri, order)))
        elif item.kind == "datasets":
            table = formats.load_datasets_table(item.uri)
            table = table.slice(0, max_rows) if max_rows is not None else table
            table = table.append_column("__row_index", pa.array(range(table.num_rows), pa.int64()))
            reads.append(
                ray.data.from_arrow(table).map_batches(
                    _table_batch_to_raw, batch_format="pyarrow", fn_kwargs={"uri": item.uri, "file_order": order}
                )
            )
    for kind in ("jsonl", "json_array", "parquet"):
        chosen = {
            storage.resolve(f.uri)[1]: (order, f.uri)
            for order, f in enumerate(files, start=first_order)
            if f.kind == kind
        }
        if chosen:
            fs = storage.resolve(files[0].uri)[0]
            reads.append(
                ray.data.read_binary_files(list(chosen), filesystem=fs, include_paths=True).map_batches(
                    _file_to_raw,
                    batch_format="pyarrow",
                    batch_size=1,
                    fn_kwargs={"kind": kind, "files": chosen, "max_rows": max_rows},
                )
            )
    return reads


def _file_to_raw(batch: pa.Table, *, kind: str, files: dict[str, tuple[int, str]], max_rows: int | None) -> pa.Table:
    assert batch.num_rows == 1, "one file per batch"
    file_order, uri = files[batch["path"][0].as_py()]
    data = batch["bytes"][0].as_py()
    read_rows = {"jsonl": formats.jsonl_rows, "json_array": formats.json_array_rows, "parquet": formats.parquet_rows}
    return _raw_table(list(read_rows[kind](data, max_rows)), uri, file_order)


def _builtin_rows(uri: str, max_rows: int | None) -> list[tuple[int, str | None, str | None]]:
    """Raw rows of a builtin source, read on the driver (sources.py streams the large files): every record, whole
    conversations as their `messages` and rejects with their reason, in file order. The Normaliser cuts turns."""
    read = sources.read_builtin(uri, turns="all", max_rows=max_rows)
    rows = [(r["provenance"]["row"], formats.dumps_row({"messages": r["messages"]}), None) for r in read.rows]
    rows += [(r["provenance"]["row"], r["raw"], f"{r['reason']}:{r['detail']}") for r in read.rejects]
    return sorted(rows)


def _table_batch_to_raw(batch: pa.Table, *, uri: str, file_order: int) -> pa.Table:
    indices = batch["__row_index"].to_pylist()
    rows = formats.table_rows(batch.drop_columns(["__row_index"]), None)
    return _raw_table([(indices[i], raw, error) for i, raw, error in rows], uri, file_order)


def _raw_table(rows: list[tuple[int, str | None, str | None]], uri: str, file_order: int) -> pa.Table:
    return pa.Table.from_pylist(
        [
            {"file_order": file_order, "row": i, "source": f"{uri}:{i}", "raw": raw, "error": error}
            for i, raw, error in rows
        ],
        schema=RAW_SCHEMA,
    )


def _normalise_batch(batch: pa.Table, **settings: Any) -> pa.Table:
    return _normaliser(**settings)(batch)


@functools.lru_cache(maxsize=4)
def _normaliser(**settings: Any) -> Normaliser:
    # Ray reuses worker processes across tasks and across runs of the stage: caching here loads the tokenizer once
    # per worker process, without the start-up cost of a fresh actor pool per run (seconds each time).
    return Normaliser(**settings)


class Normaliser:
    """Raw rows -> normalised rows or rejects (NORMALISED_SCHEMA), one output row per input row. Prompts are
    chat-templated with the generation prompt and tokenized with the verifier's tokenizer, as vLLM will see them."""

    def __init__(
        self,
        verifier_path: str,
        verifier_source: str,
        dtype: str,
        trust_remote_code: bool,
        turns: str,
        max_prompt_tokens: int,
    ):
        from transformers import AutoTokenizer

        verifier_path = verifier_dir_on_this_node(verifier_source, verifier_path, dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(verifier_path, trust_remote_code=trust_remote_code)
        self.turns, self.max_prompt_tokens = turns, max_prompt_tokens

    def __call__(self, batch: pa.Table) -> pa.Table:
        out = [self._normalise(row) for row in batch.to_pylist()]
        kept = [r for r in out if r["reason"] is None]
        for r, num_tokens in zip(kept, prompt_lengths(self.tokenizer, [r["messages"] for r in kept]), strict=True):
            r["num_prompt_tokens"] = num_tokens
            if num_tokens > self.max_prompt_tokens:
                r.update(
                    reason="prompt_too_long",
                    detail=f"{num_tokens} prompt tokens > ingest.max_prompt_tokens={self.max_prompt_tokens}",
                    raw=_readable(r["raw"]),
                )
        return pa.Table.from_pylist(out, schema=NORMALISED_SCHEMA)

    def _normalise(self, row: dict[str, Any]) -> dict[str, Any]:
        base = {
            "file_order": row["file_order"],
            "row": row["row"],
            "source": row["source"],
            "raw": row["raw"],
            "reason": None,
            "detail": None,
        }
        try:
            if row["error"] is not None:
                raise formats.Reject(*row["error"].split(":", 1))
            messages = formats.normalise(json.loads(row["raw"]), self.turns)
        except formats.Reject as r:
            return {**base, "reason": r.reason, "detail": r.detail, "raw": _readable(row["raw"])}
        num_turns = sum(m["role"] == "user" for m in messages)
        return {**base, "id": formats.conversation_id(messages), "messages": messages, "num_turns": num_turns}


def prompt_lengths(tokenizer: Any, conversations: list[list[dict[str, str]]]) -> list[int]:
    """Prompt tokens of each conversation's first turn through the chat template: [system?, first user]."""
    if not conversations:
        return []
    prompts = [m[: next(i for i, x in enumerate(m) if x["role"] == "user") + 1] for m in conversations]
    texts = tokenizer.apply_chat_template(prompts, tokenize=False, add_generation_prompt=True)
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _readable(raw: str | None) -> str | None:
    """The raw row for the rejects table: non-ASCII shown as text where it is valid, cut to MAX_RAW_CHARS."""
    if raw is None:
        return None
    try:
        text = json.dumps(json.loads(raw), ensure_ascii=False)
        text.encode("utf-8")
    except (ValueError, UnicodeEncodeError):
        text = raw
    return text[:MAX_RAW_CHARS]


# ---- driver side: progress, strict mode, dedupe, outputs -----------------------------------------------------------


def _collect(ds: ray.data.Dataset, cfg: Config, meter: RateMeter) -> tuple[pa.Table, pa.Table]:
    """Stream the normalised rows to the driver with progress lines; in strict mode the first reject fails the run."""
    ok_parts, reject_parts, num_rows, reasons, last_log_s = [], [], 0, Counter(), -PROGRESS_EVERY_S
    for batch in ds.iter_batches(batch_format="pyarrow", batch_size=None):
        rejected = pc.is_valid(batch["reason"])
        rejects = batch.filter(rejected)
        if cfg.ingest.strict and rejects.num_rows:
            first = rejects.sort_by([("file_order", "ascending"), ("row", "ascending")]).slice(0, 1).to_pylist()[0]
            raise UserError(f"ingest.strict: row {first['source']} rejected: {first['reason']} ({first['detail']})")
        ok_parts.append(batch.filter(pc.invert(rejected)))
        reject_parts.append(rejects)
        num_rows += batch.num_rows
        batch_reasons = Counter(rejects["reason"].to_pylist())
        reasons.update(batch_reasons)
        _count_rows(cfg.run.name, {"ok": ok_parts[-1].num_rows, **batch_reasons})
        if meter.elapsed_s - last_log_s >= PROGRESS_EVERY_S:
            last_log_s = meter.elapsed_s
            log(
                "ingest",
                "progress",
                rows=num_rows,
                rows_per_s=meter.per_s(num_rows),
                rejects=sum(reasons.values()),
                reject_reasons=dict(reasons),
            )
    empty = NORMALISED_SCHEMA.empty_table()
    return pa.concat_tables([empty, *ok_parts]), pa.concat_tables([empty, *reject_parts])


def _count_rows(run_name: str, num_rows_by_reason: dict[str, int]) -> None:
    """Ray metric eagle3_ingest_rows_total{reason=ok|duplicate|<reject code>} for the dashboard."""
    counter = metrics.counter("ingest_rows_total", "ingest rows by outcome", ("stage", "run", "reason"))
    for reason, num_rows in num_rows_by_reason.items():
        if num_rows:
            counter.inc(num_rows, tags={"stage": "ingest", "run": run_name, "reason": reason})


def _dedupe(ok: pa.Table) -> tuple[pa.Table, int]:
    """Keep the first row of each id in source order (input file order, then row index); count the others."""
    ok = ok.sort_by([("file_order", "ascending"), ("row", "ascending")])
    seen: set[str] = set()
    keep = [not (i in seen or seen.add(i)) for i in ok["id"].to_pylist()]
    kept = ok.filter(pa.array(keep, pa.bool_()))
    return kept.select(CONVERSATION_COLUMNS), ok.num_rows - kept.num_rows


def _summary(
    conversations: pa.Table, rejects: pa.Table, num_duplicates: int, meter: RateMeter, **extra: Any
) -> dict[str, Any]:
    num_rejected = rejects.num_rows
    rows_in = conversations.num_rows + num_rejected + num_duplicates
    return {
        "rows_in": rows_in,
        "rows_ok": conversations.num_rows,
        "rows_rejected": num_rejected,
        "duplicates": num_duplicates,
        "rejects_by_reason": dict(Counter(rejects["reason"].to_pylist())),
        "num_user_turns": pc.sum(conversations["num_turns"]).as_py() or 0,
        "num_prompt_tokens": pc.sum(conversations["num_prompt_tokens"]).as_py() or 0,
        "elapsed_s": round(meter.elapsed_s, 3),
        "rows_per_s": round(meter.per_s(rows_in), 1),
        **extra,
    }


def _write(out_dir: str, conversations: pa.Table, rejects: pa.Table) -> None:
    rejects = rejects.sort_by([("file_order", "ascending"), ("row", "ascending")]).select(REJECT_COLUMNS)
    storage.write_parquet_atomic(storage.join(out_dir, "conversations.parquet"), conversations)
    storage.write_parquet_atomic(storage.join(out_dir, "rejects.parquet"), rejects)
