"""Training data for the drafter: the generate stage's shards read lazily, one sample at a time, and packed with
speculators' sampler and collate function. Pure torch + safetensors + pyarrow tables; no Ray, no vLLM.

A sample as stored (docs/stages.md, generate): hidden states [T, L, H] for input_ids[:T], L = aux layers + final.
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
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import warnings
from dataclasses import dataclass

import pyarrow as pa
import torch
from torch.utils.data import DataLoader, Dataset

from speculators.models.eagle3.data import shift_batch
from speculators.train.data import CollateFn
from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
from speculators.train.recovery import SampleUnavailable

from eagle3_ray import shards, storage


@dataclass(slots=True)
class SampleRef:
    """Where one sample's tensors live and the tokens they cover."""

    id: str
    shard_path: str
    key: str
    num_tokens: int          # T
    input_ids: list[int]     # input_ids[:T]
    loss_mask: list[int]     # loss_mask[:T]


def is_validation(sample_id: str, val_fraction: float) -> bool:
    """Held-out split by id hash: stable across runs, worker counts and dataset order."""
    bucket = int(hashlib.sha256(sample_id.encode()).hexdigest()[:8], 16) / 0x1_0000_0000
    return bucket < val_fraction


def build_refs(manifest: list[dict], conversations: dict[str, dict], shards_dir: str) -> list[SampleRef]:
    """Join manifest rows with their conversations; a manifest id without a conversation is a ValueError."""
    refs = []
    for row in manifest:
        conv = conversations.get(row["id"])
        if conv is None:
            raise ValueError(f"manifest row id={row['id']} (shard {row['shard']}) has no conversation")
        t = row["num_tokens"]
        if t > len(conv["input_ids"]):
            raise ValueError(f"manifest row id={row['id']} (shard {row['shard']}): num_tokens={t} exceeds the "
                             f"conversation's {len(conv['input_ids'])} input_ids")
        refs.append(SampleRef(row["id"], storage.join(shards_dir, row["shard"]), row["key"], t,
                              list(conv["input_ids"][:t]), list(conv["loss_mask"][:t])))
    return refs


def load_refs(gen_dir: str) -> tuple[list[SampleRef], list[dict]]:
    """(sample refs, manifest rows) of a directory in the generate stage's layout (manifest + conversations)."""
    manifest = storage.read_parquet(storage.join(gen_dir, "manifest.parquet")).to_pylist()
    convs = storage.read_parquet(storage.join(gen_dir, "conversations.parquet"), ["id", "input_ids", "loss_mask"])
    return build_refs(manifest, {r["id"]: r for r in convs.to_pylist()}, storage.join(gen_dir, "shards")), manifest


# safetensors dtype names of the tensors a shard holds (shards.py)
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F8_E4M3": torch.float8_e4m3fn,
           "I8": torch.int8}


class BadSampleError(ValueError):
    """A sample that cannot be trained on; the message names its shard file and key."""


class ShardReader:
    """Tensors read by byte range from safetensors shards on any storage (storage.py): a shard is opened once per
    process and its header parsed once; a read fetches one tensor's bytes (pread on a local file, a ranged GET on an
    object store), so a sample costs its own bytes, never the shard's. Safe across DataLoader forks: a process that
    inherited open files from its parent reopens them."""

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
            return torch.empty(entry["shape"], dtype=_DTYPES[entry["dtype"]])
        data = f.read_at(end - start, payload + start)
        if len(data) != end - start:
            raise BadSampleError(f"{uri}: truncated at key {name} ({len(data)} of {end - start} bytes)")
        if isinstance(f, pa.MemoryMappedFile):
            with warnings.catch_warnings():  # read-only by design: nothing writes into a sample's tensors
                warnings.simplefilter("ignore", UserWarning)
                flat = torch.frombuffer(memoryview(data), dtype=_DTYPES[entry["dtype"]])
        else:
            flat = torch.frombuffer(bytearray(data), dtype=_DTYPES[entry["dtype"]])
        return flat.reshape(entry["shape"])


def _open_shard(uri: str) -> tuple[object, dict, int, int]:
    fs, path = storage.resolve(uri)
    try:
        f = pa.memory_map(path) if storage.is_local(uri) else fs.open_input_file(path)
    except (FileNotFoundError, OSError) as e:
        raise BadSampleError(f"{uri}: shard file is missing ({type(e).__name__})") from e
    size = f.size()
    try:
        (header_len,) = struct.unpack("<Q", f.read_at(8, 0))
        header = json.loads(f.read_at(header_len, 8))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise BadSampleError(f"{uri}: unreadable safetensors header ({e})") from e
    header.pop("__metadata__", None)
    payload_end = max((v["data_offsets"][1] for v in header.values()), default=0)
    if size < 8 + header_len + payload_end:
        raise BadSampleError(f"{uri}: truncated ({size} bytes, header promises {8 + header_len + payload_end})")
    return f, header, 8 + header_len, size


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
            problems[ref.id] = (f"{ref.shard_path}: {ref.key}.hs has shape {entry['shape']}, manifest says "
                                f"{expected} (num_tokens, layers, hidden) for sample {ref.id}")
    return problems


class ShardDataset(Dataset):
    """Samples read lazily from shards (memory-mapped when local, by byte range when remote): only the samples of the
    batches in flight are in memory.

    on_bad_sample="fail" raises BadSampleError; "skip" returns speculators' SampleUnavailable, which its CollateFn
    drops and counts in the batch's `error_records`."""

    def __init__(self, refs: list[SampleRef], num_aux: int, *, dtype: torch.dtype = torch.float32,
                 on_bad_sample: str = "fail", layer_ids: list[int] | None = None, max_zero_row_share: float = 0.5,
                 max_nonfinite_values: int = 0):
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

    def __getitem__(self, index: int) -> dict[str, torch.Tensor] | SampleUnavailable:
        ref = self.refs[index]
        try:
            hs = self._read(ref)  # shape: [T, A + 1, H]
        except BadSampleError as e:
            if self.on_bad_sample == "fail":
                raise
            return SampleUnavailable(reason=str(e))
        seq_len = ref.num_tokens
        return {
            "hidden_states": hs[:, : self.num_aux].flatten(1),   # shape: [T, A*H]
            "input_ids": torch.tensor(ref.input_ids, dtype=torch.long),  # shape: [T]
            "verifier_last_hidden_states": hs[:, self.num_aux],  # shape: [T, H]
            "loss_mask": torch.tensor(ref.loss_mask, dtype=torch.long),  # shape: [T]
            "lengths": torch.tensor([seq_len], dtype=torch.long),
            "position_ids": torch.arange(seq_len, dtype=torch.long),
        }

    def _read(self, ref: SampleRef) -> torch.Tensor:
        where = f"{ref.shard_path} key {ref.key} (sample {ref.id})"
        hs = self.reader.tensor(ref.shard_path, f"{ref.key}.hs")
        scale = self.reader.tensor(ref.shard_path, f"{ref.key}.scale") if hs.dtype == torch.float8_e4m3fn else None
        if hs.shape[0] != ref.num_tokens or hs.shape[1] != self.num_aux + 1:
            raise BadSampleError(f"{where}: shape {list(hs.shape)} does not match manifest num_tokens="
                                 f"{ref.num_tokens} and {self.num_aux + 1} layers")
        # straight to the training dtype: bf16 shards train in bf16 on GPU without a float32 round trip
        hs = shards.dequantize_fp8(hs, scale, self.dtype) if scale is not None else hs.to(self.dtype)
        problem = shards.capture_problem(shards.capture_stats(hs), ref.num_tokens, self.layer_ids, **self.bounds)
        if problem:  # the generate stage's own check, again: shards may come from elsewhere or an older run
            raise BadSampleError(f"{where}: hidden states fail the capture check: {problem}")
        return hs


def make_loader(dataset: ShardDataset, *, total_seq_len: int, hidden_size: int, world_size: int, rank: int,
                seed: int, num_workers: int = 1, pin_memory: bool = False) -> DataLoader:
    """Packed batches [1, total_seq_len, ...] for this rank; call `loader.batch_sampler.set_epoch(e)` each epoch.

    speculators' sampler shuffles with seed + epoch and hands every rank the same number of batches, so DDP ranks
    stay in step. Loader worker processes read and decode the next batches (4 each ahead) while the model trains;
    `pin_memory` (GPU) makes the host-to-device copy asynchronous, so it overlaps the step before."""
    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=total_seq_len, lengths=dataset.approx_lengths,
                                                 num_replicas=world_size, rank=rank, seed=seed)
    collate = CollateFn(total_seq_len, hidden_size, num_target_layers=dataset.num_aux, dtype=dataset.dtype,
                        preprocess=shift_batch)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=num_workers,
                      persistent_workers=num_workers > 0, prefetch_factor=4 if num_workers > 0 else None,
                      pin_memory=pin_memory)
