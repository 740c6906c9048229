"""Serving config: the speculative config and command line written next to a drafter, and when speculation is turned
off above a batch size."""

from __future__ import annotations

import json
import shlex

import pytest

from eagle3_ray.core import serving
from eagle3_ray.core.config import config_from_dict

pytestmark = pytest.mark.unit


def rows(k: int, speedups: dict[int, float]) -> list[dict]:
    return [{"num_speculative_tokens": k, "concurrency": c, "speedup": s} for c, s in speedups.items()]


def test_unmeasured_k_is_the_lower_middle_of_the_draft_lengths_to_evaluate():
    k = [
        serving.unmeasured_k(config_from_dict({"evaluate": {"num_speculative_tokens": ks}}))
        for ks in ([1, 2, 3], [3, 4], [3], [5, 3, 1, 7])
    ]
    assert k == [2, 3, 3, 3]


def test_speculation_is_turned_off_above_the_last_faster_concurrency_when_every_higher_one_is_slower():
    measured = rows(3, {1: 1.4, 8: 1.1, 32: 0.8, 64: 0.7}) + rows(2, {1: 0.5, 8: 0.5, 32: 1.2, 64: 1.2})
    assert serving.speculation_schedule(measured, 3) == [[1, 8, 3], [9, 9, 0]]


@pytest.mark.parametrize(
    "speedups",
    [{1: 1.4, 8: 1.1}, {1: 0.9, 8: 0.8}, {1: 0.9, 8: 1.2}, {1: 1.2, 8: 0.9, 32: 1.1}],
    ids=["faster everywhere", "slower everywhere", "slower at low load", "mixed"],
)
def test_no_batch_size_schedule_without_a_faster_then_slower_split(speedups):
    assert serving.speculation_schedule(rows(3, speedups), 3) is None


def test_engine_flags_carry_the_verifier_settings_and_the_evaluated_engine_kwargs():
    cfg = config_from_dict(
        {
            "verifier": {"max_model_len": 512, "dtype": "float32", "trust_remote_code": True},
            "evaluate": {
                "engine_kwargs": {
                    "enforce_eager": True,
                    "enable_prefix_caching": False,
                    "kv_cache_memory_bytes": 1 << 28,
                    "compilation_config": {"mode": 0},
                }
            },
        }
    )
    assert serving.engine_flags(cfg) == [
        "--max-model-len", "512", "--dtype", "float32", "--trust-remote-code", "--enforce-eager",
        "--no-enable-prefix-caching", "--kv-cache-memory-bytes", str(1 << 28), "--compilation-config", '{"mode": 0}',
    ]  # fmt: skip


def test_serve_sh_holds_the_vllm_serve_command_and_its_cpu_form_reads_back_as_argv(tmp_path):
    cfg = config_from_dict({"verifier": {"max_model_len": 512}})
    spec = serving.speculative_config("/runs/x/export/v1/speculators", 3, [[1, 4, 3], [5, 5, 0]])
    path = serving.write(cfg, str(tmp_path), "/models/verifier dir", spec, "k=3")
    assert json.loads((tmp_path / "speculative_config.json").read_text()) == {
        "method": "eagle3",
        "model": "/runs/x/export/v1/speculators",
        "num_speculative_tokens": 3,
        "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 5, 0]],
    }
    serve = [line for line in (tmp_path / "serve.sh").read_text().splitlines() if line.startswith("vllm serve")]
    tail = ["--speculative-config", json.dumps(spec), "--max-model-len", "512", "--dtype", "bfloat16"]
    assert shlex.split(serve[0]) == ["vllm", "serve", "/models/verifier dir", *tail, "$@"]
    cpu = serving.cpu_command(path)
    assert cpu == ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/verifier dir", *tail]
