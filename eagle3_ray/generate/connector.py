"""The project's vLLM KV connector: writes a request's captured hidden states where the request says.

vLLM's `ExampleHiddenStatesConnector` copies rows out of the hidden-state cache with a CUDA stream into pinned host
memory and writes each request's capture as one safetensors file; on the CPU build that dies at the first finished
request (`pin_memory=True requires a CUDA ... backend`). This subclass keeps everything else (custom save paths,
`include_output_tokens`, the flock protocol readers wait on, the writer pool) and adds:

- On the CPU the rows are copied synchronously (no pinned memory, no stream).
- A request whose kv_transfer_params carry `shard` (a prefill unit's sample with a place in a planned local shard,
  commit.ShardPlan) or `stream` (a generate unit's final turn: its place in one of the unit's open local shards is
  given when it finishes, commit.FinishOrderShards) is written straight into that place: the rows are encoded
  (bf16/fp8) and their row norms taken on the device they are on, once per engine step for all the step's such
  requests (shard_writer.planned_rows; on GPU on the copy stream, before the copy to the host, with nothing on the
  engine's thread waiting for the GPU), the stored bytes go into the shard's temp file at their offsets, and the
  request's capture path gets a note of a few KB (token ids, norms, a generate sample's place) instead of the hidden
  states (shard_writer.write_planned_capture). The hidden states are written once, into the shard, and the engine
  actor reads only the note.

Every request captures: a request that opted out (freeing its blocks at once) was still reported as sent by the
worker side, which vLLM 0.24's scheduler asserts on (`req_id in self.requests`) on GPU. Turn-by-turn regeneration
discards the captures of earlier turns instead (chat.discard_capture).

Loaded by vLLM's worker processes through
    kv_transfer_config={"kv_connector": "CaptureConnector",
                        "kv_connector_module_path": "eagle3_ray.generate.connector", ...}
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch

from eagle3_ray.core import shard_writer
from eagle3_ray.core.config import GenerateConfig
from eagle3_ray.core.vllm_support import (
    ExampleHiddenStatesConnector,
    ExampleHiddenStatesConnectorMetadata,
    PendingSave,
    extract_from_kv_cache,
)
from eagle3_ray.generate.capture_model import CAPTURE_LAYERS_KEY


def gather_groups(num_rows: list[int], max_rows: int) -> list[range]:
    """Consecutive groups of samples (indices into `num_rows`, each sample's token rows) of at most `max_rows` rows
    together, in order; a sample of more rows than that is a group of its own."""
    groups, start, rows = [], 0, 0
    for i, n in enumerate(num_rows):
        if i > start and rows + n > max_rows:
            groups.append(range(start, i))
            start, rows = i, 0
        rows += n
    if num_rows:
        groups.append(range(start, len(num_rows)))
    return groups


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
    """On GPU a planned sample's stored rows come down into a piece of one pinned arena reserved when the KV caches
    are registered (`pinned_buffer_bytes` of the extra config, shard_writer.HostArena); the piece goes back once the
    sample is written, and a sample that does not fit gets fresh pinned memory, as in vLLM's connector."""

    _saved_by_step: frozenset[str] = frozenset()  # req ids of this step's planned saves (get_finished)
    _arena: shard_writer.HostArena | None = None

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any):
        # generate.capture_method=forward: no extract_hidden_states method, the verifier's forward pass writes the
        # rows (generate/capture_model.py). vLLM's connector asserts the method and reads its layer ids only to count
        # them (num_hidden_states), so it is given a copy of the config that names them there, and keeps the real one.
        forward = vllm_config.speculative_config is None
        super().__init__(_with_capture_layers(vllm_config) if forward else vllm_config, *args, **kwargs)
        self._vllm_config = vllm_config
        self._stream_used: dict[str, int] = {}  # scheduler side: payload bytes given out per open shard file
        # worker side: a planned sample's write goes to its shard file's queue on the parent's writer threads
        self._shard_jobs = shard_writer.PerFileJobs(self._executor)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        super().register_kv_caches(kv_caches)
        num_bytes = int(self._kv_transfer_config.get_from_extra_config("pinned_buffer_bytes", 0))
        # generate.capture_gather_bytes (engine.engine_kwargs): bytes of rows gathered from the cache at once
        default = GenerateConfig().capture_gather_bytes
        self._gather_bytes = int(self._kv_transfer_config.get_from_extra_config("gather_bytes", default))
        if self._is_tp_rank_zero and self._kv_cache.is_cuda:
            if num_bytes:
                self._arena = shard_writer.HostArena(num_bytes, pin_memory=True)
            self._warm_up()

    def _warm_up(self) -> None:
        """The step-wise save path (_copy_to_host) once per stored dtype on a few cache slots, waited for, at engine
        start, so that the first use of its kernels and of pinned host memory is not on the engine's thread in the
        first step that finishes samples, where it held the engine several times as long as a later step."""
        slots = torch.arange(16)
        for dtype in ("bfloat16", "fp8", "float32"):
            _, releases, done = self._copy_to_host(slots, [(0, 8), (8, 16)], dtype)
            done.synchronize()
            for pieces in releases:
                self._give_back(pieces)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler side: the parent's pending save, carrying the request's shard target to the worker: a prefill
        sample's planned place (`shard`), or a generate sample's place in its unit's open shards (`stream`), given
        here, where T is known and requests finish one at a time (shard_writer.stream_target)."""
        delay, params = super().request_finished(request, block_ids)
        transfer = request.kv_transfer_params or {}
        pending = self._pending_saves.get(request.request_id)
        if pending is None:
            return delay, params
        target = transfer.get("shard")
        if target is None and transfer.get("stream") is not None:
            target = shard_writer.stream_target(transfer["stream"], pending.token_ids.shape[0], self._stream_used)
        if target is not None:
            self._pending_saves[request.request_id] = ShardSave(**vars(pending), shard=target)
        return delay, params

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker side, once per engine step: the step's planned saves go out together (_save_planned), the others
        one by one through the parent's loop, which then polls the copies of both."""
        metadata = self._get_connector_metadata() if self.has_connector_metadata() else None
        pending = metadata.pending_saves if isinstance(metadata, ExampleHiddenStatesConnectorMetadata) else []
        planned = [p for p in pending if isinstance(p, ShardSave) and p.shard is not None]
        self._saved_by_step = frozenset(p.req_id for p in planned)
        if planned and self._is_tp_rank_zero:
            for dtype in {p.shard["dtype"] for p in planned}:
                self._save_planned([p for p in planned if p.shard["dtype"] == dtype], dtype)
        return super().get_finished(finished_req_ids)

    def _save_planned(self, saves: list[ShardSave], dtype: str) -> None:
        """A step's planned saves, gathered from the hidden-state cache in consecutive groups of at most
        `gather_bytes` of token rows (gather_groups): the gather and its encoding and norms take device memory
        outside vLLM's gpu_memory_utilization, in proportion to the rows gathered at once."""
        assert self._kv_cache is not None
        # with the time this thread leaves, the note's stamps (shard_writer.write_planned_capture)
        step_at = time.time()
        row_bytes = self._kv_cache[0, 0].numel() * self._kv_cache.element_size()
        max_rows = max(1, self._gather_bytes // row_bytes)
        for group in gather_groups([p.token_ids.shape[0] for p in saves], max_rows):
            self._save_group([saves[i] for i in group], dtype, step_at)

    def _save_group(self, saves: list[ShardSave], dtype: str, step_at: float) -> None:
        """One gather from the hidden-state cache for a group of a step's planned saves (their token rows one after
        the other). On a GPU the encoding, row norms and non-finite counts run once for all of them too, on the copy
        stream, which waits for the step's forward pass on the device, not on the host: the slot mapping goes up
        from pinned memory, so nothing here waits for the GPU and the engine's thread goes on at once (a pageable
        upload would wait for the copy stream to drain). Each sample's stored rows come down into a piece of the
        pinned arena (given back when its write is done; fresh pinned memory when the arena is lent out), the
        group's norms into one pinned tensor."""
        spans, start = [], 0
        for p in saves:
            spans.append((start, start + p.token_ids.shape[0]))
            start = spans[-1][1]
        slots = torch.cat([self._slot_mapping(p.block_ids)[: p.token_ids.shape[0]] for p in saves])
        if not self._kv_cache.is_cuda:
            # Advanced indexing copies, so the rows survive the blocks being freed right after this call; the
            # encoding and norms run on the writer threads, off the engine's.
            rows = extract_from_kv_cache(self._kv_cache, slots, start)
            stamps = [step_at, time.time()]
            for p, (a, b) in zip(saves, spans, strict=True):
                self._submit(
                    p, _DoneEvent(), planned=partial(shard_writer.planned_capture, rows[a:b], p.shard), stamps=stamps
                )
            return
        host, releases, copy_done = self._copy_to_host(slots, spans, dtype)
        stamps = [step_at, time.time()]
        for p, rows, pieces in zip(saves, host, releases, strict=True):
            self._submit(
                p,
                copy_done,
                planned=partial(shard_writer.planned_sample, rows, p.shard["key"]),
                stamps=stamps,
                release=partial(self._give_back, pieces),
            )

    def _copy_to_host(
        self, slots: torch.Tensor, spans: list[tuple[int, int]], dtype: str
    ) -> tuple[list[dict], list[list], torch.cuda.Event]:
        """GPU: the planned_rows of cache `slots` (host tensor), encoded as `dtype`, on the copy stream after the
        forward passes so far, cut by `spans` (token rows of each sample) into host copies, not waited for: per
        sample its tensors and the pieces of the arena they took, and the event of the copies."""
        copy_stream = self._get_copy_stream()
        ready = torch.cuda.Event()
        ready.record()  # the copy stream sees every write of the forward passes so far
        copy_stream.wait_event(ready)
        with torch.cuda.stream(copy_stream):
            slots = slots.pin_memory().to(device=self._kv_cache.device, non_blocking=True)
            step = shard_writer.planned_rows(extract_from_kv_cache(self._kv_cache, slots, spans[-1][1]), dtype)
            norms = {name: pinned_copy(step.pop(name)) for name in ("norms", "nonfinite")}
            host, releases = [], []
            for a, b in spans:
                rows, pieces = {}, []
                for name, t in step.items():
                    rows[name] = self._host_copy(t[a:b], pieces)
                host.append({**rows, **{name: t[a:b] for name, t in norms.items()}})
                releases.append(pieces)
        copy_done = torch.cuda.Event()
        copy_done.record(copy_stream)
        return host, releases, copy_done

    def _host_copy(self, t: torch.Tensor, pieces: list) -> torch.Tensor:
        """A copy of device tensor `t` on the host, on the current stream, not waited for: into a piece of the
        arena (added to `pieces`, given back once the sample is written), or fresh pinned memory."""
        num_bytes = t.numel() * t.element_size()
        got = self._arena.take(num_bytes) if self._arena is not None else None
        if got is None:
            return pinned_copy(t)
        pieces.append((got[0], num_bytes))
        host = got[1].view(t.dtype).view(t.shape)
        host.copy_(t, non_blocking=True)
        return host

    def _give_back(self, pieces: list) -> None:
        for start, num_bytes in pieces:
            self._arena.give(start, num_bytes)

    def _slot_mapping(self, block_ids: list[int]) -> torch.Tensor:
        """The cache slots of a request's blocks, in token order (on the host)."""
        blocks = torch.tensor(block_ids, dtype=torch.long)
        return (blocks.reshape(-1, 1) * self._block_size + torch.arange(self._block_size).reshape(1, -1)).flatten()

    def _submit_async_write(self, pending: PendingSave) -> None:
        """The parent's save of one request without a planned shard (the parent's own on a GPU, a synchronous copy
        on the CPU); a planned save of this step is out already (get_finished)."""
        if not self._is_tp_rank_zero or pending.req_id in self._saved_by_step:
            return
        assert self._kv_cache is not None
        if self._kv_cache.is_cuda:
            super()._submit_async_write(pending)
            return
        num_tokens = pending.token_ids.shape[0]
        rows = extract_from_kv_cache(self._kv_cache, self._slot_mapping(pending.block_ids), num_tokens)
        self._submit(pending, _DoneEvent(), rows=rows)

    def _submit(
        self,
        pending: PendingSave,
        done: Any,
        *,
        rows: torch.Tensor | None = None,
        planned: Callable[[], dict[str, torch.Tensor]] | None = None,
        stamps: list[float] = (),
        release: Callable[[], None] | None = None,
    ) -> None:
        """Hand a capture to the parent's writer pool: `rows` [T, L, H] on the host for the parent's file (CPU
        engines), or `planned` making a planned sample's planned_capture on the host. The job waits for `done`,
        writes, releases the capture's lock, which wakes the engine actor's reader, and calls `release` (the
        host memory it wrote from can go). A planned sample's note gets `stamps` (when the engine step's thread
        took its save and went on) and when its copy was on the host."""
        token_ids = pending.token_ids.clone()
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)

        def write_planned() -> None:
            try:
                done.synchronize()
                shard_writer.write_planned_capture(
                    planned(), token_ids, pending.shard, pending.filename, [*stamps, time.time()]
                )
            finally:
                if lock_fd is not None:
                    os.close(lock_fd)  # releases LOCK_EX
                if release is not None:
                    release()

        if planned is None:  # the parent's write: the whole capture as one file
            tensors = {"hidden_states": rows, "token_ids": token_ids}
            future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
        else:
            future = self._shard_jobs.submit(pending.shard["file"], write_planned)
        self._req_copy_events[pending.req_id] = done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))


def _with_capture_layers(vllm_config: Any) -> Any:
    """A shallow copy of `vllm_config` whose speculative config names the captured layers as extract_hidden_states'
    does (`draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids`)."""
    layer_ids = getattr(vllm_config.model_config.hf_config, CAPTURE_LAYERS_KEY, None)
    if not layer_ids:
        raise ValueError(
            "CaptureConnector needs vLLM's extract_hidden_states method or the capture model "
            f"(generate.capture_method=forward, hf_overrides.{CAPTURE_LAYERS_KEY})"
        )
    draft = SimpleNamespace(hf_config=SimpleNamespace(eagle_aux_hidden_state_layer_ids=list(layer_ids)))
    shim = copy.copy(vllm_config)
    object.__setattr__(shim, "speculative_config", SimpleNamespace(draft_model_config=draft))
    return shim


def pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of a device tensor into fresh pinned host memory, on the current stream, not waited for."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
