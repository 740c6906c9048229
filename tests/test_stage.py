"""The stage skeleton: a config determines the data every stage reads. Unit tests of stage.run on a temp dir (no Ray,
no vLLM), then the A -> B -> A case on the real stages: generate with max_tokens A, then B, then A again (skipped),
then train with config A must train on A's captures; train with epochs A, B (with Muon), A, then export with A ships A's
drafter.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from fixtures_generate import point_generate_at, shared_generate_output

from eagle3_ray.core import stage, storage
from eagle3_ray.core.config import config_from_dict


def _cfg(tmp_path, storage_path: str | None = None, **sections):
    return config_from_dict({"run": {"storage_path": storage_path or str(tmp_path), "name": "r"}, **sections})


@pytest.mark.parametrize("as_uri", [False, True], ids=["path", "file-uri"])
def test_a_finished_version_is_skipped_and_latest_points_back_at_it(tmp_path, capsys, as_uri):
    cfg = _cfg(tmp_path, f"file://{tmp_path}" if as_uri else None)
    calls = []

    def body(out: str) -> dict:
        calls.append(out)
        storage.write_json_atomic(storage.join(out, "data.json"), {"made_in": out})
        return {"rows": 3}

    first = stage.run(cfg, "ingest", "va", body)
    stage.run(cfg, "ingest", "vb", body)
    again = stage.run(cfg, "ingest", "va", body)
    assert len(calls) == 2 and again["skipped"] and again["rows"] == first["rows"] == 3
    latest = storage.latest(cfg.run.run_dir, "ingest")
    assert latest["version"] == "va" and latest["path"] == first["path"] and latest["rows"] == 3
    assert "[eagle3 ingest] already_done version=va" in capsys.readouterr().out
    for name in ("summary.json", "provenance.json", storage.SUCCESS_MARKER):
        assert storage.exists(storage.join(first["path"], name))
    assert json.loads((tmp_path / "r" / "ingest" / "va" / "data.json").read_text()) == {"made_in": first["path"]}


def test_a_failed_body_leaves_the_version_unfinished_and_latest_untouched(tmp_path):
    cfg = _cfg(tmp_path)

    def broken(out: str) -> dict:
        storage.write_json_atomic(storage.join(out, "partial.json"), {})
        raise RuntimeError("engine died")

    with pytest.raises(RuntimeError, match="engine died"):
        stage.run(cfg, "ingest", "va", broken)
    assert not storage.is_complete(storage.stage_dir(cfg.run.run_dir, "ingest", "va"))
    assert not storage.exists(storage.join(cfg.run.run_dir, "ingest", "LATEST.json"))


def test_downstream_versions_follow_the_config_all_the_way_down(tmp_path):
    a = _cfg(tmp_path, generate={"max_tokens": 16})
    b = _cfg(tmp_path, generate={"max_tokens": 24})
    faster = _cfg(tmp_path, generate={"max_tokens": 16, "num_replicas": 4}, train={"max_failures": 9})
    assert stage.version(a, "ingest") == stage.version(b, "ingest")
    for name in ("generate", "train", "export", "evaluate"):
        assert stage.version(a, name) != stage.version(b, name), name
        assert stage.version(a, name) == stage.version(faster, name), f"{name}: operational fields changed it"


def test_reading_an_upstream_that_this_config_never_ran_names_the_version_and_latest(tmp_path):
    a = _cfg(tmp_path, generate={"max_tokens": 16})
    b = _cfg(tmp_path, generate={"max_tokens": 24})
    stage.run(b, "generate", stage.version(b, "generate"), lambda out: {})
    with pytest.raises(
        FileNotFoundError,
        match=rf"no finished 'generate' output for this config: .*"
        rf"{stage.version(a, 'generate')}.*LATEST.json names version "
        rf"{stage.version(b, 'generate')}",
    ):
        stage.input_dir(a, "generate")


ENGINE = {"enforce_eager": True, "kv_cache_memory_bytes": 256 << 20}


@pytest.mark.slow
def test_generate_a_then_b_then_a_again_trains_on_a_captures(tmp_path, tiny_llama, ray_session):
    from eagle3_ray.generate import stage as generate
    from eagle3_ray.ingest import stage as ingest
    from eagle3_ray.train import stage as train

    def cfg(max_tokens: int):
        return _cfg(
            tmp_path,
            verifier={"path": tiny_llama, "aux_layer_ids": [1, 3, 4], "max_model_len": 512},
            ingest={"max_rows": 6, "num_workers": 1},
            generate={"max_tokens": max_tokens, "engine_kwargs": ENGINE},
            train={
                "num_workers": 1,
                "epochs": 1,
                "total_seq_len": 256,
                "draft_vocab_size": 256,
                "val_fraction": 0.3,
                "log_every_steps": 1,
            },
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


@pytest.mark.slow
def test_train_a_then_b_then_a_again_exports_a_drafter(tmp_path_factory, tiny_llama, ray_session):
    from eagle3_ray.train import export
    from eagle3_ray.train import stage as train

    gen_dir = shared_generate_output(tmp_path_factory, tiny_llama, num_samples=40, max_new_tokens=40)
    root = tmp_path_factory.mktemp("aba")

    def cfg(epochs: int, optimizer: str = "adamw"):
        c = _cfg(
            root,
            verifier={"path": tiny_llama, "max_model_len": 512},
            train={
                "num_workers": 1,
                "epochs": epochs,
                "total_seq_len": 256,
                "draft_vocab_size": 512,
                "log_every_steps": 5,
                "num_loader_workers": 0,
                "optimizer": optimizer,
            },
            export={"checkpoint": "last"},
        )
        point_generate_at(c, gen_dir)
        return c

    one, two = cfg(1), cfg(2, "muon")
    first, second = train.run(one), train.run(two)
    # b trains with Muon + AdamW: both rates are in its metric lines, and its checkpoints hold both optimizers
    lines = [json.loads(line) for line in open(os.path.join(second["path"], "metrics.jsonl"))]
    train_lines = [r for r in lines if r["kind"] == "train"]
    assert train_lines and all({"lr", "muon_lr"} <= set(r) for r in train_lines)
    saved = torch.load(os.path.join(second["last"]["path"], "optimizer.pt"), weights_only=True)
    assert [o["class"] for o in saved] == ["Muon", "AdamW"]
    assert train.run(one)["skipped"]
    assert storage.latest(one.run.run_dir, "train")["path"] == first["path"] != second["path"]
    exported = export.run(one)
    assert exported["checkpoint"]["epoch"] == 0 and exported["checkpoint"]["path"].startswith(first["path"])
