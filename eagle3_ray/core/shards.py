"""Hidden-state shards: many samples per safetensors file (shard_format.py), found through a Parquet manifest.

A manifest row per sample names its shard file and key (MANIFEST_SCHEMA). Shards are written under a temporary name
and moved into place (storage.atomic_local_file, storage.write_bytes_atomic), so a shard's final name only ever holds
a complete file: whole here (write_shard), or sample by sample as they are captured (shard_writer.py).

    num_bytes = write_shard(uri, encode_sample(key, hidden_states, "fp8"))
    hidden_states = read_sample(uri, key)          # [T, L, H] float32, fp8 dequantized
"""

from __future__ import annotations

import os

import pyarrow as pa
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from safetensors.torch import save_file

from eagle3_ray.core import storage
from eagle3_ray.core.shard_format import SAFETENSORS_DTYPES, dequantize_fp8, read_header

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
