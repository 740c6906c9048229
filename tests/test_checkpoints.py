"""Checkpoint contents, restore, speculators' from_pretrained on a checkpoint as it is, and the best/ copy (no Ray)."""

from __future__ import annotations

import os

import pytest
import torch
from fixtures_generate import shared_generate_output
from safetensors import safe_open

from eagle3_ray import checkpoints, storage, vocab
from eagle3_ray.config import config_from_dict
from speculators.models.eagle3 import Eagle3DraftModel


@pytest.fixture(scope="module")
def model_and_capture(tmp_path_factory, tiny_llama):
    from eagle3_ray.train_worker import build_model  # imports Ray: only after conftest has set its environment

    gen_dir = shared_generate_output(tmp_path_factory, tiny_llama, num_samples=40, max_new_tokens=40)
    capture = storage.read_json(f"{gen_dir}/capture.json")
    vocab_dir = str(tmp_path_factory.mktemp("vocab"))
    counts = vocab.count_tokens([(list(range(300)), [1] * 300)])
    d2t, t2d = vocab.build_vocab(counts, 256, capture["vocab_size"])
    vocab.save_vocab(vocab_dir, d2t, t2d, counts)
    cfg = config_from_dict({"train": {"draft_vocab_size": 256, "total_seq_len": 128}})
    model = build_model(cfg, capture, vocab_dir, torch.device("cpu"))
    return model, capture


def _save(model, capture, directory, epoch=0, metrics=None):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    state = {"epoch": epoch, "step": 5, "metrics": metrics or {"val_acc_0": 0.5}, "best": None}
    checkpoints.save(str(directory), model, optimizer, scheduler, state, capture)
    return optimizer, scheduler


def test_checkpoint_holds_only_trainable_state_and_the_vocab_maps(model_and_capture, tmp_path):
    model, capture = model_and_capture
    _save(model, capture, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert not keys & set(checkpoints.FROZEN_KEYS)
    assert {"d2t", "t2d", "fc.weight", "lm_head.weight"} <= keys
    assert set(os.listdir(tmp_path)) >= {"config.json", "model.safetensors", "optimizer.pt", "scheduler.pt",
                                         "train_state.json", "capture.json"}


def test_checkpoint_loads_in_speculators_from_pretrained_as_it_is(model_and_capture, tmp_path):
    model, capture = model_and_capture
    with torch.no_grad():
        model.fc.weight.add_(0.25)  # something a fresh model could not have
    _save(model, capture, tmp_path)
    loaded = Eagle3DraftModel.from_pretrained(str(tmp_path))
    for name, tensor in checkpoints.trainable_state_dict(model).items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    # the verifier head and norm come back from the verifier named in config.json, not from the checkpoint
    assert torch.equal(loaded.verifier_lm_head.weight, model.verifier_lm_head.weight)
    assert loaded.config.eagle_aux_hidden_state_layer_ids == capture["aux_layer_ids"]
    # speculators 0.9.0 leaves the absent embeddings uninitialized (its refill only looks for NaN); load_drafter
    # refills them from the verifier
    assert not torch.equal(loaded.embed_tokens.weight, model.embed_tokens.weight)
    assert torch.equal(checkpoints.load_drafter(str(tmp_path)).embed_tokens.weight, model.embed_tokens.weight)


def test_restore_brings_back_weights_optimizer_scheduler_and_rng(model_and_capture, tmp_path):
    model, capture = model_and_capture
    torch.manual_seed(123)
    _save(model, capture, tmp_path, epoch=4)
    expected_draw = torch.rand(3)
    fresh = checkpoints.load_drafter(str(tmp_path))
    with torch.no_grad():
        fresh.fc.weight.zero_()
    optimizer = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    state = checkpoints.restore(str(tmp_path), fresh, optimizer, scheduler)
    assert state["epoch"] == 4 and state["step"] == 5
    assert torch.equal(fresh.fc.weight, model.fc.weight)
    assert torch.equal(torch.rand(3), expected_draw)


def test_best_copy_is_replaced_whole_and_named_in_the_latest_record(model_and_capture, tmp_path):
    model, capture = model_and_capture
    for epoch in (0, 1):
        _save(model, capture, tmp_path / f"epoch_{epoch:04d}", epoch=epoch, metrics={"val_acc_0": 0.1 * epoch})
    checkpoints.copy_best(str(tmp_path / "epoch_0000"), str(tmp_path / "best"))
    checkpoints.copy_best(str(tmp_path / "epoch_0001"), str(tmp_path / "best"))
    record = checkpoints.latest_record(str(tmp_path), str(tmp_path / "best"))
    assert record["best"]["epoch"] == 1 and record["last"]["epoch"] == 1
    assert [c["epoch"] for c in record["checkpoints"]] == [0, 1]
    assert not (tmp_path / "best" / "optimizer.pt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "epoch_0000", "epoch_0001"]
