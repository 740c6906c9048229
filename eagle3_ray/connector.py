"""The project's vLLM KV connector: writes a request's captured hidden states to the path the request names.

vLLM's `ExampleHiddenStatesConnector` copies rows out of the hidden-state cache with a CUDA stream into pinned host
memory; on the CPU build that dies at the first finished request (`pin_memory=True requires a CUDA ... backend`).
This subclass keeps everything else (custom save paths, `include_output_tokens`, the flock protocol readers wait
on) and, when the cache lives on the CPU, copies the rows synchronously. On GPU the parent's async path runs.

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

class _DoneEvent:
    """Stands in for the CUDA event of the parent's async copy: a synchronous CPU copy is done when it returns."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class CaptureConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        if self._kv_cache.is_cuda:
            super()._submit_async_write(pending)
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (block_ids.reshape(-1, 1) * self._block_size + offsets.reshape(1, -1)).flatten()
        # Advanced indexing copies, so the rows survive the blocks being freed right after this call.
        hidden_states = extract_from_kv_cache(self._kv_cache, slot_mapping, pending.token_ids.shape[0])
        tensors = {"hidden_states": hidden_states.contiguous(), "token_ids": pending.token_ids.clone()}

        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        done = _DoneEvent()
        future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
