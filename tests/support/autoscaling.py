"""The project's own cluster (cluster.yaml), scaled down to run on this machine: a real `ray start --head` with Ray's
v1 autoscaler, whose worker nodes are extra raylets on 127.0.0.1 (tests/support/loopback_node_provider.py). Jobs
go in through `ray job submit`, worker nodes start from zero when work waits, go away when idle, and can be killed.
Everything listens on 127.0.0.1, Ray's files stay in the test's temp dir, token auth is on, and the whole bed is
stopped by its own PIDs, never by `ray stop`.

    config = node_types_from_cluster_yaml(REPO / "cluster.yaml")
    cluster = start_autoscaling_cluster(tmp_path / "bed", config)
    cluster.head.submit("job-1", sys.executable, "ray_jobs/pipeline.py", ...)   # RayHead's client
    [node] = cluster.wait_for_workers(1, node_type="cpu_worker", timeout_s=60)
    cluster.kill_node(node["node_id"])
    assert not cluster.stop()   # survivors, if any

Test modules get one per session through the `autoscaling_cluster` fixture.
"""

from __future__ import annotations

import ipaddress
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import yaml

from tests.support import REPO
from tests.support.processes import free_ports, kill_processes
from tests.support.ray_head import PORT_FLAGS, RayHead, start_head

PROVIDER_MODULE = "tests.support.loopback_node_provider.LoopbackNodeProvider"
# The GCS health-checks every raylet each second and declares it dead after 3 missed checks; the autoscaler drops a
# node it has not heard from in 5 s (Ray's defaults take tens of seconds for both).
HEALTH_CHECK_CONFIG = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}
AUTOSCALER_ENV = {
    "RAY_FAKE_CLUSTER": "1",  # FakeMultiNodeProvider refuses to start without it
    "AUTOSCALER_UPDATE_INTERVAL_S": "1",  # whole seconds only (Ray reads it as an int)
    "AUTOSCALER_HEARTBEAT_TIMEOUT_S": "5",
    # `ray start` turns --node-ip-address=127.0.0.1 into the machine's outbound address (and the GCS, raylet and
    # agents then listen there too) unless Ray runs in its single-machine mode, which this variable selects.
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
}


def node_types_from_cluster_yaml(
    path: Path = REPO / "cluster.yaml",
    *,
    cpus_per_node: int = 2,
    object_store_bytes: int = 200 * 2**20,
    max_workers_per_type: int = 2,
    max_workers: int = 3,
    idle_timeout_minutes: float = 0.25,
) -> dict:
    """The autoscaler config of `path` scaled down to this machine, field by field:

    - `head_node_type`, the head's `resources` ({CPU: 0}: it schedules no work, job drivers still run there),
      `upscaling_speed` and each worker type's name: as they are.
    - worker `resources`: CPU capped at `cpus_per_node` (logical CPUs: several nodes share the 2 cores); GPU and
      custom resources (`gpu_node_8x`) kept as logical counts; `object_store_memory` = `object_store_bytes` added.
      GPUs stay `GPU`, not a renamed custom resource, so that the autoscaler picks node types as on the real
      cluster (it keeps CPU-only work off GPU types) and GPU bundles place as they would there. Nothing here can
      use a GPU: a task asking for one is scheduled on a fake GPU node and then finds no CUDA, so CPU recipes must
      ask for none.
    - worker `min_workers`: 0 (every type starts from zero); `max_workers` capped at `max_workers_per_type`; the
      global `max_workers` capped at `max_workers`.
    - `idle_timeout_minutes` = `idle_timeout_minutes` (fractions allowed), so idle nodes go in seconds.
    - `provider`, `auth`, `node_config`, file mounts and setup/start commands: replaced by the loopback provider
      (start_autoscaling_cluster fills in its GCS address) and empty values, as nothing is installed or reached
      over SSH.
    """
    source = yaml.safe_load(Path(path).read_text())
    head_type = source["head_node_type"]
    node_types = {head_type: {"resources": dict(source["available_node_types"][head_type]["resources"])}}
    node_types[head_type].update(node_config={}, max_workers=0)
    for name, spec in source["available_node_types"].items():
        if name == head_type:
            continue
        resources = dict(spec["resources"])
        resources["CPU"] = min(resources.get("CPU", cpus_per_node), cpus_per_node)
        resources["object_store_memory"] = object_store_bytes
        node_types[name] = {
            "resources": resources,
            "node_config": {},
            "min_workers": 0,
            "max_workers": min(spec.get("max_workers", max_workers_per_type), max_workers_per_type),
        }
    empty = ["initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands"]
    empty += ["head_start_ray_commands", "worker_start_ray_commands", "cluster_synced_files"]
    empty += ["rsync_exclude", "rsync_filter"]
    return {
        "cluster_name": source["cluster_name"],
        "max_workers": min(source.get("max_workers", max_workers), max_workers),
        "upscaling_speed": source.get("upscaling_speed", 1.0),
        "idle_timeout_minutes": idle_timeout_minutes,
        "provider": {},
        "head_node_type": head_type,
        "available_node_types": node_types,
        "auth": {},
        "docker": {},
        "file_mounts": {},
        "file_mounts_sync_continuously": False,
        **{key: [] for key in empty},
    }


@dataclass
class AutoscalingCluster:
    """A running bed: `head` is the RayHead client (submit, wait, logs, get), `config` the autoscaler config."""

    head: RayHead
    config: dict

    @property
    def temp_dir(self) -> Path:
        return self.head.temp_dir

    def nodes(self) -> list[dict]:
        """Every node Ray knows, dead ones included (the state API's NodeState records, plus `node_type`)."""
        reply = self.head.get("/api/v0/nodes?limit=1000&detail=true")
        nodes = reply["data"]["result"]["result"]
        for node in nodes:
            node["node_type"] = node["labels"].get("ray.io/node-group") or self.config["head_node_type"]
        return nodes

    def workers(self, *, node_type: str | None = None, state: str = "ALIVE") -> list[dict]:
        return [
            n
            for n in self.nodes()
            if not n["is_head_node"] and n["state"] == state and node_type in (None, n["node_type"])
        ]

    def wait_for_workers(
        self, count: int, *, node_type: str | None = None, timeout_s: float = 60, exclude: set[str] = frozenset()
    ) -> list[dict]:
        """Wait until exactly `count` worker nodes (of `node_type`, ids not in `exclude`) are alive; returns them."""
        deadline = time.monotonic() + timeout_s
        while True:
            alive = [n for n in self.workers(node_type=node_type) if n["node_id"] not in exclude]
            if len(alive) == count:
                return alive
            if time.monotonic() > deadline:
                pytest.fail(f"{len(alive)} alive {node_type or 'worker'} nodes, not {count}, after {timeout_s}s")
            time.sleep(0.5)

    def wait_for_node_state(self, node_id: str, state: str, *, timeout_s: float = 30) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            [node] = [n for n in self.nodes() if n["node_id"] == node_id]
            if node["state"] == state:
                return node
            if time.monotonic() > deadline:
                pytest.fail(f"node {node_id} is {node['state']}, not {state}, after {timeout_s}s")
            time.sleep(0.5)

    def kill_node(self, node_id: str) -> list[int]:
        """SIGKILL the raylet of `node_id` and every process under it (its agents, workers and their children), as
        a lost machine would go; returns the PIDs killed. The node's log monitor, whose command line does not say
        which node it serves, is left to the autoscaler: it stops it when it terminates the lost node."""
        [raylet] = [p for p in self.processes() if _is_raylet_of(p, node_id)]
        doomed = [raylet, *raylet.children(recursive=True)]
        for proc in doomed:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        # The raylet stays a zombie until the monitor that started it reaps it, when the autoscaler terminates the
        # lost node: waiting for it to vanish (kill_processes) would wait for the autoscaler.
        deadline = time.monotonic() + 10
        while any(_running(p) for p in doomed):
            assert time.monotonic() < deadline, f"processes of node {node_id} outlived SIGKILL"
            time.sleep(0.05)
        return [p.pid for p in doomed]

    def processes(self) -> list[psutil.Process]:
        """Every live process of the bed: `ray start` and its process group, whatever names the temp dir (GCS,
        raylets, agents, monitor: the worker nodes share the head's temp dir), and all their descendants (workers
        rename themselves to `ray::...`, so only their parentage tells)."""
        mark, group = str(self.temp_dir), self.head.process.pid  # `ray start` leads a session of its own
        ours = {os.getpid(), *(p.pid for p in psutil.Process().parents())}  # a caller may name the temp dir too
        roots = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            try:
                if proc.pid not in ours and (
                    any(mark in part for part in proc.info["cmdline"] or []) or os.getpgid(proc.pid) == group
                ):
                    roots.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
                continue
        found = {p.pid: p for p in roots}
        for proc in roots:
            try:
                found.update((c.pid, c) for c in proc.children(recursive=True))
            except psutil.NoSuchProcess:
                continue
        return list(found.values())

    def non_loopback_listeners(self) -> list[str]:
        """`ip:port (name pid)` of every TCP socket a process of the bed listens on other than 127.0.0.1 (gRPC's
        IPv6 sockets on `::ffff:127.0.0.1`, IPv4 loopback mapped, count as 127.0.0.1)."""
        found = []
        for proc in self.processes():
            try:
                for conn in proc.net_connections(kind="inet"):
                    ip = ipaddress.ip_address(conn.laddr.ip)
                    if conn.status == psutil.CONN_LISTEN and str(getattr(ip, "ipv4_mapped", None) or ip) != "127.0.0.1":
                        found.append(f"{conn.laddr.ip}:{conn.laddr.port} ({proc.name()} {proc.pid})")
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found

    def stop(self) -> list[psutil.Process]:
        """SIGKILL every process of the bed at once (the fake worker nodes do not share the head's fate, and a
        SIGTERMed autoscaler would try to tear them down itself); returns those still alive afterwards."""
        kill_processes(self.processes(), timeout_s=15)
        self.head.process.wait(timeout=15)
        return self.processes()


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _is_raylet_of(proc: psutil.Process, node_id: str) -> bool:
    try:
        cmdline = proc.cmdline()
    except psutil.NoSuchProcess:
        return False
    return bool(cmdline) and cmdline[0].endswith("raylet") and f"--node_id={node_id}" in cmdline


def loopback_provider(gcs_address: str, head_node_type: str) -> dict:
    """The `provider` section that starts worker nodes on 127.0.0.1 and joins them to `gcs_address`."""
    return {
        "type": "external",
        "module": PROVIDER_MODULE,
        "gcs_address": gcs_address,
        "head_node_type": head_node_type,
        "use_node_id_as_ip": True,  # all nodes share 127.0.0.1; the autoscaler tells them apart by node id
        "disable_node_updaters": True,
        "disable_launch_config_check": True,
    }


def start_autoscaling_cluster(temp_dir: Path, config: dict, *, timeout_s: float = 90) -> AutoscalingCluster:
    """Start the head of `config` (from node_types_from_cluster_yaml) on free 127.0.0.1 ports with the loopback
    provider pointed at its GCS; returns once the jobs API answers. No worker node runs yet: they come on demand."""
    temp_dir.mkdir(parents=True, exist_ok=True)
    ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
    config = {**config, "provider": loopback_provider(f"127.0.0.1:{ports['port']}", config["head_node_type"])}
    config_path = temp_dir / "autoscaling.json"
    config_path.write_text(json.dumps(config, indent=2))
    head_resources = dict(config["available_node_types"][config["head_node_type"]]["resources"])
    num_cpus = int(head_resources.pop("CPU", 0))
    assert not head_resources, f"the head type has resources `ray start` is not given: {head_resources}"
    head = start_head(
        temp_dir,
        num_cpus=num_cpus,
        timeout_s=timeout_s,
        ports=ports,
        extra_args=(
            "--node-ip-address=127.0.0.1",
            f"--autoscaling-config={config_path}",
            f"--system-config={json.dumps(HEALTH_CHECK_CONFIG)}",
        ),
        extra_env={
            **AUTOSCALER_ENV,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        },
    )
    return AutoscalingCluster(head=head, config=config)


@pytest.fixture(scope="session")
def autoscaling_cluster(tmp_path_factory):
    """One autoscaling bed from the repo's cluster.yaml per session; its teardown fails if a process outlives it.
    The temp dir's name is short: Ray's socket paths under it (`.../sockets/plasma_store.<n>`) must fit 107 bytes."""
    cluster = start_autoscaling_cluster(tmp_path_factory.mktemp("bed"), node_types_from_cluster_yaml())
    yield cluster
    survivors = cluster.stop()
    assert not survivors, f"processes of the autoscaling bed outlived stop(): {survivors}"
