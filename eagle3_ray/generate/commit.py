"""Commits off the engine's path: writer threads of the engine actor read each finished conversation's capture as
soon as it finishes (stats, bf16/fp8 encoding), and when its unit is done hand the unit to its sink, while the engine
goes on with other requests.

    engine actor (unit's requests out) --CaptureWriter.complete--> writer thread: capture_only's loss masks
    engine loop (conversation done) --CaptureWriter.prepare--> writer thread: read scratch file -> stats -> encode
    engine loop (unit done) --CaptureWriter.commit--> writer thread: check -> sink
    prefill units (capture_only, two_pass's capture pass) know every sample's T before the engine runs: a ShardPlan
    fixes their shards up front, vLLM's connector writes each sample into its place in a local shard itself, and
    the writer thread reads only the note it leaves (norms) to check the sample
    a unit's sink (`committed`, `write`) is where its finished samples go:
    ShardSink          shards/{unit}-{j}.safetensors, then parts/{unit}.parquet (the commit record): offline generate
    ConversationSink   generated/{unit}.parquet (conversations, no hidden states): two_pass's first pass
    (online_engine.TrainRowSink returns rows for the train workers instead, optionally through a ShardSink cache)
    a unit's local shards are laid out by ShardPlan (places fixed before the requests go out: prefill units) or
    FinishOrderShards (places given as samples finish: generate units)

What waits for the writers is bounded in bytes by engine_loop.ByteBudget: a unit starts only when its capture bytes
fit the budget (else it waits, logged as `backpressure`: the writers fell behind).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from typing import Any

import pyarrow as pa
import torch

from eagle3_ray.core import capture_checks, packing, shard_format, shard_writer, shards, storage
from eagle3_ray.core.config import Config
from eagle3_ray.generate import chat

STATS_FIELDS = [
    ("hs_zero_rows", pa.list_(pa.int32())),
    ("hs_nonfinite", pa.list_(pa.int64())),
    ("hs_norm_sum", pa.list_(pa.float64())),
    ("hs_norm_min", pa.list_(pa.float32())),
    ("hs_norm_max", pa.list_(pa.float32())),
]  # per captured layer: capture_checks.capture_stats
PART_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("unit_id", pa.string()),
        ("status", pa.string()),  # status: "ok" or "rejected"
        ("reason", pa.string()),
        ("detail", pa.string()),
        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("num_prompt_tokens", pa.int32()),
        ("num_response_tokens", pa.int32()),
        ("finish_reason", pa.string()),
        ("source", pa.string()),
        *[(f.name, f.type) for f in shards.MANIFEST_SCHEMA if f.name != "id"],
        *STATS_FIELDS,
    ]
)
SUMMARY_KEYS = ("id", "unit_id", "status", "num_tokens", "num_bytes")


class CaptureCheckError(RuntimeError):
    """A capture that must not be trained on (non-finite values, mostly zero rows)."""


def check_sample(cfg: Config, record: dict[str, Any], stats: dict, layer_ids: list[int], shard: str) -> None:
    gen = cfg.generate
    problem = capture_checks.capture_problem(
        stats,
        record["num_tokens"],
        layer_ids,
        max_zero_row_share=gen.max_zero_row_share,
        max_nonfinite_values=gen.max_nonfinite_values,
    )
    if problem:
        raise CaptureCheckError(
            f"generate: capture check failed: sample {record['id']} (unit {record['unit_id']}, shard {shard}) {problem}"
        )


JOB_PRIORITY = {"commit": 0, "complete": 1, "prepare": 1, "discard": 1}


class CaptureWriter:
    """The actor's writer threads (`generate.writer_threads`), all taking jobs from one queue:

        prepare(conv)   a finished conversation's capture: read the scratch file, stats, encode. Queued by the engine
                        loop the moment the conversation finishes, so the work runs while the engine decodes the rest
        commit(...)     the unit's remaining prepares (done here if no thread has taken them yet), then the sink's
                        write; units commit side by side on different threads. Returns a future on the caller's loop
        discard(paths)  delete an earlier turn's capture once vLLM has finished writing it
        complete(convs) a prefill unit's records (capture_only's loss masks: template passes), queued when its
                        requests go out, so they are done while the engine runs, not in the tail after it

    The queue is not bounded by a job count: what it holds is bounded in bytes by the actor's ByteBudget (a unit's
    capture bytes are acquired before its first request and released after its commit)."""

    # per conversation (conv.timing), summed per unit in its unit_committed line: waiting for vLLM's connector to
    # finish the capture file, reading + checking + encoding it, writing planned shards, the commit's own writes
    TIMINGS = ("capture_wait_s", "prepare_s", "shard_write_s", "commit_write_s")
    # and when (time.time()); a unit's line has the latest of its samples: the capture file readable, the capture
    # prepared, its shard written. With engine_done_s and committed_s they split the tail after a unit's last request.
    # A sample vLLM's connector wrote into a shard also has the connector's: the engine step that took its save, its
    # copy on the host, its shard write done (shard_writer.write_planned_capture's stamps)
    STAMPS = (
        "captured_at",
        "prepared_at",
        "shard_written_at",
        "connector_step_at",
        "connector_copied_at",
        "connector_written_at",
    )
    # the longest of them in a unit's line: the seconds the engine's step spent handing out its saves (the connector's
    # gather, encoding and copies on the device: they should take the step's thread no time)
    MAX_TIMINGS = ("connector_step_s",)
    # and the earliest of these (the first engine step that finished one of the unit's samples)
    FIRST_STAMPS = ("connector_step_at",)

    def __init__(self, dtype: str, num_threads: int):
        self.dtype = dtype
        self.jobs: queue.PriorityQueue = queue.PriorityQueue()
        self.order = itertools.count()  # FIFO within a kind
        for i in range(num_threads):
            threading.Thread(target=self._run, name=f"capture-writer-{i}", daemon=True).start()

    def discard(self, paths: list[str]) -> None:
        if paths:
            self._put("discard", paths)

    def prepare(self, conv: Any) -> None:
        """Any thread (the engine loop calls it when a conversation finishes)."""
        if conv.capture_path and conv.record["status"] == "ok":
            self._put("prepare", conv)

    def complete(self, convs: list) -> None:
        self._put("complete", convs)

    def commit(self, unit_id: str, convs: list, sink: Any) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self._put("commit", (unit_id, convs, sink, future))
        return future

    def _put(self, kind: str, job: Any) -> None:
        """A unit's commit goes before queued prepares (it does its own unit's remaining ones), so a finished unit
        lands, and frees its bytes, while later units' captures wait; prepares and deletions keep their order."""
        self.jobs.put((JOB_PRIORITY[kind], next(self.order), kind, job))

    def _run(self) -> None:
        # One op thread per writer: the writers are the actor's parallelism. Ray gives the actor OMP_NUM_THREADS =
        # its CPUs (8 on GPU), and a team that size behind every writer's norms would put 8 x 8 threads on cores
        # that vLLM's own processes (scheduler, the connector's file writes) need. (It sets this thread's OpenMP
        # team and the size later threads start with; the actor runs no other heavy torch work: vLLM's engine is a
        # process of its own, started before the writers.)
        torch.set_num_threads(1)
        while True:
            _, _, kind, job = self.jobs.get()
            if kind == "discard":
                for path in job:
                    chat.discard_capture(path)
            elif kind == "prepare":
                self._prepare(job)
            elif kind == "complete":
                for conv in job:
                    with conv.prepare_lock:
                        try:
                            conv.complete_record()
                        except Exception:  # noqa: BLE001 (raised again by its prepare, which fails the unit)
                            pass
            else:
                self._commit(*job)

    def _prepare(self, conv: Any) -> None:
        """Once per conversation, whichever thread comes first; a second caller waits for the first to finish.
        A failure is kept and raised by the unit's commit."""
        with conv.prepare_lock:
            if conv.prepared is not None:
                return
            r = conv.record
            try:
                conv.complete_record()  # a no-op once the unit's complete job has run (it usually has)
                start = time.monotonic()
                chat.wait_for_capture(conv.capture_path)
                waited = time.monotonic()
                conv.timing["captured_at"] = time.time()
                # A sample of a local planned shard is there already, written by vLLM's connector, which left a
                # note of its norms; any other capture is read whole, and kept until its unit commits.
                data = chat.load_capture(r, conv.capture_path)
                if "stamps" in data:
                    step_at, left_at, copied_at, written_at = data["stamps"].tolist()
                    conv.timing.update(
                        connector_step_at=step_at,
                        connector_step_s=left_at - step_at,
                        connector_copied_at=copied_at,
                        connector_written_at=written_at,
                    )
                if conv.shard is not None and conv.shard[0].streamed:
                    r["num_tokens"] = data["norms"].shape[0]
                    conv.prepared = (capture_checks.stats_from_norms(data["norms"], data["nonfinite"]), None)
                else:
                    hs = data["hidden_states"]  # shape: [T, L, H]
                    r["num_tokens"] = hs.shape[0]
                    conv.prepared = (
                        capture_checks.capture_stats(hs),
                        shard_format.encode_sample(r["id"], hs, self.dtype),
                    )
            except BaseException as e:
                conv.prepared = e
                return
            conv.timing.update(
                capture_wait_s=waited - start, prepare_s=time.monotonic() - waited, prepared_at=time.time()
            )
            if conv.shard is not None:  # still under the lock: a commit reading this conversation waits for the shard
                conv.shard[0].prepared(conv.shard[1], conv, data)

    def _commit(self, unit_id: str, convs: list, sink: Any, future: asyncio.Future) -> None:
        plans = {id(c.shard[0]): c.shard[0] for c in convs if c.shard is not None}
        try:
            records, encoded, stats = self._read(convs)
            shard_bytes = {k: v for p in plans.values() for k, v in p.shard_bytes().items()} if plans else None
            start = time.monotonic()
            result = sink.write(unit_id, records, encoded, stats, shard_bytes)
            if convs:
                convs[0].timing["commit_write_s"] = time.monotonic() - start
        except BaseException as e:  # the unit fails with it; the actor and its engine go on
            for plan in plans.values():
                plan.abort()
            future.get_loop().call_soon_threadsafe(_set, future, None, e)
        else:
            future.get_loop().call_soon_threadsafe(_set, future, result, None)

    def _read(self, convs: list) -> tuple[list[dict], dict[str, dict], dict[str, dict]]:
        """records; encoded tensors and capture stats by sample id (ok samples of a capture engine only, less those a
        ShardPlan wrote already)."""
        records, encoded, stats = [c.record for c in convs], {}, {}
        for c in convs:
            if c.record["status"] != "ok" or not c.capture_path:
                c.complete_record()  # (a capture's record is completed by its prepare)
                continue
            self._prepare(c)
            if isinstance(c.prepared, BaseException):
                raise c.prepared
            if c.shard is None:  # a planned sample's shard is written; its plan lets go of the tensors
                stats[c.record["id"]], encoded[c.record["id"]] = c.prepared
                c.prepared = ()  # the sink holds the tensors now; the conversation lets go of them
        return records, encoded, stats


def _set(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if not future.done():
        future.set_exception(error) if error else future.set_result(result)


class ShardSink:
    """The sink that stores hidden states (offline generate, and online training's cache): shards first
    (atomically, names derived from the unit id), the part file last; the unit is committed when
    `parts/{unit_id}.parquet` exists."""

    def __init__(self, cfg: Config, out_dir: str, layer_ids: list[int]):
        self.cfg, self.out_dir, self.layer_ids = cfg, out_dir, layer_ids

    def part_uri(self, unit_id: str) -> str:
        return storage.join(self.out_dir, "parts", f"{unit_id}.parquet")

    def committed(self, unit_id: str) -> list[dict] | None:
        """The unit's summaries if it committed before (a retry after its actor died), else None."""
        uri = self.part_uri(unit_id)
        return summaries(storage.read_parquet(uri).to_pylist(), {}) if storage.exists(uri) else None

    def write(
        self, unit_id: str, records: list[dict], encoded: dict, stats: dict, shard_bytes: dict[str, int] | None = None
    ) -> list[dict]:
        """shard_bytes: the unit's shards a ShardPlan wrote already (their samples are not in `encoded`)."""
        shard_bytes = {**(shard_bytes or {}), **self.write_shards(unit_id, records, encoded, stats)}
        storage.write_parquet_atomic(self.part_uri(unit_id), pa.Table.from_pylist(records, schema=PART_SCHEMA))
        return summaries(records, shard_bytes)

    def write_shards(self, unit_id: str, records: list[dict], encoded: dict, stats: dict) -> dict[str, int]:
        """Group the unit's encoded samples by bytes and write a shard of each group."""
        ok = [r for r in records if r["id"] in encoded]
        groups = packing.greedy_groups(
            [shard_format.tensor_bytes(encoded[r["id"]]) for r in ok], self.cfg.generate.shard_max_bytes
        )
        return {
            name: self.write_shard(name, [ok[i] for i in group], encoded, stats)
            for name, group in zip(shard_names(unit_id, len(groups)), groups, strict=True)
        }

    def write_shard(self, name: str, records: list[dict], encoded: dict, stats: dict) -> int:
        """Check each sample, write the shard atomically, fill the samples' manifest columns; returns its bytes."""
        unit_id = records[0]["unit_id"]
        for r in records:
            check_sample(self.cfg, r, stats[r["id"]], self.layer_ids, name)
        tensors = {k: v for r in records for k, v in encoded[r["id"]].items()}
        num_bytes = shards.write_shard(self.shard_uri(name), tensors, metadata={"unit_id": unit_id})
        for r in records:
            hs = encoded[r["id"]][f"{r['id']}.hs"]
            self.stored(name, r, stats[r["id"]], hs.dtype, hs.shape[2])
        return num_bytes

    def shard_uri(self, name: str) -> str:
        return storage.join(self.out_dir, "shards", name)

    def stored(self, name: str, record: dict, stats: dict, dtype: torch.dtype, hidden_size: int) -> None:
        """A sample's manifest columns, once its shard is in place."""
        record.update(
            shard=name,
            key=record["id"],
            hidden_size=hidden_size,
            layer_ids=self.layer_ids,
            dtype=str(dtype).removeprefix("torch."),
            **{f"hs_{k}": v for k, v in stats.items()},
        )


def shard_names(unit_id: str, num_shards: int) -> list[str]:
    return [f"{unit_id}-{j:04d}.safetensors" for j in range(num_shards)]


def reserve_pages(cfg: Config, files: list, num_bytes: int | None = None) -> None:
    """generate.reserve_shard_pages: each local shard's payload pages (`num_bytes` of each, a planned shard's
    whole payload by default) allocated on a background thread (shard_writer.InPlaceShard.reserve_in_background)."""
    gen = cfg.generate
    if gen.reserve_shard_pages if gen.reserve_shard_pages is not None else gen.num_gpus_per_worker > 0:
        for f in files:
            f.reserve_in_background(num_bytes)


class ShardPlan:
    """A prefill unit's shards, fixed before its captures arrive: every sample's T is known when its request is
    made (`_num_captured`), so the samples are grouped by their stored bytes up front, round-robin over the unit's
    shards (packing.interleaved_groups: samples whose requests finish together go to different files), and each
    shard's layout (shard_format.sample_layout of its samples) is known. On a local run dir each shard is a
    shard_writer.InPlaceShard, made here, before the unit's requests go out, and each sample's request carries its place
    in it (`kv_transfer_params["shard"]`): vLLM's connector writes the sample's stored tensors there itself
    (generate/connector.py) and leaves a note of its norms; the writer thread that reads a sample's note checks it,
    and the thread that checks a shard's last sample moves the shard into place, so a unit's shards are complete
    moments after its last capture. On an object store the thread that prepares a shard's last sample uploads the
    shard whole. Each planned conversation gets `conv.shard = (plan, group index)`; the unit's commit then writes
    only its part file (ShardSink.write with `shard_bytes()`), or, when the unit fails, `abort()` removes its
    unfinished shard files."""

    def __init__(self, sink: ShardSink, unit_id: str, convs: list, hidden_size: int):
        dtype = sink.cfg.generate.hidden_states_dtype
        layouts = [
            shard_format.sample_layout(
                c.record["id"], c.record["_num_captured"], len(sink.layer_ids), hidden_size, dtype
            )
            for c in convs
        ]
        groups = packing.interleaved_groups(
            [shard_format.layout_bytes(x) for x in layouts], sink.cfg.generate.shard_max_bytes
        )
        self.sink, self.unit_id, self.lock = sink, unit_id, threading.Lock()
        self.groups = [[convs[i] for i in g] for g in groups]
        self.layouts = [[entry for i in g for entry in layouts[i]] for g in groups]
        self.names = shard_names(unit_id, len(groups))
        self.streamed = storage.is_local(sink.out_dir)
        self.files = (
            [
                shard_writer.InPlaceShard(sink.shard_uri(name), layout, metadata={"unit_id": unit_id})
                for name, layout in zip(self.names, self.layouts, strict=True)
            ]
            if self.streamed
            else []
        )
        reserve_pages(sink.cfg, self.files)
        self.left = [len(g) for g in groups]  # samples of each shard not yet prepared
        self.written: dict[str, int] = {}
        self.error: BaseException | None = None
        for j, group in enumerate(groups):
            for i in group:
                convs[i].shard = (self, j)
                if self.streamed:
                    names = [name for name, _, _ in layouts[i]]
                    convs[i].transfer_params["shard"] = {
                        "file": self.files[j].tmp,
                        "key": convs[i].record["id"],
                        "dtype": dtype,
                        "ranges": self.files[j].ranges(names),
                    }

    def prepared(self, j: int, conv: Any, note: dict) -> None:
        """`conv`, a sample of shard j, is prepared (its writer thread, under the conversation's prepare lock): in a
        streamed shard its tensors are in place already, written by the connector."""
        try:
            if self.streamed:
                check_sample(self.sink.cfg, conv.record, conv.prepared[0], self.sink.layer_ids, self.names[j])
        except BaseException as e:  # raised by the unit's commit
            self._fail(e)
            return
        convs, start = self.groups[j], time.monotonic()
        with self.lock:
            self.left[j] -= 1
            if self.left[j] or self.error is not None:
                return
            if self.streamed:  # moved into place under the lock: abort() finds it in place and removes it, or never
                try:
                    self.written[self.names[j]] = self.files[j].finish()
                except BaseException as e:
                    self.error = self.error or e
                    return
        try:
            if self.streamed:
                hs = {name: (dtype, shape[2]) for name, dtype, shape in self.layouts[j] if name.endswith(".hs")}
                for c in convs:
                    self.sink.stored(self.names[j], c.record, c.prepared[0], *hs[f"{c.record['id']}.hs"])
            else:
                num_bytes = self.sink.write_shard(
                    self.names[j],
                    [c.record for c in convs],
                    {c.record["id"]: c.prepared[1] for c in convs},
                    {c.record["id"]: c.prepared[0] for c in convs},
                )
                with self.lock:
                    self.written[self.names[j]] = num_bytes
        except BaseException as e:
            self._fail(e)
            return
        last = convs[-1].timing
        last.update(shard_write_s=time.monotonic() - start, shard_written_at=time.time())
        for c in convs:
            c.prepared = ()  # in the shard now: the tensors can go

    def _fail(self, error: BaseException) -> None:
        with self.lock:
            self.error = self.error or error

    def shard_bytes(self) -> dict[str, int]:
        """At the unit's commit, after every sample was prepared: the shards' bytes, or the first failure."""
        if self.error is not None:
            raise self.error
        assert len(self.written) == len(self.names), f"unwritten shards: {set(self.names) - set(self.written)}"
        return self.written

    def abort(self) -> None:
        """The unit failed: remove its local shard files, moved into place or not (no part file names them; a
        connector still writing a sample fails to open its file and logs that instead), and finish no more of
        them. (A failed unit's shards uploaded whole to an object store are left to the stage's orphan sweep.)"""
        with self.lock:
            self.error = self.error or RuntimeError(f"generate: unit {self.unit_id} failed")
            for f in self.files:
                f.abort()


class FinishOrderShards:
    """A generate unit's shards on a local run dir, its samples laid out in the order they finish (ShardPlan's are
    planned before the requests go out): a sample's T is known only when its final turn does, so its place is given
    then, by vLLM's connector on the scheduler side (shard_writer.stream_target: the next free bytes of the unit's open
    shard with the fewest so far), and the connector writes the sample there as it writes a planned one (encoded and
    normed on the device, once per engine step). The unit's shards (shard_writer.InPlaceShard.open) are made before its
    requests go out, as many as its token budget fills at generate.shard_max_bytes (at most one a sample), each with
    room for the header of every sample of the unit; each conversation's final request carries them
    (`conv.capture_target["stream"]`). A writer thread checks each sample from the connector's note (norms, and its
    place), and the unit's commit writes each shard's header from the places its samples got (shard_bytes) and moves it
    into place: nothing is read back after the unit's last step. `abort()` removes the files when the unit fails. Each
    conversation gets `conv.shard = (stream, None)`."""

    streamed = True

    def __init__(self, sink: ShardSink, unit_id: str, convs: list, hidden_size: int, num_tokens: int):
        gen = sink.cfg.generate
        self.sink, self.unit_id, self.lock = sink, unit_id, threading.Lock()
        self.dtype, self.num_layers, self.hidden_size = gen.hidden_states_dtype, len(sink.layer_ids), hidden_size
        budget = shard_format.layout_bytes(self._layout("", num_tokens))
        self.names = shard_names(unit_id, max(1, min(len(convs), -(-budget // gen.shard_max_bytes))))
        # header room: every sample of the unit at the longest T it can have (offsets that large take the most digits)
        capacity = [e for c in convs for e in self._layout(c.record["id"], sink.cfg.verifier.max_model_len)]
        self.files = [
            shard_writer.InPlaceShard.open(sink.shard_uri(name), capacity, metadata={"unit_id": unit_id})
            for name in self.names
        ]
        reserve_pages(sink.cfg, self.files, -(-budget // len(self.files)))
        self.placed: list[tuple[int, int, Any]] = []  # (shard index, payload offset, conversation)
        self.written: dict[str, int] = {}
        self.error: BaseException | None = None
        stream = {
            "files": [f.tmp for f in self.files],
            "payload_start": self.files[0].payload_start,
            "dtype": self.dtype,
            "num_layers": self.num_layers,
            "hidden_size": hidden_size,
        }
        for c in convs:
            c.shard = (self, None)
            c.capture_target = {"stream": {**stream, "key": c.record["id"]}}

    def _layout(self, key: str, num_tokens: int) -> list[tuple]:
        return shard_format.sample_layout(key, num_tokens, self.num_layers, self.hidden_size, self.dtype)

    def prepared(self, j: None, conv: Any, note: dict) -> None:
        """`conv`'s final capture is in its shard (its writer thread, under the conversation's prepare lock): check
        it and keep its place for the header."""
        try:
            if "place" not in note:
                raise RuntimeError(
                    f"generate: sample {conv.record['id']} (unit {self.unit_id}): vLLM's connector "
                    "gave it no place in the unit's shards (is kv_connector the project's?)"
                )
            index, offset = note["place"].tolist()
            check_sample(self.sink.cfg, conv.record, conv.prepared[0], self.sink.layer_ids, self.names[index])
        except BaseException as e:  # raised by the unit's commit
            with self.lock:
                self.error = self.error or e
            return
        with self.lock:
            self.placed.append((index, offset, conv))

    def shard_bytes(self) -> dict[str, int]:
        """At the unit's commit, after every sample was prepared: each shard's header from its samples' places,
        the shard moved into place (a shard no sample went to is removed); the shards' bytes, or the first
        failure."""
        if self.error is not None:
            raise self.error
        start = time.monotonic()
        for j, (name, file) in enumerate(zip(self.names, self.files, strict=True)):
            placed = sorted((offset, conv) for index, offset, conv in self.placed if index == j)
            if not placed:
                file.abort()
                continue
            layout, end = [], 0
            for offset, conv in placed:
                if offset != end:  # a sample placed here whose note never came, or a place given twice
                    raise RuntimeError(
                        f"generate: shard {name}: sample {conv.record['id']} is at payload byte "
                        f"{offset}, the samples before it end at {end}"
                    )
                sample = self._layout(conv.record["id"], conv.record["num_tokens"])
                layout += sample
                end = offset + shard_format.layout_bytes(sample)
            self.written[name] = file.finish(layout)
            for _, conv in placed:
                self.sink.stored(name, conv.record, conv.prepared[0], layout[0][1], self.hidden_size)
                conv.prepared = ()  # in the shard now: the stats can go
        if self.placed:
            self.placed[-1][2].timing.update(shard_write_s=time.monotonic() - start, shard_written_at=time.time())
        return self.written

    def abort(self) -> None:
        """The unit failed: remove its shard files, moved into place or not (no part file names them)."""
        for file in self.files:
            file.abort()


class ConversationSink:
    """The sink that stores conversations and no hidden states, for two_pass's first pass:
    `generated/{unit_id}.parquet` holds the unit's regenerated conversations (input_ids,
    loss_mask, messages) or their rejects; the capture pass reads them by sample id."""

    def __init__(self, out_dir: str):
        self.out_dir = out_dir

    def committed(self, unit_id: str) -> list[dict] | None:
        uri = storage.join(self.out_dir, "generated", f"{unit_id}.parquet")
        return summaries(storage.read_parquet(uri).to_pylist(), {}) if storage.exists(uri) else None

    def records(self, unit_id: str) -> list[dict]:
        """The unit's committed first-pass records (a regenerated conversation or a reject per sample)."""
        return storage.read_parquet(storage.join(self.out_dir, "generated", f"{unit_id}.parquet")).to_pylist()

    def write(
        self, unit_id: str, records: list[dict], encoded: dict, stats: dict, shard_bytes: dict[str, int] | None = None
    ) -> list[dict]:
        assert not encoded and not shard_bytes, "the first pass of two_pass captures nothing"
        uri = storage.join(self.out_dir, "generated", f"{unit_id}.parquet")
        storage.write_parquet_atomic(uri, pa.Table.from_pylist(records, schema=PART_SCHEMA))
        return summaries(records, {})


def _attempts(out_dir: str, kind: str, unit_id: str) -> tuple[str, dict[str, Any]]:
    """attempts/<kind>-<unit>.json and what it holds (no attempts when it is absent)."""
    uri = storage.join(out_dir, "attempts", f"{kind}-{unit_id}.json")
    return uri, storage.read_json(uri) if storage.exists(uri) else {"attempts": 0, "errors": []}


def clear_attempts(out_dir: str) -> None:
    """Failed attempts count within one run of a stage: a resubmitted job (after a fix) starts afresh."""
    storage.delete(storage.join(out_dir, "attempts"))


def record_failed_attempt(out_dir: str, kind: str, unit_id: str, error: str) -> None:
    """A unit was in flight in a `kind` engine that died: count it, with the error (attempts/<kind>-<unit>.json)."""
    uri, before = _attempts(out_dir, kind, unit_id)
    storage.write_json_atomic(uri, {"attempts": before["attempts"] + 1, "errors": [*before["errors"][-4:], error]})


def check_attempts(out_dir: str, kind: str, unit_id: str, samples: list[dict[str, Any]], max_attempts: int) -> None:
    """Refuse a unit that was in flight in `max_attempts` engines that died (generate.max_unit_attempts): Ray restarts
    a dead engine actor and retries its units without end, so a failure that repeats (the engine running out of
    memory on the same work) would otherwise restart the engine forever."""
    uri, failed = _attempts(out_dir, kind, unit_id)
    if failed["attempts"] >= max_attempts:
        raise RuntimeError(
            f"generate: unit {unit_id} ({len(samples)} samples, the first {samples[0]['id']!r}) was in flight in "
            f"{failed['attempts']} {kind} engines that died (generate.max_unit_attempts={max_attempts}); the last: "
            f"{failed['errors'][-1].rstrip('.')}. The engine's own log above says why it died (e.g. CUDA out of "
            f"memory); {uri} lists the errors"
        )


def summaries(records: list[dict[str, Any]], shard_bytes: dict[str, int]) -> list[dict[str, Any]]:
    """One row per sample (SUMMARY_KEYS); a shard's bytes are counted once, on the first sample stored in it."""
    seen: set[str] = set()
    out = []
    for r in records:
        num_bytes = 0
        if r.get("shard") and r["shard"] not in seen:
            seen.add(r["shard"])
            num_bytes = shard_bytes.get(r["shard"], 0)
        out.append(
            {
                "id": r["id"],
                "unit_id": r["unit_id"],
                "status": r["status"],
                "num_tokens": r.get("num_tokens") or 0,
                "num_bytes": num_bytes,
            }
        )
    return out
