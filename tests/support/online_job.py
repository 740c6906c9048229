"""Online training as users submit it, on the session's autoscaling bed (tests/support/autoscaling.py), losing the
engine's node: `ray job submit` of ray_jobs/pipeline.py with train.source=online (ingest, then the train stage
whose engine actor streams captured samples into the train worker), its run dir on the loopback S3 server, and once
the train worker has trained on streamed samples of epoch 1, the node that hosts the engine actor is SIGKILLed. The
engine takes a node of its own (generate.num_cpus_per_replica = a node's CPUs), so the train worker outlives it.
tests/e2e/test_online.py reads this one run.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass

from eagle3_ray.core import storage
from eagle3_ray.core.telemetry import read_jsonl
from tests.support.autoscaling import AutoscalingCluster
from tests.support.pipeline_job import NodeKill, alive_actor, alive_actors
from tests.support.s3 import pointed_at

SUBMISSION_ID = "eagle3-online"
RECIPE = "ray_jobs/configs/tiny_cpu.yaml"
# The tiny Llama recipe on the session's 24 prompts (about one sample per unit, two units in flight), trained online
# for 3 short epochs by one worker; the engine asks for a whole node (2 CPUs on the bed), so the train worker and
# Ray Data's read tasks run on another one.
ONLINE = [
    "--stages",
    "ingest,train",
    "ingest.max_rows=24",
    "generate.max_tokens=24",
    "generate.max_batch_tokens=120",
    "generate.units_in_flight=2",
    "generate.num_cpus_per_replica=2",
    "train.source=online",
    "train.num_workers=1",
    "train.epochs=3",
    "train.total_seq_len=256",
    "train.lr=0.001",
    "train.warmup_steps=2",
    "train.log_every_steps=1",
]
KILL_IN_EPOCH = 1  # epoch 0 ran whole and is checkpointed; epoch 1's stream is under way


@dataclass
class OnlineJob:
    """The finished job: its REST record and log, the kill, what else ran on the killed node, and the train run."""

    info: dict
    logs: str
    kill: NodeKill
    actors_on_killed_node: list[str]
    train_dir: str
    records: list[dict]  # metrics.jsonl
    engines: list[dict]  # engines/*.json, one per engine incarnation


class EngineNodeKiller:
    """Called at every poll of the job: once the job log has a train step of epoch KILL_IN_EPOCH, SIGKILLs the node
    of the StreamEngine actor (and records which other actors went with it)."""

    def __init__(self, cluster: AutoscalingCluster):
        self.cluster = cluster
        self.kill: NodeKill | None = None
        self.actors_on_node: list[str] = []

    def __call__(self, info: dict) -> None:
        if self.kill is not None:
            return
        head = self.cluster.head
        if not re.search(rf"\[eagle3 train\] train step=\d+ epoch={KILL_IN_EPOCH} ", head.logs(SUBMISSION_ID)):
            return
        engine = alive_actor(head, "StreamEngine")
        if engine is None:  # between two incarnations: try again at the next poll
            return
        node_id = engine["node_id"]
        self.actors_on_node = sorted(a["class_name"] for a in alive_actors(head) if a["node_id"] == node_id)
        self.cluster.kill_node(node_id)
        self.kill = NodeKill("train_online", node_id, engine["class_name"], time.monotonic(), time.time())


def submit_online_job(cluster: AutoscalingCluster, s3_server) -> OnlineJob:
    """Online training submitted to the bed after the session's pipeline job (that one needs the bed to start with no
    worker node), its engine's node SIGKILLed mid-epoch 1; the job must finish without a resubmit. The session runs
    it in the background after the pipeline job (tests/support/bed_jobs.py): fixture `online_job`."""
    head = cluster.head
    storage_path = f"s3://{s3_server.bucket}/runs"
    killer = EngineNodeKiller(cluster)
    # the venv's interpreter, not `python`: the entrypoint shell's PATH is the head's
    entrypoint = [sys.executable, "ray_jobs/pipeline.py", RECIPE, f"run.storage_path={storage_path}", "run.name=online"]
    entrypoint += ONLINE
    with pointed_at(s3_server):
        head.submit(SUBMISSION_ID, *entrypoint, env_vars=s3_server.env)
        info = head.wait(SUBMISSION_ID, {"SUCCEEDED"}, timeout_s=1800, every_s=1.0, on_poll=killer)
        logs = head.logs(SUBMISSION_ID)
        assert killer.kill is not None, f"the job ended before a train step of epoch {KILL_IN_EPOCH}:\n{logs[-4000:]}"
        train_dir = storage.latest(f"{storage_path}/online", "train")["path"]
        engines = [storage.read_json(uri) for uri in storage.list_files(storage.join(train_dir, "engines"), ".json")]
        records = read_jsonl(storage.join(train_dir, "metrics.jsonl"))
    return OnlineJob(info, logs, killer.kill, killer.actors_on_node, train_dir, records, engines)
