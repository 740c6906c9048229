"""The whole pipeline as users run it on a cluster, once per session: `ray job submit` to the autoscaling bed made
from the project's cluster.yaml (tests/support/autoscaling.py: a head that schedules no work, worker nodes that start
from zero on 127.0.0.1), its run dir on the loopback S3 server, stopped mid-generate and resubmitted under the same
run name (which resumes it), and in the resubmitted job a worker node lost twice: the node of a generate engine
while it commits units, and the node of the train worker mid-run after a reported checkpoint. The job, metrics, MLA
and multi-node tests read this one run.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.fs as pafs

from eagle3_ray.core import storage
from eagle3_ray.core.telemetry import read_jsonl
from tests.support.autoscaling import AutoscalingCluster
from tests.support.ray_head import RayHead
from tests.support.s3 import pointed_at

RECIPE = "ray_jobs/configs/tiny_kimi_cpu.yaml"
# The seeds' model family (a tiny Kimi-K2.5-shaped verifier: MLA + MoE under a multimodal wrapper,
# tests/e2e/test_mla_pipeline.py reads this run too), kept small: short responses, one train worker (all batches on
# it) for 6 short epochs at a higher learning rate so that the drafter learns something, a short evaluation at c=1.
LEAN = [
    "generate.max_tokens=24",
    "train.num_workers=1",
    "train.epochs=6",
    "train.total_seq_len=256",
    "train.lr=0.001",
    "train.warmup_steps=2",
    "train.log_every_steps=1",
    "evaluate.num_prompts=4",
    "evaluate.max_tokens=24",
    "evaluate.concurrency=[1]",
    "evaluate.baseline_again=false",
    "evaluate.contract_prompts=4",
]
# The stop and the node kill must land while generate still has units to come: about one sample per unit, two in
# flight, 24 samples.
STOPPABLE = [
    "ingest.max_rows=24",
    "generate.max_tokens=32",
    "generate.max_batch_tokens=120",
    "generate.units_in_flight=2",
]


def pipeline_entrypoint(storage_path: Path | str, name: str, *extra: str) -> list[str]:
    # The venv's interpreter, not `python`: the entrypoint shell's PATH is the head's, not ours.
    return [
        sys.executable,
        "ray_jobs/pipeline.py",
        RECIPE,
        f"run.storage_path={storage_path}",
        f"run.name={name}",
        *LEAN,
        *extra,
    ]


def metric_samples(text: str, prefix: str = "ray_eagle3_") -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample whose name starts with `prefix` in Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith(prefix)
    ]


def scrape_every_node(head: RayHead) -> list[tuple[str, dict[str, str], float]]:
    """Every node's metrics endpoint, as Prometheus finds them: the service-discovery file Ray keeps in its session
    dir (what `ray metrics launch-prometheus` points Prometheus at). A node that just died is skipped."""
    discovery = head.temp_dir / "ray" / "session_latest" / "prom_metrics_service_discovery.json"
    targets = [t for group in json.loads(discovery.read_text()) for t in group["targets"]] if discovery.exists() else []
    found = []
    for target in targets or [f"127.0.0.1:{head.ports['metrics-export-port']}"]:
        try:
            with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as response:
                found += metric_samples(response.read().decode())
        except OSError:
            continue
    return found


@dataclass
class NodeKill:
    """A worker node killed while `stage` ran: which node, what ran on it, and when (monotonic seconds)."""

    stage: str
    node_id: str
    actor: str
    at: float
    wall: float  # time.time(), to compare with the run's own records (engines/*.json, metrics.jsonl)


@dataclass
class FinishedJob:
    """A job that ran to SUCCEEDED: its REST record, logs, run dir and every custom metric scraped while it ran."""

    info: dict
    logs: str
    run_dir: Path | str | None
    metrics: list[tuple[str, dict[str, str], float]]
    elapsed_s: float
    stopped_logs: str = ""
    kills: list[NodeKill] = field(default_factory=list)
    workers_at_start: list[dict] = field(default_factory=list)
    workers_seen: set[str] = field(default_factory=set)
    scale_down_s: float | None = None
    ended_at: float = 0.0


def alive_actors(head: RayHead) -> list[dict]:
    """Every ALIVE actor (the state API's records: class_name, node_id, pid, ...)."""
    reply = head.get(
        "/api/v0/actors?limit=1000&detail=true&filter_keys=state&filter_predicates=%3D&filter_values=ALIVE"
    )
    return reply["data"]["result"]["result"]


def alive_actor(head: RayHead, class_part: str) -> dict | None:
    """An ALIVE actor whose class name contains `class_part`."""
    actors = [a for a in alive_actors(head) if class_part in (a.get("class_name") or "")]
    return actors[0] if actors else None


def _generate_parts(run_dir: str) -> set[str]:
    generate = f"{run_dir}/generate"
    return {uri for v in storage.list_dirs(generate) for uri in storage.list_files(f"{generate}/{v}/parts", ".parquet")}


def _a_checkpoint_reported(run_dir: str) -> bool:
    """Epoch 1's checkpoint is on S3: epoch 0's has surely been reported to Ray Train (a worker writes an epoch's
    checkpoint, then reports it, then starts the next epoch), so a restarted worker group has one to resume."""
    train = f"{run_dir}/train"
    return any(storage.exists(f"{train}/{v}/epoch_0001") for v in storage.list_dirs(train))


def run_job(
    head: RayHead,
    submission_id: str,
    entrypoint: list[str],
    run_dir: Path | str | None,
    *,
    timeout_s: float = 1800,  # the job runs beside the rest of the suite (tests/support/bed_jobs.py)
    env_vars: dict[str, str] | None = None,
    on_poll: Callable[[dict], None] | None = None,
) -> FinishedJob:
    """Submit, poll GET /api/jobs/{id} until SUCCEEDED, scraping every node's metrics endpoint at every poll
    (metrics of short-lived workers vanish once they exit, so a scrape after the job could miss them)."""
    start = time.monotonic()
    scraped: list[tuple[str, dict[str, str], float]] = []

    def poll(info: dict) -> None:
        scraped.extend(scrape_every_node(head))
        if on_poll is not None:
            on_poll(info)

    head.submit(submission_id, *entrypoint, env_vars=env_vars)
    info = head.wait(submission_id, {"SUCCEEDED"}, timeout_s=timeout_s, every_s=1.0, on_poll=poll)
    return FinishedJob(
        info=info,
        logs=head.logs(submission_id),
        run_dir=run_dir,
        metrics=scraped,
        elapsed_s=time.monotonic() - start,
        ended_at=time.monotonic(),
    )


class NodeKiller:
    """Called at every poll of the resubmitted job: kills the node of a generate engine once that job's generate
    has committed a unit of its own, then the node of the train worker once a reported checkpoint is on S3."""

    def __init__(self, cluster: AutoscalingCluster, run_dir: str, parts_before: set[str]):
        self.cluster, self.run_dir, self.parts_before = cluster, run_dir, parts_before
        self.kills: list[NodeKill] = []
        self.workers_seen: set[str] = set()

    def __call__(self, info: dict) -> None:
        self.workers_seen |= {n["node_id"] for n in self.cluster.workers()}
        done = {k.stage for k in self.kills}
        if "generate" not in done and _generate_parts(self.run_dir) - self.parts_before:
            self._kill("generate", "EngineActor")
        elif "generate" in done and "train" not in done and _a_checkpoint_reported(self.run_dir):
            self._kill("train", "TrainWorker")

    def _kill(self, stage: str, class_part: str) -> None:
        actor = alive_actor(self.cluster.head, class_part)
        if actor is None:  # between two incarnations: try again at the next poll
            return
        self.cluster.kill_node(actor["node_id"])
        self.kills.append(NodeKill(stage, actor["node_id"], actor["class_name"], time.monotonic(), time.time()))


def submit_pipeline_job(cluster: AutoscalingCluster, s3_server) -> FinishedJob:
    """The tiny Kimi pipeline on the autoscaling bed: submitted, stopped through the Jobs REST API (what
    `ray job stop` calls) the moment generate's first unit commits, resubmitted under the same run name, which resumes
    it; in that job the node of a generate engine and then the node of the train worker are SIGKILLed, and the job
    must finish on the nodes the autoscaler starts instead. Returns the resubmitted job (`stopped_logs`: the first
    one's log; `kills`; the worker nodes seen; how long the idle nodes took to go after it). Read the run in a test
    through `s3_env`. The session runs it in the background (tests/support/bed_jobs.py): fixture `pipeline_job`."""
    head = cluster.head
    workers_at_start = cluster.workers()
    storage_path = f"s3://{s3_server.bucket}/runs"
    run_dir = f"{storage_path}/full"
    entrypoint = pipeline_entrypoint(storage_path, "full", *STOPPABLE)
    with pointed_at(s3_server):
        head.submit("eagle3-full-stopped", *entrypoint, env_vars=s3_server.env)
        deadline = time.monotonic() + 600
        while not _generate_parts(run_dir):
            assert time.monotonic() < deadline, head.logs("eagle3-full-stopped")[-4000:]
            status = head.job("eagle3-full-stopped")["status"]
            assert status in ("PENDING", "RUNNING"), head.logs("eagle3-full-stopped")[-4000:]
            time.sleep(0.1)
        assert head.post("/api/jobs/eagle3-full-stopped/stop")["stopped"]
        assert head.wait("eagle3-full-stopped", {"STOPPED"}, timeout_s=120)["status"] == "STOPPED"
        assert not storage.exists(f"{run_dir}/generate/LATEST.json"), "the job finished before it was stopped"
        killer = NodeKiller(cluster, run_dir, _generate_parts(run_dir))
    with pointed_at(s3_server):
        job = run_job(head, "eagle3-full", entrypoint, run_dir, env_vars=s3_server.env, on_poll=killer)
    job.stopped_logs = head.logs("eagle3-full-stopped")
    job.kills, job.workers_at_start, job.workers_seen = killer.kills, workers_at_start, killer.workers_seen
    cluster.wait_for_workers(0, timeout_s=120)
    job.scale_down_s = time.monotonic() - job.ended_at
    return job


def train_uninterrupted(cluster: AutoscalingCluster, s3_server, pipeline_job: FinishedJob) -> list[dict]:
    """The session job's training once more, with no stop and no node lost: its ingest and generate outputs copied
    to a run of their own (`full-uninterrupted`) and the job's config submitted there with `--stages train`, so the
    train version and every step's math are the same. Returns that training's metrics.jsonl records (fixture
    `uninterrupted_train`)."""
    head = cluster.head
    storage_path = f"s3://{s3_server.bucket}/runs"
    run_dir = f"{storage_path}/full-uninterrupted"
    entrypoint = pipeline_entrypoint(storage_path, "full-uninterrupted", *STOPPABLE, "--stages", "train")
    with pointed_at(s3_server):
        for stage in ("ingest", "generate"):
            done = storage.latest(pipeline_job.run_dir, stage)
            fs, source = storage.resolve(done["path"])
            _, target = storage.resolve(storage.stage_dir(run_dir, stage, done["version"]))
            pafs.copy_files(source, target, source_filesystem=fs, destination_filesystem=fs)
        head.submit("eagle3-full-uninterrupted", *entrypoint, env_vars=s3_server.env)
        head.wait("eagle3-full-uninterrupted", {"SUCCEEDED"}, timeout_s=900)
        return read_jsonl(storage.join(storage.latest(run_dir, "train")["path"], "metrics.jsonl"))
