"""Training throughput on CPU, on the tiny verifier's generate output: our train-stage step vs speculators' model +
loss driven by a minimal plain loop fed by speculators' own data path (ArrowDataset over per-sample files).

    .venv/bin/python -m bench.bench_train [--steps 30 --warmup 5 --total-seq-len 512 --work /tmp/bench_train]

Ours: train_worker.build_model / loss_kwargs / make_loaders (data.ShardDataset over shards + manifest), the worker's
step body, in one process without Ray Train (so it times the step, not Ray startup). Speculators: the same
Eagle3DraftModel construction and loss kwargs, its ArrowDataset + MultipackDistributedBatchSamplerV2 + CollateFn +
shift_batch, and the same step body. speculators' own Trainer cannot run on CPU (trainer.py calls
model.to(local_rank)), so the plain loop stands in for it; bench/gpu_train_bench.py runs the real Trainer on a GPU.
Runs in ABBA order (ours, spec, spec, ours) and averages, since the CPU is shared. Both sides: fp32, sdpa attention,
eager loss, one loader worker, same total_seq_len and steps, warmup excluded.
"""

from __future__ import annotations

import argparse
import json
import os

import pyarrow.parquet as pq
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import DataLoader

from bench import gpu_train_bench as gb
from eagle3_ray.core import storage


def to_speculators_format(gen_dir: str, spec_dir: str) -> None:
    """Per-sample hs_{i}.safetensors {token_ids [T], hidden_states [T, L, H]} + a datasets folder, from our shards."""
    manifest = pq.read_table(os.path.join(gen_dir, "manifest.parquet")).to_pylist()
    convs = {r["id"]: r for r in pq.read_table(os.path.join(gen_dir, "conversations.parquet")).to_pylist()}
    os.makedirs(os.path.join(spec_dir, "hidden_states"), exist_ok=True)
    rows = []
    for i, m in enumerate(manifest):
        with safe_open(os.path.join(gen_dir, "shards", m["shard"]), framework="pt") as f:
            hs = f.get_tensor(f"{m['key']}.hs")  # shape: [T, L, H]
        t, conv = m["num_tokens"], convs[m["id"]]
        save_file(
            {"token_ids": torch.tensor(conv["input_ids"][:t]), "hidden_states": hs.contiguous()},
            os.path.join(spec_dir, "hidden_states", f"hs_{i}.safetensors"),
        )
        rows.append({"input_ids": conv["input_ids"][:t], "loss_mask": conv["loss_mask"][:t], "seq_len": t})
    gb._write_spec_dataset(spec_dir, rows)


def time_speculators_loop(
    gen_dir: str, spec_dir: str, vocab_dir: str, *, total_seq_len: int, draft_vocab: int, num_steps: int, warmup: int
) -> dict:
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    from eagle3_ray.core.config import Config
    from eagle3_ray.train import worker as train_worker

    cfg = Config()
    cfg.train.total_seq_len, cfg.train.draft_vocab_size, cfg.train.loss_implementation = (
        total_seq_len,
        draft_vocab,
        "eager",
    )
    capture = json.load(open(os.path.join(gen_dir, "capture.json")))
    cfg.verifier.path = capture["verifier_path"]
    torch.manual_seed(0)
    model = train_worker.build_model(cfg, capture, vocab_dir, torch.device("cpu"))  # Eagle3DraftModel, sdpa
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.train.lr)
    ds = ArrowDataset(max_len=total_seq_len, datapath=spec_dir, on_missing="raise", hidden_states_dtype=torch.float32)
    sampler = MultipackDistributedBatchSamplerV2(
        batch_max_length=total_seq_len, lengths=ds.approx_lengths, num_replicas=1, rank=0, seed=0
    )
    num_aux = len(capture["aux_layer_ids"])
    loader = DataLoader(
        ds,
        batch_sampler=sampler,
        num_workers=1,
        persistent_workers=True,
        prefetch_factor=4,
        collate_fn=CollateFn(
            total_seq_len,
            capture["hidden_size"],
            num_target_layers=num_aux,
            dtype=torch.float32,
            preprocess=shift_batch,
        ),
    )
    step = gb.make_step(model, optimizer, train_worker.loss_kwargs(cfg), torch.device("cpu"), autocast=False)
    return gb.timed_loop(loader, step, num_steps, warmup)


def prepare(work: str, num_samples: int, draft_vocab: int) -> tuple[str, str, str]:
    """(generate dir, speculators data dir, our vocab dir) for the tiny Llama verifier."""
    from eagle3_ray.core.tiny_verifier import build_tiny_verifier
    from eagle3_ray.generate.reference import write_reference_output

    verifier = str(build_tiny_verifier("llama", os.path.join(work, "tiny-llama"), dtype="float32"))
    gen_dir = write_reference_output(os.path.join(work, "run"), verifier, num_samples=num_samples, max_new_tokens=64)
    spec_dir = os.path.join(work, "spec_data")
    if not os.path.exists(os.path.join(spec_dir, "dataset_info.json")):
        to_speculators_format(gen_dir, spec_dir)
    vocab_size = json.load(open(os.path.join(gen_dir, "capture.json")))["vocab_size"]
    return gen_dir, spec_dir, gb.write_vocabs(work, gen_dir, spec_dir, draft_vocab, vocab_size)


def _mean(runs: list[dict]) -> dict:
    return {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", default="/tmp/bench_train")
    p.add_argument("--num-samples", type=int, default=64)
    p.add_argument("--total-seq-len", type=int, default=512)
    p.add_argument("--draft-vocab", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", help="JSON results")
    args = p.parse_args()
    gen_dir, spec_dir, vocab_dir = prepare(args.work, args.num_samples, args.draft_vocab)
    common = dict(
        total_seq_len=args.total_seq_len, draft_vocab=args.draft_vocab, num_steps=args.steps, warmup=args.warmup
    )
    # ABBA order: the machine is shared, so load drifts; each side's numbers are the mean of its two runs
    runs = {"ours": [], "spec": []}
    for side in ("ours", "spec", "spec", "ours"):
        run = (
            gb.time_ours(gen_dir, vocab_dir, use_gpu=False, **common)
            if side == "ours"
            else time_speculators_loop(gen_dir, spec_dir, vocab_dir, **common)
        )
        runs[side].append(run)
        print(side, {k: round(v, 3) for k, v in run.items()}, flush=True)
    ours, spec = (_mean(runs["ours"]), _mean(runs["spec"]))
    rows = [
        {
            "total_seq_len": args.total_seq_len,
            "impl": "ours (worker step)",
            **ours,
            "ratio_vs_speculators": ours["tokens_per_s"] / spec["tokens_per_s"],
        },
        {"total_seq_len": args.total_seq_len, "impl": "speculators plain loop", **spec},
    ]
    print(
        "CPU, single process (no Ray Train: measures the step, not Ray startup). speculators' Trainer cannot run "
        "on CPU (trainer.py calls model.to(local_rank)); its model + loss + data path run in a plain loop instead."
    )
    gb.print_table(rows)
    if args.out:
        storage.write_json_atomic(args.out, {"device": "cpu", "rows": rows, **vars(args)})


if __name__ == "__main__":
    main()
