"""The generate stage's output directory: capture contract, resume bookkeeping and the final tables.

    generate/{version}/
      capture.json  shards/*.safetensors  parts/{unit}.parquet (commit records)  manifest.parquet
      conversations.parquet  rejects.parquet  summary.json  provenance.json  _SUCCESS

A part file is written after its unit's shards, so a shard no part names is an orphan of a killed run.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from eagle3_ray.core import capture_checks, shards, storage, telemetry
from eagle3_ray.core.config import Config
from eagle3_ray.core.layers import resolve_layer_ids, text_config

CONVERSATION_COLUMNS = [
    "id",
    "messages",
    "input_ids",
    "loss_mask",
    "num_prompt_tokens",
    "num_response_tokens",
    "finish_reason",
    "source",
]
REJECTS_SCHEMA = pa.schema([("id", pa.string()), ("reason", pa.string()), ("detail", pa.string())])


def capture_contract(cfg: Config, verifier_path: str) -> dict[str, Any]:
    """capture.json: the layers captured and the verifier they came from (the drafter and vLLM must agree)."""
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(verifier_path, trust_remote_code=cfg.verifier.trust_remote_code)
    text = text_config(hf)
    aux, final = resolve_layer_ids(text.num_hidden_layers, cfg.verifier.aux_layer_ids)
    return {
        "aux_layer_ids": aux,
        "final_layer_id": final,
        "layer_ids": aux + [final],
        "final_layer_norm": "pre",
        "hidden_size": text.hidden_size,
        "num_hidden_layers": text.num_hidden_layers,
        "vocab_size": text.vocab_size,
        "verifier_path": verifier_path,
        "verifier_architectures": list(getattr(hf, "architectures", None) or []),
        "model_dtype": cfg.verifier.dtype,
        "hidden_states_dtype": cfg.generate.hidden_states_dtype,
    }


def _parts(out: str) -> pa.Table | None:
    files = storage.list_files(storage.join(out, "parts"), ".parquet")
    return pa.concat_tables([storage.read_parquet(f) for f in files]) if files else None


def committed_ids(out: str) -> set[str]:
    """Samples some committed part already holds (captured or rejected by the engine)."""
    parts = _parts(out)
    return set() if parts is None else set(parts["id"].to_pylist())


def clean_orphans(out: str) -> None:
    """Delete temporary files and shards that no part file names: left by a run killed mid-unit (at the next run's
    start), or by an engine actor killed mid-unit whose unit another incarnation committed (at the stage's end)."""
    parts = _parts(out)
    referenced = set() if parts is None else {s for s in parts["shard"].to_pylist() if s}
    removed = 0
    for sub in ("shards", "parts", "generated"):
        for uri in storage.list_files(storage.join(out, sub)):
            name = uri.rsplit("/", 1)[-1]
            if ".tmp-" in name or (sub == "shards" and name not in referenced):
                storage.delete(uri)
                removed += 1
    storage.delete(storage.join(out, "_scratch"))
    if removed:
        telemetry.log("generate", "removed_orphans", files=removed)


def _one_row_per_id(parts: pa.Table) -> pa.Table:
    """A unit retried after it had committed could leave an id in two parts: keep the one from the smallest unit id."""
    order = pc.sort_indices(parts, sort_keys=[("id", "ascending"), ("unit_id", "ascending")])
    parts = parts.take(order)
    ids = parts["id"].to_pylist()
    keep = [i for i in range(len(ids)) if i == 0 or ids[i] != ids[i - 1]]
    return parts.take(pa.array(keep, pa.int64()))


def committed_samples(out: str) -> pa.Table | None:
    """Every committed part row, one per sample id (None when nothing is committed)."""
    parts = _parts(out)
    return None if parts is None else _one_row_per_id(parts)


def finalise(
    cfg: Config,
    out: str,
    ingested: pa.Table,
    plan_rejects: list[dict],
    contract: dict,
    processed: dict[str, Any],
    wall_s: float,
) -> dict[str, Any]:
    """manifest, conversations and rejects from the committed parts (counts reconciled); returns the summary."""
    parts = committed_samples(out)
    parts = parts if parts is not None else pa.table({"status": pa.array([], pa.string())})
    ok = parts.filter(pc.equal(parts["status"], "ok")) if parts.num_rows else None
    engine_rejects = (
        parts.filter(pc.equal(parts["status"], "rejected")).select(REJECTS_SCHEMA.names)
        if parts.num_rows
        else REJECTS_SCHEMA.empty_table()
    )
    rejects = pa.concat_tables(
        [pa.Table.from_pylist(plan_rejects, schema=REJECTS_SCHEMA), engine_rejects.cast(REJECTS_SCHEMA)]
    )
    manifest = (
        ok.select(shards.MANIFEST_SCHEMA.names).cast(shards.MANIFEST_SCHEMA)
        if ok is not None
        else shards.MANIFEST_SCHEMA.empty_table()
    )
    if manifest.num_rows + rejects.num_rows != ingested.num_rows:
        raise RuntimeError(
            f"generate: counts do not reconcile: {manifest.num_rows} captured + {rejects.num_rows} "
            f"rejected != {ingested.num_rows} ingested ({out})"
        )
    storage.write_parquet_atomic(storage.join(out, "manifest.parquet"), manifest)
    if ok is not None:
        storage.write_parquet_atomic(storage.join(out, "conversations.parquet"), ok.select(CONVERSATION_COLUMNS))
    storage.write_parquet_atomic(storage.join(out, "rejects.parquet"), rejects)
    clean_orphans(out)  # every unit is committed: what no part names (a killed engine's shard temp files) goes
    return {**_summary(out, ingested.num_rows, manifest, rejects, processed, wall_s), "capture": contract}


def capture_stats_summary(out: str) -> dict[str, dict]:
    """Per captured layer over every committed sample: share of all-zero token rows, non-finite values, token-row
    L2 norm mean/min/max (from the parts' hs_* columns, written as each sample was encoded)."""
    parts = _parts(out)
    if parts is None or "hs_zero_rows" not in parts.column_names:
        return {}
    parts = _one_row_per_id(parts)
    ok = parts.filter(pc.equal(parts["status"], "ok"))
    if not ok.num_rows:
        return {}
    rows = ok.select(
        ["num_tokens", "layer_ids", "hs_zero_rows", "hs_nonfinite", "hs_norm_sum", "hs_norm_min", "hs_norm_max"]
    ).to_pylist()
    per_sample = [{k.removeprefix("hs_"): r[k] for k in r if k.startswith("hs_")} for r in rows]
    return capture_checks.aggregate_stats(per_sample, [r["num_tokens"] for r in rows], rows[0]["layer_ids"])


def _summary(out: str, rows_in: int, manifest: pa.Table, rejects: pa.Table, processed: dict, wall_s: float) -> dict:
    shard_files = storage.list_files(storage.join(out, "shards"), ".safetensors")
    total_bytes = sum(storage.resolve(f)[0].get_file_info(storage.resolve(f)[1]).size for f in shard_files)
    tokens = int(pc.sum(manifest["num_tokens"]).as_py() or 0)
    reasons = pc.value_counts(rejects["reason"]).to_pylist() if rejects.num_rows else []
    return {
        "path": out,
        "rows_in": rows_in,
        "rows_ok": manifest.num_rows,
        "rows_rejected": rejects.num_rows,
        "reject_reasons": {r["values"]: r["counts"] for r in reasons},
        "num_shards": len(shard_files),
        "captured_tokens": tokens,
        "shard_bytes": total_bytes,
        "bytes_per_token": total_bytes / max(tokens, 1),
        "run_wall_s": wall_s,
        "run_samples": processed.get("samples", 0),
        "run_tokens": processed["tokens"],
        "run_tokens_per_s": processed["tokens"] / max(wall_s, 1e-9),
        "run_mode": processed.get("mode"),
        "run_first_pass": processed.get("first_pass"),
        "capture_stats": capture_stats_summary(out),
    }
