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
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

from eagle3_ray.core import contract, serving, stage, storage, verifiers
from eagle3_ray.core.config import Config, UserError, versioned
from eagle3_ray.core.prompts import tiny_prompts
from eagle3_ray.core.telemetry import log
from eagle3_ray.evaluate import gate, identity, report
from eagle3_ray.evaluate.engine import SPEC_COUNTERS, EngineBench, add_per_position, waves
from eagle3_ray.evaluate.engine import local_engine_args as local_engine_args  # the stage's public name too
from eagle3_ray.generate.engine import with_cpu_rotary_fix
from eagle3_ray.ingest import sources
from eagle3_ray.ingest.formats import conversation_id

STAGE = "evaluate"
# Largest |measured - predicted| mean acceptance length not flagged. The replay meets vLLM within a few hundredths on
# a run's own validation prompts (docs/benchmarks.md#smollm2-drafter: validation against estimate); a contract fault
# (wrong aux ids, a dropped norm flag) costs far more.
PREDICTION_TOLERANCE = 0.15


class DeployGateError(RuntimeError):
    """The drafter missed the deploy gate: the message is the summary table and every missed threshold."""


def load_prompts(cfg: Config) -> list[dict[str, Any]]:
    """Held-out conversations `{"id", "messages", "category", "second_turn"}`: `evaluate.prompts` (JSONL or Parquet
    with `messages`, a `prompt` string or MT-Bench's `turns`, optionally `id` and `category`) or the builtin eval
    split; the first `evaluate.num_prompts`, prompt turns only. `second_turn` is `turns[1]` when
    `evaluate.turns=both`, else None."""
    if cfg.evaluate.prompts is None:
        rows = tiny_prompts(split="eval", seed=cfg.run.seed)
        where = "builtin:tiny_prompts(split=eval)"
    else:
        rows, where = _read_rows(cfg.evaluate.prompts), cfg.evaluate.prompts
    if len(rows) < cfg.evaluate.num_prompts:
        raise ValueError(f"evaluate.num_prompts={cfg.evaluate.num_prompts} but {where} has {len(rows)} prompts")
    prompts = []
    for i, row in enumerate(rows[: cfg.evaluate.num_prompts]):
        first = row.get("prompt") or (row.get("turns") or [None])[0]
        messages = row.get("messages") or ([{"role": "user", "content": first}] if first else None)
        if not messages or messages[-1]["role"] != "user":
            raise ValueError(f"{where} row {i}: needs `messages` ending with a user turn, a `prompt` or `turns`")
        messages = [{"role": m["role"], "content": m["content"]} for m in messages]
        second = None
        if cfg.evaluate.turns == "both":
            if len(row.get("turns") or []) < 2:
                raise ValueError(f"evaluate.turns=both: {where} row {i} has no second turn (`turns`: [first, second])")
            second = row["turns"][1]
        prompts.append(
            {
                "id": row.get("id") or conversation_id(messages),
                "messages": messages,
                "category": row.get("category"),
                "second_turn": second,
            }
        )
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


def training_conversations(training_data_dir: str) -> Any:
    """`id` and `messages` of the training data: `conversations.parquet` of the generate stage, or in online mode of
    the ingest stage."""
    return storage.read_parquet(storage.join(training_data_dir, "conversations.parquet"), columns=["id", "messages"])


def check_held_out(prompts: list[dict[str, Any]], training_data_dir: str, table: Any = None) -> dict[str, Any]:
    """Refuse prompts the drafter was trained on: same conversation id or same user text (a second turn included) as
    a row of the training data (`table`: training_conversations, read here when not given)."""
    uri = storage.join(training_data_dir, "conversations.parquet")
    table = training_conversations(training_data_dir) if table is None else table
    train_ids = set(table.column("id").to_pylist())
    train_texts = {m["content"] for msgs in table.column("messages").to_pylist() for m in msgs if m["role"] == "user"}
    overlap = [
        p["id"]
        for p in prompts
        if p["id"] in train_ids
        or any(m["content"] in train_texts for m in p["messages"] if m["role"] == "user")
        or p.get("second_turn") in train_texts
    ]
    if overlap:
        raise UserError(
            f"{len(overlap)} evaluation prompt(s) were in the training data ({uri}), e.g. ids "
            f"{overlap[:5]}: evaluate on held-out prompts"
        )
    return {"num_train_conversations": len(train_ids), "training_data": training_data_dir}


def validation_prompts(cfg: Config, training_data_dir: str, table: Any = None) -> list[dict[str, Any]]:
    """The first `evaluate.contract_prompts` conversations of the run's validation split (train/split.json, sorted
    ids), as prompts `{"id", "messages"}` up to their first user turn: training's replay estimate was computed on
    this split, so vLLM's acceptance on it checks the serving contract apart from any shift in the prompts.
    `table`: training_conversations, read here when not given."""
    if cfg.evaluate.contract_prompts == 0:
        return []
    split = storage.read_json(storage.join(stage.input_dir(cfg, "train"), "split.json"))
    wanted = split["val_ids"][: cfg.evaluate.contract_prompts]  # one (greedy) response per prompt: data.split_role
    table = training_conversations(training_data_dir) if table is None else table
    by_id = dict(zip(table.column("id").to_pylist(), table.column("messages").to_pylist(), strict=True))
    missing = [i for i in wanted if i not in by_id]
    if missing:
        raise ValueError(
            f"{len(missing)} validation id(s) of train/split.json are not in {training_data_dir}, e.g. {missing[:3]}: "
            "the training data changed after training"
        )
    prompts = []
    for i in wanted:
        messages = [{"role": m["role"], "content": m["content"]} for m in by_id[i]]
        first_user = next(j for j, m in enumerate(messages) if m["role"] == "user")
        prompts.append({"id": i, "messages": messages[: first_user + 1]})
    return prompts


def prompt_groups(
    prompts: list[dict[str, Any]], concurrency: int, *, turn: int = 1, offset: int = 0
) -> list[dict[str, Any]]:
    """Prompt indices (+ `offset`) to decode at `concurrency`, as `{"turn", "category", "indices"}` groups whose waves
    never mix two groups: one group per category (first-seen order) when every category holds at least `concurrency`
    prompts, so each category gets its own wall time and counters at full concurrency; else one group in prompt order
    (category None), as uncategorised prompts always are: MT-Bench's 10 per category cannot fill waves of 32."""
    by_category: dict[Any, list[int]] = {}
    for i, p in enumerate(prompts):
        by_category.setdefault(p.get("category"), []).append(i + offset)
    if None in by_category or min(len(v) for v in by_category.values()) < concurrency:
        by_category = {None: [i + offset for i in range(len(prompts))]}
    return [{"turn": turn, "category": c, "indices": indices} for c, indices in by_category.items()]


def level_groups(prompts: list[dict[str, Any]], concurrency: int, turns: tuple[int, ...]) -> list[dict[str, Any]]:
    """`prompt_groups` for token prompts that hold every prompt once per turn in `turns`, turn after turn."""
    n = len(prompts)
    return [g for i, t in enumerate(turns) for g in prompt_groups(prompts, concurrency, turn=t, offset=i * n)]


def _tokenizer(verifier_dir: str, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(verifier_dir, trust_remote_code=trust_remote_code)


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def tokenize_prompts(verifier_dir: str, prompts: list[dict[str, Any]], trust_remote_code: bool) -> list[list[int]]:
    """Each prompt's messages through the verifier's chat template, with the generation prompt: what vLLM decodes."""
    tokenizer = _tokenizer(verifier_dir, trust_remote_code)
    return [_chat_ids(tokenizer, p["messages"]) for p in prompts]


def second_turn_prompts(
    tokenizer: Any, prompts: list[dict[str, Any]], first_answers: list[list[int]]
) -> list[list[int]]:
    """MT-Bench's second turn: each conversation continued with the model's own first answer and the second user
    turn, `[...messages, assistant: answer, user: second_turn]`, through the verifier's chat template. The answer is
    decoded without special tokens (its end-of-turn token is the template's to write), as a chat client sends it
    back; an answer cut at `max_tokens` is sent as it is. Every engine decodes these same token ids."""
    return [
        _chat_ids(
            tokenizer,
            [
                *p["messages"],
                {"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)},
                {"role": "user", "content": p["second_turn"]},
            ],
        )
        for p, answer in zip(prompts, first_answers, strict=True)
    ]


def check_second_turn_fits(tokenizer: Any, prompts: list[dict[str, Any]], cfg: Config) -> None:
    """Before any engine starts: a second turn holds the first prompt, an answer of up to `max_tokens` and the
    second user turn, then decodes `max_tokens` more; refuse prompts whose bound exceeds `verifier.max_model_len`."""
    empty = second_turn_prompts(tokenizer, prompts, [[] for _ in prompts])
    need = {p["id"]: len(ids) + 2 * cfg.evaluate.max_tokens for p, ids in zip(prompts, empty, strict=True)}
    too_long = {pid: n for pid, n in need.items() if n > cfg.verifier.max_model_len}
    if too_long:
        raise ValueError(
            f"evaluate.turns=both: {len(too_long)} prompt(s) need more than verifier.max_model_len="
            f"{cfg.verifier.max_model_len} tokens (first prompt, its answer and the second turn's, each answer up to "
            f"evaluate.max_tokens={cfg.evaluate.max_tokens}), e.g. {dict(list(too_long.items())[:3])}: raise "
            "verifier.max_model_len or lower evaluate.max_tokens"
        )


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


@contextlib.contextmanager
def engine_actor(cfg: Config, args: dict[str, Any]) -> Iterator[tuple[Any, dict[str, Any] | None]]:
    """One engine actor for the block: yields it and, with a drafter, what vLLM resolved for the drafter (checked
    against the drafter's own flags before anything is measured); stops it afterwards."""
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
        yield actor, info
        ray.get(actor.close.remote())
    finally:
        ray.kill(actor)


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
        second = second_turn_prompts(_tokenizer(verifier_dir, cfg.verifier.trust_remote_code), prompts, first_answers)
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
    labels = [{"prompt": prompts[i % n]["id"], "turn": 1 + i // n} for i in range(len(all_prompts))]
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


def training_metrics(drafter_dir: str) -> dict[str, Any]:
    """The exported checkpoint's validation metrics: the export's summary.json, next to its speculators/ dir."""
    export_dir = drafter_dir.rstrip("/").rsplit("/", 1)[0]
    return storage.read_json(storage.join(export_dir, "summary.json"))["checkpoint"].get("metrics") or {}


def predicted_vs_measured(
    metrics: dict[str, Any],
    rows: list[dict[str, Any]],
    infos: dict[int, dict[str, Any]],
    contract_runs: dict[int, dict[str, Any]] | None = None,
    max_tokens: int | None = None,
) -> list[dict[str, Any]]:
    """Per draft length: training's replay of vLLM's chain (acceptance.py) next to vLLM's measurement on the
    evaluation prompts and, where `contract_runs` has the draft length (spec counters of the validation split's
    decode), on the prompts the replay was computed on. A shortfall beyond PREDICTION_TOLERANCE on the validation
    prompts, or on the evaluation prompts when there is no validation decode, is flagged as a likely contract problem
    naming what to check (a contract fault lowers acceptance); a shortfall on the evaluation prompts alone is
    reported as distribution shift, acceptance above the replay as a note. When the replay covered another number
    of response tokens than this decode (`max_tokens`: an evaluation run with another evaluate.max_tokens than
    training's), every message says so first: the two count different windows of each response."""
    window = metrics.get("val_replay_max_tokens")
    window_note = None
    if window is not None and max_tokens is not None and int(window) != max_tokens:
        window_note = (
            f"training's replay covered the first {int(window)} response tokens of each validation sample and "
            f"this evaluation decodes {max_tokens}: estimate and measurement count different windows (train with "
            f"evaluate.max_tokens={max_tokens} for an estimate of this one)"
        )
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
            "validation": None,
            "flagged": False,
            "message": None,
        }
        own = (contract_runs or {}).get(k)
        if own is not None:
            own_len = report.acceptance(own)["mean_acceptance_length"]
            item["validation"] = {
                "measured_acceptance_length": own_len,
                "measured_per_position": report.per_position(own),
                "gap": None if predicted is None else own_len - predicted,
            }
        if predicted is None:
            item["message"] = (
                f"k={k}: no prediction: the checkpoint's validation has no "
                f"val_replay_acceptance_length_k{k} (trained with fewer ttt_steps, or before the "
                "replay existed)"
            )
        elif own is not None:
            item.update(_validation_verdict(k, predicted, measured, own_len, info))
        elif item["gap"] < -PREDICTION_TOLERANCE:
            item.update(flagged=True, message=_gap_message(k, predicted, measured, info, "the evaluation prompts"))
        if window_note is not None and predicted is not None:
            item["message"] = "; ".join(m for m in (f"k={k}: {window_note}", item["message"]) if m)
        out.append(item)
    return out


def _validation_verdict(k: int, predicted: float, measured: float, own_len: float, info: dict[str, Any]) -> dict:
    """A contract fault (aux ids, drafter flags, chat template) lowers vLLM's acceptance on the very prompts the
    replay was computed on: only a shortfall there is flagged. Acceptance above the replay there is not a fault
    (the replay is conservative, or the decoded sample differs from the whole split); a shortfall on the evaluation
    prompts alone is distribution shift."""
    notes = []
    if own_len - predicted < -PREDICTION_TOLERANCE:
        return {"flagged": True, "message": _gap_message(k, predicted, own_len, info, "the run's validation prompts")}
    if own_len - predicted > PREDICTION_TOLERANCE:
        notes.append(
            f"k={k}: on the run's validation prompts vLLM accepted more than training's replay predicted "
            f"({own_len:.3f} vs {predicted:.3f}): not a contract fault, which lowers acceptance; the replay is "
            "conservative there, or the decoded prompts are a sample easier than the whole split"
        )
    if measured - predicted < -PREDICTION_TOLERANCE:
        notes.append(
            f"k={k}: distribution shift: on the run's validation prompts vLLM measured {own_len:.3f} against "
            f"training's replay {predicted:.3f}, so drafter and vLLM agree, but on the evaluation prompts it "
            f"measured {measured:.3f} (gap {measured - predicted:+.3f}): they are unlike the training data, and "
            "training's estimate does not carry over to them; train on prompts like them"
        )
    return {"flagged": False, "message": "; ".join(notes) or None}


def _gap_message(k: int, predicted: float, measured: float, info: dict[str, Any], where: str) -> str:
    return (
        f"k={k}: vLLM measured mean acceptance length {measured:.3f} on {where}, training's replay predicted "
        f"{predicted:.3f} (gap {measured - predicted:+.3f}, tolerance {PREDICTION_TOLERANCE}): likely a contract "
        f"problem. Check the aux layer ids vLLM feeds the drafter ({info['aux_layer_ids']}) against the capture, "
        f"the drafter flags as this vLLM reads them ({info['drafter_flags']}; vllm_support.MEASURED), and that the "
        "prompts go through the verifier's chat template as in training"
        + ("; a held-out set unlike the training data also opens a gap" if where == "the evaluation prompts" else "")
    )


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
    results["serve"] = write_serving(cfg, summary["path"], results)  # the job's last lines name it
    report.write(summary["path"], results)
    return _verdict(cfg, results)


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
    tokenizer = _tokenizer(verifier_dir, cfg.verifier.trust_remote_code)
    token_prompts = [_chat_ids(tokenizer, p["messages"]) for p in prompts]
    own_tokens = [_chat_ids(tokenizer, p["messages"]) for p in own]
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
