"""A config determines the data every stage reads, on the real stages: generate with max_tokens A, then B, then A
again (skipped), then train with config A must train on A's captures; train with epochs A, then B (with Muon), then
A again (skipped), then export with A ships A's drafter."""

from __future__ import annotations

import json
import os

import pytest
import torch

from eagle3_ray.core import storage
from tests.support.configs import run_cfg

pytestmark = pytest.mark.e2e


ENGINE = {"enforce_eager": True, "kv_cache_memory_bytes": 256 << 20}


@pytest.mark.slow
def test_generate_and_train_a_then_b_then_a_again_train_on_a_captures_and_export_a_drafter(
    tmp_path, tiny_llama, ray_session
):
    from eagle3_ray.generate import stage as generate
    from eagle3_ray.ingest import stage as ingest
    from eagle3_ray.train import export
    from eagle3_ray.train import stage as train

    def cfg(max_tokens: int, epochs: int = 1, optimizer: str = "adamw"):
        return run_cfg(
            tmp_path,
            verifier={"path": tiny_llama, "aux_layer_ids": [1, 3, 4], "max_model_len": 512},
            ingest={"max_rows": 6, "num_workers": 1},
            generate={"max_tokens": max_tokens, "engine_kwargs": ENGINE},
            train={
                "num_workers": 1,
                "epochs": epochs,
                "total_seq_len": 256,
                "draft_vocab_size": 256,
                "val_fraction": 0.3,
                "log_every_steps": 1,
                "num_loader_workers": 0,
                "optimizer": optimizer,
            },
            export={"checkpoint": "last"},
        )

    a, b = cfg(8), cfg(20)
    ingest.run(a)
    gen_a, gen_b = generate.run(a), generate.run(b)
    again = generate.run(a)
    assert again["skipped"] and storage.latest(a.run.run_dir, "generate")["path"] == gen_a["path"]
    trained = train.run(a)
    provenance = storage.read_json(storage.join(trained["path"], "provenance.json"))
    assert provenance["inputs"] == {"generate": gen_a["path"]} != {"generate": gen_b["path"]}
    assert provenance["config"]["generate"]["max_tokens"] == 8
    assert trained["num_train"] + trained["num_val"] == gen_a["rows_ok"]

    # train b: two epochs with Muon + AdamW: both rates are in its metric lines, its checkpoints hold both optimizers
    second = train.run(cfg(8, epochs=2, optimizer="muon"))
    lines = [json.loads(line) for line in open(os.path.join(second["path"], "metrics.jsonl"))]
    train_lines = [r for r in lines if r["kind"] == "train"]
    assert train_lines and all({"lr", "muon_lr"} <= set(r) for r in train_lines)
    saved = torch.load(os.path.join(second["last"]["path"], "optimizer.pt"), weights_only=True)
    assert [o["class"] for o in saved] == ["Muon", "AdamW"]
    assert train.run(a)["skipped"]
    assert storage.latest(a.run.run_dir, "train")["path"] == trained["path"] != second["path"]
    exported = export.run(a)
    assert exported["checkpoint"]["epoch"] == 0 and exported["checkpoint"]["path"].startswith(trained["path"])
