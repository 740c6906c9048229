"""Writing a local shard in place, sample by sample, as its samples are captured: vLLM's connector writes each
sample's tensors straight into their final offsets of the shard file, so its hidden states are written once.

A prefill unit's samples go to places planned before its requests go out (InPlaceShard, planned_capture); a generate
unit's to places given as its requests finish (InPlaceShard.open, stream_target). The connector's device-to-host
copies land in a pinned HostArena, and its writer threads write one file's samples one after another (PerFileJobs).
The tensors and their layout are shard_format's; a shard's final name only ever holds a complete file.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3_ray.core import storage
from eagle3_ray.core.capture_checks import capture_norms
from eagle3_ray.core.shard_format import encode_sample, layout_bytes, layout_ranges, safetensors_header, sample_layout


class HostArena:
    """Host memory reserved once and lent out in pieces: the connector's device-to-host copies of finished
    requests' captures (pinned, so the copies run asynchronously). Fresh pinned memory costs a cudaHostAlloc on
    vLLM's worker thread, which holds up the engine's next step for as long as pinning takes, seconds for one decode
    step's captures (torch's pinned cache keeps freed blocks by power-of-two size, so a fresh engine and every new
    size pays it). First fit over the free ranges, in 4 KiB pages; `take` returns None when no
    free range is large enough (the caller takes fresh memory then). Safe from any thread."""

    PAGE_BYTES = 4096

    def __init__(self, num_bytes: int, pin_memory: bool):
        self.data = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pin_memory)
        self.free: list[list[int]] = [[0, num_bytes]]  # [begin, end) byte ranges, sorted, never touching
        self.lock = threading.Lock()

    def take(self, num_bytes: int) -> tuple[int, torch.Tensor] | None:
        """(where it starts, `num_bytes` of the arena), held until `give(start, num_bytes)`; or None."""
        size = -(-num_bytes // self.PAGE_BYTES) * self.PAGE_BYTES
        with self.lock:
            for i, (begin, end) in enumerate(self.free):
                if end - begin >= size:
                    if end - begin == size:
                        del self.free[i]
                    else:
                        self.free[i][0] = begin + size
                    return begin, self.data[begin : begin + num_bytes]
        return None

    def give(self, start: int, num_bytes: int) -> None:
        end = start + -(-num_bytes // self.PAGE_BYTES) * self.PAGE_BYTES
        with self.lock:
            i = bisect.bisect(self.free, [start, end])
            assert (i == 0 or self.free[i - 1][1] <= start) and (i == len(self.free) or end <= self.free[i][0]), (
                f"range [{start}, {end}) given back twice"
            )
            self.free.insert(i, [start, end])
            if i + 1 < len(self.free) and self.free[i + 1][0] == end:  # merge with the range after it
                self.free[i][1] = self.free.pop(i + 1)[1]
            if i > 0 and self.free[i - 1][1] == start:  # and the one before
                self.free[i - 1][1] = self.free.pop(i)[1]


class InPlaceShard:
    """One local shard file written in place: tensor by tensor into its final offsets (write_at, from any thread or
    process: vLLM's connector writes a planned sample itself, see planned_capture) as soon as each sample is
    captured, where shards.write_shard writes a whole shard once its last sample is. `finish()` (after every tensor
    was written) has safetensors open the file, which checks the header against the payload, and moves it into
    place; `abort()` removes it.

    Planned (a prefill unit: every tensor's name, dtype and shape are known before any value): the header and each
    tensor's byte range are fixed when it is made.
        shard = InPlaceShard(uri, layout, metadata)           # layout: [(name, torch dtype, shape)], in file order
        write_at(shard.tmp, tensors, shard.ranges(tensors))   # any subset of the layout, e.g. one sample's tensors
        num_bytes = shard.finish()
    Open (a generate unit: a sample's T is known when its request finishes): made with room for the header of every
    sample that may land in it (`capacity`: their layouts at the largest T); vLLM's connector gives each finished
    sample the next free payload bytes of one of its unit's open shards (stream_target), and the header follows
    when the unit is complete, from the samples in payload order.
        shard = InPlaceShard.open(uri, capacity, metadata)
        ... the connector writes each sample at stream_target's ranges ...
        num_bytes = shard.finish(layout)                      # the samples it got, in payload order
    """

    def __init__(
        self,
        uri: str,
        layout: list[tuple[str, torch.dtype, list[int]]],
        metadata: dict[str, str] | None = None,
        header_at_finish: bool = False,
    ):
        self.metadata, self.finished, self._reserving = metadata, False, None
        header, payload_ranges = safetensors_header(layout, metadata)
        self.payload_start = len(header)
        # each tensor's [begin, end) in the file (a planned shard's; an open shard's come from stream_target)
        payload = {} if header_at_finish else payload_ranges
        self.file_ranges = {name: [self.payload_start + b, self.payload_start + e] for name, (b, e) in payload.items()}
        self.size = self.payload_start + max((e for _, e in payload.values()), default=0)
        self.path = storage.local_path(uri)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.tmp = f"{self.path}.tmp-{uuid.uuid4().hex[:8]}"  # the temp name storage.atomic_local_file uses
        fd = os.open(self.tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        try:
            os.ftruncate(fd, self.size)
            if not header_at_finish:
                os.pwrite(fd, header, 0)
        finally:
            os.close(fd)

    @classmethod
    def open(
        cls, uri: str, capacity: list[tuple[str, torch.dtype, list[int]]], metadata: dict[str, str] | None = None
    ) -> InPlaceShard:
        return cls(uri, capacity, metadata, header_at_finish=True)

    def reserve_in_background(self, num_bytes: int | None = None) -> None:
        """reserve() on a thread of this process's reservation pool; finish() and abort() wait for it first (a
        reservation after finish() would lengthen the finished file)."""
        self._reserving = _reserve_pool().submit(self.reserve, num_bytes)

    def _wait_reserved(self) -> None:
        if self._reserving is not None:
            self._reserving.result()
            self._reserving = None

    def reserve(self, num_bytes: int | None = None) -> None:
        """Allocate the file's payload pages now (posix_fallocate of `num_bytes` from the payload's start; a planned
        shard's whole payload by default), so that the writes of its samples later only copy. On tmpfs (/dev/shm, a
        run's scratch) a write into a page not yet allocated faults, allocates and zeroes it on the writer's
        thread (bench/gpu/copy_bench.py; docs/benchmarks.md#the-stages-tail-shard-writes). Data already written
        is kept; finish() truncates what the samples did not fill. An error (no space left) names the shard."""
        if num_bytes is None:
            num_bytes = self.size - self.payload_start
        if num_bytes <= 0:
            return
        fd = os.open(self.tmp, os.O_WRONLY)
        try:
            os.posix_fallocate(fd, self.payload_start, num_bytes)
        except OSError as e:
            raise OSError(e.errno, f"reserving {num_bytes} bytes of shard {self.tmp}: {e.strerror}") from e
        finally:
            os.close(fd)

    def ranges(self, names) -> dict[str, list[int]]:
        """[begin, end) file offsets of these tensors (a planned shard's)."""
        return {name: self.file_ranges[name] for name in names}

    def finish(self, layout: list[tuple[str, torch.dtype, list[int]]] | None = None) -> int:
        """An open shard's `layout` (its samples' tensors in payload order) becomes its header, in the room kept
        for it; the file ends where that payload does."""
        self._wait_reserved()
        if layout is not None:
            header, payload_ranges = safetensors_header(layout, self.metadata, size=self.payload_start)
            self.size = self.payload_start + max((e for _, e in payload_ranges.values()), default=0)
            fd = os.open(self.tmp, os.O_WRONLY)
            try:
                os.pwrite(fd, header, 0)
                os.ftruncate(fd, self.size)
            finally:
                os.close(fd)
        with safe_open(self.tmp, framework="pt"):
            pass  # safetensors rejects a header whose offsets do not cover the payload exactly
        os.replace(self.tmp, self.path)
        self.finished = True
        return self.size

    def abort(self) -> None:
        """Remove the file, finished (its unit failed after it was moved into place) or not."""
        try:
            self._wait_reserved()
        except OSError:
            pass  # the file goes anyway
        for path in (self.tmp, self.path) if self.finished else (self.tmp,):
            if os.path.exists(path):
                os.remove(path)


_RESERVE_LOCK = threading.Lock()
_reserve_executor: ThreadPoolExecutor | None = None


def _reserve_pool() -> ThreadPoolExecutor:
    """Two threads per process for InPlaceShard.reserve_in_background (made at first use)."""
    global _reserve_executor
    with _RESERVE_LOCK:
        if _reserve_executor is None:
            _reserve_executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="shard-reserve")
        return _reserve_executor


class PerFileJobs:
    """Jobs on `executor` that write into files: one file's jobs run one after another, in the order submitted,
    and different files' jobs in parallel. A write into a tmpfs file holds the file's inode lock, so a second
    thread writing the same file only waits, while jobs for other files queue behind it in a plain pool's FIFO
    (docs/benchmarks.md#the-stages-tail-shard-writes). The connector's writer threads take a step's samples in
    unit order, each unit's into its own shards: this lets them write the units side by side.

        jobs = PerFileJobs(pool)
        future = jobs.submit(path, fn)   # a concurrent.futures.Future of fn()
    """

    def __init__(self, executor: Executor):
        self._executor = executor
        self._lock = threading.Lock()
        self._queues: dict[str, deque] = {}

    def submit(self, path: str, fn: Callable[[], object]) -> Future:
        future: Future = Future()
        with self._lock:
            queue = self._queues.get(path)
            if queue is not None:  # the file's drain is running or queued: it takes this job after the others
                queue.append((fn, future))
                return future
            # under the lock: the drain waits for the queue below, and a shut-down pool raises before there is one
            self._executor.submit(self._drain, path)
            self._queues[path] = deque([(fn, future)])
        return future

    def _drain(self, path: str) -> None:
        while True:
            with self._lock:
                queue = self._queues[path]
                if not queue:
                    del self._queues[path]
                    return
                fn, future = queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as e:  # the job's caller gets it through its future
                future.set_exception(e)
            else:
                future.set_result(result)


def write_at(path: str, tensors: dict[str, torch.Tensor], ranges: dict[str, list[int]]) -> None:
    """Each tensor's bytes at its [begin, end) offsets of an existing file (os.pwrite, its own descriptor). The file
    is not created: after InPlaceShard.abort() a late writer fails instead of leaving a partial shard. A tensor
    whose bytes do not fill its range exactly (another T than planned) raises, naming the file and the tensor."""
    fd = os.open(path, os.O_WRONLY)
    try:
        for name, t in tensors.items():
            begin, end = ranges[name]
            data = memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
            if len(data) != end - begin:
                raise ValueError(
                    f"{path}: {name} {t.dtype} {list(t.shape)} is {len(data)} bytes, its place in the "
                    f"shard {end - begin}"
                )
            written = 0
            while written < len(data):
                written += os.pwrite(fd, data[written:], begin + written)
    finally:
        os.close(fd)


def planned_capture(hidden_states: torch.Tensor, target: dict) -> dict[str, torch.Tensor]:
    """What vLLM's connector (generate/connector.py) makes of a captured sample [T, L, H] that has a place in a
    planned shard, on the device the capture is on: the tensors to store (encode_sample, named as in the shard) and
    its `norms` and `nonfinite` (capture_norms). `target` (commit.ShardPlan, through the request's
    kv_transfer_params["shard"]): {"file": the shard's temp file, "key", "dtype", "ranges": write_at's ranges}."""
    return planned_sample(planned_rows(hidden_states, target["dtype"]), target["key"])


def planned_rows(hidden_states: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """planned_capture of the token rows of one or more samples at once ([N, L, H] on any device, no host sync;
    the connector runs it once per engine step for all the step's finished samples): the stored tensors of
    encode_sample by their suffix ("hs", and "scale" for fp8), `norms` [N, L] and `nonfinite` [N, L] counted per
    token row. Every tensor is cut by token rows; planned_sample makes a sample's planned_capture of its rows."""
    norms, nonfinite = capture_norms(hidden_states, per_row=True)
    stored = {name.removeprefix("."): t for name, t in encode_sample("", hidden_states, dtype).items()}
    return {**stored, "norms": norms, "nonfinite": nonfinite}


def planned_sample(rows: dict[str, torch.Tensor], key: str) -> dict[str, torch.Tensor]:
    """The planned_capture of sample `key` from the planned_rows of its own token rows."""
    out = {f"{key}.{name}": t for name, t in rows.items() if name not in ("norms", "nonfinite")}
    return {**out, "norms": rows["norms"], "nonfinite": rows["nonfinite"].sum(dim=0)}


def stream_target(stream: dict, num_tokens: int, used: dict[str, int]) -> dict:
    """The place of a finished sample of `num_tokens` captured tokens in its unit's open shards
    (InPlaceShard.open, commit.FinishOrderShards): the next free payload bytes of the shard that has taken the fewest so
    far. vLLM's connector calls it on the scheduler side, where requests finish one at a time, so the places never
    overlap; `used` (the connector's) counts each shard file's payload bytes given out. `stream` (the request's
    kv_transfer_params["stream"]): {"files": the open shards' temp files, "payload_start": where their payload
    starts, "key", "dtype", "num_layers", "hidden_size"}. Returns a planned_capture target whose `place`,
    [shard index, payload offset], the connector's note carries back (write_planned_capture)."""
    layout = sample_layout(stream["key"], num_tokens, stream["num_layers"], stream["hidden_size"], stream["dtype"])
    index = min(range(len(stream["files"])), key=lambda i: used.get(stream["files"][i], 0))
    file = stream["files"][index]
    offset = used.get(file, 0)
    used[file] = offset + layout_bytes(layout)
    ranges = {name: list(r) for name, r in layout_ranges(layout, stream["payload_start"] + offset).items()}
    return {"file": file, "key": stream["key"], "dtype": stream["dtype"], "ranges": ranges, "place": [index, offset]}


def write_planned_capture(
    tensors: dict[str, torch.Tensor], token_ids: torch.Tensor, target: dict, note_path: str, stamps: list[float] = ()
) -> None:
    """The connector's write of a planned_capture (host tensors): the stored tensors into their place in the shard,
    then a note of a few KB at the request's capture path (`token_ids` [T], `norms` [T, L], `nonfinite` [L], and an
    open shard's `place` [2]: stream_target's) for the engine actor's writer, which checks it instead of reading the
    capture back (commit.CaptureWriter). `stamps` (the connector's times, time.time()) go into the note as `stamps`
    with the time the shard write ended after them."""
    write_at(target["file"], {name: tensors[name] for name in target["ranges"]}, target["ranges"])
    note = {"token_ids": token_ids, "norms": tensors["norms"], "nonfinite": tensors["nonfinite"]}
    if stamps:
        note["stamps"] = torch.tensor([*stamps, time.time()], dtype=torch.float64)
    if "place" in target:
        note["place"] = torch.tensor(target["place"], dtype=torch.int64)
    save_file(note, note_path)
