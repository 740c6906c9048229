"""How a sample's hidden states are stored: the tensors of one sample (bfloat16, fp8 with power-of-two scales, or
float32) and their safetensors layout.

A shard holds, for each sample `key`:
    {key}.hs      shape [T, L, H]  bfloat16, or float8_e4m3fn when stored as fp8
    {key}.scale   shape [T, L]     int8, only for fp8: a power-of-two exponent per token and layer (x ~= hs * 2**scale)
where T = number of captured tokens, L = number of captured layers (aux layers then the final layer), H = hidden size.

    tensors = encode_sample(key, hidden_states, "fp8")           # what a shard stores of one sample
    layout = sample_layout(key, T, L, H, "fp8")                  # the same tensors' (name, dtype, shape), no values
    header, payload_ranges = safetensors_header(layout)          # a file's first bytes, each tensor's [begin, end)
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable

import torch

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


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def read_header(read_at: Callable[[int, int], bytes]) -> tuple[dict, int, int]:
    """A safetensors file's header through `read_at(num_bytes, offset)`: ({tensor name: entry} without
    `__metadata__`, where the payload starts, the payload's bytes as the entries promise them)."""
    (header_len,) = struct.unpack("<Q", read_at(8, 0))
    header = json.loads(read_at(header_len, 8))
    header.pop("__metadata__", None)
    return header, 8 + header_len, max((entry["data_offsets"][1] for entry in header.values()), default=0)


def safetensors_header(
    layout: list[tuple[str, torch.dtype, list[int]]], metadata: dict[str, str] | None = None, size: int | None = None
) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The first bytes of a safetensors file holding `layout`'s tensors one after the other, in its order: the
    8-byte length and the JSON header, padded with spaces (which safetensors allows) so that the payload starts
    8-byte aligned, as safetensors writes it, or at `size` bytes (the room an open shard_writer.InPlaceShard kept
    for it); and each tensor's [begin, end) in the payload."""
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
