"""The generate stage against the vLLM engine it wraps, on identical prompts, in one call.

    python3 -m bench.gpu.generate_bench /tmp/verifiers/llama3-8b --out-lens 256,2048 --out $OUT/generate_bench.json
    python3 -m bench.gpu.generate_bench --summary $OUT/generate_bench.jsonl   # one line per row, a stage's tail
    .venv/bin/python -m bench.gpu.generate_bench --tiny --out /tmp/generate_bench/result.json   # CPU rehearsal

Prompts: the first turn (system + user) of `tiny_prompts` (the 200 builtin prompts), greedy, ignore_eos, so every
path generates exactly `out_len` tokens per prompt. Each measurement runs in a fresh process (one engine alive at a
time) and prints one `RESULT {json}` line:
  plain           vllm.LLM.generate, all prompts in one call, no capture
  plain_async     the plain engine as the stage drives it: vLLM's AsyncLLM (engine_loop.start_async_engine) fed
                  every prompt at once through the stage's RequestLoop, in this process, no Ray
  capture         the same engine + extract_hidden_states + the project's connector (include_output_tokens), one call,
                  its per-request files where the stage's go (engine.scratch_dir: /dev/shm when it has room)
  prefill         connector-level capture (max_tokens=1) of exactly the token ids stage_capture_only prefills: the
                  plain run's responses as the conversations' answers, templated as the stage's planner does
                  (the random verifier's text does not re-encode token for token, so its raw sequences would not do)
  stage_generate, stage_two_pass, stage_capture_only   the generate stage (Ray Data + EngineActor)
  stage_two_pass_overlap   two_pass with generate.two_pass_overlap (both engines at once, half the GPU each; on a GPU
                  give engine_kwargs.kv_cache_memory_bytes, with --set under --recipe)
  stage_<mode>@<method>   the stage row with generate.capture_method=<method> (forward, extract_hidden_states): both
                  side by side in one call, `--modes plain,stage_generate@extract_hidden_states,stage_generate@forward`
Rates exclude engine start (reported apart; an engine row's counts from before `import vllm`, as the stage's engine
actor's does, with `vllm_import_s` the import's share): engine rows time the generate() call and the capture files being
complete (`generate_s`: the call alone, files maybe still on their way); stage rows time from the first engine ready
(engines/*.json) to the last commit (parts/*.parquet), less the capture engine's start in two_pass; `total_wall_s`
is the stage's own wall, starts included. `--cpu-shares` adds each row's `cpu_cores`: where the machine's cores went
over the measured window (two_pass: its regeneration), per process of the measurement's tree (bench/gpu/cpu_shares.py).
"""

from __future__ import annotations

import argparse
import fcntl
import glob
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from eagle3_ray.core.config import apply_overrides, config_from_dict, load_config

GPU_ENGINE = {"gpu_memory_utilization": 0.85, "max_num_seqs": 256}
CPU_ENGINE = {"enforce_eager": True, "kv_cache_memory_bytes": 512 << 20, "max_num_seqs": 64}


def make_cfg(args, work: str, mode: str, out_len: int):
    """A row's config: the recipe's verifier and generate sections as a user runs them (`--recipe`), else the bench's
    own; `--set` overrides either, and the row then sets its mode and output length."""
    mode, _, method = mode.partition("@")  # a stage row `stage_<mode>@<generate.capture_method>`
    overlap = mode == "two_pass_overlap"
    if overlap:
        mode = "two_pass"
    run = {"storage_path": work, "name": f"{mode}{'-' + method if method else ''}-{out_len}", "num_cpus": args.num_cpus}
    if args.recipe:
        d = load_config(args.recipe, args.set).to_dict()
        d["run"] = {**d["run"], **run}
        d["verifier"]["path"] = args.model
    else:
        d = apply_overrides(
            {
                "run": run,
                "verifier": {
                    "path": args.model,
                    "dtype": args.dtype,
                    "max_model_len": args.max_model_len,
                    "aux_layer_ids": args.aux_layer_ids,
                },
                "generate": {
                    "engine_kwargs": args.engine_kwargs,
                    "num_gpus_per_worker": 0.0 if args.tiny else 1.0,
                    "num_cpus_per_replica": args.num_cpus_per_replica,
                    "units_in_flight": args.units_in_flight,
                    "capture_buffer_bytes": args.capture_buffer_bytes,
                    "writer_threads": args.writer_threads,
                    "max_batch_tokens": args.max_batch_tokens,
                    "shard_max_bytes": args.shard_max_bytes,
                },
            },
            args.set,
        )
    # every row: one greedy response of out_len tokens per prompt, as the plain rows generate
    d["generate"].update(mode=mode, max_tokens=out_len, ignore_eos=True, temperature=0.0, responses_per_prompt=1)
    if method:
        d["generate"]["capture_method"] = method
    # A row whose engine died measures nothing: it fails at the first death (the row records the error and the bench
    # goes on to the next) instead of Ray restarting the engine and retrying its units.
    d["generate"]["max_unit_attempts"] = 1
    d["generate"]["two_pass_overlap"] = overlap or d["generate"].get("two_pass_overlap", False)
    return config_from_dict(d)


def prompt_ids(args) -> tuple[list[list[dict]], list[list[int]]]:
    from transformers import AutoTokenizer

    from eagle3_ray.core.prompts import tiny_prompts

    tok = AutoTokenizer.from_pretrained(args.model)
    convs = []
    if args.recipe:  # the recipe's first builtin input (ShareGPT for the SmolLM2 recipes), first turns
        from eagle3_ray.ingest.sources import read_builtin

        source = next(i for i in make_cfg(args, args.work, "generate", 1).ingest.inputs if i.startswith("builtin:"))
        rows = read_builtin(source, max_rows=4 * args.num_prompts).rows
    else:
        rows = tiny_prompts(num_prompts=args.num_prompts)
    # under --recipe, as its ingest stage does: prompts over ingest.max_prompt_tokens and repeated conversations
    # (one id, one capture file) are left out
    from eagle3_ray.ingest.formats import conversation_id

    limit = make_cfg(args, args.work, "generate", 1).ingest.max_prompt_tokens if args.recipe else None
    ids, seen = [], set()
    for row in rows:
        first_user = next(i for i, m in enumerate(row["messages"]) if m["role"] == "user")
        conv = row["messages"][: first_user + 1]
        if conversation_id(conv) in seen:
            continue
        seen.add(conversation_id(conv))
        tokens = tok(
            tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True), add_special_tokens=False
        )
        if limit is None or len(tokens["input_ids"]) <= limit:
            convs.append(conv)
            ids.append(tokens["input_ids"])
        if len(convs) == args.num_prompts:
            break
    return convs, ids


def engine_child(args, mode: str, out_len: int) -> dict:
    """plain / capture / prefill through vllm.LLM with the stage's own engine arguments. Engine start counts from
    before vLLM is imported, as the stage's does (its engine actor imports vLLM when it starts the engine)."""
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    import_s = time.perf_counter() - t0
    from eagle3_ray.generate.engine import engine_kwargs, scratch_dir
    from eagle3_ray.generate.output import capture_contract

    cfg = make_cfg(args, args.work, "generate", out_len)
    contract = capture_contract(cfg, args.model)
    scratch = scratch_dir(cfg, f"bench-{mode}")  # where the stage's engine writes: /dev/shm when it has room
    kwargs = engine_kwargs(cfg, args.model, contract["layer_ids"], scratch, capture=not mode.startswith("plain"))
    llm = async_generate(kwargs) if mode == "plain_async" else LLM(**kwargs)
    start_s = time.perf_counter() - t0
    _, prompts = prompt_ids(args)
    if mode == "prefill":  # the ids stage_capture_only sends for these conversations
        prompts = capture_only_ids(args, out_len)
    paths = [os.path.join(scratch, f"req-{i:05d}.safetensors") for i in range(len(prompts))]
    capture = [
        {"kv_transfer_params": {"hidden_states_path": p, "include_output_tokens": mode == "capture"}} for p in paths
    ]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=1 if mode == "prefill" else out_len,
            ignore_eos=mode != "prefill",
            extra_args=None if mode.startswith("plain") else extra,
        )
        for extra in capture
    ]
    t0, started = time.perf_counter(), time.time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    generate_s = time.perf_counter() - t0  # the last request is out; its capture file may still be on its way
    num_bytes = 0 if mode.startswith("plain") else files_complete(paths)
    wall_s = time.perf_counter() - t0
    cpu = {"cpu_cores": args.sampler.cores(started, time.time())} if args.sampler else {}
    out_tokens = 0 if mode == "prefill" else sum(len(o.outputs[0].token_ids) for o in outs)
    if mode == "plain":
        seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
        Path(args.work, f"plain-{out_len}-sequences.json").write_text(json.dumps(seqs))
    shutil.rmtree(scratch, ignore_errors=True)
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "mode": mode,
        "out_len": out_len,
        "engine_start_s": start_s,
        "vllm_import_s": import_s,
        "wall_s": wall_s,
        "generate_s": generate_s,
        "scratch_dirs": [os.path.dirname(scratch)],
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "bytes_written": num_bytes,
        "output_tokens_per_s": out_tokens / wall_s,
        "tokens_per_s": (prompt_tokens + out_tokens) / wall_s,
        **cpu,
    }


def async_generate(kwargs: dict):
    """An object with LLM.generate's call for plain_async: the stage's AsyncLLM and RequestLoop
    (generate/engine_loop.py), every request submitted at once, the outputs back in prompt order."""
    import threading

    from eagle3_ray.generate.engine_loop import RequestLoop, start_async_engine

    loop = RequestLoop(start_async_engine(kwargs), on_death=lambda error: print(error, flush=True))

    def generate(prompts: list[dict], params: list, use_tqdm: bool = False) -> list:
        outs: dict[int, object] = {}
        done = threading.Event()

        def handler(i: int):
            def on_output(out) -> list:
                outs[i] = out
                if len(outs) == len(prompts):
                    done.set()
                return []

            return on_output

        loop.submit([(f"r{i}", p, sp, handler(i)) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))])
        done.wait()
        return [outs[i] for i in range(len(prompts))]

    return SimpleNamespace(generate=generate)


def files_complete(paths: list[str]) -> int:
    """Wait for every capture file (shared flock on its .lock = the writer is done); their total bytes."""
    for p in paths:
        if os.path.exists(p + ".lock"):
            with open(p + ".lock") as lock:
                fcntl.flock(lock, fcntl.LOCK_SH)
    return sum(os.path.getsize(p) for p in paths)


def stage_child(args, mode: str, out_len: int) -> dict:
    """The generate stage on the same prompts (capture_only: on the plain run's decoded responses)."""
    import ray

    from eagle3_ray.generate.stage import run

    row = f"stage_{mode}"
    cfg = make_cfg(args, args.work, mode, out_len)
    mode = cfg.generate.mode
    shutil.rmtree(cfg.run.run_dir, ignore_errors=True)
    write_ingest(cfg, args, mode, out_len)
    ray_dir = os.path.join(args.work, "ray")  # the actors' logs, read below: the driver may exit before Ray
    shutil.rmtree(ray_dir, ignore_errors=True)  # forwards an actor's last lines
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, _temp_dir=ray_dir)
    try:
        summary = run(cfg)
    finally:
        ray.shutdown()
    actor_logs = "".join(
        Path(p).read_text(errors="replace") for p in glob.glob(f"{ray_dir}/session_latest/logs/worker-*.out")
    )
    out = summary["path"]
    engines = [json.loads(Path(p).read_text()) for p in glob.glob(f"{out}/engines/*.json")]
    last_commit = max(os.path.getmtime(p) for p in glob.glob(f"{out}/parts/*.parquet"))
    ready = {e["kind"]: min(x["ready_time"] for x in engines if x["kind"] == e["kind"]) for e in engines}
    if mode == "two_pass" and not cfg.generate.two_pass_overlap:  # passes in turn: regeneration (plain engine
        # ready -> its last unit back) plus capture (its engine ready -> last part)
        wall_s = summary["run_first_pass"]["end_time"] - ready["plain"] + last_commit - ready["prefill"]
        window = (ready["plain"], summary["run_first_pass"]["end_time"])  # --cpu-shares: the regeneration
    else:
        wall_s = last_commit - min(ready.values())
        window = (min(ready.values()), last_commit)
    cpu = {"cpu_cores": args.sampler.cores(*window)} if args.sampler else {}
    conv = generate_table(out)
    if args.drop_shards:  # long outputs: 200 x 2048 tokens of an 8B model are ~14 GB of shards per measurement
        shutil.rmtree(f"{out}/shards", ignore_errors=True)
    out_tokens = sum(conv["num_response_tokens"]) if mode != "capture_only" else 0
    prompt_tokens = sum(len(i) for i in conv["input_ids"]) - out_tokens
    return {
        "mode": row,
        "out_len": out_len,
        "wall_s": wall_s,
        "total_wall_s": summary["run_wall_s"],
        "engine_start_s": [e["ready_time"] - e["start_time"] for e in engines],
        "prompt_tokens": prompt_tokens,
        "scratch_dirs": sorted({os.path.dirname(e["scratch"]) for e in engines}),
        "units": unit_timings(out),
        "unit_log": unit_log(actor_logs),
        "writer_threads": cfg.generate.writer_threads,
        "shard_max_bytes": cfg.generate.shard_max_bytes,
        "output_tokens": out_tokens,
        "captured_tokens": summary["captured_tokens"],
        "bytes_written": summary["shard_bytes"],
        "output_tokens_per_s": out_tokens / wall_s,
        "tokens_per_s": (prompt_tokens + out_tokens) / wall_s,
        "capture_stats": summary.get("capture_stats"),
        **cpu,
    }


def unit_timings(out: str) -> list[dict]:
    """Per unit: samples and when its part file landed, relative to the first engine ready (what the bench's wall
    spans), so a tail of commits after generation shows."""
    engines = [json.loads(Path(p).read_text()) for p in glob.glob(f"{out}/engines/*.json")]
    ready = min(e["ready_time"] for e in engines)
    return sorted(
        (
            {"unit": Path(p).stem, "committed_s": round(os.path.getmtime(p) - ready, 3)}
            for p in glob.glob(f"{out}/parts/*.parquet")
        ),
        key=lambda u: u["committed_s"],
    )


def generate_table(out: str) -> dict:
    import pyarrow.parquet as pq

    return pq.read_table(f"{out}/conversations.parquet", columns=["input_ids", "num_response_tokens"]).to_pydict()


def capture_only_convs(args, out_len: int) -> tuple[list[list[dict]], list[list[int]]]:
    """The prompts' conversations with the plain run's responses as their answers (what capture_only captures),
    and the prompts' ids."""
    from transformers import AutoTokenizer

    convs, ids = prompt_ids(args)
    tok = AutoTokenizer.from_pretrained(args.model)
    seqs = json.loads(Path(args.work, f"plain-{out_len}-sequences.json").read_text())
    return [
        c + [{"role": "assistant", "content": tok.decode(s[len(p) :], skip_special_tokens=True)}]
        for c, p, s in zip(convs, ids, seqs, strict=True)
    ], ids


def capture_only_ids(args, out_len: int) -> list[list[int]]:
    """The token ids the capture_only stage prefills for capture_only_convs (its planner's own templating)."""
    from eagle3_ray.generate.plan import chat_encoder, with_prefill_ids

    cfg = make_cfg(args, args.work, "capture_only", out_len)
    rows = [{"messages": c} for c in capture_only_convs(args, out_len)[0]]
    return [r["input_ids"] for r in with_prefill_ids(rows, cfg, chat_encoder(args.model, cfg))]


def write_ingest(cfg, args, mode: str, out_len: int) -> None:
    """ingest/{version}/conversations.parquet for the stage (what the ingest stage writes for these prompts)."""
    import pyarrow as pa

    from eagle3_ray.core import stage, storage
    from eagle3_ray.ingest.formats import conversation_id

    convs, ids = capture_only_convs(args, out_len) if mode == "capture_only" else prompt_ids(args)
    rows = [
        {
            "id": conversation_id(c),
            "messages": c,
            "source": f"bench:{i}",
            "num_turns": 1,
            "num_prompt_tokens": len(p),
        }
        for i, (c, p) in enumerate(zip(convs, ids, strict=True))
    ]
    out = stage.output_dir(cfg, "ingest")
    storage.write_parquet_atomic(storage.join(out, "conversations.parquet"), pa.Table.from_pylist(rows))
    storage.write_json_atomic(storage.join(out, "summary.json"), {"rows_ok": len(rows)})
    storage.mark_complete(out, {"rows_ok": len(rows)})
    storage.set_latest(cfg.run.run_dir, "ingest", out.rstrip("/").rsplit("/", 1)[1])


def run_child(args, mode: str, out_len: int) -> dict:
    """One measurement in a fresh process; its last `RESULT {json}` line is the answer."""
    cmd = [sys.executable, __file__, *sys.argv[1:], "--child", f"{mode}:{out_len}"]
    # the child's whole log (engine, Ray Data, the stage's unit_committed lines), written as it runs, beside the
    # results (a call cut short keeps it)
    # no `@` in the name (stage_generate@forward -> stage_generate-forward): files so named do not leave the GPU machine
    name = mode.replace("@", "-")
    log = Path(args.out or os.path.join(args.work, "out")).with_name(f"generate_bench-{name}-{out_len}.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True)
    proc.stdout = log.read_text(errors="replace")
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    result = (
        results[-1]
        if proc.returncode == 0 and results
        else {"mode": mode, "out_len": out_len, "error": f"exit {proc.returncode}"}
    )
    if "error" in result:
        sys.stdout.write(proc.stdout[-5000:])
    print("RESULT " + json.dumps(result), flush=True)
    if args.out:  # one line per measurement as it ends: a call cut short keeps what it measured
        with Path(args.out).with_suffix(".jsonl").open("a") as f:
            f.write(json.dumps(result) + "\n")
    return result


def unit_log(log: str) -> list[dict]:
    """The engine actors' `unit_committed` lines: per unit, seconds since its engine was ready when it arrived,
    got its capture bytes, finished its last request and committed (where a tail after the engine comes from), and
    the writer threads' seconds on its captures."""
    rows = []
    for line in log.splitlines():
        if "[eagle3 generate] unit_committed" in line:
            fields = dict(kv.split("=", 1) for kv in line.split("unit_committed", 1)[1].split())
            rows.append({k: v if k == "unit" else int(v) if v.isdigit() else float(v) for k, v in fields.items()})
    return sorted(rows, key=lambda r: r.get("committed_s", 0.0))


TAIL = ("requests_done_s", "last_connector_written_s", "last_captured_s", "last_prepared_s", "committed_s")


def summary(path: str) -> str:
    """The rows of a results file (.jsonl, as measured) one line each: rate, engine start, wall; under a stage row
    its tail after the first engine was ready (the latest over its units: last request out, last capture written by
    the connector, picked up by the actor's writers, prepared, committed) and the writers' seconds summed; with
    --cpu-shares, the busiest processes' average cores over the row's window."""
    lines = []
    for row in map(json.loads, Path(path).read_text().splitlines()):
        if "error" in row:
            lines.append(f"{row['mode']:<20}{row['out_len']:>6}  failed: {row['error']}")
            continue
        lines.append(
            f"{row['mode']:<20}{row['out_len']:>6}{row['tokens_per_s']:>10.0f} tok/s  wall "
            f"{row['wall_s']:.2f} s  engine start {row.get('engine_start_s')}"
        )
        units = row.get("unit_log") or []
        if units:
            tail = " ".join(f"{k} {max(u.get(k) or 0 for u in units):.3f}" for k in TAIL)
            spent = " ".join(f"{k} {sum(u.get(k) or 0 for u in units):.3f}" for k in ("capture_wait_s", "prepare_s"))
            lines.append(
                f"    {len(units)} units: {tail}; summed {spent}; longest connector step "
                f"{max(u.get('max_connector_step_s') or 0 for u in units):.3f} s"
            )
        if row.get("cpu_cores"):
            shares = {k: v for k, v in row["cpu_cores"].items() if k not in ("window_s", "total")}
            lines.append(
                f"    cores over {row['cpu_cores']['window_s']} s: total {row['cpu_cores']['total']}; "
                + ", ".join(f"{k} {v}" for k, v in list(shares.items())[:8])
            )
    return "\n".join(lines)


def ratios(results: list[dict], out_len: int) -> dict:
    """Target ratios between modes; a mode measured several times (--repeats) counts with its median run."""
    runs: dict[str, list[dict]] = {}
    for r in results:
        if r["out_len"] == out_len and "error" not in r:
            runs.setdefault(r["mode"], []).append(r)
    by = {m: sorted(rs, key=lambda r: r["tokens_per_s"])[len(rs) // 2] for m, rs in runs.items()}

    def ratio(a: str, b: str, key: str = "tokens_per_s") -> float | None:
        return by[a][key] / by[b][key] if a in by and b in by else None

    return {
        "capture_vs_plain": ratio("capture", "plain"),
        "plain_async_vs_plain": ratio("plain_async", "plain"),
        "stage_generate_vs_capture (>= 0.9)": ratio("stage_generate", "capture"),
        "stage_two_pass_vs_stage_generate (>= 1.25 at 2048)": ratio("stage_two_pass", "stage_generate"),
        "stage_two_pass_vs_stage_generate_total_wall": (
            by["stage_generate"]["total_wall_s"] / by["stage_two_pass"]["total_wall_s"]
        )
        if "stage_two_pass" in by and "stage_generate" in by
        else None,
        "stage_capture_only_vs_prefill (>= 0.9)": ratio("stage_capture_only", "prefill"),
        **{
            f"{m}_vs_plain (>= 0.8)": ratio(m, "plain")
            for m in ("stage_generate", "stage_two_pass", "stage_two_pass_overlap")
            if m in by
        },
        **{
            f"{m}_total_wall_vs_plain_with_start (<= 1.3)": by[m]["total_wall_s"]
            / (by["plain"]["engine_start_s"] + by["plain"]["wall_s"])
            for m in ("stage_generate", "stage_two_pass", "stage_two_pass_overlap")
            if m in by and "plain" in by
        },
        "stage_capture_only_tokens_vs_prefill (1: the same ids)": ratio(
            "stage_capture_only", "prefill", "prompt_tokens"
        ),
    }


def table(results: list[dict], out_lens: list[int]) -> str:
    lines = [f"{'mode':<20}{'out':>6}{'tok/s':>10}{'out tok/s':>11}{'wall_s':>9}{'start_s':>16}{'MB written':>12}"]
    for r in results:
        if "error" in r:
            lines.append(f"{r['mode']:<20}{r['out_len']:>6}  failed: {r['error']}")
            continue
        start = r["engine_start_s"]
        start = "+".join(f"{s:.0f}" for s in start) if isinstance(start, list) else f"{start:.1f}"
        lines.append(
            f"{r['mode']:<20}{r['out_len']:>6}{r['tokens_per_s']:>10.0f}{r['output_tokens_per_s']:>11.0f}"
            f"{r['wall_s']:>9.2f}{start:>16}{r['bytes_written'] / 1e6:>12.1f}"
        )
    for n in out_lens:
        lines.append(f"ratios at {n}: " + json.dumps({k: round(v, 3) for k, v in ratios(results, n).items() if v}))
    return "\n".join(lines)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="verifier directory (bench/gpu/make_verifier.py)")
    p.add_argument("--tiny", action="store_true", help="CPU rehearsal: build the tiny verifier, few prompts")
    p.add_argument(
        "--recipe",
        help="a YAML recipe: every row runs its verifier and generate sections unchanged (the row sets mode and output "
        "length), so the stage rows measure what the recipe gets; the bench's own generate options are then unused",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        help="section.field=value override of --recipe or of the bench's own config (repeatable), "
        "e.g. generate.capture_method=extract_hidden_states",
    )
    p.add_argument("--out-lens", default=None, help="comma-separated output lengths (default 256,2048; tiny 32,128)")
    p.add_argument("--num-prompts", type=int, default=None, help="default 200 (tiny: 24)")
    p.add_argument("--modes", default="plain,capture,prefill,stage_generate,stage_two_pass,stage_capture_only")
    p.add_argument("--aux-layer-ids", type=json.loads, default=None)
    p.add_argument("--engine-kwargs", type=json.loads, default=None, help="JSON for vllm.LLM, on top of the defaults")
    p.add_argument("--units-in-flight", type=int, default=64)
    p.add_argument("--capture-buffer-bytes", type=int, default=None, help="default 48 GiB on GPU, 2 GiB on CPU")
    p.add_argument("--max-batch-tokens", type=int, default=16384)
    p.add_argument("--shard-max-bytes", type=int, default=1 << 30, help="generate.shard_max_bytes of the stage")
    p.add_argument("--drop-shards", action="store_true", help="delete each stage run's shards once measured (disk)")
    p.add_argument("--writer-threads", type=int, default=4, help="generate.writer_threads of the stage")
    p.add_argument("--num-cpus", type=int, default=None, help="Ray's CPUs (default 16 on GPU, 8 on CPU)")
    p.add_argument(
        "--num-cpus-per-replica",
        type=float,
        default=None,
        help="the engine actor's CPUs = its torch threads (Ray sets OMP_NUM_THREADS), which the writer's "
        "stats and encoding use; default 8 on GPU, 1 on CPU (where vLLM's own worker needs the cores)",
    )
    p.add_argument("--repeats", type=int, default=1, help="measure every mode this many times; ratios use medians")
    p.add_argument("--work", default="/tmp/generate_bench")
    p.add_argument("--out", help="write all results as JSON here")
    p.add_argument("--summary", metavar="JSONL", help="print the rows of a results file (--out's .jsonl) and exit")
    p.add_argument(
        "--cpu-shares",
        action="store_true",
        help="each row's `cpu_cores`: average cores per process of the measurement's process tree (engine "
        "processes; in stage rows Ray's too) over its measured window (bench/gpu/cpu_shares.py)",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.summary:
        print(summary(args.summary))
        sys.exit(0)
    if args.tiny and not args.model:
        from eagle3_ray.core.tiny_verifier import build_tiny_verifier

        args.model = str(build_tiny_verifier("llama", f"{args.work}/tiny-llama"))
    if not args.model:
        p.error("a verifier directory, or --tiny")
    args.out_lens = [int(x) for x in (args.out_lens or ("32,128" if args.tiny else "256,2048")).split(",")]
    args.num_prompts = args.num_prompts or (24 if args.tiny else 200)
    args.aux_layer_ids = args.aux_layer_ids or ([1, 3, 4] if args.tiny else None)
    args.num_cpus = args.num_cpus or (8 if args.tiny else 16)
    args.num_cpus_per_replica = args.num_cpus_per_replica or (1.0 if args.tiny else 8.0)
    args.dtype = "bfloat16"
    args.max_model_len = max(args.out_lens) + 512
    args.engine_kwargs = {**(CPU_ENGINE if args.tiny else GPU_ENGINE), **(args.engine_kwargs or {})}
    args.capture_buffer_bytes = args.capture_buffer_bytes or ((2 << 30) if args.tiny else (48 << 30))
    return args


def main() -> None:
    args = parse_args()
    os.makedirs(args.work, exist_ok=True)
    if args.child:
        args.sampler = None  # --cpu-shares: this measurement's cpu_shares.CpuSampler
        if args.cpu_shares:
            from cpu_shares import CpuSampler

            args.sampler = CpuSampler()
        mode, out_len = args.child.split(":")
        fn = stage_child if mode.startswith("stage_") else engine_child
        result = fn(args, mode.removeprefix("stage_"), int(out_len))
        print("RESULT " + json.dumps(result), flush=True)
        return
    modes = args.modes.split(",")
    # --repeats: the modes in turn, round after round, so a slow spell of a shared machine hits every mode alike
    results = [run_child(args, m, n) for n in args.out_lens for _ in range(args.repeats) for m in modes]
    report = table(results, args.out_lens)
    print(report)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(
            json.dumps(
                {
                    "results": results,
                    "ratios": {n: ratios(results, n) for n in args.out_lens},
                    "table": report,
                    "args": {k: v for k, v in vars(args).items() if k != "child"},
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
