"""The autoscaling test bed (tests/support/autoscaling.py), built from the repo's cluster.yaml, behaves as the
project's cluster does: jobs submitted with `ray job submit` start worker nodes from zero, idle nodes go away, a
killed node is declared dead and replaced while work still needs it, and all of it stays on 127.0.0.1 and inside
the test's temp dir."""

from __future__ import annotations

import json
import re
import sys
import time

import psutil
import pytest

pytestmark = [pytest.mark.e2e]

JOB = "tests/support/autoscaling_job.py"


def _nodes_used(logs: str) -> set[str]:
    [line] = re.findall(r"^NODES (.*)$", logs, flags=re.MULTILINE)
    return set(json.loads(line))


def _temp_dir_args(cluster) -> set[str]:
    """Every --temp-dir / --temp_dir / --session-dir value on the command lines of the bed's processes."""
    values = set()
    for proc in cluster.processes():
        try:
            cmdline = proc.cmdline()
        except psutil.NoSuchProcess:  # a worker that finished meanwhile
            continue
        for arg in cmdline:
            match = re.match(r"--(?:temp[-_]dir|session[-_]dir)=(.+)", arg)
            if match:
                values.add(match.group(1))
    return values


def test_a_job_starts_a_cpu_worker_from_zero_and_the_idle_node_goes_away(autoscaling_cluster):
    cluster = autoscaling_cluster
    assert cluster.workers() == [], "the bed must start with no worker node"
    start = time.monotonic()
    cluster.head.submit("scale-from-zero", sys.executable, JOB, "--tasks", "2", "--cpus", "1", "--task-s", "1")
    [node] = cluster.wait_for_workers(1, node_type="cpu_worker", timeout_s=60)
    scale_up_s = time.monotonic() - start
    assert node["node_ip"] == "127.0.0.1"
    assert cluster.non_loopback_listeners() == []
    temp_dirs = _temp_dir_args(cluster)
    assert temp_dirs and all(d.startswith(str(cluster.temp_dir)) for d in temp_dirs), temp_dirs

    cluster.head.wait("scale-from-zero", {"SUCCEEDED"}, timeout_s=60)
    assert _nodes_used(cluster.head.logs("scale-from-zero")) == {node["node_id"]}
    finished = time.monotonic()
    cluster.wait_for_workers(0, timeout_s=30)
    print(f"scale-up {scale_up_s:.1f} s, scale-down {time.monotonic() - finished:.1f} s after the job")


def test_a_killed_worker_node_is_declared_dead_and_replaced_while_work_needs_it(autoscaling_cluster):
    cluster = autoscaling_cluster
    cluster.wait_for_workers(0, timeout_s=30)
    # One whole-node task at a time for 8 s: the job needs a cpu_worker before and after the kill.
    args = ["--rounds", "8", "--tasks", "1", "--cpus", "2", "--task-s", "1"]
    cluster.head.submit("kill-a-node", sys.executable, JOB, *args)
    [first] = cluster.wait_for_workers(1, node_type="cpu_worker", timeout_s=60)
    cluster.head.wait("kill-a-node", {"RUNNING"}, timeout_s=30)

    killed = time.monotonic()
    cluster.kill_node(first["node_id"])
    kill_s = time.monotonic() - killed
    cluster.wait_for_node_state(first["node_id"], "DEAD", timeout_s=20)
    dead_s = time.monotonic() - killed
    [replacement] = cluster.wait_for_workers(1, node_type="cpu_worker", exclude={first["node_id"]}, timeout_s=60)
    replaced_s = time.monotonic() - killed

    cluster.head.wait("kill-a-node", {"SUCCEEDED"}, timeout_s=60)
    assert replacement["node_id"] in _nodes_used(cluster.head.logs("kill-a-node"))
    print(f"kill {kill_s:.1f} s, node declared dead {dead_s:.1f} s and replacement alive {replaced_s:.1f} s after it")
