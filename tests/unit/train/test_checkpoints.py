"""Checkpoint contents, restore, speculators' from_pretrained on a checkpoint as it is, and the best/ copy (no Ray)."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open
from speculators.models.eagle3 import Eagle3DraftModel

from eagle3_ray.core import storage
from eagle3_ray.core.config import config_from_dict
from eagle3_ray.train import checkpoints, vocab
from tests.support.generate_output import shared_generate_output

pytestmark = pytest.mark.unit


def _capture_and_vocab(tmp_path_factory, tiny_llama) -> tuple[str, dict, str]:
    """The session's shared capture (its dir and capture.json) and a 256-token draft vocab dir for it."""
    gen_dir = shared_generate_output(tmp_path_factory, tiny_llama, num_samples=40, max_new_tokens=40)
    capture = storage.read_json(f"{gen_dir}/capture.json")
    vocab_dir = str(tmp_path_factory.mktemp("vocab"))
    counts = vocab.count_tokens([(list(range(300)), [1] * 300)])
    vocab.save_vocab(vocab_dir, *vocab.build_vocab(counts, 256, capture["vocab_size"]), counts)
    return gen_dir, capture, vocab_dir


@pytest.fixture(scope="module")
def model_and_capture(tmp_path_factory, tiny_llama):
    from eagle3_ray.train.worker import build_model  # imports Ray: only after conftest has set its environment

    _gen_dir, capture, vocab_dir = _capture_and_vocab(tmp_path_factory, tiny_llama)
    cfg = config_from_dict({"train": {"draft_vocab_size": 256, "total_seq_len": 128}})
    model = build_model(cfg, capture, vocab_dir, torch.device("cpu"))
    return model, capture


def _save(model, capture, directory, epoch=0, metrics=None):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    state = {"epoch": epoch, "step": 5, "metrics": metrics or {"val_acc_0": 0.5}, "best": None}
    checkpoints.save(str(directory), model, [optimizer], [scheduler], state, capture)
    return optimizer, scheduler


def test_checkpoint_holds_only_trainable_state_and_the_vocab_maps(model_and_capture, tmp_path):
    model, capture = model_and_capture
    _save(model, capture, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert not keys & set(checkpoints.FROZEN_KEYS)
    assert {"d2t", "t2d", "fc.weight", "lm_head.weight"} <= keys
    assert set(os.listdir(tmp_path)) >= {
        "config.json",
        "model.safetensors",
        "optimizer.pt",
        "scheduler.pt",
        "train_state.json",
        "capture.json",
    }


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
    # speculators 0.9.0 leaves the absent embeddings uninitialized (its refill only looks for NaN: whatever the
    # allocator hands back, sometimes a freed copy of the very same weights); load_drafter refills them from the
    # verifier
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
    state = checkpoints.restore(str(tmp_path), fresh, [optimizer], [scheduler])
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


def _muon_run(tmp_path_factory, tiny_llama, **train_fields):
    """The train worker's pieces on the shared capture with train.optimizer muon: (cfg, capture, the packed batches
    of epoch 0, a function building the seeded drafter with its optimizers, schedules and step)."""
    from eagle3_ray.train import data
    from eagle3_ray.train import worker as train_worker

    gen_dir, capture, vocab_dir = _capture_and_vocab(tmp_path_factory, tiny_llama)

    def config(**more):
        return config_from_dict(
            {
                "train": {
                    "draft_vocab_size": 256,
                    "total_seq_len": 128,
                    "optimizer": "muon",
                    # torch's Muon orthogonalises each update in bf16, which CPUs without bf16 matrix units (AVX2
                    # only) run some 50x slower than fp32: two Newton-Schulz steps instead of five keep these tests
                    # in seconds there, and change nothing they check
                    "muon_ns_steps": 2,
                    "num_loader_workers": 0,
                    "epochs": 1,
                    **train_fields,
                    **more,
                }
            }
        )

    cfg = config()
    refs, _ = data.load_refs(gen_dir)
    args = train_worker.WorkerArgs(cfg=cfg.to_dict(), out_dir=gen_dir, capture=capture, val_ids=[], train_refs=refs)
    loader, _ = train_worker.make_loaders(cfg, args, rank=0, world=1, device=torch.device("cpu"))
    batches = list(loader)
    cpu = torch.device("cpu")

    def build(**more):
        """`more`: train fields of this build only (not of the loader)."""
        cfg = config(**more)
        torch.manual_seed(0)
        model = train_worker.build_model(cfg, capture, vocab_dir, cpu)
        optimizers = train_worker.make_optimizers(model, cfg.train, cpu)
        schedulers = train_worker.make_schedulers(optimizers, cfg.train.warmup_steps, len(batches))
        params = [p for p in model.parameters() if p.requires_grad]
        step = train_worker.TrainStep(
            model,
            params,
            optimizers,
            schedulers,
            train_worker.loss_kwargs(cfg),
            cpu,
            autocast=False,
            max_grad_norm=cfg.train.max_grad_norm,
        )
        return model, optimizers, schedulers, step

    return cfg, capture, batches, build


def _metrics(step, batch, ttt_steps):
    from eagle3_ray.train import worker as train_worker

    sums = train_worker.MetricSums()
    sums.add(step(batch))
    return train_worker.summarize(sums.reduce(), ttt_steps, "")


def _loss(step, batch, ttt_steps):
    return _metrics(step, batch, ttt_steps)["loss"]


def test_muon_takes_the_matrices_adamw_the_rest_and_the_loss_falls(tmp_path_factory, tiny_llama):
    cfg, _capture, batches, build = _muon_run(tmp_path_factory, tiny_llama, lr=3e-3, warmup_steps=1)
    model, optimizers, schedulers, step = build()
    assert [type(o).__name__ for o in optimizers] == ["Muon", "AdamW"]
    groups = [{id(p) for g in o.param_groups for p in g["params"]} for o in optimizers]
    named = dict(model.named_parameters())
    assert id(named["fc.weight"]) in groups[0] and id(named["norm.weight"]) in groups[1]
    assert all(len(p.shape) == 2 for p in model.parameters() if id(p) in groups[0])
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert groups[0] | groups[1] == trainable and not groups[0] & groups[1]
    assert len(batches) >= 8
    losses = [_loss(step, batch, cfg.train.ttt_steps) for batch in batches]
    assert sum(losses[-3:]) / 3 < 0.9 * sum(losses[:3]) / 3, losses
    # the matrices' Muon updates do the learning: with them all but stopped only the norms move, and far less
    _model, _optimizers, _schedulers, norms_only = build(muon_lr=1e-12)
    norms_losses = [_loss(norms_only, batch, cfg.train.ttt_steps) for batch in batches]
    assert norms_losses[0] == losses[0] and sum(losses[-3:]) < 0.6 * sum(norms_losses[-3:]), (losses, norms_losses)


def test_a_muon_run_restored_from_its_checkpoint_steps_on_exactly_as_one_never_stopped(
    tmp_path_factory, tiny_llama, tmp_path
):
    cfg, capture, batches, build = _muon_run(tmp_path_factory, tiny_llama)
    half = len(batches) // 2
    whole, whole_opts, _scheds, whole_step = build()
    for batch in batches:
        _loss(whole_step, batch, cfg.train.ttt_steps)

    first, first_opts, first_scheds, first_step = build()
    for batch in batches[:half]:
        _loss(first_step, batch, cfg.train.ttt_steps)
    checkpoints.save(
        str(tmp_path), first, first_opts, first_scheds, {"epoch": 0, "step": half, "metrics": {}, "best": None}, capture
    )
    resumed, resumed_opts, resumed_scheds, resumed_step = build()
    checkpoints.restore(str(tmp_path), resumed, resumed_opts, resumed_scheds)
    assert [s.last_epoch for s in resumed_scheds] == [half, half]
    for batch in batches[half:]:
        _loss(resumed_step, batch, cfg.train.ttt_steps)
    for (name, got), want in zip(resumed.named_parameters(), whole.parameters(), strict=True):
        assert torch.equal(got, want), name
    for got, want in zip(resumed_opts, whole_opts, strict=True):
        assert got.param_groups[0]["lr"] == want.param_groups[0]["lr"]

    from eagle3_ray.train import worker as train_worker

    adamw_only = train_worker.make_optimizers(resumed, config_from_dict({}).train, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"optimizers \['Muon', 'AdamW'\], this run builds \['AdamW'\]"):
        checkpoints.restore(str(tmp_path), resumed, adamw_only, [])


def test_train_loss_picks_speculators_loss_and_the_lk_loss_trains_the_drafter(tmp_path_factory, tiny_llama):
    cfg, _capture, batches, build = _muon_run(tmp_path_factory, tiny_llama, lr=3e-3, warmup_steps=1)
    _model, _optimizers, _schedulers, kl_step = build()
    _model, _optimizers, _schedulers, lk_step = build(loss="lk_hybrid")
    kl = [_metrics(kl_step, batch, cfg.train.ttt_steps) for batch in batches]
    lk = [_metrics(lk_step, batch, cfg.train.ttt_steps) for batch in batches]
    # the same seeded drafter and first batch: the same accuracy, another loss
    assert lk[0]["acc_0"] == kl[0]["acc_0"] and 0 < lk[0]["loss"] != kl[0]["loss"], (lk[0], kl[0])
    # trained on it, the drafter's loss falls and its acceptance estimate rises
    assert sum(m["loss"] for m in lk[-3:]) < 0.95 * sum(m["loss"] for m in lk[:3]), [m["loss"] for m in lk]
    first, last = (sum(m["acceptance_length"] for m in part) / 3 for part in (lk[:3], lk[-3:]))
    assert last > first, [m["acceptance_length"] for m in lk]


def test_train_loss_that_speculators_does_not_know_names_the_field():
    with pytest.raises(ValueError, match=r"train.loss: 'lk' is not a speculators loss"):
        config_from_dict({"train": {"loss": "lk"}})


def test_train_fc_norm_builds_one_input_norm_per_captured_layer_and_export_writes_it_where_vllm_0_24_reads_it(
    tmp_path_factory, tiny_llama
):
    from eagle3_ray.core import contract
    from eagle3_ray.train import export, init_from

    cfg, capture, batches, build = _muon_run(tmp_path_factory, tiny_llama, fc_norm=True)
    model, _optimizers, _schedulers, step = build()
    assert model.input_norm is None and len(model.fc_norm) == len(capture["aux_layer_ids"])
    before = [norm.weight.detach().clone() for norm in model.fc_norm]
    for batch in batches[:3]:
        _loss(step, batch, cfg.train.ttt_steps)
    assert all(not torch.equal(b, norm.weight) for b, norm in zip(before, model.fc_norm, strict=True))
    checkpoint_config = model.config.to_dict()
    flags = {flag: checkpoint_config[flag] for flag in contract.DRAFTER_FLAGS}
    assert flags == init_from.trained_flags(cfg.train) and flags["fc_norm"] and not flags["norm_before_fc"]
    # vLLM 0.24's speculators loader drops fc_norm from the plain layout; export's compat layout carries it
    assert "fc_norm" in contract.dropped_flags(checkpoint_config, "0.24.0")
    assert export.compat_layout(cfg, checkpoint_config, "0.24.0")
    compat = export.export_config(checkpoint_config, capture, tiny_llama, "bfloat16", vllm_compat_layout=True)
    assert contract.check_serving(compat, "0.24.0", where="d")["flags"] == flags
    assert (
        contract.check_serving(
            export.export_config(checkpoint_config, capture, tiny_llama, "bfloat16"), "0.32.0", where="d"
        )["flags"]
        == flags
    )
