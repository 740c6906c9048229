"""The pipeline as users run it on a cluster: `ray job submit` to the autoscaling bed made from cluster.yaml (token
auth on, worker nodes that start from zero), watched through the dashboard's REST API, its run dir on an
S3-compatible server, stopped mid-generate and resubmitted under the same run name, which resumes it, and in that job
a worker node lost mid-generate and another mid-train (one run, in the background from the session's start:
tests/support/bed_jobs.py), whose training then validates like the same training run uninterrupted on a copy of its
data (uninterrupted_train)."""

from __future__ import annotations

import json
import re

import psutil
import pytest

from eagle3_ray.core import shards, storage
from eagle3_ray.core.telemetry import read_jsonl
from tests.support.pipeline_job import STOPPABLE, pipeline_entrypoint

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.NoSuchProcess:  # a worker that finished meanwhile
        return []


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


def test_rest_api_needs_the_token(autoscaling_cluster, pipeline_job):
    head = autoscaling_cluster.head
    assert head.status_code("/api/jobs/eagle3-full", token="") == 401
    assert head.status_code("/api/jobs/eagle3-full", token="0" * 64) == 403
    assert head.job("eagle3-full")["status"] == "SUCCEEDED"


def test_dashboard_train_view_lists_the_training_run(autoscaling_cluster, pipeline_job):
    runs = autoscaling_cluster.head.get("/api/train/v2/runs/v1")  # the Train V2 runs route in Ray 2.60
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


def test_nodes_start_from_zero_for_the_job_and_go_when_it_is_done(bed_idle, pipeline_job):
    """The head schedules no work: every stage ran on worker nodes the autoscaler started from zero (the two killed
    ones and their replacements among them), all on 127.0.0.1, and the idle nodes went once the job was done."""
    autoscaling_cluster = bed_idle
    assert pipeline_job.workers_at_start == [], "the bed must start with no worker node"
    killed = {k.node_id for k in pipeline_job.kills}
    assert killed < pipeline_job.workers_seen, (killed, pipeline_job.workers_seen)
    nodes = autoscaling_cluster.nodes()
    assert {n["node_ip"] for n in nodes} == {"127.0.0.1"}
    assert autoscaling_cluster.workers() == [] and pipeline_job.scale_down_s is not None
    assert autoscaling_cluster.non_loopback_listeners() == []
    temp_dirs = {
        arg.split("=", 1)[1]
        for proc in autoscaling_cluster.processes()
        for arg in _cmdline(proc)
        if re.match(r"--(temp[-_]dir|session[-_]dir)=", arg)
    }
    assert temp_dirs and all(d.startswith(str(autoscaling_cluster.temp_dir)) for d in temp_dirs), temp_dirs
    print(f"idle worker nodes gone {pipeline_job.scale_down_s:.1f} s after the job")


def test_a_generate_node_lost_mid_stage_costs_only_its_units(pipeline_job, s3_env):
    """The node of a generate engine was SIGKILLed after the resubmitted job committed a unit: Ray restarted the
    engine actor on another node and retried the lost units; the job log names the engine's node before and after."""
    [kill] = [k for k in pipeline_job.kills if k.stage == "generate"]
    generated = storage.latest(pipeline_job.run_dir, "generate")["path"]
    engines = [storage.read_json(uri) for uri in storage.list_files(storage.join(generated, "engines"), ".json")]
    nodes = {e["node_id"] for e in engines}
    assert kill.node_id in nodes and len(nodes) >= 2, engines
    logged = {line.split(" node=")[1].split()[0] for line in pipeline_job.logs.splitlines() if "engine_ready" in line}
    assert kill.node_id in logged and len(logged) >= 2, logged
    replacement = min(e["ready_time"] for e in engines if e["ready_time"] > kill.wall)
    print(f"generate: engine ready on another node {replacement - kill.wall:.1f} s after its node was killed")


def test_a_train_node_lost_mid_run_resumes_from_its_last_checkpoint_on_another_node(pipeline_job, s3_env):
    """The train worker's node was SIGKILLed after the first epoch's checkpoint: Ray Train (FailureConfig) started
    the worker group again on a new node without a resubmit, it resumed after the last checkpoint, and every epoch's
    validation is there."""
    [kill] = [k for k in pipeline_job.kills if k.stage == "train"]
    trained = storage.latest(pipeline_job.run_dir, "train")["path"]
    records = [
        json.loads(line)
        for line in storage.read_bytes(storage.join(trained, "metrics.jsonl")).decode().splitlines()
        if line.strip()
    ]
    [resumed] = [r for r in records if r["kind"] == "resumed"]
    assert resumed["next_epoch"] == resumed["from_epoch"] + 1 and resumed["node"] != kill.node_id, resumed
    epochs = [r["epoch"] for r in records if r["kind"] == "validation"]
    assert sorted(set(epochs)) == list(range(6)) and epochs[-1] == 5, epochs
    started = [line for line in pipeline_job.logs.splitlines() if "worker_started" in line]
    assert any(f"node={kill.node_id}" in line for line in started) and len(started) >= 2, started
    done_before = [r for r in records if r["kind"] == "validation" and r["time"] < kill.wall]
    print(
        f"train: resumed after epoch {resumed['from_epoch']} {resumed['time'] - kill.wall:.1f} s after its node was "
        f"killed; {len(done_before)} epoch(s) were done at the kill"
    )


def test_a_job_asking_for_a_node_no_type_can_make_fails_with_one_line_instead_of_waiting(bed_idle, s3_server):
    """16 GPUs on one node for one engine replica, where cluster.yaml's biggest type has 8: Ray and the autoscaler
    would wait forever; the generate stage fails after run.resource_wait_s with one line naming what it needs and the
    fields that ask for it. (Runs after the session's jobs, on the same bed.)"""
    head = bed_idle.head
    storage_path = f"s3://{s3_server.bucket}/runs"
    too_big = ["generate.tensor_parallel_size=16", "generate.num_gpus_per_worker=1", "run.resource_wait_s=5"]
    entrypoint = pipeline_entrypoint(storage_path, "too-big", "--stages", "ingest,generate", *STOPPABLE, *too_big)
    head.submit("eagle3-too-big", *entrypoint, env_vars=s3_server.env)
    info = head.wait("eagle3-too-big", {"FAILED"}, timeout_s=300)
    logs = head.logs("eagle3-too-big")
    errors = [line for line in logs.splitlines() if line.startswith("error:")]
    assert info["driver_exit_code"] == 2 and len(errors) == 1, (info, logs[-3000:])
    assert re.fullmatch(
        r"error: generate needs 16 x \{'CPU': 1, 'GPU': 1.0\} on one node and the cluster after 5 s cannot hold it "
        r"\(its resources: \{.*\}\); set by generate.tensor_parallel_size, generate.num_gpus_per_worker; no node "
        r"type of the autoscaler makes such a node or none came \(run.resource_wait_s\)",
        errors[0],
    ), errors[0]
    assert "Traceback" not in logs


# How far the final validation of the killed-and-resumed training may be from the same training run uninterrupted:
# the resumed worker restores weights, optimizer, schedule, RNG and data order, so only float summation order
# (another process on another node) may differ.
UNINTERRUPTED_TOLERANCE = {
    "val_loss": 0.02,  # relative
    "val_acc_0": 0.01,
    "val_acceptance_length": 0.02,
    "val_replay_acceptance_length": 0.02,
}


def test_training_resumed_after_losing_its_node_validates_like_the_same_training_uninterrupted(
    pipeline_job, uninterrupted_train, s3_env
):
    """The session job's training lost its node after epoch 1's checkpoint and resumed from epoch 0's; the same
    training on the same generated data without a stop or a lost node (a train-only job on a copy of the run) ends
    with validation metrics within UNINTERRUPTED_TOLERANCE of it."""
    trained = storage.latest(pipeline_job.run_dir, "train")["path"]
    killed = [r for r in read_jsonl(storage.join(trained, "metrics.jsonl")) if r["kind"] == "validation"]
    whole = [r for r in uninterrupted_train if r["kind"] == "validation"]
    assert not [r for r in uninterrupted_train if r["kind"] == "resumed"]
    assert [r["epoch"] for r in whole] == list(range(6)) and killed[-1]["epoch"] == whole[-1]["epoch"] == 5
    diffs = {key: killed[-1][key] - whole[-1][key] for key in UNINTERRUPTED_TOLERANCE}
    print("resumed minus uninterrupted, final validation: " + ", ".join(f"{k} {v:+.5f}" for k, v in diffs.items()))
    assert abs(diffs["val_loss"]) <= UNINTERRUPTED_TOLERANCE["val_loss"] * whole[-1]["val_loss"], diffs
    assert all(abs(diffs[k]) <= tol for k, tol in UNINTERRUPTED_TOLERANCE.items() if k != "val_loss"), diffs
