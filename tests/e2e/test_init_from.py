"""train.init_from end to end: a run started from an exported drafter against a cold start on the same data (real
Ray Train, 2 workers), and drafters that cannot start the run refused by the real entry point before Ray starts or
anything is generated, on the tiny Llama and on SmolLM2-135M."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from eagle3_ray.core import storage
from eagle3_ray.core.config import UserError, config_from_dict
from eagle3_ray.train import export, init_from
from eagle3_ray.train import stage as train
from eagle3_ray.train.worker import FAULT_INJECTION_ENV
from tests.support import REPO
from tests.support.drafters import attach, cached_run
from tests.support.generate_output import point_generate_at, shared_generate_output
from tests.support.initial_drafters import untrained_drafter_dir

pytestmark = pytest.mark.e2e

AUX = [1, 3, 4]  # the tiny recipe's and the test runs' aux layers


@pytest.fixture(scope="module")
def exported_drafter(tmp_path_factory, tiny_llama) -> str:
    """The speculators dir the export stage writes for a drafter trained cold (the run test_export.py exports)."""
    run_dir = cached_run(tmp_path_factory, tiny_llama, "trained", num_steps=60, num_epochs=2)
    cfg = config_from_dict(
        {
            "run": {"storage_path": str(run_dir.parent), "name": run_dir.name},
            "verifier": {"path": tiny_llama, "max_model_len": 512},
        }
    )
    return export.run(attach(cfg))["speculators_dir"]


def _train_cfg(storage_path, name: str, verifier: str, **train_fields):
    section = {
        "num_workers": 2,
        "epochs": 1,
        "total_seq_len": 256,
        "lr": 0.001,
        "warmup_steps": 2,
        "log_every_steps": 2,
        "draft_vocab_size": 512,  # the exported drafter's is 1024: its head rows are remapped
        "num_loader_workers": 1,
        **train_fields,
    }
    return config_from_dict(
        {
            "run": {"storage_path": str(storage_path), "name": name},
            "verifier": {"path": verifier, "aux_layer_ids": AUX},
            "train": section,
        }
    )


def _records(out_dir: str, kind: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def test_a_warm_start_validates_better_after_its_first_epoch_than_a_cold_start_and_resumes_from_its_own_checkpoint(
    ray_session, tmp_path_factory, tiny_llama, exported_drafter, tmp_path, monkeypatch, capfd
):
    """The warm run's worker is SIGKILLed in epoch 1 (a real kill: Ray Train restarts the workers): the restarted
    workers restore epoch 0's checkpoint, and the initial drafter was loaded once, before epoch 0 only."""
    gen_dir = shared_generate_output(tmp_path_factory, tiny_llama, num_samples=40, max_new_tokens=40)
    runs = {}
    for name, fields in (("cold", {}), ("warm", {"init_from": exported_drafter, "epochs": 2, "max_failures": 1})):
        cfg = _train_cfg(tmp_path, name, tiny_llama, **fields)
        point_generate_at(cfg, gen_dir)
        if name == "warm":
            monkeypatch.setenv(FAULT_INJECTION_ENV, "1,1")
        summary = train.run(cfg)
        runs[name] = (summary, storage.stage_dir(cfg.run.run_dir, "train", summary["version"]))
    first_val = {name: _records(out_dir, "validation")[0] for name, (_, out_dir) in runs.items()}
    # validation loss, the objective both runs minimise; first-position accuracy over these 7 validation samples
    # moves by more than the gap between the runs with whichever drafter the session trained first (60 or 100 steps)
    assert first_val["warm"]["val_loss"] < 0.8 * first_val["cold"]["val_loss"], first_val

    summary, out_dir = runs["warm"]
    assert os.path.exists(os.path.join(out_dir, "_fault_injected"))
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        starts = [r for r in map(json.loads, f) if r["kind"] in ("started_from", "resumed")]
    assert [r["kind"] for r in starts] == ["started_from", "resumed"], starts
    assert (starts[1]["from_epoch"], starts[1]["next_epoch"]) == (0, 1)
    assert [r["epoch"] for r in _records(out_dir, "validation")] == [0, 1]

    # the draft vocabularies differ (1024 tokens of other prompts, 512 of these): adapted, logged and recorded
    weights = open(os.path.join(exported_drafter, "model.safetensors"), "rb").read()
    record = summary["init_from"]
    assert record["path"] == exported_drafter and record["sha256"] == hashlib.sha256(weights).hexdigest()
    rows = record["draft_vocab"]
    assert rows["drafter"] == 1024 and rows["run"] == 512
    assert rows["rows_from_drafter"] > 0 and rows["rows_from_drafter"] + rows["new_rows"] == 512
    assert [r["rows_from_drafter"] for r in _records(out_dir, "started_from")] == [rows["rows_from_drafter"]]
    out = capfd.readouterr().out
    assert "init_from_checked" in out and f"rows_from_drafter={rows['rows_from_drafter']}" in out
    provenance = storage.read_json(storage.join(out_dir, "provenance.json"))
    assert provenance["inputs"]["init_from"] == exported_drafter


def _pipeline(tmp_path, env, *overrides) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "ray_jobs/pipeline.py", "ray_jobs/configs/tiny_cpu.yaml", f"run.storage_path={tmp_path}"]
        + list(overrides),
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


@pytest.mark.parametrize(
    ("changes", "layer_changes", "drafter_side", "run_side"),
    [
        ({}, {"hidden_size": 512}, "hidden_size=512", "hidden_size=256"),
        ({}, {"vocab_size": 8192}, "vocab_size=8192", "vocab_size=4096"),
        ({"eagle_aux_hidden_state_layer_ids": [2, 3, 4]}, {}, "ids=[2, 3, 4]", "verifier.aux_layer_ids=[1, 3, 4]"),
        ({"norm_output": False}, {}, "norm_output=False", "norm_output=True"),
        ({}, {"num_hidden_layers": 2}, "num_hidden_layers=2", "train.num_draft_layers=1"),
    ],
    ids=["hidden_size", "verifier_vocab", "aux_layer_ids", "drafter_flag", "draft_layers"],
)
def test_a_drafter_that_cannot_start_the_run_ends_the_pipeline_before_anything_is_generated(
    tiny_llama, tmp_path, _isolated_env, changes, layer_changes, drafter_side, run_side
):
    drafter = untrained_drafter_dir(
        tiny_llama, tmp_path / "drafter", aux_layer_ids=AUX, changes=changes, layer_changes=layer_changes
    )
    runs = tmp_path / "runs"
    proc = _pipeline(runs, _isolated_env, f"verifier.path={tiny_llama}", f"train.init_from={drafter}")
    line = _one_error_line(proc)
    assert f"train.init_from ({drafter}/config.json)" in line and drafter_side in line and run_side in line
    assert not runs.exists()  # nothing ingested, generated or trained; Ray never started


def test_smollm2_refuses_a_drafter_made_for_the_tiny_verifier_and_accepts_one_made_for_it(
    tiny_llama, tmp_path, _isolated_env
):
    tiny = untrained_drafter_dir(tiny_llama, tmp_path / "tiny", aux_layer_ids=AUX)
    runs = tmp_path / "runs"
    line = _one_error_line(
        _pipeline(runs, _isolated_env, "verifier.path=smollm2-135m-instruct", f"train.init_from={tiny}")
    )
    assert "hidden_size=256 but the verifier" in line and "has hidden_size=576" in line
    assert "vocab_size=4096" in line and "vocab_size=49152" in line
    assert not runs.exists()
    cfg = config_from_dict({"run": {"storage_path": str(runs)}, "verifier": {"path": "smollm2-135m-instruct"}})
    from eagle3_ray.core import verifiers

    own = untrained_drafter_dir(verifiers.verifier_dir(cfg), tmp_path / "own", aux_layer_ids=[2, 15, 27])
    ok = config_from_dict({**cfg.to_dict(), "train": {**cfg.to_dict()["train"], "init_from": str(own)}})
    init_from.check_before_compute(ok)  # the default aux ids [2, L//2, L-3] of its 30 layers: it fits
    wrong_ids = config_from_dict({**ok.to_dict(), "verifier": {**ok.to_dict()["verifier"], "aux_layer_ids": [1, 3, 4]}})
    with pytest.raises(UserError, match=r"ids=\[2, 15, 27\] but this run captures verifier.aux_layer_ids=\[1, 3, 4\]"):
        init_from.check_before_compute(wrong_ids)
