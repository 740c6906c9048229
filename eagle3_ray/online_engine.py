"""The online engine actor: CaptureEngine's vLLM engine and turn runner, returning each captured sample as a stream
row (hidden states as an ndarray) instead of writing it to storage. Used by online.py; rows are read back into
tensors by online_worker.py with `from_row`.

A row: `id` str, `input_ids` int32 [T], `loss_mask` int8 [T], `hs` [T, L, H] holding the stored dtype's bits
(uint16 for bfloat16, uint8 for fp8, float32 as is; numpy has no bf16/fp8), `scale` [T, L] (fp8 only: shards.py's
per-token, per-layer scale; else empty), `hs_dtype` the torch dtype name. T covers input_ids[:T] as in docs/stages.md (generate).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from eagle3_ray import chat, shards, storage, telemetry
from eagle3_ray.config import config_from_dict
from eagle3_ray.engine import PART_SCHEMA, CaptureEngine, _exit_when_engine_dies, engine_kwargs, prepare_engine_env
from eagle3_ray.tiny_verifier import verifier_dir_on_this_node

ROW_COLUMNS = ("id", "input_ids", "loss_mask", "hs", "scale", "hs_dtype")


def to_row(sample_id: str, input_ids: list[int], loss_mask: list[int], encoded: dict[str, torch.Tensor]) -> dict:
    """One stream row. `hs` holds the stored-dtype bits of [T, L, H]; `scale` [T, L] is empty unless fp8."""
    hs = encoded[f"{sample_id}.hs"]
    scale = encoded.get(f"{sample_id}.scale", torch.empty(0, dtype=torch.float32))
    num_tokens = hs.shape[0]
    return {"id": sample_id, "input_ids": np.asarray(input_ids[:num_tokens], np.int32),
            "loss_mask": np.asarray(loss_mask[:num_tokens], np.int8),
            "hs": hs.view(_torch_bits(hs.dtype)).numpy(), "scale": scale.numpy(),
            "hs_dtype": str(hs.dtype).removeprefix("torch.")}


def from_row(row: dict) -> torch.Tensor:
    """Hidden states [T, L, H] as float32 from a stream row (fp8 dequantized with its per-token scales)."""
    dtype = getattr(torch, row["hs_dtype"])
    hs = torch.from_numpy(np.ascontiguousarray(row["hs"])).view(dtype)
    if dtype == torch.float8_e4m3fn:
        return shards.dequantize_fp8(hs, torch.from_numpy(np.ascontiguousarray(row["scale"])))
    return hs.float()


def _torch_bits(dtype: torch.dtype) -> torch.dtype:
    return {torch.bfloat16: torch.uint16, torch.float8_e4m3fn: torch.uint8}.get(dtype, dtype)


def _encode(sample_id: str, hidden_states: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    if dtype == "float32":
        return {f"{sample_id}.hs": hidden_states.float().contiguous()}
    return shards.encode_sample(sample_id, hidden_states, dtype)


def _remove_dead_scratch(root: str) -> None:
    """Capture files left in RAM by engine actors that were killed mid-unit (their pid is in the dir name)."""
    import glob

    import psutil

    for path in glob.glob(os.path.join(root, "eagle3-online-*-*")):
        pid = int(os.path.basename(path).split("-")[2])
        if not psutil.pid_exists(pid):
            shutil.rmtree(path, ignore_errors=True)


class StreamEngine(CaptureEngine):
    """Ray Data actor: CaptureEngine's vLLM engine and turn runner, returning captured samples as rows instead of
    summaries. vLLM's connector hands each capture over through a per-request file: here it lives in /dev/shm (RAM)
    and is deleted as it is read, so nothing reaches storage. With `cache_dir`, units also commit shards + parts
    there (CaptureEngine's format) and a unit already committed is read back instead of regenerated."""

    def __init__(self, cfg_dict: dict[str, Any], verifier_path: str, layer_ids: list[int], out_dir: str,
                 cache_dir: str | None):
        from transformers import AutoTokenizer
        from vllm import LLM

        self.cfg = config_from_dict(cfg_dict)
        verifier_path = verifier_dir_on_this_node(self.cfg.verifier.path, verifier_path, self.cfg.verifier.dtype)
        self.layer_ids, self.cache_dir = layer_ids, cache_dir
        self.out_dir = cache_dir or out_dir  # CaptureEngine writes engines/*.json, shards and parts here
        root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        _remove_dead_scratch(root)
        self.scratch = tempfile.mkdtemp(prefix=f"eagle3-online-{os.getpid()}-", dir=root)
        prepare_engine_env(self.cfg)
        self.llm = LLM(**engine_kwargs(self.cfg, verifier_path, layer_ids, self.scratch))
        self.tokenizer = AutoTokenizer.from_pretrained(verifier_path,
                                                       trust_remote_code=self.cfg.verifier.trust_remote_code)
        self.chat = chat.ChatEncoder(self.tokenizer, self.cfg.generate.enable_thinking)
        engine_procs = self._record_pids()
        threading.Thread(target=_exit_when_engine_dies, args=(engine_procs,), daemon=True).start()
        self.tags = {"stage": "train_online", "run": self.cfg.run.name}

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        rows: list[dict] = []
        for unit_id, samples_json in zip(batch["unit_id"], batch["samples_json"]):
            rows += self.unit_rows(str(unit_id), json.loads(str(samples_json)))
        return {k: [r[k] for r in rows] for k in ROW_COLUMNS}

    def unit_rows(self, unit_id: str, samples: list[dict[str, Any]]) -> list[dict]:
        part_uri = storage.join(self.out_dir, "parts", f"{unit_id}.parquet")
        if self.cache_dir and storage.exists(part_uri):
            return self._cached_rows(part_uri)
        records = chat.TurnRunner(self.chat, self._generate, self.cfg, self.scratch, unit_id).run(samples)
        ok = [r for r in records if r["status"] == "ok"]
        dtype = self.cfg.generate.hidden_states_dtype
        encoded = {r["id"]: _encode(r["id"], r["_hidden_states"], dtype) for r in ok}
        if self.cache_dir:
            self._write_shards(unit_id, records)  # pops _hidden_states from the records
            storage.write_parquet_atomic(part_uri, pa.Table.from_pylist(records, schema=PART_SCHEMA))
        shutil.rmtree(os.path.join(self.scratch, unit_id), ignore_errors=True)
        rows = [to_row(r["id"], r["input_ids"], r["loss_mask"], encoded[r["id"]]) for r in ok]
        self._count(len(rows), len(records) - len(ok), sum(len(r["input_ids"]) for r in rows))
        return rows

    def _cached_rows(self, part_uri: str) -> list[dict]:
        ok = [r for r in storage.read_parquet(part_uri).to_pylist() if r["status"] == "ok"]
        tensors: dict[str, torch.Tensor] = {}
        for name in sorted({r["shard"] for r in ok}):
            tensors.update(shards.load_shard(storage.join(self.out_dir, "shards", name)))
        rows = [to_row(r["key"], r["input_ids"], r["loss_mask"], tensors) | {"id": r["id"]} for r in ok]
        telemetry.log("train_online", "unit_from_cache", part=part_uri, samples=len(rows))
        return rows

    def _count(self, num_samples: int, num_rejected: int, num_tokens: int) -> None:
        for name, value in (("online_samples_total", num_samples), ("online_rejected_total", num_rejected),
                            ("online_captured_tokens_total", num_tokens)):
            if value > 0:  # Ray counters reject non-positive increments
                telemetry.metrics.counter(name, f"train online: {name}").inc(value, tags=self.tags)
        telemetry.log("train_online", "unit_streamed", samples=num_samples, rejected=num_rejected, tokens=num_tokens)
