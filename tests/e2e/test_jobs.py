"""The pipeline as users run it on a cluster: `ray job submit` to a real `ray start --head` (token auth on), watched
through the dashboard's REST API, its run dir on an S3-compatible server; a stopped job resumes when resubmitted
under the same run name."""

from __future__ import annotations

import time

import pyarrow.parquet as pq
import pytest

pytest.register_assert_rewrite("helpers_ray_head")  # it is a plugin too; rewrite its asserts
from eagle3_ray.core import storage  # noqa: E402
from tests.support.ray_head import latest_path, pipeline_entrypoint, run_job  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_submitted_pipeline_on_an_s3_run_dir_writes_every_stage_to_the_object_store(pipeline_job, s3_env):
    """The session's pipeline job has run.storage_path=s3://... on a real S3-compatible server: shards, Ray Train's
    checkpoints, best/, metrics and the drafter all land in the bucket; nothing needs a shared local disk."""
    assert "[eagle3 pipeline] done" in pipeline_job.logs
    assert pipeline_job.info["driver_exit_code"] == 0
    run_dir = pipeline_job.run_dir
    latest = {name: storage.latest(run_dir, name) for name in ("ingest", "generate", "train", "export", "evaluate")}
    assert all(
        record["path"].startswith("s3://") and storage.is_complete(record["path"]) for record in latest.values()
    ), latest
    generated = latest["generate"]["path"]
    assert storage.list_files(storage.join(generated, "shards"), ".safetensors")
    trained = latest["train"]
    assert trained["last"]["path"].startswith(trained["path"]) and storage.exists(
        storage.join(trained["best"]["path"], "train_state.json")
    )
    metrics = storage.read_bytes(storage.join(trained["path"], "metrics.jsonl")).decode()
    assert '"kind": "validation"' in metrics and storage.list_files(storage.join(trained["path"], "tensorboard"))
    drafter = latest["export"]["speculators_dir"]
    assert storage.exists(storage.join(drafter, "config.json")) and storage.exists(
        storage.join(drafter, "model.safetensors")
    )
    assert storage.exists(storage.join(latest["evaluate"]["path"], "results.json"))


def test_every_train_worker_line_appears_once_in_the_job_log(pipeline_job):
    lines = [
        line
        for line in pipeline_job.logs.splitlines()
        if "[eagle3 train] train step=" in line or "[eagle3 train] validation step=" in line
    ]
    assert lines, "no train metric lines in the job log"
    assert len(lines) == len(set(lines)), [line for line in lines if lines.count(line) > 1][:3]


def test_rest_api_needs_the_token(ray_head, pipeline_job):
    assert ray_head.status_code("/api/jobs/eagle3-full", token="") == 401
    assert ray_head.status_code("/api/jobs/eagle3-full", token="0" * 64) == 403
    assert ray_head.job("eagle3-full")["status"] == "SUCCEEDED"


def test_dashboard_train_view_lists_the_training_run(ray_head, pipeline_job):
    runs = ray_head.get("/api/train/v2/runs/v1")  # the Train V2 runs route in Ray 2.60
    names = [run["name"] for run in runs.get("train_runs", [])]
    assert names, f"no Train runs reported (is RAY_TRAIN_ENABLE_STATE_TRACKING=1 reaching the controller?): {runs}"


def test_stopped_job_resumes_when_resubmitted_and_writes_every_sample_once(ray_head):
    storage_path = ray_head.temp_dir / "runs"
    run_dir = storage_path / "stopped"
    # One sample per generate unit (each unit commits on its own), two units in flight (the stop lands with a unit
    # half done), 48 builtin prompts with 96-token answers. The stop goes through the Jobs REST API (what
    # `ray job stop` calls) the moment the first part lands: CI once finished all 120 units in the seconds the
    # `ray job stop` CLI took to start.
    entrypoint = pipeline_entrypoint(
        storage_path,
        "stopped",
        "ingest.max_rows=48",
        "generate.max_batch_tokens=160",
        "generate.max_tokens=96",
        "generate.units_in_flight=2",
        "--stages",
        "ingest,generate",
    )
    ray_head.submit("eagle3-stop-1", *entrypoint)
    deadline = time.monotonic() + 600
    while not list(run_dir.glob("generate/*/parts/*.parquet")):
        assert time.monotonic() < deadline, ray_head.logs("eagle3-stop-1")[-4000:]
        assert ray_head.job("eagle3-stop-1")["status"] in ("PENDING", "RUNNING"), ray_head.logs("eagle3-stop-1")
        time.sleep(0.05)
    assert ray_head.post("/api/jobs/eagle3-stop-1/stop")["stopped"]
    assert ray_head.wait("eagle3-stop-1", {"STOPPED"}, timeout_s=120)["status"] == "STOPPED"
    assert not (run_dir / "generate" / "LATEST.json").exists(), "the job finished before it was stopped"

    resumed = run_job(ray_head, "eagle3-stop-2", entrypoint, run_dir)
    assert "[eagle3 pipeline] resumed" in resumed.logs
    generated = latest_path(run_dir, "generate")
    manifest_ids = pq.read_table(generated / "manifest.parquet", columns=["id"]).column(0).to_pylist()
    conversation_ids = pq.read_table(generated / "conversations.parquet", columns=["id"]).column(0).to_pylist()
    ingested = pq.read_table(latest_path(run_dir, "ingest") / "conversations.parquet", columns=["id"])
    assert len(manifest_ids) == len(set(manifest_ids)) == len(conversation_ids) == len(set(conversation_ids))
    rejected = pq.read_table(generated / "rejects.parquet", columns=["id"]).column(0).to_pylist()
    assert set(conversation_ids) | set(rejected) == set(ingested.column(0).to_pylist())
