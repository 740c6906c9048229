"""Hidden-state shards: many samples per safetensors file, found through a Parquet manifest.

A shard holds, for each sample `key`:
    {key}.hs      shape [T, L, H]  bfloat16, or float8_e4m3fn when stored as fp8
    {key}.scale   shape [T, L]     int8, only for fp8: a power-of-two exponent per token and layer (x ~= hs * 2**scale)
where T = number of captured tokens, L = number of captured layers (aux layers then the final layer), H = hidden size.

A manifest row per sample names its shard file and key (MANIFEST_SCHEMA). Shards are written under a temporary name
and moved into place (storage.atomic_local_file, storage.write_bytes_atomic), so a shard's final name only ever holds
a complete file. The local shards of a unit are written sample by sample into their final offsets by vLLM's
connector itself (StreamedShard, planned_capture): a prefill unit's at places planned before its requests go out, a
generate unit's at places given as its requests finish (stream_target); its hidden states are written once, into
the shard.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import struct
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future, ThreadPoolExecutor

import pyarrow as pa
import torch
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from safetensors.torch import save_file

from eagle3_ray.core import storage

FP8_MAX = 448.0  # largest finite float8_e4m3fn
# safetensors' header names of the dtypes shards hold (its format: 8-byte little-endian header length, the JSON
# header {name: {dtype, shape, data_offsets [begin, end) into the payload}, "__metadata__": {...}}, the payload)
SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "I8": torch.int8,
    "I32": torch.int32,
    "I64": torch.int64,
}


def response_id(prompt_id: str, k: int) -> str:
    """The sample id of a prompt's k-th regenerated response (generate.responses_per_prompt): the prompt's own id for
    k = 0, `<prompt id>#<k>` after it. Ingested ids never end in `#<digits>` (content hashes, `sharegpt:<id>`)."""
    return prompt_id if k == 0 else f"{prompt_id}#{k}"


def prompt_of(sample_id: str) -> str:
    """The prompt id a sample id was made from (response_id's inverse): samples of one prompt share it."""
    base, sep, k = sample_id.rpartition("#")
    return base if sep and k.isdigit() else sample_id


def is_greedy_response(sample_id: str, temperature: float, responses_per_prompt: int) -> bool:
    """Whether generate decodes this sample's response greedily: every one at temperature 0; with several responses
    per prompt, the first (k = 0, the prompt's own id) is the greedy one and the others are sampled at
    `temperature`, so each prompt has the response greedy serving decodes, which training's estimate replays."""
    return temperature == 0 or (responses_per_prompt > 1 and prompt_of(sample_id) == sample_id)


MANIFEST_SCHEMA = pa.schema(
    [
        ("id", pa.string()),  # sample id (content hash from ingest)
        ("shard", pa.string()),  # shard file name, relative to the shards directory
        ("key", pa.string()),  # tensor key prefix inside the shard
        ("num_tokens", pa.int32()),  # T: captured tokens (input_ids[:T] of the conversation)
        ("dtype", pa.string()),  # "bfloat16" or "float8_e4m3fn"
        ("layer_ids", pa.list_(pa.int32())),  # captured layer ids, aux ids then the final layer id
        ("hidden_size", pa.int32()),
    ]
)


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 with a power-of-two scale per (token, layer). x: [T, L, H] -> (q [T, L, H] float8_e4m3fn, exp [T, L] int8),
    x ~= q * 2**exp. A power of two rescales a floating-point value exactly, so it costs no precision over a float32
    scale, and one byte instead of four keeps fp8 storage at half of bf16 even for small hidden sizes."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1).clamp(min=2.0**-100)  # shape: [T, L]
    exp = torch.ceil(torch.log2(amax / FP8_MAX)).clamp(-127, 127)
    q = torch.ldexp(xf, -exp.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, exp.to(torch.int8)


def dequantize_fp8(q: torch.Tensor, exp: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [T, L, H] float8_e4m3fn, exp [T, L] int8 -> [T, L, H] in `dtype`."""
    return torch.ldexp(q.float(), exp.float().unsqueeze(-1)).to(dtype)


def encode_sample(key: str, hidden_states: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """Tensors to store for one sample; hidden_states: [T, L, H] on any device (no host sync). "float32" is exact
    storage, for checks against a reference forward pass."""
    if dtype == "float32":
        return {f"{key}.hs": hidden_states.float().contiguous()}
    if dtype == "fp8":
        q, scale = quantize_fp8(hidden_states)
        return {f"{key}.hs": q.contiguous(), f"{key}.scale": scale.contiguous()}
    if dtype == "bfloat16":
        return {f"{key}.hs": hidden_states.to(torch.bfloat16).contiguous()}
    raise ValueError(f"hidden_states_dtype must be 'bfloat16', 'fp8' or 'float32', got {dtype!r}")


def sample_layout(key: str, num_tokens: int, num_layers: int, hidden_size: int, dtype: str) -> list[tuple]:
    """(name, torch dtype, shape) of each tensor encode_sample stores for a sample of `num_tokens` captured tokens."""
    hs = (f"{key}.hs", [num_tokens, num_layers, hidden_size])
    if dtype == "fp8":
        return [(hs[0], torch.float8_e4m3fn, hs[1]), (f"{key}.scale", torch.int8, [num_tokens, num_layers])]
    if dtype in ("bfloat16", "float32"):
        return [(hs[0], getattr(torch, dtype), hs[1])]
    raise ValueError(f"hidden_states_dtype must be 'bfloat16' or 'fp8', got {dtype!r}")


def layout_ranges(layout: list[tuple], start: int = 0) -> dict[str, tuple[int, int]]:
    """[begin, end) of each tensor of a sample_layout laid out one after the other from `start`."""
    ranges = {}
    for name, dtype, shape in layout:
        ranges[name] = (start, start + layout_bytes([(name, dtype, shape)]))
        start = ranges[name][1]
    return ranges


def layout_bytes(layout: list[tuple]) -> int:
    """Bytes of the tensors a sample_layout lists."""
    return sum(dtype.itemsize * math.prod(shape) for _, dtype, shape in layout)


def read_header(read_at: Callable[[int, int], bytes]) -> tuple[dict, int, int]:
    """A safetensors file's header through `read_at(num_bytes, offset)`: ({tensor name: entry} without
    `__metadata__`, where the payload starts, the payload's bytes as the entries promise them)."""
    (header_len,) = struct.unpack("<Q", read_at(8, 0))
    header = json.loads(read_at(header_len, 8))
    header.pop("__metadata__", None)
    return header, 8 + header_len, max((entry["data_offsets"][1] for entry in header.values()), default=0)


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


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a local safetensors file, its payload read with one `readinto` into memory of its own (not
    mapped lazily as safetensors' load_file does, so a pass over the tensors takes no page faults)."""
    with open(path, "rb", buffering=0) as f:
        header, payload, size = read_header(lambda num_bytes, offset: os.pread(f.fileno(), num_bytes, offset))
        f.seek(payload)
        data = torch.empty(size, dtype=torch.uint8)
        view, got = memoryview(data.numpy()), 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                raise ValueError(f"{path}: {got} of its {size} payload bytes, the file ends there")
            got += n
    tensors = {}
    for name, meta in header.items():
        dtype, (begin, end) = SAFETENSORS_DTYPES[meta["dtype"]], meta["data_offsets"]
        raw = data[begin:end] if begin % dtype.itemsize == 0 else data[begin:end].clone()  # view needs alignment
        tensors[name] = raw.view(dtype).view(meta["shape"])
    return tensors


def safetensors_header(
    layout: list[tuple[str, torch.dtype, list[int]]], metadata: dict[str, str] | None = None, size: int | None = None
) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The first bytes of a safetensors file holding `layout`'s tensors one after the other, in its order: the
    8-byte length and the JSON header, padded with spaces (which safetensors allows) so that the payload starts
    8-byte aligned, as safetensors writes it, or at `size` bytes (the room an open StreamedShard kept for it); and
    each tensor's [begin, end) in the payload."""
    names = {v: k for k, v in SAFETENSORS_DTYPES.items()}
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    payload_ranges = layout_ranges(layout)
    for name, dtype, shape in layout:
        header[name] = {"dtype": names[dtype], "shape": list(shape), "data_offsets": list(payload_ranges[name])}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    room = 8 + len(encoded) + (-len(encoded) % 8) if size is None else size
    if room < 8 + len(encoded):
        raise ValueError(f"a safetensors header of {len(encoded)} bytes does not fit the {room - 8} kept for it")
    return struct.pack("<Q", room - 8) + encoded + b" " * (room - 8 - len(encoded)), payload_ranges


class StreamedShard:
    """A local shard written tensor by tensor into its final offsets (write_at, from any thread or process: vLLM's
    connector writes a planned sample itself, see planned_capture) as soon as each sample is captured, instead of
    the whole shard once the last sample is. `finish()` (after every tensor was written) has safetensors open the
    file, which checks the header against the payload, and moves it into place; `abort()` removes it.

    Planned (a prefill unit: every tensor's name, dtype and shape are known before any value): the header and each
    tensor's byte range are fixed when it is made.
        shard = StreamedShard(uri, layout, metadata)     # layout: [(name, torch dtype, shape)], in file order
        write_at(shard.tmp, tensors, shard.ranges(tensors))   # any subset of the layout, e.g. one sample's tensors
        num_bytes = shard.finish()
    Open (a generate unit: a sample's T is known when its request finishes): made with room for the header of every
    sample that may land in it (`capacity`: their layouts at the largest T); vLLM's connector gives each finished
    sample the next free payload bytes of one of its unit's open shards (stream_target), and the header follows
    when the unit is complete, from the samples in payload order.
        shard = StreamedShard.open(uri, capacity, metadata)
        ... the connector writes each sample at stream_target's ranges ...
        num_bytes = shard.finish(layout)                 # the samples it got, in payload order
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
    ) -> StreamedShard:
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
    """Two threads per process for StreamedShard.reserve_in_background (made at first use)."""
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
    is not created: after StreamedShard.abort() a late writer fails instead of leaving a partial shard. A tensor
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
    (StreamedShard.open, commit.ShardStream): the next free payload bytes of the shard that has taken the fewest so
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


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class GreedyPacker:
    """Greedy packing in arrival order: items go into the open group until the next would pass `budget`; an item
    larger than the budget gets a group of its own. The one packer of the project: generate's work units (tokens),
    shards (bytes) and the online stream's training batches (tokens).

        packer = GreedyPacker(budget)
        for item, size in items:
            if (group := packer.add(item, size)) is not None: use(group)
        use(packer.flush())   # the last, possibly partial group ([] when nothing is left)
    """

    def __init__(self, budget: int):
        self.budget = budget
        self.items: list = []
        self.used = 0

    def add(self, item, size: int) -> list | None:
        """Adds `item`; returns the group it closed (the items before it), or None."""
        closed = self.flush() if self.items and self.used + size > self.budget else None
        self.items.append(item)
        self.used += size
        return closed

    def flush(self) -> list:
        group, self.items, self.used = self.items, [], 0
        return group


def greedy_groups(sizes: list[int], budget: int) -> list[list[int]]:
    """Indices of `sizes` grouped by GreedyPacker."""
    packer, groups = GreedyPacker(budget), []
    for i, size in enumerate(sizes):
        if (group := packer.add(i, size)) is not None:
            groups.append(group)
    return groups + ([last] if (last := packer.flush()) else [])


def interleaved_groups(sizes: list[int], budget: int) -> list[list[int]]:
    """As many groups as greedy_groups makes (more when needed to keep each within `budget`), filled round-robin:
    item i goes to group i % k. Consecutive items land in different groups: samples that finish together (requests
    finish roughly in the order they were sent) are written into different shard files at once, where writes into
    one file wait on each other (the kernel serializes buffered writes to one file)."""
    k = len(greedy_groups(sizes, budget))
    while True:
        groups = [list(range(j, len(sizes), k)) for j in range(k)]
        if all(len(g) == 1 or sum(sizes[i] for i in g) <= budget for g in groups):
            return groups
        k += 1


def write_shard(uri: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> int:
    """Write one shard atomically; returns its size in bytes. A local shard is written by safetensors straight into
    its temp file (no serialized copy of the whole shard in memory); an object-store shard is uploaded whole."""
    if storage.is_local(uri):
        with storage.atomic_local_file(uri) as tmp:
            save_file(tensors, tmp, metadata=metadata)
        return os.path.getsize(storage.local_path(uri))
    data = st_save(tensors, metadata=metadata)
    storage.write_bytes_atomic(uri, data)
    return len(data)


def load_shard(uri: str) -> dict[str, torch.Tensor]:
    """All tensors of a shard. Local files are memory-mapped lazily; URIs are read whole."""
    if "://" not in uri or uri.startswith("file://"):
        from safetensors import safe_open

        path = uri[len("file://") :] if uri.startswith("file://") else uri
        with safe_open(os.path.abspath(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    return st_load(storage.read_bytes(uri))


def read_sample(shard_uri: str, key: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Hidden states [T, L, H] of one sample, decoded (fp8 dequantized) to `dtype`."""
    if "://" not in shard_uri or shard_uri.startswith("file://"):
        from safetensors import safe_open

        path = shard_uri[len("file://") :] if shard_uri.startswith("file://") else shard_uri
        with safe_open(os.path.abspath(path), framework="pt") as f:
            hs = f.get_tensor(f"{key}.hs")
            scale = f.get_tensor(f"{key}.scale") if hs.dtype == torch.float8_e4m3fn else None
    else:
        tensors = st_load(storage.read_bytes(shard_uri))
        hs, scale = tensors[f"{key}.hs"], tensors.get(f"{key}.scale")
    if hs.dtype == torch.float8_e4m3fn:
        return dequantize_fp8(hs, scale, dtype)
    return hs.to(dtype)


# capture_norms' rows at a time on the CPU, in values: under ATen's grain size (32768), so each chunk's reduction runs
# on the calling thread without an OpenMP team. vLLM's connector runs it in threads of vLLM's CPU worker, whose own
# OpenMP threads hold the cores for the forward pass: teams started from the connector's threads (larger chunks) would
# contend with them and slow the stage's decode on a few cores.
NORM_CHUNK_VALUES = (1 << 15) - 1


def capture_norms(hidden_states: torch.Tensor, per_row: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """What capture_stats needs of a captured sample, hidden_states [T, L, H], in one pass: the fp32 L2 norm of
    every token row [T, L] and the NaN/inf values per layer [L] (int64; [T, L] per token row with `per_row`). The row
    norm is 0 exactly for a zero row and non-finite exactly for a row holding NaN/inf (hidden states are far below
    fp32's overflow of a squared bf16), so on the CPU the values are counted only in the rare rows that are, and the
    norms go through the sample a few token rows at a time (NORM_CHUNK_VALUES: the same values as one call, each
    chunk's fp32 copy staying in cache, no OpenMP team). On a GPU (vLLM's connector, before its copy to the host)
    both are whole-tensor kernels, with no sync."""
    if hidden_states.is_cuda:
        norms = torch.linalg.vector_norm(hidden_states, dim=-1, dtype=torch.float32)
        nonfinite = (~torch.isfinite(hidden_states)).sum(dim=2)  # shape: [T, L]
        return norms, nonfinite if per_row else nonfinite.sum(dim=0)
    norms = torch.empty(hidden_states.shape[:2], dtype=torch.float32)  # shape: [T, L]
    rows = max(1, NORM_CHUNK_VALUES // max(1, math.prod(hidden_states.shape[1:])))
    for start in range(0, hidden_states.shape[0], rows):
        torch.linalg.vector_norm(
            hidden_states[start : start + rows], dim=-1, dtype=torch.float32, out=norms[start : start + rows]
        )
    nonfinite = torch.zeros(norms.shape, dtype=torch.int64)
    bad = ~torch.isfinite(norms).all(dim=1)  # shape: [T]
    if bool(bad.any()):
        nonfinite[bad] = (~torch.isfinite(hidden_states[bad])).sum(dim=2)
    return norms, nonfinite if per_row else nonfinite.sum(dim=0)


def stats_from_norms(norms: torch.Tensor, nonfinite: torch.Tensor) -> dict[str, list]:
    """Per-layer sanity numbers of one captured sample from its capture_norms: `zero_rows` [L] tokens whose whole row
    is 0, `nonfinite` [L] NaN/inf values, and over each layer's token rows `norm_sum`, `norm_min`, `norm_max` [L] of
    the L2 norm (non-finite rows left out)."""
    rows_finite = torch.isfinite(norms)  # shape: [T, L]
    return {
        "zero_rows": (norms == 0).sum(dim=0).tolist(),
        "nonfinite": nonfinite.tolist(),
        "norm_sum": torch.where(rows_finite, norms, 0.0).double().sum(dim=0).tolist(),
        "norm_min": torch.where(rows_finite, norms, torch.inf).amin(dim=0).tolist(),
        "norm_max": torch.where(rows_finite, norms, -torch.inf).amax(dim=0).tolist(),
    }


def capture_stats(hidden_states: torch.Tensor) -> dict[str, list]:
    """stats_from_norms of a sample's hidden states [T, L, H]."""
    return stats_from_norms(*capture_norms(hidden_states))


def bad_row_counts(hs: torch.Tensor) -> dict[str, list[int]]:
    """`zero_rows` and `nonfinite` per layer of stored hidden states [T, L, H], the two numbers
    capture_problem reads from capture_stats, from two reductions over the stored dtype (cheaper than
    capture_stats's fp32 norms). fp8 bits: |q| == 0 is 0x00, NaN is 0x7f (e4m3fn has no inf; the power-of-two
    exponents neither zero nor overflow a value), so a row's maximum of the low 7 bits says both."""
    if hs.dtype == torch.float8_e4m3fn:
        bits = hs.view(torch.uint8)
        row_max = torch.empty(hs.shape[:2], dtype=torch.uint8)  # shape: [T, L]
        chunk = torch.empty((min(256, hs.shape[0]), *hs.shape[1:]), dtype=torch.uint8)  # small, reused: no faults
        for start in range(0, hs.shape[0], chunk.shape[0]):
            part = chunk[: min(chunk.shape[0], hs.shape[0] - start)]
            torch.bitwise_and(bits[start : start + part.shape[0]], 0x7F, out=part)
            torch.amax(part, dim=-1, out=row_max[start : start + part.shape[0]])
        zero, bad = row_max == 0, row_max == 0x7F
    else:  # amax/amin propagate NaN; +inf shows in the max, -inf in the min
        hi, lo = hs.amax(dim=-1), hs.amin(dim=-1)  # shape: [T, L]
        zero, bad = (hi == 0) & (lo == 0), ~(torch.isfinite(hi) & torch.isfinite(lo))
    nonfinite = [0] * hs.shape[1]
    if bool(bad.any()):
        nonfinite = (~torch.isfinite(hs[bad.any(dim=1)].float())).sum(dim=(0, 2)).tolist()
    return {"zero_rows": zero.sum(dim=0).tolist(), "nonfinite": nonfinite}


def capture_problem(
    stats: dict[str, list],
    num_tokens: int,
    layer_ids: list[int],
    *,
    max_zero_row_share: float,
    max_nonfinite_values: int,
) -> str | None:
    """What is wrong with a sample's capture (from `capture_stats`), naming the layer id, or None. vLLM has handed
    out all-zero and NaN hidden states for some architectures (wrong cache-group slot mapping); such a capture
    trains a drafter that never matches the verifier, so it must stop the stage, not reach the shards."""
    for j, layer in enumerate(layer_ids):
        if stats["nonfinite"][j] > max_nonfinite_values:
            return f"layer {layer}: {stats['nonfinite'][j]} non-finite values (allowed {max_nonfinite_values})"
        share = stats["zero_rows"][j] / max(num_tokens, 1)
        if share > max_zero_row_share:
            return (
                f"layer {layer}: {stats['zero_rows'][j]} of {num_tokens} token rows are all zero "
                f"({share:.2f} > generate.max_zero_row_share {max_zero_row_share})"
            )
    return None


def aggregate_stats(per_sample: list[dict[str, list]], num_tokens: list[int], layer_ids: list[int]) -> dict:
    """Per-layer totals over samples (`capture_stats` dicts and their token counts): zero-row share, non-finite
    values, norm mean/min/max, keyed by layer id."""
    total = max(sum(num_tokens), 1)
    out = {}
    for j, layer in enumerate(layer_ids):
        out[str(layer)] = {
            "zero_row_share": sum(s["zero_rows"][j] for s in per_sample) / total,
            "nonfinite": int(sum(s["nonfinite"][j] for s in per_sample)),
            "norm_mean": sum(s["norm_sum"][j] for s in per_sample) / total,
            "norm_min": min((s["norm_min"][j] for s in per_sample), default=None),
            "norm_max": max((s["norm_max"][j] for s in per_sample), default=None),
        }
    return out
