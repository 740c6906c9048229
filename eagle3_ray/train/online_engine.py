"""The online engine actor: the generate stage's EngineActor (same start-up, continuous batching and background
writer) with a TrainRowSink: each captured sample comes back as a row (hidden states as an ndarray) instead of being
written to storage. Used by online.py; rows are read back into tensors by online_worker.py with `from_row`.

A row: `id` str, `input_ids` int32 [T], `loss_mask` int8 [T], `hs` [T, L, H] holding the stored dtype's bits (uint16 for
bfloat16, uint8 for fp8, float32 as is; numpy has no bf16/fp8), `scale` [T, L] (fp8 only: shard_format.py's per-token,
per-layer scale; else empty), `hs_dtype` the torch dtype name. T covers input_ids[:T] as in docs/design.md (generate,
what it writes).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from eagle3_ray.core import shard_format, shards, storage, telemetry
from eagle3_ray.core.config import Config
from eagle3_ray.generate import commit
from eagle3_ray.generate.engine import EngineActor

ROW_COLUMNS = ("id", "input_ids", "loss_mask", "hs", "scale", "hs_dtype")


def to_row(sample_id: str, input_ids: list[int], loss_mask: list[int], encoded: dict[str, torch.Tensor]) -> dict:
    """One stream row. `hs` holds the stored-dtype bits of [T, L, H]; `scale` [T, L] is empty unless fp8."""
    hs = encoded[f"{sample_id}.hs"]
    scale = encoded.get(f"{sample_id}.scale", torch.empty(0, dtype=torch.float32))
    num_tokens = hs.shape[0]
    return {
        "id": sample_id,
        "input_ids": np.asarray(input_ids[:num_tokens], np.int32),
        "loss_mask": np.asarray(loss_mask[:num_tokens], np.int8),
        "hs": hs.view(_torch_bits(hs.dtype)).numpy(),
        "scale": scale.numpy(),
        "hs_dtype": str(hs.dtype).removeprefix("torch."),
    }


def from_row(row: dict) -> torch.Tensor:
    """Hidden states [T, L, H] as float32 from a stream row (fp8 dequantized with its per-token scales)."""
    dtype = getattr(torch, row["hs_dtype"])
    hs = torch.from_numpy(np.ascontiguousarray(row["hs"])).view(dtype)
    if dtype == torch.float8_e4m3fn:
        return shard_format.dequantize_fp8(hs, torch.from_numpy(np.ascontiguousarray(row["scale"])))
    return hs.float()


def _torch_bits(dtype: torch.dtype) -> torch.dtype:
    return {torch.bfloat16: torch.uint16, torch.float8_e4m3fn: torch.uint8}.get(dtype, dtype)


class TrainRowSink:
    """The sink of online training: a unit's captured samples come back as rows for the train workers (ROW_COLUMNS)
    instead of going to storage. With `cache` (a commit.ShardSink), units also commit shards + parts there and a
    unit already committed is read back instead of regenerated."""

    def __init__(self, cfg: Config, layer_ids: list[int], cache: commit.ShardSink | None):
        self.cfg, self.layer_ids, self.cache = cfg, layer_ids, cache
        self.tags = {"stage": "train_online", "run": cfg.run.name}

    def committed(self, unit_id: str) -> list[dict] | None:
        if self.cache is None or not storage.exists(self.cache.part_uri(unit_id)):
            return None
        return self._cached_rows(self.cache.part_uri(unit_id))

    def write(
        self, unit_id: str, records: list[dict], encoded: dict, stats: dict, shard_bytes: dict[str, int] | None = None
    ) -> list[dict]:
        assert shard_bytes is None, "stream rows need every sample's tensors: no ShardPlan"
        ok = [r for r in records if r["id"] in encoded]
        if self.cache:
            self.cache.write(unit_id, records, encoded, stats)  # checks every sample
        else:
            for r in ok:
                commit.check_sample(self.cfg, r, stats[r["id"]], self.layer_ids, "(stream, no shard)")
        rows = [to_row(r["id"], r["input_ids"], r["loss_mask"], encoded[r["id"]]) for r in ok]
        self._count(len(rows), len(records) - len(ok), sum(len(r["input_ids"]) for r in rows))
        return rows

    def _cached_rows(self, part_uri: str) -> list[dict]:
        ok = [r for r in storage.read_parquet(part_uri).to_pylist() if r["status"] == "ok"]
        tensors: dict[str, torch.Tensor] = {}
        for name in sorted({r["shard"] for r in ok}):
            tensors.update(shards.load_shard(storage.join(self.cache.out_dir, "shards", name)))
        rows = [to_row(r["key"], r["input_ids"], r["loss_mask"], tensors) | {"id": r["id"]} for r in ok]
        telemetry.log("train_online", "unit_from_cache", part=part_uri, samples=len(rows))
        return rows

    def _count(self, num_samples: int, num_rejected: int, num_tokens: int) -> None:
        for name, value in (
            ("online_samples_total", num_samples),
            ("online_rejected_total", num_rejected),
            ("online_captured_tokens_total", num_tokens),
        ):
            if value > 0:  # Ray counters reject non-positive increments
                telemetry.metrics.counter(name, f"train online: {name}").inc(value, tags=self.tags)
        telemetry.log("train_online", "unit_streamed", samples=num_samples, rejected=num_rejected, tokens=num_tokens)


class StreamEngine(EngineActor):
    """Ray Data actor: EngineActor returning captured samples as rows (ROW_COLUMNS) instead of summaries. vLLM's
    per-request capture files live in RAM (/dev/shm) and are deleted as they are read, so nothing reaches storage
    unless `cache_dir` is set."""

    columns = ROW_COLUMNS
    scratch_prefix = "eagle3-online"

    def __init__(
        self, cfg_dict: dict[str, Any], verifier_path: str, layer_ids: list[int], out_dir: str, cache_dir: str | None
    ):
        self.cache_dir = cache_dir
        kind = "prefill" if cfg_dict["generate"].get("mode") == "capture_only" else "generate"
        # engines/*.json (and the cache's shards and parts) go to cache_dir when set
        super().__init__(cfg_dict, verifier_path, layer_ids, cache_dir or out_dir, kind=kind)

    def make_sink(self) -> TrainRowSink:
        cache = commit.ShardSink(self.cfg, self.cache_dir, self.layer_ids) if self.cache_dir else None
        return TrainRowSink(self.cfg, self.layer_ids, cache)
