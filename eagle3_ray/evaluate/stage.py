"""Evaluate stage: decode held-out prompts in vLLM without speculation and with the exported drafter, measure
acceptance and throughput, recommend a draft length per concurrency, and gate deployment on the result.

    python ray_jobs/evaluate.py ray_jobs/configs/tiny_cpu.yaml evaluate.min_speedup=1.1

Engines run one at a time, each in its own Ray actor (engine.py; its memory and Prometheus counters die with it): one
baseline engine serves every concurrency level, then one engine per `num_speculative_tokens` value. A concurrency
level c is measured by submitting the prompts in waves of c requests (temperature 0, `max_tokens`), so each wave
decodes c sequences together. Prompts with a `category` are decoded category by category (a wave never mixes two),
each timed and its spec-decode counters diffed on its own, at every level that each category can fill
(`prompt_groups`). The baseline engine decodes every level twice: a timed pass, then the same waves untimed with the
top-2 logprobs, the reference that greedy identity is judged against (identity.py); logprobs stay out of the timed
pass so that they do not slow the baseline. With `evaluate.turns=both` the baseline engine then builds each prompt's
second turn after its own first answer (the reference pass at the lowest concurrency), and every engine decodes
those same token ids as turn 2.

Writes `evaluate/{version}/results.json`, `report.md`, two PNG plots, and the serving config with the recommended k
(`speculative_config.json`, `serve.sh`: core/serving.py). The version hashes only what the
measurement depends on, not the gate's thresholds: re-running with other thresholds re-applies the gate (gate.py) to
the stored results without starting an engine. A miss raises `DeployGateError` (the job exits non-zero) unless
`evaluate.report_only`.

Where each part lives: prompts.py (the held-out and validation prompts, their token ids, the groups decoded
together), measure.py (engines one after another, every level), engine.py (one engine's actor), identity.py and
recheck.py (greedy identity, the float32 recheck), prediction.py (training's estimate against the measurement),
gate.py (recommended k, the deploy gate), report.py (rows, report.md, plots).
"""

from __future__ import annotations

from typing import Any

from eagle3_ray.core import contract, serving, stage, storage, verifiers
from eagle3_ray.core.config import Config, versioned
from eagle3_ray.core.telemetry import log
from eagle3_ray.evaluate import gate, report
from eagle3_ray.evaluate.acceptance import context_warning
from eagle3_ray.evaluate.measure import measure_all
from eagle3_ray.evaluate.prompts import (
    chat_ids,
    check_held_out,
    check_second_turn_fits,
    load_prompts,
    load_tokenizer,
    training_conversations,
    validation_prompts,
)

STAGE = "evaluate"


class DeployGateError(RuntimeError):
    """The drafter missed the deploy gate: the message is the summary table and every missed threshold."""


def version(cfg: Config) -> str:
    prompt_ids = [p["id"] for p in load_prompts(cfg)]
    return storage.version_hash(
        "evaluate",
        versioned(cfg.evaluate),
        versioned(cfg.verifier),
        prompt_ids,
        cfg.run.seed,
        stage.version(cfg, "export"),
    )


def run(cfg: Config) -> dict[str, Any]:
    """Measure the exported drafter in vLLM (once per version), then apply the gate (every run: its thresholds are
    not part of the version) and write the report."""
    export_dir = stage.input_dir(cfg, "export")
    prompts = load_prompts(cfg)
    training_data_dir = stage.input_dir(cfg, "ingest" if cfg.train.source == "online" else "generate")
    conversations = training_conversations(training_data_dir)
    held_out = check_held_out(prompts, training_data_dir, conversations)
    own = validation_prompts(cfg, training_data_dir, conversations)
    context = training_context(cfg, training_data_dir)
    if context["warning"]:
        log(STAGE, f"warning: {context['warning']}")
    summary = stage.run(
        cfg,
        STAGE,
        version(cfg),
        lambda out: _measure(cfg, export_dir, prompts, held_out, own, out),
        inputs={"export": export_dir},
    )
    results = {
        **storage.read_json(storage.join(summary["path"], "results.json")),
        "version": summary["version"],
        "report_dir": summary["path"],  # the job's last lines name its report.md
    }
    results["gate"] = gate.gate(results["rows"], cfg.evaluate)
    results["training_context"] = context
    results["serve"] = write_serving(cfg, summary["path"], results)  # the job's last lines name it
    report.write(summary["path"], results)
    return _verdict(cfg, results)


def training_context(cfg: Config, training_data_dir: str) -> dict[str, Any]:
    """`{"max_model_len", "longest_training_sequence": {"num_tokens", "source"}, "warning"}`: the context length the
    verifier serves against the longest sequence the drafter trained on, with acceptance.context_warning's line
    (None when serving stays within it). Checked on every run, like the gate: not part of the measurement."""
    longest = longest_training_sequence(cfg, training_data_dir)
    return {
        "max_model_len": cfg.verifier.max_model_len,
        "longest_training_sequence": longest,
        "warning": context_warning(cfg.verifier.max_model_len, longest),
    }


def longest_training_sequence(cfg: Config, training_data_dir: str) -> dict[str, Any]:
    """The longest sequence the drafter trained on, `{"num_tokens", "source"}`: the longest sample of the generate
    stage (manifest.parquet's `num_tokens`), or `train.total_seq_len` where that is shorter (packing cuts a sample
    there) or where no sample lengths are stored (online training captures as it trains)."""
    total = cfg.train.total_seq_len
    manifest = storage.join(training_data_dir, "manifest.parquet")
    if not storage.exists(manifest):
        return {"num_tokens": total, "source": "train.total_seq_len; online training stores no sample lengths"}
    longest = max(storage.read_parquet(manifest, columns=["num_tokens"]).column("num_tokens").to_pylist(), default=0)
    if longest > total:
        cut = f"train.total_seq_len, where packing cuts the longest sample of {manifest} ({longest} tokens)"
        return {"num_tokens": total, "source": cut}
    return {"num_tokens": longest, "source": f"the longest sample in {manifest}"}


def write_serving(cfg: Config, out_dir: str, results: dict[str, Any]) -> str:
    """speculative_config.json and serve.sh (core/serving.py) into this stage's output dir with the k the gate
    recommends for every load, and speculation off above the highest concurrency where that k was measured faster
    (speedup >= 1) when every higher level measured was slower. Returns serve.sh's path."""
    k = results["gate"]["recommended_num_speculative_tokens"]
    schedule = serving.speculation_schedule(results["rows"], k)
    spec = serving.speculative_config(results["drafter_dir"], k, schedule)
    how = f"k={k}, the one k the evaluation recommends for every load" + (
        f"; speculation off above {schedule[0][1]} concurrent requests, where it measured slower" if schedule else ""
    )
    return serving.write(cfg, out_dir, results["verifier_path"], spec, how)


def _measure(
    cfg: Config,
    export_dir: str,
    prompts: list[dict[str, Any]],
    held_out: dict[str, Any],
    own: list[dict[str, Any]],
    out_dir: str,
) -> dict[str, Any]:
    from eagle3_ray.core.raycluster import (
        ensure_ray,  # imports ray: only where engines start (ray reads auth at import)
    )

    capture_where = storage.join(export_dir, "capture.json")
    capture = storage.read_json(capture_where)
    verifier_dir = verifiers.verifier_dir(cfg)
    drafter_dir = storage.join(export_dir, "speculators")  # each engine actor copies it to its own node
    contract.check_dir(drafter_dir, capture, verifier_dir, capture_where=capture_where)
    tokenizer = load_tokenizer(verifier_dir, cfg.verifier.trust_remote_code)
    token_prompts = [chat_ids(tokenizer, p["messages"]) for p in prompts]
    own_tokens = [chat_ids(tokenizer, p["messages"]) for p in own]
    if cfg.evaluate.turns == "both":
        check_second_turn_fits(tokenizer, prompts, cfg)
    ensure_ray(cfg.run)
    log(STAGE, "measure", num_prompts=len(prompts), turns=cfg.evaluate.turns, drafter=drafter_dir)
    results = {
        "verifier_path": verifier_dir,
        "export_dir": export_dir,
        "drafter_dir": drafter_dir,
        "held_out": held_out,
        "prompt_ids": [p["id"] for p in prompts],
        "max_tokens": cfg.evaluate.max_tokens,
        "turns": cfg.evaluate.turns,
        "capture_aux_layer_ids": capture["aux_layer_ids"],
        "validation_prompt_ids": [p["id"] for p in own],
        **measure_all(cfg, verifier_dir, drafter_dir, prompts, token_prompts, capture, capture_where, own_tokens),
    }
    storage.write_json_atomic(storage.join(out_dir, "results.json"), results)
    return {"num_prompts": len(prompts), "drafter_dir": drafter_dir}


def _verdict(cfg: Config, results: dict[str, Any]) -> dict[str, Any]:
    table = report.summary_table(results)
    verdict = results["gate"]
    log(
        STAGE,
        "gate",
        verdict="PASS" if verdict["passed"] else "FAIL",
        report_only=cfg.evaluate.report_only,
        fastest_k=",".join(
            f"c{r['concurrency']}:k{r['num_speculative_tokens']}({r['speedup']:.2f}x)" for r in verdict["recommended"]
        ),
        recommended_num_speculative_tokens=verdict["recommended_num_speculative_tokens"],
    )
    print(table, flush=True)
    if not verdict["passed"] and not cfg.evaluate.report_only:
        raise DeployGateError(
            f"deploy gate FAILED for drafter {results['drafter_dir']}:\n  - "
            + "\n  - ".join(verdict["misses"])
            + "\n"
            + table
        )
    return {"version": results["version"], "passed": verdict["passed"], "gate": verdict, "rows": results["rows"]}
