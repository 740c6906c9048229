"""The evaluate stage's Ray actor around one vLLM engine: greedy decoding of token-id prompts in waves of a given
concurrency, timed (`measure`) or with the top-2 logprobs (`reference`), and vLLM's spec-decode counters.

    actor = ray.remote(num_cpus=1)(EngineBench).remote(engine_args, cfg.to_dict())
    run = ray.get(actor.measure.remote(token_prompts, 4, 128, groups))  # outputs, wall_s, spec, groups

    with engine_actor(cfg, engine_args(cfg, verifier_dir, drafter_dir, k)) as (actor, info):  # started, then stopped
        ...

vLLM's spec-decode metrics are global counters, so what one group of prompts (a category, a turn) accepted is the
counters' increase over that group's waves: groups are decoded one after another and never share a wave.
"""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from eagle3_ray.core import contract, storage, verifiers, vllm_support
from eagle3_ray.core.config import Config, config_from_dict
from eagle3_ray.evaluate import identity
from eagle3_ray.evaluate.acceptance import add_per_position
from eagle3_ray.generate.engine import drafter_attention_env, with_cpu_rotary_fix

SPEC_COUNTERS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}


class EngineBench:
    """Ray actor around one vLLM engine: greedy decoding of token-id prompts at a given concurrency."""

    def __init__(self, engine_args: dict[str, Any], cfg_dict: dict[str, Any]):
        from vllm import LLM

        vllm_support.check_installed()
        cfg = config_from_dict(cfg_dict)
        # Every engine of the evaluation (with and without the drafter) on this node's attention path: decided
        # here, where the engine runs, before vLLM reads its environment.
        os.environ.update(drafter_attention_env(engine_args["model"], cfg.verifier.trust_remote_code))
        args, self.local_drafter = local_engine_args(engine_args, cfg)
        self.llm = LLM(**args)

    def speculative_info(self) -> dict[str, Any]:
        """What the engine resolved for the drafter: its architecture and the verifier layers it feeds it."""
        ids = vllm_support.eagle3_aux_layer_ids(self.llm)
        spec = self.llm.llm_engine.vllm_config.speculative_config
        return {
            "method": spec.method,
            "architectures": list(spec.draft_model_config.hf_config.architectures),
            "aux_layer_ids": list(ids) if ids is not None else None,
            "drafter_flags": contract.vllm_drafter_flags(self.llm),
        }

    def _spec_counters(self) -> dict[str, Any]:
        from eagle3_ray.core.vllm_support import MetricCounter, MetricVector

        totals: dict[str, Any] = {name: 0 for name in SPEC_COUNTERS.values()}
        totals["accepted_per_pos"] = []
        for m in self.llm.get_metrics():
            if isinstance(m, MetricCounter) and m.name in SPEC_COUNTERS:
                totals[SPEC_COUNTERS[m.name]] += m.value
            elif isinstance(m, MetricVector) and m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
                totals["accepted_per_pos"] = add_per_position(totals["accepted_per_pos"], m.values)
        return totals

    def _decode(self, prompts: list[list[int]], wave: list[int], params: Any, outputs: list[Any]) -> tuple[Any, float]:
        """One wave decoded together, its outputs stored at their prompt indices. Returns vLLM's outputs, seconds."""
        start = time.perf_counter()
        results = self.llm.generate([{"prompt_token_ids": prompts[i]} for i in wave], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        for i, r in zip(wave, results, strict=True):
            outputs[i] = list(r.outputs[0].token_ids)
        return results, seconds

    def measure(
        self, prompts: list[list[int]], concurrency: int, max_tokens: int, groups: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """Timed greedy decoding in waves of `concurrency` inside each group (stage.prompt_groups; None: one group
        of every prompt). Returns the outputs (token ids per prompt), wall time and spec-decode counter increments,
        in total and per group (`groups`: turn, category, wall_s, output_tokens, spec), and `per_request`: at
        concurrency 1, where a wave is one request, each request's own increments with its prompt and output tokens
        (None per prompt at any other concurrency)."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        self.llm.generate(
            [{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False
        )  # warm-up: first-call allocations are not throughput
        outputs: list[list[int]] = [[] for _ in prompts]
        per_request: list[dict[str, Any] | None] = [None for _ in prompts]
        measured = []
        first = before = self._spec_counters()
        for g in groups or [{"turn": 1, "category": None, "indices": list(range(len(prompts)))}]:
            wall_s, wave_start = 0.0, before
            for wave in waves(g["indices"], concurrency):
                wall_s += self._decode(prompts, wave, params, outputs)[1]
                if concurrency == 1:  # read after the timed wave; vLLM records a step's counters with its outputs
                    wave_end = self._spec_counters()
                    [i] = wave
                    per_request[i] = {
                        "prompt_tokens": len(prompts[i]),
                        "output_tokens": len(outputs[i]),
                        **counter_increments(wave_start, wave_end),
                    }
                    wave_start = wave_end
            after = self._spec_counters()  # read between groups, outside the timed waves
            measured.append(
                {
                    "turn": g["turn"],
                    "category": g["category"],
                    "wall_s": wall_s,
                    "output_tokens": sum(len(outputs[i]) for i in g["indices"]),
                    "spec": counter_increments(before, after),
                }
            )
            before = after
        wall_s = sum(g["wall_s"] for g in measured)
        return {
            "outputs": outputs,
            "wall_s": wall_s,
            "spec": counter_increments(first, before),
            "groups": measured,
            "per_request": per_request,
        }

    def reference(
        self, prompts: list[list[int]], concurrency: int, max_tokens: int, groups: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """The same waves as `measure`, untimed, with vLLM's top-2 logprobs: the outputs and, per prompt, the top-2
        margin (nats) at every output position (identity.top2_margin)."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2)
        outputs: list[list[int]] = [[] for _ in prompts]
        margins: list[list[float]] = [[] for _ in prompts]
        for g in groups or [{"indices": list(range(len(prompts)))}]:
            for wave in waves(g["indices"], concurrency):
                results, _ = self._decode(prompts, wave, params, outputs)
                for i, r in zip(wave, results, strict=True):
                    margins[i] = [
                        identity.top2_margin({t: lp.logprob for t, lp in pos.items()}) for pos in r.outputs[0].logprobs
                    ]
        return {"outputs": outputs, "margins": margins}

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        if self.local_drafter:
            shutil.rmtree(self.local_drafter, ignore_errors=True)


def counter_increments(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the spec-decode counters (`EngineBench._spec_counters`) grew by between two reads."""
    spec = {k: after[k] - before[k] for k in SPEC_COUNTERS.values()}
    spec["accepted_per_pos"] = add_per_position(after["accepted_per_pos"], [-x for x in before["accepted_per_pos"]])
    return spec


def waves(indices: list[int], concurrency: int) -> list[list[int]]:
    """Prompt indices cut into waves of `concurrency` requests (the last may be smaller)."""
    return [indices[i : i + concurrency] for i in range(0, len(indices), concurrency)]


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


def _local_drafter(uri: str) -> str:
    """A drafter on an object store (or a `file://` URI) copied to this node's temp dir."""
    local = Path(tempfile.mkdtemp(prefix="eagle3-drafter-"))
    for name in ("config.json", "model.safetensors"):
        (local / name).write_bytes(storage.read_bytes(storage.join(uri, name)))
    return str(local)


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
