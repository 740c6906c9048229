"""Generate stage: regenerate responses with the verifier and capture its hidden states, on Ray Data + vLLM actors.

    python ray_jobs/generate.py ray_jobs/configs/tiny_cpu.yaml generate.max_tokens=64

Reads the latest ingest output, plans token-bounded work units, streams them through a pool of EngineActor actors
(one vLLM engine each, many units in flight; two_pass: a plain pool, then a capture pool) and writes
`generate/{version}/` as docs/design.md (generate) describes. Every unit commits as shards +
`parts/{unit}.parquet`; a re-run skips committed samples, so a killed job resumes where it stopped.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from eagle3_ray.core import stage, storage, telemetry
from eagle3_ray.core.config import Config, versioned
from eagle3_ray.core.raycluster import ensure_ray
from eagle3_ray.core.verifiers import verifier_dir
from eagle3_ray.generate import commit
from eagle3_ray.generate.engine import EngineActor, RegenerateActor
from eagle3_ray.generate.mode import resolve_mode
from eagle3_ray.generate.output import capture_contract, clean_orphans, committed_ids, finalise
from eagle3_ray.generate.plan import (
    Unit,
    chat_encoder,
    ensure_replica_fits,
    placement_args,
    plan_units,
    sample_cost,
    with_prefill_ids,
    with_responses,
)

STAGE = "generate"


def version(cfg: Config) -> str:
    return storage.version_hash(
        versioned(cfg.generate), versioned(cfg.verifier), cfg.run.seed, stage.version(cfg, "ingest")
    )


def run(cfg: Config) -> dict[str, Any]:
    ingest_dir = stage.input_dir(cfg, "ingest")
    return stage.run(
        cfg, STAGE, version(cfg), lambda out: _generate(cfg, ingest_dir, out), inputs={"ingest": ingest_dir}
    )


def _generate(cfg: Config, ingest_dir: str, out: str) -> dict[str, Any]:
    ensure_ray(cfg.run)
    ensure_replica_fits(cfg)
    verifier_path = verifier_dir(cfg)
    contract = capture_contract(cfg, verifier_path)
    storage.write_json_atomic(storage.join(out, "capture.json"), contract)

    table = with_responses(storage.read_parquet(storage.join(ingest_dir, "conversations.parquet")), cfg)
    clean_orphans(out)
    commit.clear_attempts(out)
    done = committed_ids(out)
    pending = table.filter(pc.invert(pc.is_in(table["id"], pa.array(sorted(done), pa.string())))).to_pylist()
    encoder = chat_encoder(verifier_path, cfg)
    pending = with_prefill_ids(pending, cfg, encoder)
    units, plan_rejects = plan_units(pending, [sample_cost(r, cfg, encoder) for r in pending], cfg)
    telemetry.log(
        STAGE,
        "plan",
        path=out,
        rows_in=table.num_rows,
        already_done=len(done),
        units=len(units),
        samples=sum(len(u.samples) for u in units),
        plan_rejects=len(plan_rejects),
    )
    start = time.monotonic()
    processed = _execute(cfg, units, verifier_path, contract, out) if units else {"tokens": 0, "bytes": 0}
    wall_s = time.monotonic() - start
    return finalise(cfg, out, table, plan_rejects, contract, processed, wall_s)


def _execute(cfg: Config, units: list[Unit], verifier_path: str, contract: dict, out: str) -> dict[str, Any]:
    """Stream units through the engine pool(s), logging progress as summaries come back. `generate` and
    `capture_only` run one pool; `two_pass` runs a plain pool over the units not yet regenerated, then (that pool
    gone, its GPUs free) a capture pool over the regenerated conversations, or with `generate.two_pass_overlap` both
    pools at once in one stream (_run_overlapped). `contract`: capture.json's (layer ids, the verifier's size)."""
    layer_ids = contract["layer_ids"]
    generated = generated_records(out)
    size = contract["hidden_size"] * contract["num_hidden_layers"]
    mode = resolve_mode(cfg, units, size, first_pass_done=len(generated))
    if mode != "two_pass":
        kind = "prefill" if mode == "capture_only" else "generate"
        return {**_run_pool(cfg, units, kind, verifier_path, layer_ids, out), "mode": mode}
    todo = [u for u in units if any(s["id"] not in generated for s in u.samples)]
    if cfg.generate.two_pass_overlap and todo:  # with nothing left to regenerate, no plain engine is started
        totals = _run_overlapped(cfg, units, {u.unit_id for u in todo}, generated, verifier_path, layer_ids, out)
        storage.delete(storage.join(out, "generated"))
        return {**totals, "mode": mode}
    first = _run_pool(cfg, todo, "plain", verifier_path, layer_ids, out) if todo else {}
    generated = generated_records(out)
    second = [Unit(u.unit_id, [generated[s["id"]] for s in u.samples], u.num_tokens) for u in units]
    totals = _run_pool(cfg, second, "prefill", verifier_path, layer_ids, out)
    storage.delete(storage.join(out, "generated"))  # every first-pass record is captured in a part by now
    return {**totals, "first_pass": first, "mode": mode}


def generated_records(out: str) -> dict[str, dict[str, Any]]:
    """two_pass's first-pass records by sample id (`generated/*.parquet`): a regenerated conversation with its
    input_ids and loss_mask, or a reject; a sample found twice (a unit retried after commit) keeps one."""
    files = storage.list_files(storage.join(out, "generated"), ".parquet")
    rows = [r for f in sorted(files) for r in storage.read_parquet(f).to_pylist()]
    return {r["id"]: r for r in reversed(rows)}


def engine_pool_args(cfg: Config, created_pgs: list) -> dict[str, Any]:
    """map_batches arguments of an engine pool: one async actor per replica (EngineActor.__call__ is a coroutine)
    working on `units_in_flight` units at once: Ray Data sends that many one-unit tasks to each actor and Ray Core
    runs them concurrently on the actor's event loop (what ray.data.llm does with max_concurrency; Ray 2.60 names
    it max_concurrent_calls_per_actor). With the replica's resources or placement group (placement_args)."""
    import ray

    gen = cfg.generate
    compute = ray.data.ActorPoolStrategy(
        min_size=gen.num_replicas,
        max_size=gen.max_replicas or gen.num_replicas,
        max_tasks_in_flight_per_actor=gen.units_in_flight,
        max_concurrent_calls_per_actor=gen.units_in_flight,
    )
    return {"batch_size": 1, "compute": compute, **placement_args(cfg, created_pgs)}


def _run_pool(
    cfg: Config, units: list[Unit], kind: str, verifier_path: str, layer_ids: list[int], out: str
) -> dict[str, Any]:
    import ray

    items = [{"unit_id": u.unit_id, "samples_json": json.dumps(u.samples), "num_tokens": u.num_tokens} for u in units]
    created_pgs: list = []
    ds = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        EngineActor,
        fn_constructor_kwargs={
            "cfg_dict": cfg.to_dict(),
            "verifier_path": verifier_path,
            "layer_ids": layer_ids,
            "out_dir": out,
            "kind": kind,
        },
        **engine_pool_args(cfg, created_pgs),
    )
    return _consume(cfg, ds, sum(len(u.samples) for u in units), kind, created_pgs)


def _consume(cfg: Config, ds, num_samples: int, kind: str, created_pgs: list) -> dict[str, Any]:
    """Run the pool(s) of `ds`, logging progress as the engines' summary rows come back; remove the replicas'
    placement groups after."""
    import ray

    progress = _Progress(cfg, num_samples, kind)
    try:
        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            progress.add(batch.to_pylist())
    except Exception as e:
        raise RuntimeError(f"generate stage failed: {_root_message(e)}") from e
    finally:
        for pg in created_pgs:
            ray.util.remove_placement_group(pg)
    return progress.totals()


def _run_overlapped(
    cfg: Config,
    units: list[Unit],
    todo: set[str],
    generated: dict[str, dict[str, Any]],
    verifier_path: str,
    layer_ids: list[int],
    out: str,
) -> dict[str, Any]:
    """two_pass with `generate.two_pass_overlap`: one stream through a plain pool (RegenerateActor) into a capture
    pool, both started at once on half of each replica's GPUs; a unit not in `todo` (ids of the units still to
    regenerate) goes through without the plain engine, with its first-pass records from `generated`."""
    import ray

    gen = cfg.generate
    half = replace(cfg, generate=replace(gen, num_gpus_per_worker=gen.num_gpus_per_worker / 2))
    items = []
    for u in units:
        regenerated = u.unit_id not in todo
        samples = [generated[s["id"]] for s in u.samples] if regenerated else u.samples
        items.append(
            {
                "unit_id": u.unit_id,
                "samples_json": json.dumps(samples),
                "num_tokens": u.num_tokens,
                "regenerated": regenerated,
            }
        )
    created_pgs: list = []
    common = {"cfg_dict": half.to_dict(), "verifier_path": verifier_path, "layer_ids": layer_ids, "out_dir": out}
    ds = (
        ray.data.from_items(items, override_num_blocks=len(items))
        .map_batches(RegenerateActor, fn_constructor_kwargs=common, **engine_pool_args(half, created_pgs))
        .map_batches(
            EngineActor, fn_constructor_kwargs={**common, "kind": "prefill"}, **engine_pool_args(half, created_pgs)
        )
    )
    telemetry.log(STAGE, "two_pass_overlap", units=len(items), regenerated=sum(i["regenerated"] for i in items))
    return _consume(cfg, ds, sum(len(u.samples) for u in units), "prefill", created_pgs)


def _root_message(e: BaseException) -> str:
    """The innermost error that says what went wrong (Ray wraps actor errors several times)."""
    text = str(e)
    for marker in ("generate: the vLLM engine failed to start", "generate: capture check failed"):
        if marker in text:
            return text[text.index(marker) :].splitlines()[0]
    return f"{type(e).__name__}: {text[:2000]}"


class _Progress:
    def __init__(self, cfg: Config, num_samples: int, kind: str):
        self.tags = {"stage": STAGE, "run": cfg.run.name}
        self.kind = kind
        self.meter = telemetry.RateMeter()
        self.num_samples, self.done, self.rejected, self.tokens, self.bytes = num_samples, 0, 0, 0, 0

    def add(self, rows: list[dict[str, Any]]) -> None:
        ok = [r for r in rows if r["status"] == "ok"]
        tokens, nbytes = sum(r["num_tokens"] for r in ok), sum(r["num_bytes"] for r in rows)
        self.done += len(rows)
        self.rejected += len(rows) - len(ok)
        self.tokens += tokens
        self.bytes += nbytes
        counts = (("samples_total", len(ok)), ("captured_tokens_total", tokens), ("shard_bytes_total", nbytes))
        for name, value in counts:
            if value > 0:  # Ray counters reject non-positive increments
                telemetry.metrics.counter(name, f"generate: {name}").inc(value, tags=self.tags)
        telemetry.log(
            STAGE,
            "progress",
            engine=self.kind,
            samples=f"{self.done}/{self.num_samples}",
            rejected=self.rejected,
            tokens=self.tokens,
            tokens_per_s=self.meter.per_s(self.tokens),
            bytes_written=self.bytes,
        )

    def totals(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "bytes": self.bytes,
            "samples": self.done,
            "rejected": self.rejected,
            "wall_s": self.meter.elapsed_s,
            "end_time": time.time(),
        }
