"""The evaluate stage's measurement: engines one at a time, each in its own actor (engine.py), plain decoding at
every concurrency level first (timed, then the reference logprobs; turn 2 built from its own answers), then one
engine per draft length; each output classed against plain decoding (identity.py), rechecked in float32 where the
drafter is blamed (recheck.py), and training's prediction set next to the measurement (prediction.py).

    results = measure_all(cfg, verifier_dir, drafter_dir, prompts, token_prompts, capture, capture_where)
"""

from __future__ import annotations

from typing import Any

from eagle3_ray.core import contract, storage
from eagle3_ray.core.config import Config
from eagle3_ray.core.telemetry import log
from eagle3_ray.evaluate import identity, report
from eagle3_ray.evaluate.acceptance import add_per_position
from eagle3_ray.evaluate.engine import SPEC_COUNTERS, engine_actor, engine_args
from eagle3_ray.evaluate.prediction import predicted_vs_measured, training_metrics
from eagle3_ray.evaluate.prompts import level_groups, load_tokenizer, second_turn_prompts
from eagle3_ray.evaluate.recheck import fp32_recheck

STAGE = "evaluate"


def measure_baseline_again(
    cfg: Config,
    verifier_dir: str,
    token_prompts: list[list[int]],
    prompts: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    *,
    turns: tuple[int, ...] = (1,),
) -> None:
    """With `evaluate.baseline_again`, plain decoding measured again after the drafter engines (did the machine's
    speed move meanwhile?), into the baseline rows of `rows` (report.add_baseline_again)."""
    if not cfg.evaluate.baseline_again:
        return
    with engine_actor(cfg, engine_args(cfg, verifier_dir, None, 0)) as (actor, _):
        again = measure_levels(cfg, actor, token_prompts, prompts, turns=turns)
    for row in (r for r in rows if not r["num_speculative_tokens"]):
        report.add_baseline_again(row, again[row["concurrency"]])


def measure_levels(
    cfg: Config,
    actor: Any,
    token_prompts: list[list[int]],
    prompts: list[dict[str, Any]] | None = None,
    *,
    turns: tuple[int, ...] = (1,),
    reference: bool = False,
) -> dict[int, dict[str, Any]]:
    """Every concurrency level on one engine, in the groups `level_groups` makes of `prompts` (None: one group of
    every token prompt); with `reference`, each level's untimed logprobs pass too (under the run's `reference` key)."""
    import ray

    runs = {}
    for c in cfg.evaluate.concurrency:
        groups = level_groups(prompts, c, turns) if prompts is not None else None
        runs[c] = ray.get(actor.measure.remote(token_prompts, c, cfg.evaluate.max_tokens, groups))
        if reference:
            runs[c]["reference"] = ray.get(actor.reference.remote(token_prompts, c, cfg.evaluate.max_tokens, groups))
    return runs


def run_engine(
    cfg: Config,
    args: dict[str, Any],
    token_prompts: list[list[int]],
    prompts: list[dict[str, Any]] | None = None,
    *,
    turns: tuple[int, ...] = (1,),
    contract_prompts: list[list[int]] | None = None,
) -> dict[str, Any]:
    """Start one engine actor, measure every concurrency level, stop it. Returns aux ids and one run per level; with
    `contract_prompts` (token prompts of the run's validation split), also their decode at the highest concurrency
    and `evaluate.max_tokens`, under `contract`."""
    import ray

    with engine_actor(cfg, args) as (actor, info):
        out = {"speculative": info, "runs": measure_levels(cfg, actor, token_prompts, prompts, turns=turns)}
        if contract_prompts:
            c = max(cfg.evaluate.concurrency)
            out["contract"] = ray.get(actor.measure.remote(contract_prompts, c, cfg.evaluate.max_tokens))
        return out


def concat_runs(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two measurements on one engine (turn 1, then turn 2) as one: outputs and groups appended, totals added."""
    spec = {k: a["spec"][k] + b["spec"][k] for k in SPEC_COUNTERS.values()}
    spec["accepted_per_pos"] = add_per_position(a["spec"]["accepted_per_pos"], b["spec"]["accepted_per_pos"])
    out = {
        "outputs": a["outputs"] + b["outputs"],
        "wall_s": a["wall_s"] + b["wall_s"],
        "spec": spec,
        "groups": a["groups"] + b["groups"],
        "per_request": a["per_request"] + b["per_request"],
    }
    if "reference" in a:
        out["reference"] = {key: a["reference"][key] + b["reference"][key] for key in ("outputs", "margins")}
    return out


def plain_runs(
    cfg: Config, verifier_dir: str, prompts: list[dict[str, Any]], token_prompts: list[list[int]]
) -> tuple[dict[int, dict[str, Any]], list[list[int]]]:
    """The baseline engine at every concurrency (timed and reference passes); with `evaluate.turns=both`, turn 2
    built from its own first answers at the lowest concurrency and measured as well. Returns the runs and the token
    prompts every engine decodes (turn 1 of every prompt, then turn 2)."""
    with engine_actor(cfg, engine_args(cfg, verifier_dir, None, 0)) as (actor, _):
        base = measure_levels(cfg, actor, token_prompts, prompts, reference=True)
        if cfg.evaluate.turns == "first":
            return base, token_prompts
        first_answers = base[min(base)]["reference"]["outputs"]
        second = second_turn_prompts(
            load_tokenizer(verifier_dir, cfg.verifier.trust_remote_code), prompts, first_answers
        )
        base2 = measure_levels(cfg, actor, second, prompts, turns=(2,), reference=True)
    return {c: concat_runs(base[c], base2[c]) for c in base}, token_prompts + second


def measure_all(
    cfg: Config,
    verifier_dir: str,
    drafter_dir: str,
    prompts: list[dict[str, Any]],
    token_prompts: list[list[int]],
    capture: dict[str, Any],
    capture_where: str,
    contract_prompts: list[list[int]] | None = None,
) -> dict[str, Any]:
    """Plain decoding, then each draft length; returns the rows, what vLLM resolved for the drafter, plain
    decoding's own batch-shape noise (`plain_noise_floor`) and the acceptance training predicted next to what vLLM
    measured (`predicted_vs_measured`), on `prompts` and on the validation split's `contract_prompts`."""
    check_serving_vllm(drafter_dir, capture)
    base, all_prompts = plain_runs(cfg, verifier_dir, prompts, token_prompts)
    turns = (1, 2) if cfg.evaluate.turns == "both" else (1,)
    n = len(prompts)  # all_prompts: turn 1 of every prompt, then (turns=both) turn 2 of every prompt
    labels = [
        {"prompt": prompts[i % n]["id"], "turn": 1 + i // n, "category": prompts[i % n]["category"]}
        for i in range(len(all_prompts))
    ]
    rows = [report.baseline_row(c, run) for c, run in base.items()]
    tie = identity.TIE_MARGIN_NATS[cfg.verifier.dtype]
    infos, contract_runs, measured = {}, {}, []
    for k in cfg.evaluate.num_speculative_tokens:
        args = engine_args(cfg, verifier_dir, drafter_dir, k)
        spec = run_engine(cfg, args, all_prompts, prompts, turns=turns, contract_prompts=contract_prompts)
        infos[k] = spec["speculative"]
        if "contract" in spec:
            contract_runs[k] = spec["contract"]["spec"]
        contract.check_vllm_aux_layers(infos[k]["aux_layer_ids"], capture, capture_where=capture_where)
        for c, run in spec["runs"].items():
            ref = base[c]["reference"]
            others = [base[o]["reference"]["outputs"] for o in base if o != c]
            items = identity.compare(run["outputs"], ref["outputs"], others, ref["margins"], tie_margin_nats=tie)
            measured.append((k, c, run, items))
        log(STAGE, "measured", num_speculative_tokens=k, **infos[k])
    measure_baseline_again(cfg, verifier_dir, all_prompts, prompts, rows, turns=turns)
    rechecked = fp32_recheck(cfg, verifier_dir, drafter_dir, all_prompts, prompts, turns, measured)
    rows += [report.spec_row(k, c, run, base[c], base[min(base)], items, labels) for k, c, run, items in measured]
    aux_ids = {k: info["aux_layer_ids"] for k, info in infos.items()}
    check = predicted_vs_measured(training_metrics(drafter_dir), rows, infos, contract_runs, cfg.evaluate.max_tokens)
    for item in (c for c in check if c["message"] and c["predicted_acceptance_length"] is not None):
        log(STAGE, "prediction_gap", num_speculative_tokens=item["num_speculative_tokens"], message=item["message"])
    low, high = base[min(base)]["reference"], base[max(base)]["reference"]
    floor = identity.noise_floor(low["outputs"], high["outputs"], low["margins"])
    return {
        "rows": rows,
        "vllm_speculative": infos,
        "vllm_aux_layer_ids": aux_ids,
        "predicted_vs_measured": check,
        "numerics_tie_margin_nats": tie,
        "fp32_recheck": rechecked,
        "plain_noise_floor": {
            "concurrency": [min(base), max(base)],
            "num_outputs": len(all_prompts),
            "differing": [{**labels[d["index"]], **d} for d in floor],
        },
    }


def check_serving_vllm(drafter_dir: str, capture: dict[str, Any]) -> None:
    """Before any engine starts: would the vLLM installed here misread the drafter (vllm_support.MEASURED)?"""
    version = contract.installed_vllm_version()
    assert version is not None, "the evaluate stage runs vLLM, so one is installed"
    contract.check_serving(
        storage.read_json(storage.join(drafter_dir, "config.json")),
        version,
        where=drafter_dir,
        num_hidden_layers=capture["num_hidden_layers"],
    )
