"""Drafter training stage: speculators' EAGLE-3 draft model trained on the generate stage's hidden states by a Ray
Train TorchTrainer (DDP; gloo on CPU, NCCL on GPU), one checkpoint per epoch, recovery by itself.

    python ray_jobs/train.py ray_jobs/configs/tiny_cpu.yaml train.epochs=3

Reads generate/LATEST.json; writes train/{version}/ (Ray Train's run dir: epoch_NNNN checkpoints, best/, vocab/,
split.json, metrics.jsonl, tensorboard/) and train/LATEST.json. A resubmitted job with the same config finds Ray's
snapshot in the same dir and resumes after the last checkpoint; a finished version is a no-op.
"""

from __future__ import annotations

import dataclasses
import os

from eagle3_ray import checkpoints, data, storage, vocab
from eagle3_ray.config import Config
from eagle3_ray.telemetry import log

# Ray is imported inside the functions that start training: importing this module (e.g. to check data) must not
# import Ray, which fixes its auth settings from the environment at import time.

# Fields that change how a run is operated, not what it produces: left out of the version so that a resubmitted
# job with e.g. more allowed failures still resumes the same run.
OPERATIONAL_FIELDS = ("kill_worker_at", "max_failures", "log_every_steps", "num_loader_workers")


def train_version(cfg: Config, generate_version: str) -> str:
    section = {k: v for k, v in dataclasses.asdict(cfg.train).items() if k not in OPERATIONAL_FIELDS}
    return storage.version_hash("train", section, cfg.run.seed, generate_version)


def check_capture(capture: dict, manifest_layer_ids: set[tuple[int, ...]], cfg: Config, gen_dir: str) -> None:
    """The drafter's aux layers are the captured ones; any disagreement is an error before training starts."""
    layer_ids = tuple(capture["layer_ids"])
    if layer_ids != (*capture["aux_layer_ids"], capture["final_layer_id"]):
        raise ValueError(f"{gen_dir}/capture.json: layer_ids {list(layer_ids)} are not aux_layer_ids + final_layer_id")
    if cfg.verifier.aux_layer_ids is not None and list(cfg.verifier.aux_layer_ids) != capture["aux_layer_ids"]:
        raise ValueError(f"verifier.aux_layer_ids={cfg.verifier.aux_layer_ids} (drafter config) does not match the "
                         f"captured aux layers {capture['aux_layer_ids']} in {gen_dir}/capture.json")
    wrong = sorted(ids for ids in manifest_layer_ids if ids != layer_ids)
    if wrong:
        raise ValueError(f"{gen_dir}/manifest.parquet: layer_ids {list(wrong[0])} differ from capture.json's "
                         f"{list(layer_ids)} ({len(capture['aux_layer_ids'])} aux layers + final)")


def prepare_samples(gen_dir: str, capture: dict, cfg: Config) -> tuple[list[data.SampleRef], dict[str, str]]:
    """All samples that can be trained on, and {id: problem} for those that cannot (fail: raise on the first)."""
    manifest = storage.read_parquet(storage.join(gen_dir, "manifest.parquet")).to_pylist()
    check_capture(capture, {tuple(r["layer_ids"]) for r in manifest}, cfg, gen_dir)
    convs = storage.read_parquet(storage.join(gen_dir, "conversations.parquet"), ["id", "input_ids", "loss_mask"])
    by_id = {row["id"]: row for row in convs.to_pylist()}
    refs = data.build_refs(manifest, by_id, storage.join(gen_dir, "shards"))
    problems = data.check_shards(refs, len(capture["layer_ids"]), capture["hidden_size"])
    if problems and cfg.train.on_bad_sample == "fail":
        raise data.BadSampleError(f"{len(problems)} bad samples, first: {next(iter(problems.values()))}")
    for problem in problems.values():
        log("train", "bad_sample", action="skip", problem=problem)
    return [r for r in refs if r.id not in problems], problems


def _write_split_and_vocab(out_dir: str, refs: list[data.SampleRef], cfg: Config, capture: dict) -> dict:
    train_refs = [r for r in refs if not data.is_validation(r.id, cfg.train.val_fraction)]
    val_ids = sorted(r.id for r in refs if data.is_validation(r.id, cfg.train.val_fraction))
    if len(val_ids) < cfg.train.num_workers or len(train_refs) < cfg.train.num_workers:
        raise ValueError(f"train.val_fraction={cfg.train.val_fraction} leaves {len(train_refs)} train and "
                         f"{len(val_ids)} validation samples; each of {cfg.train.num_workers} workers needs one of each")
    split = {"val_fraction": cfg.train.val_fraction, "num_train": len(train_refs), "val_ids": val_ids}
    storage.write_json_atomic(storage.join(out_dir, "split.json"), split)
    vocab_dir = storage.join(out_dir, "vocab")
    if not vocab.vocab_exists(vocab_dir):
        counts = vocab.count_tokens((r.input_ids, r.loss_mask) for r in train_refs)
        d2t, t2d = vocab.build_vocab(counts, cfg.train.draft_vocab_size, capture["vocab_size"])
        vocab.save_vocab(vocab_dir, d2t, t2d, counts)
    return split


def _trainer(cfg: Config, out_dir: str, version: str, loop_config: dict):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from eagle3_ray.train_worker import train_loop

    tc = cfg.train
    resources = {"CPU": tc.cpus_per_worker}
    return TorchTrainer(
        train_loop,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(num_workers=tc.num_workers, use_gpu=tc.use_gpu, resources_per_worker=resources),
        run_config=RunConfig(
            storage_path=os.path.dirname(out_dir), name=version,
            failure_config=FailureConfig(max_failures=tc.max_failures),
            # Ray keeps the last N by report order (enough to resume); the best by validation metric is copied to
            # best/ by rank 0, because CheckpointConfig can express top-N by score or last-N, not both.
            checkpoint_config=CheckpointConfig(num_to_keep=tc.num_to_keep)),
    )


def _finish(cfg: Config, out_dir: str, version: str, problems: dict[str, str], split: dict, gen_version: str) -> dict:
    record = checkpoints.latest_record(out_dir, storage.join(out_dir, "best"))
    storage.set_latest(cfg.run.run_dir, "train", version, **record)
    records = _read_metrics(out_dir)
    for rec in records:
        if rec["kind"] == "validation":
            log("train", "epoch_summary", **{k: v for k, v in rec.items() if k not in ("kind", "time")})
    summary = {"version": version, "generate_version": gen_version, "num_train": split["num_train"],
               "num_val": len(split["val_ids"]), "num_bad_samples": len(problems), "bad_samples": problems,
               "best": record["best"], "last": record["last"]}
    storage.write_json_atomic(storage.join(out_dir, "summary.json"), summary)
    storage.write_json_atomic(storage.join(out_dir, "provenance.json"),
                              storage.provenance(cfg.to_dict(), input_fingerprint=gen_version))
    storage.mark_complete(out_dir, summary)
    return summary


def _read_metrics(out_dir: str) -> list[dict]:
    import json

    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run(cfg: Config) -> dict:
    """Train the drafter on the latest generate output; returns the stage summary."""
    if cfg.train.source == "online":  # the capture pipeline is the dataset (eagle3_ray/online.py)
        from eagle3_ray import online

        return online.run(cfg)
    from eagle3_ray.raycluster import ensure_ray

    ensure_ray(cfg.run)
    gen = storage.latest(cfg.run.run_dir, "generate")
    gen_dir, gen_version = gen["path"], gen["version"]
    version = train_version(cfg, gen_version)
    out_dir = storage.stage_dir(cfg.run.run_dir, "train", version)
    if storage.is_complete(out_dir):
        log("train", "already_complete", version=version, path=out_dir)
        return storage.read_json(storage.join(out_dir, "summary.json"))
    capture = storage.read_json(storage.join(gen_dir, "capture.json"))
    refs, problems = prepare_samples(gen_dir, capture, cfg)
    storage.makedirs(out_dir)
    split = _write_split_and_vocab(out_dir, refs, cfg, capture)
    log("train", "start", version=version, num_train=split["num_train"], num_val=len(split["val_ids"]),
        num_bad_samples=len(problems), workers=cfg.train.num_workers, epochs=cfg.train.epochs)
    loop_config = {"cfg": cfg.to_dict(), "out_dir": out_dir, "gen_dir": gen_dir, "capture": capture,
                   "skip_ids": sorted(problems), "val_ids": split["val_ids"]}
    result = _trainer(cfg, out_dir, version, loop_config).fit()
    if result.error is not None:
        raise result.error
    return _finish(cfg, out_dir, version, problems, split, gen_version)
