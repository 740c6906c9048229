"""Shared fixtures: one tiny verifier and one local Ray per test session (starting either is the slow part), with
every temporary file of Ray and vLLM inside pytest's temp dir, and Ray's token authentication on."""

from __future__ import annotations

import os
import secrets

import pytest


@pytest.fixture(scope="session", autouse=True)
def _isolated_env(tmp_path_factory):
    """Keep Ray's and vLLM's temporary files and caches in the session's temp dir; a fresh token for Ray auth."""
    base = tmp_path_factory.mktemp("env")
    token_path = base / "ray_auth_token"
    token_path.write_text(secrets.token_hex(32))
    values = {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token_path),
        "VLLM_CACHE_ROOT": str(base / "vllm_cache"),
        "HF_HOME": str(base / "hf_home"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_TRAIN_ENABLE_STATE_TRACKING": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    os.environ.pop("RAY_ADDRESS", None)
    yield values
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A 6-layer tiny Llama verifier (bf16) with a locally trained tokenizer and ChatML template."""
    from eagle3_ray.tiny_verifier import build_tiny_verifier

    return str(build_tiny_verifier("llama", tmp_path_factory.mktemp("verifiers") / "tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llama_fp32(tmp_path_factory) -> str:
    """The same tiny Llama in float32, for exact comparisons of captured hidden states."""
    from eagle3_ray.tiny_verifier import build_tiny_verifier

    return str(build_tiny_verifier("llama", tmp_path_factory.mktemp("verifiers") / "tiny-llama-fp32", dtype="float32"))


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory, _isolated_env):
    """One local Ray for the whole session: 8 logical CPUs (more than the 2 cores, so engine actors, train workers
    and Ray Data tasks can all be scheduled), temp dir inside pytest's, no dashboard (ports stay free)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=8, include_dashboard=False,
             _temp_dir=str(tmp_path_factory.mktemp("ray")),
             runtime_env={"env_vars": {k: v for k, v in _isolated_env.items() if not k.startswith("RAY_AUTH")}})
    yield ray
    ray.shutdown()
