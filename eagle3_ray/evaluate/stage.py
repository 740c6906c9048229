"""Evaluate stage: decode held-out prompts in vLLM without speculation and with the exported drafter, measure
acceptance and throughput, and gate deployment on the result.

    python ray_jobs/evaluate.py ray_jobs/configs/tiny_cpu.yaml evaluate.min_speedup=1.1

Engines run one at a time, each in its own Ray actor (its memory and Prometheus counters die with it): one baseline
engine serves every concurrency level, then one engine per `num_speculative_tokens` value. A concurrency level c is
measured by submitting the prompts in waves of c requests (temperature 0, `max_tokens`), so each wave decodes c
sequences together. Writes `evaluate/{version}/results.json`, `report.md` and two PNG plots.

The version hashes only what the measurement depends on, not the gate's thresholds: re-running with other
thresholds re-applies the gate to the stored results without starting an engine. A miss raises `DeployGateError`
(the job exits non-zero) unless `evaluate.report_only`.
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from eagle3_ray.core import contract, stage, storage, verifiers
from eagle3_ray.core.config import Config, UserError, config_from_dict, versioned
from eagle3_ray.core.prompts import tiny_prompts
from eagle3_ray.core.telemetry import log
from eagle3_ray.evaluate import report
from eagle3_ray.generate.engine import with_cpu_rotary_fix
from eagle3_ray.ingest import sources
from eagle3_ray.ingest.formats import conversation_id

STAGE = "evaluate"
# Largest |measured - predicted| mean acceptance length not flagged. The replay matched vLLM to 0.004 on the tiny
# run's own validation prompts and to 0.015 on held-out ones; a contract fault (wrong aux ids, a dropped
# norm flag) costs far more than 0.15 (2.22 vs 1.59 with the old per-position estimate).
PREDICTION_TOLERANCE = 0.15
SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}


class DeployGateError(RuntimeError):
    """The drafter missed the deploy gate: the message is the summary table and every missed threshold."""


class EngineBench:
    """Ray actor around one vLLM engine: greedy decoding of token-id prompts at a given concurrency."""

    def __init__(self, engine_args: dict[str, Any], cfg_dict: dict[str, Any]):
        from vllm import LLM

        args, self.local_drafter = local_engine_args(engine_args, config_from_dict(cfg_dict))
        self.llm = LLM(**args)

    def speculative_info(self) -> dict[str, Any]:
        """What the engine resolved for the drafter: its architecture and the verifier layers it feeds it."""
        ids = contract.vllm_aux_layer_ids(self.llm)
        spec = self.llm.llm_engine.vllm_config.speculative_config
        return {
            "method": spec.method,
            "architectures": list(spec.draft_model_config.hf_config.architectures),
            "aux_layer_ids": list(ids) if ids is not None else None,
            "drafter_flags": contract.vllm_drafter_flags(self.llm),
        }

    def _spec_counters(self) -> dict[str, Any]:
        from vllm.v1.metrics.reader import Counter, Vector

        totals: dict[str, Any] = {name: 0 for name in SPEC_COUNTERS.values()}
        totals["accepted_per_pos"] = []
        for m in self.llm.get_metrics():
            if isinstance(m, Counter) and m.name in SPEC_COUNTERS:
                totals[SPEC_COUNTERS[m.name]] += m.value
            elif isinstance(m, Vector) and m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                pos = totals["accepted_per_pos"]
                totals["accepted_per_pos"] = [a + b for a, b in zip(pos + [0] * len(m.values), m.values, strict=False)]
        return totals

    def measure(self, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict[str, Any]:
        """Outputs (token ids per prompt), wall time and the spec-decode counter increments of this run."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        self.llm.generate(
            [{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False
        )  # warm-up: first-call allocations are not throughput
        before = self._spec_counters()
        outputs: list[list[int]] = []
        start = time.perf_counter()
        for i in range(0, len(prompts), concurrency):
            wave = [{"prompt_token_ids": p} for p in prompts[i : i + concurrency]]
            outputs += [list(o.outputs[0].token_ids) for o in self.llm.generate(wave, params, use_tqdm=False)]
        wall_s = time.perf_counter() - start
        after = self._spec_counters()
        spec = {k: after[k] - before[k] for k in SPEC_COUNTERS.values()}
        prev = before["accepted_per_pos"] + [0] * len(after["accepted_per_pos"])
        spec["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], prev, strict=False)]
        return {"outputs": outputs, "wall_s": wall_s, "spec": spec}

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        if self.local_drafter:
            shutil.rmtree(self.local_drafter, ignore_errors=True)


def local_engine_args(engine_args: dict[str, Any], cfg: Config) -> tuple[dict[str, Any], str | None]:
    """The engine's files on the node this actor runs on, which need not be the driver's: a drafter on an object
    store is copied here (vLLM reads local directories), a tiny verifier missing here is built here. Returns the
    arguments and the drafter copy to delete afterwards (None when the drafter was already local)."""
    args = copy.deepcopy(engine_args)
    args["model"] = verifiers.verifier_dir_on_this_node(cfg.verifier.path, args["model"], cfg.verifier.dtype)
    spec, copied = args.get("speculative_config"), None
    if spec is not None and "://" in spec["model"]:
        spec["model"] = copied = _local_drafter(spec["model"])
    return args, copied


def load_prompts(cfg: Config) -> list[dict[str, Any]]:
    """Held-out conversations `{"id", "messages"}`: `evaluate.prompts` (JSONL or Parquet with `messages` or
    `prompt`) or the builtin eval split; the first `evaluate.num_prompts`, prompt turns only."""
    if cfg.evaluate.prompts is None:
        rows = tiny_prompts(split="eval", seed=cfg.run.seed)
        where = "builtin:tiny_prompts(split=eval)"
    else:
        rows, where = _read_rows(cfg.evaluate.prompts), cfg.evaluate.prompts
    if len(rows) < cfg.evaluate.num_prompts:
        raise ValueError(f"evaluate.num_prompts={cfg.evaluate.num_prompts} but {where} has {len(rows)} prompts")
    prompts = []
    for i, row in enumerate(rows[: cfg.evaluate.num_prompts]):
        messages = row.get("messages") or ([{"role": "user", "content": row["prompt"]}] if row.get("prompt") else None)
        if not messages or messages[-1]["role"] != "user":
            raise ValueError(f"{where} row {i}: needs `messages` ending with a user turn, or a `prompt` string")
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        prompts.append({"id": row.get("id") or conversation_id(messages), "messages": messages})
    return prompts


def _read_rows(uri: str) -> list[dict[str, Any]]:
    """Rows of `evaluate.prompts`. `builtin:mtbench|humaneval|tiny_prompts|sharegpt` come from the reader the ingest
    stage uses (ingest/sources.py): `{"id", "messages", "provenance": {package, version, file, row, record_id}}`,
    MT-Bench's also `"category"` and `"turns"` (every user turn; `messages` holds the first)."""
    if uri.startswith(sources.PREFIX):
        read = sources.read_builtin(uri, split="eval")
        if read.rejects:  # none in MT-Bench or HumanEval as shipped; said, never dropped silently
            log(STAGE, "prompt_rejects", source=uri, num_rejects=len(read.rejects), first=read.rejects[0]["detail"])
        return read.rows
    if uri.endswith(".parquet"):
        return storage.read_parquet(uri).to_pylist()
    if uri.endswith(".jsonl"):
        return [json.loads(line) for line in storage.read_bytes(uri).decode().splitlines() if line.strip()]
    raise UserError(f"evaluate.prompts={uri!r}: must be a .jsonl or .parquet file or builtin:<name>")


def check_held_out(prompts: list[dict[str, Any]], training_data_dir: str) -> dict[str, Any]:
    """Refuse prompts the drafter was trained on: same conversation id or same user text as a row of the training
    data (`conversations.parquet` of the generate stage, or in online mode of the ingest stage)."""
    uri = storage.join(training_data_dir, "conversations.parquet")
    table = storage.read_parquet(uri, columns=["id", "messages"])
    train_ids = set(table.column("id").to_pylist())
    train_texts = {m["content"] for msgs in table.column("messages").to_pylist() for m in msgs if m["role"] == "user"}
    overlap = [
        p["id"]
        for p in prompts
        if p["id"] in train_ids or any(m["content"] in train_texts for m in p["messages"] if m["role"] == "user")
    ]
    if overlap:
        raise UserError(
            f"{len(overlap)} evaluation prompt(s) were in the training data ({uri}), e.g. ids "
            f"{overlap[:5]}: evaluate on held-out prompts"
        )
    return {"num_train_conversations": len(train_ids), "training_data": training_data_dir}


def engine_args(cfg: Config, verifier_dir: str, drafter_dir: str | None, num_speculative_tokens: int) -> dict:
    args = dict(
        model=verifier_dir,
        dtype=cfg.verifier.dtype,
        max_model_len=cfg.verifier.max_model_len,
        trust_remote_code=cfg.verifier.trust_remote_code,
        seed=cfg.run.seed,
        disable_log_stats=False,
    )
    if drafter_dir is not None:
        args["speculative_config"] = {
            "method": "eagle3",
            "model": drafter_dir,
            "num_speculative_tokens": num_speculative_tokens,
        }
    args.update(cfg.evaluate.engine_kwargs)
    return with_cpu_rotary_fix(args, verifier_dir, cfg.verifier.trust_remote_code)


def run_engine(cfg: Config, args: dict[str, Any], prompts: list[list[int]]) -> dict[str, Any]:
    """Start one engine actor, measure every concurrency level, stop it. Returns aux ids and one run per level."""
    import ray

    actor_cls = ray.remote(num_cpus=cfg.evaluate.num_cpus_per_engine, num_gpus=cfg.evaluate.num_gpus_per_engine)
    actor = actor_cls(EngineBench).remote(args, cfg.to_dict())
    try:
        info = ray.get(actor.speculative_info.remote()) if "speculative_config" in args else None
        if info is not None:  # before measuring: a drafter this vLLM misreads measures nothing useful
            drafter = args["speculative_config"]["model"]
            contract.check_vllm_drafter_flags(
                info["drafter_flags"], storage.read_json(storage.join(drafter, "config.json")), where=drafter
            )
        runs = {c: ray.get(actor.measure.remote(prompts, c, cfg.evaluate.max_tokens)) for c in cfg.evaluate.concurrency}
        ray.get(actor.close.remote())
    finally:
        ray.kill(actor)
    return {"speculative": info, "runs": runs}


def measure_all(
    cfg: Config,
    verifier_dir: str,
    drafter_dir: str,
    token_prompts: list[list[int]],
    capture: dict[str, Any],
    capture_where: str,
) -> dict[str, Any]:
    """Plain decoding, then each draft length; returns the rows, what vLLM resolved for the drafter, and the
    acceptance training predicted next to what vLLM measured (`predicted_vs_measured`)."""
    check_serving_vllm(drafter_dir, capture)
    base = run_engine(cfg, engine_args(cfg, verifier_dir, None, 0), token_prompts)["runs"]
    rows = [report.baseline_row(c, run) for c, run in base.items()]
    infos = {}
    for k in cfg.evaluate.num_speculative_tokens:
        spec = run_engine(cfg, engine_args(cfg, verifier_dir, drafter_dir, k), token_prompts)
        infos[k] = spec["speculative"]
        contract.check_vllm_aux_layers(infos[k]["aux_layer_ids"], capture, capture_where=capture_where)
        rows += [report.spec_row(k, c, run, base[c], base[min(base)]) for c, run in spec["runs"].items()]
        log(STAGE, "measured", num_speculative_tokens=k, **infos[k])
    aux_ids = {k: info["aux_layer_ids"] for k, info in infos.items()}
    check = predicted_vs_measured(training_metrics(drafter_dir), rows, infos)
    for item in (c for c in check if c["flagged"]):
        log(STAGE, "prediction_gap", num_speculative_tokens=item["num_speculative_tokens"], message=item["message"])
    return {"rows": rows, "vllm_speculative": infos, "vllm_aux_layer_ids": aux_ids, "predicted_vs_measured": check}


def check_serving_vllm(drafter_dir: str, capture: dict[str, Any]) -> None:
    """Before any engine starts: would the vLLM installed here misread the drafter (contract.SERVING_VLLM)?"""
    version = contract.installed_vllm_version()
    assert version is not None, "the evaluate stage runs vLLM, so one is installed"
    contract.check_serving(
        storage.read_json(storage.join(drafter_dir, "config.json")),
        version,
        where=drafter_dir,
        num_hidden_layers=capture["num_hidden_layers"],
    )


def training_metrics(drafter_dir: str) -> dict[str, Any]:
    """The exported checkpoint's validation metrics: the export's summary.json, next to its speculators/ dir."""
    export_dir = drafter_dir.rstrip("/").rsplit("/", 1)[0]
    return storage.read_json(storage.join(export_dir, "summary.json"))["checkpoint"].get("metrics") or {}


def predicted_vs_measured(
    metrics: dict[str, Any], rows: list[dict[str, Any]], infos: dict[int, dict[str, Any]]
) -> list[dict[str, Any]]:
    """Per draft length: training's replay of vLLM's chain (acceptance.py) next to vLLM's measurement. A gap in
    mean acceptance length above PREDICTION_TOLERANCE is flagged as a likely contract problem, naming what to check."""
    out = []
    for k, info in infos.items():
        measured, measured_pos = report.measured_acceptance(rows, k)
        predicted = metrics.get(f"val_replay_acceptance_length_k{k}")
        item = {
            "num_speculative_tokens": k,
            "measured_acceptance_length": measured,
            "measured_per_position": measured_pos,
            "predicted_acceptance_length": predicted,
            "predicted_per_position": [metrics.get(f"val_replay_acc_k{k}_{j}") for j in range(k)],
            "gap": None if predicted is None else measured - predicted,
            "flagged": False,
            "message": None,
        }
        if predicted is None:
            item["message"] = (
                f"k={k}: no prediction: the checkpoint's validation has no "
                f"val_replay_acceptance_length_k{k} (trained with fewer ttt_steps, or before the "
                "replay existed)"
            )
        elif abs(item["gap"]) > PREDICTION_TOLERANCE:
            item.update(flagged=True, message=_gap_message(k, predicted, measured, info))
        out.append(item)
    return out


def _gap_message(k: int, predicted: float, measured: float, info: dict[str, Any]) -> str:
    return (
        f"k={k}: vLLM measured mean acceptance length {measured:.3f}, training's replay predicted {predicted:.3f} "
        f"(gap {measured - predicted:+.3f}, tolerance {PREDICTION_TOLERANCE}): likely a contract problem. Check "
        f"the aux layer ids vLLM feeds the drafter ({info['aux_layer_ids']}) against the capture, the drafter "
        f"flags as this vLLM reads them ({info['drafter_flags']}; contract.SERVING_VLLM), and that the "
        "prompts go through the verifier's chat template as in training; a held-out set unlike the training "
        "data also opens a gap"
    )


def _tokenize(verifier_dir: str, prompts: list[dict[str, Any]], trust_remote_code: bool) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(verifier_dir, trust_remote_code=trust_remote_code)
    return [
        list(tok.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=True, return_dict=False))
        for p in prompts
    ]


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
    held_out = check_held_out(prompts, stage.input_dir(cfg, "ingest" if cfg.train.source == "online" else "generate"))
    summary = stage.run(
        cfg,
        STAGE,
        version(cfg),
        lambda out: _measure(cfg, export_dir, prompts, held_out, out),
        inputs={"export": export_dir},
    )
    results = {**storage.read_json(storage.join(summary["path"], "results.json")), "version": summary["version"]}
    results["gate"] = gate(results["rows"], cfg)
    report.write(summary["path"], results)
    return _verdict(cfg, results)


def _measure(
    cfg: Config, export_dir: str, prompts: list[dict[str, Any]], held_out: dict[str, Any], out_dir: str
) -> dict[str, Any]:
    from eagle3_ray.core.raycluster import (
        ensure_ray,  # imports ray: only where engines start (ray reads auth at import)
    )

    ensure_ray(cfg.run)
    capture_where = storage.join(export_dir, "capture.json")
    capture = storage.read_json(capture_where)
    verifier_dir = verifiers.verifier_dir(cfg)
    drafter_dir = storage.join(export_dir, "speculators")  # each engine actor copies it to its own node
    contract.check_dir(drafter_dir, capture, verifier_dir, capture_where=capture_where)
    token_prompts = _tokenize(verifier_dir, prompts, cfg.verifier.trust_remote_code)
    log(STAGE, "measure", num_prompts=len(prompts), drafter=drafter_dir)
    results = {
        "verifier_path": verifier_dir,
        "export_dir": export_dir,
        "drafter_dir": drafter_dir,
        "held_out": held_out,
        "prompt_ids": [p["id"] for p in prompts],
        "max_tokens": cfg.evaluate.max_tokens,
        "capture_aux_layer_ids": capture["aux_layer_ids"],
        **measure_all(cfg, verifier_dir, drafter_dir, token_prompts, capture, capture_where),
    }
    storage.write_json_atomic(storage.join(out_dir, "results.json"), results)
    return {"num_prompts": len(prompts), "drafter_dir": drafter_dir}


def _local_drafter(uri: str) -> str:
    """A drafter on an object store (or a `file://` URI) copied to this node's temp dir."""
    local = Path(tempfile.mkdtemp(prefix="eagle3-drafter-"))
    for name in ("config.json", "model.safetensors"):
        (local / name).write_bytes(storage.read_bytes(storage.join(uri, name)))
    return str(local)


def _min_speedup(cfg: Config, concurrency: int) -> float | None:
    threshold = cfg.evaluate.min_speedup
    return threshold.get(concurrency) if isinstance(threshold, dict) else threshold


def gate(rows: list[dict[str, Any]], cfg: Config) -> dict[str, Any]:
    """A draft length passes when every concurrency meets its thresholds and, if required, greedy outputs are
    identical; the drafter passes when some draft length does. The recommended length has the best worst speedup."""
    misses: dict[int, list[str]] = {}
    for row in (r for r in rows if r["num_speculative_tokens"]):
        k, c = row["num_speculative_tokens"], row["concurrency"]
        reasons = misses.setdefault(k, [])
        need = _min_speedup(cfg, c)
        if need is not None and row["speedup"] < need:
            reasons.append(f"k={k} c={c}: speedup {row['speedup']:.3f} < min_speedup {need}")
        need = cfg.evaluate.min_acceptance_length
        if need is not None and row["mean_acceptance_length"] < need:
            reasons.append(
                f"k={k} c={c}: mean acceptance length {row['mean_acceptance_length']:.3f} "
                f"< min_acceptance_length {need}"
            )
        # One request at a time, a difference is most likely speculation's; but verification scores k+1 tokens per
        # step where plain decoding scores one, so a verifier that is not batch-invariant (near-tied logits, MoE
        # routing near ties) can differ without a defect. The message says which the evidence points to: whether
        # plain decoding alone changes outputs between concurrency levels.
        if cfg.evaluate.require_identical_outputs and c == 1 and row["num_mismatched_outputs"]:
            reasons.append(
                f"k={k} c={c}: {row['num_mismatched_outputs']} greedy output(s) differ from plain decoding "
                f"(prompts {[m['prompt'] for m in row['mismatches'][:5]]}); {_identity_evidence(rows)}"
            )
    passing = [k for k, reasons in misses.items() if not reasons]
    worst = {k: min(r["speedup"] for r in rows if r["num_speculative_tokens"] == k) for k in passing}
    return {
        "passed": bool(passing),
        "passing_num_speculative_tokens": passing,
        "recommended_num_speculative_tokens": max(worst, key=worst.get) if worst else None,
        "misses": [m for reasons in misses.values() for m in reasons],
        "thresholds": {k: v for k, v in cfg.to_dict()["evaluate"].items() if k not in versioned(cfg.evaluate)},
    }


def _identity_evidence(rows: list[dict[str, Any]]) -> str:
    shifts = max((r.get("num_baseline_batch_mismatches", 0) for r in rows), default=0)
    levels = sorted({r["concurrency"] for r in rows})
    if len(levels) < 2:
        return "plain decoding ran at one concurrency only, so batch invariance is unknown"
    if shifts == 0:
        return (
            "plain decoding gives the same outputs at every concurrency: the verifier is batch-invariant here, "
            "so this points at speculation (drafter vocab mapping, verification)"
        )
    return (
        f"plain decoding alone changes {shifts} output(s) between concurrency levels {levels}: the verifier is "
        "not batch-invariant, so this may be batch-shape numerics (near-tied logits, MoE routing); "
        "evaluate.require_identical_outputs=false gates on speed and acceptance only"
    )


def _verdict(cfg: Config, results: dict[str, Any]) -> dict[str, Any]:
    table = report.summary_table(results)
    verdict = "PASS" if results["gate"]["passed"] else "FAIL"
    log(
        STAGE,
        "gate",
        verdict=verdict,
        report_only=cfg.evaluate.report_only,
        recommended_num_speculative_tokens=results["gate"]["recommended_num_speculative_tokens"],
    )
    print(table, flush=True)
    if not results["gate"]["passed"] and not cfg.evaluate.report_only:
        raise DeployGateError(
            f"deploy gate FAILED for drafter {results['drafter_dir']}:\n  - "
            + "\n  - ".join(results["gate"]["misses"])
            + "\n"
            + table
        )
    return {
        "version": results["version"],
        "passed": results["gate"]["passed"],
        "gate": results["gate"],
        "rows": results["rows"],
    }
