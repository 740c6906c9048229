"""Capture throughput: plain vLLM prefill vs the same prefill with hidden-state capture through the project's connector
(the exact engine arguments of the generate stage, `eagle3_ray.generate.engine.engine_kwargs`), on the same token
prompts, next to the prefill roofline (2 x parameters FLOPs per token over a bf16 matrix rate measured in the same
call).

    python3 -m bench.gpu.capture_bench /tmp/verifiers/llama3-8b --num-prompts 128 --prompt-len 2048
    python3 -m bench.gpu.capture_bench /tmp/verifiers/llama3-8b --tp 2          # rates also per GPU
    .venv/bin/python -m bench.gpu.capture_bench /tmp/mv/tiny --num-prompts 8 --prompt-len 128   # CPU rehearsal

Each measurement runs in its own process (one engine alive at a time, GPU memory returned between them) and prints
one `RESULT {json}` line; this process collects them and prints the table. Prefill only: max_tokens=1, so a request
is one prompt pass. Capture counts as done when every file is complete on disk (the writer's lock released), not
when `generate` returns.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from eagle3_ray.core.config import config_from_dict
from eagle3_ray.core.tiny_verifier import SPECIAL_TOKENS

GPU_ENGINE_KWARGS = {"gpu_memory_utilization": 0.85}
CPU_ENGINE_KWARGS = {"enforce_eager": True, "kv_cache_memory_bytes": 256 << 20}


def matmul_rate(n: int) -> dict:
    """bf16 n x n x n products: mean of 10 timed after 3 warm-ups, in FLOP/s."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    sync()
    seconds = (time.perf_counter() - start) / 10
    return {
        "mode": "matmul",
        "n": n,
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "flop_per_s": 2 * n**3 / seconds,
    }


def parameter_counts(model: str) -> dict:
    from bench.gpu.make_verifier import weight_shapes

    shapes = weight_shapes(Path(model))
    return {
        "params": sum(s.numel() for s in shapes.values()),
        "embedding_params": sum(s.numel() for n, s in shapes.items() if "embed_tokens" in n or n == "lm_head.weight"),
    }


def token_prompts(args, vocab_size: int) -> list[dict]:
    """Random token ids the tokenizer can decode (its special tokens excluded), same for every mode (fixed seed)."""
    g = torch.Generator().manual_seed(args.seed)
    high = min(vocab_size, args.tokenizer_ids)
    ids = torch.randint(len(SPECIAL_TOKENS), high, (args.num_prompts + args.num_warmup, args.prompt_len), generator=g)
    return [{"prompt_token_ids": row.tolist()} for row in ids]


def engine(args, mode: str, scratch: str):
    """The generate stage's engine arguments; `plain` drops the two capture entries and keeps everything else."""
    from vllm import LLM

    from eagle3_ray.generate.engine import engine_kwargs
    from eagle3_ray.generate.output import capture_contract

    cfg = config_from_dict(
        {
            "verifier": {
                "path": args.model,
                "dtype": "bfloat16",
                "max_model_len": args.prompt_len + 16,
                "aux_layer_ids": args.aux_layer_ids,
            },
            "generate": {"tensor_parallel_size": args.tp, "engine_kwargs": args.engine_kwargs},
        }
    )
    contract = capture_contract(cfg, args.model)
    kwargs = engine_kwargs(cfg, args.model, contract["layer_ids"], scratch)
    if mode == "plain":
        del kwargs["speculative_config"], kwargs["kv_transfer_config"]
    return LLM(**kwargs), contract


def prefill(args, mode: str) -> dict:
    from vllm import SamplingParams

    scratch = os.path.join(args.scratch, mode)
    shutil.rmtree(scratch, ignore_errors=True)
    llm, contract = engine(args, mode, scratch)
    prompts = token_prompts(args, contract["vocab_size"])
    paths = [os.path.join(scratch, f"req-{i:06d}.safetensors") for i in range(len(prompts))]
    params = [
        SamplingParams(
            max_tokens=1,
            temperature=0.0,
            extra_args=({"kv_transfer_params": {"hidden_states_path": p}} if mode == "capture" else None),
        )
        for p in paths
    ]
    w = args.num_warmup
    llm.generate(prompts[:w], params[:w], use_tqdm=False)
    start = time.perf_counter()
    llm.generate(prompts[w:], params[w:], use_tqdm=False)
    generate_s = time.perf_counter() - start
    result = {
        "mode": mode,
        "tokens": args.num_prompts * args.prompt_len,
        "generate_s": generate_s,
        "wall_s": generate_s,
        "layer_ids": contract["layer_ids"],
        "hidden_size": contract["hidden_size"],
    }
    if mode == "capture":
        result.update(files_complete(paths[w:], contract, args.prompt_len))
        result["wall_s"] = time.perf_counter() - start
    shutil.rmtree(scratch, ignore_errors=True)
    return result


def files_complete(paths: list[str], contract: dict, prompt_len: int) -> dict:
    """Wait for every capture file (shared flock on its .lock = the writer is done), then check one file's shape."""
    from safetensors import safe_open

    for p in paths:
        if os.path.exists(p + ".lock"):
            with open(p + ".lock") as lock:
                fcntl.flock(lock, fcntl.LOCK_SH)
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        raise RuntimeError(f"{len(missing)} of {len(paths)} capture files missing, e.g. {missing[0]}")
    with safe_open(paths[-1], "pt") as f:
        shape = f.get_slice("hidden_states").get_shape()  # shape: [T, len(layer_ids), hidden]
    expected = [prompt_len, len(contract["layer_ids"]), contract["hidden_size"]]
    if list(shape) != expected:
        raise RuntimeError(f"capture file shape {shape}, expected {expected}")
    return {"files": len(paths), "bytes": sum(os.path.getsize(p) for p in paths), "file_shape": list(shape)}


def run_child(args, mode: str) -> dict:
    """One measurement in a fresh process; its last `RESULT {json}` line is the answer."""
    cmd = [sys.executable, __file__, *sys.argv[1:], "--child", mode]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    sys.stdout.write(proc.stdout)
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not results:
        raise SystemExit(f"capture_bench: the {mode} run failed (exit {proc.returncode})")
    return results[-1]


def table(args, results: dict, counts: dict) -> str:
    flop_per_token = 2 * counts["params"]
    roofline = results["matmul"]["flop_per_s"] * args.tp / flop_per_token
    lines = [
        f"capture_bench  {args.model}  {args.num_prompts} prompts x {args.prompt_len} tokens  TP={args.tp}  "
        f"params {counts['params'] / 1e9:.3g}B  bf16 matmul {results['matmul']['flop_per_s'] / 1e12:.3g} "
        f"TFLOP/s per device ({results['matmul']['device']})",
        f"{'mode':<10}{'tokens/s':>12}{'per GPU':>12}{'vs plain':>10}{'vs roofline':>13}{'wall_s':>9}"
        f"{'GB written':>12}",
        f"{'roofline':<10}{roofline:>12.0f}{roofline / args.tp:>12.0f}{'':>10}{1:>13.2f}",
    ]
    plain = results["plain"]["tokens"] / results["plain"]["wall_s"]
    for mode in ("plain", "capture"):
        r = results[mode]
        rate = r["tokens"] / r["wall_s"]
        lines.append(
            f"{mode:<10}{rate:>12.0f}{rate / args.tp:>12.0f}{rate / plain:>10.3f}{rate / roofline:>13.3f}"
            f"{r['wall_s']:>9.2f}{r.get('bytes', 0) / 1e9:>12.3f}"
        )
    return "\n".join(lines)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="verifier directory (bench/gpu/make_verifier.py)")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--num-warmup", type=int, default=4)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--aux-layer-ids", type=json.loads, default=None, help="JSON list; default EAGLE-3's [2, L//2, L-3]")
    p.add_argument("--engine-kwargs", type=json.loads, default=None, help="JSON for vllm.LLM, on top of the defaults")
    p.add_argument("--load-format", default=None, help="e.g. dummy: random weights made by vLLM, no files needed")
    p.add_argument("--tokenizer-ids", type=int, default=4096, help="prompt ids stay below this (the tokenizer's size)")
    p.add_argument("--matmul-n", type=int, default=None, help="default 8192 on GPU, 1024 on CPU")
    p.add_argument("--scratch", default="/tmp/capture_bench")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write all results as JSON here")
    p.add_argument("--child", choices=["matmul", "plain", "capture"], help=argparse.SUPPRESS)
    args = p.parse_args()
    gpu = torch.cuda.is_available()
    args.engine_kwargs = {**(GPU_ENGINE_KWARGS if gpu else CPU_ENGINE_KWARGS), **(args.engine_kwargs or {})}
    if args.load_format:
        args.engine_kwargs["load_format"] = args.load_format
    args.matmul_n = args.matmul_n or (8192 if gpu else 1024)
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        result = matmul_rate(args.matmul_n) if args.child == "matmul" else prefill(args, args.child)
        print("RESULT " + json.dumps(result), flush=True)
        return
    results = {mode: run_child(args, mode) for mode in ("matmul", "plain", "capture")}
    counts = parameter_counts(args.model)
    report = table(args, results, counts)
    print(report)
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {
                    "results": results,
                    "params": counts,
                    "table": report,
                    "args": {k: v for k, v in vars(args).items() if k != "child"},
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
