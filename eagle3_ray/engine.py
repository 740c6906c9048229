"""The engine actor of the generate stage: one vLLM engine per replica that regenerates responses and captures the
verifier's hidden states in the same pass, then commits each work unit as shards plus one part file.

Our own actor class rather than `ray.data.llm`: its output rows drop the request's `kv_transfer_params`, so the
hidden-state file of a row cannot be found, and it cannot write shards before handing rows on.

A unit is committed when `parts/{unit_id}.parquet` exists: shards are written first (atomically, names derived from
the unit id), the part file last. A retried unit whose part already exists is not redone.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
import uuid
from typing import Any

import pyarrow as pa
import torch

from eagle3_ray import chat, shards, storage, telemetry
from eagle3_ray.config import Config, config_from_dict
from eagle3_ray.connector import CONNECTOR_MODULE, CONNECTOR_NAME
from eagle3_ray.tiny_verifier import verifier_dir_on_this_node

PART_SCHEMA = pa.schema([
    ("id", pa.string()), ("unit_id", pa.string()), ("status", pa.string()),  # status: "ok" or "rejected"
    ("reason", pa.string()), ("detail", pa.string()),
    ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8())),
    ("num_prompt_tokens", pa.int32()), ("num_response_tokens", pa.int32()),
    ("finish_reason", pa.string()), ("source", pa.string()),
    *[(f.name, f.type) for f in shards.MANIFEST_SCHEMA if f.name != "id"],
])
SUMMARY_KEYS = ("id", "unit_id", "status", "num_tokens", "num_bytes")


def engine_kwargs(cfg: Config, verifier_path: str, layer_ids: list[int], scratch_dir: str) -> dict[str, Any]:
    """Arguments for `vllm.LLM`: the verifier plus hidden-state capture through the project's connector."""
    gen = cfg.generate
    kwargs = dict(
        model=verifier_path, dtype=cfg.verifier.dtype, max_model_len=cfg.verifier.max_model_len,
        trust_remote_code=cfg.verifier.trust_remote_code, seed=cfg.run.seed,
        tensor_parallel_size=gen.tensor_parallel_size,
        speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layer_ids}}},
        kv_transfer_config={"kv_connector": CONNECTOR_NAME, "kv_connector_module_path": CONNECTOR_MODULE,
                            "kv_role": "kv_producer",
                            "kv_connector_extra_config": {"shared_storage_path": scratch_dir,
                                                          "allow_custom_save_path": True}},
    )
    if gen.tensor_parallel_size > 1:
        # GPU: workers are Ray actors inside the replica's placement group (captured from the engine actor). vLLM's
        # CPU build refuses the Ray executor ("current platform cpu does not support ray"): its TP workers are
        # processes of the engine actor, which still holds the replica's placement group.
        kwargs["distributed_executor_backend"] = "mp" if _cpu_platform() else "ray"
    kwargs.update(gen.engine_kwargs)
    return kwargs


def _cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def cpu_thread_binding(tensor_parallel_size: int, cpus: list[int]) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for TP workers of the CPU build: the allowed CPUs cut into one contiguous range
    per rank (vLLM's own "auto" wants one NUMA node per rank and asserts on a one-node machine); "nobind" when there
    are fewer CPUs than ranks."""
    if len(cpus) < tensor_parallel_size:
        return "nobind"
    per_rank = len(cpus) // tensor_parallel_size
    groups = [cpus[r * per_rank:(r + 1) * per_rank] for r in range(tensor_parallel_size)]
    groups[-1] += cpus[tensor_parallel_size * per_rank:]
    return "|".join(",".join(map(str, g)) for g in groups)


def prepare_engine_env(cfg: Config) -> None:
    """Environment the engine's own processes inherit; call right before `vllm.LLM`. A binding set by the user (or
    the job's runtime_env) is kept."""
    tp = cfg.generate.tensor_parallel_size
    if tp > 1 and _cpu_platform() and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(tp, sorted(os.sched_getaffinity(0)))


def _scratch_dir(out_dir: str) -> str:
    """Where vLLM writes per-request capture files: private to this actor incarnation, so replicas and restarts
    never collide. Local output dirs keep it beside the output; remote ones use the node's temp dir."""
    name = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    if "://" in out_dir:
        return tempfile.mkdtemp(prefix=f"eagle3-capture-{name}-")
    path = os.path.join(out_dir, "_scratch", name)
    os.makedirs(path, exist_ok=True)
    return path


class CaptureEngine:
    """Ray Data actor: `__init__` loads the engine once; `__call__` takes units (`unit_id`, `samples_json`) and
    returns one summary row per sample (SUMMARY_KEYS)."""

    def __init__(self, cfg_dict: dict[str, Any], verifier_path: str, layer_ids: list[int], out_dir: str):
        from transformers import AutoTokenizer
        from vllm import LLM

        self.cfg = config_from_dict(cfg_dict)
        verifier_path = verifier_dir_on_this_node(self.cfg.verifier.path, verifier_path, self.cfg.verifier.dtype)
        self.layer_ids, self.out_dir = layer_ids, out_dir
        self.scratch = _scratch_dir(out_dir)
        args = engine_kwargs(self.cfg, verifier_path, layer_ids, self.scratch)
        prepare_engine_env(self.cfg)
        try:
            self.llm = LLM(**args)
        except Exception as e:  # surfaced by the driver as the stage's error
            raise RuntimeError(f"generate: the vLLM engine failed to start (verifier {verifier_path}, "
                               f"engine_kwargs {self.cfg.generate.engine_kwargs}): {type(e).__name__}: {e}") from e
        self.tokenizer = AutoTokenizer.from_pretrained(verifier_path,
                                                       trust_remote_code=self.cfg.verifier.trust_remote_code)
        self.chat = chat.ChatEncoder(self.tokenizer, self.cfg.generate.enable_thinking)
        engine_procs = self._record_pids()
        threading.Thread(target=_exit_when_engine_dies, args=(engine_procs,), daemon=True).start()

    def _record_pids(self) -> list:
        """engines/<incarnation>.json: this actor's and its engine processes' pids, for operators (and the fault
        test) to find the engine of a replica. Returns the vLLM processes (EngineCore, workers)."""
        import psutil

        children = psutil.Process().children(recursive=True)
        info = {"pid": os.getpid(), "engine_pids": [p.pid for p in children], "scratch": self.scratch}
        storage.write_json_atomic(storage.join(self.out_dir, "engines", f"{os.path.basename(self.scratch)}.json"), info)
        telemetry.log("generate", "engine_ready", pid=os.getpid(), engine_pids=info["engine_pids"])
        return [p for p in children if "VLLM" in p.name() + " ".join(p.cmdline())]

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        rows: list[dict[str, Any]] = []
        for unit_id, samples_json in zip(batch["unit_id"], batch["samples_json"]):
            rows += self.process_unit(str(unit_id), json.loads(str(samples_json)))
        return {k: [r[k] for r in rows] for k in SUMMARY_KEYS}

    def process_unit(self, unit_id: str, samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
        part_uri = storage.join(self.out_dir, "parts", f"{unit_id}.parquet")
        if storage.exists(part_uri):  # a retry of a unit that committed before its actor died
            return _summaries(storage.read_parquet(part_uri).to_pylist(), {})
        runner = chat.TurnRunner(self.chat, self._generate, self.cfg, self.scratch, unit_id)
        records = runner.run(samples)
        shard_bytes = self._write_shards(unit_id, records)
        storage.write_parquet_atomic(part_uri, pa.Table.from_pylist(records, schema=PART_SCHEMA))
        shutil.rmtree(os.path.join(self.scratch, unit_id), ignore_errors=True)
        return _summaries(records, shard_bytes)

    def _generate(self, prompts: list[dict], params: list) -> list:
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            return self.llm.generate(prompts, params, use_tqdm=False)
        except EngineDeadError as e:
            # The engine process is gone and this LLM cannot recover. Exiting the actor process makes Ray restart
            # it (Ray Data actors: max_restarts=-1, max_task_retries=-1) and retry the unit on a fresh engine.
            telemetry.log("generate", "engine_dead", pid=os.getpid(), error=repr(e))
            os._exit(1)

    def _write_shards(self, unit_id: str, records: list[dict[str, Any]]) -> dict[str, int]:
        """Encode captured samples, group them by bytes, write each shard atomically; fill the manifest columns."""
        dtype = self.cfg.generate.hidden_states_dtype
        ok = [r for r in records if r["status"] == "ok"]
        encoded = [_encode(r["id"], r.pop("_hidden_states"), dtype) for r in ok]
        groups = shards.ShardPlan(self.cfg.generate.shard_max_bytes).split([shards.tensor_bytes(t) for t in encoded])
        shard_bytes: dict[str, int] = {}
        for j, group in enumerate(groups):
            name = f"{unit_id}-{j:04d}.safetensors"
            tensors = {k: v for i in group for k, v in encoded[i].items()}
            shard_bytes[name] = shards.write_shard(storage.join(self.out_dir, "shards", name), tensors,
                                                   metadata={"unit_id": unit_id})
            for i in group:
                hs = encoded[i][f"{ok[i]['id']}.hs"]
                ok[i].update(shard=name, key=ok[i]["id"], num_tokens=hs.shape[0], hidden_size=hs.shape[2],
                             dtype=str(hs.dtype).removeprefix("torch."), layer_ids=self.layer_ids)
        return shard_bytes


def _exit_when_engine_dies(procs: list, poll_s: float = 1.0) -> None:
    """vLLM's synchronous client can block forever when its EngineCore process is killed (its monitor shuts the
    output thread down without waking the waiting call), so the actor watches the processes itself and exits:
    Ray restarts it and retries the unit (Ray Data actors: max_restarts=-1, max_task_retries=-1)."""
    import psutil

    while True:
        for p in procs:
            try:
                alive = p.is_running() and p.status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                alive = False
            if not alive:
                telemetry.log("generate", "engine_dead", pid=os.getpid(), engine_pid=p.pid)
                os._exit(1)
        time.sleep(poll_s)


def _encode(key: str, hidden_states: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    if dtype == "float32":  # exact storage, for checks against a reference forward pass
        return {f"{key}.hs": hidden_states.float().contiguous()}
    return shards.encode_sample(key, hidden_states, dtype)


def _summaries(records: list[dict[str, Any]], shard_bytes: dict[str, int]) -> list[dict[str, Any]]:
    """One row per sample; a shard's bytes are counted once, on the first sample stored in it."""
    seen: set[str] = set()
    out = []
    for r in records:
        num_bytes = 0
        if r.get("shard") and r["shard"] not in seen:
            seen.add(r["shard"])
            num_bytes = shard_bytes.get(r["shard"], 0)
        out.append({"id": r["id"], "unit_id": r["unit_id"], "status": r["status"],
                    "num_tokens": r.get("num_tokens") or 0, "num_bytes": num_bytes})
    return out
