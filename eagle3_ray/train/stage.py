"""Drafter training stage: speculators' EAGLE-3 draft model trained on the generate stage's hidden states by a Ray
Train TorchTrainer (DDP; gloo on CPU, NCCL on GPU), one checkpoint per epoch, recovery by itself.

    python ray_jobs/train.py ray_jobs/configs/tiny_cpu.yaml train.epochs=3

Reads the generate output this config determines (stage.input_dir) and writes train/{version}/: Ray Train's run dir
(epoch_NNNN checkpoints), best/, vocab/, split.json, metrics.jsonl, tensorboard/, on a local path or a URI. A
resubmitted job with the same config finds Ray's snapshot in the same dir and resumes after the last checkpoint.
`train.source=online` reads the capture stream instead of shards (online.py): the same trainer and loop.
"""

from __future__ import annotations

from eagle3_ray.core import stage, storage
from eagle3_ray.core.config import Config, UserError, versioned
from eagle3_ray.core.telemetry import log, metrics, read_jsonl
from eagle3_ray.train import checkpoints, data, init_from, vocab

# Ray is imported inside the functions that start training: importing this module (e.g. to check data) must not
# import Ray, which fixes its auth settings from the environment at import time.


def version(cfg: Config) -> str:
    if cfg.train.source == "online":
        from eagle3_ray.train import online

        return online.version(cfg)
    return storage.version_hash("train", versioned(cfg.train), cfg.run.seed, stage.version(cfg, "generate"))


def check_capture(capture: dict, manifest_layer_ids: set[tuple[int, ...]], cfg: Config, gen_dir: str) -> None:
    """The drafter's aux layers are the captured ones; any disagreement is an error before training starts."""
    layer_ids = tuple(capture["layer_ids"])
    if layer_ids != (*capture["aux_layer_ids"], capture["final_layer_id"]):
        raise ValueError(f"{gen_dir}/capture.json: layer_ids {list(layer_ids)} are not aux_layer_ids + final_layer_id")
    if cfg.verifier.aux_layer_ids is not None and list(cfg.verifier.aux_layer_ids) != capture["aux_layer_ids"]:
        raise ValueError(
            f"verifier.aux_layer_ids={cfg.verifier.aux_layer_ids} (drafter config) does not match the "
            f"captured aux layers {capture['aux_layer_ids']} in {gen_dir}/capture.json"
        )
    wrong = sorted(ids for ids in manifest_layer_ids if ids != layer_ids)
    if wrong:
        raise ValueError(
            f"{gen_dir}/manifest.parquet: layer_ids {list(wrong[0])} differ from capture.json's "
            f"{list(layer_ids)} ({len(capture['aux_layer_ids'])} aux layers + final)"
        )


def prepare_samples(gen_dir: str, capture: dict, cfg: Config) -> tuple[list[data.SampleRef], dict[str, str]]:
    """All samples that can be trained on, and {id: problem} for those that cannot (fail: raise on the first)."""
    refs, manifest = data.load_refs(gen_dir)
    check_capture(capture, {tuple(r["layer_ids"]) for r in manifest}, cfg, gen_dir)
    problems = data.check_shards(refs, len(capture["layer_ids"]), capture["hidden_size"])
    if problems and cfg.train.on_bad_sample == "fail":
        raise data.BadSampleError(f"{len(problems)} bad samples, first: {next(iter(problems.values()))}")
    for problem in problems.values():
        log("train", "bad_sample", action="skip", problem=problem)
    return [r for r in refs if r.id not in problems], problems


def check_split(num_train: int, num_val: int, cfg: Config) -> None:
    """Before Ray Train starts: every worker gets at least one training and one validation sample."""
    if num_val < cfg.train.num_workers or num_train < cfg.train.num_workers:
        raise UserError(
            f"train.val_fraction={cfg.train.val_fraction} leaves {num_train} train and {num_val} "
            f"validation samples; each of {cfg.train.num_workers} workers needs one of each"
        )


def trainer(cfg: Config, out_dir: str, args, loop_cls=None, **datasets):
    """The TorchTrainer of both sources: `args` (train_worker.WorkerArgs) reach every worker, which runs
    `loop_cls` (train_worker.Loop, or online_worker.OnlineLoop reading `datasets`, the capture stream, split over
    the workers). Ray Train's run dir is `out_dir` itself, so a resubmitted job resumes."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from eagle3_ray.train.worker import train_loop

    tc = cfg.train
    parent, name = out_dir.rstrip("/").rsplit("/", 1)
    extra = {}
    if datasets:
        from eagle3_ray.train.online import data_config

        extra = {"datasets": datasets, "dataset_config": data_config(cfg)}
    return TorchTrainer(
        train_loop,
        train_loop_config={"args": args, **({"loop_cls": loop_cls} if loop_cls else {})},
        scaling_config=ScalingConfig(
            num_workers=tc.num_workers, use_gpu=tc.use_gpu, resources_per_worker={"CPU": tc.cpus_per_worker}
        ),
        run_config=RunConfig(
            storage_path=parent,
            name=name,
            failure_config=FailureConfig(max_failures=tc.max_failures),
            # Ray keeps the last N by report order (enough to resume); the best by validation metric is copied to
            # best/ by rank 0, because CheckpointConfig can express top-N by score or last-N, not both.
            checkpoint_config=CheckpointConfig(num_to_keep=tc.num_to_keep),
        ),
        **extra,
    )


def fit(trainer_) -> None:
    result = trainer_.fit()
    if result.error is not None:
        raise result.error


def start_from(cfg: Config, out_dir: str, capture: dict, args) -> dict | None:
    """`train.init_from`'s record for the summary (path, sha256, head rows), set on the workers' `args`; None
    without it. Needs the run's draft vocabulary (out_dir/vocab)."""
    if cfg.train.init_from is None:
        return None
    d2t, _t2d = vocab.load_vocab(storage.join(out_dir, "vocab"))
    whole_vocab = cfg.train.draft_vocab_size == capture["vocab_size"]  # speculators then maps no ids
    record = init_from.record(cfg.train.init_from, None if whole_vocab else d2t, cfg.train.draft_vocab_size)
    args.init_from = {"path": record["path"], "sha256": record["sha256"]}
    return record


def finish(cfg: Config, out_dir: str, split: dict, problems: dict[str, str]) -> dict:
    """The train summary: split sizes, bad samples, and best/last/kept checkpoints with their metrics. The last
    epoch's numbers also go to Prometheus from this driver process: the workers' gauges end with their processes,
    the driver's stay up while the pipeline runs its later stages."""
    validations = [rec for rec in read_jsonl(storage.join(out_dir, "metrics.jsonl")) if rec["kind"] == "validation"]
    for rec in validations:
        log("train", "epoch_summary", **{k: v for k, v in rec.items() if k not in ("kind", "time")})
    if validations:
        tags = {"stage": "train", "run": cfg.run.name}
        last = validations[-1]
        metrics.gauge("train_epochs_done", "epochs of the finished train stage").set(last["epoch"] + 1, tags=tags)
        metrics.gauge("train_final_val_loss", "validation loss after the last epoch").set(last["val_loss"], tags=tags)
    return {
        "num_train": split["num_train"],
        "num_val": len(split["val_ids"]),
        "num_held_out": split.get("num_held_out", 0),
        "num_bad_samples": len(problems),
        "bad_samples": problems,
        **checkpoints.latest_record(out_dir, storage.join(out_dir, "best")),
    }


def run(cfg: Config) -> dict:
    """Train the drafter on the shards of the generate stage, or on the capture stream (`train.source=online`);
    returns the stage summary."""
    initial = {} if cfg.train.init_from is None else {"init_from": cfg.train.init_from}
    if cfg.train.source == "online":
        ingest_dir = stage.input_dir(cfg, "ingest")
        inputs = {"ingest": ingest_dir, **initial}
        return stage.run(cfg, "train", version(cfg), lambda out: _train_online(cfg, ingest_dir, out), inputs=inputs)
    gen_dir = stage.input_dir(cfg, "generate")
    inputs = {"generate": gen_dir, **initial}
    return stage.run(cfg, "train", version(cfg), lambda out: _train(cfg, gen_dir, out), inputs=inputs)


def _train_online(cfg: Config, ingest_dir: str, out_dir: str) -> dict:
    import ray

    from eagle3_ray.core.raycluster import ensure_ray
    from eagle3_ray.train import online
    from eagle3_ray.train.online_worker import OnlineLoop

    init_from.check_before_compute(cfg)
    ensure_ray(cfg.run)
    ensure_workers_fit(cfg)
    created_pgs: list = []
    engines: list = []
    try:
        args, dataset, split, engines = online.prepare(cfg, ingest_dir, out_dir, created_pgs)
        check_split(split["num_train"], len(split["val_ids"]), cfg)
        initial = start_from(cfg, out_dir, args.capture, args)
        with online.EngineWatch(engines):
            fit(trainer(cfg, out_dir, args, OnlineLoop, train=dataset))
    finally:
        for engine in engines:
            ray.kill(engine, no_restart=True)
        for pg in created_pgs:
            ray.util.remove_placement_group(pg)
    return {**finish(cfg, out_dir, split, {}), "init_from": initial}


def ensure_workers_fit(cfg: Config) -> float:
    """Wait (run.resource_wait_s) until the cluster can hold the whole worker group (Ray Train's PACK placement);
    one error line when it cannot."""
    from eagle3_ray.core.resources import ensure_schedulable

    tc = cfg.train
    bundles = [{"CPU": tc.cpus_per_worker, "GPU": 1 if tc.use_gpu else 0}] * tc.num_workers
    return ensure_schedulable(
        "train", bundles, "PACK", "train.num_workers, train.cpus_per_worker, train.use_gpu", cfg.run
    )


def _train(cfg: Config, gen_dir: str, out_dir: str) -> dict:
    from eagle3_ray.core.raycluster import ensure_ray
    from eagle3_ray.train.worker import WorkerArgs

    capture = storage.read_json(storage.join(gen_dir, "capture.json"))
    if cfg.train.init_from is not None:
        init_from.check(cfg, capture)  # against the data it will train on, before Ray starts
    ensure_ray(cfg.run)
    refs, problems = prepare_samples(gen_dir, capture, cfg)
    roles = [data.split_role(r.id, cfg) for r in refs]
    val = [r for r, role in zip(refs, roles, strict=True) if role == "val"]
    train_refs = [r for r, role in zip(refs, roles, strict=True) if role == "train"]
    check_split(len(train_refs), len(val), cfg)
    ensure_workers_fit(cfg)  # what the data allows first: a split error is the same on any cluster
    split = {
        "val_fraction": cfg.train.val_fraction,
        "num_train": len(train_refs),
        "num_held_out": roles.count("held_out"),
        "val_ids": sorted(r.id for r in val),
    }
    storage.write_json_atomic(storage.join(out_dir, "split.json"), split)
    vocab_dir = storage.join(out_dir, "vocab")
    if not vocab.vocab_exists(vocab_dir):
        counts = vocab.count_tokens((r.input_ids, r.loss_mask) for r in train_refs)
        vocab.save_vocab(
            vocab_dir, *vocab.build_vocab(counts, cfg.train.draft_vocab_size, capture["vocab_size"]), counts
        )
    log(
        "train",
        "plan",
        num_train=len(train_refs),
        num_val=len(val),
        num_held_out=split["num_held_out"],
        num_bad_samples=len(problems),
        workers=cfg.train.num_workers,
        epochs=cfg.train.epochs,
    )
    args = WorkerArgs(
        cfg=cfg.to_dict(),
        out_dir=out_dir,
        capture=capture,
        val_ids=split["val_ids"],
        train_refs=train_refs,
        val_refs=val,
    )
    initial = start_from(cfg, out_dir, capture, args)
    fit(trainer(cfg, out_dir, args))
    return {**finish(cfg, out_dir, split, problems), "init_from": initial}
