"""How fast captured rows come off the device and into a shard: a bare device-to-host copy against the connector's
own path, and the shard writes.

The generate stage's tail on the 8B shape at 256 output tokens came after the last decode step: 1.96 GB of rows
reached their shards 0.5-0.65 s after it (3-4 GB/s). On an H200 machine the copy off the device took 0.04 s and the
writes into tmpfs the rest (docs/benchmarks.md, the stage's tail). This times, with CUDA events and the wall clock,
the same bytes moved each way:

- `pinned_one` / `pageable_one`: one copy of a contiguous device tensor into pinned / pageable host memory;
- `pinned_pieces`: one copy per sample into pieces of a pinned shard_writer.HostArena (what the connector copies
  into);
- `gather_encode`: the connector's gather from a hidden-state cache and its encoding (shard_writer.planned_rows), no
  copy;
- `connector`: CaptureConnector._copy_to_host itself, group after group as _save_planned cuts them (gather_groups,
  `--gather-bytes`), until the last group's copy event;
- `write_sparse_N` / `write_reserved_N`: the same bytes from pinned host memory into one open shard in `--scratch`
  (shard_writer.InPlaceShard.open, shard_writer.write_at, one sample per write) by N threads, as the connector's writer
  threads write them, into pages not yet allocated / allocated first (InPlaceShard.reserve, timed on its own as
  `reserve_s`: the stage does it while the unit decodes);
- `units_fifo_UxN` / `units_per_file_UxN`: the same bytes as U units, each into its own reserved shard, by vLLM's
  connector pool of N threads, in unit order: straight into the pool / through shard_writer.PerFileJobs (one file's
  writes one at a time, files side by side).

    python3 -m bench.gpu.copy_bench --out $OUT/copy_bench.json

Defaults are the 8B shape's: 200 samples of 298 captured tokens (59,697 rows in the stage), 4 layers x 4096, bf16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from types import SimpleNamespace

import torch

from eagle3_ray.core import shard_writer


def timed(fn, stream: torch.cuda.Stream) -> tuple[float, float]:
    """(wall s, device s on `stream`) of fn(), which enqueues work and returns the events to wait for."""
    torch.cuda.synchronize()
    begin = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    begin.record(stream)
    t0 = time.perf_counter()
    waits = fn()
    for event in waits:
        event.synchronize()
    end.record(stream)
    end.synchronize()
    return time.perf_counter() - t0, begin.elapsed_time(end) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=298, help="captured tokens per sample")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--gather-bytes", type=int, default=256 << 20)
    parser.add_argument("--arena-bytes", type=int, default=3 << 30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scratch", default="/dev/shm")
    parser.add_argument("--threads", default="4,16", help="writer threads of the write rows")
    parser.add_argument("--units", type=int, default=4, help="units (one shard each) of the units_* rows")
    parser.add_argument("--connector-threads", type=int, default=8, help="threads of the units_* rows")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    rows = args.samples * args.tokens
    row_bytes = args.layers * args.hidden * 2
    total = rows * row_bytes
    cuda = torch.cuda.is_available()
    # the host copy every write row writes from: pinned on a GPU machine (the connector's arena is)
    host = torch.randn(rows, args.layers, args.hidden).to(torch.bfloat16)
    if cuda:
        host = host.pin_memory()
    rows_out = copy_rows(args, total, row_bytes) if cuda else []
    rows_out += write_rows(args, host, total, row_bytes)
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "args": vars(args),
        "rows": rows_out,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


def copy_rows(args: argparse.Namespace, total: int, row_bytes: int) -> list[dict]:
    """The device-to-host rows (see the module's docstring); without vLLM installed only those that need no
    connector (the machine's own copy rates)."""
    try:
        from eagle3_ray.generate.connector import CaptureConnector, extract_from_kv_cache, gather_groups
    except ImportError as e:
        print(f"no connector rows: {e}", flush=True)
        CaptureConnector = None

    device = torch.device("cuda")
    blocks_per_sample = -(-args.tokens // args.block_size)
    num_blocks = blocks_per_sample * args.samples + 64
    cache = torch.randn(num_blocks, args.layers, args.block_size, args.hidden, device=device, dtype=torch.bfloat16)
    order = torch.randperm(num_blocks - 64)  # each sample's blocks scattered over the cache, as vLLM hands them out
    block_ids = [order[i * blocks_per_sample : (i + 1) * blocks_per_sample].tolist() for i in range(args.samples)]
    flat = torch.randn(args.samples * args.tokens, args.layers, args.hidden, device=device, dtype=torch.bfloat16)
    pinned = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    pageable = torch.empty(flat.shape, dtype=flat.dtype)
    arena = shard_writer.HostArena(args.arena_bytes, pin_memory=True)
    stream = torch.cuda.Stream()
    if CaptureConnector is not None:
        fake = SimpleNamespace(_kv_cache=cache, _arena=arena, _block_size=args.block_size)
        fake._get_copy_stream = lambda: stream
        fake._host_copy = partial(CaptureConnector._host_copy, fake)
        slot_mapping = partial(CaptureConnector._slot_mapping, fake)
        groups = gather_groups([args.tokens] * args.samples, max(1, args.gather_bytes // row_bytes))

    def one(dst: torch.Tensor):
        with torch.cuda.stream(stream):
            dst.copy_(flat, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        return [done]

    taken: list = []

    def pieces():
        with torch.cuda.stream(stream):
            for i in range(args.samples):
                got = arena.take(args.tokens * row_bytes)
                taken.append((got[0], args.tokens * row_bytes))
                got[1].view(flat.dtype).view(args.tokens, args.layers, args.hidden).copy_(
                    flat[i * args.tokens : (i + 1) * args.tokens], non_blocking=True
                )
        done = torch.cuda.Event()
        done.record(stream)
        return [done]

    def gather_encode():
        with torch.cuda.stream(stream):
            for group in groups:
                slots = torch.cat([slot_mapping(block_ids[i])[: args.tokens] for i in group])
                slots = slots.pin_memory().to(device=device, non_blocking=True)
                shard_writer.planned_rows(extract_from_kv_cache(cache, slots, slots.shape[0]), "bfloat16")
        done = torch.cuda.Event()
        done.record(stream)
        return [done]

    releases: list = []

    def connector():
        waits = []
        for group in groups:
            slots = torch.cat([slot_mapping(block_ids[i])[: args.tokens] for i in group])
            spans = [(j * args.tokens, (j + 1) * args.tokens) for j in range(len(group))]
            _, rel, done = CaptureConnector._copy_to_host(fake, slots, spans, "bfloat16")
            releases.extend(rel)
            waits.append(done)
        return waits

    def give_back():
        for start, num_bytes in taken:
            arena.give(start, num_bytes)
        taken.clear()
        for rel in releases:
            CaptureConnector._give_back(fake, rel)
        releases.clear()

    rows_out = []
    for name, fn in [
        ("pinned_one", partial(one, pinned)),
        ("pageable_one", partial(one, pageable)),
        ("pinned_pieces", pieces),
        *([("gather_encode", gather_encode), ("connector", connector)] if CaptureConnector is not None else []),
    ]:
        fn()  # warm-up: kernels, the caching allocators
        torch.cuda.synchronize()
        give_back()
        walls, devs = [], []
        for _ in range(args.repeats):
            wall, dev = timed(fn, stream)
            give_back()
            walls.append(wall)
            devs.append(dev)
        rows_out.append(bench_row(name, total, walls, device_s=devs))
    return rows_out


def write_sample(
    args: argparse.Namespace, pinned: torch.Tensor, shard, sample_bytes: int, i: int, slot: int | None = None
) -> None:
    """Sample `i` of the pinned rows into `shard`'s payload at `slot` (default: `i`), as the connector writes one."""
    begin = shard.payload_start + (i if slot is None else slot) * sample_bytes
    shard_writer.write_at(
        shard.tmp, {"hs": pinned[i * args.tokens : (i + 1) * args.tokens]}, {"hs": [begin, begin + sample_bytes]}
    )


def write_rows(args: argparse.Namespace, pinned: torch.Tensor, total: int, row_bytes: int) -> list[dict]:
    """The shard-write rows (see the module's docstring)."""
    rows_out = []
    sample_bytes = args.tokens * row_bytes
    layout = [(f"s{i}.hs", torch.bfloat16, [args.tokens, args.layers, args.hidden]) for i in range(args.samples)]
    for threads in [int(t) for t in args.threads.split(",")]:
        for reserve in (False, True):
            walls, reserves = [], []
            for r in range(args.repeats):
                shard = shard_writer.InPlaceShard.open(f"{args.scratch}/copy_bench_{r}.safetensors", layout)
                t0 = time.perf_counter()
                if reserve:
                    shard.reserve(total)
                reserves.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(partial(write_sample, args, pinned, shard, sample_bytes), range(args.samples)))
                walls.append(time.perf_counter() - t0)
                shard.abort()
            name = f"write_{'reserved' if reserve else 'sparse'}_{threads}"
            rows_out.append(bench_row(name, total, walls, reserve_s=reserves))
    rows_out += unit_write_rows(args, pinned, total, sample_bytes)
    return rows_out


def unit_write_rows(args: argparse.Namespace, pinned: torch.Tensor, total: int, sample_bytes: int) -> list[dict]:
    """`units_fifo` / `units_per_file`: the samples as `--units` units, each into its own reserved shard, submitted
    in unit order to `--connector-threads` threads (vLLM's connector pool) as they are in one engine step: straight
    into the pool, as the connector did, or through shard_writer.PerFileJobs, as it does."""
    per_unit = -(-args.samples // args.units)
    rows_out = []
    for name in ("units_fifo", "units_per_file"):
        walls = []
        for _ in range(args.repeats):
            files = []
            for u in range(args.units):
                count = len(range(u * per_unit, min(args.samples, (u + 1) * per_unit)))
                layout = [(f"s{i}.hs", torch.bfloat16, [args.tokens, args.layers, args.hidden]) for i in range(count)]
                files.append(shard_writer.InPlaceShard.open(f"{args.scratch}/copy_bench_unit{u}.safetensors", layout))
                files[-1].reserve(count * sample_bytes)

            def write(i: int, files: list = files) -> None:
                write_sample(args, pinned, files[i // per_unit], sample_bytes, i, i % per_unit)

            with ThreadPoolExecutor(args.connector_threads) as pool:
                jobs = shard_writer.PerFileJobs(pool) if name == "units_per_file" else None
                t0 = time.perf_counter()
                if jobs is None:
                    futures = [pool.submit(write, i) for i in range(args.samples)]
                else:
                    futures = [jobs.submit(files[i // per_unit].tmp, partial(write, i)) for i in range(args.samples)]
                for f in futures:
                    f.result()
                walls.append(time.perf_counter() - t0)
            for shard in files:
                shard.abort()
        rows_out.append(bench_row(f"{name}_{args.units}x{args.connector_threads}", total, walls))
    return rows_out


def bench_row(name: str, total: int, walls: list[float], **extra) -> dict:
    """One result row, printed as it is measured: the repeats' walls, their median and its rate."""
    wall = statistics.median(walls)
    row = {"row": name, "bytes": total, "wall_s": walls, **extra, "median_wall_s": wall, "gb_per_s": total / wall / 1e9}
    print(json.dumps(row), flush=True)
    return row


if __name__ == "__main__":
    main()
