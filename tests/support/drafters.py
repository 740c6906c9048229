"""Test drafters: speculators' EAGLE-3 drafter trained briefly by the library's own pieces (train/worker.py's
build_model, optimizers and TrainStep over train/data.py's packed batches) on the tiny verifier's own greedy outputs
(generate/reference.py), written as a train-stage checkpoint directory (docs/design.md: config.json,
model.safetensors with trainable weights + d2t/t2d, optimizer.pt, train_state.json, capture.json) plus a
train/LATEST.json naming it. The Ray Train loop around these pieces is tested in tests/e2e/test_train.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3_ray.generate.reference import write_reference_output

NUM_TRAIN_PROMPTS = 12
NUM_VAL_PROMPTS = 4  # generated with the others, left out of training and named in train/split.json


def train_tiny_drafter(
    verifier_dir: str,
    run_dir: Path,
    *,
    aux_layer_ids=(1, 3, 4),
    num_steps: int = 200,
    draft_vocab_size: int = 1024,
    max_new_tokens: int = 32,
    seed: int = 0,
    num_epochs: int = 1,
    train_fields: dict | None = None,
) -> Path:
    """Train a drafter for `num_steps` per epoch (0: untrained), save one checkpoint per epoch with the project's
    checkpoints.save, write train/LATEST.json; the generate output (the builtin train prompts: NUM_TRAIN_PROMPTS
    trained on, then NUM_VAL_PROMPTS held out as the validation split) is generate/LATEST. `train_fields`: more train
    config (`{"fc_norm": True}`). Returns the last checkpoint dir."""
    from eagle3_ray.core import storage
    from eagle3_ray.core.config import config_from_dict
    from eagle3_ray.core.prompts import tiny_prompts
    from eagle3_ray.ingest.formats import conversation_id
    from eagle3_ray.train import data, vocab, worker

    torch.manual_seed(seed)
    conversations = tiny_prompts(split="train", num_prompts=NUM_TRAIN_PROMPTS + NUM_VAL_PROMPTS, seed=seed)
    val_ids = sorted(conversation_id(c["messages"]) for c in conversations[NUM_TRAIN_PROMPTS:])
    gen_dir = write_reference_output(
        str(run_dir),
        verifier_dir,
        max_new_tokens=max_new_tokens,
        seed=seed,
        aux_layer_ids=list(aux_layer_ids),
        conversations=[c["messages"] for c in conversations],
    )
    capture = storage.read_json(storage.join(gen_dir, "capture.json"))
    cfg = config_from_dict(
        {
            "run": {"seed": seed},
            "verifier": {"path": verifier_dir, "aux_layer_ids": list(aux_layer_ids)},
            "train": {
                "draft_vocab_size": draft_vocab_size,
                "total_seq_len": 256,
                "optimizer": "adamw",
                "lr": 1e-3,
                "warmup_steps": 0,
                "compile": "off",
                **(train_fields or {}),
            },
        }
    )
    rows = [
        r
        for r in storage.read_parquet(storage.join(gen_dir, "conversations.parquet")).to_pylist()
        if r["id"] not in val_ids
    ]
    # an untrained drafter needs no data: its draft vocab is then simply the first ids
    counts = vocab.count_tokens((r["input_ids"], r["loss_mask"]) for r in rows) if num_steps else {}
    d2t, t2d = vocab.build_vocab(counts, draft_vocab_size, capture["vocab_size"])
    vocab_dir = str(Path(run_dir) / "vocab")
    vocab.save_vocab(vocab_dir, d2t, t2d, counts)
    device = torch.device("cpu")
    model = worker.build_model(cfg, capture, vocab_dir, device)
    optimizers = worker.make_optimizers(model, cfg.train, device)
    schedulers = worker.make_schedulers(optimizers, 0, max(1, num_steps * num_epochs))
    step = worker.TrainStep(
        model,
        [p for p in model.parameters() if p.requires_grad],
        optimizers,
        schedulers,
        worker.loss_kwargs(cfg),
        device,
        autocast=False,
        max_grad_norm=cfg.train.max_grad_norm,
    )
    refs = [r for r in data.load_refs(gen_dir)[0] if r.id not in val_ids]
    loader = data.make_loader(
        data.ShardDataset(refs, len(aux_layer_ids), dtype=torch.float32),
        total_seq_len=cfg.train.total_seq_len,
        hidden_size=capture["hidden_size"],
        world_size=1,
        rank=0,
        seed=seed,
        num_workers=0,
    )
    for epoch in range(num_epochs):
        done = 0
        while done < num_steps:  # passes over the packed batches until num_steps steps are done
            loader.batch_sampler.set_epoch(epoch * num_steps + done)
            for batch in loader:
                step(batch)
                done += 1
                if done == num_steps:
                    break
        ckpt = write_checkpoint(model, optimizers, schedulers, Path(run_dir), capture, epoch=epoch, steps=num_steps)
    split = {"val_fraction": NUM_VAL_PROMPTS / len(conversations), "num_train": len(refs), "val_ids": val_ids}
    storage.write_json_atomic(str(Path(run_dir) / "train" / "v-test" / "split.json"), split)
    return ckpt


def write_checkpoint(model, optimizers, schedulers, run_dir: Path, capture: dict, *, epoch: int, steps: int) -> Path:
    """train/v-test/epoch_N in the train stage's format (epoch 0 copied to best/), and train/LATEST.json."""
    from eagle3_ray.core import storage
    from eagle3_ray.train import checkpoints

    train_dir = run_dir / "train" / "v-test"
    ckpt = train_dir / f"epoch_{epoch}"
    ckpt.mkdir(parents=True, exist_ok=True)
    metrics = {"val_acc_0": 0.1 * (epoch + 1)}
    checkpoints.save(
        str(ckpt), model, optimizers, schedulers, {"epoch": epoch, "step": steps, "metrics": metrics}, capture
    )
    if epoch == 0:
        checkpoints.copy_best(str(ckpt), str(train_dir / "best"))
    record = checkpoints.latest_record(str(train_dir), str(train_dir / "best"))
    storage.write_json_atomic(str(train_dir / "summary.json"), {**record, "version": "v-test", "path": str(train_dir)})
    storage.mark_complete(str(train_dir), {"version": "v-test"})
    storage.set_latest(str(run_dir), "train", "v-test", record)
    return ckpt


def attach(cfg):
    """Make a stand-in run's generate/ and train/ outputs (their LATEST versions) the ones `cfg` determines: the
    version dirs `cfg` names become symlinks to them. Returns `cfg`."""
    from eagle3_ray.core import stage, storage

    for name in ("generate", "train"):
        link = Path(stage.output_dir(cfg, name))
        target = storage.latest(cfg.run.run_dir, name)["version"]
        if not link.exists():
            link.symlink_to(target, target_is_directory=True)  # relative: a copied run dir links to its own
    return cfg


def cached_run(tmp_path_factory, verifier_dir: str, name: str, **kwargs) -> Path:
    """A run dir holding a trained drafter (train/ + generate/ stand-in), built once per test session and shared by
    every test module that asks for the same `name`."""
    import json

    run_dir = tmp_path_factory.getbasetemp() / "drafter-runs" / name
    marker = run_dir / "built.json"
    if not marker.exists():
        train_tiny_drafter(verifier_dir, run_dir, **kwargs)
        marker.write_text(json.dumps(kwargs))
    return run_dir
