"""`evaluate.fp32_recheck`: outputs whose difference from plain decoding points at the drafter, decoded again with
the verifier in float32, plain and with the drafter, each in the wave it was batched in (identity.recheck).

    rechecked = fp32_recheck(cfg, verifier_dir, drafter_dir, all_prompts, prompts, turns, measured)
"""

from __future__ import annotations

from typing import Any

from eagle3_ray.core.config import Config
from eagle3_ray.core.telemetry import log
from eagle3_ray.evaluate import identity
from eagle3_ray.evaluate.engine import engine_actor, engine_args, waves
from eagle3_ray.evaluate.prompts import level_groups

STAGE = "evaluate"


def fp32_recheck(
    cfg: Config,
    verifier_dir: str,
    drafter_dir: str,
    all_prompts: list[list[int]],
    prompts: list[dict[str, Any]],
    turns: tuple[int, ...],
    measured: list[tuple[int, int, dict[str, Any], list[dict[str, Any]]]],
) -> dict[str, Any] | None:
    """`evaluate.fp32_recheck`: the waves holding outputs classed `drafter` (`measured`: k, concurrency, run, identity
    items) decoded again with the verifier in float32, plain and with the drafter, each wave as it was batched; the
    items are reclassed in place (identity.recheck). Returns what was rechecked, or None where nothing was. A recheck
    that cannot run (the float32 engine does not start, say) leaves the classes as they are, with its error."""
    import ray

    flagged = {(k, c, i) for k, c, _, items in measured for i, item in enumerate(items) if item["class"] == "drafter"}
    if not flagged or not cfg.evaluate.fp32_recheck or cfg.verifier.dtype == "float32":
        return None
    ks, levels = sorted({k for k, _, _ in flagged}), sorted({c for _, c, _ in flagged})
    wave_groups = {  # per concurrency, every wave that holds a flagged output, as its own group of one wave
        c: [
            {"turn": g["turn"], "category": None, "indices": wave}
            for g in level_groups(prompts, c, turns)
            for wave in waves(g["indices"], c)
            if any((k, c, i) in flagged for k in ks for i in wave)
        ]
        for c in levels
    }
    log(STAGE, "fp32_recheck", outputs=len(flagged), concurrency=levels, num_speculative_tokens=ks)
    try:
        outputs = {}
        for k in [0, *ks]:
            args = {**engine_args(cfg, verifier_dir, drafter_dir if k else None, k), "dtype": "float32"}
            with engine_actor(cfg, args) as (actor, _):
                for c in levels:
                    run = ray.get(actor.measure.remote(all_prompts, c, cfg.evaluate.max_tokens, wave_groups[c]))
                    outputs[k, c] = run["outputs"]
    except Exception as e:  # a diagnostic: the classes stand as measured, and the report says why
        log(STAGE, "fp32_recheck_failed", error=f"{type(e).__name__}: {e}")
        return {"outputs": len(flagged), "error": f"{type(e).__name__}: {e}"}
    agree = 0
    for k, c, _, items in measured:
        for i, item in enumerate(items):
            if (k, c, i) in flagged:
                items[i] = identity.recheck(item, outputs[0, c][i], outputs[k, c][i])
                agree += items[i]["class"] == "numerics_fp32"
    log(STAGE, "fp32_recheck_done", outputs=len(flagged), agree_in_fp32=agree)
    return {"outputs": len(flagged), "agree_in_fp32": agree}
