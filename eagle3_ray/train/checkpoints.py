"""Training checkpoints: what one epoch's directory holds, how it is restored, and which ones the run keeps.

A checkpoint directory (docs/design.md, train, what it writes):
    config.json          speculators Eagle3 config (verifier path and aux layer ids recorded)
    model.safetensors    trainable weights + d2t/t2d; no embed_tokens, verifier_lm_head, verifier_norm
    optimizer.pt         each optimizer's class name and state, in train.optimizer's order (AdamW; or Muon, AdamW):
                         torch.save of tensors, numbers and strings, so it loads with weights_only=True
    scheduler.pt         the LR schedule of each optimizer, in the same order
    train_state.json     epoch, global step, RNG states, metrics
    capture.json         the generate stage's capture contract

`Eagle3DraftModel.from_pretrained(dir)` loads such a directory as it is (the missing frozen tensors are in the
model's `_keys_to_ignore_on_load_missing`; verifier head and norm are refilled from the verifier named in
config.json), but speculators 0.9.0 leaves `embed_tokens` uninitialized (torch.empty) rather than NaN, so its
refill-if-NaN check skips it: `load_drafter` below calls from_pretrained and then refills the embeddings from the
verifier. Retention: Ray keeps the last N directories (CheckpointConfig(num_to_keep=N), ordered by report time);
the best one by the validation metric is also copied, weights and config only, to `best/` (complete when its
train_state.json exists). Run dirs may be local paths or URIs (storage.py).
"""

from __future__ import annotations

import base64
import json
import os
import pickle  # only for RNG states we created ourselves, never for data read from data paths
import random
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from eagle3_ray.core import storage

FROZEN_KEYS = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
WEIGHT_FILES = ("train_state.json", "config.json", "model.safetensors", "capture.json")


def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state without what the verifier already has (frozen embeddings, verifier head and norm)."""
    return {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if k not in FROZEN_KEYS}


def rng_state() -> dict[str, str]:
    states = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    return {k: base64.b64encode(pickle.dumps(v)).decode() for k, v in states.items()}


def set_rng_state(encoded: dict[str, str]) -> None:
    states = {k: pickle.loads(base64.b64decode(v)) for k, v in encoded.items()}  # noqa: S301 (our own file)
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])


def save(
    directory: str, model, optimizers: list, schedulers: list, train_state: dict[str, Any], capture: dict[str, Any]
) -> None:
    """Write a complete checkpoint into `directory` (a fresh local temp dir that Ray then persists)."""
    model.save_pretrained(directory, state_dict=trainable_state_dict(model), safe_serialization=True)
    torch.save(
        [{"class": type(opt).__name__, "state": opt.state_dict()} for opt in optimizers],
        os.path.join(directory, "optimizer.pt"),
    )
    torch.save([scheduler.state_dict() for scheduler in schedulers], os.path.join(directory, "scheduler.pt"))
    with open(os.path.join(directory, "capture.json"), "w") as f:
        json.dump(capture, f, indent=2)
    # train_state.json last: a reader that finds it knows the rest is there
    with open(os.path.join(directory, "train_state.json"), "w") as f:
        json.dump({**train_state, "rng": rng_state()}, f, indent=2)


def restore(directory: str, model, optimizers: list, schedulers: list) -> dict[str, Any]:
    """Load trainable weights, each optimizer and schedule, and RNG from a checkpoint; returns its train_state."""
    state = load_file(os.path.join(directory, "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - set(FROZEN_KEYS):
        raise ValueError(f"checkpoint {directory} does not match the model: missing={missing} unexpected={unexpected}")
    saved = torch.load(os.path.join(directory, "optimizer.pt"), weights_only=True)
    saved_classes, classes = [s["class"] for s in saved], [type(opt).__name__ for opt in optimizers]
    if saved_classes != classes:
        raise ValueError(
            f"checkpoint {directory} holds the state of optimizers {saved_classes}, this run builds "
            f"{classes} (train.optimizer)"
        )
    for opt, opt_state in zip(optimizers, saved, strict=True):
        opt.load_state_dict(opt_state["state"])
    for scheduler, scheduler_state in zip(
        schedulers, torch.load(os.path.join(directory, "scheduler.pt"), weights_only=True), strict=True
    ):
        scheduler.load_state_dict(scheduler_state)
    with open(os.path.join(directory, "train_state.json")) as f:
        train_state = json.load(f)
    set_rng_state(train_state["rng"])
    return train_state


def load_drafter(directory: str):
    """A checkpoint (or best/) as a ready Eagle3DraftModel: speculators' from_pretrained plus the verifier's
    embeddings, which the checkpoint deliberately does not carry."""
    from speculators.models.eagle3 import Eagle3DraftModel

    model = Eagle3DraftModel.from_pretrained(directory)
    model._load_verifier_weights(overwrite_embed_tokens=True)  # noqa: SLF001 (speculators' own refill path)
    return model


def is_better(value: float, best: float | None, mode: str) -> bool:
    if best is None:
        return True
    return value > best if mode == "max" else value < best


def copy_best(checkpoint_dir: str, best_dir: str) -> None:
    """Replace `best_dir` (any storage) with the weights, config and state of a checkpoint. Object stores have no
    atomic directory rename, so `train_state.json` marks a complete copy: removed first, written last."""
    storage.delete(storage.join(best_dir, "train_state.json"))
    for name in WEIGHT_FILES[::-1]:  # train_state.json is first in WEIGHT_FILES: copied last
        storage.copy_file(storage.join(checkpoint_dir, name), storage.join(best_dir, name))


def _record(directory: str) -> dict[str, Any] | None:
    """{path, epoch, metrics} of a complete checkpoint directory, None when it is incomplete or absent."""
    state_uri = storage.join(directory, "train_state.json")
    if not storage.exists(state_uri):
        return None
    state = storage.read_json(state_uri)
    return {"path": directory, "epoch": state["epoch"], "metrics": state["metrics"]}


def kept_checkpoints(train_dir: str) -> list[dict[str, Any]]:
    """Every complete epoch checkpoint under a Ray Train run dir (any storage), oldest first."""
    records = [
        _record(storage.join(train_dir, name)) for name in storage.list_dirs(train_dir) if name.startswith("epoch_")
    ]
    return [r for r in records if r is not None]


def latest_record(train_dir: str, best_dir: str) -> dict[str, Any]:
    """best, last and every kept checkpoint with its metrics (in the train summary and train/LATEST.json)."""
    kept = kept_checkpoints(train_dir)
    return {"best": _record(best_dir), "last": kept[-1] if kept else None, "checkpoints": kept}
