"""Capture throughput and stored bytes per token: our generate stage (capture_only, bf16 and fp8 shards) against
speculators' offline path (vLLM's OpenAI server with the project's CPU connector + `speculators
generate-offline-data`, one safetensors file per sample), same verifier, same token sequences, same run.

    .venv/bin/python -m bench.bench_capture --work /tmp/bench_capture --num-samples 96

Throughput is steady state for both sides: tokens of every file after the first one, over the time between the
first and the last file being written (engine and server start-up are excluded on both sides; they are printed).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time
import urllib.request

from eagle3_ray.core.config import config_from_dict
from eagle3_ray.core.tiny_verifier import build_tiny_verifier
from eagle3_ray.generate.engine import CONNECTOR_MODULE, CONNECTOR_NAME

ENGINE = {"enforce_eager": True, "kv_cache_memory_bytes": 256 << 20}
LAYERS = [1, 3, 4]


def make_conversations(tokenizer, num: int) -> list[list[dict]]:
    """User prompt + an assistant answer cut from standard-library source (about 150-250 tokens each)."""
    import inspect
    import textwrap

    sources = [inspect.getsource(m) for m in (json, argparse, glob, textwrap)]
    convs = []
    for i in range(num):
        src = sources[i % len(sources)]
        start = (i * 977) % max(len(src) - 900, 1)
        convs.append(
            [
                {"role": "user", "content": f"Show me some Python code, example {i}."},
                {"role": "assistant", "content": src[start : start + 500 + (i % 5) * 100]},
            ]
        )
    return convs


def steady_rate(files_tokens: list[tuple[float, int]]) -> float:
    """Tokens/s from file write times: everything after the first file, over first-to-last time."""
    files_tokens.sort()
    span = files_tokens[-1][0] - files_tokens[0][0]
    return sum(t for _, t in files_tokens[1:]) / max(span, 1e-9)


def run_ours(work: str, verifier: str, dtype: str, num_samples: int) -> dict:
    import pyarrow.parquet as pq

    from eagle3_ray.generate.stage import run

    cfg = config_from_dict(
        {
            "run": {"storage_path": work, "name": f"ours-{dtype}"},
            "verifier": {"path": verifier, "aux_layer_ids": LAYERS, "max_model_len": 1024},
            "generate": {
                "mode": "capture_only",
                "hidden_states_dtype": dtype,
                "max_batch_tokens": 2048,
                "shard_max_bytes": 64 << 20,
                "engine_kwargs": ENGINE,
            },
        }
    )
    from transformers import AutoTokenizer

    from eagle3_ray.ingest.in_memory import write_output

    tok = AutoTokenizer.from_pretrained(verifier)
    write_output(cfg, tok, make_conversations(tok, num_samples), source="bench")
    summary = run(cfg)  # a finished version is not redone: its summary and part times are reported
    out = summary["path"]
    parts = [
        (os.path.getmtime(p), int(sum(pq.read_table(p)["num_tokens"].to_pylist())))
        for p in glob.glob(f"{out}/parts/*.parquet")
    ]
    return {
        "tokens": summary["captured_tokens"],
        "bytes_per_token": summary["bytes_per_token"],
        "steady_tokens_per_s": steady_rate(parts),
        "stage_wall_s": summary["run_wall_s"],
        "out": out,
    }


def run_speculators(work: str, verifier: str, ours_out: str, concurrency: int) -> dict:
    """The same input_ids through vLLM's OpenAI server and speculators' client."""
    import datasets
    import pyarrow.parquet as pq

    conv = pq.read_table(f"{ours_out}/conversations.parquet").to_pylist()
    data_dir, hs_dir, scratch = f"{work}/spec_data", f"{work}/spec_hs", f"{work}/spec_scratch"
    data = datasets.Dataset.from_dict(
        {"input_ids": [c["input_ids"] for c in conv], "loss_mask": [c["loss_mask"] for c in conv]}
    )
    data.set_format("torch")  # speculators' client calls .tolist() on the rows
    data.save_to_disk(data_dir)
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": LAYERS + [6]}},
    }
    kv = {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": scratch},
    }
    port = 8000 + os.getpid() % 1000
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            verifier,
            "--port",
            str(port),
            "--max-model-len",
            "1024",
            "--enforce-eager",
            "--kv-cache-memory-bytes",
            str(256 << 20),
            "--speculative-config",
            json.dumps(spec),
            "--kv-transfer-config",
            json.dumps(kv),
        ],
        stdout=open(f"{work}/server.log", "w"),
        stderr=subprocess.STDOUT,
    )
    try:
        t0 = time.monotonic()
        _wait_ready(port, server)
        start_s = time.monotonic() - t0
        t1 = time.monotonic()
        subprocess.run(
            [
                os.path.join(os.path.dirname(sys.executable), "speculators"),
                "generate-offline-data",
                "--endpoint",
                f"http://127.0.0.1:{port}/v1",
                "--preprocessed-data",
                data_dir,
                "--output",
                hs_dir,
                "--concurrency",
                str(concurrency),
                "--fail-on-error",
            ],
            check=True,
            stdout=open(f"{work}/client.log", "w"),
            stderr=subprocess.STDOUT,
        )
        client_s = time.monotonic() - t1
    finally:
        server.terminate()
        server.wait(timeout=60)
    files = glob.glob(f"{hs_dir}/hs_*.safetensors")
    tokens = {f: len(conv[int(f.rsplit("_", 1)[1].split(".")[0])]["input_ids"]) for f in files}
    total_tokens = sum(tokens.values())
    return {
        "tokens": total_tokens,
        "bytes_per_token": sum(os.path.getsize(f) for f in files) / total_tokens,
        "steady_tokens_per_s": steady_rate([(os.path.getmtime(f), t) for f, t in tokens.items()]),
        "server_start_s": start_s,
        "client_wall_s": client_s,
        "client_tokens_per_s": total_tokens / client_s,
    }


def _wait_ready(port: int, server: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"vLLM server exited with {server.returncode}; see server.log")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
            return
        except OSError:
            time.sleep(1)
    raise TimeoutError("vLLM server did not become ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="/tmp/bench_capture")
    parser.add_argument("--num-samples", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    import ray

    os.makedirs(args.work, exist_ok=True)
    verifier = str(build_tiny_verifier("llama", f"{args.work}/tiny-llama"))
    ray.init(address="local", num_cpus=4, include_dashboard=False)
    try:
        bf16 = run_ours(args.work, verifier, "bfloat16", args.num_samples)
        fp8 = run_ours(args.work, verifier, "fp8", args.num_samples)
    finally:
        ray.shutdown()
    spec = run_speculators(args.work, verifier, bf16["out"], args.concurrency)
    result = {
        "ours_bf16": bf16,
        "ours_fp8": fp8,
        "speculators": spec,
        "throughput_ratio_bf16": bf16["steady_tokens_per_s"] / spec["steady_tokens_per_s"],
        "bytes_ratio_bf16": bf16["bytes_per_token"] / spec["bytes_per_token"],
        "bytes_ratio_fp8": fp8["bytes_per_token"] / spec["bytes_per_token"],
    }
    print(json.dumps(result, indent=2))
    with open(f"{args.work}/result.json", "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
