"""Planning what the engines get, shared by the generate stage and online training: the samples (each ingested
conversation `generate.responses_per_prompt` times), their token cost, token-bounded work units, and the Ray
resources of one engine replica.

    table = with_responses(conversations, cfg)
    rows = with_prefill_ids(rows, cfg, chat_encoder(verifier_path, cfg))     # capture_only: templated ids
    units, rejects = plan_units(rows, [sample_cost(r, cfg, encoder) for r in rows], cfg)
    options = replica_options(cfg, created_pgs)                              # one engine actor's resources
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from eagle3_ray.core import packing, sample_ids
from eagle3_ray.core.config import Config
from eagle3_ray.generate.chat import ChatEncoder


@dataclass(slots=True)
class Unit:
    unit_id: str
    samples: list[dict[str, Any]]
    num_tokens: int


def with_responses(table: pa.Table, cfg: Config) -> pa.Table:
    """The stage's samples: each ingested conversation `generate.responses_per_prompt` times, one after the other (a
    prompt's copies share a unit, so its prefix is cached), ids by sample_ids.response_id; what the outputs reconcile
    against."""
    n = cfg.generate.responses_per_prompt
    if n == 1:
        return table
    out = table.take(pa.array([i for i in range(table.num_rows) for _ in range(n)], pa.int64()))
    ids = [sample_ids.response_id(i, k) for i in table.column("id").to_pylist() for k in range(n)]
    return out.set_column(out.schema.get_field_index("id"), "id", pa.array(ids, pa.string()))


def chat_encoder(verifier_path: str, cfg: Config):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(verifier_path, trust_remote_code=cfg.verifier.trust_remote_code)
    return ChatEncoder(tok, cfg.generate.enable_thinking)


def with_prefill_ids(rows: list[dict[str, Any]], cfg: Config, encoder: Any) -> list[dict[str, Any]]:
    """capture_only: each row with its templated conversation's ids (`input_ids`), the tokens its prefill captures.
    Tokenized once, here: their count is the sample's cost in the plan, and the unit carries them to the engine
    actor, whose requests go out without templating anything (chat.Conversation)."""
    if cfg.generate.mode != "capture_only":
        return rows
    return [{**r, "input_ids": encoder.encode(r["messages"], False)} for r in rows]


def sample_cost(row: dict[str, Any], cfg: Config, encoder: Any) -> int:
    """Tokens a sample occupies in an engine call: its prompt(s) plus the responses it may generate (capture_only:
    the rows of with_prefill_ids)."""
    gen = cfg.generate
    if gen.mode == "capture_only":
        return len(row["input_ids"])
    if row["num_turns"] <= 1:
        return row["num_prompt_tokens"] + gen.max_tokens
    users = [m for m in row["messages"] if m["role"] != "assistant"]
    return len(encoder.encode(users, True)) + row["num_turns"] * gen.max_tokens


def plan_units(rows: list[dict[str, Any]], costs: list[int], cfg: Config) -> tuple[list[Unit], list[dict]]:
    """Greedy packing in input order up to generate.max_batch_tokens; an oversized sample goes alone or is rejected."""
    budget = cfg.generate.max_batch_tokens
    packer, groups, rejects = packing.GreedyPacker(budget), [], []
    for row, cost in zip(rows, costs, strict=True):
        if cost > budget and cfg.generate.oversize == "reject":
            rejects.append(
                {
                    "id": row["id"],
                    "reason": "over_batch_budget",
                    "detail": f"{cost} tokens > generate.max_batch_tokens {budget}",
                }
            )
            continue
        sample = {"id": row["id"], "messages": row["messages"], "source": row["source"]}
        if row.get("input_ids") is not None:  # with_prefill_ids
            sample["input_ids"] = row["input_ids"]
        if (group := packer.add((sample, cost), cost)) is not None:
            groups.append(group)
    groups += [last] if (last := packer.flush()) else []
    return [_unit([s for s, _ in group], sum(c for _, c in group)) for group in groups], rejects


def _unit(samples: list[dict[str, Any]], num_tokens: int) -> Unit:
    """A unit's id hashes its sample ids: the same samples make the same unit in a resumed run."""
    ids = "\n".join(sorted(s["id"] for s in samples))
    return Unit(hashlib.sha256(ids.encode()).hexdigest()[:16], samples, num_tokens)


def placement_args(cfg: Config, created: list) -> dict[str, Any]:
    """map_batches resources for one replica. TP>1: a STRICT_PACK placement group per replica (one bundle per TP
    worker, all on one node) that the engine actor and vLLM's Ray workers are scheduled into; `created` collects
    the groups so the stage removes them when it ends. `ray_remote_args_fn` is what Ray 2.60's ray.data.llm vLLM
    stage uses for the same purpose; Ray removes it in 2.64, hence the Ray pin in pyproject.toml."""
    if cfg.generate.tensor_parallel_size == 1:
        return replica_options(cfg, created)
    return {"num_cpus": 1, "num_gpus": 0, "ray_remote_args_fn": lambda: _replica_group(cfg, created)}


def replica_options(cfg: Config, created: list) -> dict[str, Any]:
    """Ray actor options of one engine replica: its CPUs and GPU, or (TP>1) one CPU inside a new STRICT_PACK
    placement group of its own (collected in `created`)."""
    gen = cfg.generate
    if gen.tensor_parallel_size == 1:
        return {"num_cpus": gen.num_cpus_per_replica, "num_gpus": gen.num_gpus_per_worker}
    return {"num_cpus": 1, "num_gpus": 0, **_replica_group(cfg, created)}


def replica_bundles(cfg: Config) -> tuple[list[dict[str, float]], str, str]:
    """What one engine replica occupies: (bundles, placement strategy, the config fields that set them). TP>1:
    one bundle per TP worker, all on one node."""
    gen = cfg.generate
    if gen.tensor_parallel_size == 1:
        bundle = {"CPU": gen.num_cpus_per_replica, "GPU": gen.num_gpus_per_worker}
        return [bundle], "PACK", "generate.num_cpus_per_replica, generate.num_gpus_per_worker"
    bundles = [{"GPU": gen.num_gpus_per_worker, "CPU": 1}] * gen.tensor_parallel_size
    return bundles, "STRICT_PACK", "generate.tensor_parallel_size, generate.num_gpus_per_worker"


def ensure_replica_fits(cfg: Config) -> float:
    """Wait (run.resource_wait_s) until the cluster can hold one engine replica; one error line when it cannot."""
    from eagle3_ray.core.resources import ensure_schedulable

    return ensure_schedulable("generate", *replica_bundles(cfg), cfg.run)


def _replica_group(cfg: Config, created: list) -> dict[str, Any]:
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundles, strategy, _fields = replica_bundles(cfg)
    pg = ray.util.placement_group(bundles, strategy=strategy)
    created.append(pg)
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_capture_child_tasks=True)}
