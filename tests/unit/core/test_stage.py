"""The stage skeleton on a temp dir (no Ray, no vLLM): a finished version is skipped, an unfinished one resumed, and
LATEST points at the version the config determines (the real stages: tests/e2e/test_stage.py)."""

from __future__ import annotations

import json

import pytest

from eagle3_ray.core import stage, storage
from tests.support.configs import run_cfg

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("as_uri", [False, True], ids=["path", "file-uri"])
def test_a_finished_version_is_skipped_and_latest_points_back_at_it(tmp_path, capsys, as_uri):
    cfg = run_cfg(tmp_path, f"file://{tmp_path}" if as_uri else None)
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
    cfg = run_cfg(tmp_path)

    def broken(out: str) -> dict:
        storage.write_json_atomic(storage.join(out, "partial.json"), {})
        raise RuntimeError("engine died")

    with pytest.raises(RuntimeError, match="engine died"):
        stage.run(cfg, "ingest", "va", broken)
    assert not storage.is_complete(storage.stage_dir(cfg.run.run_dir, "ingest", "va"))
    assert not storage.exists(storage.join(cfg.run.run_dir, "ingest", "LATEST.json"))


def test_downstream_versions_follow_the_config_all_the_way_down(tmp_path):
    a = run_cfg(tmp_path, generate={"max_tokens": 16})
    b = run_cfg(tmp_path, generate={"max_tokens": 24})
    faster = run_cfg(tmp_path, generate={"max_tokens": 16, "num_replicas": 4}, train={"max_failures": 9})
    assert stage.version(a, "ingest") == stage.version(b, "ingest")
    for name in ("generate", "train", "export", "evaluate"):
        assert stage.version(a, name) != stage.version(b, name), name
        assert stage.version(a, name) == stage.version(faster, name), f"{name}: operational fields changed it"


def test_reading_an_upstream_that_this_config_never_ran_names_the_version_and_latest(tmp_path):
    a = run_cfg(tmp_path, generate={"max_tokens": 16})
    b = run_cfg(tmp_path, generate={"max_tokens": 24})
    stage.run(b, "generate", stage.version(b, "generate"), lambda out: {})
    with pytest.raises(
        FileNotFoundError,
        match=rf"no finished 'generate' output for this config: .*"
        rf"{stage.version(a, 'generate')}.*LATEST.json names version "
        rf"{stage.version(b, 'generate')}",
    ):
        stage.input_dir(a, "generate")


def test_the_train_and_evaluate_stages_import_without_ray_or_vllm():
    """train/stage.py and evaluate/stage.py import Ray, and the modules that import it (core/raycluster.py,
    train/online.py, train/worker.py), inside the functions that start training or engines: a caller that only
    checks data or prompts must not import Ray, which fixes its auth settings from the environment when first
    imported. Moving one of those imports to the top of its module fails here."""
    import subprocess
    import sys

    from tests.support import REPO

    code = (
        "import sys, eagle3_ray.train.stage, eagle3_ray.evaluate.stage, eagle3_ray.train.export; "
        "print(sorted(m for m in ('ray', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]", out.stdout
