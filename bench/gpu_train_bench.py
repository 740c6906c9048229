"""Training throughput on one GPU: our train-stage step (eagle3_ray.train.worker's model build + data.py's loader)
vs speculators' own Trainer (`python3 -m speculators.train`), on the same synthetic hidden states.

    python3 -m bench.gpu_train_bench --verifier /tmp/verifiers/llama3-8b --out /tmp/tb.json      # 8192, then 2048
    python3 -m bench.gpu_train_bench --verifier /tmp/verifiers/llama3-8b --seq-lens 8192 --out /tmp/tb_8192.json
    python3 -m bench.gpu_train_bench --tiny --out /tmp/train_bench_tiny.json                            # CPU rehearsal

Each side trains one warm-up epoch (dynamo's compile, the loader's start), then one timed epoch: every sample of
speculators' train split (the first 90% of the samples; our side gets the same ones, both samplers the same seed)
once, so both sides time the same tokens (trained positions) in the same packed batches (128 samples: 115 train
samples, 129,717 positions; the timed epoch is 18 steps at 8192, 86 at 2048, the warm-up epoch 17 and 82). Both
lengths (8192 first) are meant to fit one call of the GPU machine; the JSON is rewritten after each length, so a
call cut short keeps the lengths it finished. The synthetic data (--work) is written by the first call and reused
by the next ones with the same sample arguments. Each row records the timed epoch's tokens, steps and seconds
(`timed_s`); `ratio_vs_speculators` is ours tokens/s over speculators'. Our rows split the step: data wait (host
blocked on the next batch), H2D (GPU time of the copy) and compute (GPU time of the step). `--compile both` (the
default) times our step twice at each length, `ours (compiled)` (train.compile on: the drafter's forward under
torch.compile, as speculators sets it on CUDA, which is also train.compile auto there) and `ours (eager)`
(train.compile off), next to one speculators run; dynamo compiles in the first warm-up step. The eager row runs
last at each length: speculators' flex attention is compiled only inside that forward, so eager it materializes the
full score matrix (slow, and at 8192 it may run out of memory: the row then records the error).

The verifier dir only needs config.json + embed_tokens / lm_head / norm: that is all Eagle3DraftModel loads from
`verifier_name_or_path` (speculators.utils.loading.load_model_layers). An existing dir (e.g. one made by
bench/gpu/make_verifier.py) is reused. Hidden states are random bf16 [T, 4, 4096] (aux 2, 16, 29 + final 32),
written from the same tensors in both formats: our generate-stage output (shards + manifest + conversations +
capture.json, docs/design.md) and speculators' per-sample `hidden_states/hs_{i}.safetensors` + datasets folder.
Ours is timed in-process (one process, no Ray Train: this measures the step, not Ray startup). speculators' Trainer
runs as its CLI with --epochs 2, --log-freq beyond the run (its profiled steps synchronize the GPU at each phase:
only its step 0 is profiled, in the warm-up); the timed epoch runs from its "Training epoch 2/2 started" line to its
"... completed" line, each stamped as it arrives on the CLI's stdout (its console prints the clock to the second).
Its validation epoch and checkpoint lie between the epochs, outside the timed one; its save dir is deleted after.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import torch
from safetensors.torch import save_file

from eagle3_ray.core import shard_format, shards, storage
from eagle3_ray.train import vocab

LLAMA31_8B = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
    rope_theta=500000.0,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    hidden_act="silu",
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    torch_dtype="bfloat16",
)
TINY = dict(
    LLAMA31_8B,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
    rope_theta=10000.0,
    max_position_embeddings=4096,
)
AUX_8B, AUX_TINY = [2, 16, 29], [1, 4, 6]
# speculators' Trainer trains on the first int(n * TRAIN_DATA_RATIO) rows of --data-path (the rest is its validation
# split); our side gets the same samples, and both samplers the same seed, so a timed epoch is the same batches
TRAIN_DATA_RATIO, SEED = 0.9, 0


def write_verifier(out: str, shape: dict, device: str) -> str:
    """config.json + model.safetensors holding only the three tensors the drafter loads (random bf16)."""
    if os.path.exists(os.path.join(out, "config.json")) and any(f.endswith(".safetensors") for f in os.listdir(out)):
        return out  # an existing verifier dir (full weights or ours)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(shape, f, indent=1)
    g = torch.Generator(device=device).manual_seed(0)
    v, h = shape["vocab_size"], shape["hidden_size"]
    tensors = {
        "model.embed_tokens.weight": torch.randn(v, h, generator=g, device=device, dtype=torch.bfloat16) * 0.02,
        "lm_head.weight": torch.randn(v, h, generator=g, device=device, dtype=torch.bfloat16) * 0.02,
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
    }
    save_file({k: t.cpu().contiguous() for k, t in tensors.items()}, os.path.join(out, "model.safetensors"))
    return out


def make_samples(
    num_samples: int, min_len: int, max_len: int, num_layers: int, hidden: int, vocab_size: int, seed: int = 0
):
    """Yields (input_ids [T+1], loss_mask [T+1], hs [T, num_layers, H] bf16); generate mode stores T = len - 1."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(num_samples):
        t = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        ids = torch.randint(3, vocab_size, (t + 1,), generator=g)
        mask = torch.ones(t + 1, dtype=torch.long)
        mask[: t // 4] = 0  # a "prompt" quarter
        yield ids, mask, torch.randn(t, num_layers, hidden, generator=g).to(torch.bfloat16)


def write_both_formats(work: str, verifier: str, shape: dict, aux: list[int], samples) -> tuple[str, str]:
    """(our generate dir, speculators' data dir) holding the same samples."""
    gen_dir, spec_dir = os.path.join(work, "generate"), os.path.join(work, "spec_data")
    layer_ids = aux + [shape["num_hidden_layers"]]
    manifest, convs, spec_rows, shard = [], [], [], {}
    os.makedirs(os.path.join(spec_dir, "hidden_states"), exist_ok=True)
    for i, (ids, mask, hs) in enumerate(samples):
        t, key, sid = hs.shape[0], f"s{i:06d}", f"sample{i:06d}"
        shard.update(shard_format.encode_sample(key, hs, "bfloat16"))
        name = f"shard-{i // 64:05d}.safetensors"
        manifest.append(
            {
                "id": sid,
                "shard": name,
                "key": key,
                "num_tokens": t,
                "dtype": "bfloat16",
                "layer_ids": layer_ids,
                "hidden_size": hs.shape[2],
            }
        )
        convs.append({"id": sid, "input_ids": ids.tolist(), "loss_mask": mask.tolist()})
        if (i + 1) % 64 == 0:
            shards.write_shard(os.path.join(gen_dir, "shards", name), shard)
            shard = {}
        # speculators: token_ids [T] must equal the dataset row's input_ids [T]
        save_file(
            {"token_ids": ids[:t].clone(), "hidden_states": hs.contiguous()},
            os.path.join(spec_dir, "hidden_states", f"hs_{i}.safetensors"),
        )
        spec_rows.append({"input_ids": ids[:t].tolist(), "loss_mask": mask[:t].tolist(), "seq_len": t})
    if shard:
        shards.write_shard(os.path.join(gen_dir, "shards", manifest[-1]["shard"]), shard)
    storage.write_parquet_atomic(
        os.path.join(gen_dir, "manifest.parquet"), pa.Table.from_pylist(manifest, schema=shards.MANIFEST_SCHEMA)
    )
    storage.write_parquet_atomic(os.path.join(gen_dir, "conversations.parquet"), pa.Table.from_pylist(convs))
    storage.write_json_atomic(
        os.path.join(gen_dir, "capture.json"),
        {
            "aux_layer_ids": aux,
            "final_layer_id": shape["num_hidden_layers"],
            "layer_ids": layer_ids,
            "final_layer_norm": "pre",
            "hidden_size": shape["hidden_size"],
            "num_hidden_layers": shape["num_hidden_layers"],
            "vocab_size": shape["vocab_size"],
            "verifier_path": verifier,
            "verifier_architectures": shape["architectures"],
            "model_dtype": "bfloat16",
            "hidden_states_dtype": "bfloat16",
        },
    )
    write_spec_dataset(spec_dir, spec_rows)
    return gen_dir, spec_dir


def write_spec_dataset(spec_dir: str, rows: list[dict]) -> None:
    """speculators' datasets folder: one row per sample (input_ids, loss_mask, seq_len)."""
    from datasets import Dataset

    ds = Dataset.from_list(rows)
    ds.set_format("torch")  # ArrowDataset compares torch tensors; without this: TypeError in torch.equal
    ds.save_to_disk(spec_dir)


def write_vocabs(work: str, gen_dir: str, spec_dir: str, draft_vocab: int, verifier_vocab: int) -> str:
    """Our vocab dir and speculators' d2t/t2d .npy from the same counts; returns our vocab dir."""
    import pyarrow.parquet as pq

    rows = pq.read_table(os.path.join(gen_dir, "conversations.parquet")).to_pylist()
    counts = vocab.count_tokens((r["input_ids"], r["loss_mask"]) for r in rows)
    d2t, t2d = vocab.build_vocab(counts, draft_vocab, verifier_vocab)
    vocab_dir = os.path.join(work, "vocab")
    vocab.save_vocab(vocab_dir, d2t, t2d, counts)
    np.save(os.path.join(spec_dir, f"d2t-{draft_vocab}.npy"), d2t.numpy())
    np.save(os.path.join(spec_dir, f"t2d-{draft_vocab}.npy"), t2d.numpy())
    return vocab_dir


def timed_loop(loader, step_fn, device: torch.device, *, warmup_epochs: int = 1, timed_epochs: int = 1) -> dict:
    """Runs step_fn(batch) over warmup_epochs + timed_epochs whole epochs and times the timed ones (the device
    synchronized at both ends; steps themselves never wait for it, as in the worker loop): a timed epoch is every
    sample once, so both sides of the bench time the same tokens whatever the packing. The warm-up epoch holds
    dynamo's compile and the loader's start. A DeviceBatches made for these epochs (make_loaders: train.epochs) runs one
    loader iteration through them, as in the worker loop, so the next epoch's first batches are read while this
    one's last steps run (there also during validation and the checkpoint). The split of a step: `data_wait_frac`
    (the loop blocked on the next batch) with `first_fetch_ms` (of it, the wait for each timed epoch's first batch),
    and on CUDA `compute_ms` (GPU time from a step's first kernel to its
    last, CUDA events on the compute stream), `gpu_busy_frac` and, from train_worker.DeviceBatches, `h2d_ms` (GPU time
    of a batch's copy + decode on the side stream, overlapped with compute) and `pin_ms` (host copy into pinned
    memory, in its thread)."""
    from eagle3_ray.train.worker import batch_tokens

    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    num_epochs = warmup_epochs + timed_epochs

    def start(epoch: int) -> None:
        loader.batch_sampler.set_epoch(epoch)

    for epoch in range(warmup_epochs):
        start(epoch)
        for batch in loader:
            step_fn(batch)
    sync()
    t_start = time.perf_counter()
    pin0, copied0 = getattr(loader, "pin_s", 0.0), getattr(loader, "num_copied", 0)
    waits, first_waits, tokens, steps, marks = 0.0, 0.0, 0.0, 0, []
    for epoch in range(warmup_epochs, num_epochs):
        start(epoch)
        t_fetch, first = time.perf_counter(), True
        for batch in loader:
            wait = time.perf_counter() - t_fetch
            waits += wait
            if first:
                first_waits, first = first_waits + wait, False
            if cuda:
                marks.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
                marks[-1][0].record()
            step_fn(batch)
            if cuda:
                marks[-1][1].record()
            tokens += batch_tokens(batch)
            steps += 1
            t_fetch = time.perf_counter()
    sync()
    timed_s = time.perf_counter() - t_start
    result = {
        "steps": steps,
        "tokens": int(tokens),
        "timed_s": timed_s,
        "tokens_per_s": tokens / timed_s,
        "step_ms": 1000 * timed_s / steps,
        "data_wait_frac": waits / timed_s,
        "tokens_per_step": tokens / steps,
        "first_fetch_ms": 1000 * first_waits / timed_epochs,
    }
    if cuda:
        compute_ms = sum(a.elapsed_time(b) for a, b in marks)
        result.update(compute_ms=compute_ms / steps, gpu_busy_frac=compute_ms / (1000 * timed_s))
    copies = list(getattr(loader, "h2d_events", []))[-steps:]
    if copies:
        result["h2d_ms"] = sum(a.elapsed_time(b) for a, b in copies) / len(copies)
        result["pin_ms"] = 1000 * (loader.pin_s - pin0) / max(1, loader.num_copied - copied0)
    return result


def epoch_plan(lengths: list[int], total_seq_len: int, epoch: int, seed: int = SEED) -> tuple[int, int]:
    """(steps, tokens) of one epoch as speculators' packing sampler (both sides' sampler) lays it out: every sample
    in exactly one batch, truncated to total_seq_len. Tokens are trained positions, as train_worker.batch_tokens and
    speculators' own profile count them (document_ids != -1): a sample's length less one (shift_batch drops its
    first token: x1..xT predicted from g0..g(T-1))."""
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    sampler = MultipackDistributedBatchSamplerV2(
        batch_max_length=total_seq_len, lengths=lengths, num_replicas=1, rank=0, seed=seed
    )
    sampler.set_epoch(epoch)
    batches = list(sampler)
    clipped = np.minimum(np.asarray(lengths), total_seq_len)
    return len(batches), int(sum(int(np.maximum(clipped[b] - 1, 0).sum()) for b in batches))


def compute_floor(model, total_seq_len: int, ttt_steps: int, peak_flops: float) -> dict:
    """Tokens/s if the step ran at the GPU's peak: 6 FLOPs per trainable parameter per token (forward + backward)
    for each TTT step, plus causal attention (4 * T * H per layer per token, halved by the mask, times 3)."""
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    hidden = model.config.transformer_layer_config.hidden_size
    per_token = ttt_steps * (6 * params + 3 * 2 * total_seq_len * hidden)
    return {"flops_per_token": per_token, "tokens_per_s": peak_flops / per_token, "peak_flops": peak_flops}


def time_ours(
    gen_dir: str,
    vocab_dir: str,
    *,
    total_seq_len: int,
    draft_vocab: int,
    use_gpu: bool,
    num_train_samples: int,
    warmup_epochs: int = 1,
    timed_epochs: int = 1,
    attn_impl: str = "auto",
    num_loader_workers: int | None = None,
    peak_flops: float = 0.0,
    compile_mode: str = "auto",
    optimizer: str = "adamw",
) -> dict:
    """The train worker's own pieces, one process, no Ray Train: train_worker.build_model, make_optimizers,
    make_loaders over the first `num_train_samples` samples (data.load_refs; speculators' train split) and
    TrainStep, the worker's step, timed by timed_loop. `compile_mode` is train.compile; dynamo's caches are cleared
    first, so a compiled run compiles for its own total_seq_len (after another length dynamo would recompile with
    dynamic shapes), in the first warm-up step. `optimizer` is train.optimizer."""
    from eagle3_ray.core.config import Config
    from eagle3_ray.train import data
    from eagle3_ray.train import worker as train_worker

    cfg = Config()
    tc = cfg.train
    tc.use_gpu, tc.total_seq_len, tc.draft_vocab_size, tc.ttt_steps, tc.num_draft_layers = (
        use_gpu,
        total_seq_len,
        draft_vocab,
        3,
        1,
    )
    tc.attn_impl, tc.loss_implementation, tc.num_loader_workers = attn_impl, "eager", num_loader_workers
    tc.compile, cfg.run.seed, tc.epochs, tc.optimizer = compile_mode, SEED, warmup_epochs + timed_epochs, optimizer
    capture = json.load(open(os.path.join(gen_dir, "capture.json")))
    cfg.verifier.path = capture["verifier_path"]
    device = torch.device("cuda" if use_gpu else "cpu")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = train_worker.build_model(cfg, capture, vocab_dir, device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizers = train_worker.make_optimizers(model, tc, device)
    refs, _manifest = data.load_refs(gen_dir)
    args = train_worker.WorkerArgs(
        cfg=cfg.to_dict(), out_dir=gen_dir, capture=capture, val_ids=[], train_refs=refs[:num_train_samples]
    )
    train_loader, _ = train_worker.make_loaders(cfg, args, rank=0, world=1, device=device)
    step = train_worker.TrainStep(
        model,
        params,
        optimizers,
        [],
        train_worker.loss_kwargs(cfg),
        device,
        autocast=use_gpu,
        max_grad_norm=tc.max_grad_norm,
    )
    result = timed_loop(train_loader, step, device, warmup_epochs=warmup_epochs, timed_epochs=timed_epochs)
    result["loader_workers"] = train_loader.loader.num_workers
    if peak_flops:
        result["compute_floor"] = compute_floor(model, total_seq_len, tc.ttt_steps, peak_flops)
    return result


# its root logger's epoch lines (trainer.run_training); its rich console prints the clock to the second only
# ("[21:24:51] INFO ..."), so time_speculators_cli stamps each line with time.perf_counter() as it arrives
EPOCH_RE = re.compile(r"^\s*(\d+\.\d+) .*Training epoch (\d+)/\d+ (started|completed)", re.MULTILINE)


def epoch_seconds(stamped_log: str) -> dict[int, float]:
    """{epoch (1-based): seconds from its "Training epoch e/n started" line to its "... completed" line} of a log
    whose lines each begin with their arrival time in seconds (time_speculators_cli's log file)."""
    marks = {(int(e), kind): float(t) for t, e, kind in EPOCH_RE.findall(stamped_log)}
    return {
        e: t_end - marks[(e, "started")]
        for (e, kind), t_end in marks.items()
        if kind == "completed" and (e, "started") in marks
    }


def speculators_cli_command(
    verifier: str,
    spec_dir: str,
    aux: list[int],
    *,
    draft_vocab: int,
    epochs: int,
    save_path: str,
    total_seq_len: int | None,
    optimizer: str | None = None,
    extra: list[str] | tuple[str, ...] = (),
) -> list[str]:
    """`python -m speculators.train` on a data dir written by write_both_formats / bench/gpu/parity.py (its d2t / t2d
    `.npy` beside the data): one draft layer, 3 TTT steps, the eager loss (its fused loss fails under torch 2.11's
    dynamo), mask token 0, its train/validation split and seed; everything else its own defaults (total_seq_len
    8192 when None, Muon when `optimizer` is None, lr 1e-3, linear schedule)."""
    cmd = [
        sys.executable,
        "-m",
        "speculators.train",
        "--verifier-name-or-path",
        verifier,
        "--data-path",
        spec_dir,
        "--target-layer-ids",
        *map(str, aux),
        "--draft-vocab-size",
        str(draft_vocab),
        "--d2t-path",
        os.path.join(spec_dir, f"d2t-{draft_vocab}.npy"),
        "--t2d-path",
        os.path.join(spec_dir, f"t2d-{draft_vocab}.npy"),
        "--mask-token-id",
        "0",
        "--num-layers",
        "1",
        "--ttt-steps",
        "3",
        "--loss-implementation",
        "eager",
        "--epochs",
        str(epochs),
        "--train-data-ratio",
        str(TRAIN_DATA_RATIO),
        "--seed",
        str(SEED),
        "--save-path",
        save_path,
        *extra,
    ]
    if total_seq_len is not None:
        cmd += ["--total-seq-len", str(total_seq_len)]
    if optimizer is not None:
        cmd += ["--optimizer", optimizer]
    return cmd


def time_speculators_cli(
    verifier: str,
    spec_dir: str,
    aux: list[int],
    lengths: list[int],
    *,
    total_seq_len: int,
    draft_vocab: int,
    warmup_epochs: int,
    timed_epochs: int,
    work: str,
    num_loader_workers: int,
    optimizer: str | None = None,
) -> dict:
    """speculators' Trainer through its CLI over warmup_epochs + timed_epochs epochs; the timed ones from its epoch
    log lines. `log_freq` beyond the run's steps: only global step 0 (warm-up) is profiled, since its profiled
    steps synchronize the GPU at every phase. Tokens and steps of the timed epochs: epoch_plan over `lengths` (its
    train split's seq_len, the same sampler and seed). `optimizer` None: its own default (Muon)."""
    save_path = os.path.join(work, f"spec_ckpt_{total_seq_len}")
    num_epochs = warmup_epochs + timed_epochs
    cmd = speculators_cli_command(
        verifier,
        spec_dir,
        aux,
        draft_vocab=draft_vocab,
        epochs=num_epochs,
        save_path=save_path,
        total_seq_len=total_seq_len,
        optimizer=optimizer,
        extra=["--log-freq", "1000000", "--num-workers", str(num_loader_workers)],
    )
    log_path = os.path.join(work, f"speculators_{total_seq_len}.log")
    # its rich console handler wraps at the terminal width; wide lines keep each log line on one line
    env = {**os.environ, "COLUMNS": "400", "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    try:
        with open(log_path, "w") as log:
            log.write(" ".join(cmd) + "\n")
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            for line in proc.stdout:  # rich flushes each record; stamped here on arrival
                log.write(f"{time.perf_counter() - t0:10.3f} {line}")
            returncode = proc.wait()
    finally:
        shutil.rmtree(save_path, ignore_errors=True)  # a checkpoint per epoch, ~2.3 GB each at 8B shape
    wall_s = time.perf_counter() - t0
    log_text = open(log_path).read()
    if returncode != 0:
        raise RuntimeError(f"speculators.train exited {returncode}; tail:\n{log_text[-3000:]}")
    seconds = epoch_seconds(log_text)
    timed = range(warmup_epochs + 1, num_epochs + 1)  # its epochs are 1-based in the log, 0-based in the sampler
    if any(e not in seconds for e in timed):
        raise RuntimeError(
            f"no start/end line of epochs {list(timed)} in speculators' log ({log_path}); tail:\n{log_text[-3000:]}"
        )
    plans = [epoch_plan(lengths, total_seq_len, e - 1) for e in timed]
    steps, tokens = sum(p[0] for p in plans), sum(p[1] for p in plans)
    timed_s = sum(seconds[e] for e in timed)
    return {
        "steps": steps,
        "tokens": tokens,
        "timed_s": timed_s,
        "tokens_per_s": tokens / timed_s,
        "step_ms": 1000 * timed_s / steps,
        "tokens_per_step": tokens / steps,
        "wall_s": wall_s,
    }


def print_table(rows: list[dict]) -> None:
    print(
        f"{'seq_len':>8} {'impl':<22} {'tokens':>9} {'steps':>5} {'timed s':>8} {'tokens/s':>10} {'step ms':>9} "
        f"{'data wait':>9} {'1st ms':>7} {'h2d ms':>7} {'compute ms':>10} {'ratio':>6} {'floor tok/s':>11}"
    )
    nan = float("nan")
    for r in rows:
        if "error" in r:
            print(f"{r['total_seq_len']:>8} {r['impl']:<22} FAILED (see JSON / log)")
            continue
        print(
            f"{r['total_seq_len']:>8} {r['impl']:<22} {r['tokens']:>9} {r['steps']:>5} {r['timed_s']:>8.2f} "
            f"{r['tokens_per_s']:>10.0f} {r['step_ms']:>9.1f} {r.get('data_wait_frac', nan):>9.3f} "
            f"{r.get('first_fetch_ms', nan):>7.1f} {r.get('h2d_ms') or nan:>7.1f} "
            f"{r.get('compute_ms') or nan:>10.1f} "
            f"{r.get('ratio_vs_speculators', nan):>6.2f} "
            f"{r.get('compute_floor', {}).get('tokens_per_s', nan):>11.0f}"
        )


def _copy_log_next_to(out: str, work: str, seq_len: int) -> None:
    """speculators' log beside the results JSON (the GPU machine's $OUT comes back, its --work does not)."""
    log_path = os.path.join(work, f"speculators_{seq_len}.log")
    if os.path.exists(log_path):
        shutil.copy(log_path, os.path.dirname(os.path.abspath(out)))


def prepare_data(
    work: str,
    verifier: str,
    shape: dict,
    aux: list[int],
    *,
    num_samples: int,
    min_len: int,
    max_len: int,
    draft_vocab: int,
) -> tuple[str, str, str]:
    """(our generate dir, speculators' data dir, our vocab dir), written once per work dir and kept for the next
    invocation with the same samples (one total_seq_len per call fits the GPU machine's 10-minute call limit)."""
    key = {
        "num_samples": num_samples,
        "min_len": min_len,
        "max_len": max_len,
        "shape": shape,
        "aux": aux,
        "draft_vocab": draft_vocab,
        "verifier": verifier,
    }
    stamp = os.path.join(work, "data.json")
    gen_dir, spec_dir, vocab_dir = (os.path.join(work, d) for d in ("generate", "spec_data", "vocab"))
    if os.path.exists(stamp) and json.load(open(stamp)) == key:
        print(f"data: reusing {num_samples} samples in {work}", flush=True)
        return gen_dir, spec_dir, vocab_dir
    t0 = time.perf_counter()
    for d in (gen_dir, spec_dir, vocab_dir):
        shutil.rmtree(d, ignore_errors=True)
    samples = make_samples(num_samples, min_len, max_len, len(aux) + 1, shape["hidden_size"], shape["vocab_size"])
    gen_dir, spec_dir = write_both_formats(work, verifier, shape, aux, samples)
    vocab_dir = write_vocabs(work, gen_dir, spec_dir, draft_vocab, shape["vocab_size"])
    storage.write_json_atomic(stamp, key)
    print(f"data: {num_samples} samples in both formats, {time.perf_counter() - t0:.0f} s", flush=True)
    return gen_dir, spec_dir, vocab_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--verifier", default="/tmp/verifiers/llama3-8b", help="dir to reuse or create")
    p.add_argument("--work", default="/tmp/train_bench")
    p.add_argument("--out", required=True, help="JSON results")
    p.add_argument(
        "--seq-lens",
        type=int,
        nargs="+",
        default=None,
        help="total_seq_len values (default 8192 2048; --tiny: 128 256)",
    )
    p.add_argument("--num-samples", type=int, default=128)
    p.add_argument(
        "--warmup-epochs", type=int, default=1, help="whole epochs before the timed ones (compile, loader start)"
    )
    p.add_argument("--timed-epochs", type=int, default=1, help="whole epochs timed, each every train sample once")
    p.add_argument("--loader-workers", type=int, default=8, help="DataLoader workers, both sides")
    p.add_argument("--peak-tflops", type=float, default=788.0, help="dense bf16 peak of the GPU (H200: ~788)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, our side on CPU, speculators' CLI skipped")
    p.add_argument(
        "--compile",
        choices=["off", "on", "both"],
        default="both",
        help="our side with train.compile on, off (eager), or both next to the same speculators run",
    )
    p.add_argument(
        "--optimizer",
        choices=["adamw", "muon"],
        default=None,
        help="both sides' optimizer; default: ours AdamW, speculators' its own default (Muon)",
    )
    args = p.parse_args()
    use_gpu = torch.cuda.is_available() and not args.tiny
    shape, aux = (TINY, AUX_TINY) if args.tiny else (LLAMA31_8B, AUX_8B)
    draft_vocab = 256 if args.tiny else 32000
    seq_lens = args.seq_lens or ([128, 256] if args.tiny else [8192, 2048])
    num_samples, min_len, max_len = (24, 20, 60) if args.tiny else (args.num_samples, 256, 2048)
    os.makedirs(args.work, exist_ok=True)
    verifier = write_verifier(
        os.path.join(args.work, "verifier") if args.tiny else args.verifier, shape, "cuda" if use_gpu else "cpu"
    )
    gen_dir, spec_dir, vocab_dir = prepare_data(
        args.work,
        verifier,
        shape,
        aux,
        num_samples=num_samples,
        min_len=min_len,
        max_len=max_len,
        draft_vocab=draft_vocab,
    )
    device = torch.cuda.get_device_name() if use_gpu else "cpu"
    num_train = int(num_samples * TRAIN_DATA_RATIO)
    lengths = [
        r["num_tokens"]
        for r in storage.read_parquet(os.path.join(gen_dir, "manifest.parquet"), ["num_tokens"]).to_pylist()
    ][:num_train]
    epochs = {"warmup_epochs": args.warmup_epochs, "timed_epochs": args.timed_epochs}
    our_optimizer = args.optimizer or "adamw"
    rows = []

    def write_results() -> None:
        storage.write_json_atomic(
            args.out,
            {
                "device": device,
                "torch": torch.__version__,
                "tiny": args.tiny,
                "num_samples": num_samples,
                "num_train_samples": num_train,
                **epochs,
                "rows": rows,
            },
        )

    def ours_row(seq_len: int, mode: str) -> dict:
        impl = "ours (compiled)" if mode == "on" else "ours (eager)"
        try:
            ours = time_ours(
                gen_dir,
                vocab_dir,
                total_seq_len=seq_len,
                draft_vocab=draft_vocab,
                use_gpu=use_gpu,
                num_train_samples=num_train,
                **epochs,
                num_loader_workers=args.loader_workers,
                peak_flops=args.peak_tflops * 1e12,
                compile_mode=mode,
                optimizer=our_optimizer,
            )
        except RuntimeError as e:  # a compile error, or out of memory: eager flex attention materializes the scores
            print(f"{impl} at total_seq_len={seq_len} failed: {e}", flush=True)
            if use_gpu:
                torch.cuda.empty_cache()
            return {"total_seq_len": seq_len, "impl": impl, "compile": mode, "error": str(e)[-2000:]}
        return {"total_seq_len": seq_len, "impl": impl, "compile": mode, "optimizer": our_optimizer, **ours}

    # compiled, then speculators, then eager: a slow or failed eager row cannot cost the other two
    for seq_len in seq_lens:
        ours_rows, spec = [], None
        if args.compile in ("on", "both"):
            ours_rows.append(ours_row(seq_len, "on"))
            rows.append(ours_rows[-1])
            write_results()
        if not use_gpu:
            print("speculators' Trainer skipped: it needs CUDA (trainer.py calls model.to(local_rank))", flush=True)
        else:
            try:
                spec = time_speculators_cli(
                    verifier,
                    spec_dir,
                    aux,
                    lengths,
                    total_seq_len=seq_len,
                    draft_vocab=draft_vocab,
                    **epochs,
                    work=args.work,
                    num_loader_workers=args.loader_workers,
                    optimizer=args.optimizer,
                )
                rows.append(
                    {
                        "total_seq_len": seq_len,
                        "impl": "speculators Trainer",
                        "optimizer": args.optimizer or "muon",
                        **spec,
                    }
                )
            except RuntimeError as e:  # keep our numbers; the log file named in the error has the details
                print(f"speculators' Trainer at total_seq_len={seq_len} failed: {e}", flush=True)
                rows.append({"total_seq_len": seq_len, "impl": "speculators Trainer", "error": str(e)[-2000:]})
            _copy_log_next_to(args.out, args.work, seq_len)
            write_results()
        if args.compile in ("off", "both"):
            ours_rows.append(ours_row(seq_len, "off"))
            rows.append(ours_rows[-1])
        for row in ours_rows:
            if spec is not None and "error" not in row:
                row["ratio_vs_speculators"] = row["tokens_per_s"] / spec["tokens_per_s"]
                row["same_tokens_as_speculators"] = row["tokens"] == spec["tokens"]
        write_results()
        print_table(rows)
    print_table(rows)
    write_results()


if __name__ == "__main__":
    main()
