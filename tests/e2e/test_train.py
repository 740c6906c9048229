"""The train stage on a real local Ray with 2 training workers (DDP over gloo) and the tiny verifier's data:
learning, metrics files, retention, a SIGKILLed worker, a resubmitted job. One uninterrupted reference run is shared.
"""

from __future__ import annotations

import json
import os

import pytest
from safetensors import safe_open

from eagle3_ray.core import storage
from eagle3_ray.core.config import config_from_dict
from eagle3_ray.train import checkpoints
from eagle3_ray.train import stage as train
from eagle3_ray.train.worker import FAULT_INJECTION_ENV
from tests.support.generate_output import point_generate_at, shared_generate_output

pytestmark = pytest.mark.e2e

EPOCHS = 2


@pytest.fixture(scope="module")
def gen_dir(tmp_path_factory, tiny_llama) -> str:
    return shared_generate_output(tmp_path_factory, tiny_llama, num_samples=40, max_new_tokens=40)


def _cfg(storage_path, name: str, **train_fields):
    # best by the *largest* val loss, so that the best checkpoint (epoch 0) is not the last one (epoch 1)
    section = {
        "num_workers": 2,
        "epochs": EPOCHS,
        "total_seq_len": 256,
        "lr": 0.001,
        "warmup_steps": 2,
        "log_every_steps": 2,
        "draft_vocab_size": 512,
        "num_to_keep": 1,
        "best_metric": "val_loss",
        "best_mode": "max",
        "num_loader_workers": 1,
        **train_fields,
    }
    return config_from_dict({"run": {"storage_path": str(storage_path), "name": name}, "train": section})


def _records(out_dir: str, kind: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


@pytest.fixture(scope="module")
def reference(ray_session, gen_dir, tmp_path_factory):
    """An uninterrupted run: (cfg, summary, its train dir)."""
    root = tmp_path_factory.mktemp("runs")
    cfg = _cfg(root, "reference")
    point_generate_at(cfg, gen_dir)
    summary = train.run(cfg)
    return cfg, summary, storage.stage_dir(cfg.run.run_dir, "train", summary["version"])


def test_loss_falls_and_first_position_accuracy_rises(reference):
    _cfg_, _summary, out_dir = reference
    train_lines, val_lines = _records(out_dir, "train"), _records(out_dir, "validation")
    assert train_lines[-1]["train_loss"] < 0.5 * train_lines[0]["train_loss"]
    assert train_lines[-1]["train_acc_0"] > train_lines[0]["train_acc_0"] + 0.1
    assert val_lines[-1]["val_acc_0"] > val_lines[0]["val_acc_0"]
    assert val_lines[-1]["val_loss"] < val_lines[0]["val_loss"]


def test_metrics_lines_files_and_tensorboard_hold_the_named_fields(reference):
    _cfg_, _summary, out_dir = reference
    step_fields = {
        "epoch",
        "train_loss",
        "train_acc_0",
        "train_acc_1",
        "train_acc_2",
        "lr",
        "tokens_per_s",
        "data_wait_frac",
    }
    epoch_fields = {
        "epoch",
        "val_loss",
        "val_acc_0",
        "val_acc_2",
        "val_cond_acc_1",
        "val_acceptance_length",
        "train_loss",
        "train_bad_samples",
    }
    assert all(step_fields <= set(r) for r in _records(out_dir, "train"))
    val_lines = _records(out_dir, "validation")
    assert [r["epoch"] for r in val_lines] == list(range(EPOCHS))
    assert all(epoch_fields <= set(r) for r in val_lines)
    assert 1.0 <= val_lines[-1]["val_acceptance_length"] <= 4.0
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(os.path.join(out_dir, "tensorboard")))


def test_only_last_n_and_best_checkpoints_remain_with_only_trainable_state(reference):
    cfg, summary, out_dir = reference
    assert sorted(n for n in os.listdir(out_dir) if n.startswith("epoch_") or n == "best") == ["best", "epoch_0001"]
    latest = storage.latest(cfg.run.run_dir, "train")
    assert latest["best"]["epoch"] == 0 and latest["last"]["epoch"] == EPOCHS - 1
    assert [c["epoch"] for c in latest["checkpoints"]] == [EPOCHS - 1]
    for directory in (latest["best"]["path"], latest["last"]["path"]):
        with safe_open(os.path.join(directory, "model.safetensors"), framework="pt") as f:
            assert not set(f.keys()) & set(checkpoints.FROZEN_KEYS)
        assert checkpoints.load_drafter(directory).config.eagle_aux_hidden_state_layer_ids == [1, 3, 4]


def test_finished_run_rerun_is_a_no_op(reference, capsys):
    cfg, summary, _out = reference
    again = train.run(cfg)
    assert again.pop("skipped") and again == summary
    assert "already_done" in capsys.readouterr().out


def test_killed_worker_costs_at_most_that_epoch_and_matches_uninterrupted_run(
    reference, gen_dir, tmp_path, monkeypatch
):
    _ref_cfg, ref_summary, ref_dir = reference
    cfg = _cfg(tmp_path, "killed", max_failures=1)
    monkeypatch.setenv(FAULT_INJECTION_ENV, "1,2")
    point_generate_at(cfg, gen_dir)
    summary = train.run(cfg)
    out_dir = storage.stage_dir(cfg.run.run_dir, "train", summary["version"])
    assert os.path.exists(os.path.join(out_dir, "_fault_injected"))  # a worker really was SIGKILLed
    assert [r["epoch"] for r in _records(out_dir, "validation")] == [0, 1]  # epoch 0 never trained again
    assert [r["next_epoch"] for r in _records(out_dir, "resumed")] == [1]
    assert summary["last"]["metrics"]["val_loss"] == pytest.approx(ref_summary["last"]["metrics"]["val_loss"], rel=1e-3)
    assert summary["last"]["metrics"]["val_acc_0"] == pytest.approx(
        ref_summary["last"]["metrics"]["val_acc_0"], abs=0.02
    )


def test_resubmitted_job_resumes_at_the_next_epoch(reference, gen_dir, tmp_path, capfd, monkeypatch):
    _ref_cfg, ref_summary, _ref_dir = reference
    failing = _cfg(tmp_path, "resubmit", max_failures=0)
    point_generate_at(failing, gen_dir)
    monkeypatch.setenv(FAULT_INJECTION_ENV, "1,1")
    with pytest.raises(Exception, match="(?i)worker|died|training failed"):
        train.run(failing)
    monkeypatch.delenv(FAULT_INJECTION_ENV)
    summary = train.run(_cfg(tmp_path, "resubmit"))
    out_dir = storage.stage_dir(failing.run.run_dir, "train", summary["version"])
    assert [r["next_epoch"] for r in _records(out_dir, "resumed")] == [1]
    assert [r["epoch"] for r in _records(out_dir, "validation")] == [0, 1]
    assert summary["last"]["metrics"]["val_loss"] == pytest.approx(ref_summary["last"]["metrics"]["val_loss"], rel=1e-3)
