"""Joining or starting Ray for a stage: one place that decides, so every stage behaves the same under `python`,
under `ray job submit` (RAY_ADDRESS is set for the entrypoint) and inside tests (Ray already initialised)."""

from __future__ import annotations

import os

import ray

from eagle3_ray.core.config import RunConfig

# Ray Train's dashboard view is empty without state tracking; Ray Data / Train propagate these to their workers.
DEFAULT_ENV = {"RAY_TRAIN_ENABLE_STATE_TRACKING": "1"}


def joins_cluster(run: RunConfig) -> bool:
    """True when the run joins a cluster (`run.ray_address`, or RAY_ADDRESS under `ray job submit`), which may have
    an autoscaler; False for a local Ray that this process starts (or a test started), which has none."""
    return bool(run.ray_address or os.environ.get("RAY_ADDRESS"))


def ensure_ray(run: RunConfig) -> None:
    """Initialise Ray once: join `run.ray_address` or the job's cluster, else start a local one.

    A plain `ray.init()` would join the newest cluster that `ray start` made on this machine (its address sits in
    /tmp/ray), which is never what a local run means; `address="local"` starts a fresh one."""
    for key, value in DEFAULT_ENV.items():
        os.environ.setdefault(key, value)
    if ray.is_initialized():
        return
    runtime_env = {"env_vars": dict(DEFAULT_ENV)}
    if joins_cluster(run):
        ray.init(address=run.ray_address or os.environ["RAY_ADDRESS"], runtime_env=runtime_env, log_to_driver=True)
    else:
        ray.init(address="local", num_cpus=run.num_cpus, runtime_env=runtime_env, log_to_driver=True)
