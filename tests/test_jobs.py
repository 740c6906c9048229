"""The pipeline as users run it on a cluster: `ray job submit` to a real `ray start --head` (token auth on), watched
through the dashboard's REST API; a stopped job resumes when resubmitted under the same run name."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from helpers_ray_head import run_job

pytest_plugins = ["helpers_ray_head"]
pytestmark = pytest.mark.slow

RECIPE = "ray_jobs/configs/tiny_cpu.yaml"
# Lean: few prompts, short responses, small token budgets (several generate units), one epoch, short evaluation.
LEAN = ["ingest.max_rows=12", "generate.max_tokens=24", "generate.max_batch_tokens=256", "train.epochs=1",
        "evaluate.num_prompts=4", "evaluate.max_tokens=16", "evaluate.concurrency=[1]",
        # vLLM's default CPU memory check fails on a shared machine: a fixed KV cache, no compile.
        "evaluate.engine_kwargs={enforce_eager: true, kv_cache_memory_bytes: 268435456}"]


def pipeline_entrypoint(storage_path: Path, name: str, *extra: str) -> list[str]:
    # The venv's interpreter, not `python`: the entrypoint shell's PATH is the head's, not ours.
    return [sys.executable, "ray_jobs/pipeline.py", RECIPE, f"run.storage_path={storage_path}", f"run.name={name}",
            *LEAN, *extra]


def _latest_path(run_dir: Path, stage: str) -> Path:
    import json

    return Path(json.loads((run_dir / stage / "LATEST.json").read_text())["path"])


@pytest.fixture(scope="session")
def pipeline_job(ray_head):
    """The whole tiny pipeline, submitted once per session (the metrics tests read the same run)."""
    storage_path = ray_head.temp_dir / "runs"
    return run_job(ray_head, "eagle3-full", pipeline_entrypoint(storage_path, "full"), storage_path / "full")


def test_submitted_pipeline_succeeds_and_every_stage_finishes(pipeline_job):
    run_dir = pipeline_job.run_dir
    for stage in ("ingest", "generate", "train", "export", "evaluate"):
        assert (run_dir / stage / "LATEST.json").exists(), f"{stage} has no LATEST.json"
    assert "[eagle3 pipeline] done" in pipeline_job.logs
    assert pipeline_job.info["driver_exit_code"] == 0
    drafter = _latest_path(run_dir, "export") / "speculators"
    assert (drafter / "config.json").exists() and (drafter / "model.safetensors").exists()
    assert (_latest_path(run_dir, "evaluate") / "results.json").exists()


def test_rest_api_needs_the_token(ray_head, pipeline_job):
    assert ray_head.status_code("/api/jobs/eagle3-full", token="") == 401
    assert ray_head.status_code("/api/jobs/eagle3-full", token="0" * 64) == 401
    assert ray_head.job("eagle3-full")["status"] == "SUCCEEDED"


def test_dashboard_train_view_lists_the_training_run(ray_head, pipeline_job):
    runs = ray_head.get("/api/train/v2/runs")
    names = [run["name"] for run in runs.get("train_runs", [])]
    assert names, f"no Train runs reported (is RAY_TRAIN_ENABLE_STATE_TRACKING=1 reaching the controller?): {runs}"


def test_stopped_job_resumes_when_resubmitted_and_writes_every_sample_once(ray_head):
    storage_path = ray_head.temp_dir / "runs"
    run_dir = storage_path / "stopped"
    # One sample per generate unit (each unit commits on its own), so the stop lands between commits.
    entrypoint = pipeline_entrypoint(storage_path, "stopped", "ingest.max_rows=40", "generate.max_batch_tokens=96",
                                     "--stages", "ingest,generate")
    ray_head.submit("eagle3-stop-1", *entrypoint)
    deadline = time.monotonic() + 600
    while not list(run_dir.glob("generate/*/parts/*.parquet")):
        assert time.monotonic() < deadline, ray_head.logs("eagle3-stop-1")[-4000:]
        assert ray_head.job("eagle3-stop-1")["status"] in ("PENDING", "RUNNING"), ray_head.logs("eagle3-stop-1")
        time.sleep(0.5)
    ray_head.ray_cli("job", "stop", "--address", ray_head.address, "eagle3-stop-1")
    assert ray_head.wait("eagle3-stop-1", {"STOPPED"}, timeout_s=120)["status"] == "STOPPED"
    assert not (run_dir / "generate" / "LATEST.json").exists(), "the job finished before it was stopped"

    resumed = run_job(ray_head, "eagle3-stop-2", entrypoint, run_dir)
    assert "[eagle3 pipeline] resumed" in resumed.logs
    generated = _latest_path(run_dir, "generate")
    manifest_ids = pq.read_table(generated / "manifest.parquet", columns=["id"]).column(0).to_pylist()
    conversation_ids = pq.read_table(generated / "conversations.parquet", columns=["id"]).column(0).to_pylist()
    ingested = pq.read_table(_latest_path(run_dir, "ingest") / "conversations.parquet", columns=["id"])
    assert len(manifest_ids) == len(set(manifest_ids)) == len(conversation_ids) == len(set(conversation_ids))
    rejected = pq.read_table(generated / "rejects.parquet", columns=["id"]).column(0).to_pylist()
    assert set(conversation_ids) | set(rejected) == set(ingested.column(0).to_pylist())
