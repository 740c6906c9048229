"""The project's vLLM KV connector: writes a request's captured hidden states to the path the request names.

vLLM's `ExampleHiddenStatesConnector` copies rows out of the hidden-state cache with a CUDA stream into pinned host
memory; on the CPU build that dies at the first finished request (`pin_memory=True requires a CUDA ... backend`).
This subclass keeps everything else (custom save paths, `include_output_tokens`, the flock protocol readers wait
on, the writer pool) and copies the rows itself: synchronously when the cache lives on the CPU; on GPU into a
pinned arena reserved at start, so no request waits on vLLM's worker thread for pinned memory of its own.

Every request captures: a request that opted out (freeing its blocks at once) was still reported as sent by the
worker side, which vLLM 0.24's scheduler asserts on (`req_id in self.requests`) on GPU. Turn-by-turn regeneration
discards the captures of earlier turns instead (chat.discard_capture).

Loaded by vLLM's worker processes through
    kv_transfer_config={"kv_connector": "CaptureConnector", "kv_connector_module_path": "eagle3_ray.connector", ...}
"""

from __future__ import annotations

import os
from functools import partial

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


class CaptureConnector(ExampleHiddenStatesConnector):
    """On GPU each finished request's rows are copied, on the parent's copy stream, into a piece of one pinned
    arena reserved when the KV caches are registered (`pinned_buffer_bytes` of the extra config; shards.HostArena);
    the piece goes back once the file is written, and a capture that does not fit gets fresh pinned memory, as in
    vLLM's connector. On CPU the rows are copied synchronously."""

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        super().register_kv_caches(kv_caches)
        num_bytes = self._kv_transfer_config.get_from_extra_config("pinned_buffer_bytes", 0)
        self._arena = None
        if self._is_tp_rank_zero and self._kv_cache.is_cuda and num_bytes:
            self._arena = shards.HostArena(num_bytes, pin_memory=True)

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (block_ids.reshape(-1, 1) * self._block_size + offsets.reshape(1, -1)).flatten()
        num_tokens = pending.token_ids.shape[0]
        if not self._kv_cache.is_cuda:
            # Advanced indexing copies, so the rows survive the blocks being freed right after this call.
            hidden_states = extract_from_kv_cache(self._kv_cache, slot_mapping, num_tokens)
            self._submit(pending, hidden_states.contiguous(), _DoneEvent())
            return
        copy_stream = self._get_copy_stream()
        ready = torch.cuda.Event()
        ready.record()  # the copy sees every write of the forward passes so far
        copy_stream.wait_event(ready)
        release = None
        with torch.cuda.stream(copy_stream):
            slots = slot_mapping.to(device=self._kv_cache.device, non_blocking=True)
            rows = extract_from_kv_cache(self._kv_cache, slots, num_tokens)  # shape: [T, L, H] on the GPU
            num_bytes = rows.numel() * rows.element_size()
            piece = self._arena.take(num_bytes) if self._arena is not None else None
            if piece is None:  # the arena is lent out: fresh pinned memory, as vLLM's connector does
                pinned_hs = torch.empty_like(rows, device="cpu", pin_memory=True)
            else:
                pinned_hs = piece[1].view(rows.dtype).view(rows.shape)
                release = partial(self._arena.give, piece[0], num_bytes)
            pinned_hs.copy_(rows, non_blocking=True)
        copy_done = torch.cuda.Event()
        copy_done.record(copy_stream)
        self._submit(pending, pinned_hs, copy_done, release)

    def _submit(self, pending: PendingSave, hidden_states: torch.Tensor, done, release=None) -> None:
        """Hand the rows to the parent's writer pool; its `_write_tensors` waits for `done`, writes the file and
        releases the file's lock, then `release` returns the arena piece."""
        tensors = {"hidden_states": hidden_states, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)

        def write() -> None:
            try:
                self._write_tensors(tensors, done, pending.filename, lock_fd)
            finally:
                if release is not None:
                    release()

        future = self._executor.submit(write)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
