"""The project's vLLM KV connector: writes a request's captured hidden states where the request says.

vLLM's `ExampleHiddenStatesConnector` copies rows out of the hidden-state cache with a CUDA stream into pinned host
memory and writes each request's capture as one safetensors file; on the CPU build that dies at the first finished
request (`pin_memory=True requires a CUDA ... backend`). This subclass keeps everything else (custom save paths,
`include_output_tokens`, the flock protocol readers wait on, the writer pool) and adds:

- On the CPU the rows are copied synchronously (no pinned memory, no stream).
- A request whose kv_transfer_params carry `shard` (a prefill unit's sample with a place in a planned local shard,
  commit.ShardPlan) is written straight into that place: the rows are encoded (bf16/fp8) and their row norms taken
  on the device they are on (shards.planned_capture; on GPU on the copy stream, before the copy to the host), the
  stored bytes go into the shard's temp file at their offsets, and the request's capture path gets a note of a few
  KB (token ids, norms) instead of the hidden states (shards.write_planned_capture). The hidden states are written
  once, into the shard, and the engine actor reads only the note.

Every request captures: a request that opted out (freeing its blocks at once) was still reported as sent by the
worker side, which vLLM 0.24's scheduler asserts on (`req_id in self.requests`) on GPU. Turn-by-turn regeneration
discards the captures of earlier turns instead (chat.discard_capture).

Loaded by vLLM's worker processes through
    kv_transfer_config={"kv_connector": "CaptureConnector", "kv_connector_module_path": "eagle3_ray.connector", ...}
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

from eagle3_ray import shards


class _DoneEvent:
    """Stands in for the CUDA event of the parent's async copy: a synchronous CPU copy is done when it returns."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


@dataclass
class ShardSave(PendingSave):
    """A finished request's save (scheduler side to worker side) with its place in a planned shard."""

    shard: dict | None = None


class CaptureConnector(ExampleHiddenStatesConnector):
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler side: the parent's pending save, carrying the request's `shard` target to the worker."""
        delay, params = super().request_finished(request, block_ids)
        target = (request.kv_transfer_params or {}).get("shard")
        pending = self._pending_saves.get(request.request_id)
        if target is not None and pending is not None:
            self._pending_saves[request.request_id] = ShardSave(**vars(pending), shard=target)
        return delay, params

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        target = getattr(pending, "shard", None)
        if self._kv_cache.is_cuda and target is None:
            super()._submit_async_write(pending)
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (block_ids.reshape(-1, 1) * self._block_size + offsets.reshape(1, -1)).flatten()
        num_tokens = pending.token_ids.shape[0]
        if not self._kv_cache.is_cuda:
            # Advanced indexing copies, so the rows survive the blocks being freed right after this call; the
            # encoding and norms run on the writer thread, off the engine's.
            rows = extract_from_kv_cache(self._kv_cache, slot_mapping, num_tokens).contiguous()
            self._submit(pending, _DoneEvent(), rows=rows)
            return
        copy_stream = self._get_copy_stream()
        ready = torch.cuda.Event()
        ready.record()  # the copy stream sees every write of the forward passes so far
        copy_stream.wait_event(ready)
        with torch.cuda.stream(copy_stream):
            slots = slot_mapping.to(device=self._kv_cache.device, non_blocking=True)
            rows = extract_from_kv_cache(self._kv_cache, slots, num_tokens)  # shape: [T, L, H] on the GPU
            host = {}
            for name, t in shards.planned_capture(rows, target).items():
                host[name] = torch.empty_like(t, device="cpu", pin_memory=True)
                host[name].copy_(t, non_blocking=True)
        copy_done = torch.cuda.Event()
        copy_done.record(copy_stream)
        self._submit(pending, copy_done, planned=host)

    def _submit(self, pending: PendingSave, done: Any, rows: torch.Tensor | None = None,
                planned: dict[str, torch.Tensor] | None = None) -> None:
        """Hand the capture to the parent's writer pool: `rows` [T, L, H] on the host (CPU engines), or the
        planned_capture of a planned sample copied to the host (GPU). The job waits for `done`, writes, and releases
        the capture's lock, which wakes the engine actor's reader."""
        token_ids = pending.token_ids.clone()
        target = getattr(pending, "shard", None)
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)

        def write_planned() -> None:
            try:
                done.synchronize()
                tensors = planned if planned is not None else shards.planned_capture(rows, target)
                shards.write_planned_capture(tensors, token_ids, target, pending.filename)
            finally:
                if lock_fd is not None:
                    os.close(lock_fd)  # releases LOCK_EX

        if target is None:  # the parent's write: the whole capture as one file
            tensors = {"hidden_states": rows, "token_ids": token_ids}
            future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        else:
            future = self._executor.submit(write_planned)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
