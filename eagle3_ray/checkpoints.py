"""Training checkpoints: what one epoch's directory holds, how it is restored, and which ones the run keeps.

A checkpoint directory (docs/stages.md, train):
    config.json          speculators Eagle3 config (verifier path and aux layer ids recorded)
    model.safetensors    trainable weights + d2t/t2d; no embed_tokens, verifier_lm_head, verifier_norm
    optimizer.pt         AdamW state (torch.save of tensors and numbers: loads with weights_only=True)
    scheduler.pt         LR scheduler state
    train_state.json     epoch, global step, RNG states, metrics
    capture.json         the generate stage's capture contract

`Eagle3DraftModel.from_pretrained(dir)` loads such a directory as it is (the missing frozen tensors are in the
model's `_keys_to_ignore_on_load_missing`; verifier head and norm are refilled from the verifier named in
config.json), but speculators 0.9.0 leaves `embed_tokens` uninitialized (torch.empty) rather than NaN, so its refill-if-NaN
check skips it: `load_drafter` below calls from_pretrained and then refills the embeddings from the verifier. Retention: Ray keeps the last N directories (CheckpointConfig(num_to_keep=N), ordered by report time);
the best one by the validation metric is also copied, weights and config only, to `best/` (complete or absent).
"""

from __future__ import annotations

import base64
import json
import os
import pickle  # only for RNG states we created ourselves, never for data read from data paths
import random
import shutil
import tempfile
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

FROZEN_KEYS = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
WEIGHT_FILES = ("config.json", "model.safetensors", "train_state.json", "capture.json")


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


def save(directory: str, model, optimizer, scheduler, train_state: dict[str, Any], capture: dict[str, Any]) -> None:
    """Write a complete checkpoint into `directory` (a fresh local temp dir that Ray then persists)."""
    model.save_pretrained(directory, state_dict=trainable_state_dict(model), safe_serialization=True)
    torch.save(optimizer.state_dict(), os.path.join(directory, "optimizer.pt"))
    torch.save(scheduler.state_dict(), os.path.join(directory, "scheduler.pt"))
    with open(os.path.join(directory, "capture.json"), "w") as f:
        json.dump(capture, f, indent=2)
    # train_state.json last: a reader that finds it knows the rest is there
    with open(os.path.join(directory, "train_state.json"), "w") as f:
        json.dump({**train_state, "rng": rng_state()}, f, indent=2)


def restore(directory: str, model, optimizer, scheduler) -> dict[str, Any]:
    """Load trainable weights, optimizer, scheduler and RNG from a checkpoint; returns its train_state."""
    state = load_file(os.path.join(directory, "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - set(FROZEN_KEYS):
        raise ValueError(f"checkpoint {directory} does not match the model: missing={missing} unexpected={unexpected}")
    optimizer.load_state_dict(torch.load(os.path.join(directory, "optimizer.pt"), weights_only=True))
    scheduler.load_state_dict(torch.load(os.path.join(directory, "scheduler.pt"), weights_only=True))
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
    """Replace `best_dir` with the weights, config and state of a checkpoint: staged next to it, then renamed."""
    parent = os.path.dirname(best_dir.rstrip("/"))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".best-", dir=parent)
    for name in WEIGHT_FILES:
        shutil.copy2(os.path.join(checkpoint_dir, name), os.path.join(staging, name))
    old = f"{best_dir.rstrip('/')}.old"
    if os.path.exists(best_dir):
        os.replace(best_dir, old)
    os.replace(staging, best_dir)
    shutil.rmtree(old, ignore_errors=True)


def kept_checkpoints(train_dir: str) -> list[dict[str, Any]]:
    """Every complete epoch checkpoint under a Ray Train run dir, oldest first, with its train_state."""
    kept = []
    for name in sorted(os.listdir(train_dir)) if os.path.isdir(train_dir) else []:
        path = os.path.join(train_dir, name)
        state_path = os.path.join(path, "train_state.json")
        if name.startswith("epoch_") and os.path.exists(state_path):
            with open(state_path) as f:
                state = json.load(f)
            kept.append({"path": path, "epoch": state["epoch"], "metrics": state["metrics"]})
    return kept


def latest_record(train_dir: str, best_dir: str) -> dict[str, Any]:
    """The content of train/LATEST.json: best, last and every kept checkpoint with its metrics."""
    kept = kept_checkpoints(train_dir)
    best = None
    if os.path.exists(os.path.join(best_dir, "train_state.json")):
        with open(os.path.join(best_dir, "train_state.json")) as f:
            state = json.load(f)
        best = {"path": best_dir, "epoch": state["epoch"], "metrics": state["metrics"]}
    return {"best": best, "last": kept[-1] if kept else None, "checkpoints": kept}
