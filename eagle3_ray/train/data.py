"""Training data for the drafter: the generate stage's shards read lazily, one sample at a time, packed with
speculators' sampler into the batches its collate function builds. Pure torch + safetensors + pyarrow; no Ray, no vLLM.

A sample as stored (docs/design.md, generate): hidden states [T, L, H] for input_ids[:T], L = aux layers + final.
A sample as read here (speculators' BaseDataset layout, before its `shift_batch`):
    input_ids                    [T]         input_ids[:T] of the conversation
    hidden_states                [T, A*H]    aux layers concatenated (A = len(aux_layer_ids))
    verifier_last_hidden_states  [T, H]      final layer L, pre-norm (the target distribution's input)
    loss_mask                    [T]         1 on assistant tokens
`shift_batch` then aligns position i as (x[i+1], g[i], y[i+1], l[i+1]):

    input_ids      x0 x1 x2 x3 ... x(T-1)        ->  x1 x2 ... x(T-1)
    hidden_states  g0 g1 g2 g3 ... g(T-1)        ->  g0 g1 ... g(T-2)
    verifier_last  y0 y1 y2 y3 ... y(T-1)        ->  y1 y2 ... y(T-1)
    loss_mask      l0 l1 l2 l3 ... l(T-1)        ->  l1 l2 ... l(T-1)

so the drafter sees the verifier state after x_i plus the embedding of x_(i+1), and learns the verifier's
distribution for x_(i+2) (lm_head(norm(y_(i+1)))).

Hidden states travel in their stored ("wire") dtype, bf16 or fp8 with exponents in `{key}_exp` ([T, A] and [T, 1]),
from the shard to the training device; `decode` turns them into the training dtype there (on the GPU after the copy),
so a loader worker moves the stored bytes once and never converts them. The capture check is two reductions in the
stored dtype (not fp32 norms), and a batch is written once, straight into shared memory (BatchRing), padding alone
zeroed: no fresh buffer to zero and no second copy for the trip to the training process.
"""

from __future__ import annotations

import atexit
import hashlib
import math
import os
import struct
import threading
import time
import warnings
import weakref
from dataclasses import dataclass

import pyarrow as pa
import torch
from speculators.models.eagle3.data import shift_batch
from speculators.train.data import CollateFn
from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
from speculators.train.recovery import RECOVERY_METADATA_KEY, RecoveryMetadata, SampleUnavailable
from torch.utils.data import DataLoader, Dataset, get_worker_info

from eagle3_ray.core import capture_checks, sample_ids, shard_format, storage
from eagle3_ray.core.config import Config


@dataclass(slots=True)
class SampleRef:
    """Where one sample's tensors live and the tokens they cover."""

    id: str
    shard_path: str
    key: str
    num_tokens: int  # T
    input_ids: list[int]  # input_ids[:T]
    loss_mask: list[int]  # loss_mask[:T]


def is_validation(sample_id: str, val_fraction: float) -> bool:
    """Held-out split by the hash of the sample's prompt id (sample_ids.prompt_of): stable across runs, worker counts
    and dataset order, and the responses of one prompt (generate.responses_per_prompt) all on the same side."""
    bucket = int(hashlib.sha256(sample_ids.prompt_of(sample_id).encode()).hexdigest()[:8], 16) / 0x1_0000_0000
    return bucket < val_fraction


def split_role(sample_id: str, cfg: Config) -> str:
    """`train`, `val`, or `held_out`: a validation prompt's sampled responses when generate also decoded its greedy
    one (generate.responses_per_prompt > 1). Validation is greedy there, as serving is: the replay estimate scores
    drafts against the verifier's top token where the row holds it, which a sampled response does only part of the
    time (`val_diag_agree_0` says how often), so sampled rows pull the estimate under vLLM's."""
    if not is_validation(sample_id, cfg.train.val_fraction):
        return "train"
    n = cfg.generate.responses_per_prompt
    if n > 1 and not sample_ids.is_greedy_response(sample_id, cfg.generate.temperature, n):
        return "held_out"
    return "val"


def build_refs(manifest: list[dict], conversations: dict[str, dict], shards_dir: str) -> list[SampleRef]:
    """Join manifest rows with their conversations; a manifest id without a conversation is a ValueError."""
    refs = []
    for row in manifest:
        conv = conversations.get(row["id"])
        if conv is None:
            raise ValueError(f"manifest row id={row['id']} (shard {row['shard']}) has no conversation")
        t = row["num_tokens"]
        if t > len(conv["input_ids"]):
            raise ValueError(
                f"manifest row id={row['id']} (shard {row['shard']}): num_tokens={t} exceeds the "
                f"conversation's {len(conv['input_ids'])} input_ids"
            )
        refs.append(
            SampleRef(
                row["id"],
                storage.join(shards_dir, row["shard"]),
                row["key"],
                t,
                list(conv["input_ids"][:t]),
                list(conv["loss_mask"][:t]),
            )
        )
    return refs


def load_refs(gen_dir: str) -> tuple[list[SampleRef], list[dict]]:
    """(sample refs, manifest rows) of a directory in the generate stage's layout (manifest + conversations)."""
    manifest = storage.read_parquet(storage.join(gen_dir, "manifest.parquet")).to_pylist()
    convs = storage.read_parquet(storage.join(gen_dir, "conversations.parquet"), ["id", "input_ids", "loss_mask"])
    return build_refs(manifest, {r["id"]: r for r in convs.to_pylist()}, storage.join(gen_dir, "shards")), manifest


class BadSampleError(ValueError):
    """A sample that cannot be trained on; the message names its shard file and key."""


class ShardReader:
    """Tensors read by byte range from safetensors shards on any storage (storage.py): a shard is opened once per
    process and its header parsed once; a read is a view of one tensor's bytes in the memory-mapped file (local) or
    fetches them (a ranged GET on an object store), so a sample costs its own bytes, never the shard's. (pyarrow's
    read_at on a memory map returns a bytes copy; the mapped buffer's slice is a view.)
    Safe across DataLoader forks: a process that inherited open files from its parent reopens them."""

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._files: dict[str, tuple[object, dict, int, int]] = {}

    def open(self, uri: str) -> tuple[object, dict, int, int]:
        """(file, header entries, payload offset, file size); BadSampleError naming the file when it is unreadable."""
        if self._pid != os.getpid():
            self._pid, self._files = os.getpid(), {}
        if uri not in self._files:
            self._files[uri] = _open_shard(uri)
        return self._files[uri]

    def tensor(self, uri: str, name: str) -> torch.Tensor:
        """The tensor `name` of a shard. From a local shard it is a read-only view of the memory-mapped file (no
        copy: the collate function's write into the batch buffer is the first); from an object store, a copy."""
        f, header, payload, _size = self.open(uri)
        entry = header.get(name)
        if entry is None:
            raise BadSampleError(f"{uri}: key {name} is missing")
        start, end = entry["data_offsets"]
        if end == start:
            return torch.empty(entry["shape"], dtype=shard_format.SAFETENSORS_DTYPES[entry["dtype"]])
        # a slice of the mapped file's buffer is a view; read_at (any file) returns a bytes copy
        data = (
            f.slice(payload + start, end - start)
            if isinstance(f, pa.Buffer)
            else f.read_at(end - start, payload + start)
        )
        if len(data) != end - start:
            raise BadSampleError(f"{uri}: truncated at key {name} ({len(data)} of {end - start} bytes)")
        if isinstance(f, pa.Buffer):
            with warnings.catch_warnings():  # read-only by design: nothing writes into a sample's tensors
                warnings.simplefilter("ignore", UserWarning)
                flat = torch.frombuffer(memoryview(data), dtype=shard_format.SAFETENSORS_DTYPES[entry["dtype"]])
        else:
            flat = torch.frombuffer(bytearray(data), dtype=shard_format.SAFETENSORS_DTYPES[entry["dtype"]])
        return flat.reshape(entry["shape"])


def _open_shard(uri: str) -> tuple[object, dict, int, int]:
    fs, path = storage.resolve(uri)
    try:
        f = pa.memory_map(path) if storage.is_local(uri) else fs.open_input_file(path)
    except (FileNotFoundError, OSError) as e:
        raise BadSampleError(f"{uri}: shard file is missing ({type(e).__name__})") from e
    size = f.size()
    try:
        header, payload, payload_end = shard_format.read_header(f.read_at)
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise BadSampleError(f"{uri}: unreadable safetensors header ({e})") from e
    if size < payload + payload_end:
        raise BadSampleError(f"{uri}: truncated ({size} bytes, header promises {payload + payload_end})")
    if isinstance(f, pa.MemoryMappedFile):
        f.seek(0)
        f = f.read_buffer(size)  # the whole mapping as one zero-copy buffer, sliced per tensor
    return f, header, payload, size


def check_shards(refs: list[SampleRef], num_layers: int, hidden_size: int) -> dict[str, str]:
    """Cheap eager check from shard headers only: {sample id: problem naming the file} for every sample whose shard
    is missing or truncated, or whose key is absent or has a shape the manifest does not promise."""
    problems: dict[str, str] = {}
    reader = ShardReader()
    for ref in refs:
        try:
            _f, header, _payload, _size = reader.open(ref.shard_path)
        except BadSampleError as e:
            problems[ref.id] = str(e)
            continue
        entry = header.get(f"{ref.key}.hs")
        expected = [ref.num_tokens, num_layers, hidden_size]
        if entry is None:
            problems[ref.id] = f"{ref.shard_path}: key {ref.key}.hs (sample {ref.id}) is missing"
        elif entry["shape"] != expected:
            problems[ref.id] = (
                f"{ref.shard_path}: {ref.key}.hs has shape {entry['shape']}, manifest says "
                f"{expected} (num_tokens, layers, hidden) for sample {ref.id}"
            )
    return problems


HIDDEN_KEYS = ("hidden_states", "verifier_last_hidden_states")  # stored dtype on the wire; fp8 ones carry {key}_exp


def decode(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Hidden states from their wire dtype to `dtype`, computed where the tensors are (the GPU after the copy): fp8
    [..., T, A*H] with `{key}_exp` [..., T, A] by shard_format.dequantize_fp8 (the `_exp` entries dropped), others cast.
    The values are those a decode on the host gives: the same elementwise ops on the same bytes."""
    out = {k: v for k, v in tensors.items() if not k.endswith("_exp")}
    for key in HIDDEN_KEYS:
        exp = tensors.get(f"{key}_exp")
        if exp is not None:
            q = out[key].unflatten(-1, (exp.shape[-1], -1))  # shape: [..., T, A, H]
            out[key] = shard_format.dequantize_fp8(q, exp, dtype).flatten(-2)
        elif key in out:
            out[key] = out[key].to(dtype)
    return out


class ShardDataset(Dataset):
    """Samples read lazily from shards (memory-mapped when local, by byte range when remote): only the samples of the
    batches in flight are in memory. A sample holds its hidden states as views of the stored bytes in the wire dtype
    (the stored one, or `dtype` where that is narrower: float32 shards train in bf16 on GPU); `decode` gives `dtype`.

    on_bad_sample="fail" raises BadSampleError; "skip" returns speculators' SampleUnavailable, which the collate
    function drops and counts in the batch's `error_records`."""

    def __init__(
        self,
        refs: list[SampleRef],
        num_aux: int,
        *,
        dtype: torch.dtype = torch.float32,
        on_bad_sample: str = "fail",
        layer_ids: list[int] | None = None,
        max_zero_row_share: float = 0.0,
        max_nonfinite_values: int = 0,
    ):
        """`layer_ids` (capture.json's) name layers in errors; the bounds are the generate stage's capture checks
        (generate.max_zero_row_share, max_nonfinite_values), applied again as samples are read."""
        self.refs = refs
        self.num_aux = num_aux
        self.layer_ids = layer_ids or list(range(num_aux + 1))
        self.bounds = {"max_zero_row_share": max_zero_row_share, "max_nonfinite_values": max_nonfinite_values}
        self.dtype = dtype
        self.on_bad_sample = on_bad_sample
        self.approx_lengths = [r.num_tokens for r in refs]
        self.reader = ShardReader()

    def __len__(self) -> int:
        return len(self.refs)

    def __getitems__(self, indices: list[int]) -> list:
        """The batch's samples (the DataLoader's fetcher calls this), with the ring tag make_loader's sampler gave
        the batch (reuse_buffers=True)."""
        return _Indexed((self[i] for i in indices), getattr(indices, "tag", None))

    def __getitem__(self, index: int) -> dict[str, torch.Tensor] | SampleUnavailable:
        ref = self.refs[index]
        try:
            hs, exp = self._read(ref)  # shape: [T, A + 1, H], [T, A + 1] or None
        except BadSampleError as e:
            if self.on_bad_sample == "fail":
                raise
            return SampleUnavailable(reason=str(e))
        seq_len = ref.num_tokens
        sample = {
            "hidden_states": hs[:, : self.num_aux].flatten(1),  # shape: [T, A*H]
            "input_ids": torch.tensor(ref.input_ids, dtype=torch.long),  # shape: [T]
            "verifier_last_hidden_states": hs[:, self.num_aux],  # shape: [T, H]
            "loss_mask": torch.tensor(ref.loss_mask, dtype=torch.long),  # shape: [T]
            "lengths": torch.tensor([seq_len], dtype=torch.long),
            "position_ids": torch.arange(seq_len, dtype=torch.long),
        }
        if exp is not None:
            sample["hidden_states_exp"] = exp[:, : self.num_aux]  # shape: [T, A]
            sample["verifier_last_hidden_states_exp"] = exp[:, self.num_aux :]  # shape: [T, 1]
        return sample

    def _read(self, ref: SampleRef) -> tuple[torch.Tensor, torch.Tensor | None]:
        where = f"{ref.shard_path} key {ref.key} (sample {ref.id})"
        hs = self.reader.tensor(ref.shard_path, f"{ref.key}.hs")
        exp = self.reader.tensor(ref.shard_path, f"{ref.key}.scale") if hs.dtype == torch.float8_e4m3fn else None
        if hs.shape[0] != ref.num_tokens or hs.shape[1] != self.num_aux + 1:
            raise BadSampleError(
                f"{where}: shape {list(hs.shape)} does not match manifest num_tokens="
                f"{ref.num_tokens} and {self.num_aux + 1} layers"
            )
        if hs.dtype.itemsize > self.dtype.itemsize:
            hs = hs.to(self.dtype)  # fewer bytes to move; the capture check then sees what training sees
        problem = capture_checks.capture_problem(
            capture_checks.bad_row_counts(hs), ref.num_tokens, self.layer_ids, **self.bounds
        )
        if problem:  # the generate stage's own check, again: shards may come from elsewhere or an older run
            raise BadSampleError(f"{where}: hidden states fail the capture check: {problem}")
        return hs, exp


def _batch_buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor; in a loader worker in shared memory, so that sending the batch to the training
    process passes a file descriptor instead of copying it (torch's sharing of a storage not yet shared copies)."""
    if get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    storage = torch.UntypedStorage._new_shared(math.prod(shape) * dtype.itemsize)
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


class _Indexed(list):
    """A batch's sample indices or samples, with its ring tag (worker, number) when make_loader(reuse_buffers=True)
    numbered it (None: no ring)."""

    def __init__(self, items=(), tag: tuple[int, int] | None = None):
        super().__init__(items)
        self.tag = tag


class BatchRing:
    """`slots_per_worker` batch buffers per loader worker in shared memory, made by the training process before its
    workers start (they inherit them) and reused for the loader's lifetime: worker w writes its n-th batch into its
    slot n % slots_per_worker and sends only where the tensors lie; the training process views them in its own
    mapping of the same pages. So no batch pays for fresh shared memory (page faults, about half of a worker's time
    per batch, and as much again for unmapping and freeing it in the training process, GIL held) or for
    passing file descriptors; each slot's pages are faulted in once, by the one worker that writes it.

    Hand-back: `turn[slot]` is the batch number allowed to write the slot; a worker waits for its turn, the
    consumer's `release(worker, n)` (once it no longer reads the batch, e.g. after its copy into pinned memory)
    passes the slot on to batch n + slots_per_worker. The DataLoader deals batches round robin and keeps
    prefetch_factor per worker in flight, so with slots_per_worker = prefetch_factor + 1 and a consumer that
    releases each batch before fetching the next, a worker never waits; one that waits `timeout_s` raises (a
    consumer holding batches)."""

    def __init__(self, num_workers: int, slots_per_worker: int, slot_bytes: int, timeout_s: float = 300.0):
        self.num_workers, self.slots_per_worker, self.slot_bytes = num_workers, slots_per_worker, slot_bytes
        self.timeout_s, self.num_slots = timeout_s, num_workers * slots_per_worker
        self.slots = [
            torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(slot_bytes))
            for _ in range(self.num_slots)
        ]  # pages are allocated on first touch, once
        self.turn = torch.empty(0, dtype=torch.int64).set_(torch.UntypedStorage._new_shared(8 * self.num_slots))
        self.turn.copy_(torch.arange(self.num_slots) % slots_per_worker)
        # Set by close(): a worker waiting for a slot gives up at once, so shutting the loader down does not wait
        # out DataLoader's worker join timeout (5 s a worker) for workers parked on slots nobody will release.
        self.closed = torch.zeros(1, dtype=torch.int64).share_memory_()
        self._populated: set[int] = set()  # this process's slots with their pages mapped

    def _slot(self, worker: int, n: int) -> int:
        return worker * self.slots_per_worker + n % self.slots_per_worker

    def acquire(self, worker: int, n: int) -> _SlotWriter:
        """Worker `worker`'s slot for its batch `n`, once its batch n - slots_per_worker was released."""
        slot, deadline = self._slot(worker, n), time.monotonic() + self.timeout_s
        while (turn := int(self.turn[slot])) < n:
            if int(self.closed[0]):
                raise RuntimeError(f"loader batch buffer {slot}: the loader was closed while batch {n} waited")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"loader batch buffer {slot} still holds batch {turn} of worker {worker} after "
                    f"{self.timeout_s:.0f} s: a consumer of make_loader(reuse_buffers=True) must "
                    f"release each batch (loader.release(batch)) before it fetches the next"
                )
            time.sleep(0.0005)
        if turn != n:
            raise RuntimeError(f"loader batch buffer {slot}: batch {n} of worker {worker} came after {turn}")
        if slot not in self._populated:
            self._populated.add(slot)
            _populate(self.slots[slot])
        return _SlotWriter(self.slots[slot])

    def close(self) -> None:
        """No batch will be released any more: workers stop waiting for slots."""
        self.closed[0] = 1

    def release(self, worker: int, n: int) -> None:
        """Worker `worker`'s batch `n` is no longer read: its slot goes to batch n + slots_per_worker."""
        slot = self._slot(worker, n)
        self.turn[slot] = max(int(self.turn[slot]), n + self.slots_per_worker)

    def views(self, worker: int, n: int, layout: list[tuple]) -> dict[str, torch.Tensor]:
        """The tensors a worker wrote into batch n's slot: {key: view} from its (key, dtype, shape, offset)."""
        flat = self.slots[self._slot(worker, n)]
        return {
            key: flat[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
            for key, dtype, shape, offset in layout
        }


def _populate(flat: torch.Tensor) -> None:
    """Maps a fresh slot's pages writable in one call (MADV_POPULATE_WRITE, Linux 5.14+: cheaper than a
    fault per page); elsewhere the first write faults them in."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        start = flat.data_ptr() & ~4095
        libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(flat.data_ptr() + flat.numel() - start), 23)
    except (OSError, AttributeError):
        pass


class _SlotWriter:
    """Tensors carved one after another from a ring slot (64-byte aligned); None once the slot is full."""

    def __init__(self, flat: torch.Tensor):
        self.flat, self.used, self.layout = flat, 0, []

    def take(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        offset, nbytes = -(-self.used // 64) * 64, math.prod(shape) * dtype.itemsize
        if offset + nbytes > self.flat.numel():
            return None
        self.used = offset + nbytes
        self.layout.append((key, dtype, tuple(shape), offset))
        return self.flat[offset : offset + nbytes].view(dtype).view(shape)


RING_KEY = "_ring"  # a batch's ring tag (worker, number); from a worker with where its tensors lie in the slot


class PackedCollate:
    """speculators' CollateFn(preprocess=shift_batch), tensor for tensor, written once: each shifted sample is
    copied into its rows of one buffer per key ([total_seq_len, ...], shared memory in a worker: a slot of `ring`
    when the batch has a ring tag), hidden states in their wire dtype, only the padding zeroed;
    `num_tokens` (the real tokens) is counted on the host. Batches mixing stored dtypes, and batches without a
    usable sample, are left to speculators' CollateFn on decoded samples."""

    def __init__(
        self, total_seq_len: int, hidden_size: int, num_aux: int, dtype: torch.dtype, ring: BatchRing | None = None
    ):
        self.total_seq_len, self.dtype, self.ring = total_seq_len, dtype, ring
        self.reference = CollateFn(
            total_seq_len, hidden_size, num_target_layers=num_aux, dtype=dtype, preprocess=shift_batch
        )

    def __call__(self, items: list) -> dict:
        tag = getattr(items, "tag", None)
        ring_info = {} if tag is None else {RING_KEY: (*tag, [])}
        samples = [s for s in items if isinstance(s, dict)]
        if len({tuple((k, v.dtype) for k, v in s.items()) for s in samples}) != 1:
            batch = self.reference([decode(s, self.dtype) if isinstance(s, dict) else s for s in items])
            return {**batch, "num_tokens": int((batch["document_ids"] != -1).sum()), **ring_info}
        shifted = [_shift(s) for s in samples]
        rows, filled = [], 0  # rows each sample fills; the last one is cut at total_seq_len, later ones dropped
        for s in shifted:
            rows.append(min(s["input_ids"].shape[0], self.total_seq_len - filled))
            filled += rows[-1]
            if filled == self.total_seq_len:
                break
        in_worker = get_worker_info() is not None
        slot = self.ring.acquire(*tag) if self.ring is not None and tag is not None and in_worker else None
        batch = {key: self._pack(key, [s[key] for s in shifted], rows, slot) for key in shifted[0]}
        document_ids = self._buffer(slot, "document_ids", (1, self.total_seq_len), torch.long)
        document_ids[0, filled:] = -1
        document_ids[0, :filled] = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(rows))
        batch["document_ids"] = document_ids  # shape: [1, total_seq_len]
        batch["error_records"] = len(items) - len(samples)
        unavailable = [s for s in items if isinstance(s, SampleUnavailable)]
        metadata = RecoveryMetadata.from_unavailable(unavailable, locally_empty=False)
        if metadata.failure_count:
            batch[RECOVERY_METADATA_KEY] = metadata
        batch["num_tokens"] = filled
        if slot is not None:  # the slot's tensors stay behind: the training process views them in its mapping
            for key, *_ in slot.layout:
                del batch[key]
            ring_info = {RING_KEY: (*tag, slot.layout)}
        return {**batch, **ring_info}

    def _buffer(self, slot: _SlotWriter | None, key: str, shape: tuple[int, ...], dtype: torch.dtype):
        out = slot.take(key, shape, dtype) if slot is not None else None
        return _batch_buffer(shape, dtype) if out is None else out

    def _pack(self, key: str, tensors: list[torch.Tensor], rows: list[int], slot: _SlotWriter | None):
        out = self._buffer(slot, key, (1, self.total_seq_len, *tensors[0].shape[1:]), tensors[0].dtype)
        offset = 0
        for t, n in zip(tensors, rows, strict=True):
            out[0, offset : offset + n] = t[:n]
            offset += n
        out[0, offset:].zero_()
        return out  # shape: [1, total_seq_len, ...]


def _shift(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """speculators' shift_batch (the alignment drawn at the top), with fp8 exponents shifted as their hidden states;
    `lengths` is dropped: PackedCollate counts rows itself."""
    shifted = shift_batch(sample)
    del shifted["lengths"]
    if "hidden_states_exp" in sample:
        shifted["hidden_states_exp"] = sample["hidden_states_exp"][:-1]  # g0 .. g(T-2)
        shifted["verifier_last_hidden_states_exp"] = sample["verifier_last_hidden_states_exp"][1:]  # y1 .. y(T-1)
    return shifted


def ring_slot_bytes(total_seq_len: int, hidden_size: int, num_aux: int, dtype: torch.dtype) -> int:
    """Bytes of one packed batch at most: hidden states in `dtype` (or fp8 + int8 exponents: fewer) and the four
    int64 vectors, each tensor 64-byte aligned."""
    per_token = (num_aux + 1) * (hidden_size * dtype.itemsize + 1) + 4 * 8
    return total_seq_len * per_token + 16 * 64


class EpochSampler:
    """speculators' packing sampler, epoch by epoch, in an iteration that may run on through later epochs: after
    `run_until(end)` one iteration gives the batches of epochs `epoch` .. end - 1 back to back, so a DataLoader's
    workers go on to the next epoch's first batches while the consumer takes this one's last ones, and nothing
    drains at an epoch's end (train_worker.DeviceBatches takes each epoch's share of the one iteration). Without
    run_until an iteration is the one epoch set by set_epoch, as before. `batches(e)`: epoch e's batches (its
    sample indices), made once; `len` is the current epoch's count."""

    def __init__(self, inner: MultipackDistributedBatchSamplerV2):
        self.inner, self.epoch, self.end = inner, 0, None
        self.lock = threading.Lock()  # the DataLoader iterates in its consumer's thread, the loop asks for counts
        self._made: dict[int, list] = {}

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def run_until(self, end: int | None) -> None:
        self.end = end

    def batches(self, epoch: int) -> list:
        with self.lock:
            if epoch not in self._made:
                self.inner.set_epoch(epoch)
                self._made = {e: b for e, b in self._made.items() if epoch - 2 <= e <= epoch + 2}
                self._made[epoch] = list(self.inner)
            return self._made[epoch]

    def __len__(self) -> int:
        return len(self.batches(self.epoch))

    def __iter__(self):
        """Not a generator: the epochs are fixed when the iteration is made."""
        first = self.epoch
        return (b for e in range(first, max(first + 1, self.end or 0)) for b in self.batches(e))


class _SeqSampler:
    """A batch sampler's batches tagged (worker, number) for the BatchRing: the DataLoader deals an iteration's
    batches to its workers round robin from worker 0, so the i-th goes to worker i % num_workers, which writes it
    into its own slot (a wrong guess would cost speed, not correctness). `pending`: tags dispatched whose batch the
    consumer has not received, with the iteration that dispatched them."""

    def __init__(self, inner, num_workers: int):
        self.inner, self.num_workers, self.iteration = inner, num_workers, 0
        self.counts = [0] * num_workers
        self.pending: dict[tuple[int, int], int] = {}
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self):
        with self.lock:
            self.iteration += 1
        return self._tagged(self.iteration)

    def _tagged(self, iteration: int):
        for i, indices in enumerate(self.inner):
            worker = i % self.num_workers
            with self.lock:
                tag = (worker, self.counts[worker])
                self.counts[worker] += 1
                self.pending[tag] = iteration
            yield _Indexed(indices, tag)


class RingLoader:
    """make_loader(reuse_buffers=True)'s loader: its workers pack each batch into a slot of a BatchRing, and its
    batches' tensors are views of that slot, valid until `release(batch)`. The consumer must release every batch
    it receives before it fetches the next one (train_worker.DeviceBatches does, right after its copy into pinned
    memory). Batches the DataLoader drops when an iteration ends early are released when the next one starts."""

    def __init__(self, loader: DataLoader, ring: BatchRing, sampler: _SeqSampler):
        self.loader, self.ring, self._sampler = loader, ring, sampler
        self.batch_sampler, self.dataset, self.num_workers = sampler.inner, loader.dataset, loader.num_workers

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        """Not a generator: the workers get this iteration's first batches when iter() is called, not at the first
        next()."""
        batches = iter(self.loader)  # persistent workers finish the previous iteration's batches before this returns
        with self._sampler.lock:
            dropped = [tag for tag, it in self._sampler.pending.items() if it < self._sampler.iteration]
            for tag in dropped:
                del self._sampler.pending[tag]
        for tag in dropped:
            self.ring.release(*tag)
        return self._views(batches)

    def _views(self, batches):
        for batch in batches:
            worker, n, layout = batch.pop(RING_KEY)
            with self._sampler.lock:
                self._sampler.pending.pop((worker, n), None)
            yield {**batch, **self.ring.views(worker, n, layout), RING_KEY: (worker, n)}

    def release(self, batch: dict) -> None:
        """The consumer no longer reads `batch`'s tensors: its slot may be written again."""
        tag = batch.get(RING_KEY)
        if tag is not None:
            self.ring.release(*tag)

    def __del__(self) -> None:
        self.ring.close()  # workers waiting for a slot stop now: no batch will be released any more


def make_loader(
    dataset: ShardDataset,
    *,
    total_seq_len: int,
    hidden_size: int,
    world_size: int,
    rank: int,
    seed: int,
    num_workers: int = 1,
    prefetch_factor: int = 2,
    reuse_buffers: bool = False,
) -> DataLoader | RingLoader:
    """Packed batches [1, total_seq_len, ...] for this rank (hidden states in the wire dtype: `decode` them on the
    device); call `loader.batch_sampler.set_epoch(e)` each epoch (an EpochSampler: `run_until` lets one iteration
    run on through later epochs).

    speculators' sampler shuffles with seed + epoch and hands every rank the same number of batches, so DDP ranks
    stay in step. Loader worker processes read and pack the next batches (`prefetch_factor` each ahead) while the
    model trains; pinning and the copy to the GPU are train_worker.DeviceBatches' (a thread, not the DataLoader's
    single-threaded pin loop). `reuse_buffers` (with workers): a RingLoader, its batches packed into
    prefetch_factor + 1 reused shared-memory buffers per worker (each batch released by the consumer)."""
    sampler = EpochSampler(
        MultipackDistributedBatchSamplerV2(
            batch_max_length=total_seq_len,
            lengths=dataset.approx_lengths,
            num_replicas=world_size,
            rank=rank,
            seed=seed,
        )
    )
    ring = None
    if reuse_buffers and num_workers > 0:
        sampler = _SeqSampler(sampler, num_workers)
        ring = BatchRing(
            num_workers,
            prefetch_factor + 1,
            ring_slot_bytes(total_seq_len, hidden_size, dataset.num_aux, dataset.dtype),
        )
    collate = PackedCollate(total_seq_len, hidden_size, dataset.num_aux, dataset.dtype, ring)
    loader = DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
    )
    if num_workers > 0:
        _LIVE_LOADERS.add(loader)
    return loader if ring is None else RingLoader(loader, ring, sampler)


# Loaders with worker processes, for shut_down_loaders.
_LIVE_LOADERS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def shut_down_loaders() -> None:
    """End the worker processes of every loader make_loader made in this process that is still alive, at once.
    Runs at exit; call it when done with loaders that may sit in reference cycles. A DataLoader iterator left to the
    cycle collector (or to the interpreter's teardown) can have its queues finalized before itself, and its
    shutdown then waits out a 5 s poll per worker before DataLoader's join gives up on it."""
    for loader in list(_LIVE_LOADERS):
        ring = getattr(loader.collate_fn, "ring", None)
        if ring is not None:
            ring.close()
        iterator, loader._iterator = loader._iterator, None
        if hasattr(iterator, "_shutdown_workers"):  # idempotent, what the iterator's own __del__ calls
            iterator._shutdown_workers()
