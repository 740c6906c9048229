"""Online training: the dataset of the train run is the capture pipeline itself, with no hidden states on storage.

    python ray_jobs/pipeline.py ray_jobs/configs/tiny_cpu.yaml train.source=online

Ray Data reads the ingested conversations as token-bounded work units (generate/plan.py), and a router actor
hands each unit to one of the StreamEngine actors (the generate section's engines and resources), which regenerates
and captures it; each captured sample comes back as a row whose hidden states are an ndarray. The engines are
started once for the whole stage, outside Ray Data: every epoch re-executes the stream (below), and a stream-owned
actor pool would load the verifier again each time. `TorchTrainer(datasets={"train": ds})` splits
that stream over the train workers (`ray.train.get_dataset_shard`), which pack rows into the same batches offline
training builds (online_worker.py). Engines and trainers run at the same time on their own CPUs/GPUs; Ray Data's
object-store limit (`train.online_buffer_bytes`) pauses the engines when the trainers fall behind.

Every epoch re-executes the stream (the verifier runs again) unless `train.online_cache` is on: then the engines also
commit each unit as shards + a part file under train/{version}/cache/ (generate's format), and epochs after the first
train from that cache. Outputs, metrics and checkpoints are those of train.py (train/{version}/, train/LATEST.json).

Recovery: a killed train worker makes Ray Train restart the worker group from the last epoch checkpoint; the new
group's dataset shard re-executes the stream from its start, so the interrupted epoch is trained again from the
checkpoint's weights and every sample is trained once in it (the partial epoch's updates are discarded with the
weights that made them). With the cache on, units already committed are read back instead of regenerated. A killed
engine actor (or its whole node) is restarted by Ray (max_restarts) on another node and its units sent again
(max_task_retries); the engines outlive worker-group restarts. EngineWatch logs each engine's loss and return
(`engine_lost`, `engine_back`) in the driver's log, which is the job's.
"""

from __future__ import annotations

import json
import math
import threading
import time

from ray.train import DataConfig

from eagle3_ray.core import stage, storage
from eagle3_ray.core.config import Config, versioned
from eagle3_ray.core.telemetry import log
from eagle3_ray.core.verifiers import verifier_dir
from eagle3_ray.generate import chat, commit
from eagle3_ray.generate.output import capture_contract
from eagle3_ray.generate.plan import (
    chat_encoder,
    plan_units,
    replica_options,
    sample_cost,
    with_prefill_ids,
    with_responses,
)
from eagle3_ray.train import data, vocab
from eagle3_ray.train.online_engine import StreamEngine
from eagle3_ray.train.worker import WorkerArgs

STAGE = "train"


def version(cfg: Config) -> str:
    """The train stage's version in online mode: what the generate stage's and the train stage's would hash."""
    return storage.version_hash(
        "train-online",
        versioned(cfg.train),
        versioned(cfg.generate),
        versioned(cfg.verifier),
        cfg.run.seed,
        stage.version(cfg, "ingest"),
    )


def start_engines(
    cfg: Config, verifier_path: str, layer_ids: list[int], out_dir: str, cache_dir: str | None, created_pgs: list
) -> list:
    """`generate.num_replicas` StreamEngine actors for the whole stage, each with a replica's resources (or its own
    placement group, collected in `created_pgs`). Ray restarts a dead one and resends its calls."""
    import ray

    commit.clear_attempts(cache_dir or out_dir)
    cls = ray.remote(StreamEngine)
    return [
        cls.options(max_restarts=-1, max_task_retries=-1, **replica_options(cfg, created_pgs)).remote(
            cfg.to_dict(), verifier_path, layer_ids, out_dir, cache_dir
        )
        for _ in range(cfg.generate.num_replicas)
    ]


class EngineWatch:
    """A driver thread that polls the engine actors' state (Ray's state API, every `every_s`) and logs a line when
    one is lost (`engine_lost`: no longer ALIVE, with the node it ran on) and when it is back (`engine_back`: ALIVE
    again, on which node, after how many seconds). Recovery itself is Ray's; this only says when it happened."""

    def __init__(self, engines: list, every_s: float = 1.0):
        self.ids = [e._actor_id.hex() for e in engines]
        self.every_s, self.stop = every_s, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> EngineWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        from ray.util.state import get_actor

        nodes: dict[str, str | None] = {}
        lost_at: dict[str, float] = {}
        failed: set[str] = set()
        while not self.stop.wait(self.every_s):
            for replica, actor_id in enumerate(self.ids):
                try:
                    actor = get_actor(actor_id)
                except Exception as e:  # the dashboard busy, restarting or absent: ask again at the next poll
                    if type(e).__name__ not in failed:  # one line per kind of failure, not one a second
                        failed.add(type(e).__name__)
                        log(STAGE, "engine_watch_error", replica=replica, error=f"{type(e).__name__}: {e}")
                    continue
                if actor is None:
                    continue
                alive = actor.state == "ALIVE"
                if not alive and actor_id not in lost_at and actor_id in nodes:
                    lost_at[actor_id] = time.time()
                    log(STAGE, "engine_lost", replica=replica, node=nodes[actor_id], state=actor.state)
                elif alive and actor_id in lost_at:
                    down_s = time.time() - lost_at.pop(actor_id)
                    log(STAGE, "engine_back", replica=replica, node=actor.node_id, down_s=round(down_s, 1))
                if alive:
                    nodes[actor_id] = actor.node_id


class EngineRouter:
    """Ray Data callable: sends each one-unit batch to the engine with the fewest units in flight and returns its
    rows. Cheap to start, so a re-executed stream costs no engine start."""

    def __init__(self, engines: list):
        self.engines, self.in_flight = engines, [0] * len(engines)

    async def __call__(self, batch: dict) -> dict:
        i = min(range(len(self.engines)), key=self.in_flight.__getitem__)
        self.in_flight[i] += 1
        try:
            return await self.engines[i].__call__.remote(batch)
        finally:
            self.in_flight[i] -= 1


def build_dataset(cfg: Config, units: list, engines: list):
    """The lazy stream of captured samples; nothing runs until a train worker iterates its shard. Each engine works
    on `generate.units_in_flight` units at once, as in the generate stage."""
    import ray

    items = [{"unit_id": u.unit_id, "samples_json": json.dumps(u.samples), "num_tokens": u.num_tokens} for u in units]
    in_flight = len(engines) * cfg.generate.units_in_flight
    compute = ray.data.ActorPoolStrategy(
        size=1, max_tasks_in_flight_per_actor=in_flight, max_concurrent_calls_per_actor=in_flight
    )
    return ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        EngineRouter, fn_constructor_kwargs={"engines": engines}, batch_size=1, compute=compute, num_cpus=0
    )


class StreamDataConfig(DataConfig):
    """Train's DataConfig with a split that keeps every row: the default `streaming_split(equal=True)` drops rows
    to give each worker the same count; the online worker loop keeps DDP ranks in step itself (online_worker.py)."""

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        output: list[dict] = [{} for _ in range(world_size)]
        for name, ds in datasets.items():
            ds = ds.copy(ds)
            ds.context.execution_options = self._resolve_execution_options(name)
            for i, split in enumerate(ds.streaming_split(world_size, equal=False, locality_hints=worker_node_ids)):
                output[i][name] = split
        return output


def data_config(cfg: Config) -> StreamDataConfig:
    """Ray Data limits for the stream: one CPU for the read tasks (the engines hold their own resources, outside
    Ray Data; the router takes none) and a bounded object store, so the engines pause when the trainers fall behind.
    `resource_limits` is replaced whole (its fields have no setters in Ray 2.60)."""
    from ray.data import ExecutionOptions, ExecutionResources

    limits = ExecutionResources(cpu=1, gpu=0, object_store_memory=cfg.train.online_buffer_bytes)
    return StreamDataConfig(execution_options=ExecutionOptions(resource_limits=limits))


def draft_vocab(out_dir: str, rows: list[dict], cfg: Config, encoder, capture: dict) -> None:
    """The draft vocabulary, built before any response exists: token counts of the training split's templated
    conversations as ingested (prompts, plus assistant turns where the input has them). Offline builds it from the
    regenerated responses, so the two can differ; in generate.mode=capture_only they count the same turns."""
    vocab_dir = storage.join(out_dir, "vocab")
    if vocab.vocab_exists(vocab_dir):
        return
    train_rows = [r for r in rows if data.split_role(r["id"], cfg) == "train"]
    counted = []
    for r in train_rows:
        ids = encoder.encode(r["messages"], r["messages"][-1]["role"] != "assistant")
        spans = encoder.assistant_spans(r["messages"])
        counted.append((ids, chat.loss_mask(spans, len(ids)) if spans else [1] * len(ids)))
    d2t, t2d = vocab.build_vocab(vocab.count_tokens(counted), cfg.train.draft_vocab_size, capture["vocab_size"])
    vocab.save_vocab(vocab_dir, d2t, t2d, vocab.count_tokens(counted))


def estimated_steps_per_epoch(costs: list[int], cfg: Config) -> int:
    """Packed steps per epoch from planned token costs (prompt + max_tokens per turn, an upper bound): the LR schedule
    needs a length before any response exists."""
    tokens_per_step = cfg.train.total_seq_len * cfg.train.num_workers
    return max(1, math.ceil(sum(costs) * (1 - cfg.train.val_fraction) / tokens_per_step))


def _plan(cfg: Config, ingest_dir: str, verifier_path: str):
    """(rows, units, plan rejects, token costs, encoder, held-out count) of the conversations this run trains on: a
    validation prompt's sampled responses (data.split_role `held_out`) are counted, not generated."""
    rows = with_responses(storage.read_parquet(storage.join(ingest_dir, "conversations.parquet")), cfg).to_pylist()
    rows = rows[: cfg.train.online_max_samples]
    kept = [r for r in rows if data.split_role(r["id"], cfg) != "held_out"]
    num_held_out, rows = len(rows) - len(kept), kept
    encoder = chat_encoder(verifier_path, cfg)
    rows = with_prefill_ids(rows, cfg, encoder)
    costs = [sample_cost(r, cfg, encoder) for r in rows]
    units, rejects = plan_units(rows, costs, cfg)
    return rows, units, rejects, costs, encoder, num_held_out


def _write_split(out_dir: str, rows: list[dict], rejects: list[dict], num_held_out: int, cfg: Config) -> dict:
    rejected = {r["id"] for r in rejects}
    roles = {r["id"]: data.split_role(r["id"], cfg) for r in rows if r["id"] not in rejected}
    val_ids = sorted(i for i, role in roles.items() if role == "val")
    split = {
        "val_fraction": cfg.train.val_fraction,
        "num_train": sum(role == "train" for role in roles.values()),
        "num_held_out": num_held_out,
        "val_ids": val_ids,
        "source": "online",
        "plan_rejects": rejects,
    }
    storage.write_json_atomic(storage.join(out_dir, "split.json"), split)
    return split


def prepare(cfg: Config, ingest_dir: str, out_dir: str, created_pgs: list):
    """The online data source of the train stage: (worker args, the lazy capture stream, split, engine actors). Plans
    the units, writes the capture contract, split and draft vocabulary, starts the engines; `created_pgs` collects
    their placement groups."""
    verifier_path = verifier_dir(cfg)
    capture = capture_contract(cfg, verifier_path)
    rows, units, rejects, costs, encoder, num_held_out = _plan(cfg, ingest_dir, verifier_path)
    storage.write_json_atomic(storage.join(out_dir, "capture.json"), capture)
    split = _write_split(out_dir, rows, rejects, num_held_out, cfg)
    draft_vocab(out_dir, rows, cfg, encoder, capture)
    cache_dir = storage.join(out_dir, "cache") if cfg.train.online_cache else None
    if cache_dir:
        storage.write_json_atomic(storage.join(cache_dir, "capture.json"), capture)
    log(
        STAGE,
        "plan",
        source="online",
        units=len(units),
        num_train=split["num_train"],
        num_val=len(split["val_ids"]),
        num_held_out=num_held_out,
        plan_rejects=len(rejects),
        workers=cfg.train.num_workers,
        epochs=cfg.train.epochs,
        cache=bool(cache_dir),
    )
    args = WorkerArgs(
        cfg=cfg.to_dict(),
        out_dir=out_dir,
        capture=capture,
        val_ids=split["val_ids"],
        cache_dir=cache_dir,
        steps_per_epoch=estimated_steps_per_epoch(costs, cfg),
    )
    engines = start_engines(cfg, verifier_path, capture["layer_ids"], out_dir, cache_dir, created_pgs)
    return args, build_dataset(cfg, units, engines), split, engines
