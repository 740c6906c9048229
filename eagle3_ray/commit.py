"""Commits off the engine's path: one writer thread per engine actor reads a finished unit's captures, checks and
encodes them (bf16/fp8) and hands them to the unit's sink, while the engine goes on with other units.

    engine loop (unit done) --CaptureWriter.commit--> writer thread: read scratch file -> check -> encode -> sink
    ShardSink       shards/{unit}-{j}.safetensors, then parts/{unit}.parquet (the commit record): offline generate
    GeneratedSink   generated/{unit}.parquet (conversations, no hidden states): two_pass's first pass
    (online_engine.StreamSink returns stream rows instead, optionally committing through a ShardSink cache)

The writer's queue is bounded (2 x generate.units_in_flight jobs: commits, each unit waiting for its own, and
earlier turns' captures to delete); when it is full the caller, the engine loop included, waits: the writer fell
behind, logged as `backpressure`. The bytes behind the queue are bounded by engine_loop.ByteBudget.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from typing import Any

import pyarrow as pa
import torch

from eagle3_ray import chat, shards, storage, telemetry
from eagle3_ray.config import Config

STATS_FIELDS = [("hs_zero_rows", pa.list_(pa.int32())), ("hs_nonfinite", pa.list_(pa.int64())),
                ("hs_norm_sum", pa.list_(pa.float64())), ("hs_norm_min", pa.list_(pa.float32())),
                ("hs_norm_max", pa.list_(pa.float32()))]  # per captured layer: shards.capture_stats
PART_SCHEMA = pa.schema([
    ("id", pa.string()), ("unit_id", pa.string()), ("status", pa.string()),  # status: "ok" or "rejected"
    ("reason", pa.string()), ("detail", pa.string()),
    ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
    ("num_prompt_tokens", pa.int32()), ("num_response_tokens", pa.int32()),
    ("finish_reason", pa.string()), ("source", pa.string()),
    *[(f.name, f.type) for f in shards.MANIFEST_SCHEMA if f.name != "id"], *STATS_FIELDS,
])
SUMMARY_KEYS = ("id", "unit_id", "status", "num_tokens", "num_bytes")


class CaptureCheckError(RuntimeError):
    """A capture that must not be trained on (non-finite values, mostly zero rows)."""


def encode(key: str, hidden_states: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    if dtype == "float32":  # exact storage, for checks against a reference forward pass
        return {f"{key}.hs": hidden_states.float().contiguous()}
    return shards.encode_sample(key, hidden_states, dtype)


def check_sample(cfg: Config, record: dict[str, Any], stats: dict, layer_ids: list[int], shard: str) -> None:
    gen = cfg.generate
    problem = shards.capture_problem(stats, record["num_tokens"], layer_ids, max_zero_row_share=gen.max_zero_row_share,
                                     max_nonfinite_values=gen.max_nonfinite_values)
    if problem:
        raise CaptureCheckError(f"generate: capture check failed: sample {record['id']} (unit {record['unit_id']}, "
                                f"shard {shard}) {problem}")


class CaptureWriter:
    """The actor's writer thread. `commit` is called on the actor's event loop and returns a future of the sink's
    result; `discard` (any thread) deletes an earlier turn's capture file once vLLM has finished writing it."""

    def __init__(self, dtype: str, max_jobs: int):
        self.dtype = dtype
        self.jobs: queue.Queue = queue.Queue(maxsize=max_jobs)
        threading.Thread(target=self._run, name="capture-writer", daemon=True).start()

    def discard(self, paths: list[str]) -> None:
        if paths:
            self._put(("discard", paths))

    def commit(self, unit_id: str, convs: list, sink: Any) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self._put(("commit", (unit_id, convs, sink, future)))
        return future

    def _put(self, job: tuple) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            start = time.monotonic()
            self.jobs.put(job)
            waited_s = round(time.monotonic() - start, 3)
            telemetry.log("generate", "backpressure", pid=os.getpid(), writer_queue_full_s=waited_s)

    def pending(self) -> int:
        return self.jobs.qsize()

    def _run(self) -> None:
        while True:
            kind, job = self.jobs.get()
            if kind == "discard":
                for path in job:
                    chat.discard_capture(path)
                continue
            unit_id, convs, sink, future = job
            try:
                result = sink.write(unit_id, *self._read(convs))
            except BaseException as e:  # the unit fails with it; the actor and its engine go on
                future.get_loop().call_soon_threadsafe(_set, future, None, e)
            else:
                future.get_loop().call_soon_threadsafe(_set, future, result, None)

    def _read(self, convs: list) -> tuple[list[dict], dict[str, dict], dict[str, dict]]:
        """records; encoded tensors and capture stats by sample id (ok samples of a capture engine only)."""
        records, encoded, stats = [c.record for c in convs], {}, {}
        for c in convs:
            r = c.record
            if r["status"] == "ok" and c.capture_path:
                hs = chat.load_capture(r, c.capture_path)  # shape: [T, L, H]
                stats[r["id"]], encoded[r["id"]] = shards.capture_stats(hs), encode(r["id"], hs, self.dtype)
                r["num_tokens"] = hs.shape[0]
        return records, encoded, stats


def _set(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if not future.done():
        future.set_exception(error) if error else future.set_result(result)


class ShardSink:
    """Offline generate: shards first (atomically, names derived from the unit id), the part file last; the unit
    is committed when `parts/{unit_id}.parquet` exists."""

    def __init__(self, cfg: Config, out_dir: str, layer_ids: list[int]):
        self.cfg, self.out_dir, self.layer_ids = cfg, out_dir, layer_ids

    def part_uri(self, unit_id: str) -> str:
        return storage.join(self.out_dir, "parts", f"{unit_id}.parquet")

    def committed(self, unit_id: str) -> list[dict] | None:
        """The unit's summaries if it committed before (a retry after its actor died), else None."""
        uri = self.part_uri(unit_id)
        return summaries(storage.read_parquet(uri).to_pylist(), {}) if storage.exists(uri) else None

    def write(self, unit_id: str, records: list[dict], encoded: dict, stats: dict) -> list[dict]:
        shard_bytes = self.write_shards(unit_id, records, encoded, stats)
        storage.write_parquet_atomic(self.part_uri(unit_id), pa.Table.from_pylist(records, schema=PART_SCHEMA))
        return summaries(records, shard_bytes)

    def write_shards(self, unit_id: str, records: list[dict], encoded: dict, stats: dict) -> dict[str, int]:
        """Group the unit's samples by bytes, check each, write each shard atomically; fill the manifest columns."""
        ok = [r for r in records if r["id"] in encoded]
        groups = shards.greedy_groups([shards.tensor_bytes(encoded[r["id"]]) for r in ok],
                                      self.cfg.generate.shard_max_bytes)
        shard_bytes: dict[str, int] = {}
        for j, group in enumerate(groups):
            name = f"{unit_id}-{j:04d}.safetensors"
            for i in group:
                check_sample(self.cfg, ok[i], stats[ok[i]["id"]], self.layer_ids, name)
            tensors = {k: v for i in group for k, v in encoded[ok[i]["id"]].items()}
            shard_bytes[name] = shards.write_shard(storage.join(self.out_dir, "shards", name), tensors,
                                                   metadata={"unit_id": unit_id})
            for i in group:
                r, hs = ok[i], encoded[ok[i]["id"]][f"{ok[i]['id']}.hs"]
                r.update(shard=name, key=r["id"], hidden_size=hs.shape[2], layer_ids=self.layer_ids,
                         dtype=str(hs.dtype).removeprefix("torch."),
                         **{f"hs_{k}": v for k, v in stats[r["id"]].items()})
        return shard_bytes


class GeneratedSink:
    """two_pass's first pass: `generated/{unit_id}.parquet` holds the unit's regenerated conversations (input_ids,
    loss_mask, messages) or their rejects; the capture pass reads them by sample id."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def committed(self, unit_id: str) -> list[dict] | None:
        uri = storage.join(self.out_dir, "generated", f"{unit_id}.parquet")
        return summaries(storage.read_parquet(uri).to_pylist(), {}) if storage.exists(uri) else None

    def write(self, unit_id: str, records: list[dict], encoded: dict, stats: dict) -> list[dict]:
        assert not encoded, "the first pass of two_pass captures nothing"
        uri = storage.join(self.out_dir, "generated", f"{unit_id}.parquet")
        storage.write_parquet_atomic(uri, pa.Table.from_pylist(records, schema=PART_SCHEMA))
        return summaries(records, {})


def summaries(records: list[dict[str, Any]], shard_bytes: dict[str, int]) -> list[dict[str, Any]]:
    """One row per sample (SUMMARY_KEYS); a shard's bytes are counted once, on the first sample stored in it."""
    seen: set[str] = set()
    out = []
    for r in records:
        num_bytes = 0
        if r.get("shard") and r["shard"] not in seen:
            seen.add(r["shard"])
            num_bytes = shard_bytes.get(r["shard"], 0)
        out.append({"id": r["id"], "unit_id": r["unit_id"], "status": r["status"],
                    "num_tokens": r.get("num_tokens") or 0, "num_bytes": num_bytes})
    return out
