"""What the generate stage's writer threads cost per captured byte on this machine, by step and thread count:
vLLM's connector writing a request's file into the scratch dir, then what commit.CaptureWriter does with it (read it,
capture_checks.capture_stats, write it into a shard). It sizes `generate.writer_threads` and says which step bounds
one-pass generation on a machine (the disk, the stats pass, or the scratch copy). A prefill unit's samples
(capture_only, two_pass's capture pass) skip this path on a local run dir: vLLM's connector writes them into their
shards itself.

    .venv/bin/python -m bench.bench_writer --out-dir /tmp/writer_bench --threads 1,2
    python3 -m bench.bench_writer --hidden 4096 --layers 4 --threads 1,4,8,16 --out-dir /tmp/writer_bench   # 8B-shaped

Rows: GB/s of captured bf16 bytes for each step alone and for the whole path, per thread count.

    .venv/bin/python -m bench.bench_writer --notes 200 --threads 8

`--notes N`: the pickup of N notes of samples the connector wrote into their shards (as the actor's writer threads
take them: wait for the note's lock, read and check it, stats from its norms) on `--threads` threads beside one thread
running Python (as vLLM's output handler does on the actor's event loop), at Python's default GIL switch interval and
at the engine actor's (engine.GIL_SWITCH_INTERVAL_S), alternating, three rounds: ms per note.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from safetensors.torch import save_file

from eagle3_ray.core import capture_checks, shards
from eagle3_ray.generate import chat
from eagle3_ray.generate.engine import GIL_SWITCH_INTERVAL_S


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--tokens", type=int, default=333, help="tokens per sample (the 200 builtin prompts average 333)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--scratch", default="/dev/shm", help="where the connector's per-request files go")
    p.add_argument("--out-dir", default="/tmp/writer_bench", help="where shards go (the run dir's disk)")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--notes", type=int, default=0, help="time the pickup of this many notes instead")
    args = p.parse_args()
    if args.notes:
        return note_pickup(args)
    hs = torch.randn(args.tokens, args.layers, args.hidden).to(torch.bfloat16)
    tokens = torch.arange(args.tokens)
    gb = args.samples * hs.numel() * 2 / 1e9
    scratch = tempfile.mkdtemp(dir=args.scratch, prefix="writer-bench-")
    os.makedirs(args.out_dir, exist_ok=True)
    out = tempfile.mkdtemp(dir=args.out_dir, prefix="writer-bench-")

    def connector(i: int) -> None:
        save_file({"hidden_states": hs, "token_ids": tokens}, f"{scratch}/{i}.safetensors")

    def writer_thread() -> None:  # as commit.CaptureWriter's threads start
        torch.set_num_threads(1)

    def read(i: int) -> torch.Tensor:  # as the stage reads a generate-mode capture (chat.load_capture)
        return shards.read_safetensors(f"{scratch}/{i}.safetensors")["hidden_states"]

    def stats(i: int) -> None:
        capture_checks.capture_stats(read(i))

    def shard(i: int) -> None:
        save_file({f"{i}.hs": read(i)}, f"{out}/{i}.safetensors")

    def whole(i: int) -> None:
        x = read(i)
        capture_checks.capture_stats(x)
        save_file({f"{i}.hs": x}, f"{out}/{i}.safetensors")

    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        row = {"threads": threads, "gb": gb}
        for name, fn in (
            ("connector_write", connector),
            ("read_stats", stats),
            ("read_shard_write", shard),
            ("whole_path", whole),
        ):
            if name == "connector_write":
                shutil.rmtree(scratch)
                os.makedirs(scratch)
            start = time.perf_counter()
            with ThreadPoolExecutor(threads, initializer=writer_thread) as pool:
                list(pool.map(fn, range(args.samples)))
            row[f"{name}_gb_s"] = gb / (time.perf_counter() - start)
            if name != "connector_write":
                for f in os.listdir(out):
                    os.remove(os.path.join(out, f))
        rows.append(row)
        print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


def note_pickup(args) -> None:
    threads = int(args.threads.split(",")[-1])
    scratch = tempfile.mkdtemp(dir=args.scratch, prefix="writer-bench-")
    ids = list(range(args.tokens))
    note = {
        "token_ids": torch.tensor(ids, dtype=torch.int32),
        "norms": torch.rand(args.tokens, args.layers),
        "nonfinite": torch.zeros(args.layers, dtype=torch.int64),
        "stamps": torch.zeros(4, dtype=torch.float64),
    }

    def pickup(i: int | str) -> None:  # as commit.CaptureWriter._prepare takes a planned or streamed sample's note
        path = f"{scratch}/{i}.safetensors"
        chat.wait_for_capture(path)
        data = chat.load_capture({"id": str(i), "input_ids": ids, "_num_captured": args.tokens}, path)
        capture_checks.stats_from_norms(data["norms"], data["nonfinite"])

    stop = threading.Event()

    def python_loop() -> None:
        while not stop.is_set():
            sum(range(10_000))

    save_file(note, f"{scratch}/warm.safetensors")  # imports (vLLM's file clean-up) before the clock starts
    open(f"{scratch}/warm.safetensors.lock", "w").close()
    pickup("warm")
    rows, default = [], sys.getswitchinterval()
    for round_ in range(3):
        for interval in (default, GIL_SWITCH_INTERVAL_S):
            for i in range(args.notes):
                save_file(note, f"{scratch}/{i}.safetensors")
                open(f"{scratch}/{i}.safetensors.lock", "w").close()
            sys.setswitchinterval(interval)
            stop.clear()
            busy = threading.Thread(target=python_loop)
            busy.start()
            start = time.perf_counter()
            with ThreadPoolExecutor(threads, initializer=torch.set_num_threads, initargs=(1,)) as pool:
                list(pool.map(pickup, range(args.notes)))
            wall = time.perf_counter() - start
            stop.set()
            busy.join()
            rows.append(
                {
                    "round": round_,
                    "switch_interval_ms": interval * 1e3,
                    "threads": threads,
                    "notes": args.notes,
                    "wall_s": wall,
                    "ms_per_note": wall / args.notes * 1e3,
                }
            )
            print(
                " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()),
                flush=True,
            )
    sys.setswitchinterval(default)
    shutil.rmtree(scratch, ignore_errors=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
