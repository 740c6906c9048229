"""The pipeline as users run it on a cluster: `ray job submit` to a real `ray start --head` (token auth on), watched
through the dashboard's REST API, its run dir on an S3-compatible server, stopped mid-generate and resubmitted under
the same run name, which resumes it (one run: tests/support/ray_head.py's pipeline_job)."""

from __future__ import annotations

import pytest

from eagle3_ray.core import shards, storage

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


def test_stopped_job_resumes_when_resubmitted_and_writes_every_sample_once(pipeline_job, s3_env):
    """The session's job was stopped mid-generate and resubmitted: the second run resumes, and every ingested sample
    ends up exactly once in the manifest or the rejects, each in a shard that reads back whole, with no orphan shard
    or temporary file left by the stopped run."""
    assert "[eagle3 pipeline] resumed" in pipeline_job.logs
    assert "[eagle3 pipeline] done" not in pipeline_job.stopped_logs
    generated = storage.latest(pipeline_job.run_dir, "generate")["path"]
    manifest = storage.read_parquet(storage.join(generated, "manifest.parquet")).to_pylist()
    manifest_ids = [r["id"] for r in manifest]
    conversation_ids = storage.read_parquet(storage.join(generated, "conversations.parquet"), ["id"])
    conversation_ids = conversation_ids.column(0).to_pylist()
    assert len(manifest_ids) == len(set(manifest_ids)) == len(conversation_ids) == len(set(conversation_ids))
    ingested = storage.read_parquet(
        storage.join(storage.latest(pipeline_job.run_dir, "ingest")["path"], "conversations.parquet"), ["id"]
    )
    rejected = storage.read_parquet(storage.join(generated, "rejects.parquet"), ["id"]).column(0).to_pylist()
    assert set(conversation_ids) | set(rejected) == set(ingested.column(0).to_pylist())
    shard_files = {uri.rsplit("/", 1)[1] for uri in storage.list_files(storage.join(generated, "shards"))}
    assert shard_files == {r["shard"] for r in manifest}, "orphan or missing shard"
    assert not [uri for uri in storage.list_files(generated) if ".tmp-" in uri]
    for r in manifest:
        assert shards.read_sample(storage.join(generated, "shards", r["shard"]), r["key"]).shape[0] == r["num_tokens"]
