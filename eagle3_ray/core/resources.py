"""Whether the cluster can hold what a stage asks for, answered before the stage starts: one generate engine
replica, one training worker group. Ray itself waits forever for resources no node has and no node type
of the autoscaler can make (a STRICT_PACK group of 8 GPUs on a cluster of 4-GPU nodes, a GPU on a CPU cluster); a
stage instead fails with one line naming the resources and the config fields that ask for them.

The check places the stage's bundles as a placement group and removes it at once: on an autoscaling cluster the
pending group is also what makes the autoscaler start the nodes the stage needs (cluster.yaml's worker types scale
from zero), so the wait overlaps the scale-up the stage would wait for anyway.
"""

from __future__ import annotations

import time

from eagle3_ray.core import telemetry
from eagle3_ray.core.config import RunConfig, UserError
from eagle3_ray.core.raycluster import joins_cluster

# A local Ray started by the run has no autoscaler: what its nodes cannot hold now, nothing will add.
LOCAL_WAIT_S = 5.0


def ensure_schedulable(
    stage: str, bundles: list[dict[str, float]], strategy: str, fields: str, run: RunConfig
) -> float:
    """Wait until a placement group of `bundles` (`strategy`: PACK, STRICT_PACK, SPREAD) is placed, then remove it;
    returns the seconds it took. UserError naming `fields`, the config fields that set these bundles, after
    `run.resource_wait_s` on a cluster the run joins, or LOCAL_WAIT_S on a local Ray."""
    import ray

    bundles = [{k: v for k, v in b.items() if v} for b in bundles]
    local = not joins_cluster(run)
    start = time.monotonic()
    group = ray.util.placement_group(bundles, strategy=strategy)
    try:
        timeout = LOCAL_WAIT_S if local else run.resource_wait_s
        ready, _ = ray.wait([group.ready()], timeout=timeout)
    finally:
        ray.util.remove_placement_group(group)
    waited = time.monotonic() - start
    if not ready:
        where = "this local Ray" if local else f"the cluster after {timeout:.0f} s"
        totals = {k: v for k, v in ray.cluster_resources().items() if k in {r for b in bundles for r in b}}
        raise UserError(
            f"{stage} needs {_describe(bundles, strategy)} and {where} cannot hold it (its resources: {totals}); "
            f"set by {fields}"
            + ("" if local else "; no node type of the autoscaler makes such a node or none came (run.resource_wait_s)")
        )
    telemetry.log(stage, "resources_ready", bundles=len(bundles), strategy=strategy, waited_s=round(waited, 2))
    return waited


def _describe(bundles: list[dict[str, float]], strategy: str) -> str:
    shapes = sorted({tuple(sorted(b.items())) for b in bundles})
    text = " + ".join(f"{sum(1 for b in bundles if tuple(sorted(b.items())) == s)} x {dict(s)}" for s in shapes)
    return text + (" on one node" if strategy == "STRICT_PACK" else "")
