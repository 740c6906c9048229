"""The pipeline's own training (`ray_jobs/pipeline.py --stages train`: Ray Train, one GPU worker, the loader, the
checkpoints) on the samples bench/gpu_train_bench.py wrote, at the same total_seq_len, next to that bench's
in-process rate of the same step: what the Ray Train wrapping costs.

    python3 -m bench.gpu_train_bench --out /tmp/e3r_out/train_bench.json          # writes /tmp/train_bench first
    python3 -m bench.gpu.train_pipeline_bench --seq-len 8192 --bench /tmp/e3r_out/train_bench.json --out /tmp/tp.json
    .venv/bin/python -m bench.gpu.train_pipeline_bench --cpu --work /tmp/train_bench_tiny --seq-len 256   # rehearsal

The bench's generate dir becomes this run's generate output (a link at the version this config expects, marked
finished), so the train stage reads exactly the bench's shards. The rate is the median `tokens_per_s` of the
`train` lines of metrics.jsonl after the first epoch (the first holds engine-free warm-up: model build, first steps),
with `data_wait_frac` alongside; target: >= 0.9x the bench's own rate at this total_seq_len.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from eagle3_ray.core import stage, storage
from eagle3_ray.core.config import load_config

REPO = Path(__file__).resolve().parents[2]


def overrides(args, capture: dict) -> list[str]:
    aux = ",".join(map(str, capture["aux_layer_ids"]))
    return [
        f"verifier.path={capture['verifier_path']}",
        f"verifier.aux_layer_ids=[{aux}]",
        f"run.storage_path={args.runs}",
        f"run.name=train-pipeline-{args.seq_len}",
        "train.num_workers=1",
        f"train.total_seq_len={args.seq_len}",
        f"train.epochs={args.epochs}",
        "train.log_every_steps=5",
        "train.loss_implementation=eager",
        "train.ttt_steps=3",
        f"train.draft_vocab_size={args.draft_vocab}",
        f"train.use_gpu={str(not args.cpu).lower()}",
        "train.num_draft_layers=1",
    ]


def link_generate_output(cfg, gen_dir: str) -> str:
    """The bench's samples as this config's finished generate output."""
    out = stage.output_dir(cfg, "generate")
    if not os.path.exists(out):
        os.makedirs(os.path.dirname(out), exist_ok=True)
        os.symlink(gen_dir, out)
    storage.mark_complete(out, {"source": gen_dir})
    return out


def pipeline_rate(metrics: list[dict]) -> dict:
    lines = [m for m in metrics if m.get("kind") == "train"]
    steady = [m for m in lines if m["epoch"] > 0] or lines
    return {
        "windows": len(steady),
        "tokens_per_s": statistics.median(m["tokens_per_s"] for m in steady),
        "data_wait_frac": statistics.median(m["data_wait_frac"] for m in steady),
        "first_epoch_tokens_per_s": [round(m["tokens_per_s"]) for m in lines if m["epoch"] == 0],
    }


def bench_rates(bench_jsons: list[str], seq_len: int) -> dict:
    """Our in-process rows of gpu_train_bench.py at this total_seq_len, by name."""
    rows = [r for f in bench_jsons for r in json.loads(Path(f).read_text()).get("rows", [])]
    return {
        r["impl"]: r["tokens_per_s"]
        for r in rows
        if r.get("total_seq_len") == seq_len and r.get("impl", "").startswith("ours") and "tokens_per_s" in r
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="/tmp/train_bench", help="gpu_train_bench.py's work dir")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--draft-vocab", type=int, default=None, help="default: the bench's (32000; --cpu 256)")
    p.add_argument("--runs", default="/tmp/runs")
    p.add_argument("--bench", nargs="*", default=[], help="gpu_train_bench.py's JSON files, for the ratio")
    p.add_argument("--cpu", action="store_true", help="rehearsal on the tiny CPU recipe")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    args.draft_vocab = args.draft_vocab or (256 if args.cpu else 32000)
    recipe = str(REPO / ("ray_jobs/configs/tiny_cpu.yaml" if args.cpu else "bench/gpu/h200_llama3_8b.yaml"))
    gen_dir = os.path.join(args.work, "generate")
    extra = overrides(args, json.loads(Path(gen_dir, "capture.json").read_text()))
    cfg = load_config(recipe, extra)
    link_generate_output(cfg, gen_dir)
    cmd = [sys.executable, str(REPO / "ray_jobs/pipeline.py"), recipe, "--stages", "train", *extra]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    latest = storage.latest(cfg.run.run_dir, "train")
    metrics = [json.loads(x) for x in Path(latest["path"], "metrics.jsonl").read_text().splitlines() if x.strip()]
    result = {
        "total_seq_len": args.seq_len,
        "pipeline": pipeline_rate(metrics),
        "bench": bench_rates(args.bench, args.seq_len),
    }
    if result["bench"]:
        best = max(result["bench"].values())
        result["pipeline_vs_bench (>= 0.9)"] = result["pipeline"]["tokens_per_s"] / best
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
